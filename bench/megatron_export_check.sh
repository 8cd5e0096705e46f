#!/usr/bin/env bash
# megatrain -> Megatron-LM: Megatron-LM continues a checkpoint megatrain trained (manual: needs GPUs,
# PyTorch and a Megatron-LM checkout; nothing of Megatron-LM is in this repository).
#   bench/megatron_export_check.sh MEGATRON_DIR MEGATRAIN_BIN OUT_DIR [CASE...]     CASE: gpt llama gate moe moebias
# (gate: the llama case with --attention-output-gate and --qk-layernorm: Megatron-LM reads the gated
# QKV projection's [q | gate | k | v] rows as megatrain wrote them; moe: the llama case with a dense
# first layer and three MoE layers of 4 experts, top-2, which export-megatron writes as weights only:
# Megatron-LM starts from them at iteration 0 with a fresh optimizer, and megatrain does the same
# from its checkpoint with --finetune; the two curves are compared over ITERS iterations)
# Environment: ITERS (iterations after the export, default 10), TP, PP and DP (the Megatron-LM run's
# layout, which export-megatron writes; default 1 each, TP*PP*DP GPUs), DISTOPT=1 (the distributed
# optimizer: export-megatron --use-distributed-optimizer and Megatron-LM's flag), NO_LOAD_RNG=1
# (Megatron-LM skips the exported RNG states), CONVERT=1 (also: Megatron-LM converts the export to
# torch_dist with its --ckpt-convert-format and resumes from that), FORMAT=torch_dist (export-megatron
# writes Megatron's torch_dist format: the optimizer state by parameter, with DISTOPT=1 in the
# distributed optimizer's fully reshardable layout), EXPORT_TP and EXPORT_PP (torch_dist: the layout
# export-megatron writes for, default TP and PP; Megatron-LM reshards it to TP x PP on load), PYTHON
# (default python3), WEIGHTS_ONLY=1 (export-megatron --weights-only: both sides fine-tune from the
# weights, as for a model whose optimizer state does not go over), RESAVE=1 (torch_dist: Megatron-LM
# also loads the export and saves it again without training (its scheduler the checkpoint's), and
# bench/dcp_compare.py compares its save with the export item by item: what Megatron-LM holds after
# loading is what was written).
#
# For each case megatrain trains 10 + ITERS iterations in float32 on --mock-data on one GPU, saving
# after 10; export-megatron writes iteration 10 as a Megatron-LM checkpoint (the torch format unless FORMAT says otherwise) in the
# TP x PP layout; Megatron-LM (pretrain_gpt.py --transformer-impl local, the flags of
# bench/megatron_equivalence.sh, chosen so both sides compute the same) loads it and trains on to
# 10 + ITERS. bench/compare_losses.py --after 10 compares Megatron-LM's resumed curve with
# megatrain's straight one (a resumed Megatron-LM prints at iteration 12 the mean of 11 and 12);
# the target is 1e-6 relative.
set -euo pipefail
usage="usage: megatron_export_check.sh MEGATRON_DIR MEGATRAIN_BIN OUT_DIR [CASE...]"
[ $# -ge 3 ] || { echo "$usage" >&2; exit 2; }
[ -f "$1/pretrain_gpt.py" ] || { echo "error: $1 is not a Megatron-LM checkout (no pretrain_gpt.py)" >&2; exit 2; }
[ -x "$2" ] || { echo "error: $2 is not an executable megatrain binary" >&2; exit 2; }
MEGATRON=$(cd "$1" && pwd)
BIN=$(realpath "$2")
OUT=$(mkdir -p "$3" && cd "$3" && pwd)
shift 3
CASES=("$@")
[ ${#CASES[@]} -gt 0 ] || CASES=(gpt llama)
ITERS=${ITERS:-10}
TP=${TP:-1}
PP=${PP:-1}
DP=${DP:-1}
NPROC=$((TP * PP * DP))
PY=${PYTHON:-python3}
HERE=$(cd "$(dirname "$0")" && pwd)
TOTAL=$((10 + ITERS))
export CUDA_DEVICE_MAX_CONNECTIONS=1  # Megatron-LM requires it with tensor parallelism

"$PY" -c 'import torch' 2>/dev/null || { echo "error: $PY cannot import torch (set PYTHON)" >&2; exit 2; }
gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
[ "$gpus" -ge "$NPROC" ] || { echo "error: TP $TP x PP $PP x DP $DP needs $NPROC GPUs, $gpus visible" >&2; exit 2; }

# bench/megatron_equivalence.sh's flags (float32; dropout off; Megatron's fusions off, as megatrain computes)
common=(--seq-length 256 --max-position-embeddings 256 --micro-batch-size 4 --global-batch-size 16
        --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.1 --clip-grad 1.0
        --mock-data --tokenizer-type NullTokenizer --vocab-size 2000 --split 99,1,0
        --attention-dropout 0 --hidden-dropout 0 --log-interval 1 --eval-interval 100000 --eval-iters 0
        --transformer-impl local --no-gradient-accumulation-fusion --no-masked-softmax-fusion
        --no-bias-dropout-fusion --no-rope-fusion --no-persist-layer-norm --seed 1234)
model_gpt=(--num-layers 4 --hidden-size 256 --num-attention-heads 8 --position-embedding-type learned_absolute)
model_llama=(--num-layers 4 --hidden-size 256 --ffn-hidden-size 704 --num-attention-heads 8 --group-query-attention
             --num-query-groups 2 --position-embedding-type rope --normalization RMSNorm --swiglu
             --disable-bias-linear --untie-embeddings-and-output-weights --rotary-base 10000)
model_gate=("${model_llama[@]}" --attention-output-gate --qk-layernorm)
model_moe=("${model_llama[@]}" --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 352 --moe-layer-freq "[0,1,1,1]")
# MoE with Megatron's default linear biases (bench/megatron_equivalence.sh's moebias; torch_dist only).
# Megatron-LM's local MLP adds an expert's fc2 bias in place on an autograd view, which PyTorch
# refuses: run it with that line of megatron/core/transformer/mlp.py made out of place.
model_moebias=(--num-layers 4 --hidden-size 256 --ffn-hidden-size 704 --num-attention-heads 8 --group-query-attention
               --num-query-groups 2 --position-embedding-type rope --normalization RMSNorm --swiglu
               --untie-embeddings-and-output-weights --rotary-base 10000 --num-experts 4 --moe-router-topk 2
               --moe-ffn-hidden-size 352 --moe-layer-freq "[0,1,1,1]" --no-bias-swiglu-fusion)

par=(--tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP")
export_par=("${par[@]}" --data-parallel-size "$DP")
optimizer=""
if [ "${DISTOPT:-0}" = 1 ]; then
  par+=(--use-distributed-optimizer)
  export_par+=(--use-distributed-optimizer)
  optimizer=" (distributed optimizer)"
fi
FORMAT=${FORMAT:-torch}
case $FORMAT in
  torch) ;;
  torch_dist)
    export_par=(--tensor-model-parallel-size "${EXPORT_TP:-$TP}" --pipeline-model-parallel-size "${EXPORT_PP:-$PP}"
                --data-parallel-size "$DP")
    [ "${DISTOPT:-0}" = 1 ] && export_par+=(--use-distributed-optimizer) ;;
  *) echo "error: FORMAT must be torch or torch_dist (got '$FORMAT')" >&2; exit 2 ;;
esac
rng=()
[ "${NO_LOAD_RNG:-0}" = 1 ] && rng=(--no-load-rng)

megatron() {  # log, pretrain_gpt.py flags...; fails unless the run loads its checkpoint and finishes
  local log=$1
  shift
  (cd "$MEGATRON" && PYTHONPATH="$MEGATRON${PYTHONPATH:+:$PYTHONPATH}" timeout 900 \
     "$PY" -m torch.distributed.run --nproc_per_node "$NPROC" --master_port 29534 pretrain_gpt.py "$@") > "$log" 2>&1 \
    || { echo "Megatron-LM failed, see $log"; tail -30 "$log"
         echo "(if it failed restoring the RNG states, NO_LOAD_RNG=1 skips them)"; exit 1; }
  grep -E "loading checkpoint|successfully loaded checkpoint" "$log" | head -2 || true
  grep -q "successfully loaded checkpoint" "$log" || { echo "Megatron-LM did not load its checkpoint, see $log"; exit 1; }
}

for c in "${CASES[@]}"; do
  case $c in
    gpt) model=("${model_gpt[@]}") ;;
    llama) model=("${model_llama[@]}") ;;
    gate) model=("${model_gate[@]}") ;;
    moe) model=("${model_moe[@]}") ;;
    moebias) model=("${model_moebias[@]}") ;;
    *) echo "error: unknown case '$c' (gpt, llama, gate, moe, moebias)" >&2; exit 2 ;;
  esac
  d=$OUT/$c
  rm -rf "$d" && mkdir -p "$d"
  echo "== $c: megatrain trains $TOTAL iterations (one GPU, fp32), saving after 10"
  "$BIN" "${common[@]}" "${model[@]}" --train-iters "$TOTAL" --save "$d/megatrain" --save-interval 10 \
    > "$d/megatrain.log" 2>&1 || { echo "megatrain failed, see $d/megatrain.log"; tail -20 "$d/megatrain.log"; exit 1; }
  echo "== $c: export-megatron writes iteration 10 in the $FORMAT format for TP ${EXPORT_TP:-$TP} x PP ${EXPORT_PP:-$PP}$optimizer"
  weights=()
  [ "${WEIGHTS_ONLY:-0}" = 1 ] && weights=(--weights-only)
  "$BIN" export-megatron --load "$d/megatrain" --ckpt-step 10 --save "$d/exported" --ckpt-format "$FORMAT" "${export_par[@]}" "${weights[@]}" \
    > "$d/export.log" 2>&1 || { echo "export-megatron failed:"; cat "$d/export.log"; exit 1; }
  head -2 "$d/export.log"
  if grep -q "^weights only" "$d/export.log"; then
    echo "== $c: from the exported weights, Megatron-LM (TP $TP, PP $PP, DP $DP) and megatrain (--finetune) train $ITERS iterations"
    megatron "$d/megatron_weights.log" "${common[@]}" "${model[@]}" "${par[@]}" --train-iters "$ITERS" \
      --load "$d/exported" --ckpt-format "$FORMAT"
    "$BIN" "${common[@]}" "${model[@]}" --train-iters "$ITERS" --load "$d/megatrain" --ckpt-step 10 --finetune \
      > "$d/megatrain_finetune.log" 2>&1 || { echo "megatrain failed, see $d/megatrain_finetune.log"; exit 1; }
    "$PY" "$HERE/compare_losses.py" "$d/megatrain_finetune.log" "$d/megatron_weights.log" | tee "$d/compare.txt"
    continue
  fi
  if [ "${RESAVE:-0}" = 1 ] && [ "$FORMAT" = torch_dist ]; then
    echo "== $c: Megatron-LM loads the export and saves it again (no training); the two compared"
    megatron "$d/megatron_resave.log" "${common[@]}" "${model[@]}" "${par[@]}" "${rng[@]}" --train-iters 10 \
      --use-checkpoint-opt_param-scheduler --load "$d/exported" --ckpt-format "$FORMAT" --save "$d/resaved" \
      --save-interval 3
    # (Megatron-LM's saved objects unpickle with its modules on the path.)
    PYTHONPATH="$MEGATRON${PYTHONPATH:+:$PYTHONPATH}" "$PY" "$HERE/dcp_compare.py" "$d/exported/iter_0000010" \
      "$d/resaved/iter_0000010" 2>&1 | tail -40 | tee "$d/resave_compare.txt" || true
  fi
  echo "== $c: Megatron-LM resumes it to iteration $TOTAL (TP $TP, PP $PP, DP $DP)"
  megatron "$d/megatron_resumed.log" "${common[@]}" "${model[@]}" "${par[@]}" "${rng[@]}" --train-iters "$TOTAL" \
    --load "$d/exported" --ckpt-format "$FORMAT"
  logs=("$d/megatron_resumed.log")
  if [ "${CONVERT:-0}" = 1 ]; then
    echo "== $c: Megatron-LM converts the export to torch_dist and resumes from that"
    megatron "$d/megatron_convert.log" "${common[@]}" "${model[@]}" "${par[@]}" "${rng[@]}" --train-iters "$TOTAL" \
      --load "$d/exported" --ckpt-format torch --ckpt-convert-format torch_dist --ckpt-convert-save "$d/converted"
    megatron "$d/megatron_resumed_dist.log" "${common[@]}" "${model[@]}" "${par[@]}" "${rng[@]}" --train-iters "$TOTAL" \
      --load "$d/converted/torch_dist" --ckpt-format torch_dist
    logs+=("$d/megatron_resumed_dist.log")
  fi
  "$PY" "$HERE/compare_losses.py" --after 10 "$d/megatrain.log" "${logs[@]}" | tee "$d/compare.txt"
done
