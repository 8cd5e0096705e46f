#include "data/vocab_info.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <vector>

#include "core/config.h"
#include "core/error.h"
#include "data/tokenizer.h"

namespace mt {
namespace {

namespace fs = std::filesystem;

// SAX handler that walks a tokenizer file without building a DOM (tokenizer.json can be ~10 MB).
// It records token -> id for a path pattern and the largest id seen.
class VocabScanner : public nlohmann::json_sax<nlohmann::json> {
 public:
  enum class Layout { gpt2_vocab_json, hf_tokenizer_json };
  VocabScanner(Layout layout, std::set<std::string> wanted) : layout_(layout), wanted_(std::move(wanted)) {}

  int64_t max_id = -1;
  int64_t entries = 0;  // GPT-2 vocab.json entries
  std::map<std::string, int64_t> found;  // wanted token -> id

  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t v) override { return on_number(v); }
  bool number_unsigned(number_unsigned_t v) override { return on_number(static_cast<int64_t>(v)); }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t& s) override {
    if (layout_ == Layout::hf_tokenizer_json && in_added_token() && key_ == "content") added_content_ = s;
    // Unigram vocabularies are [[piece, score], ...]: the piece is the first element.
    if (layout_ == Layout::hf_tokenizer_json && unigram_piece_pending_) {
      unigram_piece_pending_ = false;
      if (wanted_.count(s)) found.emplace(s, unigram_index_);
    }
    return true;
  }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override {
    push(false);
    if (in_added_token()) {
      added_content_.clear();
      added_id_ = -1;
    }
    return true;
  }
  bool end_object() override {
    if (in_added_token()) {
      if (added_id_ >= 0 && wanted_.count(added_content_)) found[added_content_] = added_id_;
    }
    pop();
    return true;
  }
  bool start_array(std::size_t) override {
    // A Unigram vocabulary entry: an array inside model.vocab's array.
    if (layout_ == Layout::hf_tokenizer_json && path_is({"model", "vocab", "[]"})) {
      unigram_index_ = next_unigram_++;
      max_id = std::max(max_id, unigram_index_);
      unigram_piece_pending_ = true;
    }
    push(true);
    return true;
  }
  bool end_array() override {
    pop();
    return true;
  }
  bool key(string_t& k) override {
    key_ = k;
    if (!stack_.empty()) stack_.back().key = k;
    return true;
  }
  bool parse_error(std::size_t pos, const std::string&, const nlohmann::detail::exception& e) override {
    error = fmt::format("not valid JSON at byte {}: {}", pos, e.what());
    return false;
  }
  std::string error;

 private:
  struct Frame {
    bool array;
    std::string key;
  };
  void push(bool array) { stack_.push_back({array, ""}); }
  void pop() {
    if (!stack_.empty()) stack_.pop_back();
  }
  // Path of the value being read: keys of enclosing objects, "[]" for array elements.
  bool path_is(std::initializer_list<const char*> want) const {
    if (stack_.size() != want.size()) return false;
    size_t i = 0;
    for (const char* w : want) {
      const Frame& f = stack_[i++];
      if (f.array ? std::string("[]") != w : (std::string(w) != "*" && f.key != w)) return false;
    }
    return true;
  }
  bool in_added_token() const { return path_is({"added_tokens", "[]", "*"}); }
  bool on_number(int64_t v) {
    if (layout_ == Layout::gpt2_vocab_json) {
      if (stack_.size() == 1 && !stack_[0].array) {
        ++entries;
        max_id = std::max(max_id, v);
        if (wanted_.count(key_)) found[key_] = v;
      }
      return true;
    }
    if (path_is({"model", "vocab", "*"})) {  // BPE / WordPiece / WordLevel: {"token": id}
      max_id = std::max(max_id, v);
      if (wanted_.count(key_)) found.emplace(key_, v);
    } else if (path_is({"added_tokens", "[]", "*"}) && key_ == "id") {
      added_id_ = v;
      max_id = std::max(max_id, v);
    }
    return true;
  }

  Layout layout_;
  std::set<std::string> wanted_;
  std::vector<Frame> stack_;
  std::string key_;
  std::string added_content_;
  int64_t added_id_ = -1;
  bool unigram_piece_pending_ = false;
  int64_t unigram_index_ = -1, next_unigram_ = 0;
};

void scan(const std::string& path, const std::string& flag, VocabScanner& scanner) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("{} {}: cannot open the file", flag, path);
  const bool ok = nlohmann::json::sax_parse(in, &scanner);
  if (!ok) fail("{} {}: {}", flag, path, scanner.error.empty() ? "not valid JSON" : scanner.error);
}

// tokenizer_config.json's eos_token: a string or {"content": "..."}.
std::string hf_eos_token(const fs::path& tokenizer_json) {
  const fs::path cfg = tokenizer_json.parent_path() / "tokenizer_config.json";
  std::ifstream in(cfg);
  if (!in) return "";
  nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object() || !j.contains("eos_token")) return "";
  const auto& e = j["eos_token"];
  if (e.is_string()) return e.get<std::string>();
  if (e.is_object() && e.contains("content") && e["content"].is_string()) return e["content"].get<std::string>();
  return "";
}

const char* const kWellKnownEnds[] = {"<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>"};

VocabInfo gpt2_vocab(const DataConfig& d) {
  if (!d.vocab_file || !d.merge_file)
    fail("--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file (the GPT-2 vocab.json and "
         "merges.txt); Megatron's GPT entry point defaults to this tokenizer");
  if (!fs::is_regular_file(*d.merge_file)) fail("--merge-file {}: no such file", *d.merge_file);
  if (!fs::is_regular_file(*d.vocab_file)) fail("--vocab-file {}: no such file", *d.vocab_file);
  VocabScanner s(VocabScanner::Layout::gpt2_vocab_json, {"<|endoftext|>"});
  scan(*d.vocab_file, "--vocab-file", s);
  if (s.entries == 0) fail("--vocab-file {}: no token entries (expected a JSON object token -> id)", *d.vocab_file);
  auto it = s.found.find("<|endoftext|>");
  if (it == s.found.end()) fail("--vocab-file {}: has no <|endoftext|> token (GPT-2's end of document)", *d.vocab_file);
  return {static_cast<int>(s.entries), static_cast<int>(it->second)};
}

VocabInfo hf_vocab(const DataConfig& d) {
  if (!d.tokenizer_model)
    fail("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model (a tokenizer.json or the directory holding it)");
  const std::string path = hf_tokenizer_json_path(*d.tokenizer_model);
  const std::string eos = hf_eos_token(path);
  std::set<std::string> wanted(std::begin(kWellKnownEnds), std::end(kWellKnownEnds));
  if (!eos.empty()) wanted.insert(eos);
  VocabScanner s(VocabScanner::Layout::hf_tokenizer_json, wanted);
  scan(path, "--tokenizer-model", s);
  if (s.max_id < 0) fail("--tokenizer-model {}: no vocabulary found (expected model.vocab in tokenizer.json)", path);
  VocabInfo v;
  v.size = static_cast<int>(s.max_id + 1);
  if (!eos.empty() && s.found.count(eos)) {
    v.eod = static_cast<int>(s.found[eos]);
  } else {
    for (const char* t : kWellKnownEnds)
      if (s.found.count(t)) {
        v.eod = static_cast<int>(s.found[t]);
        break;
      }
  }
  return v;
}

VocabInfo null_vocab(const DataConfig& d) {
  if (!d.vocab_size) fail("--tokenizer-type NullTokenizer needs --vocab-size");
  if (*d.vocab_size <= 0) fail("--vocab-size must be > 0 (got {})", *d.vocab_size);
  VocabInfo v{*d.vocab_size, *d.vocab_size - 1};
  if (d.null_tokenizer_eod_id) {
    if (*d.null_tokenizer_eod_id < 0 || *d.null_tokenizer_eod_id >= *d.vocab_size)
      fail("--null-tokenizer-eod-id {} is outside the vocabulary [0, --vocab-size {})", *d.null_tokenizer_eod_id,
           *d.vocab_size);
    v.eod = *d.null_tokenizer_eod_id;
  }
  return v;
}

}  // namespace

std::string hf_tokenizer_json_path(const std::string& tokenizer_model) {
  fs::path p(tokenizer_model);
  if (fs::is_directory(p)) p /= "tokenizer.json";
  if (!fs::is_regular_file(p))
    fail("--tokenizer-model {}: no tokenizer.json there (megatrain reads local Hugging Face tokenizer files; "
         "download the model's tokenizer.json first)", tokenizer_model);
  return p.string();
}

VocabInfo vocab_info(const DataConfig& d) {
  const std::string type = d.tokenizer_type.value_or("GPT2BPETokenizer");
  if (type == "GPT2BPETokenizer") return gpt2_vocab(d);
  if (type == "HuggingFaceTokenizer") return hf_vocab(d);
  if (type == "NullTokenizer") return null_vocab(d);
  if (type == "SentencePieceTokenizer" || type == "GPTSentencePieceTokenizer" || type == "Llama2Tokenizer") {
    // The .model file is a protobuf: let libsentencepiece read it (data/tokenizer.h).
    if (!d.tokenizer_model) fail("--tokenizer-type {} needs --tokenizer-model (a SentencePiece .model file)", type);
    const auto t = make_sentencepiece_tokenizer(*d.tokenizer_model, type);
    VocabInfo v;
    v.size = static_cast<int>(t->vocab_size());
    try {
      v.eod = t->eod();
    } catch (const Error&) {
      v.eod = -1;  // the model has no eos piece
    }
    return v;
  }
  throw Unsupported(fmt::format("megatrain does not support --tokenizer-type {} yet", type));
}

}  // namespace mt
