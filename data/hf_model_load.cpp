// Reads tokenizer.json (and GPT-2's vocab.json + merges.txt) into an HfModel: the components
// megatrain runs are parsed, anything else is refused with a message naming it.
#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "data/bpe_tables_reader.h"
#include "data/hf_model.h"
#include "data/utf8.h"

namespace mt {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

DecoderStep decoder_step(DecoderStep::Kind kind) {
  DecoderStep d;
  d.kind = kind;
  return d;
}

std::string read_file(const fs::path& path, const std::string& what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("cannot read {} '{}'", what, path.string());
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

json parse_json_file(const fs::path& path, const std::string& what) {
  const std::string text = read_file(path, what);
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    fail("{} '{}' is not valid JSON: {}", what, path.string(), e.what());
  }
}

[[noreturn]] void unsupported(const std::string& source, const std::string& what) {
  throw Unsupported(fmt::format("tokenizer '{}': {} is not supported by megatrain", source, what));
}

std::string type_of(const json& j) { return j.is_object() && j.contains("type") && j["type"].is_string() ? j["type"].get<std::string>() : "?"; }

void parse_normalizer(const json& j, const std::string& src, std::vector<NormalizerStep>& out) {
  if (j.is_null()) return;
  const std::string type = type_of(j);
  if (type == "Sequence") {
    for (const json& n : j.at("normalizers")) parse_normalizer(n, src, out);
  } else if (type == "Prepend") {
    out.push_back(NormalizerStep{NormalizerStep::prepend, j.at("prepend").get<std::string>(), ""});
  } else if (type == "Replace") {
    const json& pat = j.at("pattern");
    if (!pat.contains("String")) unsupported(src, "a Replace normalizer with a Regex pattern");
    out.push_back(NormalizerStep{NormalizerStep::replace, pat["String"].get<std::string>(), j.at("content").get<std::string>()});
  } else {
    unsupported(src, fmt::format("the normalizer '{}'", type));
  }
}

void parse_pre_tokenizer(const json& j, const std::string& src, std::vector<PreTokenizerStep>& out) {
  if (j.is_null()) return;
  const std::string type = type_of(j);
  if (type == "Sequence") {
    for (const json& p : j.at("pretokenizers")) parse_pre_tokenizer(p, src, out);
  } else if (type == "Split") {
    const json& pat = j.at("pattern");
    if (!pat.contains("Regex")) unsupported(src, "a Split pre-tokenizer with a String pattern");
    const std::string regex = pat["Regex"].get<std::string>();
    const auto known = recognize_split_pattern(regex);
    if (!known)
      unsupported(src, fmt::format("the Split regex '{}' (megatrain knows the GPT-2, Llama 3 (cl100k) and "
                                   "Qwen2 patterns)", regex));
    if (j.value("behavior", "") != "Isolated") unsupported(src, "a Split pre-tokenizer whose behavior is not Isolated");
    if (j.value("invert", false)) unsupported(src, "an inverted Split pre-tokenizer");
    PreTokenizerStep s;
    s.kind = PreTokenizerStep::split;
    s.pattern = *known;
    out.push_back(s);
  } else if (type == "ByteLevel") {
    PreTokenizerStep s;
    s.kind = PreTokenizerStep::byte_level;
    s.add_prefix_space = j.value("add_prefix_space", true);
    s.use_regex = j.value("use_regex", true);
    out.push_back(s);
  } else if (type == "Metaspace") {
    PreTokenizerStep s;
    s.kind = PreTokenizerStep::metaspace;
    s.replacement = j.value("replacement", kMetaspace);
    if (utf8::is_valid(s.replacement) == false || s.replacement.empty()) unsupported(src, "this Metaspace replacement");
    const std::string scheme = j.value("prepend_scheme", j.value("add_prefix_space", true) ? "always" : "never");
    s.scheme = scheme == "first" ? PreTokenizerStep::first : scheme == "never" ? PreTokenizerStep::never : PreTokenizerStep::always;
    s.split_on_replacement = j.value("split", true);
    out.push_back(s);
  } else {
    unsupported(src, fmt::format("the pre-tokenizer '{}'", type));
  }
}

void parse_decoder(const json& j, const std::string& src, std::vector<DecoderStep>& out) {
  if (j.is_null()) return;
  const std::string type = type_of(j);
  if (type == "Sequence") {
    for (const json& d : j.at("decoders")) parse_decoder(d, src, out);
  } else if (type == "ByteLevel") {
    out.push_back(decoder_step(DecoderStep::byte_level));
  } else if (type == "Replace") {
    const json& pat = j.at("pattern");
    if (!pat.contains("String")) unsupported(src, "a Replace decoder with a Regex pattern");
    DecoderStep d;
    d.kind = DecoderStep::replace;
    d.a = pat["String"].get<std::string>();
    d.b = j.at("content").get<std::string>();
    out.push_back(d);
  } else if (type == "ByteFallback") {
    out.push_back(decoder_step(DecoderStep::byte_fallback));
  } else if (type == "Fuse") {
    out.push_back(decoder_step(DecoderStep::fuse));
  } else if (type == "Strip") {
    DecoderStep d;
    d.kind = DecoderStep::strip;
    d.a = j.at("content").get<std::string>();
    d.start = j.value("start", size_t{0});
    d.stop = j.value("stop", size_t{0});
    out.push_back(d);
  } else if (type == "Metaspace") {
    DecoderStep d;
    d.kind = DecoderStep::metaspace;
    d.a = j.value("replacement", kMetaspace);
    const std::string scheme = j.value("prepend_scheme", j.value("add_prefix_space", true) ? "always" : "never");
    d.prepend = scheme != "never";
    out.push_back(d);
  } else {
    unsupported(src, fmt::format("the decoder '{}'", type));
  }
}

// Id of a token string: added tokens first, then the model vocabulary; -1 if unknown.
int32_t lookup_token(const HfModel& m, const std::string& token) {
  for (const AddedToken& t : m.added)
    if (t.content == token) return t.id;
  return m.bpe->token_to_id(token);
}

void set_template(HfModel& m, const std::vector<int32_t>& prefix, const std::vector<int32_t>& suffix) {
  m.prefix_ids = prefix;
  m.suffix_ids = suffix;
}

void parse_post_processor(const json& j, HfModel& m) {
  if (j.is_null()) return;
  const std::string type = type_of(j);
  const std::string& src = m.source;
  if (type == "Sequence") {
    for (const json& p : j.at("processors")) parse_post_processor(p, m);
  } else if (type == "ByteLevel") {
    // Only adjusts offsets.
  } else if (type == "TemplateProcessing") {
    std::vector<int32_t> before, after;
    bool seen_a = false;
    for (const json& piece : j.at("single")) {
      if (piece.contains("Sequence")) {
        if (piece["Sequence"].value("id", "A") != "A" || seen_a) unsupported(src, "this TemplateProcessing 'single' template");
        seen_a = true;
      } else if (piece.contains("SpecialToken")) {
        const std::string id = piece["SpecialToken"].at("id").get<std::string>();
        const json& special = j.at("special_tokens").at(id);
        for (const json& v : special.at("ids")) (seen_a ? after : before).push_back(v.get<int32_t>());
      } else {
        unsupported(src, "this TemplateProcessing piece");
      }
    }
    if (!seen_a) unsupported(src, "a TemplateProcessing 'single' template without $A");
    before.insert(before.begin(), m.prefix_ids.begin(), m.prefix_ids.end());
    after.insert(after.end(), m.suffix_ids.begin(), m.suffix_ids.end());
    set_template(m, before, after);
  } else if (type == "RobertaProcessing" || type == "BertProcessing") {
    const int32_t cls = j.at("cls").at(1).get<int32_t>();
    const int32_t sep = j.at("sep").at(1).get<int32_t>();
    set_template(m, {cls}, {sep});
  } else {
    unsupported(src, fmt::format("the post-processor '{}'", type));
  }
}

// The token string a tokenizer_config.json / special_tokens_map.json entry names.
std::optional<std::string> config_token(const json& j, const char* key) {
  if (!j.is_object() || !j.contains(key)) return std::nullopt;
  const json& v = j[key];
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string()) return v["content"].get<std::string>();
  return std::nullopt;
}

void finish(HfModel& m) {
  // Added tokens that a normalizer would see are matched after normalization; without a
  // normalizer both passes are the same, so all go to the raw pass.
  std::vector<AddedToken> raw, normalized;
  for (const AddedToken& t : m.added) (t.normalized && !m.normalizers.empty() ? normalized : raw).push_back(t);
  m.raw_matcher = AddedTokenMatcher(raw);
  m.normalized_matcher = AddedTokenMatcher(normalized);

  m.id_to_token = m.bpe->id_to_token();
  size_t extra = 0;
  for (const AddedToken& t : m.added) {
    if (m.bpe->token_to_id(t.content) < 0) ++extra;
    if (t.id >= static_cast<int32_t>(m.id_to_token.size())) m.id_to_token.resize(t.id + 1);
    m.id_to_token[t.id] = t.content;
  }
  // transformers' len(tokenizer): distinct strings of the model vocabulary and added tokens.
  m.vocab_size = static_cast<int64_t>(m.bpe->vocab_entries() + extra);
}

}  // namespace

std::shared_ptr<HfModel> load_tokenizer_json(const std::string& model_arg) {
  fs::path path(model_arg);
  std::error_code ec;
  if (fs::is_directory(path, ec)) path /= "tokenizer.json";
  if (!fs::exists(path, ec))
    fail("--tokenizer-model '{}': no such file (HuggingFaceTokenizer needs a tokenizer.json, or a directory "
         "holding one; megatrain does not download from the Hugging Face Hub)", path.string());
  const fs::path dir = path.parent_path();
  auto m = std::make_shared<HfModel>();
  m->name = "HuggingFaceTokenizer";
  m->source = path.string();
  // The big tables by the fast path, the rest as a DOM (see locate_model_tables).
  std::string text = read_file(path, "--tokenizer-model tokenizer.json");
  ValueSpan vocab_span, merges_span;
  locate_model_tables(text, vocab_span, merges_span);
  std::vector<std::pair<std::string, int32_t>> fast_vocab;
  std::vector<std::pair<std::string, std::string>> fast_merges;
  if (vocab_span.found() && merges_span.found() && read_vocab_object(text, vocab_span, fast_vocab) &&
      read_merges_array(text, merges_span, fast_merges)) {
    const ValueSpan& first = vocab_span.begin < merges_span.begin ? vocab_span : merges_span;
    const ValueSpan& second = vocab_span.begin < merges_span.begin ? merges_span : vocab_span;
    text = text.substr(0, first.begin) + (&first == &vocab_span ? "{}" : "[]") +
           text.substr(first.end, second.begin - first.end) + (&second == &vocab_span ? "{}" : "[]") +
           text.substr(second.end);
  } else {
    fast_vocab.clear();
    fast_merges.clear();
    vocab_span = merges_span = ValueSpan{};
  }
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    fail("--tokenizer-model tokenizer.json '{}' is not valid JSON: {}", path.string(), e.what());
  }
  const bool fast = vocab_span.found();
  const std::string& src = m->source;
  try {
    const json& model = j.at("model");
    if (type_of(model) != "BPE" && !((fast || model.contains("merges")) && !model.contains("type")))
      unsupported(src, fmt::format("the model type '{}' (megatrain runs BPE models)", type_of(model)));
    if (!model.value("dropout", json()).is_null()) unsupported(src, "BPE dropout");
    for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
      const json v = model.value(key, json());
      if (!v.is_null() && !(v.is_string() && v.get<std::string>().empty()))
        unsupported(src, fmt::format("the BPE option {}", key));
    }
    parse_normalizer(j.value("normalizer", json()), src, m->normalizers);
    parse_pre_tokenizer(j.value("pre_tokenizer", json()), src, m->pre_tokenizers);
    for (size_t i = 0; i < m->pre_tokenizers.size(); ++i)
      if (m->pre_tokenizers[i].kind == PreTokenizerStep::byte_level && i + 1 != m->pre_tokenizers.size())
        unsupported(src, "a ByteLevel pre-tokenizer followed by other pre-tokenizers");
    const bool byte_level = !m->pre_tokenizers.empty() && m->pre_tokenizers.back().kind == PreTokenizerStep::byte_level;

    BpeSpec spec;
    spec.byte_level = byte_level;
    spec.ignore_merges = model.value("ignore_merges", false);
    spec.byte_fallback = model.value("byte_fallback", false);
    spec.fuse_unk = model.value("fuse_unk", false);
    if (model.contains("unk_token") && model["unk_token"].is_string()) spec.unk_token = model["unk_token"].get<std::string>();
    if (fast) {
      spec.vocab = std::move(fast_vocab);
      spec.merges = std::move(fast_merges);
    }
    if (!fast)
      for (const auto& [token, id] : model.at("vocab").items()) {
        if (!id.is_number_integer()) fail("tokenizer '{}': the id of vocabulary entry '{}' is not an integer", src, token);
        spec.vocab.emplace_back(token, id.get<int32_t>());
      }
    if (!fast) for (const json& merge : model.at("merges")) {
      if (merge.is_array()) {
        spec.merges.emplace_back(merge.at(0).get<std::string>(), merge.at(1).get<std::string>());
      } else {
        const std::string s = merge.get<std::string>();
        const size_t sp = s.find(' ');
        if (sp == std::string::npos) fail("tokenizer '{}': merge '{}' is not two tokens", src, s);
        spec.merges.emplace_back(s.substr(0, sp), s.substr(sp + 1));
      }
    }
    m->bpe = std::make_unique<BpeModel>(spec);

    for (const json& t : j.value("added_tokens", json::array())) {
      AddedToken a;
      a.content = t.at("content").get<std::string>();
      a.id = t.at("id").get<int32_t>();
      a.special = t.value("special", false);
      a.lstrip = t.value("lstrip", false);
      a.rstrip = t.value("rstrip", false);
      a.normalized = t.value("normalized", !a.special);
      if (t.value("single_word", false)) unsupported(src, fmt::format("the single_word added token '{}'", a.content));
      m->added.push_back(a);
    }
    parse_post_processor(j.value("post_processor", json()), *m);
    parse_decoder(j.value("decoder", json()), src, m->decoders);
  } catch (const json::exception& e) {
    fail("tokenizer '{}' is not a tokenizer.json megatrain can read: {}", src, e.what());
  }

  // transformers' AutoTokenizer reads the special tokens from tokenizer_config.json (then
  // special_tokens_map.json); Megatron's eod is the eos_token.
  json config, special_map;
  if (fs::exists(dir / "tokenizer_config.json", ec)) config = parse_json_file(dir / "tokenizer_config.json", "tokenizer_config.json");
  if (fs::exists(dir / "special_tokens_map.json", ec)) special_map = parse_json_file(dir / "special_tokens_map.json", "special_tokens_map.json");
  std::optional<std::string> eos = config_token(config, "eos_token");
  if (!eos) eos = config_token(special_map, "eos_token");
  if (eos) {
    m->eod = lookup_token(*m, *eos);
    if (m->eod < 0) fail("tokenizer '{}': its eos_token '{}' is not in the vocabulary", src, *eos);
  } else {
    m->eod_missing_reason = fmt::format("no eos_token in {} or {} next to '{}'", (dir / "tokenizer_config.json").string(),
                                        (dir / "special_tokens_map.json").string(), src);
  }
  // LlamaTokenizerFast rebuilds its post-processor from add_bos_token/add_eos_token.
  const std::string cls = config.is_object() ? config.value("tokenizer_class", "") : "";
  if (cls == "LlamaTokenizer" || cls == "LlamaTokenizerFast") {
    std::vector<int32_t> before, after;
    if (config.value("add_bos_token", true)) {
      const auto bos = config_token(config, "bos_token");
      const int32_t id = bos ? lookup_token(*m, *bos) : -1;
      if (id < 0) fail("tokenizer '{}': add_bos_token is set but its bos_token is unknown", src);
      before.push_back(id);
    }
    if (config.value("add_eos_token", false)) {
      if (m->eod < 0) fail("tokenizer '{}': add_eos_token is set but its eos_token is unknown", src);
      after.push_back(m->eod);
    }
    set_template(*m, before, after);
  }
  finish(*m);
  return m;
}

std::shared_ptr<HfModel> load_gpt2_files(const std::string& vocab_file, const std::string& merge_file) {
  auto m = std::make_shared<HfModel>();
  m->name = "GPT2BPETokenizer";
  m->source = vocab_file;
  BpeSpec spec;
  spec.byte_level = true;
  const std::string vocab_text = read_file(vocab_file, "--vocab-file");
  const size_t begin = skip_json_ws(vocab_text, 0);
  const size_t end = begin < vocab_text.size() ? skip_json_value(vocab_text, begin) : std::string::npos;
  if (end == std::string::npos || vocab_text[begin] != '{' || skip_json_ws(vocab_text, end) != vocab_text.size() ||
      !read_vocab_object(vocab_text, ValueSpan{begin, end}, spec.vocab))
    fail("--vocab-file '{}' is not a JSON object of token -> integer id", vocab_file);
  // GPT2Tokenizer reads merges as split("\n")[1:-1]: the "#version" line and the (empty) text
  // after the last newline are skipped.
  const std::string merges = read_file(merge_file, "--merge-file");
  std::vector<std::string_view> lines;
  size_t start = 0;
  for (size_t i = 0; i <= merges.size(); ++i) {
    if (i == merges.size() || merges[i] == '\n') {
      lines.emplace_back(merges.data() + start, i - start);
      start = i + 1;
    }
  }
  for (size_t k = 1; k + 1 < lines.size(); ++k) {
    const std::string_view line = lines[k];
    const size_t sp = line.find(' ');
    if (sp == std::string_view::npos || line.find(' ', sp + 1) != std::string_view::npos)
      fail("--merge-file '{}': line {} is not two tokens separated by one space", merge_file, k + 1);
    spec.merges.emplace_back(std::string(line.substr(0, sp)), std::string(line.substr(sp + 1)));
  }
  try {
    m->bpe = std::make_unique<BpeModel>(spec);
  } catch (const Error& e) {
    fail("--vocab-file '{}' / --merge-file '{}': {}", vocab_file, merge_file, e.what());
  }
  const int32_t eot = m->bpe->token_to_id("<|endoftext|>");
  if (eot < 0) fail("--vocab-file '{}' has no '<|endoftext|>' token (GPT2BPETokenizer's eod)", vocab_file);
  m->added.push_back(AddedToken{"<|endoftext|>", eot, true, false, false, false});
  PreTokenizerStep bl;
    bl.kind = PreTokenizerStep::byte_level;
  bl.add_prefix_space = false;
  bl.use_regex = true;
  m->pre_tokenizers.push_back(bl);
  m->decoders.push_back(decoder_step(DecoderStep::byte_level));
  m->eod = eot;
  m->all_special_tokens = std::vector<std::string>{"<|endoftext|>"};
  m->unk = eot;
  finish(*m);
  return m;
}

}  // namespace mt
