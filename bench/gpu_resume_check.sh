#!/usr/bin/env bash
# Bit-exact resume on one GPU (issue "Checkpoints"): for GPT and Llama in bf16 with dropout,
#   straight: 20 iterations;
#   split:    10 iterations, save, exit (--exit-interval 10); a new process loads and runs 11..20;
# and the per-iteration lm loss and grad norm of iterations 11..20 must be equal bit for bit (the
# metrics JSONL keeps full double precision; lm_loss at iteration 12 follows the log interval's
# first-line rule, see below). Runs with --deterministic-mode (the attention
# backward that repeats bit for bit); one pair with --async-save. Also reports, without judging it,
# whether two straight runs WITHOUT --deterministic-mode repeat (cuDNN's default attention backward
# adds into dQ by atomics in arrival order).
#   bench/gpu_resume_check.sh <dir with megatrain>
# EXTRA="<flags>" adds flags to every run (e.g. FP8 with --fp8-param-gather). MODELS="gpt llama moe"
# picks the models (default "gpt llama"; moe: the llama model with a dense first layer and five MoE
# layers of 8 experts, top-2, grouped GEMMs, aux loss 1e-2).
set -u
cd "$(dirname "$0")/.."
bin=${1:?directory with megatrain}/megatrain
out=${OUT:-/tmp}/gpu-resume-$$
mkdir -p "$out"
common="--device gpu --bf16 --mock-data --tokenizer-type NullTokenizer --vocab-size 50304 --seq-length 1024
  --max-position-embeddings 1024 --micro-batch-size 4 --global-batch-size 8 --train-iters 20 --lr 3e-4
  --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 5 --clip-grad 1.0 --attention-dropout 0.1
  --hidden-dropout 0.1 --log-interval 1 --eval-iters 0 --split 100,0,0 --seed 1234 ${EXTRA:-}"
gpt="--num-layers 6 --hidden-size 768 --num-attention-heads 12"
llama="--num-layers 6 --hidden-size 1024 --num-attention-heads 16 --group-query-attention --num-query-groups 4
  --ffn-hidden-size 2816 --swiglu --normalization RMSNorm --position-embedding-type rope
  --untie-embeddings-and-output-weights --disable-bias-linear"
moe="$llama --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 1408 --moe-layer-freq [0,1,1,1,1,1]
  --moe-grouped-gemm --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2"
models=${MODELS:-gpt llama}

run() {  # name, flags...
  local name=$1
  shift
  # shellcheck disable=SC2086
  timeout 120 "$bin" $common "$@" --metrics-jsonl "$out/$name.jsonl" > "$out/$name.log" 2>&1 ||
    { echo "FAILED: $name (exit $?)"; tail -n 4 "$out/$name.log"; }
}

for model in $models; do
  flags="${!model}"
  rm -rf "$out/ckpt_$model" "$out/ckpt_${model}_async"
  # shellcheck disable=SC2086
  run ${model}_straight $flags --deterministic-mode
  run ${model}_first $flags --deterministic-mode --save "$out/ckpt_$model" --save-interval 10 --exit-interval 10
  run ${model}_second $flags --deterministic-mode --load "$out/ckpt_$model"
  run ${model}_first_async $flags --deterministic-mode --save "$out/ckpt_${model}_async" --save-interval 10 \
    --exit-interval 10 --async-save
  run ${model}_second_async $flags --deterministic-mode --load "$out/ckpt_${model}_async"
  run ${model}_nondet_a $flags
  run ${model}_nondet_b $flags
done

python3 - "$out" $models <<'EOF'
import json, os, sys
out = sys.argv[1]
def rows(name):
    p = os.path.join(out, name + ".jsonl")
    if not os.path.exists(p):
        return {}
    return {r["iteration"]: (r.get("lm_loss"), r.get("grad_norm")) for r in map(json.loads, open(p))
            if r.get("type") == "iteration"}
ok = True
for model in sys.argv[2:]:
    straight = rows(f"{model}_straight")
    for kind in ("", "_async"):
        second = rows(f"{model}_second{kind}")
        its = list(range(11, 21))
        # Iteration 12: the log line (and so lm_loss) averages over its interval, and a run's first
        # line (11 after the resume) does not reset it (Megatron HEAD's rule): resumed 12 must be
        # exactly (straight 11 + straight 12) / 2; the gradient norm is the iteration's own.
        def equal(i):
            if i not in straight or i not in second:
                return False
            if i != 12:
                return straight[i] == second[i]
            return (second[i][0] == (straight[11][0] + straight[12][0]) / 2 and second[i][1] == straight[i][1])
        same = [i for i in its if equal(i)]
        verdict = "PASS" if len(same) == 10 else "FAIL"
        ok &= verdict == "PASS"
        print(f"{model}{kind or ' (sync save)'}: iterations 11..20 equal bit for bit: {len(same)}/10  {verdict}")
        for i in its:
            a, b = straight.get(i), second.get(i)
            print(f"   {i:3d}  straight {a}  resumed {b}")
    a, b = rows(f"{model}_nondet_a"), rows(f"{model}_nondet_b")
    n = sum(1 for i in a if i in b and a[i] == b[i])
    print(f"{model} without --deterministic-mode: two straight runs equal at {n}/{len(a)} iterations (information)")
print("RESUME", "PASS" if ok else "FAIL")
EOF
# The checkpoints (several GB with the optimizer states) are only the test's intermediates.
rm -rf "$out"/ckpt_*
