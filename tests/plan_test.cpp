// The --dry-run planner on the configurations: GPT-3 175B on 1024 GPUs, Llama-3 8B on 8,
// a small GPT on 1 (parameter counts worked out by hand in the comments).
#include "tests/cli_test_util.h"

#include <algorithm>

#include "app/plan.h"
#include "engine/backend.h"
#include "engine/flops.h"
#include "engine/model_chunks.h"
#include "parallel/parallel_state.h"

using namespace mt;
using namespace mt::test;
using Catch::Contains;

namespace {

// examples/gpt3/train_gpt3_175b_distributed.sh with its placeholders filled.
Args gpt3_script(const std::string& data, const std::string& shared, bool with_schedule) {
  Args a = words(
      "--num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048 --max-position-embeddings 2048 "
      "--attention-backend auto --micro-batch-size 1 --global-batch-size 1536");
  if (with_schedule) a = a + Args{"--step-batch-size-schedule", "0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536"};
  return a + words("--train-iters 500000 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.006 "
                   "--clip-grad 1.0 --fp16 --lr 6.0e-5 --lr-decay-style cosine --min-lr 6.0e-6 --lr-warmup-fraction .001 "
                   "--lr-decay-iters 430000 --tensor-model-parallel-size 8 --pipeline-model-parallel-size 16 --data-path " +
                   data + " --vocab-file " + shared + "/gpt2/gpt2-vocab.json --merge-file " + shared +
                   "/gpt2/gpt2-merges.txt --split 949,50,1 --log-interval 100 --save-interval 10000 --eval-interval 1000 "
                   "--save /tmp/ckpt --load /tmp/ckpt --eval-iters 10 --tensorboard-dir /tmp/tb");
}

// examples/llama/train_llama3_8b_h100_fp8.sh, mock-data branch.
Args llama3_script(bool with_fp8) {
  Args a = words(
      "--use-mcore-models --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 "
      "--group-query-attention --num-query-groups 8 --kv-channels 128 --seq-length 8192 --max-position-embeddings 8192 "
      "--position-embedding-type rope --rotary-base 1000000 --rotary-percent 1.0 --attention-dropout 0.0 "
      "--hidden-dropout 0.0 --swiglu --normalization RMSNorm --init-method-std 0.0134 --attention-backend fused "
      "--apply-layernorm-1p --untie-embeddings-and-output-weights --disable-bias-linear --micro-batch-size 1 "
      "--global-batch-size 128 --train-samples 1953125000 --lr-decay-samples 1949218748 --lr-warmup-samples 3906252 "
      "--lr 0.00015 --min-lr 0.00001 --decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5 --lr-decay-style cosine "
      "--clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16 --grad-reduce-in-bf16 "
      "--cross-entropy-loss-fusion --calculate-per-token-loss --manual-gc --empty-unused-memory-level 1 "
      "--exit-duration-in-mins 235 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather");
  if (with_fp8) a = a + words("--fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max --fp8-param-gather");
  a = a + words("--tensor-model-parallel-size 1 --context-parallel-size 1 --sequence-parallel --mock-data "
                "--tokenizer-type NullTokenizer --vocab-size 128256 --data-cache-path /tmp/benchmark_cache_llama3_8b_fp8 "
                "--tiktoken-pattern v2");
  a = a + Args{"--split", "'99,1,0'"};
  return a + words("--no-create-attention-mask-in-dataloader --no-mmap-bin-files --num-workers 1 --log-interval 1 "
                   "--eval-iters 32 --eval-interval 100 --save-interval 1000 --log-throughput --profile "
                   "--profile-step-start 4 --profile-step-end 6 --ckpt-format torch_dist --distributed-timeout-minutes 60 "
                   "--save /tmp/ckpt --load /tmp/ckpt --tensorboard-dir /tmp/tb");
}

}  // namespace

TEST_CASE("plan: GPT-3 175B script on 1024 GPUs", "[plan]") {
  MT_REQUIRE_SHARED_DATA(shared);
  TempDir d;
  write_dataset(d.str("gpt3"));
  // The script as published passes --step-batch-size-schedule together with --global-batch-size,
  // which Megatron HEAD rejects: so does megatrain, with Megatron's message.
  try {
    parse_env(gpt3_script(d.str("gpt3"), shared, true) + words("--dry-run --world-size 1024"), {});
    FAIL("expected an error");
  } catch (const Error& e) {
    CHECK(std::string(e.what()) == "Cannot specify both --step-batch-size-schedule and --global-batch-size");
  }
  // Word-split by an unquoted array expansion, the schedule still lands on its flag; without
  // --global-batch-size the schedule plans the largest batch (1536 / (1 x DP 8) micro-batches).
  Args split = gpt3_script(d.str("gpt3"), shared, false) + words("--step-batch-size-schedule 0:16 2.4B:320 12B:1536");
  split.erase(std::find(split.begin(), split.end(), "--global-batch-size"), std::find(split.begin(), split.end(), "--global-batch-size") + 2);
  const Config scheduled = parse_env(split + words("--dry-run --world-size 1024"), {});
  CHECK(scheduled.train.num_microbatches == 192);
  CHECK(scheduled.train.global_batch == 8);  // Megatron's args.global_batch_size: micro-batch x DP
  CHECK(scheduled.train.batch_size_schedule ==
        std::vector<std::pair<int64_t, int>>{{0, 16}, {2400000000 / 2048, 320}, {12000000000 / 2048, 1536}});

  std::vector<SetupMessage> ms;
  const Config c = parse_env(gpt3_script(d.str("gpt3"), shared, false) + words("--dry-run --world-size 1024"), {}, &ms);
  CHECK(c.parallel.data_parallel_size == 8);
  CHECK(c.train.num_microbatches == 192);  // 1536 / (1 x 8)
  CHECK(c.model.padded_vocab_size == 51200);
  CHECK(c.train.lr_decay_steps == 430000LL * 1536);
  CHECK(c.train.lr_warmup_steps == Approx(0.001 * 430000 * 1536));
  const Plan p = make_plan(c);
  CHECK(p.params.total == 174615846912LL);  // see engine_count_test: ~174.6e9 with vocab 51200
  CHECK(p.stages.size() == 16);
  CHECK(p.stages[0].num_layers == 6);
  CHECK(p.stages[0].params_per_rank == 1463270400LL);
  CHECK(p.stages[15].params_per_rank == 1438129152LL);
  CHECK(p.stages[15].chunks[0].first_layer == 90);
  CHECK(p.flops_per_iteration == Approx(1061947441152.0 * 1536 * 2048).epsilon(1e-12));
  const RankCoord last = rank_coord(p.grid, 1023);
  CHECK(last.tp == 7);
  CHECK(last.dp == 7);
  CHECK(last.pp == 15);
  CHECK(rank_group_of(p.grid, "pp", 0) == std::vector<int>{0,   64,  128, 192, 256, 320, 384, 448,
                                                              512, 576, 640, 704, 768, 832, 896, 960});
  // The engine's plan (fp16 without --use-distributed-optimizer): fp16 weights, fp32 main grads,
  // fp32 master weights and two fp32 Adam moments per (padded) element: 2 + 4 + 4 + 8 bytes.
  using C = MemoryCategory;
  const StageMemory& m0 = p.stages[0].memory;
  const double elems0 = static_cast<double>(m0.plan.of(C::parameters)) / 2;
  CHECK(elems0 >= 1463270400.0);
  CHECK(elems0 < 1463270400.0 * 1.001);  // bucket padding only
  CHECK(m0.plan.of(C::gradients) == 2 * m0.plan.of(C::parameters));
  CHECK(m0.plan.of(C::master_weights) == 2 * m0.plan.of(C::parameters));
  CHECK(m0.plan.of(C::optimizer_states) == 4 * m0.plan.of(C::parameters));
  CHECK(m0.total == Approx(static_cast<double>(m0.plan.total())));
  CHECK(m0.activation_slots == 16);  // 1F1B: the first of 16 stages holds 16 micro-batches
  // The last stage runs each micro-batch's forward and backward back to back, but the next one's
  // activations are received into a slot of their own before that backward: 2 slots.
  CHECK(p.stages[15].memory.activation_slots == 2);
  CHECK(p.stages[15].memory.plan.of(C::workspace) > m0.plan.of(C::workspace));  // the output layer's logits
  // Text output summarises 1024 ranks; JSON has all of them.
  const std::string text = plan_text(c, p, ms);
  CHECK_THAT(text, Contains("1024 ranks = TP 8 x CP 1 x DP 8 x PP 16"));
  CHECK_THAT(text, Contains("more; --json lists every rank"));
  CHECK_THAT(text, Contains("*  --num-layers"));
  const nlohmann::json j = plan_json(c, p, ms);
  CHECK(j["rank_grid"]["ranks"].size() == 1024);
  CHECK(j["rank_grid"]["groups"]["tp"].size() == 128);
  CHECK(j["parameters"]["total"].get<int64_t>() == 174615846912LL);
  CHECK(j["config"]["--hidden-size"]["differs"].get<bool>());
  CHECK_FALSE(j["config"]["--seed"]["differs"].get<bool>());
}

TEST_CASE("plan: Llama-3 8B script on 8 GPUs", "[plan]") {
  std::vector<SetupMessage> ms;
  const Config c = parse_env(llama3_script(false) + words("--dry-run --world-size 8"), {}, &ms);
  CHECK(has_message(ms, SetupMessage::Kind::warning, "Disabling sequence parallelism"));
  for (const char* f : {"--use-mcore-models", "--cross-entropy-loss-fusion", "--manual-gc", "--empty-unused-memory-level",
                        "--no-create-attention-mask-in-dataloader", "--num-workers", "--profile", "--profile-step-start",
                        "--profile-step-end"}) {
    INFO(f);
    CHECK(has_message(ms, SetupMessage::Kind::note, std::string(f) + " has no effect in megatrain"));
  }
  CHECK_FALSE(c.data.mmap_bin_files);
  CHECK(c.data.split_weights[0] == Approx(0.99));
  CHECK(c.model.vocab_size == 128256);
  CHECK(c.model.padded_vocab_size == 128256);
  CHECK(c.model.query_groups == 8);
  CHECK(c.model.rotary_base == 1000000);
  CHECK(c.train.num_microbatches == 16);  // 128 / (1 x DP 8)
  CHECK(c.train.total_iters == 1953125000LL / 128);
  CHECK_FALSE(c.parallel.accumulate_allreduce_grads_in_fp32);  // --grad-reduce-in-bf16
  const Plan p = make_plan(c);
  CHECK(p.params.total == 8030261248LL);  // 8.03e9, see engine_count_test
  CHECK(p.flops_per_token == Approx(51470401536.0).epsilon(1e-12));
  // bf16 weights; bf16 main grads (--grad-reduce-in-bf16: Megatron's grad buffer in the weights'
  // dtype, 2 bytes per parameter); master weights and Adam moments sharded over the 8 DP ranks
  // (--use-distributed-optimizer), the master weights as 16-bit remainders beside the bf16
  // weights and a tie bit each (core/master_remainder.h).
  using C = MemoryCategory;
  const StageMemory& m = p.stages[0].memory;
  const size_t P = m.plan.of(C::parameters);
  CHECK(static_cast<double>(P) / 2 >= 8030261248.0);
  CHECK(static_cast<double>(P) / 2 < 8030261248.0 * 1.001);
  CHECK(m.plan.of(C::gradients) == P);
  const size_t shard = P / 2 / 8;  // elements of this rank's shards
  CHECK(m.plan.of(C::master_weights) >= 2 * shard + (shard + 31) / 32 * 4);
  CHECK(m.plan.of(C::master_weights) < 2 * shard + (shard + 31) / 32 * 4 + 4096);  // (alignment)
  CHECK(m.plan.of(C::optimizer_states) * 8 == 4 * P);

  // The script as it is, FP8 flags included: --fp8-param-gather keeps the FP8 layers' weights (87%
  // of the parameters) as FP8 only, 1 byte plus 1 for the transposed copy the input-gradient GEMM
  // takes: the parameters take what the bf16 weights alone take (without it: 2 bytes more per FP8
  // weight, 85.4 GiB per GPU, above an 80 GB H100).
  const Config f = parse_env(llama3_script(true) + words("--dry-run --world-size 8"), {});
  CHECK(f.train.fp8_param_gather);
  const Plan pf = make_plan(f);
  const StageMemory& mf = pf.stages[0].memory;
  const double Pf = static_cast<double>(mf.plan.of(C::parameters));
  CHECK(std::abs(Pf - static_cast<double>(P)) < 0.001 * static_cast<double>(P));
  CHECK(mf.plan.of(C::gradients) == P);
  CHECK(static_cast<double>(mf.plan.total()) < 78.0 * (1 << 30));
}

TEST_CASE("plan: small GPT on 1 GPU, memory worked out by hand", "[plan]") {
  const Config c = parse_env(small_gpt() + words("--bf16 --dry-run --world-size 1"), {});
  const Plan p = make_plan(c);
  // h 64, 2 layers, V 1000 padded to 1024, 32 positions. Per layer: 2 LayerNorms 256, QKV
  // 3*4096 + 192 = 12,480, projection 4096 + 64 = 4,160, fc1 16,384 + 256 = 16,640, fc2
  // 16,384 + 64 = 16,448: 49,984; x2 = 99,968; embeddings 65,536; positions 2,048; final norm 128.
  CHECK(p.params.total == 167680);
  CHECK(p.stages[0].params_per_rank == 167680);
  // Memory: exactly the plan of the model the training run builds (one process, reference
  // backend): the dry run measures the same layout.
  using C = MemoryCategory;
  const StageMemory& m = p.stages[0].memory;
  std::unique_ptr<Backend> be = make_reference_backend(1);
  ParallelState ps = make_single_process_state();
  const auto built = build_model_chunks(c, ps, *be, DType::bf16);
  REQUIRE(built.size() == 1);
  CHECK(m.plan.bytes == built[0]->memory_plan().bytes);
  CHECK(m.plan.acts_in_grads == built[0]->memory_plan().acts_in_grads);
  CHECK(m.plan.of(C::parameters) >= 2 * 167680);
  CHECK(m.plan.of(C::gradients) == 2 * m.plan.of(C::parameters));
  // Master weights: 16 bits per element beside the bf16 parameters, and a tie bit (int32 words).
  const size_t elements = m.plan.of(C::parameters) / 2;
  CHECK(m.plan.of(C::master_weights) >= 2 * elements + (elements + 31) / 32 * 4);
  CHECK(m.plan.of(C::master_weights) < 2 * elements + (elements + 31) / 32 * 4 + 1024);
  CHECK(m.activation_slots == 1);
  // Full recompute keeps less: the same engine plan under --recompute-granularity full.
  const Config full = parse_env(small_gpt() + words("--bf16 --dry-run --world-size 1 --recompute-granularity full "
                                                    "--recompute-method uniform --recompute-num-layers 1"),
                                {});
  CHECK(make_plan(full).stages[0].memory.plan.of(C::activations) < m.plan.of(C::activations));
  const std::string text = plan_text(c, p, {});
  CHECK_THAT(text, Contains("rank     0: tp 0 cp 0 dp 0 pp 0"));
  CHECK_THAT(text, Contains("total: 167,680"));
  CHECK_THAT(text, Contains("master: the 16 bits each bf16 parameter lacks and a tie bit"));
  const Config sgd = parse_env(small_gpt() + words("--bf16 --optimizer sgd --dry-run --world-size 1"), {});
  CHECK_THAT(plan_text(sgd, make_plan(sgd), {}), !Contains("master: "));  // (a float32 copy)
}

TEST_CASE("plan: activations lie in gradient memory only with one micro-batch per step", "[plan]") {
  // Six untied layers: layer i's activations over layers 0..i-2's gradients and the embeddings'.
  using C = MemoryCategory;
  const Args six = small_gpt() + words("--bf16 --num-layers 6 --untie-embeddings-and-output-weights --dry-run");
  const Config one = parse_env(six + words("--world-size 1"), {});
  const Plan p = make_plan(one);
  const MemoryPlan& m = p.stages[0].memory.plan;
  CHECK(m.acts_in_grads > 0);
  CHECK(m.acts_in_grads < m.of(C::gradients));
  CHECK(p.stages[0].memory.total == static_cast<double>(m.total()));  // (the shared bytes counted once)
  CHECK_THAT(plan_text(one, p, {}), Contains("more lie in gradient memory"));
  // The same model built for training lays them out alike (the reference backend).
  std::unique_ptr<Backend> be = make_reference_backend(1);
  ParallelState ps = make_single_process_state();
  const auto built = build_model_chunks(one, ps, *be, DType::bf16);
  REQUIRE(built.size() == 1);
  CHECK(built[0]->memory_plan().acts_in_grads == m.acts_in_grads);
  CHECK(built[0]->memory_plan().bytes == m.bytes);
  // Two micro-batches: the first's gradients outlive the second's forward. Nothing shared; the
  // activations' block holds it all.
  const Config two = parse_env(six + words("--world-size 1 --global-batch-size 4"), {});
  const MemoryPlan& m2 = make_plan(two).stages[0].memory.plan;
  CHECK(m2.acts_in_grads == 0);
  CHECK(m2.of(C::activations) == m.of(C::activations) + m.acts_in_grads);
  CHECK_THAT(plan_text(two, make_plan(two), {}), !Contains("more lie in gradient memory"));
  // Pipeline stages each on their own layers (one micro-batch: one slot per stage).
  const Config pp = parse_env(six + words("--world-size 2 --pipeline-model-parallel-size 2"), {});
  const Plan pp_plan = make_plan(pp);
  REQUIRE(pp_plan.stages.size() == 2);
  CHECK(pp_plan.stages[0].memory.plan.acts_in_grads > 0);
  CHECK(pp_plan.stages[1].memory.plan.acts_in_grads > 0);
}

TEST_CASE("plan: interleaved stages hold their chunks' layers", "[plan]") {
  const Config c = parse_env(small_gpt() + words("--num-layers 8 --pipeline-model-parallel-size 2 "
                                                    "--num-virtual-stages-per-pipeline-rank 2 --global-batch-size 8 "
                                                    "--dry-run --world-size 2"),
                                {});
  const Plan p = make_plan(c);
  REQUIRE(p.stages.size() == 2);
  REQUIRE(p.stages[1].chunks.size() == 2);
  CHECK(p.stages[1].chunks[0].first_layer == 2);
  CHECK(p.stages[1].chunks[1].first_layer == 6);
  // Warmup W = min(T, 2(P-r-1) + (V-1)N) with T = 8, N = 2: stage 0 holds 5 chunk-micro-batches.
  // Activation slots the engine's schedule plan gives the chunks (a slot is taken when its input
  // arrives, which can be before the forward): at least the chunk-micro-batches Megatron's
  // warm-up keeps in flight, W = min(T, 2(P-r-1) + (V-1)N) + 1 with T = 8, N = 2: 5 and 3.
  CHECK(p.stages[0].memory.activation_slots >= 5);
  CHECK(p.stages[1].memory.activation_slots >= 3);
  CHECK(p.stages[0].memory.activation_slots <= 8);
}

// The three single-GPU benchmark configs of bench/run_bench.sh: the dry run's estimate is the plan
// the training runs print ("> memory plan", bench/RESULTS.md): 11.84 / 38.42 / 25.72 GiB since the
// layers' activations lie partly in gradient memory (GptModel::plan_acts_over_grads; 11.84 / 41.92
// / 29.64 before, 12.06 / 44.22 / 32.25 with a separate float32 master copy, measured peaks on an
// H100 12.36 / 44.59 / 32.56). If the engine's layout changes,
// update docs/run-output.md's table of the memory plan together with these figures.
TEST_CASE("plan: the benchmark configs' estimates are the plans the H200 runs reported", "[plan]") {
  const std::string common =
      "--bf16 --mock-data --tokenizer-type NullTokenizer --attention-dropout 0.0 --hidden-dropout 0.0 --lr 1e-4 "
      "--train-iters 25 --eval-iters 0 --dry-run --world-size 1 ";
  const std::vector<std::pair<std::string, double>> configs = {
      {"--num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024 --max-position-embeddings 1024 "
       "--micro-batch-size 32 --global-batch-size 32 --vocab-size 50304",
       11.84},
      {"--recompute-granularity selective --recompute-modules core_attn layernorm "
       "--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 "
       "--micro-batch-size 8 --global-batch-size 8 --vocab-size 50304",
       38.42},
      {"--recompute-granularity selective --recompute-modules core_attn layernorm "
       "--num-layers 16 --hidden-size 2048 --num-attention-heads 32 --group-query-attention --num-query-groups 8 "
       "--ffn-hidden-size 8192 --seq-length 4096 --max-position-embeddings 4096 --micro-batch-size 2 "
       "--global-batch-size 2 --vocab-size 128256 --swiglu --normalization RMSNorm --position-embedding-type rope "
       "--untie-embeddings-and-output-weights --disable-bias-linear",
       25.72}};
  for (const auto& [flags, gib] : configs) {
    INFO(flags);
    const Plan p = make_plan(parse_env(words(common + flags), {}));
    CHECK(std::round(p.stages[0].memory.total / 1073741824.0 * 100) / 100 == Approx(gib));
  }
}
