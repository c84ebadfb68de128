"""The ``llamacpp`` backend: GGUF models run by llama.cpp's quantized kernels.

llama.cpp's C API comes from ``llama-cpp-python`` (its low-level ``llama_cpp`` module).
One model is one llama.cpp context with a **unified KV cache** shared by every request:

* a request's particles are **sequence ids** taken from the context's pool
  (:class:`SequenceCache`) and given back when the cache is garbage-collected;
* the prompt is decoded once into the first row's sequence and shared with the others by
  ``llama_memory_seq_cp`` (a KV cell can belong to several sequences: no data is copied);
* resampling (:meth:`SequenceCache.reorder`) and speculative rollback
  (:meth:`SequenceCache.truncate`) are sequence operations on cells, not copies of KV;
* one :meth:`LlamaCppModel.decode_batch` puts the rows of every request into one
  ``llama_batch`` (chunked to ``n_batch`` tokens, since a larger batch aborts the process);
* logits come back as float32 torch tensors over llama.cpp's own buffer (no copy), valid
  until the next forward of the same model; prefill logits are copied, as a program may
  hold them across another request's prefill.

All calls into one context hold the model's lock, so a model can be shared by threads.
"""

from __future__ import annotations

import ctypes
import os
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from smcspec.errors import ConfigError, ContextLengthError, ModelFileError

_KV_TYPES = {"f32": 0, "f16": 1}  # ggml_type ids
_INIT_LOCK = threading.Lock()
_INITIALISED = False
_LOG_CALLBACK = None  # llama.cpp's log callback (logs silenced), made on first use


def _llama():
    """The low-level ``llama_cpp`` module, with the backend initialised and logs silenced.

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
            _LOG_CALLBACK = llama_cpp.llama_log_callback(_silent)
            llama_cpp.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p())
            llama_cpp.llama_backend_init()
            _INITIALISED = True
    return llama_cpp


def _silent(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    pass


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
    """

    threads: int | None = None
    kv_cells: int = 32768
    max_sequences: int = 256
    n_batch: int = 512
    kv_type: str = "f16"


class SequenceCache:
    """The KV state of one request's ``rows`` particles: one llama.cpp sequence id each.

    ``length`` generated tokens are stored per row, at positions
    ``prompt_len .. prompt_len + length - 1`` (all rows advance together).
    """

    def __init__(self, model: LlamaCppModel, ids: list[int], capacity: int) -> None:
        self.model, self.ids, self.capacity = model, ids, capacity
        self.prompt_len = 0
        self.length = 0
        weakref.finalize(self, model._released.extend, list(ids))

    @property
    def rows(self) -> int:
        return len(self.ids)

    def truncate(self, length: int) -> None:
        """Roll every row back to ``length`` generated tokens (speculative rollback)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate to {length} (filled {self.length})")
        with self.model._lock:
            mem = self.model._memory
            for s in self.ids:
                self.model._lib.llama_memory_seq_rm(mem, s, self.prompt_len + length, -1)
        self.length = length

    def reorder(self, ancestors: torch.Tensor) -> None:
        """Make row ``i`` a copy of row ``ancestors[i]`` (resampling), by sequence operations.

        ``seq_cp`` adds the destination to the source's cells (a union), so a destination is
        cleared first, and a source that is itself overwritten is first parked in a spare
        sequence id. Raises ContextLengthError when no spare id is free.
        """
        anc = [int(a) for a in ancestors.tolist()]
        targets = [i for i, a in enumerate(anc) if a != i]
        if not targets or self.length == 0:  # rows hold the same prompt: nothing to do
            return
        model, lib = self.model, self.model._lib
        with model._lock:
            mem = model._memory
            parked: dict[int, int] = {}
            try:
                for j in sorted({anc[i] for i in targets} & set(targets)):
                    parked[j] = model._take_ids(1)[0]
                    lib.llama_memory_seq_cp(mem, self.ids[j], parked[j], -1, -1)
                for i in targets:
                    lib.llama_memory_seq_rm(mem, self.ids[i], -1, -1)
                    src = parked.get(anc[i], self.ids[anc[i]])
                    lib.llama_memory_seq_cp(mem, src, self.ids[i], -1, -1)
            finally:
                for spare in parked.values():
                    lib.llama_memory_seq_rm(mem, spare, -1, -1)
                    model._free_ids.append(spare)


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
        max_seq = int(getattr(lib, "LLAMA_MAX_SEQ", 256))
        if not 1 <= settings.max_sequences <= max_seq:
            raise ConfigError(f"max_sequences must be in [1, {max_seq}]")
        if settings.n_batch < settings.max_sequences:  # llama.cpp aborts (GGML_ASSERT)
            raise ConfigError(
                f"n_batch ({settings.n_batch}) must be >= max_sequences ({settings.max_sequences})"
            )
        if settings.threads is not None and settings.threads < 1:
            raise ConfigError(f"threads must be >= 1, got {settings.threads}")
        mparams = lib.llama_model_default_params()
        self._model = lib.llama_model_load_from_file(str(self.path).encode(), mparams)
        if not self._model:
            raise ModelFileError(f"llama.cpp cannot load {self.path}")
        self.threads = settings.threads or physical_cores()
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = settings.kv_cells
        cparams.n_batch = cparams.n_ubatch = settings.n_batch
        cparams.n_seq_max = settings.max_sequences
        cparams.n_outputs_max = 0  # n_batch
        cparams.n_outputs_max_per_seq = 0  # any number of logits per sequence (default 1)
        cparams.kv_unified = True
        if settings.kv_type not in _KV_TYPES:
            raise ConfigError(f"kv_type must be one of {', '.join(_KV_TYPES)}")
        cparams.type_k = cparams.type_v = _KV_TYPES[settings.kv_type]
        cparams.n_threads = cparams.n_threads_batch = self.threads
        self._ctx = lib.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            lib.llama_model_free(self._model)
            raise ModelFileError(f"llama.cpp cannot create a context for {self.path}")
        self._memory = lib.llama_get_memory(self._ctx)
        self.n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self._model))
        self.vocab_size = self.n_vocab
        self.context_length = lib.llama_model_n_ctx_train(self._model)
        self.n_batch = lib.llama_n_batch(self._ctx)
        self._batch = lib.llama_batch_init(self.n_batch, 0, 1)
        self._lock = threading.RLock()
        self._free_ids = list(range(settings.max_sequences - 1, -1, -1))
        self._released: list[int] = []  # ids of collected caches, cleared before reuse
        weakref.finalize(self, _free_context, lib, self._model, self._ctx, self._batch)

    # ------------------------------------------------------------------ sequences
    def token_texts(self, n: int | None = None) -> list[bytes]:
        """The text llama.cpp holds for token ids ``0 .. n-1`` (default: the vocabulary),
        as stored in the GGUF file (byte-level BPE tokens in their ``Ġ`` form)."""
        vocab = self._lib.llama_model_get_vocab(self._model)
        get = self._lib.llama_vocab_get_text
        return [get(vocab, i) or b"" for i in range(self.n_vocab if n is None else n)]

    def _take_ids(self, n: int) -> list[int]:
        self._reclaim()
        if len(self._free_ids) < n:
            raise ContextLengthError(
                f"out of llama.cpp sequence ids: {n} needed, {len(self._free_ids)} free of "
                f"{self.settings.max_sequences} (fewer particles or concurrent requests, or "
                "a larger max_sequences)"
            )
        return [self._free_ids.pop() for _ in range(n)]

    def _reclaim(self) -> None:
        while self._released:
            s = self._released.pop()
            self._lib.llama_memory_seq_rm(self._memory, s, -1, -1)
            self._free_ids.append(s)

    def new_cache(self, rows: int, capacity: int) -> SequenceCache:
        """A cache of ``rows`` particles holding up to ``capacity`` generated tokens each."""
        with self._lock:
            return SequenceCache(self, self._take_ids(rows), capacity)

    # ------------------------------------------------------------------ forwards
    def prefill(self, prompt: torch.Tensor, cache: SequenceCache) -> torch.Tensor:
        """Decode ``prompt`` (int64 ``[P]``) once and share it with every row.

        Returns float32 ``[V]`` logits after the last prompt token (a copy).
        """
        tokens = [int(t) for t in prompt.tolist()]
        first = cache.ids[0]
        with self._lock:
            rows = [(t, p, first, p == len(tokens) - 1) for p, t in enumerate(tokens)]
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
        rows: list[tuple[int, int, int, bool]] = []
        shapes = []
        for tokens, cache, last_only in items:
            r, t = tokens.shape
            if cache.length + t > cache.capacity:
                raise ContextLengthError(
                    f"KV cache full: {cache.length} + {t} > capacity {cache.capacity}"
                )
            base = cache.prompt_len + cache.length
            ids = tokens.tolist()
            for i, s in enumerate(cache.ids):
                for j in range(t):
                    rows.append((ids[i][j], base + j, s, not last_only or j == t - 1))
            shapes.append((r, 1 if last_only else t))
        with self._lock:
            logits = self._run(rows)
        for (tokens, cache, _), _shape in zip(items, shapes, strict=True):
            cache.length += tokens.shape[1]
        out, start = [], 0
        for r, t in shapes:
            out.append(logits[start : start + r * t].view(r, t, self.n_vocab))
            start += r * t
        return out

    def _run(self, rows: list[tuple[int, int, int, bool]]) -> torch.Tensor:
        """``llama_decode`` over ``(token, position, sequence, wants_logits)`` rows, in chunks
        of ``n_batch``; float32 ``[outputs, V]`` (llama.cpp's buffer when one chunk)."""
        lib, batch = self._lib, self._batch
        self._reclaim()
        n_out = sum(r[3] for r in rows)
        chunks = [rows[i : i + self.n_batch] for i in range(0, len(rows), self.n_batch)]
        out = None if len(chunks) == 1 else torch.empty(n_out, self.n_vocab)
        done = 0
        for chunk in chunks:
            for k, (tok, pos, seq, want) in enumerate(chunk):
                batch.token[k] = tok
                batch.pos[k] = pos
                batch.n_seq_id[k] = 1
                batch.seq_id[k][0] = seq
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
