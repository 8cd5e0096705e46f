#!/usr/bin/env bash
# Runs megatrain's NCCL tests and the collective-bandwidth benchmark on a machine with >= 2 GPUs.
#
#   bench/run_nccl_tests.sh                 # binaries from build/
#   BIN=.carry/parallel bench/run_nccl_tests.sh   # binaries copied elsewhere (nccl_comm_test,
#                                                 # nccl_bandwidth, and tests/expect_failure.sh
#                                                 # is taken from this checkout)
#   NPROC=4 MAX_MB=1024 bench/run_nccl_tests.sh
#
# What it runs (2 ranks unless NPROC says otherwise):
#   1. collectives through the workstation launcher (the program starts its own workers)
#   2. collectives with ranks started by hand, torchrun-style (RANK/WORLD_SIZE/LOCAL_RANK/
#      MASTER_ADDR/MASTER_PORT), the last rank first and rank 0 two seconds later: the TCP
#      rendezvous must wait for it
#   3. timeout: the last rank never joins an all_reduce; the watchdog must end the job within
#      seconds with a message naming the group and the operation (5 s timeout)
#   4. crash under the launcher: the last rank aborts; the launcher must stop the others and name it
#   5. crash with ranks started by hand (no launcher): rank 0's watchdog must end rank 0
#   6. two ranks given the same GPU: both must refuse to start, naming the two ranks
#   7. the bandwidth table (all-reduce f32/bf16, reduce-scatter f32, all-gather bf16, MIN_MB..MAX_MB)
# A summary of PASS/FAIL lines comes last; the exit status is non-zero if any step failed.
set -u
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
BIN=${BIN:-}
NPROC=${NPROC:-2}
MIN_MB=${MIN_MB:-1}
MAX_MB=${MAX_MB:-1024}
test_bin=${BIN:+$BIN/nccl_comm_test}
test_bin=${test_bin:-$root/build/tests/nccl_comm_test}
bench_bin=${BIN:+$BIN/nccl_bandwidth}
bench_bin=${bench_bin:-$root/build/bench/nccl_bandwidth}
expect_failure=$root/tests/expect_failure.sh
# NVLink multicast stays off on shared GPU hosts (see parallel/nccl_communicator.h).
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}

summary=()
record() {  # name status
  if [ "$2" -eq 0 ]; then summary+=("PASS  $1"); else summary+=("FAIL  $1 (exit $2)"); fi
}

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])' 2>/dev/null || echo $((20000 + RANDOM % 20000)); }

# Starts NPROC ranks by hand, last rank first; prints their output; returns the worst exit status.
by_hand() {  # mode [extra env...]
  local mode=$1
  shift
  local port
  port=$(free_port)
  local pids=() rc=0 r
  for ((r = NPROC - 1; r >= 0; r--)); do
    env "$@" RANK=$r WORLD_SIZE=$NPROC LOCAL_RANK=$r LOCAL_WORLD_SIZE=$NPROC MASTER_ADDR=127.0.0.1 \
      MASTER_PORT=$port "$test_bin" "$mode" > "/tmp/nccl_by_hand.$r.log" 2>&1 &
    pids[$r]=$!
    [ "$r" -eq 1 ] && sleep 2
  done
  for ((r = 0; r < NPROC; r++)); do
    wait "${pids[$r]}"
    local s=$?
    echo "--- rank $r exit $s"
    cat "/tmp/nccl_by_hand.$r.log"
    [ "$s" -ne 0 ] && rc=$s
  done
  return $rc
}

echo "=== 1. collectives through the workstation launcher ($NPROC ranks)"
timeout -k 5 300 "$test_bin" --nproc "$NPROC" collectives
s=$?
[ "$s" -eq 77 ] && { echo "fewer than $NPROC GPUs: nothing to run"; exit 77; }
record "collectives via launcher" $s

echo "=== 2. collectives, ranks started by hand (TCP rendezvous, rank 0 late)"
by_hand collectives
record "collectives by hand" $?

echo "=== 3. timeout: the last rank never joins (5 s limit)"
MEGATRAIN_DISTRIBUTED_TIMEOUT_SECONDS=5 "$expect_failure" 90 \
  "all_reduce .*group 'world'.* did not finish within 5 s" "$test_bin" --nproc "$NPROC" timeout
record "timeout ends the job" $?

echo "=== 4. crash under the launcher"
MEGATRAIN_DISTRIBUTED_TIMEOUT_SECONDS=30 "$expect_failure" 90 \
  "worker rank $((NPROC - 1)) .*killed by signal SIGABRT" "$test_bin" --nproc "$NPROC" crash
record "crash stops the launcher's workers" $?

echo "=== 5. crash with ranks started by hand: rank 0's watchdog ends rank 0"
start=$(date +%s)
by_hand crash MEGATRAIN_DISTRIBUTED_TIMEOUT_SECONDS=10 > /tmp/nccl_crash_by_hand.log 2>&1
cat /tmp/nccl_crash_by_hand.log
elapsed=$(($(date +%s) - start))
if grep -q -- "--- rank 0 exit 1" /tmp/nccl_crash_by_hand.log &&
  grep -Eq "error: (NCCL reported an asynchronous error|NCCL all_reduce)" /tmp/nccl_crash_by_hand.log &&
  [ "$elapsed" -lt 90 ]; then
  record "crash by hand: rank 0 exits 1 in ${elapsed}s" 0
else
  record "crash by hand: rank 0 exits 1 in ${elapsed}s" 1
fi

echo "=== 6. two ranks on one GPU are refused, naming both"
port=$(free_port)
RANK=1 WORLD_SIZE=2 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port timeout 120 "$test_bin" collectives > /tmp/nccl_dup.1.log 2>&1 &
dup_pid=$!
RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port timeout 120 "$test_bin" collectives > /tmp/nccl_dup.0.log 2>&1
dup0=$?
wait $dup_pid
dup1=$?
cat /tmp/nccl_dup.0.log /tmp/nccl_dup.1.log
if [ "$dup0" -ne 0 ] && [ "$dup1" -ne 0 ] && grep -q "ranks 0 and 1 both use GPU" /tmp/nccl_dup.0.log &&
  grep -q "ranks 0 and 1 both use GPU" /tmp/nccl_dup.1.log; then
  record "duplicate GPU refused on both ranks" 0
else
  record "duplicate GPU refused on both ranks" 1
fi

echo "=== 7. collective bandwidth"
timeout -k 5 600 "$bench_bin" --nproc "$NPROC" --min-mb "$MIN_MB" --max-mb "$MAX_MB" | tee /tmp/nccl_bandwidth.txt
record "bandwidth benchmark" "${PIPESTATUS[0]}"

echo
echo "=== summary"
failed=0
for line in "${summary[@]}"; do
  echo "$line"
  [[ $line == FAIL* ]] && failed=1
done
echo "--- bandwidth"
cat /tmp/nccl_bandwidth.txt
exit $failed
