// Fully sharded data parallelism on the command line (app/validate_fsdp.cpp): Megatron-LM's rules
// for --use-megatron-fsdp and --use-torch-fsdp2, the strategies mapped onto the data-parallel
// settings the engine reads, the dtypes, and the dry run's memory of each strategy.
#include "tests/cli_test_util.h"

#include "app/plan.h"
#include "engine/model_chunks.h"

using namespace mt;
using namespace mt::test;
using Catch::Contains;

namespace {

Args fsdp(const std::string& strategy) {
  return small_gpt() + words("--use-megatron-fsdp --ckpt-format fsdp_dtensor --data-parallel-sharding-strategy " +
                             strategy);
}

Args fsdp2() {
  return small_gpt() + words("--use-torch-fsdp2 --no-gradient-accumulation-fusion --untie-embeddings-and-output-weights");
}

}  // namespace

TEST_CASE("fsdp: each sharding strategy maps onto DDP or the distributed optimizer", "[cli][fsdp]") {
  std::vector<SetupMessage> ms;
  const Config ddp = parse(fsdp("no_shard"), 4, &ms);
  CHECK_FALSE(ddp.parallel.use_distributed_optimizer);
  CHECK(fsdp_strategy(ddp.parallel) == "no_shard");
  CHECK_FALSE(has_message(ms, SetupMessage::Kind::warning, "ZeRO-1's memory"));
  for (const char* s : {"optim", "optim_grads", "optim_grads_params"}) {
    INFO(s);
    ms.clear();
    const Config c = parse(fsdp(s), 4, &ms);
    CHECK(c.parallel.use_distributed_optimizer);
    CHECK(c.parallel.num_distributed_optimizer_instances == 1);
    CHECK(fsdp_strategy(c.parallel) == s);
    // Megatron's own note when --use-distributed-optimizer is absent (v1 turns it on).
    CHECK(has_message(ms, SetupMessage::Kind::note, "Megatron-FSDP v1 is only compatible with --use-distributed-optimizer"));
    // optim is ZeRO-1 itself; optim_grads shards the gradients too, optim_grads_params also the
    // parameters; notes say how.
    const std::string strategy = s;
    CHECK_FALSE(has_message(ms, SetupMessage::Kind::warning, "ZeRO-1's memory"));
    CHECK_FALSE(has_message(ms, SetupMessage::Kind::warning, "ZeRO-2's memory"));
    CHECK(has_message(ms, SetupMessage::Kind::note, "gradients are reduce-scattered over the 4 data-parallel ranks") ==
          (strategy != "optim"));
    CHECK(has_message(ms, SetupMessage::Kind::note, "parameters are all-gathered just before its forward") ==
          (strategy == "optim_grads_params"));
    CHECK(unsharded_gradients_reason(c) == (strategy == "optim" ? std::nullopt : std::optional<std::string>("")));
    CHECK(unsharded_params_reason(c) ==
          (strategy == "optim_grads_params" ? std::optional<std::string>("") : std::nullopt));
  }
  // Where parameter sharding is not built: ZeRO-2's layout, with the reason.
  ms.clear();
  const Config remainders =
      parse(fsdp("optim_grads_params") + words("--bf16 --use-precision-aware-optimizer"), 4, &ms);
  CHECK_THAT(*unsharded_params_reason(remainders), Contains("--use-precision-aware-optimizer"));
  CHECK(has_message(ms, SetupMessage::Kind::warning, "ZeRO-2's memory"));
  // One data-parallel rank: nothing to shard, and the notes say so instead.
  ms.clear();
  parse(fsdp("optim_grads_params"), 1, &ms);
  CHECK(has_message(ms, SetupMessage::Kind::note, "with one data-parallel rank: nothing to shard"));
  CHECK_FALSE(has_message(ms, SetupMessage::Kind::note, "all-gathered"));
  // Under pipeline parallelism each stage shards its layers.
  ms.clear();
  const Config pp = parse(fsdp("optim_grads_params") + words("--pipeline-model-parallel-size 2"), 4, &ms);
  CHECK(unsharded_gradients_reason(pp) == std::optional<std::string>(""));
  CHECK(unsharded_params_reason(pp) == std::optional<std::string>(""));
  CHECK(has_message(ms, SetupMessage::Kind::note, "all-gathered"));
  CHECK_FALSE(has_message(ms, SetupMessage::Kind::warning, "megatrain shards only"));
  // FP8 parameters: sharded too, gathered as FP8 bytes (also an MoE model's experts').
  ms.clear();
  const Config fp8 = parse(fsdp("optim_grads_params") + words("--bf16 --fp8-format hybrid --fp8-param-gather"), 4, &ms);
  CHECK(unsharded_gradients_reason(fp8) == std::optional<std::string>(""));
  CHECK(unsharded_params_reason(fp8) == std::optional<std::string>(""));
  CHECK(has_message(ms, SetupMessage::Kind::note, "FP8 weights as FP8 bytes, their transposed copies made after each gather"));
  CHECK_FALSE(has_message(ms, SetupMessage::Kind::warning, "ZeRO-2's memory"));
  ms.clear();
  const Config fp8_moe = parse(fsdp("optim_grads_params") + words("--bf16 --fp8-format hybrid --fp8-param-gather "
                                                                   "--disable-bias-linear --num-experts 4"), 4, &ms);
  CHECK(unsharded_params_reason(fp8_moe) == std::optional<std::string>(""));
  CHECK(has_message(ms, SetupMessage::Kind::note, "FP8 weights as FP8 bytes"));
  CHECK_FALSE(has_message(ms, SetupMessage::Kind::warning, "ZeRO-2's memory"));
  // Megatron-LM's default strategy is optim_grads_params.
  CHECK(fsdp_strategy(parse(small_gpt() + words("--use-megatron-fsdp --ckpt-format fsdp_dtensor"), 2).parallel) ==
        "optim_grads_params");
  CHECK(fsdp_strategy(parse(small_gpt(), 2).parallel).empty());
  // no_shard: nothing sharded, so hybrid instances are replicas and there is no parameter gather.
  ms.clear();
  const Config hsdp_ddp =
      parse(fsdp("no_shard") + words("--num-distributed-optimizer-instances 2 --overlap-grad-reduce --overlap-param-gather"),
            4, &ms);
  CHECK(hsdp_ddp.parallel.num_distributed_optimizer_instances == 1);
  CHECK_FALSE(hsdp_ddp.parallel.overlap_param_gather);
  CHECK(has_message(ms, SetupMessage::Kind::note, "there is no parameter gather to overlap"));
}

TEST_CASE("fsdp: hybrid sharding over --num-distributed-optimizer-instances", "[cli][fsdp]") {
  // outer no_shard: sharded within each instance, replicated across (the partial distributed optimizer).
  const Config hsdp = parse(fsdp("optim_grads_params") + words("--num-distributed-optimizer-instances 2"), 4);
  CHECK(hsdp.parallel.num_distributed_optimizer_instances == 2);
  // outer optim: the optimizer state sharded over every data-parallel rank.
  const Config hfsdp = parse(fsdp("optim_grads_params") + words("--num-distributed-optimizer-instances 2 "
                                                                "--outer-dp-sharding-strategy optim"),
                             4);
  CHECK(hfsdp.parallel.num_distributed_optimizer_instances == 1);
  CHECK_THAT(parse_error(fsdp("optim_grads") + words("--num-distributed-optimizer-instances 2 "
                                                     "--outer-dp-sharding-strategy optim"),
                         4),
             Contains("--outer-dp-sharding-strategy optim is only supported with") &&
                 Contains("optim_grads_params"));
  CHECK_THAT(parse_error(small_gpt() + words("--outer-dp-sharding-strategy optim"), 4),
             Contains("--outer-dp-sharding-strategy optim is only supported with --use-megatron-fsdp"));
}

TEST_CASE("fsdp: Megatron-LM's rules for --use-megatron-fsdp", "[cli][fsdp]") {
  CHECK(parse_error(small_gpt() + words("--use-megatron-fsdp"), 2) ==
        "Megatron-FSDP requires the `fsdp_dtensor` checkpointing format.");
  CHECK(parse_error(small_gpt() + words("--ckpt-format fsdp_dtensor"), 2) ==
        "--ckpt-format fsdp_dtensor is only tested with Megatron FSDP.");
  CHECK(parse_error(small_gpt() + words("--ckpt-format torch_dcp"), 2) ==
        "--ckpt-format torch_dcp is only tested with FSDP.");
  CHECK(parse_error(fsdp("optim_grads_params") + words("--check-weight-hash-across-dp-replicas-interval 10"), 2) ==
        "check_weight_hash_across_dp_replicas_interval is not supported with optim_grads_params");
  CHECK(parse(fsdp("optim_grads") + words("--check-weight-hash-across-dp-replicas-interval 10"), 2)
            .train.check_weight_hash_across_dp_replicas_interval == 10);
  CHECK_THAT(parse_error(fsdp("no_shard") + words("--init-model-with-meta-device"), 2),
             Contains("Meta device initialization (init_model_with_meta_device=True) is not supported or necessary"));
  CHECK(parse_error(small_gpt() + words("--fsdp-manual-registration"), 2) ==
        "FSDP manual registration is only supported with Megatron FSDP.");
  CHECK(parse_error(fsdp("optim") + words("--fsdp-manual-registration"), 2) ==
        "FSDP manual registration is only supported with --nccl-ub argument.");
  CHECK_NOTHROW(parse(fsdp("optim") + words("--fsdp-manual-registration --use-nccl-ub --fsdp-double-buffer "
                                            "--init-model-with-meta-device"),
                      2));
  CHECK_THAT(parse_error(fsdp("optim") + words("--data-parallel-sharding-strategy zero3"), 2),
             Contains("--data-parallel-sharding-strategy") && Contains("zero3"));
  CHECK_THAT(unsupported_error(fsdp("optim") + words("--megatron-fsdp-version 2"), 2),
             Contains("--megatron-fsdp-version 2"));
}

TEST_CASE("fsdp: main weights, main gradients and their reduction dtypes", "[cli][fsdp]") {
  // auto main gradients have the parameters' dtype: bf16 with --bf16 (Megatron-FSDP ignores
  // --accumulate-allreduce-grads-in-fp32, which Megatron sets for bf16 runs).
  std::vector<SetupMessage> ms;
  const Config bf16 = parse(fsdp("optim_grads_params") + words("--bf16"), 2, &ms);
  CHECK(bf16.parallel.grad_reduce_in_bf16);
  CHECK_FALSE(bf16.parallel.accumulate_allreduce_grads_in_fp32);
  CHECK_FALSE(has_message(ms, SetupMessage::Kind::info, "accumulate and all-reduce gradients in fp32"));
  const Config fp32_grads =
      parse(fsdp("optim_grads_params") + words("--bf16 --megatron-fsdp-main-grads-dtype fp32"), 2);
  CHECK_FALSE(fp32_grads.parallel.grad_reduce_in_bf16);
  CHECK(fp32_grads.parallel.accumulate_allreduce_grads_in_fp32);
  // A float32 model: float32 gradients unless asked for bf16 ones.
  CHECK_FALSE(parse(fsdp("optim"), 2).parallel.grad_reduce_in_bf16);
  CHECK(parse(fsdp("optim") + words("--megatron-fsdp-main-grads-dtype bf16"), 2).parallel.grad_reduce_in_bf16);
  ms.clear();
  CHECK_FALSE(parse(fsdp("optim") + words("--grad-reduce-in-bf16"), 2, &ms).parallel.grad_reduce_in_bf16);
  CHECK(has_message(ms, SetupMessage::Kind::note, "--grad-reduce-in-bf16 has no effect with --use-megatron-fsdp"));
  // What megatrain does not build: other main weights, fp16 gradients, a reduction in another dtype.
  CHECK_THAT(unsupported_error(fsdp("optim") + words("--bf16 --megatron-fsdp-main-params-dtype auto"), 2),
             Contains("--megatron-fsdp-main-params-dtype auto"));
  CHECK_NOTHROW(parse(fsdp("optim") + words("--megatron-fsdp-main-params-dtype auto"), 2));  // float32 model
  CHECK_THAT(unsupported_error(fsdp("optim") + words("--bf16 --megatron-fsdp-grad-comm-dtype fp32"), 2),
             Contains("--megatron-fsdp-grad-comm-dtype fp32 with bf16 main gradients"));
  CHECK_THAT(unsupported_error(fsdp("optim") + words("--fp16"), 2), Contains("fp16 main gradients"));
}

TEST_CASE("fsdp: --use-torch-fsdp2 runs as optim_grads_params under Megatron-LM's FSDP2 rules", "[cli][fsdp]") {
  const Config c = parse(fsdp2(), 2);
  CHECK(c.parallel.use_distributed_optimizer);
  CHECK(fsdp_strategy(c.parallel) == "optim_grads_params");
  CHECK(parse_error(fsdp2() + words("--pipeline-model-parallel-size 2"), 2) ==
        "--use-torch-fsdp2 is not supported with pipeline parallelism");
  CHECK(parse_error(fsdp2() + words("--use-distributed-optimizer"), 2) ==
        "--use-torch-fsdp2 is not supported with MCore's distributed optimizer");
  CHECK_THAT(parse_error(small_gpt() + words("--use-torch-fsdp2 --untie-embeddings-and-output-weights"), 2),
             Contains("--use-torch-fsdp2 is not supported with gradient accumulation fusion"));
  CHECK(parse_error(small_gpt() + words("--use-torch-fsdp2 --no-gradient-accumulation-fusion"), 2) ==
        "--use-torch-fsdp2 requires --untie-embeddings-and-output-weights");
  CHECK(parse_error(fsdp2() + words("--fp16"), 2) == "--use-torch-fsdp2 not supported with fp16 yet");
  CHECK(parse_error(fsdp2() + words("--ckpt-format torch"), 2) ==
        "--use-torch-fsdp2 requires --ckpt-format torch_dist or torch_dcp");
  CHECK_NOTHROW(parse(fsdp2() + words("--ckpt-format torch_dcp"), 2));
  CHECK(parse_error(fsdp2() + words("--use-megatron-fsdp --ckpt-format fsdp_dtensor"), 2) ==
        "--use-torch-fsdp2 and --use-megatron-fsdp cannot be used together");
}

TEST_CASE("fsdp: the dry run's memory of each strategy", "[cli][fsdp][plan]") {
  // 4 layers of h 64 over DP 4: ZeRO-1 shards master weights and moments, the estimates shard the
  // layers' gradients (ZeRO-2) and parameters (ZeRO-3) on top.
  const Config c = parse(fsdp("optim_grads_params") + words("--num-layers 4 --bf16"), 4);
  const std::vector<StrategyMemory> m = sharding_strategy_memory(c, 0);
  REQUIRE(m.size() == 4);
  using C = MemoryCategory;
  CHECK(m[0].strategy == "no_shard");
  CHECK(m[1].strategy == "optim");
  CHECK(m[2].strategy == "optim_grads");
  CHECK(m[3].strategy == "optim_grads_params");
  CHECK_FALSE(m[1].estimate);
  CHECK_FALSE(m[2].estimate);  // (the engine lays out sharded gradients and parameters: its plans)
  CHECK_FALSE(m[3].estimate);
  // ZeRO-1 shards the float32 master weights and Adam moments about 4 ways (bucket padding aside).
  CHECK(m[1].plan.of(C::master_weights) * 3 < m[0].plan.of(C::master_weights));
  CHECK(m[1].plan.of(C::optimizer_states) * 3 < m[0].plan.of(C::optimizer_states));
  CHECK(m[1].plan.of(C::parameters) == m[0].plan.of(C::parameters));
  // ZeRO-2 has fewer gradients, the same parameters; ZeRO-3 fewer of both; totals fall in order.
  CHECK(m[2].plan.of(C::gradients) < m[1].plan.of(C::gradients));
  // (one bucket per layer pads each to a multiple of lcm(DP, 128) elements: a little more padding)
  CHECK(m[2].plan.of(C::parameters) >= m[1].plan.of(C::parameters));
  CHECK(m[2].plan.of(C::parameters) < m[1].plan.of(C::parameters) * 101 / 100);
  CHECK(m[3].plan.of(C::parameters) < m[2].plan.of(C::parameters));
  CHECK(m[0].total > m[1].total);
  // (One micro-batch per step: the activations of the runs that keep the whole gradient buffer lie
  // partly in it, GptModel::plan_acts_over_grads; ZeRO-2's unit slots hold none. Without them the
  // totals fall in order.)
  CHECK(m[0].plan.acts_in_grads > 0);
  CHECK(m[1].plan.acts_in_grads == m[0].plan.acts_in_grads);
  CHECK(m[2].plan.acts_in_grads == 0);
  CHECK(m[1].total + m[1].plan.acts_in_grads > m[2].total);
  // (ZeRO-3's sharded parameters keep whole float32 master weights, the others remainders beside
  // their bf16 parameters, core/master_remainder.h: the rest falls in order.)
  CHECK(m[3].plan.of(C::master_weights) > m[2].plan.of(C::master_weights));
  CHECK(m[2].total - m[2].plan.of(C::master_weights) > m[3].total - m[3].plan.of(C::master_weights));
  // The first plan is what a run without the distributed optimizer lays out.
  Config ddp = c;
  ddp.parallel.use_megatron_fsdp = ddp.parallel.use_distributed_optimizer = false;
  CHECK(m[0].total == stage_memory(ddp, 0).total);
  Config zero1 = c;
  zero1.parallel.data_parallel_sharding_strategy = "optim";
  CHECK(m[1].total == stage_memory(zero1, 0).total);
  Config zero2 = c;
  zero2.parallel.data_parallel_sharding_strategy = "optim_grads";
  CHECK(m[2].total == stage_memory(zero2, 0).total);
  CHECK(m[3].total == stage_memory(c, 0).total);
  // With pipeline parallelism both are built: each stage's plans are what its runs lay out.
  const Config pp = parse(fsdp("optim_grads") + words("--num-layers 4 --bf16 --pipeline-model-parallel-size 2"), 4);
  for (int stage : {0, 1}) {
    INFO("stage " << stage);
    const auto p = sharding_strategy_memory(pp, stage);
    CHECK_FALSE(p[2].estimate);
    CHECK_FALSE(p[3].estimate);
    CHECK(p[2].total == stage_memory(pp, stage).total);
    Config pp3 = pp;
    pp3.parallel.data_parallel_sharding_strategy = "optim_grads_params";
    CHECK(p[3].total == stage_memory(pp3, stage).total);
  }
  // FP8 parameters: ZeRO-2 and ZeRO-3 are built (ZeRO-3: this run's plan, its FP8 weights sharded),
  // and DDP, which cannot hold FP8 parameters, estimated from compute-dtype weights.
  const Config fp8 = parse(fsdp("optim_grads_params") + words("--num-layers 4 --bf16 --fp8-format hybrid --fp8-param-gather"), 4);
  const auto f = sharding_strategy_memory(fp8, 0);
  CHECK(f[0].estimate);
  CHECK_FALSE(f[1].estimate);
  CHECK_FALSE(f[2].estimate);
  CHECK_FALSE(f[3].estimate);
  CHECK(f[3].total == stage_memory(fp8, 0).total);
  CHECK(f[3].plan.of(MemoryCategory::parameters) < f[2].plan.of(MemoryCategory::parameters));
}
