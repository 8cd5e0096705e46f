// --timing-log-level end to end on the CPU (one process): the exact timer names each level
// reports, in Megatron's layout and order; level 0 prints no timer block. (PP = 2 over MPI, with
// the p2p timers: tests/mpi/observability_check.cpp.)
#include <catch2/catch.hpp>

#include <array>
#include <cstdio>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

namespace {

std::string run_megatrain(const std::string& args, int* code) {
  const std::string cmd = std::string(MEGATRAIN_BINARY) + " " + args + " 2>&1";
  std::string out;
  FILE* p = popen(cmd.c_str(), "r");
  REQUIRE(p != nullptr);
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
  const int status = pclose(p);
  *code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return out;
}

const char* kTiny =
    "--device cpu --mock-data --tokenizer-type NullTokenizer --vocab-size 64 --num-layers 2 --hidden-size 32 "
    "--num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 --micro-batch-size 2 "
    "--global-batch-size 4 --lr 1e-2 --train-iters 2 --log-interval 1 --eval-iters 0";

// The timer names of each "(min, max) time across ranks (ms):" block, rows checked against
// Megatron's layout: 4 spaces, name, a space, dots up to column 48, ": (min, max)" with 2 decimals.
std::vector<std::vector<std::string>> timer_blocks(const std::string& out) {
  const std::regex row(R"(^    (\S+) (\.*): \((\d+\.\d\d), (\d+\.\d\d)\)$)");
  std::vector<std::vector<std::string>> blocks;
  std::istringstream in(out);
  std::string line;
  bool in_block = false;
  while (std::getline(in, line)) {
    if (line == "(min, max) time across ranks (ms):") {
      blocks.emplace_back();
      in_block = true;
      continue;
    }
    if (!in_block) continue;
    std::smatch m;
    if (!std::regex_match(line, m, row)) {
      INFO(line);
      CHECK(line.rfind("    ", 0) != 0);  // an indented row in another layout
      in_block = false;
      continue;
    }
    CHECK(m[1].length() + 1 + m[2].length() == 48);
    CHECK(std::stod(m[3]) == std::stod(m[4]));  // one rank: min == max
    blocks.back().push_back(m[1]);
  }
  return blocks;
}

}  // namespace

TEST_CASE("timing log levels 0, 1, 2 (binary): the timers Megatron's levels report", "[binary][timers]") {
  int code = 0;
  const std::string l0 = run_megatrain(std::string(kTiny) + " --timing-log-level 0", &code);
  REQUIRE(code == 0);
  CHECK(l0.find("time across ranks") == std::string::npos);

  const std::string l1 = run_megatrain(std::string(kTiny) + " --timing-log-level 1", &code);
  INFO(l1);
  REQUIRE(code == 0);
  const std::vector<std::string> level1 = {"forward-backward", "embedding-grads-all-reduce", "all-grads-sync",
                                           "optimizer-clip-main-grad", "optimizer-inner-step", "optimizer"};
  const auto b1 = timer_blocks(l1);
  REQUIRE(b1.size() == 2);  // after iteration 1 and 2
  for (const auto& b : b1) CHECK(b == level1);

  const std::string l2 = run_megatrain(std::string(kTiny) + " --timing-log-level 2 --log-num-zeros-in-grad", &code);
  INFO(l2);
  REQUIRE(code == 0);
  const std::vector<std::string> level2 = {"forward-backward",        "forward-compute",        "backward-compute",
                                           "batch-generator",         "embedding-grads-all-reduce", "all-grads-sync",
                                           "optimizer-clip-main-grad", "optimizer-count-zeros", "optimizer-inner-step",
                                           "optimizer"};
  const auto b2 = timer_blocks(l2);
  REQUIRE(b2.size() == 2);
  for (const auto& b : b2) CHECK(b == level2);
}

TEST_CASE("timing log options max and all (binary)", "[binary][timers]") {
  int code = 0;
  const std::string mx = run_megatrain(std::string(kTiny) + " --timing-log-level 1 --timing-log-option max", &code);
  INFO(mx);
  REQUIRE(code == 0);
  CHECK(std::regex_search(mx, std::regex(R"(max time across ranks \(ms\):\n    forward-backward \.{31}: \d+\.\d\d\n)")));
  const std::string all = run_megatrain(std::string(kTiny) + " --timing-log-level 1 --timing-log-option all", &code);
  INFO(all);
  REQUIRE(code == 0);
  CHECK(std::regex_search(all, std::regex(R"(times across ranks \(ms\):\n  forward-backward:\n     rank  0: \d+\.\d\d\n)")));
}
