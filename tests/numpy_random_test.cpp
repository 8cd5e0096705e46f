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

// Runs the oracle once for several commands (";"-separated); returns its output lines.
std::vector<std::string> oracle_lines(const std::string& python, const std::vector<std::string>& commands) {
  std::string args;
  for (const auto& c : commands) args += (args.empty() ? "" : " ';' ") + c;
  const std::string out = oracle::run_capture(oracle::shell_quote(python) + " " +
                                            oracle::shell_quote(std::string(MEGATRAIN_SOURCE_DIR) +
                                                              "/tests/oracles/numpy_streams.py") +
                                            " " + args);
  std::vector<std::string> lines;
  std::istringstream in(out);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

std::vector<uint64_t> parse_ints(const std::string& line) {
  std::istringstream in(line);
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
  auto python = oracle::python_or_skip("numpy random_interval");
  if (!python) return;
  const std::vector<uint64_t> maxima{1ull, 2ull, 7ull, 1000ull, 0xffffffffull, 0x100000000ull, 0x1234567890ull,
                                     (1ull << 62) + 12345};
  std::vector<std::string> commands;
  for (uint64_t max : maxima) commands.push_back("interval 1234 " + std::to_string(max) + " 200");
  const auto lines = oracle_lines(*python, commands);
  REQUIRE(lines.size() == maxima.size());
  for (size_t m = 0; m < maxima.size(); ++m) {
    const uint64_t max = maxima[m];
    const auto expected = parse_ints(lines[m]);
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
  auto python = oracle::python_or_skip("numpy shuffle");
  if (!python) return;
  const std::vector<uint32_t> seeds{0u, 1234u, 4294967295u};
  std::vector<std::string> commands;
  for (uint32_t seed : seeds) commands.push_back("shuffle " + std::to_string(seed) + " 1 2 17 4097 10000");
  const auto lines = oracle_lines(*python, commands);
  REQUIRE(lines.size() == seeds.size());
  for (size_t k = 0; k < seeds.size(); ++k) {
    const uint32_t seed = seeds[k];
    const auto expected = parse_ints(lines[k]);
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
  auto python = oracle::python_or_skip("numpy default_rng");
  if (!python) return;
  const std::vector<uint64_t> seeds{0ull, 1ull, 1234ull, 0x123456789abcull};
  std::vector<std::string> commands;
  for (uint64_t seed : seeds) {
    commands.push_back("seedseq " + std::to_string(seed) + " 8");
    commands.push_back("raw64 " + std::to_string(seed) + " 50");
  }
  commands.push_back("integers 0 1 4096 100000");
  commands.push_back("integers 7 5 2147483000 2000");
  const auto lines = oracle_lines(*python, commands);
  REQUIRE(lines.size() == commands.size());
  for (size_t k = 0; k < seeds.size(); ++k) {
    const auto state = parse_ints(lines[2 * k]);
    CHECK(seed_sequence_state(seeds[k], 8) == std::vector<uint32_t>(state.begin(), state.end()));
    Pcg64 gen(seeds[k]);
    for (uint64_t x : parse_ints(lines[2 * k + 1])) REQUIRE(gen.next_uint64() == x);
  }
  // MockGPTLowLevelDataset's draw: default_rng(0).integers(1, 4096, 100000, dtype=int32).
  const auto expected = parse_ints(lines[2 * seeds.size()]);
  Pcg64 gen(0);
  std::vector<int32_t> got(100000);
  integers_int32(gen, 1, 4096, got);
  REQUIRE(std::vector<uint64_t>(got.begin(), got.end()) == expected);
  // A range that forces Lemire rejections to matter (rng_excl close to 2^31).
  const auto wide = parse_ints(lines[2 * seeds.size() + 1]);
  Pcg64 gen7(7);
  std::vector<int32_t> got7(2000);
  integers_int32(gen7, 5, 2147483000, got7);
  REQUIRE(std::vector<uint64_t>(got7.begin(), got7.end()) == wide);
}

TEST_CASE("pairwise_sum and normalize are bit-identical to numpy.sum and w / numpy.sum(w)", "[data][numpy]") {
  auto python = oracle::python_or_skip("numpy pairwise sum");
  if (!python) return;
  const std::vector<int> sizes{1, 2, 3, 7, 8, 9, 16, 17, 100, 128, 129, 300, 1000};
  std::vector<std::string> commands;
  for (int n : sizes) commands.push_back("sum " + std::to_string(n) + " " + std::to_string(n));
  const auto lines = oracle_lines(*python, commands);
  REQUIRE(lines.size() == 3 * sizes.size());
  for (size_t k = 0; k < sizes.size(); ++k) {
    const int n = sizes[k];
    const std::string &l1 = lines[3 * k], &l2 = lines[3 * k + 1], &l3 = lines[3 * k + 2];
    const auto w = parse_hex_doubles(l1);
    REQUIRE(w.size() == static_cast<size_t>(n));
    INFO("n " << n);
    CHECK(pairwise_sum(w) == parse_hex_doubles(l2).at(0));
    CHECK(normalize(w) == parse_hex_doubles(l3));
  }
}

TEST_CASE("RandomState binomial equals numpy's legacy binomial (it draws for p = 0 too)", "[data][numpy]") {
  auto python = oracle::python_or_skip("numpy binomial");
  if (!python) return;
  const std::vector<double> ps{0.5, 0.0, 1.0, 0.1, 0.9, 0.25, 0.75, 0.3};
  std::string p_args;
  for (double p : ps) p_args += " " + std::to_string(p);
  const auto lines = oracle_lines(*python, {"binomial 1234 1 5000" + p_args, "binomial 7 3 2000" + p_args});
  REQUIRE(lines.size() == 2);
  const int64_t ns[2] = {1, 3};
  const uint32_t seeds[2] = {1234, 7};
  for (int k = 0; k < 2; ++k) {
    const auto expected = parse_ints(lines[k]);
    REQUIRE(expected.size() == (k == 0 ? 5001u : 2001u));
    RandomState rs(seeds[k]);
    int64_t ones = 0;
    for (size_t i = 0; i + 1 < expected.size(); ++i) {
      INFO("n " << ns[k] << " draw " << i << " p " << ps[i % ps.size()]);
      const int64_t x = rs.binomial(ns[k], std::stod(std::to_string(ps[i % ps.size()])));
      REQUIRE(x == static_cast<int64_t>(expected[i]));
      ones += x;
    }
    CHECK(ones > 0);
    CHECK(rs.random_interval(0x7fffffff) == expected.back());  // randint(0, 2**31): same stream position
  }
  RandomState rs(1);
  CHECK_THROWS(rs.binomial(1, 1.5));
  CHECK_THROWS(rs.binomial(1, -0.1));
}
