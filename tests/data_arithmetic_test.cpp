// Split, blending, sample-count and masking arithmetic; error messages for bad data flags.
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>

#include "core/config.h"
#include "core/error.h"
#include "data/blended_dataset.h"
#include "data/dataset_builder.h"
#include "data/indexed_dataset.h"
#include "data/split.h"
#include "tests/python_oracle.h"

using namespace mt;
using Catch::Matchers::Contains;

namespace {

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

void make_uniform_dataset(const std::string& prefix, int docs, int length, int first_token = 1) {
  IndexedDatasetBuilder b(prefix, TokenDType::uint16);
  std::vector<int32_t> tokens(static_cast<size_t>(length));
  for (int d = 0; d < docs; ++d) {
    for (int i = 0; i < length; ++i) tokens[static_cast<size_t>(i)] = first_token + (d * length + i) % 1000;
    b.add_document(tokens);
  }
  b.finalize();
}

// A SampleDataset of a given size whose windows say which sample they are.
class CountingDataset : public SampleDataset {
 public:
  CountingDataset(std::string name, int64_t size) : name_(std::move(name)), size_(size) {}
  int64_t size() const override { return size_; }
  int window_length() const override { return 3; }
  void window(int64_t idx, int32_t* out) const override { out[0] = out[1] = out[2] = static_cast<int32_t>(idx); }
  std::string describe() const override { return name_; }
  std::string cache_key() const override { return name_; }

 private:
  std::string name_;
  int64_t size_;
};

}  // namespace

TEST_CASE("split flag parsing follows Megatron's regex, padding and normalisation", "[data][split]") {
  CHECK(parse_split("969, 30, 1") == std::array<double, 3>{0.969, 0.03, 0.001});
  CHECK(parse_split("'99,1,0'") == std::array<double, 3>{0.99, 0.01, 0.0});
  CHECK(parse_split("\"1\"") == std::array<double, 3>{1.0, 0.0, 0.0});
  CHECK(parse_split("2 2") == std::array<double, 3>{0.5, 0.5, 0.0});
  CHECK(parse_split(".5/.25/.25") == std::array<double, 3>{0.5, 0.25, 0.25});
  const SplitMatrix m = split_matrix(parse_split("'99,1,0'"));
  REQUIRE(m[0]);
  CHECK(*m[0] == std::make_pair(0.0, 0.99));
  REQUIRE(m[1]);
  CHECK(m[1]->second == 0.99 + 0.01);
  CHECK_FALSE(m[2]);
  CHECK_THAT(error_of([] { parse_split("none"); }), Contains("--split 'none'") && Contains("no numbers"));
  CHECK_THAT(error_of([] { parse_split("1.2.3,1"); }), Contains("'1.2.3' is not a number"));
  CHECK_THAT(error_of([] { parse_split("1,2,3,4"); }), Contains("4 numbers"));
  CHECK_THAT(error_of([] { parse_split("0,0,0"); }), Contains("sum to 0"));
}

TEST_CASE("split ranges round halves to even, like Python's round", "[data][split]") {
  const SplitMatrix half = split_matrix(parse_split("1,1"));
  CHECK(split_range(*half[0], 5) == IndexRange{0, 2});  // round(2.5) = 2, std::round would say 3
  CHECK(split_range(*half[1], 5) == IndexRange{2, 5});
  CHECK(split_range(*half[0], 7) == IndexRange{0, 4});  // round(3.5) = 4
  CHECK(split_range(*half[0], 9) == IndexRange{0, 4});  // round(4.5) = 4
}

TEST_CASE("split ranges equal the Python oracle's for many splits and sizes", "[data][split]") {
  auto python = oracle::python_or_skip("split ranges oracle");
  if (!python) return;
  oracle::TempDir dir;
  std::vector<int64_t> elements;
  for (int64_t e = 0; e <= 64; ++e) elements.push_back(e);
  for (int64_t e : {97, 100, 999, 1000, 1001, 12345, 1000003, 123456789}) elements.push_back(e);
  const std::vector<std::string> splits{"969, 30, 1", "949,50,1", "98,2,0", "1,1,1", "1,1", "1", "0.9,0.05,0.05",
                                        "7,2,1", "3,3,3", "99.5,0.25,0.25", "0,1,0", "'1 , 0 , 1'"};
  nlohmann::json spec = {{"split_ranges", {{"splits", splits}, {"elements", elements}}}};
  const std::string path = dir.file("spec.json");
  std::ofstream(path) << spec.dump();
  const auto all = nlohmann::json::parse(oracle::run_capture(
      oracle::shell_quote(*python) + " " +
      oracle::shell_quote(std::string(MEGATRAIN_SOURCE_DIR) + "/tests/oracles/megatron_gpt_indices.py") + " " +
      oracle::shell_quote(path)));
  for (size_t s = 0; s < splits.size(); ++s) {
    const std::string& split = splits[s];
    const auto& out = all["ranges"][s];
    const SplitMatrix m = split_matrix(parse_split(split));
    for (size_t k = 0; k < elements.size(); ++k) {
      for (int i = 0; i < 3; ++i) {
        INFO("split '" << split << "' elements " << elements[k] << " split " << i);
        const auto& expected = out[k][i];
        REQUIRE(expected.is_null() == !m[i]);
        if (!m[i]) continue;
        const IndexRange r = split_range(*m[i], elements[k]);
        CHECK(r.begin == expected[0].get<int64_t>());
        CHECK(r.end == expected[1].get<int64_t>());
      }
    }
  }
}

TEST_CASE("blending indices: greedy deficit with the first index winning ties, and exhaustive blending", "[data][blend]") {
  std::vector<int16_t> index;
  std::vector<int64_t> sample;
  build_blending_indices({0.5, 0.5}, 4, index, sample);
  CHECK(index == std::vector<int16_t>{0, 1, 0, 1});
  CHECK(sample == std::vector<int64_t>{0, 0, 1, 1});
  build_blending_indices({0.2, 0.8}, 5, index, sample);
  CHECK(index == std::vector<int16_t>{1, 0, 1, 1, 1});
  CHECK(sample == std::vector<int64_t>{0, 0, 1, 2, 3});
  build_exhaustive_blending_indices({1, 3}, index, sample);
  CHECK(index == std::vector<int16_t>{1, 0, 1, 1});
  CHECK(sample == std::vector<int64_t>{0, 0, 1, 2});
  // Large blends keep each dataset's share within one sample of its weight.
  build_blending_indices({0.999, 0.001}, 100000, index, sample);
  CHECK(std::count(index.begin(), index.end(), 1) == 100);
}

TEST_CASE("a blend that oversamples a dataset names it and the flag to change", "[data][blend]") {
  std::vector<std::shared_ptr<const SampleDataset>> parts{std::make_shared<CountingDataset>("big.bin", 100),
                                                          std::make_shared<CountingDataset>("small.bin", 2)};
  CHECK_THAT(error_of([&] { BlendedDataset(parts, {0.5, 0.5}, 10, Split::train, 0.005); }),
             Contains("small.bin") && Contains("5 samples") && Contains("only 2") &&
                 Contains("--mid-level-dataset-surplus"));
  CHECK_THAT(error_of([&] { BlendedDataset(parts, {1.0, 0.0}, 10, Split::train, 0.005); }),
             Contains("small.bin") && Contains("weight 0"));
  const BlendedDataset ok(parts, {0.9, 0.1}, 10, Split::valid, 0.005);
  CHECK(ok.size() == 10);
  int32_t w[3];
  ok.window(1, w);  // t = 1: the second dataset's deficit 0.1 beats the first's 0.9 - 1
  CHECK(w[0] == 0);
  CHECK(ok.dataset_index()[1] == 1);
}

TEST_CASE("data-path lists: weights, prefixes, and bad weights", "[data][blend]") {
  auto b = parse_blend({"0.3", "a", "0.7", " b "}, "--data-path");
  REQUIRE(b);
  CHECK(b->prefixes == std::vector<std::string>{"a", "b"});
  CHECK(*b->weights == std::vector<double>{0.3, 0.7});
  b = parse_blend({"a", "b", "c"}, "--data-path");
  CHECK(b->prefixes.size() == 3);
  CHECK_FALSE(b->weights);
  b = parse_blend({"0.3", "a", "b", "c"}, "--data-path");  // 'b' is no weight: all prefixes
  CHECK(b->prefixes == std::vector<std::string>{"0.3", "a", "b", "c"});
  CHECK_FALSE(parse_blend({}, "--data-path"));
  CHECK_THAT(error_of([] { parse_blend({"a", "p1", "0.5", "p2"}, "--data-path"); }),
             Contains("--data-path") && Contains("'0.5' is a weight"));
  CHECK_THAT(error_of([] { parse_blend({"0", "a", "1", "b"}, "--train-data-path"); }),
             Contains("--train-data-path") && Contains("'a'") && Contains("positive"));
  CHECK_THAT(error_of([] { parse_blend({"-1", "a", "1", "b"}, "--data-path"); }), Contains("'a'"));
  CHECK_THAT(error_of([] { parse_blend({"nan", "a", "1", "b"}, "--data-path"); }), Contains("'a'"));
}

TEST_CASE("blend sizes: ceil(ceil(N w)(1 + surplus)) per component, sum of ceil(N w) for the blend",
          "[data][blend]") {
  oracle::TempDir dir;
  make_uniform_dataset(dir.file("a"), 50, 40);
  make_uniform_dataset(dir.file("b"), 50, 40);
  make_uniform_dataset(dir.file("c"), 50, 40);
  DatasetsConfig c;
  c.seq_length = 16;
  c.data_cache_path = dir.file("cache");
  c.split = "1,0,0";
  c.blend = parse_blend({"0.3", dir.file("a"), "0.7", dir.file("b")}, "--data-path");
  BuiltDatasets built = build_datasets(c, {1000, 0, 0});
  REQUIRE(built.components.size() == 2);
  CHECK(built.components[0]->num_samples() == 302);  // ceil(300 * 1.005) = ceil(301.5)
  CHECK(built.components[1]->num_samples() == 704);  // ceil(700 * 1.005) = ceil(703.5)
  CHECK(built.splits[0]->size() == 1000);
  CHECK_FALSE(built.splits[1]);
  c.blend = parse_blend({"1", dir.file("a"), "1", dir.file("b"), "1", dir.file("c")}, "--data-path");
  built = build_datasets(c, {10, 0, 0});
  CHECK(built.splits[0]->size() == 12);  // 3 x ceil(10 / 3)
  CHECK(built.components[0]->num_samples() == 5);  // ceil(4 * 1.005)
}

TEST_CASE("empty or too small splits: harmless when unused, a clear error when sampled", "[data][gpt]") {
  oracle::TempDir dir;
  make_uniform_dataset(dir.file("small"), 10, 20);
  DatasetsConfig c;
  c.seq_length = 8;
  c.data_cache_path = dir.file("cache");
  c.split = "98,1,1";  // 10 sequences: valid and test get none
  c.blend = parse_blend({dir.file("small")}, "--data-path");
  const BuiltDatasets built = build_datasets(c, {20, 0, 0});
  CHECK(built.splits[0]->size() >= 20);
  CHECK(built.splits[1]->size() == 0);
  CHECK_THAT(error_of([&] { build_datasets(c, {20, 5, 0}); }),
             Contains("small") && Contains("valid split") && Contains("holds 0 tokens") && Contains("--split"));
  c.seq_length = 1;
  CHECK_THAT(error_of([&] { build_datasets(c, {20, 0, 0}); }), Contains("--seq-length 1"));
  c.seq_length = 8;
  c.blend = parse_blend({dir.file("missing")}, "--data-path");
  CHECK_THAT(error_of([&] { build_datasets(c, {20, 0, 0}); }), Contains("missing.idx: no such file"));
}

TEST_CASE("token ids at or beyond the padded vocabulary fail at start-up, naming the file", "[data][gpt]") {
  oracle::TempDir dir;
  make_uniform_dataset(dir.file("ids"), 10, 20, 500);  // ids 500..699
  DatasetsConfig c;
  c.seq_length = 8;
  c.data_cache_path = dir.file("cache");
  c.split = "1";
  c.blend = parse_blend({dir.file("ids")}, "--data-path");
  c.token_limit = 600;
  CHECK_THAT(error_of([&] { build_datasets(c, {5, 0, 0}); }), Contains("ids.bin") && Contains("outside [0, 600)"));
  c.token_limit = 50304;
  CHECK_NOTHROW(build_datasets(c, {5, 0, 0}));
}

TEST_CASE("samples per split from the training flags", "[data][config]") {
  Config cfg;
  cfg.train.micro_batch_size = 2;
  cfg.train.global_batch = 8;
  cfg.train.train_iters = 100;
  cfg.train.eval_interval = 10;
  cfg.train.eval_iters = 5;
  CHECK(samples_per_split(cfg) == std::array<int64_t, 3>{800, (100 / 10 + 1) * 5 * 8, 40});
  cfg.train.train_iters.reset();
  cfg.train.train_samples = 1000;  // 125 iterations
  CHECK(samples_per_split(cfg) == std::array<int64_t, 3>{1000, (125 / 10 + 1) * 5 * 8, 40});
  // --start-eval-at-iter 35: the evaluations at 10, 20 and 30 are not made (nor their samples).
  cfg.train.start_eval_at_iter = 35;
  CHECK(samples_per_split(cfg) == std::array<int64_t, 3>{1000, (125 / 10 + 1 - 3) * 5 * 8, 40});
  cfg.train.start_eval_at_iter = 1000;  // past the end: none (Megatron's max(0, ...))
  CHECK(samples_per_split(cfg)[1] == 0);
  cfg.train.start_eval_at_iter.reset();
  cfg.train.eval_interval.reset();  // no periodic evaluation: the final one only
  CHECK(samples_per_split(cfg) == std::array<int64_t, 3>{1000, 5 * 8, 40});
  cfg.train.skip_train = true;
  cfg.train.eval_interval = 3;
  CHECK(samples_per_split(cfg)[1] == 5 * 8);
  cfg.train.skip_train = false;
  cfg.train.eval_iters = 0;
  CHECK(samples_per_split(cfg) == std::array<int64_t, 3>{1000, 0, 0});
}

TEST_CASE("data flags: one source, no --split with per-split paths", "[data][config]") {
  Config cfg;
  cfg.model.seq_length = 16;
  TokenizerFacts tok{50257, 50256, -1};
  CHECK_THAT(error_of([&] { datasets_config(cfg, tok); }), Contains("--data-path") && Contains("--mock-data"));
  cfg.data.mock_data = true;
  cfg.data.data_path = {"a"};
  CHECK_THAT(error_of([&] { datasets_config(cfg, tok); }), Contains("one data source"));
  cfg.data.mock_data = false;
  cfg.data.data_path.clear();
  cfg.data.train_data_path = {"a"};
  cfg.data.split = "1,1,1";
  CHECK_THAT(error_of([&] { datasets_config(cfg, tok); }), Contains("--split"));
  cfg.data.split.reset();
  cfg.model.padded_vocab_size = 50304;
  const DatasetsConfig c = datasets_config(cfg, tok);
  CHECK(c.blend_per_split[0]->prefixes == std::vector<std::string>{"a"});
  CHECK(c.token_limit == 50304);
  CHECK(c.tokenizer.eod == 50256);
  tok.pad = 50256;  // a pad id equal to EOD is dropped, as Megatron does
  CHECK(datasets_config(cfg, tok).tokenizer.pad == -1);
}

TEST_CASE("masks and positions: tokens/labels shift, EOD resets, loss masking, padding", "[data][masks]") {
  const int32_t E = 100, P = -1;
  const std::vector<int32_t> window{5, E, 7, 8, E, 9, 3, P, P};
  int32_t tokens[8], labels[8], positions[8], segments[8];
  float loss[8];
  SampleMasking m{.eod_token = E, .pad_token = P};
  make_training_sample(window, m, tokens, labels, loss, positions, segments);
  CHECK(std::vector<int32_t>(tokens, tokens + 8) == std::vector<int32_t>{5, E, 7, 8, E, 9, 3, 0});
  CHECK(std::vector<int32_t>(labels, labels + 8) == std::vector<int32_t>{E, 7, 8, E, 9, 3, 0, 0});
  CHECK(std::vector<float>(loss, loss + 8) == std::vector<float>{1, 1, 1, 1, 1, 1, 0, 0});
  CHECK(std::vector<int32_t>(positions, positions + 8) == std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 7});
  CHECK(std::vector<int32_t>(segments, segments + 8) == std::vector<int32_t>(8, 0));

  m.reset_position_ids = true;
  m.reset_attention_mask = true;
  m.eod_mask_loss = true;
  make_training_sample(window, m, tokens, labels, loss, positions, segments);
  CHECK(std::vector<int32_t>(positions, positions + 8) == std::vector<int32_t>{0, 1, 0, 1, 2, 0, 1, 2});
  CHECK(std::vector<int32_t>(segments, segments + 8) == std::vector<int32_t>{0, 0, 1, 1, 1, 2, 2, 2});
  CHECK(std::vector<float>(loss, loss + 8) == std::vector<float>{1, 0, 1, 1, 0, 1, 0, 0});
}
