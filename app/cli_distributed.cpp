// Distributed, communication-overlap and kernel-fusion flags (megatron.md section 1.10).
#include "app/flags.h"

namespace mt::cli {

void add_distributed_flags(FlagTable& t) {
  t.set_group(FlagGroup::distributed);
  t.no_effect("--distributed-backend", Arity::one, "megatrain uses NCCL on GPUs and MPI with --device cpu", "nccl");
  t.value("--distributed-timeout-minutes", "timeout of collective operations", MT_FIELD(parallel.distributed_timeout_minutes));
  {
    FlagSpec s;
    s.name = "--local-rank";
    s.group = FlagGroup::distributed;
    s.metavar = "INT";
    s.help = "local rank (default $LOCAL_RANK or the launcher's)";
    s.default_text = "$LOCAL_RANK";
    s.apply = [](CliState& st, const FlagValue& v) { st.local_rank = parse_int_arg("--local-rank", v.one()); };
    t.add(std::move(s));
  }
  t.flag("--use-distributed-optimizer", "shard fp32 master weights and Adam moments over DP",
         MT_FIELD(parallel.use_distributed_optimizer));
  t.value("--num-distributed-optimizer-instances",
          "split DP into this many distributed-optimizer instances of consecutive DP ranks: state sharded within an "
          "instance, gradients reduce-scattered within it and all-reduced across instances",
          MT_FIELD(parallel.num_distributed_optimizer_instances));
  t.flag("--overlap-grad-reduce", "overlap the DP gradient reduction with the backward pass",
         MT_FIELD(parallel.overlap_grad_reduce));
  t.flag("--overlap-param-gather", "overlap the parameter all-gather with the next forward pass",
         MT_FIELD(parallel.overlap_param_gather));
  t.flag("--overlap-param-gather-with-optimizer-step", "overlap the parameter all-gather with the optimizer step",
         MT_FIELD(parallel.overlap_param_gather_with_optimizer_step));
  t.negative_alias(t.no_effect("--no-align-grad-reduce", Arity::none, "megatrain orders collectives per stage itself"));
  t.negative_alias(t.no_effect("--no-align-param-gather", Arity::none, "megatrain orders collectives per stage itself"));
  t.value("--ddp-bucket-size", "gradient bucket size in elements", MT_FIELD(parallel.ddp_bucket_size));
  t.value("--ddp-num-buckets", "number of gradient buckets", MT_FIELD(parallel.ddp_num_buckets));
  // Megatron multiplies each rank's gradients by 1/DP before the sum either way: in place, or
  // inside the collective (NCCL's average of floating-point data pre-multiplies by 1/ranks).
  t.without_effect(t.flag("--ddp-average-in-collective", "average in the collective instead of pre-scaling",
                          MT_FIELD(parallel.ddp_average_in_collective)),
                   "megatrain sums the data-parallel gradients unscaled and applies 1/DP in the optimizer step, "
                   "whichever way Megatron would have scaled them");
  t.without_effect(t.flag("--tp-comm-overlap", "overlap TP communication with GEMMs (needs --sequence-parallel)",
                          MT_FIELD(parallel.tp_comm_overlap)),
                   "Transformer Engine's userbuffers GEMM/communication overlap is not built; megatrain overlaps "
                   "sequence parallelism's backward all-gather and reduce-scatter with GEMMs as Megatron does "
                   "without it (the same results either way)");
  t.no_effect("--tp-comm-overlap-cfg", Arity::one, "a Transformer Engine userbuffers configuration");
  for (const char* n : {"--disable-tp-comm-overlap-ag", "--disable-tp-comm-overlap-rs", "--disable-tp-comm-bulk-dgrad",
                        "--disable-tp-comm-bulk-wgrad", "--disable-tp-comm-split-ag", "--disable-tp-comm-split-rs"})
    t.negative_alias(t.no_effect(n, Arity::none, "a Transformer Engine userbuffers switch"));
  t.no_effect("--tp-comm-overlap-rs-dgrad", Arity::none, "a Transformer Engine userbuffers switch");
  // Megatron defers the output layer's weight-gradient GEMMs of the last pipeline stage to overlap
  // them with the pipeline flush: a schedule change with the same gradients.
  t.no_effect("--defer-embedding-wgrad-compute", Arity::none,
              "megatrain computes the output layer's weight gradient in each micro-batch's backward pass: the same "
              "gradients, without Megatron's overlap of those GEMMs with the pipeline flush");
  t.no_effect("--wgrad-deferral-limit", Arity::one,
              "it limits --defer-embedding-wgrad-compute, which megatrain does not need (see that flag's note)", "0");
  t.negative_alias(t.no_effect("--no-gradient-accumulation-fusion", Arity::none,
                               "megatrain always accumulates weight gradients into the main grads in its GEMMs"));
  for (const char* n : {"--no-masked-softmax-fusion", "--no-bias-swiglu-fusion",
                        "--no-bias-dropout-fusion", "--no-rope-fusion", "--no-persist-layer-norm"})
    t.negative_alias(t.no_effect(n, Arity::none, "megatrain's kernels are fused by design"));
  t.no_effect("--cross-entropy-loss-fusion", Arity::none, "megatrain's cross entropy is always fused");
  t.no_effect("--cross-entropy-fusion-impl", Arity::one, "megatrain's cross entropy is always fused", "native");
  t.recognised("--use-torch-fsdp2", Arity::none, "", "off", "PyTorch FSDP2");
  t.recognised("--use-megatron-fsdp", Arity::none, "", "off", "Megatron FSDP");
  t.recognised("--data-parallel-sharding-strategy", Arity::one, "STR", "optim_grads_params", "FSDP sharding strategy");
  t.no_effect("--disable-gloo-process-groups", Arity::none, "megatrain has no Gloo process groups");
  t.recognised("--nccl-communicator-config-path", Arity::one, "PATH", "None", "per-group NCCL configuration");
  t.recognised("--use-sharp", Arity::none, "", "off", "InfiniBand SHARP");
  t.recognised("--sharp-enabled-group", Arity::one, "STR", "None", "group using SHARP");
}

}  // namespace mt::cli
