"""Potentials: hard constraints (token masks) and rewards for the decoders.

The sequence-level target becomes ``pi(x) ∝ p_T(x)^alpha * Psi(x)`` (``docs/constraints.md``;
Lew et al. 2023, "Sequential Monte Carlo Steering of Large Language Models using
Probabilistic Programs"; Park et al. 2024, "Grammar-Aligned Decoding"; twisting: Naesseth
et al. 2019, "Elements of Sequential Monte Carlo").

- A hard constraint ``Psi = 1[x in A]`` is applied through token masks ``m_t(v)`` (1 when the
  prefix followed by ``v`` can still be completed inside A; EOS only where the prefix is in A).
  The user-facing specs :class:`Regex`, :class:`JsonSchema` and :class:`Grammar` are compiled
  once per request against the engine's tokenizer with llguidance into a
  :class:`TokenConstraint`; each particle holds a :class:`ConstraintState` (a matcher) that
  gives the mask, consumes tokens, rolls back (sd) and is copied on resampling.
- A reward ``Psi = exp(beta * R(x))`` (:class:`Reward`) is a Python callable on decoded text,
  batched over particles; with ``prefix_fn`` it is used as the twist on prefixes.

The decoders only see :class:`TokenConstraint` / :class:`ConstraintState`, so any token-level
automaton implementing them works (the statistical tests use a tiny DFA over token ids).
"""

from __future__ import annotations

import json
import math
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from smcspec.errors import ConfigError, NumericalError, SmcspecError


class DeadEndError(NumericalError):
    """No continuation satisfies the constraint (every particle, or the only sample, hit a
    prefix whose mask is empty)."""


class ConstraintState(ABC):
    """One particle's position in a constraint: a matcher over the tokens generated so far."""

    @abstractmethod
    def allowed(self) -> torch.Tensor:
        """bool ``[V]`` on CPU: tokens that keep the prefix completable inside A (a stop token
        only where the prefix is in A). All False: a dead end."""

    @abstractmethod
    def consume(self, tokens: Sequence[int]) -> None:
        """Advance through ``tokens`` (each allowed in turn). Raises :class:`DeadEndError` if
        the constraint rejects one (a mask that allowed a token leading nowhere)."""

    @abstractmethod
    def rollback(self, n: int) -> None:
        """Undo the last ``n`` consumed tokens (sd's rejected draft tokens)."""

    @abstractmethod
    def copy(self) -> ConstraintState:
        """An independent copy (resampling copies a matcher with its particle)."""

    @abstractmethod
    def is_accepting(self) -> bool:
        """Whether the tokens consumed so far form a sequence in A."""


class TokenConstraint(ABC):
    """A constraint compiled for one vocabulary; :meth:`start` gives a fresh state."""

    vocab_size: int

    @abstractmethod
    def start(self) -> ConstraintState:
        """The state before any generated token."""


class Constraint(ABC):
    """A user-facing constraint spec, compiled against a tokenizer per request."""

    @abstractmethod
    def grammar(self) -> str:
        """llguidance's grammar text for this spec (no tokenizer needed)."""

    def compile(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_ids: Sequence[int],
        budget: GrammarBudget | None = None,
    ) -> TokenConstraint:
        """Compile against a Hugging Face tokenizer for ``vocab_size`` token ids.

        Args:
            tokenizer: a ``transformers`` tokenizer (fast, byte-level or sentencepiece).
            vocab_size: ids ``0..vocab_size-1`` may be sampled (the model's, which may exceed
                the tokenizer's); ids the tokenizer lacks are never allowed.
            stop_ids: tokens that end a sequence (EOS, end of turn); allowed only where the
                prefix is in A. Empty: the tokenizer's EOS.
            budget: the time limits of compiling and of each mask (default
                :class:`GrammarBudget`'s).
        Raises:
            ConfigError: invalid pattern / schema / grammar (llguidance's message).
            GrammarBudgetError: compiling took longer than ``budget.compile_s``.
            CompilersBusyError: no compile slot came free within ``budget.compile_s``.
        """
        return LLGuidanceConstraint(self.grammar(), tokenizer, vocab_size, stop_ids, budget)


def grammar_from(kind: str, text: str) -> str:
    """llguidance's grammar for ``text`` of ``kind`` (``regex``, ``json_schema``, ``lark``).

    Raises:
        ConfigError: llguidance cannot parse it (its message, on one line).
    """
    import llguidance

    try:
        return llguidance.grammar_from(kind, text)
    except Exception as e:  # llguidance raises ValueError/RuntimeError
        raise ConfigError(f"invalid {kind}: " + " ".join(str(e).split())) from e


@dataclass(frozen=True)
class Regex(Constraint):
    """Output must match ``pattern`` (Rust ``regex`` syntax, anchored at both ends)."""

    pattern: str

    def __post_init__(self) -> None:
        if not isinstance(self.pattern, str):
            raise ConfigError(f"regex pattern must be a string, got {type(self.pattern).__name__}")

    def grammar(self) -> str:
        return grammar_from("regex", self.pattern)


MAX_SCHEMA_DEPTH = 100
"""The deepest JSON nesting a schema may have (a ``JsonSchema``, a tool's parameters; the
schema object itself is level 1). llguidance refuses JSON nested past 128 levels (serde_json's
recursion limit: "recursion limit exceeded") and the tool-call grammar wraps each tool's
schema in a few more; deeper schemas are a :class:`ConfigError` before anything recurses
over them (``json.dumps`` of a ~950-deep schema raised RecursionError)."""


def json_depth(value: Any, limit: int) -> int:
    """The nesting depth of dicts and lists in ``value`` (a scalar: 0, ``{}``: 1), counted
    without recursion; counting stops at ``limit + 1`` (anything deeper reads as that)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if not isinstance(item, (dict, list)):
            continue
        deepest = max(deepest, depth)
        if depth > limit:
            break
        stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


def check_schema_depth(schema: Any, what: str) -> None:
    """Raises :class:`ConfigError` when ``schema`` nests deeper than :data:`MAX_SCHEMA_DEPTH`
    (``what`` names it in the message)."""
    if json_depth(schema, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
        raise ConfigError(
            f"{what}: nested deeper than {MAX_SCHEMA_DEPTH} levels, more than the schema "
            "compiler takes"
        )


JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{1,20}"
"""Whitespace allowed between JSON tokens unless a schema's ``x-guidance`` says otherwise: at
most 20 characters at a time, as llama.cpp's JSON-schema grammars bound it (``space ::= | " "
| "\n" [ \t]{0,20}``). Unbounded whitespace lets locally-masked decoding fall into runs of
spaces that never end (seen with masked AR and SD on the default pair)."""


@dataclass(frozen=True)
class JsonSchema(Constraint):
    """Output must be JSON valid under ``schema`` (a dict, or its JSON text).

    Whitespace between tokens is bounded by :data:`JSON_WHITESPACE` unless the schema has an
    ``x-guidance`` object (llguidance's JSON options, e.g. ``{"whitespace_flexible": false}``
    for compact JSON), which is then used as given.
    """

    schema: dict | str

    def __post_init__(self) -> None:
        schema = self.schema
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except (ValueError, RecursionError) as e:  # RecursionError: nested too deep
                raise ConfigError(f"invalid json_schema: not JSON ({e})") from e
        elif not isinstance(schema, dict):
            raise ConfigError(
                f"json schema must be a dict or a string, got {type(schema).__name__}"
            )
        check_schema_depth(schema, "the json schema")

    def grammar(self) -> str:
        schema = json.loads(self.schema) if isinstance(self.schema, str) else self.schema
        if isinstance(schema, dict) and "x-guidance" not in schema:
            schema = {**schema, "x-guidance": {"whitespace_pattern": JSON_WHITESPACE}}
        return grammar_from("json_schema", json.dumps(schema))


@dataclass(frozen=True)
class Grammar(Constraint):
    """Output must be derived from a Lark grammar (llguidance's Lark dialect; rule ``start``)."""

    lark: str

    def __post_init__(self) -> None:
        if not isinstance(self.lark, str):
            raise ConfigError(f"grammar must be a string, got {type(self.lark).__name__}")

    def grammar(self) -> str:
        return grammar_from("lark", self.lark)


COMPILE_BUDGET_S = 5.0
"""Default wall seconds a request's constraint may take to compile (llguidance's grammar,
lexer and first mask; the tokenizer's one-time conversion not included). Measured on an
idle-ish 2-core CPU: the 500-value enum tool of issue 87, 0.03 s against the default pair's
tokenizer; 20 tools of 500-way ``anyOf`` arguments, 2.8 s against the tiny test vocabulary."""

MASK_BUDGET_S = 1.0
"""Default wall seconds one token mask may take (each particle's, each position's); measured
masks of the default pair's 151,936-token vocabulary take under 0.01 s."""

MAX_COMPILES = 2
"""Compilations that may run at once. A compile past its budget cannot be stopped (llguidance
runs it in Rust): it goes on in the background until llguidance's own limits
(``LLParserLimits``: lexer fuel, grammar size) end it, and holds its slot until then, so that
refused schemas cannot pile up work."""


class GrammarBudgetError(ConfigError):
    """A constraint took longer to compile, or one mask longer to compute, than its
    :class:`GrammarBudget` allows (the message names the limit): the request's schema or
    grammar is too complex to serve (HTTP 400, CLI exit 2)."""


class CompilersBusyError(SmcspecError):
    """Every compile slot (:data:`MAX_COMPILES`) stayed taken for the whole compile budget:
    the server is busy (HTTP 429), the schema may be fine."""


@dataclass(frozen=True)
class GrammarBudget:
    """Time limits of one request's constraint (wall seconds).

    Attributes:
        compile_s: compiling it (grammar, lexer and first mask); a request waiting for a
            compile slot spends this budget too.
        mask_s: computing one token mask while decoding.
    Raises:
        ConfigError: a limit that is not a finite number > 0.
    """

    compile_s: float = COMPILE_BUDGET_S
    mask_s: float = MASK_BUDGET_S

    def __post_init__(self) -> None:
        for name in ("compile_s", "mask_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ConfigError(
                    f"grammar budget {name} must be a finite number > 0, got {value!r}"
                )


_LL_TOKENIZERS: dict[tuple[int, int, tuple[int, ...]], tuple[Any, Any]] = {}
_LL_TOKENIZERS_LOCK = threading.Lock()  # requests are prepared on several threads
_COMPILE_SLOTS = threading.BoundedSemaphore(MAX_COMPILES)


def _ll_tokenizer(tokenizer: Any, vocab_size: int, stop_ids: Sequence[int]) -> Any:
    """llguidance's tokenizer for a HF tokenizer, cached per (tokenizer, V, stop ids)."""
    import llguidance.hf

    key = (id(tokenizer), vocab_size, tuple(sorted(stop_ids)))  # the entry keeps it alive
    with _LL_TOKENIZERS_LOCK:
        if key not in _LL_TOKENIZERS:
            eos: int | list[int] | None = sorted(stop_ids) if stop_ids else None
            try:
                ll = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
                _LL_TOKENIZERS[key] = (tokenizer, ll)
            except Exception as e:
                raise ConfigError(f"llguidance cannot use this tokenizer: {e}") from e
        return _LL_TOKENIZERS[key][1]


def _compile_matcher(grammar: str, ll_tokenizer: Any) -> Any:
    """llguidance's matcher of ``grammar``, its first mask computed (llguidance builds its
    lexer lazily: the first mask is part of compiling). Raises :class:`ConfigError`."""
    import llguidance

    try:
        matcher = llguidance.LLMatcher(ll_tokenizer, grammar)
    except Exception as e:  # anything llguidance raises here is about the grammar
        raise ConfigError("invalid constraint: " + " ".join(str(e).split())) from e
    if not matcher.is_error():
        matcher.compute_bitmask()
    if matcher.is_error():
        raise ConfigError("invalid constraint: " + " ".join(matcher.get_error().split()))
    return matcher


def compile_within(grammar: str, ll_tokenizer: Any, seconds: float) -> Any:
    """:func:`_compile_matcher` on a thread of its own, waited for at most ``seconds`` (the
    wait for a compile slot included). llguidance drops the GIL while it compiles, so the
    caller's process keeps running meanwhile.

    Raises:
        ConfigError: an invalid grammar.
        GrammarBudgetError: not compiled within ``seconds`` (the compile goes on in the
            background, holding its slot: :data:`MAX_COMPILES`).
        CompilersBusyError: no slot came free within ``seconds``.
    """
    deadline = time.monotonic() + seconds
    if not _COMPILE_SLOTS.acquire(timeout=seconds):
        raise CompilersBusyError(
            f"the server is busy compiling other constraints ({MAX_COMPILES} at once); retry later"
        )
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["matcher"] = _compile_matcher(grammar, ll_tokenizer)
        except BaseException as e:  # handed to the caller
            box["error"] = e
        finally:
            _COMPILE_SLOTS.release()

    thread = threading.Thread(target=work, name="smcspec-grammar-compile", daemon=True)
    thread.start()
    thread.join(max(0.0, deadline - time.monotonic()))
    if thread.is_alive():
        raise GrammarBudgetError(
            f"the constraint (schema, tools or grammar) did not compile within the "
            f"{seconds:g} s limit (grammar compile_s); simplify it (fewer tools, smaller "
            "enums and anyOf lists, shorter patterns)"
        )
    if "error" in box:
        raise box["error"]
    return box["matcher"]


class LLGuidanceConstraint(TokenConstraint):
    """A grammar compiled by llguidance for one tokenizer (masks over ``vocab_size`` ids),
    within ``budget`` (:class:`GrammarBudget`; default limits when None).

    Raises :class:`ConfigError` with llguidance's message when the grammar is invalid, and
    :class:`GrammarBudgetError` / :class:`CompilersBusyError` as :func:`compile_within`.
    """

    def __init__(
        self,
        grammar: str,
        tokenizer: Any,
        vocab_size: int,
        stop_ids: Sequence[int],
        budget: GrammarBudget | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        self.budget = budget or GrammarBudget()
        self._tok = _ll_tokenizer(tokenizer, vocab_size, stop_ids)
        self._start = compile_within(grammar, self._tok, self.budget.compile_s)

    def start(self) -> ConstraintState:
        return LLGuidanceState(self._start.deep_copy(), self.vocab_size, self.budget.mask_s)


class LLGuidanceState(ConstraintState):
    """A per-particle llguidance ``LLMatcher``; a mask that takes longer than ``mask_s``
    seconds raises :class:`GrammarBudgetError`."""

    def __init__(self, matcher: Any, vocab_size: int, mask_s: float = MASK_BUDGET_S) -> None:
        self.matcher, self.vocab_size, self.mask_s = matcher, vocab_size, mask_s

    def allowed(self) -> torch.Tensor:
        if self.matcher.is_error():
            return torch.zeros(self.vocab_size, dtype=torch.bool)
        t0 = time.perf_counter()
        raw = self.matcher.compute_bitmask()
        seconds = time.perf_counter() - t0
        if seconds > self.mask_s:
            raise GrammarBudgetError(
                f"one token mask of the constraint took {seconds:.2f} s, over the "
                f"{self.mask_s:g} s limit (grammar mask_s); simplify the schema or grammar"
            )
        bits = np.frombuffer(raw, dtype=np.uint8)
        mask = np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)
        return torch.from_numpy(mask)

    def consume(self, tokens: Sequence[int]) -> None:
        if not self.matcher.consume_tokens(list(tokens)):
            err = self.matcher.get_error().splitlines()[0:1]
            raise DeadEndError(f"the constraint rejected tokens {list(tokens)}: {err}")

    def rollback(self, n: int) -> None:
        if n > 0 and not self.matcher.rollback(n):
            raise ConfigError(f"constraint cannot roll back {n} tokens")

    def copy(self) -> ConstraintState:
        return LLGuidanceState(self.matcher.deep_copy(), self.vocab_size, self.mask_s)

    def is_accepting(self) -> bool:
        return bool(self.matcher.is_accepting())


class MinTokens(TokenConstraint):
    """The stop tokens may not end the output before ``n`` tokens (vLLM's ``min_tokens``):
    the mask forbids ``stop_ids`` at the first ``n`` positions and allows every token after.

    Args:
        stop_ids: the tokens that would end the output (EOS, end of turn, the request's).
        vocab_size: the mask's length.
        n: the fewest tokens (>= 1).
    """

    def __init__(self, stop_ids: Sequence[int], vocab_size: int, n: int) -> None:
        self.vocab_size, self.n = vocab_size, n
        self._early = torch.ones(vocab_size, dtype=torch.bool)
        self._early[[i for i in stop_ids if 0 <= i < vocab_size]] = False
        self._late = torch.ones(vocab_size, dtype=torch.bool)

    def start(self) -> ConstraintState:
        return MinTokensState(self, 0)


class MinTokensState(ConstraintState):
    """How many tokens a :class:`MinTokens` output holds so far."""

    def __init__(self, constraint: MinTokens, count: int) -> None:
        self.constraint, self.count = constraint, count

    def allowed(self) -> torch.Tensor:
        c = self.constraint
        return (c._early if self.count < c.n else c._late).clone()

    def consume(self, tokens: Sequence[int]) -> None:
        early = self.constraint._early
        for t in tokens:
            if self.count < self.constraint.n and not bool(early[t]):
                raise DeadEndError(f"a stop token ({t}) before min_tokens={self.constraint.n}")
            self.count += 1

    def rollback(self, n: int) -> None:
        self.count -= min(n, self.count)

    def copy(self) -> ConstraintState:
        return MinTokensState(self.constraint, self.count)

    def is_accepting(self) -> bool:
        return self.count >= self.constraint.n


# ------------------------------------------------------------------------------ timing


@dataclass
class ConstraintClock:
    """Wall seconds one request spent in its constraint (masks, consume, rollback, copies)."""

    seconds: float = 0.0

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, its wall time added to :attr:`seconds` (also when it raises)."""
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.seconds += time.perf_counter() - t0


class TimedState(ConstraintState):
    """A :class:`ConstraintState` that adds the wall time of every call to ``clock``; its
    copies share the clock, so all particles of a request add to one total (the decoders
    report it as ``stats["constraint_seconds"]``, to set beside the forward time)."""

    def __init__(self, inner: ConstraintState, clock: ConstraintClock) -> None:
        self.inner, self.clock = inner, clock

    def allowed(self) -> torch.Tensor:
        return self.clock.call(self.inner.allowed)

    def consume(self, tokens: Sequence[int]) -> None:
        self.clock.call(self.inner.consume, tokens)

    def rollback(self, n: int) -> None:
        self.clock.call(self.inner.rollback, n)

    def copy(self) -> ConstraintState:
        return TimedState(self.clock.call(self.inner.copy), self.clock)

    def is_accepting(self) -> bool:
        return self.clock.call(self.inner.is_accepting)


def timed_start(constraint: TokenConstraint) -> tuple[TimedState, ConstraintClock]:
    """``constraint.start()`` wrapped in a :class:`TimedState` with a fresh clock."""
    clock = ConstraintClock()
    return TimedState(clock.call(constraint.start), clock), clock


# ------------------------------------------------------------------------------ helpers


def compiled_constraint(constraint: object) -> TokenConstraint | None:
    """``cfg.constraint`` as the decoders need it. Raises :class:`ConfigError` for an
    uncompiled spec (``Engine`` compiles specs against its tokenizer)."""
    if constraint is None or isinstance(constraint, TokenConstraint):
        return constraint
    raise ConfigError(
        "the decoders need a compiled constraint; Engine compiles Regex/JsonSchema/Grammar "
        "against its tokenizer (or call .compile(tokenizer, vocab_size, stop_ids))"
    )


def reorder(states: list[ConstraintState], ancestors: torch.Tensor) -> list[ConstraintState]:
    """Resampling: particle i becomes a copy of ``states[ancestors[i]]`` (int64 ``[N]``)."""
    return [states[a].copy() for a in ancestors.tolist()]


def stack_masks(
    states: Sequence[ConstraintState], active: Sequence[bool], vocab: int, device: torch.device
) -> torch.Tensor:
    """bool ``[N, vocab]``: each active state's mask; all True for inactive rows (a finished,
    stopped or dead particle whose tokens are discarded)."""
    out = torch.ones(len(states), vocab, dtype=torch.bool)
    for i, (s, a) in enumerate(zip(states, active, strict=True)):
        if a:
            out[i] = s.allowed()[:vocab]
    return out.to(device)


# ------------------------------------------------------------------------------ rewards


@dataclass(frozen=True)
class Reward:
    """A reward potential ``Psi(x) = exp(beta * R(x))`` (smc only).

    Attributes:
        fn: ``R`` on complete texts, batched: ``fn(list[str]) -> list[float]``.
        beta: inverse temperature of the reward (finite).
        prefix_fn: optional ``R`` estimate on prefixes, used as the twist
            ``phi = exp(beta * prefix_fn)``: each round multiplies a particle's weight by
            ``phi(new) / phi(old)``, and a finished particle's last factor uses ``fn``
            (Naesseth et al. 2019; Lew et al. 2023). Without it the whole reward is applied
            to the final weights before the output draw (importance sampling at the end).
        detokenize: token ids -> text; ``Engine`` fills it from its tokenizer.
    Raises :class:`ConfigError` when ``fn`` is not callable or ``beta`` not finite.
    """

    fn: Callable[[list[str]], Sequence[float]]
    beta: float = 1.0
    prefix_fn: Callable[[list[str]], Sequence[float]] | None = None
    detokenize: Callable[[list[int]], str] | None = None

    def __post_init__(self) -> None:
        if not callable(self.fn) or (self.prefix_fn is not None and not callable(self.prefix_fn)):
            raise ConfigError("reward fn and prefix_fn must be callables on lists of strings")
        if not (isinstance(self.beta, int | float) and math.isfinite(self.beta)):
            raise ConfigError(f"reward beta must be a finite number, got {self.beta!r}")

    def log_potential(self, seqs: list[list[int]], prefix: bool) -> torch.Tensor:
        """float64 ``[len(seqs)]``: ``beta * R`` (``prefix``: ``beta * prefix_fn``) of each
        token sequence. Raises :class:`NumericalError` for a non-finite or missing value and
        :class:`ConfigError` without ``detokenize``."""
        if self.detokenize is None:
            raise ConfigError("reward needs detokenize (Engine sets it from its tokenizer)")
        fn = self.prefix_fn if prefix else self.fn
        values = list(fn([self.detokenize(s) for s in seqs]))
        if len(values) != len(seqs):
            raise NumericalError(f"reward returned {len(values)} values for {len(seqs)} texts")
        out = torch.tensor([float(v) for v in values], dtype=torch.float64)
        if not bool(torch.isfinite(out).all()):
            raise NumericalError("reward returned a non-finite value")
        return self.beta * out
