"""Autoregressive decoding (``ar``), the baseline: one target forward a token.

* :mod:`.program`: the program (:func:`~smcspec.decoding.ar.program.ar_program`) and the
  cache it opens.
"""

from smcspec.decoding.ar.program import ar_caches, ar_program, decode_ar

__all__ = ["ar_caches", "ar_program", "decode_ar"]
