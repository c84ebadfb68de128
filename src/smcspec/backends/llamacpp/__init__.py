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
  hold them across another request's prefill. With ``LlamaCppSettings.logits_device``
  ``cuda`` every forward's logits are copied to the GPU instead, so that the decoders'
  host-side work (sampling, weighting, resampling) runs there.

All calls into one context hold the model's lock, so a model can be shared by threads.

Modules: :mod:`.lib` (the C API, loaded once), :mod:`.settings`, :mod:`.sequences` (a
request's particles as sequence ids), :mod:`.model`, :mod:`.rpc` (llama.cpp's RPC backend)
and :mod:`.faults` (ggml's abort callback).
"""

from smcspec.backends.llamacpp.model import LlamaCppModel
from smcspec.backends.llamacpp.sequences import SPARE, SequenceCache, copy_plan
from smcspec.backends.llamacpp.settings import LlamaCppSettings, physical_cores

__all__ = [
    "SPARE",
    "LlamaCppModel",
    "LlamaCppSettings",
    "SequenceCache",
    "copy_plan",
    "physical_cores",
]
