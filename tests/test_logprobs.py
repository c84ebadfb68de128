"""Token log-probabilities (``GenerationConfig.logprobs``) against the target recomputed.

On tiny random models the values a request returns for its tokens are recomputed with
Hugging Face ``transformers`` (an implementation of its own) over the prompt and the returned
tokens in one forward, then tempered, truncated and masked here by hand: every method (ar,
chain, n-gram and multi-draft sd, SMC-SD with both round ends and both finished-particle
rules) must give ``log p~(token)`` of the distribution each position samples from, and its
most likely alternatives; greedy requests the untempered values with the emitted token
first; ``raw_logprobs`` the model's own ``log_softmax``; a prompt's values (echo) the model's.
Tolerances: torch float32 1e-4 (measured 7e-5 at most); llama.cpp, whose kernels differ from
transformers', 5e-2 times the value's size (at least 1): its logits differ from transformers'
by a few hundredths on these models (0.056 measured at a value of -16.8).
"""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch
from tiny_models import make_tiny_gguf, make_tiny_hf_model

from smcspec import Engine, GenerationConfig
from smcspec.backends.torch import load_hf_dir
from smcspec.decoding.program import ALL_LOGITS_CHUNK, Round, execute, run_program
from smcspec.scheduler import BatchScheduler, Request

PROMPT = "ab cd ef gh"
TOL = 1e-4
LLAMA_TOL = 5e-2
METHODS = {  # name: the config's method settings
    "ar": {"method": "ar"},
    "sd": {"method": "sd"},
    "ngram-sd": {"method": "sd", "draft": "ngram", "draft_p_min": 0.0},
    "multi-sd": {"method": "sd", "particles": 3},
    "smc": {"method": "smc"},
    "smc-ess": {"method": "smc", "round_end": "ess", "particles": 6},
    "smc-keep": {"method": "smc", "finished_particles": "keep", "particles": 6},
}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("logprobs")
    return [make_tiny_hf_model(root, "qwen2", seed=s) for s in (0, 1)]


@pytest.fixture(scope="module")
def engine(dirs):
    return Engine(load_hf_dir(dirs[0]), load_hf_dir(dirs[1]))


@pytest.fixture(scope="module")
def hf(dirs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(dirs[0])).eval()


def model_logits(hf, ids: list[int]) -> torch.Tensor:
    """float32 ``[len(ids), V]``: transformers' logits at every position of ``ids``."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def expected(hf, prompt: list[int], tokens: list[int], cfg: GenerationConfig,
             banned: dict[int, list[int]] | None = None) -> torch.Tensor:  # fmt: skip
    """``[len(tokens), V]``: the distribution each returned token was sampled from, by hand:
    ``log_softmax(logits / T)`` (T = 1 when greedy or raw), the top-k kept and renormalised,
    ``banned[j]``'s tokens masked out at position ``j``."""
    rows = model_logits(hf, prompt + tokens)[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
    if cfg.logprobs_mode == "raw_logprobs":
        return torch.log_softmax(rows, -1)
    t = cfg.temperature if cfg.temperature > 0 else 1.0
    lp = torch.log_softmax(rows / t, -1)
    if cfg.top_k > 0:
        kth = lp.topk(cfg.top_k, -1).values[:, -1:]
        lp = torch.log_softmax(lp.masked_fill(lp < kth, -torch.inf), -1)
    for j, ids in (banned or {}).items():
        if j < len(lp):
            row = lp[j].clone()
            row[ids] = -torch.inf
            lp[j] = torch.log_softmax(row, -1)
    return lp


def check_against(lps, want: torch.Tensor, tol: float, relative: bool = False) -> None:
    """The returned values of each token and of its alternatives equal ``want``'s (``[n,
    V]``) within ``tol`` (``relative``: ``tol * max(1, |want|)``, for llama.cpp, whose
    logits differ by a few hundredths: a value far in the tail, say -16, moves by more); the
    alternatives are the most likely under ``want`` (ties: any of them)."""

    def close(a: torch.Tensor, b: torch.Tensor) -> bool:
        bound = tol * (b.abs().clamp(min=1.0) if relative else torch.ones_like(b))
        return bool(((a - b).abs() <= bound).all())

    toks = torch.tensor(lps.token_ids)
    got = torch.tensor(lps.logprobs)
    ref = want.gather(-1, toks[:, None])[:, 0]
    assert torch.isfinite(ref).all() and torch.isfinite(got).all()
    assert close(got, ref), (got - ref).abs().max()
    for j, (ids, vals) in enumerate(zip(lps.top_ids, lps.top_logprobs, strict=True)):
        k = len(ids)
        vals_t = torch.tensor(vals)
        assert close(vals_t, want[j, ids]), (j, vals_t, want[j, ids])  # each one's own value
        assert close(vals_t, want[j].topk(k).values)  # and they are the k most likely


def run(engine, method: str, seed: int, **kw):
    base = {"max_new_tokens": 16, "temperature": 0.8, "draft_tokens": 3, "logprobs": 4}
    cfg = GenerationConfig(seed=seed, **{**base, **METHODS[method], **kw})
    return engine.generate(PROMPT, cfg, chat=False), cfg


@pytest.mark.parametrize("method", list(METHODS))
def test_each_tokens_logprob_is_the_targets_at_its_position(engine, hf, method):
    """ar, sd (chain, n-gram, multi-draft) and SMC-SD (both round ends, the keep rule):
    each token's value and its 4 alternatives equal the processed target's (T 0.8) at that
    position, over 3 seeds; with top-k 40 too (sd: the target's kept set; SMC-SD's tokens
    are drafted from the untruncated draft, whose particles outside the kept set have weight
    zero, so its values are checked without truncation). Broken variants caught: sd reading
    every token's value at the block's first row (``rows = [0] * (n + 1)`` in
    ``verify_block``): 0.99 off (chain), 0.79 (n-gram); at the next row (``slice(1, n + 2)``):
    a shape error; SMC-SD's values not reordered at resampling and banking
    (``ParticleLogprobs.reorder`` a no-op): 38 off with round_end "ess", 47 with the keep rule
    (plain smc's seeds here never move a particle whose values differ)."""
    prompt = engine.encode(PROMPT, chat=False)
    truncations = [{}] if method.startswith("smc") else [{}, {"top_k": 40}]
    for kw in truncations:
        for seed in (1, 2, 3):
            r, cfg = run(engine, method, seed, **kw)
            assert r.logprobs is not None and r.logprobs.token_ids == r.token_ids
            check_against(r.logprobs, expected(hf, prompt, r.token_ids, cfg), TOL)


@pytest.mark.parametrize("method", ["ar", "sd", "smc"])
def test_greedy_top_logprob_is_the_emitted_token(engine, hf, method):
    """Temperature 0 (smc runs as greedy sd): the first alternative is the token, and the
    values are the untempered ``log_softmax``'s, as vLLM reports them. Broken variant caught:
    ar reporting the point mass it draws from (the token's value 0): 0.83 off."""
    prompt = engine.encode(PROMPT, chat=False)
    r, cfg = run(engine, method, 5, temperature=0.0)
    assert [ids[0] for ids in r.logprobs.top_ids] == r.token_ids
    check_against(r.logprobs, expected(hf, prompt, r.token_ids, cfg), TOL)


@pytest.mark.parametrize("method", ["ar", "sd", "smc"])
def test_raw_logprobs_are_the_models_log_softmax(engine, hf, method):
    """``logprobs_mode="raw_logprobs"`` at T 0.5 with top-k 20: the model's ``log_softmax``
    at T 1 before any filter. Broken variant caught: the mode ignored by ``logprob_tensors``
    (the processed values: 0.75 off for ar)."""
    prompt = engine.encode(PROMPT, chat=False)
    r, cfg = run(engine, method, 4, temperature=0.5, top_k=20, logprobs_mode="raw_logprobs")
    check_against(r.logprobs, expected(hf, prompt, r.token_ids, cfg), TOL)


@pytest.mark.parametrize("method", ["ar", "sd", "smc"])
def test_min_tokens_masks_the_stop_tokens_and_logprobs_say_so(engine, hf, method):
    """``min_tokens=8`` with the greedy first token made a stop token: no stop token before
    the 8th position (without ``min_tokens`` the answer is that one token), and the values at
    those positions are the target's with the stop tokens masked out and renormalised.
    Broken variants caught: min_tokens not applied (``Engine._potentials`` without the
    MinTokens constraint: every answer is its first token); ar reporting the values before
    the mask (the stop tokens among the alternatives): 3.3 off."""
    prompt = engine.encode(PROMPT, chat=False)
    first = int(model_logits(hf, prompt)[-1].argmax())
    stops = (first,)
    plain, _ = run(engine, method, 1, temperature=0.0, stop_token_ids=stops)
    assert plain.token_ids == [first]
    for seed in (1, 2):
        r, cfg = run(engine, method, seed, stop_token_ids=stops, min_tokens=8)
        assert len(r.token_ids) >= 8
        assert not set(r.token_ids[:7]) & {first, *engine.stop_ids}
        banned = {j: [first, *engine.stop_ids] for j in range(7)}
        check_against(r.logprobs, expected(hf, prompt, r.token_ids, cfg, banned), TOL)


def test_streamed_logprobs_are_the_answers(engine):
    """What ``on_logprobs`` streams token by token is the answer's own values (SMC-SD
    streams a token once every particle holds it, from the first particle; the answer's come
    from the particle drawn), and each comes just before its token."""
    for method in ("ar", "sd", "smc"):
        cfg = GenerationConfig(
            **METHODS[method], seed=3, max_new_tokens=16, logprobs=2, draft_tokens=3
        )
        job = engine.prepare(PROMPT, cfg, chat=False)
        events: list = []
        record = events.append
        program = engine.program(replace(
            job, on_tokens=lambda ids, f=record: f(("tok", ids)),
            on_logprobs=lambda e, f=record: f(("lp", e)),
        ))  # fmt: skip
        out = run_program(program)
        kinds = [k for k, _ in events]
        assert kinds == ["lp", "tok"] * len(out.tokens)
        streamed = [e for k, e in events if k == "lp"]
        assert [e.token_ids[0] for e in streamed] == out.tokens
        got = torch.tensor([e.logprobs[0] for e in streamed])
        assert (got - torch.tensor(out.logprobs.logprobs)).abs().max() < 1e-5


def test_a_request_without_logprobs_computes_none(engine):
    """The default path costs nothing: no values are computed or returned."""
    r = engine.generate(PROMPT, GenerationConfig(method="smc", seed=1), chat=False)
    assert r.logprobs is None and r.prompt_logprobs is None


def test_logprobs_requests_run_step_by_step_where_rounds_are_fused(dirs):
    """On a torch model whose rounds run fused (``round_mode`` eager, static caches), a
    request asking for logprobs falls back to the step path (no ``Round`` is yielded) and
    draws the same tokens as the fused path does without them. Broken variant caught:
    ``plain`` ignoring ``cfg.logprobs`` (a Round is yielded)."""
    target, draft = load_hf_dir(dirs[0]), load_hf_dir(dirs[1])
    eng = Engine(target, draft)
    for m in (target.model, draft.model):
        m.rounds = "eager"
    for method in ("ar", "sd", "smc"):
        base = dict(**METHODS[method], seed=2, max_new_tokens=12, draft_tokens=3, ignore_eos=True)
        fused_tokens, kinds = [], set()
        for logprobs in (None, 3):
            job = eng.prepare(PROMPT, GenerationConfig(**base, logprobs=logprobs), chat=False)
            program = eng.program(job)
            try:
                step, seen = next(program), set()
                while True:
                    seen.add(type(step))
                    step = program.send(execute(step))
            except StopIteration as done:
                out = done.value
            kinds = seen
            if logprobs is None:
                assert Round in kinds, method  # the fused path ran
                fused_tokens = out.tokens
            else:
                assert Round not in kinds, method
                assert out.tokens == fused_tokens and len(out.logprobs) == len(out.tokens)


def test_prompt_logprobs_are_the_models(engine, hf):
    """``prompt_logprobs`` (echo): prompt tokens 1 .. P-1, each the model's raw
    ``log_softmax`` given the tokens before it, with its alternatives; a prompt longer than
    :data:`ALL_LOGITS_CHUNK` (in pieces) too. Broken variant caught: the rows paired with
    the tokens they follow instead of those they predict (``prompt[done:stop]``): the tokens
    are prompt tokens 0 .. P-2."""
    long = " ".join(["ab cd ef gh ij kl mn op"] * 12)
    for text in (PROMPT, long):
        ids = engine.encode(text, chat=False)
        cfg = GenerationConfig(method="smc", seed=1, max_new_tokens=2, logprobs=3,
                               prompt_logprobs=True)  # fmt: skip
        r = engine.generate(text, cfg, chat=False)
        assert r.prompt_logprobs.token_ids == ids[1:]
        want = torch.log_softmax(model_logits(hf, ids)[:-1], -1)
        check_against(r.prompt_logprobs, want, TOL)
    assert len(engine.encode(long, chat=False)) > 2 * ALL_LOGITS_CHUNK


def test_prompt_logprobs_in_scheduler_chunks_equal_the_whole(engine):
    """The scheduler's chunked prefill (16-token chunks) gives the same prompt values as one
    prefill, and streams them through ``on_prompt_logprobs`` before the first token."""
    text = " ".join(["ab cd ef gh ij kl mn op"] * 6)
    cfg = GenerationConfig(method="ar", seed=1, max_new_tokens=2, logprobs=2, prompt_logprobs=True)
    whole = engine.generate(text, cfg, chat=False).prompt_logprobs
    sched = BatchScheduler(engine, prefill_chunk=16, prefill_step_s=60)
    sched.start()
    try:
        got, order, done = {}, [], []
        job = replace(
            engine.prepare(text, cfg, chat=False),
            on_tokens=lambda ids: order.append("tok"),
            on_logprobs=lambda e: None,
            on_prompt_logprobs=lambda e: (got.setdefault("p", e), order.append("prompt")),
        )
        req = Request(job, on_done=done.append)
        sched.submit(req)
        deadline = time.monotonic() + 120  # bounds a broken scheduler only
        while not done and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        sched.stop()
    assert done and not isinstance(done[0], BaseException), done
    assert order[0] == "prompt" and got["p"].token_ids == whole.token_ids
    assert max(abs(a - b) for a, b in zip(got["p"].logprobs, whole.logprobs, strict=True)) < TOL


@pytest.mark.parametrize("method", ["ar", "sd", "smc"])
def test_llamacpp_logprobs_and_prompt_logprobs(tmp_path, hf, engine, method):
    """The llamacpp backend: generated and prompt values against transformers' recomputation
    within llama.cpp's own arithmetic (5e-2)."""
    pytest.importorskip("llama_cpp")
    from smcspec.backends.llamacpp import LlamaCppSettings
    from smcspec.models import load_model

    settings = LlamaCppSettings(threads=1, kv_cells=8192)
    paths = [make_tiny_gguf(tmp_path, "qwen2", 96, seed=s)[0] for s in (0, 1)]
    target = load_model(paths[0], backend="llamacpp", llamacpp=settings)
    draft = load_model(paths[1], backend="llamacpp", llamacpp=settings, tokenizer=False)
    eng = Engine(target, draft)
    prompt = eng.encode(PROMPT, chat=False)
    assert prompt == engine.encode(PROMPT, chat=False)
    cfg = GenerationConfig(**METHODS[method], seed=2, max_new_tokens=12, logprobs=3,
                           temperature=0.8, draft_tokens=3, prompt_logprobs=True)  # fmt: skip
    r = eng.generate(PROMPT, cfg, chat=False)
    check_against(r.logprobs, expected(hf, prompt, r.token_ids, cfg), LLAMA_TOL, True)
    want = torch.log_softmax(model_logits(hf, prompt)[:-1], -1)
    check_against(r.prompt_logprobs, want, LLAMA_TOL, True)
