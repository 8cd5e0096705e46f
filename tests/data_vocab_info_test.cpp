// Vocabulary size and EOD id from tokenizer files, and the .idx header check.
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
