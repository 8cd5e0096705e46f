// GPTDataset: fixed-length token windows cut from a LowLevelDataset in Megatron's exact order
// (Megatron-LM's megatron/core/datasets/gpt_dataset.py + helpers.cpp).
//
// Over the split's sequences [begin, end) with T tokens per epoch, E epochs are needed for
// num_samples windows of seq_length + 1 tokens (consecutive windows share one token). Three indices
// decide what sample i is, all drawn from one numpy RandomState(seed) in this order:
//   document index  every sequence id once per epoch, shuffled (the last epoch separately when it
//                   contributes fewer than 80% of an epoch's samples);
//   sample index    (position in the document index, token offset) where each window starts;
//   shuffle index   a permutation of the windows (the last epoch's again separately).
// The indices are cached as .npy files keyed by everything they depend on.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "data/fim.h"
#include "data/low_level_dataset.h"
#include "data/npy.h"
#include "data/numpy_random.h"
#include "data/split.h"

namespace mt {

// A source of fixed-length token windows, in dataset order: a GPTDataset or a BlendedDataset.
class SampleDataset {
 public:
  virtual ~SampleDataset() = default;
  virtual int64_t size() const = 0;
  // seq_length + 1 (the window holds the tokens and, shifted by one, the labels).
  virtual int window_length() const = 0;
  // The window of sample idx (0 <= idx < size()), padded with the pad id where the data runs short.
  virtual void window(int64_t idx, int32_t* out) const = 0;
  // The window as a training loader reads it. Datasets whose samples depend on the order they are
  // read in (--fim-data: a random stream per DataLoader worker) draw from `streams`, the state of
  // this reader; the others give window(idx, out).
  virtual void read_window(int64_t idx, int32_t* out, SampleStreams& streams) const {
    (void)streams;
    window(idx, out);
  }
  // The lengths of the document parts window idx is read from, in order (Megatron's
  // document_lengths: the last part includes the extra token). Default: one document.
  virtual void document_parts(int64_t idx, std::vector<int32_t>& lengths) const {
    (void)idx;
    lengths.assign(1, window_length());
  }
  virtual std::string describe() const = 0;
  // Text that determines every sample (for naming and checking cache files).
  virtual std::string cache_key() const = 0;
};

struct GPTDatasetOptions {
  int seq_length = 0;
  uint32_t seed = 1234;
  bool add_extra_token = true;             // windows of seq_length + 1 tokens
  bool drop_last_partial_sequence = true;  // Megatron's default for every split
  int32_t pad_token_id = -1;               // fills short windows (Megatron's _PAD_TOKEN_ID)
  std::optional<std::string> cache_dir;    // where the index files go; unset: not cached
  // --fim-data: read_window turns samples into fill-in-the-middle samples (data/fim.h). The
  // indices, and so the cache files, do not depend on it.
  std::shared_ptr<const FimConfig> fim;
};

class GPTDataset : public SampleDataset {
 public:
  // num_samples: the number of windows wanted (more may exist: whole epochs are built); nullopt:
  // one epoch. Throws mt::Error naming the data when the split holds too few tokens.
  GPTDataset(std::shared_ptr<const LowLevelDataset> data, Split split, IndexRange indices,
             std::optional<int64_t> num_samples, GPTDatasetOptions options);

  int64_t size() const override { return size_; }
  int window_length() const override { return options_.seq_length + (options_.add_extra_token ? 1 : 0); }
  void window(int64_t idx, int32_t* out) const override;
  void read_window(int64_t idx, int32_t* out, SampleStreams& streams) const override;
  void document_parts(int64_t idx, std::vector<int32_t>& lengths) const override;
  std::string describe() const override;

  const LowLevelDataset& data() const { return *data_; }
  Split split() const { return split_; }
  IndexRange indices() const { return indices_; }
  std::optional<int64_t> num_samples() const { return num_samples_; }
  int64_t tokens_per_epoch() const { return tokens_per_epoch_; }
  int64_t num_epochs() const { return num_epochs_; }
  bool separate_final_epoch() const { return separate_final_epoch_; }
  bool loaded_from_cache() const { return loaded_from_cache_; }
  // The cache files' common path prefix ("<dir>/<hash>-GPTDataset-<split>-"), empty if not cached.
  const std::string& cache_path_prefix() const { return cache_prefix_; }
  // The key text the cache files are named by and checked against.
  std::string cache_key() const override { return key_; }

  const IndexArray& document_index() const { return document_index_; }
  const IndexArray& sample_index() const { return sample_index_; }  // rows = size() + 1, cols = 2
  const IndexArray& shuffle_index() const { return shuffle_index_; }

 private:
  // Reads sample idx's tokens into out; returns how many (window_length() unless the data ran short).
  int64_t read_tokens(int64_t idx, int32_t* out) const;
  template <class Fn>
  void for_each_part(int64_t idx, Fn&& fn) const;
  void build();
  bool try_load_cache();
  void save_cache();

  std::shared_ptr<const LowLevelDataset> data_;
  Split split_;
  IndexRange indices_;
  std::optional<int64_t> num_samples_;
  GPTDatasetOptions options_;

  int64_t tokens_per_epoch_ = 0;
  int64_t num_epochs_ = 1;
  bool separate_final_epoch_ = false;
  int64_t samples_before_final_epoch_ = 0;
  bool loaded_from_cache_ = false;
  std::string key_;
  std::string cache_prefix_;

  IndexArray document_index_;
  IndexArray sample_index_;
  IndexArray shuffle_index_;
  int64_t size_ = 0;
};

// ---- the index-building steps, exposed for tests and the benchmark ----

// _build_document_index: the sequence ids [docs.begin, docs.end) repeated num_epochs times
// (epoch-major), shuffled as one array, or, with separate_final_epoch, the first num_epochs - 1
// epochs shuffled and then the last epoch shuffled on its own.
std::vector<int32_t> build_document_index(IndexRange docs, int64_t num_epochs, numpy_random::RandomState& rng,
                                          bool separate_final_epoch);

// helpers.cpp build_sample_idx: rows of (document-index position, token offset), one per window
// start plus the end; T is int32 or int64 (Megatron picks int32 while the document index fits).
template <typename T>
std::vector<T> build_sample_index(std::span<const int32_t> sizes, std::span<const int32_t> document_index,
                                  int32_t seq_length, int64_t num_epochs, int64_t tokens_per_epoch,
                                  bool drop_last_partial_sequence, int add_extra_token);

// _build_shuffle_index: [0, num_samples) shuffled, then [num_samples, total_size) shuffled on its
// own; uint32 elements, int64 once total_size >= 2^32 - 2.
IndexArray build_shuffle_index(int64_t num_samples, int64_t total_size, numpy_random::RandomState& rng);

// ---- from a window to what training consumes ----

struct SampleMasking {
  int32_t eod_token = -1;
  int32_t pad_token = -1;
  bool reset_position_ids = false;    // positions restart at 0 after each EOD token
  bool reset_attention_mask = false;  // no attention across an EOD token (segments below)
  bool eod_mask_loss = false;         // no loss where the input token is EOD
  // --dataloader-inter-document-masking: segments and positions by the window's document parts
  // (document_segments below) instead of its EOD tokens.
  bool inter_document_masking = false;
};

// Megatron's GPTDataset.__getitem__ + _get_ltor_masks_and_position_ids on one window of s + 1
// tokens: tokens = window[:-1], labels = window[1:]; loss_mask 1 except at EOD inputs
// (eod_mask_loss) and where the label is the pad id; positions 0..s-1 (restarted after each EOD
// with reset_position_ids); segments[t] = number of EOD tokens before position t with
// reset_attention_mask (else 0): position t attends to u <= t only when segments[u] == segments[t],
// exactly Megatron's block-diagonal causal mask. Pad ids become token 0 in tokens and labels.
void make_training_sample(std::span<const int32_t> window, const SampleMasking& masking, int32_t* tokens,
                          int32_t* labels, float* loss_mask, int32_t* positions, int32_t* segments);

// --dataloader-inter-document-masking (Megatron's GPTDataset with inter_document_masking): from the
// lengths of the document parts a window of seq_length (+ 1 with add_extra_token) tokens was read
// from, the last part less the extra token (dropped when that empties it) and any shortfall of a
// padded window folded into the last part, segments[t] = the part holding position t and
// positions[t] = t - that part's start.
void document_segments(std::vector<int32_t> parts, int seq_length, bool add_extra_token, int32_t* positions,
                       int32_t* segments);

}  // namespace mt
