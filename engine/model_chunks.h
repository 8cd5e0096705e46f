// This rank's model chunks: the pipeline stage's layers (one chunk, or V with an interleaved
// pipeline; parallel/pipeline_layout.h decides which layers, uneven first/last stages included),
// each a GptModel with the TP shard of its parameters, the DP bucket layout of its buffers and the
// activation slots the pipeline schedule needs (engine/pipeline_runner.h), initialized.
//
// The same specification (model_chunk_specs) also plans a rank that does not exist here: the dry
// run (--dry-run) measures each chunk's memory plan with the layout code the constructor runs, so
// the estimate and the training run's plan are one computation.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/config.h"
#include "engine/gpt_model.h"
#include "engine/memory_plan.h"

namespace mt {

struct ParallelState;

// What build_model_chunks constructs for one chunk.
struct ChunkSpec {
  ModelDims dims;
  ModelOptions options;
};

// The chunks of the rank at `r`, in chunk order, as build_model_chunks builds them.
std::vector<ChunkSpec> model_chunk_specs(const Config& cfg, const RankPosition& r, DType compute);

// Knowledge distillation (--export-kd-teacher-load): the teacher's configuration (the student's
// layout and precision with the teacher's model, no checkpoint flags) and its chunk on the rank at
// `r` (ModelOptions::frozen: forward only, one slot, each layer recomputed alone so that only one
// layer's activations exist at once, the head's output layer in chunks the student's head asks
// for). nullopt without distillation.
Config distill_teacher_config(const Config& cfg);
std::optional<ChunkSpec> teacher_chunk_spec(const Config& cfg, const RankPosition& r, DType compute);

// The memory plan of the rank at `r`: the sum of its chunks' plans (and a distillation teacher's),
// measured without allocating.
MemoryPlan plan_rank_memory(const Config& cfg, const RankPosition& r, DType compute);

// The compute dtype of --fp32 / --bf16 / --fp16 (no device checks: the caller makes those).
DType precision_dtype(const Config& cfg);

// Fully sharded data parallelism's gradient sharding (ModelOptions::shard_grads): whether this
// run's strategy asks for it (--use-megatron-fsdp optim_grads or optim_grads_params, or
// --use-torch-fsdp2), and why it is not built for this layout where it is not: "" when the
// gradients are sharded (every layout megatrain builds today), or the reason, with which a run
// would keep the distributed optimizer's layout. nullopt: not asked for.
std::optional<std::string> unsharded_gradients_reason(const Config& cfg);
// The same for parameter sharding (ModelOptions::shard_params; optim_grads_params and
// --use-torch-fsdp2): besides the gradients' reasons, --use-precision-aware-optimizer's
// master-weight remainders, the replica weight check and --test-mode.
std::optional<std::string> unsharded_params_reason(const Config& cfg);

std::vector<std::unique_ptr<GptModel>> build_model_chunks(const Config& cfg, ParallelState& ps, Backend& backend,
                                                          DType compute);

std::vector<GptModel*> chunk_pointers(const std::vector<std::unique_ptr<GptModel>>& chunks);

// The sum of the chunks' memory plans (what this rank's models hold).
MemoryPlan total_memory_plan(const std::vector<GptModel*>& chunks);

}  // namespace mt
