#include "checkpoint/hf_names.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>

#include "core/error.h"
#include "core/shape_text.h"

namespace mt {

using nlohmann::json;

namespace {

double load_float(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::f32: return static_cast<const float*>(p)[i];
    case DType::f64: return static_cast<const double*>(p)[i];
    case DType::bf16: return bf16_bits_to_float(static_cast<const uint16_t*>(p)[i]);
    case DType::f16: return f16_bits_to_float(static_cast<const uint16_t*>(p)[i]);
    default: fail("norm weights of dtype {} cannot be converted", dtype_name(t));
  }
}

void store_float(void* p, DType t, int64_t i, double v) {
  switch (t) {
    case DType::f32: static_cast<float*>(p)[i] = static_cast<float>(v); break;
    case DType::f64: static_cast<double*>(p)[i] = v; break;
    case DType::bf16: static_cast<uint16_t*>(p)[i] = float_to_bf16_bits(static_cast<float>(v)); break;
    case DType::f16: static_cast<uint16_t*>(p)[i] = float_to_f16_bits(static_cast<float>(v)); break;
    default: fail("norm weights of dtype {} cannot be converted", dtype_name(t));
  }
}

void check_shape(const HostArray& a, const std::vector<int64_t>& want, const std::string& name) {
  if (a.shape != want)
    fail("tensor '{}' has shape {}, expected {} for this model configuration", name, shape_text(a.shape),
         shape_text(want));
  MT_CHECK(a.bytes.size() == static_cast<size_t>(shape_numel(a.shape)) * dtype_size(a.dtype), "'{}' byte size", name);
}

}  // namespace

int64_t HostArray::numel() const { return shape_numel(shape); }

HostArray HostArray::zeros(DType dtype, std::vector<int64_t> shape) {
  HostArray a;
  a.dtype = dtype;
  a.shape = std::move(shape);
  a.bytes.assign(static_cast<size_t>(shape_numel(a.shape)) * dtype_size(dtype), 0);
  return a;
}

// ---------------------------------------------------------------------------------------------
// Spec

HfModelSpec HfModelSpec::from_model_config(const ModelConfig& m, HfArchitecture arch) {
  HfModelSpec s;
  s.arch = arch;
  for_each_hf_model_setting([&](auto ours, auto theirs) { s.*ours = m.*theirs; });
  s.learned_position_embeddings = m.position_embedding_type == PositionEmbedding::learned_absolute;
  s.layernorm = m.normalization == Normalization::layernorm;
  s.add_qkv_bias = m.add_qkv_bias;
  s.gated_unit_variant = m.glu_variant();
  s.attention_sinks = m.softmax_type != SoftmaxType::vanilla;
  s.qk_l2_norm = m.qk_l2_norm;
  s.nope_layers = std::find(m.nope_layer.begin(), m.nope_layer.end(), 1) != m.nope_layer.end();
  s.attention_output_gate = m.attention_output_gate;
  std::vector<int> windows;  // per layer: the window's LEFT, or -1
  for (int layer = 0; layer < m.num_layers; ++layer) windows.push_back(attention_window_left(m, layer));
  if (std::any_of(windows.begin(), windows.end(), [](int w) { return w >= 0; })) {
    s.sliding_window = m.window_size->first + 1;
    if (std::any_of(windows.begin(), windows.end(), [](int w) { return w < 0; }))
      for (int w : windows) s.window_layers.push_back(w >= 0 ? 1 : 0);
  }
  if (m.gated_delta_net) {  // (the layer map as derive.cpp fills it, or from the flag when not derived)
    for (int layer = 0; layer < m.num_layers; ++layer) {
      const bool gdn = !m.linear_layer.empty() ? m.is_linear_layer(layer)
                       : !m.linear_attention_pattern.empty()
                           ? m.linear_attention_pattern.at(static_cast<size_t>(layer)) != 0
                           : (layer + 1) % std::max(1, m.linear_attention_every.value_or(4)) != 0;
      s.gdn_layers.push_back(gdn ? 1 : 0);
    }
    s.gdn_key_heads = m.linear_num_key_heads;
    s.gdn_value_heads = m.linear_num_value_heads;
    s.gdn_dk = m.linear_key_head_dim;
    s.gdn_dv = m.linear_value_head_dim;
    s.gdn_conv = m.linear_conv_kernel_dim;
  }
  // The engine computes the tanh approximation (--openai-gelu, or Megatron's fused bias-GeLU, the
  // default with biases) or exact erf GeLU (core/config.h gelu_is_tanh); HF calls those "gelu_new"
  // and "gelu".
  s.gelu_activation = gelu_is_tanh(m) ? "gelu_new" : "gelu";
  if (m.position_embedding_type == PositionEmbedding::none && arch == HfArchitecture::gpt2)
    s.learned_position_embeddings = false;  // validate() refuses it
  if (m.multi_latent_attention) {
    s.q_lora_rank = m.q_lora_rank.value_or(0);
    s.kv_lora_rank = m.kv_lora_rank;
    s.qk_nope_head_dim = m.qk_head_dim;
    s.qk_rope_head_dim = m.qk_pos_emb_head_dim;
    s.v_head_dim = m.v_head_dim;
    s.mla_latent_norms = m.qk_layernorm;
    s.head_dim = m.qk_head_dim + m.qk_pos_emb_head_dim;
    s.num_query_groups = m.num_attention_heads;
    s.qk_layernorm = false;  // (MLA's --qk-layernorm means its latent norms)
    s.first_dense_layers = m.num_layers;
    s.rope_interleave = true;  // (Megatron's MLA RoPE: see mla_rope_rows)
    s.mtp_layers = m.mtp_num_layers.value_or(0);
    // YaRN with a factor of 1 is plain RoPE. Megatron scales MLA's softmax by
    // yarn_get_mscale(factor, mscale_all_dim)^2 whatever the RoPE type; transformers only with YaRN.
    s.yarn = mla_rope_is_yarn(m) && m.rotary_scaling_factor != 1.0;
    s.yarn_factor = m.rotary_scaling_factor;
    s.yarn_mscale = m.mscale;
    s.yarn_mscale_all_dim = m.mscale_all_dim;
    if (s.yarn && m.mscale_all_dim == 0.0 && m.mscale != 1.0)
      s.moe_unexpressible.push_back(fmt::format(
          "--mscale {} without --mscale-all-dim (transformers' YaRN takes mscale only beside mscale_all_dim)", m.mscale));
    if (!s.yarn && m.rotary_scaling_factor > 1.0 && m.mscale_all_dim != 0.0)
      s.moe_unexpressible.push_back("--rotary-scaling-factor and --mscale-all-dim with --rope-type rope (Megatron scales "
                                    "MLA's softmax by their mscale, transformers only with YaRN)");
  }
  if (m.moe.enabled() && arch == HfArchitecture::deepseek_v3) {
    const MoeConfig& e = m.moe;
    s.num_experts = e.num_experts;
    s.moe_topk = e.router_topk;
    s.moe_ffn_hidden_size = e.expert_ffn > 0 ? e.expert_ffn : e.ffn_hidden_size.value_or(m.ffn_size);
    s.router_aux_loss_coef = e.aux_loss_coeff_of(MoeLoadBalancing::aux_loss);
    s.expert_bias = e.router_enable_expert_bias;
    s.routed_scaling_factor = e.router_topk_scaling_factor.value_or(0.0) != 0.0 ? *e.router_topk_scaling_factor : 1.0;
    if (e.router_num_groups && e.router_group_topk) {
      s.router_groups = *e.router_num_groups;
      s.router_group_topk = *e.router_group_topk;
    }
    s.shared_expert_ffn = e.shared_expert_intermediate_size.value_or(0);
    std::vector<std::string>& no = s.moe_unexpressible;
    if (e.score_function != MoeScoreFunction::sigmoid)
      no.push_back("--moe-router-score-function softmax (DeepSeek-V3's router is sigmoid)");
    if (e.router_pre_softmax) no.push_back("--moe-router-pre-softmax");
    if (e.apply_probs_on_input) no.push_back("--moe-apply-probs-on-input (DeepSeek-V3 weights the expert's output)");
    // transformers scores a group by the sum of its two best experts; Megatron by its
    // top-k / group-top-k best.
    if (s.router_groups > 1 && s.num_experts / s.router_groups < 2)
      no.push_back(fmt::format("--moe-router-num-groups {} with {} experts (DeepSeek-V3's groups hold at least two)",
                               s.router_groups, s.num_experts));
    if (s.router_groups > 1 && s.moe_topk != 2 * s.router_group_topk)
      no.push_back(fmt::format("--moe-router-topk {} with --moe-router-group-topk {} (DeepSeek-V3 scores each group "
                               "by its two best experts: the top-k must be twice the group top-k)",
                               s.moe_topk, s.router_group_topk));
    if (e.shared_expert_gate) no.push_back("--moe-shared-expert-gate");
    if (s.shared_expert_ffn % s.moe_ffn_hidden_size != 0)
      no.push_back(fmt::format("--moe-shared-expert-intermediate-size {} (a whole number of --moe-ffn-hidden-size {}: "
                               "DeepSeek-V3's n_shared_experts)", s.shared_expert_ffn, s.moe_ffn_hidden_size));
    if (e.expert_capacity_factor) no.push_back("--moe-expert-capacity-factor (DeepSeek-V3's HF model is dropless)");
    for (MoeLoadBalancing t : e.load_balancing_type)
      if (t == MoeLoadBalancing::sinkhorn) no.push_back("--moe-router-load-balancing-type sinkhorn");
    // Dense layers first, then MoE layers only (first_k_dense_replace).
    int first_moe = m.num_layers;
    for (int layer = 0; layer < m.num_layers; ++layer)
      if (e.is_moe_layer(layer)) {
        first_moe = layer;
        break;
      }
    s.first_dense_layers = first_moe;
    for (int layer = first_moe; layer < m.num_layers; ++layer)
      if (!e.is_moe_layer(layer)) {
        no.push_back("--moe-layer-freq with a dense layer after an MoE layer (DeepSeek-V3's dense layers come first)");
        break;
      }
  } else if (m.moe.enabled()) {
    // Mixtral, Qwen2-MoE or Qwen3-MoE: softmax top-k routing over SwiGLU experts.
    const MoeConfig& e = m.moe;
    const bool qwen = hf_is_qwen_moe(arch);
    s.num_experts = e.num_experts;
    s.moe_topk = e.router_topk;
    s.moe_ffn_hidden_size = e.expert_ffn > 0 ? e.expert_ffn : e.ffn_hidden_size.value_or(m.ffn_size);
    s.router_aux_loss_coef = e.aux_loss_coeff_of(MoeLoadBalancing::aux_loss);
    s.norm_topk_prob = !e.router_pre_softmax;
    s.shared_expert_ffn = e.shared_expert_intermediate_size.value_or(0);
    s.shared_expert_gate = e.shared_expert_gate;
    bool dense = false;
    for (int layer = 0; layer < m.num_layers; ++layer) {
      const bool moe = e.is_moe_layer(layer);
      s.moe_layers.push_back(moe ? 1 : 0);
      dense = dense || !moe;
    }
    if (!dense) s.moe_layers.clear();
    const char* family = hf_architecture_name(arch);
    std::vector<std::string>& no = s.moe_unexpressible;
    if (e.score_function != MoeScoreFunction::softmax)
      no.push_back(fmt::format("--moe-router-score-function sigmoid ({} routes by softmax)", family));
    if (e.router_pre_softmax && !qwen)
      no.push_back("--moe-router-pre-softmax (Mixtral renormalizes the top-k weights; Qwen's MoE models take "
                   "norm_topk_prob false: they need --qk-layernorm, or --add-qkv-bias with a gated shared expert)");
    if (e.router_topk_scaling_factor && *e.router_topk_scaling_factor != 0.0) no.push_back("--moe-router-topk-scaling-factor");
    if (e.router_num_groups) no.push_back("--moe-router-num-groups");
    if (arch == HfArchitecture::mixtral && s.shared_expert_ffn > 0)
      no.push_back("--moe-shared-expert-intermediate-size (Mixtral has no shared expert; Qwen2MoeForCausalLM has a "
                   "gated one: --add-qkv-bias --disable-bias-linear --moe-shared-expert-gate)");
    if (arch == HfArchitecture::qwen3_moe && s.shared_expert_ffn > 0)
      no.push_back("--moe-shared-expert-intermediate-size (Qwen3-MoE has no shared expert)");
    const bool gated_shared = arch == HfArchitecture::qwen2_moe || arch == HfArchitecture::qwen3_next;
    if (gated_shared && s.shared_expert_ffn == 0)
      no.push_back(fmt::format("a mixture of experts without --moe-shared-expert-intermediate-size (every {} MoE "
                               "layer has a gated shared expert)", family));
    if (gated_shared && s.shared_expert_ffn > 0 && !s.shared_expert_gate)
      no.push_back(fmt::format("--moe-shared-expert-intermediate-size without --moe-shared-expert-gate ({} gates "
                               "its shared expert)", family));
    if (s.shared_expert_gate && !gated_shared)
      no.push_back(fmt::format("--moe-shared-expert-gate ({} has no gated shared expert)", family));
    if (e.router_enable_expert_bias) no.push_back("--moe-router-enable-expert-bias");
    if (e.apply_probs_on_input) no.push_back(fmt::format("--moe-apply-probs-on-input ({} weights the expert's output)", family));
    if (e.expert_capacity_factor) no.push_back(fmt::format("--moe-expert-capacity-factor ({} is dropless)", family));
    for (MoeLoadBalancing t : e.load_balancing_type)
      if (t == MoeLoadBalancing::sinkhorn) no.push_back("--moe-router-load-balancing-type sinkhorn");
    if (dense && !qwen) no.push_back("--moe-layer-freq with dense layers (every Mixtral layer is MoE)");
  }
  return s;
}

const char* hf_architecture_name(HfArchitecture a) {
  switch (a) {
    case HfArchitecture::gpt2: return "GPT2LMHeadModel";
    case HfArchitecture::llama: return "LlamaForCausalLM";
    case HfArchitecture::mistral: return "MistralForCausalLM";
    case HfArchitecture::qwen2: return "Qwen2ForCausalLM";
    case HfArchitecture::qwen3: return "Qwen3ForCausalLM";
    case HfArchitecture::nemotron: return "NemotronForCausalLM";
    case HfArchitecture::mixtral: return "MixtralForCausalLM";
    case HfArchitecture::qwen2_moe: return "Qwen2MoeForCausalLM";
    case HfArchitecture::qwen3_moe: return "Qwen3MoeForCausalLM";
    case HfArchitecture::qwen3_next: return "Qwen3NextForCausalLM";
    case HfArchitecture::deepseek_v3: return "DeepseekV3ForCausalLM";
  }
  return "?";
}

bool hf_is_qwen_moe(HfArchitecture a) {
  return a == HfArchitecture::qwen2_moe || a == HfArchitecture::qwen3_moe || a == HfArchitecture::qwen3_next;
}
bool hf_is_qwen(HfArchitecture a) { return a == HfArchitecture::qwen2 || a == HfArchitecture::qwen3 || hf_is_qwen_moe(a); }

namespace {
// config.json's model_type of the Llama-layout families.
const char* hf_model_type(HfArchitecture a) {
  switch (a) {
    case HfArchitecture::qwen2: return "qwen2";
    case HfArchitecture::qwen3: return "qwen3";
    case HfArchitecture::qwen2_moe: return "qwen2_moe";
    case HfArchitecture::qwen3_moe: return "qwen3_moe";
    case HfArchitecture::qwen3_next: return "qwen3_next";
    case HfArchitecture::mixtral: return "mixtral";
    case HfArchitecture::mistral: return "mistral";
    case HfArchitecture::nemotron: return "nemotron";
    default: return "llama";
  }
}
}  // namespace

void HfModelSpec::validate() const {
  const char* model = hf_architecture_name(arch);
  auto refuse = [&](const std::string& why) { throw Unsupported(fmt::format("cannot express this model as {}: {}", model, why)); };
  const bool deepseek = arch == HfArchitecture::deepseek_v3, qwen_moe = hf_is_qwen_moe(arch);
  const bool next = arch == HfArchitecture::qwen3_next;
  const bool qwen3 = arch == HfArchitecture::qwen3 || arch == HfArchitecture::qwen3_moe || next;
  const bool dense_mlp = arch != HfArchitecture::mixtral && !(deepseek && first_dense_layers == 0) &&
                         !(qwen_moe && num_experts > 0 && moe_layers.empty());
  if (num_layers <= 0 || hidden_size <= 0 || num_attention_heads <= 0 || head_dim <= 0 ||
      (dense_mlp && ffn_hidden_size <= 0))
    fail("HF mapping: model sizes are not set (layers {}, hidden {}, heads {}, head dim {}, ffn {})", num_layers,
         hidden_size, num_attention_heads, head_dim, ffn_hidden_size);
  if (num_query_groups <= 0 || num_attention_heads % num_query_groups != 0)
    fail("HF mapping: {} attention heads are not a multiple of {} query groups", num_attention_heads, num_query_groups);
  if (vocab_size <= 0 || padded_vocab_size < vocab_size)
    fail("HF mapping: vocabulary {} / padded {} is not valid", vocab_size, padded_vocab_size);
  if (qk_layernorm && !qwen3) refuse("--qk-layernorm (the HF model has no q/k norms)");
  if (qwen3 && !qk_layernorm) refuse("no --qk-layernorm (Qwen3 normalizes each head's q and k)");
  if (squared_relu && arch != HfArchitecture::nemotron)
    refuse("--squared-relu (of the mapped families only NemotronForCausalLM's MLP is squared ReLU)");
  if (qk_l2_norm) refuse("--qk-l2-norm (the HF model has no q/k norms)");
  if (gated_unit_variant)
    refuse("--quick-geglu, --glu-linear-offset or --activation-func-clamp-value (gpt-oss's MLP: none of the mapped HF "
           "families)");
  if (attention_sinks) refuse("--softmax-type other than vanilla (attention sinks: none of the mapped HF families)");
  if (nope_layers && !deepseek) refuse("--no-rope-freq (none of the mapped HF families skips RoPE in some layers)");
  if (attention_output_gate && !next)
    refuse("--attention-output-gate (of the mapped HF families only Qwen3-Next gates its attention, beside Gated "
           "DeltaNet layers)");
  if (!gdn_layers.empty() && !next)
    refuse("Gated DeltaNet layers (they export as Qwen3NextForCausalLM)");
  if (next) {
    // transformers' Qwen3NextForCausalLM: zero-centred RMSNorms, gated softmax attention with q/k
    // norms and partial RoPE, Gated DeltaNet layers, no biases.
    if (!apply_layernorm_1p) refuse("RMSNorm without --apply-layernorm-1p (Qwen3-Next's norms are zero-centred)");
    if (!attention_output_gate) refuse("softmax attention without --attention-output-gate (Qwen3-Next gates it)");
    if (static_cast<int>(gdn_layers.size()) != num_layers)
      fail("HF mapping: {} per-layer Gated DeltaNet entries for {} layers", gdn_layers.size(), num_layers);
    if (gdn_key_heads <= 0 || gdn_value_heads <= 0 || gdn_value_heads % gdn_key_heads != 0 || gdn_dk <= 0 ||
        gdn_dv <= 0 || gdn_conv <= 0)
      fail("HF mapping: Gated DeltaNet with {} key heads of {}, {} value heads of {}, {} taps", gdn_key_heads, gdn_dk,
           gdn_value_heads, gdn_dv, gdn_conv);
    if (sliding_window) refuse("--window-size (Qwen3-Next has no sliding window)");
    if (use_rope_scaling) refuse("--use-rope-scaling (Llama 3's RoPE scaling is Llama's)");
    if (rotary_interleaved) refuse("--rotary-interleaved (Qwen3-Next rotates halves)");
  }
  if (sliding_window && *sliding_window < 1) fail("HF mapping: sliding window {} (must be >= 1)", *sliding_window);
  if (!window_layers.empty() && static_cast<int>(window_layers.size()) != num_layers)
    fail("HF mapping: {} per-layer window entries for {} layers", window_layers.size(), num_layers);
  if (sliding_window && (arch == HfArchitecture::gpt2 || arch == HfArchitecture::llama || arch == HfArchitecture::nemotron))
    refuse("--window-size (the HF model has no sliding window; Llama-shaped models with one export as "
           "MistralForCausalLM, Qwen2-shaped ones as Qwen2ForCausalLM)");
  if (num_experts > 0 && arch != HfArchitecture::mixtral && !deepseek && !qwen_moe)
    refuse("--num-experts (a mixture of experts exports as MixtralForCausalLM, Qwen2MoeForCausalLM (with "
           "--add-qkv-bias), Qwen3MoeForCausalLM (with --qk-layernorm), or with --multi-latent-attention as "
           "DeepseekV3ForCausalLM)");
  if (num_experts > 0 && add_bias_linear)
    refuse("linear biases in MoE layers (the router's and the experts' biases have no place in Mixtral, Qwen2-MoE, "
           "Qwen3-MoE or DeepSeek-V3: pass --disable-bias-linear)");
  if (!moe_layers.empty() && static_cast<int>(moe_layers.size()) != num_layers)
    fail("HF mapping: {} per-layer MoE entries for {} layers", moe_layers.size(), num_layers);
  if (deepseek) {
    // transformers' DeepseekV3ForCausalLM: RMSNorm, MLA with both latent norms, SwiGLU, no biases.
    if (layernorm) refuse("--normalization LayerNorm (DeepSeek-V3 uses RMSNorm)");
    if (!swiglu) refuse("a non-SwiGLU MLP (pass --swiglu)");
    if (add_bias_linear) refuse("linear biases (DeepSeek-V3 has none: pass --disable-bias-linear)");
    if (!mla_latent_norms) refuse("multi-latent attention without --qk-layernorm (DeepSeek-V3 normalizes its latents)");
    if (q_lora_rank == 0) refuse("--q-lora-rank none with the latent norms (DeepSeek-V3's q_proj has no norm)");
    if (kv_lora_rank <= 0 || qk_nope_head_dim <= 0 || qk_rope_head_dim <= 0 || qk_rope_head_dim % 2 != 0 ||
        v_head_dim <= 0)
      fail("HF mapping: MLA ranks q {} kv {}, head dims {} + {} (even), value {}", q_lora_rank, kv_lora_rank,
           qk_nope_head_dim, qk_rope_head_dim, v_head_dim);
    if (rotary_percent != 1.0) refuse("--rotary-percent != 1 (DeepSeek-V3 rotates the whole RoPE part)");
    if (first_dense_layers < num_layers &&
        (num_experts <= 0 || moe_topk <= 0 || moe_topk > num_experts || moe_ffn_hidden_size <= 0))
      fail("HF mapping: DeepSeek-V3 with {} experts, top-{}, expert FFN {}", num_experts, moe_topk, moe_ffn_hidden_size);
    if (!moe_unexpressible.empty()) refuse(moe_unexpressible.front());
    if (sliding_window) refuse("--window-size (DeepSeek-V3 has no sliding window)");
    if (use_rope_scaling) refuse("--use-rope-scaling (Llama 3's RoPE scaling is Llama's)");
    return;
  }
  if (arch == HfArchitecture::mixtral || (qwen_moe && (!next || num_experts > 0))) {
    const bool gated_shared = arch == HfArchitecture::qwen2_moe || next;
    if (num_experts <= 0 || moe_topk <= 0 || moe_topk > num_experts || moe_ffn_hidden_size <= 0)
      fail("HF mapping: {} with {} experts, top-{}, expert FFN {}", model, num_experts, moe_topk, moe_ffn_hidden_size);
    if (!moe_unexpressible.empty()) refuse(moe_unexpressible.front());
    if (gated_shared && (shared_expert_ffn <= 0 || !shared_expert_gate))
      refuse("a shared expert without its sigmoid gate (every MoE layer of the HF model has a gated shared expert: "
             "--moe-shared-expert-intermediate-size with --moe-shared-expert-gate)");
    if (!gated_shared && shared_expert_ffn > 0)
      refuse("--moe-shared-expert-intermediate-size (the HF model has no shared expert)");
    if (arch == HfArchitecture::qwen2_moe && sliding_window)
      refuse("--window-size (transformers windows different Qwen2-MoE layers in different versions)");
    if (arch == HfArchitecture::qwen3_moe && !window_layers.empty())
      refuse("--window-attn-skip-freq (Qwen3-MoE's sliding window is on every layer)");
  }
  if (arch == HfArchitecture::mistral || arch == HfArchitecture::mixtral) {
    if (!window_layers.empty()) refuse("--window-attn-skip-freq (Mistral has one sliding window for every layer)");
    if (add_bias_linear || add_qkv_bias) refuse("linear biases (Mistral has none)");
    if (use_rope_scaling) refuse("--use-rope-scaling (Llama 3's RoPE scaling is Llama's)");
  }

  if (arch == HfArchitecture::nemotron) {
    // transformers' NemotronForCausalLM: LayerNorm1P (weight stored zero-centred, as Megatron's
    // --apply-layernorm-1p) with bias, q/k/v/o and up/down projections (no gate), relu2, and
    // rotate-half RoPE over the first partial_rotary_factor of each head.
    if (!layernorm) refuse("--normalization RMSNorm (Nemotron uses LayerNorm1P)");
    if (!apply_layernorm_1p) refuse("LayerNorm without --apply-layernorm-1p (Nemotron's norms are LayerNorm1P)");
    if (!squared_relu) refuse("a non-squared-ReLU MLP (pass --squared-relu)");
    if (learned_position_embeddings) refuse("learned absolute position embeddings (Nemotron uses RoPE)");
    if (add_qkv_bias && !add_bias_linear) refuse("--add-qkv-bias alone (Nemotron's attention_bias covers q, k, v and o)");
    if (use_rope_scaling) refuse("--use-rope-scaling (Llama 3's RoPE scaling is Llama's)");
    if (rotary_interleaved) refuse("--rotary-interleaved (Nemotron rotates halves)");
    if (head_dim % 2 != 0) refuse("an odd head dimension with RoPE");
  } else if (arch == HfArchitecture::gpt2) {
    if (!layernorm) refuse("--normalization RMSNorm (GPT-2 uses LayerNorm)");
    if (!learned_position_embeddings) refuse("--position-embedding-type other than learned_absolute");
    if (swiglu) refuse("--swiglu (GPT-2's MLP is GeLU)");
    if (!add_bias_linear) refuse("--disable-bias-linear (GPT-2's linear layers have biases)");
    if (num_query_groups != num_attention_heads) refuse("--group-query-attention");
    if (head_dim * num_attention_heads != hidden_size) refuse("--kv-channels * heads != hidden size");
  } else {
    if (layernorm) refuse("--normalization LayerNorm (Llama uses RMSNorm)");
    if (learned_position_embeddings) refuse("learned absolute position embeddings (Llama uses RoPE)");
    if (!swiglu) refuse("a non-SwiGLU MLP (pass --swiglu)");
    const bool qwen2 = arch == HfArchitecture::qwen2 || arch == HfArchitecture::qwen2_moe;
    if (qwen3 && add_bias_linear) refuse("linear biases (Qwen3's MLP has none: pass --disable-bias-linear)");
    if (!qwen2 && add_qkv_bias && !add_bias_linear)
      refuse("--add-qkv-bias alone (HF's attention_bias covers q, k, v and o; Qwen2ForCausalLM has q/k/v biases only)");
    if (qwen2 && (add_bias_linear || !add_qkv_bias))
      refuse("linear biases other than q/k/v's (Qwen2 has --add-qkv-bias with --disable-bias-linear)");
    if (rotary_percent != 1.0 && !next) refuse("--rotary-percent != 1 (HF Llama rotates the whole head)");
    if (head_dim % 2 != 0) refuse("an odd head dimension with RoPE");
  }
}

// ---------------------------------------------------------------------------------------------
// Names

std::vector<HfTensorMapping> hf_tensor_mappings(const HfModelSpec& s) {
  s.validate();
  const bool gpt2 = s.arch == HfArchitecture::gpt2;
  const int64_t h = s.hidden_size, d = s.head_dim, H = s.num_attention_heads, G = s.num_query_groups;
  const int64_t f = s.ffn_hidden_size, V = s.vocab_size, Vp = s.padded_vocab_size;
  const int64_t qkv_rows = (H + 2 * G) * d;
  std::vector<HfTensorMapping> out;
  auto add = [&](std::string ours, std::vector<int64_t> our_shape, std::vector<std::string> hf,
                 std::vector<std::vector<int64_t>> hf_shapes, HfTransform t) {
    out.push_back({std::move(ours), std::move(our_shape), std::move(hf), std::move(hf_shapes), t});
  };
  const bool nemotron = s.arch == HfArchitecture::nemotron;
  // Nemotron's LayerNorm1P stores gamma - 1 as Megatron's --apply-layernorm-1p does.
  // So do Qwen3-Next's norms (x / rms * (1 + w)), all but its Gated DeltaNet output norm.
  const bool next = s.arch == HfArchitecture::qwen3_next;
  const HfTransform norm = s.apply_layernorm_1p && !nemotron && !next ? HfTransform::norm_1p : HfTransform::copy;

  add("embedding.word_embeddings.weight", {Vp, h}, {gpt2 ? "transformer.wte.weight" : "model.embed_tokens.weight"},
      {{V, h}}, HfTransform::vocab_rows);
  if (gpt2)
    add("embedding.position_embeddings.weight", {s.max_position_embeddings, h}, {"transformer.wpe.weight"},
        {{s.max_position_embeddings, h}}, HfTransform::copy);
  // SwiGLU MLP weights: ours [gate; up] and down <-> gate_proj, up_proj, down_proj.
  auto swiglu_mlp = [&](const std::string& ours, const std::string& hf, int64_t ffn) {
    add(ours + "linear_fc1.weight", {2 * ffn, h}, {hf + "gate_proj.weight", hf + "up_proj.weight"}, {{ffn, h}, {ffn, h}},
        HfTransform::fc1_split);
    add(ours + "linear_fc2.weight", {h, ffn}, {hf + "down_proj.weight"}, {{h, ffn}}, HfTransform::copy);
  };
  // An MoE layer's experts: our stacked fc1 ([gate; up] per expert) and fc2 <-> each expert's
  // HF tensors under `prefix` + e + "." named gate, up, down (Mixtral's w1, w3, w2).
  auto experts = [&](const std::string& L, const std::string& prefix, const std::array<const char*, 3>& names) {
    const int64_t E = s.num_experts, fe = s.moe_ffn_hidden_size;
    std::vector<std::string> fc1, fc2;
    std::vector<std::vector<int64_t>> fc1_shapes, fc2_shapes;
    for (int64_t e = 0; e < E; ++e) {
      const std::string X = fmt::format("{}{}.", prefix, e);
      fc1.insert(fc1.end(), {X + names[0] + ".weight", X + names[1] + ".weight"});
      fc1_shapes.insert(fc1_shapes.end(), {{fe, h}, {fe, h}});
      fc2.push_back(X + names[2] + ".weight");
      fc2_shapes.push_back({h, fe});
    }
    add(L + "mlp.experts.linear_fc1.weight", {E * 2 * fe, h}, fc1, fc1_shapes, HfTransform::fc1_split);
    add(L + "mlp.experts.linear_fc2.weight", {E * h, fe}, fc2, fc2_shapes, HfTransform::fc1_split);
  };
  // One DeepSeek-V3 decoder layer: ours under L, HF's under P; its MLP dense or MoE (the expert
  // bias under the name `bias`: ours keys it by the layer's global index).
  auto deepseek_layer = [&](const std::string& L, const std::string& P, bool dense, const std::string& bias) {
    // Multi-latent attention: the standalone input norm, q down (q_a_proj), its latent norm and
    // up projection (q_b_proj, per head [nope; rope]), kv down with the shared RoPE key
    // ([c_kv; k_rope]: kv_a_proj_with_mqa), its latent norm and up projection (per head
    // [k_nope; v]: kv_b_proj), o_proj.
    const std::string A = P + "self_attn.";
    const int64_t ql = s.q_lora_rank, kvl = s.kv_lora_rank, dq = s.qk_nope_head_dim + s.qk_rope_head_dim;
    const int64_t dkv = s.qk_nope_head_dim + s.v_head_dim;
    add(L + "input_layernorm.weight", {h}, {P + "input_layernorm.weight"}, {{h}}, HfTransform::copy);
    add(L + "self_attention.linear_q_down_proj.weight", {ql, h}, {A + "q_a_proj.weight"}, {{ql, h}}, HfTransform::copy);
    add(L + "self_attention.linear_q_up_proj.layer_norm_weight", {ql}, {A + "q_a_layernorm.weight"}, {{ql}},
        HfTransform::copy);
    add(L + "self_attention.linear_q_up_proj.weight", {H * dq, ql}, {A + "q_b_proj.weight"}, {{H * dq, ql}},
        HfTransform::mla_q_rope);
    add(L + "self_attention.linear_kv_down_proj.weight", {kvl + s.qk_rope_head_dim, h}, {A + "kv_a_proj_with_mqa.weight"},
        {{kvl + s.qk_rope_head_dim, h}}, HfTransform::mla_kv_rope);
    add(L + "self_attention.linear_kv_up_proj.layer_norm_weight", {kvl}, {A + "kv_a_layernorm.weight"}, {{kvl}},
        HfTransform::copy);
    add(L + "self_attention.linear_kv_up_proj.weight", {H * dkv, kvl}, {A + "kv_b_proj.weight"}, {{H * dkv, kvl}},
        HfTransform::copy);
    add(L + "self_attention.linear_proj.weight", {h, H * s.v_head_dim}, {A + "o_proj.weight"}, {{h, H * s.v_head_dim}},
        HfTransform::copy);
    if (dense) {  // a dense SwiGLU MLP behind the fused pre-MLP norm
      add(L + "mlp.linear_fc1.layer_norm_weight", {h}, {P + "post_attention_layernorm.weight"}, {{h}}, HfTransform::copy);
      swiglu_mlp(L + "mlp.", P + "mlp.", f);
      return;
    }
    // The MoE layer: its standalone pre-MLP norm, the router (gate) and its expert bias
    // (e_score_correction_bias, zeros without one), the experts and the shared experts.
    const int64_t E = s.num_experts;
    add(L + "pre_mlp_layernorm.weight", {h}, {P + "post_attention_layernorm.weight"}, {{h}}, HfTransform::copy);
    add(L + "mlp.router.weight", {E, h}, {P + "mlp.gate.weight"}, {{E, h}}, HfTransform::copy);
    add(s.expert_bias ? bias : std::string(), {E}, {P + "mlp.gate.e_score_correction_bias"},
        {{E}}, s.expert_bias ? HfTransform::copy : HfTransform::zeros);
    experts(L, P + "mlp.experts.", {"gate_proj", "up_proj", "down_proj"});
    if (s.shared_expert_ffn > 0) swiglu_mlp(L + "mlp.shared_experts.", P + "mlp.shared_experts.", s.shared_expert_ffn);
  };
  for (int i = 0; i < s.num_layers; ++i) {
    const std::string L = fmt::format("decoder.layers.{}.", i);
    const std::string P = gpt2 ? fmt::format("transformer.h.{}.", i) : fmt::format("model.layers.{}.", i);
    if (s.arch == HfArchitecture::deepseek_v3) {
      deepseek_layer(L, P, i < s.first_dense_layers, L + "mlp.router.expert_bias");
      continue;
    }
    if (gpt2) {
      add(L + "self_attention.linear_qkv.layer_norm_weight", {h}, {P + "ln_1.weight"}, {{h}}, norm);
      add(L + "self_attention.linear_qkv.layer_norm_bias", {h}, {P + "ln_1.bias"}, {{h}}, HfTransform::copy);
      add(L + "self_attention.linear_qkv.weight", {qkv_rows, h}, {P + "attn.c_attn.weight"}, {{h, 3 * h}},
          HfTransform::qkv_c_attn);
      add(L + "self_attention.linear_qkv.bias", {qkv_rows}, {P + "attn.c_attn.bias"}, {{3 * h}},
          HfTransform::qkv_c_attn_bias);
      add(L + "self_attention.linear_proj.weight", {h, H * d}, {P + "attn.c_proj.weight"}, {{H * d, h}},
          HfTransform::transpose);
      add(L + "self_attention.linear_proj.bias", {h}, {P + "attn.c_proj.bias"}, {{h}}, HfTransform::copy);
      add(L + "mlp.linear_fc1.layer_norm_weight", {h}, {P + "ln_2.weight"}, {{h}}, norm);
      add(L + "mlp.linear_fc1.layer_norm_bias", {h}, {P + "ln_2.bias"}, {{h}}, HfTransform::copy);
      add(L + "mlp.linear_fc1.weight", {f, h}, {P + "mlp.c_fc.weight"}, {{h, f}}, HfTransform::transpose);
      add(L + "mlp.linear_fc1.bias", {f}, {P + "mlp.c_fc.bias"}, {{f}}, HfTransform::copy);
      add(L + "mlp.linear_fc2.weight", {h, f}, {P + "mlp.c_proj.weight"}, {{f, h}}, HfTransform::transpose);
      add(L + "mlp.linear_fc2.bias", {h}, {P + "mlp.c_proj.bias"}, {{h}}, HfTransform::copy);
    } else {
      const std::string A = P + "self_attn.";
      if (next && s.gdn_layers.at(static_cast<size_t>(i))) {
        // A Gated DeltaNet layer (linear_attn): the input norm fused into our in_proj, whose rows per
        // key head are [q k v z | beta alpha]: HF's in_proj_qkvz and in_proj_ba; the depthwise
        // convolution (HF Conv1d [C, 1, K], channels [all q | all k | all v]); dt_bias, A_log; the
        // gated output norm (HF's weight plain, ours zero-centred) and out_proj.
        const std::string N = P + "linear_attn.";
        const int64_t kh = s.gdn_key_heads, nv = s.gdn_value_heads, rep = nv / kh, dk = s.gdn_dk, dv = s.gdn_dv;
        const int64_t qkvz = 2 * dk + 2 * rep * dv, conv_ch = kh * (2 * dk + rep * dv);
        add(L + "self_attention.in_proj.layer_norm_weight", {h}, {P + "input_layernorm.weight"}, {{h}}, norm);
        add(L + "self_attention.in_proj.weight", {kh * (qkvz + 2 * rep), h}, {N + "in_proj_qkvz.weight", N + "in_proj_ba.weight"},
            {{kh * qkvz, h}, {kh * 2 * rep, h}}, HfTransform::gdn_in_proj);
        add(L + "self_attention.conv1d.weight", {conv_ch, s.gdn_conv}, {N + "conv1d.weight"}, {{conv_ch, 1, s.gdn_conv}},
            HfTransform::gdn_conv);
        add(L + "self_attention.dt_bias", {nv}, {N + "dt_bias"}, {{nv}}, HfTransform::copy);
        add(L + "self_attention.A_log", {nv}, {N + "A_log"}, {{nv}}, HfTransform::copy);
        add(L + "self_attention.out_norm.weight", {dv}, {N + "norm.weight"}, {{dv}}, HfTransform::norm_1p);
        add(L + "self_attention.out_proj.weight", {h, nv * dv}, {N + "out_proj.weight"}, {{h, nv * dv}}, HfTransform::copy);
      } else if (next) {  // gated softmax attention: q_proj holds each head's [q | gate]
        add(L + "self_attention.linear_qkv.layer_norm_weight", {h}, {P + "input_layernorm.weight"}, {{h}}, norm);
        add(L + "self_attention.linear_qkv.weight", {qkv_rows + H * d, h},
            {A + "q_proj.weight", A + "k_proj.weight", A + "v_proj.weight"}, {{2 * H * d, h}, {G * d, h}, {G * d, h}},
            HfTransform::qkvg_split);
      } else {
        add(L + "self_attention.linear_qkv.layer_norm_weight", {h}, {P + "input_layernorm.weight"}, {{h}}, norm);
        if (nemotron)
          add(L + "self_attention.linear_qkv.layer_norm_bias", {h}, {P + "input_layernorm.bias"}, {{h}}, HfTransform::copy);
        add(L + "self_attention.linear_qkv.weight", {qkv_rows, h},
            {A + "q_proj.weight", A + "k_proj.weight", A + "v_proj.weight"}, {{H * d, h}, {G * d, h}, {G * d, h}},
            HfTransform::qkv_split);
      }
      const bool softmax_layer = !(next && s.gdn_layers.at(static_cast<size_t>(i)));
      if (softmax_layer && (s.add_bias_linear || s.add_qkv_bias))
        add(L + "self_attention.linear_qkv.bias", {qkv_rows}, {A + "q_proj.bias", A + "k_proj.bias", A + "v_proj.bias"},
            {{H * d}, {G * d}, {G * d}}, HfTransform::qkv_split);
      if (softmax_layer)
        add(L + "self_attention.linear_proj.weight", {h, H * d}, {A + "o_proj.weight"}, {{h, H * d}}, HfTransform::copy);
      if (softmax_layer && s.add_bias_linear)
        add(L + "self_attention.linear_proj.bias", {h}, {A + "o_proj.bias"}, {{h}}, HfTransform::copy);
      if (softmax_layer && s.qk_layernorm) {  // Qwen3: one RMSNorm weight over head_dim for every q head, one for every k head
        add(L + "self_attention.q_layernorm.weight", {d}, {A + "q_norm.weight"}, {{d}}, HfTransform::copy);
        add(L + "self_attention.k_layernorm.weight", {d}, {A + "k_norm.weight"}, {{d}}, HfTransform::copy);
      }
      if (hf_is_qwen_moe(s.arch) && s.is_moe_layer(i)) {
        // Qwen's sparse MoE block: the standalone pre-MLP norm, the router (gate), each expert's
        // gate/up/down_proj, and Qwen2-MoE's shared expert with its sigmoid gate [1, h].
        const int64_t E = s.num_experts;
        add(L + "pre_mlp_layernorm.weight", {h}, {P + "post_attention_layernorm.weight"}, {{h}}, norm);
        add(L + "mlp.router.weight", {E, h}, {P + "mlp.gate.weight"}, {{E, h}}, HfTransform::copy);
        experts(L, P + "mlp.experts.", {"gate_proj", "up_proj", "down_proj"});
        if (s.shared_expert_ffn > 0) {
          swiglu_mlp(L + "mlp.shared_experts.", P + "mlp.shared_expert.", s.shared_expert_ffn);
          add(L + "mlp.shared_experts.gate_weight", {1, h}, {P + "mlp.shared_expert_gate.weight"}, {{1, h}},
              HfTransform::copy);
        }
        continue;
      }
      if (s.arch == HfArchitecture::mixtral) {
        // The MoE block: its own pre-MLP norm, the router, each expert's w1 (gate), w3 (up) and w2
        // (down) as rows of our stacked expert weights.
        const int64_t E = s.num_experts;
        const std::string B = P + "block_sparse_moe.";
        add(L + "pre_mlp_layernorm.weight", {h}, {P + "post_attention_layernorm.weight"}, {{h}}, norm);
        add(L + "mlp.router.weight", {E, h}, {B + "gate.weight"}, {{E, h}}, HfTransform::copy);
        experts(L, B + "experts.", {"w1", "w3", "w2"});
        continue;
      }
      add(L + "mlp.linear_fc1.layer_norm_weight", {h}, {P + "post_attention_layernorm.weight"}, {{h}}, norm);
      if (nemotron) {
        add(L + "mlp.linear_fc1.layer_norm_bias", {h}, {P + "post_attention_layernorm.bias"}, {{h}}, HfTransform::copy);
        add(L + "mlp.linear_fc1.weight", {f, h}, {P + "mlp.up_proj.weight"}, {{f, h}}, HfTransform::copy);
        if (s.add_bias_linear) add(L + "mlp.linear_fc1.bias", {f}, {P + "mlp.up_proj.bias"}, {{f}}, HfTransform::copy);
      } else {
        add(L + "mlp.linear_fc1.weight", {2 * f, h}, {P + "mlp.gate_proj.weight", P + "mlp.up_proj.weight"},
            {{f, h}, {f, h}}, HfTransform::fc1_split);
        if (s.add_bias_linear)
          add(L + "mlp.linear_fc1.bias", {2 * f}, {P + "mlp.gate_proj.bias", P + "mlp.up_proj.bias"}, {{f}, {f}},
              HfTransform::fc1_split);
      }
      add(L + "mlp.linear_fc2.weight", {h, f}, {P + "mlp.down_proj.weight"}, {{h, f}}, HfTransform::copy);
      if (s.add_bias_linear) add(L + "mlp.linear_fc2.bias", {h}, {P + "mlp.down_proj.bias"}, {{h}}, HfTransform::copy);
    }
  }
  // DeepSeek-V3's multi-token prediction depths, as its checkpoints hold them (model.layers.{L + j},
  // which inference engines read for speculative decoding and transformers leaves unused): a copy
  // of the embedding, enorm, hnorm, eh_proj ([h, 2h] over [embedding; hidden], as Megatron's), the
  // decoder layer, shared_head.norm (our final norm of the depth) and a copy of the output layer.
  if (s.arch == HfArchitecture::deepseek_v3)
    for (int j = 0; j < s.mtp_layers; ++j) {
      const std::string M = fmt::format("mtp.layers.{}.", j), P = fmt::format("model.layers.{}.", s.num_layers + j);
      add("embedding.word_embeddings.weight", {Vp, h}, {P + "embed_tokens.weight"}, {{V, h}}, HfTransform::vocab_rows_copy);
      add(M + "enorm.weight", {h}, {P + "enorm.weight"}, {{h}}, HfTransform::copy);
      add(M + "hnorm.weight", {h}, {P + "hnorm.weight"}, {{h}}, HfTransform::copy);
      add(M + "eh_proj.weight", {h, 2 * h}, {P + "eh_proj.weight"}, {{h, 2 * h}}, HfTransform::copy);
      deepseek_layer(M + "transformer_layer.", P, s.first_dense_layers >= s.num_layers,
                     fmt::format("decoder.layers.{}.mlp.router.expert_bias", s.num_layers + j));
      add(M + "final_layernorm.weight", {h}, {P + "shared_head.norm.weight"}, {{h}}, HfTransform::copy);
      add(s.untie_embeddings_and_output_weights ? "output_layer.weight" : "embedding.word_embeddings.weight", {Vp, h},
          {P + "shared_head.head.weight"}, {{V, h}}, HfTransform::vocab_rows_copy);
    }
  add("decoder.final_layernorm.weight", {h}, {gpt2 ? "transformer.ln_f.weight" : "model.norm.weight"}, {{h}}, norm);
  if (gpt2) add("decoder.final_layernorm.bias", {h}, {"transformer.ln_f.bias"}, {{h}}, HfTransform::copy);
  if (nemotron) add("decoder.final_layernorm.bias", {h}, {"model.norm.bias"}, {{h}}, HfTransform::copy);
  if (s.untie_embeddings_and_output_weights)
    add("output_layer.weight", {Vp, h}, {"lm_head.weight"}, {{V, h}}, HfTransform::vocab_rows);
  return out;
}

// ---------------------------------------------------------------------------------------------
// config.json

namespace {

// The keys DeepSeek-V3's and Qwen3-Next's configs write alike (SwiGLU, RMSNorm, plain RoPE).
void silu_rope_keys(json& c, const HfModelSpec& s) {
  c["vocab_size"] = s.vocab_size;
  c["hidden_size"] = s.hidden_size;
  c["num_hidden_layers"] = s.num_layers;
  c["num_attention_heads"] = s.num_attention_heads;
  c["hidden_act"] = "silu";
  c["max_position_embeddings"] = s.max_position_embeddings;
  c["initializer_range"] = s.init_method_std;
  c["rms_norm_eps"] = s.norm_epsilon;
  c["rope_theta"] = s.rotary_base;
  c["rope_scaling"] = nullptr;
}

// Qwen's MoE keys: MoE on every layer but mlp_only_layers (decoder_sparse_step 1), and the gated
// shared expert's size where the family has one.
void qwen_moe_keys(json& c, const HfModelSpec& s) {
  c["num_experts"] = s.num_experts;
  c["num_experts_per_tok"] = s.moe_topk;
  c["moe_intermediate_size"] = s.moe_ffn_hidden_size;
  c["norm_topk_prob"] = s.norm_topk_prob;
  c["decoder_sparse_step"] = 1;
  json dense = json::array();
  for (int layer = 0; layer < s.num_layers; ++layer)
    if (!s.is_moe_layer(layer)) dense.push_back(layer);
  c["mlp_only_layers"] = dense;
  c["router_aux_loss_coef"] = s.router_aux_loss_coef;
  c["output_router_logits"] = false;
  if (s.arch == HfArchitecture::qwen2_moe || s.arch == HfArchitecture::qwen3_next)
    c["shared_expert_intermediate_size"] = s.num_experts > 0 ? s.shared_expert_ffn : 0;
}

}  // namespace

json hf_config_json(const HfModelSpec& s) {
  s.validate();
  json c;
  if (s.arch == HfArchitecture::gpt2) {
    c["architectures"] = {"GPT2LMHeadModel"};
    c["model_type"] = "gpt2";
    c["vocab_size"] = s.vocab_size;
    c["n_positions"] = s.max_position_embeddings;
    c["n_ctx"] = s.max_position_embeddings;
    c["n_embd"] = s.hidden_size;
    c["n_layer"] = s.num_layers;
    c["n_head"] = s.num_attention_heads;
    c["n_inner"] = s.ffn_hidden_size == 4 * s.hidden_size ? json(nullptr) : json(s.ffn_hidden_size);
    c["activation_function"] = s.gelu_activation;
    c["resid_pdrop"] = s.hidden_dropout;
    c["embd_pdrop"] = s.hidden_dropout;
    c["attn_pdrop"] = s.attention_dropout;
    c["layer_norm_epsilon"] = s.norm_epsilon;
    c["initializer_range"] = s.init_method_std;
    c["scale_attn_weights"] = true;
    c["scale_attn_by_inverse_layer_idx"] = false;
    c["reorder_and_upcast_attn"] = false;
  } else if (s.arch == HfArchitecture::qwen3_next) {
    const bool moe = s.num_experts > 0;
    c["architectures"] = {"Qwen3NextForCausalLM"};
    c["model_type"] = "qwen3_next";
    silu_rope_keys(c, s);
    c["intermediate_size"] = s.ffn_hidden_size;
    c["num_key_value_heads"] = s.num_query_groups;
    c["head_dim"] = s.head_dim;
    c["partial_rotary_factor"] = s.rotary_percent;
    c["attention_bias"] = false;
    c["attention_dropout"] = s.attention_dropout;
    json types = json::array();
    for (int layer = 0; layer < s.num_layers; ++layer)
      types.push_back(s.gdn_layers.at(static_cast<size_t>(layer)) ? "linear_attention" : "full_attention");
    c["layer_types"] = types;
    c["linear_conv_kernel_dim"] = s.gdn_conv;
    c["linear_key_head_dim"] = s.gdn_dk;
    c["linear_value_head_dim"] = s.gdn_dv;
    c["linear_num_key_heads"] = s.gdn_key_heads;
    c["linear_num_value_heads"] = s.gdn_value_heads;
    qwen_moe_keys(c, s);  // (a dense model lists every layer in mlp_only_layers)
    if (!moe) {
      c["num_experts_per_tok"] = 1;
      c["moe_intermediate_size"] = s.ffn_hidden_size;
    }
  } else if (s.arch == HfArchitecture::deepseek_v3) {
    // (Dense-only models carry MoE fields the dense layers never read.)
    const bool moe = s.first_dense_layers < s.num_layers;
    c["architectures"] = {"DeepseekV3ForCausalLM"};
    c["model_type"] = "deepseek_v3";
    silu_rope_keys(c, s);
    c["intermediate_size"] = s.ffn_hidden_size;
    c["moe_intermediate_size"] = moe ? s.moe_ffn_hidden_size : s.ffn_hidden_size;
    c["num_key_value_heads"] = s.num_attention_heads;
    c["n_shared_experts"] = moe ? s.shared_expert_ffn / s.moe_ffn_hidden_size : 0;
    c["n_routed_experts"] = moe ? s.num_experts : 1;
    c["num_experts_per_tok"] = moe ? s.moe_topk : 1;
    c["routed_scaling_factor"] = s.routed_scaling_factor;
    c["n_group"] = s.router_groups;
    c["topk_group"] = s.router_group_topk;
    // Megatron renormalizes sigmoid top-k scores when it picks more than one expert.
    c["norm_topk_prob"] = moe && s.moe_topk > 1;
    c["first_k_dense_replace"] = s.first_dense_layers;
    c["num_nextn_predict_layers"] = s.mtp_layers;
    c["q_lora_rank"] = s.q_lora_rank > 0 ? json(s.q_lora_rank) : json(nullptr);
    c["kv_lora_rank"] = s.kv_lora_rank;
    c["qk_nope_head_dim"] = s.qk_nope_head_dim;
    c["qk_rope_head_dim"] = s.qk_rope_head_dim;
    c["v_head_dim"] = s.v_head_dim;
    c["head_dim"] = s.qk_rope_head_dim;
    c["rope_interleave"] = s.rope_interleave;
    if (s.yarn) {
      // transformers takes the factor as max_position_embeddings / original_max_position_embeddings
      // when the latter is given (DeepSeek-V3's config): given only where that ratio is the factor.
      json y = {{"type", "yarn"}, {"rope_type", "yarn"}, {"factor", s.yarn_factor}, {"beta_fast", 32}, {"beta_slow", 1},
                {"mscale", s.yarn_mscale}, {"mscale_all_dim", s.yarn_mscale_all_dim}};
      const double whole = s.yarn_factor * s.yarn_original_max_position_embeddings;
      if (whole == std::floor(whole) && whole >= s.max_position_embeddings) {
        y["original_max_position_embeddings"] = s.yarn_original_max_position_embeddings;
        c["max_position_embeddings"] = static_cast<int64_t>(whole);
      } else {
        c["max_position_embeddings"] = s.yarn_original_max_position_embeddings;
      }
      c["rope_scaling"] = y;
    }
    c["attention_bias"] = false;
    c["attention_dropout"] = s.attention_dropout;
  } else {
    const bool qwen = hf_is_qwen(s.arch), qwen_moe = hf_is_qwen_moe(s.arch), mixtral = s.arch == HfArchitecture::mixtral,
               mistral = s.arch == HfArchitecture::mistral || mixtral, nemotron = s.arch == HfArchitecture::nemotron;
    c["architectures"] = {hf_architecture_name(s.arch)};
    c["model_type"] = hf_model_type(s.arch);
    c["vocab_size"] = s.vocab_size;
    c["hidden_size"] = s.hidden_size;
    c["intermediate_size"] = mixtral ? s.moe_ffn_hidden_size : s.ffn_hidden_size;
    if (mixtral) {
      c["num_local_experts"] = s.num_experts;
      c["num_experts_per_tok"] = s.moe_topk;
      c["router_aux_loss_coef"] = s.router_aux_loss_coef;
      c["output_router_logits"] = false;
      c["router_jitter_noise"] = 0.0;
    }
    if (qwen_moe) qwen_moe_keys(c, s);
    c["num_hidden_layers"] = s.num_layers;
    c["num_attention_heads"] = s.num_attention_heads;
    c["num_key_value_heads"] = s.num_query_groups;
    c["head_dim"] = s.head_dim;
    c["hidden_act"] = nemotron ? "relu2" : "silu";
    c["max_position_embeddings"] = s.max_position_embeddings;
    c["initializer_range"] = s.init_method_std;
    c[nemotron ? "norm_eps" : "rms_norm_eps"] = s.norm_epsilon;
    c["rope_theta"] = s.rotary_base;
    if (nemotron) c["partial_rotary_factor"] = s.rotary_percent;
    // Megatron's --use-rope-scaling is Llama 3.1's scheme with fixed low/high frequency factors
    // 1 and 4 and an original context of 8192 (rotary_pos_embedding.py _apply_scaling).
    c["rope_scaling"] = s.use_rope_scaling ? json{{"rope_type", "llama3"},
                                                  {"factor", s.rope_scaling_factor},
                                                  {"low_freq_factor", 1.0},
                                                  {"high_freq_factor", 4.0},
                                                  {"original_max_position_embeddings", 8192}}
                                           : json(nullptr);
    c["attention_dropout"] = s.attention_dropout;
    const json window = s.sliding_window ? json(*s.sliding_window) : json(nullptr);
    if (s.arch == HfArchitecture::qwen3_moe) {  // (a window on every layer or none)
      c["attention_bias"] = false;
      c["use_sliding_window"] = s.sliding_window.has_value();
      c["sliding_window"] = window;
    } else if (qwen) {  // (Qwen2's q/k/v biases are implied; Qwen2-MoE says so)
      if (s.arch == HfArchitecture::qwen2_moe) c["qkv_bias"] = true;
      // The first max_window_layers layers attend fully; layer_types (transformers >= 4.53) says
      // the same per layer. Older readers know only max_window_layers, so the windowed layers must
      // be the last ones (import takes any layer_types).
      if (s.arch == HfArchitecture::qwen3) c["attention_bias"] = false;
      int full_layers = s.sliding_window ? 0 : s.num_layers;
      if (!s.window_layers.empty()) {
        const auto first = std::find(s.window_layers.begin(), s.window_layers.end(), 1);
        if (std::find(first, s.window_layers.end(), 0) != s.window_layers.end())
          throw Unsupported(fmt::format("cannot express this model as {}: --window-attn-skip-freq with a "
                                        "full-attention layer after a windowed one (Qwen's windowed layers are the "
                                        "last ones, from max_window_layers on)", hf_architecture_name(s.arch)));
        full_layers = static_cast<int>(first - s.window_layers.begin());
      }
      c["use_sliding_window"] = s.sliding_window.has_value();
      c["sliding_window"] = window;
      c["max_window_layers"] = full_layers;
      json types = json::array();
      for (int layer = 0; layer < s.num_layers; ++layer)
        types.push_back(layer >= full_layers ? "sliding_attention" : "full_attention");
      c["layer_types"] = types;
    } else if (mistral) {
      c["sliding_window"] = window;
    } else {  // Llama, Nemotron
      c["attention_bias"] = s.add_bias_linear;
      c["mlp_bias"] = s.add_bias_linear;
      if (!nemotron) c["pretraining_tp"] = 1;
    }
  }
  c["tie_word_embeddings"] = !s.untie_embeddings_and_output_weights;
  c["use_cache"] = true;
  c["bos_token_id"] = s.bos_token_id ? json(*s.bos_token_id) : json(nullptr);
  c["eos_token_id"] = s.eos_token_id ? json(*s.eos_token_id) : json(nullptr);
  c["torch_dtype"] = s.torch_dtype;
  return c;
}

namespace {

// The sliding windows of a Llama-family config. Mistral: sliding_window on every layer (null: none).
// Qwen2 and Qwen3 (as transformers reads them): only with use_sliding_window, on the layers
// layer_types names "sliding_attention", or without layer_types from max_window_layers on (default
// 28). Qwen configs often carry a sliding_window with use_sliding_window false: no window then; an
// absent size is transformers' 4096. Qwen3-MoE: use_sliding_window windows every layer. Qwen2-MoE's
// windows are refused (transformers' versions disagree on its layers).
void read_sliding_window(const json& c, const std::string& type, HfModelSpec& s) {
  const bool has_size = c.contains("sliding_window") && !c["sliding_window"].is_null();
  std::vector<int> layers(static_cast<size_t>(s.num_layers), 0);
  if (type == "mistral" || type == "mixtral") {
    if (!has_size) return;
    layers.assign(layers.size(), 1);
  } else if (type == "qwen3_moe") {  // (transformers' Qwen3-MoE reads no layer_types / max_window_layers)
    if (!c.value("use_sliding_window", false)) return;
    layers.assign(layers.size(), 1);
  } else if (type == "qwen2_moe") {
    bool typed = false;
    if (c.contains("layer_types") && c["layer_types"].is_array())
      for (const json& t : c["layer_types"]) typed = typed || t == "sliding_attention";
    if (c.value("use_sliding_window", false) || typed)
      throw Unsupported("HF qwen2_moe config: a sliding window (transformers windows different Qwen2-MoE layers in "
                        "different versions: every layer, those from max_window_layers on, or the even ones below it)");
    return;
  } else if (type == "qwen2" || type == "qwen3") {
    if (!c.value("use_sliding_window", false)) return;
    if (c.contains("layer_types") && c["layer_types"].is_array()) {
      const json& types = c["layer_types"];
      if (static_cast<int>(types.size()) != s.num_layers)
        fail("HF {} config: {} layer_types for {} layers", type, types.size(), s.num_layers);
      for (size_t i = 0; i < types.size(); ++i) {
        if (types[i] == "sliding_attention") layers[i] = 1;
        else if (types[i] != "full_attention")
          throw Unsupported(fmt::format("HF {} config: layer type {} (megatrain has full_attention and "
                                        "sliding_attention)", type, types[i].dump()));
      }
    } else {
      const int full = c.value("max_window_layers", 28);  // (transformers' default)
      for (int i = std::max(full, 0); i < s.num_layers; ++i) layers[static_cast<size_t>(i)] = 1;
    }
    if (std::find(layers.begin(), layers.end(), 1) == layers.end()) return;
  } else {
    return;  // Llama has no sliding window
  }
  if (!has_size && c.contains("sliding_window")) return;  // (null: transformers attends fully)
  const int window = has_size ? c["sliding_window"].get<int>() : 4096;  // (Qwen's default when absent)
  if (window < 1) fail("HF {} config: sliding_window {} (must be >= 1)", type, window);
  s.sliding_window = window;
  if (std::find(layers.begin(), layers.end(), 0) != layers.end()) s.window_layers = layers;
}

// Qwen2-MoE's and Qwen3-MoE's experts: layer i is MoE unless listed in mlp_only_layers, and when
// (i + 1) % decoder_sparse_step == 0; the top-k weights renormalized with norm_topk_prob; Qwen2-MoE's
// shared expert always gated.
void read_qwen_moe(const json& c, const std::string& type, HfModelSpec& s) {
  auto need = [&](const char* key) -> const json& {
    if (!c.contains(key) || c[key].is_null()) fail("HF config.json ({}) lacks '{}'", type, key);
    return c[key];
  };
  const int layers = need("num_hidden_layers").get<int>();
  // (transformers 5 saves Qwen3-MoE's num_experts under its attribute_map name, num_local_experts)
  s.num_experts = c.contains("num_experts")         ? need("num_experts").get<int>()
                  : c.contains("num_local_experts") ? need("num_local_experts").get<int>()
                  : type == "qwen3_next"            ? 512  // (its default)
                                                    : need("num_experts").get<int>();
  if (s.num_experts <= 0 && type == "qwen3_next") {  // (a dense Qwen3-Next: every layer mlp_only)
    s.num_experts = 0;
    return;
  }
  s.moe_topk = need("num_experts_per_tok").get<int>();
  s.moe_ffn_hidden_size = need("moe_intermediate_size").get<int>();
  s.norm_topk_prob = c.value("norm_topk_prob", type == "qwen3_next");  // (transformers' defaults)
  s.router_aux_loss_coef = c.value("router_aux_loss_coef", 0.001);
  const int step = c.value("decoder_sparse_step", 1);
  if (step < 1) fail("HF {} config: decoder_sparse_step {} (must be >= 1)", type, step);
  std::vector<int> only;
  if (c.contains("mlp_only_layers") && c["mlp_only_layers"].is_array()) only = c["mlp_only_layers"].get<std::vector<int>>();
  s.moe_layers.assign(static_cast<size_t>(layers), 0);
  for (int i = 0; i < layers; ++i)
    s.moe_layers[static_cast<size_t>(i)] =
        s.num_experts > 0 && std::find(only.begin(), only.end(), i) == only.end() && (i + 1) % step == 0;
  if (std::find(s.moe_layers.begin(), s.moe_layers.end(), 0) == s.moe_layers.end()) s.moe_layers.clear();
  if (type == "qwen2_moe" && !c.value("qkv_bias", true))
    throw Unsupported("HF qwen2_moe config: qkv_bias false (megatrain maps Qwen2-MoE with its q/k/v biases)");
  if ((type == "qwen2_moe" || type == "qwen3_next") && s.num_experts > 0) {
    s.shared_expert_ffn = c.value("shared_expert_intermediate_size", type == "qwen3_next" ? 512 : 0);
    if (s.shared_expert_ffn <= 0)
      throw Unsupported(fmt::format("HF {} config: shared_expert_intermediate_size 0 (megatrain's shared expert has "
                                    "a size; every MoE layer of the model runs one)", type));
    s.shared_expert_gate = true;
  }
}

}  // namespace

HfModelSpec hf_spec_from_config(const json& c, int make_vocab_size_divisible_by, int tp) {
  HfModelSpec s;
  const std::string type = c.value("model_type", std::string());
  auto need = [&](const char* key) -> const json& {
    if (!c.contains(key) || c[key].is_null()) fail("HF config.json ({}) lacks '{}'", type, key);
    return c[key];
  };
  try {
    if (type == "gpt2") {
      s.arch = HfArchitecture::gpt2;
      s.hidden_size = need("n_embd").get<int>();
      s.num_layers = need("n_layer").get<int>();
      s.num_attention_heads = need("n_head").get<int>();
      s.num_query_groups = s.num_attention_heads;
      s.head_dim = s.hidden_size / s.num_attention_heads;
      s.ffn_hidden_size = c.contains("n_inner") && !c["n_inner"].is_null() ? c["n_inner"].get<int>() : 4 * s.hidden_size;
      s.max_position_embeddings = need("n_positions").get<int>();
      s.learned_position_embeddings = true;
      s.layernorm = true;
      s.add_bias_linear = true;
      s.norm_epsilon = c.value("layer_norm_epsilon", 1e-5);
      s.gelu_activation = c.value("activation_function", std::string("gelu_new"));
      s.hidden_dropout = c.value("resid_pdrop", 0.1);
      s.attention_dropout = c.value("attn_pdrop", 0.1);
      s.untie_embeddings_and_output_weights = !c.value("tie_word_embeddings", true);
    } else if (type == "qwen3_next") {
      // transformers' Qwen3NextConfig defaults for the keys a config leaves out.
      s.arch = HfArchitecture::qwen3_next;
      s.hidden_size = need("hidden_size").get<int>();
      s.num_layers = need("num_hidden_layers").get<int>();
      s.num_attention_heads = need("num_attention_heads").get<int>();
      s.num_query_groups = c.value("num_key_value_heads", 2);
      s.head_dim = c.value("head_dim", 256);
      s.ffn_hidden_size = need("intermediate_size").get<int>();
      s.max_position_embeddings = need("max_position_embeddings").get<int>();
      s.layernorm = false;
      s.apply_layernorm_1p = true;  // (1 + w) RMSNorms
      s.swiglu = true;
      s.add_bias_linear = false;
      s.qk_layernorm = true;
      s.attention_output_gate = true;
      if (c.value("attention_bias", false))
        throw Unsupported("HF qwen3_next config: attention_bias (megatrain's gated attention has no biases)");
      if (c.value("hidden_act", std::string("silu")) != "silu")
        throw Unsupported(fmt::format("HF qwen3_next config: hidden_act '{}' (megatrain maps silu, SwiGLU)",
                                      c.value("hidden_act", std::string())));
      s.norm_epsilon = c.value("rms_norm_eps", 1e-6);
      const json* params = c.contains("rope_parameters") && c["rope_parameters"].is_object() ? &c["rope_parameters"] : nullptr;
      const json* scaling = c.contains("rope_scaling") && c["rope_scaling"].is_object() ? &c["rope_scaling"] : params;
      auto number = [](const json* j, const char* key, double fallback) {
        return j && j->contains(key) && (*j)[key].is_number() ? (*j)[key].get<double>() : fallback;
      };
      s.rotary_base = number(scaling, "rope_theta", number(&c, "rope_theta", 10000.0));
      s.rotary_percent = number(scaling, "partial_rotary_factor", number(&c, "partial_rotary_factor", 0.25));
      if (scaling && scaling->value("rope_type", scaling->value("type", std::string("default"))) != "default")
        throw Unsupported(fmt::format("HF qwen3_next config: rope scaling {} (megatrain maps plain RoPE for Qwen3-Next)",
                                      scaling->dump()));
      s.gdn_conv = c.value("linear_conv_kernel_dim", 4);
      s.gdn_dk = c.value("linear_key_head_dim", 128);
      s.gdn_dv = c.value("linear_value_head_dim", 128);
      s.gdn_key_heads = c.value("linear_num_key_heads", 16);
      s.gdn_value_heads = c.value("linear_num_value_heads", 32);
      if (c.contains("layer_types") && c["layer_types"].is_array()) {
        const json& types = c["layer_types"];
        if (static_cast<int>(types.size()) != s.num_layers)
          fail("HF qwen3_next config: {} layer_types for {} layers", types.size(), s.num_layers);
        for (const json& t : types) {
          if (t != "linear_attention" && t != "full_attention")
            throw Unsupported(fmt::format("HF qwen3_next config: layer type {} (megatrain has linear_attention and "
                                          "full_attention)", t.dump()));
          s.gdn_layers.push_back(t == "linear_attention" ? 1 : 0);
        }
      } else {  // every full_attention_interval-th layer (1-based) softmax attention
        const int every = std::max(1, c.value("full_attention_interval", 4));
        for (int l = 0; l < s.num_layers; ++l) s.gdn_layers.push_back((l + 1) % every == 0 ? 0 : 1);
      }
      read_qwen_moe(c, type, s);
      s.attention_dropout = c.value("attention_dropout", 0.0);
      s.hidden_dropout = 0.0;
      s.untie_embeddings_and_output_weights = !c.value("tie_word_embeddings", false);
    } else if (type == "deepseek_v3") {
      s.arch = HfArchitecture::deepseek_v3;
      s.hidden_size = need("hidden_size").get<int>();
      s.num_layers = need("num_hidden_layers").get<int>();
      s.num_attention_heads = need("num_attention_heads").get<int>();
      s.num_query_groups = s.num_attention_heads;
      const int kv_heads = c.value("num_key_value_heads", s.num_attention_heads);
      if (kv_heads != s.num_attention_heads)
        throw Unsupported(fmt::format("HF deepseek_v3 config: num_key_value_heads {} of {} heads (multi-latent "
                                      "attention has one key/value per head)", kv_heads, s.num_attention_heads));
      s.ffn_hidden_size = need("intermediate_size").get<int>();
      s.max_position_embeddings = need("max_position_embeddings").get<int>();
      s.layernorm = false;
      s.swiglu = true;
      s.add_bias_linear = false;
      if (c.value("attention_bias", false)) throw Unsupported("HF deepseek_v3 config: attention_bias (megatrain's MLA has none)");
      if (c.value("hidden_act", std::string("silu")) != "silu")
        throw Unsupported(fmt::format("HF deepseek_v3 config: hidden_act '{}' (megatrain maps silu, SwiGLU)",
                                      c.value("hidden_act", std::string())));
      s.q_lora_rank = c.contains("q_lora_rank") && !c["q_lora_rank"].is_null() ? c["q_lora_rank"].get<int>() : 0;
      s.kv_lora_rank = need("kv_lora_rank").get<int>();
      s.qk_nope_head_dim = need("qk_nope_head_dim").get<int>();
      s.qk_rope_head_dim = need("qk_rope_head_dim").get<int>();
      s.v_head_dim = need("v_head_dim").get<int>();
      s.head_dim = s.qk_nope_head_dim + s.qk_rope_head_dim;
      s.mla_latent_norms = true;
      s.rope_interleave = c.value("rope_interleave", true);
      s.mtp_layers = c.contains("num_nextn_predict_layers") && c["num_nextn_predict_layers"].is_number_integer()
                         ? c["num_nextn_predict_layers"].get<int>()
                         : 0;
      s.first_dense_layers = std::min(c.value("first_k_dense_replace", 0), s.num_layers);
      if (s.first_dense_layers < s.num_layers) {
        s.num_experts = need("n_routed_experts").get<int>();
        s.moe_topk = need("num_experts_per_tok").get<int>();
        s.moe_ffn_hidden_size = need("moe_intermediate_size").get<int>();
        s.shared_expert_ffn = c.value("n_shared_experts", 0) * s.moe_ffn_hidden_size;
        s.routed_scaling_factor = c.value("routed_scaling_factor", 1.0);
        s.router_groups = c.value("n_group", 1);
        s.router_group_topk = c.value("topk_group", 1);
        s.expert_bias = true;  // (the HF router always adds e_score_correction_bias)
        if (c.value("norm_topk_prob", true) != (s.moe_topk > 1))
          throw Unsupported(fmt::format("HF deepseek_v3 config: norm_topk_prob {} with {} experts per token "
                                        "(Megatron's sigmoid router renormalizes exactly when it picks more than one)",
                                        c.value("norm_topk_prob", true), s.moe_topk));
        if (s.router_groups > 1 && s.moe_topk != 2 * s.router_group_topk)
          throw Unsupported(fmt::format("HF deepseek_v3 config: {} experts per token with topk_group {} (transformers "
                                        "scores a group by its two best experts, Megatron by top-k / group top-k: "
                                        "they agree when num_experts_per_tok = 2 x topk_group)",
                                        s.moe_topk, s.router_group_topk));
        if (s.router_groups < 1 || s.num_experts % s.router_groups != 0 || s.num_experts / s.router_groups < 2)
          throw Unsupported(fmt::format("HF deepseek_v3 config: n_group {} of {} routed experts", s.router_groups,
                                        s.num_experts));
      }
      s.norm_epsilon = c.value("rms_norm_eps", 1e-6);
      const json* params = c.contains("rope_parameters") && c["rope_parameters"].is_object() ? &c["rope_parameters"] : nullptr;
      s.rotary_base = c.contains("rope_theta") && c["rope_theta"].is_number() ? c["rope_theta"].get<double>()
                      : params ? params->value("rope_theta", 10000.0)
                               : 10000.0;
      const json* scaling = c.contains("rope_scaling") && c["rope_scaling"].is_object() ? &c["rope_scaling"] : nullptr;
      if (!scaling && params && params->value("rope_type", std::string("default")) != "default") scaling = params;
      if (scaling) {
        // YaRN as Megatron's MLA computes it: the same factor for the frequencies and the softmax,
        // the original context 4096, beta_fast 32, beta_slow 1, integer correction bounds.
        const json& r = *scaling;
        const std::string rt = r.value("rope_type", r.value("type", std::string()));
        auto refuse = [&](const std::string& why) {
          throw Unsupported(fmt::format("HF deepseek_v3 config: rope_scaling {} ({})", r.dump(), why));
        };
        if (rt != "yarn") refuse("megatrain's MLA takes YaRN");
        auto number = [&](const char* key, double fallback) {
          return r.contains(key) && r[key].is_number() ? r[key].get<double>() : fallback;
        };
        s.yarn = true;
        s.yarn_factor = number("factor", 1.0);
        const bool original_given = r.contains("original_max_position_embeddings") && r["original_max_position_embeddings"].is_number();
        const double original = original_given ? r["original_max_position_embeddings"].get<double>() : s.max_position_embeddings;
        if (original_given && std::abs(s.max_position_embeddings / original - s.yarn_factor) > 1e-9 * s.yarn_factor)
          refuse("transformers' frequencies take max_position_embeddings / original_max_position_embeddings as the "
                 "factor, its softmax scale the factor: they differ");
        if (original != 4096) refuse("Megatron's MLA YaRN keeps an original context of 4096");
        if (number("beta_fast", 32) != 32 || number("beta_slow", 1) != 1 || !r.value("truncate", true) ||
            (r.contains("attention_factor") && !r["attention_factor"].is_null()))
          refuse("Megatron's MLA YaRN keeps beta_fast 32, beta_slow 1, integer bounds and no attention_factor");
        s.yarn_mscale = number("mscale", 1.0);
        s.yarn_mscale_all_dim = number("mscale_all_dim", 0.0);
        if (s.yarn_mscale_all_dim == 0.0 && s.yarn_mscale != 1.0)
          refuse("transformers ignores mscale without mscale_all_dim");
      }
      s.attention_dropout = c.value("attention_dropout", 0.0);
      s.hidden_dropout = 0.0;
      s.untie_embeddings_and_output_weights = !c.value("tie_word_embeddings", false);
    } else if (type == "llama" || type == "mistral" || type == "qwen2" || type == "qwen3" || type == "nemotron" ||
               type == "mixtral" || type == "qwen2_moe" || type == "qwen3_moe") {
      const bool nemotron = type == "nemotron";
      s.arch = type == "qwen2"       ? HfArchitecture::qwen2
               : type == "qwen3"     ? HfArchitecture::qwen3
               : type == "qwen2_moe" ? HfArchitecture::qwen2_moe
               : type == "qwen3_moe" ? HfArchitecture::qwen3_moe
               : type == "mistral"   ? HfArchitecture::mistral
               : type == "mixtral"   ? HfArchitecture::mixtral
               : nemotron            ? HfArchitecture::nemotron
                                     : HfArchitecture::llama;
      if (hf_is_qwen_moe(s.arch)) read_qwen_moe(c, type, s);
      if (type == "mixtral") {
        s.num_experts = need("num_local_experts").get<int>();
        s.moe_topk = need("num_experts_per_tok").get<int>();
        s.moe_ffn_hidden_size = need("intermediate_size").get<int>();
        s.router_aux_loss_coef = c.value("router_aux_loss_coef", 0.0);
        if (c.value("router_jitter_noise", 0.0) != 0.0)
          throw Unsupported("HF mixtral config: router_jitter_noise (megatrain's router has no jitter)");
      }
      s.hidden_size = need("hidden_size").get<int>();
      s.num_layers = need("num_hidden_layers").get<int>();
      s.num_attention_heads = need("num_attention_heads").get<int>();
      // Absent keys take transformers' defaults: Qwen's key/value heads (32, 32, 16, 4) and Qwen3's
      // head_dim 128; the others fall back to every head its own key/value and hidden / heads.
      const int kv_default = type == "qwen2" || type == "qwen3" ? 32
                             : type == "qwen2_moe"              ? 16
                             : type == "qwen3_moe"              ? 4
                                                                : s.num_attention_heads;
      s.num_query_groups = c.contains("num_key_value_heads") && !c["num_key_value_heads"].is_null()
                               ? c["num_key_value_heads"].get<int>()
                               : kv_default;
      s.head_dim = c.contains("head_dim") && !c["head_dim"].is_null() ? c["head_dim"].get<int>()
                   : type == "qwen3"                                  ? 128
                                                                      : s.hidden_size / s.num_attention_heads;
      s.ffn_hidden_size = need("intermediate_size").get<int>();
      s.max_position_embeddings = need("max_position_embeddings").get<int>();
      // Nemotron: LayerNorm1P (zero-centred weight, as --apply-layernorm-1p) and relu2 (squared ReLU).
      s.layernorm = nemotron;
      s.apply_layernorm_1p = nemotron;
      s.swiglu = !nemotron;
      s.squared_relu = nemotron;
      const std::string act = c.value("hidden_act", std::string(nemotron ? "relu2" : "silu"));
      if (act != (nemotron ? "relu2" : "silu"))
        throw Unsupported(fmt::format("HF {} config: hidden_act '{}' (megatrain maps {})", type, act,
                                      nemotron ? "relu2, squared ReLU" : "silu, SwiGLU"));
      if (type == "qwen2" || type == "qwen2_moe") {
        s.add_qkv_bias = true;  // Qwen2's q/k/v projections have biases, o_proj and the MLP none
        s.add_bias_linear = false;
      } else if (type == "qwen3" || type == "qwen3_moe") {
        s.qk_layernorm = true;  // q_norm and k_norm
        s.add_bias_linear = false;
        if (c.value("attention_bias", false))
          throw Unsupported(fmt::format("HF {} config: attention_bias (biases on q, k, v and o without MLP biases: "
                                        "Megatron's --add-qkv-bias covers q/k/v only, --add-bias-linear the MLP too)",
                                        type));
      } else {
        const bool attention_bias = c.value("attention_bias", false), mlp_bias = c.value("mlp_bias", false);
        if (attention_bias != mlp_bias)
          throw Unsupported(fmt::format("HF Llama config: attention_bias {} with mlp_bias {} (Megatron's "
                                        "--disable-bias-linear covers both)", attention_bias, mlp_bias));
        s.add_bias_linear = attention_bias;
      }
      s.norm_epsilon = nemotron ? c.value("norm_eps", 1e-5) : c.value("rms_norm_eps", 1e-6);
      // RoPE: transformers < 5 writes rope_theta and rope_scaling; transformers >= 5 writes
      // rope_parameters (rope_theta, and rope_type "default" or the scaling's type and factors).
      const json* params = c.contains("rope_parameters") && c["rope_parameters"].is_object() ? &c["rope_parameters"] : nullptr;
      auto number = [](const json& j, const char* key, double fallback) {
        return j.contains(key) && j[key].is_number() ? j[key].get<double>() : fallback;
      };
      s.rotary_base = number(c, "rope_theta", params ? number(*params, "rope_theta", 10000.0) : 10000.0);
      if (nemotron)  // (transformers' default 0.5)
        s.rotary_percent = number(c, "partial_rotary_factor", params ? number(*params, "partial_rotary_factor", 0.5) : 0.5);
      s.attention_dropout = c.value("attention_dropout", 0.0);
      s.hidden_dropout = 0.0;
      const json* scaling = c.contains("rope_scaling") && c["rope_scaling"].is_object() ? &c["rope_scaling"] : nullptr;
      if (!scaling && params && params->value("rope_type", std::string("default")) != "default") scaling = params;
      read_sliding_window(c, type, s);
      if (scaling) {
        const json& r = *scaling;
        const std::string rt = r.value("rope_type", r.value("type", std::string()));
        if (rt != "llama3" || r.value("low_freq_factor", 1.0) != 1.0 || r.value("high_freq_factor", 4.0) != 4.0 ||
            r.value("original_max_position_embeddings", 8192) != 8192)
          throw Unsupported(fmt::format("HF {} config: rope_scaling {} (megatrain supports Llama 3.1's llama3 "
                                        "scaling with factors 1/4 and original length 8192)", type, r.dump()));
        s.use_rope_scaling = true;
        s.rope_scaling_factor = r.value("factor", 8.0);
      }
      s.untie_embeddings_and_output_weights = !c.value("tie_word_embeddings", false);
    } else {
      throw Unsupported(
          fmt::format("HF model_type '{}' (megatrain maps gpt2, llama, mistral, qwen2, qwen3, nemotron, mixtral, "
                      "qwen2_moe, qwen3_moe, qwen3_next and deepseek_v3)", type));
    }
    s.vocab_size = need("vocab_size").get<int>();
    s.init_method_std = c.value("initializer_range", 0.02);
    if (c.contains("bos_token_id") && c["bos_token_id"].is_number_integer()) s.bos_token_id = c["bos_token_id"].get<int>();
    if (c.contains("eos_token_id") && c["eos_token_id"].is_number_integer()) s.eos_token_id = c["eos_token_id"].get<int>();
    s.torch_dtype = c.value("torch_dtype", c.value("dtype", std::string("float32")));
  } catch (const json::exception& e) {
    fail("HF config.json: {}", e.what());
  }
  // Megatron's _vocab_size_with_padding.
  const int64_t multiple = static_cast<int64_t>(make_vocab_size_divisible_by) * tp;
  s.padded_vocab_size = static_cast<int>((s.vocab_size + multiple - 1) / multiple * multiple);
  s.validate();
  return s;
}

// ---------------------------------------------------------------------------------------------
// Building blocks

void split_qkv_rows(const void* fused, size_t elem, int heads, int groups, int head_dim, int64_t cols, void* q, void* k,
                    void* v) {
  const size_t block = static_cast<size_t>(head_dim) * static_cast<size_t>(cols) * elem;  // one head's rows
  const int per_group = heads / groups;
  const auto* src = static_cast<const unsigned char*>(fused);
  auto* qd = static_cast<unsigned char*>(q);
  auto* kd = static_cast<unsigned char*>(k);
  auto* vd = static_cast<unsigned char*>(v);
  for (int g = 0; g < groups; ++g) {
    std::memcpy(qd + g * per_group * block, src, per_group * block);
    src += per_group * block;
    std::memcpy(kd + g * block, src, block);
    src += block;
    std::memcpy(vd + g * block, src, block);
    src += block;
  }
}

void merge_qkv_rows(const void* q, const void* k, const void* v, size_t elem, int heads, int groups, int head_dim,
                    int64_t cols, void* fused) {
  const size_t block = static_cast<size_t>(head_dim) * static_cast<size_t>(cols) * elem;
  const int per_group = heads / groups;
  auto* dst = static_cast<unsigned char*>(fused);
  const auto* qs = static_cast<const unsigned char*>(q);
  const auto* ks = static_cast<const unsigned char*>(k);
  const auto* vs = static_cast<const unsigned char*>(v);
  for (int g = 0; g < groups; ++g) {
    std::memcpy(dst, qs + g * per_group * block, per_group * block);
    dst += per_group * block;
    std::memcpy(dst, ks + g * block, block);
    dst += block;
    std::memcpy(dst, vs + g * block, block);
    dst += block;
  }
}

void transpose_rows(const void* src, size_t elem, int64_t rows, int64_t cols, void* dst) {
  const auto* s = static_cast<const unsigned char*>(src);
  auto* d = static_cast<unsigned char*>(dst);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      std::memcpy(d + static_cast<size_t>(c * rows + r) * elem, s + static_cast<size_t>(r * cols + c) * elem, elem);
}

void permute_rope_rows(const void* src, size_t elem, int heads, int head_dim, int64_t cols, void* dst,
                       bool to_rotate_half) {
  const size_t row = static_cast<size_t>(cols) * elem;
  const int half = head_dim / 2;
  const auto* s = static_cast<const unsigned char*>(src);
  auto* d = static_cast<unsigned char*>(dst);
  for (int h = 0; h < heads; ++h)
    for (int part = 0; part < 2; ++part)
      for (int j = 0; j < half; ++j) {
        const size_t interleaved = static_cast<size_t>(h * head_dim + 2 * j + part);
        const size_t halves = static_cast<size_t>(h * head_dim + part * half + j);
        if (to_rotate_half) std::memcpy(d + halves * row, s + interleaved * row, row);
        else std::memcpy(d + interleaved * row, s + halves * row, row);
      }
}

// ---------------------------------------------------------------------------------------------
// Tensor conversion

namespace {
// MLA's RoPE rows in a stack of blocks of `block` rows (q: one per head [nope; rope]; kv down: one
// [kv_lora; rope]), `offset` rows into each. Megatron's MLA (and ours) rotates the pairs (2j, 2j+1)
// of the RoPE part, de-interleaving it first, as transformers' DeepSeek-V3 does with rope_interleave:
// then they are copied; a model without it rotates (j, j + d/2), so its rows are permuted (to_hf:
// ours -> rotate-half pairs, else back).
void mla_rope_rows(const HostArray& src, HostArray& dst, const HfTensorMapping& m, const HfModelSpec& s, bool to_hf) {
  dst.bytes = src.bytes;
  if (s.rope_interleave) return;
  const bool q = m.transform == HfTransform::mla_q_rope;
  const int64_t rope = s.qk_rope_head_dim, block = q ? s.qk_nope_head_dim + rope : s.kv_lora_rank + rope;
  const int64_t offset = block - rope, cols = m.our_shape.size() == 2 ? m.our_shape[1] : 1;
  const size_t elem = dtype_size(src.dtype), row = static_cast<size_t>(cols) * elem;
  for (int64_t b = 0; b < m.our_shape[0] / block; ++b) {
    const size_t at = static_cast<size_t>(b * block + offset) * row;
    permute_rope_rows(src.bytes.data() + at, elem, 1, static_cast<int>(rope), cols, dst.bytes.data() + at,
                      /*to_rotate_half=*/to_hf);
  }
}
}  // namespace

namespace {

// The row moves of the transforms that permute whole rows between our tensor and its HF tensors:
// rows [ours_row, + rows) of ours are rows [hf_row, + rows) of HF tensor `part`.
struct RowBlock {
  int64_t ours_row, hf_row, rows;
  int part;
};

std::vector<RowBlock> row_blocks(const HfTensorMapping& m, const HfModelSpec& s) {
  std::vector<RowBlock> b;
  if (m.transform == HfTransform::qkvg_split) {
    // Ours per query group [q (qpg heads) | gate (qpg heads) | k | v]; q_proj per head [q | gate].
    const int64_t G = s.num_query_groups, qpg = s.num_attention_heads / G, d = s.head_dim;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t base = g * (2 * qpg + 2) * d;
      for (int64_t r = 0; r < qpg; ++r) {
        const int64_t j = g * qpg + r;
        b.push_back({base + r * d, 2 * j * d, d, 0});
        b.push_back({base + (qpg + r) * d, (2 * j + 1) * d, d, 0});
      }
      b.push_back({base + 2 * qpg * d, g * d, d, 1});
      b.push_back({base + (2 * qpg + 1) * d, g * d, d, 2});
    }
  } else if (m.transform == HfTransform::gdn_in_proj || m.transform == HfTransform::gdn_conv) {
    const int64_t kh = s.gdn_key_heads, rep = s.gdn_value_heads / kh, dk = s.gdn_dk, dv = s.gdn_dv;
    const int64_t qkvz = 2 * dk + 2 * rep * dv, conv = 2 * dk + rep * dv;
    for (int64_t g = 0; g < kh; ++g) {
      if (m.transform == HfTransform::gdn_in_proj) {
        b.push_back({g * (qkvz + 2 * rep), g * qkvz, qkvz, 0});
        b.push_back({g * (qkvz + 2 * rep) + qkvz, g * 2 * rep, 2 * rep, 1});
      } else {
        b.push_back({g * conv, g * dk, dk, 0});
        b.push_back({g * conv + dk, kh * dk + g * dk, dk, 0});
        b.push_back({g * conv + 2 * dk, 2 * kh * dk + g * rep * dv, rep * dv, 0});
      }
    }
  }
  return b;
}

}  // namespace

std::vector<HostArray> export_hf_tensor(const HfTensorMapping& m, const HfModelSpec& s, const HostArray& ours) {
  check_shape(ours, m.our_shape, m.ours);
  const size_t elem = dtype_size(ours.dtype);
  const int H = s.num_attention_heads, G = s.num_query_groups, d = s.head_dim;
  const int64_t cols = ours.shape.size() == 2 ? ours.shape[1] : 1;
  std::vector<HostArray> out;
  for (const auto& shape : m.hf_shapes) out.push_back(HostArray::zeros(ours.dtype, shape));
  switch (m.transform) {
    case HfTransform::copy:
      out[0].bytes = ours.bytes;
      break;
    case HfTransform::transpose:
      transpose_rows(ours.bytes.data(), elem, ours.shape[0], ours.shape[1], out[0].bytes.data());
      break;
    case HfTransform::vocab_rows:
    case HfTransform::vocab_rows_copy:
      std::memcpy(out[0].bytes.data(), ours.bytes.data(), out[0].bytes.size());  // the first V rows
      break;
    case HfTransform::norm_1p:
      for (int64_t i = 0; i < ours.numel(); ++i)
        store_float(out[0].bytes.data(), ours.dtype, i, load_float(ours.bytes.data(), ours.dtype, i) + 1.0);
      break;
    case HfTransform::qkv_split: {
      split_qkv_rows(ours.bytes.data(), elem, H, G, d, cols, out[0].bytes.data(), out[1].bytes.data(),
                     out[2].bytes.data());
      if (s.rotary_interleaved) {
        for (int i : {0, 1}) {  // q and k (v is not rotated)
          std::vector<unsigned char> tmp = out[i].bytes;
          permute_rope_rows(tmp.data(), elem, i == 0 ? H : G, d, cols, out[i].bytes.data(), /*to_rotate_half=*/true);
        }
      }
      break;
    }
    case HfTransform::qkv_c_attn:
    case HfTransform::qkv_c_attn_bias: {
      // [Q; K; V] rows (each E), then (weight) transposed to Conv1D's [in, 3E].
      std::vector<unsigned char> qkv(ours.bytes.size());
      const size_t part = static_cast<size_t>(H) * d * cols * elem;
      split_qkv_rows(ours.bytes.data(), elem, H, G, d, cols, qkv.data(), qkv.data() + part, qkv.data() + 2 * part);
      if (m.transform == HfTransform::qkv_c_attn) transpose_rows(qkv.data(), elem, ours.shape[0], cols, out[0].bytes.data());
      else out[0].bytes = std::move(qkv);
      break;
    }
    case HfTransform::mla_q_rope:
    case HfTransform::mla_kv_rope:
      mla_rope_rows(ours, out[0], m, s, /*to_hf=*/true);
      break;
    case HfTransform::zeros:
      break;  // (export_hf writes zeros for a mapping without a tensor of ours)
    case HfTransform::qkvg_split:
    case HfTransform::gdn_in_proj:
    case HfTransform::gdn_conv: {
      const size_t row = static_cast<size_t>(cols) * elem;
      for (const RowBlock& b : row_blocks(m, s))
        std::memcpy(out.at(static_cast<size_t>(b.part)).bytes.data() + b.hf_row * row, ours.bytes.data() + b.ours_row * row,
                    b.rows * row);
      break;
    }
    case HfTransform::fc1_split: {
      size_t at = 0;
      for (HostArray& part : out) {
        std::memcpy(part.bytes.data(), ours.bytes.data() + at, part.bytes.size());
        at += part.bytes.size();
      }
      MT_CHECK(at == ours.bytes.size(), "exporting '{}': its parts hold {} of {} bytes", m.ours, at, ours.bytes.size());
      break;
    }
  }
  return out;
}

HostArray import_hf_tensor(const HfTensorMapping& m, const HfModelSpec& s, const std::vector<HostArray>& hf) {
  if (hf.size() != m.hf.size()) fail("importing '{}': expected {} HF tensors, got {}", m.ours, m.hf.size(), hf.size());
  for (size_t i = 0; i < hf.size(); ++i) {
    check_shape(hf[i], m.hf_shapes[i], m.hf[i]);
    if (hf[i].dtype != hf[0].dtype)
      fail("importing '{}': HF tensors {} and {} have different dtypes", m.ours, m.hf[0], m.hf[i]);
  }
  const DType dt = hf[0].dtype;
  const size_t elem = dtype_size(dt);
  const int H = s.num_attention_heads, G = s.num_query_groups, d = s.head_dim;
  const int64_t cols = m.our_shape.size() == 2 ? m.our_shape[1] : 1;
  HostArray out = HostArray::zeros(dt, m.our_shape);
  switch (m.transform) {
    case HfTransform::copy:
      out.bytes = hf[0].bytes;
      break;
    case HfTransform::transpose:
      transpose_rows(hf[0].bytes.data(), elem, hf[0].shape[0], hf[0].shape[1], out.bytes.data());
      break;
    case HfTransform::vocab_rows:
    case HfTransform::vocab_rows_copy: {
      // Padding rows repeat the last real row (Megatron's tools/checkpoint saver does the same).
      std::memcpy(out.bytes.data(), hf[0].bytes.data(), hf[0].bytes.size());
      const size_t row = static_cast<size_t>(cols) * elem;
      const int64_t V = hf[0].shape[0];
      for (int64_t r = V; r < m.our_shape[0]; ++r)
        std::memcpy(out.bytes.data() + r * row, hf[0].bytes.data() + (V - 1) * row, row);
      break;
    }
    case HfTransform::norm_1p:
      for (int64_t i = 0; i < out.numel(); ++i)
        store_float(out.bytes.data(), dt, i, load_float(hf[0].bytes.data(), dt, i) - 1.0);
      break;
    case HfTransform::qkv_split: {
      std::vector<unsigned char> q = hf[0].bytes, k = hf[1].bytes;
      if (s.rotary_interleaved) {
        permute_rope_rows(hf[0].bytes.data(), elem, H, d, cols, q.data(), /*to_rotate_half=*/false);
        permute_rope_rows(hf[1].bytes.data(), elem, G, d, cols, k.data(), /*to_rotate_half=*/false);
      }
      merge_qkv_rows(q.data(), k.data(), hf[2].bytes.data(), elem, H, G, d, cols, out.bytes.data());
      break;
    }
    case HfTransform::qkv_c_attn:
    case HfTransform::qkv_c_attn_bias: {
      std::vector<unsigned char> qkv(out.bytes.size());
      if (m.transform == HfTransform::qkv_c_attn) transpose_rows(hf[0].bytes.data(), elem, hf[0].shape[0], hf[0].shape[1], qkv.data());
      else qkv = hf[0].bytes;
      const size_t part = static_cast<size_t>(H) * d * cols * elem;
      merge_qkv_rows(qkv.data(), qkv.data() + part, qkv.data() + 2 * part, elem, H, G, d, cols, out.bytes.data());
      break;
    }
    case HfTransform::mla_q_rope:
    case HfTransform::mla_kv_rope:
      mla_rope_rows(hf[0], out, m, s, /*to_hf=*/false);
      break;
    case HfTransform::zeros:
      break;  // (import_hf writes nothing for it)
    case HfTransform::qkvg_split:
    case HfTransform::gdn_in_proj:
    case HfTransform::gdn_conv: {
      const size_t row = static_cast<size_t>(cols) * elem;
      for (const RowBlock& b : row_blocks(m, s))
        std::memcpy(out.bytes.data() + b.ours_row * row, hf.at(static_cast<size_t>(b.part)).bytes.data() + b.hf_row * row,
                    b.rows * row);
      break;
    }
    case HfTransform::fc1_split: {
      size_t at = 0;
      for (const HostArray& part : hf) {
        std::memcpy(out.bytes.data() + at, part.bytes.data(), part.bytes.size());
        at += part.bytes.size();
      }
      MT_CHECK(at == out.bytes.size(), "importing '{}': its parts hold {} of {} bytes", m.ours, at, out.bytes.size());
      break;
    }
  }
  return out;
}

}  // namespace mt
