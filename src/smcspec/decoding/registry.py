"""The decoder table: everything that differs between decoding methods, in one place.

Each :class:`Decoder` owns its program (``program(job)``, on the request's
:class:`~smcspec.decoding.job.Job`), the KV caches it opens (``caches(cfg, prompt_len)``, for
the pools' reservation), the class of its typed stats (``stats_class``,
:mod:`smcspec.decoding.decoder_stats`: their JSON keys, stats line and metrics), its round's
forward shapes and cost (each decoder's ``cost`` module, :mod:`smcspec.decoding.rounds`: what
the tuner predicts and the roofline prices), the name of a setting in reports and ``eval``
(``smc-n8-k2``), whether the tuner predicts it, and what a config must hold to run on it.
:func:`decoder_for` picks the decoder of a config: greedy ``smc`` runs as greedy ``sd``
(SMC-SD's weights are undefined for a point-mass target), ``sd`` with N >= 2 chains runs
multi-draft sd (greedy: chain sd), and ``sd`` with n-gram drafts runs the n-gram decoder.
:data:`CHOICES` are the values a user may ask for (the methods and ``auto``), with how each is
tuned; :data:`BASELINE` is the decoder speed-ups are measured against.

This module is the one place code decides on the name of a method, a draft
(:class:`~smcspec.config.Draft`) or a decoder: elsewhere it asks the table (:func:`decoder_for`,
:func:`decoder_named`, :func:`choice`, a row's traits), never compares a name, looks one up in
the table's dicts or switches on a stats class (``tests/test_decoder_registry.py``).
``config.py``, below it, keeps as data what a config resolves when it is made (each method's
default N, the drafts' rows).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from smcspec.backends.pool import CacheNeed
from smcspec.config import MODEL_DRAFT, NGRAM_DRAFT, Draft, GenerationConfig
from smcspec.decoding.ar.cost import ar_cost, ar_shapes
from smcspec.decoding.ar.program import ar_caches, ar_program
from smcspec.decoding.ar.stats import ArStats
from smcspec.decoding.decoder_stats import Stats
from smcspec.decoding.job import Job
from smcspec.decoding.program import Program
from smcspec.decoding.rounds import Shape
from smcspec.decoding.sd.chain import sd_caches, sd_program
from smcspec.decoding.sd.cost import (
    multi_sd_cost,
    multi_sd_shapes,
    ngram_cost,
    ngram_shapes,
    sd_cost,
    sd_shapes,
)
from smcspec.decoding.sd.multi_sd import multi_sd_caches, multi_sd_program
from smcspec.decoding.sd.ngram import ngram_caches, ngram_sd_program
from smcspec.decoding.sd.stats import SdStats
from smcspec.decoding.smc.cost import smc_cost, smc_shapes
from smcspec.decoding.smc.program import smc_caches, smc_program
from smcspec.decoding.smc.stats import SmcStats
from smcspec.errors import ConfigError

Shapes = tuple[tuple[Shape, ...], tuple[Shape, ...]]


@dataclass(frozen=True)
class Decoder:
    """One decoder of the table.

    Attributes:
        name: ``ar``, ``sd``, ``multi-sd``, ``ngram-sd`` or ``smc``.
        method: the method it implements (``ngram-sd`` implements ``sd``).
        caches: ``(cfg, prompt_len) -> [CacheNeed]``.
        program: ``(job) -> Program`` (:class:`~smcspec.decoding.job.Job`).
        stats_class: the class of the stats its program returns (its ``DecodeOutput.stats``:
            JSON keys, stats line, metrics; :mod:`smcspec.decoding.decoder_stats`).
        draft_model: it runs the draft model.
        draft_tokens: it drafts ``cfg.draft_tokens`` tokens a round (the last round may
            overshoot the budget by that many).
        particles: it weighs N particles (their ESS, resampling, votes, rewards: SMC-SD).
        chains: it drafts N chains a round without weighing them (multi-draft sd).
        from_text: its drafts come from the text, not a model (n-gram sd; priced at its
            gate's threshold, never compared as a speed).
        tuned: the tuner predicts its settings (:mod:`smcspec.tuning.grid`).
        shapes: ``(n, k) -> (target shapes, draft shapes)`` of one round.
        cost: ``(n, k, RoundCosts, distinct) -> (tokens, seconds)`` of one round.
        label: ``(n, k) -> str``: a setting's name in reports and ``eval`` (``smc-n8-k2``).
        pattern: the regular expression of those names (groups ``n``, ``k`` where they
            appear), matched at the start of an ``eval`` name.
    """

    name: str
    method: str
    caches: Callable[[GenerationConfig, int], list[CacheNeed]]
    program: Callable[[Job], Program]
    stats_class: type[Stats]
    draft_model: bool
    draft_tokens: bool
    particles: bool
    chains: bool
    from_text: bool
    tuned: bool
    shapes: Callable[[int, int], Shapes]
    cost: Callable[..., tuple[float, float]]
    label: Callable[[int, int], str]
    pattern: re.Pattern

    def ran_as(self, cfg: GenerationConfig) -> str | None:
        """The method this decoder implements where it is not ``cfg``'s (greedy smc runs as
        sd), else None: a result's ``ran_as``, in its stats where set."""
        return None if self.method == cfg.method else self.method

    def configure(self, cfg: GenerationConfig, n: int = 1, k: int = 0) -> GenerationConfig:
        """``cfg`` set to run on this decoder with N = ``n`` and K = ``k`` where it has them
        (N = 1 where it has none)."""
        out = replace(cfg, method=self.method, particles=n if self.uses_n else 1)
        if self.draft_tokens:
            out = replace(out, draft=self.draft.name, draft_tokens=k)
        return out

    @property
    def draft(self) -> Draft:
        """Its drafts' :class:`~smcspec.config.Draft` (the draft model where it drafts none:
        a config's default)."""
        return NGRAM_DRAFT if self.from_text else MODEL_DRAFT

    @property
    def uses_n(self) -> bool:
        """It runs N rows a round (particles or chains): its settings are named by N too."""
        return self.particles or self.chains


def _decoder(name: str, method: str, caches, program, stats_class, *, draft_model: bool,
             drafts: bool, particles: bool = False, chains: bool = False,
             from_text: bool = False, tuned: bool = True, shapes, cost, label,
             pattern: str) -> Decoder:  # fmt: skip
    return Decoder(name, method, caches, program, stats_class, draft_model, drafts, particles,
                   chains, from_text, tuned, shapes, cost, label, re.compile(pattern))  # fmt: skip


DECODERS = {
    "ar": _decoder(
        "ar", "ar", ar_caches, ar_program, ArStats, draft_model=False, drafts=False,
        shapes=ar_shapes, cost=ar_cost, label=lambda n, k: "ar", pattern=r"ar",
    ),
    "sd": _decoder(
        "sd", "sd", sd_caches, sd_program, SdStats, draft_model=True, drafts=True,
        shapes=sd_shapes, cost=sd_cost, label=lambda n, k: f"sd-k{k}",
        pattern=r"sd-k(?P<k>\d+)",
    ),
    "multi-sd": _decoder(
        "multi-sd", "sd", multi_sd_caches, multi_sd_program, SdStats, draft_model=True,
        drafts=True, chains=True, shapes=multi_sd_shapes, cost=multi_sd_cost,
        label=lambda n, k: f"sd-n{n}-k{k}", pattern=r"sd-n(?P<n>\d+)-k(?P<k>\d+)",
    ),
    "ngram-sd": _decoder(
        "ngram-sd", "sd", ngram_caches, ngram_sd_program, SdStats, draft_model=False,
        drafts=True, from_text=True, shapes=ngram_shapes, cost=ngram_cost,
        label=lambda n, k: f"sd-ngram-k{k}", pattern=r"sd-ngram-k(?P<k>\d+)",
    ),
    "smc": _decoder(
        "smc", "smc", smc_caches, smc_program, SmcStats, draft_model=True, drafts=True,
        particles=True, shapes=smc_shapes, cost=smc_cost, label=lambda n, k: f"smc-n{n}-k{k}",
        pattern=r"smc-n(?P<n>\d+)-k(?P<k>\d+)",
    ),
}  # fmt: skip
"""The decoders by name."""

BY_METHOD = {"ar": DECODERS["ar"], "sd": DECODERS["sd"], "smc": DECODERS["smc"]}
"""Each method's own decoder (``sd`` with n-gram drafts runs ``ngram-sd``)."""

BASELINE = DECODERS["ar"]
"""The decoder speed-ups are measured against (``ar``: one target forward a token)."""


def decoder_for(cfg: GenerationConfig) -> Decoder:
    """The decoder that runs ``cfg`` (a config that passed ``validate``), after the checks
    that depend on the method.

    Raises:
        ConfigError: SMC-SD with n-gram drafts; a reward or a vote without particles
            (another method, or greedy smc, which runs as sd).
    """
    if cfg.draft == "ngram" and cfg.method == "smc":
        raise ConfigError(
            "SMC-SD cannot use the n-gram draft: its importance weights p/q need a "
            "proposal that covers the target, and an n-gram draft is a point mass; use "
            "method sd with the n-gram draft, or smc with the draft model"
        )
    if cfg.draft == "ngram" and cfg.method == "sd" and cfg.particles > 1:
        raise ConfigError(
            "n-gram drafts are one chain a round: multi-draft sd (N >= 2) needs the draft "
            "model (--draft model), or use N = 1"
        )
    if cfg.method == "ar":
        decoder = DECODERS["ar"]
    elif cfg.draft == "ngram":
        decoder = DECODERS["ngram-sd"]
    elif cfg.greedy or (cfg.method == "sd" and cfg.particles == 1):
        decoder = DECODERS["sd"]  # greedy multi-draft: every chain is the draft's argmax
    elif cfg.method == "sd":
        decoder = DECODERS["multi-sd"]
    else:
        decoder = DECODERS["smc"]
    _check_particles(cfg, decoder)
    return decoder


def with_updates(cfg: GenerationConfig, updates: dict[str, Any]) -> GenerationConfig:
    """``replace(cfg, **updates)``, where ``updates`` switch to another method without
    giving N: that method's default N (``particles=None``), not ``cfg``'s (an smc server's
    N particles are not an sd request's N chains)."""
    if updates.get("method", cfg.method) != cfg.method and "particles" not in updates:
        updates = {**updates, "particles": None}
    return replace(cfg, **updates)


def _check_particles(cfg: GenerationConfig, decoder: Decoder) -> None:
    """A reward or a vote needs a decoder that weighs particles."""
    if cfg.reward is not None and not decoder.particles:
        if cfg.method != "smc":
            raise ConfigError("a reward needs method smc (ar and sd cannot reweight)")
        raise ConfigError("a reward needs sampling (temperature > 0), not greedy decoding")
    if cfg.vote is not None and not decoder.particles:
        raise ConfigError(
            "a vote needs particles: method smc with temperature > 0 (for ar, draw "
            "several samples and vote over them, as eval's ar-sc-nN does)"
        )


def decoder_named(method: str, draft: str = MODEL_DRAFT.name, particles: int = 1) -> Decoder:
    """The decoder of ``method`` (``ar``, ``sd``, ``smc``) drafting with ``draft``
    (``model`` or ``ngram``: sd only) at N = ``particles`` (``sd`` with the draft model and
    N >= 2: multi-draft sd; sampling assumed, as the tuner's settings are: a greedy request
    runs as chain sd, :func:`decoder_for`).

    Raises:
        ConfigError: an unknown method, or n-gram drafts for another method than sd.
    """
    if method not in BY_METHOD:
        raise ConfigError(f"unknown method {method!r}; choose from {', '.join(BY_METHOD)}")
    if draft == NGRAM_DRAFT.name:
        if method != "sd":
            raise ConfigError(f"n-gram drafts are for sd, not {method}")
        return DECODERS["ngram-sd"]
    if method == "sd" and particles >= 2:
        return DECODERS["multi-sd"]
    return BY_METHOD[method]


def method_decoder(name: str | None) -> Decoder | None:
    """The own decoder of the method ``name`` (``ar``, ``sd``, ``smc``), or None where
    ``name`` is not a method (None, ``auto``, a setting's label such as ``sd-k4``)."""
    return BY_METHOD.get(name) if isinstance(name, str) else None


def parse_label(text: str) -> tuple[Decoder, int, int, str] | None:
    """The setting a name such as ``smc-n8-k2-keep`` starts with: ``(decoder, n, k, rest)``
    (``rest`` the unparsed suffix, ``-keep`` here), or None when no decoder's name fits. The
    longest match wins (``sd-ngram-k4`` is not ``sd``)."""
    found = []
    for d in DECODERS.values():
        m = d.pattern.match(text)
        if m is not None and (m.end() == len(text) or text[m.end()] == "-"):
            groups = m.groupdict()
            n, k = int(groups.get("n") or 1), int(groups.get("k") or 0)
            found.append((m.end(), d, n, k))
    if not found:
        return None
    end, d, n, k = max(found, key=lambda f: f[0])
    return d, n, k, text[end:]


@dataclass(frozen=True)
class Choice:
    """A value a user may give as the method: ``ar``, ``sd``, ``smc`` or ``auto``.

    Attributes:
        name: as given.
        method: the config's method while the choice is being made (``auto`` validates
            as ``smc``, whose settings it may choose).
        tuned: ``"always"`` (``auto``: the setting is chosen from measured costs),
            ``"without_nk"`` (``smc`` without N or K: they are chosen), or ``"never"``.
        particles_only: the tuner may choose only settings with particles (``smc``); else
            any (``auto``).
    """

    name: str
    method: str
    tuned: str
    particles_only: bool = False

    def wants_tuning(
        self, particles: int | None, draft_tokens: int | None, grid: bool = False
    ) -> bool:
        """Whether the setting is chosen from measured costs, given the N and K asked for
        (``grid``: a grid of N and K is given, ``eval``'s and ``bench``'s ``--grid``: they
        are not chosen)."""
        if self.tuned == "always":
            return True
        unset = particles is None or draft_tokens is None
        return self.tuned == "without_nk" and unset and not grid

    @property
    def decoder(self) -> Decoder:
        """The own decoder of the method it validates as (``auto``: smc's)."""
        return BY_METHOD[self.method]


CHOICES = {
    "auto": Choice("auto", "smc", "always"),
    "smc": Choice("smc", "smc", "without_nk", particles_only=True),
    "sd": Choice("sd", "sd", "never"),
    "ar": Choice("ar", "ar", "never"),
}
"""What ``--method`` (and the tuner) accept: the methods, and ``auto``."""


def choice(name: str) -> Choice:
    """The :class:`Choice` named ``name``.

    Raises:
        ConfigError: an unknown name.
    """
    try:
        return CHOICES[name]
    except KeyError:
        raise ConfigError(f"unknown method {name!r}; choose from {', '.join(CHOICES)}") from None


def choice_or_none(name: str) -> Choice | None:
    """The :class:`Choice` named ``name``, or None where it names none (a setting's label
    such as ``smc-n8-k2``)."""
    return CHOICES.get(name)
