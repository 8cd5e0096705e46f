// Builds a ParallelState from the Config: this rank's coordinates in Megatron's rank grid
// (parallel/rank_grid.h) and one communicator per group, each split from the world communicator.
// Works the same over MPI (reference backend) and NCCL (GPUs).
//
// Every rank must call build_parallel_state() (the splits are collective over the world, in a
// fixed order: tp, dp, pp, pp_grad, embedding, model_parallel, then cp and dp_cp when CP > 1).
#pragma once

#include <memory>

#include "parallel/communicator.h"
#include "parallel/parallel_state.h"

struct CUstream_st;  // cudaStream_t

namespace mt {

struct Config;

// world: all cfg.parallel.world_size ranks (its size must match TP x CP x DP x PP).
ParallelState build_parallel_state(const Config& cfg, std::unique_ptr<Communicator> world);

// How tensor-parallel groups run their collectives (the "tp" group, and groups split from it for
// the same traffic, e.g. the model's TP overlap group).
GroupOptions tp_group_options();

// The world communicator for this run:
//  * world size 1: a group of one (no communication library involved);
//  * --device cpu: MPI (the process must have been started by mpirun; otherwise an error says how);
//  * GPUs: NCCL on `device` with operations on `stream`, bootstrapped through the TCP rendezvous at
//    cfg.parallel.master_addr:master_port.
// The timeout is --distributed-timeout-minutes (MEGATRAIN_DISTRIBUTED_TIMEOUT_SECONDS overrides).
std::unique_ptr<Communicator> make_world_communicator(const Config& cfg, int device = 0, CUstream_st* stream = nullptr);

}  // namespace mt
