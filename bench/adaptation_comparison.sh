#!/usr/bin/env bash
# Adapting an autoregressive model against training diffusion from scratch, on CPU, at the same
# data and total budget (docs/adapting.md; BENCHMARKS.md "Adapting an autoregressive model"):
#   scratch       MDLM from scratch for N steps
#   ar            unmask's causal baseline for N/2 steps, then adapted from it for N/2 steps:
#   mdlm          to MDLM (shift, attention annealed over N/4 steps)
#   bd3           to block diffusion, L' = 4 (shift, annealing)
#   no-anneal     to MDLM, the full attention from the first step
#   no-shift      to MDLM, each token predicted at its own row (annealing)
# Every run: the tiny preset, global batch 16, seed 0, lr 1e-3 cosine, validation every N/8 steps
# on 8 batches (EMA weights). The curves are each run's metrics.jsonl (val/nelbo_per_token).
# Usage: bash bench/adaptation_comparison.sh DATA OUT [N]   (DATA: an `unmask prep` output)
set -euo pipefail
cd "$(dirname "$0")/.."
data=$1 out=$2 steps=${3:-200}
half=$((steps / 2)) anneal=$((steps / 4)) every=$((steps / 8))
python=${PYTHON:-.venv/bin/python}
mkdir -p "$out"
config() {  # name, steps, extra YAML lines
  printf 'model: {preset: tiny%s}\ntrain: {max_steps: %s, global_batch_size: 16, seed: 0, ema_decay: 0.99}\noptim: {lr: 1.0e-3, warmup_steps: %s}\neval: {every: %s, batches: 8}\ncheckpoint: {every: %s, keep_last: 1}\nlogging: {every: 10, progress: false}\n%s' \
    "$3" "$2" $((steps / 10)) "$every" "$2" "$4" > "$out/$1.yaml"
}
train() {  # name, extra flags
  local name=$1; shift
  "$python" -m orchestration.cli train --config "$out/$name.yaml" --data "$data" --run-dir "$out/$name" "$@" \
    > "$out/$name.log" 2>&1
}
config scratch "$steps" "" ""
config ar "$half" ", objective: autoregressive" ""
config mdlm "$half" "" "adapt: {anneal_steps: $anneal}"
config bd3 "$half" ", block_size: 4" "adapt: {anneal_steps: $anneal}"
config no-anneal "$half" "" "adapt: {anneal_steps: 0}"
config no-shift "$half" "" "adapt: {anneal_steps: $anneal, shift: false}"
start=$(date +%s)
train scratch
train ar
for name in mdlm bd3 no-anneal no-shift; do train "$name" --init-from "$out/ar"; done
"$python" - "$out" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
for name in ("scratch", "ar", "mdlm", "bd3", "no-anneal", "no-shift"):
    records = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    curve = {r["step"]: round(r["val/nelbo_per_token"], 3) for r in records if "val/nelbo_per_token" in r}
    tokens = max((r.get("train/tokens_seen", 0) for r in records), default=0)
    print(json.dumps({"run": name, "val_nelbo_by_step": curve, "tokens": tokens}))
PY
echo "wall: $(( $(date +%s) - start )) s"
