#!/usr/bin/env bash
# The resilience probes in one command: the ways a careful user breaks a run (a killed or stopped
# rank, SIGTERM, a kill or a full disk in the middle of a save, damaged checkpoints, datasets and
# compressed inputs, NaN, transient and persistent errors, a corrupted replica, absurd sizes), each
# a CTest test of this build, run here by name and reported one line per probe. CI runs them all
# with the rest of the suite; this script repeats only them, e.g. after a change to training,
# checkpointing or the data path.
#
#   tests/resilience_probes.sh [--list] [BUILD_DIR]      (default build-cpu, then build)
#
# --list only checks that every probe names at least one test of the build (CTest runs that as
# resilience_probes_listed, so a renamed test fails the suite instead of silently leaving a probe).
#
# Exits non-zero if any probe fails or finds no test (a renamed test must be renamed here too).
# The MPI probes need mpirun; where it is missing CTest reports them as not run and so does this.
set -uo pipefail
cd "$(dirname "$0")/.."
list_only=0
if [ "${1:-}" = --list ]; then list_only=1; shift; fi
build=${1:-}
if [ -z "$build" ]; then
  for d in build-cpu build; do [ -f "$d/CTestTestfile.cmake" ] && { build=$d; break; }; done
fi
[ -n "$build" ] && [ -f "$build/CTestTestfile.cmake" ] || { echo "no configured build directory (give one)" >&2; exit 2; }

# probe | CTest name regex (test names as CTest lists them: `ctest -N`)
probes=(
  "a killed rank ends every rank|^parallel_train_killed_rank$"
  "a stopped rank times out naming the collective and the ranks|^parallel_train_hung_rank$"
  "SIGTERM with --exit-signal-handler saves and exits 0|SIGTERM with --exit-signal-handler"
  "a kill in the middle of a save keeps the previous checkpoint|a process killed mid-save"
  "a full disk during a save keeps the previous checkpoint|a full disk during a save"
  "a failing save stops with one line, the previous checkpoint loadable|a save that fails stops"
  "damaged checkpoints are refused naming the file|corrupt, truncated and mismatched checkpoints"
  "a changed file under --verify-integrity is refused by name|flag --verify-integrity through the binary"
  "an .idx with a changed dtype byte is refused|dtype byte was changed"
  "a damaged cached index is rebuilt|cached index .*holding an out-of-range value|cached indices with out-of-range values"
  "a truncated .jsonl.gz is refused, no partial dataset|truncated or damaged .jsonl.gz|a truncated .jsonl.gz exits"
  "a NaN that reproduces saves and exits 16|a NaN loss that reproduces"
  "an injected transient error is re-run, training continues|transient_error"
  "an injected persistent error saves and exits 16|persistent_error and correct_result"
  "a corrupted replica is caught by the weight hash check|^parallel_train_weight_hash_corrupt_tp2_dp2$|^parallel_train_test_mode_corrupt_tp2_dp2$"
  "sizes that cannot fit are refused at once naming the flag|sizes that cannot fit anywhere|absurd sizes are refused"
)

count() { ctest --test-dir "$build" -N -R "$1" 2>/dev/null | sed -n 's/^Total Tests: \([0-9]*\)$/\1/p'; }
mpi_tests=$(count '^parallel_train_')  # 0: this build found no MPI, its MPI tests do not exist
failed=0
for p in "${probes[@]}"; do
  what=${p%%|*}
  regex=${p#*|}
  if [ "${mpi_tests:-0}" = 0 ] && [[ "$regex" == *parallel_train_* ]]; then
    printf 'no MPI   %s (this build has no MPI tests)\n' "$what"
    continue
  fi
  listed=$(count "$regex")
  if [ "${listed:-0}" = 0 ]; then
    printf 'NO TEST  %s (no CTest name matches %s)\n' "$what" "$regex"
    failed=1
    continue
  fi
  if [ "$list_only" = 1 ]; then
    printf 'listed   %s (%s test%s)\n' "$what" "$listed" "$([ "$listed" = 1 ] || echo s)"
    continue
  fi
  log=$(ctest --test-dir "$build" -R "$regex" --timeout 300 --output-on-failure 2>&1)
  summary=$(grep -E '[0-9]+% tests passed' <<< "$log" | tail -n 1)
  if grep -q "tests passed, 0 tests failed" <<< "$summary" && ! grep -qE "Not Run|\*\*\*Skipped" <<< "$log"; then
    printf 'ok       %s (%s test%s)\n' "$what" "$listed" "$([ "$listed" = 1 ] || echo s)"
  else
    printf 'FAILED   %s: %s\n' "$what" "${summary:-no result}"
    grep -E "\*\*\*|Not Run|Failed" <<< "$log" | head -n 5 | sed 's/^/         /'
    failed=1
  fi
done
exit $failed
