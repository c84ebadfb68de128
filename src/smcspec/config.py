"""Generation settings shared by the CLI, the Python API and the server.

Each setting is declared once, here: its default and, for those the command line exposes,
its flag and help (:class:`Option` in the field's metadata, read by
:func:`smcspec.cli.options.decoding_options`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from smcspec.aggregate import Vote
from smcspec.errors import ConfigError
from smcspec.potentials import Constraint, Reward, TokenConstraint
from smcspec.sampling.distributions import GREEDY_BELOW
from smcspec.sampling.resampling import RESAMPLERS

METHODS = ("smc", "sd", "ar")
FINISHED_PARTICLES = ("bank", "keep")  # GenerationConfig.finished_particles
DRAFT_SCHEDULES = ("fixed", "adaptive", "confidence")  # GenerationConfig.draft_schedule
ROUND_ENDS = ("block", "ess")  # GenerationConfig.round_end
MAX_TOP_LOGPROBS = 20
"""The most alternatives a token's log-probability reports (OpenAI's ``top_logprobs`` bound)."""
LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs")
"""``GenerationConfig.logprobs_mode``: the sampling distribution, or the model's own
(:mod:`smcspec.decoding.logprobs`)."""
MAX_PARTICLES = 256
DEFAULT_PARTICLES = 4
"""smc's N when a request gives none (the SMC-SD authors' default)."""
METHOD_PARTICLES = {"smc": DEFAULT_PARTICLES, "sd": 1, "ar": 1}
"""Each method's N when a request gives none (``GenerationConfig.particles`` None): smc's
particles; one chain for ``sd`` (N >= 2 is multi-draft sd) and one row for ``ar``. Data here,
not a field of the decoder table's rows (``decoding/registry.py``): a config resolves its N
when it is made, and this module sits below ``decoding/``; ``tests/test_decoder_registry.py``
checks it against the table (N > 1 exactly where the method's decoder weighs particles)."""
MAX_DRAFT_TOKENS = 64
NGRAM_DRAFT_P_MIN = 0.8
"""The n-gram draft's gate when ``draft_p_min`` is not given: measured over 20 rewrite and 20
open-chat prompts (K=4, T=0.7; ``docs/benchmarks/ngram-cpu/gated-drafts-20.md``), gated
n-gram sd ran at 1.04x and 0.94x ``ar``'s decode tokens/s against 0.97x and 0.58x ungated."""


@dataclass(frozen=True)
class Draft:
    """Where drafted tokens come from: one value of ``GenerationConfig.draft``. The decoder
    table (``decoding/registry.py``) names each decoder's draft by these rows; code reads
    their fields, never their names.

    Attributes:
        name: the value (``"model"``, ``"ngram"``).
        from_text: the drafts are copied from the prompt and text so far by an n-gram
            index, no model (a point-mass proposal: not for SMC-SD, no constraint yet).
        p_min: the gate when ``draft_p_min`` is not given (0: off).
    """

    name: str
    from_text: bool
    p_min: float


MODEL_DRAFT = Draft("model", from_text=False, p_min=0.0)
NGRAM_DRAFT = Draft("ngram", from_text=True, p_min=NGRAM_DRAFT_P_MIN)
DRAFT_KINDS = {d.name: d for d in (MODEL_DRAFT, NGRAM_DRAFT)}
"""The drafts by name."""
DRAFTS = tuple(DRAFT_KINDS)  # GenerationConfig.draft's choices


def draft_named(value: str | None) -> Draft:
    """The draft a ``--draft`` value names: a draft's name (``ngram``: no model file), else
    (a model file, or none given) the draft model."""
    return DRAFT_KINDS.get(value or "", MODEL_DRAFT)


@dataclass(frozen=True)
class Option:
    """How a :class:`GenerationConfig` field appears on the command line.

    Attributes:
        order: its place among the generic decoding options of ``--help`` (ascending).
        help: argparse's help (None: none shown).
        choices: the allowed values (argparse checks them).
        metavar: argparse's metavar.
    A bool field that defaults to True becomes ``--no-<name>`` (stores False); every other
    field ``--<name>`` with the field's type and default.
    """

    order: int
    help: str | None = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None


def option(default, order: int, server: bool = False, **kwargs):
    """A dataclass field with ``default`` exposed on the command line (:class:`Option`) and,
    with ``server``, in the server's per-request ``smc`` object."""
    return field(default=default, metadata={"option": Option(order, **kwargs), "server": server})


_FIELD_TYPES = {"float": float, "float | None": float, "int": int, "int | None": int, "str": str}


def field_type(f) -> type:
    """The Python type of a scalar :class:`GenerationConfig` field (its annotation is a string
    under ``from __future__ import annotations``); KeyError for any other field."""
    return _FIELD_TYPES[f.type]


def server_setting(default, choices: tuple[str, ...] | None = None):
    """A dataclass field with ``default`` in the server's ``smc`` object only (``choices``:
    the values its schema allows)."""
    return field(default=default, metadata={"server": True, "server_choices": choices})


@dataclass(frozen=True)
class GenerationConfig:
    """How to decode one request.

    Attributes:
        method: ``"smc"`` (SMC speculative decoding), ``"sd"`` (exact speculative
            decoding) or ``"ar"`` (autoregressive sampling from the target).
        max_new_tokens: generated-token budget (>= 1).
        temperature: target temperature ``T_t`` (>= 0). ``0`` is greedy decoding: ``ar``
            takes the target's most likely token, ``sd`` runs greedy speculative decoding
            (a drafted token is accepted iff it is the target's most likely one; the output
            equals ``ar``'s), and ``smc`` runs as greedy ``sd`` (SMC-SD's importance
            weights are undefined for a point-mass target; its stats say ``greedy``).
            A temperature below :data:`GREEDY_BELOW` (1e-30) is greedy too.
        draft_temperature: draft temperature ``T_d`` (> 0; smc and sd; greedy decoding
            drafts the draft's most likely tokens whatever it is).
        particles: N, particles per request (smc), or drafted chains per round (sd: N >= 2
            is multi-draft sd, :mod:`smcspec.decoding.sd.multi_sd`; 1 is chain sd). ``None``
            (the default) is the method's default (:data:`METHOD_PARTICLES`), resolved when
            the config is made: ``replace(cfg, method=...)`` keeps ``cfg``'s N unless it is
            given ``particles=None`` too.
        draft_tokens: K, draft tokens per round (smc and sd).
        alpha: power exponent of the SMC target ``p^alpha`` (> 0; smc only).
        ess_threshold: kappa in [0, 1]; resample when ``ESS < kappa * N`` (0 disables).
        resampler: ``systematic`` | ``stratified`` | ``multinomial`` | ``residual``.
        groups: G, a divisor of N (smc). The particles form G groups of N/G that are weighted,
            resampled and banked apart, like G independent SMC-SD runs batched in one
            forward (the island particle model of Vergé, Dubarry, Del Moral & Moulines 2015,
            "On parallel implementation of Sequential Monte Carlo methods: the island
            particle model"); the groups then count equally: a particle's final weight is its
            normalised weight within its group divided by the number of groups that kept any
            weight. One group (the default) is plain SMC-SD. A vote over G groups is a vote
            over G nearly independent answers (self-consistency), where one group's particles,
            after resampling, mostly hold copies of one answer
            (``docs/benchmarks/gsm8k-steering/diversity.md``).
        finished_particles: what SMC-SD does with a particle that ends (EOS, a stop token
            or the budget): ``"bank"`` (default) sets it aside with its share of the round's
            weight and refills the N slots from the running particles, so particles that end
            at different rounds are never compared through weights accumulated over
            different numbers of tokens; ``"keep"`` is the paper's rule (the particle keeps
            its weight among the running ones until every particle has ended). ``"bank"``
            applies where the target's prefix marginals are its own next-token
            distributions (alpha = 1, no constraint or reward); elsewhere ``"keep"`` runs.
            See :mod:`smcspec.decoding.smc.program`.
        seed: random seed, any integer (used modulo 2**64, the range of
            ``torch.Generator`` seeds); ``None`` draws a fresh one.
        return_particles: also return every particle with its normalised weight (smc).
        stop_token_ids: extra token ids that end generation (besides the model's EOS).
        ignore_eos: never stop before ``max_new_tokens`` (for benchmarks, like vLLM's).
        min_tokens: the stop tokens (EOS, end of turn, ``stop_token_ids``) cannot end the
            answer before this many tokens (vLLM's ``min_tokens``): they are masked out at
            the first ``min_tokens`` positions (a constraint: ar and sd sample the
            locally-masked target, smc the target conditioned on it; not with another
            constraint nor n-gram drafts). 0: off; moot with ``ignore_eos``.
        logprobs: report each generated token's log-probability and this many most likely
            alternatives (0 to 20; :mod:`smcspec.decoding.logprobs` says under which
            distribution). None (the default): not computed, at no cost. Requests that ask
            for them run their rounds step by step, never fused
            (:func:`smcspec.decoding.fused.plain`).
        prompt_logprobs: also report the prompt tokens' log-probabilities (the model's raw
            ones, from the prefill; OpenAI's ``echo`` with ``logprobs``), with
            ``logprobs or 0`` alternatives.
        logprobs_mode: ``"processed_logprobs"`` (the distribution each token is sampled
            from, after temperature, filters and mask) or ``"raw_logprobs"`` (the model's
            ``log_softmax`` at temperature 1), as vLLM's ``logprobs_mode`` names them.
        top_k: keep the k most likely tokens (ties with the k-th kept); 0 or -1: off.
        top_p: nucleus mass in (0, 1]; keep the smallest set of most likely tokens whose
            mass reaches it (the top token always); 1: off.
        min_p: in [0, 1]; keep tokens with ``p >= min_p * max p``; 0: off.
        constraint: a hard constraint on the output (:class:`~smcspec.potentials.Regex`,
            :class:`~smcspec.potentials.JsonSchema`, :class:`~smcspec.potentials.Grammar`,
            or an already compiled :class:`~smcspec.potentials.TokenConstraint`); ar and sd
            sample the locally-masked target, smc the conditional (``docs/constraints.md``).
        reward: a :class:`~smcspec.potentials.Reward` ``exp(beta * R(x))`` (smc only).
        vote: a :class:`~smcspec.aggregate.Vote`: the result also carries the weighted vote
            over the particles' extracted answers (smc only; the drawn answer is unchanged).
        draft_p_min: sd with the draft model: stop a round's drafting when the draft's most
            likely token has less than this probability (llama.cpp's ``--draft-p-min``).
            With n-gram drafts: draft only while the target's probability of the n-gram's
            proposals, over the last 4 rounds that had one, is at least this
            (:class:`smcspec.decoding.sd.ngram.NgramGate`). 0: off. ``None`` (the default):
            the draft's own default, off with the draft model and
            :data:`NGRAM_DRAFT_P_MIN` with n-gram drafts (:attr:`p_min`). The output stays
            exact.
        draft: where drafted tokens come from: ``"model"`` (the draft model) or
            ``"ngram"`` (prompt lookup, no draft model: ``sd`` only, without a constraint;
            :mod:`smcspec.decoding.sd.ngram`). SMC-SD refuses ``"ngram"``: a point-mass
            proposal does not cover the target, so its weights are undefined.
        draft_schedule: ``sd`` with n-gram drafts: ``"confidence"`` (the default) drafts the
            longest prefix of the proposal whose estimated acceptance probability, the
            product of the recent per-position means of the target's probability of the
            proposed tokens, is at least :attr:`p_min`
            (:meth:`smcspec.decoding.sd.ngram.NgramGate.length`; with ``p_min`` 0 the whole
            proposal); ``"fixed"`` drafts up to ``draft_tokens`` tokens every round the gate
            is open; ``"adaptive"`` lets each round's length follow the last round's
            acceptance (:func:`smcspec.decoding.sd.ngram.next_draft_length`: at most
            ``draft_tokens``, at least 1). The output stays exact either way.
        round_end: where an SMC-SD round ends: ``"block"`` (default) after all K drafted
            tokens and the bonus token; ``"ess"`` at the first drafted position where the
            running ESS falls below ``kappa * N`` (of any group): the particles are resampled
            there, the drafted tokens after it discarded, and the next token of every
            particle drawn from the target at that position (a round yields 2 to K+1
            tokens; :mod:`smcspec.decoding.smc.program`, ``docs/smc-sd.md``).
        stop_epsilon: smc with the bank rule: end the request once the particles still
            running carry less than this probability mass (and every group has banked one);
            the output is then drawn from the bank, which moves its distribution by at most
            ``stop_epsilon`` in total variation. In [0, 1); 0: off.
        shared_rows: each forward computes the distinct particle rows only (particles
            with the same history and token share one row; the output does not change,
            see :mod:`smcspec.backends.shared_rows`); ``False`` computes every row, for
            comparison.
    The three filters apply to the tempered target (and, separately, to the tempered draft)
    at every step; all methods then sample the truncated, renormalised target exactly (ar,
    sd) or approximately (smc). See :mod:`smcspec.sampling.truncation` and
    ``docs/sampling.md``.
    Defaults are the SMC-SD authors' (N=4, K=4, T_d=T_t=0.7, alpha=1, kappa=0.5, systematic).
    """

    method: str = server_setting("smc", METHODS)
    max_new_tokens: int = 128
    temperature: float = option(0.7, 1, help="target temperature T_t (0: greedy on every method)")
    draft_temperature: float = option(0.7, 2, server=True, help="draft temperature T_d")
    particles: int | None = server_setting(None)
    draft_tokens: int = server_setting(4)
    alpha: float = option(1.0, 4, server=True, help="power exponent of the SMC target")
    ess_threshold: float = option(
        0.5, 8, server=True, help="kappa: resample when ESS < kappa*N (0 disables)"
    )
    resampler: str = option("systematic", 9, server=True, choices=tuple(RESAMPLERS))
    groups: int = option(
        1,
        14,
        server=True,
        metavar="G",
        help="smc: split the N particles into G groups (G divides N) weighted, resampled and "
        "banked apart, counted equally at the end (default 1: plain SMC-SD); a vote then "
        "compares G nearly independent answers",
    )
    finished_particles: str = option(
        "bank",
        10,
        server=True,
        choices=FINISHED_PARTICLES,
        help="smc: bank a particle that ends with its share of the round's weight (default), "
        "or keep it among the running ones (the paper's rule)",
    )
    seed: int | None = option(None, 11)
    return_particles: bool = False
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: bool = False
    logprobs_mode: str = field(
        default="processed_logprobs", metadata={"server_choices": LOGPROBS_MODES}
    )
    top_k: int = option(0, 5, help="keep the k most likely tokens (0 or -1: off)")
    top_p: float = option(
        1.0, 6, help="nucleus: keep the most likely tokens up to this mass, in (0, 1] (1: off)"
    )
    min_p: float = option(0.0, 7, help="keep tokens with p >= min_p * max p, in [0, 1] (0: off)")
    constraint: Constraint | TokenConstraint | None = None
    reward: Reward | None = None
    vote: Vote | None = None
    shared_rows: bool = option(
        True,
        12,
        help="compute every particle row of a forward, also those that repeat another "
        "particle's prefix (default: each distinct row once; the output is the same)",
    )
    round_end: str = option(
        "block",
        15,
        server=True,
        choices=ROUND_ENDS,
        help="smc: end each round after the whole block (default), or at the first drafted "
        "position where the ESS falls below kappa*N, resampling there (2 to K+1 tokens a round)",
    )
    stop_epsilon: float = option(
        0.0,
        16,
        server=True,
        metavar="EPS",
        help="smc (bank rule): stop once the running particles hold less than EPS of the "
        "probability mass, drawing the answer from the banked ones (moves the output's "
        "distribution by at most EPS in total variation; 0: off)",
    )
    draft: str = server_setting("model", DRAFTS)
    draft_p_min: float | None = option(
        None,
        3,
        server=True,
        metavar="P",
        help="sd: stop a round's drafting when the draft's most likely token has less than "
        "probability P (llama.cpp's --draft-p-min); with --draft ngram, draft only while the "
        "target's probability of the n-gram's proposals (mean of the last 4) is at least P "
        f"(0: off; default: off with the draft model, {NGRAM_DRAFT_P_MIN:g} with --draft "
        "ngram; the output stays exact)",
    )
    draft_schedule: str = option(
        "confidence",
        13,
        server=True,
        choices=DRAFT_SCHEDULES,
        help="sd with n-gram drafts: 'confidence' (default) drafts the longest prefix of the "
        "proposal whose estimated acceptance (product of the recent per-position target "
        "probabilities of proposed tokens) is at least --draft-p-min; 'fixed' drafts up to "
        "--draft-tokens every round the gate is open; 'adaptive' lets each round's draft "
        "length follow the last round's acceptance (at most --draft-tokens)",
    )

    def __post_init__(self) -> None:
        if self.particles is None:  # the method's default N
            object.__setattr__(self, "particles", METHOD_PARTICLES.get(self.method, 1))

    @property
    def greedy(self) -> bool:
        """Temperature 0, or below :data:`GREEDY_BELOW`: greedy decoding (see
        ``temperature``)."""
        return self.temperature < GREEDY_BELOW

    @property
    def truncation(self) -> tuple[int, float, float]:
        """``(top_k, top_p, min_p)``: the target's filters (``docs/sampling.md``)."""
        return (self.top_k, self.top_p, self.min_p)

    @property
    def applies_min_tokens(self) -> bool:
        """``min_tokens`` masks stop tokens (set, and EOS not ignored)."""
        return self.min_tokens > 0 and not self.ignore_eos

    @property
    def has_potential(self) -> bool:
        """A constraint or a reward reweights the particles (``docs/constraints.md``)."""
        return self.constraint is not None or self.reward is not None

    @property
    def twisted(self) -> bool:
        """The reward scores prefixes too (a twist, ``Reward.prefix_fn``)."""
        return self.reward is not None and self.reward.prefix_fn is not None

    @property
    def banks_finished(self) -> bool:
        """smc banks the particles that end (``finished_particles="bank"``); banking needs
        normalised prefix targets, so it runs at alpha = 1 without a constraint or reward,
        and the paper's keep rule elsewhere."""
        return self.finished_particles == "bank" and self.alpha == 1 and not self.has_potential

    @property
    def group_size(self) -> int:
        """Particles per group (``particles / groups``)."""
        return self.particles // self.groups

    def group(self, g: int) -> slice:
        """The particles of group ``g``."""
        m = self.group_size
        return slice(g * m, (g + 1) * m)

    @property
    def p_min(self) -> float:
        """``draft_p_min`` as sd applies it: the value given, or, when ``None``, the draft's
        default (0, off, with the draft model; :data:`NGRAM_DRAFT_P_MIN` with n-gram
        drafts)."""
        if self.draft_p_min is not None:
            return float(self.draft_p_min)
        return self.draft_kind.p_min

    @property
    def draft_kind(self) -> Draft:
        """The :class:`Draft` row of ``draft`` (KeyError before :meth:`validate` for an
        unknown one)."""
        return DRAFT_KINDS[self.draft]

    def validate(self) -> GenerationConfig:
        """Check every field; returns ``self``. Raises :class:`ConfigError` with the reason."""
        self._check_types()
        self._check_ranges()
        self._check_choices()
        self._check_potentials()
        return self

    def _check_types(self) -> None:
        for name in ("max_new_tokens", "particles", "draft_tokens", "top_k", "groups"):
            if not _is_int(getattr(self, name)):
                raise ConfigError(f"{name} must be an integer, got {getattr(self, name)!r}")
        numbers = ("temperature", "draft_temperature", "alpha", "ess_threshold", "top_p", "min_p",
                   "draft_p_min", "stop_epsilon")  # fmt: skip
        for name in numbers:
            if name == "draft_p_min" and self.draft_p_min is None:
                continue  # the draft's default
            if not _is_number(getattr(self, name)):
                raise ConfigError(f"{name} must be a number, got {getattr(self, name)!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ConfigError(f"seed must be an integer or None, got {self.seed!r}")
        if not isinstance(self.shared_rows, bool):
            raise ConfigError(f"shared_rows must be true or false, got {self.shared_rows!r}")

    def _check_ranges(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens}")
        t, t_d = self.temperature, self.draft_temperature
        if not (math.isfinite(t) and t >= 0):
            raise ConfigError(f"temperature must be a finite number >= 0 (0: greedy), got {t}")
        if not (math.isfinite(t_d) and t_d > 0):
            raise ConfigError(f"draft_temperature must be a finite number > 0, got {t_d}")
        if not isinstance(self.particles, int) or not 1 <= self.particles <= MAX_PARTICLES:
            raise ConfigError(f"particles N must be in [1, {MAX_PARTICLES}], got {self.particles}")
        if not isinstance(self.draft_tokens, int) or not 1 <= self.draft_tokens <= MAX_DRAFT_TOKENS:
            raise ConfigError(
                f"draft_tokens K must be in [1, {MAX_DRAFT_TOKENS}], got {self.draft_tokens}"
            )
        if not 1 <= self.groups <= self.particles or self.particles % self.groups:
            raise ConfigError(
                f"groups G must divide the particles N={self.particles} (1 <= G <= N), "
                f"got {self.groups}"
            )
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            raise ConfigError(f"alpha must be a finite number > 0, got {self.alpha}")
        if not (isinstance(self.ess_threshold, int | float) and 0 <= self.ess_threshold <= 1):
            raise ConfigError(f"ess_threshold kappa must be in [0, 1], got {self.ess_threshold}")
        if self.top_k < -1:
            raise ConfigError(f"top_k must be an integer >= 1, or 0 or -1 (off), got {self.top_k}")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise ConfigError(f"top_p must be in (0, 1] (1 is off), got {self.top_p}")
        if not (math.isfinite(self.min_p) and 0 <= self.min_p <= 1):
            raise ConfigError(f"min_p must be in [0, 1] (0 is off), got {self.min_p}")
        if not (math.isfinite(self.stop_epsilon) and 0 <= self.stop_epsilon < 1):
            raise ConfigError(f"stop_epsilon must be in [0, 1) (0 is off), got {self.stop_epsilon}")
        p_min = self.draft_p_min
        if p_min is not None and not (math.isfinite(p_min) and 0 <= p_min <= 1):
            raise ConfigError(f"draft_p_min must be in [0, 1] (0 is off), got {p_min}")
        self._check_output_ranges()

    def _check_output_ranges(self) -> None:
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ConfigError(
                f"min_tokens must be an integer in [0, max_new_tokens={self.max_new_tokens}], "
                f"got {self.min_tokens!r}"
            )
        lp = self.logprobs
        if lp is not None and (not _is_int(lp) or not 0 <= lp <= MAX_TOP_LOGPROBS):
            raise ConfigError(
                f"logprobs (alternatives per token) must be an integer in [0, "
                f"{MAX_TOP_LOGPROBS}] or None (off), got {lp!r}"
            )
        if not isinstance(self.prompt_logprobs, bool):
            raise ConfigError(
                f"prompt_logprobs must be true or false, got {self.prompt_logprobs!r}"
            )

    def _check_choices(self) -> None:
        for f in fields(self):  # every field declared with its choices (option or server)
            choices = f.metadata.get("server_choices") or getattr(
                f.metadata.get("option"), "choices", None
            )
            value = getattr(self, f.name)
            if choices is not None and value not in choices:
                raise ConfigError(f"unknown {f.name} {value!r}; choose from {', '.join(choices)}")
        if self.draft_kind.from_text and self.constraint is not None:
            raise ConfigError("the n-gram draft does not support constraints yet; use ar or sd")
        if self.draft_kind.from_text and self.applies_min_tokens:
            raise ConfigError(
                "the n-gram draft does not support min_tokens (a mask on the stop tokens); "
                "use ar or sd with the draft model"
            )

    def _check_potentials(self) -> None:
        if self.constraint is not None and not isinstance(
            self.constraint, Constraint | TokenConstraint
        ):
            raise ConfigError(
                "constraint must be a Regex, JsonSchema, Grammar or TokenConstraint, got "
                f"{type(self.constraint).__name__}"
            )
        if self.constraint is not None and self.ignore_eos:
            raise ConfigError(
                "ignore_eos cannot be combined with a constraint: the constraint decides where "
                "the output ends (its stop token is allowed only once the output is complete)"
            )
        if self.constraint is not None and self.applies_min_tokens:
            raise ConfigError(
                "min_tokens cannot be combined with a constraint: the constraint decides where "
                "the output ends"
            )
        # which methods take a reward, a vote or n-gram drafts is the decoder table's to say
        # (smcspec.decoding.registry.decoder_for, run by Engine.prepare and the CLI)
        if self.reward is not None and not isinstance(self.reward, Reward):
            raise ConfigError(f"reward must be a Reward, got {type(self.reward).__name__}")
        if self.vote is not None and not isinstance(self.vote, Vote):
            raise ConfigError(f"vote must be a Vote, got {type(self.vote).__name__}")


DEFAULT_MIN_ESS = 4.0
"""The fidelity floor of settings chosen from measured costs: an smc setting is chosen only if
its predicted ESS after a round is at least this many effective particles
(:mod:`smcspec.tuning.predict`)."""


def check_min_ess(min_ess: object) -> float:
    """``min_ess`` if it is a number in [0, MAX_PARTICLES]. Raises :class:`ConfigError`."""
    if not _is_number(min_ess) or not 0 <= min_ess <= MAX_PARTICLES:
        raise ConfigError(
            f"min_ess must be a number of effective particles in [0, {MAX_PARTICLES}], "
            f"got {min_ess!r}"
        )
    return float(min_ess)


def check_min_particles(min_particles: object) -> int:
    """``min_particles`` (the fewest particles a tuned smc setting may have) if it is an
    integer in [1, MAX_PARTICLES]. Raises :class:`ConfigError` otherwise."""
    if not _is_int(min_particles) or not 1 <= min_particles <= MAX_PARTICLES:
        raise ConfigError(f"min_particles must be in [1, {MAX_PARTICLES}], got {min_particles!r}")
    return min_particles


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)
