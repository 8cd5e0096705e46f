// Sizes no real run reaches are refused while the flags are validated, in one line naming the flag,
// before anything is laid out or allocated: dimensions that overflowed 32-bit widths, models and
// micro-batches whose byte counts overflowed the memory plan, step sizes beyond 32-bit counts (and
// the bounds app/derive.cpp already had on layers, micro-batches and samples). Everything here only
// parses; nothing is sized by the absurd values.
#include "tests/cli_test_util.h"

#include <algorithm>

#include "app/plan.h"

using namespace mt;
using namespace mt::test;
using Catch::Contains;

namespace {

// small_gpt() without its sizes, so each case sets them (and --train-iters 10 unless they give
// --train-samples).
Args model(const std::string& sizes) {
  const std::string length = sizes.find("--train-samples") == std::string::npos ? "--train-iters 10 " : "";
  return words("--lr 1e-3 --mock-data --tokenizer-type NullTokenizer --dry-run " + length + sizes);
}
const std::string kSmall =
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
    "--micro-batch-size 1 --vocab-size 1000 ";

}  // namespace

TEST_CASE("cli: absurd sizes are refused at once in one line naming the flag", "[cli][sizes]") {
  struct Case {
    std::string flags;     // after kSmall (later flags win, as in argparse)
    std::string expected;  // in the error
  };
  const std::vector<Case> cases = {
      // Bounds on counts (layers, micro-batches per step, samples).
      {"--num-layers 1000000", "--num-layers 1000000 is more than megatrain plans for (at most 65536"},
      {"--global-batch-size 2000000000", "--global-batch-size 2000000000 needs 2000000000 micro-batches per iteration"},
      {"--train-iters 2000000000 --global-batch-size 1000000", "--train-iters 2000000000 x --global-batch-size 1000000 "
                                                              "is more samples than megatrain plans for"},
      {"--train-samples 2000000000000", "--train-samples 2000000000000 is more than megatrain plans for"},
      {"--eval-iters 2000000000 --eval-interval 1 --train-iters 1000",
       "--eval-iters 2000000000 x 1001 evaluations (every --eval-interval iterations and at the end) x 1 samples is "
       "more validation samples than megatrain plans for (at most 1099511627776)"},
      // Widths: each dimension of a weight matrix, given or derived.
      {"--hidden-size 2000000000 --num-attention-heads 1",
       "--hidden-size 2000000000 is wider than megatrain plans for (at most 16777216 = 2^24 for any dimension of a weight matrix"},
      {"--hidden-size 600000000 --num-attention-heads 1", "--hidden-size 600000000 is wider than"},
      {"--hidden-size 8388608 --num-attention-heads 1",
       "the MLP size 33554432 (Megatron's default for --hidden-size 8388608; --ffn-hidden-size sets it) is wider than"},
      {"--hidden-size 8388608 --num-attention-heads 1 --swiglu",
       "the MLP size 22369600 (Megatron's default for --hidden-size 8388608 with --swiglu"},
      {"--ffn-hidden-size 2000000000", "--ffn-hidden-size 2000000000 is wider than"},
      {"--kv-channels 2147483647", "--kv-channels 2147483647 is wider than"},
      {"--num-attention-heads 2147483647 --kv-channels 64",
       "the query width --num-attention-heads 2147483647 x --kv-channels 64 is wider than"},
      {"--num-attention-heads 1000000 --kv-channels 1000", "--num-attention-heads 1000000 x --kv-channels 1000"},
      {"--vocab-size 2000000000", "--vocab-size 2000000000 is wider than"},
      {"--vocab-size 2147483600", "--vocab-size 2147483600 is wider than"},
      {"--vocab-size 16777215 --make-vocab-size-divisible-by 1000",
       "--vocab-size 16777215, padded to 16778000 (a multiple of --make-vocab-size-divisible-by 1000 x "
       "--tensor-model-parallel-size 1), is wider than"},
      {"--padded-vocab-size 2000000000", "--padded-vocab-size 2000000000 is wider than"},
      {"--num-experts 8 --moe-router-topk 2 --disable-bias-linear --moe-ffn-hidden-size 2000000000",
       "--moe-ffn-hidden-size 2000000000 is wider than"},
      // Totals: parameters, and the activations of one micro-batch.
      {"--num-layers 65536 --hidden-size 16777216 --num-attention-heads 1 --ffn-hidden-size 64",
       "--num-layers 65536, --hidden-size 16777216, MLP size 64 and a vocabulary of 1024 give at least 7.38e+19 "
       "parameters, more than megatrain plans for (at most 2^50 = 1.13e+15"},
      {"--num-layers 4096 --hidden-size 16384 --num-attention-heads 128 --ffn-hidden-size 16777216",
       "give at least 2.26e+15 parameters"},
      {"--num-layers 2 --ffn-hidden-size 64 --num-experts 1000000 --moe-router-topk 2 --disable-bias-linear "
       "--moe-ffn-hidden-size 16777216",
       "--num-experts 1000000 of size 16777216"},
      {"--micro-batch-size 2147483647 --seq-length 2147483647 --max-position-embeddings 2147483647",
       "--micro-batch-size 2147483647 x --seq-length 2147483647 = 4.61e+18 tokens per micro-batch"},
      {"--micro-batch-size 1000000 --seq-length 1000000 --max-position-embeddings 1000000 --hidden-size 100000 "
       "--num-attention-heads 1",
       "their activations need at least 357.1 PiB"},
      {"--micro-batch-size 2000000000 --world-size 2", "--micro-batch-size 2000000000 x data-parallel size 2 = "
                                                      "4000000000 samples per step is more than megatrain plans for"},
  };
  for (const Case& c : cases) {
    INFO(c.flags);
    const std::string error = parse_error(model(kSmall + c.flags));
    CHECK_THAT(error, Contains(c.expected));
    CHECK(error.find('\n') == std::string::npos);
  }
}

TEST_CASE("cli: the largest sizes accepted plan without overflow", "[cli][sizes]") {
  struct Case {
    const char* what;
    std::string flags;
  };
  const std::vector<Case> cases = {
      {"the widest MLP and vocabulary (2^24)", "--hidden-size 4096 --num-attention-heads 32 --ffn-hidden-size 16777216 "
                                               "--vocab-size 16777216 --make-vocab-size-divisible-by 1"},
      {"a hidden size of 2^23", "--hidden-size 8388608 --num-attention-heads 64 --ffn-hidden-size 8388608"},
      {"a trillion-parameter model", "--num-layers 128 --hidden-size 32768 --num-attention-heads 256 "
                                     "--ffn-hidden-size 131072 --vocab-size 262144"},
      {"a long micro-batch", "--num-layers 32 --hidden-size 8192 --num-attention-heads 64 --micro-batch-size 64 "
                             "--seq-length 1048576 --max-position-embeddings 1048576"},
  };
  for (const Case& c : cases) {
    INFO(c.what);
    const Config cfg = parse(model(kSmall + c.flags));
    const Plan plan = make_plan(cfg);
    CHECK(plan.params.total > 0);
    // Every stage holds at least its parameters (4-byte floats here), so no count wrapped around.
    for (const StagePlan& s : plan.stages) {
      CHECK(s.params_per_rank > 0);
      CHECK(s.memory.total >= 4.0 * static_cast<double>(s.params_per_rank));
      CHECK(s.memory.plan.of(MemoryCategory::activations) > 0);
    }
  }
}
