// ParallelState: who am I and who are my peers. This rank's position in Megatron's rank grid
// (RankPosition: order tp-cp-ep-dp-pp by default, tp-cp-ep-pp-dp with --use-tp-pp-dp-mapping) and
// one communicator per group. The single source of truth for rank math, as Megatron-Core's
// parallel_state is.
#pragma once

#include <memory>
#include <vector>

#include "parallel/communicator.h"
#include "parallel/rank_position.h"

namespace mt {

struct Config;

struct ParallelState : RankPosition {
  // Built by build_parallel_state() (parallel/parallel_state_builder.h) from Megatron's rank grid.
  std::unique_ptr<Communicator> world;
  std::unique_ptr<Communicator> tp;         // ranks differing only in tp
  std::unique_ptr<Communicator> dp;         // ranks differing only in dp
  std::unique_ptr<Communicator> pp;         // ranks differing only in pp; pipeline activations travel here
  // The same ranks as pp, a separate communicator: pipeline gradients travel here, so activations
  // and gradients between two stages never pair up wrongly (parallel/schedules.h). Null when PP = 1.
  std::unique_ptr<Communicator> pp_grad;
  // First and last stage of this rank's pipeline (tied word embeddings; with PP = 1 the rank alone).
  // Null on the middle stages, which are in no embedding group.
  std::unique_ptr<Communicator> embedding;
  std::unique_ptr<Communicator> model_parallel;  // tp x pp
  // Context parallelism (null when CP = 1): ranks differing only in cp, and in dp or cp (Megatron
  // reduces gradients over dp x cp).
  std::unique_ptr<Communicator> cp;
  std::unique_ptr<Communicator> dp_cp;
  // Expert parallelism (MoE, --expert-model-parallel-size EP > 1): the experts' grid is TP x EP x
  // expert-DP x PP in Megatron's order (its "parallel folding" with the expert TP size equal to TP
  // and CP = 1: EP spans consecutive DP ranks, dp_rank = ep_rank + EP * edp_rank). ep: the ranks
  // holding the other experts of the layers this rank's tokens pass through (tokens are dispatched
  // over it); edp: the replicas of this rank's experts (their gradients are reduced, and with the
  // distributed optimizer sharded, over it); expert_model_parallel: tp x ep x pp (the experts'
  // share of the gradient norm). Null when the experts share the dense grid (EP = 1, expert TP =
  // TP), where the experts' data-parallel group is dp.
  // With an expert TP size of 1 under TP > 1 the EP group spans TP ranks (etp_size 1).
  std::unique_ptr<Communicator> ep, edp, expert_model_parallel;
  // With an expert TP size below TP: the experts' tp x ep group (the rows its members dispatch are
  // gathered over it); null when of one rank.
  std::unique_ptr<Communicator> expert_tp_ep;
  // With an expert TP size between 1 and TP: the ranks holding shards of the same experts (the FP8
  // experts' amaxes are maxed over it); null otherwise (expert TP = TP: the tp group; 1: none).
  std::unique_ptr<Communicator> etp;
  Communicator& expert_dp() const { return edp ? *edp : replicas(); }

  // --num-distributed-optimizer-instances N > 1 (Megatron's partial distributed optimizer): the DP
  // group split into N instances of DP/N consecutive DP ranks. dist_opt_intra: this rank's
  // instance (the distributed optimizer shards over it); dist_opt_inter: the ranks at the same
  // position of every instance (the reduced shards are all-reduced over it). Null when N = 1.
  int dist_opt_instances = 1;
  std::unique_ptr<Communicator> dist_opt_intra;
  std::unique_ptr<Communicator> dist_opt_inter;
  // The group the distributed optimizer shards over: the instance, or the whole DP group.
  // (With CP > 1, one instance over the replicas: DP x CP.)
  Communicator& dist_opt_group() const { return dist_opt_intra ? *dist_opt_intra : replicas(); }
  // The experts' own grid (edp) with N > 1 instances: its data-parallel groups split alike (Megatron's
  // intra- and inter-partial expert data-parallel groups); the routed experts' optimizer state is
  // sharded over edp_intra. Null otherwise.
  std::unique_ptr<Communicator> edp_intra, edp_inter;
  Communicator& expert_dist_opt_group() const { return edp_intra ? *edp_intra : expert_dp(); }
  int expert_dist_opt_size() const { return edp_size / (edp_intra ? dist_opt_instances : 1); }
  int expert_dist_opt_rank() const { return edp_rank % expert_dist_opt_size(); }
  int dist_opt_size() const { return replicas_size() / dist_opt_instances; }
  int dist_opt_rank() const { return replicas_rank() % dist_opt_size(); }

  // The ranks holding the same parameters (RankPosition::replicas_rank): DP x CP; the DP group
  // when CP = 1.
  Communicator& replicas() const { return dp_cp ? *dp_cp : *dp; }
};

// One process, no communication: every group is a group of one.
ParallelState make_single_process_state();

}  // namespace mt
