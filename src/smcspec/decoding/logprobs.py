"""Token log-probabilities, for requests that ask for them (OpenAI's ``logprobs``).

Which distribution (``cfg.logprobs_mode``, named as vLLM names its ``logprobs_mode``):

* ``"processed_logprobs"`` (the default, what OpenAI documents): the distribution the token
  was sampled from: the target after temperature, the top-k / top-p / min-p filters and the
  constraint's mask, renormalised (``p~``, or ``norm(p~ * m)`` under a constraint). For
  ``ar`` and ``sd`` (chain, n-gram and multi-draft) that *is* the output's distribution at
  each position; for ``sd`` it is the target's row at each accepted or corrected position,
  whether the token came from the draft, the residual or the bonus. For SMC-SD it is the
  target's distribution at each position of the particle that was drawn (the sampler targets
  the product of those, at ``alpha`` = 1; its tokens are drafted from the draft and
  reweighted, so they are not draws from this distribution one by one). Greedy decoding
  (temperature 0) samples a point mass; its values are those of the untempered
  ``log_softmax`` after the filters and the mask, as vLLM reports them.
* ``"raw_logprobs"``: the model's own ``log_softmax(logits)`` at temperature 1, before any
  filter or mask.

Prompt log-probabilities (``cfg.prompt_logprobs``, the ``echo`` of OpenAI's completions) are
always raw: the model's likelihood of the prompt, what loglikelihood evaluations read.

Everything here is computed only when ``cfg.logprobs`` is set (None: off, the default, which
costs nothing); ``cfg.logprobs`` is also how many of the most likely alternatives each
position reports (0 to :data:`MAX_TOP_LOGPROBS`), ranked by the same distribution.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from smcspec.config import LOGPROBS_MODES, MAX_TOP_LOGPROBS

__all__ = ["LOGPROBS_MODES", "MAX_TOP_LOGPROBS", "TokenLogprobs", "token_logprobs"]


@dataclass
class TokenLogprobs:
    """Log-probabilities of a run of tokens (host values, float).

    Attributes:
        token_ids: the tokens, in order.
        logprobs: ``log p(token)`` of each (nats; ``-inf`` possible only in raw mode's
            alternatives, never for a sampled token under the processed distribution).
        top_ids, top_logprobs: per token, the most likely alternatives under the same
            distribution, most likely first (as many as the request asked for).
    """

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.token_ids)

    def extend(self, other: TokenLogprobs) -> None:
        """Append ``other``'s tokens."""
        self.token_ids += other.token_ids
        self.logprobs += other.logprobs
        self.top_ids += other.top_ids
        self.top_logprobs += other.top_logprobs

    def slice(self, start: int, stop: int | None = None) -> TokenLogprobs:
        """Tokens ``start .. stop - 1`` (a copy)."""
        s = slice(start, stop)
        return TokenLogprobs(
            self.token_ids[s], self.logprobs[s], self.top_ids[s], self.top_logprobs[s]
        )


def logprob_tensors(
    processed: torch.Tensor | None,
    logits: torch.Tensor,
    tokens: torch.Tensor,
    top: int,
    mode: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Device tensors of the log-probabilities of ``tokens`` (no host read).

    Args:
        processed: float32 ``[..., V]`` the processed log-probs the tokens were sampled from
            (before a greedy point mass); unused in raw mode (may be None then).
        logits: ``[..., V]`` the model's logits at the same positions (raw mode).
        tokens: int64 ``[...]``.
        top: alternatives per position (``k`` >= 0).
        mode: one of :data:`LOGPROBS_MODES`.
    Returns:
        ``(lp, top_ids, top_lp)``: float32 ``[...]``, int64 ``[..., k]``, float32 ``[..., k]``.
    """
    if mode == "raw_logprobs" or processed is None:
        dist = torch.log_softmax(logits.float(), dim=-1)
    else:
        dist = processed.float()
    lp = dist.gather(-1, tokens[..., None].long())[..., 0]
    k = min(top, dist.shape[-1])
    top_lp, top_ids = dist.topk(k, dim=-1) if k > 0 else (dist[..., :0], tokens[..., None][..., :0])
    return lp, top_ids, top_lp


def to_host(lp: torch.Tensor, top_ids: torch.Tensor, top_lp: torch.Tensor,
            tokens: list[int]) -> TokenLogprobs:  # fmt: skip
    """:class:`TokenLogprobs` of ``tokens`` from :func:`logprob_tensors`' outputs (one
    position per token, leading dims flattened), in one host read per tensor kind."""
    n = len(tokens)
    k = top_ids.shape[-1]
    lps = lp.reshape(n).double().tolist()
    ids = top_ids.reshape(n, k).tolist()
    vals = top_lp.reshape(n, k).double().tolist()
    return TokenLogprobs(list(tokens), lps, ids, vals)


def token_logprobs(
    processed: torch.Tensor | None,
    logits: torch.Tensor,
    tokens: list[int],
    top: int,
    mode: str,
) -> TokenLogprobs:
    """:class:`TokenLogprobs` of ``tokens`` (``R`` of them), each at its own row of
    ``processed`` / ``logits`` (``[R, V]``): see :func:`logprob_tensors`."""
    t = torch.tensor(tokens, dtype=torch.long, device=logits.device)
    return to_host(*logprob_tensors(processed, logits, t, top, mode), tokens)


def prompt_logprobs(logits: torch.Tensor, targets: torch.Tensor, top: int) -> TokenLogprobs:
    """The raw log-probabilities of the prompt tokens ``targets`` (int64 ``[R]``), each
    predicted by its row of ``logits`` (``[R, V]``: the positions before them)."""
    t = targets.to(logits.device)
    return to_host(*logprob_tensors(None, logits, t, top, "raw_logprobs"), t.tolist())
