"""The ``smcspec`` command: output formats and clear errors (never a traceback)."""

from __future__ import annotations

import json
import re

import pytest
from tiny_models import make_tiny_hf_model

from smcspec.cli import _config, build_parser, main


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    return str(make_tiny_hf_model(root, "qwen2", seed=0)), str(
        make_tiny_hf_model(root, "qwen2", seed=1)
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--particles", "0"], "particles N must be in"),
        (["--draft-tokens", "0"], "draft_tokens K must be in"),
        (["--temperature", "0"], "temperature must be a finite number > 0"),
        (["--draft-temperature", "-1"], "draft_temperature must be"),
        (["--ess-threshold", "1.5"], "ess_threshold kappa must be in"),
        (["--max-new-tokens", "0"], "max_new_tokens must be"),
        (["--alpha", "0"], "alpha must be"),
        (["--top-k", "-2"], "top_k must be"),
        (["--top-p", "0"], "top_p must be in"),
        (["--top-p", "nan"], "top_p must be in"),
        (["--min-p", "1.5"], "min_p must be in"),
        (["--target", "/nonexistent/model.gguf"], "does not exist"),
        (["--device", "cuda:7"], "CUDA"),
    ],
)
def test_bad_options_exit_with_a_clear_error(capsys, args, message):
    code = main(["generate", "hello", *args])
    err = capsys.readouterr().err
    assert code in (2, 3)
    assert err.startswith("error: ") and re.search(message, err)
    assert "Traceback" not in err


def test_truncation_options_reach_the_config():
    args = build_parser().parse_args(
        ["generate", "hi", "--top-k", "40", "--top-p", "0.9", "--min-p", "0.05"]
    )
    cfg = _config(args)
    assert (cfg.top_k, cfg.top_p, cfg.min_p) == (40, 0.9, 0.05)
    default = _config(build_parser().parse_args(["generate", "hi"]))
    assert (default.top_k, default.top_p, default.min_p) == (0, 1.0, 0.0)  # all off


def test_unknown_resampler_and_method_are_usage_errors(capsys):
    for args in (["--resampler", "bogus"], ["--method", "bogus"]):
        with pytest.raises(SystemExit) as exc:
            main(["generate", "hello", *args])
        assert exc.value.code == 2
        assert "invalid choice" in capsys.readouterr().err


def test_corrupt_gguf_exits_3(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SMCSPEC_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    assert main(["generate", "hello", "--target", str(bad)]) == 3
    err = capsys.readouterr().err
    assert "not a readable GGUF" in err and "Traceback" not in err


@pytest.mark.parametrize("method", ["ar", "sd", "smc"])
def test_json_output(pair, capsys, method):
    target, draft = pair
    code = main(
        [
            "generate",
            "ab cd",
            "--target",
            target,
            "--draft",
            draft,
            "--no-chat",
            "--method",
            method,
            "-m",
            "6",
            "--seed",
            "1",
            "--json",
        ]
    )
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("text", "method", "new_tokens", "seconds", "tokens_per_second"):
        assert key in out
    assert out["method"] == method and 1 <= out["new_tokens"] <= 6
    if method == "smc":
        assert {"rounds", "resamples", "mean_ess"} <= out.keys()
    if method == "sd":
        assert "acceptance_rate" in out


@pytest.mark.parametrize("method", ["ar", "sd", "smc"])
def test_generate_with_truncation(pair, capsys, method):
    target, draft = pair
    args = ["generate", "ab cd", "--target", target, "--draft", draft, "--no-chat"]
    args += ["--method", method, "-m", "6", "--seed", "2", "--json"]
    code = main([*args, "--top-k", "5", "--top-p", "0.9", "--min-p", "0.05"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["method"] == method and 1 <= out["new_tokens"] <= 6


def test_plain_output_streams_then_prints_one_stats_line(pair, capsys):
    target, draft = pair
    code = main(
        [
            "generate",
            "ab cd",
            "--target",
            target,
            "--draft",
            draft,
            "--no-chat",
            "-m",
            "6",
            "--seed",
            "1",
            "-N",
            "3",
            "-K",
            "2",
        ]
    )
    assert code == 0
    lines = capsys.readouterr().out.rstrip("\n").split("\n")
    assert re.match(
        r"\[smc\] \d+ tokens in [\d.]+ s \([\d.]+ tokens/s\).*N=3 K=2, rounds \d+, "
        r"resamples \d+, mean ESS",
        lines[-1],
    )
