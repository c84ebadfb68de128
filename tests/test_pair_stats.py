"""The pair's acceptance statistics belong to the pair, not the machine
(``smcspec.tuning.pair_stats``): measured once on one machine, they serve another (the same
files' cache, or a pair-stats file carried to a GPU without the weights), and a bad file is a
clear error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import test_tuning

from smcspec import ConfigError
from smcspec.cli import main
from smcspec.config import GenerationConfig
from smcspec.models.loading import cache_root
from smcspec.tuning import tune
from smcspec.tuning import tuner as tuner_module
from smcspec.tuning.cache import read_costs, sampling_key
from smcspec.tuning.pair_stats import read_pair_stats, write_pair_stats

gguf_pair, engine, own_cache = test_tuning.gguf_pair, test_tuning.engine, test_tuning.own_cache
ACC_KEY = sampling_key(GenerationConfig())
REPO = Path(__file__).resolve().parents[1]


def _refuse(*args, **kwargs):
    raise AssertionError("acceptance measured again")


def _elsewhere(monkeypatch, machine: str) -> None:
    """The tuner now keys its costs as if on ``machine`` (another device of the same files)."""
    real = tuner_module.cost_key
    monkeypatch.setattr(tuner_module, "cost_key", lambda *a: {**real(*a), "machine": machine})


def test_acceptance_measured_on_one_machine_serves_another(engine, own_cache, monkeypatch):
    first = tune(engine)
    assert first.acceptance_source == "measured now"
    _elsewhere(monkeypatch, "a GPU")
    monkeypatch.setattr(tuner_module, "measure_acceptance", _refuse)
    there = tune(engine)
    assert there.cache_path != first.cache_path and there.measured_seconds > 0  # its own costs
    assert there.acceptance == first.acceptance
    assert there.acceptance_source.startswith("the same files' cache on ")
    assert [p.ess for p in there.predictions] == [p.ess for p in first.predictions]
    # kept in the new machine's cache: the next call reads it there
    assert read_costs(there.cache_path, there.key).acceptance[ACC_KEY] == first.acceptance
    assert tune(engine).acceptance_source == "cached"


def test_remeasure_does_not_borrow_another_machines_acceptance(engine, own_cache, monkeypatch):
    tune(engine)
    _elsewhere(monkeypatch, "a GPU")
    assert tune(engine, remeasure=True).acceptance_source == "measured now"


def test_a_pair_stats_file_replaces_measuring_and_is_never_cached(
    engine,
    own_cache,
    tmp_path,
    monkeypatch,
):
    first = tune(engine)
    path = write_pair_stats(
        tmp_path / "pair.json", engine.target.path, engine.draft.path, "this CPU",
        {ACC_KEY: first.acceptance},
    )  # fmt: skip
    stats = read_pair_stats(path)
    assert stats.target["name"] == engine.target.path.name and stats.measured_on == "this CPU"
    _elsewhere(monkeypatch, "a GPU without the weights")
    monkeypatch.setattr(tuner_module, "measure_acceptance", _refuse)
    tuned = tune(engine, pair_stats=stats)
    assert tuned.acceptance == first.acceptance and str(path) in tuned.acceptance_source
    assert [p.ess for p in tuned.predictions] == [p.ess for p in first.predictions]
    assert tuned.pick("auto") == tune(engine, pair_stats=stats).pick("auto")
    assert read_costs(tuned.cache_path, tuned.key).acceptance == {}  # only costs cached here
    with pytest.raises(ConfigError, match=r"no acceptance statistics at T=1.0.*holds: T=0.7"):
        from smcspec import GenerationConfig

        tune(engine, GenerationConfig(temperature=1.0), pair_stats=stats)


def _valid(tmp_path) -> dict:
    q = [i / 10 - 5 for i in range(101)]
    m = {"alpha": 0.8, "accepted": 8, "drafted": 12, "rounds": 4, "draft_tokens": 4,
         "new_tokens": 16, "prompts": 4, "log_weight_quantiles": q,
         "draft_top_probs": [[0.6, 0.3]], "target_top_probs": [[0.7, 0.2]]}  # fmt: skip
    f = tmp_path / "model.gguf"
    f.write_bytes(b"x" * 10)
    write_pair_stats(tmp_path / "ok.json", f, f, "m", {ACC_KEY: m})
    return json.loads((tmp_path / "ok.json").read_text())


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d.update(kind="other"), "not a smcspec-pair-stats file"),
        (lambda d: d.update(format=99), "of format 1"),
        (lambda d: d.update(acceptance={}), "no acceptance measurement"),
        (lambda d: d["acceptance"][ACC_KEY].update(alpha=1.5), r"alpha 1.5 is not in \[0, 1\]"),
        (lambda d: d["acceptance"][ACC_KEY].update(alpha="x"), "not a valid"),
        (lambda d: d["acceptance"][ACC_KEY].pop("draft_top_probs"), "needs the fields"),
        (lambda d: d["acceptance"][ACC_KEY]["log_weight_quantiles"].reverse(), "must not decrease"),
        (lambda d: d["acceptance"][ACC_KEY].update(log_weight_quantiles=[0, 1]), "101 finite"),
        (lambda d: d["acceptance"][ACC_KEY].update(target_top_probs=[[1.5]]), "probabilities"),
        (lambda d: d.pop("target"), "target"),
    ],
)
def test_a_bad_pair_stats_file_is_a_clear_error(tmp_path, change, message):
    data = _valid(tmp_path)
    assert read_pair_stats(tmp_path / "ok.json").for_sampling(ACC_KEY)["alpha"] == 0.8
    change(data)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=message) as err:
        read_pair_stats(bad)
    assert str(bad) in str(err.value)


@pytest.mark.parametrize("content", [None, "{not json", "[]"])
def test_an_unreadable_pair_stats_file_is_a_clear_error(tmp_path, content):
    path = tmp_path / "stats.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match="pair statistics|pair-statistics"):
        read_pair_stats(path)


def test_the_cli_exports_the_pair_stats_and_tunes_from_them(gguf_pair, own_cache, tmp_path, capsys):
    target, draft = (str(p) for p in gguf_pair)
    model = ["--target", target, "--draft", draft, "--threads", "1"]
    out = tmp_path / "pair.json"
    assert main(["bench", "--predict", *model, "--export-pair-stats", str(out)]) == 0
    text = capsys.readouterr().out
    assert "measured now on this machine" in text and str(out) in text
    assert read_pair_stats(out).for_sampling(ACC_KEY)["alpha"] >= 0
    for f in (cache_root() / "costs").glob("*.json"):
        f.unlink()  # a machine with none of its own measurements
    assert main(["bench", "--predict", *model, "--pair-stats", str(out)]) == 0
    assert f"from {out} (" in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["bench", "--predict", *model, "--pair-stats", str(bad)]) != 0
    assert "not a valid pair-statistics file" in capsys.readouterr().err
    assert main(["bench", *model, "--export-pair-stats", str(out)]) != 0
    assert "--export-pair-stats goes with --predict" in capsys.readouterr().err


def test_the_sampling_key_of_a_config_reads_the_committed_pair_file():
    """The key is spelled once, from a config; the committed file (written under the
    defaults) is found under it, and another temperature is another key."""
    committed = read_pair_stats(REPO / "benchmarks/pair_stats/qwen2.5-coder-1.5b-q4km_0.5b.json")
    assert committed.for_sampling(ACC_KEY)["alpha"] == pytest.approx(0.76, abs=0.005)
    assert sampling_key(GenerationConfig(temperature=1.0)) != ACC_KEY
    assert sampling_key(GenerationConfig(top_k=40)) != ACC_KEY
