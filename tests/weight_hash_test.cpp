// --check-weight-hash-across-dp-replicas-interval (Megatron-LM's check of parameter hashes across
// the data-parallel replicas): the flag's parsing and validation, the byte hash behind it (the
// reference backend's Backend::hash_bytes; the CUDA one is tested against it in tests/gpu), and a
// one-rank run through the binary that checks before training and every N iterations without
// changing the losses. The multi-rank runs, clean and with a corrupted replica, are MPI tests
// (tests/mpi/parallel_train.cmake).
#include <catch2/catch.hpp>

#include <cstring>
#include <map>
#include <random>
#include <vector>

#include "core/byte_hash.h"
#include "engine/backend.h"
#include "tests/cli_test_util.h"
#include "training_binary_util.h"

using namespace mt;
using Catch::Contains;

TEST_CASE("cli: --check-weight-hash-across-dp-replicas-interval", "[cli][weight_hash]") {
  using namespace mt::test;
  CHECK_FALSE(parse(small_gpt()).train.check_weight_hash_across_dp_replicas_interval.has_value());
  const Config c = parse(small_gpt() + words("--check-weight-hash-across-dp-replicas-interval 5"));
  REQUIRE(c.train.check_weight_hash_across_dp_replicas_interval.has_value());
  CHECK(*c.train.check_weight_hash_across_dp_replicas_interval == 5);
  // Megatron takes the iteration modulo N (0 ends its loop with ZeroDivisionError).
  CHECK(parse_error(small_gpt() + words("--check-weight-hash-across-dp-replicas-interval 0")) ==
        "--check-weight-hash-across-dp-replicas-interval must be > 0 (got 0)");
  CHECK(parse_error(small_gpt() + words("--check-weight-hash-across-dp-replicas-interval -2")) ==
        "--check-weight-hash-across-dp-replicas-interval must be > 0 (got -2)");
  CHECK_THAT(parse_error(small_gpt() + words("--check-weight-hash-across-dp-replicas-interval x")),
             Contains("--check-weight-hash-across-dp-replicas-interval"));
}

TEST_CASE("byte hash: reference hash_bytes, any change of the bytes changes it", "[weight_hash]") {
  std::mt19937_64 gen(42);
  auto be = make_reference_backend(1);
  void* out_mem = be->allocate(8);
  const Tensor out(out_mem, DType::i64, Device::cpu, {1});
  auto op = [&](Tensor x) {
    be->hash_bytes(out, x);
    uint64_t h = 0;
    be->copy_to_host(&h, out);
    return h;
  };
  for (DType dt : {DType::f32, DType::bf16, DType::fp8_e4m3, DType::f64}) {
    const int64_t n = 37;  // not a whole number of 8-byte words in the 1- and 2-byte dtypes
    const size_t bytes = static_cast<size_t>(n) * dtype_size(dt);
    void* mem = be->allocate(bytes);
    const Tensor x(mem, dt, Device::cpu, {n});
    std::vector<unsigned char> host(bytes);
    for (auto& b : host) b = static_cast<unsigned char>(gen());
    be->copy_from_host(x, host.data());
    const uint64_t h = op(x);
    CHECK(h == byte_hash(host.data(), bytes));
    CHECK(op(x) == h);  // deterministic
    // Every single-bit flip changes the hash.
    bool all_differ = true;
    for (size_t i = 0; i < bytes; ++i)
      for (int bit = 0; bit < 8; ++bit) {
        host[i] ^= static_cast<unsigned char>(1u << bit);
        all_differ = all_differ && byte_hash(host.data(), bytes) != h;
        host[i] ^= static_cast<unsigned char>(1u << bit);
      }
    CHECK(all_differ);
    // So does the sign flip of one element (what MEGATRAIN_DEBUG_FAULT=corrupt does), through the op.
    host[bytes - 1] ^= 0x80;
    be->copy_from_host(x, host.data());
    CHECK(op(x) != h);
    // Swapping two words, or a zero byte more, changes it too.
    std::vector<unsigned char> swapped(host);
    std::swap_ranges(swapped.begin(), swapped.begin() + 8, swapped.begin() + 8);
    if (swapped != host) CHECK(byte_hash(swapped.data(), bytes) != byte_hash(host.data(), bytes));
    std::vector<unsigned char> longer(host);
    longer.push_back(0);
    CHECK(byte_hash(longer.data(), longer.size()) != byte_hash(host.data(), bytes));
    be->deallocate(mem);
  }
  // An empty tensor hashes (to the length term alone), and that value is pinned: the hash is part of
  // what ranks and backends compare, so it must not change by accident.
  CHECK(op(Tensor()) == hash_fmix64(0));
  const unsigned char abc[] = {'a', 'b', 'c'};
  CHECK(byte_hash(abc, 3) == hash_fmix64(3) + hash_fmix64(0x636261ull + kByteHashStride));
  be->deallocate(out_mem);
}

namespace {
using namespace mt_test::training_binary;

std::map<int64_t, double> jsonl_losses(const std::string& path) {
  std::map<int64_t, double> out;
  for (const auto& [it, r] : read_metrics(path).iterations) out[it] = r.at("lm_loss").get<double>();
  return out;
}
}  // namespace

// One rank (a DP group of one): the check runs before the first iteration and after every N-th,
// prints Megatron's line, and changes nothing in the training.
TEST_CASE("weight hash check: a one-rank run checks at Megatron's iterations, losses unchanged",
          "[weight_hash][binary]") {
  mt_test::TempDir dir;
  const std::string run = kGpt + " --train-iters 5 --eval-interval 2 --eval-iters 1";
  const Result plain = megatrain(run + " --metrics-jsonl " + (dir / "plain.jsonl"));
  require_ok(plain);
  const Result checked =
      megatrain(run + " --check-weight-hash-across-dp-replicas-interval 2 --metrics-jsonl " + (dir / "checked.jsonl"));
  require_ok(checked);
  INFO(checked.out);
  CHECK_THAT(checked.out, Contains(">>> Weight hashes match after 0 iterations..."));
  CHECK_THAT(checked.out, Contains(">>> Weight hashes match after 2 iterations..."));
  CHECK_THAT(checked.out, Contains(">>> Weight hashes match after 4 iterations..."));
  CHECK_THAT(plain.out, !Contains("Weight hashes"));
  for (int it : {1, 3, 5}) CHECK_THAT(checked.out, !Contains(fmt::format("match after {} iterations", it)));
  // After the evaluation of iteration 2, as Megatron orders them.
  const size_t eval = checked.out.find("validation loss at iteration 2");
  const size_t hash = checked.out.find(">>> Weight hashes match after 2 iterations");
  REQUIRE(eval != std::string::npos);
  CHECK(hash > eval);
  const auto a = jsonl_losses(dir / "plain.jsonl"), b = jsonl_losses(dir / "checked.jsonl");
  REQUIRE(a.size() == 5);
  CHECK(a == b);
}
