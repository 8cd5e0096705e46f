// Model-shape rules (Megatron's validate_args and
// TransformerConfig.__post_init__).
#include "app/cli_internal.h"

#include <cmath>
#include <cstdlib>

namespace mt::cli {
namespace {

// --window-size / --window-attn-skip-freq (Transformer Engine's window rules for causal masks).
void validate_window(CliState& st) {
  const ModelConfig& m = st.cfg.model;
  if (!m.window_size) {
    if (m.window_attn_skip_every || !m.window_attn_pattern.empty())
      st.warn("--window-attn-skip-freq has no effect without --window-size (as in Megatron): every layer attends to "
              "all earlier tokens");
    return;
  }
  const auto [left, right] = *m.window_size;
  if (left < -1 || right < -1)
    fail("--window-size {},{}: each bound is -1 (unbounded) or a number of tokens >= 0", left, right);
  // Transformer Engine (check_set_window_size) refuses an unbounded LEFT with a RIGHT bound for
  // causal masks, and turns (L, R) into (L, 0) with a warning.
  if (left < 0 && right > 0)
    fail("--window-size {},{}: causal attention takes (LEFT, 0) or (-1, 0), as Transformer Engine requires", left, right);
  if (right != 0 && !(left < 0 && right < 0))
    st.warn(fmt::format("--window-size {},{}: attention is causal, so no query sees later tokens; megatrain uses ({}, 0), "
                        "as Transformer Engine does for causal masks", left, right, left));
  if (left < 0) {
    st.note("--window-size with LEFT -1 is no sliding window: every layer attends to all earlier tokens");
    return;
  }
  if (m.window_attn_skip_every && *m.window_attn_skip_every <= 0)
    fail("--window-attn-skip-freq {} must be > 0 (every N-th layer attends fully)", *m.window_attn_skip_every);
  if (!m.window_attn_pattern.empty() && static_cast<int>(m.window_attn_pattern.size()) != m.num_layers)
    fail("--window-attn-skip-freq gives {} layers but --num-layers is {}: the list needs one 0/1 entry per layer",
         m.window_attn_pattern.size(), m.num_layers);
}

}  // namespace

void validate_model(CliState& st) {
  validate_window(st);
  const Config& c = st.cfg;
  const ModelConfig& m = c.model;
  const int tp = c.parallel.tensor_model_parallel_size;
  const int cp = c.parallel.context_parallel_size;

  if (m.num_attention_heads % tp != 0)
    fail("--num-attention-heads {} is not divisible by --tensor-model-parallel-size {}", m.num_attention_heads, tp);
  if (st.has("--num-query-groups") && !m.group_query_attention)
    st.warn(fmt::format("--num-query-groups {} is ignored without --group-query-attention (as in Megatron: every "
                        "head has its own keys and values)", m.num_query_groups));
  if (m.group_query_attention) {
    const int g = m.query_groups;
    if (m.num_attention_heads % g != 0)
      fail("--num-attention-heads {} is not divisible by --num-query-groups {}", m.num_attention_heads, g);
    // Megatron HEAD: groups are split over TP, or (fewer groups than TP ranks) replicated.
    if ((g >= tp && g % tp != 0) || (g < tp && tp % g != 0))
      fail("--num-query-groups {} must be a multiple or a divisor of --tensor-model-parallel-size {}", g, tp);
  }
  if (c.data.inter_document_masking && (c.data.reset_attention_mask || c.data.reset_position_ids))
    st.note("--dataloader-inter-document-masking: the document parts bound attention and restart the positions, as in "
            "Megatron-LM, where --reset-attention-mask and --reset-position-ids then change nothing");
  if (m.gated_delta_net) {
    if (c.data.inter_document_masking)
      throw Unsupported("megatrain does not support --dataloader-inter-document-masking with Gated DeltaNet layers yet "
                        "(Megatron-LM restarts their convolution and recurrence at each document)");
    if (c.data.reset_attention_mask)
      st.note("--reset-attention-mask with Gated DeltaNet layers: as in Megatron-LM (whose GatedDeltaNet reads no "
              "attention mask), only the softmax-attention layers keep to each document; the Gated DeltaNet layers' "
              "convolution and recurrence run over the whole sequence");
    // Megatron's TransformerConfig: the key and value heads split over TP x CP.
    if (m.linear_num_key_heads % (tp * cp) != 0 || m.linear_num_value_heads % (tp * cp) != 0)
      fail("--linear-num-key-heads {} and --linear-num-value-heads {} must be multiples of --tensor-model-parallel-size "
           "x --context-parallel-size ({})", m.linear_num_key_heads, m.linear_num_value_heads, tp * cp);
  }
  if (m.ffn_size % tp != 0) {
    if (m.ffn_hidden_size)
      fail("--ffn-hidden-size {} is not divisible by --tensor-model-parallel-size {}", m.ffn_size, tp);
    fail("the MLP size {} (Megatron's default for --hidden-size {}{}) is not divisible by --tensor-model-parallel-size "
         "{}: pass --ffn-hidden-size", m.ffn_size, m.hidden_size, m.swiglu ? " with --swiglu" : "", tp);
  }
  if (m.max_position_embeddings < m.seq_length)
    fail("--max-position-embeddings {} is smaller than --seq-length {}", m.max_position_embeddings, m.seq_length);
  if (cp > 1 && m.seq_length % (2 * cp) != 0)
    fail("--seq-length {} is not a multiple of 2 x --context-parallel-size {}", m.seq_length, cp);
  if (c.parallel.sequence_parallel && (m.seq_length / cp) % tp != 0)
    fail("--sequence-parallel needs --seq-length {} (per context-parallel rank: {}) divisible by "
         "--tensor-model-parallel-size {}", m.seq_length, m.seq_length / cp, tp);
  if (m.squared_relu && m.swiglu) fail("--squared-relu and --swiglu are exclusive");
  // Megatron-LM's bias-activation fusion (on with biases unless --no-bias-gelu-fusion) takes GeLU
  // and SwiGLU only: its TransformerConfig stops a squared-ReLU model with biases there.
  if (m.squared_relu && m.add_bias_linear && m.bias_gelu_fusion)
    fail("--squared-relu with biased linear layers needs --no-bias-gelu-fusion (or --disable-bias-linear): "
         "Megatron-LM's bias-activation fusion takes only GeLU and SwiGLU and refuses this combination too");
  if (m.quick_geglu && m.swiglu) fail("--quick-geglu and --swiglu are exclusive");
  if (m.quick_geglu && m.squared_relu) fail("--quick-geglu and --squared-relu are exclusive");
  // Megatron's TransformerConfig: a linear offset only with its fused quick-GeGLU (or with the GLU
  // unfused: --no-bias-swiglu-fusion / --no-bias-gelu-fusion); SwiGLU's clamp finite and positive,
  // in MoE models only, without an offset.
  const bool gated = m.swiglu || m.quick_geglu;
  if (m.glu_linear_offset != 0.0 && !m.quick_geglu &&
      (m.swiglu ? !st.has("--no-bias-swiglu-fusion") : m.bias_gelu_fusion))
    fail("When bias_activation_fusion is True and glu_linear_offset is non-zero, activation function must be "
         "quick_gelu. (--glu-linear-offset {} with {}: pass --quick-geglu, or {})", m.glu_linear_offset,
         m.swiglu ? "--swiglu" : "GeLU", m.swiglu ? "--no-bias-swiglu-fusion" : "--no-bias-gelu-fusion");
  if (m.activation_func_clamp_value && m.swiglu) {
    const double v = *m.activation_func_clamp_value;
    if (!std::isfinite(v) || v <= 0)
      fail("activation_func_clamp_value for SwiGLU must be finite and greater than zero. (--activation-func-clamp-value {})", v);
    if (!m.moe.enabled()) fail("activation_func_clamp_value for SwiGLU is only supported with MoE. (--activation-func-clamp-value with --swiglu needs --num-experts)");
    if (m.glu_linear_offset != 0.0)
      fail("glu_linear_offset must be zero when activation_func_clamp_value is set for SwiGLU.");
  }
  if (m.activation_func_clamp_value && m.quick_geglu && *m.activation_func_clamp_value <= 0)
    fail("--activation-func-clamp-value {} must be > 0", *m.activation_func_clamp_value);
  if (!gated && (m.glu_linear_offset != 0.0 || m.activation_func_clamp_value)) {
    st.note("--glu-linear-offset and --activation-func-clamp-value have no effect without a gated MLP (--swiglu or "
            "--quick-geglu), as in Megatron-LM");
    st.cfg.model.glu_linear_offset = 0.0;
    st.cfg.model.activation_func_clamp_value.reset();
  }
  if (m.qk_l2_norm && m.multi_latent_attention) fail("--qk-l2-norm is not supported with --multi-latent-attention");
  // Megatron's MLATransformerConfig raises NotImplementedError for the gate.
  if (m.attention_output_gate && m.multi_latent_attention)
    fail("Output gate is not supported for MLA yet (--attention-output-gate with --multi-latent-attention)");
  if (m.qk_l2_norm && m.qk_layernorm)
    st.note("--qk-l2-norm with --qk-layernorm: queries and keys get the L2 norm (no weights), as in Megatron");
  if (m.multi_latent_attention && m.group_query_attention)
    fail("--multi-latent-attention and --group-query-attention are exclusive");
  if (!m.add_position_embedding && m.position_embedding_type != PositionEmbedding::rope)
    fail("--no-position-embedding is deprecated, use --position-embedding-type (it is only accepted with rope)");
  if (m.rope_type && *m.rope_type != "rope" && !m.multi_latent_attention)
    fail("--rope-type {}: attention without --multi-latent-attention supports --rope-type rope only", *m.rope_type);
  if (m.multi_latent_attention) {
    // Megatron's MLATransformerConfig and argument checks.
    if (m.rotary_interleaved) fail("--rotary-interleaved does not work with --multi-latent-attention");
    // Rope fusion is on unless --no-rope-fusion, and Megatron turns it off unless the position
    // embedding is rope; MLA's fused RoPE takes YaRN only.
    if (m.position_embedding_type == PositionEmbedding::rope && !st.has("--no-rope-fusion") && !mla_rope_is_yarn(m))
      fail("apply_rope_fusion for MLA only works with YARN RoPE: --multi-latent-attention with "
           "--position-embedding-type rope and --rope-type rope needs --no-rope-fusion");
    if (m.position_embedding_type == PositionEmbedding::yarn)
      fail("--position-embedding-type yarn with --multi-latent-attention: MLA applies its own RoPE (--rope-type); use "
           "--position-embedding-type rope or none");
    if (m.q_lora_rank && *m.q_lora_rank <= 0) fail("--q-lora-rank must be > 0 (got {})", *m.q_lora_rank);
    if (m.kv_lora_rank <= 0) fail("--kv-lora-rank must be > 0 (got {})", m.kv_lora_rank);
    if (m.qk_head_dim <= 0 || m.v_head_dim <= 0)
      fail("--qk-head-dim ({}) and --v-head-dim ({}) must be > 0", m.qk_head_dim, m.v_head_dim);
    const int rot = mla_rope_is_yarn(m) ? m.qk_pos_emb_head_dim
                                        : static_cast<int>(m.qk_pos_emb_head_dim * m.rotary_percent);
    if (m.qk_pos_emb_head_dim <= 0 || rot <= 0 || rot % 2 != 0)
      fail("--qk-pos-emb-head-dim {} (rotated: {}) must be a positive even number", m.qk_pos_emb_head_dim, rot);
  }
  if (m.mtp_num_layers && *m.mtp_num_layers > 0) {
    // Megatron-LM's argument check (the stricter of its two).
    if (m.position_embedding_type != PositionEmbedding::rope && m.position_embedding_type != PositionEmbedding::none)
      fail("Multi-Token Prediction (MTP) is not supported with {} position embedding type.The supported position "
           "embedding types are rope and none.",
           m.position_embedding_type == PositionEmbedding::yarn ? "yarn" : "learned_absolute");
  }
  if (m.mtp_num_layers && *m.mtp_num_layers < 0) fail("--mtp-num-layers must be >= 0 (got {})", *m.mtp_num_layers);
  if (m.position_embedding_type == PositionEmbedding::yarn && m.rotary_interleaved)
    fail("Yarn RoPE does not support interleaved rotary embeddings (--position-embedding-type yarn with "
         "--rotary-interleaved)");
  if (m.position_embedding_type == PositionEmbedding::yarn && m.head_dim % 2 != 0)
    fail("--position-embedding-type yarn rotates the whole head: --kv-channels {} must be even", m.head_dim);
  if (m.attention_backend == AttentionBackend::local)
    fail("--attention-backend local is only supported with --spec local");
  if (m.attention_backend == AttentionBackend::unfused)
    st.note("--attention-backend unfused runs megatrain's flash attention: the same attention, with a deterministic "
            "backward, computed without storing the s x s scores (results differ from Megatron's unfused kernels "
            "by rounding only)");
  // Megatron's Transformer Engine attention (the default --transformer-impl) raises unless the
  // environment's NVTE_APPLY_QK_LAYER_SCALING agrees with --apply-query-key-layer-scaling.
  const std::string impl = st.has("--transformer-impl") ? st.given.at("--transformer-impl").one() : "transformer_engine";
  if (impl == "transformer_engine") {
    const std::string env = st.nvte_apply_qk_layer_scaling.value_or("0");
    char* end = nullptr;
    const long v = std::strtol(env.c_str(), &end, 10);
    if (env.empty() || *end != '\0') fail("NVTE_APPLY_QK_LAYER_SCALING must be an integer (got '{}')", env);
    if ((v != 0) != m.apply_query_key_layer_scaling)
      fail("apply_query_key_layer_scaling is {} but environment variable NVTE_APPLY_QK_LAYER_SCALING is {}: with "
           "--transformer-impl transformer_engine (the default) the two must match (or use --transformer-impl local)",
           m.apply_query_key_layer_scaling ? "True" : "False",
           st.nvte_apply_qk_layer_scaling.value_or("None"));
  }
  if (m.rotary_percent <= 0.0 || m.rotary_percent > 1.0)
    fail("--rotary-percent must be in (0, 1] (got {})", format_float(m.rotary_percent));
  if (m.position_embedding_type == PositionEmbedding::rope && !m.multi_latent_attention) {
    if (m.rotary_base <= 0) fail("--rotary-base must be > 0 (got {})", m.rotary_base);
    const int rotary_dim = static_cast<int>(m.head_dim * m.rotary_percent);
    if (rotary_dim % 2 != 0)
      fail("RoPE rotates {} of the {} head dimensions (--rotary-percent {}): that must be even", rotary_dim, m.head_dim,
           format_float(m.rotary_percent));
  }
  if (m.rotary_seq_len_interpolation_factor && *m.rotary_seq_len_interpolation_factor <= 0)
    fail("--rotary-seq-len-interpolation-factor must be > 0 (got {})", *m.rotary_seq_len_interpolation_factor);
  if (m.norm_epsilon <= 0) fail("--norm-epsilon must be > 0 (got {})", format_float(m.norm_epsilon));
  if (m.attention_dropout < 0 || m.attention_dropout >= 1)
    fail("--attention-dropout must be in [0, 1) (got {})", format_float(m.attention_dropout));
  if (m.hidden_dropout < 0 || m.hidden_dropout >= 1)
    fail("--hidden-dropout must be in [0, 1) (got {})", format_float(m.hidden_dropout));
  if (m.init_method_std <= 0) fail("--init-method-std must be > 0 (got {})", format_float(m.init_method_std));
  if (m.embedding_init_method_std && *m.embedding_init_method_std <= 0)
    fail("--embedding-init-method-std must be > 0 (got {})", format_float(*m.embedding_init_method_std));
  if (c.data.padded_vocab_size) {
    if (*c.data.padded_vocab_size < m.vocab_size)
      fail("--padded-vocab-size {} is smaller than the tokenizer's vocabulary ({})", *c.data.padded_vocab_size,
           m.vocab_size);
    if (*c.data.padded_vocab_size % tp != 0)
      fail("--padded-vocab-size {} is not divisible by --tensor-model-parallel-size {}", *c.data.padded_vocab_size, tp);
  }
}

}  // namespace mt::cli
