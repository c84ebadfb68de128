"""The code sandbox (smcspec.sandbox): what bubblewrap contains, and the rlimit fallback.

Each test starts one short child interpreter (~0.05 s). The bubblewrap tests skip where
bubblewrap cannot run (``scripts/setup.sh`` installs it where apt is available)."""

from __future__ import annotations

import socket
import warnings
from pathlib import Path

import pytest

from smcspec import sandbox
from smcspec.errors import ConfigError
from smcspec.sandbox import Limits, SandboxWarning, run_python

needs_bwrap = pytest.mark.skipif(not sandbox.bwrap_works(), reason="bubblewrap cannot run here")


def _out(run) -> str:
    return run.stdout.decode()


@needs_bwrap
def test_bwrap_runs_ordinary_code_and_writes_its_own_directory(tmp_path: Path) -> None:
    prog = "open('note.txt', 'w').write('x')\nprint(sum(range(10)), open('note.txt').read())\n"
    run = run_python(prog, sandbox="bwrap", workdir_parent=tmp_path)
    assert (run.returncode, _out(run).split(), run.sandbox) == (0, ["45", "x"], "bwrap"), run
    assert list(tmp_path.iterdir()) == []  # the run's directory is removed


@needs_bwrap
def test_bwrap_blocks_the_network(tmp_path: Path) -> None:
    with socket.socket() as server:  # a server on this machine's loopback
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        prog = (
            "import socket\n"
            f"for addr in [('127.0.0.1', {port}), ('1.1.1.1', 53), ('8.8.8.8', 443)]:\n"
            "    try:\n"
            "        socket.create_connection(addr, timeout=2).close()\n"
            "        print('connected', addr)\n"
            "    except OSError as e:\n"
            "        print('refused', type(e).__name__)\n"
        )
        run = run_python(prog, sandbox="bwrap", workdir_parent=tmp_path)
    lines = _out(run).splitlines()
    assert run.returncode == 0 and len(lines) == 3, run
    assert all(line.startswith("refused") for line in lines), lines


@needs_bwrap
def test_bwrap_blocks_writes_outside_its_directory(tmp_path: Path) -> None:
    """Outside /tmp the root is read-only (EROFS); /tmp is a private tmpfs, so what the code
    writes there (here: beside its own directory) never reaches the host."""
    probe = f"smcspec-sandbox-probe-{tmp_path.name}"
    read_only = [Path(__file__).parent / probe, Path.home() / probe, Path("/etc") / probe]
    beside = tmp_path / "outside.txt"
    prog = (
        f"for path in {[str(p) for p in read_only]!r}:\n"
        "    try:\n"
        "        open(path, 'w').write('x')\n"
        "        print('wrote', path)\n"
        "    except OSError as e:\n"
        "        print('denied', e.errno)\n"
        f"open({str(beside)!r}, 'w').write('private /tmp')\n"
    )
    (tmp_path / "w").mkdir()
    run = run_python(prog, sandbox="bwrap", workdir_parent=tmp_path / "w")
    lines = _out(run).splitlines()
    assert run.returncode == 0 and len(lines) == 3, run
    # read-only (EROFS); a checkout under /tmp is not there at all (ENOENT: the private /tmp)
    assert lines[0] in ("denied 30", "denied 2") and lines[1:] == ["denied 30"] * 2, lines
    assert not any(p.exists() for p in [*read_only, beside])


@needs_bwrap
def test_bwrap_blocks_fork_threads_and_subprocesses(tmp_path: Path) -> None:
    prog = (
        "import os, subprocess, threading\n"
        "def attempt(name, fn):\n"
        "    try:\n"
        "        fn()\n"
        "        print(name, 'ran')\n"
        "    except (OSError, RuntimeError) as e:\n"
        "        print(name, 'failed', type(e).__name__)\n"
        "attempt('fork', lambda: os.fork() or os._exit(0))\n"
        "attempt('thread', lambda: threading.Thread(target=print).start())\n"
        "attempt('subprocess', lambda: subprocess.run(['/bin/true']))\n"
    )
    run = run_python(prog, sandbox="bwrap", workdir_parent=tmp_path)
    lines = _out(run).splitlines()
    assert run.returncode == 0 and len(lines) == 3, run
    assert all(" failed " in line for line in lines), lines


@pytest.mark.parametrize("kind", [pytest.param("bwrap", marks=needs_bwrap), "rlimit"])
def test_numpy_imports_in_both_sandboxes_whatever_the_cpus(kind: str, tmp_path: Path) -> None:
    # Under bwrap no thread can start; OpenBLAS used to abort numpy's import (KeyboardInterrupt)
    # wherever the parent saw more than one CPU, so a correct program's verdict depended on
    # the machine. The child is told to use one thread.
    prog = (
        "import os\n"
        "import numpy as np\n"
        "print(np.sort([3, 1, 2]).tolist(), os.environ['OPENBLAS_NUM_THREADS'])\n"
    )
    run = run_python(prog, sandbox=kind, workdir_parent=tmp_path)
    assert run.returncode == 0 and _out(run).strip() == "[1, 2, 3] 1", run


@needs_bwrap
def test_bwrap_enforces_the_time_limit(tmp_path: Path) -> None:
    run = run_python("while True:\n    pass\n", Limits(timeout_s=1), "bwrap", tmp_path)
    assert run.returncode != 0 and run.seconds < 5, run


def test_rlimit_fallback_runs_and_auto_warns_without_bwrap(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(sandbox, "bwrap_works", lambda: False)
    with pytest.warns(SandboxWarning, match="resource limits only"):
        run = run_python("print(6 * 7)\n", workdir_parent=tmp_path)
    assert (run.returncode, _out(run).strip(), run.sandbox) == (0, "42", "rlimit")
    with pytest.raises(ConfigError, match="bubblewrap"):
        run_python("print(1)\n", sandbox="bwrap")


def test_rlimit_runner_is_explicit_and_silent(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run = run_python("print('ok')\n", sandbox="rlimit", workdir_parent=tmp_path)
    assert (run.returncode, _out(run).strip(), run.sandbox) == (0, "ok", "rlimit")


def test_bad_sandbox_and_limits_are_refused() -> None:
    with pytest.raises(ConfigError, match="unknown sandbox"):
        run_python("print(1)\n", sandbox="docker")
    with pytest.raises(ValueError):
        Limits(timeout_s=0)


def test_the_interpreters_folders_under_tmp_stay_visible(monkeypatch, tmp_path: Path) -> None:
    """A virtual environment in a checkout under /tmp (a CI clone) would be hidden by the
    private /tmp: its folders are bound back read-only (found by a clean clone in /tmp)."""
    import sys

    venv = tmp_path / "checkout" / ".venv"
    (venv / "bin").mkdir(parents=True)
    monkeypatch.setattr(sys, "prefix", str(venv))
    monkeypatch.setattr(sys, "exec_prefix", str(venv))
    found = sandbox._interpreter_paths_under(str(tmp_path))
    assert str(venv) in found
    argv = sandbox._bwrap_argv("bwrap", "/")
    after_tmpfs = argv[argv.index("--tmpfs") + 2 :]
    binds = [after_tmpfs[i : i + 3] for i in range(len(after_tmpfs) - 2)]
    if str(venv).startswith("/tmp/"):
        assert ["--ro-bind", str(venv), str(venv)] in binds
