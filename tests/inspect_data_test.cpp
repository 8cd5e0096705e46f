// `megatrain inspect-data` end to end: training flags -> sample counts -> datasets -> windows,
// against the Megatron oracle.
#include <catch2/catch.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <random>
#include <sstream>

#include "data/indexed_dataset.h"
#include "tests/python_oracle.h"

using namespace mt;
using nlohmann::json;

namespace {

void make_dataset(const std::string& prefix, int docs, int max_len, uint32_t seed, TokenDType dtype) {
  std::mt19937 gen(seed);
  IndexedDatasetBuilder b(prefix, dtype);
  std::vector<int32_t> tokens;
  for (int d = 0; d < docs; ++d) {
    tokens.resize(1 + gen() % static_cast<uint32_t>(max_len));
    for (auto& t : tokens) t = static_cast<int32_t>(gen() % 999);
    tokens.back() = 999;  // EOD of NullTokenizer --vocab-size 1000
    b.add_document(tokens);
  }
  b.finalize();
}

std::vector<std::vector<int32_t>> parse_lines(const std::string& out) {
  std::vector<std::vector<int32_t>> windows;
  std::istringstream in(out);
  int64_t expected_index = 0;
  for (std::string line; std::getline(in, line);) {
    const json j = json::parse(line);
    REQUIRE(j["index"].get<int64_t>() == expected_index++);
    windows.push_back(j["tokens"].get<std::vector<int32_t>>());
  }
  return windows;
}

}  // namespace

TEST_CASE("inspect-data prints the windows training reads, for every split", "[data][inspect]") {
  auto python = oracle::python_or_skip("inspect-data oracle");
  if (!python) return;
  oracle::TempDir dir;
  const std::string a = dir.file("a"), b = dir.file("b");
  make_dataset(a, 150, 80, 1, TokenDType::uint16);
  make_dataset(b, 60, 200, 2, TokenDType::int32);

  // 20 iterations x 8 = 160 training samples; validation (20 // 10 + 1) x 3 x 8 = 72; test 3 x 8.
  const std::string flags = fmt::format(
      "--data-path 0.7 {} 0.3 {} --split 80,15,5 --tokenizer-type NullTokenizer --vocab-size 1000 --seq-length 32 "
      "--train-iters 20 --global-batch-size 8 --micro-batch-size 2 --eval-interval 10 --eval-iters 3 --seed 77 "
      "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --max-position-embeddings 32",
      a, b);
  json spec = {{"data_path", {"0.7", a, "0.3", b}}, {"split", "80,15,5"}, {"sizes", {160, 72, 24}},
               {"seq_length", 32},        {"seed", 77},            {"windows", 100}};
  std::ofstream(dir.file("spec.json")) << spec.dump();
  const json expected = json::parse(oracle::run_capture(
      oracle::shell_quote(*python) + " " +
      oracle::shell_quote(std::string(MEGATRAIN_SOURCE_DIR) + "/tests/oracles/megatron_gpt_indices.py") + " " +
      oracle::shell_quote(dir.file("spec.json"))));

  for (const char* split : {"train", "valid", "test"}) {
    INFO("split " << split);
    const std::string out = oracle::run_capture(std::string(MEGATRAIN_BINARY) + " inspect-data " + flags +
                                              " --num-samples 100 --split-name " + split + " 2> " +
                                              oracle::shell_quote(dir.file("stats.txt")));
    const auto windows = parse_lines(out);
    const auto& e = expected[split]["windows"];
    REQUIRE(windows.size() == e.size());  // min(100, split size)
    for (size_t k = 0; k < windows.size(); ++k) {
      INFO("sample " << k);
      REQUIRE(windows[k] == e[k].get<std::vector<int32_t>>());
    }
  }
  std::ifstream stats(dir.file("stats.txt"));
  const std::string text((std::istreambuf_iterator<char>(stats)), {});
  CHECK(text.find("train: 160 samples of 33 tokens (requested 160)") != std::string::npos);
  CHECK(text.find("valid: 73 samples of 33 tokens (requested 72)") != std::string::npos);  // 51 + 22

  // Its own flags are checked.
  CHECK_THROWS(oracle::run_capture(std::string(MEGATRAIN_BINARY) + " inspect-data " + flags + " 2>/dev/null"));
  CHECK_THROWS(oracle::run_capture(std::string(MEGATRAIN_BINARY) + " inspect-data " + flags +
                                 " --num-samples 1 --split-name dev 2>/dev/null"));
}

TEST_CASE("inspect-data with --mock-data equals Megatron's mock stream", "[data][inspect][mock]") {
  auto python = oracle::python_or_skip("inspect-data mock oracle");
  if (!python) return;
  oracle::TempDir dir;
  // 30 x 16 = 480 train samples; validation (30 // 10 + 1) x 2 x 16 = 128; test 2 x 16 = 32.
  const std::string flags =
      "--mock-data --tokenizer-type NullTokenizer --vocab-size 1000 --seq-length 256 --train-iters 30 "
      "--global-batch-size 16 --eval-interval 10 --eval-iters 2 --seed 5";
  json spec = {{"mock", {{"vocab_size", 1000}, {"eod", 999}}}, {"sizes", {480, 128, 32}}, {"seq_length", 256},
               {"seed", 5}, {"windows", 40}};
  std::ofstream(dir.file("spec.json")) << spec.dump();
  const json expected = json::parse(oracle::run_capture(
      oracle::shell_quote(*python) + " " +
      oracle::shell_quote(std::string(MEGATRAIN_SOURCE_DIR) + "/tests/oracles/megatron_gpt_indices.py") + " " +
      oracle::shell_quote(dir.file("spec.json"))));
  for (const char* split : {"train", "valid"}) {
    INFO("split " << split);
    const auto windows = parse_lines(oracle::run_capture(std::string(MEGATRAIN_BINARY) + " inspect-data " + flags +
                                                         " --num-samples 40 --split-name " + split + " 2>/dev/null"));
    const auto& e = expected[split]["windows"];
    REQUIRE(windows.size() == e.size());
    for (size_t k = 0; k < windows.size(); ++k) REQUIRE(windows[k] == e[k].get<std::vector<int32_t>>());
  }
}
