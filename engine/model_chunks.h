// This rank's model chunks: the pipeline stage's layers (one chunk, or V with an interleaved
// pipeline; parallel/pipeline_layout.h decides which layers, uneven first/last stages included),
// each a GptModel with the TP shard of its parameters, the DP bucket layout of its buffers and the
// activation slots the pipeline schedule needs (engine/pipeline_runner.h), initialized.
#pragma once

#include <memory>
#include <vector>

#include "core/config.h"
#include "engine/gpt_model.h"

namespace mt {

struct ParallelState;

std::vector<std::unique_ptr<GptModel>> build_model_chunks(const Config& cfg, ParallelState& ps, Backend& backend,
                                                          DType compute);

std::vector<GptModel*> chunk_pointers(const std::vector<std::unique_ptr<GptModel>>& chunks);

}  // namespace mt
