#include "parallel/parallel_state_builder.h"

#include <cstdlib>

#include <algorithm>

#include "core/config.h"
#include "core/error.h"
#include "parallel/distributed_timeout.h"
#include "parallel/mpi_communicator.h"
#include "parallel/nccl_communicator.h"
#include "parallel/rank_grid.h"
#include "parallel/tcp_rendezvous.h"

namespace mt {
namespace {

// Splits `world` into the given groups (a partition of some or all ranks). Ranks outside every
// group get nullptr. The communicator's rank is the rank's position in its group's list.
std::unique_ptr<Communicator> split_into(Communicator& world, const std::vector<std::vector<int>>& groups,
                                         const std::string& name, const GroupOptions& options = {}) {
  const int me = world.rank();
  int color = -1, key = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    auto it = std::find(groups[g].begin(), groups[g].end(), me);
    if (it != groups[g].end()) {
      color = static_cast<int>(g);
      key = static_cast<int>(it - groups[g].begin());
    }
  }
  auto comm = world.split(color, key, name, options);
  if (color >= 0) {
    MT_CHECK(comm && comm->size() == static_cast<int>(groups[color].size()) && comm->rank() == key,
             "group '{}' of rank {}: size {} rank {}, expected size {} rank {}", name, me, comm ? comm->size() : -1,
             comm ? comm->rank() : -1, groups[color].size(), key);
  } else {
    MT_CHECK(!comm, "rank {} is in no '{}' group but got a communicator", me, name);
  }
  return comm;
}

}  // namespace

GroupOptions tp_group_options() {
  // Tensor-parallel collectives sit on the critical path (with sequence parallelism about ten per
  // layer, each 16-64 MiB). NCCL's default CTA count left NVLink bandwidth unused: with 32 CTAs
  // TP=2+SP on gpt-1.3b went from 0.776x to 0.820x of one GPU's TFLOP/s per GPU on 2 H200s
  // (64 CTAs: 0.815x; bench/RESULTS.md).
  GroupOptions o;
  o.ctas = 32;
  return o;
}

ParallelState build_parallel_state(const Config& cfg, std::unique_ptr<Communicator> world) {
  MT_CHECK(world, "no world communicator");
  const RankGrid grid = RankGrid::from_config(cfg);
  if (world->size() != grid.world_size())
    fail("{} processes were started, but --tensor-model-parallel-size {} x --context-parallel-size {} x "
         "--pipeline-model-parallel-size {} x data-parallel size {} = {}",
         world->size(), grid.tp, grid.cp, grid.pp, grid.dp, grid.world_size());
  const int rank = world->rank();
  const RankCoord c = rank_coord(grid, rank);

  ParallelState s;
  static_cast<RankPosition&>(s) = RankPosition::of(cfg, rank);

  s.tp = split_into(*world, rank_groups(grid, "tp"), "tp", tp_group_options());
  s.dp = split_into(*world, rank_groups(grid, "dp"), "dp");
  const auto pp_groups = rank_groups(grid, "pp");
  s.pp = split_into(*world, pp_groups, "pp");
  if (grid.pp > 1) s.pp_grad = split_into(*world, pp_groups, "pp_grad");
  s.embedding = split_into(*world, embedding_groups(grid), "embedding");
  s.model_parallel = split_into(*world, rank_groups(grid, "tp-pp"), "model_parallel");
  if (grid.cp > 1) {
    s.cp = split_into(*world, rank_groups(grid, "cp"), "cp");
    s.dp_cp = split_into(*world, rank_groups(grid, "dp-cp"), "dp_cp");
    MT_CHECK(s.cp->rank() == s.cp_rank && s.dp_cp->rank() == s.replicas_rank(),
             "context-parallel group ranks disagree with the grid coordinates of rank {}", rank);
  }
  // Expert parallelism: the experts' grid (its TP size dividing TP, its CP 1, its pipeline groups
  // the attention's: checked by the parser, so that an EP group lies in one pipeline stage).
  // (The position's experts' coordinates are RankPosition::of's.)
  if (experts_own_grid(cfg)) {
    const RankGrid eg = RankGrid::experts_from_config(cfg);
    MT_CHECK(grid.tp % eg.tp == 0 && (grid.pp == 1 || rank_groups(grid, "pp") == rank_groups(eg, "pp")),
             "expert parallelism needs an expert TP size dividing TP and the attention's pipeline groups");
    const RankCoord ec = rank_coord(eg, rank);
    // (With the dense TP size the experts' EP x expert-DP ranks fold the dense CP x DP ones.)
    MT_CHECK(ec.pp == c.pp && (eg.tp != grid.tp || (ec.tp == c.tp && c.cp + grid.cp * c.dp == ec.ep + eg.ep * ec.dp)),
             "the experts' grid coordinates of rank {} (etp {}, ep {}, edp {}, pp {}) disagree with its dense ones (tp "
             "{}, dp {}, pp {})", rank, ec.tp, ec.ep, ec.dp, ec.pp, c.tp, c.dp, c.pp);
    if (eg.ep > 1) s.ep = split_into(*world, rank_groups(eg, "ep"), "ep");
    if (eg.tp < grid.tp && eg.tp * eg.ep > 1) s.expert_tp_ep = split_into(*world, rank_groups(eg, "tp-ep"), "expert_tp_ep");
    if (eg.tp > 1 && eg.tp < grid.tp) s.etp = split_into(*world, rank_groups(eg, "tp"), "expert_tp");
    s.edp = split_into(*world, rank_groups(eg, "dp"), "expert_dp");
    s.expert_model_parallel = split_into(*world, rank_groups(eg, "tp-ep-pp"), "expert_model_parallel");
  }
  // --num-distributed-optimizer-instances (with the distributed optimizer; checked by the parser).
  const int instances = cfg.parallel.use_distributed_optimizer ? cfg.parallel.num_distributed_optimizer_instances : 1;
  if (instances > 1) {
    MT_CHECK(grid.dp * grid.cp % instances == 0, "data-parallel x context-parallel size {} is not divisible by {} "
             "optimizer instances", grid.dp * grid.cp, instances);
    s.dist_opt_instances = instances;
    s.dist_opt_intra = split_into(*world, distributed_optimizer_instance_groups(grid, instances, false), "dist_opt_intra");
    s.dist_opt_inter = split_into(*world, distributed_optimizer_instance_groups(grid, instances, true), "dist_opt_inter");
    MT_CHECK(s.dist_opt_intra->rank() == s.dist_opt_rank() &&
                 s.dist_opt_inter->rank() == s.replicas_rank() / s.dist_opt_size(),
             "distributed optimizer instance ranks disagree with the DP x CP rank {} of rank {}", s.replicas_rank(), rank);
    if (s.edp) {  // the experts' own grid: its data-parallel groups split into the instances too
      const RankGrid eg = RankGrid::experts_from_config(cfg);
      MT_CHECK(eg.dp % instances == 0, "expert data-parallel size {} is not divisible by {} optimizer instances",
               eg.dp, instances);
      s.edp_intra = split_into(*world, instance_groups(rank_groups(eg, "dp"), instances, false), "expert_dp_intra");
      s.edp_inter = split_into(*world, instance_groups(rank_groups(eg, "dp"), instances, true), "expert_dp_inter");
      MT_CHECK(s.edp_intra->rank() == s.expert_dist_opt_rank() &&
                   s.edp_inter->rank() == s.edp_rank / s.expert_dist_opt_size(),
               "expert optimizer instance ranks disagree with the expert-DP rank {} of rank {}", s.edp_rank, rank);
    }
  }
  // Each group's communicator rank is the rank's coordinate along that axis.
  MT_CHECK(s.tp->rank() == s.tp_rank && s.dp->rank() == s.dp_rank && s.pp->rank() == s.pp_rank,
           "group ranks disagree with the grid coordinates of rank {}", rank);
  s.world = std::move(world);
  return s;
}

std::unique_ptr<Communicator> make_world_communicator(const Config& cfg, int device, CUstream_st* stream) {
  const ParallelConfig& p = cfg.parallel;
  const Millis timeout = distributed_timeout(p.distributed_timeout_minutes);
  if (p.world_size == 1) return make_self_communicator("world");
  if (cfg.train.device == DeviceKind::cpu) {
    if (!launched_by_mpi())
      fail("--device cpu with {} ranks communicates through MPI: start it with `mpirun -np {} megatrain --device "
           "cpu ...`",
           p.world_size, p.world_size);
    auto world = make_mpi_world_communicator(timeout);
    if (world->size() != p.world_size || world->rank() != p.rank)
      fail("MPI says rank {} of {}, the launcher environment says rank {} of {}", world->rank(), world->size(),
           p.rank, p.world_size);
    return world;
  }
  if (p.master_addr.empty())
    fail("no rendezvous address for NCCL: set MASTER_ADDR (and MASTER_PORT) to rank 0's host for every rank "
         "(launch/mpirun.sh does this for Open MPI)");
  TcpRendezvous rendezvous(p.master_addr, p.master_port, p.rank, p.world_size, timeout);
  return make_nccl_world_communicator(rendezvous, device, stream, timeout);
}

}  // namespace mt
