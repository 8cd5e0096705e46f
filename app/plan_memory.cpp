// Per-GPU memory of one pipeline stage for --dry-run: not a formula of its own but the engine's
// plan. The dry run asks engine/model_chunks.h for the chunks the rank (tp 0, dp 0 of the stage)
// would build and measures their layouts with GptModel::plan_memory (the constructor's layout
// code, measuring only, nothing allocated), so what it prints is what the training run's
// "> memory plan" reports. On an H200 the measured peak (PyTorch-style max allocated) came out
// 0.2 GiB above this plan in bench/RESULTS.md runs: cuBLASLt and attention workspaces and kernel
// images, which the plan does not hold (README.md, "Planning a run").
#include "app/plan.h"
#include "engine/model_chunks.h"

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

}  // namespace mt
