#!/usr/bin/env bash
# Issue 84's measurements, one resumable background campaign on the CPU (every step resumes
# where it stopped; rerun the script after a kill):
#   1. the target's answers (smcspec distill --stage data), 2. the chi2 fit and its export,
#   3. GSM8K first 100 with the fitted draft (smc-n4-k12, smc-n8-k8), paired with the
#   committed ar records, 4. HumanEval first 50 at smc-n8-k8, base and fitted, paired with
#   the committed ar records, 5. tokens a round of chain sd K=4 and multi-draft sd N=8 K=4
#   with the fitted draft (5b: the kl draft) on the 40 prompts of docs/benchmarks/multi-draft-cpu,
#   6. the kl fit (its validation curve beside chi2's; run right after step 2, while the
#      teacher's answers are on this machine), 6b. the anneal and reverse-kl fits and
#      SMC-SD's rounds simulated on all four drafts, 7. GSM8K first 100 with the kl draft at draft
#      temperature 0.6 (docs/benchmarks/distill/simulated-rounds.txt: kept -log p below the base
#      draft's at both settings with a large-N ESS not below it).
# The fitted draft (its manifest and LoRA GGUF, a few MB) is copied into the repository once
# made, so that a lost machine costs only the step in progress: with that copy present,
# steps 1 and 2 are skipped.
# Usage: RUNS=runs/distill nohup nice -n 10 bash benchmarks/distill_campaign.sh >> distill.log 2>&1 &
# Optional: WAIT_PID=<pid of a running step 1> (the script waits for it first).
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-runs/distill}
SMC=.venv/bin/smcspec
EVAL_ARGS=(--max-new-tokens 512 --temperature 0.7 --draft-temperature 0.7 --backend llamacpp --threads 2)
export GGML_NO_BACKTRACE=1
step() { echo "== $(date -u +%FT%TZ) $*"; }

if [ -n "${WAIT_PID:-}" ]; then
    step "waiting for process $WAIT_PID"
    while kill -0 "$WAIT_PID" 2>/dev/null; do sleep 30; done
fi
kl_fit() {
    step "6. kl fit (validation curve)"
    $SMC distill --stage data --out "$RUNS/teacher" --tokens 100000  # made again if lost
    $SMC distill --teacher "$RUNS/teacher" --out "$RUNS/kl" --objective kl --dtype bfloat16 \
        --tokens 100000 --stage train
    cp "$RUNS/kl/validation.jsonl" docs/benchmarks/distill/validation-kl.jsonl
}
FIT=docs/benchmarks/distill/draft-chi2  # the fitted draft as committed
if [ -f "$FIT/manifest.json" ]; then
    step "1-2. the fitted draft is in $FIT: the teacher and the fit are skipped"
else
    step "1. teacher answers"
    $SMC distill --stage data --out "$RUNS/teacher" --tokens 100000
    step "2. chi2 fit and export"
    $SMC distill --teacher "$RUNS/teacher" --out "$RUNS/chi2" --objective chi2 --dtype bfloat16 \
        --tokens 100000
    mkdir -p "$FIT"
    cp "$RUNS/chi2/validation.jsonl" docs/benchmarks/distill/validation-chi2.jsonl
    cp "$RUNS/chi2/draft/manifest.json" docs/benchmarks/distill/manifest-chi2.json
    cp "$RUNS/chi2/draft/draft-lora.gguf" "$RUNS/chi2/draft/manifest.json" "$FIT/"
    kl_fit  # while the teacher's answers are here
fi
step "2b. the fitted draft runs (a smoke test before the long runs)"
$SMC generate "Say hi." --method sd -K 4 -m 8 --draft "$FIT" --backend llamacpp

# copies of committed records: the same questions, seeds and settings, paired by item
seed_records() {  # seed_records SRC DEST METHOD FIRST
    python3 - "$@" <<'EOF'
import json, re, sys
src, dest, method, first = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
have = set()
try:
    have = {json.loads(l)["id"] for l in open(dest) if l.strip()}
except FileNotFoundError:
    pass
with open(dest, "a") as out:
    for line in open(src):
        r = json.loads(line)
        if r["method"] == method and int(re.split("[-/]", r["item"])[-1]) < first and r["id"] not in have:
            out.write(json.dumps(r) + "\n")
EOF
}
G=docs/benchmarks/distill-gsm8k
mkdir -p "$G"
seed_records docs/benchmarks/gsm8k-gpu-settings/results.jsonl "$G/results.jsonl" ar 100
step "3. GSM8K first 100 with the fitted draft"
$SMC eval gsm8k --first 100 --methods smc-n4-k12,smc-n8-k8 --draft "$FIT" --nll \
    "${EVAL_ARGS[@]}" --out "$G"

H=docs/benchmarks/distill-humaneval
mkdir -p "$H/base" "$H/chi2"
for d in base chi2; do
    seed_records docs/benchmarks/humaneval-reward/results.jsonl "$H/$d/results.jsonl" ar 50
done
step "4. HumanEval first 50, smc-n8-k8, fitted then base"
$SMC eval humaneval --first 50 --methods smc-n8-k8 --draft "$FIT" --seed 0 \
    "${EVAL_ARGS[@]}" --out "$H/chi2"
$SMC eval humaneval --first 50 --methods smc-n8-k8 --seed 0 "${EVAL_ARGS[@]}" --out "$H/base"

step "5. tokens a round, chain sd K=4 and multi-draft sd N=8 K=4, fitted draft"
.venv/bin/python benchmarks/multi_draft_acceptance.py --prompts 20 --particles 1,8 \
    --draft-tokens 4 --threads 2 --draft "$FIT" --out docs/benchmarks/distill/acceptance-chi2
step "5b. the same with the kl draft"
.venv/bin/python benchmarks/multi_draft_acceptance.py --prompts 20 --particles 1,8 \
    --draft-tokens 4 --threads 2 --draft docs/benchmarks/distill/draft-kl \
    --out docs/benchmarks/distill/acceptance-kl

[ -f docs/benchmarks/distill/validation-kl.jsonl ] || kl_fit

step "6b. the anneal and reverse-kl fits (curves), then SMC-SD's rounds simulated on every draft"
for obj in anneal reverse-kl; do
    [ -f "$RUNS/$obj/draft/manifest.json" ] && continue
    $SMC distill --stage data --out "$RUNS/teacher" --tokens 100000  # made again if lost
    $SMC distill --teacher "$RUNS/teacher" --out "$RUNS/$obj" --objective "$obj" \
        --dtype bfloat16 --tokens 100000
    cp "$RUNS/$obj/validation.jsonl" "docs/benchmarks/distill/validation-$obj.jsonl"
    cp "$RUNS/$obj/draft/manifest.json" "docs/benchmarks/distill/manifest-$obj.json"
done
SIM=docs/benchmarks/distill/simulated-rounds-4-objectives.txt
[ -s "$SIM" ] || .venv/bin/python benchmarks/distill_divergence.py \
    --fitted chi2=$FIT kl=docs/benchmarks/distill/draft-kl anneal="$RUNS/anneal/draft" \
    reverse-kl="$RUNS/reverse-kl/draft" --records docs/benchmarks/gsm8k-gpu-settings/results.jsonl \
    --answers 8 --blocks 4,12 --blocks 8,8 --draft-temperatures 0.6 > "$SIM.tmp" && mv "$SIM.tmp" "$SIM"

GK=$G/kl-draft-t0.6
mkdir -p "$GK"
seed_records docs/benchmarks/gsm8k-gpu-settings/results.jsonl "$GK/results.jsonl" ar 100
step "7. GSM8K first 100 with the kl draft at draft temperature 0.6"
$SMC eval gsm8k --first 100 --methods smc-n4-k12,smc-n8-k8 --draft docs/benchmarks/distill/draft-kl \
    --nll --max-new-tokens 512 --temperature 0.7 --draft-temperature 0.6 --backend llamacpp \
    --threads 2 --out "$GK"
step "done"
