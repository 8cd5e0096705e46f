// data/numpy_random against numpy itself (tests/oracles/numpy_streams.py).
#include <catch2/catch.hpp>

#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "data/numpy_random.h"
#include "tests/python_oracle.h"

using namespace mt;
using namespace mt::numpy_random;

namespace {

std::vector<uint64_t> oracle_ints(const std::string& python, const std::string& args) {
  const std::string out = test::run_capture(test::shell_quote(python) + " " +
                                            test::shell_quote(std::string(MEGATRAIN_SOURCE_DIR) +
                                                              "/tests/oracles/numpy_streams.py") +
                                            " " + args);
  std::istringstream in(out);
  std::vector<uint64_t> v;
  std::string tok;
  while (in >> tok) v.push_back(std::stoull(tok));
  return v;
}

std::vector<double> parse_hex_doubles(const std::string& line) {
  std::istringstream in(line);
  std::vector<double> v;
  std::string tok;
  while (in >> tok) v.push_back(std::strtod(tok.c_str(), nullptr));
  return v;
}

}  // namespace

TEST_CASE("RandomState random_interval equals numpy's masked draws, 32- and 64-bit", "[data][numpy]") {
  auto python = test::python_or_skip("numpy random_interval");
  if (!python) return;
  for (uint64_t max : {1ull, 2ull, 7ull, 1000ull, 0xffffffffull, 0x100000000ull, 0x1234567890ull,
                       (1ull << 62) + 12345}) {
    const auto expected = oracle_ints(*python, "interval 1234 " + std::to_string(max) + " 200");
    REQUIRE(expected.size() == 200);
    RandomState rs(1234);
    for (size_t i = 0; i < expected.size(); ++i) {
      INFO("max " << max << " draw " << i);
      REQUIRE(rs.random_interval(max) == expected[i]);
    }
  }
}

TEST_CASE("RandomState shuffle equals numpy's, across block boundaries and consecutive shuffles",
          "[data][numpy]") {
  auto python = test::python_or_skip("numpy shuffle");
  if (!python) return;
  for (uint32_t seed : {0u, 1234u, 4294967295u}) {
    const auto expected = oracle_ints(*python, "shuffle " + std::to_string(seed) + " 1 2 17 4097 10000");
    RandomState rs(seed);
    std::vector<uint64_t> got;
    for (size_t n : {1, 2, 17, 4097, 10000}) {
      std::vector<int32_t> a(n);
      for (size_t i = 0; i < n; ++i) a[i] = static_cast<int32_t>(i);
      rs.shuffle(std::span<int32_t>(a));
      got.insert(got.end(), a.begin(), a.end());
    }
    REQUIRE(got == expected);
  }
}

TEST_CASE("SeedSequence, PCG64 and Generator.integers(int32) equal numpy's default_rng", "[data][numpy]") {
  auto python = test::python_or_skip("numpy default_rng");
  if (!python) return;
  for (uint64_t seed : {0ull, 1ull, 1234ull, 0x123456789abcull}) {
    CHECK(seed_sequence_state(seed, 8) ==
          [&] {
            auto v = oracle_ints(*python, "seedseq " + std::to_string(seed) + " 8");
            return std::vector<uint32_t>(v.begin(), v.end());
          }());
    const auto raw = oracle_ints(*python, "raw64 " + std::to_string(seed) + " 50");
    Pcg64 gen(seed);
    for (uint64_t x : raw) REQUIRE(gen.next_uint64() == x);
  }
  // MockGPTLowLevelDataset's draw: default_rng(0).integers(1, 4096, 100000, dtype=int32).
  const auto expected = oracle_ints(*python, "integers 0 1 4096 100000");
  Pcg64 gen(0);
  std::vector<int32_t> got(100000);
  integers_int32(gen, 1, 4096, got);
  REQUIRE(std::vector<uint64_t>(got.begin(), got.end()) == expected);
  // A range that forces Lemire rejections to matter (rng_excl close to 2^31).
  const auto wide = oracle_ints(*python, "integers 7 5 2147483000 2000");
  Pcg64 gen7(7);
  std::vector<int32_t> got7(2000);
  integers_int32(gen7, 5, 2147483000, got7);
  REQUIRE(std::vector<uint64_t>(got7.begin(), got7.end()) == wide);
}

TEST_CASE("pairwise_sum and normalize are bit-identical to numpy.sum and w / numpy.sum(w)", "[data][numpy]") {
  auto python = test::python_or_skip("numpy pairwise sum");
  if (!python) return;
  for (int n : {1, 2, 3, 7, 8, 9, 16, 17, 100, 128, 129, 300, 1000}) {
    const std::string out = test::run_capture(
        test::shell_quote(*python) + " " +
        test::shell_quote(std::string(MEGATRAIN_SOURCE_DIR) + "/tests/oracles/numpy_streams.py") + " sum " +
        std::to_string(n) + " " + std::to_string(n));
    std::istringstream lines(out);
    std::string l1, l2, l3;
    std::getline(lines, l1);
    std::getline(lines, l2);
    std::getline(lines, l3);
    const auto w = parse_hex_doubles(l1);
    REQUIRE(w.size() == static_cast<size_t>(n));
    INFO("n " << n);
    CHECK(pairwise_sum(w) == parse_hex_doubles(l2).at(0));
    CHECK(normalize(w) == parse_hex_doubles(l3));
  }
}
