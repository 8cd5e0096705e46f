// Tokenizers: token ids equal to the reference libraries' (Hugging Face `tokenizers`,
// `sentencepiece`), from committed fixtures (tests/fixtures/tokenizers/, made by
// tests/oracles/make_tokenizer_fixtures.py) and, where the checkout's .venv Python exists, live on a
// few hundred KB of text. Tokenizer files come from ../shared/data; tests skip visibly without them.
#include <sentencepiece_trainer.h>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>

#include "core/config.h"
#include "core/error.h"
#include "data/pretokenizer.h"
#include "data/tokenizer.h"
#include "data/unicode_classes.h"
#include "data/utf8.h"
#include "data/vocab_info.h"
#include "tests/python_oracle.h"
#include "tests/skip.h"

using namespace mt;
using Catch::Matchers::Contains;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

const std::string kSource = MEGATRAIN_SOURCE_DIR;

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
json load_json(const std::string& path) { return json::parse(slurp(path)); }

// ../shared/data, or nullopt after a visible WARN.
std::optional<std::string> shared_data(const char* test) {
  const std::string dir = kSource + "/../shared/data";
  if (!fs::exists(dir + "/gpt2/gpt2-vocab.json") || !fs::exists(dir + "/llama3/tokenizer.json") ||
      !fs::exists(dir + "/llama2/tokenizer.json")) {
    mt::test::report_skip(std::string(test) + ": no tokenizer files under " + dir);
    return std::nullopt;
  }
  return dir;
}

// Meta's released Llama 3 tokenizer.json has a TemplateProcessing post-processor adding
// <|begin_of_text|>; the shared copy does not. Same change as make_tokenizer_fixtures.py.
void write_llama3_bos(const std::string& data, const std::string& dir) {
  json j = load_json(data + "/llama3/tokenizer.json");
  j["post_processor"] = json::parse(R"({"type": "Sequence", "processors": [
      {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true},
      {"type": "TemplateProcessing",
       "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
       "pair": [],
       "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [128000], "tokens": ["<|begin_of_text|>"]}}}]})");
  fs::create_directories(dir);
  spit(dir + "/tokenizer.json", j.dump());
  fs::copy_file(data + "/llama3/tokenizer_config.json", dir + "/tokenizer_config.json");
}

// The Llama 2 model with a Metaspace pre-tokenizer/decoder instead of the normalizer (newer
// conversions of SentencePiece models). Same change as make_tokenizer_fixtures.py.
void write_llama2_metaspace(const std::string& data, const std::string& dir, const std::string& scheme, bool split) {
  json j = load_json(data + "/llama2/tokenizer.json");
  j["normalizer"] = nullptr;
  const json meta = {{"type", "Metaspace"}, {"replacement", "\u2581"}, {"prepend_scheme", scheme}, {"split", split}};
  j["pre_tokenizer"] = meta;
  j["decoder"] = {{"type", "Sequence"}, {"decoders", {meta, {{"type", "ByteFallback"}}, {{"type", "Fuse"}}}}};
  fs::create_directories(dir);
  spit(dir + "/tokenizer.json", j.dump());
  fs::copy_file(data + "/llama2/tokenizer_config.json", dir + "/tokenizer_config.json");
}

struct Named {
  std::string name;
  json spec;  // for the oracle
  std::unique_ptr<Tokenizer> tokenizer;
  int32_t eod;
};

// All the tokenizer variants, the derived tokenizer.json files written under tmp.
std::vector<Named> all_tokenizers(const std::string& data, const std::string& tmp) {
  const std::string bos_dir = tmp + "/llama3_bos", first_dir = tmp + "/llama2_ms_first", split_dir = tmp + "/llama2_ms_split";
  if (!fs::exists(bos_dir)) {
    write_llama3_bos(data, bos_dir);
    write_llama2_metaspace(data, first_dir, "first", false);
    write_llama2_metaspace(data, split_dir, "always", true);
  }
  std::vector<Named> out;
  const std::string vocab = data + "/gpt2/gpt2-vocab.json", merges = data + "/gpt2/gpt2-merges.txt";
  out.push_back({"gpt2", {{"kind", "gpt2"}, {"vocab", vocab}, {"merges", merges}}, make_gpt2_bpe_tokenizer(vocab, merges), 50256});
  out.push_back({"llama3", {{"kind", "hf"}, {"path", data + "/llama3"}}, make_huggingface_tokenizer(data + "/llama3", true), 128001});
  out.push_back({"llama3_bos", {{"kind", "hf"}, {"path", bos_dir}}, make_huggingface_tokenizer(bos_dir, true), 128001});
  out.push_back({"llama2", {{"kind", "hf"}, {"path", data + "/llama2"}}, make_huggingface_tokenizer(data + "/llama2", true), 2});
  out.push_back({"llama2_ms_first", {{"kind", "hf"}, {"path", first_dir}}, make_huggingface_tokenizer(first_dir, true), 2});
  out.push_back({"llama2_ms_split", {{"kind", "hf"}, {"path", split_dir}}, make_huggingface_tokenizer(split_dir, true), 2});
  return out;
}

// Runs the oracle script in `mode` on spec; returns its JSON output.
json run_oracle(const std::string& python, const oracle::TempDir& dir, const std::string& mode, const json& spec) {
  const std::string spec_path = dir.file("spec.json");
  spit(spec_path, spec.dump());
  const std::string out = oracle::run_capture(oracle::shell_quote(python) + " " +
                                            oracle::shell_quote(kSource + "/tests/oracles/make_tokenizer_fixtures.py") + " " +
                                            mode + " " + oracle::shell_quote(spec_path));
  return json::parse(out);
}

// Perl's documentation (Debian perl-doc): real English text.
std::string pod_text(size_t limit) {
  std::vector<fs::path> files;
  for (const auto& dir : {"/usr/share/perl/5.36.0/pod", "/usr/share/perl/5.36/pod"}) {
    std::error_code ec;
    if (!fs::is_directory(dir, ec)) continue;
    for (const auto& e : fs::directory_iterator(dir))
      if (e.path().extension() == ".pod") files.push_back(e.path());
    break;
  }
  std::error_code perl_ec;
  if (files.empty() && fs::is_directory("/usr/share/perl", perl_ec)) {
    for (const auto& e : fs::directory_iterator("/usr/share/perl")) {
      const fs::path pod = e.path() / "pod";
      std::error_code ec;
      if (!fs::is_directory(pod, ec)) continue;
      for (const auto& f : fs::directory_iterator(pod))
        if (f.path().extension() == ".pod") files.push_back(f.path());
      break;
    }
  }
  std::sort(files.begin(), files.end());
  std::string text;
  for (const auto& f : files) {
    text += slurp(f.string());
    if (text.size() >= limit) break;
  }
  // Cut at a character boundary and keep it valid UTF-8 (pod files are).
  size_t cut = std::min(limit, text.size());
  while (cut > 0 && cut < text.size() && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) --cut;
  text.resize(cut);
  return text;
}

// Strings that stress the pre-tokenization rules: every class of character the patterns
// distinguish, contractions in both cases, CR/LF runs, mixed whitespace.
std::vector<std::string> tricky_strings(size_t count, uint32_t seed) {
  const std::vector<std::string> atoms = {
      "a", "Z", "word", "é", "ß", "ſ", "Ω", "中文", "한", "\u1C89", "x\u0301", "\u0915\u094d",  // letters (+ marks)
      "0", "7", "123", "4567", "\u0663", "\u216B", "\u00BD",                              // numbers (Nd, Nl, No)
      " ", " ", "  ", "\t", "\n", "\n\n", "\r", "\r\n", "\u00A0", "\u3000", "\u2028", "\u0085", "\v", "\f",
      "\u200B", "\u180E", "\x1c",                                                          // not White_Space
      "'", "\"", ".", ",", "!", "-", "_", "(", "\u2026", "\u2014", "\U0001F600", "\u200D", "\uFEFF", "\x01", "\x1b",
      "'s", "'S", "'t", "'T", "'re", "'RE", "'Re", "'ve", "'VE", "'m", "'M", "'ll", "'LL", "'lL", "'d", "'D", "'\u017F",
      "<|endoftext|>", "<|begin_of_text|>", "<s>", "</s>"};
  std::mt19937 rng(seed);
  std::vector<std::string> out;
  for (size_t i = 0; i < count; ++i) {
    const size_t n = 1 + rng() % 40;
    std::string s;
    for (size_t k = 0; k < n; ++k) s += atoms[rng() % atoms.size()];
    out.push_back(s);
  }
  return out;
}

std::vector<int32_t> to_ids(const json& j) { return j.get<std::vector<int32_t>>(); }

}  // namespace

TEST_CASE("unicode classes: letters, numbers and White_Space as Oniguruma defines them", "[tokenizer]") {
  using namespace unicode;
  CHECK(is_letter('a'));
  CHECK(is_letter(0x017F));   // long s
  CHECK(is_letter(0x1C89));   // new in Unicode 16
  CHECK(is_letter(0x4E2D));   // CJK
  CHECK_FALSE(is_letter(0x0301));  // combining mark (Mn)
  CHECK(is_number('7'));
  CHECK(is_number(0x216B));   // Nl
  CHECK(is_number(0x00BD));   // No
  CHECK_FALSE(is_number('a'));
  for (uint32_t cp : {0x09u, 0x0Au, 0x0Bu, 0x0Cu, 0x0Du, 0x20u, 0x85u, 0xA0u, 0x1680u, 0x2000u, 0x200Au, 0x2028u,
                      0x2029u, 0x202Fu, 0x205Fu, 0x3000u})
    CHECK(is_space(cp));
  for (uint32_t cp : {0x1Cu, 0x1Fu, 0x200Bu, 0x180Eu, 0xFEFFu, 0xD800u, 0x110000u}) CHECK_FALSE(is_space(cp));
}

TEST_CASE("unicode classes equal the oracle's for every code point", "[tokenizer][oracle]") {
  const auto python = oracle::python_or_skip("unicode classes oracle");
  if (!python) return;
  oracle::TempDir dir;
  const json ranges = json::parse(oracle::run_capture(oracle::shell_quote(*python) + " " +
                                                    oracle::shell_quote(kSource + "/tests/oracles/make_tokenizer_fixtures.py") +
                                                    " unicode"));
  for (const auto& [name, bit] : {std::pair<std::string, uint8_t>{"L", unicode::kLetter}, {"N", unicode::kNumber},
                                  {"S", unicode::kSpace}}) {
    std::vector<bool> expected(0x110000, false);
    for (const json& r : ranges.at(name))
      for (uint32_t c = r[0].get<uint32_t>(); c <= r[1].get<uint32_t>(); ++c) expected[c] = true;
    size_t mismatches = 0;
    for (uint32_t c = 0; c < 0x110000; ++c) {
      if (c >= 0xD800 && c <= 0xDFFF) continue;
      if (((unicode::classes(c) & bit) != 0) != expected[c]) {
        if (mismatches++ < 5) UNSCOPED_INFO("class " << name << " differs at U+" << std::hex << c);
      }
    }
    CHECK(mismatches == 0);
  }
}

TEST_CASE("pre-tokenizer matchers split exactly as the oracle's regexes", "[tokenizer][oracle]") {
  const auto python = oracle::python_or_skip("pre-tokenizer oracle");
  if (!python) return;
  oracle::TempDir dir;
  const std::vector<std::string> texts = tricky_strings(400, 1234);
  for (SplitPattern p : {SplitPattern::gpt2, SplitPattern::cl100k, SplitPattern::qwen2}) {
    REQUIRE(recognize_split_pattern(split_pattern_regex(p)) == p);
    const json out = run_oracle(*python, dir, "pretokenize", {{"regex", split_pattern_regex(p)}, {"texts", texts}});
    size_t bad = 0;
    for (size_t i = 0; i < texts.size(); ++i) {
      std::vector<std::string> ours;
      split_text(p, texts[i], [&](std::string_view w) { ours.emplace_back(w); });
      const auto expected = out["pieces"][i].get<std::vector<std::string>>();
      if (ours != expected && bad++ < 3) UNSCOPED_INFO("pattern " << split_pattern_regex(p) << " text #" << i << " differs: " << json(texts[i]).dump());
    }
    CHECK(bad == 0);
  }
}

TEST_CASE("tokenizer fixtures: ids equal the reference libraries'", "[tokenizer]") {
  const auto data = shared_data("tokenizer fixtures");
  if (!data) return;
  oracle::TempDir dir;
  const std::string fixtures = kSource + "/tests/fixtures/tokenizers/";
  const auto texts = load_json(fixtures + "texts.json").get<std::vector<std::string>>();
  REQUIRE(texts.size() > 100);
  for (Named& t : all_tokenizers(*data, dir.path())) {
    INFO("tokenizer " << t.name);
    {
      const json fixture = load_json(fixtures + t.name + ".json");
      CHECK(t.tokenizer->vocab_size() == fixture["vocab_size"].get<int64_t>());
      CHECK(t.tokenizer->eod() == t.eod);
      REQUIRE(fixture["ids"].size() == texts.size());
      size_t bad = 0;
      for (size_t i = 0; i < texts.size(); ++i) {
        if (t.tokenizer->encode(texts[i]) != to_ids(fixture["ids"][i]) && bad++ < 3)
          UNSCOPED_INFO(t.name << " text #" << i << " differs: " << json(texts[i]).dump().substr(0, 200));
      }
      CHECK(bad == 0);
    }
  }
}

TEST_CASE("tokenizers equal the oracle on a few hundred KB of pod text and tricky strings", "[tokenizer][oracle]") {
  const auto data = shared_data("tokenizer live oracle");
  if (!data) return;
  const auto python = oracle::python_or_skip("tokenizer live oracle");
  if (!python) return;
  oracle::TempDir dir;
  // ~300 KB of real text as documents of a few KB, plus the tricky strings (long words included).
  const std::string pod = pod_text(300 * 1024);
  if (pod.size() < 200 * 1024) {
    mt::test::report_skip("tokenizer live oracle: no Perl pod text under /usr/share/perl (install perl-doc)");
    return;
  }
  std::vector<std::string> texts = tricky_strings(300, 99);
  for (size_t i = 0; i < pod.size();) {
    size_t end = std::min(pod.size(), i + 4096);
    while (end < pod.size() && (static_cast<unsigned char>(pod[end]) & 0xC0) == 0x80) ++end;
    texts.push_back(pod.substr(i, end - i));
    i = end;
  }
  for (Named& t : all_tokenizers(*data, dir.path())) {
    INFO("tokenizer " << t.name);
    {
      json spec = t.spec;
      spec["texts"] = texts;
      std::vector<std::vector<int32_t>> ours;
      for (const std::string& s : texts) ours.push_back(t.tokenizer->encode(s));
      spec["decode"] = std::vector<std::vector<int32_t>>(ours.begin(), ours.begin() + 300);
      const json out = run_oracle(*python, dir, "ids", spec);
      CHECK(t.tokenizer->vocab_size() == out["vocab_size"].get<int64_t>());
      size_t bad = 0, tokens = 0;
      for (size_t i = 0; i < texts.size(); ++i) {
        tokens += ours[i].size();
        if (ours[i] != to_ids(out["ids"][i]) && bad++ < 3)
          UNSCOPED_INFO(t.name << " text #" << i << " differs: " << json(texts[i]).dump().substr(0, 300));
      }
      CHECK(bad == 0);
      CHECK(tokens > 50000);
      size_t bad_decode = 0;
      for (size_t i = 0; i < 300; ++i)
        if (t.tokenizer->decode(ours[i]) != out["decoded"][i].get<std::string>() && bad_decode++ < 3)
          UNSCOPED_INFO(t.name << " decode of text #" << i << " differs");
      CHECK(bad_decode == 0);
    }
  }
}

TEST_CASE("the training side's vocab_info agrees with the tokenizers", "[tokenizer]") {
  const auto data = shared_data("vocab_info agreement");
  if (!data) return;
  DataConfig d;
  d.tokenizer_type = "GPT2BPETokenizer";
  d.vocab_file = *data + "/gpt2/gpt2-vocab.json";
  d.merge_file = *data + "/gpt2/gpt2-merges.txt";
  auto t = build_tokenizer(tokenizer_options(d));
  CHECK(vocab_info(d).size == t->vocab_size());
  CHECK(vocab_info(d).eod == t->eod());
  for (const char* name : {"llama3", "llama2"}) {
    DataConfig h;
    h.tokenizer_type = "HuggingFaceTokenizer";
    h.tokenizer_model = *data + "/" + name;
    auto ht = build_tokenizer(tokenizer_options(h));
    CHECK(vocab_info(h).size == ht->vocab_size());
    CHECK(vocab_info(h).eod == ht->eod());
  }
  DataConfig n;
  n.tokenizer_type = "NullTokenizer";
  n.vocab_size = 1000;
  n.null_tokenizer_eod_id = 5;
  auto nt = build_tokenizer(tokenizer_options(n));
  CHECK(nt->eod() == 5);
  CHECK(vocab_info(n).eod == 5);
  CHECK(vocab_info(n).size == nt->vocab_size());
}

TEST_CASE("tokenizer.json readers: merge pairs, member order and the DOM fallback agree", "[tokenizer]") {
  const auto data = shared_data("tokenizer.json variants");
  if (!data) return;
  oracle::TempDir dir;
  auto original = make_huggingface_tokenizer(*data + "/llama3", true);
  json j = load_json(*data + "/llama3/tokenizer.json");
  // Current `tokenizers` writes merges as ["a", "b"] pairs; nlohmann writes members sorted
  // ("merges" before "vocab", unlike the original file).
  json pairs = json::array();
  for (const json& m : j["model"]["merges"]) {
    const std::string s = m.get<std::string>();
    pairs.push_back({s.substr(0, s.find(' ')), s.substr(s.find(' ') + 1)});
  }
  j["model"]["merges"] = pairs;
  fs::create_directories(dir.file("pairs"));
  spit(dir.file("pairs/tokenizer.json"), j.dump());
  fs::copy_file(*data + "/llama3/tokenizer_config.json", dir.file("pairs/tokenizer_config.json"));
  auto from_pairs = make_huggingface_tokenizer(dir.file("pairs"), true);
  // A float id sends the file down the DOM path, which must give the same tokenizer too.
  j["model"]["vocab"]["!"] = 0.0;
  spit(dir.file("pairs/tokenizer.json"), j.dump());
  CHECK_THROWS_AS(make_huggingface_tokenizer(dir.file("pairs"), true), Error);
  j["model"]["vocab"]["!"] = 0;
  j["model"]["ignore_merges"] = true;  // last member now, after the big tables (sorted order)
  spit(dir.file("pairs/tokenizer.json"), j.dump(2));
  auto indented = make_huggingface_tokenizer(dir.file("pairs"), true);
  for (const std::string& text : tricky_strings(100, 3)) {
    const auto ids = original->encode(text);
    CHECK(from_pairs->encode(text) == ids);
    CHECK(indented->encode(text) == ids);
  }
  CHECK(from_pairs->vocab_size() == original->vocab_size());
}

TEST_CASE("byte-level tokenizers decode what they encode", "[tokenizer]") {
  const auto data = shared_data("decode round trip");
  if (!data) return;
  auto gpt2 = make_gpt2_bpe_tokenizer(*data + "/gpt2/gpt2-vocab.json", *data + "/gpt2/gpt2-merges.txt");
  auto llama3 = make_huggingface_tokenizer(*data + "/llama3", true);
  for (const std::string& s : tricky_strings(200, 7)) {
    CHECK(gpt2->decode(gpt2->encode(s)) == s);
    CHECK(llama3->decode(llama3->encode(s)) == s);
  }
  // Bytes that are not UTF-8 on their own decode to U+FFFD, as the HF decoder does: "é" is the
  // bytes C3 A9, whose byte-level tokens are "Ã" and "©".
  const json vocab = load_json(*data + "/gpt2/gpt2-vocab.json");
  const int32_t c3 = vocab.at("\u00C3").get<int32_t>(), a9 = vocab.at("\u00A9").get<int32_t>();
  CHECK(gpt2->decode({c3, a9}) == "\u00E9");
  CHECK(gpt2->decode({c3}) == "\uFFFD");
  CHECK(gpt2->decode({a9, c3, a9}) == "\uFFFD\u00E9");
}

TEST_CASE("tokenizer clones encode independently on threads", "[tokenizer]") {
  const auto data = shared_data("tokenizer clones");
  if (!data) return;
  auto base = make_huggingface_tokenizer(*data + "/llama3", true);
  const std::string text = pod_text(64 * 1024) + tricky_strings(50, 11)[0];
  const std::vector<int32_t> expected = base->encode(text);
  REQUIRE(!expected.empty());
  std::vector<std::vector<int32_t>> got(3);
  std::vector<std::thread> threads;
  for (int i = 0; i < 3; ++i)
    threads.emplace_back([&, i, t = std::shared_ptr<Tokenizer>(base->clone())] { got[i] = t->encode(text); });
  for (auto& th : threads) th.join();
  for (const auto& g : got) CHECK(g == expected);
}

TEST_CASE("SentencePiece tokenizers: a model trained here gives the Python package's ids", "[tokenizer][oracle]") {
  const auto python = oracle::python_or_skip("SentencePiece oracle");
  if (!python) return;
  oracle::TempDir dir;
  const std::string corpus = pod_text(400 * 1024);
  if (corpus.size() < 100 * 1024) {
    mt::test::report_skip("SentencePiece test: no Perl pod text under /usr/share/perl (install perl-doc)");
    return;
  }
  spit(dir.file("train.txt"), corpus.substr(0, corpus.size() / 2));
  const std::string held_out = corpus.substr(corpus.size() / 2);
  for (const std::string type : {"bpe", "unigram"}) {
    INFO("model_type " << type);
    {
      const std::string prefix = dir.file("sp_" + type);
      const auto status = sentencepiece::SentencePieceTrainer::Train(
          "--input=" + dir.file("train.txt") + " --model_prefix=" + prefix + " --vocab_size=600 --model_type=" + type +
          " --byte_fallback=true --character_coverage=1.0 --num_threads=2 --minloglevel=2 --max_sentence_length=100000");
      REQUIRE(status.ok());
      for (const std::string name : {"SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"}) {
        TokenizerOptions o;
        o.type = name;
        o.tokenizer_model = prefix + ".model";
        auto t = build_tokenizer(o);
        CHECK(t->vocab_size() == 600);
        CHECK(t->eod() == 2);  // the trainer's default eos_id; HEAD's eod = eos_id()
        CHECK(t->name() == name);
      }
      TokenizerOptions o;
      o.type = "Llama2Tokenizer";
      o.tokenizer_model = prefix + ".model";
      auto t = build_tokenizer(o);
      DataConfig d;  // what training reads: the same vocabulary size and eod
      d.tokenizer_type = o.type;
      d.tokenizer_model = o.tokenizer_model;
      CHECK(vocab_info(d).size == 600);
      CHECK(vocab_info(d).eod == 2);
      const std::string sample = "Hello world, it's a test: \u00e9\u00e8 \u4e2d\u6587 \U0001F600.";
      const auto ids = t->encode(sample);
      CHECK(ids.front() != 1);  // no BOS: HEAD's SentencePiece wrapper calls encode_as_ids(text)
      CHECK(t->decode(ids) == sample);

      std::vector<std::string> texts = tricky_strings(100, 5);
      for (size_t i = 0; i < held_out.size(); i += 2048) {
        size_t b = i, e = std::min(held_out.size(), i + 2048);
        while (b < held_out.size() && (static_cast<unsigned char>(held_out[b]) & 0xC0) == 0x80) ++b;
        while (e < held_out.size() && (static_cast<unsigned char>(held_out[e]) & 0xC0) == 0x80) ++e;
        if (b < e) texts.push_back(held_out.substr(b, e - b));
      }
      const json out = run_oracle(*python, dir, "ids", {{"kind", "sp"}, {"model", prefix + ".model"}, {"texts", texts}});
      size_t bad = 0;
      for (size_t i = 0; i < texts.size(); ++i)
        if (t->encode(texts[i]) != to_ids(out["ids"][i]) && bad++ < 3) UNSCOPED_INFO("text #" << i << " differs");
      CHECK(bad == 0);
    }
  }
}

TEST_CASE("NullTokenizer: space-separated ids, HEAD's eod = V - 1", "[tokenizer]") {
  auto t = make_null_tokenizer(100, std::nullopt);
  CHECK(t->vocab_size() == 100);
  CHECK(t->eod() == 99);
  CHECK(t->encode("1 2 3") == std::vector<int32_t>{1, 2, 3});
  CHECK(t->encode("7\n") == std::vector<int32_t>{7});   // int() strips whitespace
  CHECK(t->encode("+5 1_0") == std::vector<int32_t>{5, 10});
  CHECK(t->decode({4, 5}) == "4 5");
  CHECK(make_null_tokenizer(100, 7)->eod() == 7);
  CHECK_THROWS_WITH(t->encode(" 5"), Contains("not a token id"));  // "".split(' ') gives ''
  CHECK_THROWS_WITH(t->encode(""), Contains("not a token id"));
  CHECK_THROWS_WITH(t->encode("1  2"), Contains("not a token id"));
  CHECK_THROWS_WITH(t->encode("x"), Contains("not a token id"));
  CHECK_THROWS_WITH(t->encode("100"), Contains("outside the vocabulary"));
  CHECK_THROWS_WITH(t->encode("-1"), Contains("outside the vocabulary"));
  CHECK_THROWS_WITH(make_null_tokenizer(100, 100), Contains("--null-tokenizer-eod-id"));
}

TEST_CASE("tokenizer errors name the flag or file and what is unsupported", "[tokenizer]") {
  TokenizerOptions o;
  CHECK_THROWS_WITH(build_tokenizer(o), Contains("--tokenizer-type is required"));
  o.type = "GPT2BPETokenizer";
  CHECK_THROWS_WITH(build_tokenizer(o), Contains("--vocab-file"));
  o.vocab_file = "/nonexistent/vocab.json";
  o.merge_file = "/nonexistent/merges.txt";
  CHECK_THROWS_WITH(build_tokenizer(o), Contains("--vocab-file '/nonexistent/vocab.json': no such file"));
  o = TokenizerOptions{};
  o.type = "HuggingFaceTokenizer";
  o.tokenizer_model = "/nonexistent/dir";
  CHECK_THROWS_WITH(build_tokenizer(o), Contains("--tokenizer-model"));
  o.type = "Llama2Tokenizer";
  o.tokenizer_model = "/nonexistent/x.model";
  CHECK_THROWS_WITH(build_tokenizer(o), Contains("--tokenizer-model '/nonexistent/x.model'"));
  o.type = "NullTokenizer";
  CHECK_THROWS_WITH(build_tokenizer(o), Contains("--vocab-size"));
  o.type = "TikTokenizer";
  CHECK_THROWS_AS(build_tokenizer(o), Unsupported);
  o.type = "Gpt2";
  CHECK_THROWS_WITH(build_tokenizer(o), Contains("not a Megatron tokenizer type"));
}

TEST_CASE("tokenizer.json errors name what is unsupported", "[tokenizer]") {
  const auto data = shared_data("tokenizer.json errors");
  if (!data) return;
  oracle::TempDir dir;
  json j = load_json(*data + "/llama3/tokenizer.json");
  // No tokenizer_config.json next to it: no eos_token, so no eod (Megatron's would be None).
  spit(dir.file("tokenizer.json"), j.dump());
  auto t = make_huggingface_tokenizer(dir.file("tokenizer.json"), true);
  CHECK(t->encode("hello").size() == 1);
  CHECK_THROWS_WITH(t->eod(), Contains("tokenizer_config.json"));
  j["normalizer"] = {{"type", "NFC"}};
  spit(dir.file("tokenizer.json"), j.dump());
  CHECK_THROWS_WITH(make_huggingface_tokenizer(dir.path(), true), Contains("the normalizer 'NFC' is not supported"));
  j["normalizer"] = nullptr;
  j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "\\w+";
  spit(dir.file("tokenizer.json"), j.dump());
  CHECK_THROWS_WITH(make_huggingface_tokenizer(dir.path(), true), Contains("the Split regex '\\w+'"));
  j = load_json(*data + "/llama3/tokenizer.json");
  j["model"]["type"] = "Unigram";
  spit(dir.file("tokenizer.json"), j.dump());
  CHECK_THROWS_AS(make_huggingface_tokenizer(dir.path(), true), Unsupported);
}
