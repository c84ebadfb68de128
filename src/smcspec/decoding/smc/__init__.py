"""SMC speculative decoding (``smc``, SMC-SD; Emara et al. 2026, arXiv:2604.15672).

The steps follow ``docs/smc-sd.md``:

* :mod:`.program`: the program (:func:`~smcspec.decoding.smc.program.smc_program`), the
  caches it opens and the loop of rounds.
* :mod:`.particles`: the particles between rounds, a round's proposal, and steps 1-2 (x0).
* :mod:`.block`: steps 3a-3e: drafting, the target's scoring and the bonus, the weights.
* :mod:`.extend`: what new tokens do to the particles, for block and cut rounds alike: the
  bonus draw (3d), the tokens kept (3c, 4), dead ends and twists (3e).
* :mod:`.fused`: steps 3a, 3b and 3d as one function of device tensors (a CUDA graph).
* :mod:`.round_end`: step 3f: resampling, banking, the epsilon stop, hosts for ended rows.
* :mod:`.cut`: rounds cut where the ESS falls (``round_end="ess"``).
* :mod:`.answer`: streaming, and step 5: the answer drawn from the particles.
* :mod:`.particle_logprobs`: every particle's token log-probabilities (``cfg.logprobs``).
* :mod:`.stats`: :class:`~smcspec.decoding.smc.stats.SmcStats`, what a request reports.
* :mod:`.cost`: the round's forward shapes and cost (the tuner's and the roofline's).

The hooks for constraints, rewards and twists are shared with multi-draft sd
(:mod:`smcspec.decoding.potential_hooks`). The weights and resampling are pure tensor functions
of the sampling layer, below this one:
:mod:`smcspec.sampling.smc_weights` (incremental log-weights, the power target and its bonus
weight, banking shares) and :mod:`smcspec.sampling.resampling` (ESS, the resamplers, group
weights).
"""

from smcspec.decoding.smc.program import decode_smc, smc_caches, smc_program

__all__ = ["decode_smc", "smc_caches", "smc_program"]
