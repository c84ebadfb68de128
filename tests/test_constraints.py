"""The llguidance-backed constraints on the tiny HF models (real byte-level BPE tokenizer)."""

from __future__ import annotations

import json
import re
import time

import pytest
import torch
from tiny_models import make_tiny_chat_pair, make_tiny_hf_model, make_tokenizer

from smcspec import (
    ConfigError,
    Engine,
    GenerationConfig,
    Grammar,
    JsonSchema,
    Regex,
    Reward,
)
from smcspec.backends.torch import load_hf_dir
from smcspec.cli import main
from smcspec.decoding.registry import decoder_for
from smcspec.potentials import reorder

V = 96
EOS = V - 1


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer(V)


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def test_regex_masks_eos_only_when_accepting(tok):
    c = Regex("ab+c").compile(tok, V, [EOS])
    s = c.start()
    m = s.allowed()
    assert m.dtype == torch.bool and m.shape == (V,)
    assert bool(m[0]) and not bool(m[EOS]) and not bool(m[1])  # 'a' yes, eos and 'b' no
    s.consume(_ids(tok, "ab"))
    assert not s.is_accepting() and not bool(s.allowed()[EOS])
    s.consume(_ids(tok, "c"))
    assert s.is_accepting()
    m = s.allowed()
    assert bool(m[EOS]) and int(m.sum()) == 1  # complete: only eos
    # copies are independent; rollback undoes tokens
    t = s.copy()
    s.rollback(1)
    assert not s.is_accepting() and t.is_accepting()
    assert bool(s.allowed()[2])  # 'c' again
    copies = reorder([s, t], torch.tensor([1, 1]))
    assert all(x.is_accepting() for x in copies) and copies[0] is not copies[1]


def test_json_whitespace_is_bounded_unless_the_schema_says_otherwise():
    """Masked decoding can fall into endless runs of spaces where JSON allows whitespace; the
    default bounds each run to 20 characters (as llama.cpp's JSON grammars), and a schema's
    own ``x-guidance`` options are used as given."""
    tok = make_tokenizer(V, extra='{}":, 0123456789')
    space = _ids(tok, " ")[0]
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}

    def spaces_after_key(spec: JsonSchema) -> int:
        s = spec.compile(tok, V, [EOS]).start()
        s.consume(_ids(tok, '{"n":'))
        run = 0
        while run < 50 and bool(s.allowed()[space]):
            s.consume([space])
            run += 1
        return run

    assert spaces_after_key(JsonSchema(schema)) == 20
    assert spaces_after_key(JsonSchema(json.dumps(schema))) == 20
    compact = {**schema, "x-guidance": {"whitespace_flexible": False}}
    assert spaces_after_key(JsonSchema(compact)) == 0
    pretty = JsonSchema(schema).compile(tok, V, [EOS]).start()
    pretty.consume(_ids(tok, '{  "n":  12 }'))  # whitespace runs up to the bound are fine
    assert pretty.is_accepting()


@pytest.mark.parametrize(
    "spec",
    [
        Regex("ab("),
        JsonSchema({"type": 3}),
        Grammar('start: "a" undefined_rule'),
    ],
    ids=["regex", "schema", "grammar"],
)
def test_invalid_specs_raise_config_error(tok, spec):
    with pytest.raises(ConfigError, match="invalid"):
        spec.compile(tok, V, [EOS])


def test_a_schema_string_that_is_not_json_raises_config_error():
    with pytest.raises(ConfigError, match="not JSON"):
        JsonSchema("{oops")
    with pytest.raises(ConfigError, match="not JSON"):  # json.loads: RecursionError
        JsonSchema('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")


def test_bad_types_raise_config_error():
    with pytest.raises(ConfigError):
        JsonSchema("{not json")
    with pytest.raises(ConfigError):
        GenerationConfig(constraint="ab+").validate()
    with pytest.raises(ConfigError):  # the decoder table's check: ar cannot reweight
        decoder_for(GenerationConfig(method="ar", reward=Reward(lambda t: [0.0] * len(t))))
    with pytest.raises(ConfigError, match="ignore_eos"):  # the constraint decides the end
        GenerationConfig(constraint=Regex("a+"), ignore_eos=True).validate()


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    dirs = make_tiny_chat_pair(tmp_path_factory.mktemp("constraints"))
    return Engine(load_hf_dir(dirs[0]), load_hf_dir(dirs[1]))


GRAMMAR = 'start: pair+ " d"\npair: "ab" | "cd"'


@pytest.mark.parametrize("method", ["ar", "sd", "smc"])
def test_engine_output_satisfies_regex_and_schema(engine, method):
    for seed in range(3):
        cfg = GenerationConfig(
            method=method, max_new_tokens=24, seed=seed, constraint=Regex("[a-d]{2,5}")
        )
        res = engine.generate("ab", cfg)
        assert re.fullmatch("[a-d]{2,5}", res.text), res.text
        assert res.finish_reason == "stop"
        # time in masks and matchers is reported, and is part of the request's wall time
        assert 0 < res.stats["constraint_seconds"] < res.seconds
    # a Lark grammar (the tiny vocabulary has only letters and a space: no JSON punctuation)
    cfg = GenerationConfig(
        method=method, max_new_tokens=24, seed=0, constraint=Grammar(GRAMMAR), temperature=0.7
    )
    res = engine.generate("ab", cfg)
    if res.finish_reason == "stop":
        assert re.fullmatch("(ab|cd)+ d", res.text), res.text
    else:  # cut by the budget: a prefix of the language
        assert re.fullmatch("(ab|cd)*[ac]?", res.text), res.text
    if method == "smc":
        assert "log_normalizer" in res.stats and "dead_particles" in res.stats


def test_engine_reward_and_mask_time(engine):
    def score(texts: list[str]) -> list[float]:
        return [float(t.count("a")) for t in texts]

    cfg = GenerationConfig(
        method="smc", max_new_tokens=8, seed=0, particles=8, reward=Reward(score, 1.0, score)
    )
    res = engine.generate("ab", cfg)
    assert "log_normalizer" in res.stats
    # cost of one mask on this 96-token vocabulary (reported in docs/constraints.md)
    s = Regex("[a-d]{2,50}").compile(engine.tokenizer, engine.vocab, [EOS]).start()
    t0 = time.perf_counter()
    for _ in range(200):
        s.allowed()
    assert (time.perf_counter() - t0) / 200 < 0.01


@pytest.fixture(scope="module")
def cli_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli-constraints")
    return [str(make_tiny_hf_model(root, "qwen2", seed=s)) for s in (0, 1)]


@pytest.mark.parametrize("method", ["ar", "smc"])
def test_cli_regex_and_grammar(cli_pair, tmp_path, capsys, method):
    base = ["generate", "ab", "--target", cli_pair[0], "--draft", cli_pair[1], "--no-chat"]
    base += ["--method", method, "-m", "12", "--seed", "1", "--json"]
    assert main([*base, "--regex", "[a-d]{2,5}"]) == 0
    assert re.fullmatch("[a-d]{2,5}", json.loads(capsys.readouterr().out)["text"])
    lark = tmp_path / "g.lark"
    lark.write_text(GRAMMAR)
    assert main([*base, "--grammar", str(lark)]) == 0
    assert re.fullmatch("(ab|cd)*[ac]?( d)?", json.loads(capsys.readouterr().out)["text"])


@pytest.mark.parametrize(
    "args",
    [["--regex", "ab("], ["--json-schema", "/nonexistent.json"], ["--grammar", "BAD"]],
    ids=["bad-regex", "missing-file", "bad-grammar"],
)
def test_cli_bad_constraint_is_one_line_error(cli_pair, tmp_path, capsys, args):
    if args[0] == "--grammar":
        bad = tmp_path / "bad.lark"
        bad.write_text('start: "a" undefined_rule')
        args = ["--grammar", str(bad)]
    argv = ["generate", "ab", "--target", cli_pair[0], "--method", "ar", "--no-chat"]
    assert main([*argv, *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err


def _many_objects(count: int) -> dict:
    """A schema of ``count`` alternative one-key objects (``anyOf``): llguidance's compile
    time grows with it (3,000: 0.5 s against the tiny vocabulary, 2-core CPU)."""
    return {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "integer"}},
                       "required": [f"k{i}"], "additionalProperties": False}
                      for i in range(count)]}  # fmt: skip


def test_cli_schema_past_the_compile_budget_is_one_line_error(
    cli_pair, tmp_path, capsys, monkeypatch
):
    """A schema that does not compile within the budget (here 0.05 s; the schema takes about
    0.5 s) ends the CLI with one ``error:`` line naming the limit, exit 2, not a wait.
    Before issue 87 there was no limit: it compiled and generated (exit 0)."""
    from smcspec.potentials import GrammarBudget

    monkeypatch.setattr("smcspec.engine.GrammarBudget", lambda: GrammarBudget(compile_s=0.05))
    schema = tmp_path / "heavy.json"
    schema.write_text(json.dumps(_many_objects(3000)))
    argv = ["generate", "ab", "--target", cli_pair[0], "--method", "ar", "--no-chat", "-m", "4"]
    assert main([*argv, "--json-schema", str(schema)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err and "compile_s" in err, err


class _SlowMatcher:
    """An llguidance matcher stand-in whose masks take ``seconds``."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def is_error(self) -> bool:
        return False

    def compute_bitmask(self) -> bytes:
        time.sleep(self.seconds)
        return b"\xff" * 12


def test_a_mask_past_its_budget_raises_naming_the_limit():
    """One mask slower than ``mask_s`` (0.2 s against 0.02 s) is a GrammarBudgetError (a
    ConfigError: HTTP 400, CLI exit 2) naming ``mask_s``; one within it gives the mask."""
    from smcspec.potentials import GrammarBudgetError, LLGuidanceState

    with pytest.raises(GrammarBudgetError, match="mask_s"):
        LLGuidanceState(_SlowMatcher(0.2), V, mask_s=0.02).allowed()
    assert LLGuidanceState(_SlowMatcher(0.0), V, mask_s=1.0).allowed().all()
