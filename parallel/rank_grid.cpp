#include "parallel/rank_grid.h"

#include <algorithm>

#include "core/config.h"
#include "core/error.h"

namespace mt {

const char* axis_name(GridAxis a) {
  switch (a) {
    case GridAxis::tp: return "tp";
    case GridAxis::cp: return "cp";
    case GridAxis::ep: return "ep";
    case GridAxis::dp: return "dp";
    case GridAxis::pp: return "pp";
  }
  return "?";
}

RankGrid RankGrid::from_config(const Config& cfg) {
  RankGrid g;
  g.tp = cfg.parallel.tensor_model_parallel_size;
  g.cp = cfg.parallel.context_parallel_size;
  g.pp = cfg.parallel.pipeline_model_parallel_size;
  g.dp = cfg.parallel.data_parallel_size;
  g.tp_pp_dp_order = cfg.parallel.use_tp_pp_dp_mapping;
  return g;
}

RankGrid RankGrid::experts_from_config(const Config& cfg) {
  const ParallelConfig& p = cfg.parallel;
  RankGrid g;
  g.tp = p.expert_tensor_parallel_size.value_or(p.tensor_model_parallel_size);
  g.ep = p.expert_model_parallel_size;
  g.pp = p.pipeline_model_parallel_size;
  const int64_t model = int64_t{g.tp} * g.ep * g.pp;
  MT_CHECK(model > 0 && p.world_size % model == 0, "world size {} is not divisible by ETP x EP x PP = {}",
           p.world_size, model);
  g.dp = static_cast<int>(p.world_size / model);
  g.tp_pp_dp_order = p.use_tp_pp_dp_mapping;
  return g;
}

std::vector<GridAxis> RankGrid::order() const {
  if (tp_pp_dp_order) return {GridAxis::tp, GridAxis::cp, GridAxis::ep, GridAxis::pp, GridAxis::dp};
  return {GridAxis::tp, GridAxis::cp, GridAxis::ep, GridAxis::dp, GridAxis::pp};
}

std::string RankGrid::order_string() const {
  std::string s;
  for (GridAxis a : order()) {
    if (!s.empty()) s += "-";
    s += axis_name(a);
  }
  return s;
}

int RankGrid::size(GridAxis a) const {
  switch (a) {
    case GridAxis::tp: return tp;
    case GridAxis::cp: return cp;
    case GridAxis::ep: return ep;
    case GridAxis::dp: return dp;
    case GridAxis::pp: return pp;
  }
  return 1;
}

int RankCoord::get(GridAxis a) const {
  switch (a) {
    case GridAxis::tp: return tp;
    case GridAxis::cp: return cp;
    case GridAxis::ep: return ep;
    case GridAxis::dp: return dp;
    case GridAxis::pp: return pp;
  }
  return 0;
}

void RankCoord::set(GridAxis a, int v) {
  switch (a) {
    case GridAxis::tp: tp = v; break;
    case GridAxis::cp: cp = v; break;
    case GridAxis::ep: ep = v; break;
    case GridAxis::dp: dp = v; break;
    case GridAxis::pp: pp = v; break;
  }
}

RankCoord rank_coord(const RankGrid& grid, int rank) {
  MT_CHECK(rank >= 0 && rank < grid.world_size(), "rank {} outside world of {}", rank, grid.world_size());
  RankCoord c;
  int rest = rank;
  for (GridAxis a : grid.order()) {
    c.set(a, rest % grid.size(a));
    rest /= grid.size(a);
  }
  return c;
}

int rank_at(const RankGrid& grid, const RankCoord& coord) {
  int rank = 0, stride = 1;
  for (GridAxis a : grid.order()) {
    MT_CHECK(coord.get(a) >= 0 && coord.get(a) < grid.size(a), "{} coordinate {} outside size {}",
             axis_name(a), coord.get(a), grid.size(a));
    rank += coord.get(a) * stride;
    stride *= grid.size(a);
  }
  return rank;
}

namespace {

std::vector<bool> axes_mask(const RankGrid& grid, const std::string& axes) {
  const std::vector<GridAxis> order = grid.order();
  std::vector<bool> mask(order.size(), false);
  size_t start = 0;
  while (start <= axes.size()) {
    size_t end = axes.find('-', start);
    if (end == std::string::npos) end = axes.size();
    const std::string name = axes.substr(start, end - start);
    bool found = false;
    for (size_t i = 0; i < order.size(); ++i) {
      if (name == axis_name(order[i])) {
        mask[i] = true;
        found = true;
      }
    }
    MT_CHECK(found, "unknown rank-grid axis '{}' in '{}'", name, axes);
    start = end + 1;
  }
  return mask;
}

}  // namespace

std::vector<std::vector<int>> rank_groups(const RankGrid& grid, const std::string& axes) {
  const std::vector<GridAxis> order = grid.order();
  const std::vector<bool> mask = axes_mask(grid, axes);
  std::vector<int> in_shape, in_stride, out_shape, out_stride;
  int stride = 1;
  for (size_t i = 0; i < order.size(); ++i) {
    const int s = grid.size(order[i]);
    (mask[i] ? in_shape : out_shape).push_back(s);
    (mask[i] ? in_stride : out_stride).push_back(stride);
    stride *= s;
  }
  auto product = [](const std::vector<int>& v) {
    int p = 1;
    for (int x : v) p *= x;
    return p;
  };
  // Decomposes index over shape (first entry fastest) and dots the digits with strides.
  auto place = [](int index, const std::vector<int>& shape, const std::vector<int>& strides) {
    int r = 0;
    for (size_t i = 0; i < shape.size(); ++i) {
      r += (index % shape[i]) * strides[i];
      index /= shape[i];
    }
    return r;
  };
  const int group_size = product(in_shape);
  const int num_groups = product(out_shape);
  std::vector<std::vector<int>> groups(num_groups);
  for (int g = 0; g < num_groups; ++g) {
    const int base = place(g, out_shape, out_stride);
    groups[g].reserve(group_size);
    for (int k = 0; k < group_size; ++k) groups[g].push_back(base + place(k, in_shape, in_stride));
  }
  return groups;
}

std::vector<std::vector<int>> distributed_optimizer_instance_groups(const RankGrid& grid, int instances, bool inter) {
  // Over the replicas (DP x CP, rank cp + CP dp).
  return instance_groups(rank_groups(grid, "dp-cp"), instances, inter);
}

std::vector<std::vector<int>> instance_groups(const std::vector<std::vector<int>>& groups, int instances, bool inter) {
  // Consecutive members of each group form an instance.
  const int size = groups.empty() ? 0 : static_cast<int>(groups.front().size());
  MT_CHECK(instances >= 1 && size % instances == 0, "{} distributed optimizer instances over groups of {}",
           instances, size);
  const int intra = size / instances;
  std::vector<std::vector<int>> out;
  for (const std::vector<int>& dp : groups) {
    if (inter) {
      for (int j = 0; j < intra; ++j) {
        std::vector<int> g;
        for (int i = 0; i < instances; ++i) g.push_back(dp[static_cast<size_t>(i * intra + j)]);
        out.push_back(std::move(g));
      }
    } else {
      for (int i = 0; i < instances; ++i)
        out.emplace_back(dp.begin() + i * intra, dp.begin() + (i + 1) * intra);
    }
  }
  return out;
}

std::vector<int> rank_group_of(const RankGrid& grid, const std::string& axes, int rank) {
  for (auto& g : rank_groups(grid, axes))
    if (std::find(g.begin(), g.end(), rank) != g.end()) return g;
  MT_CHECK(false, "rank {} is in no '{}' group", rank, axes);
  return {};
}

std::vector<std::vector<int>> embedding_groups(const RankGrid& grid) {
  std::vector<std::vector<int>> out;
  for (auto& g : rank_groups(grid, "pp")) {
    if (g.size() > 1)
      out.push_back({g.front(), g.back()});
    else
      out.push_back(g);
  }
  return out;
}

std::vector<std::vector<int>> position_embedding_groups(const RankGrid& grid) {
  std::vector<std::vector<int>> out;
  for (auto& g : rank_groups(grid, "pp")) out.push_back({g.front()});
  return out;
}

}  // namespace mt
