// Training flags checked through the megatrain binary on the CPU: --start-eval-at-iter,
// --dataloader-inter-document-masking, --no-rope-freq and --log-device-memory-used.
#include <catch2/catch.hpp>

#include <map>
#include <string>

#include "training_binary_util.h"

using Catch::Contains;
using namespace mt_test::training_binary;

namespace {
std::map<int64_t, double> losses(const std::string& path) {
  std::map<int64_t, double> out;
  for (const auto& [it, r] : read_metrics(path).iterations) out[it] = r.at("lm_loss").get<double>();
  return out;
}
}  // namespace

// --start-eval-at-iter: no evaluation at the interval's iterations before it; the losses unchanged.
TEST_CASE("start-eval-at-iter: evaluations only from that iteration on", "[binary][eval]") {
  mt_test::TempDir dir;
  const std::string run = kGpt + " --train-iters 6 --eval-interval 2 --eval-iters 1";
  const Result late = megatrain(run + " --start-eval-at-iter 3 --metrics-jsonl " + (dir / "late.jsonl"));
  require_ok(late);
  INFO(late.out);
  CHECK_THAT(late.out, !Contains("validation loss at iteration 2 "));
  CHECK_THAT(late.out, Contains("validation loss at iteration 4 "));
  CHECK_THAT(late.out, Contains("validation loss at iteration 6 "));
  const Result all = megatrain(run + " --metrics-jsonl " + (dir / "all.jsonl"));
  require_ok(all);
  CHECK_THAT(all.out, Contains("validation loss at iteration 2 "));
  CHECK(losses(dir / "late.jsonl") == losses(dir / "all.jsonl"));
}

// --dataloader-inter-document-masking: where every mock document ends with its only EOD (a
// vocabulary of 4096 ids, documents of at most 4095 tokens), the document parts are the EOD
// segments, so the run equals --reset-attention-mask --reset-position-ids bit for bit; with 128 ids
// EOD also occurs inside documents, where only the EOD-based masking splits them. Without either,
// the losses differ.
TEST_CASE("inter-document masking: attention and positions per document part of a training run", "[binary][data]") {
  mt_test::TempDir dir;
  const std::string base = kLlama + " --seq-length 256 --max-position-embeddings 256 --train-iters 2";
  auto run = [&](const std::string& vocab, const std::string& flags, const std::string& name) {
    const Result r = megatrain(base + " --vocab-size " + vocab + " " + flags + " --metrics-jsonl " + (dir / name));
    require_ok(r);
    return losses(dir / name);
  };
  const auto parts = run("4096", "--dataloader-inter-document-masking", "a.jsonl");
  REQUIRE(parts.size() == 2);
  CHECK(parts == run("4096", "--reset-attention-mask --reset-position-ids", "b.jsonl"));
  CHECK(parts != run("4096", "", "c.jsonl"));
  CHECK(run("128", "--dataloader-inter-document-masking", "d.jsonl") !=
        run("128", "--reset-attention-mask --reset-position-ids", "e.jsonl"));
}

// --no-rope-freq: a layer it marks skips RoPE. With every layer marked the model is the one without
// position embeddings, bit for bit; marking one layer of two is neither.
TEST_CASE("NoPE layers: --no-rope-freq skips RoPE in the layers it marks", "[binary][model]") {
  mt_test::TempDir dir;
  auto run = [&](const std::string& flags, const std::string& name) {
    const Result r = megatrain(kLlama + " --train-iters 3 " + flags + " --metrics-jsonl " + (dir / name));
    require_ok(r);
    return losses(dir / name);
  };
  const auto all = run("--no-rope-freq 1", "a.jsonl");
  REQUIRE(all.size() == 3);
  CHECK(all == run("--position-embedding-type none", "b.jsonl"));
  const auto first = run("--no-rope-freq [1,0]", "c.jsonl");
  CHECK(first != all);
  CHECK(first != run("", "d.jsonl"));
}

// --log-device-memory-used: report_memory's line gains the device's memory in use.
TEST_CASE("log-device-memory-used: the memory line ends with the device's memory in use", "[binary][obs]") {
  const Result plain = megatrain(kGpt + " --train-iters 2");
  require_ok(plain);
  CHECK_THAT(plain.out, Contains("memory (MB) | allocated: ") && !Contains("total device memory used"));
  const Result used = megatrain(kGpt + " --train-iters 2 --log-device-memory-used");
  require_ok(used);
  CHECK_THAT(used.out, Contains(" | total device memory used: "));
}
