// The GPT index cache: reused when nothing changed, rebuilt when the data or a parameter changes,
// survives a damaged file, and holds .npy files numpy reads back.
#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include "data/dataset_builder.h"
#include "data/indexed_dataset.h"
#include "tests/python_oracle.h"

using namespace mt;

namespace {

void make_dataset(const std::string& prefix, int docs, int length) {
  IndexedDatasetBuilder b(prefix, TokenDType::uint16);
  std::vector<int32_t> tokens(static_cast<size_t>(length));
  for (int d = 0; d < docs; ++d) {
    for (int i = 0; i < length; ++i) tokens[static_cast<size_t>(i)] = (d * 31 + i) % 997;
    b.add_document(tokens);
  }
  b.finalize();
}

std::vector<std::vector<int32_t>> all_windows(const SampleDataset& ds) {
  std::vector<std::vector<int32_t>> out;
  for (int64_t i = 0; i < ds.size(); ++i) {
    std::vector<int32_t> w(static_cast<size_t>(ds.window_length()));
    ds.window(i, w.data());
    out.push_back(std::move(w));
  }
  return out;
}

const GPTDataset& train_of(const BuiltDatasets& b) { return *b.components.at(0); }

}  // namespace

TEST_CASE("index cache: reused, rebuilt on change, robust to damage", "[data][cache]") {
  oracle::TempDir dir;
  const std::string prefix = dir.file("corpus");
  make_dataset(prefix, 60, 37);
  DatasetsConfig c;
  c.seq_length = 16;
  c.split = "1";
  c.blend = parse_blend({prefix}, "--data-path");

  // Default location: <prefix>/cache/GPTDataset_indices, as Megatron.
  const BuiltDatasets first = build_datasets(c, {300, 0, 0});
  CHECK_FALSE(train_of(first).loaded_from_cache());
  CHECK(train_of(first).cache_path_prefix().rfind(prefix + "/cache/GPTDataset_indices/", 0) == 0);
  const auto expected = all_windows(*first.splits[0]);

  const BuiltDatasets second = build_datasets(c, {300, 0, 0});
  CHECK(train_of(second).loaded_from_cache());
  CHECK(all_windows(*second.splits[0]) == expected);

  // Another seed or sample count is another cache entry.
  c.seed = 99;
  CHECK_FALSE(train_of(build_datasets(c, {300, 0, 0})).loaded_from_cache());
  c.seed = 1234;
  CHECK_FALSE(train_of(build_datasets(c, {301, 0, 0})).loaded_from_cache());
  CHECK(train_of(build_datasets(c, {300, 0, 0})).loaded_from_cache());

  // A damaged file is detected and rebuilt.
  const std::string sample_index = train_of(second).cache_path_prefix() + "sample_index.npy";
  std::filesystem::resize_file(sample_index, std::filesystem::file_size(sample_index) - 8);
  const BuiltDatasets repaired = build_datasets(c, {300, 0, 0});
  CHECK_FALSE(train_of(repaired).loaded_from_cache());
  CHECK(all_windows(*repaired.splits[0]) == expected);
  CHECK(train_of(build_datasets(c, {300, 0, 0})).loaded_from_cache());

  // New data under the same prefix (other document lengths): rebuilt, and the windows follow it.
  make_dataset(prefix, 60, 41);
  const BuiltDatasets changed = build_datasets(c, {300, 0, 0});
  CHECK_FALSE(train_of(changed).loaded_from_cache());
  CHECK(all_windows(*changed.splits[0]) != expected);

  // No temporary files are left behind.
  for (const auto& entry : std::filesystem::directory_iterator(prefix + "/cache/GPTDataset_indices")) {
    CHECK(entry.path().string().find(".tmp.") == std::string::npos);
  }
}

TEST_CASE("an unwritable cache directory only costs the cache", "[data][cache]") {
  oracle::TempDir dir;
  const std::string prefix = dir.file("corpus");
  make_dataset(prefix, 20, 30);
  const std::string blocker = dir.file("not_a_dir");
  std::ofstream(blocker) << "x";
  DatasetsConfig c;
  c.seq_length = 16;
  c.split = "1";
  c.blend = parse_blend({prefix}, "--data-path");
  c.data_cache_path = blocker + "/cache";
  const BuiltDatasets built = build_datasets(c, {30, 0, 0});
  CHECK(built.splits[0]->size() >= 30);
}

TEST_CASE("cached indices are .npy files numpy reads back unchanged", "[data][cache]") {
  auto python = oracle::python_or_skip("index cache .npy readback");
  if (!python) return;
  oracle::TempDir dir;
  const std::string prefix = dir.file("corpus");
  make_dataset(prefix, 50, 23);
  DatasetsConfig c;
  c.seq_length = 8;
  c.split = "1";
  c.blend = parse_blend({"0.6", prefix, "0.4", prefix}, "--data-path");
  c.data_cache_path = dir.file("cache");
  const BuiltDatasets built = build_datasets(c, {400, 0, 0});
  const GPTDataset& g = train_of(built);
  const std::string script =
      "import numpy,sys\n"
      "for p in sys.argv[1:]:\n"
      "    a = numpy.load(p)\n"
      "    print(a.dtype.str, a.shape, int(a.astype(numpy.int64).reshape(-1) @ numpy.arange(a.size, dtype=numpy.int64)))\n";
  std::ofstream(dir.file("read.py")) << script;
  const std::string out = oracle::run_capture(
      oracle::shell_quote(*python) + " " + oracle::shell_quote(dir.file("read.py")) + " " +
      oracle::shell_quote(g.cache_path_prefix() + "document_index.npy") + " " +
      oracle::shell_quote(g.cache_path_prefix() + "sample_index.npy") + " " +
      oracle::shell_quote(g.cache_path_prefix() + "shuffle_index.npy"));
  auto describe = [](const IndexArray& a) {
    int64_t dot = 0;
    for (int64_t i = 0; i < a.size(); ++i) dot += a[i] * i;
    const std::string shape = a.cols() == 1 ? fmt::format("({},)", a.rows()) : fmt::format("({}, {})", a.rows(), a.cols());
    return fmt::format("{} {} {}\n", index_type_descr(a.type()), shape, dot);
  };
  CHECK(out == describe(g.document_index()) + describe(g.sample_index()) + describe(g.shuffle_index()));
}

TEST_CASE("ranks building the same cache at once all get it whole", "[data][cache]") {
  oracle::TempDir dir;
  const std::string prefix = dir.file("corpus");
  make_dataset(prefix, 400, 53);
  DatasetsConfig c;
  c.seq_length = 16;
  c.split = "98,2,0";
  c.blend = parse_blend({prefix}, "--data-path");
  c.data_cache_path = dir.file("shared_cache");
  std::vector<std::vector<std::vector<int32_t>>> windows(4);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 4; ++r) {
    ranks.emplace_back([&, r] { windows[r] = all_windows(*build_datasets(c, {5000, 100, 0}).splits[0]); });
  }
  for (auto& t : ranks) t.join();
  for (int r = 1; r < 4; ++r) CHECK(windows[r] == windows[0]);
  const BuiltDatasets later = build_datasets(c, {5000, 100, 0});
  for (const auto& g : later.components) CHECK(g->loaded_from_cache());
  CHECK(all_windows(*later.splits[0]) == windows[0]);
}
