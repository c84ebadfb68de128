#!/usr/bin/env bash
# Build llama.cpp's own speculative decoding tools, llama-speculative (a draft model) and
# llama-lookup (n-gram lookup decoding), from the llama.cpp that llama-cpp-python vendors
# (the version smcspec's llamacpp backend runs), with the CPU flags setup uses
# (scripts/llamacpp_build.py). For benchmarks/llamacpp_speculative.py only: not a dependency
# of smcspec. Built once into $SMCSPEC_CACHE/llamacpp-tools/<version>/bin (a second run only
# prints the folder).
#
#   bash benchmarks/build_llamacpp_tools.sh        # prints the bin folder on its last line
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
version=$("${PYTHON:-$repo/.venv/bin/python}" -c "import importlib.metadata as m; print(m.version('llama-cpp-python'))")
root="${SMCSPEC_CACHE:-$HOME/.cache/smcspec}/llamacpp-tools/$version"
bin="$root/bin"
if [ -x "$bin/llama-speculative" ] && [ -x "$bin/llama-lookup" ]; then
    echo "$bin"
    exit 0
fi
sdist="${SMCSPEC_CACHE:-$HOME/.cache/smcspec}/sdist/llama_cpp_python-$version.tar.gz"
if [ ! -f "$sdist" ]; then
    mkdir -p "$(dirname "$sdist")"
    "${PYTHON:-$repo/.venv/bin/python}" -m pip download --quiet --no-deps --no-binary :all: \
        --dest "$(dirname "$sdist")" "llama-cpp-python==$version"
fi
mkdir -p "$root/src"
tar xzf "$sdist" -C "$root/src" --strip-components=3 "llama_cpp_python-$version/vendor/llama.cpp"
read -r -a plan <<<"$("${PYTHON:-$repo/.venv/bin/python}" "$repo/scripts/llamacpp_build.py" | sed -n 2p)"
# the planner turns examples and tools off for the library build; here they are wanted
args=()
for a in "${plan[@]}"; do
    case "$a" in -DLLAMA_BUILD_EXAMPLES=*|-DLLAMA_BUILD_TOOLS=*|-DGGML_RPC=*) ;; *) args+=("$a") ;; esac
done
start=$(date +%s)
cmake -S "$root/src" -B "$root/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=OFF \
    "${args[@]}" >/dev/null
cmake --build "$root/build" --target llama-speculative llama-lookup -j "$(nproc)" >/dev/null
mkdir -p "$bin"
cp "$root/build/bin/llama-speculative" "$root/build/bin/llama-lookup" "$bin/"
echo "built in $(( $(date +%s) - start )) s" >&2
echo "$bin"
