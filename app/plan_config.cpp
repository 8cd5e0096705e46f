// The resolved configuration and the derived values, for the dry run.
#include "app/flags.h"
#include "app/plan.h"
#include "parallel/launch_env.h"

namespace mt {

nlohmann::json resolved_config(const Config& cfg) {
  static const Config defaults{};
  nlohmann::json out = nlohmann::json::object();
  for (const cli::FlagSpec& f : cli::flag_table().flags()) {
    if (!f.value) continue;
    const nlohmann::json v = f.value(cfg), d = f.value(defaults);
    out[f.name] = {{"value", v}, {"default", d}, {"differs", v != d}};
  }
  return out;
}

nlohmann::json derived_values(const Config& c) {
  const char* precision = c.train.precision == Precision::bf16 ? "bf16" : c.train.precision == Precision::fp16 ? "fp16" : "fp32";
  nlohmann::json d = {
      {"world_size", c.parallel.world_size},
      {"launcher", launcher_name(c.parallel.launcher)},
      {"data_parallel_size", c.parallel.data_parallel_size},
      {"virtual_pipeline_size", c.parallel.virtual_pipeline_size},
      {"sequence_parallel", c.parallel.sequence_parallel},
      {"overlap_p2p_communication", c.parallel.overlap_p2p_communication},
      {"global_batch_size", c.train.global_batch},
      {"num_microbatches", c.train.num_microbatches},
      {"train_iters", c.train.total_iters},
      {"lr_warmup_steps_samples", c.train.lr_warmup_steps},
      {"lr_decay_steps_samples", c.train.lr_decay_steps},
      {"wd_incr_steps_samples", c.train.wd_incr_steps},
      {"ffn_hidden_size", c.model.ffn_size},
      {"kv_channels", c.model.head_dim},
      {"num_query_groups", c.model.query_groups},
      {"add_qkv_bias", c.model.add_qkv_bias},
      {"vocab_size", c.model.vocab_size},
      {"padded_vocab_size", c.model.padded_vocab_size},
      {"eod_id", c.data.eod_id},
      {"tokenizer_type", c.data.tokenizer_type.value_or("")},
      {"params_dtype", precision},
      {"accumulate_allreduce_grads_in_fp32", c.parallel.accumulate_allreduce_grads_in_fp32},
      {"check_for_nan_in_loss_and_grad", c.train.check_for_nan_in_loss_and_grad},
      {"split", c.data.split_weights},
  };
  // FP8: which linear layers run as FP8 GEMMs, in what format and with which scaling.
  if (c.train.fp8_format) {
    const TrainConfig& t = c.train;
    int fp8_layers = 0;
    for (int l = 0; l < c.model.num_layers; ++l) fp8_layers += t.fp8_layer(l, c.model.num_layers) ? 1 : 0;
    d["fp8"] = {{"format", *t.fp8_format == Fp8Format::hybrid ? "hybrid (e4m3 forward, e5m2 gradients)" : "e4m3"},
                {"recipe", t.fp8_recipe == Fp8Recipe::tensorwise ? "tensorwise" : "delayed"},
                {"amax_history_len", t.fp8_amax_history_len},
                {"amax_compute_algo", t.fp8_amax_compute_algo == Fp8AmaxAlgo::max ? "max" : "most_recent"},
                {"margin", t.fp8_margin},
                {"wgrad", t.fp8_wgrad ? "fp8" : "higher precision"},
                {"fp8_layers", fp8_layers},
                {"bf16_layers", c.model.num_layers - fp8_layers}};
  } else {
    d["fp8"] = nullptr;
  }
  // Mixture of experts: the shape the engine builds (null without --num-experts).
  if (c.model.moe.enabled()) {
    const MoeConfig& e = c.model.moe;
    int moe_layers = 0;
    std::string pattern;
    for (char l : e.moe_layer) {
      moe_layers += l ? 1 : 0;
      pattern.push_back(l ? 'E' : '-');
    }
    std::string balancing;
    for (MoeLoadBalancing b : e.load_balancing_type) {
      const char* name = "none";
      switch (b) {
        case MoeLoadBalancing::aux_loss: name = "aux_loss"; break;
        case MoeLoadBalancing::seq_aux_loss: name = "seq_aux_loss"; break;
        case MoeLoadBalancing::global_aux_loss: name = "global_aux_loss"; break;
        case MoeLoadBalancing::sinkhorn: name = "sinkhorn"; break;
        case MoeLoadBalancing::none: name = "none"; break;
      }
      balancing += std::string(balancing.empty() ? "" : " ") + name;
    }
    d["moe"] = {{"num_experts", e.num_experts},
                {"router_topk", e.router_topk},
                {"expert_ffn_hidden_size", e.expert_ffn},
                {"moe_layers", moe_layers},
                {"dense_layers", c.model.num_layers - moe_layers},
                {"layer_pattern", pattern},  // E: MoE layer, -: dense layer
                {"shared_expert_intermediate_size", e.shared_expert_intermediate_size.value_or(0)},
                {"shared_expert_gate", e.shared_expert_gate},
                {"score_function", e.score_function == MoeScoreFunction::sigmoid        ? "sigmoid"
                                   : e.score_function == MoeScoreFunction::sqrtsoftplus ? "sqrtsoftplus"
                                                                                        : "softmax"},
                {"load_balancing", balancing},
                {"expert_model_parallel_size", c.parallel.expert_model_parallel_size},
                {"expert_tensor_parallel_size", c.parallel.expert_tensor_parallel_size.value_or(c.parallel.tensor_model_parallel_size)}};
  } else {
    d["moe"] = nullptr;
  }
  if (c.train.lr_wsd_decay_steps) d["lr_wsd_decay_steps_samples"] = *c.train.lr_wsd_decay_steps;
  if (c.train.start_weight_decay) d["start_weight_decay"] = *c.train.start_weight_decay;
  if (c.train.end_weight_decay) d["end_weight_decay"] = *c.train.end_weight_decay;
  return d;
}

}  // namespace mt
