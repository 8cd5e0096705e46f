#!/usr/bin/env bash
# The README's first command ends here: prepares real text and trains a small GPT on it.
#   1. corpus: the Perl documentation (Debian's perl-doc), one paragraph per JSONL document;
#   2. tokenizer: a SentencePiece BPE model trained on that text (spm_train, Debian's sentencepiece);
#   3. megatrain preprocess-data: JSONL -> Megatron's .bin/.idx;
#   4. megatrain trains a small GPT on it, on the GPU when one is visible, else on the CPU
#      reference backend (a smaller model and fewer steps: the reference backend is exact, not fast);
#   5. checks that the validation loss fell, and says so.
# Environment: MEGATRAIN_BIN (default build/app/megatrain), WORK (default build/quickstart),
# MEGATRAIN_QUICKSTART_SCALE=tiny (the CI smoke test: a few seconds), MEGATRAIN_DEVICE=cpu|gpu.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${MEGATRAIN_BIN:-build/app/megatrain}
work=${WORK:-build/quickstart}
scale=${MEGATRAIN_QUICKSTART_SCALE:-normal}
pod_dir=$(ls -d /usr/share/perl/*/pod 2>/dev/null | head -n 1 || true)
[ -n "$pod_dir" ] || { echo "error: no Perl pod files found (install Debian's perl-doc)" >&2; exit 1; }
command -v spm_train > /dev/null || { echo "error: spm_train not found (install Debian's sentencepiece)" >&2; exit 1; }
mkdir -p "$work"

if [ -n "${MEGATRAIN_DEVICE:-}" ]; then
  device=$MEGATRAIN_DEVICE
elif nvidia-smi -L > /dev/null 2>&1; then
  device=gpu
else
  device=cpu
  echo "No GPU visible: training on the CPU reference backend (float32, exact, slow) with a small model."
fi

vocab=4096
if [ "$scale" = tiny ]; then vocab=512; fi

echo "== corpus: $pod_dir -> $work/pod.jsonl"
perl -MJSON::PP -e '
  my $json = JSON::PP->new->canonical;
  for my $file (sort glob("'"$pod_dir"'/*.pod")) {
    open(my $fh, "<", $file) or next;
    local $/;
    my $text = <$fh>;
    for my $para (split /\n\s*\n(?=\S)/, $text) { print $json->encode({text => $para}), "\n" if length($para) >= 200; }
  }' > "$work/pod.jsonl"
if [ "$scale" = tiny ]; then head -n 2000 "$work/pod.jsonl" > "$work/pod.small" && mv "$work/pod.small" "$work/pod.jsonl"; fi
perl -MJSON::PP -ne 'print JSON::PP->new->decode($_)->{text}, "\n"' "$work/pod.jsonl" > "$work/pod.txt"

echo "== tokenizer: SentencePiece BPE, vocabulary $vocab"
spm_train --input="$work/pod.txt" --model_prefix="$work/pod_sp" --vocab_size=$vocab --model_type=bpe \
  --character_coverage=1.0 --minloglevel=2 > "$work/spm_train.log" 2>&1 || { cat "$work/spm_train.log" >&2; exit 1; }

echo "== megatrain preprocess-data"
"$bin" preprocess-data --input "$work/pod.jsonl" --output-prefix "$work/pod" --json-keys text \
  --tokenizer-type SentencePieceTokenizer --tokenizer-model "$work/pod_sp.model" --append-eod --workers 2

data="--data-path $work/pod_text_document --split 98,2,0 --tokenizer-type SentencePieceTokenizer
  --tokenizer-model $work/pod_sp.model"
optim="--lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0 --adam-beta2 0.95 --attention-dropout 0.0
  --hidden-dropout 0.0 --seed 1234"
case "$device:$scale" in
  gpu:*) model="--num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 512
           --max-position-embeddings 512 --micro-batch-size 32 --global-batch-size 64 --train-iters 400
           --lr 6e-4 --min-lr 6e-5 --lr-warmup-iters 40 --bf16 --log-interval 20 --eval-interval 100 --eval-iters 10" ;;
  cpu:tiny) model="--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64
           --max-position-embeddings 64 --micro-batch-size 4 --global-batch-size 8 --train-iters 40
           --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 4 --log-interval 10 --eval-interval 20 --eval-iters 4" ;;
  cpu:*) model="--num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128
           --max-position-embeddings 128 --micro-batch-size 8 --global-batch-size 16 --train-iters 100
           --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 10 --log-interval 10 --eval-interval 50 --eval-iters 5" ;;
esac
metrics="$work/metrics.jsonl"
rm -f "$metrics"
echo "== megatrain: training a small GPT on the $device"
# shellcheck disable=SC2086
"$bin" --device "$device" $data $model $optim --metrics-jsonl "$metrics"

# Learned something: the last validation loss must be below the first iteration's training loss
# (about ln(vocabulary) for an untrained model).
perl -MJSON::PP -ne '
  my $r = JSON::PP->new->decode($_);
  $start //= $r->{lm_loss} if $r->{type} eq "iteration" && defined $r->{lm_loss};
  $last = $r->{lm_loss} if $r->{type} eq "evaluation" && defined $r->{lm_loss};
  END {
    die "error: no training or validation loss was recorded\n" unless defined $start && defined $last;
    printf "loss: %.4f at the first iteration, validation %.4f at the end\n", $start, $last;
    die "error: the loss did not fall\n" unless $last < $start;
  }' "$metrics"
