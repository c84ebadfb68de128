#!/usr/bin/env bash
# Build llama-cpp-python for the CPU this runs on, once, and install it into the active venv.
#
# llama.cpp's GGML_NATIVE=ON build crashed with SIGILL on an AMX CPU (tilezero on multi-token
# batches), so the build is never native: the instruction sets come from /proc/cpuinfo, and
# AMX stays off. The wheel is kept in $SMCSPEC_CACHE/wheels/<flags hash>/ so that a later
# setup on the same CPU installs it in seconds, and a CPU with other features builds its own.
set -euo pipefail
VERSION="0.3.36"
flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
has() { [[ " $flags " == *" $1 "* ]] && echo ON || echo OFF; }
args="-DGGML_NATIVE=OFF -DGGML_AVX=$(has avx) -DGGML_AVX2=$(has avx2) -DGGML_FMA=$(has fma)"
args+=" -DGGML_F16C=$(has f16c) -DGGML_BMI2=$(has bmi2) -DGGML_AVX_VNNI=$(has avx_vnni)"
args+=" -DGGML_AVX512=$(has avx512f) -DGGML_AVX512_VBMI=$(has avx512vbmi)"
args+=" -DGGML_AVX512_VNNI=$(has avx512_vnni) -DGGML_AVX512_BF16=$(has avx512_bf16)"
args+=" -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
args+=" -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF"
key=$(printf '%s %s' "$VERSION" "$args" | sha256sum | cut -c1-16)
dir="${SMCSPEC_CACHE:-$HOME/.cache/smcspec}/wheels/llamacpp-$key"
if ! ls "$dir"/llama_cpp_python-"$VERSION"-*.whl >/dev/null 2>&1; then
    echo "setup: building llama-cpp-python $VERSION for this CPU (several minutes, once)"
    echo "setup: CMAKE_ARGS=$args"
    mkdir -p "$dir"
    CMAKE_ARGS="$args" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
        python -m pip wheel --quiet --no-deps --no-cache-dir --no-binary llama-cpp-python \
        -w "$dir" "llama-cpp-python==$VERSION"
fi
python -m pip install --quiet --no-deps "$dir"/llama_cpp_python-"$VERSION"-*.whl
python -m pip install --quiet "diskcache>=5.6" "jinja2>=2.11"  # its runtime needs
