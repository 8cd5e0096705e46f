#!/usr/bin/env bash
# FP8 on one GPU in one go (what the FP8 run of 2026-11-22 06:13 UTC on one H200 ran):
#   1. bench_fp8_gemm (FP8 vs bf16 GEMMs at the model shapes, the cast kernels);
#   2. bench/run_bench.sh gpt-1.3b,llama-1b: bf16 vs FP8 tokens/s (Megatron's --fp8-format hybrid
#      --fp8-recipe delayed);
#   3. the FP8 GPU tests (+ memcheck of one cast case) in the background while
#   4. bench/fp8_loss_check.sh trains gpt-1.3b on real text in bf16 and FP8 for as many of 300
#      iterations as the time budget allows, and compares the last 50.
#   bench/fp8_gpu_check.sh --bin-dir DIR --data-dir DIR [--seconds 280]
# DIR of binaries: megatrain, megatrain_gpu_tests, bench_fp8_gemm; data DIR:
# pod_gpt2_text_document.{bin,idx}, gpt2-vocab.json, gpt2-merges.txt (bench/RESULTS.md says how
# that set was made). Everything is logged under $OUT (or /tmp).
set -u
cd "$(dirname "$0")/.."
bin_dir="" data_dir="" total=280
while [ $# -gt 0 ]; do
  case "$1" in
    --bin-dir) bin_dir="$2"; shift 2 ;;
    --data-dir) data_dir="$2"; shift 2 ;;
    --seconds) total="$2"; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
[ -n "$bin_dir" ] && [ -n "$data_dir" ] || { echo "error: --bin-dir and --data-dir are required" >&2; exit 2; }
O=${OUT:-/tmp}/fp8-gpu-check-$$; mkdir -p "$O"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$O/gpu.txt"
echo "== bench_fp8_gemm"
timeout 60 "$bin_dir/bench_fp8_gemm" --reps 20 > "$O/bench_fp8_gemm.txt" 2>&1; echo "rc=$?" >> "$O/bench_fp8_gemm.txt"
grep -v "^probe" "$O/bench_fp8_gemm.txt"
echo "== run_bench bf16 vs FP8 (t=$SECONDS)"
# shellcheck disable=SC2086
OUT=$O timeout 110 bash bench/run_bench.sh --configs gpt-1.3b,llama-1b --iters 20 --warmup 5 --no-pytorch \
  --megatrain "$bin_dir/megatrain" --fp8 hybrid > "$O/run_bench.txt" 2>&1; echo "rc=$?" >> "$O/run_bench.txt"
tail -n 8 "$O/run_bench.txt"
echo "== FP8 GPU tests in the background (t=$SECONDS)"
( timeout 90 "$bin_dir/megatrain_gpu_tests" "[fp8]" -d yes > "$O/fp8_tests.log" 2>&1; echo "rc=$?" >> "$O/fp8_tests.log"
  timeout 40 compute-sanitizer --tool memcheck "$bin_dir/megatrain_gpu_tests" "fp8 cast: float32*" > "$O/memcheck.log" 2>&1
  echo "rc=$?" >> "$O/memcheck.log" ) &
tests_pid=$!
left=$((total - SECONDS))
iters=$(( (left - 35) * 100 / 55 ))  # ~0.55 s per bf16 + FP8 iteration pair at gpt-1.3b on an H200
[ $iters -gt 300 ] && iters=300
echo "== loss check gpt-1.3b, $iters iterations (t=$SECONDS, $left s left)"
OUT=$O timeout $((left - 3)) bash bench/fp8_loss_check.sh --megatrain "$bin_dir/megatrain" --iters $iters \
  --model gpt-1.3b --data "$data_dir/pod_gpt2_text_document" --vocab-file "$data_dir/gpt2-vocab.json" \
  --merge-file "$data_dir/gpt2-merges.txt" > "$O/loss_check.txt" 2>&1
echo "rc=$?" >> "$O/loss_check.txt"
cat "$O/loss_check.txt"
wait $tests_pid
echo "== tests (t=$SECONDS)"
grep -E "^[0-9.]+ s:|test cases|assertions|FAILED|rc=|relative L2" "$O/fp8_tests.log" | tail -40
grep -B3 -A20 "FAILED" "$O/fp8_tests.log" | head -80
tail -n 3 "$O/memcheck.log"
