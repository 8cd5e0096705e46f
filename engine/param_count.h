// Parameter counts of the GPT/Llama model megatrain builds, globally and per rank, with the
// parameter shapes of Megatron-Core's GPT model:
//   word embeddings [V_padded, h] (vocab-parallel: rows split over TP), learned position
//   embeddings [max_positions, h] (replicated), per layer: input norm, QKV [q + 2k, h] (+ bias
//   with --add-qkv-bias / bias on), optional q/k norms [kv_channels], output projection [h, q]
//   (+ bias [h]), pre-MLP norm, fc1 [(F-1)*f, h] (+ bias), fc2 [h, f] (+ bias [h]); final norm;
//   output layer [V_padded, h] when untied. Column-parallel weights and their biases are split
//   over TP; row-parallel biases and norms are replicated. LayerNorm has weight and bias,
//   RMSNorm a weight only.
// Mixture of experts (--num-experts E, top-k k): an MoE layer (--moe-layer-freq) has the same
// attention and pre-MLP norm (decoder.layers.l.pre_mlp_layernorm), and instead of fc1/fc2 the
// router [E, h] (mlp.router.weight), the experts' fc1 [E * (F-1)*f_e, h] and fc2 [E * h, f_e]
// (mlp.experts.linear_fc1/2.weight, f_e = the experts' FFN size), and with a shared expert of size
// f_s its fc1 [(F-1)*f_s, h], fc2 [h, f_s] (mlp.shared_experts.linear_fc1/2.weight) and with its gate
// [1, h] (mlp.shared_experts.gate_weight). MoE layers have no biases (megatrain builds them with
// --disable-bias-linear). A token's active parameters leave out the E - k experts it is not routed
// to in every MoE layer.
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
  // MoE layers (fc1/fc2 above are 0 there): router, all experts' fc1 and fc2, shared expert.
  int64_t router_weight = 0, experts_fc1_weight = 0, experts_fc2_weight = 0;
  // With linear biases: the router's and the experts' (whose expert TP size is then 1).
  int64_t router_bias = 0, experts_bias = 0;
  int64_t shared_fc1_weight = 0, shared_fc2_weight = 0, shared_gate_weight = 0;
  // Multi-latent attention (qkv_weight then holds the query and key/value up projections, split
  // over TP): the down projections and the latents' norms, whole on every TP rank.
  int64_t mla_down_weight = 0, mla_norms = 0;
  int64_t sinks = 0;  // --softmax-type learnable: a sink logit per head (split over TP)
  int64_t total() const;
  // The part of a layer one TP rank holds (column-parallel weights and biases / tp, row-parallel
  // weights / tp, replicated norms, router, shared-expert gate and row-parallel biases whole).
  // The experts are split over the expert tensor-parallel ranks, which megatrain keeps equal to TP,
  // and the ep expert-parallel ranks.
  int64_t per_tp_rank(int tp, int ep = 1) const;
};

struct ParamCounts {
  int64_t word_embeddings = 0;      // V_padded * h
  int64_t position_embeddings = 0;  // max_positions * h (learned_absolute only)
  LayerParamCounts layer;           // one dense transformer layer
  LayerParamCounts moe_layer;       // one MoE layer (all zero without --num-experts)
  int num_moe_layers = 0;           // MoE layers among the num_layers
  // Gated DeltaNet layers (--experimental-attention-variant gated_delta_net), dense and MoE: the
  // attention's fields then hold the input projection, convolution, dt_bias and A_log (qkv_weight,
  // split over TP), the output norm (qk_norms, whole) and the output projection (proj_weight).
  LayerParamCounts gdn_layer, gdn_moe_layer;
  int num_gdn_layers = 0;
  const LayerParamCounts& of(bool moe, bool gdn) const {
    return gdn ? (moe ? gdn_moe_layer : gdn_layer) : (moe ? moe_layer : layer);
  }
  int64_t layers = 0;               // the sum of every layer's total()
  int64_t final_norm = 0;
  int64_t output_layer = 0;         // V_padded * h when untied, else 0
  // Multi-token prediction: D depths, each a layer like the last decoder layer, three norms and the
  // input projection [h, 2h] (mtp_depth: one depth's own part, without its layer).
  int64_t mtp = 0, mtp_depth = 0;
  int64_t total = 0;                // unique parameters (tied embeddings counted once)
  // Parameters one token is computed with: total less, in every MoE layer, the experts it is not
  // routed to ((E - k) experts' fc1 and fc2). Equal to total without MoE.
  int64_t active = 0;
};

// Needs the derived fields of ModelConfig (ffn_size, head_dim, query_groups, padded_vocab_size;
// with MoE, moe.expert_ffn and moe.moe_layer, else --moe-ffn-hidden-size / --moe-layer-freq).
ParamCounts count_parameters(const ModelConfig& model);

// Which global layers are MoE layers (all 0 without --num-experts), and the experts' FFN size:
// the derived values when set, else computed as app/derive.cpp does.
std::vector<char> moe_layer_map(const ModelConfig& model);
// Which global layers are Gated DeltaNet layers (all 0 without the variant).
std::vector<char> gdn_layer_map(const ModelConfig& model);
int expert_ffn_size(const ModelConfig& model);

// Parameters held by one rank of a pipeline stage with the given chunks, at tensor-parallel size
// tp, in a pipeline of pp stages, with ep expert-parallel ranks (every TP and EP rank of a stage
// holds the same count).
int64_t stage_parameters_per_rank(const ModelConfig& model, const std::vector<ModelChunk>& chunks, int tp, int pp,
                                  int ep = 1);

}  // namespace mt
