"""Autoregressive decoding (``ar``), the baseline: one target forward a token.

* :mod:`.program`: the program (:func:`~smcspec.decoding.ar.program.ar_program`) and the
  cache it opens.
* :mod:`.fused`: the round as one function of device tensors (a CUDA graph), and the host
  copy that lets the next round launch before this one's token is read.
* :mod:`.stats`: :class:`~smcspec.decoding.ar.stats.ArStats`, what a request reports.
* :mod:`.cost`: the round's forward shapes and cost (the tuner's and the roofline's).
"""

from smcspec.decoding.ar.program import ar_caches, ar_program, decode_ar

__all__ = ["ar_caches", "ar_program", "decode_ar"]
