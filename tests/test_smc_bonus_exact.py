"""SMC-SD's bonus token is drawn from exactly the right distribution, checked by enumeration.

At position K+1 each particle draws its bonus token from ``∝ p_T(v)^alpha`` (``∝ p_T(v)^alpha
m(v)`` under a constraint with mask ``m``), ``p_T = softmax(l / T_t)``. Every bonus draw of a
seeded run is intercepted, and the distribution it was drawn from is compared with one
computed independently: a fresh forward of the tiny model over the particle's whole prefix,
tempered in float64. At ``T_t = 2`` (draft == target, so the particles are the target's own
samples) a temperature applied twice, or not at all, moves these probabilities by far more
than the 1e-5 tolerance; the statistical tests, whose tiny targets are nearly deterministic at
low temperatures, catch that only by luck. Three paths: plain, power (alpha = 2) and masked.
"""

from __future__ import annotations

import sys

import pytest
import torch
from enumerable import tiny_transformer

import smcspec.decoding.smc.extend as extend
from smcspec.config import GenerationConfig
from smcspec.decoding import decode_smc
from smcspec.eval.automaton import NextTokenAutomaton
from smcspec.eval.fidelity import CONSTRAINT_TABLE
from smcspec.potentials import DeadEndError

PROMPT = [1, 2, 0]
VOCAB = 4
T = 2.0


@pytest.fixture(scope="module")
def target():
    return tiny_transformer(seed=1, vocab=VOCAB, scale=1.0)


def _reference(model, prefix: list[int], alpha: float, mask: torch.Tensor | None) -> torch.Tensor:
    """float64 ``[V]``: ``∝ softmax(l / T)^alpha m`` after ``prefix`` (one fresh forward)."""
    cache = model.new_cache(1, len(prefix) + 1)
    logits = model.prefill(torch.tensor(prefix), cache).double()
    scores = alpha * torch.log_softmax(logits / T, -1)
    if mask is not None:
        scores = scores.masked_fill(~mask, -torch.inf)
    return torch.softmax(scores, -1)


def _bonus_draws(monkeypatch, model, cfg: GenerationConfig, seeds: range) -> list[tuple]:
    """``(prefix, probs)`` of every bonus draw (each particle row) over the seeded runs."""
    draws: list[tuple] = []
    real = extend.sample_categorical

    def recording(probs, generator):
        frame = sys._getframe(2)  # draw_bonus's caller
        if frame.f_code.co_name == "score_block":  # the bonus draw (step 3d)
            ps, b = frame.f_locals["ps"], frame.f_locals["b"]
            for i in range(probs.shape[0]):
                if bool(ps.finished[i]):
                    continue
                gen = ps.tokens[i, : int(ps.lengths[i])].tolist() + b.drafted[i].tolist()
                draws.append((gen, probs[i].double() / probs[i].double().sum()))
        return real(probs, generator)

    monkeypatch.setattr(extend, "sample_categorical", recording)
    for seed in seeds:
        decode_smc(
            model, model, PROMPT, cfg, frozenset(), VOCAB, torch.Generator().manual_seed(seed)
        )
    monkeypatch.undo()
    return draws


def _cfg(**kw) -> GenerationConfig:
    base = dict(method="smc", max_new_tokens=7, particles=4, draft_tokens=2, temperature=T,
                draft_temperature=T)  # fmt: skip
    return GenerationConfig(**{**base, **kw}).validate()


@pytest.mark.parametrize("alpha", [1.0, 2.0], ids=["plain", "power"])
def test_the_bonus_is_drawn_from_the_tempered_power_target(monkeypatch, target, alpha):
    draws = _bonus_draws(monkeypatch, target, _cfg(alpha=alpha), range(6))
    assert len(draws) >= 40
    for gen, probs in draws:
        want = _reference(target, PROMPT + gen, alpha, None)
        assert torch.allclose(probs, want, atol=1e-5), (gen, probs, want)
    # the check has teeth: T applied twice (or not at all) is far outside the tolerance
    for wrong_t in (T * T, 1.0):
        gaps = []
        for gen, probs in draws:
            cache = target.new_cache(1, len(PROMPT + gen) + 1)
            logits = target.prefill(torch.tensor(PROMPT + gen), cache).double()
            wrong = torch.softmax(alpha * torch.log_softmax(logits / wrong_t, -1), -1)
            gaps.append(float((wrong - probs).abs().max()))
        assert min(gaps) > 1e-3 and max(gaps) > 5e-2, (wrong_t, min(gaps), max(gaps))


@pytest.mark.parametrize("alpha", [1.0, 2.0], ids=["masked", "masked-power"])
def test_the_masked_bonus_is_drawn_from_the_masked_power_target(monkeypatch, target, alpha):
    constraint = NextTokenAutomaton(CONSTRAINT_TABLE, VOCAB)
    cfg = _cfg(alpha=alpha, constraint=constraint)
    draws = _bonus_draws(monkeypatch, target, cfg, range(6))
    checked = 0
    for gen, probs in draws:
        state = constraint.start()
        try:
            state.consume(gen)
        except DeadEndError:
            continue  # a particle already dead: its row is never kept
        mask = state.allowed()[:VOCAB]
        if not bool(mask.any()):
            continue
        want = _reference(target, PROMPT + gen, alpha, mask)
        assert torch.allclose(probs, want, atol=1e-5), (gen, probs, want)
        checked += 1
    assert checked >= 20
