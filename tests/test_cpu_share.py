"""The llamacpp backend's fair share of the CPU (smcspec.backends.cpu_share)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from smcspec.backends.cpu_share import (
    CpuTimes,
    FairShare,
    fair_threads,
    parse_proc_stat,
    read_cpu_times,
)


@pytest.mark.parametrize(
    "wanted, cores, others, expected",
    [
        (2, 2, 0.0, 2),  # idle: the configured count
        (2, 2, 0.2, 2),  # background noise leaves both cores
        (2, 2, 0.6, 1),  # most of a core taken
        (2, 2, 1.2, 1),
        (2, 2, 1.0, 1),  # one busy process
        (2, 2, 2.0, 1),  # never below 1
        (8, 16, 3.0, 8),  # never above what was asked for
        (16, 16, 3.0, 13),
    ],
)
def test_fair_threads(wanted, cores, others, expected):
    assert fair_threads(wanted, cores, others) == expected


def test_proc_stat_counts_unniced_busy_time():
    text = "cpu  100 900 50 1000 70 5 5 40 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n"
    # user 100 + system 50 + irq 5 + softirq 5 + steal 40; nice, idle and iowait left out
    assert parse_proc_stat(text, 100.0) == pytest.approx(2.0)
    with pytest.raises(ValueError):
        parse_proc_stat("intr 1 2 3\n", 100.0)


class Fake:
    """A clock and a /proc/stat whose others' load is set by the test (our own time is 0.5
    of a core throughout)."""

    def __init__(self) -> None:
        self.now, self.busy, self.own, self.others = 0.0, 0.0, 0.0, 0.0

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.own += 0.5 * seconds
        self.busy += (0.5 + self.others) * seconds

    def read(self) -> CpuTimes:
        return CpuTimes(self.busy, self.own, 0.0)


def test_a_niced_process_does_not_subtract_its_user_time():
    """Niced, our user time is not in /proc/stat's un-niced busy time (the nice column holds
    it), so only the system time is taken off; the Fake counts all of ours as un-niced, so
    the un-subtracted half core reads as others' load. The answer must not depend on the
    niceness pytest itself runs at (the test above passes niced=False)."""
    f = Fake()
    share = FairShare(2, 2, interval_s=0.25, read=f.read, clock=lambda: f.now, niced=lambda: True)
    share.update()
    f.advance(0.5)
    share.update()
    assert share.others_busy == pytest.approx(0.5)


def test_fair_share_follows_the_others_load():
    f = Fake()
    share = FairShare(2, 2, interval_s=0.25, read=f.read, clock=lambda: f.now, niced=lambda: False)
    assert share.update() == 2  # nothing measured yet
    f.advance(0.5)
    assert share.update() == 2 and share.others_busy == pytest.approx(0.0)
    f.others = 1.0  # another process takes a core
    f.advance(0.5)
    assert share.update() == 1 and share.others_busy == pytest.approx(1.0)
    f.others = 0.0
    f.advance(0.1)  # inside the interval: the last answer stands
    assert share.update() == 1
    f.advance(0.5)
    assert share.update() == 2


def test_without_proc_stat_the_configured_count_stays():
    share = FairShare(2, 2, read=lambda: None)
    assert share.update() == 2 and share.update() == 2


@pytest.mark.skipif(read_cpu_times() is None, reason="needs Linux /proc/stat")
@pytest.mark.skipif(
    os.getpriority(os.PRIO_PROCESS, 0) > 0,
    reason="run niced, the busy child is niced too, and niced time is not counted (by design)",
)
def test_a_busy_process_is_seen_as_one_core_taken():
    share = FairShare(2, 2, interval_s=0.0)
    share.update()
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # the interpreter's start
        share.update()
        time.sleep(1.0)
        threads = share.update()
    finally:
        busy.kill()
        busy.wait()
    # one spinning process: about 1.0 core of others' load (more if the machine is busy)
    assert share.others_busy > 0.6 and threads == 1


def test_llamacpp_runs_with_the_fair_share(tmp_path):
    pytest.importorskip("llama_cpp")
    from tiny_models import make_tiny_gguf

    from smcspec.backends.llamacpp import LlamaCppModel, LlamaCppSettings

    path = make_tiny_gguf(tmp_path, "qwen2", 96, seed=3)[0]
    settings = LlamaCppSettings(threads=2, kv_cells=1024, max_sequences=8, n_batch=256)
    models = [LlamaCppModel(path, settings) for _ in range(2)]
    # model 0 sees an idle machine, model 1 one busy process (fakes: the real load of the
    # machine running the test must not decide the thread counts)
    for m, others in zip(models, (0.0, 1.0), strict=True):
        f = Fake()
        f.others = others
        m._share = FairShare(2, 2, read=f.read, clock=lambda f=f: f.now, niced=lambda: False)
        m._share.update()
        f.advance(1.0)
    logits = []
    for m in models:
        cache = m.new_cache(2, 8)
        m.prefill(torch.tensor([1, 2, 3]), cache)
        logits.append(m.decode(torch.tensor([[4, 5], [6, 7]]), cache))
    assert models[0].threads_now == 2 and models[1].threads_now == 1
    assert models[1]._lib.llama_n_threads(models[1]._ctx) == 1
    # one thread computes what two do (llama.cpp splits a matmul's rows between threads)
    torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=0)
    no_share = LlamaCppModel(path, LlamaCppSettings(**{**settings.__dict__, "fair_share": False}))
    assert no_share._share is None
