"""Running untrusted Python (a model's code) in a child process: bubblewrap, or rlimits only.

Used by HumanEval's hidden tests (:mod:`smcspec.eval.humaneval`) and by the execution reward
(:mod:`smcspec.rewards.code`). :func:`run_python` writes the program into a fresh temporary
directory and runs ``python -I -B program.py`` there, with a clean environment (``PATH``,
``HOME`` and ``TMPDIR`` = that directory, ``LANG``, and one thread for the thread pools of
OpenBLAS, OpenMP, MKL and numexpr), stdin from ``/dev/null``, stdout and stderr
into files (read back capped), in its own session, the whole process group killed at the end
or at the wall-clock limit. Before the program starts, a bootstrap sets ``RLIMIT_AS``,
``RLIMIT_CPU``, ``RLIMIT_FSIZE`` and ``RLIMIT_CORE`` and ``exec``s the interpreter (no
``preexec_fn``, which is unsafe in a threaded parent such as torch).

Two isolation levels (``sandbox=``):

* ``"bwrap"``: under bubblewrap (https://github.com/containers/bubblewrap; Debian package
  ``bubblewrap``): the root filesystem read-only, a private ``/tmp``, ``/dev`` and ``/proc``,
  new network (loopback only, no route out), PID, IPC and UTS namespaces, killed with its
  parent; only the run's own directory is writable. A seccomp filter (libseccomp through
  ``pyseccomp``) makes ``fork``, ``vfork``, ``clone`` and ``clone3`` fail with ``EPERM``, so
  the program can start no process and no thread. (``RLIMIT_NPROC`` would not do: the kernel
  does not enforce it for root.) Run as a user other than root, bubblewrap needs unprivileged
  user namespaces.
* ``"rlimit"``: the resource limits only. The code runs as the calling user with its
  filesystem and network: it can read what the user can read, write outside its directory
  (each file capped by ``RLIMIT_FSIZE``), open sockets and fork (only the CPU and wall-clock
  limits bound a fork bomb). Use it only for trusted code, or inside a container.
* ``"auto"`` (default): ``"bwrap"`` where bubblewrap works on this machine, else ``"rlimit"``
  with a :class:`SandboxWarning` (printed once per call site by Python's warning filter).

``scripts/setup.sh`` installs bubblewrap where apt is available.
"""

from __future__ import annotations

import functools
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from smcspec.errors import ConfigError

__all__ = ["SANDBOXES", "ChildRun", "Limits", "SandboxWarning", "bwrap_works", "run_python"]

SANDBOXES = ("auto", "bwrap", "rlimit")

# Sets the limits given on argv (resource, soft, hard triples), under bwrap (argv[1] == "1")
# also a seccomp filter that makes fork, vfork, clone and clone3 fail with EPERM, then
# replaces itself with the interpreter that runs the program (limits and the filter survive
# exec). Runs inside the child, so no preexec_fn is needed.
_BOOTSTRAP = """\
import os, resource, sys
args = [int(x) for x in sys.argv[2:-1]]
for i in range(0, len(args), 3):
    res, soft, hard = args[i:i + 3]
    cur_soft, cur_hard = resource.getrlimit(res)
    if cur_hard != resource.RLIM_INFINITY:
        hard = min(hard, cur_hard)
        soft = min(soft, hard)
    resource.setrlimit(res, (soft, hard))
if sys.argv[1] == "1":
    import errno, pyseccomp
    f = pyseccomp.SyscallFilter(pyseccomp.ALLOW)
    for name in ("fork", "vfork", "clone", "clone3"):
        f.add_rule(pyseccomp.ERRNO(errno.EPERM), name)
    f.load()
os.execv(sys.executable, [sys.executable, "-I", "-B", sys.argv[-1]])
"""


# Thread pools of numerical libraries start one thread per CPU at import unless told
# otherwise. Under bwrap no thread can start, and OpenBLAS (numpy's BLAS) then aborts the
# import with KeyboardInterrupt wherever more than one CPU is visible: a correct program that
# imports numpy would pass or fail by the parent's CPU affinity. One thread everywhere makes
# a program's verdict the same under both sandboxes and on every machine.
_ONE_THREAD_ENV = {
    name: "1"
    for name in (
        "OPENBLAS_NUM_THREADS",
        "OMP_NUM_THREADS",
        "MKL_NUM_THREADS",
        "NUMEXPR_NUM_THREADS",
        "VECLIB_MAXIMUM_THREADS",
    )
}


class SandboxWarning(UserWarning):
    """Code ran with resource limits only, because bubblewrap is missing or does not work."""


@dataclass(frozen=True)
class Limits:
    """Resource limits of one run.

    Attributes:
        timeout_s: wall-clock limit in seconds (> 0); the CPU-time limit is its ceiling.
        memory_mb: address-space limit (``RLIMIT_AS``) in MiB (> 0).
        file_size_mb: largest file the program may write (``RLIMIT_FSIZE``) in MiB (> 0);
            also caps the captured stdout and stderr.
    Raises :class:`ValueError` for a limit that is not positive.
    """

    timeout_s: float = 10.0
    memory_mb: int = 1024
    file_size_mb: int = 16

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.memory_mb <= 0 or self.file_size_mb <= 0:
            raise ValueError("timeout_s, memory_mb and file_size_mb must be positive")

    @property
    def cpu_s(self) -> int:
        """The CPU-time limit in seconds: ``ceil(timeout_s)``, at least 1."""
        return max(1, -int(-self.timeout_s // 1))


@dataclass
class ChildRun:
    """What one run did: exit status (negative: killed by that signal), whether the
    wall-clock limit ended it, wall seconds (interpreter start-up included), stdout (bytes,
    at most ``file_size_mb`` MiB + 1 byte), stderr (text, same cap) and the sandbox used."""

    returncode: int
    timed_out: bool
    seconds: float
    stdout: bytes
    stderr: str
    sandbox: str


@functools.cache
def bwrap_works() -> bool:
    """Whether ``bwrap`` is on ``PATH`` and can start a sandbox here, and libseccomp loads
    (probed once per process: a container may forbid the namespaces bwrap needs)."""
    exe = shutil.which("bwrap")
    if exe is None:
        return False
    try:
        import pyseccomp  # noqa: F401  (loads libseccomp.so.2 with ctypes)
    except (ImportError, OSError):
        return False
    try:
        probe = subprocess.run(
            [*_bwrap_argv(exe, "/"), "/bin/true"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return probe.returncode == 0


def _bwrap_argv(exe: str, workdir: str) -> list[str]:
    """bubblewrap's arguments: read-only root, private /tmp, /dev and /proc, ``workdir``
    writable, new network/PID/IPC/UTS namespaces (and a user namespace unless root). The
    interpreter's own folders stay visible, read-only, where they lie under /tmp (a virtual
    environment in a checkout there), since the private /tmp would hide them."""
    argv = [exe, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp"]
    for path in _interpreter_paths_under("/tmp"):
        argv += ["--ro-bind", path, path]
    if workdir != "/":
        argv += ["--bind", workdir, workdir, "--chdir", workdir]
    argv += ["--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts"]
    if os.geteuid() != 0:
        argv.append("--unshare-user")
    return [*argv, "--die-with-parent", "--new-session"]


def _interpreter_paths_under(root: str) -> list[str]:
    """The folders the interpreter runs from (its prefixes and its executable's folder,
    links resolved) that lie under ``root``, outermost only."""
    found = set()
    for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(sys.executable)):
        real = os.path.realpath(p)
        for q in {p, real}:
            if os.path.commonpath([q, root]) == root and q != root and os.path.isdir(q):
                found.add(q)
    return sorted(q for q in found if not any(q != o and q.startswith(o + os.sep) for o in found))


def _resolve(sandbox: str) -> str:
    if sandbox not in SANDBOXES:
        raise ConfigError(f"unknown sandbox {sandbox!r}; choose from {', '.join(SANDBOXES)}")
    if sandbox == "bwrap" and not bwrap_works():
        raise ConfigError("sandbox 'bwrap' asked for, but bubblewrap is missing or cannot run here")
    if sandbox == "auto":
        if bwrap_works():
            return "bwrap"
        warnings.warn(
            "bubblewrap (bwrap) is missing or cannot run here: the code runs with resource "
            "limits only, with this user's filesystem and network (install the 'bubblewrap' "
            "package)",
            SandboxWarning,
            stacklevel=3,
        )
        return "rlimit"
    return sandbox


def run_python(
    program: str,
    limits: Limits | None = None,
    sandbox: str = "auto",
    workdir_parent: str | os.PathLike[str] | None = None,
) -> ChildRun:
    """Run ``program`` (Python source) in a child process under ``limits``.

    Args:
        program: the source, written to ``program.py`` in a fresh temporary directory.
        limits: see :class:`Limits` (default: 10 s, 1024 MiB, 16 MiB files).
        sandbox: ``"auto"``, ``"bwrap"`` or ``"rlimit"`` (module docstring).
        workdir_parent: where the temporary directory is created (default: the system's).

    Returns:
        A :class:`ChildRun`; nothing the program does makes this raise.

    Raises:
        ConfigError: unknown ``sandbox``, or ``"bwrap"`` where bubblewrap cannot run.
    """
    lim = limits or Limits()
    used = _resolve(sandbox)
    fsize = lim.file_size_mb * 1024 * 1024
    rl = [
        (resource.RLIMIT_AS, lim.memory_mb * 1024 * 1024, lim.memory_mb * 1024 * 1024),
        (resource.RLIMIT_CPU, lim.cpu_s, lim.cpu_s + 1),
        (resource.RLIMIT_FSIZE, fsize, fsize),
        (resource.RLIMIT_CORE, 0, 0),
    ]
    with tempfile.TemporaryDirectory(
        prefix="smcspec-run-", dir=workdir_parent, ignore_cleanup_errors=True
    ) as tmp:
        work = Path(tmp)
        prog_path = work / "program.py"
        prog_path.write_text(program, encoding="utf-8")
        argv = _bwrap_argv(shutil.which("bwrap") or "bwrap", tmp) if used == "bwrap" else []
        argv += [sys.executable, "-I", "-c", _BOOTSTRAP, "1" if used == "bwrap" else "0"]
        argv += [str(v) for triple in rl for v in triple]
        env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp, "LANG": "C.UTF-8"}
        env.update(_ONE_THREAD_ENV)
        timed_out = False
        start = time.monotonic()
        with open(work / "stdout", "wb") as out, open(work / "stderr", "wb") as err:
            proc = subprocess.Popen(
                [*argv, str(prog_path)],
                cwd=tmp,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
                close_fds=True,
            )
            try:
                proc.wait(timeout=lim.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(proc.pid)
                proc.wait()
        seconds = time.monotonic() - start
        stdout = _read_capped(work / "stdout", fsize + 1)
        stderr = _read_capped(work / "stderr", fsize + 1).decode("utf-8", "replace")
    return ChildRun(proc.returncode, timed_out, seconds, stdout, stderr, used)


def _read_capped(path: Path, limit: int) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read(limit)
    except OSError:
        return b""


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
