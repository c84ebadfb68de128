"""The ``smcspec`` command: output formats and clear errors (never a traceback)."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
from tiny_models import make_tiny_hf_model

import smcspec.cli
from smcspec.cli import build_parser, main, parse_args
from smcspec.cli.evaluate import gsm8k_data
from smcspec.cli.options import config_from_args, method_args, resolve_max_new_tokens
from smcspec.eval.gsm8k import packaged_test_path


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    return str(make_tiny_hf_model(root, "qwen2", seed=0)), str(
        make_tiny_hf_model(root, "qwen2", seed=1)
    )


def _generate(pair: tuple[str, str], *extra: str) -> list[str]:
    """``generate "ab cd"`` on the tiny pair, plain prompt, then ``extra``."""
    target, draft = pair
    return ["generate", "ab cd", "--target", target, "--draft", draft, "--no-chat", *extra]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--particles", "0"], "particles N must be in"),
        (["--draft-tokens", "0"], "draft_tokens K must be in"),
        (["--temperature", "-1"], "temperature must be a finite number >= 0"),
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
        (["--rpc", "nohost"], "HOST:PORT"),
        (["--rpc", "127.0.0.1:99999"], "HOST:PORT"),
        (["--gpu-layers", "-5"], "gpu_layers must be"),
    ],
)
def test_bad_options_exit_with_a_clear_error(capsys, args, message):
    code = main(["generate", "hello", *args])
    err = capsys.readouterr().err
    assert code in (2, 3)
    assert err.startswith("error: ") and re.search(message, err)
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "args, message",
    [(["--port", "0"], "--port must be"), (["--threads", "0"], "--threads must be")],
)
def test_rpc_server_refuses_bad_options(capsys, args, message):
    assert main(["rpc-server", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err


def test_truncation_options_reach_the_config():
    args = parse_args(["generate", "hi", "--top-k", "40", "--top-p", "0.9", "--min-p", "0.05"])
    cfg = config_from_args(args, method_args(args))
    assert (cfg.top_k, cfg.top_p, cfg.min_p) == (40, 0.9, 0.05)
    plain = parse_args(["generate", "hi"])
    default = config_from_args(plain, method_args(plain))
    assert (default.top_k, default.top_p, default.min_p) == (0, 1.0, 0.0)  # all off


def _cli_functions(root: Path):
    """``(file name, function)`` of every function of the modules under ``root``."""
    for path in sorted(root.glob("*.py")):
        for fn in ast.walk(ast.parse(path.read_text())):
            if isinstance(fn, ast.FunctionDef):
                yield path.name, fn


def _on_args(node: ast.AST, attr: str | None = None) -> bool:
    """``node`` is ``args.<attr>`` (any attribute with ``attr`` None)."""
    return (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "args"
        and (attr is None or node.attr == attr)
    )


def method_lookups(root: Path) -> list[tuple[str, str]]:
    """``(file, function)`` of every function under ``root`` that reads ``args.method`` or
    looks a name up in the decoder table's choices (``choice``, ``choice_or_none``)."""
    found = set()
    for name, fn in _cli_functions(root):
        for node in ast.walk(fn):
            calls = (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                     and node.func.id in ("choice", "choice_or_none"))  # fmt: skip
            if _on_args(node, "method") or calls:
                found.add((name, fn.name))
    return sorted(found)


def namespace_writes(root: Path) -> list[tuple[str, str]]:
    """``(file, function)`` of every function under ``root`` that sets an attribute of
    ``args`` (the argparse Namespace)."""
    found = set()
    for name, fn in _cli_functions(root):
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign) and any(_on_args(t) for t in node.targets):
                found.add((name, fn.name))
    return sorted(found)


def test_the_cli_resolves_the_method_once():
    """``--method`` is read and resolved in the table by ``options.method_args`` alone (each
    command's ``run`` calls it once and passes the result on), ``bench``'s ``--methods`` by
    ``_bench_choices`` alone; only the parser sets anything on the argparse Namespace (the
    defaults it resolves), nothing is cached there later. Broken variants caught:
    ``generate._stats_line`` calling ``choice(args.method)`` for its note again; on cb48c1a
    eight functions of ``cli/options.py``, ``cli/engine_args.py``, ``cli/generate.py`` and
    ``cli/serve.py`` read or resolve it, and ``load_engine``, ``config_from_args`` and the
    pair-stats reader cached on the Namespace (``git archive cb48c1a src/smcspec/cli``: this
    scan finds them)."""
    root = Path(smcspec.cli.__file__).parent
    assert method_lookups(root) == [("bench.py", "_bench_choices"), ("options.py", "method_args")]
    assert namespace_writes(root) == [("parser.py", "parse_args")]


def test_unknown_resampler_and_method_are_usage_errors(capsys):
    for args in (["--resampler", "bogus"], ["--method", "bogus"], ["--finished-particles", "x"]):
        with pytest.raises(SystemExit) as exc:
            main(["generate", "hello", *args])
        assert exc.value.code == 2
        assert "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize(
    "backend, message",
    [("torch", "not a readable GGUF"), ("auto", "cannot read the tokenizer from .*bad.gguf")],
)
def test_corrupt_gguf_exits_3(tmp_path, capsys, monkeypatch, backend, message):
    monkeypatch.setenv("SMCSPEC_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    assert main(["generate", "hello", "--target", str(bad), "--backend", backend]) == 3
    err = capsys.readouterr().err
    assert re.search(message, err) and "Traceback" not in err


@pytest.mark.parametrize("method", ["ar", "sd", "smc"])
def test_json_output(pair, capsys, method):
    code = main(_generate(pair, "--method", method, "-m", "6", "--seed", "1", "--json"))
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
    args = _generate(pair, "--method", method, "-m", "6", "--seed", "2", "--json")
    code = main([*args, "--top-k", "5", "--top-p", "0.9", "--min-p", "0.05"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["method"] == method and 1 <= out["new_tokens"] <= 6


def test_generate_with_fp8_projections(pair, capsys):
    args = _generate(pair, "-m", "6", "--seed", "2", "--json", "-N", "3", "-K", "2", "--fp8")
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["method"] == "smc" and 1 <= out["new_tokens"] <= 6


def test_plain_output_streams_then_prints_one_stats_line(pair, capsys):
    code = main(_generate(pair, "-m", "6", "--seed", "1", "-N", "3", "-K", "2"))
    assert code == 0
    lines = capsys.readouterr().out.rstrip("\n").split("\n")
    assert re.match(
        r"\[smc\] \d+ tokens in [\d.]+ s \([\d.]+ tokens/s\).*N=3 K=2, rounds \d+, "
        r"resamples \d+, mean ESS",
        lines[-1],
    )


# ------------------------------------------------------------------ hostile inputs
# (args after `generate PROMPT --target T --draft D --no-chat -m 4`, exit code, stderr pattern)
HOSTILE = [
    (["--seed", str(2**70)], 0, None),  # any integer seed is used modulo 2**64
    (["--seed", str(-(2**70))], 0, None),
    (["--seed", "1.5"], "usage", "invalid int value"),
    (["--temperature", "nan"], 2, "temperature must be a finite number"),
    (["--temperature", "inf"], 2, "temperature must be a finite number"),
    (["--draft-temperature", "1e-400"], 2, "draft_temperature must be"),
    (["-m", "100000"], 2, "exceeds the model context"),
    (["-m", "-3"], 2, "max_new_tokens must be"),
    (["-N", "100000"], 2, "particles N must be in"),
    (["-K", "-1"], 2, "draft_tokens K must be in"),
    (["--ess-threshold", "nan"], 2, "ess_threshold kappa must be in"),
    (["--alpha=-inf"], 2, "alpha must be"),
    (["--dtype", "int8"], "usage", "invalid choice"),
]


def _without_notes(err: str) -> str:
    """stderr without the one-time progress notes (the first tuned run measures costs)."""
    return "".join(ln for ln in err.splitlines(keepends=True) if not ln.startswith("smcspec: "))


@pytest.mark.parametrize("args, code, message", HOSTILE)
def test_hostile_options_give_one_line_or_succeed(pair, capsys, args, code, message):
    argv = _generate(pair, "-m", "4")
    if code == "usage":  # argparse refuses it: usage text and exit 2
        with pytest.raises(SystemExit) as exc:
            main([*argv, *args])
        assert exc.value.code == 2 and re.search(message, capsys.readouterr().err)
        return
    assert main([*argv, *args]) == code
    err = _without_notes(capsys.readouterr().err)
    assert "Traceback" not in err
    if message is None:
        assert err == ""
    else:
        assert err.startswith("error: ") and err.count("\n") == 1 and re.search(message, err)


@pytest.mark.parametrize(
    "prompt, chat",
    [("ab \udcff cd", False), ("ab \ud800", True), ("   ", False)],
    ids=["surrogate-escaped-byte", "lone-surrogate-chat", "blank"],
)
def test_prompts_the_tokenizer_cannot_take_are_one_line_errors(pair, capsys, prompt, chat):
    target, draft = pair
    argv = ["generate", prompt, "--target", target, "--draft", draft, "-m", "4"]
    code = main(argv if chat else [*argv, "--no-chat"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err


def test_invalid_utf8_bytes_on_the_command_line(pair):
    """The real process: argv bytes that are not UTF-8 (Python decodes them as surrogates)."""
    import os
    import subprocess
    import sys

    target, draft = pair
    argv = [sys.executable, "-m", "smcspec", "generate", b"ab \xff\xfe cd", "--target", target,
            "--draft", draft, "--no-chat", "-m", "4"]  # fmt: skip
    proc = subprocess.run(
        [os.fsencode(a) for a in argv], capture_output=True, timeout=120, env=os.environ
    )
    err = proc.stderr.decode(errors="replace")
    assert proc.returncode == 2 and "not valid text" in err and "Traceback" not in err, err


def test_serve_refuses_bad_settings_before_loading(capsys):
    for args, message in (
        (["--port", "70000"], "--port must be in"),
        (["--max-request-bytes", "10"], "max_request_bytes must be"),
        (["--api-key", " "], "API key must not be empty"),
        (["--max-running", "0"], "max_running must be"),
        (["--target", "/nonexistent.gguf"], "does not exist"),
    ):
        assert main(["serve", *args]) in (2, 3)
        err = capsys.readouterr().err
        assert err.startswith("error: ") and re.search(message, err) and "Traceback" not in err


def _budget(argv: list[str]) -> int:
    return resolve_max_new_tokens(build_parser().parse_args(argv))


def test_max_new_tokens_defaults_per_command_and_task():
    assert _budget(["eval", "gsm8k"]) == 512  # 128 cut GSM8K answers before their #### line
    assert _budget(["eval", "humaneval"]) == 1024
    assert _budget(["eval", "gsm8k", "-m", "64"]) == 64  # an explicit -m always wins
    assert _budget(["eval", "humaneval", "--max-new-tokens", "300"]) == 300
    # answers run to the end of turn; 1024 only caps them (bench keeps a fixed budget)
    assert _budget(["generate", "hi"]) == _budget(["serve"]) == 1024
    assert _budget(["bench"]) == 128
    assert _budget(["bench", "-m", "32"]) == 32


@pytest.mark.parametrize(
    "command, shown",
    [
        (["eval"], "default: gsm8k 512"),
        (["bench"], "default: 128"),
        (["generate"], "default: 1024"),
    ],
)
def test_help_shows_the_effective_budget(capsys, command, shown):
    with pytest.raises(SystemExit) as exc:
        main([*command, "--help"])
    assert exc.value.code == 0
    assert shown in " ".join(capsys.readouterr().out.split())  # argparse wraps lines


@pytest.mark.parametrize("m, expected", [([], 512), (["-m", "64"], 64)])
def test_eval_gsm8k_report_states_the_budget_used(tmp_path, capsys, m, expected):
    """End to end through main without a model: --rescore of an empty run still reports."""
    out = tmp_path / "run"
    code = main(["eval", "gsm8k", "--limit", "2", "--rescore", "--out", str(out), *m])
    assert code == 0
    assert f"max_new_tokens {expected}," in (out / "summary.md").read_text()
    capsys.readouterr()


def test_eval_gsm8k_reads_the_packaged_test_split_unless_data_is_given(tmp_path, capsys):
    assert gsm8k_data(build_parser().parse_args(["eval", "gsm8k"])) == packaged_test_path()
    mine = tmp_path / "g.jsonl"
    mine.write_text('{"question": "q", "answer": "#### 1"}\n')
    args = build_parser().parse_args(["eval", "gsm8k", "--data", str(mine)])
    assert gsm8k_data(args) == mine
    code = main(["eval", "gsm8k", "--data", str(tmp_path / "none.jsonl"), "--rescore"])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the GSM8K data") and "no such file" in err
    assert "Traceback" not in err


def test_generate_reports_whether_the_cap_or_the_model_ended_the_answer(pair, capsys):
    """--json carries finish_reason and hit_cap; the plain stats line names the cap; an
    answer the model ends (here a regex that is complete after "ab") is not capped."""
    target, draft = pair
    common = ["generate", "ab", "--target", target, "--draft", draft, "--no-chat",
              "--method", "ar", "--seed", "0"]  # fmt: skip
    assert main([*common, "-m", "5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["finish_reason"] == "length" and out["hit_cap"] is True
    assert main([*common, "-m", "5"]) == 0
    assert "cut by the cap of 5 new tokens, not by the model" in capsys.readouterr().out
    assert main([*common, "--regex", "ab", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["text"] == "ab" and out["finish_reason"] == "stop" and out["hit_cap"] is False
    assert main([*common, "--regex", "ab"]) == 0
    assert "cut by the cap" not in capsys.readouterr().out


def test_a_gguf_pair_without_llama_cpp_says_it_falls_back_to_torch(tmp_path, monkeypatch):
    """--backend auto with llama-cpp-python missing: one line, before any conversion, naming
    the conversion's size and the fix."""
    import importlib.util

    from tiny_models import make_tiny_gguf

    from smcspec import Engine

    path, _ = make_tiny_gguf(tmp_path, "qwen2", 96, seed=0)
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llama_cpp" else real(name, *a),
    )
    lines: list[str] = []
    engine = Engine.load(path, with_draft=False, log=lines.append)
    assert engine.target.backend == "torch"
    assert len(lines) == 1, lines
    assert "llama-cpp-python is not installed" in lines[0] and "float32 (about 0.0" in lines[0]
    assert "scripts/setup.sh" in lines[0] and "smcspec[llamacpp]" in lines[0]
    monkeypatch.setattr(importlib.util, "find_spec", real)
    if real("llama_cpp") is not None:  # with it installed: the llamacpp backend, no line
        lines.clear()
        assert Engine.load(path, with_draft=False, log=lines.append).target.backend == "llamacpp"
        assert lines == []


@pytest.mark.parametrize("method", ["ar", "sd", "smc"])
def test_generate_at_temperature_0_is_greedy_on_every_method(pair, capsys, method):
    target, draft = pair
    argv = ["generate", "ab", "--target", target, "--draft", draft, "--no-chat", "-m", "6",
            "--temperature", "0", "--method", method, "-N", "4", "-K", "2"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    text, stats = out.rstrip("\n").rsplit("\n", 1)
    assert stats.startswith("[smc, greedy: run as sd]" if method == "smc" else f"[{method}]")
    assert main([*argv, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["greedy"] is True and result["text"] == text


def test_fixed_threads_turns_the_fair_share_off(monkeypatch):
    """``--fixed-threads`` reaches Engine.load as ``fair_share=False``; without it, True."""
    import smcspec.engine
    from smcspec.cli.engine_args import load_engine

    seen = []

    def fake_load(*a, **kw):
        seen.append(kw["fair_share"])
        raise RuntimeError("stop before loading")

    monkeypatch.setattr(smcspec.engine.Engine, "load", fake_load)
    cases = ((["generate", "x"], True), (["generate", "x", "--fixed-threads"], False))
    for argv, expected in cases:
        with pytest.raises(RuntimeError, match="stop before"):
            load_engine(parse_args(argv))
        assert seen[-1] is expected


def test_provenance_names_what_computed():
    """A llamacpp run's reports name llama.cpp's version and threads, not torch's dtype."""
    import argparse
    from importlib.metadata import version

    from smcspec.cli.engine_args import provenance

    pytest.importorskip("llama_cpp")
    ns = argparse.Namespace(backend="llamacpp", threads=1, device="cpu", dtype="float32")
    line = provenance(ns)
    assert f"llama-cpp-python {version('llama_cpp_python')}" in line
    assert "1 llama.cpp threads (fewer while cores are busy)" in line and "float32" not in line
    ns.fixed_threads = True
    assert "1 llama.cpp threads;" in provenance(ns)
    chosen = argparse.Namespace(backend="auto", threads=None, device="cpu", dtype="float32")
    assert "physical-core llama.cpp threads" in provenance(chosen, "llamacpp")  # what auto chose
    ns = argparse.Namespace(backend="torch", threads=None, device="cpu", dtype="bfloat16")
    assert provenance(ns).endswith("; bfloat16") and "torch threads" in provenance(ns)


def test_generate_with_ngram_drafts_needs_no_draft_model(pair, capsys):
    """``--draft ngram``: sd drafts from the text; no draft model is named or loaded, and at
    temperature 0 the output equals greedy ar's."""
    target, _ = pair
    base = ["generate", "ab cd ab cd ab", "--target", target, "--no-chat", "-m", "12",
            "--temperature", "0", "--json"]  # fmt: skip
    assert main([*base, "--method", "sd", "--draft", "ngram"]) == 0
    ngram = json.loads(capsys.readouterr().out)
    assert ngram["method"] == "sd" and ngram["draft"] == "ngram" and "acceptance_rate" in ngram
    assert main([*base, "--method", "ar"]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == ngram["text"]
    assert main(base[:-1] + ["--method", "sd", "--draft", "ngram"]) == 0  # the stats line
    line = capsys.readouterr().out.rstrip("\n").split("\n")[-1]
    assert line.startswith("[sd] ") and "K=4, n-gram drafts, rounds " in line, line
    assert "rounds the gate cut or kept from drafting " in line, line


def test_smc_refuses_the_ngram_draft(pair, capsys):
    target, _ = pair
    args = ["generate", "ab", "--target", target, "--method", "smc", "--draft", "ngram"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: SMC-SD cannot use the n-gram draft") and "point mass" in err
