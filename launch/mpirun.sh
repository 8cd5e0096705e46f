#!/usr/bin/env bash
# megatrain under Open MPI's mpirun: one process per GPU (or per CPU rank with --device cpu).
#
#   NP=8 launch/mpirun.sh --tensor-model-parallel-size 2 ...            # one machine, 8 GPUs
#   NP=16 HOSTS=node1:8,node2:8 launch/mpirun.sh ...                   # two machines
#   NP=4 launch/mpirun.sh --device cpu ...                              # reference backend, 4 ranks
#
# megatrain reads its rank, world size and local rank from Open MPI's OMPI_COMM_WORLD_* variables.
# GPU runs bootstrap NCCL over a TCP rendezvous at MASTER_ADDR:MASTER_PORT, which Open MPI does
# not set: this script passes MASTER_ADDR (the first host of HOSTS, else this host) and MASTER_PORT
# (default 29500) to every rank with -x, along with the NCCL_*, CUDA_* and MEGATRAIN_* variables
# set here. --device cpu runs communicate through MPI itself (MPI_Init happens only then).
# mpirun ends the whole job when a rank exits non-zero.
#
# Environment: NP (required), HOSTS (mpirun -H list, optional), MASTER_ADDR, MASTER_PORT,
# MEGATRAIN (the binary; default build/app/megatrain of this checkout), MPIRUN_ARGS (extra mpirun
# options, e.g. "--oversubscribe" or "--mca btl_tcp_if_include eth0").
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
: "${NP:?set NP to the number of ranks}"
MEGATRAIN=${MEGATRAIN:-$root/build/app/megatrain}
if [ -z "${MASTER_ADDR:-}" ]; then
  if [ -n "${HOSTS:-}" ]; then
    first=${HOSTS%%,*}
    MASTER_ADDR=${first%%:*}
  else
    MASTER_ADDR=$(hostname)
  fi
fi
export MASTER_ADDR
export MASTER_PORT=${MASTER_PORT:-29500}

forward=(-x MASTER_ADDR -x MASTER_PORT)
while IFS='=' read -r name _; do
  case $name in
    PATH | LD_LIBRARY_PATH | NCCL_* | CUDA_* | MEGATRAIN_* | OMP_NUM_THREADS) forward+=(-x "$name") ;;
  esac
done < <(env)

# shellcheck disable=SC2086  # MPIRUN_ARGS is a list of options on purpose
exec mpirun -np "$NP" ${HOSTS:+-H "$HOSTS"} --bind-to none ${MPIRUN_ARGS:-} "${forward[@]}" "$MEGATRAIN" "$@"
