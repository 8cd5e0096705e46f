#include "data/byte_level.h"

#include <array>

#include "data/utf8.h"

namespace mt::byte_level {
namespace {

struct Tables {
  std::array<uint32_t, 256> to_char{};
  std::array<int16_t, 512> to_byte{};  // every mapped code point is < 0x144
  Tables() {
    to_byte.fill(-1);
    uint32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      to_char[b] = printable ? static_cast<uint32_t>(b) : next++;
      to_byte[to_char[b]] = static_cast<int16_t>(b);
    }
  }
};
const Tables& tables() {
  static const Tables t;
  return t;
}

}  // namespace

uint32_t byte_to_char(uint8_t b) { return tables().to_char[b]; }

std::optional<std::string> decode_token(std::string_view token) {
  const Tables& t = tables();
  std::string out;
  out.reserve(token.size());
  size_t i = 0;
  while (i < token.size()) {
    if (utf8::valid_sequence_length(token, i) == 0) return std::nullopt;
    const uint32_t cp = utf8::next(token, i);
    if (cp >= t.to_byte.size() || t.to_byte[cp] < 0) return std::nullopt;
    out += static_cast<char>(t.to_byte[cp]);
  }
  return out;
}

std::string encode_bytes(std::string_view bytes) {
  std::string out;
  for (char c : bytes) utf8::append(out, byte_to_char(static_cast<uint8_t>(c)));
  return out;
}

}  // namespace mt::byte_level
