// The real megatrain binary: exit codes, stderr text, --help/--version/--list-flags, the dry run,
// and docs/flags.md agreeing with the flag table.
#include "tests/cli_test_util.h"

#include <nlohmann/json.hpp>

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
