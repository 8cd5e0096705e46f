// Mixture-of-experts and FP8/FP4 flags, with Megatron-LM's types and defaults. What the engine does
// not build yet is refused after Megatron's own rules (app/unsupported.cpp, app/validate_moe.cpp).
#include "app/flags.h"

#include <fmt/format.h>

#include "app/layer_pattern.h"

namespace mt::cli {

namespace {

using nlohmann::json;

const std::vector<std::pair<std::string, MoeLoadBalancing>>& balancing_names() {
  static const std::vector<std::pair<std::string, MoeLoadBalancing>> n = {
      {"aux_loss", MoeLoadBalancing::aux_loss}, {"seq_aux_loss", MoeLoadBalancing::seq_aux_loss},
      {"global_aux_loss", MoeLoadBalancing::global_aux_loss}, {"sinkhorn", MoeLoadBalancing::sinkhorn},
      {"none", MoeLoadBalancing::none}};
  return n;
}

std::string balancing_name(MoeLoadBalancing b) {
  for (const auto& [n, v] : balancing_names())
    if (v == b) return n;
  return "?";
}

// Megatron keeps a one-element nargs='+' list as its element (validate_args).
template <class T, class F>
json collapsed(const std::vector<T>& v, F&& to_json) {
  if (v.size() == 1) return to_json(v.front());
  json a = json::array();
  for (const T& x : v) a.push_back(to_json(x));
  return a;
}

}  // namespace

void add_moe_flags(FlagTable& t) {
  t.set_group(FlagGroup::moe);
  {
    FlagSpec& s = t.value("--num-experts", "experts per MoE layer E (0 or None: no MoE layers)", MT_FIELD(model.moe.num_experts));
    s.default_text = "None (0 = None)";
    s.value = [](const Config& c) -> json {
      return c.model.moe.num_experts != 0 ? json(c.model.moe.num_experts) : json(nullptr);
    };
    s.field = s.value;  // the checkpoint's model section: null without experts, as Megatron's None
    s.set_field = [](Config& c, const json& j) { c.model.moe.num_experts = j.is_null() ? 0 : j.get<int>(); };
    s.model_setting("num_experts", CheckpointTake::forced, CheckpointCompare::yes, true);
  }
  t.value("--moe-ffn-hidden-size", "one expert's FFN size (None: the dense FFN size)", MT_FIELD(model.moe.ffn_hidden_size))
      .model_setting("moe_ffn_hidden_size", CheckpointTake::forced, CheckpointCompare::no, true);
  {
    FlagSpec s;
    s.name = "--moe-layer-freq";
    s.group = FlagGroup::moe;
    s.metavar = "N|LIST";
    s.help = "MoE layers: layer i (from 0) when i % N == 0, or a 0/1 list with one entry per layer such as "
             "\"([0]*3+[1]*29)\" or \"([1]*1+[0]*2)*4\"";
    s.default_text = "1";
    s.apply = [](CliState& st, const FlagValue& v) {
      MoeConfig& e = st.cfg.model.moe;
      const std::string& text = v.one();
      if (text.find('[') == std::string::npos) {
        e.layer_freq = parse_int_arg("--moe-layer-freq", text);
        e.layer_pattern.clear();
      } else {
        e.layer_pattern = parse_int_list_expression("--moe-layer-freq", text);
        if (e.layer_pattern.empty())
          fail("--moe-layer-freq '{}' is an empty list: give one 0/1 entry per layer", text);
      }
    };
    // An int, or the list (Megatron's moe_freq_type values); the checkpoint's model section holds
    // its two fields (app/checkpoint_args.cpp).
    s.value = [](const Config& c) -> json {
      const MoeConfig& e = c.model.moe;
      return e.layer_pattern.empty() ? json(e.layer_freq) : json(e.layer_pattern);
    };
    t.add(std::move(s)).model_setting("moe_layer_freq", CheckpointTake::forced);
  }
  t.value("--moe-router-topk", "experts each token is routed to (k)", MT_FIELD(model.moe.router_topk))
      .model_setting("moe_router_topk", CheckpointTake::forced, CheckpointCompare::no, true);
  {
    FlagSpec s;
    s.name = "--moe-router-load-balancing-type";
    s.group = FlagGroup::moe;
    s.arity = Arity::one_or_more;
    s.metavar = "{aux_loss,seq_aux_loss,global_aux_loss,sinkhorn,quantile_balancing,none} [...]";
    s.help = "load balancing: aux_loss (the Switch/GShard loss) or none; one or more types";
    s.default_text = "aux_loss";
    s.apply = [](CliState& st, const FlagValue& v) {
      std::vector<std::string> names;
      for (const auto& [n, b] : balancing_names()) names.push_back(n);
      names.push_back("quantile_balancing");  // refused before this runs (app/unsupported.cpp)
      std::vector<MoeLoadBalancing>& out = st.cfg.model.moe.load_balancing_type;
      out.clear();
      for (const std::string& x : v.values) {
        const std::string c = parse_choice_arg("--moe-router-load-balancing-type", x, names);
        bool found = false;
        for (const auto& [n, b] : balancing_names())
          if (n == c) {
            out.push_back(b);
            found = true;
          }
        if (!found) fail("megatrain does not support --moe-router-load-balancing-type {} yet", c);
      }
    };
    s.value = [](const Config& c) {
      return collapsed(c.model.moe.load_balancing_type, [](MoeLoadBalancing b) { return json(balancing_name(b)); });
    };
    t.add(std::move(s));
  }
  {
    FlagSpec s;
    s.name = "--moe-aux-loss-coeff";
    s.group = FlagGroup::moe;
    s.arity = Arity::one_or_more;
    s.metavar = "FLOAT [FLOAT ...]";
    s.help = "auxiliary loss coefficient, one per --moe-router-load-balancing-type";
    s.default_text = "0.0";
    s.apply = [](CliState& st, const FlagValue& v) {
      std::vector<double>& out = st.cfg.model.moe.aux_loss_coeff;
      out.clear();
      for (const std::string& x : v.values) out.push_back(parse_float_arg("--moe-aux-loss-coeff", x));
    };
    s.value = [](const Config& c) { return collapsed(c.model.moe.aux_loss_coeff, [](double x) { return json(x); }); };
    t.add(std::move(s));
  }
  t.value("--moe-z-loss-coeff", "router z-loss coefficient (None: no z-loss)", MT_FIELD(model.moe.z_loss_coeff));
  t.choice("--moe-router-score-function",
           "router scores: softmax over the experts, or sigmoid or sqrtsoftplus (sqrt(softplus(z))) per expert, "
           "normalized over the top k",
           std::vector<std::pair<std::string, MoeScoreFunction>>{{"softmax", MoeScoreFunction::softmax},
                                                                 {"sigmoid", MoeScoreFunction::sigmoid},
                                                                 {"sqrtsoftplus", MoeScoreFunction::sqrtsoftplus}},
           MT_FIELD(model.moe.score_function))
      .model_setting("moe_router_score_function", CheckpointTake::forced, CheckpointCompare::no, true);
  t.flag("--moe-router-pre-softmax", "softmax over all experts before the top-k (softmax scoring)",
         MT_FIELD(model.moe.router_pre_softmax))
      .model_setting("moe_router_pre_softmax", CheckpointTake::forced, CheckpointCompare::no, true);
  t.choice("--moe-router-dtype", "the router's logits and routing weights in fp32 (None: the activation dtype)",
           std::vector<std::pair<std::string, std::string>>{{"fp32", "fp32"}, {"fp64", "fp64"}},
           MT_FIELD(model.moe.router_dtype))
      .model_setting("moe_router_dtype", CheckpointTake::forced, CheckpointCompare::no, true);
  t.flag("--moe-router-enable-expert-bias", "aux-loss-free load balancing with a per-expert bias (sigmoid scoring)",
         MT_FIELD(model.moe.router_enable_expert_bias))
      .model_setting("moe_router_enable_expert_bias", CheckpointTake::forced, CheckpointCompare::no, true);
  t.value("--moe-router-bias-update-rate", "the expert bias's update rate (with --moe-router-enable-expert-bias)",
          MT_FIELD(model.moe.router_bias_update_rate));
  t.value("--moe-router-topk-scaling-factor", "factor on the top-k routing weights (None or 0: none)",
          MT_FIELD(model.moe.router_topk_scaling_factor))
      .model_setting("moe_router_topk_scaling_factor", CheckpointTake::forced, CheckpointCompare::no, true);
  t.value("--moe-router-num-groups", "group-limited routing: the experts' groups (with --moe-router-group-topk)",
          MT_FIELD(model.moe.router_num_groups))
      .model_setting("moe_router_num_groups", CheckpointTake::no, CheckpointCompare::no, true);
  t.value("--moe-router-group-topk", "group-limited routing: the groups each token may use",
          MT_FIELD(model.moe.router_group_topk))
      .model_setting("moe_router_group_topk", CheckpointTake::no, CheckpointCompare::no, true);
  t.flag("--moe-router-force-load-balancing", "route with random logits (benchmarks only)",
         MT_FIELD(model.moe.router_force_load_balancing));
  t.value("--moe-router-force-biased",
          "route with random logits plus a random per-expert bias of this standard deviation, the same on every "
          "rank (benchmarks only): positive, drawn anew for each training micro-batch; negative, drawn once per layer",
          MT_FIELD(model.moe.router_force_biased));
  t.without_effect(t.flag("--moe-router-fusion", "fused top-k routing and auxiliary-loss kernels",
                          MT_FIELD(model.moe.router_fusion)),
                   "megatrain's routing and load-balancing statistics always run as fused kernels");
  t.alias(t.flag("--moe-router-padding-for-fp8", "pad each expert's tokens to the FP8/FP4 GEMM alignment",
                 MT_FIELD(model.moe.router_padding_for_fp8)),
          "--moe-router-padding-for-quantization");
  t.choice("--moe-token-dispatcher-type",
           "token dispatcher under expert parallelism: allgather (every EP rank receives the group's tokens) or "
           "alltoall / flex (each pair's row sent to its expert's rank); the same results",
           std::vector<std::pair<std::string, MoeDispatcher>>{{"allgather", MoeDispatcher::allgather},
                                                              {"alltoall", MoeDispatcher::alltoall},
                                                              {"flex", MoeDispatcher::flex}},
           MT_FIELD(model.moe.token_dispatcher_type));
  t.without_effect(t.flag("--moe-grouped-gemm", "experts as grouped GEMMs", MT_FIELD(model.moe.grouped_gemm)),
                   "megatrain's experts always run as grouped GEMMs (one GEMM per expert, the same results)")
      .model_setting("moe_grouped_gemm", CheckpointTake::forced)
      .not_imported()
      .model_key("");
  t.without_effect(t.flag("--moe-permute-fusion", "fused token permutation", MT_FIELD(model.moe.permute_fusion)),
                   "megatrain's token permutation is always fused");
  // (Token dropping decides the experts' inputs in evaluation too: part of the model.)
  t.value("--moe-expert-capacity-factor", "expert capacity factor (token dropping; None or negative: dropless)",
          MT_FIELD(model.moe.expert_capacity_factor))
      .model_setting("moe_expert_capacity_factor", CheckpointTake::forced, CheckpointCompare::no, true);
  // Megatron fills each expert's capacity with other tokens whose routing weight is 0: their
  // outputs add nothing, so the routed tokens' results are those of dropping without padding.
  t.without_effect(t.flag("--moe-pad-expert-input-to-capacity", "pad every expert's input to its capacity",
                          MT_FIELD(model.moe.pad_expert_input_to_capacity)),
                   "megatrain's grouped GEMMs take each expert's rows as they are: the results of padding to the "
                   "capacity (whose padding rows carry routing weight 0), without computing the padding; with "
                   "--moe-router-enable-expert-bias the bias stays put, as Megatron's counts every expert's whole "
                   "capacity");
  t.choice("--moe-token-drop-policy", "which tokens an expert over capacity drops",
           std::vector<std::pair<std::string, MoeDropPolicy>>{{"probs", MoeDropPolicy::probs},
                                                              {"position", MoeDropPolicy::position}},
           MT_FIELD(model.moe.token_drop_policy))
      .model_setting("moe_token_drop_policy", CheckpointTake::forced, CheckpointCompare::no, true);
  t.value("--moe-shared-expert-intermediate-size", "the shared experts' total FFN size (None: no shared expert)",
          MT_FIELD(model.moe.shared_expert_intermediate_size))
      .model_setting("moe_shared_expert_intermediate_size", CheckpointTake::forced, CheckpointCompare::yes, true);
  t.flag("--moe-shared-expert-gate", "sigmoid gate on the shared expert's output", MT_FIELD(model.moe.shared_expert_gate))
      .model_setting("moe_shared_expert_gate", CheckpointTake::no, CheckpointCompare::yes, true);
  t.without_effect(t.flag("--moe-shared-expert-overlap", "overlap the shared expert with the token dispatch",
                          MT_FIELD(model.moe.shared_expert_overlap)),
                   "megatrain runs the shared expert in order, before the router and the routed experts (Megatron's "
                   "order without the overlap)");
  t.value("--moe-input-jitter-eps", "multiplicative jitter on the router's input", MT_FIELD(model.moe.input_jitter_eps));
  t.flag("--moe-per-layer-logging", "per-layer MoE losses in TensorBoard", MT_FIELD(model.moe.per_layer_logging));
  t.flag("--moe-layer-recompute", "deprecated: --recompute-granularity selective --recompute-modules moe",
         MT_FIELD(model.moe.layer_recompute));
  t.without_effect(t.flag("--overlap-moe-expert-parallel-comm",
                          "overlap the expert-parallel dispatch with another micro-batch's computation",
                          MT_FIELD(model.moe.overlap_expert_parallel_comm)),
                   "megatrain does not overlap the expert-parallel dispatch with computation yet: the same results, "
                   "the communication not hidden");
  t.no_effect("--delay-wgrad-compute", Arity::none,
              "it delays weight-gradient GEMMs to overlap them with --overlap-moe-expert-parallel-comm's "
              "communication, which megatrain does not overlap yet (see that flag's note): the same results");
  t.recognised("--moe-latent-size", Arity::one, "INT", "None", "latent projections around the experts");
  t.recognised("--moe-use-upcycling", Arity::none, "", "off", "turn a dense checkpoint into an MoE model");
  t.recognised("--moe-upcycling-granularity", Arity::one, "INT", "1", "expert size as a fraction of the dense FFN");
  t.flag("--moe-apply-probs-on-input", "the routing weight scales the expert's input instead of its activation "
         "(needs --moe-router-topk 1)", MT_FIELD(model.moe.apply_probs_on_input))
      .model_setting("moe_apply_probs_on_input", CheckpointTake::forced, CheckpointCompare::no, true);
  t.recognised("--moe-router-quantile-balancing-ema", Arity::one, "FLOAT", "0.0", "quantile balancing's EMA");
  {
    // The flex dispatcher's kernels (Megatron's rules on them: app/validate_moe.cpp).
    FlagSpec& s = t.no_effect("--moe-flex-dispatcher-backend", Arity::one,
                              "megatrain runs its own token dispatcher for --moe-token-dispatcher-type flex: the "
                              "same routing and results, without the DeepEP, HybridEP or NCCL-EP kernels",
                              "deepep");
    s.metavar = "{deepep,hybridep,ncclep}";
    s.apply = [](CliState&, const FlagValue& v) {
      parse_choice_arg("--moe-flex-dispatcher-backend", v.one(), {"deepep", "hybridep", "ncclep"});
    };
  }
  t.no_effect("--moe-enable-deepep", Arity::none,
              "deprecated in Megatron-LM (--moe-flex-dispatcher-backend deepep); megatrain runs its own token "
              "dispatcher for --moe-token-dispatcher-type flex, without DeepEP's kernels");
  t.removed("--moe-extended-tp", Arity::none, "--moe-extended-tp was removed from Megatron-LM: drop it");
  t.removed("--moe-use-legacy-grouped-gemm", Arity::none,
            "--moe-use-legacy-grouped-gemm was removed from Megatron-LM: drop it");
}

void add_fp8_flags(FlagTable& t) {
  t.set_group(FlagGroup::fp8);
  t.choice("--fp8-format", "FP8 linear layers: hybrid (e4m3 forward, e5m2 gradients) or e4m3",
           std::vector<std::pair<std::string, Fp8Format>>{{"e4m3", Fp8Format::e4m3}, {"hybrid", Fp8Format::hybrid}},
           MT_FIELD(train.fp8_format));
  // mxfp8, blockwise and custom parse, and are refused by unsupported.cpp.
  t.choice("--fp8-recipe", "FP8 scaling: delayed (amax history) or tensorwise (current scaling)",
           std::vector<std::pair<std::string, Fp8Recipe>>{{"tensorwise", Fp8Recipe::tensorwise},
                                                          {"delayed", Fp8Recipe::delayed},
                                                          {"mxfp8", Fp8Recipe::mxfp8},
                                                          {"blockwise", Fp8Recipe::blockwise},
                                                          {"custom", Fp8Recipe::custom}},
           MT_FIELD(train.fp8_recipe));
  t.recognised("--fp8-quantizer-factory", Arity::one, "STR", "None", "custom FP8 quantizer");
  t.value("--fp8-margin", "FP8 scaling margin: scale = fp8_max / amax / 2^margin", MT_FIELD(train.fp8_margin));
  t.recognised("--fp8-interval", Arity::one, "INT", "1", "deprecated FP8 scaling interval");
  t.value("--fp8-amax-history-len", "amax history length (delayed scaling)", MT_FIELD(train.fp8_amax_history_len));
  t.choice("--fp8-amax-compute-algo", "amax from the history: its max, or the most recent (delayed scaling)",
           std::vector<std::pair<std::string, Fp8AmaxAlgo>>{{"most_recent", Fp8AmaxAlgo::most_recent},
                                                            {"max", Fp8AmaxAlgo::max}},
           MT_FIELD(train.fp8_amax_compute_algo));
  t.negative_flag("--no-fp8-wgrad", "weight gradients in higher precision (bf16 GEMM) with FP8",
                  MT_FIELD(train.fp8_wgrad));
  t.flag("--fp8-param-gather", "FP8 layers' weights kept only in FP8, all-gathered in FP8 (distributed optimizer)",
         MT_FIELD(train.fp8_param_gather));
  t.recognised("--fp8-dot-product-attention", Arity::none, "", "off", "FP8 inputs to the attention kernel");
  t.recognised("--fp8-multi-head-attention", Arity::none, "", "off", "FP8 across the whole attention block");
  t.flag("--first-last-layers-bf16", "keep the first/last transformer layers in bf16 with FP8",
         MT_FIELD(train.first_last_layers_bf16));
  t.value("--num-layers-at-start-in-bf16", "bf16 layers at the start (--first-last-layers-bf16)",
          MT_FIELD(train.num_layers_at_start_in_bf16));
  t.value("--num-layers-at-end-in-bf16", "bf16 layers at the end (--first-last-layers-bf16)",
          MT_FIELD(train.num_layers_at_end_in_bf16));
  t.recognised("--fp4-format", Arity::one, "{e2m1}", "None", "FP4 GEMMs");
  t.recognised("--fp4-recipe", Arity::one, "{nvfp4}", "nvfp4", "FP4 recipe");
  t.recognised("--fp4-param-gather", Arity::none, "", "off", "FP4 parameters and all-gather");
  t.recognised("--te-rng-tracker", Arity::none, "", "off", "Transformer Engine RNG tracker");
  t.recognised("--cuda-graph-impl", Arity::one, "{none,local,transformer_engine,full_iteration}", "none", "CUDA graphs");
  t.recognised("--enable-cuda-graph", Arity::none, "", "off", "deprecated: --cuda-graph-impl local");
  t.recognised("--cuda-graph-modules", Arity::one_or_more, "STR [STR ...]", "None", "modules captured in CUDA graphs");
  t.recognised("--cuda-graph-warmup-steps", Arity::one, "INT", "3", "steps before CUDA graph capture");
  t.recognised("--external-cuda-graph", Arity::none, "", "off", "deprecated: --cuda-graph-impl transformer_engine");
}

}  // namespace mt::cli
