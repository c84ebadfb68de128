"""The decoder table: everything that differs between decoding methods, in one place.

Each :class:`Decoder` owns its program (``program(job)``, on the request's
:class:`~smcspec.decoding.job.Job`), the KV caches it opens (``caches(cfg, prompt_len)``, for
the pools' reservation), the class of its typed stats (``stats_class``,
:mod:`smcspec.decoding.decoder_stats`: their JSON keys, stats line and metrics), its round's
forward shapes and cost (each decoder's ``cost`` module, :mod:`smcspec.decoding.rounds`: what
the tuner predicts and the roofline prices), the name of a setting in reports and ``eval``
(``smc-n8-k2``, parsed and formatted by :mod:`smcspec.decoding.labels`), whether the tuner
predicts it, and what a config must hold to run on it. One rule (:func:`_lookup`) picks the
decoder of a method, draft, N and sampling, for a config (:func:`decoder_for`) or a tuner's
setting (:func:`decoder_named`): greedy ``smc`` runs as greedy ``sd`` (SMC-SD's weights are
undefined for a point-mass target), ``sd`` with N >= 2 chains runs multi-draft sd (greedy:
chain sd), and ``sd`` with n-gram drafts runs the n-gram decoder. :data:`CHOICES` are the
values a user may ask for (the methods and ``auto``), each a :class:`Choice` that says how its
setting is chosen and how that is described; :data:`BASELINE` is the decoder speed-ups are
measured against; :func:`without_default_ngram` is the server's rule for a request that cannot
draft from the text.

This module is the one place code decides on the name of a method, a draft
(:class:`~smcspec.config.Draft`) or a decoder: elsewhere it asks the table (:func:`decoder_for`,
:func:`decoder_named`, :func:`choice`, a row's or a choice's traits), never compares a name or
a trait's value, looks one up in the table's dicts, keys its own dicts or fields by one, sets
a method by name in a branch or switches on a stats class; setting labels are
:mod:`~smcspec.decoding.labels`' alone (``tests/test_decoder_registry.py``).
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
    decoder = _lookup(cfg.method, cfg.draft == NGRAM_DRAFT.name, cfg.particles, cfg.greedy)
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
    from_text = draft == NGRAM_DRAFT.name
    if from_text and method != "sd":
        raise ConfigError(f"n-gram drafts are for sd, not {method}")
    return _lookup(method, from_text, particles, greedy=False)


def _lookup(method: str, from_text: bool, particles: int, greedy: bool) -> Decoder:
    """The one rule from a request's method, draft (``from_text``: n-gram), N and sampling
    (``greedy``: temperature 0) to the decoder that runs it, for :func:`decoder_for` and
    :func:`decoder_named` (after their checks: n-gram drafts only for sd)."""
    if method == "ar":
        return DECODERS["ar"]  # ar drafts nothing: its draft is unused
    if from_text:
        return DECODERS["ngram-sd"]
    if greedy or (method == "sd" and particles < 2):
        return DECODERS["sd"]  # greedy multi-draft: every chain is the draft's argmax
    if method == "sd":
        return DECODERS["multi-sd"]
    return DECODERS["smc"]


def method_decoder(name: str | None) -> Decoder | None:
    """The own decoder of the method ``name`` (``ar``, ``sd``, ``smc``), or None where
    ``name`` is not a method (None, ``auto``, a setting's label such as ``sd-k4``)."""
    return BY_METHOD.get(name) if isinstance(name, str) else None


def without_default_ngram(cfg: GenerationConfig, updates: dict[str, Any]) -> GenerationConfig:
    """``cfg`` (the server's defaults with a request's ``updates``) without the server's
    default n-gram draft (``--draft ngram``, or what ``--method auto`` chose) where the request
    cannot use it. A request that names ``smc`` drafts with the draft model (SMC-SD needs a
    proposal that covers the target). A masked request (a constraint, or ``min_tokens``: a
    mask on the stop tokens) runs ``ar``, or the method it names with the draft model
    (n-gram drafts take no mask). A request that asks for n-gram drafts itself keeps them,
    and is refused with the reason where they do not apply."""
    if "draft" in updates or not cfg.draft_kind.from_text:  # the server's draft: valid
        return cfg
    masked = cfg.constraint is not None or cfg.applies_min_tokens  # min_tokens: a mask too
    if masked and "method" not in updates:
        return replace(cfg, method="ar", draft=MODEL_DRAFT.name)
    named = method_decoder(updates.get("method"))
    if masked or (named is not None and named.particles):
        return replace(cfg, draft=MODEL_DRAFT.name)
    return cfg


def _any_decoder(decoder: Decoder) -> bool:
    """``auto`` chooses among every decoder's settings."""
    return True


def _weighs_particles(decoder: Decoder) -> bool:
    """``smc`` without N or K chooses among the settings that weigh particles."""
    return decoder.particles


@dataclass(frozen=True)
class Choice:
    """A value a user may give as the method: ``ar``, ``sd``, ``smc`` or ``auto``, with how
    its setting is chosen from measured costs (:mod:`smcspec.tuning`) and how that is said.

    Attributes:
        name: as given.
        method: the config's method while the choice is being made (``auto`` validates
            as ``smc``, whose settings it may choose).
        chooses: the decoders whose settings the tuner may choose for it (``auto``: every
            one; ``smc``: those that weigh particles), or None: its setting is given, never
            chosen (``ar``, ``sd``).
        chooses_method: the method is chosen too, not N and K alone (``auto``): the setting
            is always chosen, and is unknown until the tuner has run.
    """

    name: str
    method: str
    chooses: Callable[[Decoder], bool] | None = None
    chooses_method: bool = False

    @property
    def tuned(self) -> bool:
        """Its setting may be chosen from measured costs (``auto``, ``smc``)."""
        return self.chooses is not None

    def may_choose(self, decoder: Decoder) -> bool:
        """Whether the tuner may choose a setting of ``decoder`` for it."""
        return self.chooses is not None and self.chooses(decoder)

    def wants_tuning(
        self, particles: int | None, draft_tokens: int | None, grid: bool = False
    ) -> bool:
        """Whether the setting is chosen from measured costs, given the N and K asked for
        (``grid``: a grid of N and K is given, ``eval``'s and ``bench``'s ``--grid``: they
        are not chosen): always where the method is chosen, where N or K is missing (and no
        grid) where only they are, never where nothing is."""
        if self.chooses is None:
            return False
        if self.chooses_method:
            return True
        unset = particles is None or draft_tokens is None
        return unset and not grid

    @property
    def needs_draft(self) -> bool:
        """Every decoder it may choose runs the draft model: without one it is not chosen
        (``smc``)."""
        rows = [d for d in DECODERS.values() if self.may_choose(d)]
        return bool(rows) and all(d.draft_model for d in rows)

    @property
    def loads_draft(self) -> bool:
        """The draft model loads before its setting is known: the method is chosen, and a
        decoder it may choose runs the draft model (``auto``)."""
        return self.chooses_method and any(
            d.draft_model for d in DECODERS.values() if self.may_choose(d)
        )

    @property
    def chosen_by(self) -> str:
        """How a note says its setting was chosen: ``--method auto``, ``smc without -N/-K``."""
        return f"--method {self.name}" if self.chooses_method else f"{self.name} without -N/-K"

    def mark(self, min_particles: int) -> str:
        """Its mark on the setting chosen for it in the tuner's table: ``auto``, or where N
        and K alone are chosen the floor on N too (``smc (N >= 4)``)."""
        return self.name if self.chooses_method else f"{self.name} (N >= {min_particles})"

    @property
    def decoder(self) -> Decoder:
        """The own decoder of the method it validates as (``auto``: smc's)."""
        return BY_METHOD[self.method]


CHOICES = {
    "auto": Choice("auto", "smc", _any_decoder, chooses_method=True),
    "smc": Choice("smc", "smc", _weighs_particles),
    "sd": Choice("sd", "sd"),
    "ar": Choice("ar", "ar"),
}
"""What ``--method`` (and the tuner) accept: the methods, and ``auto``."""

DEFAULT_TUNED = CHOICES["auto"]
"""The choice a caller of the tuner gets where it names none (``auto``: the fastest of all)."""


def tuned_choices() -> list[Choice]:
    """The choices whose setting may be chosen from measured costs, in the table's order
    (``auto``, ``smc``): the picks the tuner makes."""
    return [c for c in CHOICES.values() if c.tuned]


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
