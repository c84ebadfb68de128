"""Fixtures for every test module.

Tests that are not marked ``real_pair`` (those use the real default pair from the user's
cache) get ``$SMCSPEC_CACHE`` pointed at one temporary directory for the session, so nothing they
do (tokenizers, measured costs, re-quantized drafts) is written to the user's cache; and the
tuner (:mod:`smcspec.tuning`), which ``generate``/``serve``/``bench`` run for ``smc`` without
-N/-K, measures a small grid on tiny models (a fraction of a second instead of seconds).
Hypothesis runs derandomized (the ``fixed`` profile).

The real default pair is loaded once for the session (``real_engine``) and served by one
live server (``real_server``); only ``real_pair`` tests may ask for them (checked at
collection), so the pair is always read from the user's cache. ``one_torch_thread`` runs a
module of tiny-model forwards on one torch thread, as the truncation and cut-round tests'
fixtures already did (tiny models' forwards are too small to share between threads);
``inference_mode`` runs a test under ``torch.inference_mode()`` (the statistical modules).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import settings

from smcspec.tuning import TuningGrid

# property-based tests draw their examples from a seed fixed per test, with no example
# database: every run of the suite tries the same examples (no flaky tests)
settings.register_profile("fixed", derandomize=True, database=None)
settings.load_profile("fixed")

SMALL_GRID = TuningGrid(
    draft_tokens=(2, 4), particles=(1, 4, 8), reps=1, context=8, acceptance_tokens=16
)


def pytest_configure(config) -> None:
    """Under CI (``CI`` set, as ``.ci/run`` runs) the llamacpp backend is part of what is
    tested: a missing llama-cpp-python is an error there, not a module of silent skips.

    In a pytest-xdist worker (``-n``), torch gets the worker's share of the cores: two
    workers' threads spinning on two cores would slow each other down many times over (the
    llamacpp backend's threads fit the free cores by themselves,
    :mod:`smcspec.backends.cpu_share`)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers > 1:
        share = str(max(1, (os.cpu_count() or 1) // workers))
        # the processes the worker's tests start (the CLI's torch runs, the campaign's
        # rehearsal) take the same share, and Inductor compiles in the worker itself (its
        # pool of compile processes would start one a core beside the other workers)
        os.environ["OMP_NUM_THREADS"] = share
        os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
        import torch

        torch.set_num_threads(int(share))
    if not os.environ.get("CI"):
        return
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        raise pytest.UsageError(
            "CI is set but llama_cpp cannot be imported: scripts/setup.sh must build "
            "llama-cpp-python (the llamacpp tests would otherwise be skipped)"
        ) from None


@pytest.fixture(scope="session")
def test_cache_dir(tmp_path_factory):
    """The session's ``$SMCSPEC_CACHE`` for tests that are not ``real_pair``."""
    return tmp_path_factory.mktemp("smcspec-cache")


# the cache the suite was started with
_USER_CACHE = os.environ.get("SMCSPEC_CACHE")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """A test (or a fixture it set up) that leaves ``$SMCSPEC_CACHE`` changed in ``os.environ``
    errors here, named, and the user's cache is put back: no later test (the real pair's least
    of all, which would unpack and convert GBs of weights) runs with a moved cache."""
    result = yield
    leaked = os.environ.get("SMCSPEC_CACHE")
    if leaked != _USER_CACHE:
        if _USER_CACHE is None:
            del os.environ["SMCSPEC_CACHE"]
        else:
            os.environ["SMCSPEC_CACHE"] = _USER_CACHE
        raise RuntimeError(f"$SMCSPEC_CACHE left set to {leaked!r}: use monkeypatch")
    return result


# fixtures that hold the real default pair: only tests marked real_pair may use them
REAL_PAIR_FIXTURES = frozenset({"real_engine", "real_server"})


def pytest_collection_modifyitems(config, items) -> None:
    """A test that asks for the real pair without the ``real_pair`` mark would load it with
    ``$SMCSPEC_CACHE`` moved to the test cache (GBs unpacked and converted into a temporary
    folder): a usage error, named, before anything runs."""
    for item in items:
        used = REAL_PAIR_FIXTURES & set(getattr(item, "fixturenames", ()))
        if used and item.get_closest_marker("real_pair") is None:
            raise pytest.UsageError(f"{item.nodeid} uses {sorted(used)} but is not real_pair")


def pytest_xdist_make_scheduler(config, log):
    """``-n N --dist loadgroup`` (README's test command): each test file runs whole in one
    worker (its module fixtures, tiny models and servers made once), and every file that
    marks tests ``real_pair`` runs in the same one, so the real pair is loaded and served
    once and two copies of it (about 5 GB each) never compete for the cores. Files go out
    longest first by the seconds ``tests/file_durations.json`` gives them
    (``scripts/file_durations.py``; a file it does not list counts a second a test):
    in xdist's own order, most tests first, the kernel files' few long tests went out last
    and one worker ran 94 s after the other finished (2026-12-07). pytest-xdist's own
    ``xdist_group`` marks did not group here (pytest 9.2, pytest-xdist 3.8: one group's
    tests went to both workers of ``-n 2 --dist loadgroup``), hence this scheduler."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    real_files: dict[str, bool] = {}
    seconds = json.loads((Path(__file__).parent / "file_durations.json").read_text())

    def is_real(path: str) -> bool:
        if path not in real_files:
            try:
                text = (config.rootpath / path).read_text()
            except OSError:
                text = ""
            real_files[path] = "mark.real_pair" in text
        return real_files[path]

    def cost(nodeids: dict) -> float:
        files = {n.split("::", 1)[0] for n in nodeids}
        unknown = sum(n.split("::", 1)[0] not in seconds for n in nodeids)
        return sum(seconds.get(f, 0.0) for f in files) + unknown

    class FilesAndTheRealPair(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "real_pair" if is_real(path) else path

        def _assign_work_unit(self, node) -> None:
            longest = max(self.workqueue, key=lambda s: cost(self.workqueue[s]))
            self.workqueue.move_to_end(longest, last=False)
            super()._assign_work_unit(node)

    return FilesAndTheRealPair(config, log)


_PREBUILD = pytest.StashKey()


def pytest_collection_finish(session) -> None:
    """One process of the session (the first xdist worker, or the only one) starts making the
    venvs of the third-party clients its selected tests name (``@pytest.mark.clients``) in
    the background (:func:`client_venvs.prebuild`); its end stops one still running (the
    next session rebuilds what it left unfinished)."""
    if os.environ.get("PYTEST_XDIST_WORKER") not in (None, "gw0"):
        return
    wanted = {c for item in session.items for m in item.iter_markers("clients") for c in m.args}
    if wanted:
        from client_venvs import prebuild

        session.config.stash[_PREBUILD] = prebuild(sorted(wanted))


def pytest_sessionfinish(session) -> None:
    proc = session.config.stash.get(_PREBUILD, None)
    if proc is not None and proc.poll() is None:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="session")
def real_engine():
    """The real default pair (``Engine.load()``: the packaged GGUF pair on llama.cpp), loaded
    once for the session from the user's cache.

    Raises:
        RuntimeError: ``$SMCSPEC_CACHE`` is not the one the suite was started with.
    """
    if os.environ.get("SMCSPEC_CACHE") != _USER_CACHE:
        raise RuntimeError("the real pair must load from the user's cache, not a test cache")
    from smcspec import Engine

    return Engine.load()


@pytest.fixture(scope="session")
def real_server(real_engine):
    """One live server of the real pair for the session (``smcspec serve``'s app on a free
    loopback port, served as the target's name, ``.model``; 64 new tokens unless a request
    says otherwise); each test sends its own requests."""
    from live_server import Server

    from smcspec import GenerationConfig
    from smcspec.server import create_app

    defaults = GenerationConfig(max_new_tokens=64)
    srv = Server(create_app(real_engine, defaults, model_name=real_engine.target.name))
    srv.model = real_engine.target.name  # what clients pass as ``model``
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch on one thread for a module (restored after it), for modules of tiny-model
    forwards, too small to share between threads."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def inference_mode():
    """The test runs under ``torch.inference_mode()``: for the statistical modules' thousands
    of seeded tiny-model requests (no autograd bookkeeping on the decoders' own tensor work,
    12-20% less CPU a request; the same draws, bit for bit)."""
    import torch

    with torch.inference_mode():
        yield


@pytest.fixture(autouse=True)
def _test_cache_and_small_tuning_grid(request, monkeypatch, test_cache_dir):
    if request.node.get_closest_marker("real_pair") is not None:
        return
    monkeypatch.setenv("SMCSPEC_CACHE", str(test_cache_dir))
    monkeypatch.setattr("smcspec.tuning.tuner.default_grid", lambda device: SMALL_GRID)
