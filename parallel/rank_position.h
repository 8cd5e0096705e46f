// RankPosition: where one rank sits, its size and index on every axis of Megatron's dense grid
// (tp-cp-ep-dp-pp) and of the experts' grid (MoE). The one struct that holds rank coordinates:
// ParallelState is a RankPosition plus its communicators (parallel/parallel_state.h), ModelDims a
// RankPosition plus the model's shapes on it (engine/model_dims.h), and the dry run plans ranks
// that do not exist from RankPosition::of.
#pragma once

namespace mt {

struct Config;

// Whether the run's experts have a grid of their own (Megatron's parallel folding): MoE with
// --expert-model-parallel-size > 1 or an expert TP size other than TP.
bool experts_own_grid(const Config& cfg);

struct RankPosition {
  int world_size = 1, rank = 0;
  int tp_size = 1, tp_rank = 0;
  int cp_size = 1, cp_rank = 0;
  int dp_size = 1, dp_rank = 0;
  int pp_size = 1, pp_rank = 0;
  int vpp_size = 1;  // model chunks per pipeline rank
  // The experts' grid (MoE; Megatron's "parallel folding"): the experts' tensor-parallel size and
  // rank (TP, or a divisor of it), the expert-parallel group (which experts this rank holds), and
  // the experts' data-parallel group (the replicas of this rank's experts). Without an own expert
  // grid (EP = 1, expert TP = TP) the experts' TP is the dense TP and their DP group the dense
  // replicas (DP x CP).
  int etp_size = 1, etp_rank = 0;
  int ep_size = 1, ep_rank = 0;
  int edp_size = 1, edp_rank = 0;

  // Rank `rank` of the run the Config describes (its derived data-parallel size), in both grids.
  static RankPosition of(const Config& cfg, int rank);
  // The first rank (tp, cp, dp 0) of pipeline stage `pp_rank`: the rank a dry run plans per stage.
  static RankPosition stage(const Config& cfg, int pp_rank);
  // A tensor x pipeline split of the Config's model that need not be the run's (conversions and
  // tests lay out other TP/PP sizes): CP and the experts' sizes from the Config, every other rank 0.
  static RankPosition split(const Config& cfg, int tp_size, int tp_rank, int pp_size = 1, int pp_rank = 0);

  // The ranks holding the same parameters: DP x CP (gradients are reduced, the distributed
  // optimizer sharded and the loss summed over them), in the order dp_rank * CP + cp_rank.
  int replicas_size() const { return dp_size * cp_size; }
  int replicas_rank() const { return dp_rank * cp_size + cp_rank; }
  bool is_first_stage() const { return pp_rank == 0; }
  bool is_last_stage() const { return pp_rank == pp_size - 1; }
};

}  // namespace mt
