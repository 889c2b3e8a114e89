#!/usr/bin/env bash
# The GPU check, in one call on a lent device (docs/performance.md), most
# valuable step first, each under its own timeout and all of them under one budget (--budget
# seconds, 540 on a GPU: the 10-minute call less the kit's setup), results written under $OUT as
# they come (what is there comes back even when the call is cut):
#
#   1. e2e       the user's path, every command as a user types it, on the device: a short
#                `medium` run (train.json: tokens/s, MFU, peak memory) with validation and one
#                checkpoint, a new run from its weights (--init-from), `unmask export` in both
#                formats, `unmask eval --quick` with samples, `unmask eval --suite zero-shot` under the
#                bd3lm protocol, `unmask sample` once per sampler, in blocks (with the prefix cache;
#                whole-sequence with the dual cache), two rounds of `unmask distill` (its tokens/s in
#                logs/e2e-distill.json) with the student exported and sampled, an imported BD3-LM fixture sampled, `unmask lm-eval --limit` on the local PTB task, transformers loading the HF export on the device, and
#                the short run again with model.document_mask (FlexAttention) and its `unmask eval --quick`; each
#                command is its own line of steps.jsonl (e2e-train, e2e-export, ...)
#   2. inference bench/train_gpu.py's inference rows (bench.jsonl): evaluation as before and
#                now with its FLOP utilization, sampling 64 x 1024 from all-mask by cached
#                ancestral and first-hitting (eager and compiled), in blocks without and with the
#                prefix cache, and the AR network of the same shape with its KV cache; lm-eval requests/s
#   3. tests     tests/test_gpu.py (bf16, attention kernels, NCCL, compile, padded vocabulary,
#                host syncs, every inference path on the device)
#      adapt     adapting GPT-2 medium (docs/adapting.md): a GPT-2 of the preset's shape with random
#                weights written by transformers (bench/gpt2_source.py; nothing is downloaded), PTB's
#                test and valid sets prepped with its tokenizer.json, `unmask train --config configs/adapt-gpt2-medium.yaml
#                --init-from` for 20 steps with the attention annealing over the first 10
#                (adapt-train.json), `unmask export`, `unmask sample`; then bench/train_gpu.py's rows
#                on that data, our network and the adapted one at one micro-batch (bench.jsonl: the MFU target
#                is within 10% of ours), and annealed. About 6 minutes: `--steps adapt` alone fits a call
#   4. train     `unmask train --config configs/medium.yaml`, no speed flag, 30 steps
#   5. bench     bench/train_gpu.py's training rows at micro-batch 16 and 32, before and now
#   6. scale     bench/train_gpu.py's rows for the large and xl presets (micro-batch 8, 5 steps):
#                MFU, peak memory beside the memory estimate
#   7. fp8       bench/train_gpu.py's rows with and without train.float8 at medium and xl
#                (micro-batch 8, 10 steps): MFU, and the FP8 cases of tests/test_gpu.py (speed,
#                loss curve against bf16) that decide whether FP8 may default on
#   8. checkpoint bench/checkpoint_stall.py (bench.jsonl): the stall of medium's checkpoints,
#                synchronous and with checkpoint.asynchronous
#
# steps.jsonl has one line per step: its name, exit status, seconds, whether it timed out, and
# "skipped" when the budget had run out before it. Every log is in logs.tar.gz, re-packed after
# each step (no background loop: one would hold the call's output pipe open to its limit).
# 4 and 5 were measured on 2026-11-27 and come last but 6 and 7 (new, unmeasured): what the budget
# cuts, `--steps scale,fp8` (or `tests,train,bench,scale,fp8`) runs in a second call on a machine still warm.
# 7 needs torchao in the kit (the fp8 extra); without it its rows say so and its tests skip.
#
#   on the device (the kit in ../shared/gpu):  bash .gpu/setup.sh && bash bench/gpu_check.sh
#   a dry run here, in minutes:                PYTHON=.venv/bin/python bash bench/gpu_check.sh --device cpu \
#                                                  --data SHARDS --eval-data PTB_ROOT --gpt2-tokenizer BPE --out DIR
#
# The dry run takes the tiny preset and configs/tiny.yaml on any `unmask prep` output, with
# a step or two per stage: it proves the script, not the speed (tests/end_to_end/test_gpu_check.py).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

device=cuda
data=.gpu/shards
gpt2_tokenizer=.gpu/tokenizer   # GPT-2's encoder.json and vocab.bpe, for the adapted GPT-2
eval_data=.gpu/data
out=${OUT:-gpu-check}
steps=e2e,inference,tests,adapt,train,bench,scale,fp8,checkpoint
budget=
while [ $# -gt 0 ]; do
  case $1 in
    --device) device=$2; shift 2 ;;
    --data) data=$2; shift 2 ;;
    --eval-data) eval_data=$2; shift 2 ;;
    --gpt2-tokenizer) gpt2_tokenizer=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --budget) budget=$2; shift 2 ;;
    *) echo "gpu_check.sh: unknown argument $1 (--device cuda|cpu, --data SHARDS, --eval-data DIR, --gpt2-tokenizer DIR, --out DIR," \
            "--steps A,B, --budget SECONDS)" >&2
       exit 2 ;;
  esac
done
wanted() { [[ ",$steps," == *",$1,"* ]]; }
python=${PYTHON:-python3}
unmask=("$python" -m orchestration.cli)   # `timeout` runs commands, not shell functions
mkdir -p "$out"
scratch=$(mktemp -d)            # runs and checkpoints (6 GB for medium) stay off $OUT
logs=$scratch/logs
mkdir -p "$logs"
# unmask's shared state (the local MLflow store) stays in the scratch directory; the kit has no
# SQLite stack for MLflow, so on the device the commands log to a file store there.
export UNMASK_HOME=$scratch/home
[ "$device" = cuda ] && export MLFLOW_TRACKING_URI=${MLFLOW_TRACKING_URI:-file://$scratch/mlruns}

if [ "$device" = cuda ]; then
  config=configs/medium.yaml preset=medium train_steps=30 log_every=10 micro_batches="16 32"
  e2e_steps=20 e2e_every=10 e2e_batch=64 sample_len=128 lm_eval_limit=16
  bench_steps=10 bench_warmup=3 eval_blocks=32 sample_batch=64 sample_steps=32 lm_eval_requests=256
  limit_e2e_train=150 limit_e2e_command=45 limit_e2e_eval=90 limit_e2e_init=90
  limit_tests=150 limit_inference=200 limit_train=210 limit_bench=150
  scale_presets="large xl" scale_micro=8 scale_steps=5 fp8_presets="medium xl" fp8_micro=8 fp8_steps=10
  limit_scale=240 limit_fp8=360
  limit_checkpoint=240 checkpoint_args=(--steps 12 --every 5 --warmup 2 --batch 8)
  adapt_seq_len=1024 adapt_batch=32 adapt_micro=16 limit_adapt_bench=240
  budget=${budget:-540} peak=()
else
  config=configs/tiny.yaml preset=tiny train_steps=2 log_every=1 micro_batches=2
  e2e_steps=2 e2e_every=1 e2e_batch=4 sample_len=16 lm_eval_limit=4
  bench_steps=1 bench_warmup=1 eval_blocks=2 sample_batch=2 sample_steps=4 lm_eval_requests=4
  limit_e2e_train=300 limit_e2e_command=200 limit_e2e_eval=300 limit_e2e_init=300
  limit_tests=120 limit_inference=300 limit_train=300 limit_bench=300
  scale_presets=tiny scale_micro=2 scale_steps=1 fp8_presets=tiny fp8_micro=2 fp8_steps=1
  limit_scale=300 limit_fp8=300
  limit_checkpoint=300 checkpoint_args=(--steps 4 --every 2 --warmup 0 --batch 2)
  adapt_seq_len=64 adapt_batch=4 adapt_micro=2 limit_adapt_bench=600
  budget=${budget:-3600}
  peak=(--peak-tflops 1)  # a nominal peak, so that the dry run computes every utilization
  export CUDA_VISIBLE_DEVICES=""  # a dry run on a GPU machine stays on its CPU
fi
deadline=$(( $(date +%s) + budget ))
MIN_STEP_S=10  # a step with less time left than this is skipped, not started

# step NAME SECONDS COMMAND...: run it under `timeout` (at most what the budget leaves), its
# output teed into logs/NAME.log, its line appended to steps.jsonl, the logs re-packed.
failed=0
step() {
  local name=$1 limit=$2 start rc ms timed_out=false left
  shift 2
  left=$(( deadline - $(date +%s) ))
  if [ "$left" -lt "$MIN_STEP_S" ]; then
    printf '{"step": "%s", "rc": null, "seconds": 0, "timed_out": false, "skipped": true}\n' "$name" \
      | tee -a "$out/steps.jsonl"
    return 0
  fi
  [ "$left" -lt "$limit" ] && limit=$left
  start=$(date +%s%N)
  echo "=== $name (at most ${limit}s): $*"
  timeout --kill-after=15 "$limit" "$@" 2>&1 | tee "$logs/$name.log"
  rc=${PIPESTATUS[0]}
  ms=$(( ($(date +%s%N) - start) / 1000000 ))
  { [ "$rc" = 124 ] || [ "$rc" = 137 ]; } && timed_out=true
  [ "$rc" = 0 ] || failed=1
  printf '{"step": "%s", "rc": %d, "seconds": %d.%03d, "timed_out": %s}\n' "$name" "$rc" $((ms / 1000)) \
    $((ms % 1000)) "$timed_out" | tee -a "$out/steps.jsonl"
  tar -czf "$out/logs.tar.gz" -C "$scratch" logs
}

# train_json RUN: the last logged interval of a run's metrics (compilation excluded) as one line.
train_json() {
  "$python" - "$1/metrics.jsonl" <<'PY'
import json, os, sys
path = sys.argv[1]
records = [json.loads(line) for line in open(path) if "train/loss" in line] if os.path.exists(path) else []
last = records[-1] if records else {}
print(json.dumps({"step": last.get("step"), "tokens_per_s": last.get("train/tokens_per_second"),
                  "mfu": last.get("train/mfu"), "peak_memory_gib": last.get("train/peak_memory_gib")}))
PY
}

"$python" - "$device" > "$out/environment.json" <<'PY'
import json, sys, torch
from pipeline.training.attention import available_kernels
device = torch.device(sys.argv[1])
dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
print(json.dumps({"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                  "torch": torch.__version__, "cuda": torch.version.cuda,
                  "attention_kernels": available_kernels(device, dtype, 64)}))
PY
cat "$out/environment.json"

# 1. The user's path: every command after `unmask prep`, on the device, with its defaults.
if wanted e2e; then
  run=$scratch/e2e
  step e2e-train "$limit_e2e_train" "${unmask[@]}" train --config "$config" --data "$data" --run-dir "$run" \
    --no-progress --logging.mlflow false --train.max_steps "$e2e_steps" --train.global_batch_size "$e2e_batch" \
    --logging.every "$e2e_every" --eval.every "$e2e_every" --eval.batches 2 --checkpoint.every 1000
  train_json "$run" > "$out/e2e-train.json"
  cat "$out/e2e-train.json"
  cp "$run/metrics.jsonl" "$logs/e2e-train-metrics.jsonl" 2>/dev/null
  # A new run from that run's weights (--init-from), one eager step: loaded on the device.
  step e2e-init-from "$limit_e2e_init" "${unmask[@]}" train --config "$config" --data "$data" \
    --run-dir "$scratch/e2e-init" --init-from "$run" --no-progress --logging.mlflow false --train.max_steps 1 \
    --train.global_batch_size "$e2e_batch" --train.compile false --logging.every 1 --eval.every 0
  step e2e-export "$limit_e2e_command" "${unmask[@]}" export "$run"
  step e2e-export-hf "$limit_e2e_command" "${unmask[@]}" export "$run" --format hf --out "$scratch/hf"
  step e2e-eval "$limit_e2e_eval" "${unmask[@]}" eval "$run" --datasets val --shards "$data" --quick --num-samples 2 \
    --sample-steps 32 --device "$device"
  for sampler in ancestral first-hitting confidence remdm; do
    budget_flag=(--steps 16)
    [ "$sampler" = first-hitting ] && budget_flag=()   # exact: one call per generated token
    step "e2e-sample-$sampler" "$limit_e2e_command" "${unmask[@]}" sample "$run" --num 2 --seq-len "$sample_len" \
      --sampler "$sampler" "${budget_flag[@]}" --prompt "The" --device "$device"
  done
  # Blocks: a sequence longer than the network's context, generated 4 blocks per context.
  context=$("$python" -c "import json, sys; print(json.load(open(sys.argv[1]))['network']['max_seq_len'])" \
            "$run/export/config.json" 2>/dev/null || echo 64)
  step e2e-sample-blocks "$limit_e2e_command" "${unmask[@]}" sample "$run" --num 2 \
    --seq-len $(( context + context / 4 )) --block-len $(( context / 4 )) --steps 8 --device "$device"
  # Fast generation (docs/fast-generation.md): threshold decoding with guidance after a prompt, and
  # blocks past the context with the approximate prefix cache refreshed every 4 calls.
  step e2e-sample-threshold "$limit_e2e_command" "${unmask[@]}" sample "$run" --num 2 --seq-len "$sample_len" \
    --sampler threshold --sampler-option threshold=0.9 --prompt "The" --guidance 1 --device "$device"
  step e2e-sample-prefix-cache "$limit_e2e_command" "${unmask[@]}" sample "$run" --num 2 \
    --seq-len $(( context + context / 4 )) --block-len $(( context / 4 )) --steps 8 --prefix-cache 4 --device "$device"
  # Whole-sequence blocks (each call sees the masked suffix) with the dual cache refreshed every 4 calls.
  step e2e-sample-dual-cache "$limit_e2e_command" "${unmask[@]}" sample "$run" --num 2 --seq-len "$context" \
    --block-len $(( context / 4 )) --steps 8 --whole-sequence --dual-cache 4 --device "$device"
  # Self-distillation (docs/fast-generation.md#self-distillation): two rounds of `unmask distill` from that run
  # (teacher 8 -> 4 steps, student 2), its tokens/s in logs/e2e-distill.json; the student exported and sampled.
  step e2e-distill "$limit_e2e_train" "${unmask[@]}" distill "$run" --config "$config" --data "$data" \
    --run-dir "$scratch/e2e-distill" --no-progress --logging.mlflow false --train.global_batch_size "$e2e_batch" \
    --distill.start_steps 8 --distill.end_steps 2 --distill.round_steps $(( (e2e_every + 1) / 2 )) \
    --logging.every 1 --eval.every 0 --checkpoint.every 1000
  train_json "$scratch/e2e-distill" > "$logs/e2e-distill.json"
  cat "$logs/e2e-distill.json"
  step e2e-export-distilled "$limit_e2e_command" "${unmask[@]}" export "$scratch/e2e-distill"
  step e2e-sample-distilled "$limit_e2e_command" "${unmask[@]}" sample "$scratch/e2e-distill" --num 2 \
    --seq-len "$sample_len" --steps 2 --device "$device"
  # The papers' zero-shot table under BD3-LM's protocol (BOS chunk EOS blocks, the BOS never
  # scored): the suite's sets under --eval-data (the others named as missing), on the device.
  step e2e-eval-suite "$limit_e2e_eval" "${unmask[@]}" eval "$run" --suite zero-shot --data-dir "$eval_data" \
    --protocol bd3lm --split test --seq-len "$context" --max-documents 200 --quick --device "$device" \
    --out "$scratch/suite-report"
  # BD3-LM's checkpoint format: its committed fixture (adaLN at sigma = 0, blocks of 4) imported,
  # then sampled block by block through the KV cache on the device, past its 16-token context.
  step e2e-bd3lm-tokenizer "$limit_e2e_command" "$python" -c "import sys; from pathlib import Path; \
from tests.support.bd3lm_fixtures import write_tokenizer; write_tokenizer(Path(sys.argv[1]))" "$scratch/bd3lm-tokenizer"
  step e2e-import-bd3lm "$limit_e2e_command" "${unmask[@]}" import bd3lm tests/fixtures/bd3lm/released \
    --tokenizer "$scratch/bd3lm-tokenizer" --out "$scratch/bd3lm"
  step e2e-sample-bd3lm "$limit_e2e_command" "${unmask[@]}" sample "$scratch/bd3lm" --num 2 --seq-len 32 \
    --device "$device"
  step e2e-lm-eval "$limit_e2e_eval" "${unmask[@]}" lm-eval "$run" --tasks ptb_word_order --limit "$lm_eval_limit" \
    --data-dir "$eval_data" --samples 2 --device "$device" --out "$scratch/lm-eval-report"
  step e2e-hf-load "$limit_e2e_command" "$python" - "$scratch/hf" "$run/export" "$device" <<'PY'
# transformers loads the HF export on the device and gives the unmask export's logits there.
import json, sys, torch, transformers
from pipeline.interchange.export import load_export
hf_dir, export_dir, device = sys.argv[1], sys.argv[2], torch.device(sys.argv[3])
model = transformers.AutoModelForMaskedLM.from_pretrained(hf_dir, trust_remote_code=True).to(device).eval()
network = load_export(export_dir).network.to(device).eval()
z = torch.randint(0, network.config.vocab_size + 1, (2, 64), generator=torch.Generator().manual_seed(0)).to(device)
t = torch.tensor([0.3, 0.7], device=device)
with torch.no_grad():
    theirs = model(input_ids=z, t=t).logits.float()
    ours = network(z, t).float()
difference = float((theirs - ours).abs().max())
print(json.dumps({"hf_load": type(model).__name__, "device": str(next(model.parameters()).device),
                  "max_abs_logit_difference": difference}))
assert next(model.parameters()).device.type == device.type and difference < 1e-3, difference
PY
  # Document masking (model.document_mask): the same short run with FlexAttention's per-batch
  # BlockMask (e2e-train-documents.json against e2e-train.json: its cost in tokens/s and MFU),
  # then its export scored on the device with the mask it was trained with.
  step e2e-train-documents "$limit_e2e_train" "${unmask[@]}" train --config "$config" --data "$data" \
    --run-dir "$scratch/e2e-documents" --no-progress --logging.mlflow false --model.document_mask true \
    --train.max_steps "$e2e_steps" --train.global_batch_size "$e2e_batch" --logging.every "$e2e_every" \
    --eval.every "$e2e_every" --eval.batches 2 --checkpoint.every 1000
  train_json "$scratch/e2e-documents" > "$out/e2e-train-documents.json"
  cat "$out/e2e-train-documents.json"
  step e2e-eval-documents "$limit_e2e_eval" "${unmask[@]}" eval "$scratch/e2e-documents" --datasets val \
    --shards "$data" --quick --device "$device"
fi

# 2. Inference: evaluation (as before and as now), sampling 64 x 1024, lm-eval's scoring.
if wanted inference; then
  step inference "$limit_inference" "$python" bench/train_gpu.py --device "$device" --data "$data" \
    --presets "$preset" --skip-training --eval-blocks "$eval_blocks" --repeats 1 --sample-batch "$sample_batch" \
    --sample-steps "$sample_steps" --lm-eval-requests "$lm_eval_requests" "${peak[@]}"
  grep -h '^{' "$logs/inference.log" >> "$out/bench.jsonl"
fi

# 3. Correctness on the device.
wanted tests && step tests "$limit_tests" "$python" -m pytest tests/test_gpu.py -v -p no:cacheprovider

# Adapting: a GPT-2 of the preset's shape, its data, 20 steps of the recipe (annealing the
# first half), export, sample; the MFU of the adapted network beside ours (and annealed).
if wanted adapt; then
  source=$scratch/gpt2-source adapt=$scratch/adapt
  step adapt-source "$limit_e2e_command" "$python" bench/gpt2_source.py --preset "$preset" --seq-len "$adapt_seq_len" \
    --tokenizer "$gpt2_tokenizer" --out "$source"
  step adapt-prep "$limit_e2e_command" "${unmask[@]}" prep --input "$eval_data/ptb" \
    --tokenizer "$source/tokenizer.json" --seq-len "$adapt_seq_len" --text-format lines --val-fraction 0.3 \
    --workers 1 --no-progress --out "$scratch/adapt-shards"
  step adapt-train "$limit_e2e_train" "${unmask[@]}" train --config configs/adapt-gpt2-medium.yaml \
    --data "$scratch/adapt-shards" --run-dir "$adapt" --init-from "$source" --no-progress --logging.mlflow false \
    --train.max_steps "$e2e_steps" --train.global_batch_size "$adapt_batch" --adapt.anneal_steps $(( e2e_steps / 2 )) \
    --logging.every "$e2e_every" --eval.every "$e2e_every" --eval.batches 2 --checkpoint.every 1000
  train_json "$adapt" > "$out/adapt-train.json"
  cat "$out/adapt-train.json"
  step adapt-export "$limit_e2e_command" "${unmask[@]}" export "$adapt" --out "$scratch/adapt-export"
  step adapt-sample "$limit_e2e_command" "${unmask[@]}" sample "$scratch/adapt-export" --num 2 \
    --seq-len "$sample_len" --sampler first-hitting --prompt "The" --device "$device"
  step adapt-bench "$limit_adapt_bench" "$python" bench/train_gpu.py --device "$device" --data "$scratch/adapt-shards" \
    --presets "$preset" --micro-batches "$adapt_micro" --steps "$bench_steps" --warmup "$bench_warmup" \
    --skip-inference --variants pipeline-zero1 pipeline-zero1+adapt-gpt2 pipeline-zero1+adapt-gpt2+annealed
  grep -h '^{' "$logs/adapt-bench.log" >> "$out/bench.jsonl"
fi

# 4. The headline: the preset with the defaults (micro-batch, compile and attention "auto").
if wanted train; then
  step train "$limit_train" "${unmask[@]}" train --config "$config" --data "$data" --run-dir "$scratch/train" \
    --no-progress --logging.mlflow false --train.max_steps "$train_steps" --logging.every "$log_every" --eval.every 0 \
    --eval.batches 2
  train_json "$scratch/train" > "$out/train.json"
  grep -h "setup:" "$logs/train.log" | tail -1
  cat "$out/train.json"
fi

# 5. Training rows: the pipeline before its GPU defaults and with them.
if wanted bench; then
  step bench "$limit_bench" "$python" bench/train_gpu.py --device "$device" --data "$data" --presets "$preset" \
    --micro-batches $micro_batches --steps "$bench_steps" --warmup "$bench_warmup" --skip-inference \
    --variants pipeline-zero1+eager+unpadded+flash pipeline-zero1
  grep -h '^{' "$logs/bench.log" >> "$out/bench.jsonl"
fi
# 6. The large and xl presets: a few steps each, peak memory against the estimate.
if wanted scale; then
  step scale "$limit_scale" "$python" bench/train_gpu.py --device "$device" --data "$data" --presets $scale_presets \
    --micro-batches "$scale_micro" --steps "$scale_steps" --warmup "$bench_warmup" --skip-inference \
    --variants pipeline-zero1 "${peak[@]}"
  grep -h '^{' "$logs/scale.log" >> "$out/bench.jsonl"
fi
# 7. FP8: MFU with and without at medium and xl, then the tests that decide its default.
if wanted fp8; then
  step fp8 "$limit_fp8" "$python" bench/train_gpu.py --device "$device" --data "$data" --presets $fp8_presets \
    --micro-batches "$fp8_micro" --steps "$fp8_steps" --warmup "$bench_warmup" --skip-inference \
    --variants pipeline-zero1 pipeline-zero1+fp8 "${peak[@]}"
  grep -h '^{' "$logs/fp8.log" >> "$out/bench.jsonl"
fi
# 8. The stall of a checkpoint, synchronous and asynchronous (the runs stay in the scratch directory).
if wanted checkpoint; then
  step checkpoint "$limit_checkpoint" "$python" bench/checkpoint_stall.py --data "$data" --preset "$preset" \
    --layers 0 --d-model 0 "${checkpoint_args[@]}" --root "$scratch"
  grep -h '"bench": "checkpoint"' "$logs/checkpoint.log" >> "$out/bench.jsonl"
fi
tar -czf "$out/logs.tar.gz" -C "$scratch" logs
echo "gpu_check.sh: done; results in $out (steps.jsonl, e2e-train.json, adapt-train.json, train.json, bench.jsonl," \
  "logs.tar.gz)"
exit "$failed"
