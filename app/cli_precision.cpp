// Mixed-precision flags (megatron.md section 1.4).
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
  t.flag("--attention-softmax-in-fp32", "attention softmax in fp32", MT_FIELD(model.attention_softmax_in_fp32));
  t.flag("--apply-query-key-layer-scaling", "scale QK^T by 1/layer number (forces softmax in fp32)",
         MT_FIELD(model.apply_query_key_layer_scaling));
  t.flag("--fp16-lm-cross-entropy", "cross entropy in fp16 (needs --fp16)", MT_FIELD(train.fp16_lm_cross_entropy));
  t.recognised("--use-precision-aware-optimizer", Arity::none, "", "off", "TE optimizer with low-precision states");
  t.recognised("--main-grads-dtype", Arity::one, "{fp32,bf16}", "fp32", "main-gradient dtype");
  t.recognised("--main-params-dtype", Arity::one, "{fp32,fp16}", "fp32", "master-weight dtype");
  t.recognised("--exp-avg-dtype", Arity::one, "{fp32,fp16,bf16,fp8}", "fp32", "Adam first-moment dtype");
  t.recognised("--exp-avg-sq-dtype", Arity::one, "{fp32,fp16,bf16,fp8}", "fp32", "Adam second-moment dtype");
}

}  // namespace mt::cli
