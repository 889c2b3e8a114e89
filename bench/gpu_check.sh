#!/usr/bin/env bash
# The GPU check of issue 24, in one call on a lent device (docs/performance.md), most valuable
# step first, each under its own timeout, every log and JSON line written under $OUT as it
# comes (what is there comes back even when the call is cut):
#
#   1. train     `unmask train --config configs/medium.yaml`, no speed flag (the defaults), for
#                30 steps; its own log gives tokens/s, MFU and peak memory (train.json: the last
#                interval's, compilation excluded)
#   2. tests     tests/test_gpu.py (bf16, attention kernels, NCCL, compile, padded vocabulary,
#                host syncs, evaluation under bf16)
#   3. bench     bench/train_gpu.py at micro-batch 16 and 32: the pipeline as it ran before
#                (eager, unpadded, flash) and with today's defaults (bench.jsonl)
#   4. inference evaluation (before / now) and sampling rows of bench/train_gpu.py (bench.jsonl)
#   5. init      (only when named: --steps train,init) `unmask train --init-from` the run of step 1,
#                one eager step: the source's weights loaded on the device (init.log; its first
#                loss is in init-metrics.jsonl)
#
# steps.jsonl has one line per step: its name, exit status, seconds and whether it timed out.
# Expected on an H100/H200: about 6 minutes, most of it compilation on the fresh machine; the
# limits below bound it to 9. --steps bench,inference runs only those (a second call on a
# machine still warm, for what a first one had to cut).
#
#   on the device (the kit in ../shared/gpu):  bash .gpu/setup.sh && bash bench/gpu_check.sh
#   a dry run here, in seconds:                PYTHON=.venv/bin/python bash bench/gpu_check.sh --device cpu \
#                                                  --data SHARDS --out DIR
#
# The dry run takes the tiny preset and configs/tiny.yaml on any `unmask prep` output, with
# a step or two per stage: it proves the script, not the speed (tests/test_gpu_check.py).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

device=cuda
data=.gpu/shards
out=${OUT:-gpu-check}
steps=train,tests,bench,inference
while [ $# -gt 0 ]; do
  case $1 in
    --device) device=$2; shift 2 ;;
    --data) data=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    *) echo "gpu_check.sh: unknown argument $1 (--device cuda|cpu, --data SHARDS, --out DIR, --steps A,B)" >&2
       exit 2 ;;
  esac
done
wanted() { [[ ",$steps," == *",$1,"* ]]; }
python=${PYTHON:-python3}
mkdir -p "$out"
run_dir=$(mktemp -d)/run  # checkpoints (6 GB for medium) stay off $OUT

if [ "$device" = cuda ]; then
  config=configs/medium.yaml preset=medium train_steps=30 log_every=10 micro_batches="16 32"
  bench_steps=10 bench_warmup=3 eval_blocks=32 sample_steps=1000
  limit_train=210 limit_tests=90 limit_bench=150 limit_inference=120  # 570 s at most: one call
  limit_init=120  # opt-in (--steps train,init): not in the default call's 570 s
else
  config=configs/tiny.yaml preset=tiny train_steps=2 log_every=1 micro_batches=2
  bench_steps=1 bench_warmup=1 eval_blocks=2 sample_steps=4
  limit_train=300 limit_tests=120 limit_bench=300 limit_inference=300 limit_init=300
  export CUDA_VISIBLE_DEVICES=""  # a dry run on a GPU machine stays on its CPU
fi

# step NAME SECONDS COMMAND...: run it under `timeout`, its output teed into NAME.log.
failed=0
step() {
  local name=$1 limit=$2 start rc ms timed_out=false
  shift 2
  start=$(date +%s%N)
  echo "=== $name (at most ${limit}s): $*"
  timeout --kill-after=15 "$limit" "$@" 2>&1 | tee "$out/$name.log"
  rc=${PIPESTATUS[0]}
  ms=$(( ($(date +%s%N) - start) / 1000000 ))
  { [ "$rc" = 124 ] || [ "$rc" = 137 ]; } && timed_out=true
  [ "$rc" = 0 ] || failed=1
  printf '{"step": "%s", "rc": %d, "seconds": %d.%03d, "timed_out": %s}\n' "$name" "$rc" $((ms / 1000)) \
    $((ms % 1000)) "$timed_out" | tee -a "$out/steps.jsonl"
}

"$python" - "$device" > "$out/environment.json" <<'PY'
import json, sys, torch
from pipeline.attention import available_kernels
device = torch.device(sys.argv[1])
dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
print(json.dumps({"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                  "torch": torch.__version__, "cuda": torch.version.cuda,
                  "attention_kernels": available_kernels(device, dtype, 64)}))
PY
cat "$out/environment.json"

# 1. The headline: the preset with the defaults (micro-batch, compile and attention "auto").
if wanted train; then
  step train "$limit_train" "$python" -m orchestration.cli train --config "$config" --data "$data" \
    --run-dir "$run_dir" --no-progress --logging.mlflow false --train.max_steps "$train_steps" \
    --logging.every "$log_every" --eval.every 0 --eval.batches 2
  cp "$run_dir/metrics.jsonl" "$out/train-metrics.jsonl" 2>/dev/null
  "$python" - "$out/train-metrics.jsonl" > "$out/train.json" <<'PY'
import json, os, sys
path = sys.argv[1]
records = [json.loads(line) for line in open(path) if "train/loss" in line] if os.path.exists(path) else []
last = records[-1] if records else {}
print(json.dumps({"step": last.get("step"), "tokens_per_s": last.get("train/tokens_per_second"),
                  "mfu": last.get("train/mfu"), "peak_memory_gib": last.get("train/peak_memory_gib")}))
PY
  grep -h "setup:" "$out/train.log" | tail -1
  cat "$out/train.json"
fi

# 2. Correctness on the device.
wanted tests && step tests "$limit_tests" "$python" -m pytest tests/test_gpu.py -v -p no:cacheprovider

# 3. Training rows: the pipeline before these defaults and with them.
if wanted bench; then
  step bench "$limit_bench" "$python" bench/train_gpu.py --device "$device" --data "$data" --presets "$preset" \
    --micro-batches $micro_batches --steps "$bench_steps" --warmup "$bench_warmup" --skip-inference \
    --variants pipeline-zero1+eager+unpadded+flash pipeline-zero1
  grep -h '^{' "$out/bench.log" >> "$out/bench.jsonl"
fi

# 4. Evaluation (as before and as now) and sampling from all-mask.
if wanted inference; then
  step inference "$limit_inference" "$python" bench/train_gpu.py --device "$device" --data "$data" \
    --presets "$preset" --skip-training --eval-blocks "$eval_blocks" --repeats 1 --sample-steps "$sample_steps"
  grep -h '^{' "$out/inference.log" >> "$out/bench.jsonl"
fi
# 5. A new run from step 1's weights (needs step 1 in the same call).
if wanted init; then
  step init "$limit_init" "$python" -m orchestration.cli train --config "$config" --data "$data" \
    --run-dir "$run_dir-init" --init-from "$run_dir" --no-progress --logging.mlflow false --train.max_steps 1 \
    --train.compile false --logging.every 1 --eval.every 0 --eval.batches 1
  cp "$run_dir-init/metrics.jsonl" "$out/init-metrics.jsonl" 2>/dev/null
fi
echo "gpu_check.sh: done; results in $out (steps.jsonl, train.json, bench.jsonl, *.log)"
exit "$failed"
