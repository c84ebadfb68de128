#!/usr/bin/env bash
# Diagnose the llamacpp backend on a fresh GPU machine in one call (the campaign's setup:
# carried wheels, llama.cpp built from .campaign/ with CUDA):
#
#   bash scripts/gpu_probe.sh OUT [BUDGET_S]
#
#   1. llama.cpp's CUDA build starts in the background (all cores); meanwhile the torch GPU
#      tests run and the Llama 8B/1B-shaped GGUF files are written.
#   2. Probes, each a fresh process (benchmarks/gpu_probe.py, 32 new tokens): SMC-SD N=4 K=4
#      alone; the campaign's grid in its order; ar and N=8 K=8 at 64 tokens under cProfile.
#   3. Where a probe died: again with CUDA_LAUNCH_BLOCKING=1 (the failing launch named), then
#      under cuda-gdb (the faulting kernel and its backtrace), in the time left.
# Every log lands in OUT. PROBE_ARGS: extra gpu_probe.py arguments (`--device cpu --tiny`
# checks the script on a CPU).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: gpu_probe.sh OUT [BUDGET_S]}
BUDGET_S=${2:-560}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOG="$OUT/probe.log"
START=$(date +%s)
log() { echo "[probe +$(( $(date +%s) - START ))s] $*" | tee -a "$LOG"; }
left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }
WORK=${CAMPAIGN_WORK:-/tmp/smcspec-campaign}
LIBS="$PWD/.campaign/llama_cpp/lib"
mkdir -p "$WORK"
START_BUILD=1 BUILD_NICE=0
# shellcheck source=scripts/gpu_env.sh
source scripts/gpu_env.sh || exit 1
# shellcheck disable=SC2206  # PROBE_ARGS split on spaces
EXTRA=(${PROBE_ARGS:-})
M="$WORK/models/probe"

log "torch: GPU tests (beside the build)"
timeout 180 "$PY" -m pytest -p no:cacheprovider -q -m gpu tests/test_gpu.py >"$OUT/pytest-torch.log" 2>&1
log "torch: GPU tests exit $?: $(tail -1 "$OUT/pytest-torch.log")"
log "writing the GGUF files"
"$PY" benchmarks/gpu_probe.py --workdir "$M" --write-only "${EXTRA[@]}" >>"$LOG" 2>&1
if [ -f "$WORK/build.started" ]; then
    log "waiting for the llama.cpp build"
    while [ ! -f "$WORK/build.done" ] && [ "$(left)" -gt 120 ]; do sleep 3; done
    cp "$WORK/build.log" "$OUT/build.log"
    [ -f "$WORK/build.ok" ] || { log "the build did not finish or failed"; tail -20 "$WORK/build.log" | tee -a "$LOG"; exit 1; }
fi
log "build ready"

probe() {  # name timeout_s args...: one fresh process; its whole output in OUT/name.log
    local name=$1 t=$2
    shift 2
    [ "$(left)" -gt 30 ] || { log "probe $name: no time left"; return 0; }
    [ "$t" -lt "$(left)" ] || t=$(( $(left) - 10 ))
    log "probe $name ($*)"
    timeout "$t" "$PY" benchmarks/gpu_probe.py --workdir "$M" "${EXTRA[@]}" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    log "probe $name exit $rc"
    grep -E "^(loaded|ok|fail)|ERROR|error|rror:" "$OUT/$name.log" | head -40 | tee -a "$LOG"
    return $rc
}

GRID=ar,smc-n4-k2,smc-n4-k4,smc-n4-k8,smc-n8-k2,smc-n8-k4,smc-n8-k8,smc-n16-k2,smc-n16-k4,smc-n16-k8
failing=""
probe k4 90 --systems smc-n4-k4 || failing="smc-n4-k4"
probe grid 150 --systems "$GRID" || failing=${failing:-$GRID}
probe profile 100 --systems ar,smc-n8-k8 --max-new-tokens 64 --profile
if [ -n "$failing" ]; then
    CUDA_LAUNCH_BLOCKING=1 probe blocking 90 --systems "$failing"
    gdb=$(command -v cuda-gdb || ls /usr/local/cuda*/bin/cuda-gdb 2>/dev/null | head -1)
    if [ -n "$gdb" ] && [ "$(left)" -gt 60 ]; then
        log "cuda-gdb on $failing"
        timeout $(( $(left) - 15 )) "$gdb" -batch -ex run -ex "info cuda kernels" -ex bt \
            -ex "info cuda threads" --args "$PY" benchmarks/gpu_probe.py --workdir "$M" \
            "${EXTRA[@]}" --systems "$failing" >"$OUT/cuda-gdb.log" 2>&1
        log "cuda-gdb exit $?"
        grep -iE "exception|kernel|^#[0-9]" "$OUT/cuda-gdb.log" | head -30 | tee -a "$LOG"
    fi
fi
log "done"
