#include "engine/param_count.h"

#include <algorithm>

#include "core/config.h"
#include "core/error.h"
#include "parallel/pipeline_layout.h"

namespace mt {

int64_t LayerParamCounts::total() const {
  return input_norm + qkv_weight + qkv_bias + qk_norms + proj_weight + proj_bias + mlp_norm + fc1_weight +
         fc1_bias + fc2_weight + fc2_bias + router_weight + experts_fc1_weight + experts_fc2_weight +
         router_bias + experts_bias + shared_fc1_weight + shared_fc2_weight + shared_gate_weight + mla_down_weight + mla_norms + sinks;
}

int64_t LayerParamCounts::per_tp_rank(int tp, int ep) const {
  const int64_t sharded = qkv_weight + qkv_bias + proj_weight + fc1_weight + fc1_bias + fc2_weight +
                          shared_fc1_weight + shared_fc2_weight + sinks;
  const int64_t experts = experts_fc1_weight + experts_fc2_weight;  // split over TP x EP
  const int64_t replicated = input_norm + qk_norms + proj_bias + mlp_norm + fc2_bias + router_weight + router_bias +
                             shared_gate_weight + mla_down_weight + mla_norms;
  MT_CHECK(sharded % tp == 0 && experts % (int64_t{tp} * ep) == 0 && experts_bias % ep == 0,
           "layer parameters {} (experts {}) not divisible by TP {} (x EP {})", sharded, experts, tp, ep);
  return sharded / tp + experts / (int64_t{tp} * ep) + experts_bias / ep + replicated;
}

std::vector<char> moe_layer_map(const ModelConfig& m) {
  const size_t L = static_cast<size_t>(std::max(0, m.num_layers));
  std::vector<char> map(L, 0);
  const MoeConfig& e = m.moe;
  if (!e.enabled()) return map;
  if (e.moe_layer.size() == L) return e.moe_layer;
  if (!e.layer_pattern.empty()) {
    MT_CHECK(e.layer_pattern.size() == L, "--moe-layer-freq has {} entries for {} layers", e.layer_pattern.size(), L);
    for (size_t l = 0; l < L; ++l) map[l] = e.layer_pattern[l] != 0;
    return map;
  }
  MT_CHECK(e.layer_freq > 0, "--moe-layer-freq {} must be > 0", e.layer_freq);
  for (size_t l = 0; l < L; ++l) map[l] = static_cast<int>(l) % e.layer_freq == 0;
  return map;
}

std::vector<char> gdn_layer_map(const ModelConfig& m) {
  const size_t L = static_cast<size_t>(std::max(0, m.num_layers));
  std::vector<char> map(L, 0);
  if (!m.gated_delta_net) return map;
  if (m.linear_layer.size() == L) return m.linear_layer;
  for (size_t l = 0; l < L; ++l)
    map[l] = m.linear_attention_pattern.size() == L ? m.linear_attention_pattern[l] != 0
             : m.linear_attention_every         ? (static_cast<int>(l) + 1) % std::max(1, *m.linear_attention_every) != 0
                                                : 0;
  return map;
}

int expert_ffn_size(const ModelConfig& m) {
  if (!m.moe.enabled()) return 0;
  return m.moe.expert_ffn > 0 ? m.moe.expert_ffn : m.moe.ffn_hidden_size.value_or(m.ffn_size);
}

ParamCounts count_parameters(const ModelConfig& m) {
  const int64_t h = m.hidden_size;
  const int64_t V = m.padded_vocab_size;
  const int64_t f = m.ffn_size;
  const int64_t d = m.head_dim;
  const int64_t q = static_cast<int64_t>(m.num_attention_heads) * d;
  const int64_t k = static_cast<int64_t>(m.query_groups) * d;
  const int64_t norm_params = (m.normalization == Normalization::layernorm) ? 2 : 1;  // weight (+ bias)
  const int64_t gated = m.swiglu ? 2 : 1;

  ParamCounts c;
  c.word_embeddings = V * h;
  if (m.position_embedding_type == PositionEmbedding::learned_absolute)
    c.position_embeddings = static_cast<int64_t>(m.max_position_embeddings) * h;
  LayerParamCounts& l = c.layer;
  l.input_norm = norm_params * h;
  const int64_t gate = m.attention_output_gate ? q : 0;
  l.qkv_weight = (q + 2 * k + gate) * h;
  l.qkv_bias = m.add_qkv_bias ? (q + 2 * k + gate) : 0;
  l.qk_norms = m.qk_layernorm && !m.qk_l2_norm ? 2 * norm_params * d : 0;  // (L2Norm has no weights)
  l.proj_weight = h * q;
  l.proj_bias = m.add_bias_linear ? h : 0;
  l.sinks = m.softmax_type == SoftmaxType::learnable ? m.num_attention_heads : 0;
  if (m.multi_latent_attention) {
    const int64_t n = m.num_attention_heads, dq = m.qk_head_dim + m.qk_pos_emb_head_dim;
    const int64_t rq = m.q_lora_rank.value_or(0), rkv = m.kv_lora_rank;
    l.qkv_weight = n * dq * (rq > 0 ? rq : h) + n * (m.qk_head_dim + m.v_head_dim) * rkv;
    l.qkv_bias = 0;
    l.qk_norms = 0;
    l.mla_down_weight = (rq + rkv + m.qk_pos_emb_head_dim) * h;
    l.mla_norms = m.qk_layernorm ? norm_params * ((rq > 0 ? rq : h) + rkv) : 0;
    l.proj_weight = h * n * m.v_head_dim;
  }
  l.mlp_norm = norm_params * h;
  l.fc1_weight = gated * f * h;
  l.fc1_bias = m.add_bias_linear ? gated * f : 0;
  l.fc2_weight = h * f;
  l.fc2_bias = m.add_bias_linear ? h : 0;
  const std::vector<char> moe = moe_layer_map(m);
  for (char is_moe : moe) c.num_moe_layers += is_moe ? 1 : 0;
  int64_t inactive = 0;  // per MoE layer: the experts a token is not routed to
  if (c.num_moe_layers > 0) {
    const MoeConfig& e = m.moe;
    const int64_t E = e.num_experts, fe = expert_ffn_size(m);
    const int64_t fs = e.shared_expert_intermediate_size.value_or(0);
    LayerParamCounts& ml = c.moe_layer;
    ml = l;
    ml.fc1_weight = ml.fc1_bias = ml.fc2_weight = ml.fc2_bias = 0;
    ml.router_weight = E * h;
    ml.experts_fc1_weight = E * gated * fe * h;
    ml.experts_fc2_weight = E * h * fe;
    ml.router_bias = m.add_bias_linear ? E : 0;
    ml.experts_bias = m.add_bias_linear ? E * (gated * fe + h) : 0;
    if (fs > 0) {
      ml.shared_fc1_weight = gated * fs * h;
      ml.shared_fc2_weight = h * fs;
      ml.shared_gate_weight = e.shared_expert_gate ? h : 0;
    }
    inactive = (E - e.router_topk) * (gated * fe * h + h * fe + (m.add_bias_linear ? gated * fe + h : 0));
  }
  // Gated DeltaNet layers: their attention block in place of softmax attention's.
  const std::vector<char> gdn = gdn_layer_map(m);
  if (m.gated_delta_net) {
    const int64_t kh = m.linear_num_key_heads, vh = m.linear_num_value_heads, dk = m.linear_key_head_dim,
                  dv = m.linear_value_head_dim;
    const int64_t proj = 2 * kh * dk + 2 * vh * dv + 2 * vh, conv = 2 * kh * dk + vh * dv;
    for (LayerParamCounts* g : {&c.gdn_layer, &c.gdn_moe_layer}) {
      *g = g == &c.gdn_layer ? l : c.moe_layer;
      g->qkv_weight = proj * h + conv * m.linear_conv_kernel_dim + 2 * vh;
      g->qkv_bias = 0;
      g->qk_norms = norm_params * dv;
      g->proj_weight = h * vh * dv;
      g->proj_bias = 0;
      g->mla_down_weight = g->mla_norms = 0;
      g->sinks = 0;  // (softmax layers only)
    }
  }
  c.layers = 0;
  for (size_t i = 0; i < moe.size(); ++i) {
    c.layers += c.of(moe[i] != 0, gdn[i] != 0).total();
    c.num_gdn_layers += gdn[i] ? 1 : 0;
  }
  c.final_norm = norm_params * h;
  c.output_layer = m.untie_embeddings_and_output_weights ? V * h : 0;
  const int64_t D = m.mtp_num_layers.value_or(0);
  const bool last_moe = !moe.empty() && moe.back(), last_gdn = !gdn.empty() && gdn.back();
  c.mtp_depth = 3 * norm_params * h + 2 * h * h;
  c.mtp = D * (c.mtp_depth + c.of(last_moe, last_gdn).total());
  c.total = c.word_embeddings + c.position_embeddings + c.layers + c.final_norm + c.output_layer + c.mtp;
  c.active = c.total - (c.num_moe_layers + (last_moe ? D : 0)) * inactive;
  return c;
}

int64_t stage_parameters_per_rank(const ModelConfig& m, const std::vector<ModelChunk>& chunks, int tp, int pp,
                                  int ep) {
  const ParamCounts c = count_parameters(m);
  MT_CHECK(c.word_embeddings % tp == 0, "padded vocabulary rows not divisible by TP {}", tp);
  const int64_t vocab_shard = c.word_embeddings / tp;
  int64_t n = 0;
  const std::vector<char> moe = moe_layer_map(m), gdn = gdn_layer_map(m);
  for (const ModelChunk& ch : chunks) {
    for (int l = ch.first_layer; l < ch.first_layer + ch.num_layers; ++l)
      n += c.of(moe.at(static_cast<size_t>(l)) != 0, gdn.at(static_cast<size_t>(l)) != 0).per_tp_rank(tp, ep);
    if (ch.has_embedding) n += vocab_shard + c.position_embeddings;
    if (ch.has_output) {
      n += c.final_norm;
      // The mtp depths: their layers, norms and input projection (its rows split over TP).
      const int64_t D = m.mtp_num_layers.value_or(0);
      if (D > 0) {
        const LayerParamCounts& last = c.of(moe.back() != 0, !gdn.empty() && gdn.back() != 0);
        const int64_t h = m.hidden_size;
        n += D * (last.per_tp_rank(tp, ep) + (c.mtp_depth - 2 * h * h) + 2 * h * h / tp);
        if (!ch.has_embedding && m.untie_embeddings_and_output_weights) n += vocab_shard;  // the depths' copy
      }
      // Untied: the output layer. Tied with PP > 1: the last stage's copy of the embeddings.
      if (m.untie_embeddings_and_output_weights || pp > 1) n += vocab_shard;
    }
  }
  return n;
}

}  // namespace mt
