// ParallelState: who am I and who are my peers. This rank's coordinates in Megatron's rank grid
// (order tp-cp-ep-dp-pp by default, tp-cp-ep-pp-dp with --use-tp-pp-dp-mapping) and one
// communicator per group. The single source of truth for rank math, as Megatron-Core's
// parallel_state is.
#pragma once

#include <memory>
#include <vector>

#include "parallel/communicator.h"

namespace mt {

struct Config;

struct ParallelState {
  int world_size = 1, rank = 0;
  int tp_size = 1, tp_rank = 0;
  int cp_size = 1, cp_rank = 0;
  int dp_size = 1, dp_rank = 0;
  int pp_size = 1, pp_rank = 0;
  int vpp_size = 1;  // model chunks per pipeline rank

  std::unique_ptr<Communicator> world;
  std::unique_ptr<Communicator> tp;         // ranks differing only in tp
  std::unique_ptr<Communicator> dp;         // ranks differing only in dp
  std::unique_ptr<Communicator> pp;         // ranks differing only in pp
  std::unique_ptr<Communicator> embedding;  // first and last stage of this rank's pipeline (tied embeddings)
  std::unique_ptr<Communicator> model_parallel;  // tp x pp

  bool is_first_stage() const { return pp_rank == 0; }
  bool is_last_stage() const { return pp_rank == pp_size - 1; }
};

// One process, no communication: every group is a group of one.
ParallelState make_single_process_state();

}  // namespace mt
