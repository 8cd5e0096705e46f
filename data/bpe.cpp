#include "data/bpe.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <queue>

#include "core/error.h"
#include "data/byte_level.h"
#include "data/utf8.h"

namespace mt {

// ---------------------------------------------------------------------------------------------
// BpeWordCache

BpeWordCache::BpeWordCache() : slots_(kSets * kWays) {}

void BpeWordCache::insert(std::string_view word, uint64_t hash, const int32_t* ids, size_t count) {
  if (word.size() > kMaxWordBytes || count > kMaxIds) return;
  Slot* set = &slots_[(hash & kSetMask) * kWays];
  size_t way = 0;
  while (way < kWays && set[way].length != 0xFF) ++way;
  if (way == kWays) {  // full: round-robin victim
    way = set[0].next_victim % kWays;
    set[0].next_victim = static_cast<uint8_t>(way + 1);
  }
  Slot& s = set[way];
  s.tag = static_cast<uint32_t>(hash >> 32);
  s.length = static_cast<uint8_t>(word.size());
  s.count = static_cast<uint8_t>(count);
  std::memcpy(s.word, word.data(), word.size());
  std::memcpy(s.ids, ids, count * sizeof(int32_t));
}

// ---------------------------------------------------------------------------------------------
// BpeModel

BpeModel::BpeModel(const BpeSpec& spec)
    : byte_level_(spec.byte_level),
      ignore_merges_(spec.ignore_merges),
      byte_fallback_(spec.byte_fallback),
      fuse_unk_(spec.fuse_unk),
      vocab_(spec.byte_level ? spec.vocab.size() : 1),
      spelled_vocab_(spec.vocab.size()),
      merges_(spec.merges.size()) {
  int32_t max_id = -1;
  for (const auto& [token, id] : spec.vocab) {
    if (id < 0) fail("BPE vocabulary entry '{}' has a negative id {}", token, id);
    max_id = std::max(max_id, id);
  }
  id_to_token_.assign(static_cast<size_t>(max_id + 1), std::string());
  for (const auto& [token, id] : spec.vocab) {
    spelled_vocab_.insert_or_assign(token, id);
    id_to_token_[id] = token;
    // Byte-level: keyed by raw bytes. A string outside the byte alphabet can never come out of a
    // byte-level pre-tokenizer. (Otherwise the model looks words up in spelled_vocab_.)
    if (byte_level_)
      if (auto bytes = byte_level::decode_token(token)) vocab_.insert_or_assign(*bytes, id);
  }
  vocab_entries_ = spelled_vocab_.size();

  static const std::string kMeta = "\xE2\x96\x81";  // U+2581
  if (!byte_level_ && !ignore_merges_) {
    split_at_metaspace_ = true;
    for (const auto& [token, id] : spec.vocab) {
      for (size_t p = token.find(kMeta, 1); p != std::string::npos; p = token.find(kMeta, p + 1)) {
        if (p < kMeta.size() || token.compare(p - kMeta.size(), kMeta.size(), kMeta) != 0) {
          split_at_metaspace_ = false;
          break;
        }
      }
      if (!split_at_metaspace_) break;
    }
  }

  for (int b = 0; b < 256; ++b) {
    const std::string one(1, static_cast<char>(b));
    const int32_t* id = byte_level_ ? vocab_.find(one) : nullptr;
    byte_ids_[b] = id ? *id : -1;
    const int32_t* fb = spelled_vocab_.find(fmt::format("<0x{:02X}>", b));
    fallback_ids_[b] = fb ? *fb : -1;
  }
  if (spec.unk_token) {
    const int32_t* id = spelled_vocab_.find(*spec.unk_token);
    if (!id) fail("BPE unk_token '{}' is not in the vocabulary", *spec.unk_token);
    unk_id_ = *id;
  }

  // Later duplicates of a pair overwrite earlier ones, as in tokenizers' HashMap collect.
  std::string joined;
  for (size_t rank = 0; rank < spec.merges.size(); ++rank) {
    const auto& [a, b] = spec.merges[rank];
    joined.assign(a);
    joined += b;
    const int32_t* ia = spelled_vocab_.find(a);
    const int32_t* ib = spelled_vocab_.find(b);
    const int32_t* inew = spelled_vocab_.find(joined);
    if (!ia || !ib || !inew)
      fail("BPE merge #{} '{} {}' refers to a token missing from the vocabulary", rank, a, b);
    merges_.insert_or_assign((uint64_t(uint32_t(*ia)) << 32) | uint32_t(*ib),
                             (uint64_t(rank) << 32) | uint32_t(*inew));
  }
}

int32_t BpeModel::token_to_id(std::string_view token) const {
  const int32_t* id = spelled_vocab_.find(token);
  return id ? *id : -1;
}

void BpeModel::initial_symbols(std::string_view word, std::vector<int32_t>& symbols) const {
  symbols.clear();
  // Unknown-character handling of models/bpe/model.rs merge_word, quirks included: byte
  // fallback if every byte has a <0xXX> token (a pending unk is not flushed first), else unk
  // (consecutive unks fused when fuse_unk), else the character is dropped.
  bool pending_unk = false;
  auto push_unknown = [&](std::string_view ch) {
    if (byte_fallback_) {
      bool all = true;
      for (char c : ch) all = all && fallback_ids_[static_cast<uint8_t>(c)] >= 0;
      if (all) {
        for (char c : ch) symbols.push_back(fallback_ids_[static_cast<uint8_t>(c)]);
        return;
      }
    }
    if (unk_id_ < 0) return;
    if (pending_unk && !fuse_unk_) symbols.push_back(unk_id_);
    pending_unk = true;
  };
  auto push_known = [&](int32_t id) {
    if (pending_unk) {
      symbols.push_back(unk_id_);
      pending_unk = false;
    }
    symbols.push_back(id);
  };
  if (byte_level_) {
    for (char c : word) {
      const int32_t id = byte_ids_[static_cast<uint8_t>(c)];
      if (id >= 0) push_known(id);
      else push_unknown(byte_level::encode_bytes(std::string_view(&c, 1)));  // the model sees the mapped char
    }
  } else {
    size_t i = 0;
    while (i < word.size()) {
      const size_t len = utf8::sequence_length(static_cast<unsigned char>(word[i]));
      const std::string_view ch = word.substr(i, len);
      if (const int32_t* id = spelled_vocab_.find(ch)) push_known(*id);
      else push_unknown(ch);
      i += len;
    }
  }
  if (pending_unk) symbols.push_back(unk_id_);
}

// Short words: keep the rank of every adjacent pair in an array and rescan it; after a merge only
// the two neighbouring pairs change. Leftmost lowest rank first, exactly the order of the
// priority queue in tokenizers' Word::merge_all.
void BpeModel::merge(std::vector<int32_t>& symbols) const {
  constexpr size_t kShort = 64;
  if (symbols.size() < 2) return;
  if (symbols.size() > kShort) return merge_long(symbols);
  uint64_t pair[kShort];  // (rank << 32 | new_id) of (symbols[i], symbols[i+1]), ~0 if none
  size_t n = symbols.size();
  for (size_t i = 0; i + 1 < n; ++i) pair[i] = pair_merge(symbols[i], symbols[i + 1]);
  while (n > 1) {
    size_t best = 0;
    uint64_t best_value = pair[0];
    for (size_t i = 1; i + 1 < n; ++i)
      if (pair[i] < best_value) best_value = pair[i], best = i;  // rank in the high bits
    if (best_value == ~uint64_t{0}) break;
    symbols[best] = static_cast<int32_t>(best_value & 0xFFFFFFFFu);
    for (size_t i = best + 1; i + 1 < n; ++i) symbols[i] = symbols[i + 1];
    for (size_t i = best + 1; i + 2 < n; ++i) pair[i] = pair[i + 1];
    --n;
    if (best > 0) pair[best - 1] = pair_merge(symbols[best - 1], symbols[best]);
    if (best + 1 < n) pair[best] = pair_merge(symbols[best], symbols[best + 1]);
  }
  symbols.resize(n);
}

// Long words (a whole document when there is no pre-tokenizer, as with Llama 2's tokenizer.json):
// a doubly linked list of symbols and a min-heap of candidate merges keyed by (rank, position).
void BpeModel::merge_long(std::vector<int32_t>& symbols) const {
  const size_t n = symbols.size();
  std::vector<int32_t> prev(n), next(n);
  for (size_t i = 0; i < n; ++i) {
    prev[i] = static_cast<int32_t>(i) - 1;
    next[i] = i + 1 < n ? static_cast<int32_t>(i + 1) : -1;
  }
  struct Candidate {
    uint32_t rank;
    int32_t pos;
    int32_t new_id;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> heap;
  auto push = [&](int32_t pos) {
    const int32_t nx = next[pos];
    if (nx < 0) return;
    const uint64_t v = pair_merge(symbols[pos], symbols[nx]);
    if (v != ~uint64_t{0})
      heap.push(Candidate{static_cast<uint32_t>(v >> 32), pos, static_cast<int32_t>(v & 0xFFFFFFFFu)});
  };
  std::vector<bool> alive(n, true);
  for (size_t i = 0; i + 1 < n; ++i) push(static_cast<int32_t>(i));
  while (!heap.empty()) {
    const Candidate top = heap.top();
    heap.pop();
    const int32_t pos = top.pos;
    if (!alive[pos] || next[pos] < 0) continue;
    const int32_t nx = next[pos];
    // A stale candidate: the pair at pos changed since it was pushed.
    const uint64_t v = pair_merge(symbols[pos], symbols[nx]);
    if (v == ~uint64_t{0} || static_cast<int32_t>(v & 0xFFFFFFFFu) != top.new_id ||
        static_cast<uint32_t>(v >> 32) != top.rank)
      continue;
    symbols[pos] = top.new_id;
    alive[nx] = false;
    next[pos] = next[nx];
    if (next[nx] >= 0) prev[next[nx]] = pos;
    if (prev[pos] >= 0) push(prev[pos]);
    push(pos);
  }
  size_t out = 0;
  for (int32_t i = 0; i >= 0; i = next[i]) symbols[out++] = symbols[i];
  symbols.resize(out);
}

void BpeModel::encode_word(std::string_view word, std::vector<int32_t>& out, BpeWordCache& cache) const {
  if (split_at_metaspace_ && word.size() > BpeWordCache::kMaxWordBytes) {
    static const std::string_view kMeta = "\xE2\x96\x81";
    size_t begin = 0;
    for (size_t p = word.find(kMeta, 1); p != std::string_view::npos; p = word.find(kMeta, p + kMeta.size())) {
      if (p >= kMeta.size() && word.compare(p - kMeta.size(), kMeta.size(), kMeta) == 0) continue;  // "▁▁" stays
      encode_piece(word.substr(begin, p - begin), out, cache);
      begin = p;
    }
    return encode_piece(word.substr(begin), out, cache);
  }
  encode_piece(word, out, cache);
}

void BpeModel::encode_piece(std::string_view word, std::vector<int32_t>& out, BpeWordCache& cache) const {
  if (word.empty()) return;
  const bool cacheable = word.size() <= BpeWordCache::kMaxWordBytes;
  uint64_t hash = 0;
  if (cacheable) {
    hash = hash_bytes(word);
    size_t count = 0;
    if (const int32_t* ids = cache.find(word, hash, count)) {
      out.insert(out.end(), ids, ids + count);
      return;
    }
  }
  thread_local std::vector<int32_t> symbols;
  symbols.clear();
  const int32_t* whole = ignore_merges_ ? (byte_level_ ? vocab_ : spelled_vocab_).find(word) : nullptr;
  if (whole) {
    symbols.push_back(*whole);
  } else {
    initial_symbols(word, symbols);
    merge(symbols);
  }
  if (cacheable) cache.insert(word, hash, symbols.data(), symbols.size());
  out.insert(out.end(), symbols.begin(), symbols.end());
}

}  // namespace mt
