#include "data/gpt_dataset.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <new>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/log.h"
#include "data/hash.h"

namespace mt {

// ---------------------------------------------------------------------------------------------
// Index building

std::vector<int32_t> build_document_index(IndexRange docs, int64_t num_epochs, numpy_random::RandomState& rng,
                                          bool separate_final_epoch) {
  MT_CHECK(docs.begin >= 0 && docs.end <= INT32_MAX && docs.begin <= docs.end, "document range [{}, {})",
           docs.begin, docs.end);
  const int64_t n = docs.size();
  std::vector<int32_t> index(static_cast<size_t>(num_epochs * n));
  for (int64_t e = 0; e < num_epochs; ++e) {
    for (int64_t i = 0; i < n; ++i) index[static_cast<size_t>(e * n + i)] = static_cast<int32_t>(docs.begin + i);
  }
  if (!separate_final_epoch || num_epochs == 1) {
    rng.shuffle(std::span<int32_t>(index));
  } else {
    rng.shuffle(std::span<int32_t>(index.data(), static_cast<size_t>((num_epochs - 1) * n)));
    rng.shuffle(std::span<int32_t>(index.data() + (num_epochs - 1) * n, static_cast<size_t>(n)));
  }
  return index;
}

template <typename T>
std::vector<T> build_sample_index(std::span<const int32_t> sizes, std::span<const int32_t> document_index,
                                  int32_t seq_length, int64_t num_epochs, int64_t tokens_per_epoch,
                                  bool drop_last_partial_sequence, int add_extra_token) {
  MT_CHECK(seq_length > 1 && num_epochs > 0 && tokens_per_epoch > 1, "seq_length {} epochs {} tokens {}",
           seq_length, num_epochs, tokens_per_epoch);
  const int64_t total = num_epochs * tokens_per_epoch - add_extra_token;
  int64_t num_samples;
  if (drop_last_partial_sequence) {
    num_samples = total / seq_length;
  } else {
    // helpers.cpp divides in float (single precision), so do we.
    num_samples = static_cast<int64_t>(std::ceil(static_cast<float>(total) / static_cast<float>(seq_length)));
  }
  std::vector<T> out(static_cast<size_t>(2 * (num_samples + 1)));
  const int64_t last = static_cast<int64_t>(document_index.size()) - 1;
  int64_t di = 0;      // position in the document index
  int64_t offset = 0;  // token offset in that document
  out[0] = 0;
  out[1] = 0;
  for (int64_t k = 1; k <= num_samples; ++k) {
    int64_t remaining = seq_length + add_extra_token;
    while (remaining != 0) {
      const int64_t doc_length = sizes[static_cast<size_t>(document_index[static_cast<size_t>(di)])] - offset;
      remaining -= doc_length;
      if (remaining <= 0) {
        // The window ends inside this document; the next starts on its last token (the extra one).
        offset += remaining + doc_length - add_extra_token;
        remaining = 0;
      } else {
        if (di == last) {
          // Out of documents (only without drop_last): the final partial window ends here.
          offset = sizes[static_cast<size_t>(document_index[static_cast<size_t>(di)])] - add_extra_token;
          break;
        }
        ++di;
        offset = 0;
      }
    }
    out[static_cast<size_t>(2 * k)] = static_cast<T>(di);
    out[static_cast<size_t>(2 * k + 1)] = static_cast<T>(offset);
  }
  return out;
}

template std::vector<int32_t> build_sample_index<int32_t>(std::span<const int32_t>, std::span<const int32_t>, int32_t,
                                                          int64_t, int64_t, bool, int);
template std::vector<int64_t> build_sample_index<int64_t>(std::span<const int32_t>, std::span<const int32_t>, int32_t,
                                                          int64_t, int64_t, bool, int);

namespace {

template <typename T>
IndexArray shuffled_ranges(int64_t num_samples, int64_t total_size, numpy_random::RandomState& rng) {
  std::vector<T> v(static_cast<size_t>(total_size));
  for (int64_t i = 0; i < total_size; ++i) v[static_cast<size_t>(i)] = static_cast<T>(i);
  rng.shuffle(std::span<T>(v.data(), static_cast<size_t>(num_samples)));
  if (num_samples != total_size) {
    rng.shuffle(std::span<T>(v.data() + num_samples, static_cast<size_t>(total_size - num_samples)));
  }
  return IndexArray::from_vector(std::move(v));
}

}  // namespace

IndexArray build_shuffle_index(int64_t num_samples, int64_t total_size, numpy_random::RandomState& rng) {
  MT_CHECK(0 <= num_samples && num_samples <= total_size, "shuffle ranges {} {}", num_samples, total_size);
  if (total_size >= static_cast<int64_t>(UINT32_MAX) - 1) return shuffled_ranges<int64_t>(num_samples, total_size, rng);
  return shuffled_ranges<uint32_t>(num_samples, total_size, rng);
}

// ---------------------------------------------------------------------------------------------
// GPTDataset

GPTDataset::GPTDataset(std::shared_ptr<const LowLevelDataset> data, Split split, IndexRange indices,
                       std::optional<int64_t> num_samples, GPTDatasetOptions options)
    : data_(std::move(data)), split_(split), indices_(indices), num_samples_(num_samples), options_(std::move(options)) {
  MT_CHECK(indices_.begin >= 0 && indices_.begin <= indices_.end && indices_.end <= data_->num_sequences(),
           "split range [{}, {}) of {} sequences", indices_.begin, indices_.end, data_->num_sequences());
  if (options_.seq_length < 2) fail("--seq-length {} is too short for a GPT dataset (at least 2)", options_.seq_length);
  if (num_samples_ && *num_samples_ < 0) fail("negative sample count {} requested from {}", *num_samples_, data_->name());
  build();
}

std::string GPTDataset::describe() const {
  return fmt::format("{}({}, {} split, sequences [{}, {}){})", options_.fim ? "GPTFIMDataset" : "GPTDataset", data_->name(),
                     split_name(split_), indices_.begin, indices_.end, options_.fim ? "; " + options_.fim->describe() : "");
}

void GPTDataset::build() {
  const auto sizes = data_->sequence_lengths();
  tokens_per_epoch_ = 0;
  for (int64_t i = indices_.begin; i < indices_.end; ++i) tokens_per_epoch_ += sizes[static_cast<size_t>(i)];
  const int64_t s = options_.seq_length;
  const int extra = options_.add_extra_token ? 1 : 0;

  if (tokens_per_epoch_ <= 1) {
    // Megatron would loop forever or trip an assertion here; an empty split that nobody samples
    // from is harmless, one that must deliver samples is an input error.
    if (num_samples_.value_or(0) == 0) {
      size_ = 0;
      document_index_ = IndexArray::from_vector(std::vector<int32_t>{});
      sample_index_ = IndexArray::from_vector(std::vector<int32_t>{0, 0}, 2);
      shuffle_index_ = IndexArray::from_vector(std::vector<uint32_t>{});
      return;
    }
    fail("{}: the {} split (sequences [{}, {}) of {}) holds {} tokens, too few for {} samples of {} tokens: change "
         "--split or add data",
         data_->name(), split_name(split_), indices_.begin, indices_.end, data_->num_sequences(), tokens_per_epoch_,
         *num_samples_, s + extra);
  }

  // _get_num_epochs: the fewest epochs whose tokens cover num_samples windows.
  num_epochs_ = 1;
  if (num_samples_) {
    const int64_t requested = *num_samples_ * s + extra;
    num_epochs_ = std::max<int64_t>(1, (requested + tokens_per_epoch_ - 1) / tokens_per_epoch_);
  }
  separate_final_epoch_ = false;
  samples_before_final_epoch_ = 0;
  if (num_epochs_ > 1) {
    samples_before_final_epoch_ = ((num_epochs_ - 1) * tokens_per_epoch_ - extra) / s;
    const int64_t from_final_epoch = *num_samples_ - samples_before_final_epoch_;
    const int64_t per_epoch = (tokens_per_epoch_ - extra) / s;
    MT_CHECK(from_final_epoch >= 0 && from_final_epoch <= per_epoch + 1, "final epoch samples {} of {}",
             from_final_epoch, per_epoch);
    separate_final_epoch_ = from_final_epoch < static_cast<int64_t>(0.80 * static_cast<double>(per_epoch));
  }

  nlohmann::ordered_json key;
  key["class"] = "GPTDataset";
  key["format"] = 1;
  key["data"] = data_->cache_identity();
  key["index_split"] = split_name(split_);
  key["indices"] = {indices_.begin, indices_.end};
  key["num_samples"] = num_samples_ ? nlohmann::ordered_json(*num_samples_) : nlohmann::ordered_json(nullptr);
  key["random_seed"] = options_.seed;
  key["sequence_length"] = options_.seq_length;
  key["add_extra_token_to_sequence"] = options_.add_extra_token;
  key["drop_last_partial_sequence"] = options_.drop_last_partial_sequence;
  key_ = key.dump();
  if (options_.cache_dir) {
    cache_prefix_ = fmt::format("{}/{}-GPTDataset-{}-", *options_.cache_dir, hash_hex(key_), split_name(split_));
    if (try_load_cache()) {
      log::info("Load the GPTDataset {} indices from {}", split_name(split_), cache_prefix_);
      loaded_from_cache_ = true;
      size_ = sample_index_.rows() - 1;
      return;
    }
  }

  const int64_t docs = indices_.size();
  // Megatron's INFO lines around the build, with its time and rate (large blends take a while).
  log::info("Build and save the GPTDataset {} indices", split_name(split_));
  const auto build_start = std::chrono::steady_clock::now();
  try {
    numpy_random::RandomState rng(options_.seed);
    std::vector<int32_t> document_index = build_document_index(indices_, num_epochs_, rng, separate_final_epoch_);
    if (document_index.size() <= static_cast<size_t>(INT32_MAX)) {
      sample_index_ = IndexArray::from_vector(
          build_sample_index<int32_t>(sizes, document_index, options_.seq_length, num_epochs_, tokens_per_epoch_,
                                      options_.drop_last_partial_sequence, extra),
          2);
    } else {
      sample_index_ = IndexArray::from_vector(
          build_sample_index<int64_t>(sizes, document_index, options_.seq_length, num_epochs_, tokens_per_epoch_,
                                      options_.drop_last_partial_sequence, extra),
          2);
    }
    document_index_ = IndexArray::from_vector(std::move(document_index));
    const int64_t total = sample_index_.rows() - 1;
    shuffle_index_ = separate_final_epoch_ ? build_shuffle_index(samples_before_final_epoch_, total, rng)
                                           : build_shuffle_index(total, total, rng);
  } catch (const std::bad_alloc&) {
    fail("{}: out of memory building the {} indices ({} epochs x {} documents, {} samples of {} tokens): request "
         "fewer samples or use more data",
         data_->name(), split_name(split_), num_epochs_, docs, num_samples_.value_or(0), s);
  }
  size_ = sample_index_.rows() - 1;
  if (options_.cache_dir) save_cache();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - build_start).count();
  log::info("> total number of samples: {}", size_);
  log::info("> total number of epochs: {}", num_epochs_);
  log::info("> built the {} indices in {:.3f} s ({} documents x {} epochs, {:.0f} samples/s)", split_name(split_), secs,
            docs, num_epochs_, static_cast<double>(size_) / std::max(secs, 1e-9));
}

namespace {

// Why the cached arrays cannot be the indices this dataset builds ("<file>: <what>"), or "" when
// they can. window() trusts them without bounds checks, so everything it indexes is checked here:
// shapes, every document-index value within the split, every sample-index row within the
// document index and its document, the rows in stream order with each window exactly window_length
// tokens long (the last one may be shorter when partial sequences are kept), and the shuffle index
// a permutation of [0, samples) (its two ranges, with a separately shuffled final epoch). One
// linear pass over each array, plus a bitmap of samples / 8 bytes.
std::string cache_damage(const std::string& prefix, const IndexArray& doc, const IndexArray& sample,
                         const IndexArray& shuffle, IndexRange docs, int64_t num_epochs, int64_t expected_samples,
                         int64_t samples_before_final_epoch, bool separate_final_epoch,
                         std::span<const int32_t> sizes, int64_t window_length, int64_t extra) {
  const std::string doc_file = prefix + "document_index.npy";
  const std::string sample_file = prefix + "sample_index.npy";
  const std::string shuffle_file = prefix + "shuffle_index.npy";
  if (!doc.valid()) return doc_file + ": missing or not a simple integer .npy array";
  if (!sample.valid()) return sample_file + ": missing or not a simple integer .npy array";
  if (!shuffle.valid()) return shuffle_file + ": missing or not a simple integer .npy array";
  if (doc.type() != IndexType::i32 || doc.cols() != 1 || doc.size() != num_epochs * docs.size()) {
    return fmt::format("{}: {} x {} elements of {}, expected {} int32 ({} epochs x {} documents)", doc_file,
                       doc.rows(), doc.cols(), index_type_descr(doc.type()), num_epochs * docs.size(), num_epochs,
                       docs.size());
  }
  if ((sample.type() != IndexType::i32 && sample.type() != IndexType::i64) || sample.cols() != 2 ||
      sample.rows() != expected_samples + 1) {
    return fmt::format("{}: {} x {} elements of {}, expected {} x 2 integers", sample_file, sample.rows(),
                       sample.cols(), index_type_descr(sample.type()), expected_samples + 1);
  }
  if ((shuffle.type() != IndexType::u32 && shuffle.type() != IndexType::i64) || shuffle.cols() != 1 ||
      shuffle.size() != expected_samples) {
    return fmt::format("{}: {} x {} elements of {}, expected {} integers", shuffle_file, shuffle.rows(),
                       shuffle.cols(), index_type_descr(shuffle.type()), expected_samples);
  }
  const int64_t positions = doc.size();
  for (int64_t i = 0; i < positions; ++i) {
    const int64_t d = doc[i];
    if (d < docs.begin || d >= docs.end) {
      return fmt::format("{}: element {} is {}, outside the split's documents [{}, {})", doc_file, i, d, docs.begin,
                         docs.end);
    }
  }
  auto length_at = [&](int64_t position) -> int64_t { return sizes[static_cast<size_t>(doc[position])]; };
  // Row k: (position in the document index, token offset). Windows run from row k to row k + 1.
  int64_t d0 = sample.at(0, 0), o0 = sample.at(0, 1);
  if (d0 != 0 || o0 != 0) return fmt::format("{}: row 0 is ({}, {}), expected (0, 0)", sample_file, d0, o0);
  for (int64_t k = 1; k <= expected_samples; ++k) {
    const int64_t d1 = sample.at(k, 0), o1 = sample.at(k, 1);
    // (The offset is compared before anything is added to it: an int64 file may hold any value.)
    if (d1 < d0 || d1 >= positions || (d1 == d0 && o1 < o0) || o1 < -extra || o1 > length_at(d1) - extra) {
      return fmt::format("{}: row {} is ({}, {}) after ({}, {}): out of order or outside the document index ({} "
                         "positions)",
                         sample_file, k, d1, o1, d0, o0, positions);
    }
    // Tokens the window reads: from (d0, o0) to (d1, o1 + extra), walking the documents between.
    int64_t tokens = 0;
    if (d0 == d1) {
      tokens = o1 - o0 + extra;
    } else {
      tokens = length_at(d0) - o0;
      for (int64_t p = d0 + 1; p < d1; ++p) tokens += length_at(p);
      tokens += o1 + extra;
    }
    if (tokens > window_length || (k < expected_samples && tokens != window_length) || o0 > length_at(d0)) {
      return fmt::format("{}: sample {} (rows {} and {}) spans {} tokens, expected {}", sample_file, k - 1, k - 1, k,
                         tokens, window_length);
    }
    d0 = d1;
    o0 = o1;
  }
  std::vector<uint64_t> seen(static_cast<size_t>((expected_samples + 63) / 64), 0);
  const int64_t split_at = separate_final_epoch ? samples_before_final_epoch : expected_samples;
  for (int64_t i = 0; i < expected_samples; ++i) {
    const int64_t v = shuffle[i];
    const int64_t lo = i < split_at ? 0 : split_at, hi = i < split_at ? split_at : expected_samples;
    if (v < lo || v >= hi) {
      return fmt::format("{}: element {} is {}, outside [{}, {})", shuffle_file, i, v, lo, hi);
    }
    uint64_t& word = seen[static_cast<size_t>(v / 64)];
    const uint64_t bit = uint64_t{1} << (v % 64);
    if (word & bit) return fmt::format("{}: element {} repeats the sample {}", shuffle_file, i, v);
    word |= bit;
  }
  return {};
}

}  // namespace

bool GPTDataset::try_load_cache() {
  std::ifstream description(cache_prefix_ + "description.txt");
  std::string first_line;
  if (!description || !std::getline(description, first_line) || first_line != key_) return false;
  IndexArray doc = IndexArray::map_npy(cache_prefix_ + "document_index.npy");
  IndexArray sample = IndexArray::map_npy(cache_prefix_ + "sample_index.npy");
  IndexArray shuffle = IndexArray::map_npy(cache_prefix_ + "shuffle_index.npy");
  // The sample count build_sample_index makes (drop_last: whole windows; else a final partial one).
  const int64_t extra = options_.add_extra_token ? 1 : 0;
  const int64_t total_tokens = num_epochs_ * tokens_per_epoch_ - extra;
  const int64_t expected_samples =
      options_.drop_last_partial_sequence
          ? total_tokens / options_.seq_length
          : static_cast<int64_t>(std::ceil(static_cast<float>(total_tokens) / static_cast<float>(options_.seq_length)));
  const std::string damage =
      cache_damage(cache_prefix_, doc, sample, shuffle, indices_, num_epochs_, expected_samples,
                   samples_before_final_epoch_, separate_final_epoch_, data_->sequence_lengths(), window_length(), extra);
  if (!damage.empty()) {
    // docs/data.md promises a rebuild; the rebuilt files replace these (temporary name + rename).
    log::warn("ignoring the damaged index cache {}; rebuilding the {} indices", damage, split_name(split_));
    return false;
  }
  document_index_ = std::move(doc);
  sample_index_ = std::move(sample);
  shuffle_index_ = std::move(shuffle);
  return true;
}

void GPTDataset::save_cache() {
  std::error_code ec;
  std::filesystem::create_directories(*options_.cache_dir, ec);
  if (ec) {
    log::warn("cannot create the index cache directory {} ({}): the {} indices of {} are not cached; pass a writable "
              "--data-cache-path",
              *options_.cache_dir, ec.message(), split_name(split_), data_->name());
    return;
  }
  try {
    // The description goes last: a reader trusts the files only once it is there.
    document_index_.write_npy(cache_prefix_ + "document_index.npy");
    sample_index_.write_npy(cache_prefix_ + "sample_index.npy");
    shuffle_index_.write_npy(cache_prefix_ + "shuffle_index.npy");
    write_cache_file_atomically(cache_prefix_ + "description.txt",
                          key_ + "\n" + fmt::format("dataset: {}\n", data_->name()));
  } catch (const Error& e) {
    log::warn("cannot write the index cache ({}); continuing without it; pass a writable --data-cache-path", e.what());
    return;
  }
  // Use the files from now on: mapped pages are shared by every rank of the machine (and dropped
  // under memory pressure) where the built arrays were private to this process.
  IndexArray doc = IndexArray::map_npy(cache_prefix_ + "document_index.npy");
  IndexArray sample = IndexArray::map_npy(cache_prefix_ + "sample_index.npy");
  IndexArray shuffle = IndexArray::map_npy(cache_prefix_ + "shuffle_index.npy");
  if (doc.valid() && sample.valid() && shuffle.valid() && doc.size() == document_index_.size() &&
      sample.size() == sample_index_.size() && shuffle.size() == shuffle_index_.size()) {
    document_index_ = std::move(doc);
    sample_index_ = std::move(sample);
    shuffle_index_ = std::move(shuffle);
  }
}

void GPTDataset::window(int64_t idx, int32_t* out) const {
  const int64_t filled = read_tokens(idx, out);
  std::fill(out + filled, out + window_length(), options_.pad_token_id);
}

// GPTFIMDataset._query_document_sample_shuffle_indices: the tokens read, transformed at their own
// length (Megatron's FIM dataset pads nothing itself; a short final sample keeps the pad id after
// them here).
void GPTDataset::read_window(int64_t idx, int32_t* out, SampleStreams& streams) const {
  if (!options_.fim) return window(idx, out);
  const int64_t filled = read_tokens(idx, out);
  streams.fim(this, *options_.fim, std::span<int32_t>(out, static_cast<size_t>(filled)));
  std::fill(out + filled, out + window_length(), options_.pad_token_id);
}

// Megatron's _query_document_sample_shuffle_indices: the document parts of window idx in order,
// each as (document-index position, token offset, tokens); the last one holds the extra token.
template <class Fn>
void GPTDataset::for_each_part(int64_t idx, Fn&& fn) const {
  MT_CHECK(idx >= 0 && idx < size_, "sample {} of {} ({})", idx, size_, describe());
  const int64_t extra = options_.add_extra_token ? 1 : 0;
  const int64_t j = shuffle_index_[idx];
  const int64_t d0 = sample_index_.at(j, 0), o0 = sample_index_.at(j, 1);
  const int64_t d1 = sample_index_.at(j + 1, 0), o1 = sample_index_.at(j + 1, 1);
  const auto sizes = data_->sequence_lengths();
  if (d0 == d1) {
    fn(d0, o0, o1 - o0 + extra);
    return;
  }
  for (int64_t i = d0; i <= d1; ++i) {
    const int64_t offset = i > d0 ? 0 : o0;
    const int64_t count = i < d1 ? sizes[static_cast<size_t>(document_index_[i])] - offset : o1 + extra;
    fn(i, offset, count);
  }
}

int64_t GPTDataset::read_tokens(int64_t idx, int32_t* out) const {
  const int64_t length = window_length();
  int64_t filled = 0;
  for_each_part(idx, [&](int64_t position, int64_t offset, int64_t count) {
    MT_CHECK(count >= 0 && filled + count <= length, "window {} overflows ({} + {} > {})", idx, filled, count, length);
    data_->read(document_index_[position], offset, count, out + filled);
    filled += count;
  });
  return filled;
}

void GPTDataset::document_parts(int64_t idx, std::vector<int32_t>& lengths) const {
  lengths.clear();
  for_each_part(idx, [&](int64_t, int64_t, int64_t count) { lengths.push_back(static_cast<int32_t>(count)); });
}

// ---------------------------------------------------------------------------------------------
// Masks and positions

void make_training_sample(std::span<const int32_t> window, const SampleMasking& m, int32_t* tokens, int32_t* labels,
                          float* loss_mask, int32_t* positions, int32_t* segments) {
  const size_t s = window.size() - 1;
  int32_t segment_start = 0;  // position of the first token after the last EOD seen
  int32_t segment = 0;
  for (size_t t = 0; t < s; ++t) {
    const int32_t token = window[t];
    const int32_t label = window[t + 1];
    const bool is_eod = token == m.eod_token;
    positions[t] = m.reset_position_ids ? static_cast<int32_t>(t) - segment_start : static_cast<int32_t>(t);
    segments[t] = m.reset_attention_mask ? segment : 0;
    loss_mask[t] = (m.eod_mask_loss && is_eod) || label == m.pad_token ? 0.0f : 1.0f;
    tokens[t] = token == m.pad_token ? 0 : token;
    labels[t] = label == m.pad_token ? 0 : label;
    if (is_eod) {
      segment_start = static_cast<int32_t>(t) + 1;
      ++segment;
    }
  }
}

void document_segments(std::vector<int32_t> parts, int seq_length, bool add_extra_token, int32_t* positions,
                       int32_t* segments) {
  if (add_extra_token && !parts.empty() && --parts.back() == 0) parts.pop_back();
  int64_t sum = 0;
  for (int32_t n : parts) sum += n;
  MT_CHECK(sum <= seq_length, "document parts of {} tokens in a sequence of {}", sum, seq_length);
  if (sum < seq_length) {  // a padded window: the padding joins the last document
    if (parts.empty()) parts.push_back(0);
    parts.back() += static_cast<int32_t>(seq_length - sum);
  }
  int32_t t = 0;
  for (size_t d = 0; d < parts.size(); ++d)
    for (int32_t k = 0; k < parts[d]; ++k, ++t) {
      positions[t] = k;
      segments[t] = static_cast<int32_t>(d);
    }
}

}  // namespace mt
