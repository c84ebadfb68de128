"""Autoregressive decoding (``ar``), the baseline: one target forward a token.

* :mod:`.program`: the program (:func:`~smcspec.decoding.ar.program.ar_program`) and the
  cache it opens.
* :mod:`.fused`: the round as one function of device tensors (a CUDA graph), and the host
  copy that lets the next round launch before this one's token is read.
* :mod:`.stats`: :class:`~smcspec.decoding.ar.stats.ArStats`, what a request reports.
* :mod:`.cost`: the round's forward shapes and cost (the tuner's and the roofline's).

Step and fused bodies, written apart and tied only by draw-for-draw tests (the fused round
draws the step round's uniforms in its order):

* the step round ``program._ar_steps`` (a :class:`~smcspec.decoding.program.Forward` and
  ``_next_token`` a token) and the fused round :func:`.fused.ar_round` (pipelined by
  ``program._pipelined_rounds``): ``tests/test_fused_rounds.py``
  (``test_fused_ar_steps_draw_what_the_steps_draw``,
  ``test_pipelined_ar_rounds_stop_where_the_steps_stop``);
* :func:`.fused.ar_joined`, the fused round over a bank of requests:
  ``tests/test_joined_rounds.py`` (``test_concurrent_requests_join_and_draw_what_they_draw_alone``).

The step round is not derived from the fused body: it carries the host work a fused round
cannot (a constraint's mask from its matcher before each draw, the log-probabilities a request
asks for, top-p), and it yields forwards for the scheduler to batch and for llama.cpp, where
the fused body calls the torch backend's static forward itself.
"""

from smcspec.decoding.ar.program import ar_caches, ar_program, decode_ar

__all__ = ["ar_caches", "ar_program", "decode_ar"]
