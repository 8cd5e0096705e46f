#include "parallel/rank_position.h"

#include <algorithm>

#include "core/config.h"
#include "core/error.h"
#include "parallel/rank_grid.h"

namespace mt {

bool experts_own_grid(const Config& cfg) {
  const ParallelConfig& p = cfg.parallel;
  return cfg.model.moe.enabled() && (p.expert_model_parallel_size > 1 ||
                                     p.expert_tensor_parallel_size.value_or(p.tensor_model_parallel_size) !=
                                         p.tensor_model_parallel_size);
}

namespace {

// The experts' coordinates of a rank that shares the dense grid's: its TP, the replicas as its DP.
void experts_on_dense_grid(RankPosition& r) {
  r.etp_size = r.tp_size;
  r.etp_rank = r.tp_rank;
  r.ep_size = 1;
  r.ep_rank = 0;
  r.edp_size = r.replicas_size();
  r.edp_rank = r.replicas_rank();
}

}  // namespace

RankPosition RankPosition::of(const Config& cfg, int rank) {
  const RankGrid grid = RankGrid::from_config(cfg);
  MT_CHECK(rank >= 0 && rank < grid.world_size(), "rank {} of a grid of {}", rank, grid.world_size());
  const RankCoord c = rank_coord(grid, rank);
  RankPosition r;
  r.world_size = grid.world_size();
  r.rank = rank;
  r.tp_size = grid.tp;
  r.tp_rank = c.tp;
  r.cp_size = grid.cp;
  r.cp_rank = c.cp;
  r.dp_size = grid.dp;
  r.dp_rank = c.dp;
  r.pp_size = grid.pp;
  r.pp_rank = c.pp;
  r.vpp_size = std::max(1, cfg.parallel.virtual_pipeline_size);
  experts_on_dense_grid(r);
  if (experts_own_grid(cfg)) {
    const RankGrid eg = RankGrid::experts_from_config(cfg);
    const RankCoord e = rank_coord(eg, rank);
    r.etp_size = eg.tp;
    r.etp_rank = e.tp;
    r.ep_size = eg.ep;
    r.ep_rank = e.ep;
    r.edp_size = eg.dp;
    r.edp_rank = e.dp;
  }
  return r;
}

RankPosition RankPosition::stage(const Config& cfg, int pp_rank) {
  RankCoord c;
  c.pp = pp_rank;
  return of(cfg, rank_at(RankGrid::from_config(cfg), c));
}

RankPosition RankPosition::split(const Config& cfg, int tp_size, int tp_rank, int pp_size, int pp_rank) {
  RankPosition r;
  r.tp_size = tp_size;
  r.tp_rank = tp_rank;
  r.pp_size = pp_size;
  r.pp_rank = pp_rank;
  r.cp_size = cfg.parallel.context_parallel_size;
  r.world_size = tp_size * r.cp_size * pp_size;
  r.rank = tp_rank + tp_size * r.cp_size * pp_rank;
  experts_on_dense_grid(r);
  if (cfg.model.moe.enabled()) {  // (the experts' TP size as the Config gives it; ranks 0 off the dense TP)
    r.ep_size = cfg.parallel.expert_model_parallel_size;
    r.etp_size = cfg.parallel.expert_tensor_parallel_size.value_or(tp_size);
    r.etp_rank = r.etp_size == tp_size ? tp_rank : 0;
  }
  return r;
}

}  // namespace mt
