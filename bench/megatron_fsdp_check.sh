#!/usr/bin/env bash
# Megatron-FSDP -> megatrain -> Megatron-FSDP, on the CPU (manual: needs PyTorch and a Megatron-LM
# checkout; nothing of Megatron-LM is in this repository).
#   bench/megatron_fsdp_check.sh MEGATRON_DIR MEGATRAIN_BIN OUT_DIR [PYTHON]
# For each checkpoint Megatron-LM's Megatron-FSDP saved after iteration 2 of 4
# (tests/fixtures/megatron/fsdp: make_fsdp_fixtures.sh, float32, ZeRO-3; one process, and two at
# tensor parallel 2 for llama_tp2, whose export is written for TP 2):
# import-megatron reads it, export-megatron --ckpt-format fsdp_dtensor writes it back, and
# Megatron-LM's pretrain_gpt.py (bench/megatron_cpu.py, --use-megatron-fsdp) resumes the export for
# iterations 3 and 4 (--no-load-rng: on the CPU Megatron-LM cannot take the GPU generator states the
# export holds). Its printed losses and gradient norms must be those of its own straight run (the
# fixture's log; a resumed Megatron-LM prints at iteration 4 the mean of 3 and 4): Megatron-FSDP's
# weights, Adam moments and step, scheduler and consumed samples went through megatrain unchanged.
set -euo pipefail -f
[ $# -ge 3 ] || { echo "usage: megatron_fsdp_check.sh MEGATRON_DIR MEGATRAIN_BIN OUT_DIR [PYTHON]" >&2; exit 2; }
M=$(cd "$1" && pwd)
BIN=$(realpath "$2")
OUT=$(mkdir -p "$3" && cd "$3" && pwd)
PY=${4:-python3}
HERE=$(cd "$(dirname "$0")" && pwd)
FIX=$HERE/../tests/fixtures/megatron/fsdp
# the flags of make_fsdp_fixtures.sh
source "$FIX/../cpu_models.sh"
common="$cpu_common $cpu_fsdp"
fields() { grep "iteration .*lm loss" "$1" | sed -E 's/.*iteration +([0-9]+).*lm loss: ([^ ]+).*grad norm: ([^ ]+).*/\1 \2 \3/'; }
status=0
for name in llama moe llama_tp2; do
  tp=1
  case $name in
    llama) flags="--num-layers 2 $cpu_llama" ;;
    moe) flags=$cpu_moe ;;
    llama_tp2) tp=2; flags="--num-layers 2 $cpu_llama --tensor-model-parallel-size 2 --sequence-parallel" ;;
  esac
  rm -rf "$OUT/$name"
  "$BIN" import-megatron --load "$FIX/$name" --save "$OUT/$name/imported" > "$OUT/$name.import.log"
  "$BIN" export-megatron --load "$OUT/$name/imported" --save "$OUT/$name/fsdp" --ckpt-format fsdp_dtensor \
    --tensor-model-parallel-size $tp > "$OUT/$name.export.log"
  (cd "$M" && CUDA_DEVICE_MAX_CONNECTIONS=8 PYTHONPATH="$M" "$PY" -m torch.distributed.run --nproc_per_node $tp \
     --master_port 29877 "$HERE/megatron_cpu.py" "$M" $common $flags --load "$OUT/$name/fsdp" --no-load-rng) \
     > "$OUT/$name.megatron.log" 2>&1 || { tail -20 "$OUT/$name.megatron.log"; exit 1; }
  got=$(fields "$OUT/$name.megatron.log" | tr '\n' ' ')
  want=$(fields "$FIX/${name}_iterations.log" | sed -n 3,4p | tr '\n' ' ')
  # (iteration 4: the mean of the straight run's 3 and 4, from their 7 printed digits: within 1e-6)
  if "$PY" - "$got" "$want" <<'PYEOF'
import sys
g, w = [list(map(float, a.split())) for a in sys.argv[1:3]]
ok = len(g) == 6 and g[0] == 3 and g[3] == 4 and g[1] == w[1] and g[2] == w[2] and g[5] == w[5] and \
    abs(g[4] - (w[1] + w[4]) / 2) <= 1e-6 * abs(g[4])
sys.exit(0 if ok else 1)
PYEOF
  then echo "$name: Megatron-FSDP resumed megatrain's export: $got"; else
    echo "$name: DIFFERENT: got [$got], the straight run [$want]"; status=1; fi
done
exit $status
