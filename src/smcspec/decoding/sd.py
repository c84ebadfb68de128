"""Exact speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

Each round the draft proposes up to K tokens autoregressively, the target scores them in one
forward, :func:`~smcspec.sampling.speculative.speculative_verify` accepts a prefix and draws
the next token; rejected tokens are rolled back from both KV caches. The output is
distributed exactly as the target at temperature ``T_t``.

With top-k / top-p / min-p set, the target's and the draft's distributions are each
truncated and renormalised (``p~`` and ``q~``, with the same parameters, as vLLM does)
before the rule is applied: accept with ``min(1, p~(d)/q~(d))``, residual
``norm(max(p~ - q~, 0))``, first and bonus tokens from ``p~``. The output is then
distributed exactly as ``p~`` step by step (``docs/sampling.md``).

The draft's KV is kept one step behind (deferred feeding): the tokens it has not yet seen
(the last accepted draft token and the target's token) go into the next round's first draft
forward, so a round costs K draft forwards.
"""

from __future__ import annotations

import torch

from smcspec.config import GenerationConfig
from smcspec.decoding.common import (
    DecodeOutput,
    TokenCallback,
    as_prompt_tensor,
    cache_capacity,
    cut_at_stop,
)
from smcspec.decoding.program import Forward, Prefill, Program, run_program
from smcspec.models.transformer import Transformer
from smcspec.sampling.distributions import sample_categorical, tempered_log_probs
from smcspec.sampling.speculative import speculative_verify
from smcspec.sampling.truncation import truncate_log_probs


def sd_program(
    target: Transformer,
    draft: Transformer,
    prompt: list[int],
    cfg: GenerationConfig,
    stop_ids: frozenset[int],
    vocab: int,
    generator: torch.Generator,
    on_tokens: TokenCallback | None = None,
) -> Program:
    """Speculative sampling with ``cfg.draft_tokens`` draft tokens per round.

    Yields :class:`Prefill`/:class:`Forward` requests (see :mod:`smcspec.decoding.program`).

    Returns:
        :class:`DecodeOutput`; stats: ``rounds``, ``drafted``, ``accepted``,
        ``acceptance_rate`` (accepted / drafted) and ``mean_accepted_length``
        (1 + accepted / rounds, as vLLM defines it).
    """
    dev = target.device
    trunc = (cfg.top_k, cfg.top_p, cfg.min_p)
    cap = cache_capacity(cfg.max_new_tokens, cfg.draft_tokens)
    tcache, dcache = target.new_cache(1, cap), draft.new_cache(1, cap)
    p = as_prompt_tensor(prompt, dev)
    first_logits = (yield Prefill(target, p, tcache))[:vocab]
    yield Prefill(draft, p, dcache)
    first = truncate_log_probs(tempered_log_probs(first_logits, cfg.temperature), *trunc)
    tok = int(sample_categorical(first.exp(), generator))
    out = [tok]
    if on_tokens:
        on_tokens([tok])
    pending_t = tok  # fed to the target at the start of the next round
    pending_d = [tok]  # tokens the draft has not seen yet
    rounds = drafted = accepted = 0
    finished = tok in stop_ids or len(out) >= cfg.max_new_tokens
    while not finished:
        k = min(cfg.draft_tokens, cfg.max_new_tokens - len(out) - 1)
        d_tokens: list[int] = []
        d_probs = []
        d_len0 = dcache.length
        if k > 0:
            x = torch.tensor([pending_d], device=dev)
            for _ in range(k):
                logits = (yield Forward(draft, x, dcache, last_only=True))[0, -1, :vocab]
                q = truncate_log_probs(tempered_log_probs(logits, cfg.draft_temperature), *trunc)
                q = q.exp()
                d = int(sample_categorical(q, generator))
                d_tokens.append(d)
                d_probs.append(q)
                x = torch.tensor([[d]], device=dev)
        t_len0 = tcache.length
        block = torch.tensor([[pending_t, *d_tokens]], device=dev)
        t_logits = (yield Forward(target, block, tcache))[0, :, :vocab]
        t_probs = truncate_log_probs(tempered_log_probs(t_logits, cfg.temperature), *trunc).exp()
        if k > 0:
            n, nxt = speculative_verify(
                torch.tensor(d_tokens, device=dev), torch.stack(d_probs), t_probs, generator
            )
        else:
            n, nxt = 0, int(sample_categorical(t_probs[0], generator))
        rounds += 1
        drafted += k
        accepted += n
        new, stopped = cut_at_stop([*d_tokens[:n], nxt], stop_ids)
        new = new[: cfg.max_new_tokens - len(out)]
        out.extend(new)
        if on_tokens:
            on_tokens(new)
        finished = stopped or len(out) >= cfg.max_new_tokens
        # roll back what was rejected
        tcache.truncate(t_len0 + 1 + n)
        pending_t = nxt
        if k == 0:
            pending_d = [*pending_d, nxt]
        elif n < k:
            dcache.truncate(d_len0 + len(pending_d) + n)
            pending_d = [nxt]
        else:
            pending_d = [d_tokens[-1], nxt]
    stats = {
        "rounds": rounds,
        "drafted": drafted,
        "accepted": accepted,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_accepted_length": 1 + accepted / rounds if rounds else 0.0,
    }
    return DecodeOutput(tokens=out, stats=stats)


def decode_sd(*args, **kwargs) -> DecodeOutput:
    """Run :func:`sd_program` to completion on its own (same arguments)."""
    return run_program(sd_program(*args, **kwargs))
