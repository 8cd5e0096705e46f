// Vocabulary size and end-of-document id of the configured tokenizer, read cheaply from its files
// (no tokenizer is built): what the CLI needs for the padded vocabulary and the data pipeline for
// EOD handling. Semantics follow Megatron's tokenizers:
//   GPT2BPETokenizer      entries in --vocab-file (GPT-2: 50257), eod = id of <|endoftext|>
//   HuggingFaceTokenizer  max id + 1 over tokenizer.json's model vocabulary and added tokens
//                         (Llama 3: 128256); eod = the eos_token of tokenizer_config.json next to
//                         it, else a well-known end token (<|endoftext|>, <|end_of_text|>, </s>,
//                         <eos>), else -1 (unknown)
//   NullTokenizer         --vocab-size V; eod = V - 1 (Megatron HEAD) or --null-tokenizer-eod-id
//   SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer
//                         the .model's piece count; eod = its eos_id (data/tokenizer.h)
// Throws mt::Error naming the flag and file when something is missing or malformed.
#pragma once

#include <string>

namespace mt {

struct DataConfig;

struct VocabInfo {
  int size = 0;  // before padding
  int eod = -1;  // -1: the tokenizer has no known end-of-document token
};

VocabInfo vocab_info(const DataConfig& data);

// The tokenizer.json that --tokenizer-model names (the file itself, or a directory holding one).
std::string hf_tokenizer_json_path(const std::string& tokenizer_model);

}  // namespace mt
