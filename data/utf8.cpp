#include "data/utf8.h"

namespace mt::utf8 {

size_t valid_sequence_length(std::string_view s, size_t i) {
  const size_t n = s.size();
  const auto b0 = static_cast<unsigned char>(s[i]);
  if (b0 < 0x80) return 1;
  auto byte = [&](size_t k) { return static_cast<unsigned char>(s[i + k]); };
  auto cont = [&](size_t k) { return i + k < n && (byte(k) & 0xC0) == 0x80; };
  if (b0 >= 0xC2 && b0 <= 0xDF) return cont(1) ? 2 : 0;
  if (b0 >= 0xE0 && b0 <= 0xEF) {
    if (i + 1 >= n) return 0;
    const unsigned char b1 = byte(1);
    const unsigned char lo = b0 == 0xE0 ? 0xA0 : 0x80;
    const unsigned char hi = b0 == 0xED ? 0x9F : 0xBF;  // ED A0..BF would be a surrogate
    if (b1 < lo || b1 > hi) return 0;
    return cont(2) ? 3 : 0;
  }
  if (b0 >= 0xF0 && b0 <= 0xF4) {
    if (i + 1 >= n) return 0;
    const unsigned char b1 = byte(1);
    const unsigned char lo = b0 == 0xF0 ? 0x90 : 0x80;
    const unsigned char hi = b0 == 0xF4 ? 0x8F : 0xBF;
    if (b1 < lo || b1 > hi) return 0;
    return cont(2) && cont(3) ? 4 : 0;
  }
  return 0;
}

bool is_valid(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    // ASCII fast path: 8 bytes at a time.
    while (i + 8 <= s.size()) {
      uint64_t w;
      __builtin_memcpy(&w, s.data() + i, 8);
      if (w & 0x8080808080808080ull) break;
      i += 8;
    }
    if (i >= s.size()) break;
    const size_t len = valid_sequence_length(s, i);
    if (len == 0) return false;
    i += len;
  }
  return true;
}

// Rust's from_utf8_lossy: on an invalid sequence, the replacement covers the longest prefix of a
// well-formed sequence that is present (at least one byte), then decoding resumes after it.
std::string from_bytes_lossy(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    const size_t len = valid_sequence_length(s, i);
    if (len > 0) {
      out.append(s.data() + i, len);
      i += len;
      continue;
    }
    // Length of the maximal valid prefix of a sequence starting here.
    const auto b0 = static_cast<unsigned char>(s[i]);
    size_t bad = 1;
    auto in = [&](size_t k, unsigned char lo, unsigned char hi) {
      return i + k < s.size() && static_cast<unsigned char>(s[i + k]) >= lo &&
             static_cast<unsigned char>(s[i + k]) <= hi;
    };
    if (b0 >= 0xE0 && b0 <= 0xEF) {
      const unsigned char lo = b0 == 0xE0 ? 0xA0 : 0x80, hi = b0 == 0xED ? 0x9F : 0xBF;
      if (in(1, lo, hi)) bad = 2;
    } else if (b0 >= 0xF0 && b0 <= 0xF4) {
      const unsigned char lo = b0 == 0xF0 ? 0x90 : 0x80, hi = b0 == 0xF4 ? 0x8F : 0xBF;
      if (in(1, lo, hi)) bad = in(2, 0x80, 0xBF) ? 3 : 2;
    }
    out += "\xEF\xBF\xBD";
    i += bad;
  }
  return out;
}

}  // namespace mt::utf8
