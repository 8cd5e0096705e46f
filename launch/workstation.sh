#!/usr/bin/env bash
# megatrain on one machine, all of its GPUs, no launcher needed.
#
#   launch/workstation.sh --tensor-model-parallel-size 2 --num-layers 24 ... (Megatron flags)
#   NPROC=4 launch/workstation.sh ...          # only 4 workers (= --nproc-per-node 4)
#   CUDA_VISIBLE_DEVICES=2,3 launch/workstation.sh ...   # these two GPUs
#
# A bare `megatrain` with no launcher environment (no RANK/WORLD_SIZE, OMPI_*, PMI_*, SLURM step)
# becomes the parent of one worker process per visible GPU, like `torchrun --nproc-per-node N`:
# workers get RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1 and a free
# MASTER_PORT (or yours, if MASTER_PORT is set), meet at a TCP rendezvous and bootstrap NCCL. If a
# worker dies, the others are stopped and megatrain exits non-zero naming the rank; Ctrl-C stops them
# all. MEGATRAIN_LAUNCHER_GRACE_SECONDS (default 10) is the wait between SIGTERM and SIGKILL.
#
# Environment: MEGATRAIN (the binary; default build/app/megatrain of this checkout), NPROC.
# NCCL_NVLS_ENABLE is left to you: megatrain sets it to 0 when unset (see parallel/nccl_communicator.h).
# The reference backend (--device cpu) runs several ranks only under MPI: use launch/mpirun.sh.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
MEGATRAIN=${MEGATRAIN:-$root/build/app/megatrain}
args=()
if [ -n "${NPROC:-}" ]; then
  args+=(--nproc-per-node "$NPROC")
fi
exec "$MEGATRAIN" "${args[@]}" "$@"
