// Mixed-precision flags.
#include "app/flags.h"

namespace mt::cli {

namespace {
FlagSpec precision_switch(const char* name, Precision p, const char* help) {
  FlagSpec s;
  s.name = name;
  s.group = FlagGroup::mixed_precision;
  s.arity = Arity::none;
  s.help = help;
  s.apply = [p](CliState& st, const FlagValue&) { st.cfg.train.precision = p; };
  s.value = [p](const Config& c) { return nlohmann::json(c.train.precision == p); };
  return s;
}
}  // namespace

void add_precision_flags(FlagTable& t) {
  t.set_group(FlagGroup::mixed_precision);
  t.add(precision_switch("--fp16", Precision::fp16, "fp16 parameters with loss scaling (exclusive with --bf16)"));
  t.add(precision_switch("--bf16", Precision::bf16, "bf16 parameters, fp32 master weights and main gradients (bf16 with --grad-reduce-in-bf16)"));
  t.value("--loss-scale", "static loss scale (unset: dynamic scaling with --fp16)", MT_FIELD(train.loss_scale));
  t.value("--initial-loss-scale", "dynamic loss scale at start", MT_FIELD(train.initial_loss_scale));
  t.value("--min-loss-scale", "dynamic loss scale floor", MT_FIELD(train.min_loss_scale));
  t.value("--loss-scale-window", "iterations without overflow before doubling the scale", MT_FIELD(train.loss_scale_window));
  t.value("--hysteresis", "overflows tolerated before halving the scale", MT_FIELD(train.hysteresis));
  t.flag("--accumulate-allreduce-grads-in-fp32", "fp32 main-gradient buffers and reductions (on with --bf16)",
         MT_FIELD(parallel.accumulate_allreduce_grads_in_fp32));
  t.flag("--grad-reduce-in-bf16", "bf16 main gradients: accumulated over micro-batches and reduced in bf16", MT_FIELD(parallel.grad_reduce_in_bf16));
  // Both only matter where attention scores are stored in 16 bits (Megatron's local and unfused
  // attention under --fp16/--bf16); megatrain's attention keeps them in float32 or wider.
  t.without_effect(t.flag("--attention-softmax-in-fp32", "attention softmax in fp32",
                          MT_FIELD(model.attention_softmax_in_fp32)),
                   "megatrain's attention always computes the scores and the softmax in float32 or wider");
  t.without_effect(t.flag("--apply-query-key-layer-scaling", "scale QK^T by 1/layer number (forces softmax in fp32)",
                          MT_FIELD(model.apply_query_key_layer_scaling)),
                   "the softmax multiplies the 1/layer scaling back; it only keeps 16-bit scores in range, and "
                   "megatrain's attention keeps its scores in float32 or wider")
      .model_setting("apply_query_key_layer_scaling")
      .model_key("")
      .not_imported();
  t.flag("--fp16-lm-cross-entropy", "cross entropy in fp16 (needs --fp16)", MT_FIELD(train.fp16_lm_cross_entropy));
  // Megatron's precision-aware optimizer (fp16 / fp8 states and fp16 master weights parse, and are
  // refused by unsupported.cpp).
  t.flag("--use-precision-aware-optimizer", "store the optimizer's tensors in the dtypes below (Adam, distributed optimizer)",
         MT_FIELD(train.use_precision_aware_optimizer));
  using SD = std::vector<std::pair<std::string, StateDtype>>;
  t.choice("--main-grads-dtype", "main-gradient dtype (bf16: as --grad-reduce-in-bf16)",
           SD{{"fp32", StateDtype::fp32}, {"bf16", StateDtype::bf16}}, MT_FIELD(train.main_grads_dtype));
  t.choice("--main-params-dtype", "master-weight dtype", SD{{"fp32", StateDtype::fp32}, {"fp16", StateDtype::fp16}},
           MT_FIELD(train.main_params_dtype));
  const SD moment{{"fp32", StateDtype::fp32}, {"fp16", StateDtype::fp16}, {"bf16", StateDtype::bf16}, {"fp8", StateDtype::fp8}};
  t.choice("--exp-avg-dtype", "Adam first-moment storage dtype (computed in fp32)", moment, MT_FIELD(train.exp_avg_dtype));
  t.choice("--exp-avg-sq-dtype", "Adam second-moment storage dtype (computed in fp32)", moment,
           MT_FIELD(train.exp_avg_sq_dtype));
}

}  // namespace mt::cli
