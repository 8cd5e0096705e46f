// Tokenizers for megatrain's data preparation and evaluation: Megatron's --tokenizer-type classes
// with the token ids Megatron's own classes produce (Megatron-LM HEAD,
// megatron/core/tokenizers: tokenize(text) of each class):
//   GPT2BPETokenizer      --vocab-file vocab.json --merge-file merges.txt. Megatron builds a
//                         Hugging Face GPT2TokenizerFast from them: byte-level BPE, "<|endoftext|>"
//                         in the text is the special token 50256; eod = 50256.
//   HuggingFaceTokenizer  --tokenizer-model: a local tokenizer.json (or the directory holding it).
//                         ids = the HF tokenizer's encode(text) with its post-processor (a Llama 3
//                         tokenizer.json with a TemplateProcessing post-processor puts
//                         <|begin_of_text|> first); eod = the eos_token of tokenizer_config.json.
//   SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer
//                         --tokenizer-model x.model (libsentencepiece). HEAD wraps all three in one
//                         class: ids = EncodeAsIds(text) (no BOS/EOS added); eod = eos_id().
//   NullTokenizer         --vocab-size V: text is space-separated ids; vocab V, eod = V - 1
//                         (HEAD's rule; --null-tokenizer-eod-id overrides).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace mt {

struct DataConfig;

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  // Appends the ids of text to out. Not thread-safe (tokenizers keep per-word caches): give each
  // thread its own clone().
  virtual void encode(std::string_view text, std::vector<int32_t>& out) = 0;
  std::vector<int32_t> encode(std::string_view text) {
    std::vector<int32_t> ids;
    encode(text, ids);
    return ids;
  }
  // The text of ids (special tokens included), as the reference library decodes them.
  virtual std::string decode(const std::vector<int32_t>& ids) const = 0;
  // What Megatron's FIM dataset asks of its tokenizer (the Hugging Face wrapper's tokens_to_ids
  // and ids_to_text(ids, remove_special_tokens=True)); tokenizers that cannot answer throw
  // mt::Unsupported. convert_token_to_id: the id of a vocabulary token (added tokens included),
  // else the unknown token's id, else nullopt.
  // unknown (optional) is set to whether the token is missing from the vocabulary.
  virtual std::optional<int32_t> convert_token_to_id(std::string_view token, bool* unknown = nullptr) const;
  // The text of ids without the tokenizer's special tokens; ids outside the vocabulary are
  // dropped (transformers' convert_ids_to_tokens gives None for them).
  virtual std::string decode_skip_special(std::span<const int32_t> ids) const;
  // Megatron's tokenizer.vocab_size (before padding): the .bin dtype and the padded vocab follow it.
  virtual int64_t vocab_size() const = 0;
  // End-of-document id (what --append-eod appends). Throws mt::Error, naming the tokenizer files,
  // when the tokenizer defines none.
  virtual int32_t eod() const = 0;
  virtual std::string name() const = 0;  // the --tokenizer-type
  // An independent tokenizer for another thread; shares the (immutable) vocabulary.
  virtual std::unique_ptr<Tokenizer> clone() const = 0;
};

// The tokenizer flags of Megatron's _add_tokenizer_args that matter for tokenization.
struct TokenizerOptions {
  std::string type;                            // --tokenizer-type
  std::optional<std::string> vocab_file;       // --vocab-file
  std::optional<std::string> merge_file;       // --merge-file
  std::optional<std::string> tokenizer_model;  // --tokenizer-model
  std::optional<int64_t> vocab_size;           // --vocab-size (NullTokenizer)
  std::optional<int64_t> null_eod_id;          // --null-tokenizer-eod-id
  bool hf_include_special_tokens = true;       // false: --tokenizer-hf-no-include-special-tokens
};

TokenizerOptions tokenizer_options(const DataConfig& data);

// Builds the tokenizer; throws mt::Error naming the flag or file when something is missing or
// unsupported.
std::unique_ptr<Tokenizer> build_tokenizer(const TokenizerOptions& options);

// Individual constructors (build_tokenizer dispatches to them).
std::unique_ptr<Tokenizer> make_gpt2_bpe_tokenizer(const std::string& vocab_file, const std::string& merge_file);
std::unique_ptr<Tokenizer> make_huggingface_tokenizer(const std::string& tokenizer_model, bool include_special_tokens);
std::unique_ptr<Tokenizer> make_sentencepiece_tokenizer(const std::string& model_file, const std::string& type_name);
std::unique_ptr<Tokenizer> make_null_tokenizer(int64_t vocab_size, std::optional<int64_t> eod_id);

}  // namespace mt
