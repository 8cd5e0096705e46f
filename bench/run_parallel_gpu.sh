#!/usr/bin/env bash
# Multi-GPU training on one host with 2 GPUs: equivalence with one GPU, scaling and memory, and the
# NCCL tests. Every multi-GPU run goes through the workstation launcher (a bare `megatrain
# --tensor-model-parallel-size 2 ...` starts one worker per GPU); one-GPU runs use
# CUDA_VISIBLE_DEVICES=0. All runs: --bf16 --mock-data, NullTokenizer, no dropout.
#
#   bench/run_parallel_gpu.sh [--bin DIR | --megatrain build/app/megatrain] [--skip-nccl] [--quick] [--four]
#   --bin DIR: a directory holding megatrain (and nccl_comm_test, nccl_bandwidth for step 3: it
#   becomes run_nccl_tests.sh's BIN). The whole script keeps to about 5 minutes: each run has a
#   time limit, and runs that would start after BUDGET_S (default 270) seconds are skipped (and say so).
#   ONLY='eq_1gpu|eq_pp2' runs only the runs of those names.
#
# 1. Equivalence: gpt2-124m, 20 iterations, 1 GPU vs itself, TP=2, TP=2+SP, PP=2, interleaved PP=2
#    and DP=2 (same global batch, same data; --deterministic-mode): both loss columns per iteration
#    and the largest relative difference (bf16: PASS below 2e-2); FP8 (hybrid, delayed) 1 GPU vs
#    TP=2+SP and DP=2 (PASS below 2e-2); bf16 main grads (--grad-reduce-in-bf16) on 1 GPU and DP=2
#    against float32 ones (PASS below 2e-2); FP8 parameters (--fp8-param-gather; delayed and
#    tensorwise) on 1 GPU and DP=2 against FP8 without them (PASS below 2e-2); tensorwise FP8 without
#    them over DP=2; the precision-aware optimizer (bf16 moments, bf16 main grads, master-weight
#    remainders) on 1 GPU and DP=2 against plain bf16 (PASS below 2e-2); and in fp32 on 4
#    layers, 1 GPU vs TP=2+SP, PP=2 and interleaved PP=2 (PASS below 1e-4).
# 2. Scaling (iterations after the first 4 of 12, median):
#      DP=2 tokens/s vs 1 GPU on gpt2-124m and gpt-1.3b (weak scaling, target >= 1.9x), with the
#        distributed optimizer and overlapped gradient reduce-scatter / parameter all-gather;
#      TP=2+SP TFLOP/s per GPU vs 1 GPU on gpt-1.3b (same batch; target >= 0.8x);
#      PP=2 with 8 micro-batches TFLOP/s per GPU vs 1 GPU with the same micro-batches (target >= 0.85x),
#        1F1B and interleaved (2 chunks of 6 layers per stage);
#    and each layout's per-GPU memory (planned buffers and device memory in use beyond the CUDA
#    context after the run, from the
#    "[rank N] memory:" lines).
# 3. bench/run_nccl_tests.sh (MAX_MB=256).
# --four (4 GPUs) instead: equivalence with 1 GPU of TP=2 x PP=2, TP=2 x DP=2 with the distributed
# optimizer and PP=4 interleaved, in bf16 (--deterministic-mode, gpt2-124m) and fp32 (8 layers),
# and FP8 parameters (delayed, tensorwise) over TP=2+SP x DP=2 and PP=2 x DP=2 against 1 GPU's;
# then tokens/s and TFLOP/s per GPU of those layouts on gpt-1.3b against 1 GPU.
# The summary table is printed last. Logs go to $OUT (or /tmp).
set -u
cd "$(dirname "$0")/.."
bin=build/app/megatrain
nccl=1
quick=0
four=0
while [ $# -gt 0 ]; do
  case "$1" in
    --megatrain) bin="$2"; shift 2 ;;
    --bin) bin="$2/megatrain"; [ -x "$2/nccl_comm_test" ] && export BIN="$2"; shift 2 ;;
    --skip-nccl) nccl=0; shift ;;
    --quick) quick=1; shift ;;
    --four) four=1; nccl=0; shift ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
budget=${BUDGET_S:-270}  # seconds after which no further run starts
out=${OUT:-/tmp}/parallel-gpu-$$
mkdir -p "$out"
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
ngpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | wc -l)
if [ "$ngpu" -lt 2 ]; then
  echo "run_parallel_gpu.sh needs 2 GPUs, found $ngpu"
  exit 77
fi
if [ "$four" = 1 ]; then
  [ "$ngpu" -ge 4 ] || { echo "--four needs 4 GPUs, found $ngpu"; exit 77; }
  export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0,1,2,3}
fi
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0,1}
one_gpu=${CUDA_VISIBLE_DEVICES%%,*}

common="--mock-data --tokenizer-type NullTokenizer --attention-dropout 0.0 --hidden-dropout 0.0
  --min-lr 3e-5 --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0
  --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.02 --log-interval 1 --log-throughput
  --eval-iters 0 --split 100,0,0 --vocab-size 50304 --make-vocab-size-divisible-by 64 --seed 1234"
# Scaling runs: the schedule of the first runs (speed does not depend on it).
sched="--lr 3e-4 --lr-warmup-iters 2"
# bf16 equivalence: --deterministic-mode (so that one GPU repeats itself bit for bit and every
# difference is the layout's rounding) and a warm-up of 10 iterations at a peak of 1e-4. The first
# runs used 3e-4 after 2 warm-up iterations: there one GPU differed from ITSELF by 2.1% between
# two calls (bench/RESULTS.md), so that setting could not judge a layout in bf16.
eqsched="--lr 1e-4 --lr-warmup-iters 10 --deterministic-mode"
gpt2="--num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024 --max-position-embeddings 1024"
gpt13="--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048"

# run NAME GPUS FLAGS...: one megatrain run (through the launcher when GPUS=2), metrics in $out/NAME.jsonl.
run() {
  local name=$1 gpus=$2
  shift 2
  local devices=$CUDA_VISIBLE_DEVICES
  [ "$gpus" = 1 ] && devices=$one_gpu
  rm -f "$out/$name.jsonl"
  if [ -n "${ONLY:-}" ] && ! [[ "$name" =~ ^($ONLY)$ ]]; then return 0; fi
  if [ "$SECONDS" -gt "$budget" ]; then
    echo "SKIPPED: $name (the ${budget}-second budget is spent)"
    return 0
  fi
  # shellcheck disable=SC2086
  CUDA_VISIBLE_DEVICES=$devices timeout 100 "$bin" $common ${PREC:---bf16} "$@" --metrics-jsonl "$out/$name.jsonl" \
    > "$out/$name.log" 2>&1
  local rc=$?
  if [ $rc -ne 0 ]; then
    echo "FAILED: $name (exit $rc), last lines of $out/$name.log:"
    tail -n 5 "$out/$name.log"
  fi
  return 0
}

# ---- 1. equivalence --------------------------------------------------------------------------
eq_iters=20
if [ "$four" = 1 ]; then
  eq="$gpt2 --micro-batch-size 4 --global-batch-size 16 --train-iters $eq_iters $eqsched"
  run eq_1gpu 1 $eq
  run eq4_tp2_pp2 4 $eq --tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2
  run eq4_tp2_dp2 4 $eq --tensor-model-parallel-size 2 --sequence-parallel --use-distributed-optimizer \
    --overlap-grad-reduce --overlap-param-gather
  run eq4_pp4_vpp 4 $eq --pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 1
  # FP8 parameters (delayed and tensorwise) over TP=2+SP x DP=2 and PP=2 x DP=2 against one GPU's FP8
  # parameters (--calculate-per-token-loss: output-gradient scales independent of the DP size).
  fp8pg4="--fp8-format hybrid --use-distributed-optimizer --fp8-param-gather --calculate-per-token-loss"
  for r in delayed tensorwise; do
    run eq4_fp8pg_${r}_1gpu 1 $eq $fp8pg4 --fp8-recipe $r
    run eq4_fp8pg_${r}_tp2_dp2 4 $eq $fp8pg4 --fp8-recipe $r --tensor-model-parallel-size 2 --sequence-parallel \
      --overlap-grad-reduce --overlap-param-gather
    run eq4_fp8pg_${r}_pp2_dp2 4 $eq $fp8pg4 --fp8-recipe $r --pipeline-model-parallel-size 2 --overlap-grad-reduce \
      --overlap-param-gather
  done
  eq32="--num-layers 8 --hidden-size 768 --num-attention-heads 12 --seq-length 1024 --max-position-embeddings 1024
    --micro-batch-size 4 --global-batch-size 16 --train-iters $eq_iters $sched"
  PREC=" " run eq32_1gpu 1 $eq32
  PREC=" " run eq32_tp2_pp2 4 $eq32 --tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2
  PREC=" " run eq32_tp2_dp2 4 $eq32 --tensor-model-parallel-size 2 --sequence-parallel --use-distributed-optimizer
  PREC=" " run eq32_pp4_vpp 4 $eq32 --pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 1
  unset PREC
  iters=12
  run s4_1gpu 1 $sched $gpt13 --micro-batch-size 2 --global-batch-size 16 --train-iters $iters
  run s4_tp2_pp2 4 $sched $gpt13 --micro-batch-size 2 --global-batch-size 16 --train-iters $iters \
    --tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2
  run s4_tp2_dp2 4 $sched $gpt13 --micro-batch-size 2 --global-batch-size 32 --train-iters $iters \
    --tensor-model-parallel-size 2 --sequence-parallel --use-distributed-optimizer --overlap-grad-reduce \
    --overlap-param-gather
  run s4_pp4_vpp 4 $sched $gpt13 --micro-batch-size 2 --global-batch-size 16 --train-iters $iters \
    --pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 3
fi
if [ "$four" = 0 ]; then
eq="$gpt2 --micro-batch-size 4 --global-batch-size 16 --train-iters $eq_iters $eqsched"
run eq_1gpu 1 $eq
run eq_1gpu_again 1 $eq
run eq_tp2 2 $eq --tensor-model-parallel-size 2
run eq_tp2_sp 2 $eq --tensor-model-parallel-size 2 --sequence-parallel
run eq_pp2 2 $eq --pipeline-model-parallel-size 2
# Interleaved 1F1B: 2 model chunks of 3 layers per stage (4 micro-batches).
run eq_pp2_vpp 2 $eq --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 3
run eq_dp2 2 $eq --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
# FP8 (Megatron's --fp8-format hybrid, delayed scaling): the amax reductions over the tensor- and
# data-parallel groups and the FP8 casts of sequence-parallel shards against one GPU.
fp8="--fp8-format hybrid --fp8-recipe delayed"
run eq_fp8_1gpu 1 $eq $fp8
run eq_fp8_tp2_sp 2 $eq $fp8 --tensor-model-parallel-size 2 --sequence-parallel
run eq_fp8_dp2 2 $eq $fp8 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
# bf16 main gradients (--grad-reduce-in-bf16: Megatron's grad buffer in the parameters' dtype,
# accumulated over micro-batches and reduced in bf16) on one GPU and DP=2, against float32 ones.
bf16g="--grad-reduce-in-bf16"
run eq_bf16g_1gpu 1 $eq $bf16g
run eq_bf16g_dp2 2 $eq $bf16g --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
run eq_bf16g_fp8_dp2 2 $eq $fp8 $bf16g --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
# FP8 parameters (--fp8-param-gather): the weights cast from the master shards and all-gathered as
# FP8 bytes, on one GPU and DP=2 (also with Megatron's Llama-3 recipe's bf16 main grads).
fp8pg="$fp8 --use-distributed-optimizer --fp8-param-gather"
run eq_fp8pg_1gpu 1 $eq $fp8pg
run eq_fp8pg_dp2 2 $eq $fp8pg --overlap-grad-reduce --overlap-param-gather
run eq_fp8pg_bf16g_dp2 2 $eq $fp8pg $bf16g --overlap-grad-reduce --overlap-param-gather
# Tensorwise (current) scaling, without and with FP8 parameters (one GPU, DP=2).
fp8tw="--fp8-format hybrid --fp8-recipe tensorwise --use-distributed-optimizer"
run eq_fp8tw_1gpu 1 $eq $fp8tw
run eq_fp8twpg_1gpu 1 $eq $fp8tw --fp8-param-gather
run eq_fp8twpg_dp2 2 $eq $fp8tw --fp8-param-gather --overlap-grad-reduce --overlap-param-gather
# ... and without FP8 parameters over DP=2: the weights' amaxes taken by each rank's update and
# maxed over DP.
run eq_fp8tw_dp2 2 $eq $fp8tw --overlap-grad-reduce --overlap-param-gather
# Megatron's precision-aware optimizer: bf16 moments, bf16 main grads and the float32 master
# weights kept as remainders of the bf16 parameters, on one GPU and DP=2, against plain bf16.
pa="--use-distributed-optimizer --use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16
  --main-grads-dtype bf16"
run eq_pa_1gpu 1 $eq $pa
run eq_pa_dp2 2 $eq $pa --overlap-grad-reduce --overlap-param-gather
# The same in fp32 (GEMMs without TF32) on a 4-layer model: bf16 runs drift apart once rounding
# differences grow, fp32 runs must stay together (a layout defect shows at once).
eq32="--num-layers 4 --hidden-size 768 --num-attention-heads 12 --seq-length 1024 --max-position-embeddings 1024
  --micro-batch-size 4 --global-batch-size 16 --train-iters $eq_iters $sched"
PREC=" " run eq32_1gpu 1 $eq32
PREC=" " run eq32_tp2_sp 2 $eq32 --tensor-model-parallel-size 2 --sequence-parallel
PREC=" " run eq32_pp2 2 $eq32 --pipeline-model-parallel-size 2
PREC=" " run eq32_pp2_vpp 2 $eq32 --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1
unset PREC

# ---- 2. scaling --------------------------------------------------------------------------------
iters=12
[ "$quick" = 1 ] && iters=8
run dp_124m_1gpu 1 $sched $gpt2 --micro-batch-size 32 --global-batch-size 32 --train-iters $iters
run dp_124m_dp2 2 $sched $gpt2 --micro-batch-size 32 --global-batch-size 64 --train-iters $iters \
  --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
run dp_13b_1gpu 1 $sched $gpt13 --micro-batch-size 8 --global-batch-size 8 --train-iters $iters
run dp_13b_dp2 2 $sched $gpt13 --micro-batch-size 8 --global-batch-size 16 --train-iters $iters \
  --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
run tp_13b_tp2sp 2 $sched $gpt13 --micro-batch-size 8 --global-batch-size 8 --train-iters $iters \
  --tensor-model-parallel-size 2 --sequence-parallel
run pp_13b_1gpu 1 $sched $gpt13 --micro-batch-size 2 --global-batch-size 16 --train-iters $iters
run pp_13b_pp2 2 $sched $gpt13 --micro-batch-size 2 --global-batch-size 16 --train-iters $iters \
  --pipeline-model-parallel-size 2
run pp_13b_pp2_vpp 2 $sched $gpt13 --micro-batch-size 2 --global-batch-size 16 --train-iters $iters \
  --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 6
# The last stage also runs the output layer and the loss (about as much as a few decoder layers at
# vocabulary 50304): Megatron's --decoder-last-pipeline-num-layers moves layers off it.
run pp_13b_pp2_last11 2 $sched $gpt13 --micro-batch-size 2 --global-batch-size 16 --train-iters $iters \
  --pipeline-model-parallel-size 2 --decoder-last-pipeline-num-layers 11
run pp_13b_pp2_last10 2 $sched $gpt13 --micro-batch-size 2 --global-batch-size 16 --train-iters $iters \
  --pipeline-model-parallel-size 2 --decoder-last-pipeline-num-layers 10

fi  # four = 0

# ---- 3. NCCL tests ----------------------------------------------------------------------------
nccl_summary="(skipped)"
if [ "$nccl" = 1 ] && [ "$SECONDS" -gt $((budget - 20)) ]; then
  nccl_summary="(skipped: the 5-minute budget is spent)"
elif [ "$nccl" = 1 ]; then
  MAX_MB=256 timeout $((budget + 30 - SECONDS > 40 ? budget + 30 - SECONDS : 40)) bench/run_nccl_tests.sh > "$out/nccl.log" 2>&1
  nccl_summary=$(grep -E '^(PASS|FAIL)' "$out/nccl.log" | tr '\n' ';')
  [ -z "$nccl_summary" ] && nccl_summary="no summary (see $out/nccl.log)"
fi

# ---- summary ------------------------------------------------------------------------------------
echo
echo "GPU: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1) x $ngpu; logs in $out"
python3 - "$out" "$eq_iters" "$nccl_summary" "$four" <<'EOF'
import json, os, re, statistics, sys
out, eq_iters, nccl, four = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"

def records(name):
    path = os.path.join(out, name + ".jsonl")
    if not os.path.exists(path):
        return []
    return [r for r in map(json.loads, open(path)) if r.get("type") == "iteration"]

def steady(name, key, skip=4):
    vals = [r[key] for r in records(name) if r["iteration"] > skip and key in r]
    return statistics.median(vals) if vals else None

def memory(name):
    path = os.path.join(out, name + ".log")
    if not os.path.exists(path):
        return "-"
    ranks = re.findall(r"\[rank (\d+)\] memory: planned ([\d.]+) MiB, allocated [\d.]+ MiB, device in use ([\d.]+) MiB", open(path).read())
    return ", ".join(f"r{r}: {float(p)/1024:.1f}/{float(d)/1024:.1f} GiB" for r, p, d in sorted(ranks))

table = []  # (measure, 1 GPU, 2 GPUs, ratio or difference, target, status)
def equivalence(title, base_name, names, bound):
    print(f"\n== equivalence with 1 GPU ({title}, lm loss per iteration) ==")
    base = {r["iteration"]: r["lm_loss"] for r in records(base_name)}
    for name in names:
        other = {r["iteration"]: r["lm_loss"] for r in records(name)}
        common = sorted(set(base) & set(other))
        if len(common) < eq_iters:
            table.append((f"{name} loss vs 1 GPU", None, None, None, f"< {bound:g}",
                          f"FAIL ({len(common)} of {eq_iters} iterations)"))
            continue
        worst = max(abs(other[i] - base[i]) / abs(base[i]) for i in common)
        table.append((f"{name} loss vs 1 GPU", base[common[-1]], other[common[-1]], worst, f"< {bound:g}",
                      "PASS" if worst < bound else "FAIL"))
        print(f"{name}:  iter   1-GPU loss   parallel loss")
        for i in common:
            print(f"        {i:4d}   {base[i]:.6f}     {other[i]:.6f}")

if four:
    equivalence("gpt2-124m, bf16, --deterministic-mode", "eq_1gpu", ["eq4_tp2_pp2", "eq4_tp2_dp2", "eq4_pp4_vpp"], 2e-2)
    for r in ("delayed", "tensorwise"):
        equivalence(f"gpt2-124m, FP8 {r} with FP8 parameters", f"eq4_fp8pg_{r}_1gpu",
                    [f"eq4_fp8pg_{r}_tp2_dp2", f"eq4_fp8pg_{r}_pp2_dp2"], 2e-2)
    equivalence("8 layers of gpt2-124m, fp32", "eq32_1gpu", ["eq32_tp2_pp2", "eq32_tp2_dp2", "eq32_pp4_vpp"], 1e-4)
    print("\n== gpt-1.3b on 4 GPUs (median of iterations 5..; per GPU) ==")
    print(f"{'layout':14s} {'tokens/s/GPU':>13s} {'TFLOP/s/GPU':>12s} {'vs 1 GPU':>9s}  memory per GPU")
    base = steady("s4_1gpu", "tflops_per_gpu")
    for name in ["s4_1gpu", "s4_tp2_pp2", "s4_tp2_dp2", "s4_pp4_vpp"]:
        t, f = steady(name, "tokens_per_second"), steady(name, "tflops_per_gpu")
        n = 1 if name == "s4_1gpu" else 4
        print(f"{name:14s} {(t / n if t else 0):13,.0f} {(f or 0):12.1f} {((f or 0) / base if base else 0):9.3f}  {memory(name)}")
if not four:
  equivalence("gpt2-124m, bf16, --deterministic-mode", "eq_1gpu",
            ["eq_1gpu_again", "eq_tp2", "eq_tp2_sp", "eq_pp2", "eq_pp2_vpp", "eq_dp2"], 2e-2)
  equivalence("4 layers of gpt2-124m, fp32", "eq32_1gpu", ["eq32_tp2_sp", "eq32_pp2", "eq32_pp2_vpp"], 1e-4)
  equivalence("gpt2-124m, FP8 hybrid delayed, --deterministic-mode", "eq_fp8_1gpu", ["eq_fp8_tp2_sp", "eq_fp8_dp2"], 2e-2)
  equivalence("gpt2-124m, bf16 main grads against float32 ones", "eq_1gpu", ["eq_bf16g_1gpu", "eq_bf16g_dp2"], 2e-2)
  equivalence("gpt2-124m, FP8 with bf16 main grads against float32 ones", "eq_fp8_1gpu", ["eq_bf16g_fp8_dp2"], 2e-2)
  equivalence("gpt2-124m, FP8 parameters (--fp8-param-gather) against FP8 without", "eq_fp8_1gpu",
              ["eq_fp8pg_1gpu", "eq_fp8pg_dp2", "eq_fp8pg_bf16g_dp2"], 2e-2)
  equivalence("gpt2-124m, FP8 tensorwise with FP8 parameters against without", "eq_fp8tw_1gpu",
              ["eq_fp8twpg_1gpu", "eq_fp8twpg_dp2", "eq_fp8tw_dp2"], 2e-2)
  equivalence("gpt2-124m, precision-aware optimizer (bf16 moments, main grads, master remainders) against bf16",
              "eq_1gpu", ["eq_pa_1gpu", "eq_pa_dp2"], 2e-2)

def ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b
def scaling(measure, key, one, two, target):
    a, b = steady(one, key), steady(two, key)
    r = ratio(b, a)
    table.append((measure, a, b, r, f">= {target}", "-" if r is None else ("ok" if r >= target else "BELOW")))
if not four:
    scaling("DP=2 gpt2-124m tokens/s", "tokens_per_second", "dp_124m_1gpu", "dp_124m_dp2", 1.9)
    scaling("DP=2 gpt-1.3b tokens/s", "tokens_per_second", "dp_13b_1gpu", "dp_13b_dp2", 1.9)
    scaling("TP=2+SP gpt-1.3b TFLOP/s/GPU", "tflops_per_gpu", "dp_13b_1gpu", "tp_13b_tp2sp", 0.8)
    scaling("PP=2 M=8 gpt-1.3b TFLOP/s/GPU", "tflops_per_gpu", "pp_13b_1gpu", "pp_13b_pp2", 0.85)
    scaling("PP=2 VPP=2 M=8 gpt-1.3b TFLOP/s/GPU", "tflops_per_gpu", "pp_13b_1gpu", "pp_13b_pp2_vpp", 0.85)
    scaling("PP=2 13+11 layers M=8 TFLOP/s/GPU", "tflops_per_gpu", "pp_13b_1gpu", "pp_13b_pp2_last11", 0.85)
    scaling("PP=2 14+10 layers M=8 TFLOP/s/GPU", "tflops_per_gpu", "pp_13b_1gpu", "pp_13b_pp2_last10", 0.85)

print("\n== memory per GPU (planned buffers / device memory in use after the run, beyond the CUDA context) ==")
for name in ["eq32_1gpu", "eq32_tp2_sp", "eq32_pp2", "eq32_pp2_vpp", "eq_1gpu", "eq_tp2", "eq_tp2_sp", "eq_pp2",
             "eq_pp2_vpp", "eq_dp2", "eq_fp8_1gpu", "eq_fp8_tp2_sp", "eq_fp8_dp2", "eq_bf16g_1gpu", "eq_bf16g_dp2", "eq_bf16g_fp8_dp2", "eq_fp8tw_dp2", "eq_pa_1gpu", "eq_pa_dp2",
             "eq_fp8pg_1gpu", "eq_fp8pg_dp2", "eq_fp8pg_bf16g_dp2", "eq_fp8tw_1gpu", "eq_fp8twpg_1gpu",
             "eq_fp8twpg_dp2", "dp_124m_1gpu", "dp_124m_dp2", "dp_13b_1gpu",
             "dp_13b_dp2", "tp_13b_tp2sp", "pp_13b_1gpu", "pp_13b_pp2", "pp_13b_pp2_vpp", "pp_13b_pp2_last11",
             "pp_13b_pp2_last10", "eq4_tp2_pp2", "eq4_tp2_dp2", "eq4_fp8pg_delayed_1gpu", "eq4_fp8pg_delayed_tp2_dp2",
             "eq4_fp8pg_delayed_pp2_dp2", "eq4_fp8pg_tensorwise_1gpu", "eq4_fp8pg_tensorwise_tp2_dp2",
             "eq4_fp8pg_tensorwise_pp2_dp2",
             "eq4_pp4_vpp", "eq32_tp2_pp2", "eq32_tp2_dp2", "eq32_pp4_vpp"]:
    print(f"{name:14s} {memory(name)}")
print(f"\nNCCL tests: {nccl}")

print("\n== summary (scaling: median of iterations 5.., ratio = 2 GPUs / 1 GPU; equivalence: last loss "
      "of each run and the largest relative difference) ==")
fmt = lambda v: "-" if v is None else (f"{v:,.1f}" if abs(v) >= 100 else f"{v:.4g}")
print(f"{'measure':32s} {'1 GPU':>12s} {('4' if four else '2') + ' GPUs':>12s} {'ratio/diff':>10s} {'target':>8s}  status")
for measure, a, b, r, target, status in table:
    print(f"{measure:32s} {fmt(a):>12s} {fmt(b):>12s} {fmt(r):>10s} {target:>8s}  {status}")
EOF
