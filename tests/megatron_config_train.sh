#!/usr/bin/env bash
# Trains one of Megatron-LM's own configurations at shrunk widths on CPU ranks, as
# bench/megatron_configs.py --train wrote it into the fixture:
#   megatron_config_train.sh FIXTURE NAME MPIEXEC MEGATRAIN SRC SCRATCH
# FIXTURE lines: NAME<TAB>ranks<TAB>megatrain's flags (shell-quoted; @TMP@ a scratch directory,
# @SRC@ the repository). Passes when every rank exits 0 and the log shows the last iteration and
# (unless the flags say --eval-iters 0) the evaluation after it.
set -u
fixture=$1 name=$2 mpiexec=$3 megatrain=$4 src=$5 scratch=$6
line=$(awk -F'\t' -v n="$name" '$1 == n { print; exit }' "$fixture")
if [ -z "$line" ]; then
  echo "FAIL: no configuration named $name in $fixture"
  exit 1
fi
ranks=$(printf '%s' "$line" | cut -f2)
flags=$(printf '%s' "$line" | cut -f3- | sed -e "s|@TMP@|$scratch|g" -e "s|@SRC@|$src|g")
iters=$(printf '%s' "$flags" | sed -n 's/.*--train-iters \([0-9]*\).*/\1/p')
rm -rf "$scratch" && mkdir -p "$scratch"
log="$scratch/train.log"
# Distillation (--export-kd-teacher-load DIR): a teacher of the student's own model first, the same
# command without the distillation flags training one iteration into DIR (as the sweep makes it).
eval "words=($flags)"
teacher=() dir=""
for ((i = 0; i < ${#words[@]}; i++)); do
  case "${words[i]}" in
    --export-kd-teacher-load) dir=${words[i + 1]}; i=$((i + 1)) ;;
    --export-kd-cfg|--export-kd-teacher-model-config|--export-kd-teacher-ckpt-format|--load|--save|--save-interval|\
    --train-iters|--train-samples|--exit-interval) i=$((i + 1)) ;;
    *) teacher+=("${words[i]}") ;;
  esac
done
if [ -n "$dir" ]; then
  timeout -k 5 600 "$mpiexec" -np "$ranks" --oversubscribe "$megatrain" "${teacher[@]}" --train-iters 1 --save "$dir" \
    --save-interval 1 > "$scratch/teacher.log" 2>&1 || { tail -n 20 "$scratch/teacher.log"; echo "FAIL: the teacher's run"; exit 1; }
fi
eval "timeout -k 5 600 \"$mpiexec\" -np $ranks --oversubscribe \"$megatrain\" $flags" > "$log" 2>&1
rc=$?
tail -n 40 "$log"
echo "--- $name: $ranks ranks, exit status $rc"
[ "$rc" -eq 0 ] || exit 1
if [ -n "$iters" ]; then
  grep -Eq "iteration +$iters/ +$iters" "$log" || { echo "FAIL: no log line of iteration $iters"; exit 1; }
else  # (a schedule in samples)
  grep -Eq "iteration +[0-9]+/ +[0-9]+ \|" "$log" || { echo "FAIL: no iteration logged"; exit 1; }
fi
evals=$(printf '%s' "$flags" | grep -o -- '--eval-iters [0-9]*' | tail -n 1 | cut -d' ' -f2)
if [ "${evals:-1}" != 0 ]; then
  grep -q "validation loss at iteration" "$log" || { echo "FAIL: no evaluation after the last iteration"; exit 1; }
fi
