// Training-loop, learning-rate and recompute rules.
#include <algorithm>
#include <set>

#include "app/cli_internal.h"
#include "engine/muon.h"
#include "parallel/pipeline_layout.h"

namespace mt::cli {

namespace {

void validate_recompute(CliState& st) {
  const Config& c = st.cfg;
  const TrainConfig& t = c.train;
  const bool method = t.recompute_method != RecomputeMethod::none;
  switch (t.recompute_granularity) {
    case RecomputeGranularity::none:
      // Megatron-LM checks --recompute-method and --recompute-num-layers only when a granularity
      // is set (TransformerConfig.__post_init__); without one they are accepted and do nothing.
      if (method) st.note("--recompute-method has no effect without --recompute-granularity full");
      if (st.has("--recompute-num-layers"))
        st.note("--recompute-num-layers has no effect without --recompute-granularity full");
      break;
    case RecomputeGranularity::selective:
      if (method) fail("--recompute-method is not supported with --recompute-granularity selective");
      if (t.recompute_num_layers) fail("--recompute-num-layers must not be set with --recompute-granularity selective");
      break;
    case RecomputeGranularity::full: {
      if (!method) fail("--recompute-granularity full needs --recompute-method uniform or block");
      const std::vector<int> per_stage = layers_per_stage(PipelineSplit::from_config(c));
      const int max_layers = *std::max_element(per_stage.begin(), per_stage.end());
      if (!t.recompute_num_layers)
        fail("--recompute-granularity full needs --recompute-num-layers between 1 and the layers per pipeline stage ({})",
             max_layers);
      if (*t.recompute_num_layers < 1 || *t.recompute_num_layers > max_layers)
        fail("--recompute-num-layers {} must be between 1 and the layers per pipeline stage ({})",
             *t.recompute_num_layers, max_layers);
      break;
    }
  }
  static const std::set<std::string> modules = {"core_attn", "moe_act", "layernorm",     "mla_up_proj",
                                                 "mlp",       "moe",     "shared_experts", "gdn_norm_out"};
  for (const std::string& m : t.recompute_modules)
    if (!modules.count(m))
      fail("--recompute-modules {}: not one of core_attn, moe_act, layernorm, mla_up_proj, mlp, moe, shared_experts, "
           "gdn_norm_out", m);
  for (const std::string& m : t.recompute_modules) {
    if (m == "mla_up_proj" && !c.model.multi_latent_attention)
      fail("mla_up_proj in recompute_modules is only supported with multi_latent_attention");
    if (m == "gdn_norm_out" && !c.model.gated_delta_net)
      fail("gdn_norm_out in recompute_modules is only supported with experimental_attention_variant='gdn' or 'gdn2'.");
    if (m == "gdn_norm_out" && t.recompute_granularity == RecomputeGranularity::selective)
      st.note("--recompute-modules gdn_norm_out: megatrain's Gated DeltaNet layers always recompute their output norm "
              "and gate in backward (neither is kept), which is what gdn_norm_out asks for");
  }
  const bool moe_act = std::find(t.recompute_modules.begin(), t.recompute_modules.end(), "moe_act") !=
                       t.recompute_modules.end();
  if (moe_act && t.recompute_granularity == RecomputeGranularity::selective) {
    if (!c.model.moe.grouped_gemm)
      fail("--recompute-modules moe_act needs --moe-grouped-gemm (moe_act in recompute_modules is only supported with "
           "moe_grouped_gemm.)");
    st.note(c.model.moe.enabled()
                ? "--recompute-modules moe_act: megatrain's experts always recompute their activation in backward from "
                  "fc1's output (the activation's output is never kept), which is what moe_act asks for"
                : "--recompute-modules moe_act: no MoE layers, nothing to recompute");
  }
  if (t.recompute_granularity == RecomputeGranularity::selective)
    for (const char* m : {"moe", "shared_experts"}) {
      if (std::find(t.recompute_modules.begin(), t.recompute_modules.end(), m) == t.recompute_modules.end()) continue;
      const bool none = !c.model.moe.enabled() ||
                        (std::string(m) == "shared_experts" && !c.model.moe.shared_expert_intermediate_size);
      if (none)
        st.note(fmt::format("--recompute-modules {}: no {}, nothing to recompute", m,
                            std::string(m) == "moe" ? "MoE layers" : "shared experts"));
    }
  if (st.has("--recompute-modules") && t.recompute_granularity != RecomputeGranularity::selective)
    st.warn("--recompute-modules has no effect without --recompute-granularity selective");
}

// Fine-grained activation offloading: Megatron-LM's TransformerConfig checks, and its
// arguments.py's (the Transformer Engine implementation).
void validate_offloading(CliState& st) {
  const Config& c = st.cfg;
  const TrainConfig& t = c.train;
  if (!t.fine_grained_activation_offloading) {
    for (const char* f : {"--offload-modules", "--min-offloaded-tensor-size", "--activation-offload-fraction",
                          "--delta-offload-bytes-across-pp-ranks", "--fine-grained-offloading-max-inflight-offloads"})
      if (st.has(f)) st.note(fmt::format("{} has no effect without --fine-grained-activation-offloading", f));
    return;
  }
  if (const auto it = st.given.find("--transformer-impl"); it != st.given.end() && it->second.one() != "transformer_engine")
    fail("--fine-grained-activation-offloading is only supported with --transformer-impl transformer_engine (as in "
         "Megatron-LM; megatrain's own kernels take its place)");
  if (t.offload_modules.empty())
    fail("--fine-grained-activation-offloading needs --offload-modules (one or more of attn_norm, qkv_linear, "
         "core_attn, attn_proj, mlp_norm, expert_fc1, moe_act, fused_group_mlp)");
  static const std::set<std::string> allowed = {"core_attn", "attn_proj", "expert_fc1", "fused_group_mlp", "moe_act",
                                                "attn_norm", "mlp_norm",  "qkv_linear", "gdp_qkv"};
  const std::set<std::string> mods(t.offload_modules.begin(), t.offload_modules.end());
  for (const std::string& m : t.offload_modules)
    if (!allowed.count(m))
      fail("--offload-modules {}: not one of attn_norm, qkv_linear, core_attn, attn_proj, mlp_norm, expert_fc1, "
           "moe_act, fused_group_mlp, gdp_qkv",
           m);
  if (mods.count("attn_proj") && !mods.count("core_attn"))
    fail("--offload-modules attn_proj needs core_attn too (as in Megatron-LM): the input of attn_proj is the output of "
         "core_attn, which core_attn's backward needs");
  if (t.recompute_granularity == RecomputeGranularity::selective &&
      std::find(t.recompute_modules.begin(), t.recompute_modules.end(), "moe") != t.recompute_modules.end())
    for (const char* m : {"moe_act", "expert_fc1", "fused_group_mlp"})
      if (mods.count(m))
        fail("--offload-modules {} with --recompute-modules moe: the recomputed MoE layer keeps nothing of its experts "
             "to offload (as in Megatron-LM): remove moe from --recompute-modules or {} from --offload-modules",
             m, m);
  if (mods.count("fused_group_mlp")) {
    if (!st.has("--use-transformer-engine-op-fuser"))
      fail("--offload-modules fused_group_mlp needs --use-transformer-engine-op-fuser (as in Megatron-LM)");
    for (const char* m : {"expert_fc1", "moe_act"})
      if (mods.count(m))
        fail("--offload-modules fused_group_mlp offloads the whole grouped MLP and cannot be combined with {} (as in "
             "Megatron-LM): remove {}",
             m, m);
  }
  if (mods.count("gdp_qkv"))
    st.note("--offload-modules gdp_qkv: megatrain builds no Gated DeltaProduct layers, so nothing is offloaded for it");
  if (t.min_offloaded_tensor_size < 0)
    fail("--min-offloaded-tensor-size must be non-negative (got {})", t.min_offloaded_tensor_size);
  if (!(t.activation_offload_fraction >= 0 && t.activation_offload_fraction <= 1))
    fail("--activation-offload-fraction must be in range [0, 1] (got {})", t.activation_offload_fraction);
  if (t.delta_offload_bytes_across_pp_ranks < 0)
    fail("--delta-offload-bytes-across-pp-ranks must be non-negative (got {})", t.delta_offload_bytes_across_pp_ranks);
  if (t.fine_grained_offloading_max_inflight_offloads && *t.fine_grained_offloading_max_inflight_offloads < 0)
    fail("--fine-grained-offloading-max-inflight-offloads must be non-negative (got {})",
         *t.fine_grained_offloading_max_inflight_offloads);
}

}  // namespace

// FP8. The recipes not built (mxfp8, blockwise, custom) are refused by
// unsupported.cpp before this runs.
static void validate_fp8(CliState& st) {
  const Config& c = st.cfg;
  const TrainConfig& t = c.train;
  if (t.fp8_amax_history_len < 1) fail("--fp8-amax-history-len must be >= 1 (got {})", t.fp8_amax_history_len);
  if (t.fp8_margin < -100 || t.fp8_margin > 100) fail("--fp8-margin {} is out of range (scale = fp8_max / amax / 2^margin)", t.fp8_margin);
  if (t.num_layers_at_start_in_bf16 < 0) fail("--num-layers-at-start-in-bf16 must be >= 0 (got {})", t.num_layers_at_start_in_bf16);
  if (t.num_layers_at_end_in_bf16 < 0) fail("--num-layers-at-end-in-bf16 must be >= 0 (got {})", t.num_layers_at_end_in_bf16);
  if (!t.fp8_format) {
    if (t.first_last_layers_bf16) st.note("--first-last-layers-bf16 has no effect without --fp8-format");
    if (t.fp8_param_gather) fail("--fp8-param-gather needs --fp8-format (it keeps the FP8 layers' weights in FP8)");
    return;
  }
  if (t.fp8_param_gather) {
    // Megatron: "--fp8-param-gather only supported with distributed optimizer, torch fully sharded
    // data parallel or when performing inference".
    if (!c.parallel.use_distributed_optimizer)
      fail("--fp8-param-gather is only supported with --use-distributed-optimizer (as in Megatron): the optimizer's "
           "float32 master weights are what it casts to FP8");
  }
  // Without --bf16 (Transformer Engine's FP8 around float32 parameters and activations, as NVIDIA's
  // DeepSeek-proxy configurations run): the casts read float32, the FP8 GEMMs write float32. The
  // GPU's FP8 GEMMs add a bias in their epilogue for bf16 outputs only.
  if (t.precision == Precision::fp32 && t.device == DeviceKind::gpu && (c.model.add_bias_linear || c.model.add_qkv_bias))
    fail("megatrain does not support --fp8-format without --bf16 with linear biases on the GPU yet (its FP8 GEMMs add "
         "biases to bf16 outputs only): add --bf16 or --disable-bias-linear");
  // Transformer Engine also runs FP8 around fp16; megatrain's FP8 casts and GEMM outputs are built
  // for bf16 (and float32) only, so the combination is refused here, not by a kernel's check.
  if (t.precision == Precision::fp16)
    fail("--fp8-format with --fp16 is not supported by megatrain yet (its FP8 kernels take bf16 activations): use "
         "--bf16 with --fp8-format");
  if (t.first_last_layers_bf16 && t.fp8_recipe == Fp8Recipe::delayed)
    fail("--first-last-layers-bf16 does not work with --fp8-recipe delayed (as in Megatron): use --fp8-recipe tensorwise");
  if (t.fp8_recipe == Fp8Recipe::tensorwise && (t.fp8_amax_history_len != 1 || t.fp8_amax_compute_algo != Fp8AmaxAlgo::most_recent))
    st.note("--fp8-amax-history-len / --fp8-amax-compute-algo apply to --fp8-recipe delayed only; tensorwise scales "
            "each tensor from its own amax");
  if (t.first_last_layers_bf16 && t.num_layers_at_start_in_bf16 + t.num_layers_at_end_in_bf16 >= c.model.num_layers)
    st.warn(fmt::format("--num-layers-at-start-in-bf16 {} + --num-layers-at-end-in-bf16 {} cover all {} layers: no layer "
                        "runs in FP8", t.num_layers_at_start_in_bf16, t.num_layers_at_end_in_bf16, c.model.num_layers));
}

// --use-precision-aware-optimizer and its dtypes (Megatron's OptimizerConfig and optimizer set-up
// rules). fp16 / fp8 states and fp16 master weights are refused by unsupported.cpp before this runs.
static void validate_precision_aware_optimizer(CliState& st) {
  const Config& c = st.cfg;
  const TrainConfig& t = c.train;
  if (!t.use_precision_aware_optimizer) {
    const std::pair<const char*, StateDtype> dtypes[] = {{"--main-grads-dtype", t.main_grads_dtype},
                                                         {"--exp-avg-dtype", t.exp_avg_dtype},
                                                         {"--exp-avg-sq-dtype", t.exp_avg_sq_dtype}};
    for (const auto& [flag, d] : dtypes)
      if (d != StateDtype::fp32)
        fail("{} can only be fp32 when not using precision-aware optimizer: add --use-precision-aware-optimizer "
             "(with --use-distributed-optimizer)", flag);
    return;
  }
  if (t.optimizer != OptimizerKind::adam) fail("--use-precision-aware-optimizer only supported with adam");
  if (!c.parallel.use_distributed_optimizer)
    fail("--use-precision-aware-optimizer only supported with distributed optimizer: add --use-distributed-optimizer");
  if (t.main_grads_dtype == StateDtype::bf16 && t.precision != Precision::bf16)
    st.note("--main-grads-dtype bf16 has no effect without --bf16: the gradient buffer has the parameters' dtype "
            "(megatrain keeps float32 main gradients with --fp16)");
}

void validate_muon(CliState& st) {
  Config& c = st.cfg;
  const TrainConfig& t = c.train;
  if (t.optimizer != OptimizerKind::muon) {
    // (Megatron-LM reads them in its Muon optimizer only.)
    for (const auto& [flag, value] : st.given)
      if (flag.starts_with("--muon-"))
        st.note(fmt::format("{} has no effect without --optimizer muon (as in Megatron-LM)", flag));
    return;
  }
  const MuonConfig& m = t.muon;
  // (Megatron-LM's own checks, in its words where it has them.)
  if (t.precision == Precision::fp16) fail("emerging optimizer with fp16 is not supported (--optimizer muon with --fp16)");
  if (c.parallel.use_megatron_fsdp) fail("Emerging optimizer does not support Megatron-FSDP for now (--optimizer muon)");
  if (c.parallel.use_torch_fsdp2) fail("Emerging optimizer does not support Torch-FSDP2 for now (--optimizer muon)");
  if (c.checkpoint.ckpt_format != "torch" && c.checkpoint.ckpt_format != "torch_dist")
    fail("Emerging optimizer supports torch and torch_dist checkpoint format (--optimizer muon with --ckpt-format {})",
         c.checkpoint.ckpt_format);
  if (!muon_coefficients_known(m.coefficient_type))
    fail("Unsupported muon coefficient type '{}'. Supported types: {} (--muon-coefficient-type)", m.coefficient_type,
         muon_coefficient_types());
  if (m.num_ns_steps < 1) fail("num_ns_steps must be at least 1, got {} (--muon-num-ns-steps)", m.num_ns_steps);
  if (m.fp32_matmul_prec == MuonMatmulPrecision::low)
    fail("--muon-fp32-matmul-prec low: PyTorch has no 'low' float32 matmul precision, so Megatron-LM fails at its first "
         "Muon step; use medium (the default) or high");
  if (m.scalar_optimizer != "adam")
    fail("megatrain does not support --muon-scalar-optimizer {} yet (the Lion optimizer): use adam", m.scalar_optimizer);
  if (t.use_precision_aware_optimizer)
    fail("--use-precision-aware-optimizer is not supported with --optimizer muon (it needs the distributed optimizer, "
         "which Megatron-LM replaces by its layer-wise one for Muon)");
  if (c.train.fp8_param_gather)
    fail("megatrain does not support --fp8-param-gather with --optimizer muon yet (the FP8 parameters are cast by "
         "AdamW's update)");
  if (c.train.fp8_format && c.train.fp8_recipe == Fp8Recipe::tensorwise)
    fail("megatrain does not support --fp8-recipe tensorwise with --optimizer muon yet (the weights' amaxes come from "
         "AdamW's update); the delayed recipe runs");
  if (c.parallel.grad_reduce_in_bf16)
    fail("megatrain does not support --grad-reduce-in-bf16 with --optimizer muon yet (Muon keeps its float32 update in "
         "the gradient buffer)");
  if (c.parallel.use_distributed_optimizer)
    st.note("--use-distributed-optimizer with --optimizer muon: Megatron-LM's layer-wise distributed optimizer gives "
            "each data-parallel rank whole parameters; megatrain shards the optimizer state as for AdamW, gathers "
            "the momentum updates, splits the orthogonalizations over the data-parallel ranks and reduce-scatters "
            "their results (the same update)");
}

void validate_training(CliState& st) {
  const Config& c = st.cfg;
  const TrainConfig& t = c.train;
  if (!t.lr && !t.skip_train) fail("--lr is required (the peak learning rate)");
  // Megatron's real-time test checks only the q/k layernorm parameters (and is silent without them).
  if (t.test_mode && !c.model.qk_layernorm)
    st.note("--test-mode compares the q/k layernorm parameters across DP and TP ranks; without --qk-layernorm "
            "there is nothing to compare");
  if (t.lr && t.min_lr > *t.lr)
    fail("--min-lr {} is larger than --lr {}", format_float(t.min_lr), format_float(*t.lr));
  if (t.decoupled_lr && t.decoupled_min_lr && *t.decoupled_min_lr > *t.decoupled_lr)
    fail("--decoupled-min-lr {} is larger than --decoupled-lr {}", format_float(*t.decoupled_min_lr),
         format_float(*t.decoupled_lr));
  if (t.lr_warmup_fraction && (*t.lr_warmup_fraction < 0 || *t.lr_warmup_fraction > 1))
    fail("--lr-warmup-fraction must be in [0, 1] (got {})", format_float(*t.lr_warmup_fraction));
  if (t.lr_warmup_iters < 0 || t.lr_warmup_samples < 0) fail("--lr-warmup-iters/--lr-warmup-samples must be >= 0");
  if (!t.skip_train && t.total_iters > 0) {
    // Megatron's OptimizerParamScheduler asserts these (steps are samples).
    if (t.lr_decay_steps <= 0)
      fail("the learning-rate decay horizon is {} samples (--lr-decay-iters/--lr-decay-samples): it must be > 0",
           t.lr_decay_steps);
    if (t.lr_warmup_steps >= static_cast<double>(t.lr_decay_steps))
      fail("the learning-rate warmup ({} samples, from --lr-warmup-*) must be shorter than the decay horizon ({} samples, "
           "--lr-decay-iters/--lr-decay-samples)", t.lr_warmup_steps, t.lr_decay_steps);
    if (t.lr_decay_style == LrDecayStyle::wsd && !t.lr_wsd_decay_steps)
      fail("--lr-decay-style WSD needs --lr-wsd-decay-iters (or --lr-wsd-decay-samples)");
  }
  if (t.fp16_lm_cross_entropy && t.precision != Precision::fp16) fail("--fp16-lm-cross-entropy needs --fp16");
  if (t.loss_scale && *t.loss_scale <= 0) fail("--loss-scale must be > 0 (got {})", format_float(*t.loss_scale));
  if (t.initial_loss_scale <= 0) fail("--initial-loss-scale must be > 0");
  if (t.min_loss_scale <= 0) fail("--min-loss-scale must be > 0");
  if (t.loss_scale_window <= 0) fail("--loss-scale-window must be > 0");
  if (t.hysteresis < 1) fail("--hysteresis must be >= 1 (got {})", t.hysteresis);
  if (t.clip_grad < 0) fail("--clip-grad must be >= 0 (0 disables clipping), got {}", format_float(t.clip_grad));
  if (t.adam_beta1 < 0 || t.adam_beta1 >= 1) fail("--adam-beta1 must be in [0, 1) (got {})", format_float(t.adam_beta1));
  if (t.adam_beta2 < 0 || t.adam_beta2 >= 1) fail("--adam-beta2 must be in [0, 1) (got {})", format_float(t.adam_beta2));
  if (t.adam_eps <= 0) fail("--adam-eps must be > 0 (got {})", format_float(t.adam_eps));
  if (t.weight_decay < 0) fail("--weight-decay must be >= 0 (got {})", format_float(t.weight_decay));
  if (t.eval_iters < 0) fail("--eval-iters must be >= 0 (got {})", t.eval_iters);
  if (t.eval_interval && *t.eval_interval <= 0) fail("--eval-interval must be > 0 (got {})", *t.eval_interval);
  if (t.exit_interval && *t.exit_interval <= 0) fail("--exit-interval must be > 0 (got {})", *t.exit_interval);
  // (Megatron takes the iteration modulo N: 0 stops its loop with ZeroDivisionError.)
  if (t.check_weight_hash_across_dp_replicas_interval && *t.check_weight_hash_across_dp_replicas_interval <= 0)
    fail("--check-weight-hash-across-dp-replicas-interval must be > 0 (got {})",
         *t.check_weight_hash_across_dp_replicas_interval);
  if (t.exit_duration_in_mins && *t.exit_duration_in_mins <= 0)
    fail("--exit-duration-in-mins must be > 0 (got {})", *t.exit_duration_in_mins);
  for (int64_t it : t.iterations_to_skip)
    if (it < 1) fail("--iterations-to-skip takes 1-indexed iterations (got {})", it);
  validate_recompute(st);
  validate_offloading(st);
  validate_fp8(st);
  validate_precision_aware_optimizer(st);
}

}  // namespace mt::cli
