// The megatrain binary end to end on the CPU: flags through parse_config, training, Megatron's
// log line on stdout.
#include <catch2/catch.hpp>

#include "tests/skip.h"

#include <array>
#include <cstdio>
#include <regex>
#include <string>

namespace {

struct Result {
  int code = -1;
  std::string out;
};

Result run(const std::string& args) {
  const std::string cmd = std::string(MEGATRAIN_BINARY) + " " + args + " 2>&1";
  Result r;
  FILE* p = popen(cmd.c_str(), "r");
  REQUIRE(p != nullptr);
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), n);
  const int status = pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

const char* kTinyRun =
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 64 --num-layers 2 --hidden-size 32 "
    "--num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 --micro-batch-size 2 "
    "--global-batch-size 4 --lr 1e-2 --log-interval 5";

}  // namespace

TEST_CASE("megatrain --device cpu --mock-data trains 20 iterations and prints Megatron's log line", "[binary]") {
  const Result r = run(std::string("--device cpu --train-iters 20 ") + kTinyRun);
  INFO(r.out);
  REQUIRE(r.code == 0);
  const std::regex line(
      R"( \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}\] iteration       20/      20 \| consumed samples:           80 \| )"
      R"(elapsed time per iteration \(ms\): \d+\.\d \| learning rate: \d\.\d{6}E[-+]\d\d \| global batch size:     4 \| )"
      R"(lm loss: \d\.\d{6}E\+00 \| loss scale: 1\.0 \| grad norm: \d+\.\d{3} \| number of skipped iterations:   0 \| )"
      R"(number of nan iterations:   0 \|)");
  CHECK(std::regex_search(r.out, line));
}

TEST_CASE("megatrain on a machine without a usable GPU says to use --device cpu", "[binary]") {
  const Result r = run(std::string("--device gpu --train-iters 2 ") + kTinyRun);
  if (r.code == 0) {
    MT_SKIP("a GPU is visible here: the no-GPU error path cannot be exercised");
  }
  INFO(r.out);
  CHECK(r.code == 1);
  CHECK(r.out.find("--device cpu") != std::string::npos);
}

TEST_CASE("megatrain --mtp-num-layers 2 prints Megatron's mtp losses after lm loss", "[binary][mtp]") {
  const Result r = run(std::string("--device cpu --train-iters 10 --position-embedding-type rope --mtp-num-layers 2 ") +
                       kTinyRun);
  INFO(r.out);
  REQUIRE(r.code == 0);
  const std::regex line(R"(lm loss: (\d\.\d{6}E\+00) \| mtp_1 loss: (\d\.\d{6}E\+00) \| mtp_2 loss: (\d\.\d{6}E\+00) \| )"
                        R"(loss scale: 1\.0 \|)");
  std::smatch m;
  REQUIRE(std::regex_search(r.out, m, line));
  // Each depth predicts from the vocabulary of 64 tokens: its loss starts near ln 64 = 4.16 and is
  // its own (not lm loss).
  for (int k = 1; k <= 3; ++k) {
    const double v = std::stod(m[k].str());
    CHECK(v > 2.0);
    CHECK(v < 6.0);
  }
  CHECK(m[2].str() != m[1].str());
}
