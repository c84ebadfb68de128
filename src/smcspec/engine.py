"""The engine: a loaded draft/target pair and ``generate``.

Load once, generate many times::

    from smcspec import Engine, GenerationConfig
    engine = Engine.load()                      # default pair from the PyPI model packages
    result = engine.generate("Write a haiku about caches.", GenerationConfig(particles=8))
    print(result.text, result.stats)
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from smcspec.aggregate import Vote
from smcspec.backends import pool
from smcspec.backends.pool import CacheNeed, Reservation, ResourcePool
from smcspec.chat import encode_chat, encode_raw
from smcspec.config import GenerationConfig
from smcspec.decoding import DecodeOutput, Program, run_program
from smcspec.decoding.decoder_stats import Stats
from smcspec.decoding.job import Job
from smcspec.decoding.logprobs import TokenLogprobs
from smcspec.decoding.output import hit_token_cap
from smcspec.decoding.registry import Decoder, decoder_for
from smcspec.errors import ConfigError, ContextLengthError, PromptError
from smcspec.models.loading import LoadedModel
from smcspec.models.pair import check_same_vocabulary, load_pair
from smcspec.potentials import Constraint, GrammarBudget, MinTokens
from smcspec.tool_calls import ToolCalls

# end-of-generation tokens of common chat templates, used where the tokenizer has them as
# special tokens (Qwen2.5's vocabulary holds "</s>" as ordinary text, id 128247)
_EOG_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "</s>", "<|end|>")

Prompt = str | list[dict[str, str]]

SEED_RANGE = 2**64  # torch.Generator seeds are 64-bit; a seed s is used as s mod 2**64


@dataclass
class GenerationResult:
    """The outcome of :meth:`Engine.generate`.

    ``seconds`` is wall time from the start of prefill to the last token; ``tokens_per_second``
    is ``new_tokens / seconds``. ``logprobs`` (with ``config.logprobs``): each new token's
    log-probability and alternatives (:class:`~smcspec.decoding.logprobs.TokenLogprobs`);
    ``prompt_logprobs`` (with ``config.prompt_logprobs``): prompt tokens 1 .. P-1's.
    ``first_token_s`` and ``max_gap_s``: the stream's timing (seconds to the first token, from
    the start of the prefill with :meth:`Engine.generate` and from submission in the server;
    the longest wait between two streamed tokens; None until measured).
    ``particles`` (smc with ``return_particles``) holds
    ``{"text", "tokens", "weight"}`` dicts with normalised weights. ``vote`` (smc with
    ``vote``) is the weighted vote over the particles' answers
    (:class:`~smcspec.aggregate.Vote`): ``{"answer", "share", "text", "answers"}``, the
    text being the particle that carries the answer with the largest weight; None when no
    particle has an answer.
    ``decode_stats`` is the decoder's own statistics, typed
    (:mod:`smcspec.decoding.decoder_stats`); ``seed`` the seed it ran with, ``greedy``
    whether it decoded greedily, ``ran_as`` the method whose decoder ran it where that is
    not the requested one (greedy ``smc`` runs as ``sd``), else None; :attr:`stats` is all
    of them as JSON.
    """

    text: str
    token_ids: list[int]
    method: str
    prompt_tokens: int
    new_tokens: int
    seconds: float
    tokens_per_second: float
    decode_stats: Stats
    seed: int | None = None
    greedy: bool = False
    ran_as: str | None = None
    particles: list[dict[str, Any]] | None = None
    log_normalizer: float | None = None
    finish_reason: str = "stop"  # "length": cut by max_new_tokens (see hit_token_cap)
    vote: dict[str, Any] | None = None
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: TokenLogprobs | None = None
    first_token_s: float | None = None  # seconds to the first streamed token
    max_gap_s: float | None = None  # the longest wait between two streamed tokens
    max_burst: int | None = None  # Engine.generate: the most tokens streamed at once

    @property
    def stats(self) -> dict[str, Any]:
        """The result's statistics as JSON, derived from the typed fields: the decoder's
        keys (``decode_stats.to_dict()``), then ``seed``, ``greedy`` (only when true) and
        ``ran_as`` (only where set), in that order: what the server's ``smcspec`` field,
        ``eval``'s records and ``generate --json`` write."""
        out = {**self.decode_stats.to_dict(), "seed": self.seed}
        if self.greedy:
            out["greedy"] = True
        if self.ran_as is not None:
            out["ran_as"] = self.ran_as
        return out

    @property
    def stream_stats(self) -> dict[str, float]:
        """The stream's timing as JSON fields (:func:`stream_stats`)."""
        return stream_stats(self.first_token_s, self.max_gap_s)

    def to_dict(self) -> dict[str, Any]:
        """The result as JSON-ready fields (seconds to 4 decimals, tokens/s to 3), the
        decoder's stats included (``smcspec generate --json`` prints it with ``hit_cap``)."""
        d = {
            "text": self.text,
            "method": self.method,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "seconds": round(self.seconds, 4),
            "tokens_per_second": round(self.tokens_per_second, 3),
            "finish_reason": self.finish_reason,
            **self.stream_stats,
            **self.stats,
        }
        if self.particles is not None:
            d["particles"] = self.particles
            d["log_normalizer"] = self.log_normalizer
        if self.vote is not None:
            d["vote"] = self.vote
        return d


def stream_stats(first_token_s: float | None, max_gap_s: float | None) -> dict[str, float]:
    """A result's stream timing (its stats' ``time_to_first_token_s``, from the request's
    start, and ``max_token_gap_s``, the longest wait between two streamed tokens): seconds to
    4 decimals, each only once measured."""
    out = {}
    if first_token_s is not None:
        out["time_to_first_token_s"] = round(first_token_s, 4)
    if max_gap_s is not None:
        out["max_token_gap_s"] = round(max_gap_s, 4)
    return out


class TokenClock:
    """Times a stream: wraps a token callback (``None``: times only) and records the
    seconds from ``start`` to the first token, the longest gap between two calls that
    carried tokens, and the most tokens one call carried (``max_burst``: tokens held back,
    then released at once; a count, unlike the gap, that another process's load does not
    change)."""

    def __init__(self, callback: Callable[[list[int]], None] | None, start: float) -> None:
        self.callback, self.start = callback, start
        self.first_s: float | None = None
        self.max_gap_s: float | None = None
        self.max_burst = 0
        self._last: float | None = None

    def __call__(self, ids: list[int]) -> None:
        self.max_burst = max(self.max_burst, len(ids))
        if ids:
            now = time.perf_counter()
            if self._last is None:
                self.first_s = now - self.start
            else:
                self.max_gap_s = max(self.max_gap_s or 0.0, now - self._last)
            self._last = now
        if self.callback is not None:
            self.callback(ids)


class TextStreamer:
    """Turns token ids into text increments, holding back incomplete UTF-8 characters."""

    def __init__(self, tokenizer, callback: Callable[[str], None]) -> None:
        self.tokenizer, self.callback = tokenizer, callback
        self.ids: list[int] = []
        self.sent = 0

    def __call__(self, ids: list[int]) -> None:
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return
        if len(text) > self.sent:
            self.callback(text[self.sent :])
            self.sent = len(text)


class Engine:
    """A target model, an optional draft sharing its vocabulary, and their tokenizer.

    Raises:
        ModelFileError: the draft's vocabulary differs from the target's. ConfigError: a
        target without a tokenizer.
    """

    def __init__(self, target: LoadedModel, draft: LoadedModel | None = None) -> None:
        if target.tokenizer is None:
            raise ConfigError("the target must be loaded with its tokenizer (tokenizer=True)")
        self.target, self.draft = target, draft
        self.tokenizer = target.tokenizer
        self.vocab = target.vocab_size
        if draft is not None:
            check_same_vocabulary(target, draft)
            self.vocab = min(self.vocab, draft.vocab_size)
            if hasattr(target.model, "share_pool"):  # torch: one default KV pool a device
                target.model.share_pool(draft.model)
        self.stop_ids = frozenset(self._stop_ids())
        self.grammar_budget = GrammarBudget()  # constraints' time limits, unless prepare's

    @classmethod
    def load(cls, *args: Any, **kwargs: Any) -> Engine:
        """Load a pair and make its engine: :func:`smcspec.models.pair.load_pair`'s arguments
        (target, draft, device, dtype, with_draft, backend, threads, quantize_draft, log,
        gpu_layers, rpc, fair_share, fp8) and errors. ``None`` selects the default model."""
        return cls(*load_pair(*args, **kwargs))

    def _stop_ids(self) -> set[int]:
        """The tokenizer's end-of-text token and those of :data:`_EOG_TOKENS` that it holds
        as special tokens (never a token that is ordinary text, which a model may write
        inside an answer), below the pair's vocabulary size."""
        return stop_token_ids(self.tokenizer, self.vocab)

    def encode(
        self,
        prompt: Prompt,
        chat: bool = True,
        parse_special: bool = True,
        tools: list[dict] | None = None,
    ) -> list[int]:
        """Token ids of ``prompt``: chat-templated (a string is one user message) or raw.

        Message contents are tokenized as text: special-token text inside a message (e.g. a
        forged ``<|im_start|>system``) does not become control tokens
        (:func:`smcspec.chat.encode_chat`). A raw prompt's special-token text is parsed,
        unless ``parse_special`` is False. ``tools`` (OpenAI-shaped function entries) are
        rendered by the chat template.

        Raises:
            ConfigError: empty prompt, ``chat`` with a tokenizer that has no template,
                ``tools`` with a raw prompt or a template that cannot render them.
        """
        tok = self.tokenizer
        if isinstance(prompt, str) and not prompt.strip() and not chat:
            raise ConfigError("the prompt is empty")
        if chat:
            if not getattr(tok, "chat_template", None):
                raise ConfigError("this model has no chat template; use --no-chat")
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            _check_messages(messages)
            return encode_chat(tok, messages, tools)
        if tools is not None:
            raise ConfigError("tools need a chat prompt (the chat template renders them)")
        if not isinstance(prompt, str):
            raise ConfigError("a raw (--no-chat) prompt must be a string")
        _check_text(prompt, "the prompt")
        return encode_raw(tok, prompt, parse_special)

    def generate(
        self,
        prompt: Prompt | list[int],
        config: GenerationConfig | None = None,
        chat: bool = True,
        on_text: Callable[[str], None] | None = None,
        fit_context: bool = False,
    ) -> GenerationResult:
        """Generate a continuation of ``prompt``.

        Args:
            prompt: a user message (chat template applied), a list of chat messages, a raw
                string with ``chat=False``, or token ids.
            config: decoding method and parameters (defaults: SMC-SD, N=4, K=4).
            on_text: called with each new piece of final text as it is produced.
            fit_context: lower ``max_new_tokens`` to what the context leaves (see
                :meth:`prepare`).
        Raises:
            ConfigError: invalid config or prompt; ContextLengthError: prompt too long;
            NumericalError: NaN logits.
        """
        job = self.prepare(prompt, config, chat, fit_context=fit_context)
        streamer = TextStreamer(self.tokenizer, on_text) if on_text else None
        reason = self.never_fits(job)
        if reason is not None:
            raise ContextLengthError(reason)
        reservation = self.try_reserve(job)
        if reservation is None:
            raise ContextLengthError(
                "the models' KV pools are held by other requests on this engine; try again"
            )
        try:
            t0 = time.perf_counter()
            clock = TokenClock(streamer, t0)
            out = run_program(self.program(replace(job, on_tokens=clock, reservation=reservation)))
            if self.target.model.device.type == "cuda":
                torch.cuda.synchronize()  # inside the timed region
            seconds = time.perf_counter() - t0
        finally:
            reservation.release()
        result = self.finish(job, out, seconds)
        result.first_token_s, result.max_gap_s = clock.first_s, clock.max_gap_s
        result.max_burst = clock.max_burst
        return result

    # ------------------------------------------------------------------ pools
    def models(self) -> dict[str, Any]:
        """Each loaded model by role (``target``, ``draft``)."""
        out = {"target": self.target.model}
        if self.draft is not None:
            out["draft"] = self.draft.model
        return out

    def pools(self) -> dict[str, ResourcePool]:
        """Each loaded model's pool by role (``target``, ``draft``)."""
        return {role: m.pool for role, m in self.models().items()}

    def cache_needs(self, job: Job) -> list[CacheNeed]:
        """The KV caches ``job``'s decoder opens (see :meth:`program`)."""
        return decoder_for(job.config).caches(job.config, len(job.ids))

    def never_fits(self, job: Job) -> str | None:
        """Why ``job`` can never run on these models' pools (even alone), or None
        (:func:`smcspec.backends.pool.never_fits`)."""
        return pool.never_fits(self.models(), self.cache_needs(job))

    def try_reserve(self, job: Job, owner: object | None = None) -> Reservation | None:
        """Reserve everything ``job`` can ever use on both models, all-or-nothing, or None
        (:func:`smcspec.backends.pool.try_reserve`); the caller releases it."""
        return pool.try_reserve(self.models(), self.cache_needs(job), owner)

    def prepare(
        self,
        prompt: Prompt | list[int],
        config: GenerationConfig | None = None,
        chat: bool = True,
        parse_special: bool = True,
        fit_context: bool = False,
        grammar_budget: GrammarBudget | None = None,
    ) -> Job:
        """Validate ``config``, tokenize ``prompt`` (see :meth:`encode`; a
        :class:`~smcspec.tool_calls.ToolCalls` constraint's tools are rendered by the chat
        template) and check the context; fixes the seed. ``fit_context``: lower
        ``max_new_tokens`` to what the context leaves after the prompt instead of refusing
        (a default cap, not the user's). ``grammar_budget``: the constraint's time limits
        (default :attr:`grammar_budget`).

        Raises:
            ConfigError, ContextLengthError (see :meth:`generate`);
            :class:`~smcspec.potentials.GrammarBudgetError` (a ConfigError) when the
            constraint does not compile within its budget;
            :class:`~smcspec.potentials.CompilersBusyError` when no compile slot frees.
        """
        cfg = (config or GenerationConfig()).validate()
        decoder = decoder_for(cfg)
        if decoder.draft_model and self.draft is None:
            raise ConfigError(f"method {cfg.method!r} needs a draft model; none is loaded")
        tools = cfg.constraint.template_tools() if isinstance(cfg.constraint, ToolCalls) else None
        if _is_token_list(prompt):
            ids = list(prompt)
        else:
            ids = self.encode(prompt, chat, parse_special, tools)
        if not ids:
            raise PromptError("the prompt is empty")
        if any(not 0 <= i < self.vocab for i in ids):
            raise PromptError(f"prompt token ids must be in [0, {self.vocab})")
        if fit_context:
            room = self._context_room(len(ids), cfg, decoder)
            if 1 <= room < cfg.max_new_tokens:
                cfg = replace(cfg, max_new_tokens=room)
        self._check_context(len(ids), cfg, decoder)
        seed = cfg.seed if cfg.seed is not None else int.from_bytes(os.urandom(6), "little")
        seed %= SEED_RANGE  # any integer maps to one of torch.Generator's seeds
        stop_ids = frozenset() if cfg.ignore_eos else self.stop_ids | set(cfg.stop_token_ids)
        budget = grammar_budget or self.grammar_budget
        cfg = replace(cfg, seed=seed, **self._potentials(cfg, stop_ids, budget))
        draft = self.draft.model if self.draft is not None and decoder.draft_model else None
        return Job(ids, cfg, stop_ids, self.target.model, draft, self.vocab)

    def _potentials(
        self, cfg: GenerationConfig, stop_ids: frozenset[int], budget: GrammarBudget
    ) -> dict[str, Any]:
        """Compile ``cfg.constraint`` against the tokenizer (once per request; stop tokens are
        allowed only where the output is complete), or ``cfg.min_tokens`` as a
        :class:`~smcspec.potentials.MinTokens` constraint, and give ``cfg.reward`` the
        detokenizer.
        Raises :class:`ConfigError` for an invalid pattern, schema or grammar."""
        out: dict[str, Any] = {}
        if cfg.applies_min_tokens and stop_ids:  # no other constraint (validate refuses it)
            out["constraint"] = MinTokens(sorted(stop_ids), self.vocab, cfg.min_tokens)
        if isinstance(cfg.constraint, Constraint):
            out["constraint"] = cfg.constraint.compile(
                self.tokenizer, self.vocab, sorted(stop_ids or self.stop_ids), budget
            )
        if cfg.reward is not None and cfg.reward.detokenize is None:
            tok = self.tokenizer
            out["reward"] = replace(
                cfg.reward, detokenize=lambda ids: tok.decode(ids, skip_special_tokens=True)
            )
        return out

    def program(self, job: Job) -> Program:
        """The program of the decoder the table picks for ``job``'s config
        (:func:`~smcspec.decoding.registry.decoder_for`; see :mod:`smcspec.decoding.program`),
        started with its seed (:meth:`Job.started <smcspec.decoding.job.Job.started>`). It
        streams through the job's ``on_tokens`` (``on_logprobs`` before each token where
        ``config.logprobs`` asks for them, ``on_prompt_logprobs`` once prefilled) and draws
        its caches on ``job.reservation`` (:meth:`try_reserve`; the caller releases it)."""
        return decoder_for(job.config).program(job.started())

    def finish(self, job: Job, out: DecodeOutput, seconds: float) -> GenerationResult:
        """Turn a program's output into a :class:`GenerationResult`."""
        cfg = job.config
        text = self.tokenizer.decode(out.tokens, skip_special_tokens=True)
        particles, vote = None, None
        if out.particles is not None:
            particles = [
                {
                    "text": self.tokenizer.decode(p.tokens, skip_special_tokens=True),
                    "tokens": len(p.tokens),
                    "weight": p.weight,
                }
                for p in out.particles
            ]
            if cfg.vote is not None:
                vote = _vote(cfg.vote, particles)
            if not cfg.return_particles:
                particles = None
        return GenerationResult(
            text=text,
            token_ids=out.tokens,
            method=cfg.method,
            prompt_tokens=len(job.ids),
            new_tokens=len(out.tokens),
            seconds=seconds,
            tokens_per_second=len(out.tokens) / seconds if seconds > 0 else 0.0,
            decode_stats=out.stats,
            seed=cfg.seed,
            greedy=cfg.greedy,
            ran_as=decoder_for(cfg).ran_as(cfg),
            particles=particles,
            log_normalizer=out.log_normalizer,
            vote=vote,
            logprobs=out.logprobs,
            prompt_logprobs=out.prompt_logprobs,
            finish_reason=(
                "length" if hit_token_cap(out.tokens, cfg.max_new_tokens, job.stop_ids) else "stop"
            ),
        )

    def _context_and_overshoot(self, cfg: GenerationConfig, decoder: Decoder) -> tuple[int, int]:
        """The context every model the decoder runs has, and the tokens its last round may
        run past the budget."""
        limits = [self.target.context_length]
        if self.draft is not None and decoder.draft_model:
            limits.append(self.draft.context_length)
        return min(limits), cfg.draft_tokens if decoder.draft_tokens else 0

    def _context_room(self, prompt_len: int, cfg: GenerationConfig, decoder: Decoder) -> int:
        """New tokens the context leaves after ``prompt_len`` (the last round's overshoot
        counted)."""
        ctx, k = self._context_and_overshoot(cfg, decoder)
        return ctx - prompt_len - k - 1

    def _check_context(self, prompt_len: int, cfg: GenerationConfig, decoder: Decoder) -> None:
        ctx, k = self._context_and_overshoot(cfg, decoder)
        need = prompt_len + cfg.max_new_tokens + k + 1
        if need > ctx:
            raise ContextLengthError(
                f"prompt of {prompt_len} tokens + max_new_tokens {cfg.max_new_tokens} "
                f"(+{k + 1} for the last round) = {need} exceeds the model context of {ctx} tokens"
            )


def stop_token_ids(tokenizer, vocab: int) -> set[int]:
    """The ids that end a generation: the tokenizer's eos token, and the end-of-turn and
    end-of-text tokens of common chat templates (:data:`_EOG_TOKENS`) where the tokenizer
    marks them special (``added_tokens_decoder[id].special``), each below ``vocab``."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    vocab_ids = tokenizer.get_vocab()
    special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    ids |= {vocab_ids[t] for t in _EOG_TOKENS if vocab_ids.get(t) in special}
    return {i for i in ids if i < vocab}


def _vote(vote: Vote, particles: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The result's ``vote`` field: the weighted vote over ``particles`` (decoded)."""
    won = vote.tally([p["text"] for p in particles], [p["weight"] for p in particles])
    if won is None:
        return None
    return {
        "answer": won.answer,
        "share": won.share,
        "text": particles[won.index]["text"],
        "answers": won.answers,
    }


def _check_text(text: str, what: str) -> None:
    """Refuse text that is not valid Unicode (lone surrogates, e.g. from invalid UTF-8 bytes
    in a command line or a ``\\ud800`` JSON escape): the tokenizer cannot encode it.

    Raises:
        ConfigError: naming the offending character's position.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ConfigError(
            f"{what} is not valid text: {exc.reason} at character {exc.start} "
            f"({text[exc.start : exc.end]!r}); send UTF-8 text"
        ) from None


def _check_messages(messages: Any) -> None:
    """Chat messages must be a non-empty list of ``{"role": str, "content": str}`` dicts.

    Raises:
        ConfigError: naming the first bad message.
    """
    if not isinstance(messages, list | tuple) or not messages:
        raise ConfigError("chat messages must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ConfigError(f"message {i} must be a dict with a string 'role'")
        if not isinstance(m.get("content"), str):
            raise ConfigError(f"message {i} must have a string 'content'")
        _check_text(m["role"], f"message {i}'s role")
        _check_text(m["content"], f"message {i}'s content")


def _is_token_list(prompt: Any) -> bool:
    return (
        isinstance(prompt, list | tuple)
        and all(isinstance(i, int) for i in prompt)
        and bool(prompt)
    )
