"""``smcspec eval fidelity`` with potentials: the exact enumerations, the report and the command.

The exact functions are checked against hand-computed values on a distribution small enough
to write down; the command end to end on the tiny models with few seeded runs (200), with
thresholds stated next to each assertion.
"""

from __future__ import annotations

import math
import re

import pytest

from smcspec.cli import main
from smcspec.eval.automaton import NextTokenAutomaton
from smcspec.eval.exact import (
    conditional_log_probs,
    expected_noise_tv,
    locally_masked_log_probs,
    tilted_log_probs,
)
from smcspec.eval.fidelity import (
    PotentialFidelity,
    PotentialRow,
    letter_count_reward,
    letters,
    write_fidelity_report,
)

# two tokens, two steps: p(x1 = 0) = 0.3; p(x2 = 0 | 0) = 0.6; p(x2 = 0 | 1) = 0.2
P1 = {0: 0.3, 1: 0.7}
P2 = {0: {0: 0.6, 1: 0.4}, 1: {0: 0.2, 1: 0.8}}
LOG_P = {(a, b): math.log(P1[a] * P2[a][b]) for a in (0, 1) for b in (0, 1)}
# after 0 only 0; anything first and after 1: A = {00, 10, 11}
SMALL = {None: {0, 1}, 0: {0}, 1: {0, 1}}


def _exp(d: dict) -> dict:
    return {k: math.exp(v) for k, v in d.items()}


def test_conditional_and_log_pa_by_hand():
    cond, log_pa = conditional_log_probs(LOG_P, NextTokenAutomaton(SMALL, 2))
    pa = 0.3 * 0.6 + 0.7  # 00, and 1 followed by anything
    assert log_pa == pytest.approx(math.log(pa))
    want = {(0, 0): 0.18 / pa, (1, 0): 0.14 / pa, (1, 1): 0.56 / pa}
    assert _exp(cond) == pytest.approx(want)


def test_locally_masked_by_hand():
    # step 1 keeps both tokens (0.3 / 0.7); after 0 the mask keeps only 0, renormalised to 1
    local = _exp(locally_masked_log_probs(LOG_P, NextTokenAutomaton(SMALL, 2)))
    assert local == pytest.approx({(0, 0): 0.3, (1, 0): 0.14, (1, 1): 0.56})


def test_a_refused_token_is_outside_a():
    dfa = NextTokenAutomaton(SMALL, 2, refused=frozenset({(1, 1)}))
    cond, log_pa = conditional_log_probs(LOG_P, dfa)
    assert set(cond) == {(0, 0), (1, 0)}
    assert log_pa == pytest.approx(math.log(0.18 + 0.14))


def test_empty_language_raises():
    with pytest.raises(ValueError, match="zero weight"):
        conditional_log_probs(LOG_P, NextTokenAutomaton({None: {0}, 0: set()}, 2))


def test_tilted_by_hand():
    reward = letter_count_reward(1, 0.5, 2)  # R = number of "b" (token 1)
    tilted, log_z = tilted_log_probs(LOG_P, reward)
    w = {k: math.exp(v) * math.exp(0.5 * sum(k)) for k, v in LOG_P.items()}
    z = sum(w.values())
    assert log_z == pytest.approx(math.log(z))
    assert _exp(tilted) == pytest.approx({k: v / z for k, v in w.items()})
    assert letters([0, 1, 3]) == "abd"
    with pytest.raises(ValueError):
        letter_count_reward(2, 0.5, 2)


def test_expected_noise_tv():
    # one cell of mass 1: no noise; two cells of 1/2: sum_x sqrt(1/4 / (2 pi n))
    assert expected_noise_tv({(0,): 1.0}, 100) == 0.0
    assert expected_noise_tv({(0,): 0.5, (1,): 0.5}, 100) == pytest.approx(
        2 * math.sqrt(0.25 / (2 * math.pi * 100))
    )


def test_report_sections_and_plot(tmp_path):
    rows = [
        PotentialRow("masked-ar", 0, 0, 50, 0.45, 0.2),
        PotentialRow("masked-ar", 0, 0, 200, 0.44, 0.1),
        PotentialRow("smc-constraint", 1, 2, 200, 0.5, 0.1, -2.2, 1.01),
        PotentialRow("smc-constraint", 16, 2, 200, 0.12, 0.1, -1.5, 0.99),
        PotentialRow("smc-reward", 1, 2, 200, 0.6, 0.2, -0.3, 0.9),
        PotentialRow("smc-reward", 16, 2, 200, 0.25, 0.2, 0.6, 1.02),
        PotentialRow("smc-reward-end", 1, 2, 200, 0.6, 0.2, -0.3, 0.9),
        PotentialRow("smc-reward-end", 16, 2, 200, 0.26, 0.2, 0.6, 1.03),
    ]
    pf = PotentialFidelity(rows, -1.466, 16, 0.443, 0.05, 0.678, 0.235, 0.7, 0.6)
    md = write_fidelity_report([], 0.75, tmp_path, "note", pf, "potentials note").read_text()
    assert "Exact TV(locally-masked, conditional) = 0.4430" in md
    assert "| masked ar | 200 | 0.4400 | 0.1000 |" in md
    assert "| 16 | 2 | 200 | 0.1200 | 0.1000 | -1.5000 | 0.990 |" in md
    assert "| at the end | 16 | 2 | 200 | 0.2600 | 0.2000 | 0.6000 | 1.030 |" in md
    assert "potentials note" in md and "exact log P(A) = -1.466" in md
    assert (tmp_path / "fidelity_potentials.png").stat().st_size > 1000


def _table_rows(md: str, heading: str) -> list[list[str]]:
    """The data rows (cells as strings) of the first table after ``heading``."""
    section = md.split(heading, 1)[1]
    lines = [ln for ln in section.split("\n\n")[2].splitlines() if ln.startswith("|")]
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:]]


def _run_fidelity_command(out) -> str:
    """``smcspec eval fidelity`` with 200 runs, N in {1, 16}, K = 2 and the reward at beta
    1.2 (log Z = 1.419, so a sampler whose weights ignore the reward estimates Z / Z-hat at
    0.24, and one with beta 1.5x too large at about 3); returns the report."""
    argv = ["eval", "fidelity", "--runs", "200", "--fidelity-n", "1,16", "--fidelity-k", "2"]
    argv += ["--reward-beta", "1.2"]
    assert main([*argv, "--out", str(out)]) == 0
    return (out / "fidelity.md").read_text()


@pytest.mark.slow
def test_eval_fidelity_command_reports_potentials(tmp_path, capsys):
    """The command's new sections hold the expected behaviour (200 seeded runs, seeds 0-199;
    an exact sampler's TV at 200 runs is about 0.10 over A's 16 sequences, 0.20 over 64).

    Measured (2-core CPU, torch 2.13): masked AR 0.431 (bias 0.443); constrained SMC-SD TV
    0.498 at N=1, 0.211 at N=16, mean log Z-hat at N=16 -1.617 vs log P(A) -1.466; reward
    at beta 1.2: TV 0.718 -> 0.406 (twist) and 0.412 (at the end), mean Z-hat / Z 1.128 and
    1.122 at N=16. Breaking the mask correction of the
    weights (as ``test_smc_without_the_mask_correction_fails``) gives N=16 TV 0.83: it fails.
    """
    out = tmp_path / "fid"
    md = _run_fidelity_command(out)
    printed = capsys.readouterr().out
    assert "potentials: masked AR TV to the conditional" in printed
    assert (out / "fidelity.png").stat().st_size > 1000
    assert (out / "fidelity_potentials.png").stat().st_size > 1000
    bias = float(re.search(r"Exact TV\(locally-masked, conditional\) = ([0-9]+\.[0-9]+)", md)[1])
    log_pa = float(re.search(r"exact log P\(A\) = (-?[0-9]+\.[0-9]+)", md)[1])
    assert bias == pytest.approx(0.4432, abs=1e-3)  # exact, by enumeration
    assert log_pa == pytest.approx(-1.466, abs=1e-3)
    # masked AR stays at the bias: within 0.15 of it (1.5x the noise) at 50 and 200 samples
    ar = _table_rows(md, "### Masked AR")
    assert [r[1] for r in ar] == ["50", "200"]
    assert all(abs(float(r[2]) - bias) < 0.15 for r in ar)
    # constrained SMC-SD: TV falls by more than 0.15 from N=1 to N=16 and ends more than
    # 0.1 below masked AR's bias; mean log Z-hat within 0.3 of log P(A) at N=16, and closer
    # than at N=1 (the Jensen gap shrinks with N)
    smc = {int(r[0]): r for r in _table_rows(md, "### Constrained SMC-SD")}
    tv = {n: float(r[3]) for n, r in smc.items()}
    log_z = {n: float(r[5]) for n, r in smc.items()}
    assert tv[16] < tv[1] - 0.15
    assert tv[16] < bias - 0.1
    assert abs(log_z[16] - log_pa) < 0.3
    assert log_z[1] < log_z[16]
    # reward SMC-SD, with and without the twist: TV falls by more than 0.15 from N=1 to 16,
    # and the normaliser estimate finds the tilt's Z. The TV alone cannot tell a working
    # reward from an ignored one here: TV(p, tilted) is 0.432 against a noise of 0.18 at 200
    # runs (and a stronger beta needs far more than 16 particles: at beta 2, N=64 still
    # gives TV 0.48), while mean Z-hat / Z is 1.13 at N=16 and would be 0.24 with the
    # reward ignored in the weights, about 3 with beta 1.5x too large
    untilted = float(re.search(r"TV\(p, tilted\) = ([0-9]+\.[0-9]+)", md)[1])
    assert untilted == pytest.approx(0.4321, abs=1e-3)  # exact, by enumeration
    reward = _table_rows(md, "### Reward SMC-SD")
    for kind in ("prefix twist", "at the end"):
        rtv = {int(r[1]): float(r[4]) for r in reward if r[0] == kind}
        z_ratio = {int(r[1]): float(r[7]) for r in reward if r[0] == kind}
        assert rtv[16] < rtv[1] - 0.15
        assert abs(z_ratio[16] - 1) < 0.25
