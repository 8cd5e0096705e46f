// Rank grid: Megatron's mapping between a global rank and its (tp, cp, ep, dp, pp) coordinates,
// and the process groups (all ranks that differ only in the named axes). Pure functions of the
// grid; ParallelState builds its communicators from these lists.
//
// Order (fastest-varying axis first) is Megatron's default "tp-cp-ep-dp-pp", or "tp-cp-ep-pp-dp"
// with --use-tp-pp-dp-mapping. For the dense (attention) grid EP is 1, so with the default order
//   rank = tp + TP*(cp + CP*(dp + DP*pp)).
// Group enumeration follows Megatron's RankGenerator / generate_masked_orthogonal_rank_groups:
// groups are listed by the index of the axes NOT in the group (first such axis fastest), and the
// ranks inside a group by the axes in the group (first such axis fastest).
#pragma once

#include <string>
#include <vector>

namespace mt {

struct Config;

enum class GridAxis { tp, cp, ep, dp, pp };

struct RankGrid {
  int tp = 1, cp = 1, ep = 1, dp = 1, pp = 1;
  bool tp_pp_dp_order = false;  // --use-tp-pp-dp-mapping

  static RankGrid from_config(const Config& cfg);  // uses the derived data_parallel_size
  // The experts' grid (MoE): tp = the expert TP size, ep = --expert-model-parallel-size, dp = the
  // expert-data-parallel size world / (ETP x EP x PP), cp = 1; the same order.
  static RankGrid experts_from_config(const Config& cfg);
  int world_size() const { return tp * cp * ep * dp * pp; }
  std::vector<GridAxis> order() const;  // fastest-varying first
  std::string order_string() const;     // "tp-cp-ep-dp-pp" or "tp-cp-ep-pp-dp"
  int size(GridAxis a) const;
};

struct RankCoord {
  int tp = 0, cp = 0, ep = 0, dp = 0, pp = 0;
  int get(GridAxis a) const;
  void set(GridAxis a, int v);
  bool operator==(const RankCoord&) const = default;
};

RankCoord rank_coord(const RankGrid& grid, int rank);
int rank_at(const RankGrid& grid, const RankCoord& coord);

// All groups over the axes named in `axes` ("tp", "dp", "pp", "cp", "tp-pp" (model parallel),
// "dp-cp", "tp-cp", "tp-dp-cp", ...; the order of names inside `axes` does not matter).
std::vector<std::vector<int>> rank_groups(const RankGrid& grid, const std::string& axes);
// The group over `axes` that contains `rank`.
std::vector<int> rank_group_of(const RankGrid& grid, const std::string& axes, int rank);

// Megatron's partial distributed optimizer (--num-distributed-optimizer-instances N): each DP
// group's ranks (in DP order) split into N instances of DP/N consecutive ranks (intra: the
// instances), and the ranks at the same position of every instance (inter: Megatron's second level
// of create_hierarchical_groups with sizes [DP/N, N]).
std::vector<std::vector<int>> distributed_optimizer_instance_groups(const RankGrid& grid, int instances, bool inter);
// The same split of any groups (the experts' data-parallel groups under expert parallelism:
// Megatron's intra- and inter-partial expert data-parallel groups).
std::vector<std::vector<int>> instance_groups(const std::vector<std::vector<int>>& groups, int instances, bool inter);

// Megatron's embedding groups: for each pipeline group, its first and last rank (the ranks
// holding the word embeddings / tied output layer); the pipeline group itself when PP == 1.
std::vector<std::vector<int>> embedding_groups(const RankGrid& grid);
// Position-embedding groups: the first rank of each pipeline group.
std::vector<std::vector<int>> position_embedding_groups(const RankGrid& grid);

const char* axis_name(GridAxis a);

}  // namespace mt
