"""Multi-draft sd's tokens a round, predicted from the pair's measured distributions.

Multi-draft sd (:mod:`smcspec.decoding.sd.multi_sd`) verifies N drafted chains from one prefix by
recursive rejection over their token tree (:mod:`smcspec.sampling.tree_verify`; SpecInfer,
Miao et al. 2024, section 4.2). At a node whose ``m`` chains propose ``x_1..x_m`` i.i.d. from
the draft's ``q``, candidate ``i`` is tried against the residual ``r_{i-1}`` (``r_0 = p``,
``r_i = norm(max(r_{i-1} - q, 0))``); ``r_i`` does not depend on which token was rejected, so
candidate ``i`` is accepted, given that the ones before it were not, with probability
``beta_i = sum_x min(r_{i-1}(x), q(x))``, and

    P(all m rejected) = prod_{i <= m} (1 - beta_i)                                  (1)

exactly, for one node's ``p`` and ``q``. After an acceptance the chains whose token there
equals the accepted one (the accepted chain and its duplicates) are the next node's
candidates.

**Measured** (:func:`tree_acceptance`), at every position of the calibration sd runs (the
same tempered distributions as the log-weight quantiles, :mod:`smcspec.tuning.measure`):
(1) for ``m = 1..M`` (:data:`MAX_CHAINS`), averaged over positions (``rejection[m-1]``), and,
by seeded simulation of the m draws and the tests, the distribution of the number of chains
that continue given an acceptance (``continuing[m-1][c-1]``, ``c = 1..m``).

**Predicted** (:func:`multi_sd_tokens_per_round`): a Markov chain over the number of
candidates ``m`` at the node of depth ``j``, ``m_1 = N``: the node accepts with probability
``a(m) = 1 - (1 - alpha) rejection[m-1] / rejection[0]`` and then has ``c`` candidates at the
next depth with probability ``continuing[m-1][c-1]``; tokens a round are
``1 + sum_{j=1..K} P(depths 1..j accepted)``. Assumptions: (a) the node of each depth is a
position drawn independently from the calibration positions (as
:func:`~smcspec.tuning.predict.predicted_ess` treats tokens); (b) the chains through a node
draw i.i.d. from ``q`` (true: a chain's next token depends on its own prefix only); (c) the
gain over one chain is anchored on the run-measured chain ``alpha`` (Leviathan et al.'s, the
one chain sd is priced at): the rejection with m candidates is ``1 - alpha`` times its
measured ratio to the rejection with one. With N = 1 the chain never branches and
``a(1) = alpha``: ``1 + sum_j alpha^j``, chain sd's ``(1 - alpha^(K+1)) / (1 - alpha)``
(Leviathan et al. 2023, eq. 1).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from smcspec.errors import ConfigError

MAX_CHAINS = 8
"""The largest N whose tree acceptance is measured (multi-draft settings above it are not
predicted)."""


def _residual(r: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    res = (r - q).clamp_min(0)
    mass = res.sum()
    return res / mass if mass > 0 else r


def tree_acceptance(
    lp: torch.Tensor, lq: torch.Tensor, max_chains: int = MAX_CHAINS, draws: int = 64, seed: int = 0
) -> tuple[list[float], list[list[float]]]:
    """``(rejection, continuing)`` of the module notes from the tempered log-probabilities
    ``lp`` (target) and ``lq`` (draft), float ``[L, V]`` at ``L`` positions.

    ``rejection``: ``max_chains`` floats, ``rejection[m-1]`` the mean over positions of
    eq. (1) (exact per position). ``continuing``: ``max_chains`` rows, row ``m-1`` the
    probabilities of ``c = 1..m`` chains continuing given that a node of ``m`` candidates
    accepted, pooled over positions and ``draws`` seeded draws of the m candidates each (a
    row with no acceptance at all: one chain continues). Positions measured in parts (one
    prompt at a time, to keep one ``[L, V]`` pair in memory): :class:`TreeSums`.

    Raises:
        ConfigError: ``lp`` and ``lq`` differ in shape, are empty, or ``max_chains < 1``.
    """
    sums = TreeSums(max_chains, draws, torch.Generator().manual_seed(seed))
    sums.add(lp, lq)
    return sums.result()


class TreeSums:
    """:func:`tree_acceptance` pooled over parts: :meth:`add` each part's ``[L, V]``
    log-probabilities (the seeded generator ``generator`` carried across them), then
    :meth:`result`."""

    def __init__(self, max_chains: int, draws: int, generator: torch.Generator) -> None:
        if max_chains < 1:
            raise ConfigError("tree_acceptance needs max_chains >= 1")
        self.m_max, self.draws, self.g = max_chains, draws, generator
        self.rejection = torch.zeros(max_chains, dtype=torch.float64)
        self.joint = torch.zeros(max_chains, max_chains, dtype=torch.float64)  # [m-1, c-1]
        self.positions = 0

    def add(self, lp: torch.Tensor, lq: torch.Tensor) -> None:
        """Add the positions of one part (float ``[L, V]``, equal shapes, L >= 1)."""
        if lp.shape != lq.shape or lp.ndim != 2 or lp.shape[0] < 1:
            raise ConfigError("tree_acceptance needs log-probabilities [L, V] of equal shape")
        m_max, draws, g = self.m_max, self.draws, self.g
        for p, q in zip(lp.double().exp(), lq.double().exp(), strict=True):
            r, rs, beta = p, [], []
            for _ in range(m_max):
                rs.append(r)
                beta.append(float(torch.minimum(r, q).sum()))
                r = _residual(r, q)
            beta_t = torch.tensor(beta, dtype=torch.float64).clamp(0, 1)
            self.rejection += torch.cumprod(1 - beta_t, 0)
            x = torch.multinomial(q.float(), draws * m_max, replacement=True, generator=g)
            x = x.view(draws, m_max)
            u = torch.rand(draws, m_max, generator=g, dtype=torch.float64)
            r_at = torch.stack([rs[i][x[:, i]] for i in range(m_max)], 1)  # r_{i-1}(x_i)
            test = u * q[x] < r_at  # [draws, M]: candidate i would be accepted if tried
            for m in range(1, m_max + 1):
                hit = test[:, :m]
                took = hit.any(1)
                first = hit.int().argmax(1)
                token = x[torch.arange(draws), first]
                count = (x[:, :m] == token[:, None]).sum(1)[took]  # chains through the child
                counts = torch.bincount(count - 1, minlength=m_max)[:m_max].double()
                self.joint[m - 1] += counts / draws
        self.positions += lp.shape[0]

    def result(self) -> tuple[list[float], list[list[float]]]:
        """``(rejection, continuing)`` over every position added.

        Raises:
            ConfigError: no position was added.
        """
        if self.positions < 1:
            raise ConfigError("tree_acceptance needs log-probabilities [L, V] of equal shape")
        rejection = self.rejection / self.positions
        continuing = []
        for m in range(1, self.m_max + 1):
            row = self.joint[m - 1, :m]
            total = float(row.sum())
            continuing.append(
                [round(float(v) / total, 6) for v in row] if total > 0 else [1.0] + [0.0] * (m - 1)
            )
        return [round(float(v), 6) for v in rejection], continuing


def multi_sd_tokens_per_round(
    alpha: float,
    chains: int,
    draft_tokens: int,
    rejection: Sequence[float],
    continuing: Sequence[Sequence[float]],
) -> float:
    """Expected tokens of one multi-draft sd round of N = ``chains`` chains and K =
    ``draft_tokens`` drafts (the accepted depth plus the target's token), by the Markov chain
    of the module notes, at the chain acceptance ``alpha`` and the measured ``rejection``
    and ``continuing`` (:func:`tree_acceptance`). In ``[1, K + 1]``; N = 1 gives chain sd's
    ``(1 - alpha^(K+1)) / (1 - alpha)`` up to rounding.

    Raises:
        ConfigError: N < 1 or above the chains measured, K < 0, or alpha outside [0, 1].
    """
    if not 1 <= chains <= len(rejection) or draft_tokens < 0 or not 0 <= alpha <= 1:
        raise ConfigError(
            f"multi-draft sd is predicted for 1 <= N <= {len(rejection)}, K >= 0, alpha in "
            f"[0, 1]; got N={chains}, K={draft_tokens}, alpha={alpha}"
        )
    single = rejection[0]
    ratio = np.array([v / single if single > 0 else 1.0 for v in rejection], dtype=np.float64)
    accept = 1.0 - (1.0 - alpha) * np.minimum(ratio, 1.0)  # a(m), m = 1..M
    m_max = len(rejection)
    move = np.zeros((m_max, m_max))  # [m-1, c-1]: accept at m candidates, c at the next depth
    for m in range(1, m_max + 1):
        move[m - 1, :m] = accept[m - 1] * np.asarray(continuing[m - 1][:m], dtype=np.float64)
    dist = np.zeros(m_max)
    dist[chains - 1] = 1.0
    tokens = 1.0
    for _ in range(draft_tokens):
        dist = dist @ move
        tokens += float(dist.sum())
    return tokens
