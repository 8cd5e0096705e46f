// Fill-in-the-middle (FIM) samples, as Megatron-LM's GPTFIMDataset makes them (--fim-data;
// megatron/training/datasets/fim_dataset.py, after "Efficient Training of Language Models to Fill
// in the Middle", Bavarian et al. 2022).
//
// A sample (the seq_length + 1 tokens GPTDataset reads) is cut at every EOD token into segments.
// Each non-empty segment is transformed and followed by the EOD again (an empty segment, i.e. an
// EOD right after another or at the start, loses its EOD); the part after the last EOD is
// transformed too, even when empty. With --fim-split-sample a segment holding that token is first
// given one FIM draw (--fim-rate); if it wins, each fragment between split tokens is transformed
// with --fim-fragment-rate and the split tokens are kept. A segment (or fragment) is transformed
// with probability rate:
//   text = the tokenizer's text of its tokens, special tokens left out;
//   unchanged if the text starts with --fim-no-prefix;
//   two cut points drawn uniformly in [0, characters of text] (Unicode code points) and sorted
//   give prefix, middle, suffix, each tokenized again;
//   SPM (probability --fim-spm-rate): <prefix_tok> <suffix_tok> suffix <middle_tok> prefix middle
//   PSM (otherwise):                  <prefix_tok> prefix <suffix_tok> suffix <middle_tok> middle
// The result is cut to the sample's length, or padded with the FIM pad token.
//
// Every draw comes from one numpy RandomState(--seed) per dataset object, in the order samples are
// read: binomial(1, rate) per segment, then (when transformed) randint(0, len + 1, size=2) and
// binomial(1, spm_rate). Megatron's DataLoader workers each hold a copy of the dataset, so each
// worker has its own stream; SampleStreams is one such copy.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "data/numpy_random.h"

namespace mt {

class Tokenizer;
struct DataConfig;

// The FIM settings with the token ids resolved.
struct FimSpec {
  double rate = 0.5;                    // --fim-rate
  double spm_rate = 0.5;                // --fim-spm-rate
  std::optional<double> fragment_rate;  // --fim-fragment-rate
  std::optional<int32_t> split_sample;  // id of --fim-split-sample
  std::optional<std::string> no_prefix;  // --fim-no-prefix
  int32_t prefix = -1, middle = -1, suffix = -1, pad = -1, eod = -1;
};

// What a FIM dataset needs: the settings, the seed of its streams, and a tokenizer to clone for
// each stream (tokenizers are not thread-safe).
struct FimConfig {
  FimSpec spec;
  uint32_t seed = 1234;
  std::shared_ptr<const Tokenizer> tokenizer;
  std::string describe() const;
};

// The FIM settings of a run: the --fim-* flags, their tokens looked up as Megatron's Hugging Face
// tokenizer does (convert_tokens_to_ids: a token missing from the vocabulary becomes the unknown
// token, "<|endoftext|>" for GPT-2). Throws mt::Error naming the flag when a token has no id at
// all. `notes` receives one line per token that is not in the vocabulary.
std::shared_ptr<const FimConfig> fim_config(const DataConfig& data, uint32_t seed, std::shared_ptr<const Tokenizer> tokenizer,
                                            std::vector<std::string>* notes = nullptr);

// One FIM transformation stream's worker: the transformation with its own tokenizer clone.
class FimTransform {
 public:
  FimTransform(const FimSpec& spec, std::unique_ptr<Tokenizer> tokenizer);
  ~FimTransform();
  FimTransform(FimTransform&&) noexcept;
  FimTransform& operator=(FimTransform&&) noexcept;

  // Transforms sample in place (its length kept), drawing from rng.
  void apply(std::span<int32_t> sample, numpy_random::RandomState& rng);

  // _permute of one segment with the given rate, appended to out (exposed for tests).
  void permute(std::span<const int32_t> segment, double rate, numpy_random::RandomState& rng, std::vector<int32_t>& out);

 private:
  void split_and_permute(std::span<const int32_t> segment, numpy_random::RandomState& rng, std::vector<int32_t>& out);

  FimSpec spec_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::vector<int32_t> result_, prefix_, middle_, suffix_;
};

// The order-dependent state of one reader (one of Megatron's DataLoader workers): for each FIM
// dataset it has read from, a RandomState(seed) and a transform.
class SampleStreams {
 public:
  SampleStreams();
  ~SampleStreams();
  SampleStreams(SampleStreams&&) noexcept;
  SampleStreams& operator=(SampleStreams&&) noexcept;

  // Transforms the sample of FIM dataset `owner` (any stable address identifying it).
  void fim(const void* owner, const FimConfig& config, std::span<int32_t> sample);

 private:
  struct Stream;
  std::vector<std::unique_ptr<Stream>> streams_;
};

}  // namespace mt
