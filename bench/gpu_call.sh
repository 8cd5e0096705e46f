#!/usr/bin/env bash
# One single-GPU device call in one of two halves, so that timing and correctness never share the GPU:
#   bench/gpu_call.sh speed  BIN_DIR        the three configs in bf16 beside PyTorch + torch.compile,
#                                           then gpt-1.3b and llama-1b with --fp8-format hybrid
#                                           (delayed scaling), then an op profile of gpt-1.3b;
#   bench/gpu_call.sh verify BIN_DIR DATA   the GPU op tests (all) in the background while
#                                           bench/gpu_resume_check.sh and bench/fp8_loss_check.sh
#                                           (gpt-1.3b, real text, Megatron's FP8 flags) run.
# BIN_DIR holds megatrain and megatrain_gpu_tests (or their .xz: a build for the device machine's
# Hopper GPU alone, cmake -DCMAKE_CUDA_ARCHITECTURES=90a-real, stripped, is half the default build's
# size, which with the test fixtures no longer fits a device call's 64 MiB); DATA holds
# pod_gpt2_text_document.{bin,idx}, gpt2-vocab.json and gpt2-merges.txt. Logs go to $OUT (or /tmp);
# the summary is printed last. TOTAL_S (default 560) bounds the whole call.
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:?speed or verify}
src=${2:?binary directory}
data=${3:-}
total=${TOTAL_S:-560}
O=${OUT:-/tmp}/gpu-call-$mode
mkdir -p "$O"
bin=/tmp/gpu-call-bin
mkdir -p $bin
for f in megatrain megatrain_gpu_tests; do
  if [ -f "$src/$f.xz" ]; then xz -dc "$src/$f.xz" > $bin/$f; else cp "$src/$f" $bin/$f; fi
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
