"""Rounds as one function of device tensors (each decoder's fused.py) against step-by-step rounds.

On the CPU the fused rounds run uncaptured (``rounds="eager"``) on static caches under the
host-read guard, which raises at any host read inside a round; captured, the same functions
are CUDA graphs (tests/test_gpu.py checks replay against eager on a GPU). A fused round draws
the same uniforms as the step-by-step one, so for a seed both must give the same tokens, the
same resampling and weights equal to float rounding (the static forward attends over padded
windows with masks, a different summation order). The statistical checks at the end run the
fused path against the exact target.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace

import pytest
import torch
from enumerable import (
    chisquare_p,
    one_particle_log_probs,
    sequence_log_probs,
    tiny_transformer,
    total_variation,
)
from tiny_models import make_tiny_hf_model

from smcspec import Engine, GenerationConfig
from smcspec.backends.torch import load_hf_dir
from smcspec.backends.torch.graphs import HostReadError, HostReadGuard, RoundGraphs, run_round
from smcspec.backends.torch.static_cache import StaticKVCache
from smcspec.decoding import decode_ar, decode_sd, decode_smc
from smcspec.decoding.fused import fused_rounds, plain
from smcspec.errors import NumericalError

PROMPT = [1, 2, 0]


@pytest.fixture(scope="module")
def pair():
    return tiny_transformer(seed=1, vocab=8), tiny_transformer(seed=2, vocab=8)


def _run(decode, models, mode: str, cfg: GenerationConfig, stop=frozenset(), seed: int = 5):
    for m in models:
        m.rounds = mode
    g = torch.Generator().manual_seed(seed)
    try:
        return decode(*models, PROMPT, cfg, stop, models[0].cfg.vocab_size, g)
    finally:
        for m in models:
            m.rounds = "auto"


def _same(a, b) -> None:
    """Two decoder outputs or two engine results: the same tokens, particles and stats."""
    assert getattr(a, "tokens", None) == getattr(b, "tokens", None)
    assert getattr(a, "token_ids", None) == getattr(b, "token_ids", None)
    sa, sb = (x.stats if isinstance(x.stats, dict) else x.stats.to_dict() for x in (a, b))
    for key, value in sa.items():
        other = sb[key]
        if key.startswith("distinct_rows"):  # a static cache computes every row
            continue
        if isinstance(value, float):
            assert other == pytest.approx(value, rel=1e-5, abs=1e-6), key
        else:
            assert other == value, key
    if a.particles is not None:
        tokens = [_get(p, "tokens") for p in a.particles]
        assert tokens == [_get(p, "tokens") for p in b.particles]
        wa = torch.tensor([_get(p, "weight") for p in a.particles])
        wb = torch.tensor([_get(p, "weight") for p in b.particles])
        torch.testing.assert_close(wb, wa, rtol=1e-5, atol=1e-7)


def _get(particle, name: str):
    return particle[name] if isinstance(particle, dict) else getattr(particle, name)


SMC = GenerationConfig(
    method="smc", max_new_tokens=30, particles=8, draft_tokens=3, temperature=0.8,
    draft_temperature=1.2, ess_threshold=0.9, return_particles=True,
)  # fmt: skip
SMC_VARIANTS = {
    "plain": {},
    "alpha": {"alpha": 1.5},
    "keep-rule": {"finished_particles": "keep"},
    "groups": {"groups": 2},
    "top-k-min-p": {"top_k": 2, "min_p": 0.05},
    "stratified-k1": {"resampler": "stratified", "draft_tokens": 1, "particles": 4},
}


@pytest.mark.parametrize("variant", SMC_VARIANTS)
def test_fused_smc_rounds_draw_what_the_steps_draw(pair, variant):
    cfg = replace(SMC, **SMC_VARIANTS[variant])
    stop = frozenset({7})  # particles end at different rounds: banking and the keep rule run
    rounds = []
    for seed in (5, 6, 7):
        steps = _run(decode_smc, pair, "steps", cfg, stop, seed)
        _same(steps, _run(decode_smc, pair, "eager", cfg, stop, seed))
        rounds.append(steps.stats.rounds)
    assert max(rounds) >= 3


def test_the_smc_runs_compared_resample_and_bank(pair):
    out = _run(decode_smc, pair, "eager", SMC, frozenset({7}))
    assert out.stats.resamples >= 1 and out.stats.banked >= 1


def _host_reads(pair, cfg: GenerationConfig) -> tuple[Counter, int]:
    """(host reads by operation, rounds) of one SMC-SD request with fused rounds: every read
    is between rounds (inside one, the rounds' own guard would raise)."""
    with HostReadGuard(strict=False) as guard:
        out = _run(decode_smc, pair, "eager", cfg)
    return Counter(guard.reads), out.stats.rounds


def test_smc_host_reads_a_few_values_a_round(pair):
    """On a GPU each host read between rounds waits for the device and copies back. In the
    middle of a request (the difference of a 4- and an 8-round request of one seed: the first
    and last rounds' work cancels) a round's host work reads exactly 6 times, here with a
    resampling every round: the round's ``ok`` flag, the loop's end test, the ESS, the groups'
    flags, the streamed prefix with its tokens, the resampling's log mean weight (3
    ``tolist``, 2 ``__bool__``, 1 ``__float__``). The whole 4-round request reads 81 times
    (57 outside its rounds' host work, among them 2 boolean indexings and 1 write through a
    boolean mask), the 8-round one 105; deterministic for a seed, so the counts are exact.
    (Measured 17.5 a round before the weights' normalisation, the groups' flags, the streamed
    prefix and the caches' reorders were made to read less.)

    Broken variants it catches (run by hand; the old bound, ``<= 6`` a round, passed both):
    the guard not counting ``tolist`` (3 a round); the guard not counting writes through a
    boolean mask (80 reads)."""
    cfg = replace(SMC, ignore_eos=True, draft_tokens=3, ess_threshold=1.0)
    short, r1 = _host_reads(pair, replace(cfg, max_new_tokens=1 + 4 * 4))
    long, r2 = _host_reads(pair, replace(cfg, max_new_tokens=1 + 8 * 4))
    assert (r1, r2) == (4, 8)
    assert long - short == Counter({"tolist": 4 * 3, "__bool__": 4 * 2, "__float__": 4 * 1})
    assert (short.total(), long.total()) == (81, 105)
    assert (short["__getitem__"], short["__setitem__"]) == (2, 1)


@pytest.mark.parametrize("decode", [decode_sd, decode_smc], ids=["sd", "smc"])
def test_nan_inside_a_fused_round_raises_after_it(pair, decode):
    """A draft whose logits are NaN fails inside the round (its draws): the round's ``ok``
    flag, read with its outputs, raises what the step path raises."""
    draft = tiny_transformer(seed=2, vocab=8)
    with torch.no_grad():
        draft.lm_head.weight.fill_(float("nan"))
    cfg = replace(SMC, method="smc") if decode is decode_smc else GenerationConfig(
        method="sd", max_new_tokens=20, draft_tokens=3, ignore_eos=True
    )  # fmt: skip
    for mode in ("steps", "eager"):
        with pytest.raises(NumericalError):
            _run(decode, (pair[0], draft), mode, cfg)


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_fused_sd_rounds_draw_what_the_steps_draw(pair, temperature):
    cfg = GenerationConfig(
        method="sd", max_new_tokens=40, draft_tokens=3, temperature=temperature,
        draft_temperature=1.0, ignore_eos=True,
    )  # fmt: skip
    steps = _run(decode_sd, pair, "steps", cfg)
    fused = _run(decode_sd, pair, "eager", cfg)
    _same(steps, fused)
    assert 0 < steps.stats.accepted < steps.stats.drafted  # both branches ran


@pytest.mark.parametrize("temperature", [0.7, 0.0])
def test_fused_ar_steps_draw_what_the_steps_draw(pair, temperature):
    cfg = GenerationConfig(method="ar", max_new_tokens=40, temperature=temperature, top_k=3)
    target = pair[:1]
    _same(_run(decode_ar, target, "steps", cfg), _run(decode_ar, target, "eager", cfg))


def test_pipelined_ar_rounds_stop_where_the_steps_stop(pair, monkeypatch):
    """The fused ar rounds launch round t+1 before reading round t's token: at a stop token
    one round more than the answer needs has run (its token dropped), and the answer is the
    step path's, token for token."""
    cfg = GenerationConfig(method="ar", max_new_tokens=60, temperature=1.0)
    target = pair[:1]
    steps = _run(decode_ar, target, "steps", cfg, stop=frozenset({3}))
    assert steps.tokens[-1] == 3 and len(steps.tokens) < 60  # it stopped early
    rounds = []
    real = type(target[0]).run_round

    def count(model, *args, **kwargs):
        rounds.append(1)
        return real(model, *args, **kwargs)

    monkeypatch.setattr(type(target[0]), "run_round", count)
    fused = _run(decode_ar, target, "eager", cfg, stop=frozenset({3}))
    _same(steps, fused)
    # the prefill (a round too on a static cache), a round per token after the prefill's
    # first one, and the round launched before the stop token was read
    assert len(rounds) == 1 + (len(fused.tokens) - 1) + 1


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_fused_rounds_on_a_real_architecture(tmp_path, family):
    """GQA, biases, tied or untied embeddings, a prompt that is not a power of two: the
    static forward's masks and windows against the eager forward's exact slices."""
    d = [make_tiny_hf_model(tmp_path / str(s), family, seed=s) for s in (0, 1)]
    engine = Engine(load_hf_dir(d[0]), load_hf_dir(d[1]))
    models = (engine.target.model, engine.draft.model)
    prompt = list(range(3, 40))  # 37 tokens: the prompt window (64) is padded
    for method in ("ar", "sd", "smc"):
        cfg = GenerationConfig(
            method=method, max_new_tokens=70, particles=4, draft_tokens=4, seed=3,
            ignore_eos=True, return_particles=method == "smc",
        )  # fmt: skip
        results = {}
        for mode in ("steps", "eager"):
            for m in models:
                m.rounds = mode
            results[mode] = engine.generate(prompt, cfg)
        _same(results["steps"], results["eager"])
        assert len(results["steps"].token_ids) == 70


def test_a_second_request_reuses_the_static_cache():
    target, draft = tiny_transformer(seed=1), tiny_transformer(seed=2)
    target.rounds = draft.rounds = "eager"
    try:
        decode_smc(target, draft, PROMPT, SMC, frozenset(), 4, torch.Generator().manual_seed(0))
        slots = list(target.static_slots.slots)
        assert len(slots) == 1 and not slots[0].in_use
        decode_smc(target, draft, PROMPT, SMC, frozenset(), 4, torch.Generator().manual_seed(1))
        assert target.static_slots.slots == slots  # the same cache, given back again
    finally:
        target.rounds = draft.rounds = "auto"


def test_without_a_free_static_cache_a_request_runs_step_by_step():
    target, draft = tiny_transformer(seed=1, vocab=8), tiny_transformer(seed=2, vocab=8)
    pair = (target, draft)
    target.rounds = draft.rounds = "eager"
    try:
        slots = target.static_slots.max_slots
        held = [target.new_cache(8, 40, static=True, prompt_len=3) for _ in range(slots)]
        assert all(isinstance(c, StaticKVCache) for c in held)
        assert len({c.bank for c in held}) == 1  # one bank, grown to hold them all
        cache = target.new_cache(8, 40, static=True, prompt_len=3)  # the slots are full
        assert not isinstance(cache, StaticKVCache)
        steps = _run(decode_smc, pair, "steps", SMC, frozenset({0}))
        g = torch.Generator().manual_seed(5)
        target.rounds = draft.rounds = "eager"
        out = decode_smc(target, draft, PROMPT, SMC, frozenset({0}), 8, g)
        assert out.tokens == steps.tokens
        for c in held:
            c.close()
    finally:
        target.rounds = draft.rounds = "auto"


def test_the_host_read_guard_catches_a_round_that_reads_a_value():
    x = {"a": torch.tensor([1.0, 2.0])}
    ok = run_round("eager", {}, ("k",), lambda t: {"b": t["a"] * 2}, x, object())
    assert torch.equal(ok["b"], torch.tensor([2.0, 4.0]))
    for read in (
        lambda t: {"b": t["a"] * float(t["a"].sum())},
        lambda t: {"b": t["a"] if bool(t["a"].any()) else t["a"]},
        lambda t: {"b": torch.tensor(t["a"].tolist())},
        lambda t: {"b": t["a"][t["a"] > 1]},  # a boolean index: a nonzero in disguise
        lambda t: {"b": t["a"].nonzero()},
    ):
        with pytest.raises(HostReadError):
            run_round("eager", {}, ("k",), read, x, object())


def test_an_uncaptured_round_is_guarded_once_a_key():
    """Mode ``eager`` with a static cache's :class:`RoundGraphs`: a key's first run is
    guarded (as a capture), its later runs not (as replays: a key fixes the operations); a
    run that raised leaves its key unchecked, and ``clear()`` (a cache's graphs dropped)
    guards every key again. A plain dict guards every run."""
    x = {"a": torch.tensor([1.0, 2.0])}
    ok = lambda t: {"b": t["a"] * 2}  # noqa: E731
    read = lambda t: {"b": t["a"] * float(t["a"].sum())}  # noqa: E731
    graphs = RoundGraphs()
    run_round("eager", graphs, ("k",), ok, x, object())
    assert graphs.checked == {("k",)} and not graphs  # nothing captured
    assert torch.equal(run_round("eager", graphs, ("k",), read, x, object())["b"], x["a"] * 3)
    with pytest.raises(HostReadError):
        run_round("eager", graphs, ("k2",), read, x, object())
    assert ("k2",) not in graphs.checked
    graphs.clear()
    with pytest.raises(HostReadError):
        run_round("eager", graphs, ("k",), read, x, object())
    plain: dict = {}
    run_round("eager", plain, ("k",), ok, x, object())
    with pytest.raises(HostReadError):
        run_round("eager", plain, ("k",), read, x, object())


def test_the_host_read_guard_catches_writes_through_a_boolean_mask():
    """``x[mask] = v`` is an ``index_put`` with a boolean index, which counts the mask's
    True entries on the host (a ``nonzero`` in disguise, as a read through a mask is): the
    guard raises at it, and with ``strict=False`` counts it and lets it run. An integer
    index and ``masked_fill_`` read nothing back and are not counted.

    Broken variant it catches: the guard checking boolean indices in ``__getitem__`` only
    (reads through a mask caught, writes not: no raise, 1 read counted instead of 3)."""
    x = {"a": torch.tensor([1.0, 2.0, 3.0])}

    def write(t):
        y = t["a"].clone()
        y[t["a"] > 1] = 0.0
        return {"b": y}

    with pytest.raises(HostReadError):
        run_round("eager", {}, ("k",), write, x, object())
    y = torch.zeros(2, 3)
    mask = torch.tensor([True, False, True])
    with HostReadGuard(strict=False) as guard:
        y[0, mask] = 1.0  # a tuple index holding a mask
        y[1][mask] = 2.0
        y[:, torch.tensor([1])] = 3.0  # an integer index: no read
        y.masked_fill_(torch.tensor([[False, False, False], [True, False, False]]), 4.0)
        picked = y[0][mask]
    assert guard.reads == ["__setitem__", "__setitem__", "__getitem__"]
    assert torch.equal(y, torch.tensor([[1.0, 3.0, 1.0], [4.0, 3.0, 2.0]]))
    assert torch.equal(picked, torch.tensor([1.0, 1.0]))


def test_the_host_read_guard_catches_data_dependent_aten_operations():
    """Whatever Python spelling reaches them, the aten operations whose output shape or
    work depends on device values are host reads: ``index_put_`` / ``index_put`` with a
    mask (what ``x[mask] = v`` becomes), ``torch.where(mask)`` (a ``nonzero``),
    ``torch.equal`` (a value handed to Python), a ``repeat_interleave`` by a tensor without
    ``output_size`` and ``unique`` raise inside a round and are counted once each by name
    outside; an integer ``index_put_``, ``nonzero_static``, ``repeat_interleave`` with
    ``output_size``, ``masked_fill`` and ``index_select`` are not reads. Each read is
    counted once: ``x[mask]`` is ``__getitem__`` alone, not also the ``index`` inside it.

    Broken variant it catches: the guard of cb48c1a, a list of Python method names
    (``index_put_``, ``index_put``, ``where`` and ``equal`` not caught: 4 rounds run
    without a raise, 4 reads missing from the count)."""
    mask = torch.tensor([True, False, True])
    x = {"a": torch.tensor([1.0, 2.0, 3.0]), "m": mask}
    reads = {
        "index_put_": lambda t: {"b": t["a"].clone().index_put_((t["m"],), t["a"][:1])},
        "index_put": lambda t: {"b": t["a"].index_put((t["m"],), t["a"][:1], accumulate=True)},
        "nonzero": lambda t: {"b": torch.where(t["m"])[0]},
        "equal": lambda t: {"b": t["a"] * torch.equal(t["a"], t["a"])},
        "repeat_interleave": lambda t: {"b": t["a"].repeat_interleave(t["m"].long())},
        "_unique2": lambda t: {"b": torch.unique(t["a"])},
    }
    for name, read in reads.items():
        with pytest.raises(HostReadError, match=name):
            run_round("eager", {}, ("k",), read, x, object())
    fine = [
        lambda t: {"b": t["a"].clone().index_put_((torch.tensor([0, 2]),), t["a"][:1])},
        lambda t: {"b": torch.nonzero_static(t["m"], size=3)},
        lambda t: {"b": t["a"].repeat_interleave(t["m"].long(), output_size=2)},
        lambda t: {"b": t["a"].masked_fill(t["m"], 0.0)},
        lambda t: {"b": t["a"].index_select(0, torch.tensor([2, 0]))},
    ]
    for ok in fine:
        run_round("eager", {}, ("k",), ok, x, object())
    with HostReadGuard(strict=False) as guard:
        for read in (*reads.values(), *fine, lambda t: {"b": t["a"][t["m"]]}):
            read(x)
    assert guard.reads == [*reads, "__getitem__"]


def test_which_requests_run_fused(pair):
    target, draft = pair
    assert not fused_rounds(target, draft)  # auto on a CPU: step by step
    target.rounds = draft.rounds = "eager"
    try:
        assert fused_rounds(target, draft) and not fused_rounds(target, None)
    finally:
        target.rounds = draft.rounds = "auto"
    assert plain(GenerationConfig(top_k=5, min_p=0.1))
    assert not plain(GenerationConfig(top_p=0.9))


# ------------------------------------------------------------------------ statistics
@pytest.mark.slow
def test_fused_sd_matches_the_target():
    """tests/test_decoders_statistical.py's pair and bounds, on the fused path."""
    target, draft = tiny_transformer(seed=1), tiny_transformer(seed=2)
    length, runs = 3, 3000
    exact = sequence_log_probs(target, PROMPT, length, 1.0)
    # one token more than is counted: tokens 2 and 3 come from a full K=2 round, the fused
    # one (a shorter last round runs step by step)
    cfg = GenerationConfig(
        method="sd", max_new_tokens=length + 1, draft_tokens=2, temperature=1.0,
        draft_temperature=1.0,
    )  # fmt: skip
    target.rounds = draft.rounds = "eager"
    counts: Counter = Counter()
    fused = 0
    try:
        for i in range(runs):
            g = torch.Generator().manual_seed(i)
            out = decode_sd(target, draft, PROMPT, cfg, frozenset(), 4, g)
            counts[tuple(out.tokens[:length])] += 1
        fused = sum(c.rounds_run for c in target.static_slots.slots)
    finally:
        target.rounds = draft.rounds = "auto"
    assert fused == 2 * runs  # each request: its prefill and one full round, fused
    # fixed seeds; chi-square p-value bound 1e-3, TV at sampling-noise level (~0.07 at 3000)
    assert chisquare_p(exact, counts, runs) > 1e-3
    assert total_variation(exact, counts, runs) < 0.1


@pytest.mark.slow
def test_fused_smc_error_falls_with_particles():
    """tests/test_smc_multiround_statistical.py's pair and bounds, on the fused path. N=1 is
    plain drafting, its distribution enumerated as there (exact TV 0.538; 1,500 sampled runs
    of the fused path measured 0.552, their pooled chi-square against the enumeration p
    0.043), so only N=16 is sampled."""
    target = tiny_transformer(seed=1, vocab=3, scale=0.6)
    draft = tiny_transformer(seed=2, vocab=3, scale=0.6)
    length, runs = 5, 1500
    exact = sequence_log_probs(target, PROMPT, length, 1.0)
    one = one_particle_log_probs(target, draft, PROMPT, length, draft_tokens=1)
    tv = {1: 0.5 * sum(abs(math.exp(one[k]) - math.exp(exact[k])) for k in exact)}
    target.rounds = draft.rounds = "eager"
    try:
        cfg = GenerationConfig(
            method="smc", max_new_tokens=length, particles=16, draft_tokens=1,
            temperature=1.0, draft_temperature=1.0, ess_threshold=1.0,
        )  # fmt: skip
        counts: Counter = Counter()
        for i in range(runs):
            g = torch.Generator().manual_seed(i)
            counts[tuple(decode_smc(target, draft, PROMPT, cfg, frozenset(), 3, g).tokens)] += 1
        tv[16] = total_variation(exact, counts, runs)
        assert sum(c.rounds_run for c in target.static_slots.slots) > 0  # rounds ran fused
    finally:
        target.rounds = draft.rounds = "auto"
    # the step path measured 0.547 (N=1, sampled) and 0.096 (N=16) at 2000 runs
    assert tv[1] > 0.4
    assert tv[16] < 0.15


def test_the_tuner_times_the_forwards_fused_rounds_run():
    """Where rounds run fused (CUDA graphs on a GPU), the tuner's forward costs are those
    forwards (static, replayed), not the eager ones: here uncaptured, on a static cache."""
    from smcspec.tuning.measure import forward_timings_by_tokens

    model = tiny_transformer(seed=1)
    model.rounds = "eager"
    try:
        timed = forward_timings_by_tokens(model, 2, [1, 3], reps=2, context=5)
        assert set(timed) == {1, 3} and all(len(v) == 2 and min(v) > 0 for v in timed.values())
        assert [c.rows for c in model.static_slots.slots] == [2]  # a static cache served them
    finally:
        model.rounds = "auto"


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_the_captured_prefill_matches_the_eager_one(tmp_path, family):
    """The prefill a static cache gets in graphs mode (the prompt padded to its window, one
    causal forward, no host read), here uncaptured: the eager prefill's logits and prompt
    KV; the padding's KV lies past the prompt, where every later forward masks it."""
    model = load_hf_dir(make_tiny_hf_model(tmp_path, family, seed=0)).model
    prompt = torch.arange(3, 40)  # 37 tokens: padded to a window of 64
    model.rounds = "eager"
    try:
        static = model.new_cache(2, 8, static=True, prompt_len=37)
        static.begin_prefill(37)
        got = model._prefill_captured(prompt, static)  # run_round: under the host-read guard
        eager = model.new_cache(2, 8)
        want = model.prefill(prompt, eager)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(static.prefix_k, eager.prefix_k, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(static.prefix_v, eager.prefix_v, rtol=1e-5, atol=1e-6)
        assert static.prompt_window == 64 and int(static.prompt_len_t) == 37
    finally:
        model.rounds = "auto"


def test_captured_rounds_are_keyed_by_the_kernel_set(pair, monkeypatch):
    """A graph replays the kernels it captured: rounds run with compiled kernels are kept
    under their own keys, so switching kernel sets never replays the other set's graph."""
    from smcspec.backends.torch import transformer
    from smcspec.backends.torch.kernels import EAGER

    keys = []
    real = transformer.run_round

    def record(mode, graphs, key, *args, **kwargs):
        keys.append(key)
        return real(mode, graphs, key, *args, **kwargs)

    monkeypatch.setattr(transformer, "run_round", record)
    cfg = GenerationConfig(method="ar", max_new_tokens=3, temperature=1.0)
    model = pair[0]
    _run(decode_ar, (model,), "eager", cfg)
    model.use_kernels(replace(EAGER, name="compiled"))  # the written functions, named compiled
    try:
        _run(decode_ar, (model,), "eager", cfg)
    finally:
        model.use_kernels("auto")
    half = len(keys) // 2
    assert keys[half:] == [(*k, "compiled") for k in keys[:half]]


def test_auto_falls_back_to_the_written_kernels_when_compiling_fails(pair, monkeypatch, caplog):
    """``auto`` (flex on CUDA) whose compiled attention fails to compile (a machine without
    Triton or a C++ compiler): the round runs again on the written kernels and the request
    gets what it gets on them; the failure is logged once and ``auto`` stays on the written
    kernels in the process. Fails if the error is raised instead (tried)."""
    from smcspec.backends.torch import kernels, transformer

    def no_compiler(*args, **kwargs):
        raise torch._dynamo.exc.TorchDynamoException("no C++ compiler here")

    failing = replace(kernels.EAGER, name="flex", flex=no_compiler)
    monkeypatch.setattr(kernels, "_auto_failures", [])
    monkeypatch.setattr(
        transformer, "auto_kernels", lambda *a: kernels.EAGER if kernels._auto_failures else failing
    )
    for m in pair:
        m.use_kernels("auto")
    want = _run(decode_smc, pair, "eager", SMC)  # auto resolves to the written kernels here
    kernels._auto_failures.clear()
    with caplog.at_level("WARNING", logger="smcspec.backends.torch.kernels"):
        got = _run(decode_smc, pair, "eager", SMC)
    _same(want, got)
    assert len(kernels._auto_failures) == 1 and "no C++ compiler" in caplog.text
    assert all(m.kernels is kernels.EAGER for m in pair)
