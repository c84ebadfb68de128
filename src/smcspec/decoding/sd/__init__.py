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
