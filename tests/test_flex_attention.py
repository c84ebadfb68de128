"""The particle rows' attention as one ``flex_attention`` call (``backends/torch/flex.py``)
against the written attention (``kernels.attend``, what every path ran before), called
eagerly (PyTorch's unfused reference of ``flex_attention``: the mask's meaning without a
compiler; the compiled kernel is checked in ``tests/test_kernels.py``, slow).

Shapes: an ``ar`` step (1 row, 1 token), a draft step (8 rows, 1 token), a target block
(8 rows, 9 tokens), a bank of 3 slots (4 rows, 2 tokens each, their own prompt lengths and
positions); grouped-query heads. Tolerances: float32 1e-5; bfloat16 0.02 absolute on
outputs of at most 1.95 (the written attention rounds its scores to bf16 before the float32
softmax, the flex kernel keeps them in float32: measured at most 0.0078 here).
"""

from __future__ import annotations

import pytest
import torch

from smcspec.backends.torch.flex import attend_flex, particle_mask
from smcspec.backends.torch.kernels import attend

pytestmark = pytest.mark.filterwarnings("ignore:.*flex_attention.*:UserWarning")

CASES = {
    "ar": (1, 1, 1, 64, 64),
    "draft-step": (1, 8, 1, 64, 128),
    "target-block": (1, 8, 9, 128, 64),
    "bank": (3, 4, 2, 64, 64),
}
H, HKV, D = 4, 2, 16


def _inputs(b: int, n: int, t: int, pw: int, sw: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    q = randn(b * n, H, t, D)
    pk, pv = randn(b, HKV, pw, D), randn(b, HKV, pw, D)
    sk, sv = randn(b * n, HKV, sw, D), randn(b * n, HKV, sw, D)
    prompt_lens = torch.randint(1, pw + 1, (b,), generator=g)
    starts = torch.randint(0, sw - t + 1, (b,), generator=g)
    write_at = starts[:, None] + torch.arange(t)
    return q, pk, pv, sk, sv, prompt_lens, write_at


def _written(q, pk, pv, sk, sv, prompt_lens, write_at, scale):
    """The static forward's attention as it was: masks as ``Transformer._static_view``
    builds them, queries grouped per kv head (``Block.forward_layer``)."""
    r, h, t, d = q.shape
    g = h // HKV
    qg = q.reshape(r, HKV, g * t, d)
    mask_prefix = torch.arange(pk.shape[2]) >= prompt_lens[:, None]
    mask_suffix = torch.arange(sk.shape[2]) > write_at.repeat(1, g)[:, :, None]
    out = attend(qg, pk, pv, sk, sv, mask_prefix, mask_suffix, scale)
    return out.reshape(r, h, t, d)


def _flex(q, pk, pv, sk, sv, prompt_lens, write_at, scale):
    r, h, t, d = q.shape
    b = pk.shape[0]
    n = r // b
    qf = q.view(b, n, h, t, d).permute(0, 2, 1, 3, 4).reshape(b, h, n * t, d)
    mask = particle_mask(prompt_lens, write_at, n, pk.shape[2], sk.shape[2])
    out = attend_flex(qf, pk, pv, sk, sv, mask, scale)
    return out.view(b, h, n, t, d).permute(0, 2, 1, 3, 4).reshape(r, h, t, d)


@pytest.mark.parametrize("case", CASES)
def test_flex_attention_equals_the_written_attention_in_float32(case):
    """Every row sees its slot's prompt up to its length and its own suffix up to its
    position. Fails with the mask's last visible key one short (``kv_idx < last``), with the
    prompt's padding visible (no ``prompt_lens`` test), or with the rows' suffixes offset by
    the prompt window forgotten in ``first``."""
    args = _inputs(*CASES[case], torch.float32)
    want = _written(*args, 0.25)
    torch.testing.assert_close(_flex(*args, 0.25), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", CASES)
def test_flex_attention_in_bfloat16_within_its_tolerance(case):
    args = _inputs(*CASES[case], torch.bfloat16, seed=1)
    got, want = _flex(*args, 0.25), _written(*args, 0.25)
    assert got.dtype == torch.bfloat16
    assert (got.float() - want.float()).abs().max() < 0.02


def test_the_mask_sees_only_its_row_and_the_prompt():
    """The mask's tables: query (row i, token t) of slot b sees keys ``[0, prompt_len[b])``
    and ``[Pw + i*Sw, Pw + i*Sw + write_at[b, t]]``; every block listed."""
    prompt_lens, write_at = torch.tensor([3, 5]), torch.tensor([[4, 5], [0, 1]])
    m = particle_mask(prompt_lens, write_at, rows=2, prefix_window=64, suffix_window=64)
    assert m.first.tolist() == [[64, 64, 128, 128]] * 2
    assert m.last.tolist() == [[68, 69, 132, 133], [64, 65, 128, 129]]
    assert m.kv_blocks.tolist() == [[[2]], [[2]]]  # 64 + 2 * 64 keys: two blocks of 128
    assert m.kv_indices.tolist() == [[[[0, 1]]], [[[0, 1]]]]
