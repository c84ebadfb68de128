"""Device kernels inside ``torch.profiler`` events recorded on a CPU: the counting rule of
``benchmarks/layer_kernels.py`` and ``benchmarks/request_kernels.py``.

Each aten operation the dispatcher runs stands for one CUDA kernel, as in eager CUDA PyTorch:
views, allocations and no-ops count none (:data:`NO_KERNEL`); operations whose CPU
implementation calls others, but which are one CUDA kernel, count one (:data:`ONE_KERNEL`:
reductions that a CPU starts with a ``fill_`` of the output, ``_fused_rms_norm``, a
composite on a CPU); any other operation counts the kernels of its children, or one if it
has none. Inside a compiled region each generated C++ kernel is an event (Inductor's
``cpp.enable_kernel_profile``, :data:`GENERATED`) and counts one, and each extern call
(``mm``, ``bmm``) one. GEMMs (:data:`GEMMS`) are counted apart from the small kernels.

:func:`instrumented` names the ranges counts are taken from (rounds, static forwards,
layers); :func:`calibration` and :func:`predict` turn counts into predicted H200 device
times (``benchmarks/layer_kernels.py``'s notes). Only torch is imported at the top (the
calibration check, ``benchmarks/request_kernels.py``, runs this rule on older code).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

from torch.profiler import record_function

CALIBRATION = Path(__file__).parent / "data" / "h200_calibration.json"

GENERATED = ("graph_", "cpp_")
"""How Inductor names its generated kernels in a profile (``graph_{n}_cpp_fused_...``, the
flex template's ``graph_{n}_kernel``)."""
GEMMS = frozenset({"aten::mm", "aten::addmm", "aten::_scaled_mm"})
NO_KERNEL = frozenset(
    f"aten::{name}"
    for name in (
        "view _unsafe_view _reshape_alias as_strided as_strided_ slice select expand expand_as "
        "transpose permute t unsqueeze unsqueeze_ squeeze squeeze_ alias detach narrow split "
        "split_with_sizes chunk unbind unfold view_as reshape flatten empty empty_strided "
        "empty_like resolve_conj resolve_neg result_type lift_fresh to contiguous type_as "
        "resize_ set_ scalar_tensor is_nonzero item _local_scalar_dense"
    ).split()
)
"""Operations that launch no device kernel (views, allocations; ``to`` and ``contiguous``
that change nothing have no children; a Python scalar in ``where`` stays on the host)."""
ONE_KERNEL = frozenset(
    f"aten::{name}"
    for name in (
        "_fused_rms_norm mean sum any all amax amin max min argmax argmin prod repeat bmm baddbmm"
    ).split()
)
"""One CUDA kernel each, whose CPU implementation calls other operations (a ``fill_`` of
the output first; ``_fused_rms_norm`` and ``mean`` are composites on a CPU; a CPU batched
GEMM may copy a transposed operand that cuBLAS reads as it is)."""


def kernels_of(event) -> tuple[int, int]:
    """``(gemms, small)`` kernels launched inside a profiler event (module notes)."""
    name = event.name
    if name in ONE_KERNEL:
        return 0, 1
    if name in GEMMS:
        return 1, 0
    gemm = small = 0
    for child in event.cpu_children:
        g, s = kernels_of(child)
        gemm, small = gemm + g, small + s
    if gemm or small:
        return gemm, small
    if name.startswith(GENERATED) or (name.startswith("aten::") and name not in NO_KERNEL):
        return 0, 1
    return 0, 0


def total(events: Iterable) -> tuple[int, int]:
    """``(gemms, small)`` of several events (none inside another)."""
    gemm = small = 0
    for e in events:
        g, s = kernels_of(e)
        gemm, small = gemm + g, small + s
    return gemm, small


def inside(event, label: str) -> list:
    """The outermost events named ``label`` under ``event``."""
    found = []
    for child in event.cpu_children:
        if child.name == label:
            found.append(child)
        else:
            found += inside(child, label)
    return found


def inside_or_self(event, label: str) -> list:
    return [event] if event.name == label else inside(event, label)


@contextlib.contextmanager
def instrumented() -> Iterator[None]:
    """Name the ranges counts are taken from, while inside: each round ``ROUND:{kind}`` (its
    key's first item: ``smc``, ``ar``, ``sd``, ``prefill``), each static forward
    ``FORWARD:{label}`` (the model's ``bench_label``), each layer of one ``LAYER``."""
    from smcspec.backends.torch.transformer import Block, Transformer

    layer, logits = Block.forward_static, Transformer._static_logits
    run_round = Transformer.run_round

    def forward_static(self, x, view):
        with record_function("LAYER"):
            return layer(self, x, view)

    def static_logits(self, tokens, view, last_only):
        with record_function(f"FORWARD:{getattr(self, 'bench_label', '?')}"):
            return logits(self, tokens, view, last_only)

    def marked_round(self, cache, key, fn, inputs):
        with record_function(f"ROUND:{key[0]}"):
            return run_round(self, cache, key, fn, inputs)

    Block.forward_static, Transformer._static_logits = forward_static, static_logits
    Transformer.run_round = marked_round
    try:
        yield
    finally:
        Block.forward_static, Transformer._static_logits = layer, logits
        Transformer.run_round = run_round


def calibration(path: Path = CALIBRATION) -> dict:
    """The committed calibration with its derived figures: ``gemm_share`` (of the device
    time), ``small_mean_us`` (a small kernel's mean device time) and ``gemm_bytes_per_s``
    (the GEMMs' effective bandwidth: the weight bytes they read over their time)."""
    c = json.loads(path.read_text())
    gemm_kernels = c["gemm_calls"] + c["gemm_extra_kernels"]
    small_ms = c["device_time_ms"] - c["gemm_time_ms"]
    w = c["weight_bytes"]
    per_round = c["k"] * w["draft"] + w["target"]
    read = c["rounds"] * per_round + w["draft"] + w["target"]  # the prefill reads each once
    return {
        **c,
        "gemm_share": c["gemm_time_ms"] / c["device_time_ms"],
        "small_mean_us": 1000 * small_ms / (c["kernels"] - gemm_kernels),
        "gemm_bytes_per_s": read / (c["gemm_time_ms"] / 1000),
    }


def predict(counts: dict, cal: dict, k: int) -> dict:
    """Device milliseconds the calibration predicts for :func:`at_depth`'s counts: each
    forward's GEMMs at the calibration's bandwidth, its small kernels at their mean; SMC-SD
    tokens/s at ``K + 1`` tokens a round, ``ar`` at one (the device's time only: no
    prefill, no host work between rounds)."""
    w, bw, mean = cal["weight_bytes"], cal["gemm_bytes_per_s"], cal["small_mean_us"] / 1000
    gemm_ms = {"draft": 1000 * w["draft"] / bw, "target": 1000 * w["target"] / bw}

    def ms(small: int, gemm: float) -> float:
        return round(gemm + small * mean, 3)

    smc = ms(counts["smc_round"][1], k * gemm_ms["draft"] + gemm_ms["target"])
    ar = ms(counts["ar_round"][1], gemm_ms["target"])
    return {
        "draft_step_ms": ms(counts["draft_step"][1], gemm_ms["draft"]),
        "target_forward_ms": ms(counts["target_forward"][1], gemm_ms["target"]),
        "ar_forward_ms": ms(counts["ar_forward"][1], gemm_ms["target"]),
        "smc_round_ms": smc,
        "ar_round_ms": ar,
        "smc_tokens_per_s": round(1000 * (k + 1) / smc, 1),
        "ar_tokens_per_s": round(1000 / ar, 1),
    }
