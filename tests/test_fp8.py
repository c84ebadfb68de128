"""FP8 weights on the torch backend (``smcspec.backends.torch.fp8``), on the CPU.

PyTorch's CPU ``_scaled_mm`` is the reference FP8 GEMM (CUDA runs CUTLASS's row-wise kernel
on the same operands: tests/test_gpu.py). Tolerances come from e4m3's 3 mantissa bits: a
rounding error of at most 2^-4 of an element (2^-9 of the row's scale below the normal
range), which over a dot product mostly averages out; each bound below is stated where it
is used, with the value measured on these seeds beside it.
"""

from __future__ import annotations

import pytest
import torch
from enumerable import tiny_transformer
from test_fused_rounds import SMC, _run, _same
from torch import nn

from smcspec import ConfigError, GenerationConfig
from smcspec.backends.torch.fp8 import (
    FP8,
    FP8_MAX,
    PROJECTIONS,
    Fp8Linear,
    convert_to_fp8,
    quantize_rows,
)
from smcspec.decoding import decode_ar, decode_smc
from smcspec.eval.roofline import weight_bytes_read


def test_rows_quantize_within_e4m3s_rounding():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=g) * torch.tensor([1e-3, 1.0, 30.0, 1e4, 0.0])[:, None]
    q, scale = quantize_rows(x)
    assert q.dtype == FP8 and scale.shape == (5, 1) and scale.dtype == torch.float32
    back = q.float() * scale
    row_max = x.abs().amax(-1, keepdim=True)
    # normal range: 2^-4 relative; below it (|x| < 2^-6 * 448 scales): 2^-9 of the scale
    bound = x.abs() * 2**-4 + scale * 2**-9
    assert ((back - x).abs() <= bound + 1e-30).all()
    assert (q.float().abs().amax(-1) <= FP8_MAX).all()
    assert torch.equal(back[4], torch.zeros(64))  # a zero row stays zero (no 0/0)
    # the largest element of a row maps to 448
    torch.testing.assert_close(q.float().abs().amax(-1)[:4] * scale[:4, 0], row_max[:4, 0])


def test_an_fp8_linear_is_the_linear_to_fp8_rounding():
    g = torch.Generator().manual_seed(1)
    layer = nn.Linear(256, 96, bias=True)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(96, 256, generator=g) * 0.05)
        layer.bias.copy_(torch.randn(96, generator=g))
    x = torch.randn(2, 7, 256, generator=g)
    want = layer(x)
    fp8 = Fp8Linear.from_linear(layer)
    got = fp8(x)
    assert got.shape == want.shape and got.dtype == want.dtype
    # both operands rounded (up to 2^-4 each): measured 0.042 of the largest output on this
    # seed, about what 256 terms' independent roundings give at the extreme of 1,344 outputs
    err = (got - want).abs().max() / (want - layer.bias).abs().max()
    assert err < 0.08
    assert fp8.weight.dtype == FP8 and fp8.weight_scale.shape == (96,)
    assert not any(p.requires_grad for p in fp8.parameters())


def test_a_layer_whose_dimensions_are_not_multiples_of_16_is_refused():
    with pytest.raises(ConfigError, match="multiples of 16"):
        Fp8Linear.from_linear(nn.Linear(24, 32))


def test_a_converted_model_reads_fewer_bytes_and_keeps_its_logits():
    base = tiny_transformer(seed=3, vocab=8)
    model = tiny_transformer(seed=3, vocab=8)
    before = weight_bytes_read(model)
    saved = convert_to_fp8(model)
    assert all(isinstance(getattr(b, n), Fp8Linear) for b in model.layers for n in PROJECTIONS)
    assert weight_bytes_read(model) == before - saved
    # float32 -> 1 byte, plus a float32 scale per output row
    layers = [getattr(b, n) for b in model.layers for n in PROJECTIONS]
    assert saved == sum(3 * m.weight.numel() - 4 * m.out_features for m in layers)
    assert convert_to_fp8(model) == 0  # converting twice changes nothing
    ids = torch.tensor([1, 2, 0, 3, 4])

    def logits(m) -> torch.Tensor:
        cache = m.new_cache(1, 8)
        first = m.prefill(ids, cache)
        return torch.cat((first.flatten(), m.decode(torch.tensor([[5, 6, 7]]), cache).flatten()))

    want, got = logits(base), logits(model)
    # measured: 0.085 of the logits' spread on this seed (a 16-wide model: few terms to
    # average the roundings over)
    assert (got - want).abs().max() < 0.2 * (want.max() - want.min())


@pytest.fixture(scope="module")
def fp8_pair():
    models = tiny_transformer(seed=1, vocab=8), tiny_transformer(seed=2, vocab=8)
    for m in models:
        convert_to_fp8(m)
    return models


def test_fused_rounds_on_fp8_weights_draw_what_their_steps_draw(fp8_pair):
    """A round of fused FP8 forwards runs under the host-read guard (the activations' scales
    stay on the device) and gives the steps' tokens and resampling."""
    for seed in (5, 6):
        _same(_run(decode_smc, fp8_pair, "steps", SMC, seed=seed),
              _run(decode_smc, fp8_pair, "eager", SMC, seed=seed))  # fmt: skip
    ar = GenerationConfig(method="ar", max_new_tokens=20, temperature=0.8)
    target = fp8_pair[:1]
    _same(_run(decode_ar, target, "steps", ar), _run(decode_ar, target, "eager", ar))


def test_fp8_on_a_llamacpp_model_is_a_clear_error():
    from types import SimpleNamespace

    from smcspec.models.pair import _to_fp8

    gguf = SimpleNamespace(backend="llamacpp", name="draft.gguf", model=None)
    with pytest.raises(ConfigError, match="--fp8 needs the torch backend; draft.gguf runs on"):
        _to_fp8(None, gguf)


def test_the_fidelity_measures_are_zero_for_identical_logits_and_grow_with_noise():
    """``benchmarks/fp8_fidelity.py``'s comparison, on logits whose answer is known."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from fp8_fidelity import compare

    g = torch.Generator().manual_seed(2)
    ref = torch.randn(5, 11, generator=g) * 3
    answer = [0, 3, 3, 7, 10]
    same = compare(ref, ref.clone(), answer)
    assert same["kl_nats_mean"] == pytest.approx(0, abs=1e-6)
    assert same["tv_t07_mean"] == pytest.approx(0, abs=1e-6)
    assert same["top1_agreement"] == 1 and same["nll_ref"] == same["nll_fp8"]
    want_nll = -ref.log_softmax(-1)[torch.arange(5), answer].mean().item()
    assert same["nll_ref"] == pytest.approx(want_nll) and same["tokens"] == 5
    small = compare(ref, ref + 0.05 * torch.randn(5, 11, generator=g), answer)
    large = compare(ref, ref + 2.0 * torch.randn(5, 11, generator=g), answer)
    assert 0 < small["kl_nats_mean"] < large["kl_nats_mean"]
    assert 0 < small["tv_t07_mean"] < large["tv_t07_mean"] <= 1
