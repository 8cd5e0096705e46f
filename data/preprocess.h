// megatrain preprocess-data: JSONL -> Megatron's indexed dataset (<prefix>_<key>_document.bin/.idx),
// byte-identical to Megatron's tools/preprocess_data.py for the same input and tokenizer.
//
// A bounded streaming pipeline: a reader thread cuts the input into chunks of whole lines; N worker
// threads parse and tokenize chunks; the calling thread writes the results in input order. At most
// 2N+2 chunks are in flight, so memory does not grow with the input (only the index arrays, a few
// bytes per document, do, as in any writer of the format).
//
// Megatron's semantics kept: each line is one document; a key whose value is a list tokenizes
// each element as a sequence; empty sequences are dropped; --append-eod adds the tokenizer's eod to
// non-empty documents only; an empty document still ends a document in the index; the dtype is
// uint16 when the vocabulary has fewer than 65500 entries, else int32. With --partitions P > 1 the
// input is a glob and lines go round-robin to P partitions (contiguously with
// --keep-sequential-samples) whose outputs are then concatenated in partition order, which is the
// document order Megatron's tool produces.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

#include "data/tokenizer.h"

namespace mt {

struct PreprocessOptions {
  std::string input;                        // --input (a glob when partitions > 1)
  std::vector<std::string> json_keys{"text"};
  std::string output_prefix;
  TokenizerOptions tokenizer;
  bool append_eod = false;
  int workers = 1;
  int partitions = 1;
  bool keep_sequential_samples = false;
  int64_t log_interval = 1000;
  size_t chunk_bytes = size_t{1} << 20;    // lines per work item, by size
};

struct PreprocessResult {
  int64_t documents = 0;
  uint64_t bytes = 0;  // input bytes (after newline translation)
  double seconds = 0;  // from the first chunk to the last write
  std::vector<std::string> output_prefixes;  // one per key: <prefix>_<key>_document
};

// The input files, in the order Megatron's tool reads them: --input itself when partitions == 1,
// else the glob's matches in directory order (Python's glob.glob does not sort).
std::vector<std::string> resolve_preprocess_inputs(const std::string& input, int partitions);

// Runs the whole conversion; progress lines go to `log`. Throws mt::Error naming the file, line
// and key on bad input (outputs written so far are removed).
PreprocessResult preprocess_data(const PreprocessOptions& options, std::ostream& log);

}  // namespace mt
