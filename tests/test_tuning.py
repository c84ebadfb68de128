"""Settings from measured costs (``smcspec.tuning``): the roofline predictions and the choice on
hand-written costs, the cost cache on a tiny GGUF pair, and the CLI (``--method auto``, smc
without -N/-K, ``bench --predict``, ``--quantize-draft``)."""

from __future__ import annotations

import json
import platform
import re

import pytest
import torch
from conftest import SMALL_GRID
from tiny_models import CHAT_TEMPLATE, make_tiny_gguf, make_tiny_hf_model

from smcspec import ConfigError, Engine, GenerationConfig, Regex
from smcspec.cli import main
from smcspec.config import NGRAM_DRAFT_P_MIN
from smcspec.tuning import (
    ForwardCosts,
    Setting,
    TuningGrid,
    alpha_from_counts,
    choose,
    default_grid,
    format_table,
    predict,
    predict_all,
    sd_tokens_per_round,
    tune,
)
from smcspec.tuning import tuner as tuner_module
from smcspec.tuning.cache import cache_file, cost_key, cpu_model, read_costs
from smcspec.tuning.calibration import read_calibration
from smcspec.tuning.predict import (
    CHOICE_MARGIN,
    DEFAULT_SMC,
    Prediction,
    meets_floor,
    predicted_ess,
    sd_accepted_per_round,
)

NS, KS = (1, 2, 4, 8, 16), (2, 4, 8)


def hand_costs(t1: float, c: float, per_row: float, alpha: float = 0.8) -> ForwardCosts:
    """Target forwards cost ``t1 * (1 + per_row * (rows * tokens - 1))``; the draft ``c`` times
    that. per_row 1: every row costs a whole forward (a CPU with no idle compute); 0: rows are
    free (memory-bound)."""

    def cost(scale: float, rows: int, tokens: int) -> float:
        return scale * t1 * (1 + per_row * (rows * tokens - 1))

    shapes = [(n, t) for n in NS for t in (1, 2, 3, 5, 9)]
    return ForwardCosts(
        target={s: cost(1.0, *s) for s in shapes},
        draft={s: cost(c, *s) for s in shapes},
        alpha=alpha,
    )


def all_settings() -> list[Setting]:
    return TuningGrid(max_forward_tokens=10_000).settings(min_particles=1)


# ------------------------------------------------------------------ formulas
def test_ar_sd_and_smc_predictions_follow_the_formulas():
    t = {(1, 1): 0.030, (1, 5): 0.060, (4, 5): 0.090}
    d = {(1, 1): 0.010, (1, 2): 0.012, (4, 1): 0.015, (4, 2): 0.020}
    costs = ForwardCosts(target=t, draft=d, alpha=0.5)
    ar = predict(Setting("ar"), costs)
    assert ar.tokens_per_second == pytest.approx(1 / 0.030)
    sd = predict(Setting("sd", 1, 4), costs)
    assert sd.tokens_per_round == pytest.approx((1 - 0.5**5) / 0.5)  # Leviathan et al. eq. 1
    # 3 one-token draft forwards, the first one with 2 tokens when all 4 were accepted (1/16)
    assert sd.round_seconds == pytest.approx(3 * 0.010 + (0.012 / 16 + 0.010 * 15 / 16) + 0.060)
    smc = predict(Setting("smc", 4, 4), costs)
    assert smc.tokens_per_round == 5
    assert smc.round_seconds == pytest.approx(3 * 0.015 + 0.020 + 0.090)
    with pytest.raises(KeyError):
        predict(Setting("smc", 8, 4), costs)  # not measured
    with pytest.raises(ConfigError, match="alpha"):
        predict(Setting("sd", 1, 4), ForwardCosts(t, d, alpha=None))


def test_memory_bound_smc_meets_the_roofline():
    """Rows and tokens free (per_row 0): SMC-SD's speed-up is (K+1) / (K c + 1) whatever N is
    (K draft forwards a round: deferred feeding puts the bonus into the first one)."""
    costs = hand_costs(0.02, c=0.1, per_row=0.0)
    ar = predict(Setting("ar"), costs).tokens_per_second
    for n in NS:
        speedup = predict(Setting("smc", n, 8), costs).tokens_per_second / ar
        assert speedup == pytest.approx(9 / (8 * 0.1 + 1))


def test_sd_tokens_per_round_limits():
    assert sd_tokens_per_round(0.0, 4) == 1.0
    assert sd_tokens_per_round(1.0, 4) == 5.0
    assert sd_tokens_per_round(0.5, 1) == pytest.approx(1.5)


@pytest.mark.parametrize("alpha, k", [(0.86, 2), (0.86, 4), (0.3, 8), (0.99, 4)])
def test_alpha_from_counts_inverts_the_expected_accepted_drafts(alpha, k):
    rounds = 1000
    accepted = round(sd_accepted_per_round(alpha, k) * rounds)
    assert alpha_from_counts(accepted, k * rounds, rounds) == pytest.approx(alpha, abs=2e-3)


def test_alpha_is_not_the_acceptance_rate():
    """The committed CPU benchmark's sd-k4 counts (4 prompts pooled): accepted/drafted 0.70,
    but alpha 0.86, the same as sd-k2's (rate 0.80). The rate as alpha under-predicted sd-k4."""
    assert alpha_from_counts(373, 531, 135) == pytest.approx(0.86, abs=0.01)
    assert alpha_from_counts(312, 390, 196) == pytest.approx(0.86, abs=0.01)
    assert alpha_from_counts(0, 40, 10) == 0.0
    assert alpha_from_counts(40, 40, 10) == 1.0
    for bad in ((5, 4, 1), (1, 4, 0), (-1, 4, 1)):
        with pytest.raises(ConfigError):
            alpha_from_counts(*bad)


# ------------------------------------------------------------------ the choice
def test_cpu_without_idle_compute_picks_ar_and_the_fewest_particles_allowed():
    """Every row costs a forward (per_row 1) and the draft costs 0.65 of the target (the
    committed CPU benchmark's c): auto is ar; smc is at the floor N = min_particles."""
    preds = predict_all(all_settings(), hand_costs(0.033, c=0.65, per_row=1.0))
    assert choose(preds, "auto").setting == Setting("ar")
    pick = choose(preds, "smc", min_particles=4)
    assert pick.setting.particles == 4
    assert choose(preds, "smc", min_particles=1).setting.particles == 1  # faster, below 4
    assert choose(preds, "smc", min_particles=8).setting.particles == 8


def test_memory_bound_gpu_picks_smc_with_the_most_particles():
    """Rows free and a cheap draft (c 0.1): auto is smc; every N predicts the same speed, so
    the tie rule takes the largest N; the largest K wins (alpha does not limit SMC-SD)."""
    preds = predict_all(all_settings(), hand_costs(0.02, c=0.1, per_row=0.0, alpha=0.6))
    auto = choose(preds, "auto")
    assert auto.setting == Setting("smc", 16, 8)
    assert choose(preds, "smc", draft_tokens=4).setting == Setting("smc", 16, 4)
    assert choose(preds, "auto", particles=2).setting == Setting("smc", 2, 8)  # explicit N


def test_ties_go_to_more_particles_only_within_the_tolerance():
    costs = hand_costs(0.02, c=0.1, per_row=0.001)  # each extra token costs 0.1 %
    preds = predict_all(all_settings(), costs)
    by_n = {n: choose(preds, "smc", particles=n).tokens_per_second for n in NS}
    assert by_n[8] > 0.95 * by_n[4] > by_n[16]  # 8 within 5 % of the fastest, 16 not
    assert choose(preds, "smc", tie=0.0).setting.particles == 4  # the fastest
    assert choose(preds, "smc", tie=0.05).setting.particles == 8


def test_the_documented_default_is_kept_unless_another_is_faster_by_the_margin():
    """smc N=8 K=2 (DEFAULT_SMC) stays the choice while it is predicted within
    CHOICE_MARGIN of the fastest and meets the floors; an explicit N or K, a faster setting
    beyond the margin, or a default below --min-ess move the choice."""

    def preds(default_tps: float, default_ess: float = 6.0) -> list[Prediction]:
        rows = [(Setting("ar"), 10.0, None), (Setting("smc", 8, 4), 5.0, 5.0),
                (Setting("smc", 16, 2), 4.5, 9.0),
                (Setting("smc", *DEFAULT_SMC), default_tps, default_ess)]  # fmt: skip
        return [Prediction(s, tokens_per_round=t, round_seconds=1.0, ess=e) for s, t, e in rows]

    kw = dict(min_ess=4, default=DEFAULT_SMC)
    near = 5.0 * (1 - CHOICE_MARGIN) + 0.01  # just inside the margin of smc-n8-k4
    assert choose(preds(near), "smc", **kw).setting == Setting("smc", *DEFAULT_SMC)
    assert choose(preds(near), "smc", **kw, margin=0.0).setting == Setting("smc", 8, 4)
    assert choose(preds(near), "smc", min_ess=4).setting == Setting("smc", 8, 4)  # no default
    far = 5.0 * (1 - CHOICE_MARGIN) - 0.01  # just outside it
    assert choose(preds(far), "smc", **kw).setting == Setting("smc", 8, 4)
    below = preds(near, default_ess=3.0)  # the default misses the fidelity floor
    assert choose(below, "smc", **kw).setting == Setting("smc", 8, 4)
    assert choose(preds(near), "smc", **kw, draft_tokens=2).setting.particles == 16  # K given
    assert choose(preds(near), "auto", **kw).setting == Setting("ar")  # ar is the fastest


def test_ngram_sd_is_priced_at_its_gates_threshold():
    """One drafted token accepted with probability NGRAM_DRAFT_P_MIN, for a 2-row forward;
    it needs no draft forward and applies as sd with the n-gram draft."""
    costs = hand_costs(0.03, c=0.5, per_row=0.6)
    ngram = Setting("sd", 1, 4, draft="ngram")
    p = predict(ngram, costs)
    assert p.tokens_per_round == pytest.approx(1 + NGRAM_DRAFT_P_MIN)
    assert p.round_seconds == pytest.approx(costs.target[(1, 2)])
    assert ngram.draft_shapes() == () and (1, 2) in ngram.target_shapes()
    cfg = ngram.apply(GenerationConfig(method="smc"))
    assert (cfg.method, cfg.draft, cfg.draft_tokens) == ("sd", "ngram", 4)
    assert ngram.name == "sd-ngram-k4" and not Setting("sd", 1, 4).ngram


@pytest.mark.parametrize(
    ("per_row", "chosen"),
    [(0.6, "sd-ngram-k4"), (0.75, "ar"), (1.0, "ar")],
)
def test_auto_takes_ngram_sd_for_ar_where_its_gate_pays(per_row, chosen):
    """A CPU whose 2-row forward costs 1 + per_row one-row forwards: drafting one token at
    the gate's threshold (0.8) yields 1.8 tokens, so n-gram sd replaces ar only where
    1.8 / (1 + per_row) beats ar by more than NGRAM_MARGIN (1.6: 1.125x; 1.75: 1.03x, inside
    the margin). smc is never n-gram, and a faster sd or smc is not displaced."""
    preds = predict_all(all_settings(), hand_costs(0.03, c=0.65, per_row=per_row))
    assert choose(preds, "auto").setting.name == chosen
    assert not choose(preds, "smc").setting.ngram
    assert choose(preds, "auto", draft_tokens=2).setting.name == "ar"  # no n-gram at K=2
    gpu = predict_all(all_settings(), hand_costs(0.02, c=0.1, per_row=0.0, alpha=0.6))
    assert choose(gpu, "auto").setting.method == "smc"  # the faster setting stays


def test_the_note_on_a_chosen_ngram_sd_says_where_its_prediction_holds():
    from smcspec.cli.engine_args import tuned_note
    from smcspec.decoding.registry import choice

    pick = Prediction(Setting("sd", 1, 4, draft="ngram"), tokens_per_round=1.8, round_seconds=0.04)
    line = tuned_note(pick, choice("auto"))
    assert line.startswith("sd-ngram-k4 chosen by --method auto") and "45.00 tokens/s" in line
    assert "gate's threshold" in line


def test_choose_errors_are_clear():
    preds = predict_all([Setting("ar")], hand_costs(0.03, 0.5, 1.0))
    with pytest.raises(ConfigError, match="no predicted smc setting with N >= 4"):
        choose(preds, "smc")
    with pytest.raises(ConfigError, match="auto or smc"):
        choose(preds, "sd")
    assert choose(preds, "auto").setting.method == "ar"


# ------------------------------------------------------------------ the fidelity floor
SPREAD = [v / 25 for v in range(-75, 26)]  # per-token log-weights -3 .. +1: a far draft


def test_predicted_ess_is_simulated_from_the_log_weight_quantiles():
    assert predicted_ess(8, 4, [0.0] * 101) == pytest.approx(8.0)  # draft == target
    assert predicted_ess(1, 8, SPREAD) == 1.0 and predicted_ess(6, 0, SPREAD) == 6.0
    ess = {(n, k): predicted_ess(n, k, SPREAD) for n in (4, 16) for k in (2, 8)}
    assert all(1.0 <= e <= n for (n, _), e in ess.items())
    assert ess[(4, 8)] < ess[(4, 2)] and ess[(16, 8)] < ess[(16, 2)]  # longer blocks degenerate
    assert ess[(16, 8)] > ess[(4, 8)]  # more particles, more effective ones
    assert predicted_ess(4, 8, SPREAD) == predicted_ess(4, 8, SPREAD)  # seeded
    with pytest.raises(ConfigError):
        predicted_ess(0, 4, SPREAD)


def _with_quantiles(costs: ForwardCosts, quantiles) -> ForwardCosts:
    return ForwardCosts(costs.target, costs.draft, costs.alpha, log_weight_quantiles=quantiles)


def test_the_floor_keeps_the_fastest_setting_whose_predicted_ess_meets_it():
    """A memory-bound GPU (rows free, cheap draft): without the floor smc N=16 K=8 wins; with
    a far draft its predicted ESS is low, and the floor takes the fastest setting that keeps
    enough effective particles."""
    costs = _with_quantiles(hand_costs(0.02, c=0.1, per_row=0.0, alpha=0.6), SPREAD)
    preds = predict_all(all_settings(), costs)
    assert choose(preds, "smc").setting == Setting("smc", 16, 8)  # no floor (0)
    for floor in (2.0, 3.0, 5.0):  # SPREAD: ESS 1.6-2.2 at N=4, 1.9-3.3 at 8, 2.5-5.2 at 16
        pick = choose(preds, "smc", min_ess=floor)
        ok = [p for p in preds if p.setting.method == "smc" and p.setting.particles >= 4
              and p.ess >= floor]  # fmt: skip
        fastest = max(p.tokens_per_second for p in ok)
        assert meets_floor(pick, floor) and pick.tokens_per_second >= 0.95 * fastest
    assert not meets_floor(choose(preds, "smc"), 4.0)
    assert choose(preds, "smc", particles=4, min_ess=100).setting.particles == 4  # as given


def test_when_no_smc_setting_meets_the_floor_auto_takes_ar_or_sd_and_smc_the_most_faithful():
    far = [v / 5 for v in range(-100, 1)]  # per-token log-weights down to -20
    costs = _with_quantiles(hand_costs(0.02, c=0.1, per_row=0.0, alpha=0.6), far)
    preds = predict_all(all_settings(), costs)
    assert choose(preds, "auto", min_ess=4.0).setting.method in ("ar", "sd")
    pick = choose(preds, "smc", min_ess=4.0)
    assert not meets_floor(pick, 4.0)
    assert pick.ess == max(p.ess for p in preds if p.setting.method == "smc"
                           and p.setting.particles >= 4)  # fmt: skip


def test_log_weight_quantiles_match_the_exact_distribution_of_the_log_weights():
    """Zero for the same model; otherwise each returned quantile sits where the exact pooled
    distribution of ``log p(x) - log q(x)``, ``x ~ q`` at each position (computed from fresh
    prefills, 4-token vocabulary), puts it (within 0.02 of the level at 4000 draws a position)."""
    from enumerable import tiny_transformer

    from smcspec.tuning.measure import log_weight_quantiles

    target, draft = tiny_transformer(seed=1), tiny_transformer(seed=2)
    prompt, tokens = [1, 2, 0], [3, 1, 1, 0, 2]
    same = log_weight_quantiles(target, target, prompt, tokens, 0.7, 0.7, 4)
    assert len(same) == 101 and max(abs(v) for v in same) < 1e-5
    got = log_weight_quantiles(target, draft, prompt, tokens, 1.0, 1.0, 4, draws=4000)
    values, probs = [], []
    for j in range(len(tokens)):
        lp = []
        for model in (target, draft):
            cache = model.new_cache(1, 1)
            lp.append(
                torch.log_softmax(
                    model.prefill(torch.tensor(prompt + tokens[:j]), cache).double(), -1
                )
            )
        for v in range(4):
            values.append(float(lp[0][v] - lp[1][v]))
            probs.append(float(lp[1][v].exp()) / len(tokens))

    def cdf(t: float) -> float:
        return sum(p for x, p in zip(values, probs, strict=True) if x <= t)

    for level in (0.1, 0.25, 0.5, 0.75, 0.9):
        v = got[round(100 * level)]  # interpolated between the support points around it
        below = max(x for x in values if x <= v + 1e-6)
        above = min(x for x in values if x >= v - 1e-6)
        assert cdf(below - 1e-6) <= level + 0.02 and cdf(above + 1e-6) >= level - 0.02, level


def test_degenerate_rounds_count_rounds_whose_weights_collapsed():
    from enumerable import tiny_transformer

    from smcspec.decoding import decode_smc

    target = tiny_transformer(seed=1, scale=1.0)
    far = tiny_transformer(seed=2, scale=1.0)
    cfg = GenerationConfig(method="smc", max_new_tokens=40, particles=4, draft_tokens=8)
    g = torch.Generator().manual_seed(0)
    out = decode_smc(target, far, [1, 2, 0], cfg, frozenset(), 4, g)
    assert out.stats.degenerate_rounds >= 1
    assert out.stats.degenerate_rounds <= out.stats.rounds and out.stats.min_ess < 1.1
    same = decode_smc(target, target, [1, 2, 0], cfg, frozenset(), 4, g)
    assert same.stats.degenerate_rounds == 0


# ------------------------------------------------------------------ the grid
def test_grid_caps_large_forwards_but_keeps_the_floor():
    grid = TuningGrid()  # CPU: at most 80 target tokens a forward
    names = {s.name for s in grid.settings(min_particles=4)}
    assert {"ar", "sd-k2", "sd-k8", "smc-n1-k2", "smc-n8-k8", "smc-n16-k4"} <= names
    assert "smc-n16-k8" not in names
    big = {s.name for s in grid.settings(min_particles=32)}
    assert {"smc-n32-k2", "smc-n32-k4", "smc-n32-k8"} <= big  # the floor is always measured
    assert [s.name for s in grid.settings(4, particles=3, draft_tokens=5)] == [
        "ar",
        "sd-ngram-k5",
        "sd-k5",
        "sd-n3-k5",
        "smc-n3-k5",
        "smc-n3-k5-ess",
    ]
    assert [s.name for s in grid.settings(4, with_draft=False)] == ["ar", "sd-ngram-k4"]
    assert [s.name for s in grid.settings(4, with_draft=False, ngram=False)] == ["ar"]
    gpu, cpu = default_grid("cuda:0"), default_grid("cpu")
    assert gpu.max_forward_tokens >= 16 * 33 > 16 * 9 > cpu.max_forward_tokens
    assert max(gpu.draft_tokens) == 32 > max(cpu.draft_tokens) == 8  # long drafts on a GPU
    big = [s.name for s in gpu.settings(4) if s.method == "smc"]
    assert "smc-n16-k32" in big and "smc-n8-k12" in big


# ------------------------------------------------------------------ measuring and the cache
@pytest.fixture(scope="module")
def gguf_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("tuning")
    return [
        make_tiny_gguf(root, "qwen2", 96, seed=s, chat_template=CHAT_TEMPLATE)[0] for s in (0, 1)
    ]


@pytest.fixture(scope="module")
def engine(gguf_pair, test_cache_dir):
    from smcspec.backends.llamacpp import LlamaCppSettings
    from smcspec.models import load_model

    with pytest.MonkeyPatch.context() as mp:  # tokenizers into the test cache
        mp.setenv("SMCSPEC_CACHE", str(test_cache_dir))
        settings = LlamaCppSettings(threads=1)
        return Engine(*[load_model(p, backend="llamacpp", llamacpp=settings) for p in gguf_pair])


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SMCSPEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_costs_are_measured_once_and_cached(engine, own_cache, monkeypatch):
    notes: list[str] = []
    first = tune(engine, min_particles=4, log=notes.append)
    assert len(notes) == 1 and "measuring" in notes[0] and str(first.cache_path) in notes[0]
    assert first.cache_path.parent == own_cache / "costs" and first.measured_seconds > 0
    assert first.pick("smc").setting.method == "smc" and first.pick("smc").setting.particles >= 4
    # auto: the fastest setting under both floors (an smc tie within 5% may take more
    # particles); smc's own pick may be faster when no smc setting meets the ESS floor
    allowed = [
        p
        for p in first.predictions
        if p.setting.method != "smc" or (p.setting.particles >= 4 and meets_floor(p, first.min_ess))
    ]
    assert first.pick("auto") in allowed
    assert first.pick("auto").tokens_per_second >= 0.95 * max(p.tokens_per_second for p in allowed)
    assert 0.0 <= first.costs.alpha <= 1.0
    names = {p.setting.name for p in first.predictions}
    assert {"ar", "sd-k2", "sd-k4", "smc-n4-k2", "smc-n8-k4"} <= names  # the test grid

    def refuse(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(tuner_module, "measure_forwards", refuse)
    monkeypatch.setattr(tuner_module, "measure_acceptance", refuse)
    again = tune(engine, min_particles=4, log=notes.append)
    assert len(notes) == 1 and again.measured_seconds == 0
    assert again.predictions == first.predictions and again.picks == first.picks
    other_floor = tune(engine, min_particles=8)  # same costs
    assert other_floor.pick("smc").setting.particles >= 8


def test_a_row_count_warms_up_once_then_times_each_shape(monkeypatch):
    """On a CPU the first forward after a row count's prefill is the one untimed warm-up:
    a later token count's first forward is timed (it takes what the timed ones take,
    docs/benchmarks/tuner-warm-up/); ``reps`` timed forwards a shape, each rolled back."""
    from enumerable import tiny_transformer

    from smcspec.tuning.measure import forward_timings_by_tokens

    model = tiny_transformer(seed=1)
    shapes = []
    real = type(model).decode

    def counted(self, tokens, cache, last_only=False):
        shapes.append(tuple(tokens.shape))
        return real(self, tokens, cache, last_only)

    monkeypatch.setattr(type(model), "decode", counted)
    timed = forward_timings_by_tokens(model, 2, [1, 3, 5], reps=2, context=4)
    assert {t: len(v) for t, v in timed.items()} == {1: 2, 3: 2, 5: 2}
    assert shapes == [(2, 1)] * 3 + [(2, 3)] * 2 + [(2, 5)] * 2


def test_remeasure_replaces_the_cached_costs(engine, own_cache):
    first = tune(engine)
    notes: list[str] = []
    again = tune(engine, remeasure=True, log=notes.append)
    assert again.measured_seconds > 0 and len(notes) == 1
    assert again.cache_path == first.cache_path
    assert read_costs(first.cache_path, first.key).target == again.costs.target


def test_other_sampling_measures_only_alpha_again(engine, own_cache, monkeypatch):
    tune(engine)
    calls = []
    real = tuner_module.measure_acceptance

    def count(*args, **kwargs):
        calls.append(args[1].temperature)
        return real(*args, **kwargs)

    monkeypatch.setattr(tuner_module, "measure_forwards", lambda *a: pytest.fail("re-measured"))
    monkeypatch.setattr(tuner_module, "measure_acceptance", count)
    tune(engine, GenerationConfig(temperature=1.0))
    tune(engine, GenerationConfig(temperature=1.0))
    assert calls == [1.0]


def test_calibration_prompts_are_measured_and_cached_beside_the_builtin(
    engine, own_cache, monkeypatch, tmp_path
):
    builtin = tune(engine)
    f = tmp_path / "math.txt"
    f.write_text("What is 17 times 23?\nA shop sells 3 pens for 2 dollars. Cost of 12?\n")
    cal = read_calibration(f, 6)
    calls = []
    real = tuner_module.measure_acceptance

    def count(*args, **kwargs):
        calls.append((args[3], args[4]))
        return real(*args, **kwargs)

    monkeypatch.setattr(tuner_module, "measure_forwards", lambda *a: pytest.fail("re-measured"))
    monkeypatch.setattr(tuner_module, "measure_acceptance", count)
    notes: list[str] = []
    mine = tune(engine, calibration=cal, log=notes.append)
    assert calls == [(12, cal.prompts)]  # 6 tokens from each of the 2 prompts, costs cached
    assert any("2 prompts of" in n for n in notes)
    assert mine.acceptance_key == builtin.acceptance_key + cal.key != builtin.acceptance_key
    assert mine.acceptance["prompts"] == 2 and mine.acceptance["new_tokens"] == 12
    assert "2 prompts of" in format_table(mine)
    record = read_costs(mine.cache_path, mine.key).acceptance
    assert record[builtin.acceptance_key] == builtin.acceptance  # the built-in one kept
    assert tune(engine, calibration=cal).acceptance == mine.acceptance and len(calls) == 1
    assert tune(engine).acceptance == builtin.acceptance and len(calls) == 1


@pytest.mark.parametrize(
    "content", [b"{not json", b"\xff\xfe", b"[]", b'{"key": 1}', b"", "wrong shape"]
)
def test_a_corrupt_cache_file_is_measured_again(engine, own_cache, content):
    path = cache_file(cost_key(engine, SMALL_GRID.context))
    path.parent.mkdir(parents=True)
    if content == "wrong shape":
        tune(engine)
        data = json.loads(path.read_text())
        data["target"]["1x1"] = -1.0
        content = json.dumps(data).encode()
    path.write_bytes(content)
    tuning = tune(engine)
    assert tuning.cache_path == path and tuning.measured_seconds > 0
    assert read_costs(path, tuning.key).target  # rewritten, readable


def test_the_key_names_machine_backend_and_model_files(engine, own_cache):
    key = cost_key(engine, 100)
    assert key["backend"] == "llamacpp" and key["threads"] == 1 and key["format"] >= 1
    assert key["target"]["path"].endswith("tiny-qwen2-s0.gguf")
    assert key["draft"]["files"][0][1] == engine.draft.path.stat().st_size
    assert "CPU" in key["machine"]
    assert cache_file(key) != cache_file({**key, "threads": 2})


@pytest.mark.parametrize("flags, expected", [
    ("fpu sse2 avx avx2 avx512f avx512bw", "AMD EPYC (AVX-512)"),
    ("fpu sse2 avx avx2", "AMD EPYC (AVX2)"),
    ("fpu avx2 avx512f amx_tile amx_bf16", "AMD EPYC (AVX-512, AMX)"),
    ("fpu sse2", "AMD EPYC"),
])  # fmt: skip
def test_cpu_model_names_the_widest_vector_extension(tmp_path, flags, expected):
    # two VMs that both call themselves "AMD EPYC" ran llama.cpp about twofold apart
    info = tmp_path / "cpuinfo"
    first = f"processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: {flags}\n"
    info.write_text(first + "\nprocessor\t: 1\nmodel name\t: other\nflags\t\t: avx512f amx_tile\n")
    assert cpu_model(info) == expected


def test_cpu_model_without_cpuinfo_falls_back_to_platform(tmp_path):
    assert cpu_model(tmp_path / "missing") == (platform.processor() or platform.machine())


def test_a_draftless_engine_predicts_ar_and_ngram_sd_only(engine, own_cache):
    tuning = tune(Engine(engine.target))
    names = [p.setting.name for p in tuning.predictions]
    assert names == ["ar", "sd-ngram-k4"] and [c.name for c in tuning.picks] == ["auto"]
    assert tuning.config(GenerationConfig(), "auto").method in ("ar", "sd")
    with pytest.raises(ConfigError, match="draft"):
        tuning.pick("smc")


def test_a_constraint_keeps_ngram_sd_out_of_the_choice(engine, own_cache):
    """The n-gram draft takes no constraint, so a constrained config is never tuned to it."""
    cfg = GenerationConfig(constraint=Regex("[ab]+"))
    tuning = tune(Engine(engine.target), cfg)
    assert [p.setting.name for p in tuning.predictions] == ["ar"]
    tuning.config(cfg, "auto").validate()


def test_table_marks_the_choices(engine, own_cache):
    table = format_table(tune(engine, min_particles=4))
    rows = [ln for ln in table.splitlines() if ln.startswith("| ")]
    assert rows[0].startswith("| method | N | K |")
    assert sum("auto" in r for r in rows[1:]) == 1
    assert sum("smc (N >= 4)" in r for r in rows[1:]) == 1
    assert any("below --min-particles" in r for r in rows if r.startswith("| smc | 1 |"))
    assert "alpha" in table and "measured now" in table


# ------------------------------------------------------------------ command line
def _args(gguf_pair, *extra: str) -> list[str]:
    target, draft = (str(p) for p in gguf_pair)
    return ["generate", "ab cd", "--target", target, "--draft", draft, "--threads", "1",
            "-m", "6", "--seed", "1", *extra]  # fmt: skip


def test_generate_method_auto_says_what_it_chose(gguf_pair, capsys):
    assert main(_args(gguf_pair, "--method", "auto", "--json")) == 0
    out = json.loads(capsys.readouterr().out)
    tuned = out["tuned"]
    assert tuned["chosen_by"] == "auto" and tuned["predicted_tokens_per_second"] > 0
    assert out["method"] == re.match(r"(ar|sd|smc)", tuned["setting"]).group(1)
    if out["method"] == "smc":
        assert tuned["setting"] == f"smc-n{out['particles']}-k{out['draft_tokens']}"
        assert out["particles"] >= 4


def test_generate_smc_without_n_k_is_tuned_with_the_floor(gguf_pair, capsys):
    assert main(_args(gguf_pair, "--min-particles", "8")) == 0
    line = capsys.readouterr().out.rstrip("\n").split("\n")[-1]
    m = re.match(r"\[smc\] .*N=(\d+) K=(\d+), .*; smc-n\1-k\2(-ess)? chosen by smc without", line)
    assert m and int(m.group(1)) >= 8, line
    assert re.search(r"predicted [\d.]+ tokens/s, predicted ESS [\d.]+ of \d+ after a round", line)


def test_generate_keeps_an_explicit_n_or_k(gguf_pair, capsys):
    assert main(_args(gguf_pair, "-N", "2", "--json")) == 0  # below the floor: as given
    out = json.loads(capsys.readouterr().out)
    assert out["particles"] == 2 and out["tuned"]["setting"].startswith("smc-n2-")
    assert main(_args(gguf_pair, "-N", "3", "-K", "2", "--json")) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["particles"], out["draft_tokens"]) == (3, 2) and "tuned" not in out


@pytest.mark.slow
def test_serve_chooses_once_at_startup(gguf_pair, tmp_path):
    """A real ``smcspec serve --method auto`` process: the setting is chosen (and the costs
    measured) once, before it serves; every request without a method of its own then runs
    that setting, and nothing is measured again."""
    import os
    import subprocess
    import sys
    import time

    import httpx
    from live_server import free_port

    target, draft = (str(p) for p in gguf_pair)
    port = free_port()
    argv = ["serve", "--target", target, "--draft", draft, "--threads", "1", "--method", "auto",
            "--port", str(port), "-m", "6"]  # fmt: skip
    code = "import sys; from smcspec.cli import main; sys.exit(main(sys.argv[1:]))"
    env = {**os.environ, "SMCSPEC_CACHE": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-c", code, *argv], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
            assert proc.poll() is None
        methods = []
        for i in range(3):
            body = {"prompt": "ab cd", "seed": i}
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            methods.append(r.json()["choices"][0]["smcspec"]["method"])
    finally:
        proc.terminate()
        err = proc.communicate(timeout=30)[1].decode()
    chosen = re.findall(r"smcspec: default setting (\S+) chosen by --method auto", err)
    assert len(chosen) == 1, err
    assert err.count("measuring this machine's forward costs") == 1
    assert methods == [chosen[0].split("-")[0]] * 3


@pytest.mark.parametrize("value", ["0", "100000"])
def test_bad_min_particles_is_a_one_line_error(gguf_pair, capsys, value):
    assert main(_args(gguf_pair, "--min-particles", value)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: min_particles must be in [1, ") and err.count("\n") == 1


def test_bench_predict_prints_the_table_and_runs_nothing(gguf_pair, tmp_path, capsys):
    target, draft = (str(p) for p in gguf_pair)
    out = tmp_path / "bench"
    code = main(["bench", "--predict", "--target", target, "--draft", draft, "--threads", "1",
                 "--out", str(out)])  # fmt: skip
    assert code == 0 and not out.exists()
    text = capsys.readouterr().out
    assert "Predicted tokens/s from measured forward costs" in text
    row = r"^\| ar \| - \| - \| 1\.00 \| [\d.]+ \| ([\d.]+) \| ([\d.]+)-([\d.]+) \| 1\.00x \|"
    m = re.search(row, text, re.M)
    assert m and float(m[2]) <= float(m[1]) <= float(m[3])  # the range holds the prediction
    assert "Range: the prediction with every forward at the slowest / fastest" in text
    assert re.search(r"^\| smc( \(ess\))? \| \d+ \| \d+ \|.*smc \(N >= 4\)", text, re.M)
    assert main(["bench", "--predict", "--remeasure", "--target", target, "--draft", draft,
                 "--threads", "1"]) == 0  # fmt: skip
    captured = capsys.readouterr()
    assert "measured now" in captured.out and "smcspec: measuring" in captured.err


def test_bench_runs_auto_as_the_chosen_setting(gguf_pair, tmp_path, capsys, monkeypatch):
    from smcspec.eval import throughput

    target, draft = (str(p) for p in gguf_pair)
    monkeypatch.setattr(throughput, "roofline_rows", lambda *a: [])  # not what this test checks
    monkeypatch.setattr(
        "smcspec.eval.sharegpt.load_sharegpt_prompts", lambda *a, **k: ["ab cd", "ef gh"]
    )
    out = tmp_path / "bench"
    code = main(["bench", "--methods", "ar,auto,smc", "--target", target, "--draft", draft,
                 "--threads", "1", "-m", "4", "--out", str(out)])  # fmt: skip
    assert code == 0
    methods = {json.loads(ln)["method"] for ln in (out / "runs.jsonl").read_text().splitlines()}
    auto = next(m for m in methods if m.startswith("auto-"))
    smc = next(m for m in methods if m.startswith("smc-"))
    assert methods == {"ar", auto, smc} and int(re.match(r"smc-n(\d+)", smc).group(1)) >= 4
    assert "Settings chosen from measured costs" in capsys.readouterr().out


# ------------------------------------------------------------------ --quantize-draft
def test_quantize_draft_is_made_once_and_used(gguf_pair, test_cache_dir, capsys):
    argv = _args(gguf_pair, "--quantize-draft", "Q8_0", "--method", "sd", "-K", "2", "--json")
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "re-quantizing the draft tiny-qwen2-s1.gguf to Q8_0 once" in captured.err
    made = list((test_cache_dir / "quantized").glob("tiny-qwen2-s1-*-Q8_0.gguf"))
    assert len(made) == 1 and made[0].stat().st_size < gguf_pair[1].stat().st_size  # F32 -> Q8_0
    assert json.loads(captured.out)["method"] == "sd"
    assert main(argv) == 0
    assert "re-quantizing" not in capsys.readouterr().err  # cached
    engine = Engine.load(*gguf_pair, quantize_draft="Q8_0", threads=1)
    assert engine.draft.path == made[0]
    assert cost_key(engine, 100)["draft"]["path"] == str(made[0])  # the cost key follows it


def test_quantize_draft_errors(gguf_pair, tmp_path, capsys):
    hf = str(make_tiny_hf_model(tmp_path, "qwen2", seed=1))
    capsys.readouterr()
    for extra, message in (
        (["--draft", hf], "needs a GGUF draft file"),
        (["--backend", "torch"], "the torch backend dequantizes GGUF weights"),
    ):
        argv = _args(gguf_pair, "--quantize-draft", "Q4_0", "--method", "sd", *extra)
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: --quantize-draft") and message in err, err
    with pytest.raises(SystemExit) as exc:
        main(_args(gguf_pair, "--quantize-draft", "Q5_9"))
    assert exc.value.code == 2 and "invalid choice" in capsys.readouterr().err


# ------------------------------------------------------------------ distinct rows
SURE = [[1.0] + [0.0] * 7] * 10  # every particle draws the same token everywhere
NEVER = [[0.0] * 8] * 10  # all mass outside the top tokens: no two particles agree
MIXED = [[0.9, 0.05, 0.02] + [0.0] * 5, [0.5, 0.3, 0.1] + [0.0] * 5, [0.98] + [0.0] * 7]


def test_predicted_distinct_rows_from_the_agreement_profiles():
    from smcspec.tuning.predict import predicted_distinct

    assert predicted_distinct(16, 4, SURE, SURE, SPREAD) == pytest.approx(1 / 16)
    assert predicted_distinct(8, 4, NEVER, NEVER, [0.0] * 101) == pytest.approx(1.0)
    assert predicted_distinct(1, 4, MIXED, MIXED, SPREAD) == 1.0
    f = {(n, k): predicted_distinct(n, k, MIXED, MIXED, SPREAD) for n in (4, 16) for k in (4, 8)}
    assert all(0 < v < 1 for v in f.values())
    assert f[(16, 4)] < f[(4, 4)]  # more particles, more of them repeat another
    # resampling makes copies that share rows again: without it, fewer rows are shared
    assert predicted_distinct(8, 4, MIXED, MIXED, None) > predicted_distinct(
        8, 4, MIXED, MIXED, SPREAD
    )
    assert predicted_distinct(8, 4, MIXED, MIXED, SPREAD) == predicted_distinct(
        8, 4, MIXED, MIXED, SPREAD
    )  # seeded


def test_smc_is_priced_at_its_distinct_rows():
    """Costs proportional to rows (a CPU): a round of distinct fraction f costs about f of
    the every-row round; sharing off (or no profiles) prices every row."""
    from smcspec.tuning.predict import seconds_for_rows

    base = hand_costs(0.02, c=0.2, per_row=1.0)
    assert seconds_for_rows(base.target, 10) == pytest.approx(0.02 * 10)
    assert seconds_for_rows(base.target, 7.5) == pytest.approx(0.02 * 7.5)  # interpolated
    costs = ForwardCosts(base.target, base.draft, base.alpha, SPREAD, MIXED, MIXED)
    smc = Setting("smc", 16, 4)
    shared, every = predict(smc, costs), predict(smc, costs, shared_rows=False)
    assert every.distinct == 1.0 and every.round_seconds == every.all_rows_seconds
    assert predict(smc, base).distinct == 1.0  # nothing to predict from
    assert 0 < shared.distinct < 1 and shared.all_rows_seconds == every.round_seconds
    assert shared.round_seconds == pytest.approx(shared.distinct * every.round_seconds, rel=0.05)
    assert shared.all_rows_tokens_per_second == pytest.approx(every.tokens_per_second)


def test_the_tuner_never_imports_the_engine():
    """engine -> tuning only (Engine.tune calls it); the tuner names a protocol instead."""
    import ast
    from pathlib import Path

    import smcspec.tuning

    for path in Path(smcspec.tuning.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            assert not any(n == "smcspec.engine" or n == "smcspec.Engine" for n in names), path


def test_alpha_interval_holds_alpha_and_narrows_with_more_rounds():
    from smcspec.tuning.predict import alpha_from_counts, alpha_interval

    a = alpha_from_counts(171, 306, 81)  # the default pair's pooled measurement
    low, high = alpha_interval(a, 171, 306, 81)
    assert low < a < high and high - low < 0.15
    low10, high10 = alpha_interval(a, 1710, 3060, 810)
    assert low < low10 < a < high10 < high
    assert alpha_interval(1.0, 40, 40, 10)[1] == pytest.approx(1.0)
    with pytest.raises(ConfigError):
        alpha_interval(0.5, 5, 4, 1)


def test_prediction_range_brackets_the_prediction():
    from smcspec.tuning.predict import ForwardCosts, Setting, predict, prediction_range

    target = {(1, 1): 0.06, (1, 5): 0.14}
    draft = {(1, 1): 0.03, (1, 2): 0.035}
    costs = ForwardCosts(target, draft, alpha=0.8)
    sd = Setting("sd", 1, 4)
    assert prediction_range(sd, costs) is None  # nothing known about the noise
    ranged = ForwardCosts(
        target, draft, alpha=0.8,
        target_range={s: (v * 0.9, v * 1.2) for s, v in target.items()},
        draft_range={s: (v * 0.9, v * 1.2) for s, v in draft.items()},
        alpha_range=(0.75, 0.85),
    )  # fmt: skip
    low, high = prediction_range(sd, ranged)
    mid = predict(sd, ranged).tokens_per_second
    assert low < mid < high
    ar_low, ar_high = prediction_range(Setting("ar", 1, 1), ranged)
    assert ar_low == pytest.approx(1 / 0.072) and ar_high == pytest.approx(1 / 0.054)


def test_cost_ranges_survive_the_cache(tmp_path):
    from smcspec.tuning.cache import CostRecord, read_costs, write_costs

    record = CostRecord()
    record.add_timings("target", {(1, 1): [0.05, 0.07, 0.06]})
    record.add_timings("draft", {(1, 1): [0.02, 0.03, 0.025]})
    assert record.target == {(1, 1): 0.06} and record.target_range == {(1, 1): (0.05, 0.07)}
    path, key = tmp_path / "c.json", {"k": 1}
    write_costs(path, key, record)
    again = read_costs(path, key)
    assert again.target_range == record.target_range and again.draft_range == record.draft_range
