// Byte-pair-encoding model with Hugging Face `tokenizers` semantics (models/bpe/model.rs):
// a word is split into initial symbols, then the adjacent pair with the lowest merge rank (the
// leftmost of equals) is merged until no pair has a rank. Used by GPT2BPETokenizer and by the
// HuggingFaceTokenizer's "BPE" model.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "data/flat_hash.h"

namespace mt {

struct BpeSpec {
  // Token strings as the vocabulary file spells them, with their ids.
  std::vector<std::pair<std::string, int32_t>> vocab;
  // Merges in rank order (rank = position), each a pair of vocabulary strings.
  std::vector<std::pair<std::string, std::string>> merges;
  // The vocabulary is written in GPT-2's byte alphabet (a ByteLevel pre-tokenizer feeds the
  // model): words are raw bytes and each byte is one initial symbol. Otherwise each UTF-8
  // character is one initial symbol.
  bool byte_level = false;
  bool ignore_merges = false;  // a word that is itself a vocabulary entry is emitted whole
  bool byte_fallback = false;  // unknown characters become <0xXX> byte tokens
  std::optional<std::string> unk_token;
  bool fuse_unk = false;  // consecutive unknown characters become one unk token
};

// Per-thread memo of word -> ids (the BPE of a word never changes); bounded, cleared when full.
class BpeWordCache {
 public:
  const int32_t* find(std::string_view word, uint64_t hash, size_t& count) const;
  void insert(std::string_view word, uint64_t hash, const int32_t* ids, size_t count);

 private:
  struct Slot {
    uint64_t hash = 0;
    uint32_t key_offset = 0, key_length = 0;
    uint32_t ids_offset = 0, ids_count = 0;
    bool used = false;
  };
  static constexpr size_t kSlots = size_t{1} << 17;  // at most half full
  static constexpr size_t kMaxKeyBytes = size_t{8} << 20;
  void clear();
  std::vector<Slot> slots_;
  std::string keys_;
  std::vector<int32_t> ids_;
  size_t used_ = 0;
};

class BpeModel {
 public:
  explicit BpeModel(const BpeSpec& spec);

  // Appends the ids of one word (a pre-token: raw bytes when byte_level, else UTF-8 text).
  void encode_word(std::string_view word, std::vector<int32_t>& out, BpeWordCache& cache) const;

  bool byte_level() const { return byte_level_; }
  // Id of a vocabulary string (as spelled in the vocabulary file), or -1.
  int32_t token_to_id(std::string_view token) const;
  // Number of distinct ids in the vocabulary and the largest id + 1.
  size_t vocab_entries() const { return vocab_entries_; }
  const std::vector<std::string>& id_to_token() const { return id_to_token_; }  // "" for holes

 private:
  void initial_symbols(std::string_view word, std::vector<int32_t>& symbols) const;
  void merge(std::vector<int32_t>& symbols) const;
  void merge_long(std::vector<int32_t>& symbols) const;
  // (rank << 32 | new_id) for a pair, or ~0.
  uint64_t pair_merge(int32_t a, int32_t b) const {
    const uint64_t* v = merges_.find((uint64_t(uint32_t(a)) << 32) | uint32_t(b));
    return v ? *v : ~uint64_t{0};
  }

  bool byte_level_, ignore_merges_, byte_fallback_, fuse_unk_;
  int32_t unk_id_ = -1;
  int32_t byte_ids_[256];           // byte_level: id of each single byte (-1 if absent)
  int32_t fallback_ids_[256];       // byte_fallback: id of <0xXX> (-1 if absent)
  FlatStringMap vocab_;             // key: raw bytes (byte_level) or the vocabulary string
  FlatStringMap spelled_vocab_;     // key: the vocabulary string as written in the file
  FlatU64Map merges_;
  std::vector<std::string> id_to_token_;
  size_t vocab_entries_ = 0;
};

}  // namespace mt
