// Megatron's indexed dataset: a .bin of raw token ids and an .idx ("MMIDIDX", version 1) that says
// where each sequence starts and where each document ends (Megatron-LM's
// megatron/core/datasets/indexed_dataset.py).
//
//   .idx: magic "MMIDIDX\0\0" | u64 version=1 | u8 dtype code | u64 N (sequences) | u64 D (=docs+1)
//         | i32 sequence_lengths[N] | i64 sequence_pointers[N] (byte offsets into .bin)
//         | i64 document_indices[D] (sequence index where each document ends; 0 first, N last)
//         | i8 sequence_modes[N] (multimodal datasets only)
//   .bin: the tokens of every sequence back to back, little-endian, no header.
//
// IndexedDataset reads one (the .idx and, by default, the .bin memory-mapped; --no-mmap-bin-files
// reads the .bin with pread instead). IndexedDatasetBuilder writes one, byte-identical to
// Megatron's IndexedDatasetBuilder for the same documents.
#pragma once

#include <cstdint>
#include <cstdio>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <mutex>
#include <vector>

#include "data/low_level_dataset.h"

namespace mt {

// The .idx dtype codes.
enum class TokenDType : uint8_t {
  uint8 = 1,
  int8 = 2,
  int16 = 3,
  int32 = 4,
  int64 = 5,
  float64 = 6,
  float32 = 7,
  uint16 = 8,
};

bool is_valid_dtype_code(uint8_t code);
size_t dtype_itemsize(TokenDType dtype);
std::string_view dtype_name(TokenDType dtype);
// Megatron's DType.optimal_dtype (what preprocess_data writes): uint16 when the vocabulary has
// fewer than 65500 entries, else int32 (also int32 when the size is unknown).
TokenDType optimal_token_dtype(std::optional<int64_t> vocab_size);

std::string idx_path_of(const std::string& prefix);  // prefix + ".idx"
std::string bin_path_of(const std::string& prefix);  // prefix + ".bin"

class IndexedDataset : public LowLevelDataset {
 public:
  struct Options {
    bool mmap_bin = true;     // false: --no-mmap-bin-files (pread instead of mmap)
    bool multimodal = false;  // read sequence_modes after the document indices
  };

  // Opens and validates prefix.idx/.bin. Throws mt::Error naming the file for: a missing file, a
  // wrong magic/version/dtype code, a truncated .idx, negative sequence lengths, a
  // sequence_lengths/document_indices mismatch, and an index that disagrees with its .bin: the
  // sequence pointers must be the running byte offsets of the lengths x the dtype size from 0, and
  // the last sequence must end exactly at the end of the .bin (a linear scan of the pointers).
  IndexedDataset(std::string prefix, Options options);
  explicit IndexedDataset(std::string prefix) : IndexedDataset(std::move(prefix), Options{}) {}
  ~IndexedDataset() override;
  IndexedDataset(const IndexedDataset&) = delete;
  IndexedDataset& operator=(const IndexedDataset&) = delete;

  const std::string& prefix() const { return prefix_; }
  TokenDType dtype() const { return dtype_; }
  int64_t num_sequences() const override { return static_cast<int64_t>(sequence_lengths_.size()); }
  int64_t num_documents() const { return document_count_ - 1; }
  uint64_t bin_size() const { return bin_size_; }
  uint64_t idx_size() const { return idx_size_; }

  std::span<const int32_t> sequence_lengths() const override { return sequence_lengths_; }
  int64_t sequence_pointer(int64_t seq) const;   // byte offset in .bin
  int64_t document_index(int64_t i) const;       // i in [0, num_documents()]
  std::vector<int64_t> document_indices() const;
  std::vector<int8_t> sequence_modes() const;  // empty unless Options::multimodal

  // Tokens [offset, offset + count) of sequence `seq`, as int32, into out. Every token is checked
  // against the limit set by set_token_limit (default: representable as int32 and not negative).
  void read(int64_t seq, int64_t offset, int64_t count, int32_t* out) const override;
  std::string name() const override { return prefix_; }
  // "<N> sequences, lengths <hash>": the GPT indices depend on nothing else in the files.
  std::string cache_identity() const override;

  // Token ids must lie in [0, limit) (the padded vocabulary). Reads check it from then on.
  void set_token_limit(int64_t limit) { token_limit_ = limit; }
  // Checks the token ids against `limit` now: cheaply (the first and last MiB of the .bin and a
  // spread of 64 whole sequences) or, with full (--full-data-check), every token and every
  // sequence's extent. Throws mt::Error naming the file and the first bad id found.
  void check_tokens(int64_t limit, bool full) const;

 private:
  void open_idx();
  void release();
  void open_bin();
  void check_pointers() const;
  void read_raw(uint64_t byte_offset, uint64_t nbytes, void* dst) const;
  void check_range_in_bytes(uint64_t byte_offset, uint64_t nbytes, int64_t limit, const char* what) const;

  std::string prefix_;
  Options options_;
  TokenDType dtype_ = TokenDType::int32;
  size_t itemsize_ = 4;
  int64_t token_limit_ = INT32_MAX + int64_t{1};

  // .idx, memory-mapped; the sequence lengths are copied out (they are the hot array, and the
  // file's 34-byte header leaves them unaligned).
  const uint8_t* idx_map_ = nullptr;
  uint64_t idx_size_ = 0;
  std::vector<int32_t> sequence_lengths_;
  uint64_t pointers_offset_ = 0;
  uint64_t doc_indices_offset_ = 0;
  uint64_t modes_offset_ = 0;
  int64_t document_count_ = 0;
  mutable std::once_flag identity_once_;
  mutable std::string identity_;

  // .bin: mapped, or a descriptor for pread.
  const uint8_t* bin_map_ = nullptr;
  int bin_fd_ = -1;
  uint64_t bin_size_ = 0;
};

// Writes prefix.bin while documents are added and prefix.idx on finalize().
class IndexedDatasetBuilder {
 public:
  IndexedDatasetBuilder(std::string prefix, TokenDType dtype);
  ~IndexedDatasetBuilder();
  IndexedDatasetBuilder(const IndexedDatasetBuilder&) = delete;
  IndexedDatasetBuilder& operator=(const IndexedDatasetBuilder&) = delete;

  // One document made of one sequence (preprocess_data without --split-sentences). An empty
  // document adds no sequence but still ends a document, as Megatron's writer does.
  void add_document(std::span<const int32_t> tokens);
  // One document made of several sequences (sentences) of the given lengths (sum = tokens.size()).
  void add_document(std::span<const int32_t> tokens, std::span<const int32_t> lengths);
  // One sequence; end_document() closes the document (Megatron's add_item/end_document).
  void add_item(std::span<const int32_t> tokens);
  void end_document();
  // Appends another dataset with the same dtype (merging preprocess_data partitions).
  void add_index(const std::string& other_prefix);
  // Flushes and closes prefix.bin and writes prefix.idx.
  void finalize();

  int64_t num_sequences() const { return static_cast<int64_t>(sequence_lengths_.size()); }
  int64_t num_documents() const { return static_cast<int64_t>(document_indices_.size()) - 1; }

 private:
  void write_tokens(std::span<const int32_t> tokens);

  std::string prefix_;
  TokenDType dtype_;
  size_t itemsize_;
  std::FILE* bin_ = nullptr;
  std::vector<uint8_t> convert_buffer_;
  std::vector<int32_t> sequence_lengths_;
  std::vector<int64_t> document_indices_{0};
  bool finalized_ = false;
};

}  // namespace mt
