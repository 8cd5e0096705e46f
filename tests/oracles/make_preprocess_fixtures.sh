#!/usr/bin/env bash
# Regenerates tests/fixtures/preprocess/: small JSONL inputs and the .bin/.idx that Megatron-LM's own
# tools/preprocess_data.py writes for them (the expected bytes of tests/preprocess_test.cpp).
#
# Needs a Megatron-LM checkout and a Python with its imports (torch, numpy, transformers<5,
# sentencepiece, tokenizers). The committed files were made with Megatron-LM d98e8a64ddf3 (HEAD of
# 2026-08-22), Python 3.11 (plus a one-line shim giving typing.override, which HEAD imports from 3.12),
# torch 2.15, transformers 4.57.6, tokenizers 0.22.2:
#   MEGATRON=/tmp/megatron-lm PYTHON=/tmp/megatron-venv/bin/python PYTHONPATH=/tmp/megatron-shim \
#     tests/oracles/make_preprocess_fixtures.sh ../shared/data
# GPT2BPETokenizer makes Megatron call AutoTokenizer.from_pretrained("gpt2", vocab_file=...,
# merges_file=...): a local ./gpt2 directory (config.json + the shared vocab/merges) stands in for
# the Hub, so this runs offline.
set -euo pipefail
DATA=$(realpath "${1:?usage: make_preprocess_fixtures.sh SHARED_DATA_DIR}")
: "${MEGATRON:?set MEGATRON to a Megatron-LM checkout}" "${PYTHON:?set PYTHON to its interpreter}"
cd "$(dirname "$0")/../fixtures/preprocess"
OUT=$(pwd)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

# Inputs: unicode, escapes (surrogate pairs, \/), empty documents, lists of sentences (one empty),
# repeated keys (the last wins), special-token strings in the text, a CRLF line ending.
"$PYTHON" - <<'PY'
import json
docs = [
    {"text": "Hello world! It's a test.\n\nNew paragraph   with  spaces\t\ttabs.", "title": "Greeting", "id": 1},
    {"text": "", "title": "empty"},
    {"text": "emoji 😀👍🏽 CJK 中文字符 combining e\u0301 naïve", "meta": {"a": [1, 2, {"b": None}]}, "title": "Ünïcödé"},
    {"title": "specials", "text": "<|endoftext|> special in text <|begin_of_text|> and <|end_of_text|>", "other": 5},
    {"text": "   ", "title": ""},
    {"text": ["sentence one.", "", "sentence three"], "title": ["a", "b"]},
    {"text": [], "title": []},
    {"text": "digits 1234567890 and 3.14159", "title": "numbers 42"},
    {"text": "it's THEY'LL we'Re 'ſ 'S  \n\n\t ", "title": "contractions"},
]
with open("small.jsonl", "w", encoding="utf-8", newline="") as f:
    for i, d in enumerate(docs):
        f.write(json.dumps(d, ensure_ascii=(i % 2 == 0)) + "\n")
    f.write('{"title": "escapes", "text": "pair \\ud83d\\ude00 slash \\/ \\u0041\\u00e9 tab\\t nl\\n", "x": [true, false, null, -1.5e3, NaN]}\r\n')
    f.write('  {"x": {"text": "nested, not used"}, "title": "dup", "text": "dup first", "text": "dup last wins"}  \n')
with open("null.jsonl", "w") as f:
    for t in ["1 2 3", "7", "5 6\n", "10\n 20", ["4 4", "9"], "+3 1_0", "99"]:
        f.write(json.dumps({"text": t}) + "\n")
PY

mkdir -p "$WORK/gpt2"
cp "$DATA/gpt2/gpt2-vocab.json" "$WORK/gpt2/vocab.json"
cp "$DATA/gpt2/gpt2-merges.txt" "$WORK/gpt2/merges.txt"
echo '{"model_type": "gpt2"}' > "$WORK/gpt2/config.json"
echo '{"tokenizer_class": "GPT2Tokenizer"}' > "$WORK/gpt2/tokenizer_config.json"
GPT2=(--tokenizer-type GPT2BPETokenizer --vocab-file "$DATA/gpt2/gpt2-vocab.json" --merge-file "$DATA/gpt2/gpt2-merges.txt")
megatron() {  # megatron INPUT OUTPUT_PREFIX ARGS...
  local input=$1 prefix=$2
  shift 2
  (cd "$WORK" && HF_HUB_OFFLINE=1 "$PYTHON" "$MEGATRON/tools/preprocess_data.py" --input "$input" \
     --output-prefix "$WORK/$prefix" "$@" > "$WORK/$prefix.log" 2>&1) || { cat "$WORK/$prefix.log"; exit 1; }
  for f in "$WORK/$prefix"_*_document.bin "$WORK/$prefix"_*_document.idx; do
    case "$f" in "$WORK/$prefix"_[0-9]_*) continue ;; esac  # partition intermediates
    cp "$f" "$OUT/"
  done
}
cp small.jsonl null.jsonl "$WORK/"
megatron "$WORK/small.jsonl" gpt2 "${GPT2[@]}" --json-keys text title --append-eod --workers 2
megatron "$WORK/small.jsonl" gpt2_noeod "${GPT2[@]}" --workers 1
megatron "$WORK/small.jsonl" llama3 --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$DATA/llama3" --append-eod --workers 2
megatron "$WORK/small.jsonl" gpt2_p2 "${GPT2[@]}" --json-keys text title --append-eod --workers 2 --partitions 2
rm -f "$WORK"/small_[0-9].jsonl
megatron "$WORK/small.jsonl" gpt2_p2seq "${GPT2[@]}" --append-eod --workers 2 --partitions 2 --keep-sequential-samples
megatron "$WORK/null.jsonl" null --tokenizer-type NullTokenizer --vocab-size 100 --append-eod --workers 1
# Contiguous partitions keep the input order: the same bytes as one partition.
cmp gpt2_p2seq_text_document.bin gpt2_text_document.bin
cmp gpt2_p2seq_text_document.idx gpt2_text_document.idx
rm gpt2_p2seq_text_document.*
ls -l "$OUT"
