#!/usr/bin/env bash
# Build llama.cpp's shared libraries from source and copy them into one folder:
#
#   scripts/build_llamacpp_libs.sh SRC_DIR OUT_DIR
#
# SRC_DIR: a llama.cpp tree (e.g. .campaign/llama.cpp, made by scripts/prepare_gpu_campaign.sh).
# OUT_DIR: where every lib*.so* lands (libllama, libggml, libggml-base, libggml-cpu,
#          libggml-rpc, and libggml-cuda on a CUDA machine). Then
#            LLAMA_CPP_LIB_PATH=OUT_DIR PYTHONPATH=.campaign python -c "import llama_cpp"
#          loads them: llama_cpp loads OUT_DIR/libllama.so, and the loader finds its ggml
#          libraries through their RUNPATH, $ORIGIN (CMAKE_BUILD_RPATH_USE_ORIGIN), so they must
#          stay together; the CUDA runtime and cuBLAS come from the toolkit's folder, kept as
#          an absolute RUNPATH. With OUT_DIR=.campaign/llama_cpp/lib no LLAMA_CPP_LIB_PATH is
#          needed, and smcspec's RPC code (which looks for libggml in llama_cpp/lib) works.
#
# The CMake arguments are the second line of `python scripts/llamacpp_build.py` (the
# build planner: CUDA with the card's CMAKE_CUDA_ARCHITECTURES where nvidia-smi and nvcc are
# found, RPC always, the CPU's instruction sets), plus, here only:
#   LLAMA_BUILD_APP/SERVER/TOOLS=OFF   the trimmed tree has no app/ nor tools/ (llama-cpp-python
#                                      needs neither); common/ and examples only for --tools
#   GGML_CUDA_NCCL=OFF                 one GPU: no NCCL to find or link
#   CMAKE_BUILD_RPATH_USE_ORIGIN=ON    the libraries find each other once copied together
# The CUDA kernels are otherwise llama.cpp's defaults (docs/build.md, "Performance Tuning"):
# flash attention compiled (GGML_CUDA_FA=ON, passed explicitly: llama.cpp turns flash attention
# on by itself where the GPU supports it, so these kernels are in the decode's path), and its
# vector kernels only for the K-V type pairs of GGML_CUDA_FA_QUANTS' default,
# q4_0-q4_0;q8_0-q8_0;f16-f16;bf16-bf16 (4 of 49; llama.cpp's K-V cache is f16 unless told
# otherwise, whatever the weights' type). GGML_CUDA_FA_ALL_QUANTS is a deprecated alias of
# GGML_CUDA_FA_QUANTS=all and stays unset. The compile is cut mainly by the planner's single
# CMAKE_CUDA_ARCHITECTURES (90 on an H100/H200) instead of the default list (75-virtual to
# 121a-real, seven entries under CUDA 13), and by building only the llama target (no tools,
# tests, examples, common).
#
# The build folder is $LLAMACPP_BUILD_DIR (default ${TMPDIR:-/tmp}/llamacpp-build); a second
# run rebuilds only what changed. Prints the elapsed seconds.
#
#   scripts/build_llamacpp_libs.sh --tools SRC_DIR OUT_DIR
#
# builds llama.cpp's own llama-speculative in the same build folder (after the libraries: the
# ggml kernels are compiled once) and copies it, with libllama-common, into OUT_DIR; its
# RUNPATH ($ORIGIN) finds the libraries there. Where SRC_DIR has common/ and
# examples/speculative/ both calls configure with LLAMA_BUILD_COMMON=ON and
# LLAMA_BUILD_EXAMPLES=ON (the same cache, so the second call reconfigures nothing), no HTTPS
# (LLAMA_OPENSSL=OFF) and no subprocess support; else as below.
set -euo pipefail
tools=0
if [ "${1:-}" = --tools ]; then
    tools=1
    shift
fi
if [ $# -ne 2 ]; then
    echo "usage: $0 [--tools] SRC_DIR OUT_DIR" >&2
    exit 2
fi
src=$(cd "$1" && pwd)
mkdir -p "$2"
out=$(cd "$2" && pwd)
build="${LLAMACPP_BUILD_DIR:-${TMPDIR:-/tmp}/llamacpp-build}"
repo=$(cd "$(dirname "$0")/.." && pwd)
start=$(date +%s)

# nvcc may be installed but off the PATH (the planner looks in /usr/local/cuda/bin too)
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
    export PATH="/usr/local/cuda/bin:$PATH"
    export CUDACXX="${CUDACXX:-/usr/local/cuda/bin/nvcc}"
fi
plan=$("${PYTHON:-python3}" "$repo/scripts/llamacpp_build.py")
accelerator=$(printf '%s\n' "$plan" | sed -n 1p)
read -r -a plan_args <<<"$(printf '%s\n' "$plan" | sed -n 2p)"
common=OFF
if [ -d "$src/common" ] && [ -d "$src/examples/speculative" ]; then
    common=ON  # llama-speculative can be built (--tools)
elif [ "$tools" = 1 ]; then
    echo "build: $src has no common/ and examples/speculative/: no llama-speculative" >&2
    exit 1
fi
args=(
    -DBUILD_SHARED_LIBS=ON
    -DCMAKE_BUILD_TYPE=Release
    -DCMAKE_BUILD_RPATH_USE_ORIGIN=ON
    -DLLAMA_BUILD_APP=OFF
    -DLLAMA_BUILD_SERVER=OFF
    "${plan_args[@]}"
    # after the planner's (which turns examples off): the last -D of a name wins
    -DLLAMA_BUILD_COMMON=$common
    -DLLAMA_BUILD_EXAMPLES=$common
    -DLLAMA_BUILD_TESTS=OFF
    -DLLAMA_BUILD_TOOLS=OFF
    -DLLAMA_OPENSSL=OFF
    -DLLAMA_SUBPROCESS=OFF
)
if [ "$accelerator" = cuda ]; then
    args+=(-DGGML_CUDA_NCCL=OFF -DGGML_CUDA_FA=ON)
fi
generator=()
if command -v ninja >/dev/null 2>&1; then
    generator=(-G Ninja)
fi
echo "build: $accelerator build of $src in $build"
echo "build: cmake ${args[*]}"
cmake -S "$src" -B "$build" "${generator[@]}" "${args[@]}"
if [ "$tools" = 1 ]; then
    cmake --build "$build" --config Release --target llama-speculative -j"$(nproc)"
    cp -a "$build/bin/llama-speculative" "$out/"
else
    cmake --build "$build" --config Release --target llama -j"$(nproc)"
fi

# every shared library the build made (libllama needs each of them), symlinks kept
shopt -s nullglob
libs=("$build"/bin/lib*.so*)
if [ ${#libs[@]} -eq 0 ]; then
    echo "build: no lib*.so* in $build/bin" >&2
    exit 1
fi
cp -a "${libs[@]}" "$out/"
ls -l "$out"
echo "build: $accelerator libraries in $out after $(($(date +%s) - start)) s"
