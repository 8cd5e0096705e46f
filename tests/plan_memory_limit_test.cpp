// The dry run's check of every rank's planned memory against the GPU's (--gpu-memory-gib, or the
// local GPU's when one is visible).
#include "tests/cli_test_util.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "app/plan.h"

using namespace mt;
using namespace mt::test;
using Catch::Contains;

TEST_CASE("plan: --gpu-memory-gib checks every rank's plan", "[cli][plan]") {
  const Args big = words(
      "--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 "
      "--micro-batch-size 4 --global-batch-size 16 --lr 1e-4 --train-iters 10 --mock-data --tokenizer-type "
      "NullTokenizer --vocab-size 50000 --bf16 --dry-run --pipeline-model-parallel-size 2 --world-size 4");
  const Config c = parse(big + words("--gpu-memory-gib 1"));
  REQUIRE(c.run.gpu_memory_gib);
  const Plan over = make_plan(c);
  REQUIRE(over.limit);
  CHECK(over.limit->bytes == 1073741824.0);
  CHECK(over.limit->source == "--gpu-memory-gib 1");
  CHECK(over.over_limit());
  // The rank named is the first rank of the stage with the largest plan.
  const StagePlan* peak = &over.stages.front();
  for (const StagePlan& s : over.stages)
    if (s.memory.total > peak->memory.total) peak = &s;
  CHECK(over.peak_stage().pp_rank == peak->pp_rank);
  CHECK(rank_coord(over.grid, over.peak_rank()).pp == peak->pp_rank);
  for (int r = 0; r < over.peak_rank(); ++r) CHECK(rank_coord(over.grid, r).pp != peak->pp_rank);
  const std::string err = memory_limit_error(over);
  CHECK_THAT(err, Contains(fmt::format("the plan needs {:.2f} GiB on rank {} (pipeline stage {}, the largest plan), "
                                       "more than the 1.00 GiB of --gpu-memory-gib 1: add parallelism",
                                       peak->memory.total / 1073741824.0, over.peak_rank(), peak->pp_rank)));
  CHECK_THAT(err, Contains("--recompute-granularity"));
  CHECK_THAT(err, Contains("--micro-batch-size"));
  const Plan fits = make_plan(parse(big + words("--gpu-memory-gib 1000")));
  CHECK_FALSE(fits.over_limit());
  CHECK(memory_limit_error(fits).empty());
  // The text and the JSON say which limit was checked.
  CHECK_THAT(plan_text(c, over, {}), Contains("limit: 1.00 GiB per GPU (--gpu-memory-gib 1): the peak exceeds it (rank "));
  const nlohmann::json j = plan_json(c, over, {});
  CHECK(j["memory"]["limit"]["fits"] == false);
  CHECK(j["memory"]["limit"]["bytes"] == 1073741824.0);
  // No flag and --device cpu: nothing to check against.
  CHECK_FALSE(memory_limit(parse(small_gpt() + words("--dry-run --device cpu"))));
  CHECK_THAT(parse_error(small_gpt() + words("--gpu-memory-gib 80")), Contains("--gpu-memory-gib is for --dry-run only"));
  CHECK_THAT(parse_error(small_gpt() + words("--dry-run --gpu-memory-gib 0")), Contains("--gpu-memory-gib must be > 0"));
}
