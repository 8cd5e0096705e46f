#!/usr/bin/env bash
# megatrain preprocess-data vs Megatron-LM's tools/preprocess_data.py on the same JSONL corpus of
# real English text (bench/make_pod_corpus.py: Perl's pod documentation, repeated), same worker
# count, GPT2BPETokenizer and the Llama 3 HuggingFaceTokenizer. Checks that both write the same
# bytes and prints wall time, docs/s, MB/s (input bytes / 10^6 per second, start-up included) and the
# speed ratio.
#
#   bench/preprocess_bench.sh [MEGABYTES=150] [WORKERS=2]
# Environment:
#   MEGATRAIN   the binary (default build/app/megatrain)
#   DATA        tokenizer files (default ../shared/data)
#   WORKDIR     scratch directory for the corpus and outputs (default /tmp/megatrain_preprocess_bench)
#   MEGATRON, MEGATRON_PYTHON  a Megatron-LM checkout and a Python with its imports (torch,
#               transformers, sentencepiece); without them only megatrain runs. Extra environment
#               for that Python (e.g. PYTHONPATH) is passed through.
set -euo pipefail
cd "$(dirname "$0")/.."
MB=${1:-150}
WORKERS=${2:-2}
MEGATRAIN=$(realpath "${MEGATRAIN:-build/app/megatrain}")
DATA=$(realpath "${DATA:-../shared/data}")
WORKDIR=${WORKDIR:-/tmp/megatrain_preprocess_bench}
mkdir -p "$WORKDIR"
CORPUS=$WORKDIR/pod_${MB}MB.jsonl
[ -f "$CORPUS" ] || python3 bench/make_pod_corpus.py "$CORPUS" --megabytes "$MB"
BYTES=$(stat -c %s "$CORPUS")
DOCS=$(wc -l < "$CORPUS")
echo "corpus: $CORPUS, $DOCS documents, $BYTES bytes; workers $WORKERS"
echo "machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores; load: $(cut -d' ' -f1-3 /proc/loadavg)"

# A stand-in for the Hub's "gpt2" (Megatron's GPT2BPETokenizer loads AutoTokenizer("gpt2", vocab, merges)).
mkdir -p "$WORKDIR/gpt2"
cp "$DATA/gpt2/gpt2-vocab.json" "$WORKDIR/gpt2/vocab.json"
cp "$DATA/gpt2/gpt2-merges.txt" "$WORKDIR/gpt2/merges.txt"
echo '{"model_type": "gpt2"}' > "$WORKDIR/gpt2/config.json"
echo '{"tokenizer_class": "GPT2Tokenizer"}' > "$WORKDIR/gpt2/tokenizer_config.json"

seconds() { date +%s.%N; }
report() {  # report NAME TOKENIZER SECONDS
  awk -v n="$1" -v t="$2" -v s="$3" -v d="$DOCS" -v b="$BYTES" \
    'BEGIN { printf "%-9s %-22s %8.2f s %10.0f docs/s %8.2f MB/s\n", n, t, s, d / s, b / 1e6 / s }'
}

for TOK in GPT2BPETokenizer HuggingFaceTokenizer; do
  if [ "$TOK" = GPT2BPETokenizer ]; then
    ARGS=(--tokenizer-type GPT2BPETokenizer --vocab-file "$DATA/gpt2/gpt2-vocab.json" --merge-file "$DATA/gpt2/gpt2-merges.txt")
    NAME=gpt2
  else
    ARGS=(--tokenizer-type HuggingFaceTokenizer --tokenizer-model "$DATA/llama3")
    NAME=llama3
  fi
  t0=$(seconds)
  /usr/bin/time -f "max RSS %M KB" -o "$WORKDIR/mt_$NAME.rss" \
    "$MEGATRAIN" preprocess-data --input "$CORPUS" --output-prefix "$WORKDIR/mt_$NAME" "${ARGS[@]}" \
    --append-eod --workers "$WORKERS" --log-interval 100000 > "$WORKDIR/mt_$NAME.log" 2>&1
  t1=$(seconds)
  MT=$(echo "$t1 - $t0" | bc -l)
  report megatrain "$TOK" "$MT"
  echo "  megatrain $(cat "$WORKDIR/mt_$NAME.rss")"
  if [ -n "${MEGATRON:-}" ] && [ -n "${MEGATRON_PYTHON:-}" ]; then
    t0=$(seconds)
    (cd "$WORKDIR" && HF_HUB_OFFLINE=1 "$MEGATRON_PYTHON" "$MEGATRON/tools/preprocess_data.py" --input "$CORPUS" \
       --output-prefix "$WORKDIR/meg_$NAME" "${ARGS[@]}" --append-eod --workers "$WORKERS" --log-interval 100000 \
       > "$WORKDIR/meg_$NAME.log" 2>&1)
    t1=$(seconds)
    MEG=$(echo "$t1 - $t0" | bc -l)
    report Megatron "$TOK" "$MEG"
    same=identical
    for ext in bin idx; do
      cmp -s "$WORKDIR/mt_${NAME}_text_document.$ext" "$WORKDIR/meg_${NAME}_text_document.$ext" || same=DIFFERENT
    done
    echo "  outputs: $same; speed ratio megatrain/Megatron: $(echo "$MEG / $MT" | bc -l | xargs printf %.1f)x"
  fi
done
