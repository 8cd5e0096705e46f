#!/usr/bin/env bash
# Data index building speed: a synthetic corpus of 10^9 tokens (plus two smaller ones for a 3-way
# blend) in /tmp, then the GPT indices for ITERS x GLOBAL_BATCH samples of SEQ tokens, single
# prefix and blended. Needs ~8 GB of disk in $BENCH_DIR and ~6 GB of memory at the default sizes.
#   bench/data_index_bench.sh            (ITERS=500000 GLOBAL_BATCH=512 SEQ=2048 by default)
# Record the output in bench/RESULTS.md.
set -euo pipefail
cd "$(dirname "$0")/.."
ITERS=${ITERS:-500000}
GLOBAL_BATCH=${GLOBAL_BATCH:-512}
SEQ=${SEQ:-2048}
TOKENS=${TOKENS:-1000000000}
BENCH_DIR=${BENCH_DIR:-/tmp/megatrain_data_bench}
BIN=build/bench/data_index_bench
cmake --build build -j2 --target data_index_bench > /dev/null
mkdir -p "$BENCH_DIR"
for spec in "big:$TOKENS:1" "mid:$((TOKENS / 4)):2" "small:$((TOKENS / 20)):3"; do
  IFS=: read -r name tokens seed <<< "$spec"
  if [ ! -f "$BENCH_DIR/$name.idx" ]; then "$BIN" generate "$BENCH_DIR/$name" "$tokens" "$seed"; fi
done
SAMPLES=$((ITERS * GLOBAL_BATCH))
echo "== single prefix: $SAMPLES samples of $SEQ tokens, split 969,30,1"
/usr/bin/time -f "peak RSS %M KiB, wall %e s" "$BIN" build --seq-length "$SEQ" --samples "$SAMPLES" --split 969,30,1 \
  --cache "$BENCH_DIR/cache" "$BENCH_DIR/big"
echo "== 3-way blend 0.5/0.3/0.2: $SAMPLES samples of $SEQ tokens, split 969,30,1, 3 builder threads"
/usr/bin/time -f "peak RSS %M KiB, wall %e s" "$BIN" build --seq-length "$SEQ" --samples "$SAMPLES" --split 969,30,1 \
  --threads 3 --cache "$BENCH_DIR/cache" 0.5 "$BENCH_DIR/big" 0.3 "$BENCH_DIR/mid" 0.2 "$BENCH_DIR/small"
rm -rf "$BENCH_DIR/cache"
