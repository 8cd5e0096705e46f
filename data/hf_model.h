// A Hugging Face tokenizer as megatrain runs it: the components of a tokenizer.json (or of GPT-2's
// vocab.json + merges.txt) that it supports, read into plain data. data/hf_tokenizer.cpp runs them
// (added tokens -> normalizer -> pre-tokenizer -> BPE -> post-processor, as tokenizers'
// TokenizerImpl::encode does); data/hf_model_load.cpp reads them and refuses, by name, anything
// else a tokenizer.json may hold (never approximated).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "data/added_tokens.h"
#include "data/bpe.h"
#include "data/pretokenizer.h"

namespace mt {

inline const std::string kMetaspace = "\xE2\x96\x81";  // U+2581, SentencePiece's word boundary

struct NormalizerStep {
  enum Kind { prepend, replace } kind = prepend;
  std::string a, b;  // prepend: a; replace: a -> b
};

struct PreTokenizerStep {
  enum Kind { split, byte_level, metaspace } kind = split;
  SplitPattern pattern = SplitPattern::gpt2;  // split
  bool add_prefix_space = false;              // byte_level
  bool use_regex = true;                      // byte_level
  std::string replacement;                    // metaspace
  enum Scheme { always, first, never } scheme = always;
  bool split_on_replacement = true;
};

struct DecoderStep {
  enum Kind { byte_level, replace, byte_fallback, fuse, strip, metaspace } kind = byte_level;
  std::string a, b;             // replace: a -> b; strip: a = content; metaspace: a = replacement
  size_t start = 0, stop = 0;   // strip
  bool prepend = true;          // metaspace: strip the space it put first
};

// Everything immutable, shared by the clones of one tokenizer.
struct HfModel {
  std::string name;    // --tokenizer-type
  std::string source;  // file(s) it came from, for messages
  std::unique_ptr<BpeModel> bpe;
  std::vector<AddedToken> added;
  AddedTokenMatcher raw_matcher;         // added tokens matched on the raw text
  AddedTokenMatcher normalized_matcher;  // normalized added tokens (only with a normalizer)
  std::vector<NormalizerStep> normalizers;
  std::vector<PreTokenizerStep> pre_tokenizers;
  std::vector<int32_t> prefix_ids, suffix_ids;  // post-processor around the sequence
  std::vector<DecoderStep> decoders;
  std::vector<std::string> id_to_token;  // model vocabulary + added tokens
  int64_t vocab_size = 0;
  int32_t eod = -1;  // -1: none
  // transformers' all_special_tokens and unk_token_id, where megatrain knows them (GPT-2's files:
  // "<|endoftext|>" is bos, eos and unk): what Megatron's FIM dataset uses.
  std::optional<std::vector<std::string>> all_special_tokens;
  int32_t unk = -1;
  std::string eod_missing_reason;
};

// tokenizer.json at --tokenizer-model (the file, or the directory holding it), with the eos_token
// of tokenizer_config.json / special_tokens_map.json beside it. Throws mt::Error / mt::Unsupported.
std::shared_ptr<HfModel> load_tokenizer_json(const std::string& tokenizer_model);

// GPT-2's vocab.json and merges.txt as transformers' GPT2TokenizerFast builds them (Megatron's
// GPT2BPETokenizer): ByteLevel pre-tokenizer and decoder, BPE, "<|endoftext|>" special.
std::shared_ptr<HfModel> load_gpt2_files(const std::string& vocab_file, const std::string& merge_file);

}  // namespace mt
