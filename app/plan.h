// The --dry-run planner: from a validated Config, without a GPU, what the run would look like:
// the rank layout, the layers of each pipeline stage, parameter counts, FLOPs per iteration and a
// per-GPU memory estimate. Printed as text or (--json) as one JSON object.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "app/cli.h"
#include "core/config.h"
#include "engine/memory_plan.h"
#include "engine/param_count.h"
#include "parallel/pipeline_layout.h"
#include "parallel/rank_grid.h"

namespace mt {

// Bytes per GPU of one pipeline stage: the engine's own memory plan (engine/model_chunks.h,
// engine/memory_plan.h), measured by the same layout code the training run executes before its
// first step, so the estimate and the run's "> memory plan" are the same numbers by construction.
// Every TP/DP rank of a stage lays out the same sizes (DP shards are padded to equal size).
// Not in it: the CUDA context, cuBLASLt and attention workspaces, NCCL buffers, fragmentation.
struct StageMemory {
  MemoryPlan plan;                // by category, summed over the stage's model chunks
  double total = 0;               // plan.total()
  int activation_slots = 0;       // (chunk-)micro-batches whose activations are held at once, all chunks
};

struct StagePlan {
  int pp_rank = 0;
  std::vector<ModelChunk> chunks;
  int num_layers = 0;
  int64_t params_per_rank = 0;  // one TP shard of this stage
  StageMemory memory;
};

// The per-GPU memory a dry run checks the plan against: --gpu-memory-gib, else the local GPU's
// (a CUDA build with a GPU visible, --device gpu), else none.
struct MemoryLimit {
  double bytes = 0;
  std::string source;  // "--gpu-memory-gib 80", "GPU 0 (NVIDIA H200)"
};
std::optional<MemoryLimit> memory_limit(const Config& cfg);

struct Plan {
  RankGrid grid;
  std::vector<ModelChunk> chunks;  // model order
  std::vector<StagePlan> stages;
  ParamCounts params;
  double flops_per_iteration = 0;
  double flops_per_token = 0;
  std::optional<MemoryLimit> limit;
  // With a limit: the longest --seq-length whose plan fits it on every stage, all else as given
  // (a multiple of what the layout needs: 2 CP, and TP with sequence parallelism); 0 when none
  // fits. capped_by_positions: learned absolute position embeddings stop it at
  // --max-position-embeddings.
  int64_t longest_seq = 0;
  bool longest_seq_capped_by_positions = false;

  const StagePlan& peak_stage() const;  // the stage with the largest per-GPU plan (the first of equals)
  int peak_rank() const;                // the lowest rank of peak_stage()
  bool over_limit() const { return limit && peak_stage().memory.total > limit->bytes; }
};

Plan make_plan(const Config& cfg);
// Fills p.longest_seq* (p.limit set).
void longest_sequence(const Config& cfg, Plan& p);

// Memory of one rank of pipeline stage pp_rank (plan_memory.cpp).
StageMemory stage_memory(const Config& cfg, int pp_rank);

// Per-GPU memory of one pipeline stage under each data-parallel sharding strategy (--use-megatron-
// fsdp's dry-run table): the engine's plans of the run as no_shard (DDP), optim (the distributed
// optimizer), optim_grads and optim_grads_params where engine/model_chunks.h builds their
// gradient and parameter sharding, else estimates: the closer strategy's plan with the decoder
// layers' gradients (or parameters) sharded over the optimizer's ranks plus two whole layers'
// worth (the double-buffered units), the other parameters whole.
struct StrategyMemory {
  std::string strategy, zero;  // "optim_grads", "ZeRO-2"
  MemoryPlan plan;
  double total = 0;
  bool estimate = false;
};
std::vector<StrategyMemory> sharding_strategy_memory(const Config& cfg, int pp_rank);

// The resolved configuration: flag -> {value, default, differs} (plan_config.cpp).
nlohmann::json resolved_config(const Config& cfg);
// Derived values (DP size, micro-batches, padded vocabulary, ...).
nlohmann::json derived_values(const Config& cfg);

std::string plan_text(const Config& cfg, const Plan& plan, const std::vector<SetupMessage>& messages);
nlohmann::json plan_json(const Config& cfg, const Plan& plan, const std::vector<SetupMessage>& messages);

// The error for a plan over its limit: the rank with the largest plan, its GiB, the limit and
// what to change ("" when it fits or there is no limit).
std::string memory_limit_error(const Plan& plan);

// `megatrain ... --dry-run [--json]`: prints the plan on stdout; returns the exit code. Throws
// (after printing the plan) when the plan exceeds the GPU's memory (memory_limit_error).
int run_dry_run(const Config& cfg, const std::vector<SetupMessage>& messages);

}  // namespace mt
