// Per-GPU memory of one pipeline stage for --dry-run: not a formula of its own but the engine's
// plan. The dry run asks engine/model_chunks.h for the chunks the rank (tp 0, dp 0 of the stage)
// would build and measures their layouts with GptModel::plan_memory (the constructor's layout
// code, measuring only, nothing allocated), so what it prints is what the training run's
// "> memory plan" reports. On an H200 the measured peak (PyTorch-style max allocated) came out
// 0.2 GiB above this plan in bench/RESULTS.md runs: cuBLASLt and attention workspaces and kernel
// images, which the plan does not hold (README.md, "Planning a run").
#include <algorithm>
#include <map>
#include <tuple>

#include "app/plan.h"
#include "engine/model_chunks.h"
#include "engine/param_layout.h"

namespace mt {

StageMemory stage_memory(const Config& cfg, int pp_rank) {
  RankPosition r;
  r.tp_size = cfg.parallel.tensor_model_parallel_size;
  r.pp_size = cfg.parallel.pipeline_model_parallel_size;
  r.pp_rank = pp_rank;
  r.dp_size = cfg.parallel.data_parallel_size;
  r.cp_size = cfg.parallel.context_parallel_size;
  StageMemory m;
  for (const ChunkSpec& s : model_chunk_specs(cfg, r, precision_dtype(cfg))) {
    m.plan += GptModel::plan_memory(s.dims, s.options);
    m.activation_slots += s.options.num_slots;
  }
  m.total = static_cast<double>(m.plan.total());
  return m;
}

std::vector<StrategyMemory> sharding_strategy_memory(const Config& cfg, int pp_rank) {
  using C = MemoryCategory;
  Config ddp = cfg, zero1 = cfg;
  ddp.parallel.use_distributed_optimizer = false;
  ddp.parallel.num_distributed_optimizer_instances = 1;
  zero1.parallel.use_distributed_optimizer = true;
  std::vector<StrategyMemory> out;
  for (const auto& [name, zero, c] : {std::tuple{"no_shard", "DDP", &ddp}, std::tuple{"optim", "ZeRO-1", &zero1}}) {
    StrategyMemory m{name, zero, stage_memory(*c, pp_rank).plan};
    m.total = static_cast<double>(m.plan.total());
    out.push_back(m);
  }
  // The stage's parameter elements: in decoder layers (per layer) and outside them.
  RankPosition r;
  r.tp_size = cfg.parallel.tensor_model_parallel_size;
  r.pp_size = cfg.parallel.pipeline_model_parallel_size;
  r.pp_rank = pp_rank;
  r.dp_size = cfg.parallel.data_parallel_size;
  r.cp_size = cfg.parallel.context_parallel_size;
  double in_layers = 0, outside = 0, largest_layer = 0;
  for (const ChunkSpec& s : model_chunk_specs(cfg, r, precision_dtype(cfg))) {
    int64_t total = 0;
    std::map<int, double> layers;
    for (const ParamDesc& p : build_param_descs(s.dims, &total)) {
      if (p.layer >= 0) layers[p.layer] += static_cast<double>(p.numel());
      else outside += static_cast<double>(p.numel());
    }
    for (const auto& [l, n] : layers) {
      in_layers += n;
      largest_layer = std::max(largest_layer, n);
    }
  }
  const double elements = in_layers + outside;
  if (elements <= 0) return out;
  const int shards = cfg.parallel.data_parallel_size * cfg.parallel.context_parallel_size /
                     std::max(1, zero1.parallel.num_distributed_optimizer_instances);
  // Bytes per element of the whole-size categories, from ZeRO-1's plan (padding included).
  const MemoryPlan& base = out.back().plan;
  auto sharded = [&](C c) {
    const double per = static_cast<double>(base.of(c)) / elements;
    return static_cast<size_t>(per * (in_layers / shards + std::min(2 * largest_layer, in_layers) + outside));
  };
  for (const auto& [name, zero, params] : {std::tuple{"optim_grads", "ZeRO-2", false},
                                           std::tuple{"optim_grads_params", "ZeRO-3", true}}) {
    StrategyMemory m{name, zero, base};
    m.estimate = true;
    m.plan.bytes[static_cast<size_t>(C::gradients)] = sharded(C::gradients);
    if (params) m.plan.bytes[static_cast<size_t>(C::parameters)] = sharded(C::parameters);
    m.total = static_cast<double>(m.plan.total());
    out.push_back(m);
  }
  return out;
}

}  // namespace mt
