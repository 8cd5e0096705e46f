// Parameter counts of the GPT/Llama model megatrain builds, globally and per rank, with the
// parameter shapes of Megatron-Core's GPT model (megatron.md section 5):
//   word embeddings [V_padded, h] (vocab-parallel: rows split over TP), learned position
//   embeddings [max_positions, h] (replicated), per layer: input norm, QKV [q + 2k, h] (+ bias
//   with --add-qkv-bias / bias on), optional q/k norms [kv_channels], output projection [h, q]
//   (+ bias [h]), pre-MLP norm, fc1 [(F-1)*f, h] (+ bias), fc2 [h, f] (+ bias [h]); final norm;
//   output layer [V_padded, h] when untied. Column-parallel weights and their biases are split
//   over TP; row-parallel biases and norms are replicated. LayerNorm has weight and bias,
//   RMSNorm a weight only.
// Tied embeddings (the default): the model has ONE copy, but with PP > 1 the last stage holds
// its own copy of the word embeddings for the output layer (kept equal by the embedding group's
// all-reduce), so per-rank counts include it as Megatron's do.
#pragma once

#include <cstdint>
#include <vector>

namespace mt {

struct ModelConfig;
struct ModelChunk;

struct LayerParamCounts {
  int64_t input_norm = 0, qkv_weight = 0, qkv_bias = 0, qk_norms = 0, proj_weight = 0, proj_bias = 0;
  int64_t mlp_norm = 0, fc1_weight = 0, fc1_bias = 0, fc2_weight = 0, fc2_bias = 0;
  int64_t total() const;
  // The part of a layer one TP rank holds (column-parallel weights and biases / tp, row-parallel
  // weights / tp, replicated norms and row-parallel biases whole).
  int64_t per_tp_rank(int tp) const;
};

struct ParamCounts {
  int64_t word_embeddings = 0;      // V_padded * h
  int64_t position_embeddings = 0;  // max_positions * h (learned_absolute only)
  LayerParamCounts layer;           // one transformer layer
  int64_t layers = 0;               // num_layers * layer.total()
  int64_t final_norm = 0;
  int64_t output_layer = 0;         // V_padded * h when untied, else 0
  int64_t total = 0;                // unique parameters (tied embeddings counted once)
};

// Needs the derived fields of ModelConfig (ffn_size, head_dim, query_groups, padded_vocab_size).
ParamCounts count_parameters(const ModelConfig& model);

// Parameters held by one rank of a pipeline stage with the given chunks, at tensor-parallel size
// tp, in a pipeline of pp stages (every TP rank of a stage holds the same count).
int64_t stage_parameters_per_rank(const ModelConfig& model, const std::vector<ModelChunk>& chunks, int tp, int pp);

}  // namespace mt
