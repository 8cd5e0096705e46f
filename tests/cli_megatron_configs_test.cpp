// Megatron-LM functional-test style flag sets through the real binary's --dry-run: the ones that
// only tune checkpointing, logging or recompute pass; the ones megatrain cannot run are refused
// with every problem named in one error.
#include "tests/cli_test_util.h"

using namespace mt;
using namespace mt::test;
using Catch::Contains;

namespace {

// A GPT run as Megatron-LM's functional tests write it (TP 2, PP 2, mock data, NullTokenizer),
// with the checkpointing and logging flags those configs carry.
Args functional_gpt(const TempDir& d) {
  return words("--num-layers 12 --hidden-size 512 --num-attention-heads 8 --log-params-norm --log-num-zeros-in-grad "
               "--log-validation-ppl-to-tensorboard --log-timers-to-tensorboard --log-memory-to-tensorboard "
               "--tensorboard-dir " + d.str("tb") + " --micro-batch-size 4 --global-batch-size 32 --seq-length 1024 "
               "--max-position-embeddings 1024 --train-iters 50 --timing-log-level 0 --lr-decay-iters 320000 "
               "--save " + d.str("ckpt") + " --load " + d.str("ckpt") + " --mock-data --tokenizer-type NullTokenizer "
               "--vocab-size 8192 --split 949,50,1 --distributed-backend nccl --lr 0.00015 --lr-decay-style cosine "
               "--min-lr 1.0e-5 --weight-decay 1e-2 --clip-grad 1.0 --lr-warmup-fraction .01 --log-interval 1 "
               "--save-interval 10000 --eval-interval 1000 --eval-iters 10 --transformer-impl transformer_engine "
               "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --deterministic-mode "
               "--no-gradient-accumulation-fusion --attention-softmax-in-fp32 --use-mcore-models --ckpt-format "
               "torch_dist --data-cache-path " + d.str("cache") + " --bf16 --use-distributed-optimizer "
               "--overlap-grad-reduce --overlap-param-gather --sequence-parallel --num-workers 1 --seed 1234");
}

// GPT-3 175B on 8 GPUs with TP 8 only (hundreds of GiB per GPU), planned against --gpu-memory-gib.
RunResult gpt3_175b_dry_run(const std::string& gpu_memory_gib) {
  return run_binary(words(
      "--num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048 --max-position-embeddings 2048 "
      "--micro-batch-size 1 --global-batch-size 8 --lr 6e-5 --train-iters 10 --mock-data --tokenizer-type "
      "NullTokenizer --vocab-size 50257 --bf16 --tensor-model-parallel-size 8 --dry-run --world-size 8 "
      "--gpu-memory-gib " + gpu_memory_gib));
}

}  // namespace

TEST_CASE("cli: Megatron functional-test GPT configs pass the dry run", "[cli][binary]") {
  TempDir d;
  // Checkpointing and recompute flags that change nothing for megatrain: accepted with notes; W&B
  // logging becomes TensorBoard event files in --tensorboard-dir.
  const RunResult gpt = run_binary(functional_gpt(d) + words("--ckpt-assume-constant-structure --recompute-num-layers 1 "
                                                             "--no-ckpt-fully-parallel-save --ckpt-fully-parallel-load "
                                                             "--dist-ckpt-strictness log_all "
                                                             "--wandb-project megatron-lm --wandb-exp-name gpt-tp2-pp2 "
                                                             "--dry-run --world-size 8"));
  INFO(gpt.err);
  CHECK(gpt.exit_code == 0);
  CHECK_THAT(gpt.out, Contains("dry run: 8 ranks"));
  CHECK_THAT(gpt.out, Contains("8 ranks = TP 2 x CP 1 x DP 2 x PP 2"));
  CHECK_THAT(gpt.err, Contains("note: --ckpt-assume-constant-structure has no effect in megatrain"));
  CHECK_THAT(gpt.err, Contains("note: --recompute-num-layers has no effect without --recompute-granularity full"));
  CHECK_THAT(gpt.err, !Contains("] error:"));

  // A Llama-style variant: RoPE, RMSNorm, SwiGLU, GQA, untied embeddings, method without granularity.
  const RunResult llama = run_binary(
      functional_gpt(d) + words("--position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear "
                                "--group-query-attention --num-query-groups 2 --untie-embeddings-and-output-weights "
                                "--recompute-method uniform --ckpt-assume-constant-structure --async-save "
                                "--dry-run --world-size 16 --json"));
  INFO(llama.err);
  CHECK(llama.exit_code == 0);
  CHECK_THAT(llama.out, Contains("\"data_parallel_size\": 4"));
  CHECK_THAT(llama.err, Contains("note: --recompute-method has no effect without --recompute-granularity full"));
}

TEST_CASE("cli: Megatron configs megatrain cannot run are refused naming every problem at once", "[cli][binary]") {
  TempDir d;
  const RunResult r = run_binary(functional_gpt(d) + words("--experimental-attention-variant dsa --num-layer 4 "
                                                           "--checkpoint-activations --fp8-format e4m3 --fp8-recipe mxfp8 "
                                                           "--use-sharp --dry-run --world-size 8"));
  CHECK(r.exit_code == 1);
  CHECK(r.out.empty());
  CHECK(r.err ==
        "[rank 0] error: 5 problems with the command line:\n"
        "  unrecognized argument --num-layer (did you mean --num-layers?)\n"
        "  --checkpoint-activations is no longer valid, use --recompute-activations, or, for more control, "
        "--recompute-granularity and --recompute-method.\n"
        "  megatrain does not support --experimental-attention-variant dsa yet (Gated DeltaNet 2 and DeepSeek sparse "
        "attention layers (gated_delta_net / gdn is built))\n"
        "  megatrain does not support --use-sharp yet\n"
        "  megatrain does not support --fp8-recipe mxfp8 yet (FP8 recipes built: delayed, tensorwise)\n");

  // A plan larger than the GPU: the plan is printed, then the error naming the rank; exit 1.
  const RunResult big = gpt3_175b_dry_run("80");
  CHECK(big.exit_code == 1);
  CHECK_THAT(big.out, Contains("limit: 80.00 GiB per GPU (--gpu-memory-gib 80): the peak exceeds it (rank 0)"));
  CHECK_THAT(big.err, Contains("[rank 0] error: the plan needs "));
  CHECK_THAT(big.err, Contains(" GiB on rank 0 (pipeline stage 0, the largest plan), more than the 80.00 GiB of "
                               "--gpu-memory-gib 80: add parallelism"));
  // The same plan with enough memory passes.
  const RunResult roomy = gpt3_175b_dry_run("100000");
  CHECK(roomy.exit_code == 0);
  CHECK_THAT(roomy.out, Contains("the peak fits"));
}

// Megatron-LM's own training configurations (functional tests and examples) that pass the dry run,
// kept passing: tests/fixtures/megatron_configs.txt (bench/megatron_configs.py --write-fixture).
TEST_CASE("cli: Megatron-LM's functional-test configurations that pass the dry run keep passing", "[cli][binary]") {
  std::ifstream in(MEGATRAIN_SOURCE_DIR "/tests/fixtures/megatron_configs.txt");
  REQUIRE(in.good());
  TempDir d;
  int configs = 0;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    const size_t tab = line.find('\t');
    REQUIRE(tab != std::string::npos);
    const std::string name = line.substr(0, tab);
    std::string args = line.substr(tab + 1);
    for (size_t at; (at = args.find("@TMP@")) != std::string::npos;) args.replace(at, 5, d.str(std::to_string(configs)));
    for (size_t at; (at = args.find("@SRC@")) != std::string::npos;) args.replace(at, 5, MEGATRAIN_SOURCE_DIR);
    const RunResult r = run_binary_shell(args);
    INFO(name << "\n" << r.err);
    CHECK(r.exit_code == 0);
    CHECK_THAT(r.out, Contains("dry run: "));
    ++configs;
  }
  CHECK(configs >= 99);
}
