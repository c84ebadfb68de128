"""Running untrusted Python (a model's code) in a child process: bubblewrap, or rlimits only.

Used by HumanEval's hidden tests (:mod:`smcspec.eval.humaneval`) and by the execution reward
(:mod:`smcspec.rewards.code`). :func:`run_python` writes the program into a fresh temporary
directory and runs ``python -I -B program.py`` there, with a clean environment (``PATH``,
``HOME`` and ``TMPDIR`` = that directory, ``LANG``, and one thread for the thread pools of
OpenBLAS, OpenMP, MKL and numexpr), stdin from ``/dev/null``, stdout and stderr into two
files without a name that the caller opens before the program starts and reads back
(capped) through its own descriptors, in its own session, the whole process group killed
at the end or at the wall-clock limit. The caller opens nothing by a name the program
controls: whatever the program leaves in its directory (links to host files, FIFOs,
folders without permissions) is neither read nor followed, and the directory is removed
(:func:`_remove_tree`). Before the program starts, a bootstrap sets ``RLIMIT_AS``,
``RLIMIT_CPU``, ``RLIMIT_FSIZE``, ``RLIMIT_CORE`` and ``RLIMIT_NOFILE`` (256 descriptors)
and ``exec``s the interpreter (no ``preexec_fn``, which is unsafe in a threaded parent such
as torch).

Two isolation levels (``sandbox=``):

* ``"bwrap"``: under bubblewrap (https://github.com/containers/bubblewrap; Debian package
  ``bubblewrap``). What it guarantees, run as root (the default user of most containers)
  and as any other user alike (``tests/test_sandbox.py`` checks each point both ways):

  - **No capabilities.** The program's effective, permitted, inheritable, ambient and
    bounding sets are all empty: bubblewrap drops every capability but ``CAP_SETPCAP``
    (``--cap-drop ALL --cap-add CAP_SETPCAP``; as a user other than root it runs in a new
    user namespace, which grants none outside it), with which the bootstrap empties the
    bounding set (``prctl(PR_CAPBSET_DROP)``, which bubblewrap run as root leaves the
    caller's) before it drops that one too and runs the program; ``no_new_privs`` keeps an
    ``exec`` from gaining any: a program running as root cannot remount the filesystem,
    change its uid or reach a device.
  - **A minimal, read-only view of the host.** Only what the interpreter needs is there:
    ``/usr``, ``/bin`` and ``/lib*`` (links kept as links), the ``/etc`` entries the dynamic
    loader and Python read (:data:`_ETC_ENTRIES`), and the interpreter's own folders (its
    prefixes, e.g. a virtual environment: nothing else of the folder that holds it), all
    read-only, on a read-only root. ``/root``, ``/home``, ``/run``, ``/var``, ``/srv``,
    ``/opt``, ``/mnt``, ``/sys``, the user's ``$HOME`` and the project checkout are absent
    (but for the interpreter's folders where they lie inside one of them), and so are the
    host's UNIX sockets. No host folder is writable.
  - **Kernel settings read-only.** ``/proc`` is private (this sandbox's processes only);
    the entries Docker's default container spec makes read-only (``/proc/sys``,
    ``/proc/sysrq-trigger``, ``/proc/irq``, ``/proc/bus``, ``/proc/fs``) are read-only
    mounts, and those it masks (``/proc/kcore``, ``/proc/keys``, ``/proc/timer_list``,
    ``/proc/interrupts``, ``/proc/acpi``, ...: :data:`_PROC_MASKED`) read as nothing, where
    they exist (:data:`_PROC_PATHS_SOURCE`). The kernel checks only the uid for
    ``/proc/sys``, so without this root could write ``kernel/core_pattern`` (a program the
    host runs as root at the next crash), and bubblewrap's own cover skips ``/proc/sys``.
  - **What it writes is bounded in total, in memory.** The only writable places are three
    size-capped tmpfs mounts: its working directory (the temporary directory's path, a
    tmpfs inside the sandbox: ``program.py`` is bound into it read-only, nothing it writes
    reaches the host's disk), ``/tmp`` and ``/dev/shm``, each of
    :attr:`Limits.tmpfs_bytes` (``4 * file_size_mb`` MiB, at most ``memory_mb / 3``), so
    together at most ``memory_mb`` MiB beside its address space (``RLIMIT_AS``): a run
    holds at most ``2 * memory_mb`` MiB of the host's memory in files and mappings, plus
    its stdout and stderr, at most ``file_size_mb`` MiB each, on the caller's disk.
    ``/dev`` (null, zero, random, ...) is read-only but for its devices; ``memfd_create``
    and SysV shared memory and message queues, which no limit counts, are denied. Where
    bubblewrap lacks ``--size`` (before 0.7) the tmpfs mounts have no size and this bound
    does not hold.
  - **New namespaces**: network (loopback only: no route out, not even to the host's
    loopback), PID, IPC, UTS (host name ``sandbox``) and cgroup where available; killed
    with its parent.
  - **A seccomp filter** (libseccomp through ``pyseccomp``, installed by bubblewrap's
    ``--seccomp``) that makes the calls a test program never needs fail with ``EPERM``
    (:data:`DENIED_SYSCALLS`): new processes and threads (``RLIMIT_NPROC`` would not do: the
    kernel does not enforce it for root), mounts, namespaces, ``chroot``, ``ptrace`` and
    other processes' memory, BPF, perf events, kernel modules, kexec, reboot, kernel
    keyrings, ``userfaultfd``, file handles, io_uring (whose requests seccomp cannot see),
    ``memfd_create``, ``shmget``, ``msgget``; and ``socket`` for every family but
    ``AF_UNIX``. Calls of another ABI (32-bit x86 or x32 on x86-64) kill the program. The
    list is modelled on Docker's default profile (:data:`SECCOMP_PROFILE_SOURCE`): what
    Docker allows a container only with a capability the sandbox does not have, or never,
    plus io_uring, the memory no limit counts and the socket rule.
  - **Resource limits**: address space, CPU time, file size, descriptors, no core files,
    wall clock.

  What it does not guarantee: the program runs as the calling user's uid (root stays uid 0,
  without capabilities); it shares the host's kernel (a kernel bug reachable by the allowed
  calls is out of its reach to stop); it can read what the interpreter's folders hold, the
  host's kernel settings (``/proc/sys``, read-only) and what the rest of ``/proc`` shows of
  the machine (CPUs, memory, load, uptime); it can measure time and the CPU (timing side
  channels on other work of the machine: caches, branch predictors, frequency); it can use
  the whole CPU time and memory of its limits; kernel memory that no limit counts remains:
  the inodes of the files and folders it creates in its tmpfs mounts (about 1 KiB each;
  bubblewrap cannot set tmpfs's ``nr_inodes``, so only the wall clock bounds their number:
  430,000 empty files in 3 s measured on a 2-core VM, ~400 MiB, freed when the run ends)
  and the buffers of its at most 256 descriptors (pipes, UNIX sockets, pseudo-terminals);
  no cgroup bounds the sum; and it can read its own source (HumanEval's sentinel is
  therefore no secret from it). Run as a user other than root, bubblewrap needs
  unprivileged user namespaces.
* ``"rlimit"``: the resource limits only. The code runs as the calling user with its
  filesystem and network: it can read what the user can read, write outside its directory
  (each file capped by ``RLIMIT_FSIZE``: the total on the host's disk is not bounded, nor
  are ``/dev/shm`` and the memory of tmpfs mounts it can write), open sockets and fork (only
  the CPU and wall-clock limits bound a fork bomb, and a process that leaves the session
  outlives the run). The caller still reads its output through descriptors and removes its
  directory without following links. Use it only for trusted code, or inside a container.
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
import stat
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING

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
    # memory no limit counts (Docker allows these): files in memory on no mount
    # (memfd_create: RLIMIT_FSIZE bounds each, nothing their sum), SysV shared memory
    # segments and message queues, which keep their pages after the program unmaps them
    "memfd_create", "shmget", "msgget",
)  # fmt: skip

# socket(2) succeeds for this family only (Docker denies AF_VSOCK alone); the host's UNIX
# sockets lie outside the sandbox's view of the filesystem
_ALLOWED_SOCKET_FAMILY = 1  # AF_UNIX

# The /proc entries Docker's default container spec makes read-only (``ReadonlyPaths``) and
# hides (``MaskedPaths``: a file behind /dev/null, a folder behind an empty read-only
# tmpfs), in moby/moby daemon/pkg/oci/defaults.go (_PROC_PATHS_SOURCE). Writing
# /proc/sys/kernel/core_pattern names a program the host kernel runs as root at the next
# crash, and the kernel checks only the uid for the files of /proc/sys (root without
# capabilities may write them); bubblewrap's own cover of /proc/sys is skipped, because its
# write check (access(2) on the folder) says EACCES. Docker's /sys entries (/sys/firmware,
# /sys/devices/virtual/powercap, the CPUs' thermal_throttle) are moot: no /sys is mounted.
_PROC_PATHS_SOURCE = "https://github.com/moby/moby/blob/master/daemon/pkg/oci/defaults.go"
_PROC_READONLY = ("bus", "fs", "irq", "sys", "sysrq-trigger")
_PROC_MASKED = (
    "acpi", "asound", "interrupts", "kcore", "keys", "latency_stats", "sched_debug", "scsi",
    "timer_list", "timer_stats",
)  # fmt: skip

# Descriptors the program may hold open (RLIMIT_NOFILE): each may hold kernel buffers (a
# pipe's, a socket's) that no other limit counts, so their number is kept small.
_OPEN_FILES = 256

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
if sys.argv[1] == "drop-caps":  # under bwrap, holding CAP_SETPCAP only: see _DROP_CAPS
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    cap = 0
    while libc.prctl(24, cap, 0, 0, 0) == 0:  # PR_CAPBSET_DROP, up to the last one (EINVAL)
        cap += 1
    if ctypes.get_errno() != 22 or cap == 0:
        sys.exit(f"sandbox: cannot drop capability {cap}: errno {ctypes.get_errno()}")
    libc.prctl(47, 4, 0, 0, 0)  # PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    if libc.capset(header, (ctypes.c_uint32 * 6)()) != 0:  # no effective/permitted/inheritable
        sys.exit(f"sandbox: capset failed: errno {ctypes.get_errno()}")
args = [int(x) for x in sys.argv[2:-1]]
for i in range(0, len(args), 3):
    res, soft, hard = args[i:i + 3]
    cur_soft, cur_hard = resource.getrlimit(res)
    if cur_hard != resource.RLIM_INFINITY:
        hard = min(hard, cur_hard)
        soft = min(soft, hard)
    resource.setrlimit(res, (soft, hard))
os.execv(sys.executable, [sys.executable, "-I", "-B", sys.argv[-1]])
"""


# bubblewrap's capability options: none but CAP_SETPCAP, which the bootstrap (before it runs
# the program: _BOOTSTRAP) uses to empty the bounding set, then drops with the rest. bwrap
# run as root (no user namespace) with "--cap-drop ALL" alone empties the effective,
# permitted, inheritable and ambient sets but leaves the bounding set the caller's
# (000001fffeffffff here): harmless while no_new_privs holds, as no exec can then gain a
# capability, yet Docker drops it, and only a holder of CAP_SETPCAP can.
_DROP_CAPS = ["--cap-drop", "ALL", "--cap-add", "CAP_SETPCAP"]

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
            also caps the captured stdout and stderr; under bwrap its working directory,
            ``/tmp`` and ``/dev/shm`` each hold at most :attr:`tmpfs_bytes`.
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

    @property
    def tmpfs_bytes(self) -> int:
        """Bytes each of the sandbox's three writable tmpfs mounts (the working directory,
        ``/tmp``, ``/dev/shm``) holds under bwrap: ``4 * file_size_mb`` MiB, at most a third
        of ``memory_mb``, so that together they hold at most ``memory_mb`` MiB (> 0)."""
        mib = 1024 * 1024
        return min(4 * self.file_size_mb * mib, self.memory_mb * mib // 3)


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
    namespaces, view of the host and seccomp filter, every capability dropped, the bounding
    set's too: the bootstrap with no program), and libseccomp loads; probed once per
    process (a container may forbid the namespaces bwrap needs)."""
    exe = shutil.which("bwrap")
    if exe is None:
        return False
    try:
        _seccomp_bpf()
    except (ImportError, OSError):
        return False
    probe = [sys.executable, "-I", "-c", _BOOTSTRAP, "drop-caps", os.devnull]  # caps dropped
    try:
        with tempfile.TemporaryDirectory(prefix="smcspec-probe-") as work:
            return _run_bwrap_probe(exe, work, probe)
    except (OSError, subprocess.SubprocessError):
        return False


def _run_bwrap_probe(exe: str, work: str, command: list[str]) -> bool:
    with _seccomp_fd() as fd:
        proc = subprocess.run(
            [*_bwrap_argv(exe, work, fd, 1 << 20, None), *command],
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


def _bwrap_argv(
    exe: str, workdir: str, seccomp_fd: int, tmpfs_bytes: int, program: str | None
) -> list[str]:
    """bubblewrap's arguments (module docstring): the host view; private /dev (read-only
    but for its devices and /dev/shm), /proc (its kernel settings read-only, Docker's
    masked entries hidden) and /tmp; the interpreter's folders; ``workdir`` a private
    tmpfs (the working directory) with ``program`` (a host file, or None) bound read-only
    at its own path; a read-only root. /dev/shm, /tmp and ``workdir`` hold at most
    ``tmpfs_bytes`` each where bwrap supports ``--size``. New namespaces (and a user
    namespace unless root), no capabilities, the seccomp filter read from ``seccomp_fd``."""
    size = ["--size", str(tmpfs_bytes)] if _bwrap_supports(exe, "--size") else []
    argv = [exe, *_host_view()]
    argv += ["--dev", "/dev", *size, "--tmpfs", "/dev/shm", "--remount-ro", "/dev"]
    argv += ["--proc", "/proc", *_proc_cover(), *size, "--tmpfs", "/tmp"]
    for path in _interpreter_paths():
        argv += ["--ro-bind", path, path]
    argv += [*size, "--tmpfs", workdir]
    if program is not None:
        argv += ["--ro-bind", program, program]
    argv += ["--chdir", workdir, "--remount-ro", "/"]
    argv += ["--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts"]
    argv += ["--unshare-cgroup-try", "--hostname", "sandbox"]
    if os.geteuid() != 0:
        argv.append("--unshare-user")
    argv += [*_DROP_CAPS, "--seccomp", str(seccomp_fd)]
    return [*argv, "--die-with-parent", "--new-session"]


def _proc_cover() -> list[str]:
    """bwrap arguments, after ``--proc /proc``, that bind the entries of
    :data:`_PROC_READONLY` read-only (the caller's: the same kernel's settings; bwrap binds
    from the host only) and hide those of :data:`_PROC_MASKED`, each where it exists (a
    mount needs its mount point)."""
    args: list[str] = []
    for name in _PROC_READONLY:
        path = f"/proc/{name}"
        if os.path.exists(path):
            args += ["--ro-bind", path, path]
    for name in _PROC_MASKED:
        path = f"/proc/{name}"
        if os.path.isdir(path):
            args += ["--tmpfs", path, "--remount-ro", path]
        elif os.path.exists(path):
            args += ["--ro-bind", "/dev/null", path]
    return args


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
        A :class:`ChildRun`; nothing the program does makes this raise or wait past the
        limits.

    Raises:
        ConfigError: unknown ``sandbox``, or ``"bwrap"`` where bubblewrap cannot run.
    """
    lim = limits or Limits()
    used = _resolve(sandbox)
    tmp = tempfile.mkdtemp(prefix="smcspec-run-", dir=workdir_parent)
    try:
        work = Path(tmp)
        prog_path = work / "program.py"
        prog_path.write_text(program, encoding="utf-8")
        caps = "drop-caps" if used == "bwrap" else "keep-caps"
        command = [sys.executable, "-I", "-c", _BOOTSTRAP, caps, *_rlimit_args(lim), str(prog_path)]
        # stdout and stderr: files without a name, opened here before the program starts
        # and read back through these descriptors: nothing the program does to the names
        # in its directory (a link to a host file, a FIFO) reaches the caller
        with tempfile.TemporaryFile(dir=tmp) as out, tempfile.TemporaryFile(dir=tmp) as err:
            if used == "bwrap":
                with _seccomp_fd() as fd:
                    exe = shutil.which("bwrap") or "bwrap"
                    bwrap = _bwrap_argv(exe, tmp, fd, lim.tmpfs_bytes, str(prog_path))
                    result = _run_child([*bwrap, *command], work, lim.timeout_s, (fd,), out, err)
            else:
                result = _run_child(command, work, lim.timeout_s, (), out, err)
            cap = lim.file_size_mb * 1024 * 1024 + 1
            stdout = _read_capped(out.fileno(), cap)
            stderr = _read_capped(err.fileno(), cap).decode("utf-8", "replace")
    finally:
        _remove_tree(tmp)
    return ChildRun(*result, stdout, stderr, used)


def _rlimit_args(lim: Limits) -> list[str]:
    """The bootstrap's (resource, soft, hard) triples, flattened: address space, CPU time
    (hard one second above soft, so that SIGXCPU comes first), file size, no core files,
    :data:`_OPEN_FILES` descriptors."""
    memory = lim.memory_mb * 1024 * 1024
    fsize = lim.file_size_mb * 1024 * 1024
    triples = [
        (resource.RLIMIT_AS, memory, memory),
        (resource.RLIMIT_CPU, lim.cpu_s, lim.cpu_s + 1),
        (resource.RLIMIT_FSIZE, fsize, fsize),
        (resource.RLIMIT_CORE, 0, 0),
        (resource.RLIMIT_NOFILE, _OPEN_FILES, _OPEN_FILES),
    ]
    return [str(v) for triple in triples for v in triple]


def _run_child(
    argv: list[str],
    work: Path,
    timeout_s: float,
    pass_fds: tuple[int, ...],
    stdout: IO[bytes],
    stderr: IO[bytes],
) -> tuple[int, bool, float]:
    """Run ``argv`` in ``work`` with a clean environment, stdout and stderr into the files
    given, in a new session whose process group is killed at the end or after
    ``timeout_s``; returns (exit status, whether the wall clock ended it, seconds)."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(work), "TMPDIR": str(work), "LANG": "C.UTF-8"}
    env.update(_ONE_THREAD_ENV)
    timed_out = False
    start = time.monotonic()
    proc = subprocess.Popen(
        argv,
        cwd=work,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=stderr,
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


def _read_capped(fd: int, limit: int) -> bytes:
    """At most ``limit`` bytes from the start of the regular file open as ``fd`` (the
    caller's own: a read cannot block)."""
    chunks: list[bytes] = []
    size = 0
    while size < limit:
        chunk = os.pread(fd, limit - size, size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def _remove_tree(path: str) -> None:
    """Remove the run's directory and all in it without following a link out of it or
    opening anything in it but folders: each real folder (``lstat``) is first made the
    owner's to write and search again (a program may have taken the bits away), then
    :func:`shutil.rmtree` unlinks links and FIFOs as names (its walk by descriptors follows
    no link); a directory replaced by a link loses the link only. Under bwrap the program
    never sees this directory (a tmpfs covers it); under rlimit nothing of the program's
    runs by now but what it detached (trusted code). Errors are ignored: a leftover
    directory must not turn a run into an exception."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):  # replaced (rlimit): drop the name only
            os.unlink(path)
            return
        os.chmod(path, 0o700)
    except OSError:
        pass
    for root, dirs, _files in os.walk(path):  # does not descend into links
        for name in dirs:
            sub = os.path.join(root, name)
            with contextlib.suppress(OSError):
                if stat.S_ISDIR(os.lstat(sub).st_mode):
                    os.chmod(sub, 0o700)
    shutil.rmtree(path, ignore_errors=True)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
