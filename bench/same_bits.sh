#!/usr/bin/env bash
# Two megatrain binaries (e.g. before and after a refactor) trained on the same runs must print the
# same bits: every iteration's loss and gradient norm equal, not merely close.
#
#   bench/same_bits.sh BIN_A BIN_B [gpu|cpu] [runs]
#
# gpu (default): the three benchmark configs of bench/run_bench.sh (gpt2-124m, gpt-1.3b,
#   llama-1b) in bf16, gpt-1.3b / llama-1b with FP8 (hybrid, delayed and tensorwise scaling), and
#   moe-mixtral-proxy's model at 8 layers (and at 4 layers with linear biases), each for ITERS (default 6)
#   iterations with --deterministic-mode on --mock-data; llama-1b also under --optimizer muon.
# cpu: tiny GPT and Llama models on the reference backend (float32), also with FP8, recompute,
#   dropout, q/k norm, a sliding window and MoE (also with linear biases), and over MPI ranks
#   (TP2+SP x PP2, TP2 x DP2 with the distributed optimizer, TP2+SP x DP2 with FP8, MoE at EP2 with
#   expert TP 2 and 1) where mpirun is.
# runs: a comma-separated subset of the run names printed (default: all).
# EXTRA: flags added to every run (e.g. --log-params-norm: the parameters' norm compared as well).
# Prints one line per run ("same" or the first difference) and exits non-zero on any difference.
set -uo pipefail
cd "$(dirname "$0")/.."
a=${1:?binary A}
b=${2:?binary B}
where=${3:-gpu}
only=${4:-}
iters=${ITERS:-6}
out=${OUT:-/tmp}/same-bits-$$
mkdir -p "$out"

declare -A runs
order=()
add() { runs[$1]="$2"; order+=("$1"); }
if [ "$where" = gpu ]; then
  common="--device gpu --bf16 --mock-data --tokenizer-type NullTokenizer --attention-dropout 0.0 --hidden-dropout 0.0
    --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.1 --clip-grad 1.0
    --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.02 --log-interval 1 --eval-iters 0
    --train-iters $iters --deterministic-mode --seed 1234"
  norms="--recompute-granularity selective --recompute-modules core_attn layernorm"
  gpt2="--num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024 --max-position-embeddings 1024
    --micro-batch-size 32 --global-batch-size 32 --vocab-size 50304"
  gpt13="$norms --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048
    --max-position-embeddings 2048 --micro-batch-size 8 --global-batch-size 8 --vocab-size 50304"
  llama="$norms --num-layers 16 --hidden-size 2048 --num-attention-heads 32 --group-query-attention
    --num-query-groups 8 --ffn-hidden-size 8192 --seq-length 4096 --max-position-embeddings 4096
    --micro-batch-size 2 --global-batch-size 2 --vocab-size 128256 --swiglu --normalization RMSNorm
    --position-embedding-type rope --untie-embeddings-and-output-weights --disable-bias-linear"
  delayed="--fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 16 --fp8-amax-compute-algo max"
  tensorwise="--fp8-format hybrid --fp8-recipe tensorwise"
  add gpt2-124m "$common $gpt2"
  add gpt-1.3b "$common $gpt13"
  add llama-1b "$common $llama"
  add gpt-1.3b-fp8-delayed "$common $gpt13 $delayed"
  add llama-1b-fp8-delayed "$common $llama $delayed"
  add gpt-1.3b-fp8-tensorwise "$common $gpt13 $tensorwise"
  add llama-1b-fp8-tensorwise "$common $llama $tensorwise"
  add gpt-1.3b-gelu-recompute "$common $gpt13 --recompute-granularity full --recompute-method uniform --recompute-num-layers 2"
  add llama-1b-muon "$common $llama --optimizer muon"
  moe="--num-layers 8 --hidden-size 2048 --num-attention-heads 32 --group-query-attention --num-query-groups 8
    --seq-length 4096 --max-position-embeddings 4096 --micro-batch-size 2 --global-batch-size 2 --vocab-size 32000
    --swiglu --normalization RMSNorm --position-embedding-type rope --untie-embeddings-and-output-weights
    --disable-bias-linear --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 5632 --moe-grouped-gemm
    --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2"
  add moe-mixtral-proxy-8-layers "$common $moe"
  # (MoE with linear biases: binaries from before 50a5c3b refuse it.)
  add moe-linear-bias-4-layers "$common ${moe/--disable-bias-linear/} --num-layers 4"
else
  common="--device cpu --mock-data --tokenizer-type NullTokenizer --vocab-size 96 --seq-length 32
    --max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --min-lr 3e-4
    --lr-decay-style cosine --lr-warmup-iters 2 --clip-grad 1.0 --log-interval 1 --eval-iters 0
    --train-iters $iters --seed 1234 --num-layers 4 --hidden-size 64 --num-attention-heads 4"
  llama="--group-query-attention --num-query-groups 2 --ffn-hidden-size 96 --swiglu --normalization RMSNorm
    --position-embedding-type rope --untie-embeddings-and-output-weights --disable-bias-linear"
  nodrop="--attention-dropout 0.0 --hidden-dropout 0.0"
  add gpt "$common $nodrop"
  add gpt-dropout "$common --attention-dropout 0.1 --hidden-dropout 0.1"
  add llama "$common $nodrop $llama"
  add gpt-recompute "$common $nodrop --recompute-granularity full --recompute-method block --recompute-num-layers 2"
  add gpt-fp8-delayed "$common $nodrop --fp8-format hybrid --fp8-recipe delayed"
  add llama-fp8-tensorwise "$common $nodrop $llama --fp8-format hybrid --fp8-recipe tensorwise"
  add gpt-squared-relu "$common $nodrop --squared-relu --no-bias-gelu-fusion"
  add llama-qk-norm-window "$common $nodrop $llama --qk-layernorm --window-size 7,0"
  moe="$llama --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 48 --moe-grouped-gemm
    --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2"
  add moe "$common $nodrop $moe"
  # (MoE with linear biases, the router's and the experts': binaries from before 50a5c3b refuse it.)
  add moe-linear-bias "$common $nodrop ${llama/--disable-bias-linear/} --num-experts 4 --moe-router-topk 2
    --moe-ffn-hidden-size 48 --moe-grouped-gemm --moe-aux-loss-coeff 1e-2"
  if command -v mpirun > /dev/null; then
    mpi="mpirun -np 4 --oversubscribe --allow-run-as-root"
    add mpi-tp2sp-pp2 "$common $nodrop --tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2"
    add mpi-dp2-distopt "$common $nodrop $llama --use-distributed-optimizer --tensor-model-parallel-size 2"
    add mpi-tp2sp-fp8 "$common $nodrop --tensor-model-parallel-size 2 --sequence-parallel --fp8-format hybrid --fp8-recipe tensorwise"
    add mpi-moe-ep2-tp2sp-distopt "$common $nodrop $moe --expert-model-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel --use-distributed-optimizer"
    add mpi-moe-etp1-ep2-dp2 "$common $nodrop $moe --expert-model-parallel-size 2 --expert-tensor-parallel-size 1 --tensor-model-parallel-size 2 --sequence-parallel --use-distributed-optimizer"
  fi
fi

fail=0
for name in "${order[@]}"; do
  if [ -n "$only" ] && [[ ",$only," != *",$name,"* ]]; then continue; fi
  launcher=""
  [[ $name == mpi-* ]] && launcher="$mpi"
  for side in a b; do
    bin=$a
    [ $side = b ] && bin=$b
    rm -f "$out/$name.$side.jsonl"
    # shellcheck disable=SC2086
    if ! $launcher "$bin" ${runs[$name]} ${EXTRA:-} --metrics-jsonl "$out/$name.$side.jsonl" > "$out/$name.$side.log" 2>&1; then
      echo "$name: binary $side failed: $(tail -n 2 "$out/$name.$side.log" | tr '\n' ' ')"
      fail=1
      continue 2
    fi
  done
  python3 - "$name" "$out/$name.a.jsonl" "$out/$name.b.jsonl" "$iters" <<'PY' || fail=1
import json, sys
name, fa, fb, iters = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
def rows(f):
    return [(r["iteration"], r.get("lm_loss"), r.get("grad_norm"), r.get("params_norm")) for r in map(json.loads, open(f))
            if r.get("type") == "iteration"]
ra, rb = rows(fa), rows(fb)
if len(ra) != iters or len(rb) != iters:
    print(f"{name}: DIFFERENT iteration counts {len(ra)} and {len(rb)} (want {iters})")
    sys.exit(1)
for x, y in zip(ra, rb):
    if x != y:
        print(f"{name}: DIFFERENT at iteration {x[0]}: loss {x[1]!r} vs {y[1]!r}, grad norm {x[2]!r} vs {y[2]!r}, "
              f"params norm {x[3]!r} vs {y[3]!r}")
        sys.exit(1)
norm = f", params norm {ra[-1][3]!r}" if ra[-1][3] is not None else ""
print(f"{name}: same ({iters} iterations; last loss {ra[-1][1]!r}, grad norm {ra[-1][2]!r}{norm})")
PY
done
exit $fail
