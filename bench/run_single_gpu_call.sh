#!/usr/bin/env bash
# Driver for one GPU call (branch perf2): from a checkout root on the GPU machine, with the stripped
# binaries in <dir>/bin.tgz (bin/megatrain, bin/megatrain_gpu_tests, bin/bench_ops) beside this
# script and bench/run_bench.sh, bench/pytorch_reference.py under <dir>/bench. Runs: op tests of what changed, megatrain e2e, PyTorch e2e
# (same call), bench_ops of the changed kernels, op profiles. Logs in $OUT; summary.txt last.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
O=${OUT:-/tmp/out}
mkdir -p "$O"
W=/tmp/work
mkdir -p $W
bin=/tmp/mtbin/bin
mkdir -p /tmp/mtbin && tar xzf $here/bin.tgz -C /tmp/mtbin
S=$O/summary.txt
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader >> $S
echo "commit: $(cat $here/COMMIT)" >> $S
t0=$(date +%s)
stamp() { echo "[t=$(( $(date +%s) - t0 ))s] $*" >> $S; }
# 1. GPU op tests of the changed kernels.
timeout ${TEST_TIMEOUT:-100} $bin/megatrain_gpu_tests "[norm],cuda linear_backward_weight*,cuda fill*,cuda bias_dropout_add*" -r compact -d yes > $O/gpu_tests.log 2>&1
stamp "gpu tests rc=$? : $(grep -E 'test cases|Passed|passed|failed' $O/gpu_tests.log | tail -n 2 | tr '\n' ' ')"
grep -B2 -A12 -E 'FAILED|failed:' $O/gpu_tests.log | head -80 >> $S
grep -E "^[0-9.]+ s: " $O/gpu_tests.log | sort -rn | head -12 >> $S
# 2. megatrain end to end (bench/run_bench.sh, the three configs).
OUT=$W timeout 80 $here/bench/run_bench.sh --megatrain $bin/megatrain --iters 20 --warmup 5 --no-pytorch > $W/bench.out 2>&1
stamp "bench rc=$?"
tail -n 4 $W/bench.out >> $S
for f in $W/bench-*/*.megatrain.log; do echo "== $f"; grep -E "memory plan|^  [a-z]|summary|rror" "$f" | head -14; done > $O/bench_plans.log 2>&1
# 3. PyTorch + torch.compile on the same machine (what run_bench.sh runs per config, one process).
timeout ${PYTORCH_TIMEOUT:-200} python3 $here/bench/pytorch_reference.py --configs gpt2-124m,gpt-1.3b,llama-1b --iters 20 --warmup 5 > $W/pytorch.out 2> $W/pytorch.err
stamp "pytorch rc=$?"
cat $W/pytorch.out >> $S
tail -n 5 $W/pytorch.err >> $O/bench_plans.log
# 4. bench_ops: the changed kernels, fast and general paths.
timeout 45 $bin/bench_ops --only "norm|bias_dropout_add|+dbias|fill grads" > $O/bench_ops.log 2>&1
stamp "bench_ops rc=$?"
# 5. Op profiles (GPU time per op) with what time is left.
for c in gpt-1.3b gpt2-124m llama-1b; do
  left=$(( ${TOTAL_BUDGET:-405} - ($(date +%s) - t0) ))
  [ $left -gt 25 ] || break
  MEGATRAIN_PROFILE_OPS=4 OUT=$W/prof-$c timeout $(( left - 5 )) $here/bench/run_bench.sh --megatrain $bin/megatrain --configs $c --iters 6 --warmup 4 --no-pytorch > /dev/null 2>&1
  { echo "== $c"; grep -A45 "op profile" $W/prof-$c/bench-*/$c.megatrain.log | head -50; } >> $O/profile.txt
done
stamp "end"
