"""Fixtures for every test module.

Tests that are not marked ``real_pair`` (those use the real default pair from the user's
cache) get ``$SMCSPEC_CACHE`` pointed at one temporary directory for the session, so nothing they
do (tokenizers, measured costs, re-quantized drafts) is written to the user's cache; and the
tuner (:mod:`smcspec.tuning`), which ``generate``/``serve``/``bench`` run for ``smc`` without
-N/-K, measures a small grid on tiny models (a fraction of a second instead of seconds).
Hypothesis runs derandomized (the ``fixed`` profile).
"""

from __future__ import annotations

import os

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
    tested: a missing llama-cpp-python is an error there, not a module of silent skips."""
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


@pytest.fixture(autouse=True)
def _test_cache_and_small_tuning_grid(request, monkeypatch, test_cache_dir):
    if request.node.get_closest_marker("real_pair") is not None:
        return
    monkeypatch.setenv("SMCSPEC_CACHE", str(test_cache_dir))
    monkeypatch.setattr("smcspec.tuning.tuner.default_grid", lambda device: SMALL_GRID)
