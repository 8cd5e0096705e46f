// Distributed, communication-overlap and kernel-fusion flags.
#include "app/flags.h"

namespace mt::cli {

// Fully sharded data parallelism: app/validate_fsdp.cpp
// holds Megatron-LM's rules and maps the strategies onto megatrain's data-parallel machinery.
namespace {
void add_fsdp_flags(FlagTable& t) {
  t.flag("--use-megatron-fsdp", "Megatron-FSDP: shard over the data-parallel ranks as "
         "--data-parallel-sharding-strategy says (needs --ckpt-format fsdp_dtensor, as in Megatron-LM)",
         MT_FIELD(parallel.use_megatron_fsdp));
  t.value("--megatron-fsdp-version", "Megatron-FSDP implementation (1; 2 is refused)",
          MT_FIELD(parallel.megatron_fsdp_version));
  t.choice("--data-parallel-sharding-strategy",
           "with --use-megatron-fsdp: no_shard (DDP), optim (ZeRO-1: optimizer state sharded), optim_grads (ZeRO-2: "
           "also the decoder layers' gradients), optim_grads_params (ZeRO-3: also their parameters, gathered per "
           "layer); where a layout cannot shard something yet a warning says what the run keeps",
           std::vector<std::pair<std::string, std::string>>{{"no_shard", "no_shard"}, {"optim", "optim"},
                                                            {"optim_grads", "optim_grads"},
                                                            {"optim_grads_params", "optim_grads_params"}},
           MT_FIELD(parallel.data_parallel_sharding_strategy));
  t.choice("--outer-dp-sharding-strategy",
           "hybrid sharding over --num-distributed-optimizer-instances: no_shard (replicas) or optim (optimizer "
           "state sharded over every data-parallel rank; needs optim_grads_params)",
           std::vector<std::pair<std::string, std::string>>{{"no_shard", "no_shard"}, {"optim", "optim"}},
           MT_FIELD(parallel.outer_dp_sharding_strategy));
  const std::vector<std::pair<std::string, std::string>> dtypes{
      {"fp32", "fp32"}, {"bf16", "bf16"}, {"fp16", "fp16"}, {"auto", "auto"}};
  t.choice("--megatron-fsdp-main-params-dtype", "Megatron-FSDP's main weights (megatrain keeps fp32 ones: fp32, or "
           "auto with float32 parameters)", dtypes, MT_FIELD(parallel.megatron_fsdp_main_params_dtype));
  t.choice("--megatron-fsdp-main-grads-dtype", "Megatron-FSDP's main gradients: auto = the parameters' dtype (bf16 "
           "is --grad-reduce-in-bf16's buffer)", dtypes, MT_FIELD(parallel.megatron_fsdp_main_grads_dtype));
  t.choice("--megatron-fsdp-grad-comm-dtype", "Megatron-FSDP's gradient reduction dtype: auto = the main gradients' "
           "(megatrain reduces in that dtype only)", dtypes, MT_FIELD(parallel.megatron_fsdp_grad_comm_dtype));
  t.flag("--use-torch-fsdp2", "PyTorch FSDP2 (fully_shard): megatrain runs it as Megatron-FSDP's optim_grads_params "
         "(Megatron-LM's FSDP2 rules apply)", MT_FIELD(parallel.use_torch_fsdp2));
  t.recognised("--torch-fsdp2-no-reshard-after-forward", Arity::none, "", "off",
               "keep FSDP2's gathered parameters from the forward to the backward pass");
  const char* buffers = "megatrain lays out every communication buffer before the first step and reuses it in every "
                        "step (nothing is allocated inside the step), which is what Megatron-FSDP's persistent "
                        "double buffers are for";
  t.no_effect("--fsdp-double-buffer", Arity::none, buffers);
  t.no_effect("--megatron-fsdp-max-pool-double-buffer", Arity::none, buffers);
  t.no_effect("--fsdp-db-use-persist-buf-on-alloc-fail", Arity::none, buffers);
  const char* ub = "megatrain's data-parallel collectives run on its own buffers without NCCL user-buffer "
                   "registration: the same results, without the streaming-multiprocessor saving registration brings";
  t.no_effect("--use-nccl-ub", Arity::none, ub);
  t.no_effect("--fsdp-manual-registration", Arity::none, ub);
  t.no_effect("--disable-symmetric-registration", Arity::none, ub);
  t.no_effect("--suggested-communication-unit-size", Arity::one,
              "megatrain communicates data-parallel gradients and parameters per bucket (--ddp-bucket-size)", "None");
  t.no_effect("--keep-fp8-transpose-cache", Arity::none,
              "megatrain keeps each FP8 layer's cast weights (and their transposes) from the step's first use to its "
              "end, also when the layer's parameters are gathered again for its backward");
  t.no_effect("--no-gradient-reduce-div-fusion", Arity::none,
              "megatrain sums the data-parallel gradients unscaled and applies 1/DP in the optimizer step");
  t.no_effect("--init-model-with-meta-device", Arity::none,
              "megatrain never builds a model on one device to move or shard it later: each rank draws only its own "
              "tensor- and pipeline-parallel part of every parameter, straight into its device memory, from "
              "streams that depend on the seed alone");
  t.recognised("--enable-full-sharding-in-hsdp", Arity::none, "", "off", "full sharding inside hybrid FSDP");
  t.recognised("--megatron-fsdp-enable-fine-grained-param-gather", Arity::none, "", "off",
               "fine-grained Megatron-FSDP parameter gathers");
}
}  // namespace

void add_distributed_flags(FlagTable& t) {
  t.set_group(FlagGroup::distributed);
  t.no_effect("--distributed-backend", Arity::one, "megatrain uses NCCL on GPUs and MPI with --device cpu", "nccl");
  t.value("--distributed-timeout-minutes", "timeout of collective operations", MT_FIELD(parallel.distributed_timeout_minutes));
  t.value("--distributed-timeout-seconds-after-init",
          "timeout of collective operations (every group) once the first iteration of the run has finished",
          MT_FIELD(parallel.distributed_timeout_seconds_after_init));
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
  t.flag("--overlap-grad-reduce",
         "overlap the DP gradient reduction with the backward pass (FSDP's sharded gradients: each layer's "
         "reduce-scatter finishes while the layers below run backward, a third layer-sized gradient slot)",
         MT_FIELD(parallel.overlap_grad_reduce));
  t.flag("--overlap-param-gather",
         "overlap the parameter all-gather with the next forward pass (FSDP's sharded parameters: each layer's "
         "gather prefetched a layer ahead, a third layer-sized parameter slot)",
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
  add_fsdp_flags(t);
  t.no_effect("--disable-gloo-process-groups", Arity::none, "megatrain has no Gloo process groups");
  t.recognised("--nccl-communicator-config-path", Arity::one, "PATH", "None", "per-group NCCL configuration");
  t.recognised("--use-sharp", Arity::none, "", "off", "InfiniBand SHARP");
  t.recognised("--sharp-enabled-group", Arity::one, "STR", "None", "group using SHARP");
}

}  // namespace mt::cli
