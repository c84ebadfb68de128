"""``scripts/file_durations.py``: the seconds per test file the suite's scheduler sends
out longest first (``tests/conftest.py``), from pytest's ``--durations=0`` report; and the
committed ``tests/file_durations.json`` names only files that exist."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from file_durations import file_seconds  # noqa: E402

REPORT = """\
============================= slowest durations ==============================
81.00s call     tests/test_gpu_campaign.py::test_cpu_rehearsal_runs_every_step
37.53s setup    tests/test_integration_real.py::test_real_draft_forward_matches_transformers
2.14s call     tests/test_integration_real.py::test_real_draft_forward_matches_transformers
0.01s teardown tests/test_tuning.py::test_a_corrupt_cache_file_is_measured_again[\\xff\\xfe]
1.00s call     tests/test_tuning.py::TestGrid::test_one[a::b]

(4604 durations < 0.005s hidden.  Use -vv to show these durations.)
1967 passed, 25 skipped, 38 warnings in 972.49s (0:16:12)
"""


def test_setup_call_and_teardown_sum_per_file():
    assert file_seconds(REPORT.splitlines()) == {
        "tests/test_gpu_campaign.py": 81.0,
        "tests/test_integration_real.py": 39.7,
        "tests/test_tuning.py": 1.0,
    }


def test_a_log_without_durations_is_an_error(tmp_path):
    log = tmp_path / "run.log"
    log.write_text("1967 passed in 972.49s\n")
    script = ROOT / "scripts" / "file_durations.py"
    done = subprocess.run([sys.executable, str(script), str(log)], capture_output=True, text=True)
    assert done.returncode == 2 and "no --durations lines" in done.stderr


def test_the_committed_durations_name_existing_files():
    seconds = json.loads((ROOT / "tests" / "file_durations.json").read_text())
    assert seconds and all((ROOT / f).is_file() for f in seconds), seconds
    assert all(s >= 0 for s in seconds.values())
