#!/usr/bin/env bash
# Build llama-cpp-python for the machine this runs on, once, and install it into the active
# venv (run by scripts/setup.sh after smcspec itself is installed).
#
# The build is chosen by scripts/llamacpp_build.py (a pure function of the host, unit
# tested): CUDA where nvidia-smi and nvcc are found, Metal on Apple Silicon, the CPU otherwise;
# RPC (llama.cpp's rpc-server protocol) in every build. llama.cpp's GGML_NATIVE=ON build crashed
# with SIGILL on an AMX CPU (tilezero on multi-token batches), so the build is never native:
# the instruction sets come from /proc/cpuinfo, and AMX stays off. The wheel is kept in
# $SMCSPEC_CACHE/wheels/<flags hash>/ so that a later setup on the same machine installs it in
# seconds, and a machine with other features builds its own.
set -euo pipefail
VERSION="0.3.36"
plan=$(python "$(dirname "$0")/llamacpp_build.py")
accelerator=$(printf '%s\n' "$plan" | sed -n 1p)
args=$(printf '%s\n' "$plan" | sed -n 2p)
key=$(printf '%s %s' "$VERSION" "$args" | sha256sum | cut -c1-16)
dir="${SMCSPEC_CACHE:-$HOME/.cache/smcspec}/wheels/llamacpp-$key"
if ! ls "$dir"/llama_cpp_python-"$VERSION"-*.whl >/dev/null 2>&1; then
    echo "setup: building llama-cpp-python $VERSION for $accelerator (several minutes, once)"
    echo "setup: CMAKE_ARGS=$args"
    mkdir -p "$dir"
    CMAKE_ARGS="$args" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
        python -m pip wheel --quiet --no-deps --no-cache-dir --no-binary llama-cpp-python \
        -w "$dir" "llama-cpp-python==$VERSION"
fi
# --force-reinstall: a venv holding another build of the same version gets this one
python -m pip install --quiet --no-deps --force-reinstall "$dir"/llama_cpp_python-"$VERSION"-*.whl
python -m pip install --quiet "diskcache>=5.6" "jinja2>=2.11"  # its runtime needs
