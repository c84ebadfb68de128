#!/usr/bin/env bash
# Fill .campaign/ (git-ignored) with what a GPU machine without network needs to run the
# llamacpp backend: it gets a copy of the repository plus carried folders, at most 64 MiB in
# all, and builds llama.cpp there with scripts/build_llamacpp_libs.sh.
#
#   .campaign/llama.cpp/  llama.cpp as vendored by llama-cpp-python $VERSION, trimmed to what a
#                         CMake build of the shared libraries llama + ggml (CPU, CUDA, RPC
#                         backends) and of llama.cpp's own `llama-speculative` (common/ and
#                         examples/speculative/; examples/CMakeLists.txt rewritten to enter that
#                         one example) reads: no docs, models, tests, tools, other examples,
#                         nor the other ggml backends.
#   .campaign/llama_cpp/  llama-cpp-python's pure-Python package (no compiled libraries; it
#                         loads libllama.so from $LLAMA_CPP_LIB_PATH, else from llama_cpp/lib/).
#   .campaign/wheels/     cp312 manylinux x86_64 wheels of the Python packages the GPU image
#                         lacks (versions as installed in this .venv), for
#                         `pip install --no-index --no-deps .campaign/wheels/*.whl`.
#   .campaign/SIZES.txt   the carried sizes in bytes.
#
# Idempotent: a second run downloads only what is missing (the sdist is kept in
# $SMCSPEC_CACHE/sdist, default ~/.cache/smcspec) and rebuilds the trimmed trees.
# Exits non-zero when .campaign plus the tracked tree exceed 60 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION="0.3.36"
LIMIT=62914560  # 60 MiB: the carry limit is 64 MiB, leave room
CAMPAIGN=.campaign
# the sdist, kept outside .campaign (it is not carried) so that a second run needs no network
CACHE="${SMCSPEC_CACHE:-$HOME/.cache/smcspec}/sdist"
PY=${PYTHON:-python3}

# Python packages the GPU image lacks (versions as in this .venv, `pip show NAME`), then
# what their Requires-Dist asks for beyond the image: fastapi needs annotated-doc and
# opentelemetry-api (whose only need, typing-extensions, the image has).
WHEELS=(
    fastapi==0.165.0
    starlette==1.10.0
    pydantic==2.14.4
    pydantic-core==2.50.5
    annotated-types==0.8.0
    typing-inspection==0.4.5
    gguf==0.19.0
    llguidance==1.9.1
    uvicorn==0.54.0
    diskcache==5.6.3
    annotated-doc==0.0.7
    opentelemetry-api==1.45.2
)
# llguidance 1.9.1 comes only as cp39-abi3-manylinux_2_31 (the GPU image, Python 3.12.3 on
# Ubuntu 24.04, has glibc 2.39), so manylinux_2_31 joins the tags the campaign asked for.
PLATFORMS=(manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64
    manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64)

mkdir -p "$CAMPAIGN/wheels" "$CACHE"
grep -qxF '/.campaign/' .gitignore || printf '/.campaign/\n' >>.gitignore

# 1. the sdist
sdist="$CACHE/llama_cpp_python-$VERSION.tar.gz"
if [ ! -s "$sdist" ]; then
    echo "prepare: downloading the llama-cpp-python $VERSION sdist"
    tmp=$(mktemp -d)
    "$PY" -m pip download --quiet --no-deps --no-binary :all: -d "$tmp" \
        "llama-cpp-python==$VERSION"
    mv "$tmp"/llama_cpp_python-"$VERSION".tar.gz "$sdist"
    rm -rf "$tmp"
fi
src=$(mktemp -d)
trap 'rm -rf "$src"' EXIT
tar -xzf "$sdist" -C "$src"
root="$src/llama_cpp_python-$VERSION"

# 2. the pure-Python package (compiled libraries, if an sdist ever held any, left out)
rm -rf "$CAMPAIGN/llama_cpp"
cp -a "$root/llama_cpp" "$CAMPAIGN/llama_cpp"
find "$CAMPAIGN/llama_cpp" \( -name '*.so*' -o -name '*.dylib' -o -name '*.dll' \
    -o -name __pycache__ \) -prune -exec rm -rf {} +
rm -rf "$CAMPAIGN/llama_cpp/lib"

# 3. llama.cpp, trimmed. Kept: the top-level CMakeLists.txt and what it includes (cmake/,
# LICENSE), include/ and src/ (libllama), ggml/ with its base sources and the cpu, cuda and
# rpc backends (ggml/src/CMakeLists.txt enters a backend's folder only when GGML_<NAME>=ON),
# and vendor/, which the top level always enters (mtmd's header-only libraries: their
# CMakeLists.txt is enough; libllama includes none of them).
lc="$root/vendor/llama.cpp"
out="$CAMPAIGN/llama.cpp"
rm -rf "$out"
mkdir -p "$out" "$out/ggml/src" "$out/vendor"
cp -a "$lc/CMakeLists.txt" "$lc/LICENSE" "$lc/cmake" "$lc/include" "$lc/src" "$out/"
cp -a "$lc/ggml/CMakeLists.txt" "$lc/ggml/cmake" "$lc/ggml/include" "$out/ggml/"
for f in "$lc"/ggml/src/*; do
    name=$(basename "$f")
    case "$name" in
        ggml-*) [ -d "$f" ] || cp -a "$f" "$out/ggml/src/" ;;  # backend folders: below
        *) cp -a "$f" "$out/ggml/src/" ;;
    esac
done
for backend in ggml-cpu ggml-cuda ggml-rpc; do
    cp -a "$lc/ggml/src/$backend" "$out/ggml/src/"
done
cp -a "$lc/vendor/CMakeLists.txt" "$out/vendor/"
for dir in "$lc"/vendor/*/; do
    name=$(basename "$dir")
    mkdir -p "$out/vendor/$name"
    case "$name" in
        # hash: a static library; the others: what common/ (llama-speculative) includes
        hash|cpp-httplib|nlohmann|sheredom) cp -a "$dir"/. "$out/vendor/$name/" ;;
        *) cp -a "$dir/CMakeLists.txt" "$out/vendor/$name/" ;;  # header-only, unused
    esac
done
# llama-speculative (scripts/build_llamacpp_libs.sh --tools): common/ and the one example;
# examples/ and pocs/ are entered together with LLAMA_BUILD_EXAMPLES, so both get a
# CMakeLists.txt of their own that enters only what was carried
cp -a "$lc/common" "$out/"
mkdir -p "$out/examples" "$out/pocs"
cp -a "$lc/examples/speculative" "$out/examples/"
printf 'find_package(Threads REQUIRED)\nllama_add_compile_flags()\nadd_subdirectory(speculative)\n' \
    >"$out/examples/CMakeLists.txt"
printf '# trimmed: no proofs of concept\n' >"$out/pocs/CMakeLists.txt"

# 4. the wheels
for spec in "${WHEELS[@]}"; do
    name=${spec%%==*}
    version=${spec#*==}
    pattern="$(printf '%s' "$name" | tr '-' '_')-$version-*.whl"
    # shellcheck disable=SC2086
    if ! ls "$CAMPAIGN"/wheels/$pattern >/dev/null 2>&1; then
        platform_args=()
        for p in "${PLATFORMS[@]}"; do platform_args+=(--platform "$p"); done
        "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
            --implementation cp "${platform_args[@]}" -d "$CAMPAIGN/wheels" "$spec"
    fi
done

# 5. sizes
campaign=$(du -sb "$CAMPAIGN" | cut -f1)
tracked=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
llamacpp=$(du -sb "$CAMPAIGN/llama.cpp" | cut -f1)
package=$(du -sb "$CAMPAIGN/llama_cpp" | cut -f1)
wheels=$(du -sb "$CAMPAIGN/wheels" | cut -f1)
total=$((campaign + tracked))
{
    echo "llama.cpp (trimmed)  $llamacpp"
    echo "llama_cpp (package)  $package"
    echo "wheels               $wheels"
    echo ".campaign            $campaign"
    echo "tracked tree         $tracked"
    echo "total                $total"
    echo "limit                $LIMIT"
} >"$CAMPAIGN/SIZES.txt"
cat "$CAMPAIGN/SIZES.txt"
awk -v t="$total" 'BEGIN { printf "prepare: %.2f MiB of 60 MiB\n", t / 1048576 }'
if [ "$total" -gt "$LIMIT" ]; then
    echo "prepare: over the 60 MiB limit" >&2
    exit 1
fi
