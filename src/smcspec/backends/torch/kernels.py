"""The pieces of a decoder layer between its matrix products, as pure tensor functions that a
model runs either as written (PyTorch's own kernels, one or more per operation) or through
``torch.compile`` (Inductor fuses each into one or a few generated kernels: Triton on CUDA,
C++ on a CPU).

On an H200 a graph-replayed 1B draft step over 8 rows took 2.5 ms against 0.5 ms to read its
weights, and 44% of a round's device time was GEMMs: the rest is small kernels of 2-3 us each
(norms, RoPE, casts, masks, softmax), about 47 per layer forward
(``docs/benchmarks/gpu-h200-graphs/``). Fusing them is the route of gpt-fast and of the SMC-SD
authors' engine; :func:`compiled_kernels` takes it for these four functions only (the GEMMs
stay cuBLAS calls), compiled once each with dynamic shapes, so that every model, row count,
block length and attention window shares one compilation. A model uses them after
:meth:`Transformer.use_kernels(compiled_kernels())
<smcspec.backends.torch.transformer.Transformer.use_kernels>`; the CUDA graphs of
:mod:`smcspec.backends.torch.graphs` then capture the fused kernels (the warm-up before a
capture compiles).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from smcspec.backends.torch.graphs import compiled_region


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019) of ``x`` ``[..., hidden]`` in float32, cast back to
    ``x``'s dtype, times ``weight`` ``[hidden]``: transformers' order of operations
    (``F.rms_norm`` is the same arithmetic, bit for bit on the CPU, and one kernel on CUDA
    where PyTorch has one)."""
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return weight * normed.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE (Su et al. 2021, the rotate-half form of Llama and Qwen2) of ``x`` ``[..., D]``
    with ``cos``/``sin`` broadcastable to it."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gating (Shazeer 2020): ``silu(gate) * up``, same shapes."""
    return F.silu(gate) * up


def attend(
    qg: torch.Tensor,
    pk: torch.Tensor,
    pv: torch.Tensor,
    sk: torch.Tensor,
    sv: torch.Tensor,
    mask_prefix: torch.Tensor | None,
    mask_suffix: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of grouped queries ``qg`` ``[R, Hkv, g*T, D]`` over a prompt's keys/values
    ``pk``/``pv`` and each row's suffix ``sk``/``sv`` ``[R, Hkv, S, D]``. The prompt is
    ``[Hkv, P, D]``, shared by every row, or ``[B, Hkv, P, D]``, one per slot of ``R / B``
    consecutive rows (the requests of a batched static forward). True in ``mask_prefix``
    (``[P]``, ``[B, P]`` or None) and ``mask_suffix`` (``[g*T, S]`` or ``[B, g*T, S]``) hides
    a position. Scores (times ``scale``) and softmax in float32. Returns
    ``[R, Hkv, g*T, D]`` in ``qg``'s dtype."""
    if pk.dim() == 3:
        pk, pv = pk[None], pv[None]
    r, hkv, gt, d = qg.shape
    b, p_len = pk.shape[0], pk.shape[2]
    n = r // b
    # a slot's prompt is shared by its rows: fold them into one [B, Hkv, n*g*T, D] product
    # with it (a broadcast [R, ...] @ [1, ...] product would copy the prompt once per row)
    qf = qg.view(b, n, hkv, gt, d).transpose(1, 2).reshape(b, hkv, n * gt, d)
    s_pre = (qf @ pk.transpose(-1, -2)).view(b, hkv, n, gt, p_len).transpose(1, 2)
    s_pre = s_pre.reshape(r, hkv, gt, p_len)
    scores = torch.cat((s_pre, qg @ sk.transpose(-1, -2)), dim=-1)
    scores = scores.float() * scale
    per_slot = scores.view(b, n, hkv, gt, -1)
    if mask_prefix is not None:
        per_slot[..., :p_len].masked_fill_(_slot_mask(mask_prefix, 1), float("-inf"))
    per_slot[..., p_len:].masked_fill_(_slot_mask(mask_suffix, 2), float("-inf"))
    probs = scores.softmax(dim=-1).to(qg.dtype)
    p_pre = probs[..., :p_len].reshape(b, n, hkv, gt, p_len).transpose(1, 2)
    o_pre = (p_pre.reshape(b, hkv, n * gt, p_len) @ pv).view(b, hkv, n, gt, d).transpose(1, 2)
    return o_pre.reshape(r, hkv, gt, d) + probs[..., p_len:] @ sv


def _slot_mask(mask: torch.Tensor, dims: int) -> torch.Tensor:
    """``mask`` (``[(B,) P]`` for ``dims`` 1, ``[(B,) g*T, S]`` for 2) shaped to broadcast
    over scores viewed as ``[B, n, Hkv, g*T, positions]``."""
    if mask.dim() == dims:
        mask = mask[None]
    return mask.view(mask.shape[0], 1, 1, -1 if dims == 2 else 1, mask.shape[-1])


@dataclass(frozen=True)
class LayerKernels:
    """The four functions a layer calls between its matrix products (signatures as
    :func:`rms_norm`, :func:`rotate`, :func:`silu_mul`, :func:`attend`); ``compiled`` says
    whether they go through ``torch.compile``."""

    rms_norm: Callable[..., torch.Tensor]
    rotate: Callable[..., torch.Tensor]
    silu_mul: Callable[..., torch.Tensor]
    attend: Callable[..., torch.Tensor]
    compiled: bool = False


EAGER = LayerKernels(rms_norm, rotate, silu_mul, attend)
"""The functions as written: what every model runs unless told otherwise."""


def compiled_kernels() -> LayerKernels:
    """The four functions through ``torch.compile(dynamic=True, fullgraph=True)``: one
    compilation each, at its first call (Dynamo keys its cache by the function's code, so every
    model and every call of this function shares it). The results equal :data:`EAGER`'s up to float
    rounding (Inductor may reorder a reduction): ``tests/test_kernels.py`` bounds it on the
    CPU.

    Raises:
        RuntimeError (at the first call): Inductor cannot compile here (no C++ compiler on a
            CPU, no Triton on a GPU).
    """

    def compile_(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        return compiled_region(torch.compile(fn, dynamic=True, fullgraph=True))

    return LayerKernels(
        compile_(rms_norm), compile_(rotate), compile_(silu_mul), compile_(attend), True
    )
