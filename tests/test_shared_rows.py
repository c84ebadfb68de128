"""Distinct rows (``smcspec.backends.shared_rows``): every forward computes each distinct
particle prefix once, and nothing a decoder sees changes.

* The plan against brute force: for random forwards, resamplings and rollbacks, the rows that
  share a computed row are exactly those with the same history and tokens, and the batch
  order meets llama.cpp's checks (each sequence's positions increase; the set of sequences
  sharing its token only shrinks).
* Both backends, shared against unshared caches under the same random edits: the logits
  agree, including batches chunked to ``n_batch``. Not bitwise on torch: a shared forward's
  matrix products see fewer rows, and the CPU BLAS rounds some shapes differently by row
  count (a one-row product takes another kernel: 1e-6 on these shapes, measured 5.4e-7 on
  the logits here); ``ATOL_TORCH`` bounds it. llama.cpp's differ by up to 0.024 on logits
  of magnitude 28 (1e-3 relative: its attention rounds through 16 bits, and a shared
  cache holds fewer cells), within the bound its other tests allow for batch-shape
  arithmetic (``ATOL_LLAMACPP``); a row given another history would differ by whole units.
* The decoders with fixed seeds: SMC-SD's tokens, particles and stats (but the distinct
  fractions) are identical with and without sharing on both backends, and the weights
  equal within float rounding; N = 16 identical particles score one row per position; rows
  of two requests in one batched forward are never merged; under the keep rule the
  particles that ended ride on running ones' rows (same draws, fewer rows computed).
"""

from __future__ import annotations

import random

import pytest
import torch
from enumerable import tiny_transformer
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import make_tiny_gguf

from smcspec.backends.shared_rows import RowHistories
from smcspec.config import GenerationConfig
from smcspec.decoding import decode_smc

ATOL_TORCH = 1e-5  # float32 rounding of products over other row counts; measured 5.4e-7
ATOL_LLAMACPP = 5e-2  # test_backend_llamacpp's F32 bound; measured 0.024 (20 random lives)


# ---------------------------------------------------------------- the plan, by brute force
@st.composite
def scripts(draw):
    """A cache's life: ``rows`` and a list of forwards, resamplings and rollbacks, over a
    two-token alphabet so that rows often coincide."""
    rows = draw(st.integers(1, 6))
    ops, length = [], 0
    for _ in range(draw(st.integers(1, 8))):
        kind = draw(st.sampled_from(["decode", "decode", "reorder", "truncate"]))
        if kind == "decode":
            t = draw(st.integers(1, 4))
            toks = draw(
                st.lists(
                    st.lists(st.integers(0, 1), min_size=t, max_size=t),
                    min_size=rows,
                    max_size=rows,
                )
            )
            ops.append(("decode", toks, draw(st.booleans())))
            length += t
        elif kind == "reorder":
            ops.append(
                ("reorder", draw(st.lists(st.integers(0, rows - 1), min_size=rows, max_size=rows)))
            )
        elif length:
            drop = draw(st.integers(0, length))
            ops.append(("truncate", drop))
            length -= drop
    return rows, ops


def _check_llama_cpp_order(plan) -> None:
    """llama.cpp's batch checks (src/llama-batch.cpp): per sequence, positions increase
    and the set of sequences sharing its token is a subset of the previous one."""
    last_set: dict[int, set[int]] = {}
    last_pos: dict[int, int] = {}
    for j, members in zip(plan.positions, plan.members, strict=True):
        cur = set(members)
        for s in members:
            assert cur <= last_set.get(s, cur)
            assert j > last_pos.get(s, -1)
            last_set[s], last_pos[s] = cur, j


@given(scripts())
@settings(max_examples=200, deadline=None)
def test_plan_groups_exactly_the_rows_with_the_same_prefix(script):
    rows, ops = script
    h = RowHistories(rows)
    history = [[] for _ in range(rows)]  # brute force: every row's generated tokens
    for op in ops:
        if op[0] == "decode":
            _, toks, last_only = op
            t = len(toks[0])
            plan = h.plan(toks, last_only)
            _check_llama_cpp_order(plan)
            full = [[tuple(history[i] + toks[i][: j + 1]) for j in range(t)] for i in range(rows)]
            grid = plan.expand.tolist() if plan.shared else list(range(rows * t))
            assert plan.distinct == len({full[i][j] for i in range(rows) for j in range(t)})
            for i in range(rows):
                for j in range(t):
                    u = grid[i * t + j]
                    assert plan.tokens[u] == toks[i][j] and plan.positions[u] == j
                    assert plan.members[u] == [k for k in range(rows) if full[k][j] == full[i][j]]
            assert plan.outputs == [not last_only or j == t - 1 for j in plan.positions]
            # every returned (row, position) gets its own distinct row's logits
            fake = torch.arange(sum(plan.outputs), dtype=torch.float32)[:, None]
            got = plan.expand_logits(fake, last_only)[..., 0]
            cols = [t - 1] if last_only else range(t)
            want = [[sum(plan.outputs[: grid[i * t + j]]) for j in cols] for i in range(rows)]
            assert got.tolist() == want
            h.commit(plan)
            history = [history[i] + toks[i] for i in range(rows)]
        elif op[0] == "reorder":
            h.reorder(op[1])
            history = [list(history[a]) for a in op[1]]
        else:
            h.truncate(op[1])
            history = [row[: len(row) - op[1]] for row in history]
        by_history: dict[tuple, list[int]] = {}
        for i, row in enumerate(history):
            by_history.setdefault(tuple(row), []).append(i)
        assert h.groups() == list(by_history.values())


def test_plan_without_sharing_computes_every_row():
    h = RowHistories(3, shared=False)
    plan = h.plan([[1, 2], [1, 2], [1, 2]], last_only=False)
    assert plan.distinct == 6 and not plan.shared
    h.commit(plan)
    assert (h.computed, h.fed) == (6, 6)


# ---------------------------------------------------------------- backends, shared vs not
def _torch_model():
    return tiny_transformer(seed=3, vocab=8)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    pytest.importorskip("llama_cpp")
    root = tmp_path_factory.mktemp("shared-rows")
    return make_tiny_gguf(root, "qwen2", 96, seed=5)[0]


def _llamacpp_model(path, **overrides):
    from smcspec.backends.llamacpp import LlamaCppModel, LlamaCppSettings

    settings = {"threads": 1, "kv_cells": 4096, "kv_type": "f32", **overrides}
    return LlamaCppModel(path, LlamaCppSettings(**settings))


def _random_edits(model, rows: int, seed: int, steps: int = 12, shared: bool = True):
    """Logits of a random life of one cache (forwards over a 2-token alphabet, resamplings
    with repeated ancestors, rollbacks), and the cache's row counts."""
    rng = random.Random(seed)
    cache = model.new_cache(rows, 64, shared_rows=shared)
    outs = [model.prefill(torch.tensor([3, 1, 4, 1, 5]), cache).clone()]
    for _ in range(steps):
        kind = rng.choice(["decode", "decode", "reorder", "truncate"])
        if kind == "decode" and cache.length + 4 <= 64:
            t = rng.randint(1, 4)
            toks = torch.tensor([[rng.randint(0, 1) for _ in range(t)] for _ in range(rows)])
            outs.append(model.decode(toks, cache, last_only=rng.random() < 0.5).clone())
        elif kind == "reorder":
            cache.reorder(torch.tensor([rng.randrange(rows) for _ in range(rows)]))
        elif cache.length:
            cache.truncate(rng.randint(0, cache.length))
    counts = (cache.histories.computed, cache.histories.fed)
    cache.close()
    return outs, counts


def _same_logits(model, rows: int, seed: int, atol: float) -> tuple[int, int]:
    shared, (computed, fed) = _random_edits(model, rows, seed)
    every, (computed_all, fed_all) = _random_edits(model, rows, seed, shared=False)
    assert fed == fed_all == computed_all
    for a, b in zip(shared, every, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=atol)
    return computed, fed


def test_torch_shared_rows_give_the_same_logits():
    model = _torch_model()
    saved = 0
    for seed in range(20):
        computed, fed = _same_logits(model, rows=5, seed=seed, atol=ATOL_TORCH)
        saved += fed - computed
    assert saved > 100  # the two-token alphabet makes rows coincide: rows were saved


def test_llamacpp_shared_rows_give_the_same_logits(gguf_file):
    model = _llamacpp_model(gguf_file)
    saved = 0
    for seed in range(20):
        computed, fed = _same_logits(model, rows=5, seed=seed, atol=ATOL_LLAMACPP)
        saved += fed - computed
    assert saved > 100


def test_llamacpp_shared_rows_across_chunks(gguf_file):
    """A forward of 8 x 6 rows with n_batch = 16: the shared tokens are split over chunks."""
    model = _llamacpp_model(gguf_file, n_batch=16, max_sequences=16)
    toks = torch.tensor([[1, 2, 3, 4, 5, 6]] * 4 + [[1, 2, 7, 4, 5, 6]] * 2 + [[8] * 6] * 2)
    got = {}
    for shared in (True, False):
        cache = model.new_cache(8, 16, shared_rows=shared)
        model.prefill(torch.tensor([3, 1, 4]), cache)
        first = model.decode(toks, cache).clone()
        cache.reorder(torch.tensor([6, 0, 4, 4, 1, 7, 0, 2]))
        second = model.decode(toks[:, :3], cache).clone()
        got[shared] = (first, second, cache.histories.computed)
        cache.close()
    for a, b in zip(got[True][:2], got[False][:2], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=ATOL_LLAMACPP)
    # first 6 + 4 + 6; then histories C{0,5} A{1,4,6,7} B{2,3}: C 3 + 1, A 3 + 1 + 3, B 3
    assert got[True][2] == 16 + 14
    assert got[False][2] == 8 * 6 + 8 * 3


@pytest.mark.parametrize("backend", ["torch", "llamacpp"])
def test_rows_of_different_requests_are_never_merged(backend, gguf_file):
    model = _torch_model() if backend == "torch" else _llamacpp_model(gguf_file)
    toks = torch.tensor([[1, 0], [1, 0], [0, 1]])
    caches = [model.new_cache(3, 8) for _ in range(2)]
    for c in caches:
        model.prefill(torch.tensor([2, 3]), c)
    outs = model.decode_batch([(toks, c, False) for c in caches])
    assert [c.histories.computed for c in caches] == [4, 4]  # 4 distinct rows each
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=ATOL_LLAMACPP)
    for c in caches:
        c.close()


# ---------------------------------------------------------------- decoders
def _smc(target, draft, vocab, cfg, seed):
    g = torch.Generator().manual_seed(seed)
    return decode_smc(target, draft, [1, 2, 0], cfg, frozenset(), vocab, g)


def _same_runs(target, draft, vocab, cfg, seeds) -> float:
    """Runs ``cfg`` with and without sharing; returns the mean distinct target fraction."""
    fractions = []
    for seed in seeds:
        a = _smc(target, draft, vocab, cfg, seed)
        b = _smc(
            target, draft, vocab, GenerationConfig(**{**cfg.__dict__, "shared_rows": False}), seed
        )
        assert a.tokens == b.tokens
        assert [p.tokens for p in a.particles] == [p.tokens for p in b.particles]
        wa, wb = [p.weight for p in a.particles], [p.weight for p in b.particles]
        assert wa == pytest.approx(wb, rel=1e-5, abs=1e-7)
        assert a.log_normalizer == pytest.approx(b.log_normalizer, rel=1e-6)
        sa, sb = a.stats.to_dict(), b.stats.to_dict()
        frac = {k: sa.pop(k) for k in ("distinct_rows_target", "distinct_rows_draft")}
        assert sb.pop("distinct_rows_target") == sb.pop("distinct_rows_draft") == 1.0
        assert sa == pytest.approx(sb, rel=1e-5)
        fractions.append(frac["distinct_rows_target"])
    return sum(fractions) / len(fractions)


SMC_CFG = GenerationConfig(
    max_new_tokens=12,
    particles=8,
    draft_tokens=3,
    temperature=1.0,
    draft_temperature=1.0,
    return_particles=True,
    ignore_eos=True,
)


def test_smc_is_unchanged_by_sharing_on_torch():
    target, draft = tiny_transformer(seed=1), tiny_transformer(seed=2)
    frac = _same_runs(target, draft, 4, SMC_CFG, range(8))
    assert frac < 0.8  # 4 tokens, 8 particles: rows coincide often


def _llamacpp_pair(tmp_path, vocab: int, kv_cells: int):
    """A tiny one-layer qwen2 GGUF target (seed 1) and draft (seed 2) on llama.cpp, F32 KV
    (skips the test without llama-cpp-python)."""
    pytest.importorskip("llama_cpp")
    from smcspec.backends.llamacpp import LlamaCppModel, LlamaCppSettings

    settings = LlamaCppSettings(threads=1, kv_cells=kv_cells, kv_type="f32", max_sequences=64)
    return tuple(
        LlamaCppModel(
            make_tiny_gguf(tmp_path, "qwen2", vocab, seed=s, num_hidden_layers=1)[0], settings
        )
        for s in (1, 2)
    )


def test_smc_is_unchanged_by_sharing_on_llamacpp(tmp_path):
    target, draft = _llamacpp_pair(tmp_path, vocab=4, kv_cells=1024)
    frac = _same_runs(target, draft, 4, SMC_CFG, range(8))
    assert frac < 0.8


KEEP_CFG = GenerationConfig(
    max_new_tokens=24,
    particles=8,
    draft_tokens=3,
    temperature=1.0,
    draft_temperature=1.0,
    alpha=2.0,  # not normalised: the keep rule runs, ended particles stay among the N
    return_particles=True,
)


def _keep_runs(target, draft, vocab, stop, monkeypatch, seeds, rel=1e-5) -> tuple[float, float]:
    """Keep-rule SMC-SD with ``stop`` as the stop token, with and without hosts for the
    particles that end (``round_end.host_ended``): identical tokens and particles, weights and
    stats equal within ``rel``; returns the mean distinct target fraction with and without
    hosts."""
    import smcspec.decoding.smc.round_end as round_end

    def run(seed):
        g = torch.Generator().manual_seed(seed)
        return decode_smc(target, draft, [1, 2, 0], KEEP_CFG, frozenset({stop}), vocab, g)

    with_hosts, without = [], []
    for seed in seeds:
        a = run(seed)
        with monkeypatch.context() as m:
            m.setattr(round_end, "host_ended", lambda ps, tcache, dcache: None)
            b = run(seed)
        assert a.tokens == b.tokens
        assert [p.tokens for p in a.particles] == [p.tokens for p in b.particles]
        wa, wb = [p.weight for p in a.particles], [p.weight for p in b.particles]
        assert wa == pytest.approx(wb, rel=rel, abs=1e-7)
        sa, sb = a.stats.to_dict(), b.stats.to_dict()
        fa = {k: sa.pop(k) for k in ("distinct_rows_target", "distinct_rows_draft")}
        fb = {k: sb.pop(k) for k in ("distinct_rows_target", "distinct_rows_draft")}
        assert sa == pytest.approx(sb, rel=rel)
        assert fa["distinct_rows_target"] <= fb["distinct_rows_target"]
        assert fa["distinct_rows_draft"] <= fb["distinct_rows_draft"]
        with_hosts.append(fa["distinct_rows_target"])
        without.append(fb["distinct_rows_target"])
    return sum(with_hosts) / len(seeds), sum(without) / len(seeds)


def test_ended_particles_cost_no_rows_under_the_keep_rule_on_torch(monkeypatch):
    """Under the keep rule (alpha = 2) an ended particle rides on a running one's rows: the
    same draws, fewer rows computed. 16 tokens, stop token 12: particles end at lengths
    from 2 to 24 in one request; measured 0.47 of the target rows fed computed with hosts,
    0.77 without."""
    target, draft = tiny_transformer(seed=1, vocab=16), tiny_transformer(seed=2, vocab=16)
    hosted, plain = _keep_runs(target, draft, 16, 12, monkeypatch, range(8))
    assert hosted < plain - 0.05


def test_ended_particles_cost_no_rows_under_the_keep_rule_on_llamacpp(tmp_path, monkeypatch):
    """The same on llama.cpp (sequence copies instead of gathers): measured 0.16 of the
    target rows computed with hosts, 0.31 without."""
    target, draft = _llamacpp_pair(tmp_path, vocab=16, kv_cells=2048)
    # llama.cpp's logits move by ~1e-3 relative with the batch's rows (module notes): the
    # ESS statistics differ by 1e-4 relative (measured), the draws not at all
    hosted, plain = _keep_runs(target, draft, 16, 7, monkeypatch, range(8), rel=1e-3)
    assert hosted < plain - 0.05


def test_identical_particles_score_one_row_per_position():
    """N = 16 particles at a temperature so low that every draft and bonus is the most
    likely token: all particles stay one sequence, and each forward computes one row per
    position (1/16 of the rows fed)."""
    target, draft = tiny_transformer(seed=1, vocab=8), tiny_transformer(seed=2, vocab=8)
    cfg = GenerationConfig(
        max_new_tokens=20,
        particles=16,
        draft_tokens=4,
        temperature=1e-3,
        draft_temperature=1e-3,
        ignore_eos=True,
        return_particles=True,
    )
    out = _smc(target, draft, 8, cfg, seed=0)
    assert len({tuple(p.tokens) for p in out.particles}) == 1
    assert out.stats.distinct_rows_target == pytest.approx(1 / 16)
    assert out.stats.distinct_rows_draft == pytest.approx(1 / 16)


def test_particles_with_the_same_tokens_have_the_same_matcher_state(monkeypatch):
    """Sharing never looks at matchers (each particle keeps its own mask), but a shared row
    is only right if a particle's state is a function of its tokens: checked after every
    round of constrained SMC-SD (with resampling), for every pair of live particles."""
    import smcspec.decoding.smc.round_end as round_end
    from smcspec.eval.automaton import NextTokenAutomaton
    from smcspec.eval.fidelity import CONSTRAINT_TABLE

    target, draft = tiny_transformer(seed=1), tiny_transformer(seed=2)
    real_resample, pairs = round_end.end_round, []

    def checked(st, ps, ended, running, tcache, dcache):
        real_resample(st, ps, ended, running, tcache, dcache)
        live = [i for i in range(st.config.particles) if not bool(ps.finished[i])]
        for a in live:
            for b in live:
                n = int(ps.lengths[a])
                if (
                    a < b
                    and n == int(ps.lengths[b])
                    and torch.equal(ps.tokens[a, :n], ps.tokens[b, :n])
                ):
                    pairs.append((a, b))
                    assert torch.equal(ps.states[a].allowed(), ps.states[b].allowed())
                    assert ps.states[a].is_accepting() == ps.states[b].is_accepting()

    monkeypatch.setattr(round_end, "end_round", checked)
    cfg = GenerationConfig(
        max_new_tokens=9,
        particles=8,
        draft_tokens=2,
        temperature=1.0,
        draft_temperature=1.0,
        constraint=NextTokenAutomaton(CONSTRAINT_TABLE, 4),
    )
    for seed in range(10):
        _smc(target, draft, 4, cfg, seed)
    assert len(pairs) > 50  # particles coincide often: the check ran
