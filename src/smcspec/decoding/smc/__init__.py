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

Step and fused bodies, written apart and tied only by draw-for-draw tests (the fused round
draws the step round's uniforms in its order); everything after the proposal (weights,
:mod:`.extend`, :mod:`.round_end`, :mod:`.cut`) is one body for both:

* the proposal step by step, :func:`.block.draft_block` and :func:`.block.score_block`, and
  as one round, :func:`.fused.smc_block`: ``tests/test_fused_rounds.py``
  (``test_fused_smc_rounds_draw_what_the_steps_draw``: bank and keep rules, alpha, groups,
  truncation, stratified resampling) and, for rounds cut where the ESS falls,
  ``tests/test_smc_cut.py`` (``test_fused_cut_rounds_draw_what_the_steps_draw``);
* :func:`.fused.smc_joined`, the proposal over a bank of requests:
  ``tests/test_joined_rounds.py``
  (``test_concurrent_smc_requests_join_and_draw_what_they_draw_alone``).

The step proposal is not derived from the fused body: under a constraint or a reward it
masks the draft and consumes the drafted tokens between the draft forwards (host work), and
it yields forwards for the scheduler to batch and for llama.cpp, where the fused body calls
the torch backend's static forwards itself.
"""

from smcspec.decoding.smc.program import decode_smc, smc_caches, smc_program

__all__ = ["decode_smc", "smc_caches", "smc_program"]
