"""Fidelity to the target distribution.

* Exact, on enumerable models: tiny random draft/target pairs with a small vocabulary, whose
  target distribution over the first ``L`` generated tokens is computed exactly; each
  method's empirical distribution (many seeded runs) is compared with it by total variation
  and KL (:func:`fidelity_grid`). Expected: SD at sampling noise; SMC-SD's error falling
  roughly like ``1/sqrt(N)`` and rising with K and with draft/target divergence.
* With potentials, on the same models (:func:`potential_fidelity`): a token-level constraint
  A and a reward R, with the exact conditional ``p(x | x in A)`` and ``log P(A)``, the
  locally-masked distribution masked AR samples, and the tilted ``p(x) exp(beta R(x)) / Z``
  enumerated. Expected: masked AR at a fixed bias; SMC-SD's TV falling with N and its
  log-normaliser estimate approaching ``log P(A)`` (Lew et al. 2023; Park et al. 2024).
* On a real pair: the target's own per-token negative log-likelihood of generated texts
  (:func:`target_nll`).

The exact distributions come from :mod:`smcspec.eval.exact`; this module samples the
decoders, compares, and writes the reports.
"""

from __future__ import annotations

import math
import string
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from smcspec.backends.torch.transformer import Transformer
from smcspec.config import GenerationConfig
from smcspec.decoding import run_program
from smcspec.decoding.job import job_for
from smcspec.decoding.registry import decoder_for, decoder_named
from smcspec.eval.exact import (
    LogProbs,
    conditional_log_probs,
    exact_distribution,
    expected_noise_tv,
    locally_masked_log_probs,
    probabilities,
    sequence_log_probs,
    tilted_log_probs,
)
from smcspec.eval.stats import empirical, kl_divergence, total_variation
from smcspec.potentials import Reward, TokenConstraint

CONSTRAINT_TABLE: dict[int | None, set[int]] = {
    None: {0, 1, 2, 3},
    0: {1},
    1: {2, 3},
    2: {0, 1, 2, 3},
    3: {0},
}
"""The example constraint over 4 token ids (a :class:`~smcspec.eval.automaton.NextTokenAutomaton`
table): anything first and after 2; after 0 only 1; after 1 only 2 or 3; after 3 only 0."""


def letter_count_reward(token: int, beta: float, vocab: int, twisted: bool = True) -> Reward:
    """``R(x)`` = how many times ``token`` occurs in ``x``, on the text of a tokenizer-less
    model whose token ``i`` reads as the ``i``-th lowercase letter (``0 -> "a"``).

    ``twisted``: also use the count in the prefix so far as the twist (``prefix_fn``).
    ``detokenize`` is :func:`letters`. Raises ValueError for ``vocab > 26`` or ``token``
    outside the vocabulary.
    """
    if not 0 <= token < vocab <= len(string.ascii_lowercase):
        raise ValueError(f"need 0 <= token < vocab <= 26, got token {token}, vocab {vocab}")
    letter = string.ascii_lowercase[token]

    def count(texts: list[str]) -> list[float]:
        return [float(t.count(letter)) for t in texts]

    return Reward(count, beta, prefix_fn=count if twisted else None, detokenize=letters)


def letters(ids: list[int]) -> str:
    """Token ids as letters (``[0, 1, 3] -> "abd"``): the tiny models' detokenizer."""
    return "".join(string.ascii_lowercase[i] for i in ids)


@contextmanager
def one_thread() -> Iterator[None]:
    """Run the block with one torch intra-op thread, then restore the previous count.

    The tiny models' matrices are far too small to gain from threads; on a shared 2-core
    machine two threads made every decode about 5-10x slower (measured: smc N=16 9 ms vs
    85 ms per run).
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def sample_outputs(
    target: Transformer,
    draft: Transformer,
    prompt: list[int],
    cfg: GenerationConfig,
    runs: int,
    seed0: int = 0,
) -> tuple[Counter, list[float]]:
    """Run ``cfg.method`` ``runs`` times, run ``i`` seeded with ``seed0 + i`` (no stop tokens).

    Returns:
        ``(counts, log_zs)``: how often each generated sequence (a tuple of token ids) came
        out, and each run's log-normaliser estimate (``SmcStats.log_normalizer``: a decoder
        that weighs particles, with a constraint or reward; NaN otherwise), in run order.
    """
    decoder = decoder_for(cfg)
    vocab = target.cfg.vocab_size
    counts: Counter = Counter()
    log_zs: list[float] = []
    for i in range(runs):
        g = torch.Generator().manual_seed(seed0 + i)
        job = job_for(target, draft, prompt, cfg, frozenset(), vocab, g)
        out = run_program(decoder.program(job))
        counts[tuple(out.tokens)] += 1
        log_z = out.stats.log_normalizer if decoder.particles else None  # SmcStats' estimate
        log_zs.append(math.nan if log_z is None else float(log_z))
    return counts, log_zs


def sample_counts(
    target: Transformer,
    draft: Transformer,
    prompt: list[int],
    cfg: GenerationConfig,
    runs: int,
    seed0: int = 0,
) -> Counter:
    """Counts of the generated sequences over ``runs`` seeded runs of ``cfg.method``
    (:func:`sample_outputs` without the log-normalisers)."""
    return sample_outputs(target, draft, prompt, cfg, runs, seed0)[0]


@dataclass
class FidelityRow:
    """One setting of :func:`fidelity_grid`: TV and KL (nats) of the empirical distribution
    of ``runs`` samples to the exact one."""

    method: str
    particles: int
    draft_tokens: int
    runs: int
    tv: float
    kl: float

    @property
    def weighted(self) -> bool:
        """Whether the method weighs particles (SMC-SD; exact SD does not)."""
        return decoder_named(self.method).particles


def fidelity_grid(
    target: Transformer,
    draft: Transformer,
    prompt: list[int],
    length: int,
    particles: list[int],
    draft_tokens: list[int],
    runs: int,
    temperature: float = 1.0,
) -> tuple[list[FidelityRow], float]:
    """TV and KL(target || empirical) of SD and SMC-SD for each (N, K); returns the rows and
    the TV between the draft's and the target's exact distributions."""
    exact = exact_distribution(target, prompt, length, temperature)
    draft_tv = total_variation(exact, exact_distribution(draft, prompt, length, temperature))
    rows = []
    base = GenerationConfig(
        max_new_tokens=length, temperature=temperature, draft_temperature=temperature
    )
    settings = [("sd", 1, k) for k in draft_tokens]
    settings += [("smc", n, k) for k in draft_tokens for n in particles]
    for method, n, k in settings:
        cfg = GenerationConfig(
            **{**base.__dict__, "method": method, "particles": n, "draft_tokens": k}
        )
        emp = empirical(sample_counts(target, draft, prompt, cfg, runs))
        rows.append(
            FidelityRow(
                method, n, k, runs, total_variation(exact, emp), kl_divergence(exact, emp, eps=1e-6)
            )
        )
    return rows, draft_tv


@dataclass
class PotentialRow:
    """One setting of :func:`potential_fidelity`.

    Attributes:
        setting: ``masked-ar`` (its TV is to the conditional), ``smc-constraint``,
            ``smc-reward`` (reward with the prefix twist) or ``smc-reward-end`` (the whole
            reward at the end).
        particles: N (0 for masked AR). draft_tokens: K (0 for masked AR). runs: seeded runs.
        tv: TV between the runs' empirical distribution and the exact target of the
            potential (the conditional, or the reward-tilted distribution).
        noise: :func:`expected_noise_tv` of that target at ``runs`` (an exact sampler's TV).
        mean_log_z: mean over runs of the log-normaliser estimate (NaN for masked AR).
        z_ratio: mean over runs of the normaliser estimate over the exact normaliser (1 for
            an unbiased estimator; NaN for masked AR).
    """

    setting: str
    particles: int
    draft_tokens: int
    runs: int
    tv: float
    noise: float
    mean_log_z: float = math.nan
    z_ratio: float = math.nan


@dataclass
class PotentialFidelity:
    """Exact quantities and rows of :func:`potential_fidelity`.

    Attributes:
        rows: masked AR at ``runs // 4`` and ``runs`` samples, then SMC-SD per N.
        log_pa: exact ``log P(A)``. in_a: how many of the enumerated sequences are in A.
        masked_bias: exact TV(locally-masked, conditional), masked AR's and SD's bias.
        masked_ar_tv_local: masked AR's empirical TV to the locally-masked distribution at
            ``runs`` samples (it samples that one exactly: sampling noise only).
        reward_log_z: exact ``log Z`` of the tilted target.
        reward_tv_untilted: TV(p, tilted): the error of a sampler that ignores the reward.
        reward_beta: the reward's beta.
        draft_tv: exact TV(draft, target) over the enumerated sequences.
    """

    rows: list[PotentialRow]
    log_pa: float
    in_a: int
    masked_bias: float
    masked_ar_tv_local: float
    reward_log_z: float
    reward_tv_untilted: float
    reward_beta: float
    draft_tv: float


def _mean_log_and_ratio(log_zs: list[float], exact_log_z: float) -> tuple[float, float]:
    """Mean of ``log Z-hat`` and ``mean(Z-hat) / Z`` (NaN if any run lacks an estimate)."""
    lz = torch.tensor(log_zs, dtype=torch.float64)
    log_mean = float(torch.logsumexp(lz, 0)) - math.log(len(log_zs))
    return float(lz.mean()), math.exp(log_mean - exact_log_z)


def _smc_rows(
    setting: str,
    models: tuple[Transformer, Transformer],
    prompt: list[int],
    cfg: GenerationConfig,
    particles: list[int],
    runs: int,
    exact: LogProbs,
    exact_log_z: float,
    seed0: int,
) -> list[PotentialRow]:
    """SMC-SD with ``cfg``'s potential at each N: TV to ``exact`` and the normaliser."""
    want = probabilities(exact)
    rows = []
    for n in particles:
        cfg_n = replace(cfg, particles=n).validate()
        counts, log_zs = sample_outputs(*models, prompt, cfg_n, runs, seed0)
        mean_log_z, ratio = _mean_log_and_ratio(log_zs, exact_log_z)
        tv = total_variation(want, empirical(counts))
        noise = expected_noise_tv(want, runs)
        rows.append(PotentialRow(setting, n, cfg.draft_tokens, runs, tv, noise, mean_log_z, ratio))
    return rows


def potential_fidelity(
    target: Transformer,
    draft: Transformer,
    prompt: list[int],
    length: int,
    particles: list[int],
    draft_tokens: int,
    runs: int,
    constraint: TokenConstraint,
    reward: Reward,
    temperature: float = 1.0,
    seed0: int = 0,
) -> PotentialFidelity:
    """Exact fidelity with potentials over the first ``length`` tokens (no stop tokens).

    Runs (run ``i`` seeded ``seed0 + i``): masked AR at ``runs`` samples and, seeded from
    ``seed0 + runs`` on, at ``runs // 4`` (its TV to the conditional is a fixed bias,
    ``masked_bias``, that more samples do not shrink);
    SMC-SD with ``constraint`` at each N in ``particles`` (TV to the exact conditional, and
    the log-normaliser estimate against the exact ``log P(A)``); SMC-SD with ``reward`` at
    each N, with its prefix twist when it has one (``smc-reward``) and with the whole reward
    at the end (``smc-reward-end``), TV to the exact ``p(x) exp(beta R(x)) / Z``. SMC uses
    ``draft_tokens`` = K and the default resampling (kappa 0.5, systematic), both models at
    ``temperature``. Formulas: Lew et al. 2023; Park et al. 2024; the notes' "Potentials".

    Raises:
        ValueError: if no enumerated sequence is in A; the decoders' errors propagate.
    """
    exact = sequence_log_probs(target, prompt, length, temperature)
    cond, log_pa = conditional_log_probs(exact, constraint)
    local = probabilities(locally_masked_log_probs(exact, constraint))
    tilted, log_z = tilted_log_probs(exact, reward)
    base = GenerationConfig(
        max_new_tokens=length,
        temperature=temperature,
        draft_temperature=temperature,
        draft_tokens=draft_tokens,
    )
    ar_cfg = replace(base, method="ar", constraint=constraint).validate()
    want = probabilities(cond)
    rows, tv_local = [], math.nan
    for r, s0 in ((runs // 4, seed0 + runs), (runs, seed0)):  # two independent samples
        emp = empirical(sample_counts(target, draft, prompt, ar_cfg, r, s0))
        tv_local = total_variation(local, emp)
        rows.append(
            PotentialRow(
                "masked-ar", 0, 0, r, total_variation(want, emp), expected_noise_tv(want, r)
            )
        )
    models = (target, draft)
    smc = replace(base, method="smc")
    rows += _smc_rows(
        "smc-constraint",
        models,
        prompt,
        replace(smc, constraint=constraint).validate(),
        particles,
        runs,
        cond,
        log_pa,
        seed0,
    )
    rewards = [("smc-reward", reward)] if reward.prefix_fn is not None else []
    rewards.append(("smc-reward-end", replace(reward, prefix_fn=None)))
    for setting, rw in rewards:
        cfg = replace(smc, reward=rw).validate()
        rows += _smc_rows(setting, models, prompt, cfg, particles, runs, tilted, log_z, seed0)
    return PotentialFidelity(
        rows=rows,
        log_pa=log_pa,
        in_a=len(cond),
        masked_bias=total_variation(local, probabilities(cond)),
        masked_ar_tv_local=tv_local,
        reward_log_z=log_z,
        reward_tv_untilted=total_variation(probabilities(tilted), probabilities(exact)),
        reward_beta=reward.beta,
        draft_tv=total_variation(
            probabilities(exact),
            probabilities(sequence_log_probs(draft, prompt, length, temperature)),
        ),
    )


@torch.inference_mode()
def target_nll(model: Transformer, prompt: list[int], output: list[int]) -> float:
    """Mean per-token negative log-likelihood (nats, temperature 1) of ``output`` given
    ``prompt`` under ``model``."""
    if not output:
        return float("nan")
    cache = model.new_cache(1, len(output) + 1)
    try:
        first = model.prefill(torch.tensor(prompt), cache)
        logits = first[None]
        if len(output) > 1:
            logits = torch.cat((logits, model.decode(torch.tensor([output[:-1]]), cache)[0]))
    finally:
        cache.close()
    lp = torch.log_softmax(logits.double(), -1)[torch.arange(len(output)), torch.tensor(output)]
    return float(-lp.mean())


def _pyplot():
    """matplotlib's pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_fidelity_report(
    rows: list[FidelityRow],
    draft_tv: float,
    out_dir: str | Path,
    note: str = "",
    potentials: PotentialFidelity | None = None,
    potentials_note: str = "",
) -> Path:
    """Write ``fidelity.md`` (tables) and ``fidelity.png`` (TV vs N, log-log, one line per K).

    With ``potentials`` (:func:`potential_fidelity`), ``fidelity.md`` gains the sections of
    :func:`potential_report_lines` (``potentials_note`` opens them: models, constraint,
    reward) and ``fidelity_potentials.png`` is written (:func:`plot_potentials`).
    Returns the path of ``fidelity.md``; creates ``out_dir`` if needed.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lines = [
        "# Fidelity to the exact target distribution",
        "",
        note,
        "",
        f"TV(draft, target) over the enumerated sequences: {draft_tv:.3f}",
        "",
        "| method | N | K | runs | TV | KL(target, empirical) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.method} | {r.particles if r.weighted else '-'} | "
            f"{r.draft_tokens} | {r.runs} | {r.tv:.4f} | {r.kl:.4f} |"
        )
    if potentials is not None:
        lines += ["", *potential_report_lines(potentials, potentials_note)]
        plot_potentials(potentials, out / "fidelity_potentials.png")
    (out / "fidelity.md").write_text("\n".join(lines) + "\n")
    _plot_grid(rows, out / "fidelity.png")
    return out / "fidelity.md"


def _plot_grid(rows: list[FidelityRow], path: Path) -> None:
    """TV vs N (log-log) of the unconstrained grid, one line per K, SD dotted."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for k in sorted({r.draft_tokens for r in rows}):
        smc = sorted((r.particles, r.tv) for r in rows if r.weighted and r.draft_tokens == k)
        if smc:
            ax.plot([n for n, _ in smc], [t for _, t in smc], "o-", label=f"SMC-SD K={k}")
        sd = [r.tv for r in rows if not r.weighted and r.draft_tokens == k]
        if sd:
            ax.axhline(sd[0], linestyle=":", linewidth=1, color="gray")
    ns = sorted({r.particles for r in rows if r.weighted})
    if ns:
        first = [r.tv for r in rows if r.weighted and r.particles == ns[0]]
        ref = max(first) if first else 1.0
        ax.plot(
            ns,
            [ref * (ns[0] / n) ** 0.5 for n in ns],
            "k--",
            linewidth=1,
            label="1/sqrt(N) reference",
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("particles N")
    ax.set_ylabel("TV to the exact target")
    ax.set_title("SMC-SD fidelity (dotted: exact SD at sampling noise)")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def potential_summary(pf: PotentialFidelity) -> str:
    """One line: masked AR's bias, the constrained and the reward SMC-SD's TV at the smallest
    and the largest N, and the mean log-normaliser estimate at the largest N vs log P(A)."""

    def ends(setting: str) -> tuple[PotentialRow, PotentialRow]:
        rs = sorted((r for r in pf.rows if r.setting == setting), key=lambda r: r.particles)
        return rs[0], rs[-1]

    c0, c1 = ends("smc-constraint")
    r0, r1 = ends(
        "smc-reward" if any(r.setting == "smc-reward" for r in pf.rows) else "smc-reward-end"
    )
    ar = [r for r in pf.rows if r.setting == "masked-ar"][-1]
    return (
        f"potentials: masked AR TV to the conditional {ar.tv:.3f} at {ar.runs} samples "
        f"(exact bias {pf.masked_bias:.3f}); constrained SMC-SD TV {c0.tv:.3f} (N={c0.particles}) "
        f"-> {c1.tv:.3f} (N={c1.particles}), mean log Z-hat {c1.mean_log_z:.3f} vs exact "
        f"log P(A) {pf.log_pa:.3f}; reward SMC-SD TV {r0.tv:.3f} (N={r0.particles}) -> "
        f"{r1.tv:.3f} (N={r1.particles})"
    )


_SETTING_LABELS = {
    "smc-constraint": "SMC-SD, constraint",
    "smc-reward": "SMC-SD, reward (prefix twist)",
    "smc-reward-end": "SMC-SD, reward at the end",
}


def potential_report_lines(pf: PotentialFidelity, note: str = "") -> list[str]:
    """Markdown sections for :func:`potential_fidelity`'s results: masked AR's bias, the
    constrained SMC-SD's TV and log-normaliser vs N, the reward SMC-SD's TV vs N."""
    ar = [r for r in pf.rows if r.setting == "masked-ar"]
    lines = [
        "## With potentials: a hard constraint and a reward",
        "",
        note,
        "",
        f"TV(draft, target) over the enumerated sequences: {pf.draft_tv:.3f}. "
        f"Sequences in A: {pf.in_a}; exact log P(A) = {pf.log_pa:.3f}. "
        "`noise`: the TV an exact sampler would show at that many runs "
        "(normal approximation, sum_x sqrt(p(1-p) / (2 pi runs))).",
        "",
        "### Masked AR: a fixed bias",
        "",
        f"Exact TV(locally-masked, conditional) = {pf.masked_bias:.4f}: masked AR and masked SD "
        "sample the locally-masked distribution exactly, so this is their error at any sample "
        f"count. Masked AR's TV to the locally-masked distribution at {ar[-1].runs} samples: "
        f"{pf.masked_ar_tv_local:.4f} (sampling noise).",
        "",
        "| method | samples | TV to the conditional | noise |",
        "|---|---:|---:|---:|",
    ]
    lines += [f"| masked ar | {r.runs} | {r.tv:.4f} | {r.noise:.4f} |" for r in ar]
    lines += [
        "",
        "### Constrained SMC-SD: TV to the conditional and the log-normaliser",
        "",
        f"Exact log P(A) = {pf.log_pa:.4f}. `mean log Z-hat`: mean over runs of the "
        'estimate `stats["log_normalizer"]` (below log P(A) by Jensen\'s inequality, less so '
        "as N grows); `mean Z-hat / P(A)`: 1 for an unbiased estimator.",
        "",
        "| N | K | runs | TV to the conditional | noise | mean log Z-hat | mean Z-hat / P(A) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r.particles} | {r.draft_tokens} | {r.runs} | {r.tv:.4f} | {r.noise:.4f} | "
        f"{r.mean_log_z:.4f} | {r.z_ratio:.3f} |"
        for r in pf.rows
        if r.setting == "smc-constraint"
    ]
    lines += [
        "",
        "### Reward SMC-SD: TV to p(x) exp(beta R(x)) / Z",
        "",
        f"beta = {pf.reward_beta:g}; exact log Z = {pf.reward_log_z:.4f}; TV(p, tilted) = "
        f"{pf.reward_tv_untilted:.4f} (the error of ignoring the reward).",
        "",
        "| reward | N | K | runs | TV to the tilted target | noise | mean log Z-hat | "
        "mean Z-hat / Z |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {'prefix twist' if r.setting == 'smc-reward' else 'at the end'} | {r.particles} | "
        f"{r.draft_tokens} | {r.runs} | {r.tv:.4f} | {r.noise:.4f} | {r.mean_log_z:.4f} | "
        f"{r.z_ratio:.3f} |"
        for r in pf.rows
        if r.setting in ("smc-reward", "smc-reward-end")
    ]
    lines += ["", "Plot: `fidelity_potentials.png`."]
    return lines


def plot_potentials(pf: PotentialFidelity, path: str | Path) -> None:
    """Two log-x panels: TV to the exact target vs N (log-log) for the constrained and the
    reward SMC-SD, with masked AR's exact bias as a horizontal line and the exact
    sampler's noise dotted; and ``mean log Z-hat - exact log Z`` vs N (0 dashed)."""
    plt = _pyplot()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    for setting, label in _SETTING_LABELS.items():
        rs = sorted((r for r in pf.rows if r.setting == setting), key=lambda r: r.particles)
        if not rs:
            continue
        ns = [r.particles for r in rs]
        (line,) = ax.plot(ns, [r.tv for r in rs], "o-", label=label)
        ax.axhline(rs[0].noise, linestyle=":", linewidth=1, color=line.get_color())
        exact = pf.log_pa if setting == "smc-constraint" else pf.reward_log_z
        bx.plot(ns, [r.mean_log_z - exact for r in rs], "o-", label=label)
    ax.axhline(pf.masked_bias, color="k", linewidth=1.5, label="masked AR bias (exact)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("particles N")
    ax.set_ylabel("TV to the exact target")
    ax.set_title("With potentials (dotted: exact sampler's noise)")
    ax.legend(fontsize=8)
    bx.axhline(0.0, color="k", linestyle="--", linewidth=1)
    bx.set_xscale("log", base=2)
    bx.set_xlabel("particles N")
    bx.set_ylabel("mean log Z-hat - exact log Z")
    bx.set_title("Log-normaliser estimate")
    bx.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
