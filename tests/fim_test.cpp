// data/fim: Megatron's fill-in-the-middle samples. Hand-checked layouts on a one-character-per-token
// tokenizer, then the exactness check against tests/oracles/megatron_fim.py (numpy's RandomState
// and the Hugging Face tokenizers library) on windows read through the BatchLoader.
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <random>

#include "core/config.h"
#include "core/error.h"
#include "data/batch_loader.h"
#include "data/fim.h"
#include "data/gpt_dataset.h"
#include "data/indexed_dataset.h"
#include "data/tokenizer.h"
#include "tests/python_oracle.h"

using namespace mt;
using nlohmann::json;
using numpy_random::RandomState;

namespace {

// Token ids 1..26 are the letters a..z, 27 is ',', 0 is the special EOD (left out of the text);
// the FIM tokens are 28..31 and are not letters.
constexpr int32_t E = 0, COMMA = 27, P = 28, M = 29, S = 30, PAD = 31;

class LetterTokenizer final : public Tokenizer {
 public:
  void encode(std::string_view text, std::vector<int32_t>& out) override {
    for (char c : text) out.push_back(c == ',' ? COMMA : c - 'a' + 1);
  }
  std::string decode(const std::vector<int32_t>& ids) const override { return decode_skip_special(ids); }
  std::string decode_skip_special(std::span<const int32_t> ids) const override {
    std::string s;
    for (int32_t id : ids) {
      if (id >= 1 && id <= 26) s += static_cast<char>('a' + id - 1);
      else if (id == COMMA) s += ',';
    }
    return s;
  }
  int64_t vocab_size() const override { return 32; }
  int32_t eod() const override { return E; }
  std::string name() const override { return "letters"; }
  std::unique_ptr<Tokenizer> clone() const override { return std::make_unique<LetterTokenizer>(); }
};

std::vector<int32_t> ids(const std::string& letters) {
  std::vector<int32_t> v;
  LetterTokenizer().encode(letters, v);
  return v;
}

FimSpec spec(double rate, double spm_rate) {
  FimSpec s;
  s.rate = rate;
  s.spm_rate = spm_rate;
  s.prefix = P;
  s.middle = M;
  s.suffix = S;
  s.pad = PAD;
  s.eod = E;
  return s;
}

std::vector<int32_t> run(const FimSpec& s, std::vector<int32_t> sample, uint32_t seed = 1234) {
  FimTransform t(s, std::make_unique<LetterTokenizer>());
  RandomState rng(seed);
  t.apply(sample, rng);
  return sample;
}

std::vector<int32_t> cat(std::initializer_list<std::vector<int32_t>> parts) {
  std::vector<int32_t> v;
  for (const auto& p : parts) v.insert(v.end(), p.begin(), p.end());
  return v;
}

// The two sorted cut points a twin stream draws for a text of n characters.
std::pair<size_t, size_t> cuts(RandomState& twin, uint64_t n) {
  uint64_t a = twin.random_interval(n), b = twin.random_interval(n);
  if (b < a) std::swap(a, b);
  return {a, b};
}

}  // namespace

TEST_CASE("FIM: rate 0 leaves samples as they are but still draws once per segment", "[data][fim]") {
  const std::vector<int32_t> sample = cat({ids("abc"), {E}, ids("defg"), {E}, ids("hi")});
  FimTransform t(spec(0.0, 0.5), std::make_unique<LetterTokenizer>());
  RandomState rng(99), twin(99);
  std::vector<int32_t> out = sample;
  t.apply(out, rng);
  CHECK(out == sample);
  for (int i = 0; i < 3; ++i) twin.random_sample();  // three segments, three binomial draws
  CHECK(rng.next_uint32() == twin.next_uint32());
}

TEST_CASE("FIM: an empty segment loses its EOD and the sample is padded with the FIM pad token", "[data][fim]") {
  // A leading EOD and the second of two EODs close empty segments: Megatron keeps only the EODs
  // of non-empty segments.
  const std::vector<int32_t> sample = cat({{E}, ids("ab"), {E, E}, ids("c")});
  CHECK(run(spec(0.0, 0.5), sample) == cat({ids("ab"), {E}, ids("c"), {PAD, PAD}}));
}

TEST_CASE("FIM: rate 1 gives PSM with SPM rate 0 and SPM with SPM rate 1, cut at the drawn characters", "[data][fim]") {
  const std::vector<int32_t> sample = ids("abcdefghijkl");
  const std::string text = "abcdefghijkl";
  for (const double spm : {0.0, 1.0}) {
    INFO("spm rate " << spm);
    RandomState twin(1234);
    REQUIRE(twin.binomial(1, 1.0) == 1);
    const auto [a, b] = cuts(twin, text.size());
    REQUIRE(twin.binomial(1, spm) == static_cast<int64_t>(spm));
    const auto pre = ids(text.substr(0, a)), mid = ids(text.substr(a, b - a)), suf = ids(text.substr(b));
    std::vector<int32_t> expected = spm == 1.0 ? cat({{P, S}, suf, {M}, pre, mid}) : cat({{P}, pre, {S}, suf, {M}, mid});
    REQUIRE(expected.size() == sample.size() + 3);
    expected.resize(sample.size());  // three sentinels more: cut to the sample's length
    CHECK(run(spec(1.0, spm), sample) == expected);
  }
  // Spelled out for seed 1234 (numpy: binomial(1, 1.0) = 1, randint(0, 13, size=2) = [6, 5]):
  // prefix "abcde", middle "f", suffix "ghijkl"; PSM cut to 12 tokens.
  CHECK(run(spec(1.0, 0.0), sample) == cat({{P}, ids("abcde"), {S}, ids("ghijk")}));
  CHECK(run(spec(1.0, 1.0), sample) == cat({{P, S}, ids("ghijkl"), {M}, ids("abc")}));
}

TEST_CASE("FIM: each EOD-separated segment is permuted on its own and the empty tail gets three sentinels",
          "[data][fim]") {
  const std::vector<int32_t> sample = cat({ids("abcd"), {E}, ids("efg"), {E}});
  RandomState twin(5);
  std::vector<int32_t> expected;
  for (const std::string& seg : {std::string("abcd"), std::string("efg"), std::string()}) {
    REQUIRE(twin.binomial(1, 1.0) == 1);
    const auto [a, b] = cuts(twin, seg.size());
    const bool spm = twin.binomial(1, 0.5) == 1;
    const auto pre = ids(seg.substr(0, a)), mid = ids(seg.substr(a, b - a)), suf = ids(seg.substr(b));
    const auto part = spm ? cat({{P, S}, suf, {M}, pre, mid}) : cat({{P}, pre, {S}, suf, {M}, mid});
    expected.insert(expected.end(), part.begin(), part.end());
    if (!seg.empty()) expected.push_back(E);
  }
  // 4+3 + 3+3 + 3 tokens with the two EODs: 18, cut to the sample's 9.
  REQUIRE(expected.size() == 18);
  expected.resize(sample.size());
  CHECK(run(spec(1.0, 0.5), sample, 5) == expected);
}

TEST_CASE("FIM: --fim-split-sample splits a segment into fragments, one FIM draw for the segment first", "[data][fim]") {
  FimSpec s = spec(1.0, 0.5);
  s.split_sample = COMMA;
  s.fragment_rate = 0.0;
  // The outer draw wins (rate 1); each fragment then stays (fragment rate 0); the split token of
  // an empty fragment (",,") is dropped, as Megatron keeps only those after non-empty fragments.
  const std::vector<int32_t> sample = ids("ab,cd,,e");
  CHECK(run(s, sample) == cat({ids("ab,cd,e"), {PAD}}));
  // Draws: one for the segment, then one per fragment (ab, cd, e).
  {
    FimTransform t(s, std::make_unique<LetterTokenizer>());
    RandomState rng(3), twin(3);
    std::vector<int32_t> out = sample;
    t.apply(out, rng);
    for (int i = 0; i < 4; ++i) twin.random_sample();
    CHECK(rng.next_uint32() == twin.next_uint32());
  }
  // A segment without the split token is permuted whole with --fim-rate.
  s.rate = 0.0;
  CHECK(run(s, ids("abcd")) == ids("abcd"));
  // Fragment rate 1: every non-empty fragment is a FIM sample of its own.
  s.rate = 1.0;
  s.fragment_rate = 1.0;
  // The first fragment's FIM sample (3 letters + 3 sentinels) fills all 6 places.
  const std::vector<int32_t> out = run(s, ids("abc,de"), 11);
  CHECK(out.front() == P);
  CHECK(std::count(out.begin(), out.end(), COMMA) == 0);
  CHECK(std::count(out.begin(), out.end(), M) == 1);
}

TEST_CASE("FIM: --fim-no-prefix leaves fragments whose text starts with it", "[data][fim]") {
  FimSpec s = spec(1.0, 0.5);
  s.no_prefix = "ab";
  const std::vector<int32_t> sample = cat({ids("abcd"), {E}, ids("bacd")});
  const std::vector<int32_t> out = run(s, sample);
  CHECK(std::vector<int32_t>(out.begin(), out.begin() + 5) == cat({ids("abcd"), {E}}));
  CHECK(out[5] == P);
}

TEST_CASE("FIM: fim_config looks the tokens up as Megatron's GPT-2 tokenizer does", "[data][fim]") {
  const auto python = oracle::python_or_skip("FIM token lookup");
  if (!python) return;
  oracle::TempDir dir;
  oracle::run_capture(oracle::shell_quote(*python) + " " +
                      oracle::shell_quote(std::string(MEGATRAIN_SOURCE_DIR) + "/tests/oracles/megatron_fim.py") +
                      " vocab " + oracle::shell_quote(dir.path()));
  std::shared_ptr<const Tokenizer> tok = make_gpt2_bpe_tokenizer(dir.file("vocab.json"), dir.file("merges.txt"));
  DataConfig d;
  d.fim_data = true;
  std::vector<std::string> notes;
  auto c = fim_config(d, 1234, tok, &notes);
  CHECK(notes.empty());
  CHECK(c->spec.eod == tok->eod());
  CHECK(c->spec.prefix == *tok->convert_token_to_id("<fim_prefix>"));
  CHECK(c->spec.prefix != c->spec.eod);
  // Tokens missing from the vocabulary become the unknown token, "<|endoftext|>" for GPT-2.
  d.fim_prefix_token = "<PRE>";
  d.fim_split_sample = ",";
  c = fim_config(d, 1234, tok, &notes);
  CHECK(c->spec.prefix == tok->eod());
  CHECK(c->spec.split_sample == *tok->convert_token_to_id(","));
  REQUIRE(notes.size() == 1);
  CHECK_THAT(notes[0], Catch::Contains("--fim-prefix-token '<PRE>' is not in the GPT2BPETokenizer vocabulary"));
  // An empty --fim-split-sample splits nothing (Megatron's `if fim_split_sample:`).
  d.fim_split_sample = "";
  CHECK_FALSE(fim_config(d, 1234, tok)->spec.split_sample);
}

namespace {

struct OracleCase {
  std::string name;
  double rate, spm_rate;
  std::optional<double> fragment_rate;
  std::optional<std::string> split_sample, no_prefix;
  int workers;
  std::string prefix_token = "<fim_prefix>";
};

// Documents of words (ASCII, two- and three-byte UTF-8, words the merges join), each closed by
// EOD, some empty or doubled EODs; a few lone bytes of multi-byte characters so that decoding
// meets invalid UTF-8.
void make_documents(const std::string& prefix, Tokenizer& tok, int docs, uint32_t seed) {
  const std::vector<std::string> words{"the", " code", " in", " café", " 中文", " a", " merge", "de", " fi", ",",
                                       " x", "\n", " or", " 😀", " er", "<|endoftext|>"};
  std::mt19937 gen(seed);
  IndexedDatasetBuilder b(prefix, TokenDType::uint16);
  const int32_t eod = tok.eod();
  const int32_t lone = *tok.convert_token_to_id("\xC3\xA4");  // GPT-2's stand-in for byte 0xE4 alone
  for (int d = 0; d < docs; ++d) {
    std::string text;
    const int n = static_cast<int>(gen() % 30);
    for (int i = 0; i < n; ++i) text += words[gen() % words.size()];
    std::vector<int32_t> t = tok.encode(text);
    if (gen() % 4 == 0 && !t.empty()) t.insert(t.begin() + static_cast<long>(gen() % t.size()), lone);
    t.push_back(eod);
    if (gen() % 7 == 0) t.push_back(eod);
    b.add_document(t);
  }
  b.finalize();
}

void check_against_oracle(const std::string& python, const std::string& vocab, const std::string& merges,
                          const OracleCase& oc) {
  INFO("case " << oc.name << ", vocabulary " << vocab);
  oracle::TempDir dir;
  std::shared_ptr<const Tokenizer> tok = make_gpt2_bpe_tokenizer(vocab, merges);
  const std::string prefix = dir.file("docs");
  make_documents(prefix, *tok->clone(), 120, 17);

  DataConfig d;
  d.fim_data = true;
  d.fim_rate = oc.rate;
  d.fim_spm_rate = oc.spm_rate;
  d.fim_fragment_rate = oc.fragment_rate;
  d.fim_split_sample = oc.split_sample;
  d.fim_no_prefix = oc.no_prefix;
  d.fim_prefix_token = oc.prefix_token;
  const uint32_t seed = 4321;
  GPTDatasetOptions o;
  o.seq_length = 48;
  o.seed = seed;
  o.fim = fim_config(d, seed, tok);
  auto data = std::make_shared<const IndexedDataset>(prefix);
  auto ds = std::make_shared<const GPTDataset>(data, Split::train, IndexRange{0, data->num_sequences()}, 60, o);

  BatchLoaderOptions lo;
  lo.micro_batch_size = 3;
  lo.data_parallel_rank = 1;
  lo.data_parallel_size = 2;
  lo.consumed_samples = 6;
  lo.workers = std::max(1, oc.workers);  // as batch_loader_options turns --num-workers 0 into one stream
  lo.masking.eod_token = tok->eod();
  BatchLoader loader(ds, lo);
  json spec;
  spec["vocab"] = vocab;
  spec["merges"] = merges;
  spec["seed"] = seed;
  spec["rate"] = oc.rate;
  spec["spm_rate"] = oc.spm_rate;
  spec["fragment_rate"] = oc.fragment_rate ? json(*oc.fragment_rate) : json();
  spec["split_sample"] = oc.split_sample ? json(*oc.split_sample) : json();
  spec["no_prefix"] = oc.no_prefix ? json(*oc.no_prefix) : json();
  spec["tokens"] = {{"prefix", d.fim_prefix_token}, {"middle", d.fim_middle_token}, {"suffix", d.fim_suffix_token},
                    {"pad", d.fim_pad_token}, {"eod", d.fim_eod_token}};
  std::vector<std::vector<int32_t>> got;
  json samples = json::array(), streams = json::array();
  std::vector<int32_t> raw(static_cast<size_t>(ds->window_length()));
  MicroBatch mb;
  for (int64_t k = 0; loader.next(mb); ++k) {
    const int64_t first = loader.samples_of(k)[0];
    for (int i = 0; i < mb.batch; ++i) {
      ds->window(first + i, raw.data());
      samples.push_back(raw);
      streams.push_back(k % std::max(1, oc.workers));
      const size_t at = static_cast<size_t>(i) * mb.seq;
      std::vector<int32_t> w(mb.tokens.begin() + static_cast<long>(at), mb.tokens.begin() + static_cast<long>(at + mb.seq));
      w.push_back(mb.labels[at + mb.seq - 1]);
      got.push_back(std::move(w));
    }
  }
  // (size - 6) / 6 micro-batches of 3 on this rank (whole epochs are built: size >= 60).
  REQUIRE(got.size() == static_cast<size_t>((ds->size() - 6) / 6 * 3));
  REQUIRE(got.size() >= 27);
  spec["samples"] = samples;
  spec["streams"] = streams;
  const std::string path = dir.file("spec.json");
  std::ofstream(path) << spec.dump();
  const json out = json::parse(oracle::run_capture(
      oracle::shell_quote(python) + " " +
      oracle::shell_quote(std::string(MEGATRAIN_SOURCE_DIR) + "/tests/oracles/megatron_fim.py") + " " +
      oracle::shell_quote(path)));
  const auto& sp = o.fim->spec;
  CHECK(out["ids"] == json({sp.prefix, sp.middle, sp.suffix, sp.pad, sp.eod}));
  const auto expected = out["samples"].get<std::vector<std::vector<int32_t>>>();
  REQUIRE(expected.size() == got.size());
  int changed = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    INFO("sample " << i << " of this rank");
    CHECK(got[i] == expected[i]);
    changed += got[i] != samples[i].get<std::vector<int32_t>>();
  }
  CHECK(changed > 0);  // the rates draw some FIM samples
}

}  // namespace

TEST_CASE("FIM samples equal Megatron's algorithm run with numpy and Hugging Face tokenizers", "[data][fim][oracle]") {
  const auto python = oracle::python_or_skip("FIM oracle");
  if (!python) return;
  oracle::TempDir vocab_dir;
  oracle::run_capture(oracle::shell_quote(*python) + " " +
                      oracle::shell_quote(std::string(MEGATRAIN_SOURCE_DIR) + "/tests/oracles/megatron_fim.py") +
                      " vocab " + oracle::shell_quote(vocab_dir.path()));
  const std::vector<OracleCase> cases{
      {"functional-test rates, 2 workers", 0.5, 0.5, std::nullopt, std::nullopt, std::nullopt, 2},
      {"rate 1, PSM mostly, no workers", 1.0, 0.1, std::nullopt, std::nullopt, std::nullopt, 0},
      {"split on ',' with fragment rate, no-prefix, 3 workers", 0.8, 0.5, 0.6, std::string(","), std::string(" a"), 3},
      {"prefix token missing from the vocabulary", 0.7, 0.9, std::nullopt, std::nullopt, std::nullopt, 1, "<PRE>"},
  };
  for (const OracleCase& c : cases)
    check_against_oracle(*python, vocab_dir.file("vocab.json"), vocab_dir.file("merges.txt"), c);
  // With GPT-2's own files (where the test data has them) the FIM tokens are all "<|endoftext|>".
  const std::filesystem::path gpt2 = std::filesystem::path(MEGATRAIN_SOURCE_DIR) / ".." / "shared" / "data" / "gpt2";
  if (std::filesystem::exists(gpt2 / "gpt2-vocab.json"))
    check_against_oracle(*python, (gpt2 / "gpt2-vocab.json").string(), (gpt2 / "gpt2-merges.txt").string(), cases[0]);
}
