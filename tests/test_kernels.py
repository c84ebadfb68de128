"""The compiled kernel sets (``smcspec.backends.torch.kernels``) against the functions as
written, on the CPU (Inductor's C++ kernels; on CUDA they are Triton kernels the campaign
captures in graphs): ``compiled`` (a layer's norms, RoPE, gating and attention each through
``torch.compile``), ``flex`` (the rounds' attention one compiled ``flex_attention`` kernel)
and ``layer`` (each static forward's layer one compiled function, flex attention inside).

Tolerances: float32 1e-5 (Inductor may reorder a reduction: the norm's mean, the softmax's
sum; flex sums its keys in blocks), tokens equal. The sets in bfloat16 are checked on the
forwards whose kernels ``tests/test_layer_kernels.py`` counts (compiled once for both).
Compiling takes seconds to tens of seconds a shape on a 2-core CPU (Inductor's cache on disk
shortens a second run): the slow tier.
"""

from __future__ import annotations

import pytest
import torch
from enumerable import tiny_transformer
from test_fused_rounds import SMC, _run, _same

from smcspec import GenerationConfig
from smcspec.backends.torch import kernels
from smcspec.backends.torch.graphs import HostReadGuard
from smcspec.backends.torch.kernels import EAGER, LayerKernels, compiled_kernels
from smcspec.decoding import decode_ar, decode_sd, decode_smc

pytestmark = pytest.mark.slow


KERNELS = ("rms_norm", "rotate", "silu_mul", "attend")


def _checked(compiled: LayerKernels, calls: list) -> LayerKernels:
    """``compiled``'s four functions, each call recorded in ``calls`` as ``(name, prompt
    mask given, output, the written function's output on the same inputs)``; the written one
    runs at once, before a later step writes to a cache its inputs view, and nothing is read
    to the host (a fused round runs under the host-read guard)."""

    def checking(name: str):
        fn, written = getattr(compiled, name), getattr(kernels, name)

        def run(*args):
            out = fn(*args)
            calls.append((name, name == "attend" and args[5] is not None, out, written(*args)))
            return out

        return run

    return LayerKernels(*(checking(n) for n in KERNELS), "compiled")


def _each_call_matches(calls: list) -> set[tuple[str, bool]]:
    """Every recorded call's output against the written function's (default float32
    tolerances: 1.3e-6 relative, 1e-5 absolute); returns the (function, masked) kinds seen."""
    for name, _, got, want in calls:
        torch.testing.assert_close(got, want, msg=lambda m, name=name: f"{name}: {m}")
    return {(name, masked) for name, masked, _, _ in calls}


def test_a_model_on_compiled_kernels_gives_the_same_logits():
    """Every call of each compiled function (norms, RoPE, gating, attention) matches the
    written function on its inputs, and the model's logits match to 1e-5. The functions are
    checked on the model's own inputs so that no shape compiles only for this check (a
    separate check on other shapes took 21 s of compiling). Fails with the compiled RoPE
    turning the other way (``sin`` negated; tried, as the fused test below does)."""
    model = tiny_transformer(seed=3, vocab=8)
    ids = torch.tensor([1, 2, 0, 3, 4])

    def logits() -> torch.Tensor:
        cache = model.new_cache(1, 8)
        first = model.prefill(ids, cache)
        block = model.decode(torch.tensor([[5, 6, 7]]), cache)
        return torch.cat((first.flatten(), block.flatten()))

    eager = logits()
    calls: list = []
    model.use_kernels(_checked(compiled_kernels(), calls))
    try:
        assert all(layer.kernels.compiled for layer in model.layers)
        torch.testing.assert_close(logits(), eager, rtol=1e-5, atol=1e-5)
    finally:
        model.use_kernels("auto")
    assert not model.norm.kernels.compiled
    kinds = _each_call_matches(calls)
    assert {name for name, _ in kinds} == set(KERNELS) and ("attend", False) in kinds
    assert compiled_kernels().compiled and not EAGER.compiled


def test_fused_smc_rounds_on_compiled_kernels_match_the_written_ones():
    """The whole fused round (static caches, under the host-read guard) with the compiled
    kernels: the same tokens and resampling, weights to float rounding; each compiled
    function's calls (attention with a prompt mask too) match the written function's."""
    models = tiny_transformer(seed=1, vocab=8), tiny_transformer(seed=2, vocab=8)
    want = _run(decode_smc, models, "eager", SMC)
    calls: list = []
    for m in models:
        m.use_kernels(_checked(compiled_kernels(), calls))
    try:
        _same(want, _run(decode_smc, models, "eager", SMC))
    finally:
        for m in models:
            m.use_kernels("auto")
    assert ("attend", True) in _each_call_matches(calls)


# ------------------------------------------------------------ flex and whole-layer sets
SETS = ["flex", "layer"]
AR = GenerationConfig(method="ar", max_new_tokens=30, temperature=0.7, top_k=3)
SD = GenerationConfig(method="sd", max_new_tokens=30, draft_tokens=3, temperature=1.0,
                      draft_temperature=1.0, ignore_eos=True)  # fmt: skip


@pytest.fixture(scope="module")
def tiny_pair():
    return tiny_transformer(seed=1, vocab=8), tiny_transformer(seed=2, vocab=8)


@pytest.mark.parametrize("name", SETS)
def test_kernel_sets_draw_what_the_steps_draw(tiny_pair, name):
    """ar, sd and SMC-SD (particles ending at a stop token: banking) with the fused rounds on
    the flex attention and on whole compiled layers give the tokens, resampling and weights
    (1e-5) of the step-by-step rounds, which share their distinct rows and run the written
    kernels; float32. Fails with the flex mask's last visible key one short, or with the
    compiled layer's cache write left out (both tried)."""
    stop = frozenset({7})
    steps = {
        "ar": _run(decode_ar, tiny_pair[:1], "steps", AR),
        "sd": _run(decode_sd, tiny_pair, "steps", SD),
        "smc": _run(decode_smc, tiny_pair, "steps", SMC, stop),
    }
    for m in tiny_pair:
        m.use_kernels(name)
    try:
        _same(steps["ar"], _run(decode_ar, tiny_pair[:1], "eager", AR))
        _same(steps["sd"], _run(decode_sd, tiny_pair, "eager", SD))
        _same(steps["smc"], _run(decode_smc, tiny_pair, "eager", SMC, stop))
        assert all(m.kernels.name == name for m in tiny_pair)
    finally:
        for m in tiny_pair:
            m.use_kernels("auto")
    assert steps["smc"].stats.banked >= 1 and steps["smc"].stats.resamples >= 1


def _bank_logits(model, filled: list[tuple[list[int], int]]) -> torch.Tensor:
    """A bank forward over three filled slots and one no request holds
    (``tests/test_joined_rounds.py``'s)."""
    caches = []
    for prompt, steps in filled:
        cache = model.new_cache(1, 40, static=True, prompt_len=len(prompt))
        model.prefill(torch.tensor(prompt), cache)
        for i in range(steps):
            model.decode(torch.tensor([[3 + i]]), cache)
        caches.append(cache)
    bank = caches[0].bank
    tokens = torch.tensor([[3], [6], [7], [0]])
    starts = torch.tensor([c.length for c in caches] + [0])
    keep = torch.tensor([True, False, True, False])
    with HostReadGuard():
        out = model.decode_bank(tokens, bank, starts, keep, 64, 64, last_only=True)
    for c in caches:
        c.close()
    return out[keep]


@pytest.mark.parametrize("name", SETS)
def test_kernel_sets_give_a_joined_forward_its_logits(name):
    """The rounds of concurrent requests as one forward over a bank's slots (each its own
    prompt length and position, a slot written back unchanged): the flex and whole-layer
    sets give the written kernels' logits (float32, 1e-5)."""
    model = tiny_transformer(seed=1, vocab=8)
    model.rounds = "eager"
    filled = [([1, 2, 0], 2), ([4] * 9, 0), ([2, 1], 5)]
    want = _bank_logits(model, filled)
    model.release_static()
    model.use_kernels(name)
    torch.testing.assert_close(_bank_logits(model, filled), want, rtol=1e-5, atol=1e-5)
