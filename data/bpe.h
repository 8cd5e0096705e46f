// Byte-pair-encoding model with Hugging Face `tokenizers` semantics (models/bpe/model.rs):
// a word is split into initial symbols, then the adjacent pair with the lowest merge rank (the
// leftmost of equals) is merged until no pair has a rank. Used by GPT2BPETokenizer and by the
// HuggingFaceTokenizer's "BPE" model.
#pragma once

#include <cstdint>
#include <cstring>
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

// Per-thread memo of word -> ids (the BPE of a word never changes). A fixed 4 MiB table of
// 64-byte slots (word and ids stored inline, so a hit touches one cache line), 4-way set
// associative with replacement: it holds the hot words and never needs clearing. Words longer than
// kMaxWordBytes or with more than kMaxIds ids are not cached.
class BpeWordCache {
 public:
  static constexpr size_t kMaxWordBytes = 32;
  static constexpr size_t kMaxIds = 5;

  BpeWordCache();
  // Ids of a cached word (count set), or nullptr.
  const int32_t* find(std::string_view word, uint64_t hash, size_t& count) const {
    const Slot* set = &slots_[(hash & kSetMask) * kWays];
    const auto tag = static_cast<uint32_t>(hash >> 32);
    for (size_t w = 0; w < kWays; ++w) {
      const Slot& s = set[w];
      if (s.tag == tag && s.length == word.size() && std::memcmp(s.word, word.data(), word.size()) == 0) {
        count = s.count;
        return s.ids;
      }
    }
    return nullptr;
  }
  void insert(std::string_view word, uint64_t hash, const int32_t* ids, size_t count);

 private:
  struct alignas(64) Slot {
    uint32_t tag = 0;
    uint8_t length = 0xFF;  // 0xFF: empty
    uint8_t count = 0;
    uint8_t next_victim = 0;  // only used in a set's first slot
    uint8_t pad = 0;
    int32_t ids[kMaxIds] = {};
    char word[kMaxWordBytes] = {};
  };
  static_assert(sizeof(Slot) == 64);
  static constexpr size_t kWays = 4;
  static constexpr size_t kSets = size_t{1} << 14;  // 16384 sets * 4 ways * 64 B = 4 MiB
  static constexpr uint64_t kSetMask = kSets - 1;
  std::vector<Slot> slots_;
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
  void encode_piece(std::string_view word, std::vector<int32_t>& out, BpeWordCache& cache) const;
  void initial_symbols(std::string_view word, std::vector<int32_t>& symbols) const;
  void merge(std::vector<int32_t>& symbols) const;
  void merge_long(std::vector<int32_t>& symbols) const;
  // (rank << 32 | new_id) for a pair, or ~0.
  uint64_t pair_merge(int32_t a, int32_t b) const {
    const uint64_t* v = merges_.find((uint64_t(uint32_t(a)) << 32) | uint32_t(b));
    return v ? *v : ~uint64_t{0};
  }

  bool byte_level_, ignore_merges_, byte_fallback_, fuse_unk_;
  // No vocabulary entry holds U+2581 after another character: no merge can join across a U+2581
  // that follows a different character, so a long word may be split there and its parts encoded
  // (and cached) separately with the same result (SentencePiece-style models without a
  // pre-tokenizer, whose "word" is a whole document).
  bool split_at_metaspace_ = false;
  int32_t unk_id_ = -1;
  int32_t byte_ids_[256];           // byte_level: id of each single byte (-1 if absent)
  int32_t fallback_ids_[256];       // byte_fallback: id of <0xXX> (-1 if absent)
  FlatStringMap vocab_;             // byte_level only: key = the raw bytes a token stands for
  FlatStringMap spelled_vocab_;     // key: the vocabulary string as written in the file
  FlatU64Map merges_;
  std::vector<std::string> id_to_token_;
  size_t vocab_entries_ = 0;
};

}  // namespace mt
