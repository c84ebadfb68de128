"""The evaluation harness end to end on tiny models: methods, resume, rescore, reports."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from tiny_models import make_tiny_chat_pair

from smcspec import ConfigError, Engine, GenerationConfig
from smcspec.backends.torch import load_hf_dir
from smcspec.eval import harness, report
from smcspec.eval.exact import tiny_transformer
from smcspec.eval.fidelity import fidelity_grid, write_fidelity_report
from smcspec.eval.gsm8k import Gsm8kItem
from smcspec.eval.results import ResultFile
from smcspec.rewards import false_equations


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
    (grouped,) = harness.method_specs("smc-n8-k2-g4-vote", base)
    assert (grouped.config.groups, grouped.vote, grouped.config.particles) == (4, True, 8)
    assert harness.method_specs("smc-n8-k2", base)[0].config.groups == 1
    ngram = harness.method_specs("sd-ngram-k5,sd-k2", base)
    assert [(s.name, s.config.draft, s.config.draft_tokens) for s in ngram] == [
        ("sd-ngram-k5", "ngram", 5), ("sd-k2", "model", 2)]  # fmt: skip
    # with --draft ngram (base.draft), sd settings draft n-grams and smc keeps its draft model
    both = harness.method_specs("sd-k3,smc-n4-k2", replace(base, draft="ngram"))
    assert [s.config.draft for s in both] == ["ngram", "model"]
    for bad in ("ar,beam", "smc-n0-k2", "smc-n4", "sd-ngram-k0", "smc-n8-k2-g3"):
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
    rows = report.summarize(records)
    assert {r["method"] for r in rows} == {"ar", "sd-k4"}
    sd = next(r for r in rows if r["method"] == "sd-k4")
    assert sd["paired_n"] == 3 and "mcnemar_p" in sd and "nll_mean" in sd
    summary = report.write_report(rows, tmp_path / "out", "test")
    assert "| ar | 3 |" in summary.read_text()
    assert (tmp_path / "out" / "pareto.png").stat().st_size > 1000
    json.dumps(rows)  # serialisable


@pytest.mark.slow
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
    from smcspec.decoding.output import hit_token_cap

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
        # the draft is named where the method drafts with it (a fitted draft's name then)
        assert r.get("draft") == (engine.draft.name if r["method"] != "ar" else None)
        if r["new_tokens"] < 6:
            assert not r["hit_cap"]  # ended on its own before the budget
    again = harness.rescore("gsm8k", records, ITEMS)
    assert [r["hit_cap"] for r in again] == [r["hit_cap"] for r in records]
    rows = report.summarize(records)
    for row in rows:
        mine = [r for r in records if r["method"] == row["method"]]
        assert row["capped_known"] == 3
        assert row["capped"] == sum(r["hit_cap"] for r in mine)


def test_baselines_votes_and_rewards_end_to_end(engine, tmp_path):
    """The steered and baseline settings run through the harness on the tiny pair: records
    carry what each adds (samples, rewards, the vote beside the drawn answer's score)."""
    from smcspec.eval.humaneval import HumanEvalProblem

    specs = harness.method_specs(
        "ar-greedy,ar-sc-n3,smc-n4-k2-vote", GenerationConfig(max_new_tokens=6)
    )
    rf = ResultFile(tmp_path / "g.jsonl")
    records = harness.run_task(engine, "gsm8k", ITEMS[:2], specs, rf, progress=False)
    by = {(r["method"], r["item"]): r for r in records}
    assert len(by) == 6
    assert by[("ar-sc-n3", "q0")]["samples"] == 3
    assert 0 <= by[("ar-sc-n3", "q0")]["distinct_answers"] <= 3
    assert (
        "drawn_correct" in by[("smc-n4-k2-vote", "q0")] and "vote" in by[("smc-n4-k2-vote", "q0")]
    )
    assert by[("ar-greedy", "q0")]["stats"]["greedy"] is True
    rows = {r["method"]: r for r in report.summarize(records)}
    assert rows["smc-n4-k2-vote (drawn)"]["n"] == 2 and rows["ar-sc-n3"]["mean_seconds"] > 0
    report.write_report(list(rows.values()), tmp_path / "rep", "t")
    assert (tmp_path / "rep" / "accuracy-time.png").stat().st_size > 1000
    # GSM8K's reward is the arithmetic check: minus the false equations of the text
    specs = harness.method_specs("ar-bon-n2,smc-n4-k2-reward", GenerationConfig(max_new_tokens=6))
    rf = ResultFile(tmp_path / "r.jsonl")
    bon, smc = harness.run_task(engine, "gsm8k", ITEMS[:1], specs, rf, progress=False)
    assert len(bon["rewards"]) == 2 and all(r <= 0 for r in bon["rewards"])
    assert smc["reward"] == -false_equations(smc["output"])
    toy = HumanEvalProblem(
        task_id="Toy/0",
        prompt='def add(a, b):\n    """\n    >>> add(2, 3)\n    5\n    """\n',
        test="def check(candidate):\n    assert candidate(2, 3) == 5\n",
        entry_point="add",
        canonical_solution="    return a + b\n",
    )
    specs = harness.method_specs(
        "ar-bon-n2,smc-n4-k2-reward-vote", GenerationConfig(max_new_tokens=6)
    )
    rf = ResultFile(tmp_path / "h.jsonl")
    records = harness.run_task(engine, "humaneval", [toy], specs, rf, progress=False)
    bon, smc = records
    assert bon["rewards"] == [0.0, 0.0] and bon["samples"] == 2  # random text passes nothing
    assert 0 <= bon["distinct_answers"] <= 2
    assert smc["reward"] == 0.0 and "log_normalizer" in smc["stats"]
    assert report.summarize(records)  # the report reads the new records


def test_a_run_waits_while_its_pause_file_exists(tmp_path):
    import threading
    import time

    pause = tmp_path / harness.PAUSE_FILE
    pause.touch()
    done = threading.Event()
    t = threading.Thread(target=lambda: (harness.wait_while_paused(pause, 0.01), done.set()))
    t.start()
    time.sleep(0.1)
    assert not done.is_set()  # still paused
    pause.unlink()
    assert done.wait(5)
    t.join()
