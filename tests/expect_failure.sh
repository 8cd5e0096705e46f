#!/usr/bin/env bash
# Runs a command that must fail cleanly: usage expect_failure.sh <seconds> <regex> <command...>
# Passes when the command exits non-zero, its output (stdout + stderr) matches the extended regex,
# and it ends within <seconds>. A hang (killed at the limit) or exit 0 fails the test.
set -u
limit=$1
regex=$2
shift 2
start=$(date +%s%N)
output=$(timeout -k 5 "$limit" "$@" 2>&1)
rc=$?
elapsed_ms=$(( ($(date +%s%N) - start) / 1000000 ))
printf '%s\n' "$output"
echo "--- exit status $rc after ${elapsed_ms} ms (limit ${limit}s)"
if [ "$rc" -eq 77 ]; then
  echo "SKIPPED (exit 77)"
  exit 77
fi
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
  echo "FAIL: still running after ${limit}s (a hang)"
  exit 1
fi
if [ "$rc" -eq 0 ]; then
  echo "FAIL: exited 0 but was expected to fail"
  exit 1
fi
if ! printf '%s\n' "$output" | grep -Eq -- "$regex"; then
  echo "FAIL: output does not match /$regex/"
  exit 1
fi
echo "PASS: failed as expected"
