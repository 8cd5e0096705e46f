// The GPT and blend index caches: reused when nothing changed, rebuilt when the data or a parameter
// changes, survive a damaged file, and hold .npy files numpy reads back.
#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <sstream>
#include <thread>

#include "data/blended_dataset.h"
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

// Overwrites element i (of `itemsize` bytes) of a .npy file's data with value, keeping the header.
void poke_npy(const std::string& path, int64_t i, size_t itemsize, int64_t value) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  REQUIRE(f);
  unsigned char len[2];
  f.seekg(8);
  f.read(reinterpret_cast<char*>(len), 2);
  const int64_t data = 10 + len[0] + 256 * len[1];
  f.seekp(data + i * static_cast<int64_t>(itemsize));
  f.write(reinterpret_cast<const char*>(&value), static_cast<std::streamsize>(itemsize));  // little-endian
  REQUIRE(f);
}

int64_t peek_npy(const std::string& path, int64_t i, size_t itemsize) {
  std::ifstream f(path, std::ios::binary);
  unsigned char len[2];
  f.seekg(8);
  f.read(reinterpret_cast<char*>(len), 2);
  f.seekg(10 + len[0] + 256 * len[1] + i * static_cast<int64_t>(itemsize));
  int64_t v = 0;
  f.read(reinterpret_cast<char*>(&v), static_cast<std::streamsize>(itemsize));
  if (itemsize == 4) v = static_cast<int32_t>(v);
  return v;
}

// What `f` writes to stderr (the warnings).
std::string stderr_of(const std::function<void()>& f) {
  oracle::TempDir dir;
  const std::string path = dir.file("stderr");
  std::fflush(stderr);
  const int saved = dup(2);
  std::FILE* out = std::fopen(path.c_str(), "w");
  dup2(fileno(out), 2);
  try {
    f();
  } catch (...) {
    std::fflush(stderr);
    dup2(saved, 2);
    close(saved);
    std::fclose(out);
    throw;
  }
  std::fflush(stderr);
  dup2(saved, 2);
  close(saved);
  std::fclose(out);
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A corpus of 60 documents at `prefix`, read as one training split of 16-token windows.
DatasetsConfig one_corpus(const std::string& prefix) {
  make_dataset(prefix, 60, 37);
  DatasetsConfig c;
  c.seq_length = 16;
  c.split = "1";
  c.blend = parse_blend({prefix}, "--data-path");
  return c;
}

}  // namespace

TEST_CASE("index cache: reused, rebuilt on change, robust to damage", "[data][cache]") {
  oracle::TempDir dir;
  const std::string prefix = dir.file("corpus");
  DatasetsConfig c = one_corpus(prefix);

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

TEST_CASE("cached indices with out-of-range values are rebuilt, never read out of bounds", "[data][cache]") {
  oracle::TempDir dir;
  const std::string prefix = dir.file("corpus");
  DatasetsConfig c = one_corpus(prefix);
  const BuiltDatasets first = build_datasets(c, {300, 0, 0});
  const auto expected = all_windows(*first.splits[0]);
  const std::string cache = train_of(first).cache_path_prefix();
  const std::string doc = cache + "document_index.npy", sample = cache + "sample_index.npy",
                    shuffle = cache + "shuffle_index.npy";
  REQUIRE(train_of(first).document_index().type() == IndexType::i32);
  REQUIRE(train_of(first).sample_index().type() == IndexType::i32);
  REQUIRE(train_of(first).shuffle_index().type() == IndexType::u32);

  struct Damage {
    const char* what;
    std::string file;
    int64_t element;
    size_t itemsize;
    std::function<int64_t(int64_t)> value;  // from the original value
  };
  const std::vector<Damage> damages = {
      {"shuffle index far out of range", shuffle, 5, 4, [](int64_t) { return int64_t{0x7fffffff}; }},
      {"shuffle index one past the end", shuffle, 0, 4, [&](int64_t) { return train_of(first).size(); }},
      {"shuffle index repeating a sample", shuffle, 1, 4, [&](int64_t) { return train_of(first).shuffle_index()[0]; }},
      {"document index past the documents", doc, 3, 4, [](int64_t) { return int64_t{60}; }},
      {"negative document index", doc, 7, 4, [](int64_t) { return int64_t{-1}; }},
      {"sample offset past its document", sample, 2 * 4 + 1, 4, [](int64_t) { return int64_t{1000}; }},
      {"negative sample offset", sample, 2 * 4 + 1, 4, [](int64_t) { return int64_t{-7}; }},
      {"sample positions going backwards", sample, 2 * 9, 4, [](int64_t v) { return v - 2; }},
      {"sample position past the document index", sample, 2 * 9, 4, [](int64_t) { return int64_t{1} << 30; }},
      {"a window one token short", sample, 2 * 9 + 1, 4, [](int64_t v) { return v > 0 ? v - 1 : v; }},
  };
  for (const Damage& d : damages) {
    INFO(d.what);
    const int64_t original = peek_npy(d.file, d.element, d.itemsize);
    const int64_t value = d.value(original);
    REQUIRE(value != original);
    poke_npy(d.file, d.element, d.itemsize, value);
    std::optional<BuiltDatasets> rebuilt;
    const std::string err = stderr_of([&] { rebuilt = build_datasets(c, {300, 0, 0}); });
    CHECK_FALSE(train_of(*rebuilt).loaded_from_cache());
    CHECK_THAT(err, Catch::Matchers::Contains("damaged index cache " + d.file) &&
                        Catch::Matchers::Contains("rebuilding"));
    CHECK(all_windows(*rebuilt->splits[0]) == expected);
    // The rebuilt files replaced the damaged ones.
    CHECK(peek_npy(d.file, d.element, d.itemsize) == original);
    CHECK(train_of(build_datasets(c, {300, 0, 0})).loaded_from_cache());
  }

  // Blend indices (cached under --data-cache-path): a dataset id or sample id out of range.
  DatasetsConfig b = c;
  b.blend = parse_blend({"0.6", prefix, "0.4", prefix}, "--data-path");
  b.data_cache_path = dir.file("blend_cache");
  const BuiltDatasets blend = build_datasets(b, {200, 0, 0});
  const auto blend_expected = all_windows(*blend.splits[0]);
  std::string blend_prefix;
  for (const auto& e : std::filesystem::directory_iterator(*b.data_cache_path)) {
    const std::string name = e.path().string();
    const std::string suffix = "BlendedDataset-train-dataset_index.npy";
    if (name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0)
      blend_prefix = name.substr(0, name.size() - std::string("dataset_index.npy").size());
  }
  REQUIRE_FALSE(blend_prefix.empty());
  const std::vector<Damage> blend_damages = {
      {"blend dataset id past the datasets", blend_prefix + "dataset_index.npy", 4, 2, [](int64_t) { return int64_t{2}; }},
      {"negative blend dataset id", blend_prefix + "dataset_index.npy", 4, 2, [](int64_t) { return int64_t{0xffff}; }},
      {"blend sample id past its dataset", blend_prefix + "dataset_sample_index.npy", 6, 8,
       [](int64_t) { return int64_t{1} << 40; }},
  };
  for (const Damage& d : blend_damages) {
    INFO(d.what);
    const int64_t original = peek_npy(d.file, d.element, d.itemsize) & (d.itemsize == 2 ? 0xffff : -1);
    poke_npy(d.file, d.element, d.itemsize, d.value(original));
    std::optional<BuiltDatasets> rebuilt;
    const std::string err = stderr_of([&] { rebuilt = build_datasets(b, {200, 0, 0}); });
    CHECK_THAT(err, Catch::Matchers::Contains("damaged blend cache " + d.file) && Catch::Matchers::Contains("rebuilding"));
    CHECK(all_windows(*rebuilt->splits[0]) == blend_expected);
    CHECK(peek_npy(d.file, d.element, d.itemsize) == original);
  }
}

TEST_CASE("an exhaustive blend's cached index of the wrong length is rebuilt", "[data][cache]") {
  // Without a size (Megatron's unweighted per-split blend) dataset j gives exactly weights[j]
  // samples: a cached index with one sample fewer (a valid header, every value in range) is damage.
  oracle::TempDir dir;
  const std::string prefix = dir.file("corpus");
  make_dataset(prefix, 40, 37);
  auto data = std::make_shared<IndexedDataset>(prefix);
  GPTDatasetOptions o;
  o.seq_length = 16;
  std::vector<std::shared_ptr<const SampleDataset>> parts = {
      std::make_shared<GPTDataset>(data, Split::train, IndexRange{0, 20}, std::nullopt, o),
      std::make_shared<GPTDataset>(data, Split::train, IndexRange{20, 40}, std::nullopt, o)};
  const std::vector<double> sizes = {static_cast<double>(parts[0]->size()), static_cast<double>(parts[1]->size())};
  const std::string cache = dir.file("blend_cache");
  const BlendedDataset built(parts, sizes, std::nullopt, Split::train, 0.0, cache);
  REQUIRE(built.size() == parts[0]->size() + parts[1]->size());
  const auto expected = all_windows(built);
  CHECK(BlendedDataset(parts, sizes, std::nullopt, Split::train, 0.0, cache).loaded_from_cache());

  std::string blend_prefix;
  for (const auto& e : std::filesystem::directory_iterator(cache)) {
    const std::string name = e.path().string();
    const std::string suffix = "BlendedDataset-train-dataset_index.npy";
    if (name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0)
      blend_prefix = name.substr(0, name.size() - std::string("dataset_index.npy").size());
  }
  REQUIRE_FALSE(blend_prefix.empty());
  // Both arrays rewritten one sample shorter, consistently.
  std::vector<int16_t> index;
  std::vector<int64_t> sample;
  for (int64_t i = 0; i + 1 < built.size(); ++i) {
    index.push_back(static_cast<int16_t>(built.dataset_index()[i]));
    sample.push_back(built.dataset_sample_index()[i]);
  }
  IndexArray::from_vector(std::move(index)).write_npy(blend_prefix + "dataset_index.npy");
  IndexArray::from_vector(std::move(sample)).write_npy(blend_prefix + "dataset_sample_index.npy");

  std::optional<BlendedDataset> rebuilt;
  const std::string err =
      stderr_of([&] { rebuilt.emplace(parts, sizes, std::nullopt, Split::train, 0.0, cache); });
  CHECK_FALSE(rebuilt->loaded_from_cache());
  CHECK_THAT(err, Catch::Matchers::Contains("damaged blend cache " + blend_prefix + "dataset_index.npy") &&
                      Catch::Matchers::Contains("wrong length") && Catch::Matchers::Contains("rebuilding"));
  CHECK(rebuilt->size() == built.size());
  CHECK(all_windows(*rebuilt) == expected);
  CHECK(BlendedDataset(parts, sizes, std::nullopt, Split::train, 0.0, cache).loaded_from_cache());
}

TEST_CASE("an int64 sample index cache is used whole, and rebuilt for an offset at the int64 limit",
          "[data][cache]") {
  // Megatron writes the sample index as int64 for large document indices; the check reads either
  // width and must not overflow on any value an int64 file can hold.
  oracle::TempDir dir;
  const std::string prefix = dir.file("corpus");
  DatasetsConfig c = one_corpus(prefix);
  const BuiltDatasets first = build_datasets(c, {300, 0, 0});
  const auto expected = all_windows(*first.splits[0]);
  const IndexArray& sample32 = train_of(first).sample_index();
  REQUIRE(sample32.type() == IndexType::i32);
  const std::string file = train_of(first).cache_path_prefix() + "sample_index.npy";
  std::vector<int64_t> wide(static_cast<size_t>(sample32.size()));
  for (int64_t i = 0; i < sample32.size(); ++i) wide[static_cast<size_t>(i)] = sample32[i];

  IndexArray::from_vector(std::vector<int64_t>(wide), 2).write_npy(file);
  const BuiltDatasets widened = build_datasets(c, {300, 0, 0});
  CHECK(train_of(widened).loaded_from_cache());
  CHECK(train_of(widened).sample_index().type() == IndexType::i64);
  CHECK(all_windows(*widened.splits[0]) == expected);

  for (const int64_t offset : {std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::min()}) {
    INFO("offset " << offset);
    std::vector<int64_t> damaged = wide;
    damaged[2 * 5 + 1] = offset;
    IndexArray::from_vector(std::move(damaged), 2).write_npy(file);
    std::optional<BuiltDatasets> rebuilt;
    const std::string err = stderr_of([&] { rebuilt = build_datasets(c, {300, 0, 0}); });
    CHECK_FALSE(train_of(*rebuilt).loaded_from_cache());
    CHECK_THAT(err, Catch::Matchers::Contains("damaged index cache " + file + ": row 5") &&
                        Catch::Matchers::Contains("rebuilding"));
    CHECK(all_windows(*rebuilt->splits[0]) == expected);
  }
}
