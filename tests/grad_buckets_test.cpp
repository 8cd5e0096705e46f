// DP gradient bucket planning: Megatron's bucket-size rule, alignment and padding, and the map from
// each DP rank's reduce-scatter shard back to parameter pieces, for even and odd DP sizes.
#include <catch2/catch.hpp>

#include <numeric>
#include <vector>

#include "core/error.h"
#include "parallel/grad_buckets.h"

using namespace mt;

namespace {

std::vector<GradParam> make_params(const std::vector<int64_t>& sizes) {
  std::vector<GradParam> p;
  for (size_t i = 0; i < sizes.size(); ++i) p.push_back({"p" + std::to_string(i), sizes[i], false});
  return p;
}

// Every structural property a plan must have, for any DP size.
void check_plan_invariants(const GradBufferPlan& plan, const std::vector<GradParam>& params) {
  const int dp = plan.dp_size;
  const int64_t multiple = std::lcm(int64_t{dp}, int64_t{128});
  int64_t prev_end = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& pl = plan.params[i];
    CHECK(pl.numel == params[i].numel);
    CHECK(pl.offset % 64 == 0);
    CHECK(pl.offset >= prev_end);  // placed in order, no overlap
    prev_end = pl.offset + pl.numel;
    const auto& b = plan.buckets.at(pl.bucket);
    CHECK(pl.offset >= b.offset);
    CHECK(pl.offset + pl.numel <= b.offset + b.numel_unpadded);
  }
  int64_t expect_offset = 0;
  for (size_t b = 0; b < plan.buckets.size(); ++b) {
    const auto& k = plan.buckets[b];
    CHECK(k.offset == expect_offset);  // buckets tile the buffer
    CHECK(k.numel % multiple == 0);
    CHECK(k.numel >= k.numel_unpadded);
    CHECK(k.numel - k.numel_unpadded < multiple);
    expect_offset = k.offset + k.numel;
  }
  CHECK(plan.numel == expect_offset);

  // The shards of all DP ranks cover each parameter element exactly once, and each segment's
  // shard coordinates agree with its flat-buffer coordinates.
  std::vector<std::vector<int>> covered(params.size());
  for (size_t i = 0; i < params.size(); ++i) covered[i].assign(params[i].numel, 0);
  for (int b = 0; b < static_cast<int>(plan.buckets.size()); ++b) {
    CHECK(plan.shard_numel(b) * dp == plan.buckets[b].numel);
    for (int r = 0; r < dp; ++r) {
      int64_t last_shard_end = 0;
      for (const auto& s : plan.shard_segments(b, r)) {
        REQUIRE(s.numel > 0);
        CHECK(s.shard_offset >= last_shard_end);
        last_shard_end = s.shard_offset + s.numel;
        CHECK(last_shard_end <= plan.shard_numel(b));
        CHECK(plan.shard_offset(b, r) + s.shard_offset == plan.params[s.param].offset + s.param_offset);
        CHECK(plan.params[s.param].bucket == b);
        for (int64_t e = 0; e < s.numel; ++e) ++covered[s.param][s.param_offset + e];
      }
    }
  }
  for (size_t i = 0; i < params.size(); ++i)
    for (int64_t e = 0; e < params[i].numel; ++e) {
      if (covered[i][e] != 1) FAIL("param " << i << " element " << e << " covered " << covered[i][e] << " times");
    }
}

}  // namespace

TEST_CASE("Megatron's DDP bucket size rule", "[grad_buckets]") {
  CHECK(resolve_ddp_bucket_size({}, {}, true, 8, 1000) == 40000000);
  CHECK(resolve_ddp_bucket_size({}, {}, true, 64, 1000) == 64000000);  // 1M per DP rank beyond 40
  CHECK(resolve_ddp_bucket_size({}, 4, true, 8, 100000000) == 25000000);
  CHECK(resolve_ddp_bucket_size(5000, {}, true, 8, 1000) == 5000);
  CHECK(resolve_ddp_bucket_size(5000, 4, true, 8, 100) == 25);  // --ddp-num-buckets wins
  CHECK_FALSE(resolve_ddp_bucket_size(5000, {}, false, 8, 1000).has_value());  // no overlap: one bucket
  CHECK_THROWS_WITH(resolve_ddp_bucket_size(0, {}, true, 2, 10), Catch::Contains("--ddp-bucket-size"));
  CHECK_THROWS_WITH(resolve_ddp_bucket_size({}, -1, true, 2, 10), Catch::Contains("--ddp-num-buckets"));
}

TEST_CASE("a worked example with DP = 3: alignment, padding and shard segments", "[grad_buckets]") {
  const auto params = make_params({100, 200, 50});
  const auto plan = plan_grad_buffer(params, 3, std::nullopt);
  REQUIRE(plan.buckets.size() == 1);
  CHECK(plan.params[0].offset == 0);
  CHECK(plan.params[1].offset == 128);  // 100 rounded up to 64
  CHECK(plan.params[2].offset == 384);  // 328 rounded up to 64
  CHECK(plan.buckets[0].numel_unpadded == 434);
  CHECK(plan.buckets[0].numel == 768);  // lcm(3, 128) = 384; 434 -> 768
  CHECK(plan.shard_numel(0) == 256);

  auto r0 = plan.shard_segments(0, 0);
  REQUIRE(r0.size() == 2);
  CHECK((r0[0].param == 0 && r0[0].param_offset == 0 && r0[0].shard_offset == 0 && r0[0].numel == 100));
  CHECK((r0[1].param == 1 && r0[1].param_offset == 0 && r0[1].shard_offset == 128 && r0[1].numel == 128));
  auto r1 = plan.shard_segments(0, 1);
  REQUIRE(r1.size() == 2);
  CHECK((r1[0].param == 1 && r1[0].param_offset == 128 && r1[0].shard_offset == 0 && r1[0].numel == 72));
  CHECK((r1[1].param == 2 && r1[1].param_offset == 0 && r1[1].shard_offset == 128 && r1[1].numel == 50));
  CHECK(plan.shard_segments(0, 2).empty());  // rank 2's shard is all padding
  check_plan_invariants(plan, params);
}

TEST_CASE("buckets close at the bucket size, invariants hold for DP 1, 2, 3, 5, 8", "[grad_buckets]") {
  const auto params = make_params({1000, 300, 700, 64, 1, 2500, 129, 900, 33, 4000});
  for (int dp : {1, 2, 3, 5, 8}) {
    INFO("DP " << dp);
    const auto one = plan_grad_buffer(params, dp, std::nullopt);
    CHECK(one.buckets.size() == 1);
    check_plan_invariants(one, params);

    const auto many = plan_grad_buffer(params, dp, 1500);
    check_plan_invariants(many, params);
    // A bucket closes after the first parameter that brings it to >= 1500 elements.
    for (const auto& b : many.buckets) {
      const int last = b.params.back();
      const int64_t filled = many.params[last].offset + many.params[last].numel - b.offset;
      if (&b != &many.buckets.back()) CHECK(filled >= 1500);
      if (b.params.size() > 1) {
        const int before = b.params[b.params.size() - 2];
        CHECK(many.params[before].offset + many.params[before].numel - b.offset < 1500);
      }
    }
    // Buckets by index: {p0,p1,p2} reaches 1000..2047 >= 1500; {p3,p4,p5}; {p6,p7,p8,p9}.
    REQUIRE(many.buckets.size() == 3);
    CHECK(many.buckets[0].params == std::vector<int>{0, 1, 2});
    CHECK(many.buckets[1].params == std::vector<int>{3, 4, 5});
    CHECK(many.buckets[2].params == std::vector<int>{6, 7, 8, 9});
  }
}

TEST_CASE("the tied word embedding gets a bucket of its own", "[grad_buckets]") {
  auto params = make_params({500, 600, 700, 800});
  params[2].own_bucket = true;
  const auto plan = plan_grad_buffer(params, 2, std::nullopt);
  REQUIRE(plan.buckets.size() == 3);
  CHECK(plan.buckets[0].params == std::vector<int>{0, 1});
  CHECK(plan.buckets[1].params == std::vector<int>{2});
  CHECK(plan.buckets[2].params == std::vector<int>{3});
  check_plan_invariants(plan, params);
}

TEST_CASE("bad parameter sizes are refused", "[grad_buckets]") {
  CHECK_THROWS_WITH(plan_grad_buffer(make_params({10, 0}), 2, std::nullopt), Catch::Contains("'p1'"));
  CHECK(plan_grad_buffer({}, 4, std::nullopt).numel == 0);
}
