// The --dry-run planner: from a validated Config, without a GPU, what the run would look like:
// the rank layout, the layers of each pipeline stage, parameter counts, FLOPs per iteration and a
// per-GPU memory estimate. Printed as text or (--json) as one JSON object.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "app/cli.h"
#include "core/config.h"
#include "engine/param_count.h"
#include "parallel/pipeline_layout.h"
#include "parallel/rank_grid.h"

namespace mt {

// Bytes per GPU of one pipeline stage (every TP/DP rank of a stage needs the same).
struct StageMemory {
  double weights = 0;                // parameters in the training precision
  double gradients = 0;              // main-gradient buffers
  double optimizer = 0;              // fp32 master weights + optimizer moments, unsharded
  double optimizer_distributed = 0;  // the same sharded over DP (--use-distributed-optimizer)
  double activations_none = 0;       // peak stored activations without recompute
  double activations_selective = 0;  // --recompute-granularity selective (the configured modules)
  double activations_full = 0;       // --recompute-granularity full (configured method, or uniform 1)
  double activations = 0;            // with this run's recompute setting
  double total = 0;                  // weights + gradients + optimizer (as configured) + activations
  int inflight_microbatches = 0;     // micro-batches (interleaved: chunk-micro-batches) held at the peak
};

struct StagePlan {
  int pp_rank = 0;
  std::vector<ModelChunk> chunks;
  int num_layers = 0;
  int64_t params_per_rank = 0;  // one TP shard of this stage
  StageMemory memory;
};

struct Plan {
  RankGrid grid;
  std::vector<ModelChunk> chunks;  // model order
  std::vector<StagePlan> stages;
  ParamCounts params;
  double flops_per_iteration = 0;
  double flops_per_token = 0;
};

Plan make_plan(const Config& cfg);

// Memory of one stage (plan_memory.cpp).
StageMemory estimate_stage_memory(const Config& cfg, const StagePlan& stage, int64_t params_per_rank);

// The resolved configuration: flag -> {value, default, differs} (plan_config.cpp).
nlohmann::json resolved_config(const Config& cfg);
// Derived values (DP size, micro-batches, padded vocabulary, ...).
nlohmann::json derived_values(const Config& cfg);

std::string plan_text(const Config& cfg, const Plan& plan, const std::vector<SetupMessage>& messages);
nlohmann::json plan_json(const Config& cfg, const Plan& plan, const std::vector<SetupMessage>& messages);

// `megatrain ... --dry-run [--json]`: prints the plan on stdout; returns the exit code.
int run_dry_run(const Config& cfg, const std::vector<SetupMessage>& messages);

}  // namespace mt
