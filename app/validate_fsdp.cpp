// Fully sharded data parallelism: Megatron-LM's rules for --use-megatron-fsdp and --use-torch-fsdp2
// (arguments.py validate_args), then the mapping onto
// megatrain's data-parallel machinery, which every other rule reads afterwards:
//
//   no_shard             DDP: every rank holds everything, gradients all-reduced
//   optim                the distributed optimizer (ZeRO-1): master weights and optimizer state
//                        sharded, gradients reduce-scattered, parameters all-gathered after the step
//   optim_grads          ZeRO-2: besides, each decoder layer's gradients are reduce-scattered
//                        after its backward in every micro-batch into this rank's shard
//                        (ModelOptions::shard_grads; the routed experts' over the expert-data-
//                        parallel group)
//   optim_grads_params, --use-torch-fsdp2
//                        ZeRO-3: besides, each rank keeps only its shard of every decoder layer's
//                        compute-dtype parameters and gathers a layer's just before its forward
//                        and backward (ModelOptions::shard_params), where built (not with FP8
//                        parameters, --use-precision-aware-optimizer's remainders or the replica
//                        weight check); elsewhere optim_grads. Warnings say what a run lays out,
//                        and the dry run prints each strategy's memory. Sharding never changes the
//                        numbers.
//
// Hybrid sharding (--num-distributed-optimizer-instances N): outer no_shard is the partial
// distributed optimizer (sharded within each of N instances, all-reduced across them); outer optim
// shards the optimizer state over every data-parallel rank, which is one instance.
#include "app/cli_internal.h"
#include "engine/model_chunks.h"

namespace mt::cli {

namespace {

// The gradient dtype Megatron-FSDP's "auto" resolves to: the parameters' (bf16 for FP8 ones).
std::string model_dtype(const Config& c) {
  switch (c.train.precision) {
    case Precision::bf16: return "bf16";
    case Precision::fp16: return "fp16";
    default: return "fp32";
  }
}

void megatron_rules(CliState& st) {
  Config& c = st.cfg;
  ParallelConfig& p = c.parallel;
  const std::string& fmt_ = c.checkpoint.ckpt_format;
  if (p.use_torch_fsdp2) {
    if (p.use_megatron_fsdp) fail("--use-torch-fsdp2 and --use-megatron-fsdp cannot be used together");
    if (p.pipeline_model_parallel_size != 1) fail("--use-torch-fsdp2 is not supported with pipeline parallelism");
    if (p.expert_model_parallel_size != 1) fail("--use-torch-fsdp2 is not supported with expert parallelism");
    if (p.use_distributed_optimizer) fail("--use-torch-fsdp2 is not supported with MCore's distributed optimizer");
    // Megatron-LM's gradient_accumulation_fusion is on unless --no-gradient-accumulation-fusion.
    if (!st.has("--no-gradient-accumulation-fusion"))
      fail("--use-torch-fsdp2 is not supported with gradient accumulation fusion (add "
           "--no-gradient-accumulation-fusion)");
    if (fmt_ != "torch_dist" && fmt_ != "torch_dcp")
      fail("--use-torch-fsdp2 requires --ckpt-format torch_dist or torch_dcp");
    if (!c.model.untie_embeddings_and_output_weights)
      fail("--use-torch-fsdp2 requires --untie-embeddings-and-output-weights");
    if (c.train.precision == Precision::fp16) fail("--use-torch-fsdp2 not supported with fp16 yet");
  }
  if (p.use_megatron_fsdp) {
    // (Version 2 is refused by app/unsupported.cpp; version 1 turns the distributed optimizer on.)
    if (!p.use_distributed_optimizer)
      st.note("Megatron-FSDP v1 is only compatible with --use-distributed-optimizer. Using DistributedOptimizer...");
    if (p.data_parallel_sharding_strategy == "optim_grads_params" &&
        c.train.check_weight_hash_across_dp_replicas_interval)
      fail("check_weight_hash_across_dp_replicas_interval is not supported with optim_grads_params");
    if (fmt_ != "fsdp_dtensor") fail("Megatron-FSDP requires the `fsdp_dtensor` checkpointing format.");
    if (st.has("--init-model-with-meta-device") && p.data_parallel_sharding_strategy == "no_shard")
      fail("Meta device initialization (init_model_with_meta_device=True) is not supported or necessary for the "
           "'no_shard' / 0 sharding strategy.");
  }
  if (st.has("--fsdp-manual-registration")) {
    if (!p.use_megatron_fsdp) fail("FSDP manual registration is only supported with Megatron FSDP.");
    if (!st.has("--use-nccl-ub")) fail("FSDP manual registration is only supported with --nccl-ub argument.");
  }
  if (fmt_ == "torch_dcp" && !p.use_torch_fsdp2) fail("--ckpt-format torch_dcp is only tested with FSDP.");
  if (fmt_ == "fsdp_dtensor" && !p.use_megatron_fsdp)
    fail("--ckpt-format fsdp_dtensor is only tested with Megatron FSDP.");
  if (p.outer_dp_sharding_strategy != "no_shard" &&
      (!p.use_megatron_fsdp || p.data_parallel_sharding_strategy != "optim_grads_params"))
    fail("--outer-dp-sharding-strategy {} is only supported with --use-megatron-fsdp and "
         "--data-parallel-sharding-strategy optim_grads_params",
         p.outer_dp_sharding_strategy);
}

// Megatron-FSDP's main weights, main gradients and gradient reduction in megatrain's terms.
void map_dtypes(CliState& st) {
  Config& c = st.cfg;
  ParallelConfig& p = c.parallel;
  const std::string model = model_dtype(c);
  const std::string& main_params = p.megatron_fsdp_main_params_dtype;
  if (main_params != "fp32" && !(main_params == "auto" && model == "fp32"))
    throw Unsupported(fmt::format("megatrain does not support --megatron-fsdp-main-params-dtype {} yet (its main "
                                  "weights are float32: use fp32, the default)",
                                  main_params));
  // auto: the parameters' dtype (bf16 for FP8 parameters).
  const std::string grads = p.megatron_fsdp_main_grads_dtype == "auto"
                                ? (c.train.fp8_param_gather ? std::string("bf16") : model)
                                : p.megatron_fsdp_main_grads_dtype;
  const std::string comm = p.megatron_fsdp_grad_comm_dtype == "auto" ? grads : p.megatron_fsdp_grad_comm_dtype;
  if (grads == "fp16")
    throw Unsupported("megatrain does not support fp16 main gradients yet (--megatron-fsdp-main-grads-dtype: use "
                      "fp32 or bf16)");
  if (comm != grads)
    throw Unsupported(fmt::format("megatrain does not support --megatron-fsdp-grad-comm-dtype {} with {} main "
                                  "gradients yet (it reduces gradients in their own dtype)",
                                  comm, grads));
  // Megatron-FSDP's gradient buffer has this dtype whatever --grad-reduce-in-bf16 and
  // --accumulate-allreduce-grads-in-fp32 say (derive() set the latter for bf16 runs).
  const bool bf16 = grads == "bf16";
  const char* ignored = bf16 ? "--accumulate-allreduce-grads-in-fp32" : "--grad-reduce-in-bf16";
  if (st.has(ignored))
    st.note(fmt::format("{} has no effect with --use-megatron-fsdp: --megatron-fsdp-main-grads-dtype decides the "
                        "main gradients' dtype ({})",
                        ignored, grads));
  if (bf16 && p.accumulate_allreduce_grads_in_fp32)  // (its info line no longer holds)
    std::erase_if(st.messages, [](const SetupMessage& m) { return m.text.starts_with("accumulate and all-reduce"); });
  p.grad_reduce_in_bf16 = bf16;  // accumulated over micro-batches and reduced in bf16
  p.accumulate_allreduce_grads_in_fp32 = !bf16 && c.train.precision == Precision::bf16;
}

}  // namespace

void validate_fsdp(CliState& st) {
  megatron_rules(st);
  ParallelConfig& p = st.cfg.parallel;
  const std::string strategy = fsdp_strategy(p);
  if (strategy.empty()) return;
  if (p.use_megatron_fsdp) map_dtypes(st);
  const int dp = p.data_parallel_size * p.context_parallel_size;
  const char* what = p.use_torch_fsdp2 ? "--use-torch-fsdp2" : "--use-megatron-fsdp";
  if (strategy == "no_shard") {
    p.use_distributed_optimizer = false;  // nothing sharded: the replicas all-reduce their gradients
    if (p.num_distributed_optimizer_instances != 1)
      st.note(fmt::format("--num-distributed-optimizer-instances {} with --data-parallel-sharding-strategy no_shard: "
                          "nothing is sharded, so every data-parallel rank is a replica",
                          p.num_distributed_optimizer_instances));
    p.num_distributed_optimizer_instances = 1;
    if (p.overlap_param_gather) {
      st.note("--overlap-param-gather with --data-parallel-sharding-strategy no_shard: there is no parameter gather "
              "to overlap");
      p.overlap_param_gather = false;
    }
    return;
  }
  p.use_distributed_optimizer = true;
  if (p.outer_dp_sharding_strategy == "optim") p.num_distributed_optimizer_instances = 1;
  if (strategy == "optim") return;
  const int ranks = dp / p.num_distributed_optimizer_instances;
  if (ranks == 1) {  // (engine/model_chunks.cpp shards nothing over one rank)
    st.note(fmt::format("{} ({}) with one data-parallel rank{}: nothing to shard, the run is the distributed "
                        "optimizer's over one rank",
                        what, strategy, p.num_distributed_optimizer_instances > 1 ? " per optimizer instance" : ""));
    return;
  }
  const std::string over = fmt::format("over the {} data-parallel ranks{}", ranks,
                                       p.num_distributed_optimizer_instances > 1
                                           ? fmt::format(" of each of {} instances", p.num_distributed_optimizer_instances)
                                           : std::string());
  const std::string reason = unsharded_gradients_reason(st.cfg).value_or("");
  if (!reason.empty()) {
    st.warn(fmt::format("{} ({}) with {}: megatrain shards only the master weights and optimizer state {} (ZeRO-1's "
                        "memory; gradient sharding is not built with {} yet): the same losses; the dry run prints each "
                        "strategy's memory per GPU",
                        what, strategy, reason, over, reason));
    return;
  }
  const std::string params_reason = unsharded_params_reason(st.cfg).value_or("-");
  if (strategy == "optim_grads_params" && params_reason != "")
    st.warn(fmt::format("{} ({}) with {}: megatrain shards the gradients, master weights and optimizer state {} "
                        "(ZeRO-2's memory) and keeps the compute-dtype parameters whole on every rank (parameter "
                        "sharding is not built with {} yet): the same losses; the dry run prints each strategy's "
                        "memory per GPU",
                        what, strategy, params_reason, over, params_reason));
  const ParallelConfig& q = st.cfg.parallel;
  const bool experts = st.cfg.model.moe.enabled() &&
                       (q.expert_model_parallel_size > 1 ||
                        q.expert_tensor_parallel_size.value_or(q.tensor_model_parallel_size) != q.tensor_model_parallel_size);
  st.note(fmt::format("{} ({}): {}each decoder layer's gradients are reduce-scattered {}{} when its backward ends, in "
                      "every micro-batch, and summed into this rank's shard; neither is overlapped with the "
                      "neighbouring layers' compute yet",
                      what, strategy,
                      params_reason != "" ? ""
                      : st.cfg.train.fp8_param_gather
                          ? "each decoder layer's parameters are all-gathered just before its forward and again before "
                            "its backward (two layers' worth held at once; FP8 weights as FP8 bytes, their transposed "
                            "copies made after each gather); "
                          : "each decoder layer's parameters are all-gathered just before its forward and again before "
                            "its backward (two layers' worth held at once); ",
                      over, experts ? " (the routed experts' over the expert-data-parallel ranks)" : ""));
}

}  // namespace mt::cli
