// The exactness check: for the same files and flags, megatrain's GPTDataset/BlendedDataset (and
// mock data) give the same windows in the same order as Megatron's algorithm run with numpy's own
// RandomState (tests/oracles/megatron_gpt_indices.py). Every window of every split is compared.
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <fstream>
#include <random>

#include "core/error.h"
#include "data/blended_dataset.h"
#include "data/dataset_builder.h"
#include "data/indexed_dataset.h"
#include "tests/python_oracle.h"

using namespace mt;
using nlohmann::json;

namespace {

// A dataset of `docs` documents with lengths drawn from [min_len, max_len] (0 allowed: empty
// documents), tokens i*7+j mod 5000, an EOD (id 4999) closing every non-empty document.
void make_dataset(const std::string& prefix, int docs, int min_len, int max_len, uint32_t seed,
                  TokenDType dtype = TokenDType::uint16) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int> length(min_len, max_len);
  IndexedDatasetBuilder b(prefix, dtype);
  std::vector<int32_t> tokens;
  for (int d = 0; d < docs; ++d) {
    const int n = length(gen);
    tokens.resize(n);
    for (int j = 0; j < n; ++j) tokens[j] = (d * 7 + j * 13 + static_cast<int>(seed)) % 4999;
    if (n > 0) tokens[n - 1] = 4999;
    b.add_document(tokens);
  }
  b.finalize();
}

json run_oracle(const std::string& python, const oracle::TempDir& dir, const json& spec) {
  const std::string path = dir.file("oracle_spec.json");
  std::ofstream(path) << spec.dump();
  const std::string out = oracle::run_capture(
      oracle::shell_quote(python) + " " +
      oracle::shell_quote(std::string(MEGATRAIN_SOURCE_DIR) + "/tests/oracles/megatron_gpt_indices.py") + " " +
      oracle::shell_quote(path));
  return json::parse(out);
}

std::vector<std::string> as_strings(const json& j) {
  std::vector<std::string> v;
  if (j.is_array()) {
    for (const auto& x : j) v.push_back(x.get<std::string>());
  }
  return v;
}

// Builds the datasets described by spec (the oracle's spec format) with megatrain.
BuiltDatasets build_from_spec(const json& spec, const std::string& cache_dir) {
  DatasetsConfig c;
  c.blend = parse_blend(as_strings(spec.value("data_path", json::array())), "--data-path");
  c.blend_per_split[0] = parse_blend(as_strings(spec.value("train_data_path", json::array())), "--train-data-path");
  c.blend_per_split[1] = parse_blend(as_strings(spec.value("valid_data_path", json::array())), "--valid-data-path");
  c.blend_per_split[2] = parse_blend(as_strings(spec.value("test_data_path", json::array())), "--test-data-path");
  if (spec.contains("mock")) {
    c.mock = true;
    c.tokenizer.vocab_size = spec["mock"]["vocab_size"];
    c.tokenizer.eod = spec["mock"]["eod"];
  }
  if (spec.contains("split")) c.split = spec["split"];
  c.seq_length = spec["seq_length"];
  c.seed = spec["seed"];
  c.data_cache_path = cache_dir;
  c.mid_level_dataset_surplus = spec.value("surplus", 0.005);
  c.num_dataset_builder_threads = 2;
  c.token_limit = 50304;
  std::array<std::optional<int64_t>, 3> sizes;
  for (int i = 0; i < 3; ++i) {
    if (!spec["sizes"][i].is_null()) sizes[i] = spec["sizes"][i].get<int64_t>();
  }
  return build_datasets(c, sizes);
}

void compare_with_oracle(const json& expected, const BuiltDatasets& built, const std::string& label) {
  const char* names[3] = {"train", "valid", "test"};
  for (int i = 0; i < 3; ++i) {
    INFO(label << " split " << names[i]);
    const json& e = expected[names[i]];
    if (e.is_null()) {
      CHECK(built.splits[i] == nullptr);
      continue;
    }
    REQUIRE(built.splits[i] != nullptr);
    const SampleDataset& ds = *built.splits[i];
    REQUIRE(ds.size() == e["size"].get<int64_t>());
    std::vector<int32_t> window(static_cast<size_t>(ds.window_length()));
    const auto& windows = e["windows"];
    for (size_t k = 0; k < windows.size(); ++k) {
      ds.window(static_cast<int64_t>(k), window.data());
      if (windows[k].get<std::vector<int32_t>>() != window) {
        FAIL_CHECK("window " << k << " differs");
        break;
      }
    }
  }
}

}  // namespace

TEST_CASE("GPT and blended windows equal Megatron's algorithm run with numpy (every window)",
          "[data][gpt][oracle]") {
  auto python = oracle::python_or_skip("Megatron GPT/blend oracle");
  if (!python) return;
  oracle::TempDir dir;
  const std::string a = dir.file("a"), b = dir.file("b"), c = dir.file("c"), d = dir.file("d");
  make_dataset(a, 300, 0, 120, 1);                       // short documents, some empty
  make_dataset(b, 40, 50, 900, 2, TokenDType::int32);   // long documents (windows inside one)
  make_dataset(c, 120, 1, 60, 3);
  make_dataset(d, 25, 1, 3, 4);                          // tiny: a window spans many documents

  struct Case {
    std::string name;
    json spec;
  };
  std::vector<Case> cases = {
      {"single prefix, one epoch", {{"data_path", {a}}, {"split", "80,15,5"}, {"sizes", {300, 40, 10}}}},
      {"single prefix, several epochs (final epoch kept)",
       {{"data_path", {a}}, {"split", "'80, 15, 5'"}, {"sizes", {2700, 150, 60}}}},
      {"single prefix, several epochs (final epoch separate)",
       {{"data_path", {a}}, {"split", "80,15,5"}, {"sizes", {2100, 100, 30}}}},
      {"long documents", {{"data_path", {b}}, {"split", "70,20,10"}, {"sizes", {500, 100, 50}}}},
      {"tiny documents, no test split", {{"data_path", {d}}, {"split", "60,40,0"}, {"sizes", {7, 3, 2}}}},
      {"weighted three-way blend",
       {{"data_path", {"0.5", a, "0.3", b, "0.2", c}}, {"split", "90,8,2"}, {"sizes", {800, 60, 20}}}},
      {"one weighted prefix (still a blend)", {{"data_path", {"1.0", c}}, {"split", "90,8,2"}, {"sizes", {50, 9, 4}}}},
      {"unweighted blend", {{"data_path", {a, c}}, {"split", "90,8,2"}, {"sizes", {500, 30, 10}}}},
      {"extreme weights", {{"data_path", {"0.999", a, "0.001", c}}, {"split", "90,8,2"}, {"sizes", {1500, 50, 10}}}},
      {"a dataset much smaller than its share",
       {{"data_path", {"0.2", b, "0.8", d}}, {"split", "1,0,0"}, {"sizes", {400, 0, 0}}}},
      {"per-split data paths",
       {{"train_data_path", {"0.7", a, "0.3", b}}, {"valid_data_path", {c}}, {"test_data_path", {a, d}},
        {"sizes", {600, 40, 15}}}},
  };
  json specs = json::array();
  for (auto& [name, spec] : cases) {
    spec["seq_length"] = name == "long documents" ? 64 : 32;
    spec["seed"] = name == "weighted three-way blend" ? 99 : 1234;
    spec["windows"] = -1;
    specs.push_back(spec);
  }
  const json all_expected = run_oracle(*python, dir, specs);  // one oracle run for every case
  REQUIRE(all_expected.size() == cases.size());
  for (size_t k = 0; k < cases.size(); ++k) {
    const std::string& name = cases[k].name;
    const json& spec = cases[k].spec;
    const json& expected = all_expected[k];
    const std::string cache = dir.file("cache_" + std::to_string(k));
    const BuiltDatasets built = build_from_spec(spec, cache);
    compare_with_oracle(expected, built, name);
    // The second build reads the cached indices and must give the same windows.
    const BuiltDatasets cached = build_from_spec(spec, cache);
    for (const auto& g : cached.components) CHECK(g->loaded_from_cache());
    compare_with_oracle(expected, cached, name + " (from cache)");
    if (name == "single prefix, several epochs (final epoch kept)") {
      const auto* train = dynamic_cast<const GPTDataset*>(built.splits[0].get());
      REQUIRE(train);
      CHECK(train->num_epochs() > 1);
      CHECK_FALSE(train->separate_final_epoch());
    }
    if (name == "single prefix, several epochs (final epoch separate)") {
      const auto* train = dynamic_cast<const GPTDataset*>(built.splits[0].get());
      REQUIRE(train);
      CHECK(train->num_epochs() > 1);
      CHECK(train->separate_final_epoch());
    }
  }
}

TEST_CASE("mock data windows equal Megatron's MockGPTDataset", "[data][gpt][oracle][mock]") {
  auto python = oracle::python_or_skip("Megatron mock-data oracle");
  if (!python) return;
  oracle::TempDir dir;
  json spec = {{"mock", {{"vocab_size", 50257}, {"eod", 50256}}},
               {"sizes", {200, 40, 8}},
               {"seq_length", 2048},
               {"seed", 1234},
               {"windows", 60}};
  // A small vocabulary wraps the token ramp; another seed reorders everything.
  json other = spec;
  other["mock"] = {{"vocab_size", 1000}, {"eod", 999}};
  other["seed"] = 7;
  other["seq_length"] = 4096;
  const json expected = run_oracle(*python, dir, json::array({spec, other}));
  compare_with_oracle(expected[0], build_from_spec(spec, dir.file("cache")), "mock");
  compare_with_oracle(expected[1], build_from_spec(other, dir.file("cache")), "mock vocab 1000");
}
