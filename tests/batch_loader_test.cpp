// BatchLoader: Megatron's `single` sampler order per DP rank, resume, masks, buffer reuse, errors.
#include <catch2/catch.hpp>

#include <atomic>
#include <set>

#include "core/config.h"
#include "core/error.h"
#include "data/batch_loader.h"

using namespace mt;
using Catch::Matchers::Contains;

namespace {

// Windows that say which sample they are: token t of sample i is i * 1000 + t; sample `bad`
// throws (a corrupt file, say).
class NumberedDataset : public SampleDataset {
 public:
  NumberedDataset(int64_t size, int seq, int64_t bad = -1) : size_(size), seq_(seq), bad_(bad) {}
  int64_t size() const override { return size_; }
  int window_length() const override { return seq_ + 1; }
  void window(int64_t idx, int32_t* out) const override {
    reads++;
    if (idx == bad_) fail("corrupt.bin: sample {} is unreadable", idx);
    for (int t = 0; t <= seq_; ++t) out[t] = static_cast<int32_t>(idx * 1000 + t);
  }
  std::string describe() const override { return "numbered"; }
  std::string cache_key() const override { return "numbered"; }
  mutable std::atomic<int64_t> reads{0};

 private:
  int64_t size_;
  int seq_;
  int64_t bad_;
};

BatchLoaderOptions options(int b, int rank = 0, int dp = 1, int64_t consumed = 0, int prefetch = 4,
                           SampleMasking masking = {}) {
  BatchLoaderOptions o;
  o.micro_batch_size = b;
  o.data_parallel_rank = rank;
  o.data_parallel_size = dp;
  o.consumed_samples = consumed;
  o.prefetch = prefetch;
  o.masking = masking;
  return o;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST_CASE("each DP rank gets rows r*b to (r+1)*b - 1 of every chunk of b*DP samples from consumed_samples",
          "[data][loader]") {
  const int64_t total = 103, consumed = 5;
  const int b = 2, dp = 3, seq = 4;
  auto ds = std::make_shared<NumberedDataset>(total, seq);
  std::set<int64_t> seen;
  for (int r = 0; r < dp; ++r) {
    BatchLoader loader(ds, options(b, r, dp, consumed));
    CHECK(loader.num_micro_batches() == (total - consumed) / (b * dp));
    MicroBatch mb;
    int64_t k = 0;
    while (loader.next(mb)) {
      REQUIRE(mb.batch == b);
      REQUIRE(mb.seq == seq);
      for (int i = 0; i < b; ++i) {
        const int64_t id = consumed + k * b * dp + r * b + i;
        INFO("rank " << r << " micro-batch " << k << " row " << i);
        CHECK(mb.tokens[static_cast<size_t>(i * seq)] == id * 1000);
        CHECK(mb.labels[static_cast<size_t>(i * seq + seq - 1)] == id * 1000 + seq);
        CHECK(seen.insert(id).second);
      }
      ++k;
    }
    CHECK(k == loader.num_micro_batches());
    CHECK_FALSE(loader.next(mb));  // stays exhausted
  }
  // Together the ranks consume every sample of the full chunks exactly once.
  CHECK(seen.size() == static_cast<size_t>((total - consumed) / (b * dp) * b * dp));
  CHECK(*seen.begin() == consumed);
}

TEST_CASE("resuming from consumed_samples continues the same stream", "[data][loader]") {
  auto ds = std::make_shared<NumberedDataset>(200, 3);
  BatchLoader from_start(ds, options(4, 1, 2));
  MicroBatch a, b;
  for (int k = 0; k < 7; ++k) REQUIRE(from_start.next(a));
  REQUIRE(from_start.next(a));  // the 8th micro-batch
  BatchLoader resumed(ds, options(4, 1, 2, 7 * 4 * 2));
  REQUIRE(resumed.next(b));
  CHECK(a.tokens == b.tokens);
  CHECK(a.labels == b.labels);
}

TEST_CASE("only this rank's samples are read, into buffers reused after start-up", "[data][loader]") {
  auto ds = std::make_shared<NumberedDataset>(400, 8);
  std::set<const int32_t*> buffers;
  {
    BatchLoader loader(ds, options(2, 0, 4, 0, 3));
    MicroBatch mb;
    int n = 0;
    while (loader.next(mb)) {
      if (++n > 10) buffers.insert(mb.tokens.data());
    }
    CHECK(n == 50);
  }
  CHECK(ds->reads == 50 * 2);
  CHECK(buffers.size() <= 4);  // the prefetch slots plus the consumer's own buffer
}

TEST_CASE("masks and positions reach the micro-batch", "[data][loader]") {
  auto ds = std::make_shared<NumberedDataset>(10, 6);
  // Token 2001 (sample 2, position 1) is EOD.
  SampleMasking masking;
  masking.eod_token = 2001;
  masking.reset_position_ids = true;
  masking.reset_attention_mask = true;
  masking.eod_mask_loss = true;
  BatchLoader loader(ds, options(1, 0, 1, 2, 4, masking));
  MicroBatch mb;
  REQUIRE(loader.next(mb));
  CHECK(mb.positions == std::vector<int32_t>{0, 1, 0, 1, 2, 3});
  CHECK(mb.segments == std::vector<int32_t>{0, 0, 1, 1, 1, 1});
  CHECK(mb.loss_mask == std::vector<float>{1, 0, 1, 1, 1, 1});
}

TEST_CASE("loader errors reach the consumer and shutdown never hangs", "[data][loader]") {
  auto bad = std::make_shared<NumberedDataset>(100, 4, /*bad=*/21);
  {
    BatchLoader loader(bad, options(2));
    MicroBatch mb;
    for (int k = 0; k < 10; ++k) REQUIRE(loader.next(mb));  // samples 0..19
    CHECK_THAT(error_of([&] { loader.next(mb); }), Contains("corrupt.bin") && Contains("sample 21"));
  }
  {
    // Destroyed with the producer blocked on a full queue.
    BatchLoader loader(std::make_shared<NumberedDataset>(1000, 4), options(1, 0, 1, 0, 2));
    MicroBatch mb;
    REQUIRE(loader.next(mb));
  }
  auto small = std::make_shared<NumberedDataset>(10, 4);
  CHECK_THAT(error_of([&] { BatchLoader(small, options(1, 0, 1, 10)); }),
             Contains("no samples left") && Contains("10 samples were consumed"));
  CHECK_THAT(error_of([&] { BatchLoader(small, options(1, 2, 2)); }),
             Contains("rank 2 of 2"));
  BatchLoader too_few(small, options(4, 0, 2, 3));
  MicroBatch mb;
  CHECK_FALSE(too_few.next(mb));  // 7 samples left, a chunk needs 8
}

TEST_CASE("loader options from the run's flags", "[data][loader]") {
  Config cfg;
  cfg.train.micro_batch_size = 3;
  cfg.data.eod_mask_loss = true;
  cfg.data.reset_position_ids = true;
  const BatchLoaderOptions o = batch_loader_options(cfg, {50257, 50256, 50256}, 1, 4, 96);
  CHECK(o.micro_batch_size == 3);
  CHECK(o.data_parallel_rank == 1);
  CHECK(o.data_parallel_size == 4);
  CHECK(o.consumed_samples == 96);
  CHECK(o.masking.eod_token == 50256);
  CHECK(o.masking.pad_token == -1);  // a pad id equal to EOD is dropped
  CHECK(o.masking.eod_mask_loss);
  CHECK(o.masking.reset_position_ids);
  CHECK_FALSE(o.masking.reset_attention_mask);
  cfg.data.dataloader_type = "cyclic";
  CHECK_THROWS_AS(batch_loader_options(cfg, {50257, 50256, -1}, 0, 1, 0), Unsupported);
}
