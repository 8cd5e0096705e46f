// GPT-2's reversible byte <-> unicode mapping (openai/gpt-2 encoder.py bytes_to_unicode, also the
// Hugging Face ByteLevel pre-tokenizer/decoder): printable bytes map to themselves, the other 68
// to U+0100.. in byte order. Byte-level BPE vocabularies are written in this alphabet.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace mt::byte_level {

// The code point that stands for byte b.
uint32_t byte_to_char(uint8_t b);

// The raw bytes a vocabulary string (in the byte alphabet) stands for, or nullopt if it holds a
// character outside the alphabet.
std::optional<std::string> decode_token(std::string_view token);

// The vocabulary-alphabet spelling of raw bytes.
std::string encode_bytes(std::string_view bytes);

}  // namespace mt::byte_level
