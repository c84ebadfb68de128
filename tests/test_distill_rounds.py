"""``smcspec.distill.rounds``: SMC-SD's rounds simulated on per-position distributions.

Statistical checks on a small vocabulary whose limits are known exactly: with the draft equal
to the target every weight is 1 (ESS = N); as N grows the round's ESS tends to
``N exp(-sum D2)`` and the kept particle's tokens to the target's own (their ``-log p`` to the
target's entropy). Fixed seeds; tolerances stated per check, each a few standard errors of
the estimate at these sizes and well inside the gap to the broken variants named below.
"""

from __future__ import annotations

import pytest
import torch

from smcspec.distill.rounds import simulate_rounds


def _pair(seed: int, positions: int = 12, vocab: int = 5, scale: float = 0.6):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, positions, vocab, generator=g, dtype=torch.float64) * scale
    lp, lq = torch.log_softmax(logits, -1)
    return lp, lq


def test_the_target_as_its_own_draft_keeps_every_particle():
    lp, _ = _pair(0)
    sim = simulate_rounds(lp, lp.clone(), 8, 3, 4, torch.Generator().manual_seed(0))
    assert sim.blocks == 4
    assert sim.ess == pytest.approx(8, abs=1e-4)
    assert sim.ess_large_n == pytest.approx(8, abs=1e-4)


def test_at_many_particles_the_ess_and_the_kept_tokens_reach_their_limits():
    """N = 2048, 256 rounds a block (20 seeds: the ESS ratio 1.004 +- 0.001, the kept
    tokens' -log p minus the entropy 0.002 +- 0.009): the ESS within 2% of N exp(-sum D2),
    the kept tokens' -log p within 0.04 nats of the target's entropy. Broken variants, each
    outside its tolerance here: weights q/p (their ESS limit, ``N / prod E_q[(q/p)^2]``, is
    more than 10% away) and a particle kept uniformly (its -log p is the drafted tokens',
    more than 0.15 nats from the entropy)."""
    lp, lq = _pair(1)
    n, k = 2048, 3
    sim = simulate_rounds(lp, lq, n, k, 256, torch.Generator().manual_seed(1))
    assert sim.ess == pytest.approx(sim.ess_large_n, rel=0.02)
    entropy = float(-(lp.exp() * lp).sum(-1).mean())
    assert sim.kept_nll == pytest.approx(entropy, abs=0.04)
    # the checks above can fail: the broken variants' limits are far outside their tolerances
    inverted_second_moment = (2 * lq - lp).logsumexp(-1).view(-1, k).sum(1)  # log E_q[(q/p)^2]
    inverted = n * float((-inverted_second_moment).exp().mean())
    assert abs(inverted - sim.ess_large_n) > 0.1 * sim.ess_large_n
    assert abs(sim.draft_nll - entropy) > 0.15


def test_short_answers_and_bad_shapes():
    lp, lq = _pair(2, positions=2)
    assert simulate_rounds(lp, lq, 4, 3, 2, torch.Generator()) is None  # no whole block
    with pytest.raises(ValueError, match="one shape"):
        simulate_rounds(lp, lq[:, :3], 4, 1, 2, torch.Generator())
    with pytest.raises(ValueError, match="at least 1"):
        simulate_rounds(lp, lq, 0, 1, 2, torch.Generator())
