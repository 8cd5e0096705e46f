#include "app/plan.h"

#include <fmt/format.h>

#include <cstdio>

#include "core/error.h"
#include "engine/flops.h"

#if MEGATRAIN_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace mt {

Plan make_plan(const Config& cfg) {
  Plan p;
  p.grid = RankGrid::from_config(cfg);
  const PipelineSplit split = PipelineSplit::from_config(cfg);
  p.chunks = pipeline_chunks(split);
  p.params = count_parameters(cfg.model);
  const int tp = cfg.parallel.tensor_model_parallel_size, pp = cfg.parallel.pipeline_model_parallel_size;
  for (int r = 0; r < pp; ++r) {
    StagePlan s;
    s.pp_rank = r;
    for (const ModelChunk& c : p.chunks)
      if (c.pp_rank == r) {
        s.chunks.push_back(c);
        s.num_layers += c.num_layers;
      }
    s.params_per_rank = stage_parameters_per_rank(cfg.model, s.chunks, tp, pp,
                                                  cfg.model.moe.enabled() ? cfg.parallel.expert_model_parallel_size : 1);
    s.memory = stage_memory(cfg, r);
    p.stages.push_back(std::move(s));
  }
  p.flops_per_iteration = num_floating_point_operations(cfg.model, cfg.train.global_batch);
  p.flops_per_token = flops_per_token(cfg.model);
  p.limit = memory_limit(cfg);
  if (p.limit) longest_sequence(cfg, p);
  return p;
}

// The longest sequence whose plan fits the limit: the plan grows with --seq-length (activations,
// workspaces, the RoPE table), so a binary search over multiples of the layout's step.
void longest_sequence(const Config& cfg, Plan& p) {
  const ParallelConfig& par = cfg.parallel;
  int64_t step = par.context_parallel_size > 1 ? 2 * int64_t{par.context_parallel_size} : 1;
  if (par.sequence_parallel && par.tensor_model_parallel_size > 1) step *= par.tensor_model_parallel_size;
  const bool learned = cfg.model.position_embedding_type == PositionEmbedding::learned_absolute;
  int64_t hi = int64_t{1} << 24;  // 16M tokens per sample: beyond any plan this searches
  if (learned) hi = std::min<int64_t>(hi, cfg.model.max_position_embeddings);
  hi /= step;
  auto fits = [&](int64_t k) {
    Config c = cfg;
    c.model.seq_length = static_cast<int>(k * step);
    if (!learned) c.model.max_position_embeddings = c.model.seq_length;
    for (int r = 0; r < par.pipeline_model_parallel_size; ++r)
      if (stage_memory(c, r).total > p.limit->bytes) return false;
    return true;
  };
  int64_t lo = 0;  // fits (0: nothing yet)
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (fits(mid)) lo = mid;
    else hi = mid - 1;
  }
  p.longest_seq = lo * step;
  p.longest_seq_capped_by_positions =
      learned && lo > 0 && (lo + 1) * step > cfg.model.max_position_embeddings;
}

std::optional<MemoryLimit> memory_limit(const Config& cfg) {
  if (cfg.run.gpu_memory_gib)
    return MemoryLimit{*cfg.run.gpu_memory_gib * 1073741824.0, fmt::format("--gpu-memory-gib {:g}", *cfg.run.gpu_memory_gib)};
#if MEGATRAIN_WITH_CUDA
  int count = 0;
  cudaDeviceProp prop{};
  if (cfg.train.device == DeviceKind::gpu && cudaGetDeviceCount(&count) == cudaSuccess && count > 0 &&
      cudaGetDeviceProperties(&prop, 0) == cudaSuccess)
    return MemoryLimit{static_cast<double>(prop.totalGlobalMem), fmt::format("GPU 0 ({})", prop.name)};
  cudaGetLastError();  // no GPU: not an error for a dry run
#endif
  return std::nullopt;
}

const StagePlan& Plan::peak_stage() const {
  const StagePlan* peak = &stages.front();
  for (const StagePlan& s : stages)
    if (s.memory.total > peak->memory.total) peak = &s;
  return *peak;
}

int Plan::peak_rank() const {
  const int stage = peak_stage().pp_rank;
  for (int r = 0; r < grid.world_size(); ++r)
    if (rank_coord(grid, r).pp == stage) return r;
  return 0;
}

std::string memory_limit_error(const Plan& plan) {
  if (!plan.over_limit()) return "";
  const StagePlan& s = plan.peak_stage();
  constexpr double GiB = 1073741824.0;
  return fmt::format(
      "the plan needs {:.2f} GiB on rank {} (pipeline stage {}, the largest plan), more than the {:.2f} GiB of {}: "
      "add parallelism (--tensor-model-parallel-size, --pipeline-model-parallel-size, --use-distributed-optimizer), "
      "recompute activations (--recompute-granularity selective, or full with --recompute-method and "
      "--recompute-num-layers), or lower --micro-batch-size",
      s.memory.total / GiB, plan.peak_rank(), s.pp_rank, plan.limit->bytes / GiB, plan.limit->source);
}

int run_dry_run(const Config& cfg, const std::vector<SetupMessage>& messages) {
  const Plan plan = make_plan(cfg);
  const std::string out = cfg.run.json ? plan_json(cfg, plan, messages).dump(2) : plan_text(cfg, plan, messages);
  std::fwrite(out.data(), 1, out.size(), stdout);
  std::fputc('\n', stdout);
  std::fflush(stdout);
  const std::string over = memory_limit_error(plan);
  if (!over.empty()) throw Error(over);
  return 0;
}

}  // namespace mt
