#include "app/preprocess_data.h"

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <iostream>

#include "core/error.h"
#include "data/preprocess.h"

namespace mt {
namespace {

// Flags of Megatron's tool (or of its tokenizer group) that megatrain does not implement: refused
// by name rather than ignored, because each changes the output.
struct Refused {
  const char* flag;
  const char* why;
};
constexpr Refused kRefused[] = {
    {"--split-sentences", "megatrain does not support --split-sentences yet (NLTK punkt sentence splitting)"},
    {"--find-optimal-num-workers", "megatrain does not support --find-optimal-num-workers (its workers are threads)"},
    {"--workers-to-check", "megatrain does not support --workers-to-check (see --find-optimal-num-workers)"},
    {"--max-documents", "megatrain does not support --max-documents (see --find-optimal-num-workers)"},
    {"--tokenizer-special-tokens", "megatrain does not support --tokenizer-special-tokens"},
    {"--tokenizer-sentencepiece-legacy", "megatrain does not support --tokenizer-sentencepiece-legacy"},
    {"--no-tokenizer-sentencepiece-ignore-extra-whitespaces",
     "megatrain does not support --no-tokenizer-sentencepiece-ignore-extra-whitespaces"},
    {"--disable-tokenizer-sentencepiece-ignore-extra-whitespaces",
     "megatrain does not support --disable-tokenizer-sentencepiece-ignore-extra-whitespaces"},
    {"--tokenizer-hf-no-use-fast", "megatrain does not support --tokenizer-hf-no-use-fast (Python 'slow' tokenizers)"},
    {"--trust-remote-code", "megatrain does not run a tokenizer's Python code (--trust-remote-code)"},
    {"--tokenizer-metadata", "megatrain does not support --tokenizer-metadata"},
    {"--tiktoken-pattern", "megatrain does not support TikTokenizer (--tiktoken-pattern)"},
    {"--tiktoken-num-special-tokens", "megatrain does not support TikTokenizer (--tiktoken-num-special-tokens)"},
    {"--chat-template", "megatrain does not support --chat-template"},
};

int run(const std::vector<std::string>& args) {
  for (const std::string& a : args) {
    const std::string name = a.substr(0, a.find('='));
    for (const Refused& r : kRefused)
      if (name == r.flag) throw Unsupported(r.why);
  }

  CLI::App app{"Tokenize a JSONL corpus into Megatron's indexed dataset (<prefix>_<key>_document.bin/.idx); "
               "the flags of Megatron's tools/preprocess_data.py",
               "megatrain preprocess-data"};
  PreprocessOptions o;
  TokenizerOptions& t = o.tokenizer;
  bool keep_newlines = false, no_pad = false, use_gigatoken = false, hf_no_special = false;
  std::string lang = "english";
  int64_t vocab_size = 0, null_eod = 0, null_pad = -1, padded_vocab = 0, vocab_extra_ids = 0;
  std::string vocab_file, merge_file, tokenizer_model;

  // input data
  app.add_option("--input", o.input, "JSONL file (with --partitions > 1: a glob; .gz read as gzip)")->required();
  app.add_option("--json-keys", o.json_keys, "keys to extract from each JSON line (default: text)")->expected(1, -1);
  app.add_flag("--keep-newlines", keep_newlines, "(only with --split-sentences, which megatrain does not support)");
  // tokenization
  app.add_flag("--append-eod", o.append_eod, "append the tokenizer's end-of-document token to each non-empty document");
  app.add_option("--lang", lang, "(only with --split-sentences)");
  app.add_option("--tokenizer-type", t.type, "GPT2BPETokenizer, HuggingFaceTokenizer, SentencePieceTokenizer, "
                 "GPTSentencePieceTokenizer, Llama2Tokenizer or NullTokenizer")->required();
  auto* vf = app.add_option("--vocab-file", vocab_file, "GPT2BPETokenizer: vocab.json");
  auto* mf = app.add_option("--merge-file", merge_file, "GPT2BPETokenizer: merges.txt");
  auto* tm = app.add_option("--tokenizer-model", tokenizer_model,
                            "HuggingFaceTokenizer: tokenizer.json or its directory; SentencePiece types: the .model file");
  auto* vs = app.add_option("--vocab-size", vocab_size, "NullTokenizer: vocabulary size V (eod = V - 1)");
  auto* ne = app.add_option("--null-tokenizer-eod-id", null_eod, "NullTokenizer: eod id (default V - 1)");
  app.add_option("--null-tokenizer-pad-id", null_pad, "NullTokenizer: pad id (does not affect preprocessing)");
  app.add_flag("--tokenizer-hf-no-include-special-tokens", hf_no_special,
               "HuggingFaceTokenizer: leave out the post-processor's special tokens (e.g. a BOS)");
  app.add_option("--padded-vocab-size", padded_vocab, "(does not affect preprocessing)");
  app.add_flag("--no-pad-vocab-size,--disable-pad-vocab-size", no_pad, "(does not affect preprocessing)");
  app.add_option("--vocab-extra-ids", vocab_extra_ids, "(Megatron's tool resets it to 0)");
  app.add_flag("--use-gigatoken", use_gigatoken, "(no effect: megatrain uses its own tokenizer implementation)");
  // output and runtime
  app.add_option("--output-prefix", o.output_prefix, "path prefix of the output files")->required();
  app.add_option("--workers", o.workers, "tokenizer threads")->required();
  app.add_option("--partitions", o.partitions, "split the input into N partitions (Megatron's document order)");
  app.add_flag("--keep-sequential-samples", o.keep_sequential_samples,
               "with --partitions: contiguous partitions (input order kept)");
  app.add_option("--log-interval", o.log_interval, "progress line every N documents");

  std::vector<std::string> reversed(args.rbegin(), args.rend());
  try {
    app.parse(reversed);
  } catch (const CLI::CallForHelp&) {
    std::cout << app.help();
    return 0;
  } catch (const CLI::ParseError& e) {
    fail("megatrain preprocess-data: {} (see megatrain preprocess-data --help)", e.what());
  }

  if (*vf) t.vocab_file = vocab_file;
  if (*mf) t.merge_file = merge_file;
  if (*tm) t.tokenizer_model = tokenizer_model;
  if (*vs) t.vocab_size = vocab_size;
  if (*ne) t.null_eod_id = null_eod;
  t.hf_include_special_tokens = !hf_no_special;
  if (keep_newlines) std::cerr << "note: --keep-newlines has no effect without --split-sentences (as in Megatron)\n";
  if (app.count("--lang")) std::cerr << "note: --lang has no effect without --split-sentences (as in Megatron)\n";
  if (use_gigatoken) std::cerr << "note: --use-gigatoken has no effect: megatrain tokenizes natively\n";

  const PreprocessResult r = preprocess_data(o, std::cerr);
  const double mb = r.bytes / 1024.0 / 1024.0;
  std::cerr << fmt::format("Done: {} documents, {:.1f} MB in {:.2f} s ({:.1f} docs/s, {:.2f} MB/s)\n", r.documents, mb,
                           r.seconds, r.documents / std::max(r.seconds, 1e-9), mb / std::max(r.seconds, 1e-9));
  for (const std::string& p : r.output_prefixes) std::cerr << "Wrote " << p << ".bin and " << p << ".idx\n";
  return 0;
}

}  // namespace

int preprocess_data_main(const std::vector<std::string>& args) {
  try {
    return run(args);
  } catch (const std::exception& e) {
    std::cerr << "megatrain preprocess-data: error: " << e.what() << "\n";
    return 1;
  }
}

}  // namespace mt
