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
  ``bubblewrap``). What it guarantees, run as root (the default user of most containers)
  and as any other user alike (``tests/test_sandbox.py`` checks each point both ways):

  - **No capabilities.** bubblewrap drops them all (``--cap-drop ALL``; as a user other
    than root it runs in a new user namespace, which grants none outside it), and
    ``no_new_privs`` keeps an ``exec`` from gaining any: a program running as root cannot
    remount the filesystem, change its uid or reach a device.
  - **A minimal, read-only view of the host.** Only what the interpreter needs is there:
    ``/usr``, ``/bin`` and ``/lib*`` (links kept as links), the ``/etc`` entries the dynamic
    loader and Python read (:data:`_ETC_ENTRIES`), and the interpreter's own folders (its
    prefixes, e.g. a virtual environment: nothing else of the folder that holds it), all
    read-only, on a read-only root. ``/root``, ``/home``, ``/run``, ``/var``, ``/srv``,
    ``/opt``, ``/mnt``, the user's ``$HOME`` and the project checkout are absent (but for
    the interpreter's folders where they lie inside one of them), and so are the host's
    UNIX sockets. Private ``/dev`` (null, zero, random, ...), ``/proc`` (this sandbox's
    processes only) and ``/tmp`` (a tmpfs of at most 4 x ``file_size_mb`` MiB where
    bubblewrap supports ``--size``) are mounted; the run's own directory is the only host
    folder it can write.
  - **New namespaces**: network (loopback only: no route out, not even to the host's
    loopback), PID, IPC, UTS (host name ``sandbox``) and cgroup where available; killed
    with its parent.
  - **A seccomp filter** (libseccomp through ``pyseccomp``, installed by bubblewrap's
    ``--seccomp``) that makes the calls a test program never needs fail with ``EPERM``
    (:data:`DENIED_SYSCALLS`): new processes and threads (``RLIMIT_NPROC`` would not do: the
    kernel does not enforce it for root), mounts, namespaces, ``chroot``, ``ptrace`` and
    other processes' memory, BPF, perf events, kernel modules, kexec, reboot, kernel
    keyrings, ``userfaultfd``, file handles, io_uring (whose requests seccomp cannot see);
    and ``socket`` for every family but ``AF_UNIX``. Calls of another ABI (32-bit x86 or
    x32 on x86-64) kill the program. The list is modelled on Docker's default profile
    (:data:`SECCOMP_PROFILE_SOURCE`): what Docker allows a container only with a
    capability the sandbox does not have, or never, plus io_uring and the socket rule.
  - **Resource limits**: address space, CPU time, file size, no core files, wall clock.

  What it does not guarantee: the program runs as the calling user's uid (root stays uid 0,
  without capabilities), so files it writes in its directory belong to that user; it shares
  the host's kernel (a kernel bug reachable by the allowed calls is out of its reach to
  stop); it can read what the interpreter's folders hold; it can measure time and the CPU
  (timing side channels on other work of the machine: caches, branch predictors,
  frequency); it can use the whole CPU time and memory of its limits; the disk space of its
  own directory is bounded per file (``RLIMIT_FSIZE``), not in total; and it can read its
  own source (HumanEval's sentinel is therefore no secret from it).
  Run as a user other than root, bubblewrap needs unprivileged user namespaces.
* ``"rlimit"``: the resource limits only. The code runs as the calling user with its
  filesystem and network: it can read what the user can read, write outside its directory
  (each file capped by ``RLIMIT_FSIZE``), open sockets and fork (only the CPU and wall-clock
  limits bound a fork bomb). Use it only for trusted code, or inside a container.
* ``"auto"`` (default): ``"bwrap"`` where bubblewrap works on this machine, else ``"rlimit"``
  with a :class:`SandboxWarning` (printed once per call site by Python's warning filter).

``scripts/setup.sh`` installs bubblewrap where apt is available. The server
(``smcspec serve``) runs no code at all: it offers no execution reward.
"""

from __future__ import annotations

import contextlib
import errno
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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from smcspec.errors import ConfigError

if TYPE_CHECKING:
    import pyseccomp

__all__ = [
    "DENIED_SYSCALLS",
    "SANDBOXES",
    "SECCOMP_PROFILE_SOURCE",
    "ChildRun",
    "Limits",
    "SandboxWarning",
    "bwrap_works",
    "run_python",
    "seccomp_filter",
]

SANDBOXES = ("auto", "bwrap", "rlimit")

SECCOMP_PROFILE_SOURCE = "https://github.com/moby/moby/blob/master/profiles/seccomp/default.json"

# The calls the seccomp filter makes fail with EPERM (Docker's default errno), grouped as in
# Docker's default profile (SECCOMP_PROFILE_SOURCE), which allows each group only with the
# capability named, or never; the sandbox holds no capability, so these are what a test
# program never needs. Names this machine's libseccomp does not know are skipped; names of
# another architecture are ignored by libseccomp.
DENIED_SYSCALLS: tuple[str, ...] = (
    # no new process or thread (Docker: clone only without namespace flags)
    "fork", "vfork", "clone", "clone3",
    # mounts, namespaces, the root (Docker: CAP_SYS_ADMIN, CAP_SYS_CHROOT, never)
    "mount", "umount", "umount2", "pivot_root", "chroot", "unshare", "setns",
    "fsopen", "fsconfig", "fsmount", "fspick", "move_mount", "open_tree", "mount_setattr",
    # other processes (Docker: CAP_SYS_PTRACE)
    "ptrace", "process_vm_readv", "process_vm_writev", "process_madvise", "kcmp",
    "pidfd_getfd",
    # the kernel (Docker: CAP_BPF, CAP_PERFMON, CAP_SYS_MODULE, CAP_SYS_BOOT, CAP_SYSLOG,
    # CAP_SYS_PACCT, CAP_SYS_ADMIN, CAP_SYS_RAWIO, CAP_SYS_TIME, CAP_SYS_TTY_CONFIG, never)
    "bpf", "perf_event_open", "init_module", "finit_module", "delete_module", "kexec_load",
    "kexec_file_load", "reboot", "syslog", "acct", "swapon", "swapoff", "quotactl",
    "quotactl_fd", "lookup_dcookie", "fanotify_init", "iopl", "ioperm", "settimeofday",
    "stime", "clock_settime", "clock_settime64", "sethostname", "setdomainname", "vhangup",
    # kernel keyrings, userfaultfd, obsolete calls (Docker: never)
    "keyctl", "add_key", "request_key", "userfaultfd", "uselib", "ustat", "sysfs", "_sysctl",
    "nfsservctl", "vm86", "vm86old", "create_module", "get_kernel_syms", "query_module",
    # files by handle, past every path check (Docker: CAP_DAC_READ_SEARCH)
    "open_by_handle_at",
    # io_uring: seccomp does not see the operations it runs, socket creation among them
    # (Docker denies it since 25.0, moby/moby#46762)
    "io_uring_setup", "io_uring_enter", "io_uring_register",
)  # fmt: skip

# socket(2) succeeds for this family only (Docker denies AF_VSOCK alone); the host's UNIX
# sockets lie outside the sandbox's view of the filesystem
_ALLOWED_SOCKET_FAMILY = 1  # AF_UNIX

# Folders of the host the sandbox shows, read-only (a link, e.g. /bin -> usr/bin, stays a
# link), and the /etc entries the dynamic loader and Python read.
_SYSTEM_PATHS = ("/usr", "/bin", "/lib", "/lib32", "/lib64", "/libx32")
_ETC_ENTRIES = (
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "localtime",
    "alternatives",
    f"python{sys.version_info[0]}.{sys.version_info[1]}",
    f"python{sys.version_info[0]}",
)

# Sets the limits given on argv (resource, soft, hard triples), then replaces itself with the
# interpreter that runs the program (the limits, and bubblewrap's seccomp filter, survive
# exec). Runs inside the child, so no preexec_fn is needed.
_BOOTSTRAP = """\
import os, resource, sys
args = [int(x) for x in sys.argv[1:-1]]
for i in range(0, len(args), 3):
    res, soft, hard = args[i:i + 3]
    cur_soft, cur_hard = resource.getrlimit(res)
    if cur_hard != resource.RLIM_INFINITY:
        hard = min(hard, cur_hard)
        soft = min(soft, hard)
    resource.setrlimit(res, (soft, hard))
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
            also caps the captured stdout and stderr; under bwrap the private ``/tmp`` holds
            at most 4 times as much.
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


def seccomp_filter() -> pyseccomp.SyscallFilter:
    """The sandbox's seccomp policy as a ``pyseccomp.SyscallFilter``: allow by default;
    :data:`DENIED_SYSCALLS`, and ``socket`` for any family but ``AF_UNIX``, fail with
    ``EPERM``; a call of another ABI kills the thread (libseccomp's default). ``pyseccomp``
    is imported here, not at the module's import: it loads libseccomp with ctypes.

    Raises:
        ImportError, OSError: ``pyseccomp`` or libseccomp (``libseccomp.so.2``) is missing.
    """
    import pyseccomp

    f = pyseccomp.SyscallFilter(pyseccomp.ALLOW)
    deny = pyseccomp.ERRNO(errno.EPERM)
    for name in DENIED_SYSCALLS:
        if pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, name) != -1:  # -1: unknown name
            f.add_rule(deny, name)
    f.add_rule(deny, "socket", pyseccomp.Arg(0, pyseccomp.NE, _ALLOWED_SOCKET_FAMILY))
    return f


@functools.cache
def _seccomp_bpf() -> bytes:
    """The compiled filter of :func:`seccomp_filter` (classic BPF, as bwrap's ``--seccomp``
    reads it), built once per process."""
    with tempfile.TemporaryFile() as fh:
        seccomp_filter().export_bpf(fh)
        fh.seek(0)
        return fh.read()


@functools.cache
def bwrap_works() -> bool:
    """Whether ``bwrap`` is on ``PATH`` and can start this module's sandbox here (its
    namespaces, view of the host and seccomp filter), and libseccomp loads; probed once per
    process (a container may forbid the namespaces bwrap needs)."""
    exe = shutil.which("bwrap")
    if exe is None:
        return False
    try:
        _seccomp_bpf()
    except (ImportError, OSError):
        return False
    probe = [sys.executable, "-I", "-S", "-c", "pass"]
    try:
        with tempfile.TemporaryDirectory(prefix="smcspec-probe-") as work:
            return _run_bwrap_probe(exe, work, probe)
    except (OSError, subprocess.SubprocessError):
        return False


def _run_bwrap_probe(exe: str, work: str, command: list[str]) -> bool:
    with _seccomp_fd() as fd:
        proc = subprocess.run(
            [*_bwrap_argv(exe, work, fd, 1 << 20), *command],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=10,
            pass_fds=(fd,),
        )
    return proc.returncode == 0


@contextlib.contextmanager
def _seccomp_fd() -> Iterator[int]:
    """An open file descriptor of the compiled filter at offset 0, for bwrap's ``--seccomp
    FD``; the file is closed (and gone) on exit."""
    with tempfile.TemporaryFile() as fh:
        fh.write(_seccomp_bpf())
        fh.flush()
        fh.seek(0)
        yield fh.fileno()


@functools.cache
def _bwrap_supports(exe: str, option: str) -> bool:
    """Whether this bubblewrap knows ``option`` (older ones lack ``--size``)."""
    try:
        out = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return False
    return option in out.stdout + out.stderr


def _bwrap_argv(exe: str, workdir: str, seccomp_fd: int, tmp_bytes: int) -> list[str]:
    """bubblewrap's arguments (module docstring): the host view, private /dev, /proc and
    /tmp (at most ``tmp_bytes`` where bwrap supports ``--size``), the interpreter's folders
    and ``workdir`` (writable, the working directory), a read-only root; new namespaces (and
    a user namespace unless root), no capabilities, the seccomp filter read from
    ``seccomp_fd``."""
    argv = [exe, *_host_view(), "--dev", "/dev", "--proc", "/proc"]
    if _bwrap_supports(exe, "--size"):
        argv += ["--size", str(tmp_bytes)]
    argv += ["--tmpfs", "/tmp"]
    for path in _interpreter_paths():
        argv += ["--ro-bind", path, path]
    argv += ["--bind", workdir, workdir, "--chdir", workdir, "--remount-ro", "/"]
    argv += ["--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts"]
    argv += ["--unshare-cgroup-try", "--hostname", "sandbox"]
    if os.geteuid() != 0:
        argv.append("--unshare-user")
    argv += ["--cap-drop", "ALL", "--seccomp", str(seccomp_fd)]
    return [*argv, "--die-with-parent", "--new-session"]


def _host_view() -> list[str]:
    """bwrap arguments that show the system folders (a link as the same link) and the /etc
    entries of :data:`_ETC_ENTRIES` that exist, read-only."""
    args: list[str] = []
    for path in _SYSTEM_PATHS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    for name in _ETC_ENTRIES:
        path = os.path.join("/etc", name)
        if os.path.exists(path):
            args += ["--ro-bind", path, path]
    return args


def _interpreter_paths() -> list[str]:
    """The folders the interpreter runs from (its prefixes and its executable's folder, as
    given and with links resolved) that the system folders do not already show, outermost
    only."""
    shown = [os.path.realpath(p) for p in _SYSTEM_PATHS if os.path.isdir(p)]
    found = set()
    for p in (
        sys.prefix,
        sys.base_prefix,
        sys.exec_prefix,
        sys.base_exec_prefix,
        os.path.dirname(sys.executable),
    ):
        for q in {os.path.abspath(p), os.path.realpath(p)}:
            if q != "/" and os.path.isdir(q) and not any(_under(q, s) for s in shown):
                found.add(q)
    return sorted(q for q in found if not any(q != o and _under(q, o) for o in found))


def _under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


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
    with tempfile.TemporaryDirectory(
        prefix="smcspec-run-", dir=workdir_parent, ignore_cleanup_errors=True
    ) as tmp:
        work = Path(tmp)
        prog_path = work / "program.py"
        prog_path.write_text(program, encoding="utf-8")
        command = [sys.executable, "-I", "-c", _BOOTSTRAP, *_rlimit_args(lim), str(prog_path)]
        if used == "bwrap":
            with _seccomp_fd() as fd:
                exe = shutil.which("bwrap") or "bwrap"
                tmp_bytes = 4 * lim.file_size_mb * 1024 * 1024
                argv = [*_bwrap_argv(exe, tmp, fd, tmp_bytes), *command]
                returncode, timed_out, seconds = _run_child(argv, work, lim.timeout_s, (fd,))
        else:
            returncode, timed_out, seconds = _run_child(command, work, lim.timeout_s, ())
        cap = lim.file_size_mb * 1024 * 1024 + 1
        stdout = _read_capped(work / "stdout", cap)
        stderr = _read_capped(work / "stderr", cap).decode("utf-8", "replace")
    return ChildRun(returncode, timed_out, seconds, stdout, stderr, used)


def _rlimit_args(lim: Limits) -> list[str]:
    """The bootstrap's (resource, soft, hard) triples, flattened: address space, CPU time
    (hard one second above soft, so that SIGXCPU comes first), file size, no core files."""
    memory = lim.memory_mb * 1024 * 1024
    fsize = lim.file_size_mb * 1024 * 1024
    triples = [
        (resource.RLIMIT_AS, memory, memory),
        (resource.RLIMIT_CPU, lim.cpu_s, lim.cpu_s + 1),
        (resource.RLIMIT_FSIZE, fsize, fsize),
        (resource.RLIMIT_CORE, 0, 0),
    ]
    return [str(v) for triple in triples for v in triple]


def _run_child(
    argv: list[str], work: Path, timeout_s: float, pass_fds: tuple[int, ...]
) -> tuple[int, bool, float]:
    """Run ``argv`` in ``work`` with a clean environment, stdout and stderr into files
    there, in a new session whose process group is killed at the end or after
    ``timeout_s``; returns (exit status, whether the wall clock ended it, seconds)."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(work), "TMPDIR": str(work), "LANG": "C.UTF-8"}
    env.update(_ONE_THREAD_ENV)
    timed_out = False
    start = time.monotonic()
    with open(work / "stdout", "wb") as out, open(work / "stderr", "wb") as err:
        proc = subprocess.Popen(
            argv,
            cwd=work,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            start_new_session=True,
            close_fds=True,
            pass_fds=pass_fds,
        )
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            _kill_group(proc.pid)
            proc.wait()
    return proc.returncode, timed_out, time.monotonic() - start


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
