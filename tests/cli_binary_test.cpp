// The real megatrain binary: exit codes, stderr text, --help/--version/--list-flags, the dry run,
// and docs/flags.md agreeing with the flag table.
#include "tests/cli_test_util.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>

#include "app/cli.h"

using namespace mt;
using namespace mt::test;
using Catch::Contains;

TEST_CASE("binary: --version and --help", "[cli][binary]") {
  const RunResult v = run_binary({"--version"});
  CHECK(v.exit_code == 0);
  CHECK_THAT(v.out, Contains("megatrain "));
  const RunResult h = run_binary({"--help"});
  CHECK(h.exit_code == 0);
  for (const char* group : {"\nmodel:", "\nparallelism:", "\ntraining:", "\nmixed precision:", "\ndata:",
                            "\ncheckpointing:", "\nlogging:", "\nrecompute:", "\nregularization:", "\ndistributed:",
                            "\nmegatrain-specific:", "subcommands:"})
    CHECK_THAT(h.out, Contains(group));
  CHECK_THAT(h.out, Contains("--dry-run"));
  CHECK(run_binary({"--num-layers", "2", "-h"}).exit_code == 0);
}

TEST_CASE("binary: errors are one line prefixed with the rank, exit code 1", "[cli][binary]") {
  const RunResult r = run_binary(small_gpt() + words("--num-layer 3 --dry-run"));
  CHECK(r.exit_code == 1);
  CHECK(r.err == "[rank 0] error: unrecognized argument --num-layer (did you mean --num-layers?)\n");
  const RunResult u = run_binary(small_gpt() + words("--fp8-format e4m3 --fp8-recipe mxfp8 --dry-run"));
  CHECK(u.exit_code == 1);
  CHECK_THAT(u.err, Contains("[rank 0] error: megatrain does not support --fp8-recipe mxfp8 yet"));
  // The rank comes from the launcher's environment.
  const RunResult ranked = run_binary(small_gpt() + words("--hidden-size 66"), "RANK=3 WORLD_SIZE=4");
  CHECK(ranked.exit_code == 1);
  CHECK_THAT(ranked.err, Contains("[rank 3] error: --hidden-size 66 is not divisible by --num-attention-heads 4"));
  const RunResult sub = run_binary({"frobnicate"});
  CHECK(sub.exit_code == 1);
  CHECK_THAT(sub.err, Contains("unknown subcommand 'frobnicate'"));
}

TEST_CASE("binary: a valid command line trains on the CPU reference backend and exits 0", "[cli][binary]") {
  // (Before the engine existed this was refused; now the same flags train.)
  const RunResult r = run_binary(small_gpt() + words("--device cpu --eval-iters 0"));
  CHECK(r.exit_code == 0);
  CHECK_THAT(r.out, Contains("iteration        1/      10"));  // the first iteration's line (--log-interval 100)
}

TEST_CASE("binary: --dry-run prints the plan, --json prints one JSON object", "[cli][binary]") {
  const RunResult t = run_binary(small_gpt() + words("--dry-run --world-size 2 --use-mcore-models"));
  CHECK(t.exit_code == 0);
  CHECK_THAT(t.out, Contains("== rank layout"));
  CHECK_THAT(t.out, Contains("== memory per GPU"));
  CHECK_THAT(t.out, Contains(" > padded vocab (size: 1000) with 24 dummy tokens (new size: 1024)"));
  CHECK(t.err == "[rank 0] note: --use-mcore-models has no effect in megatrain: megatrain builds Megatron-Core-style "
                 "models only\n");
  const RunResult j = run_binary(small_gpt() + words("--dry-run --world-size 2 --json"));
  CHECK(j.exit_code == 0);
  const nlohmann::json plan = nlohmann::json::parse(j.out);
  CHECK(plan["derived"]["data_parallel_size"] == 2);
  CHECK(plan["parameters"]["total"] == 167680);
  CHECK(plan["rank_grid"]["ranks"].size() == 2);
}

TEST_CASE("binary: docs/flags.md is what --list-flags prints", "[cli][binary]") {
  const RunResult r = run_binary({"--list-flags"});
  CHECK(r.exit_code == 0);
  CHECK(r.out == flags_markdown());
  std::ifstream in(std::string(MEGATRAIN_SOURCE_DIR) + "/docs/flags.md");
  REQUIRE(in.good());
  std::stringstream doc;
  doc << in.rdbuf();
  // If this fails: build/app/megatrain --list-flags > docs/flags.md
  CHECK(doc.str() == r.out);
}

TEST_CASE("binary: sizes that cannot fit anywhere are refused at once, naming the flag", "[cli][binary]") {
  const std::string model =
      "--hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 --micro-batch-size 1 "
      "--lr 1e-3 --train-iters 10 --mock-data --tokenizer-type NullTokenizer --vocab-size 1000 ";
  struct Case {
    std::string flags, flag;
  };
  const std::vector<Case> cases = {
      {"--num-layers 1000000 --dry-run", "--num-layers 1000000"},
      {"--num-layers 1000000 --device cpu", "--num-layers 1000000"},
      {"--num-layers 2 --global-batch-size 2000000000 --dry-run", "--global-batch-size 2000000000"},
      {"--num-layers 2 --global-batch-size 2000000000 --device cpu", "--global-batch-size 2000000000"},
  };
  for (const Case& c : cases) {
    INFO(c.flags);
    const auto start = std::chrono::steady_clock::now();
    const RunResult r = run_binary(words(model + c.flags));
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    CHECK(r.exit_code == 1);
    CHECK_THAT(r.err, Contains("[rank 0] error: " + c.flag));
    CHECK_THAT(r.err, !Contains("bad_alloc") && !Contains("internal error"));
    CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
    CHECK(secs < 5.0);
  }
  // The largest accepted sizes still plan at once.
  const RunResult ok = run_binary(words(model + "--num-layers 4096 --global-batch-size 1048576 --dry-run"));
  CHECK(ok.exit_code == 0);
}
