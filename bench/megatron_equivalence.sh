#!/usr/bin/env bash
# Megatron-LM itself against megatrain from the same weights (manual: needs a GPU, PyTorch and a
# Megatron-LM checkout; nothing of Megatron-LM is in this repository).
#   bench/megatron_equivalence.sh MEGATRON_DIR MEGATRAIN_BIN OUT_DIR [CASE...]     CASE: gpt llama nemotron mla moebias
# Environment: ITERS (default 30), PREC (fp32 or bf16, default fp32), TP, PP and DP (Megatron's layout,
# default 1; TP*PP*DP GPUs), MODE (finetune or resume, default finetune), MEGATRON_EXTRA (more
# Megatron-LM flags, e.g. --use-distributed-optimizer), MEGATRAIN_LAYOUT (one: megatrain trains on
# one GPU, the default; same: with Megatron's TP, PP, DP and MEGATRON_EXTRA), FORMATS (finetune mode:
# the checkpoint formats Megatron saves, default "torch_dist torch"; resume mode: CKPT_FORMAT, default
# torch_dist), PYTHON (default python3).
#
# MODE=finetune: for each case Megatron-LM (pretrain_gpt.py, local transformer implementation: no
# Transformer Engine or Apex needed) trains 10 iterations on --mock-data and saves, once in
# torch_dist and once in torch format. Then, from the torch_dist checkpoint with --finetune (weights
# only, fresh optimizer, data from the first sample), Megatron-LM trains ITERS iterations;
# megatrain imports each checkpoint (import-megatron) and trains the same ITERS iterations with the
# same flags (on one GPU, or in Megatron's layout with MEGATRAIN_LAYOUT=same).
# MODE=resume: Megatron-LM trains 10 + ITERS iterations in one run, saving (torch_dist) after 10;
# megatrain imports that checkpoint with its optimizer state and resumes it to 10 + ITERS.
# bench/compare_losses.py prints the curves and the largest differences.
set -euo pipefail
MEGATRON=$(cd "${1:?usage: megatron_equivalence.sh MEGATRON_DIR MEGATRAIN_BIN OUT_DIR [CASE...]}" && pwd)
BIN=$(realpath "${2:?megatrain binary}")
OUT=$(mkdir -p "${3:?output directory}" && cd "$3" && pwd)
shift 3
CASES=("$@")
[ ${#CASES[@]} -gt 0 ] || CASES=(gpt llama)
ITERS=${ITERS:-30}
PREC=${PREC:-fp32}
TP=${TP:-1}
PP=${PP:-1}
DP=${DP:-1}
NPROC=$((TP * PP * DP))
read -r -a formats <<< "${FORMATS:-torch_dist torch}"
MODE=${MODE:-finetune}
read -r -a extra <<< "${MEGATRON_EXTRA:-}"
PY=${PYTHON:-python3}
HERE=$(cd "$(dirname "$0")" && pwd)
export CUDA_DEVICE_MAX_CONNECTIONS=1  # Megatron-LM requires it with tensor parallelism

common=(--seq-length 256 --max-position-embeddings 256 --micro-batch-size 4 --global-batch-size 16
        --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.1 --clip-grad 1.0
        --mock-data --tokenizer-type NullTokenizer --vocab-size 2000 --split 99,1,0
        --attention-dropout 0 --hidden-dropout 0 --log-interval 1 --eval-interval 100000 --eval-iters 0
        --transformer-impl local --no-gradient-accumulation-fusion --no-masked-softmax-fusion
        --no-bias-dropout-fusion --no-rope-fusion --no-persist-layer-norm --seed 1234)
[ "$PREC" = bf16 ] && common+=(--bf16)
model_gpt=(--num-layers 4 --hidden-size 256 --num-attention-heads 8 --position-embedding-type learned_absolute)
model_llama=(--num-layers 4 --hidden-size 256 --ffn-hidden-size 704 --num-attention-heads 8 --group-query-attention
             --num-query-groups 2 --position-embedding-type rope --normalization RMSNorm --swiglu
             --disable-bias-linear --untie-embeddings-and-output-weights --rotary-base 10000)
# Nemotron-4's MLP and RoPE (squared ReLU, half of each head rotated). Without --apply-layernorm-1p:
# Megatron-LM's local transformer implementation (torch norms, no Apex) refuses zero-centred gamma.
model_nemotron=(--num-layers 4 --hidden-size 256 --ffn-hidden-size 1024 --num-attention-heads 8 --group-query-attention
                --num-query-groups 2 --position-embedding-type rope --rotary-percent 0.5 --squared-relu
                --disable-bias-linear --untie-embeddings-and-output-weights --rotary-base 10000)

# DeepSeek-style multi-latent attention: query rank, latent norms, YaRN with DeepSeek-V3's terms
# (factor 40, mscale = mscale_all_dim = 1); Megatron-LM's core attention replaced by a plain one
# (bench/megatron_mla_core.py: its local one cannot run MLA). torch_dist only (FORMATS=torch_dist): Megatron-LM's
# local spec keys MLA's norms by module in its per-rank torch files too, which import-megatron maps
# for torch_dist only.
model_mla=(--num-layers 4 --hidden-size 256 --ffn-hidden-size 704 --num-attention-heads 8 --multi-latent-attention
           --q-lora-rank 64 --kv-lora-rank 32 --qk-head-dim 32 --qk-pos-emb-head-dim 16 --v-head-dim 32 --qk-layernorm
           --normalization RMSNorm --swiglu --disable-bias-linear --untie-embeddings-and-output-weights
           --position-embedding-type rope --rotary-scaling-factor 40 --mscale 1.0 --mscale-all-dim 1.0
           --rotary-base 10000)

# Mixture of experts with Megatron's default linear biases (the router's bias, each expert's fc1
# and fc2 biases; Megatron-LM's local spec runs the experts as its SequentialMLP): a dense first
# layer, then 3 MoE layers of 4 experts, top-2, aux loss. --no-bias-swiglu-fusion: Megatron-LM's fused
# SwiGLU with routing weights raises "Bias is not supported for weighted swiglu fusion".
model_moebias=(--num-layers 4 --hidden-size 256 --ffn-hidden-size 704 --num-attention-heads 8 --group-query-attention
               --num-query-groups 2 --position-embedding-type rope --normalization RMSNorm --swiglu
               --untie-embeddings-and-output-weights --rotary-base 10000 --num-experts 4 --moe-router-topk 2
               --moe-ffn-hidden-size 352 --moe-layer-freq "[0,1,1,1]" --moe-aux-loss-coeff 1e-2 --no-bias-swiglu-fusion)

megatron() {  # log, nproc, args...
  local log=$1 nproc=$2
  shift 2
  (cd "$MEGATRON" && PYTHONPATH="$MEGATRON${PYTHONPATH:+:$PYTHONPATH}" timeout 600 \
     "$PY" -m torch.distributed.run --nproc_per_node "$nproc" --master_port 29533 "$entry" "$@") > "$log" 2>&1 \
    || { echo "Megatron-LM failed, see $log"; tail -20 "$log"; return 1; }
}

for c in "${CASES[@]}"; do
  # MLA: Megatron-LM's local spec has no core attention for its head sizes (Transformer Engine's
  # only): bench/megatron_mla_core.py runs pretrain_gpt.py with a plain PyTorch one.
  entry=pretrain_gpt.py
  [ "$c" = mla ] && entry=$HERE/megatron_mla_core.py
  model_var="model_$c[@]"
  model=("${!model_var}")
  d=$OUT/$c
  rm -rf "$d" && mkdir -p "$d"
  par=(--tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" "${extra[@]}")
  mt_par=()
  [ "${MEGATRAIN_LAYOUT:-one}" = same ] && mt_par=("${par[@]}")
  if [ "$MODE" = resume ]; then
    total=$((10 + ITERS))
    echo "== $c: Megatron-LM trains $total iterations (TP $TP, PP $PP, DP $DP, $PREC), saving after 10"
    megatron "$d/megatron_straight.log" $NPROC "${common[@]}" "${model[@]}" "${par[@]}" --train-iters "$total" \
      --save "$d/megatron_at10" --save-interval 10 --ckpt-format "${CKPT_FORMAT:-torch_dist}"
    echo "== $c: megatrain imports iteration 10 with its optimizer state and resumes to $total"
    "$BIN" import-megatron --load "$d/megatron_at10" --ckpt-step 10 --save "$d/imported" > "$d/import.log" 2>&1 \
      || { cat "$d/import.log"; exit 1; }
    head -2 "$d/import.log"
    "$BIN" "${common[@]}" "${model[@]}" "${mt_par[@]}" --train-iters "$total" --load "$d/imported" \
      > "$d/megatrain_resumed.log" 2>&1 || { tail -20 "$d/megatrain_resumed.log"; exit 1; }
    "$PY" "$HERE/compare_losses.py" --after 10 "$d/megatron_straight.log" "$d/megatrain_resumed.log" | tee "$d/compare.txt"
    continue
  fi
  for fmt in "${formats[@]}"; do
    echo "== $c: Megatron-LM trains 10 iterations (TP $TP, PP $PP, DP $DP, $PREC) and saves in $fmt format"
    megatron "$d/megatron_save_$fmt.log" $NPROC "${common[@]}" "${model[@]}" "${par[@]}" --train-iters 10 \
      --save "$d/megatron_$fmt" --save-interval 10 --ckpt-format "$fmt"
  done
  echo "== $c: Megatron-LM trains $ITERS iterations from its checkpoint (--finetune)"
  megatron "$d/megatron_finetune.log" $NPROC "${common[@]}" "${model[@]}" "${par[@]}" --train-iters "$ITERS" \
    --load "$d/megatron_torch_dist" --finetune --ckpt-format torch_dist
  megatrain_logs=()
  for fmt in "${formats[@]}"; do
    echo "== $c: megatrain imports the $fmt checkpoint and trains $ITERS iterations"
    "$BIN" import-megatron --load "$d/megatron_$fmt" --save "$d/imported_$fmt" > "$d/import_$fmt.log" 2>&1 \
      || { cat "$d/import_$fmt.log"; exit 1; }
    head -1 "$d/import_$fmt.log"
    "$BIN" "${common[@]}" "${model[@]}" "${mt_par[@]}" --train-iters "$ITERS" --load "$d/imported_$fmt" --finetune \
      > "$d/megatrain_$fmt.log" 2>&1 || { tail -20 "$d/megatrain_$fmt.log"; exit 1; }
    megatrain_logs+=("$d/megatrain_$fmt.log")
  done
  "$PY" "$HERE/compare_losses.py" "$d/megatron_finetune.log" "${megatrain_logs[@]}" \
    | tee "$d/compare.txt"
done
