#!/usr/bin/env bash
# One GPU cycle for the single-GPU engine (run on the lent GPU machine, from the checkout root):
#   1. the GPU op tests (CUDA against the reference backend);
#   2. tiny GPT and Llama (head dim 64) trained 20 steps on the GPU beside the CPU reference
#      backend, same seed and data: fp32 (generic attention kernels, no TF32), bf16 (attention
#      auto = cuDNN) and bf16 with --attention-backend flash (our tensor-core kernels); the loss
#      columns and their largest relative difference, against the bounds fp32 1e-4, bf16 1e-2;
#   3. the Hugging Face logits check against transformers (tests/hf/check_hf_logits.py), with
#      megatrain's forward in fp32 and in bf16;
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
  # TINY_SEQ / TINY_MBS change the shape: e.g. 200 x 5 = 1000 tokens per micro-batch, a k with a
  # tail for the weight-gradient GEMMs (cuda/gemm_splitk_guard.h) and a sequence off the tiles.
  # TINY_EXTRA adds model flags to every model (e.g. "--window-size 31,0 --window-attn-skip-freq 2");
  # TINY_MODELS picks the models (default "gpt llama"; also "nemotron": LayerNorm1P, squared ReLU,
  # RoPE over half of each head; "moe", "moe_ds", "gptoss": mixtures of experts, below).
  seq=${TINY_SEQ:-128} mbs=${TINY_MBS:-4}
  common="--mock-data --tokenizer-type NullTokenizer --vocab-size 512 --seq-length $seq --max-position-embeddings $seq
    --micro-batch-size $mbs --global-batch-size $((2 * mbs)) --train-iters ${TINY_ITERS:-20} --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine
    --lr-warmup-iters 2 --clip-grad 1.0 --attention-dropout 0.0 --hidden-dropout 0.0 --log-interval 1 --eval-iters 0 --seed 1234"
  # Head dim 64 (256 / 4): the shapes the fast attention paths take.
  gpt="--num-layers 2 --hidden-size 256 --num-attention-heads 4"
  llama="--num-layers 2 --hidden-size 256 --num-attention-heads 4 --group-query-attention --num-query-groups 2
    --ffn-hidden-size 512 --swiglu --normalization RMSNorm --position-embedding-type rope
    --untie-embeddings-and-output-weights --disable-bias-linear"
  nemotron="--num-layers 2 --hidden-size 256 --num-attention-heads 4 --group-query-attention --num-query-groups 2
    --ffn-hidden-size 512 --squared-relu --apply-layernorm-1p --position-embedding-type rope --rotary-percent 0.5
    --untie-embeddings-and-output-weights --disable-bias-linear"
  # Mixture of experts on the Llama shape: Mixtral's softmax top-2 with aux + global aux + z-losses;
  # DeepSeek's sigmoid top-2 of 6 with the expert bias, scaling and seq_aux_loss; gpt-oss's clamped
  # quick-GeGLU experts with the linear offset. Their float32 runs are the check against the
  # reference; in bf16 a rounding that flips a routing choice moves the loss past the dense bound.
  moe="$llama --num-experts 4 --moe-router-topk 2 --moe-grouped-gemm --moe-token-dispatcher-type alltoall
    --moe-router-load-balancing-type aux_loss global_aux_loss --moe-aux-loss-coeff 1e-2 1e-3 --moe-z-loss-coeff 1e-3"
  moe_ds="$llama --num-experts 6 --moe-router-topk 2 --moe-grouped-gemm --moe-router-score-function sigmoid
    --moe-router-enable-expert-bias --moe-router-topk-scaling-factor 2.5 --moe-router-load-balancing-type seq_aux_loss
    --moe-aux-loss-coeff 1e-3 --moe-shared-expert-intermediate-size 256"
  gptoss="${llama/--swiglu/--quick-geglu --glu-linear-offset 1.0 --activation-func-clamp-value 7.0} --num-experts 4
    --moe-router-topk 2 --moe-grouped-gemm --moe-aux-loss-coeff 1e-2"
  for model in ${TINY_MODELS:-gpt llama}; do
    flags="$common ${!model} ${TINY_EXTRA:-}"
    run() {  # kind, extra flags
      local kind=$1
      shift
      # shellcheck disable=SC2086
      "$bin/megatrain" $flags "$@" --metrics-jsonl "$out/$model.$kind.jsonl" > "$out/$model.$kind.log" 2>&1 ||
        echo "$model $kind: exit $? -- $(tail -n 2 "$out/$model.$kind.log" | tr '\n' ' ')" >> "$out/tiny_failures.log"
    }
    run cpu --device cpu
    run gpu32 --device gpu
    run gpubf16 --device gpu --bf16
    run gpubf16flash --device gpu --bf16 --attention-backend flash
    summary+=("$(python3 - "$model" "$out" <<'PY'
import json, sys
model, out = sys.argv[1], sys.argv[2]
def losses(kind):
    try:
        rows = [json.loads(l) for l in open(f"{out}/{model}.{kind}.jsonl")]
    except OSError:
        return {}
    return {r["iteration"]: r["lm_loss"] for r in rows if r.get("type") == "iteration" and r.get("lm_loss") is not None}
cpu = losses("cpu")
kinds = [("gpu32", "gpu-fp32", 1e-4), ("gpubf16", "gpu-bf16", 1e-2), ("gpubf16flash", "bf16-flash", 1e-2)]
runs = {k: losses(k) for k, _, _ in kinds}
lines = [f"{model}: iter  cpu-fp32  " + "  ".join(f"{label:>9}" for _, label, _ in kinds)]
for it in sorted(cpu):
    lines.append(f"  {it:4d} {cpu[it]:.6f} " + " ".join(f"{runs[k].get(it, float('nan')):.6f}" for k, _, _ in kinds))
def maxrel(a):
    return max((abs(a[i] - cpu[i]) / abs(cpu[i]) for i in cpu if i in a), default=float("nan")) if cpu and len(a) == len(cpu) else float("nan")
verdicts = []
for k, label, bound in kinds:
    r = maxrel(runs[k])
    verdicts.append(f"{label} {r:.2e} ({'ok' if r <= bound else 'FAIL'}, bound {bound:g})")
lines.append(f"  {model}: max rel diff vs cpu: " + ", ".join(verdicts) +
             f"; first/last cpu loss {cpu.get(1, float('nan')):.4f}/{cpu.get(20, float('nan')):.4f}")
print("\n".join(lines))
PY
)")
  done
  [ -s "$out/tiny_failures.log" ] && summary+=("tiny runs that failed: $(cat "$out/tiny_failures.log")")
fi

if [[ $steps == *hf* ]]; then
  python3 tests/hf/check_hf_logits.py --megatrain "$bin/megatrain" --device gpu > "$out/hf.log" 2>&1
  summary+=("hf logits (gpu, fp32 forward): rc=$? $(tail -n 2 "$out/hf.log" | tr '\n' ' ')")
  python3 tests/hf/check_hf_logits.py --megatrain "$bin/megatrain" --device gpu --forward-bf16 > "$out/hf_bf16.log" 2>&1
  summary+=("hf logits (gpu, bf16 forward): rc=$? $(tail -n 2 "$out/hf_bf16.log" | tr '\n' ' ')")
fi

if [[ $steps == *bench* ]]; then
  opts=(--megatrain "$bin/megatrain" --iters "${BENCH_ITERS:-20}" --warmup 5)
  [ "${PYTORCH:-0}" = 1 ] || opts+=(--no-pytorch)
  bench/run_bench.sh "${opts[@]}" > "$out/bench.log" 2>&1
  summary+=("$(tail -n 8 "$out/bench.log")")
fi

echo
printf '%s\n' "${summary[@]}"
