#include "engine/model_dims.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "engine/backend.h"
#include "engine/param_count.h"
#include "engine/rope_table.h"

namespace mt {

ModelDims ModelDims::from_config(const Config& cfg, const RankPosition& r,
                                 std::optional<std::pair<int, int>> layer_range) {
  const ModelConfig& m = cfg.model;
  ModelDims d;
  static_cast<RankPosition&>(d) = r;
  const int tp_size = r.tp_size, pp_size = r.pp_size, pp_rank = r.pp_rank;
  d.num_layers = m.num_layers;
  d.hidden = m.hidden_size;
  d.heads = m.num_attention_heads;
  d.head_dim = m.head_dim ? m.head_dim : (m.num_attention_heads ? m.hidden_size / m.num_attention_heads : 0);
  d.groups = m.query_groups ? m.query_groups
                            : (m.group_query_attention ? m.num_query_groups : m.num_attention_heads);
  d.ffn = m.ffn_size ? m.ffn_size : m.ffn_hidden_size.value_or(4 * m.hidden_size);
  d.vocab = m.padded_vocab_size;
  d.seq = m.seq_length;
  d.micro_batch = cfg.train.micro_batch_size;
  d.max_positions = std::max(m.max_position_embeddings, m.seq_length);

  if (d.num_layers <= 0 || d.hidden <= 0 || d.heads <= 0) fail("--num-layers, --hidden-size and --num-attention-heads must be > 0");
  if (d.head_dim <= 0) fail("--kv-channels (or --hidden-size / --num-attention-heads) must be > 0");
  if (d.vocab <= 0) fail("the padded vocabulary size is {}: set a tokenizer or --vocab-size", d.vocab);
  if (d.seq <= 0) fail("--seq-length must be > 0");
  if (d.micro_batch <= 0) fail("--micro-batch-size must be > 0");
  if (d.groups <= 0 || d.heads % d.groups != 0)
    fail("--num-attention-heads ({}) must be a multiple of --num-query-groups ({})", d.heads, d.groups);

  d.sequence_parallel = cfg.parallel.sequence_parallel && tp_size > 1;
  if (d.sequence_parallel && d.seq % tp_size != 0)
    fail("--sequence-parallel needs --seq-length ({}) divisible by --tensor-model-parallel-size ({})", d.seq, tp_size);
  MT_CHECK(r.cp_size == cfg.parallel.context_parallel_size, "CP {} at the rank, {} in the Config", r.cp_size,
           cfg.parallel.context_parallel_size);
  if (d.cp_size < 1 || (d.cp_size > 1 && d.seq % (2 * d.cp_size) != 0))
    fail("--seq-length {} is not a multiple of 2 x --context-parallel-size {}", d.seq, d.cp_size);
  if (d.sequence_parallel && (d.seq / d.cp_size) % tp_size != 0)
    fail("--sequence-parallel needs --seq-length {} (per context-parallel rank: {}) divisible by "
         "--tensor-model-parallel-size {}", d.seq, d.seq / d.cp_size, tp_size);
  const std::vector<int64_t>& hier = cfg.parallel.hierarchical_context_parallel_sizes;
  d.cp_a2a_size = hier.empty() ? 1 : static_cast<int>(hier.front());
  for (int layer = 0; layer < d.num_layers; ++layer) {
    const std::vector<std::string>& types = cfg.parallel.cp_comm_type;
    const std::string& t = types.size() == 1 ? types[0] : types.at(static_cast<size_t>(layer));
    d.cp_comm.push_back(t == "a2a" ? CpCommType::a2a
                        : t == "allgather" ? CpCommType::allgather
                        : t == "a2a+p2p" ? CpCommType::a2a_p2p
                                         : CpCommType::p2p);
  }
  if (d.heads % d.tp_size) fail("--num-attention-heads ({}) must be divisible by --tensor-model-parallel-size ({})", d.heads, d.tp_size);
  if (d.groups < d.tp_size)
    throw Unsupported(fmt::format(
        "--num-query-groups {} is smaller than --tensor-model-parallel-size {}: Megatron would replicate KV heads "
        "across tensor-parallel ranks, megatrain does not; use a TP size that divides the number of query groups",
        d.groups, d.tp_size));
  if (d.groups % d.tp_size)
    fail("--num-query-groups ({}) must be divisible by --tensor-model-parallel-size ({})", d.groups, d.tp_size);
  if (d.ffn % d.tp_size) fail("--ffn-hidden-size ({}) must be divisible by --tensor-model-parallel-size ({})", d.ffn, d.tp_size);
  if (d.vocab % d.tp_size) fail("the padded vocabulary ({}) must be divisible by --tensor-model-parallel-size ({})", d.vocab, d.tp_size);

  d.pipeline = pp_size > 1;
  d.first_stage = pp_rank == 0;
  d.last_stage = pp_rank == pp_size - 1;
  if (layer_range) {
    d.layer_begin = layer_range->first;
    d.layer_end = layer_range->second;
  } else {
    if (d.num_layers % pp_size)
      fail("--num-layers ({}) must be divisible by --pipeline-model-parallel-size ({})", d.num_layers, pp_size);
    const int per = d.num_layers / pp_size;
    d.layer_begin = pp_rank * per;
    d.layer_end = d.layer_begin + per;
  }

  if (m.apply_residual_connection_post_layernorm)
    throw Unsupported("--apply-residual-connection-post-layernorm is not supported by megatrain");
  if (m.fp32_residual_connection) throw Unsupported("--fp32-residual-connection is not supported by megatrain yet");
  d.norm = m.normalization;
  d.norm_eps = static_cast<float>(m.norm_epsilon);
  d.norm_1p = m.apply_layernorm_1p;
  d.swiglu = m.swiglu || m.quick_geglu;
  d.glu = Glu{m.quick_geglu, static_cast<float>(m.glu_linear_offset),
              static_cast<float>(m.activation_func_clamp_value.value_or(0.0))};
  d.gelu_tanh = gelu_is_tanh(m);
  d.squared_relu = m.squared_relu;
  d.linear_bias = m.add_bias_linear;
  d.qkv_bias = m.add_bias_linear || m.add_qkv_bias;
  // Megatron takes L2Norm over the q/k layernorm when both are given.
  d.qk_norm = m.qk_layernorm || m.qk_l2_norm;
  d.qk_l2 = m.qk_l2_norm;
  d.qk_norm_weight_decay = cfg.train.apply_wd_to_qk_layernorm;
  d.output_gate = m.attention_output_gate;
  d.softmax = m.softmax_type;
  d.tied_embeddings = !m.untie_embeddings_and_output_weights;
  d.position = m.position_embedding_type;
  if (d.position == PositionEmbedding::learned_absolute && m.max_position_embeddings < m.seq_length)
    fail("--max-position-embeddings ({}) must be >= --seq-length ({})", m.max_position_embeddings, m.seq_length);
  if (d.position == PositionEmbedding::yarn) {
    // YaRN rotates the whole head whatever --rotary-percent says (Megatron's YarnRotaryEmbedding
    // takes kv_channels as its dimension).
    d.position = PositionEmbedding::rope;
    d.rot_dim = d.head_dim;
  } else if (d.position == PositionEmbedding::rope && m.multi_latent_attention) {
    d.position = PositionEmbedding::none;  // (GPTModel builds no RoPE for MLA: the attention has its own)
  } else if (d.position == PositionEmbedding::rope) {
    // Megatron: dim = int(kv_channels * rotary_percent) when the percent is below 1.
    d.rot_dim = m.rotary_percent < 1.0 ? static_cast<int>(d.head_dim * m.rotary_percent) : d.head_dim;
    if (d.rot_dim % 2 != 0 || d.rot_dim <= 0)
      fail("--rotary-percent {} gives {} rotary dims of head dim {}: it must be a positive even number",
           m.rotary_percent, d.rot_dim, d.head_dim);
    d.rope_interleaved = m.rotary_interleaved;
  }
  if (m.multi_latent_attention) {
    d.mla = true;
    d.q_lora = m.q_lora_rank.value_or(0);
    d.kv_lora = m.kv_lora_rank;
    d.mla_nope = m.qk_head_dim;
    d.mla_rope = m.qk_pos_emb_head_dim;
    d.mla_v = m.v_head_dim;
    d.mla_latent_norm = m.qk_layernorm;
    d.head_dim = d.mla_nope + d.mla_rope;
    d.groups = d.heads;
    d.qk_norm = false;
    d.qkv_bias = false;
    d.rot_dim = mla_rope_is_yarn(m) ? d.mla_rope
                : m.rotary_percent < 1.0 ? static_cast<int>(d.mla_rope * m.rotary_percent)
                                         : d.mla_rope;
    d.rope_interleaved = false;
    // Megatron: mscale = yarn_get_mscale(--rotary-scaling-factor, --mscale-all-dim), whatever
    // --rope-type; the scale is mscale^2 / sqrt(d_qk).
    const double ms = yarn_get_mscale(m.rotary_scaling_factor, m.mscale_all_dim);
    d.softmax_scale = static_cast<float>(ms * ms / std::sqrt(static_cast<double>(d.head_dim)));
  }
  // A window that reaches back to the first token is causal attention: left out, since its mask
  // costs cuDNN's kernels time (bench/RESULTS.md).
  for (int layer = 0; layer < d.num_layers; ++layer) {
    const int window = attention_window_left(m, layer);
    d.window_left.push_back(window >= d.seq - 1 ? -1 : window);
  }
  d.seq /= d.cp_size;  // this rank's positions (the windows above are of the whole sequence)
  if (m.moe.enabled()) {
    const MoeConfig& e = m.moe;
    // What the MoE block does not run yet (app/ refuses these flags first, naming them).
    if (tp_size > 1 && !d.sequence_parallel)
      fail("--num-experts with --tensor-model-parallel-size {} needs --sequence-parallel (as in Megatron-LM)", tp_size);
    if (m.add_bias_linear && (cfg.parallel.expert_tensor_parallel_size.value_or(tp_size) != 1 ||
                              e.shared_expert_intermediate_size.value_or(0) > 0))
      fail("MoE layers with linear biases need an expert tensor-parallel size of 1 and no shared expert (as in "
           "Megatron-LM)");
    d.experts = e.num_experts;
    d.topk = e.router_topk;
    const int ep = cfg.parallel.expert_model_parallel_size;
    if (ep < 1 || d.experts % ep)
      fail("--num-experts {} is not a multiple of --expert-model-parallel-size {}", d.experts, ep);
    MT_CHECK(r.ep_size == ep && r.etp_size == cfg.parallel.expert_tensor_parallel_size.value_or(tp_size),
             "EP x ETP {} x {} at the rank, {} x {} in the Config", r.ep_size, r.etp_size, ep,
             cfg.parallel.expert_tensor_parallel_size.value_or(tp_size));
    if (d.etp_size < 1 || tp_size % d.etp_size != 0)
      throw Unsupported(fmt::format("--expert-tensor-parallel-size {} with --tensor-model-parallel-size {} is not "
                                    "supported yet (divisors of the TP size are)", d.etp_size, tp_size));
    d.expert_ffn = e.expert_ffn ? e.expert_ffn : e.ffn_hidden_size.value_or(d.ffn);
    d.shared_ffn = e.shared_expert_intermediate_size.value_or(0);
    d.shared_gate = e.shared_expert_gate;
    if (d.expert_ffn % d.etp_size || d.shared_ffn % tp_size)
      fail("--moe-ffn-hidden-size ({}) must be divisible by the experts' tensor-parallel size ({}) and "
           "--moe-shared-expert-intermediate-size ({}) by the tensor-parallel size ({})", d.expert_ffn, d.etp_size,
           d.shared_ffn, tp_size);
    d.moe_score = e.score_function;
    d.moe_pre_softmax = e.router_pre_softmax;
    d.moe_probs_on_input = e.apply_probs_on_input;
    d.moe_scaling = static_cast<float>(e.router_topk_scaling_factor.value_or(0.0));
    d.moe_groups = e.router_num_groups.value_or(0);
    d.moe_group_topk = e.router_group_topk.value_or(0);
    using LB = MoeLoadBalancing;
    d.moe_aux_coeff = static_cast<float>(e.aux_loss_coeff_of(LB::aux_loss));
    d.moe_seq_coeff = static_cast<float>(e.aux_loss_coeff_of(LB::seq_aux_loss));
    d.moe_global_coeff = static_cast<float>(e.aux_loss_coeff_of(LB::global_aux_loss));
    d.moe_z_coeff = static_cast<float>(e.z_loss_coeff.value_or(0.0));
    const auto has = [&](LB t) {
      return std::find(e.load_balancing_type.begin(), e.load_balancing_type.end(), t) != e.load_balancing_type.end();
    };
    for (LB t : e.load_balancing_type) d.moe_sinkhorn |= t == LB::sinkhorn;
    // (Megatron's `"aux_loss" in args.moe_router_load_balancing_type`: one type is a string.)
    const bool one = e.load_balancing_type.size() == 1;
    d.moe_log_aux = has(LB::aux_loss) || (one && (has(LB::seq_aux_loss) || has(LB::global_aux_loss)));
    d.moe_log_seq = has(LB::seq_aux_loss);
    d.moe_log_global = has(LB::global_aux_loss);
    d.moe_log_z = e.z_loss_coeff.has_value();
    d.moe_per_layer_logging = e.per_layer_logging;
    d.moe_force_balance = e.router_force_load_balancing;
    if (e.router_force_biased) d.moe_force_bias = static_cast<float>(*e.router_force_biased);
    d.moe_jitter_eps = static_cast<float>(e.input_jitter_eps.value_or(0.0));
    d.moe_expert_bias = e.router_enable_expert_bias;
    d.moe_bias_rate = static_cast<float>(e.router_bias_update_rate);
    d.moe_alltoall = e.token_dispatcher_type != MoeDispatcher::allgather;
    if (e.expert_capacity_factor && *e.expert_capacity_factor >= 0) {
      d.moe_pad_to_capacity = e.pad_expert_input_to_capacity;
      d.moe_capacity_factor = *e.expert_capacity_factor;
      d.moe_drop_by_position = e.token_drop_policy == MoeDropPolicy::position;
    }
    if (e.router_dtype && *e.router_dtype != "fp32")
      throw Unsupported(fmt::format("--moe-router-dtype {} is not supported yet (fp32 is)", *e.router_dtype));
    d.moe_router_fp32 = e.router_dtype.has_value();
    d.moe_layer.assign(static_cast<size_t>(d.num_layers), 0);
    for (int l = 0; l < d.num_layers; ++l)
      d.moe_layer[static_cast<size_t>(l)] =
          e.moe_layer.empty() ? (l % std::max(1, e.layer_freq) == 0) : e.moe_layer.at(static_cast<size_t>(l));
  }
  if (m.gated_delta_net) {
    // (The engine's own checks; the CLI refuses these combinations with their flags first.)
    if (cfg.train.fp8_format) throw Unsupported("Gated DeltaNet with --fp8-format is not supported yet");
    if (d.cp_size > 1) throw Unsupported("Gated DeltaNet with context parallelism is not supported yet");
    if (m.multi_latent_attention) throw Unsupported("Gated DeltaNet with multi-latent attention is not supported yet");
    if (!m.swiglu) throw Unsupported("Gated DeltaNet without --swiglu (SiLU) is not supported yet");
    MT_CHECK(m.linear_num_key_heads % d.tp_size == 0 && m.linear_num_value_heads % d.tp_size == 0 &&
                 m.linear_num_value_heads % m.linear_num_key_heads == 0,
             "Gated DeltaNet heads {}/{} under TP {}", m.linear_num_key_heads, m.linear_num_value_heads, d.tp_size);
    d.gdn_key_heads = m.linear_num_key_heads;
    d.gdn_value_heads = m.linear_num_value_heads;
    d.gdn_dk = m.linear_key_head_dim;
    d.gdn_dv = m.linear_value_head_dim;
    d.gdn_conv = m.linear_conv_kernel_dim;
    d.linear_layer = gdn_layer_map(m);
  }
  d.nope_layer = m.nope_layer;
  d.mtp = m.mtp_num_layers.value_or(0);
  if (d.mtp > 0) {
    // What the multi-token prediction layers do not run yet (named, never silently wrong).
    if (d.mtp > 6) throw Unsupported(fmt::format("--mtp-num-layers {} is not supported yet (at most 6)", d.mtp));
    d.mtp_scale = static_cast<float>(m.mtp_loss_scaling_factor / d.mtp);
    // The mtp layers are laid out as the last decoder layer is, but for their windows: Megatron
    // numbers each MTP depth's transformer layer on its own, 1, 2, ... (MultiTokenPredictionLayer:
    // depth + 1, plus the pipeline layout's MTP offset, 0 with every MTP layer on the last stage),
    // so depth j + 1 takes the window --window-attn-skip-freq gives decoder layer j + 1.
    const int64_t whole = static_cast<int64_t>(d.seq) * d.cp_size;
    for (int j = 0; j < d.mtp; ++j) {
      if (!m.window_attn_pattern.empty() && static_cast<size_t>(j) >= m.window_attn_pattern.size())
        fail("--window-attn-skip-freq's list has {} entries: multi-token prediction depth {} reads entry {}",
             m.window_attn_pattern.size(), j + 1, j + 1);
      const int window = attention_window_left(m, j);
      d.window_left.push_back(window >= whole - 1 ? -1 : window);
      d.cp_comm.push_back(d.cp_comm.back());
      if (!d.moe_layer.empty()) d.moe_layer.push_back(d.moe_layer.back());
      // (Megatron-LM's MTP layer takes the last decoder layer's spec: Gated DeltaNet if it is.)
      if (!d.linear_layer.empty()) d.linear_layer.push_back(d.linear_layer.back());
      // (Megatron-LM's no_rope_freq[layer_number - 1]: depth j + 1 reads entry j.)
      if (!m.nope_layer.empty()) {
        if (static_cast<size_t>(j) >= m.nope_layer.size())
          fail("--no-rope-freq's list has {} entries: multi-token prediction depth {} reads entry {}",
               m.nope_layer.size(), j + 1, j + 1);
        d.nope_layer.push_back(m.nope_layer[static_cast<size_t>(j)]);
      }
    }
    if (d.last_stage) d.layer_end += d.mtp;
  }
  d.attention_dropout = static_cast<float>(m.attention_dropout);
  d.hidden_dropout = static_cast<float>(m.hidden_dropout);
  if (d.attention_dropout < 0 || d.attention_dropout >= 1) fail("--attention-dropout must be in [0, 1)");
  if (d.hidden_dropout < 0 || d.hidden_dropout >= 1) fail("--hidden-dropout must be in [0, 1)");
  d.init_std = static_cast<float>(m.init_method_std);
  // Megatron's scaled init for the output projections of each layer: sigma / sqrt(2 L).
  d.output_init_std = static_cast<float>(m.init_method_std / std::sqrt(2.0 * m.num_layers));
  d.embedding_init_std = static_cast<float>(m.embedding_init_method_std.value_or(m.init_method_std));
  d.output_layer_init_std = d.init_std;
  if (m.use_mup) {
    // MuP (Megatron's TransformerConfig): the hidden weights' std over sqrt(width), the output
    // projections' over sqrt(2 L width), the embeddings' (and an untied output layer's) unscaled;
    // softmax scale sqrt(base head dim or 1) / d^power; the embedding and logit multipliers.
    const double w = m.mup_width_mult;
    d.init_std = static_cast<float>(m.init_method_std / std::sqrt(w));
    d.output_init_std = static_cast<float>(m.init_method_std / (std::sqrt(2.0 * m.num_layers) * std::sqrt(w)));
    d.output_layer_init_std = d.embedding_init_std;
    d.softmax_scale = static_cast<float>((m.mup_base_head_dim ? std::sqrt(*m.mup_base_head_dim) : 1.0) /
                                         std::pow(static_cast<double>(d.head_dim), m.mup_attn_scale_power));
    d.embedding_mult = static_cast<float>(m.mup_embedding_mult);
    d.logits_mult = static_cast<float>(m.mup_output_mult);
    d.mup = true;
  }
  d.seed = static_cast<uint64_t>(static_cast<uint32_t>(cfg.train.seed));
  return d;
}

// Megatron's get_capacity(num_tokens * topk, num_experts, capacity_factor) on one rank's rows.
int64_t ModelDims::moe_capacity() const {
  return static_cast<int64_t>(
      std::ceil((static_cast<double>(tokens_local() * topk) / experts) * moe_capacity_factor));
}

ModelDims ModelDims::for_chunk(const Config& cfg, const RankPosition& r, int first_layer, int num_layers,
                               bool has_embedding, bool has_output) {
  ModelDims d = from_config(cfg, r, std::make_pair(first_layer, first_layer + num_layers));
  d.first_stage = has_embedding;
  d.last_stage = has_output;
  d.layer_end = first_layer + num_layers + (has_output ? d.mtp : 0);
  return d;
}

GdnShape ModelDims::gdn_shape() const {
  GdnShape s;
  s.batch = micro_batch;
  s.seq = seq;
  s.key_heads = gdn_key_heads / tp_size;
  s.value_heads = gdn_value_heads / tp_size;
  s.dk = gdn_dk;
  s.dv = gdn_dv;
  s.conv_k = gdn_conv;
  s.scale = gdn_dk > 0 ? 1.0f / std::sqrt(static_cast<float>(gdn_dk)) : 0.0f;
  return s;
}

}  // namespace mt
