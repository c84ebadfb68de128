"""Integration on the real default pair (Qwen2.5-Coder 1.5B target, 0.5B draft).

These need the ``smcspec[models]`` packages (the README's test command installs them) and
take a few minutes on a 2-core CPU: the first run assembles, verifies and converts both
GGUF files into ``$SMCSPEC_CACHE``. The llama.cpp pair is the session's (``real_engine``,
``real_server``: tests/conftest.py): the CLI runs on it in this process, except where the
CLI's own loading is what is checked (a child process: plain ``generate``, and the torch
backend).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from smcspec import ContextLengthError, Engine, GenerationConfig, ModelFileError
from smcspec.models import load_model
from smcspec.models.default_pair import DEFAULT_DRAFT, DEFAULT_TARGET, ensure_packaged_model
from smcspec.models.loading import cache_root

pytestmark = [pytest.mark.slow, pytest.mark.real_pair]
PROMPT = "Write a Python function that returns the squares of a list of numbers, and explain it."


@pytest.fixture(scope="module")
def gguf_paths():
    return {
        spec.name: ensure_packaged_model(spec, cache_root())
        for spec in (DEFAULT_TARGET, DEFAULT_DRAFT)
    }


def test_default_pair_installed_and_verified(gguf_paths):
    for spec in (DEFAULT_TARGET, DEFAULT_DRAFT):
        assert gguf_paths[spec.name].stat().st_size == spec.size  # sha256 checked on the way


def test_wrong_hash_is_refused(tmp_path):
    fake = replace(DEFAULT_DRAFT, name="tampered", sha256="0" * 64)
    with pytest.raises(ModelFileError, match="does not match.*Refusing"):
        ensure_packaged_model(fake, tmp_path)
    assert not (tmp_path / "models" / "tampered.gguf").exists()


def test_altered_cached_file_is_rebuilt_from_the_packages(tmp_path, gguf_paths):
    dest = tmp_path / "models" / f"{DEFAULT_DRAFT.name}.gguf"
    dest.parent.mkdir(parents=True)
    shutil.copyfile(gguf_paths[DEFAULT_DRAFT.name], dest)
    with open(dest, "r+b") as f:  # flip one byte in the middle
        f.seek(DEFAULT_DRAFT.size // 2)
        b = f.read(1)
        f.seek(DEFAULT_DRAFT.size // 2)
        f.write(bytes([b[0] ^ 0xFF]))
    assert ensure_packaged_model(DEFAULT_DRAFT, tmp_path) == dest  # rebuilt and verified


def test_a_verified_file_is_not_hashed_again_until_it_changes(tmp_path, gguf_paths, monkeypatch):
    import smcspec.models.default_pair as default_pair

    dest = tmp_path / "models" / f"{DEFAULT_DRAFT.name}.gguf"
    dest.parent.mkdir(parents=True)
    shutil.copyfile(gguf_paths[DEFAULT_DRAFT.name], dest)
    assert ensure_packaged_model(DEFAULT_DRAFT, tmp_path) == dest  # hashed, stamped
    assert dest.with_name(dest.name + ".verified").is_file()
    hashed = []
    real_sha256 = default_pair.sha256_file
    monkeypatch.setattr(default_pair, "sha256_file", lambda p: hashed.append(p) or real_sha256(p))
    assert ensure_packaged_model(DEFAULT_DRAFT, tmp_path) == dest
    assert hashed == []  # the stamp matched
    with open(dest, "r+b") as f:  # the file changes after its stamp: verified again, rebuilt
        f.seek(DEFAULT_DRAFT.size // 2)
        b = f.read(1)
        f.seek(DEFAULT_DRAFT.size // 2)
        f.write(bytes([b[0] ^ 0xFF]))
    assert ensure_packaged_model(DEFAULT_DRAFT, tmp_path) == dest
    assert len(hashed) == 2  # the altered file, then the rebuilt one
    assert default_pair._verified_before(DEFAULT_DRAFT, dest)


def test_missing_packages_are_named(tmp_path):
    ghost = replace(DEFAULT_DRAFT, name="ghost", dist_prefix="smcspec-no-such-model-part")
    with pytest.raises(ModelFileError, match="(?s)smcspec-no-such-model-part1==0.9.0.*pip install"):
        ensure_packaged_model(ghost, tmp_path)


def test_truncated_gguf_is_refused(tmp_path, gguf_paths, monkeypatch):
    monkeypatch.setenv("SMCSPEC_CACHE", str(tmp_path / "cache"))
    cut = tmp_path / "cut.gguf"
    with open(gguf_paths[DEFAULT_DRAFT.name], "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(DEFAULT_DRAFT.size // 3))
    with pytest.raises(ModelFileError):
        load_model(cut)


@pytest.fixture(scope="module")
def draft_model(gguf_paths):
    return load_model(gguf_paths[DEFAULT_DRAFT.name], sha256=DEFAULT_DRAFT.sha256, backend="torch")


def test_real_draft_forward_matches_transformers(draft_model):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(draft_model.path, dtype=torch.float32).eval()
    ids = Engine(draft_model).encode(PROMPT)
    x = torch.tensor(ids)
    with torch.inference_mode():
        ref = hf(x[None]).logits[0]
    cache = draft_model.model.new_cache(1, 8)
    last = draft_model.model.prefill(x[:-4], cache)
    inc = draft_model.model.decode(x[-4:][None], cache)[0]
    # float32, same dequantized weights: max |diff| measured 2.6e-5 on logits of size ~30
    torch.testing.assert_close(last, ref[-5], atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(inc, ref[-4:], atol=1e-3, rtol=1e-4)


def test_prompt_over_the_context_is_refused(draft_model):
    engine = Engine(draft_model)
    with pytest.raises(ContextLengthError, match="exceeds the model context of 32768"):
        engine.generate([1000] * 32_800, GenerationConfig(method="ar", max_new_tokens=8))


def _cli(*args: str) -> subprocess.CompletedProcess:
    """``smcspec generate PROMPT *args`` in a child process, which loads the pair itself."""
    return subprocess.run(
        [sys.executable, "-m", "smcspec", "generate", PROMPT, *args],
        capture_output=True,
        text=True,
        timeout=1200,
        env=os.environ.copy(),
    )


def _cli_here(engine, monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """``smcspec generate PROMPT *args`` in this process on ``engine``, the session's default
    pair, in place of the one the CLI would load (the options must name the default pair);
    returns (exit code, stdout, stderr)."""
    import smcspec.cli.generate as generate
    from smcspec.cli import main

    def shared_pair(parsed, with_draft: bool = True):
        assert parsed.target is None and parsed.draft is None and parsed.backend == "auto"
        return engine

    monkeypatch.setattr(generate, "load_engine", shared_pair)
    capsys.readouterr()
    code = main(["generate", PROMPT, *args])
    out, err = capsys.readouterr()
    return code, out, err


def _readable(text: str) -> bool:
    letters = sum(c.isascii() and (c.isalnum() or c.isspace()) for c in text)
    return len(text) > 40 and letters / len(text) > 0.7


@pytest.mark.parametrize(
    "method, backend",
    [("smc", "auto"), ("sd", "auto"), ("ar", "auto"), ("smc", "torch")],
)
def test_cli_generates_readable_text_on_the_real_pair(
    method, backend, gguf_paths, real_engine, monkeypatch, capsys
):
    """``auto`` runs the GGUF pair on llama.cpp (the session's, in this process); ``torch``
    the dequantized draft GGUF as target and draft, in a child process that loads it.

    The torch run takes the draft for both so that no 7 GB float32 copy of the 1.5B target
    is converted for it (75 s of the suite's 112 s for this case): the conversion runs the
    same code on every tensor type (the ``gguf`` library dequantizes), the draft's
    conversion is the one checked against ``transformers`` above and is made once for both
    tests.

    ``smc`` on ``auto`` is the session's first tuner run on the real pair (unless the user's
    cache holds its costs): it measures every forward shape of the default grid timed once
    (``reps`` 1; 3 by default) and the acceptance on the built-in prompts over 64 new tokens
    (256 by default; the pair-profile pass over the 151,936-token vocabulary was most of the
    case's 142 s), into ``$SMCSPEC_CACHE/costs``, where the later CLI tests read them. Fails
    with the fidelity floors left out of the choice (``min_particles`` 1 and ``min_ess`` 0
    given to ``choose`` in ``tune``: a mean ESS of 1.0; tried)."""
    if (method, backend) == ("smc", "auto"):
        import smcspec.tuning.tuner as tuner

        full = tuner.default_grid
        quick = lambda device: replace(full(device), reps=1, acceptance_tokens=64)  # noqa: E731
        monkeypatch.setattr(tuner, "default_grid", quick)
    # torch: N and K given, so the tuner does not measure the slower torch forwards here
    draft = str(gguf_paths[DEFAULT_DRAFT.name])
    extra = ["--target", draft, "--draft", draft, "--dtype", "bfloat16", "-N", "4", "-K", "4"]
    extra = extra if backend == "torch" else []
    args = ("--method", method, "--max-new-tokens", "32", "--seed", "0", "--json",
            "--backend", backend, *extra)  # fmt: skip
    if backend == "torch":
        r = _cli(*args)
        code, stdout, stderr = r.returncode, r.stdout, r.stderr
    else:
        code, stdout, stderr = _cli_here(real_engine, monkeypatch, capsys, *args)
    assert code == 0, stderr
    out = json.loads(stdout)
    assert out["method"] == method and out["new_tokens"] == 32
    assert _readable(out["text"]), out["text"]
    if method == "smc":
        k = out["draft_tokens"]  # chosen from measured costs on llamacpp: K+1 tokens a round
        assert out["rounds"] >= math.ceil((32 - 1) / (k + 1)) and out["mean_ess"] > 1.0
        assert out["particles"] >= 4
    elif method == "sd":
        assert 0.0 < out["acceptance_rate"] <= 1.0


def test_cli_plain_mode_streams_and_ends_with_stats(gguf_paths):
    """smc without -N/-K: the setting comes from this machine's measured costs (measured once,
    about a minute, into ``$SMCSPEC_CACHE/costs``), N at least 4."""
    r = _cli("--max-new-tokens", "16", "--seed", "3")
    assert r.returncode == 0, r.stderr
    *text, stats = r.stdout.rstrip("\n").split("\n")
    assert _readable("\n".join(text))
    m = re.match(
        r"\[smc\] \d+ tokens in [\d.]+ s .*N=(\d+) K=(\d+), rounds \d+.*; "
        r"smc-n\1-k\2 chosen by smc without -N/-K from measured costs",
        stats,
    )
    assert m and int(m.group(1)) >= 4, stats


def test_cli_method_auto_on_the_real_pair(real_engine, monkeypatch, capsys):
    """``--method auto`` picks the fastest predicted setting and says which (on the 2-core CPU
    of ``docs/benchmarks/llamacpp-cpu/predict.md`` that is ar)."""
    args = ("--method", "auto", "--max-new-tokens", "32", "--seed", "0", "--json")
    code, stdout, stderr = _cli_here(real_engine, monkeypatch, capsys, *args)
    assert code == 0, stderr
    out = json.loads(stdout)
    tuned = out["tuned"]
    assert tuned["chosen_by"] == "auto" and tuned["predicted_tokens_per_second"] > 0
    assert tuned["setting"].split("-")[0] == out["method"] and out["new_tokens"] == 32
    assert _readable(out["text"]), out["text"]


def test_eval_harness_on_real_gsm8k_questions(tmp_path, real_engine):
    """The harness end to end on a real GSM8K test question by ``ar`` and ``smc`` (a short
    answer: mechanics only; several questions: tests/test_eval_harness.py's tiny pair)."""
    from smcspec.eval import harness, report
    from smcspec.eval.gsm8k import load_gsm8k
    from smcspec.eval.results import ResultFile

    items = load_gsm8k(limit=1, seed=0)  # the test split shipped in the package
    engine = real_engine
    specs = harness.method_specs("ar,smc", GenerationConfig(max_new_tokens=24))
    records = harness.run_task(
        engine,
        "gsm8k",
        items,
        specs,
        ResultFile(tmp_path / "r.jsonl"),
        progress=False,
        score_nll=True,
    )
    assert len(records) == 2
    assert all(r["new_tokens"] >= 1 and r["target_nll"] > 0 for r in records)
    rows = report.summarize(records)
    assert {r["method"] for r in rows} == {"ar", "smc-n4-k4"}


def test_server_on_the_default_pair(real_server):
    """``smcspec serve``'s app on the real pair (the session's server, served as the
    target's name), through the real openai client."""
    name = real_server.model
    client = real_server.client(timeout=600)
    assert name == "qwen2.5-coder-1.5b-instruct-q4_k_m"
    text, usage = "", None
    for chunk in client.chat.completions.create(
        model=name,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=16,
        seed=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"smc": {"method": "smc", "particles": 4, "draft_tokens": 4}},
    ):
        usage = chunk.usage or usage
        text += "".join(c.delta.content or "" for c in chunk.choices)
    assert usage.completion_tokens == 16
    assert len(text) > 20 and sum(c.isalpha() for c in text) > 10, text
    # structured output: a JSON schema through response_format, constrained SMC-SD
    import jsonschema_rs

    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 30},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "skills": {
                "type": "array",
                "items": {"type": "string", "enum": ["python", "rust", "sql", "go"]},
                "maxItems": 3,
            },
        },
        "required": ["name", "age", "skills"],
        "additionalProperties": False,
    }
    reply = client.chat.completions.create(
        model=name,
        messages=[{"role": "user", "content": "Ana Ruiz, 34, writes Python and SQL. "
                   "Give her name, age and skills as JSON."}],
        max_tokens=96,
        seed=0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": schema}},
        extra_body={"smc": {"method": "smc", "particles": 4, "draft_tokens": 4}},
    )  # fmt: skip
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert jsonschema_rs.validator_for(schema).is_valid(json.loads(choice.message.content))


def test_the_default_pair_stops_only_at_its_special_end_tokens(real_engine):
    """Qwen2.5's ``</s>`` (id 128247) is ordinary text: only ``<|endoftext|>`` (151643) and
    ``<|im_end|>`` (151645), both special, end an answer."""
    tok = real_engine.tokenizer
    assert real_engine.stop_ids == {151643, 151645}
    assert tok.convert_ids_to_tokens(128247) == "</s>" and 128247 not in real_engine.stop_ids
    assert all(tok.added_tokens_decoder[i].special for i in real_engine.stop_ids)


def test_choice_i_of_n_is_a_lone_request_with_seed_plus_i(real_server):
    """Issue 87's case on the real pair: ``n: 4``, seed 4242, temperature 2, one token, ar.
    Each choice i draws what a lone request with seed 4242 + i draws (choices 2 and 3 drew
    'Cha' and '_gem' where lone requests drew 'Thunder' and ' discredit' when chunked
    prefill cut prompts where the measured speed said)."""
    client = real_server.client(timeout=600)
    ask = dict(
        model=real_server.model,
        messages=[{"role": "user", "content": "Name a color."}],
        max_tokens=1,
        temperature=2,
        logprobs=True,
        extra_body={"smc": {"method": "ar"}},
    )
    together = client.chat.completions.create(n=4, seed=4242, **ask)
    for choice in together.choices:
        alone = client.chat.completions.create(seed=4242 + choice.index, **ask).choices[0]
        assert choice.message.content == alone.message.content, choice.index
        assert choice.logprobs.content[0].logprob == alone.logprobs.content[0].logprob
