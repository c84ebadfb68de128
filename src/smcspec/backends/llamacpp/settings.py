"""How a llama.cpp context is made (:class:`LlamaCppSettings`) and the CPU cores it
computes on by default."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from smcspec.errors import ConfigError

_KV_TYPES = {"f32": 0, "f16": 1}  # ggml_type ids


def physical_cores() -> int:
    """CPU cores this process may run on, counting hyper-threads of one core once."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    cores = set()
    for cpu in cpus:
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(((topo / "physical_package_id").read_text(), (topo / "core_id").read_text()))
        except OSError:
            cores.add(("", str(cpu)))
    return max(1, len(cores) or (os.cpu_count() or 1))


@dataclass(frozen=True)
class LlamaCppSettings:
    """How a llama.cpp context is made.

    Attributes:
        threads: compute threads (None: the physical cores, see :func:`physical_cores`).
        kv_cells: KV cells of the unified cache, shared by all requests and particles
            (prompt cells once per request, generated cells once per particle).
        max_sequences: sequence ids in the pool (each particle holds one).
        n_batch: most tokens per ``llama_decode`` call (larger batches are chunked); at
            least ``max_sequences``. llama.cpp keeps an output buffer of ``n_batch`` logit
            rows (311 MB at 512 for a 151,936-token vocabulary).
        kv_type: ``f16`` (llama.cpp's default) or ``f32`` KV storage.
        gpu_layers: layers offloaded to the devices (llama.cpp's ``n_gpu_layers``; -1: all,
            0: none, the CPU computes everything).
        rpc_servers: ``HOST:PORT`` of llama.cpp RPC servers whose devices take the offloaded
            layers, before any local GPU (:mod:`smcspec.backends.llamacpp.rpc`).
        fair_share: before each forward, lower the thread count to the cores other
            processes leave free (:mod:`smcspec.backends.cpu_share`), and raise it back when
            they are free again; only where nothing is offloaded. False: always ``threads``.
        cuda_graphs: let llama.cpp's CUDA backend replay its forwards as CUDA graphs. Off by
            default where layers are offloaded: on an H200 (CUDA 13, the llama.cpp of
            llama-cpp-python 0.3.36) every SMC-SD grid run (96-128 new tokens) with graphs on
            aborted with "illegal instruction" (6 runs over two lendings; with
            ``CUDA_LAUNCH_BLOCKING=1`` the fault surfaced at ``cudaGraphLaunch``), and the
            same grid with graphs off ran through (docs/gpu.md). llama.cpp reads the switch
            (the environment variable ``GGML_CUDA_DISABLE_GRAPHS``) once per process: the
            first offloaded model decides.
        logits_device: where forwards return their logits (``cpu``, or ``cuda[:i]`` with a
            CUDA build of PyTorch). llama.cpp always hands them over in host memory; on
            ``cuda`` they are copied to the GPU once per forward (37 MB for 8 x 9 rows of a
            128,256-token vocabulary), and the decoders' sampling, weighting and resampling
            run there instead of on the host CPU, where they took about half of an SMC-SD
            round on an H200 (docs/gpu.md). The model's ``device`` is this device.
        lora: a llama.cpp LoRA adapter GGUF applied to the model at scale 1 (a fitted draft,
            :mod:`smcspec.models.fitted_draft`); None: the model as it is.
    """

    threads: int | None = None
    kv_cells: int = 32768
    max_sequences: int = 256
    n_batch: int = 512
    kv_type: str = "f16"
    gpu_layers: int = 0
    rpc_servers: tuple[str, ...] = ()
    fair_share: bool = True
    cuda_graphs: bool = False
    logits_device: str = "cpu"
    lora: str | None = None

    def environment(self) -> dict[str, str]:
        """Environment variables llama.cpp must see before its first forward (set with
        ``os.environ.setdefault``, so a user's own value wins)."""
        if self.gpu_layers != 0 and not self.cuda_graphs:
            return {"GGML_CUDA_DISABLE_GRAPHS": "1"}
        return {}

    def offload(self) -> str | None:
        """What runs off this process's CPU, for the tuner's cost key (None: nothing)."""
        if self.gpu_layers == 0:
            return None
        return f"gpu_layers={self.gpu_layers};rpc={','.join(self.rpc_servers)}"

    def validate(self, max_seq: int) -> None:
        """Refuse what llama.cpp would abort on or misread (``max_seq``: its
        ``LLAMA_MAX_SEQ``), before anything is loaded. Raises :class:`ConfigError`."""
        if not 1 <= self.max_sequences <= max_seq:
            raise ConfigError(f"max_sequences must be in [1, {max_seq}]")
        if self.n_batch < self.max_sequences:  # llama.cpp aborts (GGML_ASSERT)
            raise ConfigError(
                f"n_batch ({self.n_batch}) must be >= max_sequences ({self.max_sequences})"
            )
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"threads must be >= 1, got {self.threads}")
        if self.gpu_layers < -1:
            raise ConfigError(f"gpu_layers must be -1 (all) or >= 0, got {self.gpu_layers}")
        if self.kv_type not in _KV_TYPES:
            raise ConfigError(f"kv_type must be one of {', '.join(_KV_TYPES)}")
        if self.logits_device != "cpu":
            import torch

            if not re.fullmatch(r"cuda(:\d+)?", self.logits_device):
                raise ConfigError(
                    f"logits_device must be cpu or cuda[:index], got {self.logits_device!r}"
                )
            if not torch.cuda.is_available():
                raise ConfigError(
                    f"logits_device {self.logits_device}: this PyTorch sees no CUDA device"
                )

    def context_params(self, lib: Any, threads: int) -> Any:
        """llama.cpp's ``llama_context_params`` for these settings: one unified KV cache of
        ``kv_cells`` cells, ``n_batch``-token batches and any number of logit rows per
        sequence, ``threads`` compute threads."""
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = self.kv_cells
        cparams.n_batch = cparams.n_ubatch = self.n_batch
        cparams.n_seq_max = self.max_sequences
        cparams.n_outputs_max = 0  # n_batch
        cparams.n_outputs_max_per_seq = 0  # any number of logits per sequence (default 1)
        cparams.kv_unified = True
        cparams.type_k = cparams.type_v = _KV_TYPES[self.kv_type]
        cparams.n_threads = cparams.n_threads_batch = threads
        return cparams
