"""A layer's norms, RoPE, gating and attention through ``torch.compile``
(``smcspec.backends.torch.kernels``) against the same functions as written, on the CPU
(Inductor's C++ kernels; on CUDA they are Triton kernels the campaign captures in graphs).

Tolerances: float32 everywhere; Inductor may reorder a reduction (the norm's mean, the
softmax's sum), so logits agree to 1e-5 relative, not bit for bit. Compiling takes tens of
seconds on a 2-core CPU: the slow tier.
"""

from __future__ import annotations

import pytest
import torch
from enumerable import tiny_transformer
from test_fused_rounds import SMC, _run, _same

from smcspec.backends.torch import kernels
from smcspec.backends.torch.kernels import EAGER, compiled_kernels
from smcspec.decoding import decode_smc

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def compiled():
    return compiled_kernels()


def test_each_compiled_function_matches_the_written_one(compiled):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 3, 16, generator=g)
    w = torch.randn(16, generator=g)
    torch.testing.assert_close(compiled.rms_norm(x, w, 1e-6), kernels.rms_norm(x, w, 1e-6))
    cos, sin = torch.randn(6, 1, 16, generator=g), torch.randn(6, 1, 16, generator=g)
    torch.testing.assert_close(compiled.rotate(x, cos, sin), kernels.rotate(x, cos, sin))
    torch.testing.assert_close(compiled.silu_mul(x, x + 1), kernels.silu_mul(x, x + 1))
    r, hkv, gt, d, p, s = 3, 2, 4, 16, 5, 7
    qg = torch.randn(r, hkv, gt, d, generator=g)
    pk, pv = torch.randn(hkv, p, d, generator=g), torch.randn(hkv, p, d, generator=g)
    sk, sv = torch.randn(r, hkv, s, d, generator=g), torch.randn(r, hkv, s, d, generator=g)
    mask_p = torch.arange(p) >= 3
    mask_s = torch.arange(s)[None, :] > torch.arange(gt)[:, None] + 2
    for mp in (mask_p, None):
        args = (qg, pk, pv, sk, sv, mp, mask_s, 0.25)
        torch.testing.assert_close(compiled.attend(*args), kernels.attend(*args))
    assert compiled.compiled and not EAGER.compiled


def test_a_model_on_compiled_kernels_gives_the_same_logits():
    model = tiny_transformer(seed=3, vocab=8)
    ids = torch.tensor([1, 2, 0, 3, 4])

    def logits() -> torch.Tensor:
        cache = model.new_cache(1, 8)
        first = model.prefill(ids, cache)
        block = model.decode(torch.tensor([[5, 6, 7]]), cache)
        return torch.cat((first.flatten(), block.flatten()))

    eager = logits()
    model.use_kernels(compiled_kernels())
    try:
        assert all(layer.kernels.compiled for layer in model.layers)
        torch.testing.assert_close(logits(), eager, rtol=1e-5, atol=1e-5)
    finally:
        model.use_kernels(EAGER)
    assert not model.norm.kernels.compiled


def test_fused_smc_rounds_on_compiled_kernels_match_the_written_ones():
    """The whole fused round (static caches, under the host-read guard) with the compiled
    kernels: the same tokens and resampling, weights to float rounding."""
    models = tiny_transformer(seed=1, vocab=8), tiny_transformer(seed=2, vocab=8)
    want = _run(decode_smc, models, "eager", SMC)
    for m in models:
        m.use_kernels(compiled_kernels())
    try:
        _same(want, _run(decode_smc, models, "eager", SMC))
    finally:
        for m in models:
            m.use_kernels(EAGER)
