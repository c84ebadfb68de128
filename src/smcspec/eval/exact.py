"""Exact distributions of enumerable models: tiny random Qwen2-style transformers whose
outputs over a few tokens can be listed, and the sequence-level targets the decoders must
sample, computed by enumeration.

* :func:`sequence_log_probs` (every sequence of L tokens), :func:`stopped_sequence_log_probs`
  (outputs that end at a stop token or the budget);
* with a potential (``pi(x) ∝ p(x) Psi(x)``, ``docs/constraints.md``; Lew et al. 2023; Park
  et al. 2024): the conditional given a constraint and ``log P(A)``
  (:func:`conditional_log_probs`), what locally-masked decoding samples instead
  (:func:`locally_masked_log_probs`), and the reward-tilted distribution
  (:func:`tilted_log_probs`);
* :func:`expected_noise_tv`: the TV an exact sampler shows at a given number of runs.

Used by :mod:`smcspec.eval.fidelity` and the statistical tests.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Sequence

import torch

from smcspec.backends.torch.architecture import ModelConfig
from smcspec.backends.torch.transformer import Transformer
from smcspec.potentials import DeadEndError, Reward, TokenConstraint


def tiny_transformer(
    seed: int, vocab: int = 4, scale: float = 0.3, base: Transformer | None = None
) -> Transformer:
    """A 1-layer Qwen2-style model with random weights (std ``scale``) and ``vocab`` tokens.

    With ``base``, the weights are ``base``'s plus the random ones (a perturbed copy).
    """
    cfg = ModelConfig(
        model_type="qwen2",
        vocab_size=vocab,
        hidden_size=16,
        intermediate_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=64,
        qkv_bias=True,
        tie_word_embeddings=False,
    )
    g = torch.Generator().manual_seed(seed)
    model = Transformer(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                continue
            p.copy_(torch.randn(p.shape, generator=g) * scale)
            if base is not None:
                p.add_(base.get_parameter(name))
    return model.eval()


def sequence_log_probs(
    model: Transformer, prompt: list[int], length: int, temperature: float
) -> dict[tuple[int, ...], float]:
    """Exact ``log p_T(x_1..x_L | prompt)`` of every sequence of ``length`` tokens."""
    vocab = model.cfg.vocab_size
    out = {}
    for seq in itertools.product(range(vocab), repeat=length):
        cache = model.new_cache(1, length + 1)
        first = model.prefill(torch.tensor(prompt), cache)
        if length == 1:
            logits = first[None]
        else:
            logits = torch.cat((first[None], model.decode(torch.tensor([seq[:-1]]), cache)[0]))
        lp = torch.log_softmax(logits.double() / temperature, -1)
        out[seq] = float(lp[torch.arange(length), torch.tensor(seq)].sum())
    return out


def stopped_sequence_log_probs(
    model: Transformer, prompt: list[int], length: int, temperature: float, stop: int
) -> dict[tuple[int, ...], float]:
    """Exact ``log p_T`` of every output of at most ``length`` tokens that ends at ``stop``
    (included) or at the budget: the outputs' distribution when ``stop`` ends generation.
    The probabilities sum to 1. One forward per prefix (a depth-first walk)."""
    out: dict[tuple[int, ...], float] = {}

    def walk(prefix: list[int], lp: float) -> None:
        if len(prefix) == length or (prefix and prefix[-1] == stop):
            out[tuple(prefix)] = lp
            return
        cache = model.new_cache(1, len(prompt) + length + 1)
        logits = model.prefill(torch.tensor(prompt + prefix), cache)
        step = torch.log_softmax(logits.double() / temperature, -1)
        for v in range(model.cfg.vocab_size):
            walk([*prefix, v], lp + float(step[v]))

    walk([], 0.0)
    return out


def exact_distribution(model: Transformer, prompt: list[int], length: int, temperature: float):
    """Probabilities (dict sequence -> p) of the first ``length`` tokens under ``model``."""
    return {
        k: math.exp(v) for k, v in sequence_log_probs(model, prompt, length, temperature).items()
    }


# ------------------------------------------------------------------ exact potentials
# The sequence-level target with a potential is ``pi(x) ∝ p(x) Psi(x)`` (the notes
# ``docs/constraints.md``; Lew et al. 2023; Park et al. 2024). Over the
# first L tokens of an enumerable model every quantity below is a finite sum.

LogProbs = dict[tuple[int, ...], float]
"""``sequence -> log-probability`` (natural log), as :func:`sequence_log_probs` returns."""


def _log_normalise(log_weights: LogProbs) -> tuple[LogProbs, float]:
    """``(log w(x) - log Z, log Z)`` with ``Z = sum_x w(x)`` over the finite entries.

    Entries of ``-inf`` (zero weight) are dropped. Raises ValueError if none is finite.
    """
    kept = {k: v for k, v in log_weights.items() if v > -math.inf}
    if not kept:
        raise ValueError("every sequence has zero weight (the potential excludes them all)")
    top = max(kept.values())
    log_z = top + math.log(sum(math.exp(v - top) for v in kept.values()))
    return {k: v - log_z for k, v in kept.items()}, log_z


def constraint_masks(constraint: TokenConstraint, seq: Sequence[int]) -> list[torch.Tensor] | None:
    """The masks (bool ``[V]`` each) a decoder sees along ``seq``: ``m_t`` after ``seq[:t]``.

    Returns None when ``seq`` leaves the constraint: a token its mask forbids, or one the
    matcher refuses (:class:`DeadEndError`; the decoders treat both as weight zero).
    """
    state, masks = constraint.start(), []
    for t in seq:
        mask = state.allowed()
        if not bool(mask[t]):
            return None
        try:
            state.consume([t])
        except DeadEndError:
            return None
        masks.append(mask)
    return masks


def conditional_log_probs(
    log_probs: LogProbs, constraint: TokenConstraint
) -> tuple[LogProbs, float]:
    """The conditional ``log p(x | x in A)`` over A and ``log P(A)``, by enumeration.

    ``A``: the sequences every token of which the constraint's mask allows after its prefix
    (:func:`constraint_masks`); over a budget of L tokens this is the set SMC-SD's target
    ``p(x) prod_t m_t(x_t)`` puts mass on (Lew et al. 2023; Park et al. 2024, "the
    constrained distribution").

    Args:
        log_probs: ``log p(x)`` of every sequence of one length (:func:`sequence_log_probs`).
        constraint: a compiled constraint over the model's token ids.
    Returns:
        ``(cond, log_pa)``: ``cond[x] = log p(x) - log P(A)`` for ``x`` in A (sequences
        outside A are absent), and ``log P(A) = log sum_{x in A} p(x)``.
    Raises:
        ValueError: if no enumerated sequence is in A.
    """
    inside = {
        k: (v if constraint_masks(constraint, k) is not None else -math.inf)
        for k, v in log_probs.items()
    }
    return _log_normalise(inside)


def _prefix_masses(log_probs: LogProbs) -> dict[tuple[int, ...], float]:
    """``p(x_<t)`` of every prefix (the empty one included), summed from the full sequences."""
    mass: dict[tuple[int, ...], float] = defaultdict(float)
    for seq, lp in log_probs.items():
        p = math.exp(lp)
        for t in range(len(seq) + 1):
            mass[seq[:t]] += p
    return mass


def locally_masked_log_probs(log_probs: LogProbs, constraint: TokenConstraint) -> LogProbs:
    """``log prod_t p(x_t | x_<t) m_t(x_t) / sum_v p(v | x_<t) m_t(v)``: what masked AR and
    masked SD sample exactly (each step renormalised over the allowed tokens), by enumeration.

    Park et al. 2024 (grammar-constrained decoding distorts the conditional): it differs
    from :func:`conditional_log_probs` unless every prefix keeps the same share of mass.

    Args: as :func:`conditional_log_probs` (``log_probs`` must hold every sequence of its
        length, so that prefix masses are exact).
    Returns:
        ``sequence -> log-probability`` over A (absent outside A).
    """
    mass = _prefix_masses(log_probs)
    out: LogProbs = {}
    for seq in log_probs:
        masks = constraint_masks(constraint, seq)
        if masks is None:
            continue
        total = 0.0
        for t, mask in enumerate(masks):
            pre = seq[:t]
            kept = sum(mass[(*pre, v)] for v in torch.nonzero(mask).flatten().tolist())
            total += math.log(mass[seq[: t + 1]] / kept)
        out[seq] = total
    return out


def tilted_log_probs(log_probs: LogProbs, reward: Reward) -> tuple[LogProbs, float]:
    """The reward-tilted ``log p(x) exp(beta R(x)) / Z`` and ``log Z``, by enumeration.

    ``Z = sum_x p(x) exp(beta R(x))`` (Lew et al. 2023; the notes' "Potentials"); ``beta R``
    is ``reward.log_potential`` of the full sequences (``reward.fn`` on their texts).

    Returns:
        ``(tilted, log_z)`` over every enumerated sequence.
    Raises:
        ValueError: if every sequence has zero weight; errors of
            :meth:`~smcspec.potentials.Reward.log_potential` (no ``detokenize``, non-finite
            rewards) propagate.
    """
    keys = list(log_probs)
    beta_r = reward.log_potential([list(k) for k in keys], prefix=False).tolist()
    return _log_normalise({k: log_probs[k] + b for k, b in zip(keys, beta_r, strict=True)})


def probabilities(log_probs: LogProbs) -> dict[tuple[int, ...], float]:
    """``exp`` of every entry (for :func:`~smcspec.eval.stats.total_variation`)."""
    return {k: math.exp(v) for k, v in log_probs.items()}


def expected_noise_tv(probs: dict, runs: int) -> float:
    """Expected TV between ``probs`` and the empirical distribution of ``runs`` exact draws.

    Normal approximation to each binomial count's mean absolute deviation,
    ``E|c - n p| ≈ sqrt(2 n p (1 - p) / pi)``: ``TV ≈ sum_x sqrt(p(x)(1 - p(x)) / (2 pi n))``.
    The floor an exact sampler sits at; ``probs``: ``sequence -> probability``.
    """
    return sum(math.sqrt(p * (1 - p) / (2 * math.pi * runs)) for p in probs.values())
