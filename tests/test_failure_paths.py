"""A request that fails gives back everything it reserved, on both backends, every time.

Each failure is made to happen, not waited for: an exception in a batched forward or in a
prefill, NaN logits (a numerical error), a reward function that raises, and a constraint
whose mask raises. Each runs through the real :class:`~smcspec.scheduler.BatchScheduler`;
afterwards the request has its exception, the worker is alive, both models' pools hold no
lease and every resource is free again, and a fresh request of the same kind succeeds.
(The pools test once caught a failing request that kept its reservation only when a
cancel's timing allowed it; this one does not depend on timing.)
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import replace

import pytest
import torch
from tiny_models import make_tiny_chat_pair, make_tiny_gguf_chat_engine

from smcspec import Engine, GenerationConfig
from smcspec.backends.torch import load_hf_dir
from smcspec.errors import NumericalError
from smcspec.potentials import ConstraintState, Reward, TokenConstraint
from smcspec.scheduler import BatchScheduler, Request


@pytest.fixture(scope="module", params=["torch", "llamacpp"])
def engine(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"failures-{request.param}")
    if request.param == "llamacpp":
        pytest.importorskip("llama_cpp")
        return make_tiny_gguf_chat_engine(root, max_position_embeddings=512)
    dirs = make_tiny_chat_pair(root, max_position_embeddings=512)
    return Engine(load_hf_dir(dirs[0]), load_hf_dir(dirs[1]))


@pytest.fixture
def scheduler(engine):
    sched = BatchScheduler(engine, max_running=4, max_waiting=8)
    sched.start()
    yield sched
    sched.stop()


def _run(scheduler: BatchScheduler, engine: Engine, cfg: GenerationConfig, timeout: float = 60):
    """Submit one request and wait for its outcome (a result or an exception)."""
    done = threading.Event()
    outcome: list = []
    job = engine.prepare("ab cd", cfg)
    scheduler.submit(Request(job=job, on_done=lambda o: (outcome.append(o), done.set())))
    assert done.wait(timeout), "the request never ended"
    return outcome[0]


def _pools_full(engine: Engine) -> None:
    for role in ("target", "draft"):
        pool = getattr(engine, role).model.pool
        assert pool.leases == 0 and not pool.in_use, (role, pool.free())
        assert pool.free() == pool.capacity


class _ExplodingState(ConstraintState):
    """Allows every token; its mask raises on the ``after``-th call (a broken grammar)."""

    def __init__(self, vocab: int, calls: list[int], after: int) -> None:
        self.vocab, self.calls, self.after = vocab, calls, after

    def allowed(self) -> torch.Tensor:
        self.calls[0] += 1
        if self.calls[0] >= self.after:
            raise RuntimeError("the grammar library failed")
        return torch.ones(self.vocab, dtype=torch.bool)

    def consume(self, tokens: Sequence[int]) -> None:
        pass

    def rollback(self, n: int) -> None:
        pass

    def copy(self) -> ConstraintState:
        return self

    def is_accepting(self) -> bool:
        return True


class _Exploding(TokenConstraint):
    def __init__(self, vocab: int, after: int = 3) -> None:
        self.vocab_size, self.after = vocab, after

    def start(self) -> ConstraintState:
        return _ExplodingState(self.vocab_size, [0], self.after)


def _failing_reward(texts: list[str]) -> list[float]:
    raise RuntimeError("the reward function failed")


METHODS = ["ar", "sd", "smc"]


def _cfg(method: str, **kw) -> GenerationConfig:
    base = dict(method=method, max_new_tokens=12, particles=4, draft_tokens=2, seed=1)
    return GenerationConfig(**{**base, **kw})


def _after(scheduler, engine, cfg, outcome, kind) -> None:
    assert isinstance(outcome, kind), outcome
    assert scheduler.alive
    _pools_full(engine)
    again = _run(scheduler, engine, cfg)
    assert not isinstance(again, BaseException), again
    assert len(again.token_ids) >= 1
    _pools_full(engine)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("where", ["decode_batch", "prefill"])
def test_an_exception_in_a_forward(scheduler, engine, monkeypatch, method, where):
    model = engine.target.model

    def broken(*args, **kwargs):
        raise RuntimeError(f"{where} failed")

    monkeypatch.setattr(model, where, broken)
    cfg = _cfg(method)
    outcome = _run(scheduler, engine, cfg)
    monkeypatch.undo()
    _after(scheduler, engine, cfg, outcome, RuntimeError)


@pytest.mark.parametrize("method", METHODS)
def test_nan_logits_are_a_numerical_error(scheduler, engine, monkeypatch, method):
    model = engine.target.model
    real = model.decode_batch

    def nan_logits(items):
        return [torch.full_like(out.float(), torch.nan) for out in real(items)]

    monkeypatch.setattr(model, "decode_batch", nan_logits)
    cfg = _cfg(method)
    outcome = _run(scheduler, engine, cfg)
    monkeypatch.undo()
    _after(scheduler, engine, cfg, outcome, NumericalError)


@pytest.mark.parametrize("twisted", [False, True], ids=["terminal", "prefix"])
def test_a_reward_that_raises(scheduler, engine, twisted):
    reward = Reward(_failing_reward, beta=1.0, prefix_fn=_failing_reward if twisted else None)
    outcome = _run(scheduler, engine, _cfg("smc", reward=reward))
    _after(scheduler, engine, _cfg("smc"), outcome, RuntimeError)


@pytest.mark.parametrize("method", METHODS)
def test_a_constraint_that_raises(scheduler, engine, method):
    outcome = _run(scheduler, engine, _cfg(method, constraint=_Exploding(engine.vocab)))
    _after(scheduler, engine, _cfg(method), outcome, RuntimeError)


def test_one_job_behind_several_requests_each_gives_back_its_own(scheduler, engine):
    """A request's reservation lives on its job (the scheduler's ``Request`` refers to it):
    one job submitted as three requests, admitted at the same step, each takes and gives
    back a lease of its own, so every request decodes the seed's tokens and the pools are
    full again; a job that already carries a reservation is refused (the scheduler would
    release what it did not take). Broken variant caught: admission setting
    ``head.job.reservation`` on the shared job instead of the request's own copy (the first
    two leases are overwritten and never released)."""
    job = engine.prepare("ab cd", _cfg("smc"))
    done = [threading.Event() for _ in range(3)]
    outcomes: list = [None] * 3
    with scheduler._cv:  # all queued before the worker admits any
        for i in range(3):
            on_done = lambda o, i=i: (outcomes.__setitem__(i, o), done[i].set())  # noqa: E731
            scheduler.submit(Request(job, on_done=on_done))
    assert all(d.wait(60) for d in done), "a request never ended"
    assert not any(isinstance(o, BaseException) for o in outcomes), outcomes
    assert outcomes[0].token_ids == outcomes[1].token_ids == outcomes[2].token_ids
    assert job.reservation is None
    _pools_full(engine)
    held = engine.try_reserve(job)
    try:
        with pytest.raises(ValueError, match="on admission"):
            Request(replace(job, reservation=held), on_done=lambda o: None)
    finally:
        held.release()
    _pools_full(engine)
