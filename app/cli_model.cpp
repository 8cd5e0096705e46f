// Model architecture flags.
#include "app/flags.h"

#include <fmt/format.h>

#include <array>
#include <vector>

#include "app/layer_pattern.h"

namespace mt::cli {

namespace {

// A per-layer pattern (Megatron's moe_freq_type values: N, or a 0/1 list expression) held in two
// ModelConfig fields, recorded in the checkpoint's model section as those fields
// (app/checkpoint_args.cpp) under the Megatron destination `dest`.
void layer_frequency_flag(FlagTable& t, const std::string& name, const std::string& help,
                          std::optional<int> ModelConfig::*every, std::vector<int> ModelConfig::*pattern,
                          const std::string& dest) {
  FlagSpec s;
  s.name = name;
  s.group = FlagGroup::model;
  s.metavar = "N|LIST";
  s.help = help;
  s.default_text = "None";
  s.apply = [name, every, pattern](CliState& st, const FlagValue& v) {
    const LayerFrequency f = parse_layer_frequency(name, v.one());
    st.cfg.model.*every = f.every;
    st.cfg.model.*pattern = f.pattern;
  };
  s.value = [every, pattern](const Config& c) -> nlohmann::json {
    if (!(c.model.*every) && (c.model.*pattern).empty()) return nullptr;
    return layer_frequency_text({c.model.*every, c.model.*pattern});
  };
  t.add(std::move(s)).model_setting(dest);
}

}  // namespace

void add_model_flags(FlagTable& t) {
  t.set_group(FlagGroup::model);
  t.value("--num-layers", "number of transformer layers (required)", MT_FIELD(model.num_layers)).model_setting("num_layers", CheckpointTake::if_absent, CheckpointCompare::yes).default_text =
      "None (required)";
  {
    FlagSpec s;
    s.name = "--encoder-num-layers";
    s.group = FlagGroup::model;
    s.metavar = "INT";
    s.help = "alias of --num-layers for GPT models (the two are exclusive)";
    s.default_text = "None";
    s.apply = [](CliState& st, const FlagValue& v) { st.encoder_num_layers = parse_int_arg("--encoder-num-layers", v.one()); };
    t.add(std::move(s));
  }
  t.recognised("--decoder-num-layers", Arity::one, "INT", "None", "decoder layers of T5-style encoder-decoder models");
  t.value("--hidden-size", "transformer hidden size h (required)", MT_FIELD(model.hidden_size)).model_setting("hidden_size", CheckpointTake::if_absent, CheckpointCompare::yes).default_text =
      "None (required)";
  t.value("--num-attention-heads", "attention heads n (required)", MT_FIELD(model.num_attention_heads)).model_setting("num_attention_heads", CheckpointTake::if_absent, CheckpointCompare::yes).default_text =
      "None (required)";
  t.value("--ffn-hidden-size", "MLP inner size (default 4h; with --swiglu int(8h/3/64)*64)", MT_FIELD(model.ffn_hidden_size)).model_setting("ffn_hidden_size", CheckpointTake::if_absent);
  t.value("--kv-channels", "per-head dimension (default hidden-size / num-attention-heads)", MT_FIELD(model.kv_channels)).model_setting("kv_channels", CheckpointTake::if_absent);
  t.flag("--group-query-attention", "grouped-query attention (with --num-query-groups)", MT_FIELD(model.group_query_attention)).model_setting("group_query_attention");
  t.value("--num-query-groups", "key/value groups with --group-query-attention", MT_FIELD(model.num_query_groups)).model_setting("num_query_groups").not_imported();
  t.value("--max-position-embeddings", "maximum sequence length / learned position table size (required)",
          MT_FIELD(model.max_position_embeddings)).model_setting("max_position_embeddings", CheckpointTake::if_absent, CheckpointCompare::with_learned_positions).default_text = "None (required)";
  t.choice("--position-embedding-type", "position embedding (Megatron also has mrope, relative)",
           std::vector<std::pair<std::string, PositionEmbedding>>{{"learned_absolute", PositionEmbedding::learned_absolute},
                                                                 {"rope", PositionEmbedding::rope},
                                                                 {"yarn", PositionEmbedding::yarn},
                                                                 {"none", PositionEmbedding::none}},
           MT_FIELD(model.position_embedding_type)).model_setting("position_embedding_type", CheckpointTake::forced, CheckpointCompare::yes);
  {
    FlagSpec s;
    s.name = "--use-rotary-position-embeddings";
    s.group = FlagGroup::model;
    s.arity = Arity::none;
    s.help = "deprecated alias of --position-embedding-type rope";
    s.apply = [](CliState& st, const FlagValue&) { st.use_rotary_position_embeddings = true; };
    t.add(std::move(s));
  }
  t.flag("--no-position-embedding", "deprecated: no learned position embeddings (only valid with rope)",
         MT_FIELD(model.add_position_embedding), false).model_setting("add_position_embedding");
  t.value("--rotary-base", "RoPE theta (an integer, as in Megatron)", MT_FIELD(model.rotary_base)).model_setting("rotary_base");
  t.value("--rotary-percent", "fraction of the head dimension rotated", MT_FIELD(model.rotary_percent)).model_setting("rotary_percent");
  t.flag("--rotary-interleaved", "interleaved rotary pairs (default: rotate-half)", MT_FIELD(model.rotary_interleaved)).model_setting("rotary_interleaved");
  t.value("--rotary-seq-len-interpolation-factor", "linear RoPE position interpolation factor",
          MT_FIELD(model.rotary_seq_len_interpolation_factor)).model_setting("rotary_seq_len_interpolation_factor", CheckpointTake::no);
  t.flag("--use-rope-scaling", "Llama-3.x RoPE frequency scaling", MT_FIELD(model.use_rope_scaling)).model_setting("use_rope_scaling");
  t.value("--rope-scaling-factor", "Llama-3.x RoPE scaling factor", MT_FIELD(model.rope_scaling_factor)).model_setting("rope_scaling_factor");
  t.choice("--rope-type", "RoPE flavour of --multi-latent-attention (default yarn; other attention: rope only)", std::vector<std::pair<std::string, std::string>>{{"rope", "rope"}, {"yarn", "yarn"}},
           MT_FIELD(model.rope_type)).model_setting("rope_type", CheckpointTake::forced, CheckpointCompare::no, true);
  t.choice("--normalization", "normalisation layer",
           std::vector<std::pair<std::string, Normalization>>{{"LayerNorm", Normalization::layernorm},
                                                              {"RMSNorm", Normalization::rmsnorm}},
           MT_FIELD(model.normalization)).model_setting("normalization", CheckpointTake::forced, CheckpointCompare::yes);
  t.value("--norm-epsilon", "LayerNorm/RMSNorm epsilon", MT_FIELD(model.norm_epsilon)).model_setting("layernorm_epsilon").model_key("norm_epsilon");
  t.flag("--apply-layernorm-1p", "zero-centred norm weight (stored as w - 1)", MT_FIELD(model.apply_layernorm_1p)).model_setting("apply_layernorm_1p", CheckpointTake::forced, CheckpointCompare::yes);
  t.flag("--apply-residual-connection-post-layernorm", "BERT-style residual after the norm",
         MT_FIELD(model.apply_residual_connection_post_layernorm)).model_setting("apply_residual_connection_post_layernorm", CheckpointTake::no);
  t.flag("--swiglu", "SwiGLU MLP (gate and up projections, SiLU)", MT_FIELD(model.swiglu)).model_setting("swiglu", CheckpointTake::forced, CheckpointCompare::yes);
  t.flag("--squared-relu", "squared-ReLU activation", MT_FIELD(model.squared_relu)).model_setting("squared_relu", CheckpointTake::forced, CheckpointCompare::yes, true);
  t.flag("--quick-geglu", "quick-GeLU gated linear unit (gpt-oss): x0 sigmoid(1.702 x0) * x1", MT_FIELD(model.quick_geglu))
      .model_setting("quick_geglu", CheckpointTake::forced, CheckpointCompare::yes, true);
  t.value("--glu-linear-offset", "offset added to the gated unit's linear half: act(x0) * (x1 + offset)",
          MT_FIELD(model.glu_linear_offset))
      .model_setting("glu_linear_offset", CheckpointTake::forced, CheckpointCompare::no, true);
  t.value("--activation-func-clamp-value",
          "the gated unit's halves clamped first: x0 to at most V, x1 to [-V, V] (gpt-oss; SwiGLU: MoE only)",
          MT_FIELD(model.activation_func_clamp_value))
      .model_setting("activation_func_clamp_value", CheckpointTake::forced, CheckpointCompare::no, true);
  t.flag("--openai-gelu", "tanh-approximated GeLU", MT_FIELD(model.openai_gelu)).model_setting("openai_gelu");
  // Not only a kernel switch: Megatron's fused bias-GeLU is the tanh approximation, its unfused
  // path exact GeLU, so this flag picks the activation (core/config.h gelu_is_tanh).
  t.negative_flag("--no-bias-gelu-fusion", "exact (erf) GeLU instead of Megatron's fused bias-GeLU (tanh approximation)",
                  MT_FIELD(model.bias_gelu_fusion)).model_setting("bias_gelu_fusion");
  t.flag("--disable-bias-linear", "no biases in the linear layers", MT_FIELD(model.add_bias_linear), false).model_setting("add_bias_linear", CheckpointTake::forced, CheckpointCompare::yes);
  t.flag("--add-qkv-bias", "bias on the QKV projection only", MT_FIELD(model.add_qkv_bias)).model_setting("add_qkv_bias", CheckpointTake::forced, CheckpointCompare::yes);
  t.flag("--qk-layernorm", "normalise queries and keys per head", MT_FIELD(model.qk_layernorm)).model_setting("qk_layernorm", CheckpointTake::forced, CheckpointCompare::yes);
  t.flag("--qk-l2-norm", "Llama-4 style L2 norm of queries and keys (RMS normalization without weights)",
         MT_FIELD(model.qk_l2_norm)).model_setting("qk_l2_norm", CheckpointTake::forced, CheckpointCompare::yes, true);
  t.flag("--untie-embeddings-and-output-weights", "separate output layer (default: tied to the word embeddings)",
         MT_FIELD(model.untie_embeddings_and_output_weights)).model_setting("untie_embeddings_and_output_weights", CheckpointTake::forced, CheckpointCompare::yes);
  t.value("--make-vocab-size-divisible-by", "pad the vocabulary to a multiple of this times TP",
          MT_FIELD(model.make_vocab_size_divisible_by)).model_setting("make_vocab_size_divisible_by", CheckpointTake::no);
  t.value("--seq-length", "training sequence length", MT_FIELD(model.seq_length)).model_setting("seq_length", CheckpointTake::if_absent).default_text = "None";
  {
    FlagSpec s;
    s.name = "--encoder-seq-length";
    s.group = FlagGroup::model;
    s.metavar = "INT";
    s.help = "alias of --seq-length (the two are exclusive)";
    s.default_text = "None";
    s.apply = [](CliState& st, const FlagValue& v) { st.encoder_seq_length = parse_int_arg("--encoder-seq-length", v.one()); };
    t.add(std::move(s));
  }
  t.recognised("--decoder-seq-length", Arity::one, "INT", "None", "decoder sequence length of encoder-decoder models");
  {
    FlagSpec s;
    s.name = "--window-size";
    s.group = FlagGroup::model;
    s.metavar = "LEFT,RIGHT";
    s.help = "sliding-window attention: a query sees LEFT earlier keys (-1: all); causal, so RIGHT counts as 0";
    s.default_text = "None";
    s.apply = [](CliState& st, const FlagValue& v) {
      const std::vector<int> w = parse_int_tuple("--window-size", v.one());
      if (w.size() != 2)
        fail("--window-size takes two integers LEFT,RIGHT (Transformer Engine's window), got '{}'", v.one());
      st.cfg.model.window_size = std::make_pair(w[0], w[1]);
    };
    s.value = [](const Config& c) -> nlohmann::json {
      const auto& w = c.model.window_size;
      return w ? nlohmann::json(fmt::format("{},{}", w->first, w->second)) : nlohmann::json(nullptr);
    };
    // The checkpoint's model section holds the pair, [LEFT, RIGHT].
    s.field = [](const Config& c) { return field_json(c.model.window_size); };
    s.set_field = [](Config& c, const nlohmann::json& j) { field_from_json(c.model.window_size, j); };
    t.add(std::move(s)).model_setting("window_size", CheckpointTake::forced, CheckpointCompare::no, true);
  }
  {
    FlagSpec s;
    s.name = "--window-attn-skip-freq";
    s.group = FlagGroup::model;
    s.metavar = "N|LIST";
    s.help = "layers without the window: every N-th (1-based), or a 0/1 list per layer such as \"([1]*3+[0])*4\"";
    s.default_text = "None";
    s.apply = [](CliState& st, const FlagValue& v) {
      const LayerFrequency f = parse_layer_frequency("--window-attn-skip-freq", v.one());
      st.cfg.model.window_attn_skip_every = f.every;
      st.cfg.model.window_attn_pattern = f.pattern;
    };
    s.value = [](const Config& c) -> nlohmann::json {
      const ModelConfig& m = c.model;
      if (!m.window_attn_skip_every && m.window_attn_pattern.empty()) return nullptr;
      return layer_frequency_text({m.window_attn_skip_every, m.window_attn_pattern});
    };
    // Recorded in the checkpoint's model section as its two fields (app/checkpoint_args.cpp).
    t.add(std::move(s)).model_setting("window_attn_skip_freq");
  }
  t.choice("--softmax-type",
           "attention softmax: vanilla, off-by-one (every row's denominator + 1: a sink logit of 0) or learnable (a "
           "sink logit per head, trained: gpt-oss's attention sinks)",
           std::vector<std::pair<std::string, SoftmaxType>>{{"vanilla", SoftmaxType::vanilla},
                                                            {"off-by-one", SoftmaxType::off_by_one},
                                                            {"learnable", SoftmaxType::learnable}},
           MT_FIELD(model.softmax_type)).model_setting("softmax_type", CheckpointTake::forced, CheckpointCompare::no, true);
  t.choice("--attention-backend",
           "attention implementation: flash (megatrain's kernels: the reference backend's dropout mask), fused "
           "(cuDNN: its own dropout mask), auto (cuDNN where it runs); unfused runs flash (the same attention, "
           "deterministic, scores never stored)",
           std::vector<std::pair<std::string, AttentionBackend>>{{"flash", AttentionBackend::flash},
                                                                 {"fused", AttentionBackend::fused},
                                                                 {"unfused", AttentionBackend::unfused},
                                                                 {"local", AttentionBackend::local},
                                                                 {"auto", AttentionBackend::auto_}},
           MT_FIELD(model.attention_backend));
  t.no_effect("--enable-experimental", Arity::none,
              "megatrain has no experimental switch: what it accepts runs without this flag, and what it does not "
              "build is refused by name with or without it");
  t.recognised("--spec", Arity::zero_or_more, "STR [STR ...]", "None", "model layer spec module");
  t.flag("--attention-output-gate", "gate each attention head's output with sigmoid(x W_gate), W_gate part of the QKV "
         "projection", MT_FIELD(model.attention_output_gate)).model_setting("attention_output_gate", CheckpointTake::forced, CheckpointCompare::yes, true);
  t.flag("--multi-latent-attention", "DeepSeek's multi-latent attention (low-rank queries, keys and values)",
         MT_FIELD(model.multi_latent_attention)).model_setting("multi_latent_attention", CheckpointTake::forced,
                                                               CheckpointCompare::yes, true);
  t.value("--q-lora-rank", "MLA: rank of the queries' low-rank projection (None: a direct projection)",
          MT_FIELD(model.q_lora_rank)).model_setting("q_lora_rank", CheckpointTake::forced, CheckpointCompare::no, true);
  t.value("--kv-lora-rank", "MLA: rank of the keys' and values' low-rank projection", MT_FIELD(model.kv_lora_rank))
      .model_setting("kv_lora_rank", CheckpointTake::forced, CheckpointCompare::no, true);
  t.value("--qk-head-dim", "MLA: query/key head dimension without RoPE", MT_FIELD(model.qk_head_dim))
      .model_setting("qk_head_dim", CheckpointTake::forced, CheckpointCompare::no, true);
  t.value("--qk-pos-emb-head-dim", "MLA: query/key head dimension with RoPE (the key's part shared by the heads)",
          MT_FIELD(model.qk_pos_emb_head_dim)).model_setting("qk_pos_emb_head_dim", CheckpointTake::forced,
                                                             CheckpointCompare::no, true);
  t.value("--v-head-dim", "MLA: value head dimension", MT_FIELD(model.v_head_dim))
      .model_setting("v_head_dim", CheckpointTake::forced, CheckpointCompare::no, true);
  t.value("--mtp-num-layers", "multi-token prediction: D layers after the decoder predicting 2..D+1 tokens ahead",
          MT_FIELD(model.mtp_num_layers)).model_setting("mtp_num_layers", CheckpointTake::forced, CheckpointCompare::yes,
                                                        true);
  t.value("--mtp-loss-scaling-factor", "multi-token prediction: the weight of the D losses' mean",
          MT_FIELD(model.mtp_loss_scaling_factor));
  t.recognised("--mtp-use-repeated-layer", Arity::none, "", "off", "multi-token prediction: one layer's weights for every depth");
  t.recognised("--mtp-detach-heads", Arity::none, "", "off",
               "multi-token prediction: no gradient from the depths into the decoder, embedding and output layer");
  t.recognised("--mtp-hsm", Arity::none, "", "off", "multi-token prediction: hidden-state mixing");
  t.value("--rotary-scaling-factor", "YaRN: the context scaling factor s", MT_FIELD(model.rotary_scaling_factor))
      .model_setting("rotary_scaling_factor", CheckpointTake::forced, CheckpointCompare::no, true);
  t.value("--mscale", "YaRN: the mscale term of the concentration factor", MT_FIELD(model.mscale))
      .model_setting("mscale", CheckpointTake::forced, CheckpointCompare::no, true);
  t.value("--mscale-all-dim", "YaRN: the mscale_all_dim term (MLA: also the softmax scale's)",
          MT_FIELD(model.mscale_all_dim)).model_setting("mscale_all_dim", CheckpointTake::forced, CheckpointCompare::no,
                                                        true);
  t.value("--yarn-original-max-position-embeddings",
          "YaRN (--position-embedding-type yarn): the original context (default 4096)",
          MT_FIELD(model.yarn_original_max_position_embeddings))
      .model_setting("yarn_original_max_position_embeddings", CheckpointTake::forced, CheckpointCompare::no, true);
  t.value("--yarn-beta-fast", "YaRN (--position-embedding-type yarn): beta_fast (default 32)",
          MT_FIELD(model.yarn_beta_fast)).model_setting("yarn_beta_fast", CheckpointTake::forced, CheckpointCompare::no, true);
  t.value("--yarn-beta-slow", "YaRN (--position-embedding-type yarn): beta_slow (default 1)",
          MT_FIELD(model.yarn_beta_slow)).model_setting("yarn_beta_slow", CheckpointTake::forced, CheckpointCompare::no, true);
  for (const bool round : {true, false}) {
    FlagSpec s;
    s.name = round ? "--yarn-correction-range-round-to-int" : "--no-yarn-correction-range-round-to-int";
    s.group = FlagGroup::model;
    s.arity = Arity::none;
    s.help = round ? "YaRN: round the correction range to integers (the default)"
                   : "YaRN: keep the correction range's ends fractional";
    s.apply = [round](CliState& st, const FlagValue&) { st.cfg.model.yarn_correction_range_round_to_int = round; };
    t.add(std::move(s));
  }
  // Megatron-LM's experimental attention variants: Gated DeltaNet (gated_delta_net, or gdn) is
  // built; gdn2 and DeepSeek sparse attention are refused (app/unsupported.cpp), and the DSA
  // indexer's settings change nothing without it (as in Megatron-LM).
  {
    FlagSpec s;
    s.name = "--experimental-attention-variant";
    s.group = FlagGroup::model;
    s.metavar = "{gdn,gdn2,dsa,gated_delta_net}";
    s.help = "gated_delta_net (or gdn): Gated DeltaNet linear attention in the layers --linear-attention-freq marks";
    s.default_text = "None";
    s.apply = [](CliState& st, const FlagValue& v) {
      const std::string& x = v.one();
      if (x != "gdn" && x != "gated_delta_net" && x != "gdn2" && x != "dsa")
        fail("--experimental-attention-variant: invalid choice '{}' (choose from gdn, gdn2, dsa, gated_delta_net)", x);
      st.cfg.model.gated_delta_net = x == "gdn" || x == "gated_delta_net";
    };
    s.value = [](const Config& c) -> nlohmann::json {
      return c.model.gated_delta_net ? nlohmann::json("gdn") : nlohmann::json(nullptr);
    };
    s.field = [](const Config& c) { return nlohmann::json(c.model.gated_delta_net); };
    s.set_field = [](Config& c, const nlohmann::json& j) { c.model.gated_delta_net = j.get<bool>(); };
    t.add(std::move(s)).model_setting("gated_delta_net", CheckpointTake::forced, CheckpointCompare::yes, true);
  }
  layer_frequency_flag(t, "--linear-attention-freq",
                       "Gated DeltaNet layers: all but every N-th (1-based), which keeps softmax attention, or a 0/1 "
                       "list per layer (1 = Gated DeltaNet) such as \"([1]*3+[0])*4\"",
                       &ModelConfig::linear_attention_every, &ModelConfig::linear_attention_pattern,
                       "linear_attention_freq");
  layer_frequency_flag(t, "--no-rope-freq",
                       "layers without the rotary embedding (NoPE): every N-th (1-based), or a 0/1 list per layer (1 = "
                       "no RoPE) such as \"([0]*3+[1])*4\"",
                       &ModelConfig::no_rope_every, &ModelConfig::no_rope_pattern, "no_rope_freq");
  t.value("--linear-conv-kernel-dim", "Gated DeltaNet: taps of the causal convolution of q, k and v",
          MT_FIELD(model.linear_conv_kernel_dim))
      .model_setting("linear_conv_kernel_dim", CheckpointTake::forced, CheckpointCompare::yes, true);
  t.value("--linear-key-head-dim", "Gated DeltaNet: query and key head dimension",
          MT_FIELD(model.linear_key_head_dim))
      .model_setting("linear_key_head_dim", CheckpointTake::forced, CheckpointCompare::yes, true);
  t.value("--linear-value-head-dim", "Gated DeltaNet: value and output-gate head dimension",
          MT_FIELD(model.linear_value_head_dim))
      .model_setting("linear_value_head_dim", CheckpointTake::forced, CheckpointCompare::yes, true);
  t.value("--linear-num-key-heads", "Gated DeltaNet: query and key heads", MT_FIELD(model.linear_num_key_heads))
      .model_setting("linear_num_key_heads", CheckpointTake::forced, CheckpointCompare::yes, true);
  t.value("--linear-num-value-heads", "Gated DeltaNet: value heads (a multiple of the key heads)",
          MT_FIELD(model.linear_num_value_heads))
      .model_setting("linear_num_value_heads", CheckpointTake::forced, CheckpointCompare::yes, true);
  for (const auto& [name, metavar] : std::vector<std::array<const char*, 2>>{{"--dsa-indexer-n-heads", "INT"},
                                                                             {"--dsa-indexer-head-dim", "INT"},
                                                                             {"--dsa-indexer-topk", "INT"},
                                                                             {"--dsa-indexer-loss-coeff", "FLOAT"}}) {
    t.no_effect_checked(name, metavar, {},
                        "a setting of DeepSeek sparse attention (--experimental-attention-variant dsa, not built): "
                        "no effect without it, as in Megatron-LM",
                        "None");
  }
  // Megatron-Core's MuP (TransformerConfig's use_mup and mup_* fields).
  t.flag("--use-mup", "maximal-update parametrization: width-scaled init, attention scale, output logits and Adam "
         "learning rate and eps of the hidden matrices", MT_FIELD(model.use_mup))
      .model_setting("use_mup", CheckpointTake::forced, CheckpointCompare::yes, true);
  t.value("--mup-base-hidden-size", "MuP: the base model's hidden size (width multiplier = hidden size / this; "
          "None: the hidden size)", MT_FIELD(model.mup_base_hidden_size))
      .model_setting("mup_base_hidden_size", CheckpointTake::forced, CheckpointCompare::yes, true);
  t.value("--mup-width-mult", "MuP: the width multiplier (computed from --mup-base-hidden-size with --use-mup)",
          MT_FIELD(model.mup_width_mult))
      .model_setting("mup_width_mult", CheckpointTake::forced, CheckpointCompare::no, true);
  t.value("--mup-embedding-mult", "MuP: multiplier of the embeddings' output", MT_FIELD(model.mup_embedding_mult))
      .model_setting("mup_embedding_mult", CheckpointTake::forced, CheckpointCompare::yes, true);
  t.value("--mup-output-mult", "MuP: multiplier of the logits (left at 1: 1 / width multiplier)",
          MT_FIELD(model.mup_output_mult))
      .model_setting("mup_output_mult", CheckpointTake::forced, CheckpointCompare::yes, true);
  t.value("--mup-base-head-dim", "MuP: base head dimension: softmax scale sqrt(this) / kv_channels^power",
          MT_FIELD(model.mup_base_head_dim))
      .model_setting("mup_base_head_dim", CheckpointTake::forced, CheckpointCompare::yes, true);
  t.value("--mup-attn-scale-power", "MuP: softmax scale 1 / kv_channels^power (1: MuP's 1/d, 0.5: 1/sqrt(d))",
          MT_FIELD(model.mup_attn_scale_power))
      .model_setting("mup_attn_scale_power", CheckpointTake::forced, CheckpointCompare::yes, true);
  t.flag("--fp32-residual-connection", "keep the residual stream in fp32 with --fp16 or --bf16",
         MT_FIELD(model.fp32_residual_connection));
  t.no_effect("--use-mcore-models", Arity::none, "megatrain builds Megatron-Core-style models only");
  t.no_effect("--transformer-impl", Arity::one, "megatrain runs its own kernels (CUDA, or the reference backend)",
              "transformer_engine");
  t.no_effect("--use-transformer-engine-op-fuser", Arity::none,
              "megatrain has no Transformer Engine: its own kernels fuse the linear layers' neighbouring ops");
  t.no_effect("--use-flash-attn", Arity::none, "megatrain's attention is always flash-style (it never stores the s x s matrix)");
  t.removed("--hybrid-attention-ratio", Arity::one, "--hybrid-attention-ratio was removed from Megatron-LM: drop it");
  t.removed("--hybrid-mlp-ratio", Arity::one, "--hybrid-mlp-ratio was removed from Megatron-LM: drop it");
  t.removed("--use-legacy-models", Arity::none,
            "--use-legacy-models was removed from Megatron-LM; megatrain builds Megatron-Core-style models only: drop it");
}

}  // namespace mt::cli
