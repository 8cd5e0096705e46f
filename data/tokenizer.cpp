#include "data/tokenizer.h"

#include <filesystem>

#include "core/config.h"
#include "core/error.h"

namespace mt {

TokenizerOptions tokenizer_options(const DataConfig& data) {
  TokenizerOptions o;
  o.type = data.tokenizer_type.value_or("");
  o.vocab_file = data.vocab_file;
  o.merge_file = data.merge_file;
  o.tokenizer_model = data.tokenizer_model;
  if (data.vocab_size) o.vocab_size = *data.vocab_size;
  if (data.null_tokenizer_eod_id) o.null_eod_id = *data.null_tokenizer_eod_id;
  return o;
}

std::optional<int32_t> Tokenizer::convert_token_to_id(std::string_view, bool*) const {
  throw Unsupported(name() + " cannot look up token strings (needed by --fim-data)");
}

std::string Tokenizer::decode_skip_special(std::span<const int32_t>) const {
  throw Unsupported(name() + " cannot decode without its special tokens (needed by --fim-data)");
}

namespace {
const std::string& require(const std::optional<std::string>& value, const char* flag, const std::string& type) {
  if (!value || value->empty()) fail("--tokenizer-type {} needs {}", type, flag);
  return *value;
}
void require_file(const std::string& path, const char* flag) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) fail("{} '{}': no such file", flag, path);
}
}  // namespace

std::unique_ptr<Tokenizer> build_tokenizer(const TokenizerOptions& o) {
  const std::string& t = o.type;
  if (t.empty()) fail("--tokenizer-type is required");
  if (t == "GPT2BPETokenizer") {
    const std::string& vocab = require(o.vocab_file, "--vocab-file (GPT-2's vocab.json)", t);
    const std::string& merges = require(o.merge_file, "--merge-file (GPT-2's merges.txt)", t);
    require_file(vocab, "--vocab-file");
    require_file(merges, "--merge-file");
    return make_gpt2_bpe_tokenizer(vocab, merges);
  }
  if (t == "HuggingFaceTokenizer")
    return make_huggingface_tokenizer(require(o.tokenizer_model, "--tokenizer-model (a tokenizer.json or its directory)", t),
                                      o.hf_include_special_tokens);
  if (t == "SentencePieceTokenizer" || t == "GPTSentencePieceTokenizer" || t == "Llama2Tokenizer")
    return make_sentencepiece_tokenizer(require(o.tokenizer_model, "--tokenizer-model (a SentencePiece .model file)", t), t);
  if (t == "NullTokenizer") {
    if (!o.vocab_size) fail("--tokenizer-type NullTokenizer needs --vocab-size");
    return make_null_tokenizer(*o.vocab_size, o.null_eod_id);
  }
  if (t == "BertWordPieceLowerCase" || t == "BertWordPieceCase" || t == "TikTokenizer" || t == "MultimodalTokenizer" ||
      t == "NullMultimodalTokenizer" || t == "SFTTokenizer")
    throw Unsupported("--tokenizer-type " + t +
                      " is not supported by megatrain (supported: GPT2BPETokenizer, HuggingFaceTokenizer, "
                      "SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer, NullTokenizer)");
  fail("--tokenizer-type '{}' is not a Megatron tokenizer type", t);
}

}  // namespace mt
