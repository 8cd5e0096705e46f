#!/usr/bin/env bash
# Single-GPU benchmark: megatrain on the three reference configs (gpt2-124m, gpt-1.3b, llama-1b)
# with --mock-data, and, where PyTorch is importable, the same configs in PyTorch + torch.compile
# (bench/pytorch_reference.py), side by side. Prints a table of tokens/s, TFLOP/s, MFU, peak memory,
# and for every run the GPU's median SM clock and power while it computed (where nvidia-smi is).
# Two mixture-of-experts configs run when --configs names them (not by default): moe-mixtral-proxy
# (16 layers, 8 experts, top-2, expert FFN 5632) and moe-fine-grained (12 layers, 64 experts, top-8,
# expert FFN 768), both h 2048, 32 heads / 8 KV groups, seq 4096, micro-batch 2, vocabulary 32000,
# dropless, grouped-GEMM experts, aux loss 1e-2; their PyTorch side is bench/pytorch_moe.py, after
# its --self-check (routing, permutation, grouped GEMM and aux loss against a per-token reference).
# gdn-hybrid (not by default) is llama-1b's model and batch (seq 4096, micro-batch 2) with Gated
# DeltaNet in 12 of its 16 layers (--experimental-attention-variant gated_delta_net
# --linear-attention-freq 4: every 4th layer keeps softmax attention) with Qwen3-Next's heads (16 key
# and 32 value heads of 128, a 4-tap convolution), its softmax layers with Qwen3-Next's output gate
# and q/k norms (--attention-output-gate --qk-layernorm), dense SwiGLU MLPs; its PyTorch side is
# bench/pytorch_gdn.py (transformers' Qwen3-Next modules: without flash-linear-attention, their
# torch delta rule and convolution), after its --self-check. megatrain refuses --fp8 with it.
# On an H200 (2026-12-05) neither PyTorch side trained within the call's limit: the torch
# fallbacks ran past 240 s, and with flash-linear-attention importable (its source on PYTHONPATH)
# the default per-layer torch.compile ran past 210 s without a step; try --pytorch-extra
# "--compile none" there (fla's kernels are already fused).
#
#   bench/run_bench.sh [--configs gpt2-124m,gpt-1.3b,llama-1b] [--iters 30] [--no-pytorch]
#                      [--megatrain build/app/megatrain] [--extra "<more megatrain flags>"]
#                      [--fp8 e4m3|hybrid] [--fp8-recipe delayed|tensorwise] [--fp8-extra "<flags>"]
#                      [--fp8-only] [--no-energy] [--pytorch-extra "<more PyTorch script flags>"]
#   bench/run_bench.sh --configs moe-mixtral-proxy,moe-fine-grained --iters 20 --warmup 5
#   bench/run_bench.sh --configs gdn-hybrid --iters 20 --warmup 5
#   bench/run_bench.sh --configs llama-1b-8k,llama-1b-32k --attention-dropout 0.1 --iters 8 --warmup 3
# llama-1b-8k, -32k and -64k (not by default) are llama-1b's model at 8,192, 32,768 and 65,536
# tokens with micro-batch 1. --attention-dropout P (default 0) sets Megatron's attention dropout
# of every config, megatrain's and PyTorch's (SDPA's dropout_p) alike.
# --pytorch-extra adds flags to the PyTorch script of every config run: "--profile-kernels N" (both
# scripts), "--experts loop" (bench/pytorch_moe.py only: one GEMM per expert instead of
# torch._grouped_mm, should the grouped GEMM fail on a machine; run the MoE configs alone then),
# "--compile model|layers|none" (bench/pytorch_gdn.py only: torch.compile of the whole model, of
# each decoder layer (its default), or eager; run gdn-hybrid alone then).
# --fp8 runs every config a second time with --fp8-format <format> --fp8-recipe delayed
# --fp8-amax-history-len 16 --fp8-amax-compute-algo max (Transformer Engine's usual delayed
# scaling; --fp8-recipe picks another recipe) and prints the fp8/bf16 tokens/s ratio. --fp8-extra
# adds flags to the FP8 runs only (e.g. "--use-distributed-optimizer --fp8-param-gather").
# --fp8-only skips megatrain's bf16 runs (FP8 A/B comparisons; no fp8/bf16 ratio then).
# Every megatrain run has --log-energy (its summary line ends with the GPU's joules per iteration,
# watts and joules per token; PyTorch's JSON line has the same from the same NVML counter), unless
# --no-energy. An NVML read takes milliseconds with the GPU idle (3.7 ms on an H200), and idle time
# relieves the power cap, so these runs log only after the first and the last iteration: the
# counter is then read outside the timed steps only, as PyTorch's is.
set -euo pipefail
cd "$(dirname "$0")/.."
configs="gpt2-124m,gpt-1.3b,llama-1b"
iters=30
warmup=10
pytorch=1
bin=build/app/megatrain
extra=""
fp8=""
fp8_recipe=delayed
fp8_extra=""
fp8_only=0
energy="--log-energy"
pytorch_extra=""
attention_dropout=0.0
while [ $# -gt 0 ]; do
  case "$1" in
    --configs) configs="$2"; shift 2 ;;
    --iters) iters="$2"; shift 2 ;;
    --warmup) warmup="$2"; shift 2 ;;
    --no-pytorch) pytorch=0; shift ;;
    --megatrain) bin="$2"; shift 2 ;;
    --extra) extra="$2"; shift 2 ;;
    --fp8) fp8="$2"; shift 2 ;;
    --fp8-recipe) fp8_recipe="$2"; shift 2 ;;
    --fp8-extra) fp8_extra="$2"; shift 2 ;;
    --fp8-only) fp8_only=1; shift ;;
    --no-energy) energy=""; shift ;;
    --pytorch-extra) pytorch_extra="$2"; shift 2 ;;
    --attention-dropout) attention_dropout="$2"; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
# (after the options: --iters and --warmup are known now; the last --log-interval wins)
if [ -n "$energy" ]; then energy="$energy --log-interval $((iters + warmup))"; fi
if [ "$fp8_only" = 1 ] && [ -z "$fp8" ]; then echo "--fp8-only needs --fp8 e4m3|hybrid" >&2; exit 2; fi
out=${OUT:-/tmp}/bench-$$
mkdir -p "$out"

# Megatron flags of each config (the model shapes the issues name).
flags_for() {
  local common="--bf16 --mock-data --tokenizer-type NullTokenizer --attention-dropout $attention_dropout --hidden-dropout 0.0
    --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.1 --clip-grad 1.0
    --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.02 --log-interval 5 --log-throughput
    --eval-iters 0 --train-iters $((iters + warmup)) --benchmark-warmup-iters $warmup"
  # gpt-1.3b and llama-1b recompute their norm outputs in backward (Megatron's selective recompute
  # of layernorm): keeping them, as gpt2-124m does (and Megatron by default), would put their peak
  # memory above PyTorch's (+3.0 / +1.0 GiB).
  local recompute_norms="--recompute-granularity selective --recompute-modules core_attn layernorm"
  # The MoE configs: a Llama-style decoder (as llama-1b) whose every layer's MLP is dropless MoE
  # (Megatron-Core's defaults otherwise: softmax scores, top-k before the softmax, aux_loss, bf16
  # router). --ffn-hidden-size is the expert FFN too (every layer is MoE: no dense MLP uses it).
  local llama_moe="$recompute_norms --hidden-size 2048 --num-attention-heads 32 --group-query-attention
    --num-query-groups 8 --seq-length 4096 --max-position-embeddings 4096 --micro-batch-size 2
    --global-batch-size 2 --vocab-size 32000 --swiglu --normalization RMSNorm --position-embedding-type rope
    --untie-embeddings-and-output-weights --disable-bias-linear --moe-grouped-gemm --moe-token-dispatcher-type alltoall
    --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2"
  local llama_1b="--num-layers 16 --hidden-size 2048 --num-attention-heads 32 --group-query-attention
    --num-query-groups 8 --ffn-hidden-size 8192 --vocab-size 128256 --swiglu --normalization RMSNorm
    --position-embedding-type rope --untie-embeddings-and-output-weights --disable-bias-linear"
  # gdn-hybrid: llama-1b with Qwen3-Next's Gated DeltaNet layers and softmax attention (output gate,
  # q/k norms), as transformers' Qwen3-Next modules build it (bench/pytorch_gdn.py).
  local gdn="--experimental-attention-variant gated_delta_net --linear-attention-freq 4 --linear-num-key-heads 16
    --linear-num-value-heads 32 --linear-key-head-dim 128 --linear-value-head-dim 128 --linear-conv-kernel-dim 4
    --attention-output-gate --qk-layernorm"
  case "$1" in
    gpt2-124m) echo "$common --num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024
      --max-position-embeddings 1024 --micro-batch-size 32 --global-batch-size 32 --vocab-size 50304" ;;
    gpt-1.3b) echo "$common $recompute_norms --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048
      --max-position-embeddings 2048 --micro-batch-size 8 --global-batch-size 8 --vocab-size 50304" ;;
    llama-1b) echo "$common $recompute_norms $llama_1b --seq-length 4096 --max-position-embeddings 4096
      --micro-batch-size 2 --global-batch-size 2" ;;
    llama-1b-8k|llama-1b-32k|llama-1b-64k)
      local seq=${1#llama-1b-}
      seq=$(( ${seq%k} * 1024 ))
      echo "$common $recompute_norms $llama_1b --seq-length $seq --max-position-embeddings $seq
      --micro-batch-size 1 --global-batch-size 1" ;;
    gdn-hybrid) echo "$common $recompute_norms $llama_1b $gdn --seq-length 4096 --max-position-embeddings 4096
      --micro-batch-size 2 --global-batch-size 2" ;;
    moe-mixtral-proxy) echo "$common $llama_moe --num-layers 16 --num-experts 8 --moe-router-topk 2
      --ffn-hidden-size 5632 --moe-ffn-hidden-size 5632" ;;
    moe-fine-grained) echo "$common $llama_moe --num-layers 12 --num-experts 64 --moe-router-topk 8
      --ffn-hidden-size 768 --moe-ffn-hidden-size 768" ;;
    *) echo "unknown config $1" >&2; exit 2 ;;
  esac
}

fp8_flags=""
if [ -n "$fp8" ]; then
  fp8_flags="--fp8-format $fp8 --fp8-recipe $fp8_recipe"
  if [ "$fp8_recipe" = delayed ]; then fp8_flags="$fp8_flags --fp8-amax-history-len 16 --fp8-amax-compute-algo max"; fi
  fp8_flags="$fp8_flags${fp8_extra:+ $fp8_extra}"
fi

declare -A mt_line pt_line fp8_line
IFS=, read -r -a names <<< "$configs"
# run_one <name> <log> <more flags>: prints the run's summary line, or FAILED
# with the log's tail.
run_one() {
  # shellcheck disable=SC2046,SC2086
  if "$bin" $(flags_for "$1") $energy $extra $3 > "$2" 2>&1; then
    grep -E '^\[megatrain\] summary' "$2" | tail -n 1 || true
  else
    echo "FAILED (see $2): $(tail -n 2 "$2" | tr '\n' ' ')"
  fi
}
tokens_per_s() { sed -n 's/.*| tokens\/s: \([0-9.]*\) .*/\1/p' <<< "$1"; }
# The GPU's SM clock and power while a run computes: training at the power cap runs well below the
# maximum clock, and machines differ (bench/RESULTS.md, 2026-11-25, one H100), so every line says what it
# ran at. clocked <csv> <command...>: runs the command with nvidia-smi sampling GPU 0 every 50 ms;
# then clock_summary <csv> gives the medians over the samples drawing more than 350 W (the busy
# part: not start-up or compilation), or nothing without nvidia-smi.
clocked() {
  local csv=$1 smi="" rc=0
  shift
  if command -v nvidia-smi > /dev/null; then
    nvidia-smi -i 0 --query-gpu=clocks.sm,power.draw --format=csv,noheader,nounits -lms 50 > "$csv" 2> /dev/null &
    smi=$!
  fi
  "$@" || rc=$?
  if [ -n "$smi" ]; then kill "$smi" 2> /dev/null; wait "$smi" 2> /dev/null; fi
  return $rc
}
clock_summary() {
  [ -s "$1" ] || return 0
  local busy="$1.busy"
  awk -F', *' '$2 + 0 > 350 { print $1, $2 }' "$1" > "$busy"
  [ -s "$busy" ] || { echo "(GPU never over 350 W while sampled)"; return 0; }
  local n mhz watts
  n=$(wc -l < "$busy")
  mhz=$(awk '{ print $1 }' "$busy" | sort -n | awk -v m=$(( (n + 1) / 2 )) 'NR == m')
  watts=$(awk '{ print $2 }' "$busy" | sort -n | awk -v m=$(( (n + 1) / 2 )) 'NR == m')
  echo "(SM clock median ${mhz} MHz, power median ${watts} W over ${n} busy samples)"
}
for name in "${names[@]}"; do
  if [ "$fp8_only" = 0 ]; then
    mt_line[$name]="$(clocked "$out/$name.megatrain.clocks" run_one "$name" "$out/$name.megatrain.log" "") $(clock_summary "$out/$name.megatrain.clocks")"
  fi
  if [ -n "$fp8" ]; then
    fp8_line[$name]="$(clocked "$out/$name.megatrain-fp8.clocks" run_one "$name" "$out/$name.megatrain-fp8.log" "$fp8_flags") $(clock_summary "$out/$name.megatrain-fp8.clocks")"
  fi
done
# The PyTorch script of a config: the MoE configs have their own model (bench/pytorch_moe.py), and
# so has the Gated DeltaNet hybrid (bench/pytorch_gdn.py).
pytorch_script() {
  case "$1" in
    moe-*) echo bench/pytorch_moe.py ;;
    gdn-*) echo bench/pytorch_gdn.py ;;
    *) echo bench/pytorch_reference.py ;;
  esac
}
moe_check=""
gdn_check=""
if [ "$pytorch" = 1 ] && python3 -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
  for name in "${names[@]}"; do
    script=$(pytorch_script "$name")
    if [ "$script" = bench/pytorch_moe.py ] && [ -z "$moe_check" ]; then
      if python3 bench/pytorch_moe.py --self-check > "$out/pytorch_moe.self-check" 2>&1; then moe_check="ok"
      else moe_check="FAILED (see $out/pytorch_moe.self-check): $(grep -c FAILED "$out/pytorch_moe.self-check" || true) checks failed; $(tail -n 1 "$out/pytorch_moe.self-check")"; fi
    fi
    if [ "$script" = bench/pytorch_gdn.py ] && [ -z "$gdn_check" ]; then
      if python3 bench/pytorch_gdn.py --self-check > "$out/pytorch_gdn.self-check" 2>&1; then gdn_check="ok"
      else gdn_check="FAILED (see $out/pytorch_gdn.self-check): $(grep -c FAILED "$out/pytorch_gdn.self-check" || true) checks failed; $(tail -n 1 "$out/pytorch_gdn.self-check")"; fi
    fi
    # shellcheck disable=SC2086
    pt_line[$name]="$(clocked "$out/$name.pytorch.clocks" python3 "$script" --configs "$name" --iters "$iters" --warmup "$warmup" --attention-dropout "$attention_dropout" $pytorch_extra 2>"$out/$name.pytorch.err" | tail -n 1 || true) $(clock_summary "$out/$name.pytorch.clocks")"
  done
fi

echo
echo "GPU: $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)"
if [ -n "$moe_check" ]; then echo "PyTorch MoE self-check (bench/pytorch_moe.py --self-check): $moe_check"; fi
if [ -n "$gdn_check" ]; then echo "PyTorch Gated DeltaNet self-check (bench/pytorch_gdn.py --self-check): $gdn_check"; fi
for name in "${names[@]}"; do
  if [ "$fp8_only" = 0 ]; then echo "$name megatrain: ${mt_line[$name]}"; fi
  if [ -n "$fp8" ]; then
    echo "$name megatrain fp8 ($fp8_flags): ${fp8_line[$name]}"
    bf=$(tokens_per_s "${mt_line[$name]:-}"); f8=$(tokens_per_s "${fp8_line[$name]}")
    if [ -n "$bf" ] && [ -n "$f8" ]; then
      echo "$name fp8/bf16 tokens/s: $(awk -v a="$f8" -v b="$bf" 'BEGIN { printf "%.3f", a / b }')x"
    fi
  fi
  if [ -n "${pt_line[$name]:-}" ]; then echo "$name pytorch:   ${pt_line[$name]}"; fi
done
