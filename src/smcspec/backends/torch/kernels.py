"""The pieces of a decoder layer between its matrix products, and the kernel sets a model runs
them with: as written (PyTorch's own kernels, one or more per operation) or through
``torch.compile`` (Inductor fuses them into generated kernels: Triton on CUDA, C++ on a CPU).

On an H200 a graph-replayed 1B draft step over 8 rows took 2.5 ms against 0.5 ms to read its
weights, and 44% of a round's device time was GEMMs: the rest is small kernels of 2-3 us each
(norms, RoPE, casts, masks, softmax), about 47 per layer forward
(``docs/benchmarks/gpu-h200-graphs/``). Fusing them is the route of gpt-fast and of the SMC-SD
authors' engine. The sets (:data:`KERNEL_SETS`, :func:`kernel_set`):

* ``eager`` (:data:`EAGER`): the functions as written.
* ``compiled`` (:func:`compiled_kernels`): the four functions each through ``torch.compile``
  (dynamic shapes: one compilation each, shared by every model and shape).
* ``flex``: the written norms, RoPE and gating; the static forwards' attention one
  ``flex_attention`` kernel over each slot's prompt and rows (:mod:`.flex`).
* ``layer`` (:func:`layer_kernels`): a static forward's whole layer, its GEMMs included,
  as one compiled function (gpt-fast's route, one layer at a time: every layer of a model
  shares the compilation), with the flex attention inside, so that the norms, RoPE, the
  cache writes, the residual adds and the gating fuse around the GEMMs (which stay cuBLAS
  calls on CUDA).

A model uses a set after :meth:`Transformer.use_kernels
<smcspec.backends.torch.transformer.Transformer.use_kernels>`; the CUDA graphs of
:mod:`smcspec.backends.torch.graphs` then capture the generated kernels (the warm-up before a
capture compiles). ``benchmarks/layer_kernels.py`` counts the kernels each set launches per
layer (``docs/benchmarks/layer-kernels/``).
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from smcspec.backends.torch.graphs import compiled_region

log = logging.getLogger(__name__)


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


KERNEL_SETS = ("eager", "compiled", "flex", "layer")
"""The kernel sets a model can run (module notes)."""


@dataclass(frozen=True)
class LayerKernels:
    """The four functions a layer calls between its matrix products (signatures as
    :func:`rms_norm`, :func:`rotate`, :func:`silu_mul`, :func:`attend`), and for the static
    forwards (what rounds run) ``flex``, the attention of every particle row as one
    ``flex_attention`` call (:func:`~smcspec.backends.torch.flex.attend_flex`; None: ``attend``),
    and ``layer``, the whole layer as one function (``(block, x, layer_view) -> x``; None:
    the layer as written). ``name``: one of :data:`KERNEL_SETS` (the graphs captured with a set
    are keyed by it)."""

    rms_norm: Callable[..., torch.Tensor]
    rotate: Callable[..., torch.Tensor]
    silu_mul: Callable[..., torch.Tensor]
    attend: Callable[..., torch.Tensor]
    name: str = "eager"
    flex: Callable[..., torch.Tensor] | None = None
    layer: Callable[..., torch.Tensor] | None = None

    @property
    def compiled(self) -> bool:
        """Whether anything runs through ``torch.compile``."""
        return self.name != "eager"


EAGER = LayerKernels(rms_norm, rotate, silu_mul, attend)
"""The functions as written: what every model on a CPU runs unless told otherwise."""

RECOMPILE_LIMIT = 64
"""Dynamo's compilations per function allowed once a compiled set is made (its default, 8,
would send a process with many model shapes, slot counts and prompt windows back to the
unfused functions without an error)."""


def _allow_recompiles() -> None:
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)


@functools.cache
def compiled_kernels() -> LayerKernels:
    """The four functions through ``torch.compile(dynamic=True, fullgraph=True)``: one
    compilation each, at its first call (Dynamo keys its cache by the function's code, so every
    model shares it). The results equal :data:`EAGER`'s up to float rounding (Inductor may
    reorder a reduction): ``tests/test_kernels.py`` bounds it on the CPU.

    Raises:
        RuntimeError (at the first call): Inductor cannot compile here (no C++ compiler on a
            CPU, no Triton on a GPU).
    """
    _allow_recompiles()

    def compile_(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        return compiled_region(torch.compile(fn, dynamic=True, fullgraph=True))

    return LayerKernels(
        compile_(rms_norm), compile_(rotate), compile_(silu_mul), compile_(attend), "compiled"
    )


@functools.cache
def flex_kernels() -> LayerKernels:
    """The written functions, and the static forwards' attention as one compiled
    ``flex_attention`` kernel (:func:`~smcspec.backends.torch.flex.compiled_attend_flex`)."""
    from smcspec.backends.torch.flex import compiled_attend_flex

    _allow_recompiles()
    return LayerKernels(rms_norm, rotate, silu_mul, attend, "flex", flex=compiled_attend_flex())


def _run_layer(block, x: torch.Tensor, view) -> torch.Tensor:
    return block.forward_layer(x, view)


@functools.cache
def layer_kernels() -> LayerKernels:
    """A static forward's layer as one ``torch.compile(fullgraph=True)`` function of the block,
    its input rows and its :class:`~smcspec.backends.torch.static_view.LayerView` (the
    flex attention inside), with the rows, tokens and suffix window dynamic
    (``LayerView.mark_dynamic``) and everything else static: one compilation per model
    shape, slots, prompt window and 0/1 pattern of rows and tokens, shared by every layer of
    the model (Dynamo lifts a module's parameters into inputs) and every suffix window. The
    step-by-step forwards run the written functions.

    Raises:
        RuntimeError (at the first call): Inductor cannot compile here.
    """
    from smcspec.backends.torch.flex import attend_flex

    _allow_recompiles()
    compiled = compiled_region(torch.compile(_run_layer, dynamic=False, fullgraph=True))

    def layer(block, x: torch.Tensor, view) -> torch.Tensor:
        torch._dynamo.maybe_mark_dynamic(x, 0)
        view.mark_dynamic()
        return compiled(block, x, view)

    return LayerKernels(rms_norm, rotate, silu_mul, attend, "layer", attend_flex, layer)


KERNEL_MODES = ("auto", *KERNEL_SETS)
"""What a model may be told to run (:meth:`Transformer.use_kernels
<smcspec.backends.torch.transformer.Transformer.use_kernels>`): a set's name, or ``auto``
(:func:`auto_kernels`)."""

_auto_failures: list[str] = []  # why auto gave up compiling in this process


def auto_kernels(device: torch.device, head_dim: int) -> LayerKernels:
    """What ``auto`` runs on ``device`` for a model of ``head_dim``: on CUDA the ``flex`` set
    (the rounds' attention as one kernel; chosen before any GPU measured it, so that the next
    measurement runs the default it judges) where heads have at least 16 dims (smaller
    heads, only test models', stay on the written kernels: whether Triton's flex kernel takes
    them is not checked) and no compiled set failed to compile in this process
    (:func:`auto_failed`); otherwise :data:`EAGER` (a CPU runs rounds step by step)."""
    if device.type == "cuda" and head_dim >= 16 and not _auto_failures:
        return kernel_set("flex")
    return EAGER


def is_compile_error(exc: BaseException) -> bool:
    """Whether ``exc`` is ``torch.compile``'s (Dynamo's or Inductor's; none can be where Dynamo
    was never imported, so this imports nothing)."""
    dynamo = sys.modules.get("torch._dynamo.exc")
    return dynamo is not None and isinstance(exc, dynamo.TorchDynamoException)


def auto_failed(exc: BaseException) -> None:
    """Record that a compiled set failed to compile (``exc``): ``auto`` runs :data:`EAGER`
    from now on, in every model of the process (a compiler that fails for one model fails
    for the others); logged once."""
    if not _auto_failures:
        log.warning("torch.compile failed; the written kernels run from now on: %s", exc)
    _auto_failures.append(f"{type(exc).__name__}: {exc}"[:2000])


def kernel_set(name: str) -> LayerKernels:
    """The kernel set called ``name`` (:data:`KERNEL_SETS`); the compiled ones are made once
    per process. Raises ValueError for another name."""
    sets = {"eager": lambda: EAGER, "compiled": compiled_kernels, "flex": flex_kernels}
    sets["layer"] = layer_kernels
    if name not in sets:
        raise ValueError(f"kernels must be one of {KERNEL_SETS}, not {name!r}")
    return sets[name]()
