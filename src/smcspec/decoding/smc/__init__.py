"""SMC speculative decoding (``smc``, SMC-SD; Emara et al. 2026, arXiv:2604.15672).

* :mod:`.program`: the program (:func:`~smcspec.decoding.smc.program.smc_program`) and the
  caches it opens.
* :mod:`.cut`: rounds cut where the ESS falls (``round_end="ess"``).
* :mod:`.potentials`: the hooks for constraints, rewards and twists.
* :mod:`.logprobs`: every particle's token log-probabilities (``cfg.logprobs``).

The weights and resampling are pure tensor functions of the sampling layer, below this one:
:mod:`smcspec.sampling.smc_weights` (incremental log-weights, the power target, banking
shares) and :mod:`smcspec.sampling.resampling` (ESS, the resamplers, group weights).
"""

from smcspec.decoding.smc.program import decode_smc, smc_caches, smc_program

__all__ = ["decode_smc", "smc_caches", "smc_program"]
