#!/usr/bin/env bash
# One single-GPU device call in one of two halves, so that timing and correctness never share the GPU:
#   bench/gpu_call.sh speed  BIN_DIR        the three configs in bf16 beside PyTorch + torch.compile,
#                                           then gpt-1.3b and llama-1b with --fp8-format hybrid
#                                           (delayed scaling), then an op profile of gpt-1.3b;
#   bench/gpu_call.sh verify BIN_DIR DATA   the GPU op tests (all) in the background while
#                                           bench/gpu_resume_check.sh and bench/fp8_loss_check.sh
#                                           (gpt-1.3b, real text, Megatron's FP8 flags) run;
#   bench/gpu_call.sh moe    BIN_DIR        the two MoE configs beside PyTorch + torch.compile (on a
#                                           GPU of less than 100 GB moe-mixtral-proxy runs 10 of its
#                                           16 layers on both sides: the whole model needs 88.7 GiB),
#                                           bench_ops' grouped GEMMs (BIN_DIR/bench_ops[.xz], if
#                                           there) and an op profile of moe-mixtral-proxy.
# BIN_DIR holds megatrain and megatrain_gpu_tests (or their .xz: a build for the device machine's
# Hopper GPU alone, cmake -DCMAKE_CUDA_ARCHITECTURES=90a-real, stripped, is half the default build's
# size, which with the test fixtures no longer fits a device call's 64 MiB), or all of them in one
# BIN_DIR/bins.tar.xz: compressed together with a dictionary larger than the binaries, their shared
# code is stored once (the three in 12.5 MB, against 31.6 MB as three .xz files):
#   tar cf - -C DIR megatrain megatrain_gpu_tests bench_ops | xz -T2 --x86 --lzma2=preset=9e,dict=256MiB > bins.tar.xz
# DATA holds
# pod_gpt2_text_document.{bin,idx}, gpt2-vocab.json and gpt2-merges.txt. Logs go to $OUT (or /tmp);
# the summary is printed last. TOTAL_S (default 560) bounds the whole call.
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:?speed, verify or moe}
src=${2:?binary directory}
data=${3:-}
total=${TOTAL_S:-560}
O=${OUT:-/tmp}/gpu-call-$mode
mkdir -p "$O"
bin=/tmp/gpu-call-bin
mkdir -p $bin
if [ -f "$src/bins.tar.xz" ]; then xz -dc "$src/bins.tar.xz" | tar xf - -C $bin; fi
for f in megatrain megatrain_gpu_tests bench_ops; do
  if [ -f "$bin/$f" ] && [ -f "$src/bins.tar.xz" ]; then chmod +x $bin/$f; continue; fi
  if [ -f "$src/$f.xz" ]; then xz -dc "$src/$f.xz" > $bin/$f; elif [ -f "$src/$f" ]; then cp "$src/$f" $bin/$f; else continue; fi
  chmod +x $bin/$f
done
S=$O/summary.txt
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$S"
stamp() { echo "[t=${SECONDS}s] $*" >> "$S"; }

if [ "$mode" = speed ]; then
  OUT=$O timeout 330 bash bench/run_bench.sh --megatrain $bin/megatrain --iters 20 --warmup 5 > "$O/bench.txt" 2>&1
  stamp "run_bench bf16 + PyTorch rc=$?"
  tail -n 8 "$O/bench.txt" >> "$S"
  OUT=$O timeout 120 bash bench/run_bench.sh --megatrain $bin/megatrain --configs gpt-1.3b,llama-1b --iters 20 \
    --warmup 5 --no-pytorch --fp8 hybrid > "$O/bench_fp8.txt" 2>&1
  stamp "run_bench FP8 (flags) rc=$?"
  tail -n 7 "$O/bench_fp8.txt" >> "$S"
  left=$((total - SECONDS))
  if [ $left -gt 40 ]; then
    MEGATRAIN_PROFILE_OPS=4 OUT=$O/prof timeout $((left - 10)) bash bench/run_bench.sh --megatrain $bin/megatrain \
      --configs gpt-1.3b --iters 6 --warmup 4 --no-pytorch > /dev/null 2>&1
    grep -h -A45 "op profile" "$O"/prof/bench-*/gpt-1.3b.megatrain.log > "$O/profile_gpt13.txt" 2>/dev/null
    stamp "profile gpt-1.3b: $(wc -l < "$O/profile_gpt13.txt") lines"
  fi
elif [ "$mode" = moe ]; then
  gib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  layers=()
  if [ "${gib:-0}" -lt 100000 ]; then layers=(--extra "--num-layers 10" --pytorch-extra "--num-layers 10"); fi
  OUT=$O timeout 300 bash bench/run_bench.sh --megatrain $bin/megatrain --configs moe-mixtral-proxy --iters 10 \
    --warmup 3 "${layers[@]}" > "$O/bench_mixtral.txt" 2>&1
  stamp "run_bench moe-mixtral-proxy ${layers[*]} rc=$?"
  tail -n 3 "$O/bench_mixtral.txt" >> "$S"
  OUT=$O timeout 240 bash bench/run_bench.sh --megatrain $bin/megatrain --configs moe-fine-grained --iters 10 \
    --warmup 3 > "$O/bench_fine.txt" 2>&1
  stamp "run_bench moe-fine-grained rc=$?"
  tail -n 3 "$O/bench_fine.txt" >> "$S"
  if [ -x $bin/bench_ops ] && [ $((total - SECONDS)) -gt 120 ]; then
    timeout $((total - SECONDS - 70)) $bin/bench_ops --only moe- --reps 20 > "$O/ops.txt" 2>&1
    stamp "bench_ops moe- rc=$?"
    grep -E "ceilings|uniform" "$O/ops.txt" >> "$S"
  fi
  left=$((total - SECONDS))
  if [ $left -gt 50 ]; then
    MEGATRAIN_PROFILE_OPS=3 OUT=$O/prof timeout $((left - 10)) bash bench/run_bench.sh --megatrain $bin/megatrain \
      --configs moe-mixtral-proxy --iters 4 --warmup 3 --no-pytorch --extra "--num-layers 10" > /dev/null 2>&1
    grep -h -A40 "op profile" "$O"/prof/bench-*/moe-mixtral-proxy.megatrain.log > "$O/profile_mixtral.txt" 2>/dev/null
    stamp "profile moe-mixtral-proxy (10 layers): $(wc -l < "$O/profile_mixtral.txt") lines"
  fi
elif [ "$mode" = verify ]; then
  ( timeout $((total - 30)) $bin/megatrain_gpu_tests -d yes > "$O/gpu_tests.log" 2>&1; echo "rc=$?" >> "$O/gpu_tests.log" ) &
  tests=$!
  OUT=$O timeout 240 bash bench/gpu_resume_check.sh $bin > "$O/resume.txt" 2>&1
  stamp "resume check rc=$?"
  grep -E "PASS|FAIL|information" "$O/resume.txt" >> "$S"
  left=$((total - SECONDS - 20))
  iters=$(( (left - 40) * 100 / 60 ))
  [ $iters -gt 300 ] && iters=300
  if [ $iters -ge 60 ]; then
    OUT=$O timeout $left bash bench/fp8_loss_check.sh --megatrain $bin/megatrain --iters $iters --model gpt-1.3b \
      --data "$data/pod_gpt2_text_document" --vocab-file "$data/gpt2-vocab.json" --merge-file "$data/gpt2-merges.txt" \
      > "$O/fp8_loss.txt" 2>&1
    stamp "fp8 loss check ($iters iterations) rc=$?"
    tail -n 6 "$O/fp8_loss.txt" >> "$S"
  else
    stamp "fp8 loss check skipped: $left s left"
  fi
  wait $tests
  stamp "gpu tests: $(grep -E 'test cases|rc=' "$O/gpu_tests.log" | tr '\n' ' ')"
  grep -B3 -A25 "FAILED" "$O/gpu_tests.log" | head -120 >> "$S"
  grep -E "^[0-9.]+ s: " "$O/gpu_tests.log" | sort -rn | head -8 >> "$S"
fi
cat "$S"
