"""Reports of accuracy runs on hand-made records: capping, provenance notes, the paired
comparison with a baseline (accuracy, NLL, budget) and the 3-point verdict."""

from __future__ import annotations

import json
import math

import pytest

from smcspec.eval import report


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
    rows = {r["method"]: r for r in report.summarize(records)}
    assert (rows["ar"]["capped"], rows["ar"]["capped_known"]) == (2, 3)
    assert rows["ar"]["capped_fraction"] == pytest.approx(2 / 3)
    assert (rows["smc-n4-k4"]["capped"], rows["smc-n4-k4"]["capped_known"]) == (1, 2)
    assert rows["sd-k4"]["capped"] is None and rows["sd-k4"]["capped_fraction"] is None
    text = report.write_report(list(rows.values()), tmp_path, "gsm8k accuracy").read_text()
    assert "| capped |" in text
    accuracy_table = text.split("| method | n |")[1].split("\n\n")[0]
    table = [ln.split(" | ") for ln in accuracy_table.splitlines() if ln.startswith("| ")]
    cells = {row[0].removeprefix("| "): row[4] for row in table}  # method -> capped
    assert cells == {"ar": "2/3", "smc-n4-k4": "1/2 (1 unknown)", "sd-k4": "-"}
    json.dumps(list(rows.values()))  # still serialisable


def test_budget_note_states_the_stored_budget():
    assert report.budget_note([], 512) == "max_new_tokens 512"
    recs = [_record("ar", "q0", True), _record("ar", "q1", None)]
    assert report.budget_note(recs[:1], 512) == "max_new_tokens 8"
    assert report.budget_note(recs, 512) == (
        "max_new_tokens 8; max_new_tokens of 1 older answers not stored (this command's: 512)"
    )


def test_machines_note_counts_the_machines_behind_the_records():
    one = [{**_record("ar", "q0", False), "machine": "A CPU"}]
    assert report.machines_note(one) == ""  # one machine: the provenance line says it
    mixed = [*one, {**_record("ar", "q1", False), "machine": "B CPU"}, _record("smc", "q0", False)]
    note = report.machines_note(mixed)
    assert note.startswith("Records by machine: A CPU (1); B CPU (1); not stored")
    assert "(1). Median tokens/s pools" in note


def test_no_discordant_pair_gives_no_verdict():
    """Five questions both methods got right: the bootstrap interval is the point 0, which
    must not read as "within 3 points"."""
    recs = [
        {**_record(m, f"q{i}", False), "correct": True} for m in ("ar", "smc") for i in range(5)
    ]
    row = next(r for r in report.summarize(recs) if r["method"] == "smc")
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
    rows = {r["method"]: r for r in report.summarize(recs)}
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
    text = report.write_report(list(rows.values()), tmp_path, "gsm8k accuracy").read_text()
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
    rows = report.summarize(recs, baseline="old")
    new = next(r for r in rows if r["method"] == "new")
    assert (new["lost"], new["gained"]) == (0, 5) and new["diff_vs_baseline"] == 0.5
    text = report.write_report(rows, tmp_path, "t", baseline="old").read_text()
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
    row = next(r for r in report.summarize(recs) if r["method"] == "smc")
    assert (row["lost"], row["gained"], row["diff_low"]) == (0, 2, 0.0)
    assert row["exact_low"] == pytest.approx(-0.0760, abs=1e-4)
    assert row["verdict"] == "not decidable"
    text = report.write_report(report.summarize(recs), tmp_path, "t").read_text()
    assert "| +11.1 pts (-7.6, +27.8)* |" in text  # the interval the verdict read, marked


def test_budget_is_paired_with_the_baseline(tmp_path):
    """12 questions: ar is cut on q0-q3, smc on q4 only (and both on q5); on the six neither
    cut, smc loses q6 and q7 and gains q8. Of the cut answers, smc's q4 alone is right. smc's
    answer to q{i} is i tokens longer than ar's. Old records without ``hit_cap`` are left
    out."""
    recs = []
    for i in range(12):
        ar = {
            **_record("ar", f"q{i}", i in (0, 1, 2, 3, 5)),
            "correct": i not in (0, 1, 2, 3, 5, 8),
        }
        smc = {**_record("smc", f"q{i}", i in (4, 5), 8 + i), "correct": i not in (5, 6, 7)}
        recs += [ar, smc]
    recs += [_record("ar", "old", None), _record("smc", "old", None)]
    row = next(r for r in report.summarize(recs) if r["method"] == "smc")
    assert row["cap_paired_n"] == 12
    caps = (row["capped_baseline_only"], row["capped_method_only"], row["capped_both"])
    assert caps == (4, 1, 1)
    assert row["cap_mcnemar_p"] == pytest.approx(0.375)  # binomial(1; 5, 1/2), two-sided
    assert (row["uncapped_n"], row["uncapped_lost"], row["uncapped_gained"]) == (6, 2, 1)
    assert row["uncapped_mcnemar_p"] == pytest.approx(1.0)
    assert (row["capped_right_baseline"], row["capped_right_method"]) == ((0, 5), (1, 2))
    assert row["uncapped_median_tokens_diff"] == 8.5  # median of 6..11 (q6-q11)
    text = report.write_report(report.summarize(recs), tmp_path, "t").read_text()
    assert "| smc | 12 | 4 / 1 / 1 | 0.375 | 6 | 2/1 | 1.000 | 0 of 5 / 1 of 2 | +8.5 |" in text
    assert "capped: only ar / only method / both" in text


def test_reward_settings_are_paired_with_best_of_n_at_their_times(tmp_path):
    """Steered SMC-SD against the run's best-of-n settings, on the items both answered:
    accuracies, the paired difference with its discordant counts, and the time ratio."""
    records = []
    for i in range(6):
        item = f"q{i}"
        steered = {**_record("smc-n8-k2-reward-vote", item, False), "correct": i != 0}
        bon = {**_record("ar-bon-n3", item, False), "correct": i not in (1, 2)}
        steered["seconds"], bon["seconds"] = 30.0, 40.0
        records += [steered, bon, _record("ar", item, False)]
    records.append(_record("ar-bon-n4", "q0", False))  # one shared item: no pair
    (row,) = report.against_best_of_n(records)
    assert (row["method"], row["best_of_n"], row["paired_n"]) == (
        "smc-n8-k2-reward-vote",
        "ar-bon-n3",
        6,
    )
    assert row["accuracy"] == pytest.approx(5 / 6)
    assert row["bon_accuracy"] == pytest.approx(4 / 6)
    assert (row["lost"], row["gained"]) == (1, 2)
    assert row["diff_vs_baseline"] == pytest.approx(1 / 6)
    assert row["seconds"] / row["bon_seconds"] == pytest.approx(0.75)
    rows = report.summarize(records)
    text = report.write_report(rows, tmp_path, "t", records=records).read_text()
    assert "| smc-n8-k2-reward-vote | ar-bon-n3 | 6 | 83.3% | 66.7% | +16.7 pts" in text
    assert "| 0.75 |" in text
    assert "best-of-n" not in report.write_report(rows, tmp_path, "t").read_text()
