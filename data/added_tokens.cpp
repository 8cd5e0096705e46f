#include "data/added_tokens.h"

#include <algorithm>

#include "data/unicode_classes.h"
#include "data/utf8.h"

namespace mt {

AddedTokenMatcher::AddedTokenMatcher(const std::vector<AddedToken>& tokens) {
  nodes_.emplace_back();
  for (const AddedToken& t : tokens) {
    if (t.content.empty()) continue;
    tokens_.push_back(t);
    int32_t node = 0;
    for (char c : t.content) {
      const auto b = static_cast<unsigned char>(c);
      int32_t next = child(node, b);
      if (next < 0) {
        next = static_cast<int32_t>(nodes_.size());
        nodes_[node].children.emplace_back(b, next);
        nodes_.emplace_back();
      }
      node = next;
    }
    nodes_[node].token = static_cast<int32_t>(tokens_.size() - 1);
    first_byte_[static_cast<unsigned char>(t.content[0])] = true;
  }
}

int32_t AddedTokenMatcher::child(int32_t node, unsigned char b) const {
  for (const auto& [byte, next] : nodes_[node].children)
    if (byte == b) return next;
  return -1;
}

namespace {
// Char::is_whitespace (Rust) is Unicode White_Space, the same set as \s.
bool is_ws(uint32_t cp) { return unicode::is_space(cp); }
}  // namespace

void AddedTokenMatcher::split(std::string_view text, std::vector<Piece>& out) const {
  if (tokens_.empty()) {
    if (!text.empty()) out.push_back(Piece{0, text.size(), -1});
    return;
  }
  size_t start_offset = 0;  // end of the previous match
  size_t pos = 0;           // where the search resumes
  while (pos < text.size()) {
    // Leftmost position where some token matches, then the longest token there.
    size_t mbegin = text.size();
    int32_t best = -1;
    size_t best_len = 0;
    for (size_t p = pos; p < text.size(); ++p) {
      if (!first_byte_[static_cast<unsigned char>(text[p])]) continue;
      int32_t node = 0;
      for (size_t q = p; q < text.size(); ++q) {
        node = child(node, static_cast<unsigned char>(text[q]));
        if (node < 0) break;
        if (nodes_[node].token >= 0) best = nodes_[node].token, best_len = q + 1 - p;
      }
      if (best >= 0) {
        mbegin = p;
        break;
      }
    }
    if (best < 0) break;
    const AddedToken& tok = tokens_[best];
    size_t begin = mbegin, end = mbegin + best_len;
    pos = end;
    if (tok.lstrip) {
      // Back over whitespace, but not into the previous match.
      size_t b = begin;
      while (b > start_offset) {
        size_t k = b - 1;
        while (k > 0 && (static_cast<unsigned char>(text[k]) & 0xC0) == 0x80) --k;
        size_t kk = k;
        if (!is_ws(utf8::next(text, kk))) break;
        b = k;
      }
      begin = std::max(b, start_offset);
    }
    if (tok.rstrip) {
      size_t e = end;
      while (e < text.size()) {
        size_t k = e;
        if (!is_ws(utf8::next(text, k))) break;
        e = k;
      }
      end = e;
      pos = end;
    }
    if (start_offset < begin) out.push_back(Piece{start_offset, begin, -1});
    out.push_back(Piece{begin, end, tok.id});
    start_offset = end;
  }
  if (start_offset < text.size()) out.push_back(Piece{start_offset, text.size(), -1});
}

}  // namespace mt
