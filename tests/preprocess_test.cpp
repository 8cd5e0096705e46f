// megatrain preprocess-data: the same .bin/.idx bytes as Megatron's tools/preprocess_data.py
// (tests/fixtures/preprocess/, written by Megatron itself: tests/oracles/make_preprocess_fixtures.sh),
// whatever the worker count, chunking, partitioning, compression or line endings; and one clear
// error per kind of bad input.
#include <zlib.h>

#include <catch2/catch.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "app/preprocess_data.h"
#include "core/error.h"
#include "data/preprocess.h"
#include "tests/python_oracle.h"
#include "tests/skip.h"

using namespace mt;
using Catch::Matchers::Contains;
namespace fs = std::filesystem;

namespace {

const std::string kSource = MEGATRAIN_SOURCE_DIR;
const std::string kFixtures = kSource + "/tests/fixtures/preprocess/";

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}
void spit(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
}

std::optional<std::string> shared_data(const char* test) {
  const std::string dir = kSource + "/../shared/data";
  if (!fs::exists(dir + "/gpt2/gpt2-vocab.json") || !fs::exists(dir + "/llama3/tokenizer.json")) {
    mt::test::report_skip(std::string(test) + ": no tokenizer files under " + dir);
    return std::nullopt;
  }
  return dir;
}

TokenizerOptions gpt2(const std::string& data) {
  TokenizerOptions t;
  t.type = "GPT2BPETokenizer";
  t.vocab_file = data + "/gpt2/gpt2-vocab.json";
  t.merge_file = data + "/gpt2/gpt2-merges.txt";
  return t;
}

// Both files of <prefix>_<key>_document equal the fixture's.
void check_same(const std::string& prefix, const std::string& key, const std::string& expected) {
  for (const char* ext : {".bin", ".idx"}) {
    const std::string got = prefix + "_" + key + "_document" + ext;
    const std::string want = kFixtures + expected + "_" + key + "_document" + ext;
    INFO(got << " vs " << want);
    REQUIRE(fs::exists(got));
    CHECK(slurp(got) == slurp(want));
  }
}

PreprocessResult run_quiet(const PreprocessOptions& o) {
  std::ostringstream log;
  return preprocess_data(o, log);
}

void gzip_file(const std::string& src, const std::string& dst) {
  const std::string data = slurp(src);
  gzFile gz = gzopen(dst.c_str(), "wb");
  REQUIRE(gz);
  REQUIRE(gzwrite(gz, data.data(), static_cast<unsigned>(data.size())) == static_cast<int>(data.size()));
  gzclose(gz);
}

}  // namespace

TEST_CASE("preprocess-data writes Megatron's bytes: GPT-2, two keys, --append-eod", "[preprocess]") {
  const auto data = shared_data("preprocess GPT-2 fixture");
  if (!data) return;
  oracle::TempDir dir;
  // Workers, and chunks from one line each up to the whole file: the order must not change.
  for (int workers : {1, 2, 3}) {
    for (size_t chunk : {size_t{1}, size_t{100}, size_t{1} << 20}) {
      INFO("workers " << workers << ", chunk bytes " << chunk);
      PreprocessOptions o;
      o.input = kFixtures + "small.jsonl";
      o.json_keys = {"text", "title"};
      o.output_prefix = dir.file("out");
      o.tokenizer = gpt2(*data);
      o.append_eod = true;
      o.workers = workers;
      o.chunk_bytes = chunk;
      const PreprocessResult r = run_quiet(o);
      CHECK(r.documents == 11);
      check_same(dir.file("out"), "text", "gpt2");
      check_same(dir.file("out"), "title", "gpt2");
    }
  }
}

TEST_CASE("preprocess-data writes Megatron's bytes: no eod, Llama 3 (int32), NullTokenizer", "[preprocess]") {
  const auto data = shared_data("preprocess fixtures");
  if (!data) return;
  oracle::TempDir dir;
  PreprocessOptions o;
  o.input = kFixtures + "small.jsonl";
  o.output_prefix = dir.file("noeod");
  o.tokenizer = gpt2(*data);
  o.workers = 2;
  run_quiet(o);
  check_same(dir.file("noeod"), "text", "gpt2_noeod");

  o.output_prefix = dir.file("llama3");
  o.tokenizer = TokenizerOptions{};
  o.tokenizer.type = "HuggingFaceTokenizer";
  o.tokenizer.tokenizer_model = *data + "/llama3";
  o.append_eod = true;
  run_quiet(o);
  check_same(dir.file("llama3"), "text", "llama3");

  o.input = kFixtures + "null.jsonl";
  o.output_prefix = dir.file("null");
  o.tokenizer = TokenizerOptions{};
  o.tokenizer.type = "NullTokenizer";
  o.tokenizer.vocab_size = 100;
  run_quiet(o);
  check_same(dir.file("null"), "text", "null");
}

TEST_CASE("preprocess-data --partitions: Megatron's document order", "[preprocess]") {
  const auto data = shared_data("preprocess partitions");
  if (!data) return;
  oracle::TempDir dir;
  // The input is a glob with --partitions > 1; here it matches one file.
  fs::copy_file(kFixtures + "small.jsonl", dir.file("in.jsonl"));
  PreprocessOptions o;
  o.input = dir.file("in*.jsonl");
  o.json_keys = {"text", "title"};
  o.output_prefix = dir.file("p2");
  o.tokenizer = gpt2(*data);
  o.append_eod = true;
  o.workers = 2;
  o.partitions = 2;
  o.chunk_bytes = 64;
  run_quiet(o);
  check_same(dir.file("p2"), "text", "gpt2_p2");  // round-robin: partition 0's documents first
  check_same(dir.file("p2"), "title", "gpt2_p2");
  CHECK_FALSE(fs::exists(dir.file("p2_0_text_document.bin")));  // intermediates removed

  o.output_prefix = dir.file("p2seq");
  o.keep_sequential_samples = true;
  o.json_keys = {"text"};
  run_quiet(o);
  check_same(dir.file("p2seq"), "text", "gpt2");  // contiguous partitions keep the order

  o.workers = 3;
  CHECK_THROWS_WITH(run_quiet(o), Contains("--workers 3 is not divisible by --partitions 2"));
}

TEST_CASE("preprocess-data reads gzip input and any line ending the same way", "[preprocess]") {
  const auto data = shared_data("preprocess gzip/CRLF");
  if (!data) return;
  oracle::TempDir dir;
  gzip_file(kFixtures + "small.jsonl", dir.file("small.jsonl.gz"));
  std::string crlf, cr;
  for (char c : slurp(kFixtures + "small.jsonl")) {
    if (c == '\n') crlf += "\r\n", cr += "\r";
    else if (c != '\r') crlf += c, cr += c;
  }
  spit(dir.file("crlf.jsonl"), crlf);
  spit(dir.file("cr.jsonl"), cr.substr(0, cr.size() - 1));  // and no final line ending
  for (const std::string input : {"small.jsonl.gz", "crlf.jsonl", "cr.jsonl"}) {
    for (size_t chunk : {size_t{7}, size_t{1} << 20}) {  // a "\r\n" split across reads
      INFO(input << ", chunk " << chunk);
      PreprocessOptions o;
      o.input = dir.file(input);
      o.json_keys = {"text", "title"};
      o.output_prefix = dir.file("out");
      o.tokenizer = gpt2(*data);
      o.append_eod = true;
      o.workers = 2;
      o.chunk_bytes = chunk;
      CHECK(run_quiet(o).documents == 11);
      check_same(dir.file("out"), "text", "gpt2");
    }
  }
}

TEST_CASE("preprocess-data on many documents: any workers and chunking give the same bytes", "[preprocess]") {
  const auto data = shared_data("preprocess many documents");
  if (!data) return;
  oracle::TempDir dir;
  // 3000 documents built from the fixture lines.
  std::string lines = slurp(kFixtures + "small.jsonl"), big;
  for (int i = 0; i < 300; ++i) big += lines;
  spit(dir.file("big.jsonl"), big);
  std::string reference_bin, reference_idx;
  for (auto [workers, chunk] : {std::pair{1, size_t{1} << 22}, {2, size_t{4096}}, {4, size_t{333}}}) {
    PreprocessOptions o;
    o.input = dir.file("big.jsonl");
    o.output_prefix = dir.file("big");
    o.tokenizer = gpt2(*data);
    o.append_eod = true;
    o.workers = workers;
    o.chunk_bytes = chunk;
    o.log_interval = 1000;
    std::ostringstream log;
    const PreprocessResult r = preprocess_data(o, log);
    CHECK(r.documents == 3300);
    CHECK_THAT(log.str(), Contains("Processed 3000 documents ("));
    const std::string bin = slurp(dir.file("big_text_document.bin")), idx = slurp(dir.file("big_text_document.idx"));
    if (reference_bin.empty()) {
      reference_bin = bin, reference_idx = idx;
      // The fixture's documents, 300 times over.
      const std::string one = slurp(kFixtures + "gpt2_text_document.bin");
      CHECK(bin.size() == 300 * one.size());
      CHECK(bin.substr(0, one.size()) == one);
      CHECK(bin.substr(bin.size() - one.size()) == one);
    } else {
      CHECK(bin == reference_bin);
      CHECK(idx == reference_idx);
    }
  }
}

TEST_CASE("preprocess-data errors name the file, line, key or flag", "[preprocess]") {
  const auto data = shared_data("preprocess errors");
  if (!data) return;
  oracle::TempDir dir;
  auto options = [&](const std::string& input) {
    PreprocessOptions o;
    o.input = input;
    o.output_prefix = dir.file("out");
    o.tokenizer = gpt2(*data);
    o.workers = 2;
    o.chunk_bytes = 16;
    return o;
  };
  auto no_outputs = [&] {
    CHECK_FALSE(fs::exists(dir.file("out_text_document.bin")));
    CHECK_FALSE(fs::exists(dir.file("out_text_document.idx")));
  };
  CHECK_THROWS_WITH(run_quiet(options(dir.file("missing.jsonl"))), Contains("--input '" + dir.file("missing.jsonl") + "': no such file"));

  spit(dir.file("bad.jsonl"), "{\"text\": \"a\"}\n{\"text\": \"b\"}\n{\"text\": \"c\"}\n{\"text\": \"d\",}\n{\"text\": \"e\"}\n");
  CHECK_THROWS_WITH(run_quiet(options(dir.file("bad.jsonl"))),
                    Contains("line 4: not valid JSON") && Contains("Expecting property name enclosed in double quotes"));
  no_outputs();
  spit(dir.file("blank.jsonl"), "{\"text\": \"a\"}\n\n{\"text\": \"c\"}\n");
  CHECK_THROWS_WITH(run_quiet(options(dir.file("blank.jsonl"))), Contains("line 2: not valid JSON") && Contains("Expecting value"));
  spit(dir.file("nokey.jsonl"), "{\"text\": \"a\"}\n{\"txt\": \"b\"}\n");
  CHECK_THROWS_WITH(run_quiet(options(dir.file("nokey.jsonl"))), Contains("line 2 has no key 'text'"));
  no_outputs();
  spit(dir.file("number.jsonl"), "{\"text\": 5}\n");
  CHECK_THROWS_WITH(run_quiet(options(dir.file("number.jsonl"))), Contains("line 1: the value of 'text' is a number"));
  spit(dir.file("lone.jsonl"), "{\"text\": \"x\\ud800y\"}\n");
  CHECK_THROWS_WITH(run_quiet(options(dir.file("lone.jsonl"))), Contains("line 1: the value of 'text' holds an unpaired UTF-16 surrogate"));
  spit(dir.file("notobj.jsonl"), "[1, 2]\n");
  CHECK_THROWS_WITH(run_quiet(options(dir.file("notobj.jsonl"))), Contains("line 1: not valid JSON") && Contains("not a JSON object"));
  spit(dir.file("badutf8.jsonl"), "{\"text\": \"a\xff\"}\n");
  CHECK_THROWS_WITH(run_quiet(options(dir.file("badutf8.jsonl"))), Contains("line 1") && Contains("invalid UTF-8"));

  auto o = options(kFixtures + "small.jsonl");
  o.tokenizer.vocab_file = dir.file("nope.json");
  CHECK_THROWS_WITH(run_quiet(o), Contains("--vocab-file '" + dir.file("nope.json") + "': no such file"));
  o = options(kFixtures + "small.jsonl");
  o.output_prefix = dir.file("no/such/dir/out");
  CHECK_THROWS_WITH(run_quiet(o), Contains("--output-prefix") && Contains("does not exist"));
  o = options(dir.file("*.nothing"));
  o.partitions = 2;
  CHECK_THROWS_WITH(run_quiet(o), Contains("matches no file"));
  o = options(kFixtures + "small.jsonl");
  o.json_keys = {"text", "text"};
  CHECK_THROWS_WITH(run_quiet(o), Contains("--json-keys lists 'text' twice"));
  // A tokenizer.json without tokenizer_config.json has no eos_token: --append-eod cannot work.
  fs::create_directories(dir.file("l3"));
  fs::copy_file(*data + "/llama3/tokenizer.json", dir.file("l3/tokenizer.json"));
  o = options(kFixtures + "small.jsonl");
  o.tokenizer = TokenizerOptions{};
  o.tokenizer.type = "HuggingFaceTokenizer";
  o.tokenizer.tokenizer_model = dir.file("l3");
  o.append_eod = true;
  CHECK_THROWS_WITH(run_quiet(o), Contains("has no end-of-document token"));
}

TEST_CASE("megatrain preprocess-data command line", "[preprocess]") {
  const auto data = shared_data("preprocess command line");
  if (!data) return;
  oracle::TempDir dir;
  const std::string bin = MEGATRAIN_BINARY;
  const std::string common = " --input " + oracle::shell_quote(kFixtures + "small.jsonl") + " --output-prefix " +
                             oracle::shell_quote(dir.file("cli")) + " --tokenizer-type GPT2BPETokenizer --vocab-file " +
                             oracle::shell_quote(*data + "/gpt2/gpt2-vocab.json") + " --merge-file " +
                             oracle::shell_quote(*data + "/gpt2/gpt2-merges.txt");
  const std::string log = dir.file("log.txt");
  auto run = [&](const std::string& args) {
    return std::system((oracle::shell_quote(bin) + " preprocess-data" + args + " > " + log + " 2>&1").c_str());
  };
  REQUIRE(run(common + " --json-keys text title --append-eod --workers 2 --log-interval 5") == 0);
  check_same(dir.file("cli"), "text", "gpt2");
  check_same(dir.file("cli"), "title", "gpt2");
  CHECK_THAT(slurp(log), Contains("Processed 10 documents (") && Contains("docs/s") && Contains("MB/s)."));

  CHECK(run(common + " --workers 2 --split-sentences") != 0);
  CHECK_THAT(slurp(log), Contains("megatrain does not support --split-sentences yet"));
  CHECK(run(common) != 0);  // --workers is required, as in Megatron
  CHECK_THAT(slurp(log), Contains("--workers"));
  CHECK(run(common + " --workers 2 --no-such-flag") != 0);
  CHECK_THAT(slurp(log), Contains("--no-such-flag"));
}

namespace {

// `text` as one gzip member, compressed in memory (level 0: stored blocks, whose bytes are the text).
std::string gzip_member(const std::string& text, int level = Z_DEFAULT_COMPRESSION) {
  z_stream zs{};
  REQUIRE(deflateInit2(&zs, level, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY) == Z_OK);
  std::string out(deflateBound(&zs, static_cast<uLong>(text.size())), '\0');
  zs.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(text.data()));
  zs.avail_in = static_cast<uInt>(text.size());
  zs.next_out = reinterpret_cast<Bytef*>(out.data());
  zs.avail_out = static_cast<uInt>(out.size());
  REQUIRE(deflate(&zs, Z_FINISH) == Z_STREAM_END);
  out.resize(zs.total_out);
  deflateEnd(&zs);
  return out;
}

// NullTokenizer documents ("a b c" token ids), `count` of them from `first`.
std::string null_documents(int first, int count) {
  std::string text;
  for (int i = first; i < first + count; ++i) text += fmt::format("{{\"text\": \"{} {} {}\"}}\n", i % 90, (i * 7) % 90, 3);
  return text;
}

PreprocessOptions null_options(const std::string& input, const std::string& prefix) {
  PreprocessOptions o;
  o.json_keys = {"text"};
  o.input = input;
  o.output_prefix = prefix;
  o.tokenizer.type = "NullTokenizer";
  o.tokenizer.vocab_size = 100;
  o.workers = 2;
  o.chunk_bytes = 4096;
  return o;
}

// The error preprocess_data throws ("(no error)" when it does not).
std::string preprocess_error(const PreprocessOptions& o) {
  try {
    run_quiet(o);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST_CASE("preprocess-data refuses a truncated or damaged .jsonl.gz and leaves no partial dataset", "[preprocess]") {
  oracle::TempDir dir;
  // 2000 NullTokenizer documents; the first half flushed as a whole deflate block so that the
  // file can be cut where the decompressed text ends exactly at a line boundary.
  const std::string first_half = null_documents(0, 1000), second_half = null_documents(1000, 1000);
  const std::string gz = dir.file("in.jsonl.gz");
  uint64_t flushed_at = 0;
  {
    gzFile f = gzopen(gz.c_str(), "wb");
    REQUIRE(f);
    REQUIRE(gzwrite(f, first_half.data(), static_cast<unsigned>(first_half.size())) == static_cast<int>(first_half.size()));
    REQUIRE(gzflush(f, Z_FULL_FLUSH) == Z_OK);
    flushed_at = fs::file_size(gz);
    REQUIRE(gzwrite(f, second_half.data(), static_cast<unsigned>(second_half.size())) == static_cast<int>(second_half.size()));
    REQUIRE(gzclose(f) == Z_OK);
  }
  const std::string whole = slurp(gz);
  REQUIRE(flushed_at > 10);
  REQUIRE(flushed_at < whole.size() - 8);

  PreprocessOptions o = null_options(gz, dir.file("out"));
  // The whole file: every document, under the final names, and no temporary files left.
  CHECK(run_quiet(o).documents == 2000);
  const std::string good_bin = slurp(dir.file("out_text_document.bin")), good_idx = slurp(dir.file("out_text_document.idx"));
  REQUIRE_FALSE(good_bin.empty());

  struct Bad {
    const char* what;
    std::string bytes;
    std::string expected;   // in the one-line error
    bool at_open = false;   // refused when the input is opened, before any output exists
  };
  const std::string truncated = "the gzip stream is truncated", damaged = "the gzip stream is damaged";
  std::string bad_crc = whole;
  bad_crc[bad_crc.size() - 8] ^= 0x55;  // the trailer: CRC-32, then the length mod 2^32
  std::string bad_length = whole;
  bad_length[bad_length.size() - 4] ^= 0x01;
  // Stored (level 0) blocks hold the text itself: a changed byte early in the file inflates to
  // invalid JSON, and only the CRC-32 at the end of the member, 400 KB later, tells that the file is
  // damaged.
  std::string stored = gzip_member(null_documents(0, 20000), 0);
  const size_t line_11 = stored.find(null_documents(10, 1));
  REQUIRE(line_11 != std::string::npos);
  stored[line_11] = 'X';
  const std::string second_member = gzip_member(null_documents(2000, 500));
  const std::vector<Bad> bads = {
      {"cut at a line boundary (after the flushed first half)", whole.substr(0, flushed_at),
       truncated + " (the file ends at byte " + std::to_string(flushed_at) + ", inside gzip member 1, before its trailer)"},
      {"cut mid-line", whole.substr(0, flushed_at + (whole.size() - flushed_at) / 2), truncated},
      {"missing the 8-byte trailer", whole.substr(0, whole.size() - 8), truncated},
      {"missing part of the trailer", whole.substr(0, whole.size() - 3), truncated},
      {"cut in the header", whole.substr(0, 5), truncated},
      {"empty", "", truncated + " (the file is empty)", true},
      {"a wrong CRC-32: where", bad_crc, damaged + " (gzip member 1, near byte "},
      {"a wrong CRC-32: why", bad_crc, "the CRC-32 in its trailer does not match the data): the file is corrupt"},
      {"a wrong length", bad_length, "the length in its trailer does not match the data"},
      {"damaged data that inflates to invalid JSON", stored, "the CRC-32 in its trailer does not match the data"},
      {"a second member cut short", whole + second_member.substr(0, second_member.size() / 2),
       "inside gzip member 2, before its trailer"},
      {"a second member cut after its first byte", whole + second_member.substr(0, 1), "inside gzip member 2"},
      {"a second member missing its trailer", whole + second_member.substr(0, second_member.size() - 8),
       "inside gzip member 2"},
      {"trailing garbage", whole + "{\"text\": \"1 2 3\"}\n",
       damaged + " (byte " + std::to_string(whole.size()) + " follows the end of gzip member 1 but does not start "
                 "another member; gzip -t calls this trailing garbage)"},
      {"a member after zero padding", whole + std::string(4, '\0') + second_member, "trailing garbage"},
      {"not gzip at all", first_half, "not in gzip format", true},
  };
  for (const Bad& bad : bads) {
    INFO(bad.what);
    const std::string path = dir.file("bad.jsonl.gz");
    spit(path, bad.bytes);
    o.input = path;
    const std::string error = preprocess_error(o);
    CHECK_THAT(error, Contains("--input '" + path + "'") && Contains(bad.expected));
    if (!bad.at_open) CHECK_THAT(error, Contains("; nothing was written"));
    CHECK(error.find("not valid JSON") == std::string::npos);
    CHECK(error.find('\n') == std::string::npos);
    // The earlier complete output is untouched and nothing partial is left beside it.
    CHECK(slurp(dir.file("out_text_document.bin")) == good_bin);
    CHECK(slurp(dir.file("out_text_document.idx")) == good_idx);
    for (const auto& e : fs::directory_iterator(dir.path())) CHECK(e.path().filename().string().find(".tmp.") == std::string::npos);
    // A fresh output prefix is not created at all.
    o.output_prefix = dir.file("fresh");
    CHECK_THAT(preprocess_error(o), Contains(bad.expected));
    CHECK_FALSE(fs::exists(dir.file("fresh_text_document.bin")));
    CHECK_FALSE(fs::exists(dir.file("fresh_text_document.idx")));
    o.output_prefix = dir.file("out");
  }
}

TEST_CASE("preprocess-data reads concatenated gzip members and zero padding as gzip does", "[preprocess]") {
  oracle::TempDir dir;
  const std::string a = null_documents(0, 1500), b = null_documents(1500, 700);
  spit(dir.file("plain.jsonl"), a + b);
  PreprocessOptions o = null_options(dir.file("plain.jsonl"), dir.file("plain"));
  REQUIRE(run_quiet(o).documents == 2200);
  const std::string want_bin = slurp(dir.file("plain_text_document.bin"));
  const std::string want_idx = slurp(dir.file("plain_text_document.idx"));
  struct Good {
    const char* what;
    std::string name, bytes;
  };
  const std::vector<Good> goods = {
      {"two members (cat a.gz b.gz)", "two.jsonl.gz", gzip_member(a) + gzip_member(b)},
      // A member may end mid-line: the line continues in the next one.
      {"a line split across members", "split.jsonl.gz", gzip_member(a + b.substr(0, 10)) + gzip_member(b.substr(10))},
      {"an empty member between", "empty_member.jsonl.gz", gzip_member(a) + gzip_member("") + gzip_member(b)},
      {"zero padding after the last member", "padded.jsonl.gz", gzip_member(a + b) + std::string(100, '\0')},
      {"gzip content under a name without .gz", "named_plain.jsonl", gzip_member(a) + gzip_member(b)},
  };
  for (const Good& good : goods) {
    INFO(good.what);
    spit(dir.file(good.name), good.bytes);
    o = null_options(dir.file(good.name), dir.file("gz"));
    CHECK(run_quiet(o).documents == 2200);
    CHECK(slurp(dir.file("gz_text_document.bin")) == want_bin);
    CHECK(slurp(dir.file("gz_text_document.idx")) == want_idx);
  }
}

TEST_CASE("preprocess-data refuses zstd/xz/lz4/bzip2 input by name before writing anything", "[preprocess]") {
  oracle::TempDir dir;
  const std::string rest = std::string("\x00\x01\x02\x03\x04\x05\x06\x07", 8) + "more bytes";
  const std::vector<std::pair<std::string, std::string>> formats = {
      {"zstd", std::string("\x28\xb5\x2f\xfd", 4) + rest},
      {"xz", std::string("\xfd" "7zXZ\x00", 6) + rest},
      {"lz4", std::string("\x04\x22\x4d\x18", 4) + rest},
      {"bzip2", std::string("BZh9\x31\x41\x59\x26\x53\x59", 10) + rest},
  };
  for (const auto& [format, bytes] : formats) {
    INFO(format);
    const std::string path = dir.file("in.jsonl." + format);
    spit(path, bytes);
    PreprocessOptions o = null_options(path, dir.file("out"));
    CHECK_THAT(preprocess_error(o), Contains("--input '" + path + "' is compressed with " + format) &&
                                        Contains("decompress it with"));
    CHECK(fs::directory_iterator(dir.path()) != fs::directory_iterator());
    for (const auto& e : fs::directory_iterator(dir.path())) CHECK(e.path().filename().string().rfind("out", 0) != 0);
  }
  // Text that merely starts with "BZh" is read as text (and fails as JSON).
  spit(dir.file("bzh.jsonl"), "BZh9 is not JSON\n");
  CHECK_THAT(preprocess_error(null_options(dir.file("bzh.jsonl"), dir.file("out"))),
             Contains("line 1: not valid JSON"));
}

TEST_CASE("megatrain preprocess-data: a truncated .jsonl.gz exits non-zero with one line and no dataset", "[preprocess]") {
  oracle::TempDir dir;
  const std::string whole = gzip_member(null_documents(0, 3000));
  const std::string cut = dir.file("cut.jsonl.gz");
  spit(cut, whole.substr(0, whole.size() - 8));
  const std::string log = dir.file("log.txt");
  const std::string cmd = oracle::shell_quote(MEGATRAIN_BINARY) + " preprocess-data --input " + oracle::shell_quote(cut) +
                          " --output-prefix " + oracle::shell_quote(dir.file("out")) +
                          " --tokenizer-type NullTokenizer --vocab-size 100 --workers 2 > " + oracle::shell_quote(log) +
                          " 2>&1";
  const int status = std::system(cmd.c_str());
  CHECK(status != 0);
  const std::string out = slurp(log);
  // Progress lines, then the error: one line naming the file.
  const size_t error_at = out.find("megatrain preprocess-data: error: ");
  REQUIRE(error_at != std::string::npos);
  const std::string error = out.substr(error_at);
  CHECK(std::count(error.begin(), error.end(), '\n') == 1);
  CHECK_THAT(error, Contains("--input '" + cut + "': the gzip stream is truncated") && Contains("nothing was written"));
  CHECK_FALSE(fs::exists(dir.file("out_text_document.bin")));
  CHECK_FALSE(fs::exists(dir.file("out_text_document.idx")));
  for (const auto& e : fs::directory_iterator(dir.path())) CHECK(e.path().filename().string().find(".tmp.") == std::string::npos);
}
