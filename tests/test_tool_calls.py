"""Tool calls: the constraint's language, reading calls back, and SMC-SD's calls on a tiny
enumerable model (:mod:`smcspec.tool_calls`).

The tiny vocabulary has ``<tool_call>`` / ``</tool_call>`` as added tokens (as Qwen2.5's
does) and the JSON punctuation, so every call the grammar allows for two small tools can be
enumerated token by token: the grammar's language is compared with the texts built
independently from the tools, and SMC-SD's calls with the exact conditional.
"""

from __future__ import annotations

import copy
import json
import math
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import build_tiny_hf_model, make_tokenizer

from smcspec import ConfigError, Engine, GenerationConfig
from smcspec.backends.torch import load_hf_dir
from smcspec.potentials import MAX_SCHEMA_DEPTH, JsonSchema, json_depth
from smcspec.tool_calls import (
    ArgumentsDelta,
    CallStart,
    ContentDelta,
    FunctionTool,
    ToolCallParser,
    ToolCalls,
    parse_tool_calls,
)
from smcspec.tool_calls.spec import FENCE_CLOSE, FENCE_OPEN

V = 64  # model vocabulary: the BPE tokens (eos at 61) and the two call markers (62, 63)
EOS = 61
PROMPT = [0, 1, 2]
F = FunctionTool(
    "f",
    parameters={
        "type": "object",
        "properties": {"a": {"enum": ["x", "y"]}},
        "required": ["a"],
        "additionalProperties": False,
    },
)
G = FunctionTool("g", parameters={"type": "object", "additionalProperties": False})
H = FunctionTool("h", parameters=F.parameters)  # same calls as f's, another name


def call_text(name: str, args: dict) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'


CALLS = [call_text("f", {"a": "x"}), call_text("f", {"a": "y"}), call_text("g", {})]


@pytest.fixture(scope="module")
def tok():
    tok = make_tokenizer(V - 2, extra='{}":,_\u010a')  # \u010a: "\n" in the byte alphabet
    tok.add_tokens(["<tool_call>", "</tool_call>"])
    assert tok.convert_tokens_to_ids(["<tool_call>", "</tool_call>"]) == [62, 63]
    return tok


def accepted(
    constraint, tok, max_calls: int = 1, limit: int = 70
) -> dict[tuple[int, ...], list[torch.Tensor]]:
    """Every token sequence with at most ``max_calls`` calls that the constraint accepts
    (ending at eos, eos not included), with the mask before each of its tokens (eos's
    last), by depth-first search over the masks."""
    out: dict[tuple[int, ...], list[torch.Tensor]] = {}

    def walk(state, seq, masks):
        mask = state.allowed()
        for t in torch.nonzero(mask).flatten().tolist():
            if t == EOS:
                out[tuple(seq)] = masks + [mask]
                continue
            if t == 62 and seq.count(62) == max_calls:
                continue  # a further call: beyond what is enumerated
            assert len(seq) < limit * max_calls, "the language is not finite"
            nxt = state.copy()
            nxt.consume([t])
            walk(nxt, seq + [t], masks + [mask])

    walk(constraint.compile(tok, V, [EOS]).start(), [], [])
    return out


def texts(seqs, tok) -> set[str]:
    return {tok.decode(list(s)) for s in seqs}


# ----------------------------------------------------------------------------- the language
@pytest.mark.parametrize(
    "choice, parallel, expected",
    [
        ("required", False, set(CALLS)),
        ("f", True, set(CALLS[:2])),  # a named function: one call of it, even if parallel
        ("g", False, {CALLS[2]}),
        ("required", True, {a + "\n" + b for a in CALLS for b in CALLS} | set(CALLS)),
    ],
)
def test_the_grammar_accepts_exactly_the_valid_calls(tok, choice, parallel, expected):
    seqs = accepted(ToolCalls((F, G), choice, parallel), tok, max_calls=2)
    found = texts(seqs, tok)
    # calls may end with one newline (the model writes "</tool_call>\n" before its end token)
    assert {t.removesuffix("\n") for t in found} == expected
    assert {t for t in found if t.endswith("\n")}  # that newline is allowed
    for text in found:
        content, calls = parse_tool_calls(text)
        assert content is None and all(c.complete for c in calls)
        assert all(c.name == choice for c in calls) if choice in "fg" else True
        assert all(json.loads(c.arguments) in ({"a": "x"}, {"a": "y"}, {}) for c in calls)


def test_none_and_auto(tok):
    # none: text only, the markers (special tokens) never allowed
    state = ToolCalls((F, G), "none").compile(tok, V, [EOS]).start()
    mask = state.allowed()
    assert not mask[62] and not mask[63] and mask[0] and not mask[EOS]
    # auto: text, or text then calls; once <tool_call> is written the call must be valid
    state = ToolCalls((F, G), "auto").compile(tok, V, [EOS]).start()
    state.consume(tok.encode("ab ", add_special_tokens=False) + [62])
    later = accepted_from(state, tok)
    assert texts(later, tok) - {t[len("<tool_call>") :] for t in CALLS} <= {
        t[len("<tool_call>") :] + "\n" for t in CALLS
    }


def test_auto_reads_a_json_block_opening_the_reply_as_a_call():
    """The default pair writes calls as a Markdown json block: under auto such a block must
    be a valid call (name offered, arguments valid, bounded whitespace); other text is free,
    and so is a json block later in the reply."""
    tok = make_tokenizer(V - 2, extra='{}":,_\u010a`')
    tok.add_tokens(["<tool_call>", "</tool_call>"])
    c = ToolCalls((F, G), "auto").compile(tok, V, [tok.convert_tokens_to_ids("<|im_end|>")])

    def ok(text: str) -> bool:
        state = c.start()
        try:
            state.consume(tok.encode(text, add_special_tokens=False))
        except Exception:
            return False
        return state.is_accepting()

    good = '```json\n{\n  "name": "f",\n  "arguments": {\n    "a": "y"\n  }\n}\n```'
    assert ok(good) and ok('```json\n{"name": "g", "arguments": {}}\n```')
    assert not ok(good.replace('"f"', '"h"'))  # not an offered function
    assert not ok(good.replace('"y"', '"z"'))  # arguments outside the schema
    assert not ok('```json\n{"a": 1}\n```')  # a json block opening the reply is a call
    assert ok('see ```json\n{"a": 1}\n```') and ok("```py\nx\n```")
    content, calls = parse_tool_calls(good)
    assert content is None and len(calls) == 1 and calls[0].complete
    assert (calls[0].name, calls[0].arguments) == ("f", '{"a": "y"}')  # json.dumps form
    # a reply opening with "{" is a bare call: valid, and then the reply ends
    bare = '{"name": "f", "arguments": {"a": "x"}}'
    assert ok(bare) and ok('{\n  "name": "g",\n  "arguments": {}\n}')
    assert not ok('{{"name": "f", "arguments": {"a": "x"}}}')  # doubled braces: no JSON
    assert not ok('{"a": 1}') and not ok(bare + " and text")
    assert ok('see {"a": 1}') and ok(' {"a": 1}')  # not opening the reply: text
    assert parse_tool_calls(bare)[0] is None
    assert [(c.name, c.arguments) for c in parse_tool_calls(bare)[1]] == [("f", '{"a": "x"}')]


def accepted_from(state, tok):
    out = {}

    def walk(s, seq):
        for t in torch.nonzero(s.allowed()).flatten().tolist():
            if t == EOS:
                out[tuple(seq)] = True
            elif len(seq) < 60:
                n = s.copy()
                n.consume([t])
                walk(n, seq + [t])

    walk(state, [])
    return out


@pytest.mark.parametrize(
    "tools, choice, match",
    [
        ((), "auto", "at least one tool"),
        ((F, F), "auto", "unique"),
        ((F,), "h", "neither"),
    ],
)
def test_bad_tool_sets_are_refused(tools, choice, match):
    with pytest.raises(ConfigError, match=match):
        ToolCalls(tools, choice)


@pytest.mark.parametrize(
    "tool, match",
    [
        ({"type": "function", "function": {"name": "a b"}}, "letters, digits"),
        (
            {"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}},
            "object",
        ),
        ({"type": "function", "function": {"name": "f", "parameters": []}}, "JSON schema"),
        ({"type": "code_interpreter"}, "type"),
        ({"type": "function"}, "name"),
    ],
)
def test_bad_tools_are_refused(tool, match):
    with pytest.raises(ConfigError, match=match):
        FunctionTool.from_openai(tool)


def test_a_schema_llguidance_cannot_compile_is_a_config_error(tok):
    bad = FunctionTool("f", parameters={"type": "object", "properties": {"a": {"type": "nope"}}})
    with pytest.raises(ConfigError, match="invalid"):
        ToolCalls((bad,), "required").compile(tok, V, [EOS])


def test_a_vocabulary_without_call_tokens_is_refused():
    with pytest.raises(ConfigError, match="no <tool_call> token"):
        ToolCalls((F,), "required").compile(make_tokenizer(V), V, [EOS])


# ----------------------------------------------------------------------------- each tool's root
NODE = {
    "type": "object",
    "properties": {"next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}},
    "required": ["next"],
    "additionalProperties": False,
}
WALK = FunctionTool("walk", parameters={
    "$defs": {"node": NODE}, "type": "object", "properties": {"head": {"$ref": "#/$defs/node"}},
    "required": ["head"], "additionalProperties": False,
})  # fmt: skip
TREE = FunctionTool(  # "#" is the tool's own root: a kid is another tree
    "tree", parameters={"type": "object", "properties": {"kid": {"$ref": "#"}},
                        "additionalProperties": False},
)  # fmt: skip
OLD = FunctionTool("old", parameters={  # draft-07 "definitions"
    "definitions": {"n": {"type": "object", "properties": {"n": {"$ref": "#/definitions/n"}},
                          "additionalProperties": False}},
    "type": "object", "properties": {"x": {"$ref": "#/definitions/n"}},
    "additionalProperties": False,
})  # fmt: skip
# (tool, arguments valid under the tool's own schema, arguments that are not)
ROOTED = [
    (WALK, {"head": {"next": {"next": None}}}, {"head": {"next": {}}}),
    # with "#" read as the root of the fenced call's schema, a kid could be a whole call
    (TREE, {"kid": {"kid": {}}}, {"kid": {"name": "tree", "arguments": {}}}),
    (OLD, {"x": {"n": {"n": {}}}}, {"x": {"m": {}}}),
]


def _call_forms(name: str, args: dict, choice: str) -> list[str]:
    """The texts of one call that ``choice`` allows: the <tool_call> form, and under auto
    also the fenced json block and the bare object."""
    forms = [call_text(name, args)]
    if choice == "auto":
        body = json.dumps({"name": name, "arguments": args})
        forms += [FENCE_OPEN + body + FENCE_CLOSE, body]
    return forms


@pytest.fixture(scope="module")
def fence_tok():
    tok = make_tokenizer(V - 2, extra='{}":,_\u010a`')
    tok.add_tokens(["<tool_call>", "</tool_call>"])
    return tok


def _accepts(constraint, tok, text: str) -> bool:
    state = constraint.start()
    try:
        state.consume(tok.encode(text, add_special_tokens=False))
    except Exception:
        return False
    return state.is_accepting()


@pytest.mark.parametrize("choice", ["auto", "required", "named"])
@pytest.mark.parametrize("tool, good, bad", ROOTED, ids=[t.name for t, _, _ in ROOTED])
def test_each_tools_refs_resolve_against_its_own_root(fence_tok, choice, tool, good, bad):
    """A tool's ``$ref``s (``#/$defs/...``, ``#`` itself, ``#/definitions/...``) mean what
    they mean in its schema alone, under every tool_choice and in every call form. Under
    auto the fenced form nests the arguments' schema under ``properties.arguments`` of the
    call's: before each tool became a resource of its own (``$id``), ``#/$defs/node`` was a
    ConfigError "Pointer '/$defs/node' does not exist" and ``#`` silently meant the call
    (broken variant: ``own_root`` returning the schema unchanged)."""
    picked = tool.name if choice == "named" else choice
    c = ToolCalls((tool, G), picked).compile(fence_tok, V, [EOS])
    for text in _call_forms(tool.name, good, choice):
        assert _accepts(c, fence_tok, text), text
    for text in _call_forms(tool.name, bad, choice):
        assert not _accepts(c, fence_tok, text), text


def test_tools_that_share_an_id_keep_their_own_roots(fence_tok):
    """Two tools whose schemas carry the same ``$id`` (and one that names it in a ref): in
    one fenced schema the later would answer both (broken variant: keeping the tools' own
    ``$id``)."""
    same = "https://example.com/args"
    tree = FunctionTool("tree", parameters={**TREE.parameters, "$id": same})
    old = dict(
        OLD.parameters, **{"$id": same, "properties": {"x": {"$ref": same + "#/definitions/n"}}}
    )
    c = ToolCalls((tree, FunctionTool("old", parameters=old)), "auto").compile(fence_tok, V, [EOS])
    for tool, good, bad in ROOTED[1:]:
        for text in _call_forms(tool.name, good, "auto"):
            assert _accepts(c, fence_tok, text), text
        for text in _call_forms(tool.name, bad, "auto"):
            assert not _accepts(c, fence_tok, text), text


def _nested_parameters(depth: int) -> dict:
    """Tool parameters nested exactly ``depth`` JSON levels deep (arrays of arrays)."""
    inner: dict = {"type": "integer"}
    while json_depth({"type": "object", "properties": {"a": inner}}, depth) < depth:
        inner = {"type": "array", "items": inner}
    return {"type": "object", "properties": {"a": inner}}


def test_schemas_nested_past_what_the_compiler_takes_are_refused_before_compiling(fence_tok):
    """The deepest schema allowed (:data:`MAX_SCHEMA_DEPTH` levels) compiles under every
    tool_choice and as a response format; one level more is a ConfigError when the tool or
    the schema is made, before anything recurses over it (a ~950-deep one was a
    RecursionError: a 500 in the server). Broken variant: no depth check."""
    deepest = _nested_parameters(MAX_SCHEMA_DEPTH)
    assert json_depth(deepest, 10**6) == MAX_SCHEMA_DEPTH
    tool = FunctionTool("f", parameters=deepest)
    for choice in ("auto", "required", "f"):
        ToolCalls((tool, G), choice).compile(fence_tok, V, [EOS])
    JsonSchema(deepest).compile(fence_tok, V, [EOS])
    for depth in (MAX_SCHEMA_DEPTH + 1, 2000):
        too_deep = _nested_parameters(depth)
        with pytest.raises(ConfigError, match="nested deeper than"):
            FunctionTool("f", parameters=too_deep)
        with pytest.raises(ConfigError, match="nested deeper than"):
            JsonSchema(too_deep)


# ----------------------------------------------------------------------------- reading back
REPLIES = [
    "Plain text, no call.",
    "Let me look.\n" + CALLS[0],
    CALLS[0] + "\n" + CALLS[2] + "\n",
    CALLS[1][:-5],  # cut inside the closing marker: arguments kept, call incomplete
    CALLS[0] + '\n<tool_call>\n{"na',  # a second call cut before its name: dropped
    "",
    "a < b and <tool_ or ```json {}``` are text",
    '```json\n{\n  "name": "f",\n  "arguments": {"a": "x"}\n}\n```',  # auto's other form
    '```json\n{"b": 1}\n```\nthen text',  # a json block that is no call: text
    '```json\n{"name": "f", "argu',  # a json block cut short: text
    '{"name": "f", "arguments": {"a": "x"}}',  # auto's bare form
    '{"name": "f", "argu',  # cut short: text
    '{"b": 1} is no call',  # (not from the grammar) text
]


@settings(max_examples=200, deadline=None)
@given(reply=st.sampled_from(REPLIES), cuts=st.lists(st.integers(0, 200), max_size=12))
def test_streamed_parsing_equals_whole_parsing(reply, cuts):
    whole_content, whole_calls = parse_tool_calls(reply)
    parser = ToolCallParser()
    events = []
    bounds = sorted({min(c, len(reply)) for c in cuts})
    for a, b in zip([0, *bounds], [*bounds, len(reply)], strict=True):
        events += parser.feed(reply[a:b])
    events += parser.finish()
    assert parser.content == whole_content
    assert [(c.name, c.arguments, c.complete) for c in parser.calls] == [
        (c.name, c.arguments, c.complete) for c in whole_calls
    ]
    # the events rebuild the reply: content, then per call its start and argument pieces
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    assert (content or None) == (whole_content if whole_content is not None else None) or (
        whole_content is None and not content.strip()
    )
    starts = [e for e in events if isinstance(e, CallStart)]
    assert [s.call.name for s in starts] == [c.name for c in whole_calls]
    for i, c in enumerate(whole_calls):
        args = "".join(e.text for e in events if isinstance(e, ArgumentsDelta) and e.index == i)
        assert args == c.arguments


def test_reading_back_examples():
    assert parse_tool_calls("Plain text") == ("Plain text", [])
    content, calls = parse_tool_calls("Let me look.\n" + CALLS[0])
    assert content == "Let me look." and [c.name for c in calls] == ["f"]
    assert calls[0].arguments == '{"a": "x"}' and calls[0].complete
    content, calls = parse_tool_calls(CALLS[0] + "\n" + CALLS[2] + "\n")
    assert content is None and [(c.name, c.arguments) for c in calls] == [
        ("f", '{"a": "x"}'),
        ("g", "{}"),
    ]
    assert calls[0].id != calls[1].id and calls[0].id.startswith("call_")
    _, calls = parse_tool_calls(CALLS[1][:-5])
    assert not calls[0].complete
    _, calls = parse_tool_calls(CALLS[0] + '\n<tool_call>\n{"na')
    assert len(calls) == 1
    assert parse_tool_calls('```json\n{"b": 1}\n```') == ('```json\n{"b": 1}\n```', [])
    assert parse_tool_calls('```json\n{"name": "f"') == ('```json\n{"name": "f"', [])
    assert parse_tool_calls('{"name": "f"') == ('{"name": "f"', [])
    assert parse_tool_calls('{"b": 1}') == ('{"b": 1}', [])
    deep = '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"  # deeper than json.loads recurses
    assert parse_tool_calls(deep) == (deep, [])
    content, calls = parse_tool_calls('{"name": "g", "arguments": {}}\n')
    assert content is None and [(c.name, c.arguments, c.complete) for c in calls] == [
        ("g", "{}", True)
    ]


# ----------------------------------------------------------------------------- SMC-SD
TARGET_SEED = 13  # chosen (seeds 12-39 scanned) for a large local-masking bias, below


@pytest.fixture(scope="module")
def engine(tmp_path_factory, tok):
    """Target: a tiny qwen2 (seed 13); draft: the target with 10% Gaussian noise on every
    weight (a good draft, as a real pair's is). Returns (engine, transformers target)."""
    target = build_tiny_hf_model("qwen2", vocab_size=V, seed=TARGET_SEED)
    draft = copy.deepcopy(target)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.1 * p.std() * torch.randn(p.shape, generator=g) if p.numel() > 1 else 0)
    dirs = []
    for name, model in (("target", target), ("draft", draft)):
        d = tmp_path_factory.mktemp(f"tools-{name}")
        model.save_pretrained(str(d))
        tok.save_pretrained(str(d))
        dirs.append(d)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield Engine(load_hf_dir(dirs[0]), load_hf_dir(dirs[1])), target
    torch.set_num_threads(threads)


def exact_distributions(hf_target, tok, constraint):
    """Exact conditional ``p_T(call | valid)`` and locally-masked distribution (what masked
    AR samples) over the call texts (a trailing newline folded in), from the target's
    teacher-forced log-probs at T=1 (the transformers model the torch backend is checked
    against), summed over every tokenization the constraint allows."""
    cond, local, fulls = Counter(), Counter(), []
    for seq, masks in accepted(constraint, tok).items():
        ids = torch.tensor([PROMPT + list(seq) + [EOS]])
        with torch.no_grad():
            logits = hf_target(ids).logits[0]
        lp = torch.log_softmax(logits.double(), -1)[len(PROMPT) - 1 : -1]
        toks = list(seq) + [EOS]
        full = sum(float(lp[i, t]) for i, t in enumerate(toks))
        masked = sum(
            float(lp[i, t] - torch.logsumexp(lp[i][m], 0))
            for i, (t, m) in enumerate(zip(toks, masks, strict=True))
        )
        key = tok.decode(list(seq)).removesuffix("\n")
        fulls.append((key, full))
        local[key] += math.exp(masked)
    top = max(f for _, f in fulls)
    for key, full in fulls:
        cond[key] += math.exp(full - top)
    total = sum(cond.values())
    return {k: v / total for k, v in cond.items()}, dict(local)


def _tv(p: dict, counts: Counter, runs: int) -> float:
    keys = set(p) | set(counts)
    return 0.5 * sum(abs(p.get(k, 0.0) - counts.get(k, 0) / runs) for k in keys)


def _tv_upper_bound(p: dict, counts: Counter, runs: int, delta: float = 1e-3) -> float:
    """An upper confidence bound (level ``1 - delta``) on the TV between ``p`` (a
    distribution that is nearly a point mass) and the one that drew ``counts``: with ``m``
    ``p``'s mode, ``TV <= max(1 - P(m), 1 - p(m))``, and ``1 - P(m)`` is bounded by the
    one-sided Clopper-Pearson bound of the runs that missed ``m``."""
    from scipy.stats import beta

    mode = max(p, key=p.get)
    misses = runs - counts.get(mode, 0)
    miss = 1.0 if misses == runs else float(beta.ppf(1 - delta, misses + 1, runs - misses))
    return max(miss, 1 - p[mode])


@pytest.mark.slow
def test_smc_calls_approach_the_conditional(engine, tok):
    """Two tools with the same arguments: which call the target prefers shows only tokens
    after the choice, so locally-masked decoding (masked AR, SMC with one particle) keeps
    a fixed bias and SMC-SD with 16 particles removes it. SMC-SD's runs stop at 75 if the
    TV is then below 0.1 with confidence 1 - 1e-3 (every run so far called f(x): the
    bound is 0.088); a sampler that kept the bias misses f(x) about every other run, so it
    runs the 150 and fails the bound on the estimate."""
    engine, hf_target = engine
    constraint = ToolCalls((F, H), "required", parallel=False)
    cond, local = exact_distributions(hf_target, tok, constraint)
    assert set(cond) == {call_text(n, {"a": a}) for n in "fh" for a in "xy"}
    bias = 0.5 * sum(abs(cond[k] - local[k]) for k in cond)
    assert bias > 0.45  # exact: 0.518 (conditional ~1 on f(x); local 0.48 f(x), 0.52 f(y))
    runs, tv = 150, {}
    # SMC-SD with one particle runs 75: it drew masked AR's calls run for run here (TV 0.427
    # at 75 runs, 0.433 at 150), against a bound of 0.3
    for name, method, n, most in (("ar", "ar", 1, runs), ("smc1", "smc", 1, 75),
                                  ("smc16", "smc", 16, runs)):  # fmt: skip
        counts: Counter = Counter()
        for i in range(most):
            cfg = GenerationConfig(
                method=method, particles=n, draft_tokens=2, temperature=1.0,
                draft_temperature=1.0, max_new_tokens=60, seed=i, constraint=constraint,
            )  # fmt: skip
            out = engine.generate(PROMPT, cfg)
            _, calls = parse_tool_calls(out.text)
            assert len(calls) == 1 and calls[0].complete  # every call valid, every method
            assert out.finish_reason == "stop"
            counts[out.text.removesuffix("\n")] += 1
            if n == 16 and i + 1 == 75 and _tv_upper_bound(cond, counts, 75) < 0.1:
                break  # decided
        tv[name] = _tv(cond, counts, i + 1)
        if method == "ar":  # masked AR samples the local distribution (noise ~0.04 here)
            assert _tv(local, counts, runs) < 0.1
    # measured (seeds 0-149): ar 0.43 (0.085 from the local distribution), smc N=1 0.43
    # (seeds 0-74), N=16 0.00003 (seeds 0-74); binomial noise at 150 runs is about 0.04, so
    # the locally-masked methods sit at the bias and N=16 at zero
    assert tv["ar"] > 0.3 and tv["smc1"] > 0.3
    assert tv["smc16"] < 0.1
