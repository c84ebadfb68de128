"""Virtual environments for the third-party clients the server is tested with (lm-eval,
aiperf), made once per machine and reused.

Neither client goes into the project's own environment: ``lm-eval[api]`` adds 46 packages
(102 MB of wheels: pyarrow, pandas, scikit-learn, datasets, ...) and ``aiperf`` 87 (138 MB:
dash, plotly, kubernetes-asyncio, ...), and aiperf pins older ``prometheus-client`` and
``huggingface-hub`` than the project's (``pip install --dry-run``, 2026-12; neither asks for
torch). Each gets a venv of its own under ``$SMCSPEC_CLIENT_VENVS`` (default
``~/.cache/smcspec/client-venvs``) that sees the project's packages through a ``.pth`` file
(transformers, numpy, ... are not installed twice) and installs only what the client adds or
pins differently, in its own ``site-packages``, ahead of the project's on its path. A venv is
made once (a few minutes; an exclusive file lock keeps concurrent test processes from
building it twice) and found ready by every later run: in the background from the start of a
session whose selected tests name the client (``@pytest.mark.clients``)
(:func:`prebuild`, tests/conftest.py), or else by the first test that needs it.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
import sysconfig
from collections.abc import Iterable
from pathlib import Path

import pytest

CLIENTS = {
    "lm-eval": ("lm-eval[api]==0.4.13",),
    "aiperf": ("aiperf==0.13.0",),
}
"""Each client's pinned requirements (the versions the issue was reproduced with)."""

INSTALL_TIMEOUT_S = 1800


def venv_root() -> Path:
    return Path(os.environ.get("SMCSPEC_CLIENT_VENVS", Path.home() / ".cache/smcspec/client-venvs"))


def _home(name: str) -> Path:
    parent = sysconfig.get_paths()["purelib"]
    tag = hashlib.sha256("\n".join([parent, *CLIENTS[name]]).encode()).hexdigest()[:10]
    return venv_root() / f"{name}-{tag}"


def prebuild(names: Iterable[str]) -> subprocess.Popen | None:
    """Start making the venvs of the clients ``names`` that are not ready, one after another
    in a background process (log: ``prebuild.log`` under :func:`venv_root`), so that pip's
    downloads overlap the tests that run before the first client test; that test then finds
    its venv ready or waits on its lock. None when every venv is ready already."""
    missing = [n for n in names if not (_home(n) / ".ready").exists()]
    if not missing:
        return None
    venv_root().mkdir(parents=True, exist_ok=True)
    code = "import sys, client_venvs\nfor n in sys.argv[1:]: client_venvs.client_bin(n)"
    here = str(Path(__file__).resolve().parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}
    with open(venv_root() / "prebuild.log", "w") as log:
        return subprocess.Popen(
            [sys.executable, "-c", code, *missing], cwd=here, env=env, stdout=log, stderr=log
        )


def client_bin(name: str) -> Path:
    """The ``bin`` directory of client ``name``'s venv, made if missing (see the module
    notes). Fails the test with pip's output when the install fails."""
    parent = sysconfig.get_paths()["purelib"]
    home = _home(name)
    ready = home / ".ready"
    if ready.exists():
        return home / "bin"
    home.parent.mkdir(parents=True, exist_ok=True)
    with open(home.parent / f"{home.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not ready.exists():
            _build(home, parent, CLIENTS[name])
            ready.write_text("ok\n")
    return home / "bin"


def _build(home: Path, parent: str, requirements: tuple[str, ...]) -> None:
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(home)], check=True)
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = subprocess.run(
        [str(home / "bin/python"), "-c", code], check=True, capture_output=True, text=True
    ).stdout.strip()
    Path(site, "_smcspec_parent.pth").write_text(parent + "\n")
    # --no-compile: a client imports a fraction of what it installs, and Python compiles that
    # fraction on first import (pip's compiling of every module was 29 s of the two venvs'
    # 66 s of CPU on the 2-core AMD EPYC VM, 2026-12-07)
    cmd = [str(home / "bin/python"), "-m", "pip", "install", "-q", "--no-compile", *requirements]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    if done.returncode != 0:
        pytest.fail(f"could not install {requirements} into {home}:\n{done.stderr[-3000:]}")


def offline_env(**extra: str) -> dict[str, str]:
    """The environment a client runs in: no Hugging Face hub access (its tasks, datasets and
    tokenizer are local files), no proxy for loopback."""
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    env |= {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "NO_PROXY": "127.0.0.1,localhost", "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
    return env | extra
