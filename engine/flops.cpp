#include "engine/flops.h"

#include "core/config.h"
#include "engine/param_count.h"

namespace mt {

double num_floating_point_operations(const ModelConfig& m, int64_t global_batch_size) {
  const double B = static_cast<double>(global_batch_size);
  const double s = m.seq_length;
  const double L = m.num_layers;
  const double h = m.hidden_size;
  const double f = m.ffn_size;
  const double V = m.padded_vocab_size;
  const double q = static_cast<double>(m.num_attention_heads) * m.head_dim;
  const double k = static_cast<double>(m.query_groups) * m.head_dim;
  const double F = m.swiglu ? 3.0 : 2.0;
  // Dense and MoE layers' MLPs (without --num-experts every layer is dense).
  double moe_layers = 0;
  const std::vector<char> map = moe_layer_map(m);
  for (char is_moe : map) moe_layers += is_moe ? 1 : 0;
  // Multi-token prediction: its D layers count as decoder layers of the last one's kind, plus their
  // norms and input projections and one more output layer each (Megatron's formula).
  const double D = m.mtp_num_layers.value_or(0);
  if (D > 0 && !map.empty() && map.back()) moe_layers += D;
  const double routed = static_cast<double>(expert_ffn_size(m)) * m.moe.router_topk * F;
  const double shared = static_cast<double>(m.moe.shared_expert_intermediate_size.value_or(0)) * F;
  const double mlp = 6.0 * h * (f * F * (L + D - moe_layers) + (routed + shared) * moe_layers);
  const double G = m.attention_output_gate ? q : 0.0;  // the gate's rows of the QKV projection
  double projections = 6.0 * (L + D) * (h * (q + 2.0 * k + G) + q * h);
  const double logits = 6.0 * h * V * (D + 1) + 6.0 * D * (3 * h + 2 * h * h);
  double attention = 6.0 * q * (L + D);  // times s^2 per sample (causal: half of QK^T + PV)
  if (m.multi_latent_attention) {
    // Megatron's MLA terms: the low-rank projections with their norms ("+ 1"), the shared RoPE key,
    // the output projection; the core's QK^T over d_qk and PV over d_v, each halved by causality.
    const double n = m.num_attention_heads, dq = m.qk_head_dim + m.qk_pos_emb_head_dim;
    const double q_term = m.q_lora_rank ? *m.q_lora_rank * (h + n * dq + 1) : h * n * dq;
    projections = 6.0 * (L + D) *
                  (q_term + m.kv_lora_rank * (h + n * (m.qk_head_dim + m.v_head_dim) + 1) +
                   h * m.qk_pos_emb_head_dim + n * m.v_head_dim * h);
    attention = 6.0 * (L + D) * (n * dq / 2 + n * m.v_head_dim / 2);
  }
  if (m.gated_delta_net) {
    // Megatron's Gated DeltaNet term in place of the softmax attention's (projections and core) in
    // its layers: the input projection, the convolution, the delta rule (4 dv^2 per value head) and
    // the output projection; no s^2 term.
    double nl = 0;
    const std::vector<char> gdn = gdn_layer_map(m);
    for (char g : gdn) nl += g ? 1 : 0;
    // The multi-token prediction layers: Megatron's formula continues --linear-attention-freq N over
    // them (num_layers + D layers); with a per-layer list they count as the last layer's kind.
    for (int j = 0; j < static_cast<int>(D); ++j)
      nl += m.linear_attention_every ? ((m.num_layers + j + 1) % *m.linear_attention_every != 0 ? 1 : 0)
                                     : (!gdn.empty() && gdn.back() ? 1 : 0);
    const double kh = m.linear_num_key_heads, vh = m.linear_num_value_heads, dk = m.linear_key_head_dim,
                 dv = m.linear_value_head_dim;
    const double qk = kh * dk, v = vh * dv;
    const double linear = 6.0 * (h * (2 * qk + 2 * v + 2 * vh) + m.linear_conv_kernel_dim * (2 * qk + v) +
                                 vh * dv * dv * 4 + h * v);
    projections = projections / (L + D) * (L + D - nl) + nl * linear;
    attention = attention / (L + D) * (L + D - nl);
  }
  return B * s * (mlp + projections + logits) + B * s * s * attention;
}

double flops_per_token(const ModelConfig& m) {
  return num_floating_point_operations(m, 1) / static_cast<double>(m.seq_length);
}

}  // namespace mt
