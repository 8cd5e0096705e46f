#include "data/pretokenizer.h"

#include "data/unicode_classes.h"
#include "data/utf8.h"

namespace mt {
namespace {

constexpr const char* kGpt2 = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
constexpr const char* kCl100k =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr const char* kQwen2 =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// Code point at i, its class bits and the offset after it.
struct Char {
  uint32_t cp;
  uint8_t cls;
  size_t end;
};
inline Char char_at(std::string_view s, size_t i) {
  const auto b = static_cast<unsigned char>(s[i]);
  if (b < 0x80) {
    // ASCII fast path through the same table (first block).
    return Char{b, unicode::kClassBlocks[0][b], i + 1};
  }
  size_t j = i;
  const uint32_t cp = utf8::next(s, j);
  return Char{cp, unicode::classes(cp), j};
}
inline bool is_other(uint8_t cls) { return cls == 0; }  // [^\s\p{L}\p{N}]

// End of the run of characters whose classes satisfy pred, starting at i.
template <typename Pred>
inline size_t run_end(std::string_view s, size_t i, Pred pred) {
  while (i < s.size()) {
    const Char c = char_at(s, i);
    if (!pred(c)) break;
    i = c.end;
  }
  return i;
}
inline bool letter(const Char& c) { return c.cls & unicode::kLetter; }
inline bool number(const Char& c) { return c.cls & unicode::kNumber; }
inline bool space(const Char& c) { return c.cls & unicode::kSpace; }
inline bool other(const Char& c) { return is_other(c.cls); }

// \s+(?!\S) then \s+, for a whitespace character at i: the run, minus its last character when a
// non-space follows and the run has more than one character.
inline size_t whitespace_tail(std::string_view s, size_t i) {
  size_t last_start = i, j = i;
  while (j < s.size()) {
    const Char c = char_at(s, j);
    if (!space(c)) break;
    last_start = j;
    j = c.end;
  }
  if (j == s.size()) return j;
  return last_start > i ? last_start : j;
}

size_t gpt2_match(std::string_view s, size_t i) {
  const size_t n = s.size();
  if (s[i] == '\'' && i + 1 < n) {
    const char a = s[i + 1];
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return i + 2;
    if (i + 2 < n) {
      const char b = s[i + 2];
      if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return i + 3;
    }
  }
  const Char c = char_at(s, i);
  if (c.cp == ' ' && c.end < n) {
    const Char d = char_at(s, c.end);
    if (letter(d)) return run_end(s, d.end, letter);
    if (number(d)) return run_end(s, d.end, number);
    if (other(d)) return run_end(s, d.end, other);
  }
  if (letter(c)) return run_end(s, c.end, letter);
  if (number(c)) return run_end(s, c.end, number);
  if (other(c)) return run_end(s, c.end, other);
  return whitespace_tail(s, i);
}

// (?i:'s|'t|'re|'ve|'m|'ll|'d): Oniguruma's case folding adds U+017F (long s) for 's'.
inline size_t contraction_ci(std::string_view s, size_t i) {
  const size_t n = s.size();
  if (i + 1 >= n) return 0;
  const char a = s[i + 1];
  switch (a | 0x20) {
    case 's':
    case 't':
    case 'm':
    case 'd':
      if (a >= 'A' && a <= 'z') return i + 2;
      break;
    default:
      break;
  }
  if (a == '\xC5' && i + 2 < n && s[i + 2] == '\xBF') return i + 3;  // U+017F
  if (i + 2 < n) {
    const char x = a | 0x20, y = s[i + 2] | 0x20;
    const bool ascii = (a >= 'A' && a <= 'z') && (s[i + 2] >= 'A' && s[i + 2] <= 'z');
    if (ascii && ((x == 'r' && y == 'e') || (x == 'v' && y == 'e') || (x == 'l' && y == 'l'))) return i + 3;
  }
  return 0;
}

size_t cl100k_match(std::string_view s, size_t i, int max_digits) {
  const size_t n = s.size();
  if (s[i] == '\'') {
    if (const size_t e = contraction_ci(s, i)) return e;
  }
  const Char c = char_at(s, i);
  // [^\r\n\p{L}\p{N}]?\p{L}+
  if (letter(c)) return run_end(s, c.end, letter);
  if (c.cp != '\r' && c.cp != '\n' && !number(c) && c.end < n) {
    const Char d = char_at(s, c.end);
    if (letter(d)) return run_end(s, d.end, letter);
  }
  // \p{N}{1,3}
  if (number(c)) {
    size_t j = c.end;
    for (int k = 1; k < max_digits && j < n; ++k) {
      const Char d = char_at(s, j);
      if (!number(d)) break;
      j = d.end;
    }
    return j;
  }
  //  ?[^\s\p{L}\p{N}]+[\r\n]*
  size_t start = i;
  if (c.cp == ' ' && c.end < n && other(char_at(s, c.end))) start = c.end;
  if (start != i || other(c)) {
    size_t j = run_end(s, start, other);
    while (j < n && (s[j] == '\r' || s[j] == '\n')) ++j;
    return j;
  }
  // c is whitespace. \s*[\r\n]+ : up to the last CR/LF of the whitespace run.
  size_t j = i, last_newline_end = 0;
  while (j < n) {
    const Char d = char_at(s, j);
    if (!space(d)) break;
    if (d.cp == '\r' || d.cp == '\n') last_newline_end = d.end;
    j = d.end;
  }
  if (last_newline_end) return last_newline_end;
  return whitespace_tail(s, i);
}

}  // namespace

std::optional<SplitPattern> recognize_split_pattern(std::string_view regex) {
  if (regex == kGpt2) return SplitPattern::gpt2;
  if (regex == kCl100k) return SplitPattern::cl100k;
  if (regex == kQwen2) return SplitPattern::qwen2;
  return std::nullopt;
}

const char* split_pattern_regex(SplitPattern p) {
  switch (p) {
    case SplitPattern::gpt2: return kGpt2;
    case SplitPattern::cl100k: return kCl100k;
    case SplitPattern::qwen2: return kQwen2;
  }
  return "";
}

size_t split_match_end(SplitPattern p, std::string_view text, size_t i) {
  switch (p) {
    case SplitPattern::gpt2: return gpt2_match(text, i);
    case SplitPattern::cl100k: return cl100k_match(text, i, 3);
    case SplitPattern::qwen2: return cl100k_match(text, i, 1);
  }
  return text.size();
}

}  // namespace mt
