"""How many compute threads the CPU can give the llamacpp backend now: the cores other
processes leave free.

llama.cpp's CPU threads meet at a barrier after every operation of a forward and spin there.
When another process takes one of the cores, a descheduled thread stalls the others for up to
a scheduler slice at every barrier, and decoding collapses: 0.18 tokens/s at 2 threads beside
one busy process on a 2-core machine, against 2.9 at 1 thread (issue 40). A thread count that
fits the free cores avoids that; ``llama_set_n_threads`` changes it between forwards.

:class:`FairShare` reads the machine's busy time (``/proc/stat``, Linux's ``proc(5)``) and this
process's own CPU time (``os.times``) at most every ``interval_s`` seconds; what is busy and
not ours is the others' load, in cores. Time of niced processes (``/proc/stat``'s ``nice``
column) is not counted: the scheduler gives a nice-0 thread the core over them. Off Linux,
or where ``/proc/stat`` cannot be read, the configured thread count stays.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

SLACK_CORES = 0.25  # a core counts as free while others use less than 0.25 of it


def fair_threads(wanted: int, cores: int, others_busy: float, slack: float = SLACK_CORES) -> int:
    """Threads that fit in the cores others leave: ``floor(cores - others_busy + slack)``,
    clamped to ``[1, wanted]``.

    Args:
        wanted: the configured thread count (the most used).
        cores: the cores this process may run on.
        others_busy: cores' worth of CPU time other processes used (0 to ``cores``).
    """
    return max(1, min(wanted, int(cores - others_busy + slack)))


@dataclass(frozen=True)
class CpuTimes:
    """Cumulative CPU seconds: all CPUs' un-niced busy time, and this process's user and
    system time (its threads included)."""

    busy: float
    own_user: float
    own_system: float


def parse_proc_stat(text: str, ticks_per_s: float) -> float:
    """Un-niced busy seconds of all CPUs from ``/proc/stat``'s first (``cpu``) line: user,
    system, irq, softirq and steal (nice, idle and iowait are not counted).

    Raises:
        ValueError: no ``cpu`` line.
    """
    for line in text.splitlines():
        f = line.split()
        if f and f[0] == "cpu":
            vals = [float(x) for x in f[1:9]] + [0.0] * max(0, 9 - len(f))
            user, _nice, system, _idle, _iowait, irq, softirq, steal = vals[:8]
            return (user + system + irq + softirq + steal) / ticks_per_s
    raise ValueError("/proc/stat has no 'cpu' line")


def read_cpu_times(stat: Path = Path("/proc/stat")) -> CpuTimes | None:
    """This machine's :class:`CpuTimes`, or None where ``/proc/stat`` cannot be read."""
    try:
        busy = parse_proc_stat(stat.read_text(), os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError):
        return None
    t = os.times()
    return CpuTimes(busy, t.user, t.system)


class FairShare:
    """The thread count for the next forward: :func:`fair_threads` of the others' load over
    the last ``interval_s`` seconds or more.

    Args:
        wanted: the configured thread count.
        cores: the cores this process may run on.
        interval_s: the shortest window measured (shorter calls reuse the last answer).
        read: the clock-less reader of :class:`CpuTimes` (tests pass a fake).
        clock: monotonic seconds.
        niced: whether this process runs niced (then its user time is not in
            ``/proc/stat``'s un-niced sum and is not subtracted); default: its priority.
    """

    def __init__(
        self,
        wanted: int,
        cores: int,
        interval_s: float = 0.25,
        read: Callable[[], CpuTimes | None] = read_cpu_times,
        clock: Callable[[], float] = time.monotonic,
        niced: Callable[[], bool] = lambda: os.getpriority(os.PRIO_PROCESS, 0) > 0,
    ) -> None:
        self.wanted, self.cores, self.interval_s = wanted, cores, interval_s
        self._read, self._clock, self._niced = read, clock, niced
        self._last: tuple[float, CpuTimes] | None = None
        self.threads = wanted
        self.others_busy = 0.0

    def update(self) -> int:
        """Measure if ``interval_s`` has passed since the last measurement; return the thread
        count to use now."""
        now = self._clock()
        if self._last is not None and now - self._last[0] < self.interval_s:
            return self.threads
        times = self._read()
        if times is None:
            return self.threads
        if self._last is not None:
            t0, prev = self._last
            own = times.own_system - prev.own_system
            if not self._niced():  # our user time is in the un-niced sum
                own += times.own_user - prev.own_user
            self.others_busy = max(0.0, (times.busy - prev.busy - own) / (now - t0))
            self.threads = fair_threads(self.wanted, self.cores, self.others_busy)
        self._last = (now, times)
        return self.threads
