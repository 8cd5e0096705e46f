#include <catch2/catch.hpp>

#include <cmath>
#include <set>

#include "core/dtype.h"
#include "core/philox.h"
#include "core/shard.h"
#include "core/tensor.h"

using namespace mt;

TEST_CASE("bf16 conversion rounds to nearest even", "[core]") {
  CHECK(bf16_bits_to_float(float_to_bf16_bits(1.0f)) == 1.0f);
  // 1 + 2^-8 is exactly halfway between bf16 neighbours 1 and 1 + 2^-7: ties to even (1.0).
  CHECK(bf16_bits_to_float(float_to_bf16_bits(1.0f + 0.00390625f)) == 1.0f);
  CHECK(bf16_bits_to_float(float_to_bf16_bits(1.0f + 0.0040f)) == 1.0078125f);
  CHECK(std::isnan(bf16_bits_to_float(float_to_bf16_bits(NAN))));
}

TEST_CASE("f16 conversion round trips representable values", "[core]") {
  for (float f : {0.0f, 1.0f, -2.5f, 65504.0f, 6.103515625e-05f, 5.960464477539063e-08f}) {
    CHECK(f16_bits_to_float(float_to_f16_bits(f)) == f);
  }
  CHECK(std::isinf(f16_bits_to_float(float_to_f16_bits(70000.0f))));
}

TEST_CASE("philox normals have mean 0 and variance 1 and differ by key", "[core]") {
  double s = 0, s2 = 0;
  const int n = 200000;
  for (int i = 0; i < n; ++i) {
    const double x = normal_at(42, i);
    s += x;
    s2 += x * x;
  }
  CHECK(std::abs(s / n) < 0.01);
  CHECK(std::abs(s2 / n - 1.0) < 0.02);
  CHECK(normal_at(1, 0) != normal_at(2, 0));
  CHECK(normal_at(1, 0) == normal_at(1, 0));
}

TEST_CASE("shard index maps a TP shard of chunked rows to global elements", "[core]") {
  // Global [2 chunks x 4 rows, 3 cols]; rank 1 of 2 holds rows 2..3 of each chunk.
  ShardIndex s{8, 3, 2, 0, 2, 3, 2};
  std::set<int64_t> seen;
  for (int64_t i = 0; i < s.local_numel(); ++i) seen.insert(shard_global_index(s, i));
  CHECK(seen == std::set<int64_t>{6, 7, 8, 9, 10, 11, 18, 19, 20, 21, 22, 23});
  CHECK(shard_global_index(ShardIndex::whole(4, 5), 13) == 13);
}
