// Damaged data files through the real binary: an .idx whose dtype byte was changed (refused by
// --dry-run and by training, --full-data-check or not), and cached GPT indices holding out-of-range
// values (rebuilt with one warning naming the file; the run goes on).
#include "tests/cli_test_util.h"

#include <cstring>
#include <iterator>

#include "data/indexed_dataset.h"
#include "data/npy.h"

using namespace mt;
using namespace mt::test;
using Catch::Contains;

namespace {

// Documents of 20..50 uint16 tokens below 999 (NullTokenizer --vocab-size 1000).
void make_dataset(const std::string& prefix, int docs) {
  IndexedDatasetBuilder b(prefix, TokenDType::uint16);
  std::vector<int32_t> tokens;
  for (int d = 0; d < docs; ++d) {
    tokens.resize(static_cast<size_t>(20 + (d * 7) % 31));
    for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>((d * 31 + static_cast<int>(i)) % 999);
    b.add_document(tokens);
  }
  b.finalize();
}

// A tiny CPU run on `prefix`, all of it in the train split.
Args tiny_run(const std::string& prefix) {
  return words("--device cpu --tokenizer-type NullTokenizer --vocab-size 1000 --num-layers 2 --hidden-size 32 "
               "--num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 --micro-batch-size 2 "
               "--global-batch-size 4 --lr 1e-3 --train-iters 2 --log-interval 1 --split 1,0,0 --eval-iters 0 "
               "--data-path " + prefix);
}

// The lines of `text` that contain `what`.
std::vector<std::string> lines_with(const std::string& text, const std::string& what) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);)
    if (line.find(what) != std::string::npos) out.push_back(line);
  return out;
}

// The data bytes of a .npy file (after its header) and the header before them.
struct NpyBytes {
  std::string header, data;
};

NpyBytes read_npy(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), {});
  REQUIRE(bytes.size() >= 10);
  const size_t header_len = static_cast<unsigned char>(bytes[8]) + 256 * size_t{static_cast<unsigned char>(bytes[9])};
  const size_t start = 10 + header_len;
  REQUIRE(start <= bytes.size());
  return {bytes.substr(0, start), bytes.substr(start)};
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  REQUIRE(out);
}

// The cache file of the train split whose name ends in `suffix` ("shuffle_index.npy", ...).
std::string cache_file(const std::string& prefix, const std::string& suffix) {
  std::string found;
  for (const auto& e : std::filesystem::directory_iterator(prefix + "/cache/GPTDataset_indices")) {
    const std::string name = e.path().string();
    if (name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0 &&
        name.find("-GPTDataset-train-") != std::string::npos) {
      REQUIRE(found.empty());
      found = name;
    }
  }
  REQUIRE_FALSE(found.empty());
  return found;
}

}  // namespace

TEST_CASE("megatrain --dry-run and training refuse an indexed dataset whose .idx dtype byte was changed",
          "[data][idx][binary]") {
  TempDir d;
  const std::string good = d.str("good"), flipped = d.str("flipped");
  make_dataset(good, 40);
  make_dataset(flipped, 40);
  {
    std::fstream f(flipped + ".idx", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(17);
    f.put(static_cast<char>(TokenDType::uint8));  // was uint16
  }
  const RunResult ok = run_binary(tiny_run(good) + words("--dry-run"));
  INFO(ok.err);
  REQUIRE(ok.exit_code == 0);

  // The bytes would split into twice as many "tokens", all below the vocabulary: only the index
  // against its .bin tells. Every way in refuses it in one line naming both files.
  const std::string disagree = flipped + ".idx and " + flipped + ".bin disagree";
  for (const Args& extra : {words("--dry-run"), words("--dry-run --full-data-check"), Args{},
                            words("--full-data-check"), words("--no-mmap-bin-files")}) {
    std::string how;
    for (const auto& a : extra) how += a + " ";
    INFO("megatrain <tiny run> " << how);
    const RunResult r = run_binary(tiny_run(flipped) + extra);
    INFO(r.out << r.err);
    CHECK(r.exit_code == 1);
    const auto errors = lines_with(r.err, "error:");
    REQUIRE(errors.size() == 1);
    CHECK_THAT(errors[0], Contains(disagree) && Contains("2-byte tokens, not the index's dtype uint8"));
    CHECK(lines_with(r.out, "iteration ").empty());  // no training step ran
  }
}

TEST_CASE("megatrain rebuilds a cached index (document, sample, shuffle .npy) holding an out-of-range value",
          "[data][cache][binary]") {
  TempDir d;
  const std::string prefix = d.str("corpus");
  make_dataset(prefix, 60);
  const RunResult first = run_binary(tiny_run(prefix));
  INFO(first.err);
  REQUIRE(first.exit_code == 0);

  struct Damage {
    const char* what;
    std::string suffix;
    size_t element;   // which element of the array
    size_t itemsize;  // the array's element size (int32 document/sample index, uint32 shuffle index)
    int64_t value;
  };
  const std::vector<Damage> damages = {
      {"shuffle index far past the samples", "shuffle_index.npy", 3, 4, 0x7fffffff},
      {"document index past the documents", "document_index.npy", 2, 4, 1 << 30},
      {"negative document index", "document_index.npy", 5, 4, -1},
      {"sample index offset past its document", "sample_index.npy", 2 * 4 + 1, 4, 1 << 30},
      {"sample index position past the document index", "sample_index.npy", 2 * 6, 4, 1 << 30},
  };
  for (const Damage& damage : damages) {
    INFO(damage.what);
    const std::string file = cache_file(prefix, damage.suffix);
    const NpyBytes original = read_npy(file);
    REQUIRE((damage.element + 1) * damage.itemsize <= original.data.size());
    std::string data = original.data;
    std::memcpy(data.data() + damage.element * damage.itemsize, &damage.value, damage.itemsize);  // little-endian
    REQUIRE(data != original.data);
    write_file(file, original.header + data);  // the header stays valid

    const RunResult r = run_binary(tiny_run(prefix));
    INFO(r.out << r.err);
    CHECK(r.exit_code == 0);
    const auto warnings = lines_with(r.err, "damaged index cache");
    REQUIRE(warnings.size() == 1);
    CHECK_THAT(warnings[0], Contains("warning:") && Contains("damaged index cache " + file + ":") &&
                                Contains("rebuilding the train indices"));
    CHECK(lines_with(r.err, "error:").empty());
    CHECK_FALSE(lines_with(r.out, "iteration        2/       2").empty());
    // The rebuilt file replaced the damaged one, and the next run uses it without a word.
    CHECK(read_npy(file).data == original.data);
    const RunResult again = run_binary(tiny_run(prefix));
    CHECK(again.exit_code == 0);
    CHECK(lines_with(again.err, "damaged").empty());
  }
}
