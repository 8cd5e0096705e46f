// NullTokenizer (Megatron HEAD megatron/core/tokenizers/text/libraries/null_tokenizer.py): the text
// is token ids separated by single spaces (text.split(' '), each int()-parsed); vocab_size = V,
// eod = V - 1 unless --null-tokenizer-eod-id. megatrain refuses what int() would refuse and, unlike
// Megatron, ids outside [0, V) (they would index past the embedding).
#include <fmt/format.h>

#include "core/error.h"
#include "data/tokenizer.h"
#include "data/unicode_classes.h"
#include "data/utf8.h"

namespace mt {
namespace {

// Python's str.strip() whitespace for the ASCII range, plus Unicode White_Space.
bool python_space(uint32_t cp) { return (cp >= 0x1C && cp <= 0x1F) || unicode::is_space(cp); }

class NullTokenizer final : public Tokenizer {
 public:
  NullTokenizer(int64_t vocab, int64_t eod) : vocab_(vocab), eod_(eod) {}

  void encode(std::string_view text, std::vector<int32_t>& out) override {
    size_t start = 0;
    while (true) {
      const size_t sp = text.find(' ', start);
      const std::string_view field = text.substr(start, sp == std::string_view::npos ? std::string_view::npos : sp - start);
      out.push_back(parse(field));
      if (sp == std::string_view::npos) break;
      start = sp + 1;
    }
  }
  std::string decode(const std::vector<int32_t>& ids) const override {
    std::string s;
    for (size_t i = 0; i < ids.size(); ++i) {
      if (i) s += ' ';
      s += std::to_string(ids[i]);
    }
    return s;
  }
  int64_t vocab_size() const override { return vocab_; }
  int32_t eod() const override { return static_cast<int32_t>(eod_); }
  std::string name() const override { return "NullTokenizer"; }
  std::unique_ptr<Tokenizer> clone() const override { return std::make_unique<NullTokenizer>(vocab_, eod_); }

 private:
  int32_t parse(std::string_view field) const {
    // int(): surrounding whitespace, an optional sign, digits with single '_' between them.
    size_t b = 0, e = field.size();
    while (b < e) {
      size_t k = b;
      if (utf8::valid_sequence_length(field, k) == 0 || !python_space(utf8::next(field, k))) break;
      b = k;
    }
    while (e > b) {
      size_t k = e - 1;
      while (k > b && (static_cast<unsigned char>(field[k]) & 0xC0) == 0x80) --k;
      size_t kk = k;
      if (!python_space(utf8::next(field, kk))) break;
      e = k;
    }
    const std::string_view s = field.substr(b, e - b);
    size_t i = 0;
    bool negative = false;
    if (i < s.size() && (s[i] == '+' || s[i] == '-')) negative = s[i++] == '-';
    int64_t value = 0;
    bool digits = false, ok = i < s.size();
    for (; i < s.size() && ok; ++i) {
      const char c = s[i];
      if (c >= '0' && c <= '9') {
        value = value * 10 + (c - '0');
        digits = true;
        if (value > (int64_t{1} << 40)) ok = false;
      } else if (c == '_' && digits && i + 1 < s.size() && s[i + 1] >= '0' && s[i + 1] <= '9') {
      } else {
        ok = false;
      }
    }
    if (!ok || !digits)
      fail("NullTokenizer: '{}' is not a token id (the text must be integers separated by single spaces)", std::string(field));
    if (negative) value = -value;
    if (value < 0 || value >= vocab_)
      fail("NullTokenizer: token id {} is outside the vocabulary [0, {}) set by --vocab-size", value, vocab_);
    return static_cast<int32_t>(value);
  }
  int64_t vocab_, eod_;
};

}  // namespace

std::unique_ptr<Tokenizer> make_null_tokenizer(int64_t vocab_size, std::optional<int64_t> eod_id) {
  if (vocab_size < 1 || vocab_size > (int64_t{1} << 31) - 1)
    fail("--vocab-size {} is out of range for NullTokenizer (1 .. 2^31-1)", vocab_size);
  const int64_t eod = eod_id.value_or(vocab_size - 1);
  if (eod < 0 || eod >= vocab_size) fail("--null-tokenizer-eod-id {} is outside [0, --vocab-size {})", eod, vocab_size);
  return std::make_unique<NullTokenizer>(vocab_size, eod);
}

}  // namespace mt
