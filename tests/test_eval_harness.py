"""The evaluation harness end to end on tiny models: methods, resume, rescore, reports."""

from __future__ import annotations

import json
import math

import pytest
from tiny_models import make_tiny_chat_pair

from smcspec import ConfigError, Engine, GenerationConfig
from smcspec.backends.torch import load_hf_dir
from smcspec.eval import harness
from smcspec.eval.fidelity import fidelity_grid, tiny_transformer, write_fidelity_report
from smcspec.eval.gsm8k import Gsm8kItem
from smcspec.eval.results import ResultFile


def test_method_specs_and_grid():
    base = GenerationConfig(max_new_tokens=8)
    names = [s.name for s in harness.method_specs("ar,sd,smc", base, "N=2,4;K=2,3")]
    assert names == ["ar", "sd-k2", "sd-k3", "smc-n2-k2", "smc-n2-k3", "smc-n4-k2", "smc-n4-k3"]
    assert [s.name for s in harness.method_specs("smc", base)] == ["smc-n4-k4"]
    named = harness.method_specs("ar,smc-n8-k2,smc-n4-k8,sd-k3", base)
    assert [s.name for s in named] == ["ar", "smc-n8-k2", "smc-n4-k8", "sd-k3"]
    assert (named[1].config.particles, named[1].config.draft_tokens) == (8, 2)
    assert named[3].config.method == "sd" and named[3].config.draft_tokens == 3
    assert named[1].config.finished_particles == "bank"
    (keep,) = harness.method_specs("smc-n8-k2-keep", base)
    assert keep.name == "smc-n8-k2-keep" and keep.config.finished_particles == "keep"
    for bad in ("ar,beam", "smc-n0-k2", "smc-n4"):
        with pytest.raises(ConfigError):
            harness.method_specs(bad, base)
    with pytest.raises(ConfigError):
        harness.method_specs("smc", base, "N=two")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("harness")
    dirs = make_tiny_chat_pair(root)
    return Engine(load_hf_dir(dirs[0]), load_hf_dir(dirs[1]))


ITEMS = [
    Gsm8kItem(id=f"q{i}", question=q, answer="7") for i, q in enumerate(["ab cd", "ef gh", "ij kl"])
]


def test_resume_skips_finished_items_and_gives_the_same_file(engine, tmp_path, monkeypatch):
    specs = harness.method_specs("ar,smc", GenerationConfig(max_new_tokens=6))
    full = ResultFile(tmp_path / "full.jsonl")
    harness.run_task(engine, "gsm8k", ITEMS, specs, full, seed=3, progress=False)
    # an interrupted run: the first 2 answers written, then half a line
    lines = (tmp_path / "full.jsonl").read_text().splitlines()
    assert len(lines) == 6
    part = tmp_path / "part.jsonl"
    part.write_text(lines[0] + "\n" + lines[1] + "\n" + lines[2][:20])
    calls = []
    real = engine.generate
    monkeypatch.setattr(engine, "generate", lambda *a, **k: calls.append(1) or real(*a, **k))
    records = harness.run_task(
        engine, "gsm8k", ITEMS, specs, ResultFile(part), seed=3, progress=False
    )
    assert len(calls) == 4  # only the 4 unfinished answers were generated

    def strip(recs):
        return [
            {k: v for k, v in r.items() if k not in ("seconds", "tokens_per_second")} for r in recs
        ]

    assert strip(records) == strip(full.records())  # same outputs: seeds are per question


def test_summary_rescore_and_report(engine, tmp_path):
    specs = harness.method_specs("ar,sd", GenerationConfig(max_new_tokens=6))
    rf = ResultFile(tmp_path / "r.jsonl")
    records = harness.run_task(engine, "gsm8k", ITEMS, specs, rf, progress=False, score_nll=True)
    assert all(r["target_nll"] > 0 for r in records)
    again = harness.rescore("gsm8k", records, ITEMS)
    assert [r["correct"] for r in again] == [r["correct"] for r in records]
    rows = harness.summarize(records)
    assert {r["method"] for r in rows} == {"ar", "sd-k4"}
    sd = next(r for r in rows if r["method"] == "sd-k4")
    assert sd["paired_n"] == 3 and "mcnemar_p" in sd and "nll_mean" in sd
    report = harness.write_report(rows, tmp_path / "out", "test")
    assert "| ar | 3 |" in report.read_text()
    assert (tmp_path / "out" / "pareto.png").stat().st_size > 1000
    json.dumps(rows)  # serialisable


def test_fidelity_grid_small():
    target, draft = tiny_transformer(seed=1), tiny_transformer(seed=2)
    rows, draft_tv = fidelity_grid(target, draft, [1, 2, 0], 2, [1, 8], [2], runs=300)
    by = {(r.method, r.particles): r for r in rows}
    assert draft_tv > 0.3
    # SD is exact: at 300 runs over 16 sequences its TV is sampling noise (< 0.15);
    # SMC-SD at N=1 is plain drafting, far off; N=8 must be closer
    assert by[("sd", 1)].tv < 0.15
    assert by[("smc", 8)].tv < by[("smc", 1)].tv
    assert all(r.kl >= 0 for r in rows)


def test_fidelity_report(tmp_path):
    from smcspec.eval.fidelity import FidelityRow

    rows = [
        FidelityRow("sd", 1, 2, 10, 0.05, 0.01),
        FidelityRow("smc", 1, 2, 10, 0.5, 0.9),
        FidelityRow("smc", 4, 2, 10, 0.25, 0.3),
    ]
    md = write_fidelity_report(rows, 0.6, tmp_path)
    assert "| smc | 4 | 2 | 10 | 0.2500 |" in md.read_text()
    assert (tmp_path / "fidelity.png").stat().st_size > 1000


def test_hit_token_cap_rule():
    from smcspec.decoding.common import hit_token_cap

    """Capped = the budget is used up and the last token is not a stop token."""
    stop = {9}
    assert hit_token_cap([1, 2, 3], 3, stop)
    assert not hit_token_cap([1, 2, 9], 3, stop)  # EOS as the last allowed token
    assert not hit_token_cap([1, 9], 3, stop)
    assert not hit_token_cap([1, 2], 3, stop)
    assert hit_token_cap([1, 2, 9], 3, set())  # EOS ignored: full length is capped


def test_run_task_records_the_budget_and_whether_it_was_hit(engine, tmp_path):
    specs = harness.method_specs("ar,smc", GenerationConfig(max_new_tokens=6))
    rf = ResultFile(tmp_path / "r.jsonl")
    records = harness.run_task(engine, "gsm8k", ITEMS, specs, rf, progress=False, machine="M")
    for r in records:
        assert r["max_new_tokens"] == 6 and isinstance(r["hit_cap"], bool)
        assert r["machine"] == "M"
        if r["new_tokens"] < 6:
            assert not r["hit_cap"]  # ended on its own before the budget
    again = harness.rescore("gsm8k", records, ITEMS)
    assert [r["hit_cap"] for r in again] == [r["hit_cap"] for r in records]
    rows = harness.summarize(records)
    for row in rows:
        mine = [r for r in records if r["method"] == row["method"]]
        assert row["capped_known"] == 3
        assert row["capped"] == sum(r["hit_cap"] for r in mine)


def _record(method: str, item: str, capped: bool | None, new_tokens: int = 8) -> dict:
    rec = {
        "id": f"{method}/{item}",
        "item": item,
        "method": method,
        "output": "x",
        "correct": item != "q0",
        "new_tokens": new_tokens,
        "seconds": 1.0,
        "tokens_per_second": 8.0,
    }
    if capped is not None:  # records written before the field existed have neither key
        rec.update(max_new_tokens=8, hit_cap=capped)
    return rec


def test_summary_counts_capped_answers_per_method_and_tolerates_old_records(tmp_path):
    records = [
        _record("ar", "q0", True),
        _record("ar", "q1", True),
        _record("ar", "q2", False, new_tokens=3),
        _record("smc-n4-k4", "q0", True),
        _record("smc-n4-k4", "q1", False, new_tokens=5),
        _record("smc-n4-k4", "q2", None),  # an old record: unknown, not uncapped
        _record("sd-k4", "q0", None),
        _record("sd-k4", "q1", None),
    ]
    rows = {r["method"]: r for r in harness.summarize(records)}
    assert (rows["ar"]["capped"], rows["ar"]["capped_known"]) == (2, 3)
    assert rows["ar"]["capped_fraction"] == pytest.approx(2 / 3)
    assert (rows["smc-n4-k4"]["capped"], rows["smc-n4-k4"]["capped_known"]) == (1, 2)
    assert rows["sd-k4"]["capped"] is None and rows["sd-k4"]["capped_fraction"] is None
    text = harness.write_report(list(rows.values()), tmp_path, "gsm8k accuracy").read_text()
    assert "| capped |" in text
    accuracy_table = text.split("| method | n |")[1].split("\n\n")[0]
    table = [ln.split(" | ") for ln in accuracy_table.splitlines() if ln.startswith("| ")]
    cells = {row[0].removeprefix("| "): row[4] for row in table}  # method -> capped
    assert cells == {"ar": "2/3", "smc-n4-k4": "1/2 (1 unknown)", "sd-k4": "-"}
    json.dumps(list(rows.values()))  # still serialisable


def test_budget_note_states_the_stored_budget():
    assert harness.budget_note([], 512) == "max_new_tokens 512"
    recs = [_record("ar", "q0", True), _record("ar", "q1", None)]
    assert harness.budget_note(recs[:1], 512) == "max_new_tokens 8"
    assert harness.budget_note(recs, 512) == (
        "max_new_tokens 8; max_new_tokens of 1 older answers not stored (this command's: 512)"
    )


def test_machines_note_counts_the_machines_behind_the_records():
    one = [{**_record("ar", "q0", False), "machine": "A CPU"}]
    assert harness.machines_note(one) == ""  # one machine: the provenance line says it
    mixed = [*one, {**_record("ar", "q1", False), "machine": "B CPU"}, _record("smc", "q0", False)]
    note = harness.machines_note(mixed)
    assert note.startswith("Records by machine: A CPU (1); B CPU (1); not stored")
    assert "(1). Median tokens/s pools" in note


def test_no_discordant_pair_gives_no_verdict():
    """Five questions both methods got right: the bootstrap interval is the point 0, which
    must not read as "within 3 points"."""
    recs = [
        {**_record(m, f"q{i}", False), "correct": True} for m in ("ar", "smc") for i in range(5)
    ]
    row = next(r for r in harness.summarize(recs) if r["method"] == "smc")
    assert (row["diff_low"], row["diff_high"]) == (0.0, 0.0)
    assert row["verdict"] == "not decidable" and row["pairs_for_margin"] == "-"


def test_summary_pairs_accuracy_and_nll_with_the_baseline(tmp_path):
    """On shared items only: lost/gained counts, the verdict against the 3-point margin, the
    pairs needed, and the paired NLL difference (hand-computed)."""
    recs = []
    for i in range(80):  # ar right on all; smc wrong on q0-q15: -20 points, not met
        recs.append({**_record("ar", f"q{i}", False), "correct": True, "target_nll": 0.2})
        smc = {**_record("smc", f"q{i}", False), "correct": i >= 16}
        recs.append({**smc, "target_nll": 0.2 + i / 1000})
    recs.append({**_record("smc", "only-smc", False), "correct": True, "target_nll": 9.0})
    rows = {r["method"]: r for r in harness.summarize(recs)}
    smc = rows["smc"]
    assert smc["n"] == 81 and smc["paired_n"] == 80  # the unpaired item is not compared
    assert (smc["lost"], smc["gained"]) == (16, 0)
    assert smc["diff_vs_baseline"] == pytest.approx(-0.20)
    assert smc["diff_high"] < -0.03 and smc["verdict"] == "not met"
    # differences: 16 of -1, 64 of 0 -> s^2 = (16 - 80 * 0.2^2) / 79; ceil((z s / 0.03)^2)
    need = math.ceil(1.959963984540054**2 * 12.8 / 79 / 0.03**2)
    assert smc["pairs_for_margin"] == need == 692
    assert smc["nll_paired_n"] == 80
    assert smc["nll_diff"] == pytest.approx(sum(range(80)) / 1000 / 80)  # 0.0395
    assert smc["nll_diff_low"] > 0 and smc["nll_wilcoxon_p"] < 1e-6  # every pair higher
    assert "paired_n" not in rows["ar"] and "nll_diff" not in rows["ar"]
    text = harness.write_report(list(rows.values()), tmp_path, "gsm8k accuracy").read_text()
    assert "| 16/0 | not met | 692 |" in text
    assert "| 80 | +0.0395 (" in text


def test_report_pairs_against_any_baseline(tmp_path):
    """``summarize(baseline=...)`` pairs every other method with that one, and the report's
    tables name it instead of ar (used to compare two settings, e.g. bank vs keep)."""
    recs = [
        {**_record(m, f"q{i}", False), "correct": m == "new" or i % 2 == 0, "target_nll": 0.1}
        for m in ("old", "new")
        for i in range(10)
    ]
    rows = harness.summarize(recs, baseline="old")
    new = next(r for r in rows if r["method"] == "new")
    assert (new["lost"], new["gained"]) == (0, 5) and new["diff_vs_baseline"] == 0.5
    text = harness.write_report(rows, tmp_path, "t", baseline="old").read_text()
    assert "| diff vs old (95% CI) |" in text and "questions only old / only" in text
    assert "paired against old on" in text and "vs ar" not in text


def test_verdict_needs_the_exact_interval_when_all_discordant_pairs_agree(tmp_path):
    """18 questions, the method gains 2 and loses none: the bootstrap interval starts at 0
    ("met" on its own), the exact conditional interval reaches -7.6 points: not decidable."""
    recs = [
        {**_record(m, f"q{i}", False), "correct": i < 5 or (m == "smc" and i < 7)}
        for m in ("ar", "smc")
        for i in range(18)
    ]
    row = next(r for r in harness.summarize(recs) if r["method"] == "smc")
    assert (row["lost"], row["gained"], row["diff_low"]) == (0, 2, 0.0)
    assert row["exact_low"] == pytest.approx(-0.0760, abs=1e-4)
    assert row["verdict"] == "not decidable"
    text = harness.write_report(harness.summarize(recs), tmp_path, "t").read_text()
    assert "| +11.1 pts (-7.6, +27.8)* |" in text  # the interval the verdict read, marked


def test_budget_is_paired_with_the_baseline(tmp_path):
    """12 questions: ar is cut on q0-q3, smc on q4 only (and both on q5); on the six neither
    cut, smc loses q6 and q7 and gains q8. Old records without ``hit_cap`` are left out."""
    recs = []
    for i in range(12):
        ar = {
            **_record("ar", f"q{i}", i in (0, 1, 2, 3, 5)),
            "correct": i not in (0, 1, 2, 3, 5, 8),
        }
        smc = {**_record("smc", f"q{i}", i in (4, 5)), "correct": i not in (4, 5, 6, 7)}
        recs += [ar, smc]
    recs += [_record("ar", "old", None), _record("smc", "old", None)]
    row = next(r for r in harness.summarize(recs) if r["method"] == "smc")
    assert row["cap_paired_n"] == 12
    caps = (row["capped_baseline_only"], row["capped_method_only"], row["capped_both"])
    assert caps == (4, 1, 1)
    assert row["cap_mcnemar_p"] == pytest.approx(0.375)  # binomial(1; 5, 1/2), two-sided
    assert (row["uncapped_n"], row["uncapped_lost"], row["uncapped_gained"]) == (6, 2, 1)
    assert row["uncapped_mcnemar_p"] == pytest.approx(1.0)
    text = harness.write_report(harness.summarize(recs), tmp_path, "t").read_text()
    assert "| smc | 12 | 4 / 1 / 1 | 0.375 | 6 | 2/1 | 1.000 |" in text
    assert "capped: only ar / only method / both" in text
