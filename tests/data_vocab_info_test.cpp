// Vocabulary size and EOD id from tokenizer files, and the dataset files check (.idx header, index
// against its .bin).
#include "tests/cli_test_util.h"

#include "core/config.h"
#include "data/blend_spec.h"
#include "data/idx_header.h"
#include "data/vocab_info.h"

using namespace mt;
using namespace mt::test;
using Catch::Contains;

TEST_CASE("vocab_info: NullTokenizer", "[data][vocab]") {
  DataConfig n;
  n.tokenizer_type = "NullTokenizer";
  n.vocab_size = 128256;
  CHECK(vocab_info(n).size == 128256);
  CHECK(vocab_info(n).eod == 128255);
}

TEST_CASE("vocab_info: GPT-2, Llama 3 and Llama 2 tokenizer files", "[data][vocab]") {
  MT_REQUIRE_SHARED_DATA(dir);
  DataConfig g;
  g.vocab_file = dir + "/gpt2/gpt2-vocab.json";
  g.merge_file = dir + "/gpt2/gpt2-merges.txt";
  const VocabInfo v = vocab_info(g);  // default type: GPT2BPETokenizer
  CHECK(v.size == 50257);
  CHECK(v.eod == 50256);
  DataConfig h;
  h.tokenizer_type = "HuggingFaceTokenizer";
  h.tokenizer_model = dir + "/llama3/tokenizer.json";
  CHECK(vocab_info(h).size == 128256);
  CHECK(vocab_info(h).eod == 128001);
  h.tokenizer_model = dir + "/llama2";
  CHECK(vocab_info(h).size == 32000);
  CHECK(vocab_info(h).eod == 2);
}

TEST_CASE("vocab_info: a Unigram tokenizer.json counts its vocabulary array", "[data][vocab]") {
  TempDir d;
  std::ofstream(d.str("tokenizer.json"))
      << R"({"added_tokens":[{"id":0,"content":"<pad>"},{"id":5,"content":"</s>"}],)"
      << R"("model":{"type":"Unigram","vocab":[["<pad>",0.0],["a",-1.0],["b",-2.0],["c",-3.0]]}})";
  DataConfig h;
  h.tokenizer_type = "HuggingFaceTokenizer";
  h.tokenizer_model = d.path.string();
  const VocabInfo v = vocab_info(h);
  CHECK(v.size == 6);  // max id 5 (an added token) + 1
  CHECK(v.eod == 5);
  std::ofstream(d.str("tokenizer.json")) << "{ not json";
  CHECK_THROWS_WITH(vocab_info(h), Contains("not valid JSON"));
}

TEST_CASE("idx header: valid, truncated, wrong dtype", "[data][idx]") {
  TempDir d;
  write_dataset(d.str("ds"), 3, 10);
  const IdxHeader h = check_indexed_dataset(d.str("ds"), "--data-path");
  CHECK(h.version == 1);
  CHECK(h.dtype_code == 8);
  CHECK(h.sequence_count == 3);
  CHECK(h.document_count == 4);
  std::filesystem::resize_file(d.str("ds.idx"), 40);
  CHECK_THROWS_WITH(read_idx_header(d.str("ds.idx")), Contains("truncated"));
  write_dataset(d.str("dt"), 1, 4);
  {
    std::fstream f(d.str("dt.idx"), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(17);
    f.put(9);
  }
  CHECK_THROWS_WITH(read_idx_header(d.str("dt.idx")), Contains("unknown token dtype code 9"));
}

TEST_CASE("indexed dataset check for --data-path and --dry-run: a .idx whose dtype byte was changed is refused",
          "[data][idx]") {
  TempDir d;
  // A uint16 dataset whose .idx then says uint8: every header check passes (the .bin's size is a
  // multiple of 1), but the .bin holds twice the bytes the index accounts for and the pointers
  // were written for 2-byte tokens. The check --dry-run and start-up run refuse it in one line
  // naming both files.
  auto flip_to_uint8 = [&](const std::string& prefix) {
    std::fstream f(prefix + ".idx", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(17);
    f.put(1);  // uint8
  };
  auto error_of = [](const std::string& prefix) -> std::string {
    try {
      check_indexed_dataset(prefix, "--data-path");
    } catch (const Error& e) {
      return e.what();
    }
    FAIL_CHECK("check_indexed_dataset accepted " << prefix);
    return "";
  };
  write_dataset(d.str("three"), 3, 10);
  CHECK(check_indexed_dataset(d.str("three"), "--data-path").dtype_code == 8);
  flip_to_uint8(d.str("three"));
  const std::string three = error_of(d.str("three"));
  CHECK_THAT(three, Contains(d.str("three.idx") + " and " + d.str("three.bin") + " disagree") &&
                        Contains("sequence 1 starts at byte 20") && Contains("at byte 10") &&
                        Contains("2-byte tokens"));
  CHECK(three.find('\n') == std::string::npos);
  // One sequence: no second pointer to disagree; the sizes do (4 uint8 tokens, an 8-byte .bin).
  write_dataset(d.str("one"), 1, 4);
  flip_to_uint8(d.str("one"));
  const std::string one = error_of(d.str("one"));
  CHECK_THAT(one, Contains(d.str("one.idx") + " and " + d.str("one.bin") + " disagree") &&
                      Contains("dtype uint8 end at byte 4") && Contains("has 8 bytes") &&
                      Contains("2 times the index's bytes"));
  CHECK(one.find('\n') == std::string::npos);
}

TEST_CASE("blend and split arguments", "[data][blend]") {
  const BlendSpec b = blend_from_list({"0.3", "a", "0.7", " b "}, "--data-path");
  CHECK(b.prefixes == std::vector<std::string>{"a", "b"});
  CHECK(b.weights == std::vector<double>{0.3, 0.7});
  CHECK(blend_from_list({"a", "b"}, "--data-path").weights.empty());  // even, but not numbers: all prefixes
  CHECK(blend_from_list({"a"}, "--data-path").prefixes == std::vector<std::string>{"a"});
  const auto s = parse_split("969, 30, 1");
  CHECK(s[0] == Approx(0.969));
  CHECK(s[1] == Approx(0.03));
  CHECK(s[2] == Approx(0.001));
  CHECK(parse_split("'99,1,0'")[0] == Approx(0.99));
  CHECK(parse_split("100")[0] == 1.0);
  CHECK_THROWS_WITH(parse_split("1,2,3,4"), Contains("has 4 numbers"));
  CHECK_THROWS_WITH(parse_split("0,0,0"), Contains("sum to 0"));
}
