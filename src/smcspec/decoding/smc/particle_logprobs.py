"""SMC-SD's token log-probabilities, for requests that ask for them (``cfg.logprobs``).

Each particle keeps, beside its tokens, the log-probability of each of its tokens under the
target's distribution at that position (after temperature, the top-k / top-p / min-p filters
and the constraint's mask; or the model's raw one, :mod:`smcspec.decoding.logprobs`) and
the most likely alternatives there. They are written where the tokens are written (x0, the
drafted block and its bonus, the deferred bonus of ``round_end="ess"``) from the target's
rows the round computes anyway, and move with the tokens: reordered at resampling and banking
(:meth:`ParticleLogprobs.reorder`), set aside with a banked particle. The answer's values are
those of the particle drawn; a streamed token's are those of the first particle, which holds
it with the same prefix as every other particle (a token is streamed once every particle
holds it, so its distribution is the same in all of them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from smcspec.config import GenerationConfig
from smcspec.decoding.logprobs import TokenLogprobs, logprob_tensors, to_host
from smcspec.sampling.distributions import tempered_log_probs
from smcspec.sampling.masking import mask_log_probs
from smcspec.sampling.truncation import truncate_log_probs

Values = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""``(lp [...], top_ids [..., k], top_lp [..., k])`` of some positions (device tensors)."""


def position_values(
    cfg: GenerationConfig,
    logits: torch.Tensor,
    tokens: torch.Tensor,
    masks: torch.Tensor | None = None,
) -> Values:
    """The log-probabilities of ``tokens`` (int64 ``[...]``) at the target's ``logits``
    (``[..., V]``, the same positions): under ``p~`` (tempered and truncated as
    ``cfg`` says), masked where ``masks`` (bool ``[..., V]``) allows some token ``p~`` keeps
    (a row whose mask allows none is a dead end, never reported, left unmasked), or raw.
    Returns :data:`Values` with ``cfg.logprobs`` alternatives. No host read."""
    processed = None
    if cfg.logprobs_mode != "raw_logprobs":
        processed = truncate_log_probs(tempered_log_probs(logits, cfg.temperature), *cfg.truncation)
        if masks is not None:
            usable = (masks & (processed > -torch.inf)).any(-1, keepdim=True)
            masked = mask_log_probs(processed, masks | ~usable)
            processed = torch.where(usable, masked, processed)
    return logprob_tensors(processed, logits, tokens, cfg.logprobs or 0, cfg.logprobs_mode)


@dataclass
class ParticleLogprobs:
    """The log-probabilities of every particle's tokens (device tensors, column ``j`` for
    token ``j`` as in ``Particles.tokens``), and those of the particles banked so far (host
    values, in the order of ``Bank.entries``)."""

    lp: torch.Tensor  # float32 [N, cap]
    top_ids: torch.Tensor  # int64 [N, cap, k]
    top_lp: torch.Tensor  # float32 [N, cap, k]
    banked: list[TokenLogprobs] = field(default_factory=list)

    @classmethod
    def start(cls, n: int, cap: int, top: int, device: torch.device) -> ParticleLogprobs:
        """Room for ``n`` particles of ``cap`` tokens with ``top`` alternatives each."""
        return cls(
            torch.zeros(n, cap, device=device),
            torch.zeros(n, cap, top, dtype=torch.long, device=device),
            torch.zeros(n, cap, top, device=device),
        )

    def write(self, start: int, keep: torch.Tensor, values: Values) -> None:
        """Columns ``start .. start + m - 1`` of the rows not in ``keep`` (bool ``[N]``: rows
        whose tokens are not written either) take ``values`` (``[N, m]`` positions)."""
        lp, ids, vals = values
        m = lp.shape[1]
        cols = slice(start, start + m)
        k = keep[:, None]
        self.lp[:, cols] = torch.where(k, self.lp[:, cols], lp)
        self.top_ids[:, cols] = torch.where(k[..., None], self.top_ids[:, cols], ids)
        self.top_lp[:, cols] = torch.where(k[..., None], self.top_lp[:, cols], vals)

    def reorder(self, ancestors: torch.Tensor) -> None:
        """Particle ``i`` takes particle ``ancestors[i]``'s values (int64 ``[N]``)."""
        self.lp, self.top_ids, self.top_lp = (
            self.lp[ancestors],
            self.top_ids[ancestors],
            self.top_lp[ancestors],
        )

    def row(self, i: int, tokens: list[int], start: int = 0) -> TokenLogprobs:
        """Particle ``i``'s values of its tokens ``start .. start + len(tokens) - 1`` (host)."""
        cols = slice(start, start + len(tokens))
        return to_host(self.lp[i, cols], self.top_ids[i, cols], self.top_lp[i, cols], tokens)

    def bank(self, i: int, tokens: list[int]) -> None:
        """Set particle ``i``'s values of its ``tokens`` aside, with it (banking)."""
        self.banked.append(self.row(i, tokens))
