"""The torch backend's ``kv_bytes`` pool against the KV tensors its caches and banks allocate.

A request reserves on admission what its caches can ever hold
(:meth:`Transformer.cache_need`, summed by :func:`~smcspec.backends.pool.pool_needs`); the
scheduler admits requests while their reservations fit the pool's budget, so a reservation
smaller than what is allocated over-commits the device under load. Checked here against the
bytes (``nbytes``) of the tensors a real request's caches hold (each cache recorded as the
decoder opens it, with what its lease held on admission), never against ``cache_need``
itself: for one row and N particle rows, on ordinary caches and on static slots (fused
rounds, ``eager`` on the CPU). Static slots live in banks kept between requests
(``backends/torch/static_cache.py``): every bank's bytes are held on a lease of its own, so
that at any time, growth and its copy included, the bytes of all banks and of the ordinary
caches of running requests are at most what the pool has lent; a bank the pool cannot pay
is not made (an ordinary cache instead), idle banks are freed when a reservation needs their
room, and ``release_static`` gives every bank back.
"""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch
from enumerable import tiny_transformer
from tiny_models import make_tiny_chat_pair

from smcspec import Engine, GenerationConfig
from smcspec.backends.pool import PoolError, ResourcePool, pool_needs
from smcspec.backends.torch import load_hf_dir, transformer
from smcspec.backends.torch.static_cache import SlotBank, StaticKVCache, StaticSlots
from smcspec.backends.torch.transformer import Transformer, default_kv_budget
from smcspec.scheduler import BatchScheduler, Request

KV = "kv_bytes"
PROMPT = [5, 9, 2, 7, 7, 3, 11]  # 7 tokens (not a power of two: no bucket matches it)
CASES = {
    "ar": GenerationConfig(method="ar", max_new_tokens=9, seed=1, ignore_eos=True),
    "sd": GenerationConfig(method="sd", max_new_tokens=9, draft_tokens=3, seed=2, ignore_eos=True),
    "smc-n4": GenerationConfig(
        method="smc", max_new_tokens=9, particles=4, draft_tokens=3, seed=3, ignore_eos=True
    ),
}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    dirs = make_tiny_chat_pair(tmp_path_factory.mktemp("torch-pool"), max_position_embeddings=512)
    return Engine(load_hf_dir(dirs[0]), load_hf_dir(dirs[1]))


def _kv(cache) -> tuple[torch.Tensor, ...]:
    return (cache.suffix_k, cache.suffix_v, cache.prefix_k, cache.prefix_v)


def _record(engine, monkeypatch) -> list[tuple[str, object, object, int]]:
    """(role, cache, lease, bytes the lease held when the cache was opened) of every cache
    opened from now on, in order."""
    opened = []
    new_cache = Transformer.new_cache

    def recording(model, rows, capacity, lease=None, **kw):
        held = lease.amounts[KV] if lease is not None else 0
        cache = new_cache(model, rows, capacity, lease=lease, **kw)
        role = "target" if model is engine.target.model else "draft"
        opened.append((role, cache, lease, held))
        return cache

    monkeypatch.setattr(Transformer, "new_cache", recording)
    return opened


def _opened(engine, cfg: GenerationConfig, monkeypatch) -> list[tuple[str, object, object, int]]:
    """What :func:`_record` records of one request, after it ran."""
    opened = _record(engine, monkeypatch)
    out = engine.generate(PROMPT, cfg)
    assert len(out.token_ids) == cfg.max_new_tokens
    return opened


def _reserved(opened) -> dict[str, int]:
    """Role -> bytes reserved on admission (what the lease held when its first cache
    opened: one cache a model here)."""
    assert all(lease is not None for _, _, lease, _ in opened)  # opened on the reservation
    first: dict[str, int] = {}
    for role, _, _, held in opened:
        first.setdefault(role, held)
    return first


@pytest.mark.parametrize("case", CASES)
def test_the_reservation_is_what_ordinary_caches_allocate(engine, case, monkeypatch):
    """Step-by-step rounds on ordinary caches (suffix ``[layers, rows, kv_heads, capacity,
    head_dim]``, the prompt once): the reservation equals the K and V bytes the request's
    caches allocate on each model, exactly, for 1 row and for 4 particle rows.

    Broken variant it catches (run by hand): ``cache_need`` reserving N rows as one
    (``prompt_len + capacity``): smc-n4 reserves 10,752 bytes on each model for the 32,256
    its caches allocate (ar and sd, one row, still pass)."""
    for m in engine.models().values():
        m.rounds = "steps"
    try:
        opened = _opened(engine, CASES[case], monkeypatch)
    finally:
        for m in engine.models().values():
            m.rounds = "auto"
    allocated: dict[str, int] = {}
    for role, cache, _, _ in opened:
        assert not isinstance(cache, StaticKVCache)
        allocated[role] = allocated.get(role, 0) + sum(t.nbytes for t in _kv(cache))
    assert _reserved(opened) == allocated
    rows = {role: cache.rows for role, cache, _, _ in opened}
    assert rows == ({"target": 4, "draft": 4} if case == "smc-n4" else dict.fromkeys(rows, 1))
    assert all(cache.prefix_k.shape[1] == 1 for _, cache, _, _ in opened)  # one stored prompt


@pytest.mark.parametrize("case", ["ar", "smc-n4"])
def test_the_reservation_is_what_a_static_slot_allocates(engine, case, monkeypatch):
    """Fused rounds on a static slot (its views of a bank: suffix rows x capacity bucketed
    to a power of two, the whole bucketed prompt storage): what the request reserves on
    admission is exactly what its fresh slot allocates (ar: 65,536 bytes on the target for
    a 64-position suffix and a 64-position prompt storage; smc-n4: 163,840 on each model).
    The slot is then its bank's to pay: the bank's lease holds the bank's bytes, the
    request's lease nothing more.

    Broken variant it catches (run by hand): ``cache_need`` counting the request's own
    positions only (the code before this test passed): ar reserves 8,704 bytes for the
    65,536 its slot allocates, smc-n4 32,256 for 163,840."""
    for m in engine.models().values():
        m.release_static()
        m.rounds = "eager"
    try:
        opened = _opened(engine, CASES[case], monkeypatch)
    finally:
        for m in engine.models().values():
            m.rounds = "auto"
    allocated: dict[str, int] = {}
    for role, cache, lease, _ in opened:
        assert isinstance(cache, StaticKVCache)
        slot = (cache.suffix_k, cache.suffix_v, cache.prefix_store_k, cache.prefix_store_v)
        allocated[role] = allocated.get(role, 0) + sum(t.nbytes for t in slot)
        assert cache.bank.lease.amounts[KV] == cache.bank.nbytes == allocated[role]
        assert lease.released
    assert _reserved(opened) == allocated
    assert allocated["target"] == (163_840 if case == "smc-n4" else 65_536)
    assert [c.rows for _, c, _, _ in opened] == ([4, 4] if case == "smc-n4" else [1])


# ----------------------------------------------------------- the pool never lends held bytes
def _lent(pool) -> int:
    return pool.capacity[KV] - pool.free()[KV]


def _check(models, ordinary=(), extra: int = 0) -> None:
    """Every bank's lease holds its bytes; every bank's and running ordinary cache's bytes
    (and ``extra``: tensors being copied) are at most what the models' pool has lent."""
    pool = models[0].pool
    assert all(m.pool is pool for m in models)
    banks = [b for m in models for b in m.static_slots.banks]
    assert all(b.lease.amounts[KV] == b.nbytes for b in banks), "a bank holds more than it paid"
    held = sum(b.nbytes for b in banks) + extra
    held += sum(sum(t.nbytes for t in _kv(c)) for c, lease in ordinary if not lease.released)
    assert held <= _lent(pool), f"{held} bytes held, {_lent(pool)} lent"


@pytest.fixture
def checked_growth(monkeypatch):
    """Check :func:`_check` inside every bank allocation, while a growing bank's old tensors
    still live (returns the models to check: append them)."""
    models: list[Transformer] = []
    real = SlotBank._allocate

    def allocate(bank, slots):
        old = bank.nbytes if hasattr(bank, "suffix_k") else 0  # none in __init__
        real(bank, slots)
        for m in models:
            if bank in m.static_slots.banks:
                others = [b for b in m.static_slots.banks if b is not bank]
                held = sum(b.nbytes for b in others) + old + bank.nbytes
                assert held <= _lent(m.pool), f"growing: {held} bytes held, {_lent(m.pool)} lent"

    monkeypatch.setattr(SlotBank, "_allocate", allocate)
    return models


def _tiny_model(budget: int) -> Transformer:
    model = tiny_transformer(seed=1, vocab=8)
    model.kv_budget_bytes = budget
    model.rounds = "eager"
    return model


def test_banks_are_paid_from_the_pool_and_given_back(checked_growth):
    """One model, a pool of 3 one-row slots (plus 100 bytes), requests reserved and their
    static caches taken and closed by hand, the invariant checked after every step and
    inside every allocation: A takes a new bank (its reservation pays for it and is left
    holding nothing); B doubles it (2 slots, paid with B's share and 2 slots' worth more
    while the old slot is copied: all 3 lent at the peak); C cannot double it (4 slots) and
    gets a bank of its own; D does not fit and waits; with A closed it still does not (no
    bank is idle); with C closed and released, D's reservation frees C's idle bank and D
    takes A's slot. ``release_static`` gives back the idle bank now and the one in use when
    its last cache closes: the pool is full again, the tensors gone.

    Broken variants it catches (run by hand): banks not charged to the pool (their leases
    hold nothing: "a bank holds more than it paid"); a growth charged without the copy's
    old tensors (the check inside the allocation fails: 24,576 bytes held, 16,384 lent);
    idle banks never reclaimed (D's reservation never fits)."""
    probe = _tiny_model(1 << 20)
    slot = probe.cache_need(1, 10, 7)[KV]  # one row, 64 suffix and 64 prompt positions
    model = _tiny_model(3 * slot + 100)
    checked_growth.append(model)
    pool = model.pool

    def admit():
        return pool.try_reserve(model.cache_need(1, 10, 7))

    def take(lease):
        cache = model.new_cache(1, 10, lease=lease, static=True, prompt_len=7)
        _check([model])
        return cache

    a = admit()
    ca = take(a)
    assert isinstance(ca, StaticKVCache) and a.amounts[KV] == 0 and _lent(pool) == slot
    b = admit()
    cb = take(b)
    assert cb.bank is ca.bank and ca.bank.slots == 2 and _lent(pool) == 2 * slot
    c = admit()
    cc = take(c)
    assert isinstance(cc, StaticKVCache) and cc.bank is not ca.bank and cc.bank.slots == 1
    assert pool.free()[KV] == 100 and admit() is None  # D waits
    ca.close()
    a.release()
    assert admit() is None  # A's slot is idle, its bank is not
    cc.close()
    c.release()
    _check([model])
    gone = cc.bank
    d = admit()  # fits once the idle bank is freed
    assert d is not None and gone.freed and gone not in model.static_slots.banks
    assert gone.suffix_k is None and cc.suffix_k is None  # nothing left for the collector
    cd = take(d)
    assert cd is ca and d.amounts[KV] == 0
    model.release_static()  # the bank is in use (B, D): kept until both close
    assert ca.bank.retired and not ca.bank.freed and _lent(pool) == 2 * slot
    cb.close()
    b.release()
    cd.close()
    assert ca.bank.freed and _lent(pool) == 0  # D's lease: its share went to the bank
    d.release()
    assert pool.free() == pool.capacity and pool.leases == 0


def test_idle_banks_are_freed_only_when_that_makes_a_reservation_fit():
    """An idle bank (its graphs with it) is kept while a reservation would not fit even
    without it, and freed for one that fits only without it; a lease cannot give back
    more than it holds, nor grow once released.

    Broken variant it catches (run by hand): the pool reclaiming at every reservation that
    does not fit (the idle bank freed for one that then fails anyway)."""
    model = _tiny_model(1 << 20)
    slot = model.cache_need(1, 10, 7)[KV]  # 1 row; 2 rows: 1.5 slots
    model = _tiny_model(4 * slot)
    pool = model.pool
    held = model.new_cache(1, 10, static=True, prompt_len=7)  # in use: 1 slot
    idle = model.new_cache(2, 10, static=True, prompt_len=7)
    idle.close()  # 1.5 slots idle, 1.5 free
    assert pool.try_reserve({KV: 3 * slot + slot // 2}) is None  # short 2 slots: keep it
    assert not idle.bank.freed and len(model.static_slots.banks) == 2
    lease = pool.try_reserve({KV: 2 * slot + slot // 2})  # short 1 slot: free it
    assert lease is not None and idle.bank.freed and model.static_slots.banks == [held.bank]
    with pytest.raises(PoolError, match="cannot give back"):
        pool.shrink(lease, {KV: 3 * slot})
    lease.release()
    with pytest.raises(PoolError, match="released"):
        pool.try_grow(lease, {KV: 1})
    held.close()
    model.release_static()
    assert pool.free() == pool.capacity


def test_a_bank_the_pool_cannot_pay_is_not_made():
    """Without a reservation (the tuner's timings) a static cache's bank is still paid from
    the pool: one that does not fit is not made and the caller gets an ordinary cache.

    Broken variant it catches (run by hand): a bank made whatever the pool holds (a static
    cache of 8,192 bytes from a pool of 8,000)."""
    model = _tiny_model(8_000)
    cache = model.new_cache(1, 10, static=True, prompt_len=7)
    assert not isinstance(cache, StaticKVCache) and model.static_slots.banks == []
    assert model.pool.free() == model.pool.capacity


def _submit_all(sched: BatchScheduler, jobs) -> list:
    """Queue every job before the worker admits any (it waits for the lock), so that the
    admission order, and what follows, is the same every run. Returns their outcomes."""
    outcomes: list = [None] * len(jobs)
    done = threading.Semaphore(0)
    with sched._cv:
        for i, job in enumerate(jobs):

            def on_done(out, i=i):
                outcomes[i] = out
                done.release()

            sched.submit(Request(job=job, on_done=on_done))
    for _ in jobs:
        assert done.acquire(timeout=120), "a request never ended"
    return outcomes


def test_under_load_the_banks_never_hold_more_than_the_pool_lends(
    engine, checked_growth, monkeypatch
):
    """Six ar, sd and SMC-SD requests (prompts of 7 and 70 tokens: 64- and 128-position
    prompt buckets) queued at once on pools of 3 SMC-SD slots a model, 4 running at a time,
    fused (``eager``): the invariant is checked at every round and inside every bank
    allocation. Every request succeeds, with the tokens it draws alone on ordinary
    caches; afterwards no request holds a lease, the pool lends exactly the idle banks'
    bytes, and ``release_static`` makes it full. In this run banks grew to 2 slots and idle
    banks were reclaimed for reservations that fitted only without them.

    Broken variants it catches (run by hand): banks not charged to the pool (the check
    fails at the first round: the requests fail); a growth charged without the copy's old
    tensors (a request fails); idle banks never reclaimed (the queued requests wait
    forever). (``cache_need`` counting the request's own positions passes here: the banks
    pay the rest from the pool, and the first two tests fail.)"""
    models = list(engine.models().values())
    for m in models:
        m.release_static()
    jobs, alone = [], []
    for i, cfg in enumerate([*CASES.values(), *CASES.values()]):
        prompt = PROMPT * 10 if i % 2 else PROMPT
        cfg = replace(cfg, seed=10 + i)
        alone.append(engine.generate(prompt, cfg).token_ids)  # steps on ordinary caches
        jobs.append(engine.prepare(prompt, cfg))
    slot = 163_840  # one SMC-SD slot (4 rows, 64 suffix and 64 prompt positions)
    for m in models:
        m.kv_budget_bytes, m._pool = 3 * slot, None  # fresh pools, before any use
        m.rounds = "eager"
        checked_growth.append(m)
    opened = _record(engine, monkeypatch)
    reclaims, real_reclaim = [], StaticSlots.reclaim
    monkeypatch.setattr(
        StaticSlots, "reclaim", lambda s, short: (reclaims.append(short), real_reclaim(s, short))
    )
    real_round = transformer.run_round

    def checked(*args, **kwargs):
        for role, m in engine.models().items():
            ordinary = [(c, lease) for r, c, lease, _ in opened if r == role]
            _check([m], [(c, lease) for c, lease in ordinary if not isinstance(c, StaticKVCache)])
        return real_round(*args, **kwargs)

    monkeypatch.setattr(transformer, "run_round", checked)
    sched = BatchScheduler(engine, max_running=4, max_waiting=16)
    sched.start()
    try:
        outcomes = _submit_all(sched, jobs)
    finally:
        sched.stop()
        for m in models:
            m.rounds = "auto"
    assert [o.token_ids for o in outcomes] == alone
    grown = max(b.slots for m in models for b in m.static_slots.banks)
    assert all(isinstance(c, StaticKVCache) for _, c, _, _ in opened)
    assert grown >= 2 and reclaims, (grown, len(reclaims))
    for m in models:
        banks = m.static_slots.banks
        assert m.pool.leases == len(banks) and _lent(m.pool) == sum(b.nbytes for b in banks)
        m.release_static()
        assert m.pool.free() == m.pool.capacity and m.pool.leases == 0
        m.kv_budget_bytes, m._pool = None, None


def test_a_pair_on_one_device_shares_one_default_pool(tmp_path):
    """Two torch models of one engine on one device with the default budget reserve from
    one pool of :func:`default_kv_budget` (90% of a GPU's free memory, read once), not two
    pools each lending the same memory; a request that fits each model's share but not
    their sum can never fit. A model given its own budget keeps its own pool.

    Broken variants it catches (run by hand): a default pool per model (two pools: the
    pair could reserve the free memory twice); ``never_fits`` checking each model's needs
    against the shared pool apart (the request reads as fitting and would wait forever)."""
    dirs = make_tiny_chat_pair(tmp_path, max_position_embeddings=512)
    engine = Engine(load_hf_dir(dirs[0]), load_hf_dir(dirs[1]))
    target, draft = engine.target.model, engine.draft.model
    assert target.pool is draft.pool
    assert abs(target.pool.capacity[KV] - default_kv_budget(target.device)) < 1 << 30
    job = engine.prepare(PROMPT, CASES["sd"])
    need = pool_needs(engine.models(), engine.cache_needs(job))
    both = need["target"][KV] + need["draft"][KV]
    small = Engine(load_hf_dir(dirs[0]), load_hf_dir(dirs[1]))
    small.target.model.kv_budget_bytes = small.draft.model.kv_budget_bytes = both - 1
    assert small.target.model.pool is not small.draft.model.pool  # budgets of their own
    assert small.never_fits(job) is None  # each alone fits its own pool
    shared = Engine(load_hf_dir(dirs[0]), load_hf_dir(dirs[1]))
    one = ResourcePool("torch", {KV: both - 1})
    shared.target.model._pool = shared.draft.model._pool = one
    assert "can never fit: the target and draft" in shared.never_fits(job)
