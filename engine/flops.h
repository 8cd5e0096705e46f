// Model FLOPs of one training iteration, by Megatron-LM's num_floating_point_operations (HEAD,
// dense GPT; megatron.md section 2.1). Recompute is NOT counted (model FLOPs, not hardware FLOPs).
//
//   FLOPs = B*s * [ 6*F*h*f*L + 6*L*(h*(q + 2k) + q*h) + 6*h*V ] + B*s^2 * 6*q*L
//
// B global batch (samples), s sequence length, L layers, h hidden, f ffn size, V padded vocab,
// q = heads * kv_channels, k = query_groups * kv_channels, F = 3 with SwiGLU else 2. The last term
// is core attention (QK^T and PV) with the causal halving HEAD applies (12 -> 6).
// --log-throughput divides it by (iteration seconds * 1e12 * world size) for TFLOP/s/GPU.
#pragma once

#include <cstdint>

namespace mt {

struct ModelConfig;

// Needs the derived fields of ModelConfig (ffn_size, head_dim, query_groups, padded_vocab_size).
double num_floating_point_operations(const ModelConfig& model, int64_t global_batch_size);

// The same per token (global batch 1, divided by seq_length).
double flops_per_token(const ModelConfig& model);

}  // namespace mt
