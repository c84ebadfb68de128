"""The ``llamacpp`` backend: GGUF models run by llama.cpp's quantized kernels.

llama.cpp's C API comes from ``llama-cpp-python`` (its low-level ``llama_cpp`` module).
One model is one llama.cpp context with a **unified KV cache** shared by every request:

* the context's sequence ids and KV cells are a :class:`~smcspec.backends.pool.ResourcePool`
  (``sequences``, ``kv_cells``): a request reserves what it can ever use when it is
  admitted and releases it explicitly (the released ids are cleared at once); a cache
  made without a lease reserves its own and gives it back in :meth:`SequenceCache.close`;
* the prompt is decoded once into the first row's sequence and shared with the others by
  ``llama_memory_seq_cp`` (a KV cell can belong to several sequences: no data is copied);
* resampling (:meth:`SequenceCache.reorder`) and speculative rollback
  (:meth:`SequenceCache.truncate`) are sequence operations on cells, not copies of KV;
* one :meth:`LlamaCppModel.decode_batch` puts the rows of every request into one
  ``llama_batch`` (chunked to ``n_batch`` tokens, since a larger batch aborts the process);
* distinct rows (:mod:`smcspec.backends.shared_rows`): particles of one request whose
  histories and new token are the same go into the batch as **one** token belonging to all
  their sequences (``n_seq_id > 1``): llama.cpp computes it once, stores one KV cell shared
  by those sequences and returns one logits row, which every particle gets. The plan orders
  the tokens so that each sequence's positions increase and its sharing set only shrinks
  (llama.cpp's batch checks); sequences that share a token have the same positions in the
  cache, since every row of a request advances together; rows of different requests are
  never merged;
* logits come back as float32 torch tensors over llama.cpp's own buffer (no copy), valid
  until the next forward of the same model; prefill logits are copied, as a program may
  hold them across another request's prefill.

All calls into one context hold the model's lock, so a model can be shared by threads.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import weakref
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from smcspec.backends.cpu_share import FairShare
from smcspec.backends.pool import Lease, ResourcePool
from smcspec.backends.shared_rows import RowHistories
from smcspec.errors import ConfigError, ContextLengthError, ModelFileError

_KV_TYPES = {"f32": 0, "f16": 1}  # ggml_type ids
_INIT_LOCK = threading.Lock()
_INITIALISED = False
_LOG_CALLBACK = None  # llama.cpp's log callback (logs silenced), made on first use


def _llama():
    """The low-level ``llama_cpp`` module, with the backend initialised and its log silenced but
    for errors.

    Raises:
        ConfigError: llama-cpp-python is not installed.
    """
    global _INITIALISED, _LOG_CALLBACK
    try:
        import llama_cpp
    except ImportError as exc:
        raise ConfigError(
            "the llamacpp backend needs llama-cpp-python (scripts/setup.sh builds it for this "
            "CPU); or use --backend torch"
        ) from exc
    with _INIT_LOCK:
        if not _INITIALISED:
            # the callback object must outlive every llama.cpp call: kept in the module
            _LOG_CALLBACK = llama_cpp.llama_log_callback(_errors_only)
            llama_cpp.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p())
            llama_cpp.llama_backend_init()
            _INITIALISED = True
    return llama_cpp


GGML_LOG_LEVEL_ERROR = 4  # ggml.h: NONE, DEBUG, INFO, WARN, ERROR, CONT


def _errors_only(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    """llama.cpp's log, silenced but for its errors (e.g. the CUDA error printed just before
    an abort), which go to stderr."""
    if level == GGML_LOG_LEVEL_ERROR:
        sys.stderr.write(text.decode("utf-8", "replace"))


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
            layers, before any local GPU (:mod:`smcspec.backends.llamacpp_rpc`).
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


SPARE = -1  # the spare sequence of a copy plan


def copy_plan(ancestors: list[int]) -> list[tuple[int, int]]:
    """Sequence copies that make row ``i`` a copy of row ``ancestors[i]`` for every ``i``,
    with one spare sequence (:data:`SPARE`) at most in use at any time.

    Returns ``(dst, src)`` pairs to run in order (``seq_rm(dst)`` then ``seq_cp(src, dst)``);
    ``dst == SPARE`` parks a row that is about to be overwritten while others still read it.
    Rows that nobody reads are overwritten first (peeling the trees of the ancestor graph);
    what is left are disjoint cycles, each broken by parking one row in the spare, which is
    free again once that cycle is done.
    """
    src = {i: a for i, a in enumerate(ancestors) if a != i}
    readers = Counter(src.values())
    ready = sorted((i for i in src if readers[i] == 0), reverse=True)
    ops: list[tuple[int, int]] = []
    while src:
        if not ready:  # only cycles remain: park one of their rows in the spare
            if readers[SPARE]:
                raise AssertionError("the spare is still read")  # cannot happen (see above)
            j = min(src)
            ops.append((SPARE, j))
            for i in src:
                if src[i] == j:
                    src[i] = SPARE
            readers[SPARE], readers[j] = readers[j], 0
            ready.append(j)
            continue
        i = ready.pop()
        s = src.pop(i)
        ops.append((i, s))
        readers[s] -= 1
        if s != SPARE and readers[s] == 0 and s in src:
            ready.append(s)
    return ops


class SequenceCache:
    """The KV state of one request's ``rows`` particles: one llama.cpp sequence id each,
    plus a spare id for resampling when ``rows > 1``.

    ``length`` generated tokens are stored per row, at positions
    ``prompt_len .. prompt_len + length - 1`` (all rows advance together). The ids come
    from ``lease`` (a request's reservation, released by its owner) or, without one, from
    a lease of the cache's own that :meth:`close` releases. ``histories`` tracks which rows
    hold identical tokens (:class:`~smcspec.backends.shared_rows.RowHistories`; with
    ``shared_rows`` off every row is computed).
    """

    def __init__(
        self,
        model: LlamaCppModel,
        lease: Lease,
        rows: int,
        capacity: int,
        owned: bool,
        shared_rows: bool = True,
    ):
        taken = lease.items.setdefault("taken", 0)
        need = rows + (1 if rows > 1 else 0)
        ids = lease.items["ids"][taken : taken + need]
        if len(ids) < need:
            raise ContextLengthError(
                f"the request reserved {len(lease.items['ids'])} llama.cpp sequences and "
                f"needs {taken + need}"
            )
        lease.items["taken"] = taken + need
        self.model, self.lease, self.capacity, self._owned = model, lease, capacity, owned
        self.ids, self.spare = ids[:rows], (ids[rows] if rows > 1 else None)
        self.prompt_len = 0
        self.length = 0
        self.histories = RowHistories(rows, shared=shared_rows)
        if owned:  # a direct user's cache: close() gives it back, collection as a last resort
            weakref.finalize(self, lease.release)

    @property
    def rows(self) -> int:
        return len(self.ids)

    def close(self) -> None:
        """Release the cache's own lease (a cache made without one); otherwise nothing: the
        request's reservation is released by its owner."""
        if self._owned:
            self.lease.release()

    def _check_open(self) -> None:
        if self.lease.released:
            raise ContextLengthError("this KV cache's sequences were released")

    def truncate(self, length: int) -> None:
        """Roll every row back to ``length`` generated tokens (speculative rollback)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate to {length} (filled {self.length})")
        self._check_open()
        with self.model._lock:
            mem = self.model._memory
            for s in self.ids:
                self.model._lib.llama_memory_seq_rm(mem, s, self.prompt_len + length, -1)
        self.histories.truncate(self.length - length)
        self.length = length

    def reorder(self, ancestors: torch.Tensor) -> None:
        """Make row ``i`` a copy of row ``ancestors[i]`` (resampling), by sequence operations.

        ``seq_cp`` adds the destination to the source's cells (a union, no KV is copied), so
        a destination is cleared first; the order and the one spare come from
        :func:`copy_plan`.
        """
        anc = [int(a) for a in ancestors.tolist()]
        if self.length == 0 or all(a == i for i, a in enumerate(anc)):
            return  # rows hold the same prompt: nothing to do
        self._check_open()
        lib, mem = self.model._lib, self.model._memory
        seq = {i: s for i, s in enumerate(self.ids)} | {SPARE: self.spare}
        with self.model._lock:
            try:
                for dst, src in copy_plan(anc):
                    lib.llama_memory_seq_rm(mem, seq[dst], -1, -1)
                    lib.llama_memory_seq_cp(mem, seq[src], seq[dst], -1, -1)
            finally:
                lib.llama_memory_seq_rm(mem, self.spare, -1, -1)
        self.histories.reorder(anc)


class LlamaCppModel:
    """A GGUF model in one llama.cpp context (see the module notes).

    Args:
        path: the GGUF file.
        settings: :class:`LlamaCppSettings`.
    Raises:
        ModelFileError: llama.cpp cannot load the file.
        ConfigError: llama-cpp-python is missing, or a setting is out of range.
    """

    device = torch.device("cpu")

    def __init__(self, path: str | os.PathLike, settings: LlamaCppSettings | None = None) -> None:
        lib = self._lib = _llama()
        self.settings = settings = settings or LlamaCppSettings()
        self.path = Path(path)
        settings.validate(int(getattr(lib, "LLAMA_MAX_SEQ", 256)))
        for name, value in settings.environment().items():
            os.environ.setdefault(name, value)
        mparams = lib.llama_model_default_params()
        mparams.n_gpu_layers = settings.gpu_layers
        self._devices = None  # the device array must outlive the model
        if settings.rpc_servers:
            from smcspec.backends.llamacpp_rpc import local_gpus, rpc_devices

            self._devices = rpc_devices(settings.rpc_servers, local_gpus())
            mparams.devices = ctypes.cast(self._devices, ctypes.c_void_p)
        self.offload = settings.offload()
        self._model = lib.llama_model_load_from_file(str(self.path).encode(), mparams)
        if not self._model:
            raise ModelFileError(f"llama.cpp cannot load {self.path}")
        self.threads = settings.threads or physical_cores()
        self._ctx = lib.llama_init_from_model(
            self._model, settings.context_params(lib, self.threads)
        )
        if not self._ctx:
            lib.llama_model_free(self._model)
            raise ModelFileError(f"llama.cpp cannot create a context for {self.path}")
        self._memory = lib.llama_get_memory(self._ctx)
        self.threads_now = self.threads  # what llama.cpp runs with (fair_share may lower it)
        self.set_fair_share(settings.fair_share)
        self.n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self._model))
        self.vocab_size = self.n_vocab
        self.context_length = lib.llama_model_n_ctx_train(self._model)
        self.n_batch = lib.llama_n_batch(self._ctx)
        # each token may belong to every sequence (distinct rows shared by several particles)
        self._batch = lib.llama_batch_init(self.n_batch, 0, settings.max_sequences)
        self._lock = threading.RLock()
        self._free_ids = list(range(settings.max_sequences - 1, -1, -1))
        self.pool = ResourcePool(
            self.path.name,
            {"sequences": settings.max_sequences, "kv_cells": settings.kv_cells},
            on_take=self._take_ids,
            on_release=self._give_back_ids,
        )
        self._free = weakref.finalize(self, _free_context, lib, self._model, self._ctx, self._batch)

    # ------------------------------------------------------------------ sequences

    def release(self) -> None:
        """Free the llama.cpp model and context now instead of at garbage collection
        (idempotent; the model cannot be used afterwards). A model on RPC servers must be
        released while they still run: freeing it talks to them, and llama.cpp aborts the
        process if they are gone."""
        self._free()

    def token_texts(self, n: int | None = None) -> list[bytes]:
        """The text llama.cpp holds for token ids ``0 .. n-1`` (default: the vocabulary),
        as stored in the GGUF file (byte-level BPE tokens in their ``Ġ`` form)."""
        vocab = self._lib.llama_model_get_vocab(self._model)
        get = self._lib.llama_vocab_get_text
        return [get(vocab, i) or b"" for i in range(self.n_vocab if n is None else n)]

    def _take_ids(self, lease: Lease) -> None:
        lease.items["ids"] = [self._free_ids.pop() for _ in range(lease.amounts["sequences"])]

    def _give_back_ids(self, lease: Lease) -> None:
        with self._lock:
            for s in lease.items.get("ids", []):
                self._lib.llama_memory_seq_rm(self._memory, s, -1, -1)
                self._free_ids.append(s)

    def cache_need(self, rows: int, capacity: int, prompt_len: int) -> dict[str, int]:
        """What a cache of ``rows`` particles, ``capacity`` generated tokens each, after a
        ``prompt_len``-token prompt can ever take from :attr:`pool`: a sequence id per row
        (and a spare for resampling) and, at most, the prompt's cells once plus every row's
        own generated cells."""
        return {
            "sequences": rows + (1 if rows > 1 else 0),
            "kv_cells": prompt_len + rows * capacity,
        }

    def new_cache(
        self, rows: int, capacity: int, lease: Lease | None = None, shared_rows: bool = True
    ) -> SequenceCache:
        """A cache of ``rows`` particles holding up to ``capacity`` generated tokens each.

        With ``lease`` (from :attr:`pool`, reserved with :meth:`cache_need`) the ids come
        from it; without, the cache reserves its own (prompt cells not counted) and must be
        closed (:meth:`SequenceCache.close`). ``shared_rows``: compute each distinct row of
        a forward once (the module notes); ``False`` computes every row.

        Raises:
            ContextLengthError: without a lease, the pool cannot hold the cache now.
        """
        if lease is not None:
            return SequenceCache(self, lease, rows, capacity, owned=False, shared_rows=shared_rows)
        need = self.cache_need(rows, capacity, 0)
        own = self.pool.try_reserve(need)
        if own is None:
            free = self.pool.free()
            raise ContextLengthError(
                f"out of llama.cpp sequence ids or KV cells: {need['sequences']} sequences and "
                f"{need['kv_cells']} cells needed, {free['sequences']} and {free['kv_cells']} "
                f"free of {self.settings.max_sequences} and {self.settings.kv_cells} (fewer "
                "particles or concurrent requests, or larger max_sequences/kv_cells)"
            )
        return SequenceCache(self, own, rows, capacity, owned=True, shared_rows=shared_rows)

    # ------------------------------------------------------------------ forwards
    def prefill(self, prompt: torch.Tensor, cache: SequenceCache) -> torch.Tensor:
        """Decode ``prompt`` (int64 ``[P]``) once and share it with every row.

        Returns float32 ``[V]`` logits after the last prompt token (a copy).
        """
        tokens = [int(t) for t in prompt.tolist()]
        cache._check_open()
        first = cache.ids[0]
        with self._lock:
            rows = [(t, p, (first,), p == len(tokens) - 1) for p, t in enumerate(tokens)]
            logits = self._run(rows)[0].clone()
            for s in cache.ids[1:]:
                self._lib.llama_memory_seq_cp(self._memory, first, s, -1, -1)
        cache.prompt_len = len(tokens)
        return logits

    def decode(
        self, tokens: torch.Tensor, cache: SequenceCache, last_only: bool = False
    ) -> torch.Tensor:
        """Append ``tokens`` (int64 ``[R, T]``) to every row; logits ``[R, T|1, V]``."""
        return self.decode_batch([(tokens, cache, last_only)])[0]

    def decode_batch(
        self, items: list[tuple[torch.Tensor, SequenceCache, bool]]
    ) -> list[torch.Tensor]:
        """Several requests' :meth:`decode` in one ``llama_batch``.

        Raises:
            ContextLengthError: a cache's capacity, or the KV cells, are exhausted (every
                request of the batch fails: its sequences may hold part of the batch).
        """
        rows: list[tuple[int, int, tuple[int, ...], bool]] = []
        plans = []
        for tokens, cache, last_only in items:
            r, t = tokens.shape
            cache._check_open()
            if r != cache.rows:
                raise ValueError(f"{r} token rows for a cache of {cache.rows} rows")
            if cache.length + t > cache.capacity:
                raise ContextLengthError(
                    f"KV cache full: {cache.length} + {t} > capacity {cache.capacity}"
                )
            base = cache.prompt_len + cache.length
            plan = cache.histories.plan(tokens.tolist(), last_only)
            for tok, j, members, want in zip(
                plan.tokens, plan.positions, plan.members, plan.outputs, strict=True
            ):
                rows.append((tok, base + j, tuple(cache.ids[i] for i in members), want))
            plans.append(plan)
        with self._lock:
            logits = self._run(rows)
        out, start = [], 0
        for (tokens, cache, last_only), plan in zip(items, plans, strict=True):
            cache.length += tokens.shape[1]
            cache.histories.commit(plan)
            n_out = sum(plan.outputs)
            out.append(plan.expand_logits(logits[start : start + n_out], last_only))
            start += n_out
        return out

    def set_fair_share(self, on: bool) -> None:
        """Follow the cores other processes leave free (see ``LlamaCppSettings.fair_share``;
        never where layers are offloaded), or run every forward with ``threads``."""
        self._share = None
        if on and self.offload is None:
            cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
            self._share = FairShare(self.threads, cpus)
        elif self.threads_now != self.threads:
            self._lib.llama_set_n_threads(self._ctx, self.threads, self.threads)
            self.threads_now = self.threads

    def _run(self, rows: list[tuple[int, int, tuple[int, ...], bool]]) -> torch.Tensor:
        """``llama_decode`` over ``(token, position, sequences, wants_logits)`` rows, in
        chunks of ``n_batch``; float32 ``[outputs, V]`` (llama.cpp's buffer when one chunk).
        A row of several sequences is one token (one KV cell) shared by all of them."""
        lib, batch = self._lib, self._batch
        if self._share is not None and self._share.update() != self.threads_now:
            self.threads_now = self._share.threads
            lib.llama_set_n_threads(self._ctx, self.threads_now, self.threads_now)
        n_out = sum(r[3] for r in rows)
        chunks = [rows[i : i + self.n_batch] for i in range(0, len(rows), self.n_batch)]
        out = None if len(chunks) == 1 else torch.empty(n_out, self.n_vocab)
        done = 0
        for chunk in chunks:
            for k, (tok, pos, seqs, want) in enumerate(chunk):
                batch.token[k] = tok
                batch.pos[k] = pos
                batch.n_seq_id[k] = len(seqs)
                ids = batch.seq_id[k]
                for m, seq in enumerate(seqs):
                    ids[m] = seq
                batch.logits[k] = want
            batch.n_tokens = len(chunk)
            rc = lib.llama_decode(self._ctx, batch)
            if rc == 1:
                raise ContextLengthError(
                    f"llama.cpp KV cache full ({self.settings.kv_cells} cells shared by all "
                    "requests): fewer concurrent requests or particles, or more kv_cells"
                )
            if rc != 0:
                raise RuntimeError(f"llama_decode failed with code {rc}")
            m = sum(r[3] for r in chunk)
            if m == 0:
                continue
            view = np.ctypeslib.as_array(lib.llama_get_logits(self._ctx), shape=(m, self.n_vocab))
            if out is None:
                return torch.from_numpy(view)
            out[done : done + m] = torch.from_numpy(view)
            done += m
        return out if out is not None else torch.empty(0, self.n_vocab)


def _free_context(lib, model, ctx, batch) -> None:
    lib.llama_batch_free(batch)
    lib.llama_free(ctx)
    lib.llama_model_free(model)


# llama.cpp's quantization types offered for a cheaper draft
QUANT_TYPES = {"Q8_0": 7, "Q4_0": 2, "Q4_K_S": 14, "Q4_K_M": 15, "Q3_K_M": 12, "Q2_K": 10}


def quantize_gguf(src: Path, dst: Path, kind: str, threads: int | None = None) -> Path:
    """Re-quantize ``src`` to llama.cpp type ``kind`` (e.g. ``Q4_0``) into ``dst``, once.

    Raises:
        ConfigError: unknown type; ModelFileError: llama.cpp failed.
    """
    if kind not in QUANT_TYPES:
        raise ConfigError(f"unknown quantization {kind!r}; choose from {', '.join(QUANT_TYPES)}")
    if dst.is_file():
        return dst
    lib = _llama()
    params = lib.llama_model_quantize_default_params()
    params.ftype = QUANT_TYPES[kind]
    params.nthread = threads or physical_cores()
    params.allow_requantize = True  # the source may itself be quantized (Q8_0, ...)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + ".tmp")
    rc = lib.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0:
        tmp.unlink(missing_ok=True)
        raise ModelFileError(f"llama.cpp could not quantize {src} to {kind} (code {rc})")
    tmp.rename(dst)
    return dst
