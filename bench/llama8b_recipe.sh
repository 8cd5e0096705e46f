#!/usr/bin/env bash
# Megatron-LM's Llama-3 8B recipe (examples/llama/train_llama3_8b_h100_fp8.sh: its model, optimizer
# and precision flags) on the GPUs of one host, data parallel with the distributed optimizer, as
# that script runs it (TP 1, PP 1), on mock data. Prints each run's planned memory per GPU, its
# device memory in use, and the median tokens/s per GPU, TFLOP/s per GPU and MFU of the iterations
# after the first 2.
#
#   bench/llama8b_recipe.sh [--bin DIR] [--gpus N] [--iters N] [--micro-batches N] [--fp8 | --fp8-no-param-gather] [--extra "FLAGS"]
#
# --micro-batches: per rank and step (global batch = N x GPUs; the recipe's 128 would take ~25 s a
# step on 4 GPUs). --fp8 adds the recipe's FP8 flags (hybrid, delayed, amax history 1024, max,
# --fp8-param-gather); --fp8-no-param-gather instead drops that one flag (for comparison).
# TIMEOUT_S (default 560) limits the run. Logs go to $OUT (or /tmp).
set -u
cd "$(dirname "$0")/.."
bin=build/app/megatrain
gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | wc -l)
iters=8
mbs_per_rank=4
fp8=""
extra=""
while [ $# -gt 0 ]; do
  case "$1" in
    --bin) bin="$2/megatrain"; shift 2 ;;
    --gpus) gpus="$2"; shift 2 ;;
    --iters) iters="$2"; shift 2 ;;
    --micro-batches) mbs_per_rank="$2"; shift 2 ;;
    --fp8) fp8="--fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max --fp8-param-gather"; shift ;;
    --fp8-no-param-gather) fp8="--fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max"; shift ;;
    --extra) extra="$2"; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
[ "$gpus" -ge 1 ] || { echo "llama8b_recipe.sh needs a GPU"; exit 77; }
out=${OUT:-/tmp}/llama8b-$$
mkdir -p "$out"
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}

# The recipe's flags (checkpointing, profiling, data and logging flags left out; --log-interval 1).
recipe="--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 --group-query-attention
  --num-query-groups 8 --kv-channels 128 --seq-length 8192 --max-position-embeddings 8192 --position-embedding-type rope
  --rotary-base 1000000 --rotary-percent 1.0 --attention-dropout 0.0 --hidden-dropout 0.0 --swiglu --normalization RMSNorm
  --init-method-std 0.0134 --attention-backend fused --apply-layernorm-1p --untie-embeddings-and-output-weights
  --disable-bias-linear --micro-batch-size 1 --lr 0.00015 --min-lr 0.00001 --decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5
  --lr-decay-style cosine --lr-warmup-iters 2 --clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16
  --grad-reduce-in-bf16 --cross-entropy-loss-fusion --calculate-per-token-loss --use-distributed-optimizer
  --overlap-grad-reduce --overlap-param-gather --tensor-model-parallel-size 1 --context-parallel-size 1
  --mock-data --tokenizer-type NullTokenizer --vocab-size 128256 --log-interval 1 --log-throughput --eval-iters 0"
gbs=$((mbs_per_rank * gpus))
name="llama8b_${gpus}gpu${fp8:+_fp8}$(case "$fp8" in *param-gather*) echo _pg ;; esac)"
# shellcheck disable=SC2086
echo "\$ megatrain <recipe> --global-batch-size $gbs --train-iters $iters $fp8 $extra"
# shellcheck disable=SC2086
timeout "${TIMEOUT_S:-560}" "$bin" $recipe --global-batch-size "$gbs" --train-iters "$iters" $fp8 $extra \
  --metrics-jsonl "$out/$name.jsonl" > "$out/$name.log" 2>&1
rc=$?
grep -E "memory plan|peak:|\[rank [0-9]+\] memory:|error|Error" "$out/$name.log" | head -n 20
[ $rc -ne 0 ] && { echo "FAILED (exit $rc); last lines:"; tail -n 15 "$out/$name.log"; }
python3 - "$out/$name.jsonl" "$gpus" <<'EOF'
import json, os, statistics, sys
path, gpus = sys.argv[1], int(sys.argv[2])
recs = [r for r in map(json.loads, open(path)) if r.get("type") == "iteration"] if os.path.exists(path) else []
steady = [r for r in recs if r["iteration"] > 2]
if not steady:
    print("no iterations after the first 2")
    sys.exit(0)
med = lambda k: statistics.median(r[k] for r in steady if k in r)
print(f"iterations {len(recs)}; lm loss first {recs[0]['lm_loss']:.4f} last {recs[-1]['lm_loss']:.4f}")
print(f"median of iterations 3..: {med('tokens_per_second') / gpus:,.0f} tokens/s per GPU, "
      f"{med('tflops_per_gpu'):.1f} TFLOP/s per GPU, MFU {med('tflops_per_gpu') / 989.0 * 100:.1f}% of 989")
EOF
