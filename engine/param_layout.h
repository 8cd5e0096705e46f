// Parameter descriptions: every parameter of this rank's stage with its Megatron-Core name
// (global layer numbers), global shape, this rank's TP shard, init rule and optimizer flags, and
// where it sits in the flat parameter/gradient buffers.
//
// Initialization is layout-independent: element e of the global tensor gets
// std * normal_at(mix_key(seed, fnv1a64(init_name)), e), so any TP shard draws its own slice and
// a TP=2 model starts equal to the TP=1 model.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/shard.h"
#include "core/tensor.h"
#include "engine/model_dims.h"

namespace mt {

// normal: init_std * N(0, 1); uniform: U(init_lo, init_hi); log_uniform: log of U(init_lo, init_hi).
enum class InitKind { normal, zeros, ones, uniform, log_uniform };

struct ParamDesc {
  std::string name;                  // e.g. "decoder.layers.3.mlp.linear_fc1.weight"
  std::vector<int64_t> global_shape; // 1-D or 2-D, as Megatron's state dict
  ShardIndex shard;                  // this rank's block; a 1-D tensor of n is a [n, 1] matrix
  InitKind init = InitKind::normal;
  float init_std = 0;
  float init_lo = 0, init_hi = 0;    // uniform and log_uniform
  std::string init_name;             // key of the init stream (the tied output copy uses the embedding's)
  bool weight_decay = true;          // false for biases and 1-D parameters (Megatron's rule)
  bool decoupled_lr = false;         // word embeddings and output layer (--decoupled-lr)
  bool tp_duplicated = false;        // identical on every TP rank (counted once in the grad norm)
  bool shared_copy = false;          // last stage's copy of tied embeddings (or, with mtp layers and an
                                     // untied output layer, of the word embeddings): not in the grad norm
  // Each TP rank holds only a part of the gradient, which is summed over the TP group once per
  // step: norms on sequence shards (--sequence-parallel) and the q/k layernorms shared by heads
  // that TP splits (Megatron's finalize_model_grads does the same all-reduce).
  bool tp_partial_grad = false;
  int layer = -1;                    // global layer number, -1 outside the decoder layers
  // --fp8-param-gather: a linear weight of an FP8 layer, kept only as FP8 (the model's FP8
  // parameter buffer, engine/grad_layout.h's FP8 region) beside its float32 master weights.
  bool fp8_storage = false;
  // A routed expert's weight (the MoE experts' fc1/fc2): under expert parallelism this rank holds
  // its experts' rows only, and the gradients are reduced over the expert-data-parallel group.
  bool expert = false;
  // A matrix here that Megatron holds with more dimensions (Gated DeltaNet's conv1d weight, [C, 1,
  // K] there): not one of Muon's 2-D parameters.
  bool muon_excluded = false;
  // --use-mup: a hidden matrix (not 1-D, not the embeddings or the output layer), whose Adam
  // learning rate and eps MuP divides by the width multiplier (its own optimizer group).
  bool mup_hidden = false;
  int64_t offset = 0;                // element offset in the flat buffers

  int64_t numel() const { return shard.local_numel(); }
  int64_t local_rows() const { return shard.local_rows * shard.local_chunks(); }
  int64_t local_cols() const { return shard.local_cols; }
  bool is_1d() const { return global_shape.size() == 1; }
  uint64_t init_key(uint64_t seed) const;
};

// Flat-buffer alignment of each parameter (elements): keeps every view 256-byte aligned for any dtype.
constexpr int64_t kParamAlignment = 64;

// The parameters of this stage in forward order, with offsets assigned; total (padded) elements
// in *total_elements.
std::vector<ParamDesc> build_param_descs(const ModelDims& d, int64_t* total_elements);

class Backend;

// A parameter's initial values (its InitKind; the random kinds drawn by global index from the
// parameter's stream under `seed`, or zeros unless `random`).
void init_param(Backend& be, const ParamDesc& p, Tensor w, uint64_t seed, bool random);

// Index of a parameter by name, or -1.
int find_param(const std::vector<ParamDesc>& params, const std::string& name);

}  // namespace mt
