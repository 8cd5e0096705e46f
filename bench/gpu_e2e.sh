#!/usr/bin/env bash
# One GPU cycle for the single-GPU engine (run on the lent GPU machine, from the checkout root):
#   1. the GPU op tests (CUDA against the reference backend);
#   2. tiny GPT and Llama trained 20 steps on the GPU (fp32 and bf16) beside the CPU reference
#      backend, same seed and data: the loss columns and their largest relative difference;
#   3. the Hugging Face logits check against transformers (tests/hf/check_hf_logits.py);
#   4. the three benchmark configs (bench/run_bench.sh), megatrain only unless PYTORCH=1.
#   bench/gpu_e2e.sh <dir with megatrain and megatrain_gpu_tests> [steps to run: tests,tiny,hf,bench]
set -uo pipefail
cd "$(dirname "$0")/.."
bin=${1:?binary directory}
steps=${2:-tests,tiny,hf,bench}
out=${OUT:-/tmp/gpu-e2e}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
summary=()

if [[ $steps == *tests* ]]; then
  "$bin/megatrain_gpu_tests" > "$out/gpu_tests.log" 2>&1
  rc=$?
  summary+=("gpu tests: rc=$rc, $(tail -n 3 "$out/gpu_tests.log" | tr '\n' ' ')")
fi

if [[ $steps == *tiny* ]]; then
  common="--mock-data --tokenizer-type NullTokenizer --vocab-size 512 --seq-length 128 --max-position-embeddings 128
    --micro-batch-size 4 --global-batch-size 8 --train-iters 20 --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine
    --lr-warmup-iters 2 --clip-grad 1.0 --attention-dropout 0.0 --hidden-dropout 0.0 --log-interval 1 --eval-iters 0 --seed 1234"
  gpt="--num-layers 2 --hidden-size 128 --num-attention-heads 4"
  llama="--num-layers 2 --hidden-size 128 --num-attention-heads 4 --group-query-attention --num-query-groups 2
    --ffn-hidden-size 256 --swiglu --normalization RMSNorm --position-embedding-type rope
    --untie-embeddings-and-output-weights --disable-bias-linear"
  for model in gpt llama; do
    flags="$common ${!model}"
    # shellcheck disable=SC2086
    "$bin/megatrain" $flags --device cpu --metrics-jsonl "$out/$model.cpu.jsonl" > "$out/$model.cpu.log" 2>&1
    # shellcheck disable=SC2086
    "$bin/megatrain" $flags --device gpu --metrics-jsonl "$out/$model.gpu32.jsonl" > "$out/$model.gpu32.log" 2>&1
    # shellcheck disable=SC2086
    "$bin/megatrain" $flags --device gpu --bf16 --metrics-jsonl "$out/$model.gpubf16.jsonl" > "$out/$model.gpubf16.log" 2>&1
    summary+=("$(python3 - "$model" "$out" <<'PY'
import json, sys
model, out = sys.argv[1], sys.argv[2]
def losses(kind):
    try:
        rows = [json.loads(l) for l in open(f"{out}/{model}.{kind}.jsonl")]
    except OSError:
        return {}
    return {r["iteration"]: r["lm_loss"] for r in rows if r.get("type") == "iteration" and r.get("lm_loss") is not None}
cpu, g32, g16 = losses("cpu"), losses("gpu32"), losses("gpubf16")
lines = [f"{model}: iter  cpu-fp32   gpu-fp32   gpu-bf16"]
for it in sorted(cpu):
    lines.append(f"  {it:4d} {cpu[it]:.6f} {g32.get(it, float('nan')):.6f} {g16.get(it, float('nan')):.6f}")
def maxrel(a):
    return max((abs(a[i] - cpu[i]) / abs(cpu[i]) for i in cpu if i in a), default=float("nan")) if len(a) == len(cpu) else float("nan")
lines.append(f"  {model}: max rel diff gpu-fp32 {maxrel(g32):.2e}, gpu-bf16 {maxrel(g16):.2e}; first/last cpu loss {cpu.get(1, float('nan')):.4f}/{cpu.get(20, float('nan')):.4f}")
print("\n".join(lines))
PY
)")
  done
fi

if [[ $steps == *hf* ]]; then
  python3 tests/hf/check_hf_logits.py --megatrain "$bin/megatrain" --device gpu > "$out/hf.log" 2>&1
  summary+=("hf logits (gpu, fp32 forward): rc=$? $(tail -n 2 "$out/hf.log" | tr '\n' ' ')")
fi

if [[ $steps == *bench* ]]; then
  opts=(--megatrain "$bin/megatrain" --iters "${BENCH_ITERS:-20}" --warmup 5)
  [ "${PYTORCH:-0}" = 1 ] || opts+=(--no-pytorch)
  bench/run_bench.sh "${opts[@]}" > "$out/bench.log" 2>&1
  summary+=("$(tail -n 8 "$out/bench.log")")
fi

echo
printf '%s\n' "${summary[@]}"
