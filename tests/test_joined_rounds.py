"""Fused rounds of several requests run as one batched call over a bank of static caches.

The static caches of one shape live in one bank (``backends/torch/static_cache.py``); the
scheduler runs the pending ``ar`` rounds of the requests on one bank as one forward over
every slot (``Transformer.decode_bank``, ``decoding/ar/fused.ar_joined``), captured as one CUDA
graph on a GPU. On the CPU they run uncaptured under the host-read guard (``rounds="eager"``).
Checked here: the bank keeps what its caches hold when it grows; the batched forward gives
each slot the logits its own static forward gives, and leaves the slots outside the call
untouched; requests run concurrently through the scheduler draw the tokens they draw alone.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from enumerable import tiny_transformer
from scheduling import run_concurrently
from tiny_models import make_tiny_chat_pair

from smcspec import Engine, GenerationConfig
from smcspec.backends.torch import load_hf_dir
from smcspec.backends.torch.graphs import HostReadGuard


def _filled(model, prompt: list[int], steps: int):
    """A static cache holding ``prompt`` and ``steps`` generated tokens (eager forwards)."""
    cache = model.new_cache(1, 40, static=True, prompt_len=len(prompt))
    model.prefill(torch.tensor(prompt), cache)
    for i in range(steps):
        model.decode(torch.tensor([[3 + i]]), cache)
    return cache


def test_a_growing_bank_keeps_its_caches():
    model = tiny_transformer(seed=1, vocab=8)
    model.rounds = "eager"
    try:
        a = _filled(model, [1, 2, 0, 4], 3)
        before = model.decode(torch.tensor([[5]]), a)[0, -1]
        a.truncate(3)
        serial, bank = a.serial, a.bank
        a.graphs["x"] = object()
        b = _filled(model, [2, 2], 1)  # the bank doubles to hold it
        assert b.bank is bank and bank.slots == 2 and (a.slot, b.slot) == (0, 1)
        assert a.serial != serial and not a.graphs  # graphs of the old tensors dropped
        assert a.suffix_k.data_ptr() == bank.suffix_k.data_ptr()  # a's views moved
        after = model.decode(torch.tensor([[5]]), a)[0, -1]
        torch.testing.assert_close(after, before, rtol=0, atol=0)
    finally:
        model.rounds = "auto"


def test_a_bank_forward_gives_each_slot_its_own_logits():
    model = tiny_transformer(seed=1, vocab=8)
    model.rounds = "eager"
    try:
        caches = [_filled(model, p, s) for p, s in (([1, 2, 0], 2), ([4] * 9, 0), ([2, 1], 5))]
        bank = caches[0].bank
        assert all(c.bank is bank for c in caches) and bank.slots == 4
        tokens = torch.tensor([[3], [6], [7], [0]])  # slot 3: no cache holds it
        starts = torch.tensor([c.length for c in caches] + [0])
        keep = torch.tensor([True, False, True, False])
        untouched = caches[1].suffix_k.clone(), caches[1].suffix_v.clone()
        with HostReadGuard():
            joined = model.decode_bank(tokens, bank, starts, keep, 64, 64, last_only=True)
        assert torch.equal(caches[1].suffix_k, untouched[0])
        assert torch.equal(caches[1].suffix_v, untouched[1])
        for b in (0, 2):
            cache = caches[b]
            alone = model.decode_static(tokens[b : b + 1], cache, starts[b], 64, last_only=True)
            torch.testing.assert_close(joined[b], alone[0], rtol=1e-5, atol=1e-5)
    finally:
        model.rounds = "auto"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    dirs = make_tiny_chat_pair(tmp_path_factory.mktemp("joined"), max_position_embeddings=512)
    return Engine(load_hf_dir(dirs[0]), load_hf_dir(dirs[1]))


@pytest.mark.parametrize(
    ("method", "chains", "greedy"),
    [("ar", 1, False), ("ar", 1, True), ("sd", 1, False), ("sd", 1, True), ("sd", 3, False)],
    ids=["ar", "ar-greedy", "sd", "sd-greedy", "multi-draft-sd"],
)
def test_concurrent_requests_join_and_draw_what_they_draw_alone(
    engine, method, chains, greedy, monkeypatch
):
    """Four ``ar`` (``sd``, multi-draft ``sd`` of 3 chains) requests at once: their rounds run
    as one call while at least two are running, and each draws the tokens it draws alone, and
    on the step path."""
    target, draft = engine.target.model, engine.draft.model
    prompts = ["ab cd", "ef", "ab ab ab cd ef gh", "cd"]
    chained = {"particles": chains} if chains > 1 else {}
    cfgs = [
        GenerationConfig(
            method=method,
            **chained,
            draft_tokens=3,
            max_new_tokens=12 + 3 * i,
            seed=i,
            ignore_eos=True,
            temperature=0.0 if greedy else 0.9,
            top_k=0 if greedy else 20,
        )  # fmt: skip
        for i in range(len(prompts))
    ]
    joined_sizes: list[int] = []
    run_joined = type(target).run_joined

    def counted(model, rounds):
        joined_sizes.append(len(rounds))
        return run_joined(model, rounds)

    monkeypatch.setattr(type(target), "run_joined", counted)
    target.rounds = draft.rounds = "eager"
    try:
        alone = [engine.generate(p, c).token_ids for p, c in zip(prompts, cfgs, strict=True)]
        assert not joined_sizes  # one request at a time: nothing to join
        jobs = [engine.prepare(p, c) for p, c in zip(prompts, cfgs, strict=True)]
        together = run_concurrently(engine, jobs)
    finally:
        target.rounds = draft.rounds = "auto"
    assert [o.token_ids for o in together] == alone
    assert [len(t) for t in alone] == [12, 15, 18, 21]
    assert max(joined_sizes) == 4 and min(joined_sizes) >= 2  # all four, then the rest
    steps = [engine.generate(p, c).token_ids for p, c in zip(prompts, cfgs, strict=True)]
    assert steps == alone  # and the step-by-step path draws them too


def test_concurrent_smc_requests_join_and_draw_what_they_draw_alone(engine, monkeypatch):
    """SMC-SD proposals of four requests as one call over the target's and the draft's
    banks (resampling and banking stay per request, on the host), beside an ``ar`` and an
    ``sd`` request whose rounds run alone: every request's tokens and particle weights are
    those it gets alone."""
    target, draft = engine.target.model, engine.draft.model
    prompts = ["ab cd", "ef gh ab", "cd", "ab ab ab cd ef gh", "ef", "gh ab"]
    smc = dict(method="smc", particles=4, draft_tokens=3, ignore_eos=True, return_particles=True)
    cfgs = [GenerationConfig(max_new_tokens=10 + 4 * i, seed=i, **smc) for i in range(4)]
    cfgs += [
        GenerationConfig(method="ar", max_new_tokens=9, seed=7, ignore_eos=True),
        GenerationConfig(method="sd", max_new_tokens=9, draft_tokens=3, seed=8, ignore_eos=True),
    ]
    joined_keys: list[tuple] = []
    run_joined = type(target).run_joined

    def counted(model, rounds):
        joined_keys.append((rounds[0][0].key[0], len(rounds)))
        return run_joined(model, rounds)

    monkeypatch.setattr(type(target), "run_joined", counted)
    target.rounds = draft.rounds = "eager"
    try:
        alone = [engine.generate(p, c) for p, c in zip(prompts, cfgs, strict=True)]
        jobs = [engine.prepare(p, c) for p, c in zip(prompts, cfgs, strict=True)]
        together = run_concurrently(engine, jobs)
    finally:
        target.rounds = draft.rounds = "auto"
    for a, b in zip(alone, together, strict=True):
        assert b.token_ids == a.token_ids
        if a.particles:
            wa = torch.tensor([p["weight"] for p in a.particles])
            wb = torch.tensor([p["weight"] for p in b.particles])
            torch.testing.assert_close(wb, wa, rtol=1e-5, atol=1e-7)
    assert ("smc", 4) in joined_keys and {k for k, _ in joined_keys} == {"smc"}


def test_a_request_takes_the_same_slot_in_both_banks(engine, monkeypatch):
    """Two ``ar`` requests hold target slots 0 and 1; three ``sd`` requests then take target
    slots 2-4, and their draft caches the same slots (the draft's bank grows to reach
    them), so that the three sd rounds join as the two ar rounds do."""
    target, draft = engine.target.model, engine.draft.model
    prompts = ["ab cd", "ef", "ab ab ab cd ef gh", "cd", "gh gh"]
    base = GenerationConfig(max_new_tokens=10, draft_tokens=3, ignore_eos=True)
    cfgs = [replace(base, method="ar", seed=i) for i in range(2)]
    cfgs += [replace(base, method="sd", particles=1, seed=i) for i in (2, 3, 4)]
    keys: list[tuple] = []
    run_joined = type(target).run_joined

    def counted(model, rounds):
        keys.append((rounds[0][0].key[0], tuple(j.caches[0].slot for j, _ in rounds)))
        return run_joined(model, rounds)

    monkeypatch.setattr(type(target), "run_joined", counted)
    target.release_static()
    draft.release_static()
    target.rounds = draft.rounds = "eager"
    try:
        alone = [engine.generate(p, c).token_ids for p, c in zip(prompts, cfgs, strict=True)]
        target.release_static()
        draft.release_static()
        keys.clear()
        jobs = [engine.prepare(p, c) for p, c in zip(prompts, cfgs, strict=True)]
        together = run_concurrently(engine, jobs)
    finally:
        target.rounds = draft.rounds = "auto"
    assert [o.token_ids for o in together] == alone
    assert ("ar", (0, 1)) in keys and ("sd", (2, 3, 4)) in keys


LONG_PROMPT = [3 + (7 * i) % 90 for i in range(80)]  # 80 tokens: prompt window 128


@pytest.mark.parametrize(
    ("method", "order"), [("ar", "admitted"), ("ar", "reversed"), ("sd", "reversed")]
)
def test_a_request_past_the_first_window_joins_short_ones(engine, method, order, monkeypatch):
    """A request past the first 64-position windows, both of them (an 80-token prompt:
    prompt window 128; 80 generated tokens: suffix window 128 from its 64th), joined with
    short ones (prompt window 64; the second admitted when the first ends, 30 tokens later,
    so that it is inside the 64-position suffix window while the long one is past it): each
    draws the tokens it draws alone. A joined call must attend over its members' largest
    windows; with a smaller one the long request's newest keys are cut. The members come in
    the order they were admitted (the long one first) or reversed (a short one first; sd only
    so, to keep the test cheap: its draft bank's windows are checked too). The test also
    checks that joined calls with different windows happened (the smaller first, reversed).

    Broken variants it catches (each run by hand; the other tests here pass the smallest):
    ``run_joined`` taking the first member's suffix window (``span =
    joins[0].suffix_window``) or prompt windows: ar and sd reversed fail; taking the smallest
    of either: all three fail."""
    import smcspec.scheduler as scheduler_module

    target, draft = engine.target.model, engine.draft.model
    long = GenerationConfig(method=method, max_new_tokens=80, draft_tokens=3, seed=1,
                            ignore_eos=True, temperature=0.9, top_k=20)  # fmt: skip
    prompts = [LONG_PROMPT, [5, 6], [8, 9, 10]]
    cfgs = [long, replace(long, max_new_tokens=30, seed=2)]
    cfgs.append(replace(long, max_new_tokens=50, seed=3))
    windows: list[list[tuple[int, int]]] = []  # per joined call: (suffix, prompt) windows
    run_joined = type(target).run_joined

    def counted(model, rounds):
        windows.append([(j.suffix_window, j.caches[0].prompt_window) for j, _ in rounds])
        return run_joined(model, rounds)

    monkeypatch.setattr(type(target), "run_joined", counted)
    if order == "reversed":
        execute_rounds = scheduler_module.execute_rounds
        monkeypatch.setattr(
            scheduler_module, "execute_rounds", lambda rounds: execute_rounds(rounds[::-1])[::-1]
        )
    target.release_static()  # the long request's bank (capacity 128, prompt 128) made first:
    draft.release_static()  # the short ones take its free slots (they fit)
    target.rounds = draft.rounds = "eager"
    try:
        alone = [engine.generate(p, c).token_ids for p, c in zip(prompts, cfgs, strict=True)]
        windows.clear()
        jobs = [engine.prepare(p, c) for p, c in zip(prompts, cfgs, strict=True)]
        together = run_concurrently(engine, jobs, max_running=2)
    finally:
        target.rounds = draft.rounds = "auto"
    assert [o.token_ids for o in together] == alone
    assert [len(t) for t in alone] == [80, 30, 50]
    # what the test is about happened: joined calls whose members' windows differ, the
    # smaller first when reversed
    first_smaller = [(w[0][0] < max(w)[0], w[0][1] < max(p for _, p in w)) for w in windows]
    assert any(s for s, _ in first_smaller) == (order == "reversed")
    assert any(p for _, p in first_smaller) == (order == "reversed")
    assert any(len({s for s, _ in w}) > 1 for w in windows)
    assert any(len({p for _, p in w}) > 1 for w in windows)
