// Mixture-of-experts and FP8/FP4 flags (megatron.md sections 1.11, 1.12): recognised so that a
// launch script using them gets "megatrain does not support --X yet" (unsupported.cpp) instead of
// an unknown-flag error; left at their defaults they are accepted.
#include "app/flags.h"

namespace mt::cli {

void add_moe_flags(FlagTable& t) {
  t.set_group(FlagGroup::moe);
  t.recognised("--num-experts", Arity::one, "INT", "None (0 = None)", "experts per MoE layer")
      .model_setting("num_experts", CheckpointTake::no);
  t.recognised("--moe-ffn-hidden-size", Arity::one, "INT", "None", "expert FFN size");
  t.recognised("--moe-layer-freq", Arity::one, "INT|PATTERN", "1", "which layers are MoE layers");
  t.recognised("--moe-router-topk", Arity::one, "INT", "2", "experts per token");
  t.recognised("--moe-router-load-balancing-type", Arity::one_or_more, "STR [STR ...]", "aux_loss", "load balancing");
  t.recognised("--moe-aux-loss-coeff", Arity::one_or_more, "FLOAT [FLOAT ...]", "0.0", "auxiliary loss weight");
  t.recognised("--moe-z-loss-coeff", Arity::one, "FLOAT", "None", "router z-loss weight");
  t.recognised("--moe-router-score-function", Arity::one, "{softmax,sigmoid}", "softmax", "router score function");
  t.recognised("--moe-router-pre-softmax", Arity::none, "", "off", "softmax before top-k");
  t.recognised("--moe-router-dtype", Arity::one, "{fp32,fp64}", "None", "router dtype");
  t.recognised("--moe-router-enable-expert-bias", Arity::none, "", "off", "aux-loss-free balancing");
  t.recognised("--moe-router-bias-update-rate", Arity::one, "FLOAT", "0.001", "expert bias update rate");
  t.recognised("--moe-router-topk-scaling-factor", Arity::one, "FLOAT", "None", "top-k score scaling");
  t.recognised("--moe-router-num-groups", Arity::one, "INT", "None", "group-limited routing groups");
  t.recognised("--moe-router-group-topk", Arity::one, "INT", "None", "group-limited routing top-k");
  t.recognised("--moe-token-dispatcher-type", Arity::one, "{allgather,alltoall,flex}", "allgather", "token dispatcher");
  t.recognised("--moe-grouped-gemm", Arity::none, "", "off", "grouped-GEMM experts");
  t.recognised("--moe-permute-fusion", Arity::none, "", "off", "fused token permutation");
  t.recognised("--moe-expert-capacity-factor", Arity::one, "FLOAT", "None", "expert capacity");
  t.recognised("--moe-pad-expert-input-to-capacity", Arity::none, "", "off", "pad expert inputs to capacity");
  t.recognised("--moe-token-drop-policy", Arity::one, "{probs,position}", "probs", "token dropping policy");
  t.recognised("--moe-shared-expert-intermediate-size", Arity::one, "INT", "None", "shared experts' FFN size");
  t.recognised("--moe-shared-expert-overlap", Arity::none, "", "off", "overlap shared experts");
  t.recognised("--moe-input-jitter-eps", Arity::one, "FLOAT", "None", "input jitter");
  t.recognised("--moe-per-layer-logging", Arity::none, "", "off", "per-layer MoE logging");
  t.recognised("--moe-layer-recompute", Arity::none, "", "off", "recompute MoE layers");
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
  t.recognised("--external-cuda-graph", Arity::none, "", "off", "deprecated: --cuda-graph-impl transformer_engine");
}

}  // namespace mt::cli
