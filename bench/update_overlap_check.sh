#!/usr/bin/env bash
# The optimizer's update beside the next forward (engine/optimizer.h: update overlap) on one GPU:
# the same training with the update in order (MEGATRAIN_OVERLAP_UPDATE=0), beside the forward
# (the default), and beside it with GEMMs leaving 16 SMs to it (MEGATRAIN_UPDATE_SM_MARGIN=16), for
# GPT and Llama in bf16 (two micro-batches per step, 20 iterations, --deterministic-mode: the
# attention backward that repeats bit for bit). Every iteration's lm loss and grad norm must be
# equal bit for bit: a forward that read a weight before its update finished, or a backward that
# wrote a gradient the update still read, would change them.
#   bench/update_overlap_check.sh <dir with megatrain>
# EXTRA="<flags>" adds flags to every run (e.g. FP8).
set -u
cd "$(dirname "$0")/.."
bin=${1:?directory with megatrain}/megatrain
out=${OUT:-/tmp}/update-overlap-$$
mkdir -p "$out"
common="--device gpu --bf16 --mock-data --tokenizer-type NullTokenizer --vocab-size 50304 --seq-length 1024
  --max-position-embeddings 1024 --micro-batch-size 4 --global-batch-size 8 --train-iters 20 --lr 3e-4
  --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 5 --clip-grad 1.0 --attention-dropout 0.1
  --hidden-dropout 0.1 --log-interval 1 --eval-iters 0 --split 100,0,0 --seed 1234 --deterministic-mode ${EXTRA:-}"
gpt="--num-layers 6 --hidden-size 768 --num-attention-heads 12"
llama="--num-layers 6 --hidden-size 1024 --num-attention-heads 16 --group-query-attention --num-query-groups 4
  --ffn-hidden-size 2816 --swiglu --normalization RMSNorm --position-embedding-type rope
  --untie-embeddings-and-output-weights --disable-bias-linear"

run() {  # name, env assignment, flags...
  local name=$1 env=$2
  shift 2
  # shellcheck disable=SC2086
  env $env timeout 120 "$bin" $common "$@" --metrics-jsonl "$out/$name.jsonl" > "$out/$name.log" 2>&1 ||
    { echo "FAILED: $name (exit $?)"; tail -n 4 "$out/$name.log"; }
}

for model in gpt llama; do
  flags="${!model}"
  run ${model}_in_order MEGATRAIN_OVERLAP_UPDATE=0 $flags
  run ${model}_beside MEGATRAIN_OVERLAP_UPDATE=1 $flags
  run ${model}_beside_margin16 "MEGATRAIN_OVERLAP_UPDATE=1 MEGATRAIN_UPDATE_SM_MARGIN=16" $flags
done

python3 - "$out" <<'PY'
import json, os, sys
out = sys.argv[1]
def rows(name):
    p = os.path.join(out, name + ".jsonl")
    if not os.path.exists(p):
        return {}
    return {r["iteration"]: (r.get("lm_loss"), r.get("grad_norm")) for r in map(json.loads, open(p))
            if r.get("type") == "iteration"}
ok = True
for model in ("gpt", "llama"):
    base = rows(f"{model}_in_order")
    for kind in ("beside", "beside_margin16"):
        other = rows(f"{model}_{kind}")
        same = [i for i in range(1, 21) if i in base and i in other and base[i] == other[i]]
        verdict = "PASS" if len(same) == 20 else "FAIL"
        ok &= verdict == "PASS"
        print(f"{model} {kind}: iterations 1..20 equal to the in-order update bit for bit: {len(same)}/20  {verdict}")
        if verdict == "FAIL":
            for i in range(1, 21):
                print(f"   {i:3d}  in order {base.get(i)}  {kind} {other.get(i)}")
print("UPDATE OVERLAP", "PASS" if ok else "FAIL")
PY
