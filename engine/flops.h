// Model FLOPs of one training iteration, by Megatron-LM's num_floating_point_operations (HEAD,
// dense GPT). Recompute is NOT counted (model FLOPs, not hardware FLOPs).
//
//   FLOPs = B*s * [ 6*F*h*f*L + 6*L*(h*(q + 2k) + q*h) + 6*h*V ] + B*s^2 * 6*q*L
//
// B global batch (samples), s sequence length, L layers, h hidden, f ffn size, V padded vocab,
// q = heads * kv_channels, k = query_groups * kv_channels, F = 3 with SwiGLU else 2. The last term
// is core attention (QK^T and PV) with the causal halving HEAD applies (12 -> 6).
//
// Mixture of experts (Megatron's MoE term): the MLP term 6*F*h*f*L becomes
//   6*h*[ f*F*L_dense + (f_e*k*F + f_s*F) * L_moe ]
// with L_moe the MoE layers (--moe-layer-freq), L_dense the others, f_e the experts' FFN size, k
// the top-k and f_s the shared expert's size (0 without one). The router GEMM, the shared-expert
// gate and the token dispatch are not counted (as in Megatron).
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
