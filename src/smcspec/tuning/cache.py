"""The measured-costs cache: ``$SMCSPEC_CACHE/costs/<key hash>.json``, one file per machine,
backend, model pair and format version.

The key names the machine (the CPU model and vector extension from ``/proc/cpuinfo`` and its
core count, or the CUDA device's name), the compute threads, the backend, device and dtype, the
measurement's context length, and each model file by its resolved path, size and modification
time (a directory: each of its ``config.json`` and ``*.safetensors`` files), so a re-quantized
or replaced model is measured again. The key is stored in the file too and checked on reading; a
missing, unreadable, corrupt or mismatching file reads as empty (everything is measured again
and the file rewritten), never as an error.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from smcspec.models.loading import cache_root
from smcspec.tuning.predict import ForwardCosts, Shape, alpha_interval

if TYPE_CHECKING:
    from smcspec.config import GenerationConfig
    from smcspec.tuning.tunable import TunablePair

FORMAT_VERSION = 1
"""Bumped when the file's content or the way it is measured changes."""


@dataclass
class CostRecord:
    """What one cache file holds.

    Attributes:
        target, draft: median seconds per ``(rows, tokens)`` forward.
        target_range, draft_range: the fastest and slowest of the timed forwards per shape
            (absent in files written before they were kept).
        acceptance: per sampling key (:func:`sampling_key`), the sd run that measured alpha
            (``{"alpha", "draft_tokens", "new_tokens", "accepted", "drafted", "rounds"}``)
            and the log-weights and agreement profiles measured on its tokens
            (:class:`smcspec.tuning.measure.Acceptance`).
    """

    target: dict[Shape, float] = field(default_factory=dict)
    draft: dict[Shape, float] = field(default_factory=dict)
    acceptance: dict[str, dict[str, Any]] = field(default_factory=dict)
    target_range: dict[Shape, tuple[float, float]] = field(default_factory=dict)
    draft_range: dict[Shape, tuple[float, float]] = field(default_factory=dict)

    def add_timings(self, model: str, timings: dict[Shape, list[float]]) -> None:
        """Keep the median and the range of each shape's timed forwards for ``model``
        (``"target"`` or ``"draft"``)."""
        medians, ranges = getattr(self, model), getattr(self, f"{model}_range")
        for shape, times in timings.items():
            medians[shape] = statistics.median(times)
            ranges[shape] = (min(times), max(times))

    def forward_costs(self, acceptance: Mapping[str, Any] | None) -> ForwardCosts:
        """The :class:`~smcspec.tuning.predict.ForwardCosts` of this record's forwards with
        the pair's ``acceptance`` measurement (one value of :attr:`acceptance`, or one read
        from :mod:`smcspec.tuning.pair_stats`; None: no alpha, no fidelity prediction)."""
        acc = acceptance or {}
        alpha_range = None
        if acc.get("alpha") is not None and acc.get("rounds"):
            alpha_range = alpha_interval(
                acc["alpha"], acc["accepted"], acc["drafted"], acc["rounds"]
            )
        return ForwardCosts(
            target=self.target,
            draft=self.draft,
            alpha=acc.get("alpha"),
            target_range=self.target_range or None,
            draft_range=self.draft_range or None,
            alpha_range=alpha_range,
            log_weight_quantiles=acc.get("log_weight_quantiles"),
            draft_top_probs=acc.get("draft_top_probs"),
            target_top_probs=acc.get("target_top_probs"),
            tree_rejection=acc.get("tree_rejection"),
            tree_continuing=acc.get("tree_continuing"),
        )


#: x86 vector extensions, widest first, as ``/proc/cpuinfo`` flags and as printed.
_VECTOR_ISAS = (
    ("amx_tile", "AVX-512, AMX"), ("avx512f", "AVX-512"), ("avx2", "AVX2"), ("avx", "AVX"),
)  # fmt: skip


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name from ``cpuinfo``'s first ``model name`` line, with the widest x86
    vector extension its first ``flags`` line names in brackets (``"AMD EPYC (AVX-512)"``,
    ``"AMD EPYC (AVX2)"``); else what :mod:`platform` knows (the processor, or the machine
    type). Cloud VMs give one model name to CPUs of different generations, and llama.cpp's
    kernels follow the vector extension, so the name alone cannot tell apart two machines whose
    speeds differ about twofold (the records of ``docs/benchmarks/gsm8k-sc-400``)."""
    name, flags = None, None
    try:
        lines = cpuinfo.read_text().splitlines()
    except OSError:
        lines = []
    for ln in lines:
        if name is None and ln.startswith("model name"):
            name = ln.split(":", 1)[1].strip()
        elif flags is None and ln.startswith("flags"):
            flags = set(ln.split(":", 1)[1].split())
    isa = next((label for flag, label in _VECTOR_ISAS if flag in (flags or ())), "")
    if not name:
        return platform.processor() or platform.machine()
    return f"{name} ({isa})" if isa else name


def machine_name(device: str | torch.device) -> str:
    """The CUDA device's name, or ``"<CPU model> CPU, <n> cores"``."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"{cpu_model()} CPU, {os.cpu_count()} cores"


def file_identity(path: Path) -> dict[str, Any]:
    """A model's path, size and mtime (a directory: those of its config and weights; a
    fitted draft's: its manifest and adapter files)."""
    p = Path(path).resolve()
    kinds = ("config.json", "manifest.json", "*.safetensors", "*.gguf")
    files = [p] if p.is_file() else sorted(f for k in kinds for f in p.glob(k))
    return {
        "path": str(p),
        "files": [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files],
    }


def _threads(model: object) -> int:
    threads = getattr(model, "threads", None)
    return int(threads) if threads else torch.get_num_threads()


def _dtype(model: object) -> str:
    params = getattr(model, "parameters", None)
    if params is None:
        return "file"  # llamacpp computes with the file's own types
    first = next(iter(params()), None)
    return str(first.dtype).removeprefix("torch.") if first is not None else "file"


def cost_key(engine: TunablePair, context: int) -> dict[str, Any]:
    """The cache key of ``engine``'s pair on this machine (see the module notes)."""
    model = engine.target.model
    key = {
        "format": FORMAT_VERSION,
        "machine": machine_name(model.device),
        "threads": _threads(model),
        "backend": engine.target.backend,
        "device": str(model.device),
        "dtype": _dtype(model),
        "context": context,
        "target": file_identity(engine.target.path),
        "draft": file_identity(engine.draft.path) if engine.draft is not None else None,
    }
    offload = [getattr(m.model, "offload", None) for m in (engine.target, engine.draft) if m]
    if any(offload):  # GPU layers or RPC servers: costs measured there, keyed apart
        key["offload"] = offload
    rounds = getattr(model, "round_mode", "steps")
    if rounds != "steps":  # fused rounds time other forwards (graph replays): keyed apart
        key["rounds"] = rounds
    return key


def cache_file(key: dict[str, Any], root: Path | None = None) -> Path:
    """``<root>/costs/<first 16 hex digits of the key's SHA-256>.json`` (root: the cache)."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return (root or cache_root()) / "costs" / f"{digest}.json"


def sampling_key(config: GenerationConfig) -> str:
    """The key of an acceptance measurement: alpha depends on the temperatures and filters
    of ``config``. ``GenerationConfig()`` (the defaults) gives
    ``"T=0.7,Td=0.7,top_k=0,top_p=1.0,min_p=0.0"``, the key of the committed pair files."""
    c = config
    filters = f"top_k={c.top_k},top_p={c.top_p},min_p={c.min_p}"
    return f"T={c.temperature},Td={c.draft_temperature},{filters}"


def _shape_key(shape: Shape) -> str:
    return f"{shape[0]}x{shape[1]}"


def _parse_shapes(d: dict[str, Any]) -> dict[Shape, float]:
    out = {}
    for k, v in d.items():
        rows, tokens = (int(x) for x in k.split("x"))
        if not (isinstance(v, int | float) and v > 0):
            raise ValueError(f"bad cost {v!r}")
        out[(rows, tokens)] = float(v)
    return out


def _parse_ranges(d: dict[str, Any]) -> dict[Shape, tuple[float, float]]:
    out = {}
    for k, v in d.items():
        rows, tokens = (int(x) for x in k.split("x"))
        low, high = (float(x) for x in v)
        if not 0 < low <= high:
            raise ValueError(f"bad cost range {v!r}")
        out[(rows, tokens)] = (low, high)
    return out


def read_costs(path: Path, key: dict[str, Any]) -> CostRecord:
    """The record in ``path`` if it is readable, well formed and has ``key``; else empty."""
    try:
        data = json.loads(path.read_text())
        if data.get("key") != key:
            return CostRecord()
        acceptance = data.get("acceptance", {})
        if not all(0 <= a["alpha"] <= 1 for a in acceptance.values()):
            return CostRecord()
        return CostRecord(
            target=_parse_shapes(data["target"]),
            draft=_parse_shapes(data["draft"]),
            acceptance=dict(acceptance),
            target_range=_parse_ranges(data.get("target_range", {})),
            draft_range=_parse_ranges(data.get("draft_range", {})),
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return CostRecord()


def write_costs(path: Path, key: dict[str, Any], record: CostRecord) -> None:
    """Write ``record`` atomically (a temporary file renamed over ``path``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "key": key,
        "target": {_shape_key(s): v for s, v in sorted(record.target.items())},
        "draft": {_shape_key(s): v for s, v in sorted(record.draft.items())},
        "acceptance": record.acceptance,
        "target_range": {_shape_key(s): list(v) for s, v in sorted(record.target_range.items())},
        "draft_range": {_shape_key(s): list(v) for s, v in sorted(record.draft_range.items())},
    }
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
