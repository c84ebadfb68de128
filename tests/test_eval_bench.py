"""``smcspec bench``: ShareGPT prompt sampling and the throughput run on tiny models."""

from __future__ import annotations

import json

import pytest
from tiny_models import make_tiny_chat_pair
from transformers import AutoTokenizer

from smcspec import ConfigError, Engine, GenerationConfig
from smcspec.backends.torch import load_hf_dir
from smcspec.cli import main
from smcspec.eval import harness, report, throughput
from smcspec.eval.sharegpt import load_sharegpt_prompts, read_json_list


def test_read_json_list_stops_before_a_truncated_item():
    assert read_json_list('[{"a": 1}, {"b": [2, 3]}]') == [{"a": 1}, {"b": [2, 3]}]
    assert read_json_list('[{"a": 1},\n {"b": [2, 3') == [{"a": 1}]
    assert read_json_list("[]") == []
    assert read_json_list("[") == []
    with pytest.raises(ValueError):
        read_json_list('{"a": 1}')


def _conv(text: str, first: str = "human") -> dict:
    return {"id": text[:8], "conversations": [{"from": first, "value": text}]}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    return [str(d) for d in make_tiny_chat_pair(root)]


@pytest.fixture(scope="module")
def sharegpt_file(tmp_path_factory, dirs):
    tok = AutoTokenizer.from_pretrained(dirs[0])
    words = ["ab", "cd", "ef", "gh", "ij", "kl"]
    # 40 distinct texts of 1 to 12 words
    convs = [_conv(" ".join(words[: 1 + i % 6] + words[: i // 6])) for i in range(40)]
    convs.insert(3, _conv("ab cd ef gh", first="gpt"))  # not a human first turn: skipped
    convs.insert(5, {"id": "empty", "conversations": []})
    text = json.dumps(convs)
    path = tmp_path_factory.mktemp("sharegpt") / "sg.json"
    path.write_text(text[: len(text) - 30])  # cut inside the last record, like the package
    return path, tok


def test_sharegpt_prompts_are_seeded_and_length_filtered(sharegpt_file):
    path, tok = sharegpt_file
    a = load_sharegpt_prompts(5, tok, seed=0, min_tokens=4, max_tokens=20, path=path)
    b = load_sharegpt_prompts(5, tok, seed=0, min_tokens=4, max_tokens=20, path=path)
    c = load_sharegpt_prompts(5, tok, seed=1, min_tokens=4, max_tokens=20, path=path)
    assert a == b and a != c and len(a) == 5
    assert all(4 <= len(tok(t)["input_ids"]) <= 20 for t in a + c)
    assert "ab cd ef gh" not in a + c
    with pytest.raises(ConfigError, match="only"):
        load_sharegpt_prompts(50, tok, min_tokens=4, max_tokens=20, path=path)
    with pytest.raises(ConfigError):
        load_sharegpt_prompts(0, tok, path=path)
    with pytest.raises(ConfigError):
        load_sharegpt_prompts(1, tok, min_tokens=10, max_tokens=5, path=path)


def test_packaged_sharegpt_gives_real_prompts():
    def words(text: str) -> dict:  # a whitespace "tokenizer" keeps the test light
        return {"input_ids": text.split()}

    prompts = load_sharegpt_prompts(3, words, seed=0, min_tokens=16, max_tokens=256)
    assert len(prompts) == 3 and len(set(prompts)) == 3
    assert all(16 <= len(p.split()) <= 256 for p in prompts)


@pytest.fixture(scope="module")
def engine(dirs):
    return Engine(load_hf_dir(dirs[0]), load_hf_dir(dirs[1]))


def test_run_bench_alternates_methods_and_measures_ttft(engine):
    base = GenerationConfig(max_new_tokens=6, ignore_eos=True)
    specs = harness.method_specs("ar,sd,smc", base, "N=2,3;K=2")
    names = [s.name for s in specs]
    prompts = ["ab cd", "ef gh ij", "kl ab"]
    recs = throughput.run_bench(engine, prompts, specs, seed=5, progress=False)
    assert len(recs) == len(prompts) * len(specs)
    for i in range(len(prompts)):  # the order rotates from prompt to prompt
        order = [r["method"] for r in recs if r["prompt"] == i]
        assert order == names[i:] + names[:i]
    for r in recs:
        assert r["new_tokens"] == 6  # EOS ignored: equal work for every method
        assert r["max_new_tokens"] == 6 and r["hit_cap"] is None  # a cap count says nothing
        assert r["tokens_per_second"] > 0 and r["seconds"] > 0
        if r["method"] != "smc-n2-k2" and r["method"] != "smc-n3-k2":
            # ar and sd stream every token: the first arrives before the end
            assert r["ttft_seconds"] is not None and 0 < r["ttft_seconds"] <= r["seconds"] + 0.05
    # paired seeds: the same prompt and seed give the same text again
    again = throughput.run_bench(engine, prompts[:1], specs, seed=5, warmup=False, progress=False)
    for a, r in zip(again, recs[: len(specs)], strict=True):
        assert a["method"] == r["method"] and a["text"] == r["text"]
    other = throughput.run_bench(engine, prompts[:1], specs, seed=6, warmup=False, progress=False)
    assert [o["text"] for o in other] != [r["text"] for r in recs[: len(specs)]]
    rows = throughput.summarize_bench(recs)
    by = {r["method"]: r for r in rows}
    assert by["ar"]["ratio_vs_baseline"] == pytest.approx(1.0)
    assert set(by) == set(names) and all(r["requests"] == 3 for r in rows)
    roof = throughput.roofline_rows(engine, specs, rows)
    assert [r["method"] for r in roof] == ["smc-n2-k2", "smc-n3-k2"]
    for r in roof:
        assert r["c"] > 0 and r["memory_bound"] > 0 and r["measured_costs"] > 0
        assert r["measured"] == pytest.approx(by[r["method"]]["ratio_vs_baseline"])


def test_bench_command_writes_report(dirs, sharegpt_file, tmp_path, capsys):
    path, _ = sharegpt_file
    out = tmp_path / "bench"
    code = main(
        ["bench", "--target", dirs[0], "--draft", dirs[1], "--sharegpt", str(path)]
        + ["--prompts", "2", "--min-prompt-tokens", "4", "--max-prompt-tokens", "20"]
        + ["-m", "4", "--methods", "ar,smc", "--grid", "N=2;K=2", "--out", str(out)]
    )
    assert code == 0
    runs = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    assert len(runs) == 4 and {r["method"] for r in runs} == {"ar", "smc-n2-k2"}
    summary = (out / "summary.md").read_text()
    assert "| ar | 2 |" in summary and "smc-n2-k2" in summary and "memory-bound" in summary
    assert "smcspec bench --target" in summary
    assert (out / "throughput.png").stat().st_size > 1000
    assert "Throughput on ShareGPT prompts" in capsys.readouterr().out


def test_bench_command_errors_are_clear(dirs, sharegpt_file, tmp_path, capsys):
    path, _ = sharegpt_file
    code = main(
        ["bench", "--target", dirs[0], "--draft", dirs[1], "--sharegpt", str(path)]
        + ["--prompts", "500", "--out", str(tmp_path / "x")]
    )
    assert code == 2
    assert "ShareGPT prompts" in capsys.readouterr().err


def test_bench_speeds_feed_the_pareto_plot(tmp_path):
    runs = tmp_path / "runs.jsonl"
    recs = [
        {"prompt": i, "method": m, "tokens_per_second": tps, "ttft_seconds": 0.1}
        for i, (m, tps) in enumerate([("ar", 2.0), ("ar", 4.0), ("smc-n4-k4", 5.0)])
    ]
    runs.write_text("".join(json.dumps(r) + "\n" for r in recs))
    speeds = throughput.load_bench_speeds(runs)
    assert speeds == {"ar": 3.0, "smc-n4-k4": 5.0}
    rows = [
        {"method": "ar", "n": 4, "correct": 2, "accuracy": 0.5, "ci_low": 0.2, "ci_high": 0.8,
         "median_tokens_per_second": 2.5},
        {"method": "sd-k4", "n": 4, "correct": 3, "accuracy": 0.75, "ci_low": 0.3,
         "ci_high": 0.95, "median_tokens_per_second": 2.9},
    ]  # fmt: skip
    out = report.write_report(rows, tmp_path / "rep", "gsm8k accuracy", "", speeds)
    text = out.read_text()
    assert "bench tokens/s" in text and "| 2.50 |" in text and text.count(" 3.00 |") == 1
    assert "| sd-k4 |" in text and text.rstrip().splitlines()[-1].endswith(" - |")
    assert (tmp_path / "rep" / "pareto.png").stat().st_size > 1000
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    for path in (bad, tmp_path / "missing.jsonl"):
        with pytest.raises(ConfigError):
            throughput.load_bench_speeds(path)


def test_bench_capped_column_only_when_eos_is_honoured(tmp_path):
    def rec(method: str, capped: bool | None) -> dict:
        return {"method": method, "tokens_per_second": 4.0, "ttft_seconds": 0.1, "hit_cap": capped}

    ignored = throughput.summarize_bench([rec("ar", None), rec("ar", None)])  # the default run
    assert ignored[0]["capped"] is None
    text = throughput.write_bench_report(ignored, [], tmp_path / "a", "t").read_text()
    assert "capped" not in text
    honoured = throughput.summarize_bench([rec("ar", True), rec("ar", False), rec("ar", True)])
    assert (honoured[0]["capped"], honoured[0]["capped_known"]) == (2, 3)
    text = throughput.write_bench_report(honoured, [], tmp_path / "b", "t").read_text()
    assert "| capped |" in text and text.splitlines()[6].endswith(" | 2/3 |")
