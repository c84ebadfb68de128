"""Measuring what the predictions need: forward costs, sd's acceptance alpha and the pair's
per-token log-weights (SMC-SD's degeneracy).

Forward costs are median wall seconds of decode forwards of the shapes the decoders issue
(:func:`forward_seconds_by_tokens`: one prefill per row count, an untimed warm-up forward
after it, then ``reps`` timed forwards per token count; ``smcspec.eval.roofline`` uses it
too). alpha comes from short real sd runs on fixed, varied prompts and a fixed seed, pooled
(:func:`smcspec.tuning.predict.alpha_from_counts`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from smcspec.config import GenerationConfig
from smcspec.errors import ConfigError
from smcspec.tuning.multi_draft import MAX_CHAINS, TreeSums
from smcspec.tuning.predict import Shape, alpha_from_counts

if TYPE_CHECKING:
    from smcspec.backends.base import DecoderModel
    from smcspec.models.loading import LoadedModel
    from smcspec.tuning.tunable import TunablePair

ACCEPTANCE_PROMPTS = (
    "Write a Python function that returns the prime numbers below n, and explain how it works.",
    "A train leaves at 9:40 and arrives at 13:05, stopping twice for 12 minutes. How long is "
    "it moving? Think step by step.",
    "Describe a quiet morning in a harbour town in a short paragraph.",
    'Give the capital, population and main language of Norway as JSON with keys "capital", '
    '"population" and "language".',
)
"""The sd runs that measure acceptance and the log-weights, pooled: code, arithmetic
reasoning, prose and JSON (one prompt made the tuner's choice wander between machines and
runs, issue 40)."""
ACCEPTANCE_SEED = 0


@dataclass(frozen=True)
class Acceptance:
    """alpha and the sd run it came from (counts of ``smcspec.decoding.sd.chain``'s stats)."""

    alpha: float
    draft_tokens: int
    new_tokens: int
    accepted: int
    drafted: int
    rounds: int
    log_weight_quantiles: list[float] | None = None  # see log_weight_quantiles()
    prompts: int = 1  # the prompts pooled (ACCEPTANCE_PROMPTS; 1 in caches written before)
    draft_top_probs: list[list[float]] | None = None  # see top_probabilities(), of q_T
    target_top_probs: list[list[float]] | None = None  # and of p_T
    tree_rejection: list[float] | None = None  # multi-draft sd, see tuning.multi_draft
    tree_continuing: list[list[float]] | None = None


QUANTILES = 101  # per-token log-weight quantiles kept (0, 1, ..., 100 %)
TOP_PROBS = 8  # most likely tokens kept per position in the agreement profiles


def pair_log_probs(
    target: DecoderModel,
    draft: DecoderModel,
    prompt: list[int],
    tokens: list[int],
    temperature: float,
    draft_temperature: float,
    vocab: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both models' tempered next-token log-probabilities at every position of ``tokens``
    after ``prompt`` (one teacher-forced forward each): float64 ``[L, vocab]`` for the
    target (``log p_T``) and the draft (``log q_T``).

    Raises:
        ConfigError: fewer than 2 tokens, or a temperature of 0 (greedy has no weights).
    """
    if len(tokens) < 2 or temperature <= 0 or draft_temperature <= 0:
        raise ConfigError("log-weights need 2 or more tokens and sampling temperatures > 0")
    logs = []
    for model, temp in ((target, temperature), (draft, draft_temperature)):
        cache = model.new_cache(1, len(tokens))
        try:
            first = model.prefill(torch.tensor(prompt, device=model.device), cache)[None]
            rest = model.decode(torch.tensor([tokens[:-1]], device=model.device), cache)[0]
            logits = torch.cat((first.clone(), rest))[:, :vocab].double().cpu()
        finally:
            cache.close()
        logs.append(torch.log_softmax(logits / temp, -1))
    return logs[0], logs[1]


def quantiles_of_log_weights(
    lp: torch.Tensor, lq: torch.Tensor, draws: int = 64, seed: int = 0
) -> list[float]:
    """Quantiles (0 %, 1 %, ..., 100 %) of ``log p_T(x) - log q_T(x)``, ``x ~ q_T``, pooled
    over the positions of :func:`pair_log_probs` (``draws`` seeded draws per position)."""
    g = torch.Generator().manual_seed(seed)
    return quantiles_of(sampled_log_weights(lp, lq, draws, g))


def sampled_log_weights(
    lp: torch.Tensor, lq: torch.Tensor, draws: int, generator: torch.Generator
) -> torch.Tensor:
    """``log p_T(x) - log q_T(x)`` at ``draws`` draws ``x ~ q_T`` per position of ``lp``,
    ``lq`` (``[L, V]``, :func:`pair_log_probs`): the finite ones, float64, flattened."""
    x = torch.multinomial(lq.exp().float(), draws, replacement=True, generator=generator)
    w = (lp.gather(1, x) - lq.gather(1, x)).flatten()
    return w[torch.isfinite(w)]


def quantiles_of(weights: torch.Tensor) -> list[float]:
    """The :data:`QUANTILES` quantiles (0 %, 1 %, ..., 100 %) of ``weights`` (float)."""
    qs = torch.quantile(weights.double(), torch.linspace(0, 1, QUANTILES, dtype=torch.float64))
    return [round(float(v), 6) for v in qs]


def top_probabilities(log_probs: torch.Tensor, top: int = TOP_PROBS) -> list[list[float]]:
    """The ``top`` largest probabilities at each position of ``log_probs`` (``[L, V]``),
    descending: how likely two particles with the same history are to draw the same token
    there (:func:`smcspec.tuning.predict.predicted_distinct` simulates distinct rows from
    them)."""
    vals = log_probs.exp().topk(min(top, log_probs.shape[-1]), dim=-1).values
    return [[round(float(v), 5) for v in row] for row in vals]


def log_weight_quantiles(
    target: DecoderModel,
    draft: DecoderModel,
    prompt: list[int],
    tokens: list[int],
    temperature: float,
    draft_temperature: float,
    vocab: int,
    draws: int = 64,
    seed: int = 0,
) -> list[float]:
    """Quantiles (0 %, 1 %, ..., 100 %) of SMC-SD's per-token incremental log-weight
    ``log p_T(x) - log q_T(x)`` with ``x ~ q_T``, pooled over the positions of ``tokens``
    (after ``prompt``; a sample of the target, e.g. an sd run's output): ``draws`` seeded
    draws per position from the draft's distribution there, scored by both models' logits
    from one teacher-forced forward each. :func:`smcspec.tuning.predict.predicted_ess`
    simulates rounds from them.

    Raises:
        ConfigError: fewer than 2 tokens, or a temperature of 0 (greedy has no weights).
    """
    lp, lq = pair_log_probs(target, draft, prompt, tokens, temperature, draft_temperature, vocab)
    return quantiles_of_log_weights(lp, lq, draws, seed)


def forward_seconds_by_tokens(
    model: DecoderModel, rows: int, tokens: Sequence[int], reps: int = 5, context: int = 100
) -> dict[int, float]:
    """The median of :func:`forward_timings_by_tokens` for every ``t`` in ``tokens``."""
    timed = forward_timings_by_tokens(model, rows, tokens, reps, context)
    return {t: statistics.median(v) for t, v in timed.items()}


def forward_timings_by_tokens(
    model: DecoderModel, rows: int, tokens: Sequence[int], reps: int = 5, context: int = 100
) -> dict[int, list[float]]:
    """Wall seconds of ``reps`` timed forwards of ``rows x t`` for every ``t`` in
    ``tokens``, after one ``context``-token prefill shared by all of them and one untimed
    warm-up forward (on CUDA one for every ``t``), each forward rolled back before the next.
    On a CPU the first forward of a later ``t`` takes what the timed ones take, on both
    backends (within their spread: docs/benchmarks/tuner-warm-up/), so it is timed; on
    CUDA a shape's first forward can set up its kernels. A model whose rounds run fused (a
    torch model on CUDA: CUDA graphs) is timed as its rounds run its forwards
    (:func:`static_timings`)."""
    if getattr(model, "round_mode", "steps") != "steps":
        return static_timings(model, rows, tokens, reps, context)
    # every row computed: the forward of the full shape is what is timed (the rows here
    # all hold the same tokens, which distinct rows would compute once)
    cache = model.new_cache(rows, max(tokens), shared_rows=False)
    try:
        return _timed_forwards(model, cache, rows, tokens, reps, context)
    finally:
        cache.close()


def _timed_forwards(model, cache, rows, tokens, reps, context) -> dict[int, list[float]]:
    vocab = model.vocab_size
    model.prefill((torch.arange(context, device=model.device) + 1000) % vocab, cache)
    out = {}
    for i, t in enumerate(tokens):
        x = torch.full((rows, t), 500 % vocab, device=model.device)
        if i == 0 or model.device.type == "cuda":  # the untimed warm-up
            model.decode(x, cache, last_only=t <= 2)
            cache.truncate(0)
        times = []
        for _ in range(reps):
            if model.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            model.decode(x, cache, last_only=t <= 2)
            if model.device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            cache.truncate(0)
        out[t] = times
    return out


def static_timings(
    model: DecoderModel, rows: int, tokens: Sequence[int], reps: int = 10, context: int = 128
) -> dict[int, list[float]]:
    """Wall seconds of ``reps`` forwards of ``rows x t`` for every ``t`` in ``tokens`` as a
    fused round runs them: the static-cache forward (``decode_static``) after a
    ``context``-token prompt, through ``model.run_round`` (a replayed CUDA graph in
    ``graphs`` mode; each shape's first, untimed call captures it), the device synchronised
    before and after each. Logits of the last position only when ``t <= 2``, as the decoders
    ask.

    Raises:
        ValueError: the model gives no static cache (llamacpp, or ``steps`` mode).
    """
    cache = model.new_cache(rows, max(tokens), static=True, prompt_len=context)
    if getattr(cache, "graphs", None) is None:
        cache.close()
        raise ValueError("static forward timings need a torch model whose rounds are not 'steps'")
    try:
        model.prefill((torch.arange(context, device=model.device) + 1000) % model.vocab_size, cache)
        return {t: _replayed(model, cache, rows, t, reps) for t in tokens}
    finally:
        cache.close()


def _replayed(model, cache, rows: int, t: int, reps: int) -> list[float]:
    span = cache.capacity
    inputs = {
        "tokens": torch.full((rows, t), 500 % model.vocab_size, device=model.device),
        "start": torch.zeros((), dtype=torch.long, device=model.device),
    }

    def fn(x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        logits = model.decode_static(x["tokens"], cache, x["start"], span, t <= 2)
        return {"first": logits[..., :1]}

    key = ("forward-cost", rows, t, span, cache.prompt_window)
    times = []
    for i in range(reps + 1):
        _sync(model)
        t0 = time.perf_counter()
        model.run_round(cache, key, fn, inputs)
        _sync(model)
        if i:  # the first call captures
            times.append(time.perf_counter() - t0)
    return times


def _sync(model: DecoderModel) -> None:
    if model.device.type == "cuda":
        torch.cuda.synchronize()


def measurement_context(model: LoadedModel, context: int, longest: int) -> int:
    """``context`` prompt tokens, fewer if the model's context cannot also hold ``longest``
    generated tokens. Raises ConfigError for a model too short to measure at all."""
    ctx = min(context, model.context_length - longest - 1) if model.context_length else context
    if ctx < 1:
        raise ConfigError(
            f"{model.name}'s context of {model.context_length} tokens is too short to measure "
            f"a {longest}-token forward"
        )
    return ctx


def measure_forwards(
    model: LoadedModel, shapes: Iterable[Shape], reps: int, context: int
) -> dict[Shape, list[float]]:
    """Seconds of ``reps`` timed decode forwards of every ``(rows, tokens)`` shape of
    ``model`` (the tuner keeps their median and their range)."""
    by_rows: dict[int, set[int]] = {}
    for rows, tokens in shapes:
        by_rows.setdefault(rows, set()).add(tokens)
    out: dict[Shape, list[float]] = {}
    for rows, tokens in sorted(by_rows.items()):
        ctx = measurement_context(model, context, max(tokens))
        timed = forward_timings_by_tokens(model.model, rows, sorted(tokens), reps, ctx)
        out.update({(rows, t): s for t, s in timed.items()})
    return out


class PairProfile:
    """What the predictions read from the pair's log-probabilities, pooled over parts (one
    calibration prompt's :func:`pair_log_probs` at a time, so that memory holds one
    ``[L, V]`` pair, not all of them): the log-weight quantiles
    (:func:`sampled_log_weights`, 64 draws a position, seed 0), both models' agreement
    profiles (:func:`top_probabilities`) and multi-draft sd's tree acceptance
    (:class:`~smcspec.tuning.multi_draft.TreeSums`, seed 0)."""

    def __init__(self, draws: int = 64, seed: int = 0) -> None:
        self.draws = draws
        self.g = torch.Generator().manual_seed(seed)
        self.weights: list[torch.Tensor] = []
        self.draft_top: list[list[float]] = []
        self.target_top: list[list[float]] = []
        self.tree = TreeSums(MAX_CHAINS, draws, torch.Generator().manual_seed(seed))

    def add(self, lp: torch.Tensor, lq: torch.Tensor) -> None:
        """One part's target and draft log-probabilities, float ``[L, V]`` each."""
        self.weights.append(sampled_log_weights(lp, lq, self.draws, self.g))
        self.draft_top += top_probabilities(lq)
        self.target_top += top_probabilities(lp)
        self.tree.add(lp, lq)

    def result(
        self,
    ) -> tuple[list[float], list[list[float]], list[list[float]], tuple[list[float], list]]:
        """``(quantiles, draft top probabilities, target top probabilities, (rejection,
        continuing))`` over every part added."""
        quantiles = quantiles_of(torch.cat(self.weights))
        return quantiles, self.draft_top, self.target_top, self.tree.result()


def measure_acceptance(
    engine: TunablePair,
    sampling: GenerationConfig,
    draft_tokens: int,
    new_tokens: int,
    prompts: Sequence[str] = ACCEPTANCE_PROMPTS,
) -> Acceptance:
    """alpha, the per-token log-weight quantiles (:func:`quantiles_of_log_weights` on the
    runs' outputs), both models' most likely probabilities there (:func:`top_probabilities`)
    and multi-draft sd's tree acceptance there
    (:func:`smcspec.tuning.multi_draft.tree_acceptance`) of ``engine``'s pair, pooled over
    one sd run per prompt of ``prompts`` (default :data:`ACCEPTANCE_PROMPTS`; chat template
    when the tokenizer has one), ``new_tokens`` tokens in all split evenly between them (EOS
    ignored; a prompt too long for the context with them is cut to its last tokens),
    ``draft_tokens`` drafts a round, the temperatures and truncation of ``sampling``, seed 0.

    Raises:
        ConfigError: the engine has no draft, or the model context is too short.
    """
    if engine.draft is None:
        raise ConfigError("measuring sd's acceptance needs a draft model")
    chat = bool(getattr(engine.tokenizer, "chat_template", None))
    ctx = min(engine.target.context_length, engine.draft.context_length)
    each = max(2, new_tokens // len(prompts))
    counts = {"accepted": 0, "drafted": 0, "rounds": 0}
    profile = None if sampling.greedy else PairProfile()
    total = 0
    run = replace(
        sampling,
        method="sd",
        draft_tokens=draft_tokens,
        seed=ACCEPTANCE_SEED,
        ignore_eos=True,
        constraint=None,
        reward=None,
        return_particles=False,
        stop_token_ids=(),
    )
    for prompt in prompts:
        ids = engine.encode(prompt, chat=chat)
        ids = ids[-max(1, ctx - each - draft_tokens - 2) :]
        budget = min(each, ctx - len(ids) - draft_tokens - 2)
        if budget < 2:
            raise ConfigError(f"the model context ({ctx} tokens) is too short to measure sd")
        result = engine.generate(ids, replace(run, max_new_tokens=budget))
        sd = result.decode_stats  # an sd run: SdStats
        counts["accepted"] += sd.accepted
        counts["drafted"] += sd.drafted
        counts["rounds"] += sd.rounds
        total += budget
        if profile is not None:  # one prompt's [L, V] pair in memory at a time
            profile.add(*pair_log_probs(
                engine.target.model, engine.draft.model, ids, result.token_ids,
                run.temperature, run.draft_temperature, engine.vocab,
            ))  # fmt: skip
    quantiles = draft_top = target_top = rejection = continuing = None
    if profile is not None:
        quantiles, draft_top, target_top, (rejection, continuing) = profile.result()
    return Acceptance(
        alpha=alpha_from_counts(counts["accepted"], counts["drafted"], counts["rounds"]),
        draft_tokens=draft_tokens,
        new_tokens=total,
        accepted=counts["accepted"],
        drafted=counts["drafted"],
        rounds=counts["rounds"],
        log_weight_quantiles=quantiles,
        draft_top_probs=draft_top,
        target_top_probs=target_top,
        tree_rejection=rejection,
        tree_continuing=continuing,
        prompts=len(prompts),
    )
