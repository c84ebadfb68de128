#!/usr/bin/env bash
# The GPU figures in one command, on a fresh CUDA machine with no network.
#
#   bash scripts/prepare_gpu_campaign.sh          # beforehand, where the package registries are
#   bash scripts/gpu_campaign.sh --out DIR        # on the GPU machine: everything below
#   bash scripts/gpu_campaign.sh --device cpu --tiny --out DIR   # the CPU rehearsal (CI runs it)
#
# Steps (each logged to DIR/campaign.log; every file it writes is in DIR, at most 7 files):
#   1. Python packages the machine lacks, from the wheels carried in .campaign/wheels.
#   2. llama.cpp built with CUDA for the card found, from the trimmed source carried in
#      .campaign/llama.cpp (scripts/build_llamacpp_libs.sh), in the background, detached,
#      while step 3 runs. Skipped where `import llama_cpp` already works (a CPU build
#      installed by scripts/setup.sh: the rehearsal).
#   3. The torch backend: `pytest -m gpu tests/test_gpu.py` (CUDA forward against the CPU,
#      graph replay against the uncaptured fused rounds,
#      every method, exact SD's distribution on the GPU), then benchmarks/gpu_campaign.py.
#   4. The llamacpp backend, once the build is done: `pytest -m gpu tests/test_gpu_llamacpp.py`,
#      then benchmarks/gpu_campaign.py, with llama.cpp's own llama-speculative on the 8B/1B
#      GGUF files where the build made it (built after the libraries, in the same folder;
#      benchmarks/llama_speculative_gpu.py).
# --phase torch runs 1-3 (the build keeps going after it returns), --phase llamacpp runs 4
# (waiting for the build): two commands of under 10 minutes each on a lent machine. The
# default, --phase all, runs both. --budget-s S: start nothing after S seconds (what the
# benchmark has not begun by then is listed as not measured); --torch-s S: the torch
# benchmarks start nothing after S seconds (the rest is the llamacpp backend's).
# The torch backend runs TORCH_PAIRS (default llama: 8B/1B) with CAMPAIGN_ARGS, a cProfile
# of one round and the tuner on the device (its forward costs measured there, the real default
# pair's acceptance statistics from PAIR_STATS, benchmarks/pair_stats/; TUNE=0: no tuner,
# PAIR_STATS still giving llama-speculative's predicted speed), then BIG_PAIRS
# (default qwen32,llama70: 32B/0.5B and 70B/1B; empty: none) with BIG_ARGS appended (default
# a small grid, N 4,8 and K 8, with FP8 projections, the sixth lending having run them in bf16;
# no steps or kernel-set comparison); PROFILE_KERNELS (default every kernel set; --tiny: eager
# and layer) the sets whose
# SMC-SD request runs under torch.profiler after the main pair's groups (kernels and device
# time a round beside their prediction, docs/benchmarks/layer-kernels/);
# --big-s S keeps S seconds of --torch-s for the large pairs. Results: DIR/results.jsonl,
# DIR/report.md, DIR/tokens_per_s.png, logs beside them.
set -uo pipefail
cd "$(dirname "$0")/.."
DEVICE=cuda TINY=0 OUT="" PHASE=all BUDGET_S=36000 TORCH_S="" BIG_S=0 PY=${PYTHON:-python3}
BIG_PAIRS=${BIG_PAIRS-qwen32,llama70}
BIG_ARGS=${BIG_ARGS:---particles 4,8 --draft-tokens 8 --compare-steps none --compare-kernels none --compare-frontier none --compare-fp8 none --weights fp8}
while [ $# -gt 0 ]; do
    case "$1" in
        --device) DEVICE=$2; shift 2 ;;
        --tiny) TINY=1; shift ;;
        --out) OUT=$2; shift 2 ;;
        --phase) PHASE=$2; shift 2 ;;
        --budget-s) BUDGET_S=$2; shift 2 ;;
        --torch-s) TORCH_S=$2; shift 2 ;;
        --big-s) BIG_S=$2; shift 2 ;;
        *) echo "gpu_campaign: unknown argument $1" >&2; exit 2 ;;
    esac
done
[ -n "$OUT" ] || { echo "gpu_campaign: --out DIR is required" >&2; exit 2; }
case "$PHASE" in all|torch|llamacpp) ;; *) echo "gpu_campaign: --phase all|torch|llamacpp" >&2; exit 2 ;; esac
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOG="$OUT/campaign.log"
START=$(date +%s)
log() { echo "[campaign +$(( $(date +%s) - START ))s] $*" | tee -a "$LOG"; }
WORK=${CAMPAIGN_WORK:-/tmp/smcspec-campaign}
# where llama_cpp looks first (smcspec's RPC code finds libggml there too)
LIBS="$PWD/.campaign/llama_cpp/lib"
mkdir -p "$WORK"

# 1-2. packages the machine lacks; llama.cpp (built in the background unless --phase llamacpp)
START_BUILD=$([ "$PHASE" = llamacpp ] && echo 0 || echo 1)
# shellcheck source=scripts/gpu_env.sh
source scripts/gpu_env.sh || exit 1

BENCH=("$PY" benchmarks/gpu_campaign.py --device "$DEVICE" --out "$OUT"
       --workdir "$WORK/models")
# shellcheck disable=SC2206  # CAMPAIGN_ARGS: extra benchmark arguments, split on spaces
BENCH+=(${CAMPAIGN_ARGS:-})
if [ "$TINY" = 1 ]; then  # every step once, small: one N, two K, the tuner's K two
    # the kernel-set group on the written and flex sets, the cheapest compiled set to
    # compile (about 20 s on a 2-core CPU, the whole-layer set about 75 s): the compiled
    # and whole-layer sets compile the same tiny pair's N=8 K=8 and ar rounds in
    # tests/test_layer_kernels.py
    BENCH+=(--tiny --reps 1 --prompt-tokens 16 --max-new-tokens 16 --kv-cells 16384
            --particles 8 --draft-tokens 2,8 --tune-draft-tokens 2,8 --batches 4
            --upper-bound-pairs qwen,llama --kernel-sets eager,flex)
    BIG_ARGS="$BIG_ARGS --particles 8"
    PROFILE_KERNELS=${PROFILE_KERNELS-eager,flex}  # the path once; the group runs every set
fi
PROFILE_KERNELS=${PROFILE_KERNELS-eager,compiled,flex,layer}
PAIR_STATS=${PAIR_STATS:-benchmarks/pair_stats/qwen2.5-coder-1.5b-q4km_0.5b.json}
TUNE_STATS=$([ "${TUNE:-1}" = 0 ] || echo "$PAIR_STATS")  # the torch phase's: its tuner

if [ "$PHASE" != llamacpp ]; then
    log "torch: GPU tests"
    "$PY" -m pytest -p no:cacheprovider -q -m gpu tests/test_gpu.py 2>&1 | tee "$OUT/pytest-torch.log" | tail -3
    log "torch: benchmarks"
    "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" | tee -a "$LOG"
    "${BENCH[@]}" --backends torch --pairs "${TORCH_PAIRS:-llama}" --profile \
        --profile-kernels "$PROFILE_KERNELS" \
        --pair-stats "$TUNE_STATS" \
        --deadline-s $(( ${TORCH_S:-$BUDGET_S} - ($(date +%s) - START) - BIG_S - 30 )) >>"$LOG" 2>&1
    log "torch: benchmarks exit $?"
    if [ -n "$BIG_PAIRS" ]; then
        log "torch: the large pairs ($BIG_PAIRS)"
        # shellcheck disable=SC2086  # BIG_ARGS: options split on spaces, after the others
        "${BENCH[@]}" --backends torch --pairs "$BIG_PAIRS" $BIG_ARGS \
            --deadline-s $(( ${TORCH_S:-$BUDGET_S} - ($(date +%s) - START) - 30 )) >>"$LOG" 2>&1
        log "torch: large pairs exit $?"
    fi
fi

if [ "$PHASE" != torch ]; then
    if [ -f "$WORK/build.started" ]; then
        log "waiting for the llama.cpp build"
        while [ ! -f "$WORK/build.done" ] && [ $(( $(date +%s) - START )) -lt $(( BUDGET_S - 120 )) ]; do
            sleep 5
        done
        if [ ! -f "$WORK/build.ok" ]; then
            log "the llama.cpp build did not finish in time or failed:"
            tail -20 "$WORK/build.log" | tee -a "$LOG"
        fi
    fi
    if "$PY" -c "import llama_cpp" >/dev/null 2>&1; then
        log "llamacpp: GPU tests"
        "$PY" -m pytest -p no:cacheprovider -q -m gpu tests/test_gpu_llamacpp.py 2>&1 \
            | tee "$OUT/pytest-llamacpp.log" | tail -3
        log "llamacpp: benchmarks"
        SPEC=()  # llama.cpp's own tool, where this run builds llama.cpp (not the rehearsal)
        [ -f "$WORK/build.started" ] && SPEC=(--llama-speculative "$LIBS/llama-speculative")
        "${BENCH[@]}" --backends llamacpp --pairs llama,qwen "${SPEC[@]}" \
            --pair-stats "$PAIR_STATS" \
            --deadline-s $(( BUDGET_S - ($(date +%s) - START) - 30 )) >>"$LOG" 2>&1
        log "llamacpp: benchmarks exit $?"
    else
        log "llamacpp: skipped (llama_cpp does not import)"
    fi
fi
if [ -f "$WORK/build.started" ]; then
    cp "$WORK/build.log" "$OUT/build.log"
    [ -f "$WORK/build.done" ] || log "the llama.cpp build is still running"
fi
log "done: $OUT/report.md"
