"""The decoder table: which decoder runs a request, decided once from its config.

Every decoder exposes the same two functions: ``caches(cfg, prompt_len)`` (the KV caches it
opens, for the pools' reservation) and ``program(job)`` (its program on the request,
:class:`~smcspec.decoding.job.Job`; see :mod:`smcspec.decoding.program`).
:func:`decoder_for` is the one place that reads ``cfg.method``: greedy ``smc`` runs as greedy
``sd`` (SMC-SD's weights are undefined for a point-mass target), and ``sd`` with
``draft="ngram"`` runs the n-gram decoder.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from smcspec.backends.pool import CacheNeed
from smcspec.config import GenerationConfig
from smcspec.decoding.ar import ar_caches, ar_program
from smcspec.decoding.job import Job
from smcspec.decoding.ngram import ngram_caches, ngram_sd_program
from smcspec.decoding.program import Program
from smcspec.decoding.sd import sd_caches, sd_program
from smcspec.decoding.smc import smc_caches, smc_program


@dataclass(frozen=True)
class Decoder:
    """One decoder of the table.

    Attributes:
        name: ``ar``, ``sd``, ``ngram-sd`` or ``smc``.
        method: the method it implements (``ngram-sd`` implements ``sd``).
        caches: ``(cfg, prompt_len) -> [CacheNeed]``.
        program: ``(job) -> Program`` (:class:`~smcspec.decoding.job.Job`).
        draft_model: it runs the draft model.
        draft_tokens: it drafts ``cfg.draft_tokens`` tokens a round (the last round may
            overshoot the budget by that many).
    """

    name: str
    method: str
    caches: Callable[[GenerationConfig, int], list[CacheNeed]]
    program: Callable[[Job], Program]
    draft_model: bool
    draft_tokens: bool

    def stats(self, cfg: GenerationConfig) -> dict[str, Any]:
        """What a result's stats add to the decoder's own: ``ran_as`` where the decoder is
        not the requested method's own (greedy smc)."""
        return {} if self.method == cfg.method else {"ran_as": self.method}


DECODERS = {
    "ar": Decoder("ar", "ar", ar_caches, ar_program, draft_model=False, draft_tokens=False),
    "sd": Decoder("sd", "sd", sd_caches, sd_program, draft_model=True, draft_tokens=True),
    "ngram-sd": Decoder(
        "ngram-sd", "sd", ngram_caches, ngram_sd_program, draft_model=False, draft_tokens=True
    ),
    "smc": Decoder("smc", "smc", smc_caches, smc_program, draft_model=True, draft_tokens=True),
}


def decoder_for(cfg: GenerationConfig) -> Decoder:
    """The decoder that runs ``cfg`` (a validated config)."""
    if cfg.method == "ar":
        return DECODERS["ar"]
    if cfg.draft == "ngram":
        return DECODERS["ngram-sd"]
    if cfg.method == "sd" or cfg.greedy:
        return DECODERS["sd"]
    return DECODERS["smc"]
