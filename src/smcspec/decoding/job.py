"""The one request object: what a decoder's program is given, and all it is given.

:meth:`smcspec.engine.Engine.prepare` makes a :class:`Job` (prompt ids, the validated config
with its seed fixed, stop tokens, the models, the vocabulary); whoever runs it gives it its
stream callbacks and its reservation (:meth:`~smcspec.engine.Engine.generate`, or the
scheduler on admission: they live on the job, and a scheduler's request refers to them).
:meth:`~smcspec.engine.Engine.program` starts it (:meth:`Job.started`: the request's random
generator) and hands it to the program of the decoder the table picks for its config
(:func:`~smcspec.decoding.registry.decoder_for`: ``decoder_for(job.config).program(job)``).
A job does not name its decoder: this module sits below the table, which imports every
decoder's program. Settings are read from ``job.config`` under the config's own names; what
a decoder derives from them lives here or on :class:`~smcspec.config.GenerationConfig`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from smcspec.backends.base import DecoderModel
from smcspec.backends.pool import Reservation
from smcspec.config import GenerationConfig
from smcspec.decoding.logprobs import TokenLogprobs
from smcspec.decoding.output import LogprobCallback, TokenCallback
from smcspec.potentials import TokenConstraint, compiled_constraint


@dataclass
class Job:
    """One request, as its decoder runs it.

    Attributes:
        ids: the prompt's token ids.
        config: the validated :class:`GenerationConfig`, its seed fixed.
        stop_ids: tokens that end an answer (EOS, end of turn, the request's stop tokens).
        target, draft: the models (``draft`` None where none is loaded or needed).
        vocab: token ids ``< vocab`` may be sampled (the pair's shared vocabulary).
        generator: the request's random generator on the target's device (set by
            :meth:`started`).
        on_tokens: called with token ids as soon as they are final (streaming).
        reservation: the request's leases on the models' pools, taken before it runs
            (:meth:`~smcspec.engine.Engine.try_reserve`) and released by whoever took it;
            without one each cache reserves its own.
        truncate_draft: smc only: the proposal is the draft truncated like the target
            (``docs/sampling.md``; a comparison, not consistent).
        on_logprobs: with ``config.logprobs``, called with each final token's
            log-probabilities before ``on_tokens`` streams it (:meth:`emit`).
        on_prompt_logprobs: with ``config.prompt_logprobs``, called with the prompt's
            log-probabilities once the target's prefill has run
            (:func:`~smcspec.decoding.program.target_prefill`).
    """

    ids: list[int]
    config: GenerationConfig
    stop_ids: frozenset[int]
    target: DecoderModel
    draft: DecoderModel | None = None
    vocab: int = 0
    generator: torch.Generator | None = None
    on_tokens: TokenCallback | None = None
    reservation: Reservation | None = None
    truncate_draft: bool = False
    on_logprobs: LogprobCallback | None = None
    on_prompt_logprobs: LogprobCallback | None = None

    def started(self) -> Job:
        """A copy ready to run: a generator on the target's device seeded with
        ``config.seed`` (the stream callbacks and the reservation are the job's own, set by
        whoever runs it: ``dataclasses.replace(job, on_tokens=..., reservation=...)``)."""
        gen = torch.Generator(device=self.target.device).manual_seed(self.config.seed or 0)
        return replace(self, generator=gen)

    @property
    def wants_logprobs(self) -> bool:
        """The request asked for its tokens' log-probabilities (``config.logprobs``)."""
        return self.config.logprobs is not None

    def emit(self, tokens: list[int], logprobs: TokenLogprobs | None = None) -> None:
        """Stream ``tokens``, now final: ``on_tokens(tokens)``; with ``on_logprobs`` and
        their ``logprobs``, token by token, each one's log-probabilities first (so that a
        stream carries each token's values with the text it adds)."""
        if not tokens:
            return
        if self.on_logprobs is not None and logprobs is not None:
            for i, t in enumerate(tokens):
                self.on_logprobs(logprobs.slice(i, i + 1))
                if self.on_tokens:
                    self.on_tokens([t])
        elif self.on_tokens:
            self.on_tokens(tokens)

    @property
    def device(self) -> torch.device:
        """The target's device: where the decoders keep their tensors."""
        return self.target.device

    @property
    def models(self) -> dict[str, DecoderModel]:
        """The models by role (``target``, and ``draft`` where there is one)."""
        out = {"target": self.target}
        if self.draft is not None:
            out["draft"] = self.draft
        return out

    @functools.cached_property
    def stop_tensor(self) -> torch.Tensor:
        """int64 ``[S]``: :attr:`stop_ids` on the device, sorted."""
        return torch.tensor(sorted(self.stop_ids), dtype=torch.long, device=self.device)

    @functools.cached_property
    def constraint(self) -> TokenConstraint | None:
        """The config's constraint compiled for this request's tokenizer (None: none)."""
        return compiled_constraint(self.config.constraint)

    @property
    def draft_truncation(self) -> tuple[int, float, float]:
        """``(top_k, top_p, min_p)`` of smc's proposal: the target's with
        :attr:`truncate_draft`, all filters off otherwise (``q_T``)."""
        return self.config.truncation if self.truncate_draft else (0, 1.0, 0.0)


def job_for(
    target: DecoderModel,
    draft: DecoderModel | None,
    prompt: list[int],
    cfg: GenerationConfig,
    stop_ids: frozenset[int],
    vocab: int,
    generator: torch.Generator,
    on_tokens: TokenCallback | None = None,
    reservation: Reservation | None = None,
    truncate_draft: bool = False,
) -> Job:
    """A started :class:`Job` from its parts, for running one decoder's program without an
    engine (the ``decode_*`` helpers, tests, calibration): the caller picks the program."""
    return Job(
        ids=list(prompt),
        config=cfg,
        stop_ids=stop_ids,
        target=target,
        draft=draft,
        vocab=vocab,
        generator=generator,
        on_tokens=on_tokens,
        reservation=reservation,
        truncate_draft=truncate_draft,
    )
