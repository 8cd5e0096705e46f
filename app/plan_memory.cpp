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
  const RankPosition r = RankPosition::stage(cfg, pp_rank);
  StageMemory m;
  m.plan = plan_rank_memory(cfg, r, precision_dtype(cfg));  // (a distillation teacher's too)
  for (const ChunkSpec& s : model_chunk_specs(cfg, r, precision_dtype(cfg))) m.activation_slots += s.options.num_slots;
  m.total = static_cast<double>(m.plan.total());
  return m;
}

std::vector<StrategyMemory> sharding_strategy_memory(const Config& cfg, int pp_rank) {
  using C = MemoryCategory;
  // The same run under each strategy (Megatron-FSDP's spelling of it).
  auto with = [&](const char* strategy) {
    Config c = cfg;
    ParallelConfig& p = c.parallel;
    p.use_torch_fsdp2 = false;
    p.use_megatron_fsdp = std::string(strategy) != "no_shard";
    p.data_parallel_sharding_strategy = strategy;
    p.use_distributed_optimizer = p.use_megatron_fsdp;
    if (!p.use_distributed_optimizer) p.num_distributed_optimizer_instances = 1;
    return c;
  };
  auto planned = [&](const char* name, const char* zero, const Config& c) {
    StrategyMemory m{name, zero, stage_memory(c, pp_rank).plan};
    m.total = static_cast<double>(m.plan.total());
    return m;
  };
  // (FP8 parameters need a sharded optimizer: no_shard's row plans the weights in the compute dtype.)
  Config ddp = with("no_shard");
  const bool ddp_without_fp8_params = ddp.train.fp8_param_gather;
  ddp.train.fp8_param_gather = false;
  std::vector<StrategyMemory> out{planned("no_shard", "DDP", ddp), planned("optim", "ZeRO-1", with("optim"))};
  out.front().estimate = ddp_without_fp8_params;
  // The stage's parameter elements: in decoder layers (per layer) and outside them.
  const RankPosition r = RankPosition::stage(cfg, pp_rank);
  double in_layers = 0, outside = 0, largest_layer = 0;
  for (const ChunkSpec& s : model_chunk_specs(cfg, r, precision_dtype(cfg))) {
    int64_t total = 0;
    std::map<int, double> layers;
    for (const ParamDesc& p : build_param_descs(s.dims, &total)) {
      if (p.layer >= 0 && p.layer < s.dims.num_layers) layers[p.layer] += static_cast<double>(p.numel());
      else outside += static_cast<double>(p.numel());
    }
    for (const auto& [l, n] : layers) {
      in_layers += n;
      largest_layer = std::max(largest_layer, n);
    }
  }
  const double elements = in_layers + outside;
  if (elements <= 0) return out;
  const Config zero2 = with("optim_grads");
  const int shards = cfg.parallel.data_parallel_size * cfg.parallel.context_parallel_size /
                     std::max(1, zero2.parallel.num_distributed_optimizer_instances);
  // A whole-size category of `base` as the estimates shard it: the layers' part over the ranks,
  // plus two layers' worth of staging, the rest whole.
  auto sharded = [&](const MemoryPlan& base, C c) {
    const double per = static_cast<double>(base.of(c)) / elements;
    return static_cast<size_t>(per * (in_layers / shards + std::min(2 * largest_layer, in_layers) + outside));
  };
  auto estimate = [&](const char* name, const char* zero, MemoryPlan plan, C c) {
    plan.bytes[static_cast<size_t>(c)] = sharded(plan, c);
    StrategyMemory m{name, zero, plan};
    m.total = static_cast<double>(m.plan.total());
    m.estimate = true;
    return m;
  };
  // optim_grads: the engine lays it out where it shards gradients (engine/model_chunks.h).
  out.push_back(unsharded_gradients_reason(zero2) == std::optional<std::string>("")
                    ? planned("optim_grads", "ZeRO-2", zero2)
                    : estimate("optim_grads", "ZeRO-2", out[1].plan, C::gradients));
  const Config zero3 = with("optim_grads_params");
  out.push_back(unsharded_params_reason(zero3) == std::optional<std::string>("")
                    ? planned("optim_grads_params", "ZeRO-3", zero3)
                    : estimate("optim_grads_params", "ZeRO-3", out[2].plan, C::parameters));
  return out;
}

}  // namespace mt
