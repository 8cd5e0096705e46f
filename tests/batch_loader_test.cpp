// BatchLoader: Megatron's `single` and `cyclic` sampler orders per DP rank, resume, masks, buffer
// reuse, errors.
#include <catch2/catch.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <fstream>
#include <numeric>
#include <set>

#include "core/config.h"
#include "core/error.h"
#include "data/batch_loader.h"
#include "data/cyclic_order.h"
#include "data/dataset_builder.h"
#include "data/gpt_dataset.h"
#include "data/mock_dataset.h"

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
  void document_parts(int64_t idx, std::vector<int32_t>& lengths) const override {
    // Sample i is cut from documents of 2 + i % 3 tokens and the rest (the extra token in the last).
    lengths = {2 + static_cast<int32_t>(idx % 3), seq_ + 1 - 2 - static_cast<int32_t>(idx % 3)};
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

// Every EOD-based masking of the packed documents, token 2001 (sample 2, position 1) the EOD.
static SampleMasking eod_masking() {
  SampleMasking masking;
  masking.eod_token = 2001;
  masking.reset_position_ids = true;
  masking.reset_attention_mask = true;
  masking.eod_mask_loss = true;
  return masking;
}

TEST_CASE("masks and positions reach the micro-batch", "[data][loader]") {
  auto ds = std::make_shared<NumberedDataset>(10, 6);
  BatchLoader loader(ds, options(1, 0, 1, 2, 4, eod_masking()));
  MicroBatch mb;
  REQUIRE(loader.next(mb));
  CHECK(mb.positions == std::vector<int32_t>{0, 1, 0, 1, 2, 3});
  CHECK(mb.segments == std::vector<int32_t>{0, 0, 1, 1, 1, 1});
  CHECK(mb.loss_mask == std::vector<float>{1, 0, 1, 1, 1, 1});
}

// --dataloader-inter-document-masking: the document parts, not the EOD tokens, give the segments
// and positions; the loss mask still follows the EOD tokens (--eod-mask-loss).
TEST_CASE("inter-document masking: segments and positions from the document parts", "[data][loader]") {
  auto ds = std::make_shared<NumberedDataset>(10, 6);
  SampleMasking masking = eod_masking();
  masking.inter_document_masking = true;
  BatchLoader loader(ds, options(2, 0, 1, 1, 4, masking));
  MicroBatch mb;
  REQUIRE(loader.next(mb));
  // Sample 1: parts {3, 4} of the 7-token window, the last less the extra token: 3 + 3.
  // Sample 2: parts {4, 3}: 4 + 2 (EOD at position 1 changes neither).
  CHECK(mb.positions == std::vector<int32_t>{0, 1, 2, 0, 1, 2, 0, 1, 2, 3, 0, 1});
  CHECK(mb.segments == std::vector<int32_t>{0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 1, 1});
  CHECK(mb.loss_mask == std::vector<float>{1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1});
}

// A GPTDataset's document parts are the pieces read_window assembles the window from: every part
// but the last ends its document (mock documents end with EOD) and together they fill the window.
TEST_CASE("GPTDataset document parts: the documents a window is cut from", "[data]") {
  auto mock = std::make_shared<MockLowLevelDataset>(50000, 49999);
  GPTDatasetOptions o;
  o.seq_length = 1024;
  const GPTDataset ds(mock, Split::train, IndexRange{0, 200}, 40, o);
  std::vector<int32_t> window(1025), parts;
  int cut = 0;
  for (int64_t i = 0; i < 40; ++i) {
    INFO(i);
    ds.window(i, window.data());
    ds.document_parts(i, parts);
    int32_t at = 0;
    for (size_t k = 0; k < parts.size(); ++k) {
      REQUIRE(parts[k] > 0);
      at += parts[k];
      if (k + 1 < parts.size()) CHECK(window[static_cast<size_t>(at - 1)] == 49999);
    }
    CHECK(at == 1025);
    cut += parts.size() > 1 ? 1 : 0;
  }
  CHECK(cut > 5);  // (windows that span documents were checked)
}

TEST_CASE("document_segments: Megatron's extra-token and padding rules", "[data]") {
  std::vector<int32_t> pos(8), seg(8);
  auto run = [&](std::vector<int32_t> parts, bool extra) {
    document_segments(std::move(parts), 8, extra, pos.data(), seg.data());
  };
  run({5, 4}, true);  // the last part loses the extra token
  CHECK(seg == std::vector<int32_t>{0, 0, 0, 0, 0, 1, 1, 1});
  CHECK(pos == std::vector<int32_t>{0, 1, 2, 3, 4, 0, 1, 2});
  run({8, 1}, true);  // a last part of just the extra token is dropped
  CHECK(seg == std::vector<int32_t>(8, 0));
  CHECK(pos == std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 7});
  run({2, 3}, true);  // a padded window: the shortfall joins the last document
  CHECK(seg == std::vector<int32_t>{0, 0, 1, 1, 1, 1, 1, 1});
  CHECK(pos == std::vector<int32_t>{0, 1, 0, 1, 2, 3, 4, 5});
  run({3, 5}, false);  // no extra token
  CHECK(seg == std::vector<int32_t>{0, 0, 0, 1, 1, 1, 1, 1});
  run({}, false);
  CHECK(seg == std::vector<int32_t>(8, 0));
  CHECK_THROWS(run({6, 4}, true));  // more tokens than the sequence
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
  CHECK_FALSE(o.masking.inter_document_masking);
  cfg.data.inter_document_masking = true;
  CHECK(batch_loader_options(cfg, {50257, 50256, 50256}, 1, 4, 96).masking.inter_document_masking);
  CHECK_FALSE(batch_loader_options(cfg, {50257, 50256, 50256}, 1, 4, 96).cyclic);
  cfg.data.dataloader_type = "cyclic";
  cfg.data.data_sharding = false;
  CHECK(batch_loader_options(cfg, {50257, 50256, 50256}, 1, 4, 96).cyclic);
  CHECK_FALSE(batch_loader_options(cfg, {50257, 50256, 50256}, 1, 4, 96).data_sharding);
  cfg.data.dataloader_type = "external";
  CHECK_THROWS_AS(batch_loader_options(cfg, {50257, 50256, -1}, 0, 1, 0), Unsupported);
}

// --null-tokenizer-pad-id: NullTokenizer's pad id reaches the masking (labels equal to it leave the
// loss, make_training_sample); one equal to EOD is dropped unless --allow-ambiguous-pad-tokens; other
// tokenizers take none here.
TEST_CASE("NullTokenizer's pad id and --allow-ambiguous-pad-tokens", "[data][loader]") {
  Config cfg;
  cfg.train.micro_batch_size = 1;
  cfg.data.tokenizer_type = "NullTokenizer";
  cfg.model.vocab_size = 100;
  cfg.data.eod_id = 99;
  CHECK(tokenizer_facts(cfg).pad == -1);  // Megatron-LM's default
  cfg.data.null_tokenizer_pad_id = 7;
  CHECK(tokenizer_facts(cfg).pad == 7);
  CHECK(batch_loader_options(cfg, tokenizer_facts(cfg), 0, 1, 0).masking.pad_token == 7);
  cfg.data.null_tokenizer_pad_id = 99;
  CHECK(batch_loader_options(cfg, tokenizer_facts(cfg), 0, 1, 0).masking.pad_token == -1);
  cfg.data.allow_ambiguous_pad_tokens = true;
  CHECK(batch_loader_options(cfg, tokenizer_facts(cfg), 0, 1, 0).masking.pad_token == 99);
  cfg.data.tokenizer_type = "GPT2BPETokenizer";
  CHECK(tokenizer_facts(cfg).pad == -1);
}

// --dataloader-type cyclic ------------------------------------------------------------------------

namespace {

CyclicOrderOptions cyclic_options(int64_t samples, int b, int rank, int dp, int64_t consumed, bool sharding) {
  return CyclicOrderOptions{samples, b, rank, dp, consumed, sharding};
}

std::vector<int64_t> take(CyclicOrder& order, int64_t from, int64_t count, int b) {
  std::vector<int64_t> ids(static_cast<size_t>(count * b));
  for (int64_t k = 0; k < count; ++k) order.ids(from + k, ids.data() + k * b);
  return ids;
}

}  // namespace

TEST_CASE("torch_randperm: a seeded permutation, the same for the same seed", "[data][loader][cyclic]") {
  for (int64_t n : {0, 1, 2, 17, 1000}) {
    const std::vector<int64_t> p = torch_randperm(n, 3);
    std::vector<int64_t> sorted = p;
    std::sort(sorted.begin(), sorted.end());
    std::vector<int64_t> iota(static_cast<size_t>(n));
    std::iota(iota.begin(), iota.end(), 0);
    CHECK(sorted == iota);
    CHECK(torch_randperm(n, 3) == p);
  }
  CHECK(torch_randperm(1000, 3) != torch_randperm(1000, 4));
  // Only the seed's low 32 bits reach the generator (at::mt19937 seeds with them).
  CHECK(torch_randperm(100, (uint64_t{1} << 33) + 5) == torch_randperm(100, 5));
}

TEST_CASE("cyclic order with data sharding: each rank shuffles its own bucket, one permutation per epoch",
          "[data][loader][cyclic]") {
  const int64_t samples = 103;
  const int b = 2, dp = 3;
  const int64_t bucket = samples / (b * dp) * b;  // 34: one sample is never used
  for (int r = 0; r < dp; ++r) {
    CyclicOrder order(cyclic_options(samples, b, r, dp, 0, true));
    const std::vector<int64_t> epoch0 = take(order, 0, bucket / b, b);
    const std::vector<int64_t> epoch1 = take(order, bucket / b, bucket / b, b);
    const std::vector<int64_t> p0 = torch_randperm(bucket, 0), p1 = torch_randperm(bucket, 1);
    for (int64_t j = 0; j < bucket; ++j) {
      INFO("rank " << r << " position " << j);
      CHECK(epoch0[static_cast<size_t>(j)] == r * bucket + p0[static_cast<size_t>(j)]);
      CHECK(epoch1[static_cast<size_t>(j)] == r * bucket + p1[static_cast<size_t>(j)]);
    }
    // Going back re-walks the passes from the start.
    CHECK(take(order, 0, 3, b) == std::vector<int64_t>(epoch0.begin(), epoch0.begin() + 3 * b));
  }
}

TEST_CASE("cyclic order without data sharding: ranks stride through one shuffle of the split",
          "[data][loader][cyclic]") {
  const int64_t samples = 103;
  const int b = 2, dp = 3;
  const std::vector<int64_t> p = torch_randperm(samples / b * b, 0);  // 102
  for (int r = 0; r < dp; ++r) {
    CyclicOrder order(cyclic_options(samples, b, r, dp, 0, false));
    const std::vector<int64_t> got = take(order, 0, 17, b);
    for (size_t j = 0; j < got.size(); ++j) CHECK(got[j] == p[static_cast<size_t>(r) + j * dp]);
  }
}

TEST_CASE("cyclic order: resuming from consumed samples continues the stream, epochs included",
          "[data][loader][cyclic]") {
  for (bool sharding : {true, false}) {
    for (int64_t steps : {0, 5, 16, 17, 18, 40}) {
      CyclicOrder straight(cyclic_options(103, 2, 1, 3, 0, sharding));
      CyclicOrder resumed(cyclic_options(103, 2, 1, 3, steps * 6, sharding));
      INFO("sharding " << sharding << ", resumed after " << steps << " micro-batches");
      CHECK(take(resumed, 0, 25, 2) == take(straight, steps, 25, 2));
    }
  }
}

TEST_CASE("cyclic order: splits too small and misaligned resumes are refused in one line", "[data][loader][cyclic]") {
  CHECK_THROWS_WITH(CyclicOrder(cyclic_options(7, 4, 0, 2, 0, true)),
                    Contains("--dataloader-type cyclic") && Contains("7 samples") && Contains("4 x 2"));
  CHECK_THROWS_WITH(CyclicOrder(cyclic_options(100, 2, 0, 2, 6, true)),
                    Contains("6 consumed samples") && Contains("multiple"));
}

TEST_CASE("cyclic order equals Megatron-LM's MegatronPretrainingRandomSampler and torch.randperm",
          "[data][loader][cyclic]") {
  // tests/oracles/megatron_cyclic_sampler.py wrote it with Megatron-LM's data_samplers.py; its
  // "torch" entry says where the permutations came from (torch, or a stand-in for it).
  std::ifstream in(std::string(MEGATRAIN_SOURCE_DIR) + "/tests/fixtures/megatron_cyclic_sampler.json");
  REQUIRE(in.good());
  const nlohmann::json fx = nlohmann::json::parse(in);
  for (const auto& c : fx.at("randperm")) {
    INFO("randperm n " << c.at("n") << " seed " << c.at("seed"));
    CHECK(torch_randperm(c.at("n").get<int64_t>(), c.at("seed").get<uint64_t>()) ==
          c.at("perm").get<std::vector<int64_t>>());
  }
  for (const auto& c : fx.at("cases")) {
    const int64_t samples = c.at("samples");
    const int b = c.at("micro_batch_size"), dp = c.at("data_parallel_size");
    const int64_t consumed = c.at("consumed_samples");
    const bool sharding = c.at("data_sharding");
    for (int r = 0; r < dp; ++r) {
      const auto want = c.at("ranks").at(static_cast<size_t>(r)).get<std::vector<std::vector<int64_t>>>();
      CyclicOrder order(cyclic_options(samples, b, r, dp, consumed, sharding));
      for (size_t k = 0; k < want.size(); ++k) {
        INFO("samples " << samples << " micro-batch " << b << " DP " << dp << " consumed " << consumed
                        << " sharding " << sharding << ": rank " << r << ", micro-batch " << k);
        std::vector<int64_t> got(static_cast<size_t>(b));
        order.ids(static_cast<int64_t>(k), got.data());
        CHECK(got == want[k]);
      }
    }
  }
}

TEST_CASE("a cyclic loader never runs out and reads the order's samples", "[data][loader][cyclic]") {
  auto ds = std::make_shared<NumberedDataset>(30, 3);
  BatchLoaderOptions o = options(2, 1, 2);
  o.cyclic = true;
  BatchLoader loader(ds, o);
  CyclicOrder order(cyclic_options(30, 2, 1, 2, 0, true));
  MicroBatch mb;
  for (int64_t k = 0; k < 40; ++k) {  // 7 micro-batches per epoch per rank: over five epochs
    REQUIRE(loader.next(mb));
    std::vector<int64_t> ids(2);
    order.ids(k, ids.data());
    for (int i = 0; i < 2; ++i) CHECK(mb.tokens[static_cast<size_t>(i * 3)] == ids[static_cast<size_t>(i)] * 1000);
  }
}
