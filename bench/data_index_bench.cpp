// Index-building speed of the data pipeline (bench/data_index_bench.sh drives it).
//
//   data_index_bench generate PREFIX TOKENS [SEED]
//       writes a synthetic uint16 corpus of about TOKENS tokens: document lengths log-normal
//       (median 600 tokens, sigma 1.0: mean ~990, long tail capped at 100k), random ids, EOD last.
//   data_index_bench build --seq-length S --samples N --split SPLIT --cache DIR [--threads T]
//                          PREFIX | W1 PREFIX1 W2 PREFIX2 ...
//       builds the train/valid/test datasets for N training samples (valid/test: N/1000 each) as
//       training would, timing the first build (indices built and cached) and a second one (read
//       back from the cache), then times random window reads; for a single prefix it also times
//       the train split's three index steps one by one.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/error.h"
#include "data/dataset_builder.h"
#include "data/indexed_dataset.h"

using namespace mt;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

int generate(const std::string& prefix, int64_t tokens, uint32_t seed) {
  std::mt19937_64 gen(seed);
  std::lognormal_distribution<double> length(std::log(600.0), 1.0);
  IndexedDatasetBuilder builder(prefix, TokenDType::uint16);
  std::vector<int32_t> doc;
  int64_t written = 0, docs = 0;
  const auto t0 = Clock::now();
  while (written < tokens) {
    const int64_t n = std::clamp<int64_t>(static_cast<int64_t>(length(gen)), 1, 100000);
    doc.resize(static_cast<size_t>(n));
    for (auto& t : doc) t = static_cast<int32_t>(gen() % 50256);
    doc.back() = 50256;
    builder.add_document(doc);
    written += n;
    ++docs;
  }
  builder.finalize();
  std::printf("generated %s: %lld tokens in %lld documents (mean %.0f) in %.1f s\n", prefix.c_str(),
              static_cast<long long>(written), static_cast<long long>(docs),
              static_cast<double>(written) / static_cast<double>(docs), seconds_since(t0));
  return 0;
}

int build(const std::vector<std::string>& args) {
  DatasetsConfig c;
  int64_t samples = 0;
  std::vector<std::string> blend;
  for (size_t i = 0; i < args.size(); ++i) {
    auto next = [&] {
      if (i + 1 >= args.size()) fail("{} needs a value", args[i]);
      return args[++i];
    };
    if (args[i] == "--seq-length") c.seq_length = std::stoi(next());
    else if (args[i] == "--samples") samples = std::stoll(next());
    else if (args[i] == "--split") c.split = next();
    else if (args[i] == "--cache") c.data_cache_path = next();
    else if (args[i] == "--threads") c.num_dataset_builder_threads = std::stoi(next());
    else blend.push_back(args[i]);
  }
  c.blend = parse_blend(blend, "blend");
  if (!c.blend || samples <= 0 || c.seq_length <= 0 || !c.data_cache_path) fail("usage: see the header of {}", __FILE__);
  c.token_limit = 50304;
  const std::array<std::optional<int64_t>, 3> sizes{samples, samples / 1000, samples / 1000};
  std::filesystem::remove_all(*c.data_cache_path);

  auto t0 = Clock::now();
  BuiltDatasets built = build_datasets(c, sizes);
  const double first = seconds_since(t0);
  int64_t doc_entries = 0;
  for (const auto& g : built.components) doc_entries += g->document_index().size();
  std::printf("first build (indices built, cached): %.2f s  [%zu GPT datasets, %lld document-index entries, "
              "train %lld samples]\n",
              first, built.components.size(), static_cast<long long>(doc_entries),
              static_cast<long long>(built.splits[0]->size()));
  for (const auto& g : built.components) {
    std::printf("  %s %s: %lld tokens/epoch, %lld epochs%s, %lld samples\n", g->data().name().c_str(),
                split_name(g->split()), static_cast<long long>(g->tokens_per_epoch()),
                static_cast<long long>(g->num_epochs()), g->separate_final_epoch() ? " (last separate)" : "",
                static_cast<long long>(g->size()));
  }
  built = {};

  t0 = Clock::now();
  built = build_datasets(c, sizes);
  const double second = seconds_since(t0);
  bool all_cached = true;
  for (const auto& g : built.components) all_cached = all_cached && g->loaded_from_cache();
  std::printf("second build (%s): %.2f s\n", all_cached ? "every index from the cache" : "NOT all cached", second);

  const SampleDataset& train = *built.splits[0];
  std::mt19937_64 gen(1);
  std::vector<int32_t> window(static_cast<size_t>(train.window_length()));
  const int reads = 200000;
  t0 = Clock::now();
  int64_t checksum = 0;
  for (int i = 0; i < reads; ++i) {
    train.window(static_cast<int64_t>(gen() % static_cast<uint64_t>(train.size())), window.data());
    checksum += window[0];
  }
  const double read_s = seconds_since(t0);
  std::printf("random window reads: %.0f windows/s (%.2f us each; checksum %lld)\n", reads / read_s,
              1e6 * read_s / reads, static_cast<long long>(checksum));

  if (c.blend->prefixes.size() == 1 && !c.blend->weights) {
    // The three steps of the train split, one by one (no cache), with the datasets released first.
    const GPTDataset& g = *built.components.at(0);
    const IndexRange range = g.indices();
    const int64_t epochs = g.num_epochs(), tokens = g.tokens_per_epoch();
    const bool separate = g.separate_final_epoch();
    built = {};
    const IndexedDataset data(c.blend->prefixes[0]);
    numpy_random::RandomState rng(c.seed);
    t0 = Clock::now();
    std::vector<int32_t> doc = build_document_index(range, epochs, rng, separate);
    const double doc_s = seconds_since(t0);
    t0 = Clock::now();
    const auto sample = build_sample_index<int32_t>(data.sequence_lengths(), doc, c.seq_length, epochs, tokens, true, 1);
    const double sample_s = seconds_since(t0);
    t0 = Clock::now();
    const int64_t total = static_cast<int64_t>(sample.size() / 2) - 1;
    const IndexArray shuffle = build_shuffle_index(total, total, rng);
    const double shuffle_s = seconds_since(t0);
    std::printf("train split steps: document index %.2f s (%zu entries), sample index %.2f s (%lld rows), "
                "shuffle index %.2f s\n",
                doc_s, doc.size(), sample_s, static_cast<long long>(total + 1), shuffle_s);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  try {
    if (args.size() >= 3 && args[0] == "generate") {
      return generate(args[1], std::stoll(args[2]), args.size() > 3 ? static_cast<uint32_t>(std::stoul(args[3])) : 1);
    }
    if (!args.empty() && args[0] == "build") return build(std::vector<std::string>(args.begin() + 1, args.end()));
    std::fprintf(stderr, "usage: data_index_bench generate PREFIX TOKENS [SEED] | build ... (see the source header)\n");
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
