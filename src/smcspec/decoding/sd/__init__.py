"""Exact speculative decoding (``sd``): drafts verified so that the output is the target's.

* :mod:`.chain`: one chain of K drafted tokens a round from the draft model (Leviathan et
  al. 2023); its first token and block verification serve the other two.
* :mod:`.multi_sd`: N drafted chains a round, verified as a token tree (``-N`` >= 2).
* :mod:`.ngram`: drafts looked up in the text (prompt lookup), no draft model.
* :mod:`.fused`: chain and multi-draft rounds as single functions of device tensors.
* :mod:`.stats`: :class:`~smcspec.decoding.sd.stats.SdStats`, what each of the three reports.
* :mod:`.cost`: their rounds' forward shapes and cost (the tuner's and the roofline's).

The speculative rule and the tree's verification are pure tensor functions of the sampling
layer: :mod:`smcspec.sampling.speculative` and :mod:`smcspec.sampling.tree_verify`.

Step and fused bodies, written apart and tied only by draw-for-draw tests (the fused round
draws the step round's uniforms in its order):

* chain sd: the step round ``chain._round_steps`` (``_draft_block``, then
  :func:`.chain.verify_block`) and :func:`.fused.sd_round`:
  ``tests/test_fused_rounds.py`` (``test_fused_sd_rounds_draw_what_the_steps_draw``);
  :func:`.fused.sd_joined` over a bank: ``tests/test_joined_rounds.py``
  (``test_concurrent_requests_join_and_draw_what_they_draw_alone[sd]``);
* multi-draft sd: the step round ``multi_sd._tree_round_steps`` and
  :func:`.fused.multi_sd_round`: ``tests/test_multi_sd.py``
  (``test_fused_rounds_draw_what_the_steps_draw``); :func:`.fused.multi_sd_joined` over a
  bank: ``tests/test_joined_rounds.py``
  (``test_concurrent_requests_join_and_draw_what_they_draw_alone[multi-draft-sd]``);
* n-gram drafts: a step round only (the drafts are looked up in the text on the host).

The step rounds are not derived from the fused bodies: they carry the host work a fused
round cannot (a constraint's masks and matcher between the draft steps, a drafted stop token
or dead end ending the block early, ``draft_p_min``, the log-probabilities a request asks
for), and they yield forwards for the scheduler to batch and for llama.cpp, where a fused body
calls the torch backend's static forwards itself. What both share is the sampling layer's
(the speculative rule, the tree's verification, the categorical draw from uniforms).
"""

from smcspec.decoding.sd.chain import decode_sd, sd_caches, sd_program
from smcspec.decoding.sd.multi_sd import decode_multi_sd, multi_sd_caches, multi_sd_program
from smcspec.decoding.sd.ngram import decode_ngram_sd, ngram_caches, ngram_sd_program

__all__ = [
    "decode_multi_sd",
    "decode_ngram_sd",
    "decode_sd",
    "multi_sd_caches",
    "multi_sd_program",
    "ngram_caches",
    "ngram_sd_program",
    "sd_caches",
    "sd_program",
]
