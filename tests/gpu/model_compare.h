// A whole small model on the CUDA backend against the same model on the reference backend (the MoE,
// MLA and MTP GPU tests): one training micro-batch from the same parameters, its loss, logged MoE
// losses and every parameter's gradient.
#pragma once

#include <cstdint>
#include <vector>

#include "core/config.h"
#include "data/batch.h"
#include "engine/backend.h"
#include "tests/gpu/gpu_test_util.h"

namespace mt::gputest {

struct ModelRun {
  // lm loss; the MoE aux, z, seq_aux and global_aux loss sums (0 without MoE or without the term)
  double loss = 0, aux = 0, z = 0, seq = 0, global = 0;
  std::vector<double> grads;
};

// One training micro-batch of `c` on `be` in dtype T from the float parameters `w` (the reference
// model's, in its flat order; both models lay parameters out alike), or with init: the model's own
// initialization, whose float values are written to *init.
ModelRun run_model_micro_batch(Backend& be, const Config& c, DType T, const std::vector<double>& w,
                               const MicroBatch& mb, std::vector<double>* init = nullptr);

// A small Llama-style model (h 64, 4 heads, RMSNorm, SwiGLU MLP of 96, RoPE, untied, no biases,
// vocabulary 96, no dropout) of `layers` layers over sequences of `seq`, trained one micro-batch of
// `batch` at a time on the GPU: the MoE and MLA model tests set their parts on it.
Config small_llama_config(int layers, int seq, int batch);

// A micro-batch of random tokens and labels below `vocab`, every seventh row from the fourth masked out.
MicroBatch random_micro_batch(Rng& rng, int batch, int seq, int vocab);

// The gradients of a device run against the reference's: each element within 5e-3 of the largest
// (float32 only) and the whole vector's relative error norm within 2e-3 (bf16: 5e-2).
void check_gradients_close(const std::vector<double>& got, const std::vector<double>& want, bool bf16);

}  // namespace mt::gputest
