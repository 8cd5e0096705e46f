// data/indexed_dataset: round trips, byte-identity with an independent Python writer, merging, and
// one clear error per kind of corrupt input.
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <chrono>
#include <cstdio>

#include "core/error.h"
#include "data/indexed_dataset.h"
#include "tests/python_oracle.h"

using namespace mt;
using Catch::Matchers::Contains;

namespace {

using Document = std::vector<std::vector<int32_t>>;  // sequences

std::vector<Document> sample_documents() {
  return {
      {{5, 6, 7}},
      {},  // empty document
      {{1}, {2, 3}, {}},  // three sequences, one empty
      {{100, 101, 102, 103, 104}},
      {},
      {{9, 8}},
  };
}

void write_with_builder(const std::string& prefix, TokenDType dtype, const std::vector<Document>& docs) {
  IndexedDatasetBuilder builder(prefix, dtype);
  for (const Document& doc : docs) {
    std::vector<int32_t> tokens, lengths;
    for (const auto& seq : doc) {
      tokens.insert(tokens.end(), seq.begin(), seq.end());
      lengths.push_back(static_cast<int32_t>(seq.size()));
    }
    builder.add_document(tokens, lengths);
  }
  builder.finalize();
}

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void spit(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

struct PythonDataset {
  std::string prefix;
  int code;
  std::vector<Document> docs;
};

// Writes every dataset with the Python writer (one interpreter run).
void write_with_python(const std::string& python, const oracle::TempDir& dir, const std::vector<PythonDataset>& sets) {
  nlohmann::json specs = nlohmann::json::array();
  for (const auto& s : sets) specs.push_back({{"prefix", s.prefix}, {"dtype", s.code}, {"documents", s.docs}});
  const std::string spec_path = dir.file("spec.json");
  spit(spec_path, specs.dump());
  oracle::run_capture(oracle::shell_quote(python) + " " +
                    oracle::shell_quote(std::string(MEGATRAIN_SOURCE_DIR) + "/tests/oracles/indexed_writer.py") + " " +
                    oracle::shell_quote(spec_path));
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

TEST_CASE("indexed dataset round trips every dtype, empty documents and multi-sequence documents", "[data][indexed]") {
  oracle::TempDir dir;
  const auto docs = sample_documents();
  for (uint8_t code = 1; code <= 8; ++code) {
    const auto dtype = static_cast<TokenDType>(code);
    const std::string prefix = dir.file(std::string("ds_") + std::string(dtype_name(dtype)));
    write_with_builder(prefix, dtype, docs);
    for (bool mmap_bin : {true, false}) {
      IndexedDataset ds(prefix, {.mmap_bin = mmap_bin});
      INFO("dtype " << dtype_name(dtype) << " mmap " << mmap_bin);
      CHECK(ds.dtype() == dtype);
      CHECK(ds.num_documents() == 6);
      CHECK(ds.num_sequences() == 6);
      CHECK(ds.document_indices() == std::vector<int64_t>{0, 1, 1, 4, 5, 5, 6});
      CHECK(std::vector<int32_t>(ds.sequence_lengths().begin(), ds.sequence_lengths().end()) ==
            std::vector<int32_t>{3, 1, 2, 0, 5, 2});
      int64_t seq = 0;
      for (const Document& doc : docs) {
        for (const auto& expected : doc) {
          std::vector<int32_t> got(expected.size());
          ds.read(seq, 0, static_cast<int64_t>(got.size()), got.data());
          CHECK(got == expected);
          CHECK(ds.sequence_pointer(seq) ==
                (seq == 0 ? 0 : ds.sequence_pointer(seq - 1) + ds.sequence_lengths()[seq - 1] * int64_t(dtype_itemsize(dtype))));
          ++seq;
        }
      }
      int32_t part[3];
      ds.read(4, 1, 3, part);  // tokens 101..103 of the fifth sequence
      CHECK(part[0] == 101);
      CHECK(part[2] == 103);
    }
  }
}

TEST_CASE("builder output is byte-identical to an independent writer of the format", "[data][indexed]") {
  auto python = oracle::python_or_skip("indexed dataset byte identity");
  if (!python) return;
  oracle::TempDir dir;
  auto docs = sample_documents();
  docs.push_back({{65535, 0, 300}});
  std::vector<PythonDataset> sets;
  for (int code : {1, 4, 5, 6, 7, 8}) {
    auto these = docs;
    if (code == 1) these.back() = {{255, 0, 30}};
    const std::string name = "ds" + std::to_string(code);
    write_with_builder(dir.file(name + "_ours"), static_cast<TokenDType>(code), these);
    sets.push_back({dir.file(name + "_theirs"), code, these});
  }
  // A dataset with no documents at all.
  write_with_builder(dir.file("empty"), TokenDType::uint16, {});
  sets.push_back({dir.file("empty_py"), 8, {}});
  write_with_python(*python, dir, sets);
  for (int code : {1, 4, 5, 6, 7, 8}) {
    const std::string name = "ds" + std::to_string(code);
    INFO("dtype code " << code);
    CHECK(slurp(dir.file(name + "_ours.bin")) == slurp(dir.file(name + "_theirs.bin")));
    CHECK(slurp(dir.file(name + "_ours.idx")) == slurp(dir.file(name + "_theirs.idx")));
  }
  CHECK(slurp(dir.file("empty.idx")) == slurp(dir.file("empty_py.idx")));
  IndexedDataset empty(dir.file("empty"));
  CHECK(empty.num_documents() == 0);
  CHECK(empty.num_sequences() == 0);
}

TEST_CASE("add_index merges partitions exactly as writing all documents in one go", "[data][indexed]") {
  oracle::TempDir dir;
  const auto docs = sample_documents();
  const std::vector<Document> first(docs.begin(), docs.begin() + 3), second(docs.begin() + 3, docs.end());
  write_with_builder(dir.file("p0"), TokenDType::uint16, first);
  write_with_builder(dir.file("p1"), TokenDType::uint16, second);
  write_with_builder(dir.file("all"), TokenDType::uint16, docs);
  {
    IndexedDatasetBuilder merged(dir.file("merged"), TokenDType::uint16);
    merged.add_index(dir.file("p0"));
    merged.add_index(dir.file("p1"));
    merged.finalize();
  }
  CHECK(slurp(dir.file("merged.bin")) == slurp(dir.file("all.bin")));
  CHECK(slurp(dir.file("merged.idx")) == slurp(dir.file("all.idx")));

  IndexedDatasetBuilder wrong(dir.file("wrong"), TokenDType::int32);
  CHECK_THAT(error_of([&] { wrong.add_index(dir.file("p0")); }), Contains("dtype is uint16") && Contains("p0.idx"));
}

TEST_CASE("add_item/end_document and token range checks in the builder", "[data][indexed]") {
  oracle::TempDir dir;
  {
    IndexedDatasetBuilder b(dir.file("items"), TokenDType::int32);
    const std::vector<int32_t> a{1, 2}, c{3};
    b.add_item(a);
    b.add_item(c);
    b.end_document();
    b.end_document();
    b.finalize();
  }
  IndexedDataset ds(dir.file("items"));
  CHECK(ds.document_indices() == std::vector<int64_t>{0, 2, 2});

  IndexedDatasetBuilder small(dir.file("small"), TokenDType::uint16);
  const std::vector<int32_t> too_big{70000};
  CHECK_THAT(error_of([&] { small.add_document(too_big); }), Contains("70000") && Contains("uint16"));
  const std::vector<int32_t> three{1, 2, 3}, lengths{2};
  CHECK_THAT(error_of([&] { small.add_document(three, lengths); }), Contains("sum to 2") && Contains("3 tokens"));
  CHECK(optimal_token_dtype(50257) == TokenDType::uint16);
  CHECK(optimal_token_dtype(65500) == TokenDType::int32);
  CHECK(optimal_token_dtype(std::nullopt) == TokenDType::int32);
}

TEST_CASE("corrupt or missing dataset files give an error naming the file", "[data][indexed]") {
  oracle::TempDir dir;
  const std::string good = dir.file("good");
  write_with_builder(good, TokenDType::uint16, sample_documents());
  const std::string idx = slurp(good + ".idx"), bin = slurp(good + ".bin");
  auto variant = [&](const std::string& name, const std::string& idx_bytes, const std::string& bin_bytes) {
    const std::string prefix = dir.file(name);
    spit(prefix + ".idx", idx_bytes);
    spit(prefix + ".bin", bin_bytes);
    return error_of([&] { IndexedDataset ds(prefix); });
  };

  CHECK_THAT(error_of([&] { IndexedDataset ds(dir.file("nothing")); }),
             Contains("nothing.idx: no such file") && Contains("nothing.bin"));
  spit(dir.file("only_idx.idx"), idx);
  CHECK_THAT(error_of([&] { IndexedDataset ds(dir.file("only_idx")); }), Contains("only_idx.bin: no such file"));

  std::string bad_magic = idx;
  bad_magic[0] = 'X';
  CHECK_THAT(variant("magic", bad_magic, bin), Contains("magic.idx") && Contains("MMIDIDX"));

  std::string bad_version = idx;
  bad_version[9] = 2;
  CHECK_THAT(variant("version", bad_version, bin), Contains("version.idx") && Contains("version 2"));

  std::string bad_code = idx;
  bad_code[17] = 9;
  CHECK_THAT(variant("code", bad_code, bin), Contains("code.idx") && Contains("dtype code 9"));

  CHECK_THAT(variant("short_header", idx.substr(0, 20), bin), Contains("short_header.idx: truncated"));
  CHECK_THAT(variant("truncated", idx.substr(0, idx.size() - 8), bin), Contains("truncated.idx: truncated"));

  CHECK_THAT(variant("short_bin", idx, bin.substr(0, bin.size() - 2)),
             Contains("short_bin.bin") && Contains("shorter than its index"));

  // document_indices[-1] = 5 while there are 6 sequences.
  std::string inconsistent = idx;
  const int64_t five = 5;
  std::memcpy(inconsistent.data() + inconsistent.size() - 8, &five, 8);
  CHECK_THAT(variant("inconsistent", inconsistent, bin),
             Contains("inconsistent.idx") && Contains("6 sequence lengths") && Contains("last document index is 5"));

  std::string negative = idx;
  const int32_t minus = -3;
  std::memcpy(negative.data() + 34, &minus, 4);
  CHECK_THAT(variant("negative", negative, bin), Contains("negative.idx") && Contains("negative length"));
}

TEST_CASE("token ids outside the vocabulary: cheap check, full check and reads", "[data][indexed]") {
  oracle::TempDir dir;
  // ~3 MiB of uint16 tokens in 1000-token documents; one bad id in the middle of a document that
  // the cheap check neither samples nor reaches through the first/last MiB.
  const std::string prefix = dir.file("vocab");
  const int docs = 1600;
  const int bad_doc = 37 * docs / 64 + 3;  // between two of the 64 sampled sequences
  {
    IndexedDatasetBuilder b(prefix, TokenDType::uint16);
    std::vector<int32_t> tokens(1000);
    for (int d = 0; d < docs; ++d) {
      for (int i = 0; i < 1000; ++i) tokens[i] = (d * 7 + i) % 1000;
      if (d == bad_doc) tokens[500] = 1234;
      b.add_document(tokens);
    }
    b.finalize();
  }
  IndexedDataset ds(prefix);
  CHECK_NOTHROW(ds.check_tokens(1000, /*full=*/false));
  CHECK_THAT(error_of([&] { ds.check_tokens(1000, /*full=*/true); }),
             Contains("vocab.bin") && Contains("token id 1234") && Contains("--full-data-check"));
  // The cheap check does catch ids in the first MiB.
  CHECK_THAT(error_of([&] { ds.check_tokens(999, false); }), Contains("token id 999") && Contains("first MiB"));

  ds.set_token_limit(1000);
  std::vector<int32_t> out(1000);
  CHECK_NOTHROW(ds.read(bad_doc - 1, 0, 1000, out.data()));
  CHECK_THAT(error_of([&] { ds.read(bad_doc, 0, 1000, out.data()); }),
             Contains("vocab.bin") && Contains(fmt::format("sequence {}", bad_doc)) && Contains("token id 1234") &&
                 Contains("position 500"));
  IndexedDataset file_mode(prefix, {.mmap_bin = false});
  file_mode.set_token_limit(1000);
  CHECK_THAT(error_of([&] { file_mode.read(bad_doc, 400, 200, out.data()); }), Contains("position 500"));
}

TEST_CASE("an index that disagrees with its .bin is refused at open, naming both files", "[data][indexed]") {
  oracle::TempDir dir;
  const std::string good = dir.file("good");
  write_with_builder(good, TokenDType::uint16, sample_documents());
  const std::string idx = slurp(good + ".idx"), bin = slurp(good + ".bin");
  CHECK_NOTHROW(IndexedDataset(good));
  auto variant = [&](const std::string& name, const std::string& idx_bytes, const std::string& bin_bytes) {
    const std::string prefix = dir.file(name);
    spit(prefix + ".idx", idx_bytes);
    spit(prefix + ".bin", bin_bytes);
    return error_of([&] { IndexedDataset ds(prefix); });
  };
  // One line naming both files (the matchers of a Catch && chain must outlive it: built in place).
  auto names_both = [&](const std::string& error, const std::string& name) {
    return error.find(dir.file(name) + ".idx and " + dir.file(name) + ".bin disagree") != std::string::npos &&
           error.find('\n') == std::string::npos;
  };

  // The dtype byte changed from uint16 to uint8: the .bin holds twice the bytes the index
  // accounts for, and the second sequence's pointer is 2 bytes per token before it.
  std::string uint8_code = idx;
  uint8_code[17] = static_cast<char>(TokenDType::uint8);
  {
    const std::string e = variant("dtype", uint8_code, bin);
    CHECK(names_both(e, "dtype"));
    CHECK_THAT(e, Contains("sequence 1 starts at byte 6") && Contains("at byte 3") &&
                 Contains("2-byte tokens"));
  }
  // The same with only one sequence: no pointer to disagree, but the sizes do.
  const std::string one = dir.file("one");
  write_with_builder(one, TokenDType::uint16, {{{5, 6, 7}}});
  std::string one_idx = slurp(one + ".idx");
  one_idx[17] = static_cast<char>(TokenDType::uint8);
  {
    const std::string e = variant("one_dtype", one_idx, slurp(one + ".bin"));
    CHECK(names_both(e, "one_dtype"));
    CHECK_THAT(e, Contains("end at byte 3") && Contains("has 6 bytes") &&
                 Contains("2 times the index's bytes"));
  }

  // A pointer moved (the lengths say 6 bytes: 3 uint16 tokens before sequence 1).
  std::string moved = idx;
  const uint64_t pointers = 34 + 6 * 4;
  const int64_t eight = 8;
  std::memcpy(moved.data() + pointers + 8, &eight, 8);
  {
    const std::string e = variant("moved", moved, bin);
    CHECK(names_both(e, "moved"));
    CHECK_THAT(e, Contains("sequence 1 starts at byte 8"));
  }
  // A first pointer that is not 0.
  std::string first = idx;
  std::memcpy(first.data() + pointers, &eight, 8);
  {
    const std::string e = variant("first", first, bin);
    CHECK(names_both(e, "first"));
    CHECK_THAT(e, Contains("sequence 0 starts at byte 8"));
  }
  // Extra bytes after the last sequence, and a .bin cut short (the existing wording is kept).
  {
    const std::string e = variant("padded", idx, bin + std::string(4, '\0'));
    CHECK(names_both(e, "padded"));
    CHECK_THAT(e, Contains("has " + std::to_string(bin.size() + 4) + " bytes"));
  }
  {
    const std::string e = variant("cut", idx, bin.substr(0, bin.size() - 2));
    CHECK(names_both(e, "cut"));
    CHECK_THAT(e, Contains("shorter than its index"));
  }
  // An empty index with a non-empty .bin.
  const std::string empty = dir.file("empty");
  write_with_builder(empty, TokenDType::int32, {});
  CHECK_NOTHROW(IndexedDataset(empty));
  {
    const std::string e = variant("empty_bin", slurp(empty + ".idx"), "abcd");
    CHECK(names_both(e, "empty_bin"));
    CHECK_THAT(e, Contains("has 4 bytes"));
  }
}

// Not run by default: the cost of the open-time pointer check on a few million documents.
// megatrain_tests "[.bench-idx-open]" prints the time to open a 4M-document index.
TEST_CASE("opening a 4M-document index (pointer check timing)", "[.bench-idx-open]") {
  oracle::TempDir dir;
  const std::string prefix = dir.file("big");
  const int64_t docs = 4'000'000;
  {
    IndexedDatasetBuilder b(prefix, TokenDType::uint16);
    std::vector<int32_t> tokens(3);
    for (int64_t d = 0; d < docs; ++d) {
      tokens.resize(static_cast<size_t>(1 + d % 5), 7);
      b.add_document(tokens);
    }
    b.finalize();
  }
  for (int round = 0; round < 3; ++round) {
    const auto start = std::chrono::steady_clock::now();
    IndexedDataset ds(prefix);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("open of %lld documents: %.1f ms\n", static_cast<long long>(ds.num_documents()), secs * 1e3);
    CHECK(ds.num_documents() == docs);
  }
}
