"""A GGUF model in one llama.cpp context: :class:`LlamaCppModel` (see the package notes)."""

from __future__ import annotations

import ctypes
import os
import threading
import weakref
from pathlib import Path

import numpy as np
import torch

from smcspec.backends.cpu_share import FairShare
from smcspec.backends.llamacpp.lib import library
from smcspec.backends.llamacpp.sequences import SequenceCache
from smcspec.backends.llamacpp.settings import LlamaCppSettings, physical_cores
from smcspec.backends.pool import Lease, ResourcePool
from smcspec.errors import ContextLengthError, ModelFileError


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
        lib = self._lib = library()
        self.settings = settings = settings or LlamaCppSettings()
        self.path = Path(path)
        settings.validate(int(getattr(lib, "LLAMA_MAX_SEQ", 256)))
        self.device = torch.device(settings.logits_device)
        for name, value in settings.environment().items():
            os.environ.setdefault(name, value)
        mparams = lib.llama_model_default_params()
        mparams.n_gpu_layers = settings.gpu_layers
        self._devices = None  # the device array must outlive the model
        if settings.rpc_servers:
            from smcspec.backends.llamacpp.rpc import local_gpus, rpc_devices

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
        self._adapter = None
        if settings.lora is not None:
            self._apply_lora(lib, settings.lora)
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
        self._free = weakref.finalize(
            self, _free_context, lib, self._model, self._ctx, self._batch
        )

    def _apply_lora(self, lib, path: str) -> None:
        """Load the LoRA adapter GGUF ``path`` and apply it to this context at scale 1.

        Raises:
            ModelFileError: llama.cpp cannot load it (another architecture, shapes that do
                not fit this model) or apply it.
        """
        self._adapter = lib.llama_adapter_lora_init(self._model, str(path).encode())
        applied = -1
        if self._adapter:
            adapters = (lib.llama_adapter_lora_p_ctypes * 1)(self._adapter)
            scales = (ctypes.c_float * 1)(1.0)
            applied = lib.llama_set_adapters_lora(self._ctx, adapters, 1, scales)
        if applied != 0:
            _free_context(lib, self._model, self._ctx, None)
            raise ModelFileError(f"llama.cpp cannot apply the LoRA adapter {path} to {self.path}")

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
            alive = self._free.alive  # a cache closed after release(): nothing to clear
            for s in lease.items.get("ids", []):
                if alive:
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
    def prefill(
        self,
        prompt: torch.Tensor,
        cache: SequenceCache,
        start: int = 0,
        end: int | None = None,
        all_logits: bool = False,
    ) -> torch.Tensor | None:
        """Decode ``prompt`` (int64 ``[P]``) once and share it with every row; or only its
        positions ``start .. end - 1``, a chunk of a prompt run in pieces, in order (each
        chunk starts where the one before ended; the rows share the prompt once its last
        chunk has run).

        Returns float32 ``[V]`` logits after the last prompt token (a copy, on
        :attr:`device`); None after a chunk that does not end the prompt. With
        ``all_logits``, every chunk's ``[end - start, V]``: llama.cpp computes the logits of
        every position of the chunk (row ``i``: the next token after position ``start + i``).

        Raises:
            ValueError: a chunk out of range or out of order.
            ContextLengthError: the KV cells are exhausted, or the cache was released.
        """
        n = prompt.shape[-1]
        end = n if end is None else end
        if not 0 <= start < end <= n or start != cache.prefilled or cache.prompt_len:
            raise ValueError(
                f"prefill chunk [{start}, {end}) of a {n}-token prompt, after {cache.prefilled}"
            )
        tokens = [int(t) for t in prompt[start:end].tolist()]
        cache._check_open()
        first, last = cache.ids[0], end == n
        with self._lock:
            rows = [(t, start + i, (first,), all_logits or (last and start + i == n - 1))
                    for i, t in enumerate(tokens)]  # fmt: skip
            logits = self._run(rows)
            cache.prefilled = end
            if all_logits:
                logits = logits.clone()  # llama.cpp's buffer: the next forward reuses it
            elif not last:
                return None
            else:
                logits = logits[0].clone() if self.device.type == "cpu" else logits[0]
            if not last:
                return logits
            for s in cache.ids[1:]:
                self._lib.llama_memory_seq_cp(self._memory, first, s, -1, -1)
        cache.prompt_len = n
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
        chunks of ``n_batch``; float32 ``[outputs, V]`` on :attr:`device` (on the CPU,
        llama.cpp's own buffer when one chunk). A row of several sequences is one token (one
        KV cell) shared by all of them."""
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
                return torch.from_numpy(view).to(self.device)
            out[done : done + m] = torch.from_numpy(view)
            done += m
        return (out if out is not None else torch.empty(0, self.n_vocab)).to(self.device)


def _free_context(lib, model, ctx, batch) -> None:
    """Free a context and its model (a LoRA adapter goes with the model)."""
    if batch is not None:
        lib.llama_batch_free(batch)
    lib.llama_free(ctx)
    lib.llama_model_free(model)
