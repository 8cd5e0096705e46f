#include "data/json_line.h"

#include <fmt/format.h>

#include <cstring>

#include "data/utf8.h"

namespace mt {
namespace {

// Python's json scanner accepts these between tokens (and nothing else).
inline bool is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

inline int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// True if any of the 8 bytes is '"', '\\', a control character (< 0x20) or non-ASCII (>= 0x80).
inline bool has_special(uint64_t w) {
  constexpr uint64_t ones = 0x0101010101010101ull, highs = 0x8080808080808080ull;
  const uint64_t quote = w ^ (ones * '"');
  const uint64_t slash = w ^ (ones * '\\');
  auto zero_byte = [&](uint64_t x) { return (x - ones) & ~x & highs; };
  const uint64_t control = (w - ones * 0x20) & ~w & highs;  // bytes < 0x20 (w's high bit clear)
  return (zero_byte(quote) | zero_byte(slash) | control | (w & highs)) != 0;
}

struct Abort {};  // unwinds out of the recursive descent after fail_at recorded the failure

}  // namespace

JsonLineParser::JsonLineParser(std::vector<std::string> keys) : keys_(std::move(keys)) {}

void JsonLineParser::fail_at(const std::string& message, size_t pos) {
  *error_ = message;
  error_pos_ = pos;
  throw Abort{};
}

void JsonLineParser::skip_ws() {
  while (i_ < s_.size() && is_ws(s_[i_])) ++i_;
}

void JsonLineParser::literal(std::string_view word) {
  if (s_.compare(i_, word.size(), word) != 0) fail_at("Expecting value", i_);
  i_ += word.size();
}

// -?(0|[1-9]\d*)(\.\d+)?([eE][-+]?\d+)?  (fraction and exponent only taken when complete)
void JsonLineParser::number() {
  const size_t start = i_;
  auto digit = [&](size_t k) { return k < s_.size() && s_[k] >= '0' && s_[k] <= '9'; };
  size_t k = i_;
  if (k < s_.size() && s_[k] == '-') ++k;
  if (!digit(k)) fail_at("Expecting value", start);
  if (s_[k] == '0') ++k;
  else while (digit(k)) ++k;
  if (k < s_.size() && s_[k] == '.' && digit(k + 1)) {
    k += 2;
    while (digit(k)) ++k;
  }
  if (k < s_.size() && (s_[k] == 'e' || s_[k] == 'E')) {
    size_t e = k + 1;
    if (e < s_.size() && (s_[e] == '+' || s_[e] == '-')) ++e;
    if (digit(e)) {
      while (digit(e)) ++e;
      k = e;
    }
  }
  i_ = k;
}

bool decode_json_string(std::string_view s, size_t& i, std::string* out, bool* lone_surrogate, JsonStringError* err) {
  const size_t start = i;
  const size_t n = s.size();
  auto error = [&](const char* message, size_t pos) {
    if (err) *err = JsonStringError{message, pos};
    return false;
  };
  ++i;
  while (true) {
    // Plain ASCII runs, 8 bytes at a time.
    size_t run = i;
    while (run + 8 <= n) {
      uint64_t w;
      std::memcpy(&w, s.data() + run, 8);
      if (has_special(w)) break;
      run += 8;
    }
    while (run < n) {
      const auto c = static_cast<unsigned char>(s[run]);
      if (c == '"' || c == '\\' || c < 0x20 || c >= 0x80) break;
      ++run;
    }
    if (out) out->append(s.data() + i, run - i);
    i = run;
    if (i >= n) return error("Unterminated string starting at", start);
    const auto c = static_cast<unsigned char>(s[i]);
    if (c == '"') {
      ++i;
      return true;
    }
    if (c >= 0x80) {
      const size_t len = utf8::valid_sequence_length(s, i);
      if (len == 0) return error("invalid UTF-8", i);
      if (out) out->append(s.data() + i, len);
      i += len;
      continue;
    }
    // A line's own newline inside an open string too: Python's line keeps it (a lone \r becomes
    // one), and json.loads reports it as a control character, not as an unterminated string.
    if (c < 0x20) return error("Invalid control character at", i);
    // Backslash escape.
    if (i + 1 >= n) return error("Unterminated string starting at", start);
    const char e = s[i + 1];
    char simple = 0;
    switch (e) {
      case '"': simple = '"'; break;
      case '\\': simple = '\\'; break;
      case '/': simple = '/'; break;
      case 'b': simple = '\b'; break;
      case 'f': simple = '\f'; break;
      case 'n': simple = '\n'; break;
      case 'r': simple = '\r'; break;
      case 't': simple = '\t'; break;
      case 'u': break;
      default: return error("Invalid \\escape", i);
    }
    if (simple) {
      if (out) *out += simple;
      i += 2;
      continue;
    }
    auto read_hex4 = [&](size_t at) -> int {
      if (at + 4 > n) return -1;
      int v = 0;
      for (size_t k = 0; k < 4; ++k) {
        const int h = hex_value(s[at + k]);
        if (h < 0) return -1;
        v = v * 16 + h;
      }
      return v;
    };
    int cp = read_hex4(i + 2);
    if (cp < 0) return error("Invalid \\uXXXX escape", i + 1);
    i += 6;
    if (cp >= 0xD800 && cp <= 0xDBFF && i + 1 < n && s[i] == '\\' && s[i + 1] == 'u') {
      const int lo = read_hex4(i + 2);
      if (lo < 0) return error("Invalid \\uXXXX escape", i + 1);
      if (lo >= 0xDC00 && lo <= 0xDFFF) {
        cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
        i += 6;
      }
    }
    if (cp >= 0xD800 && cp <= 0xDFFF) {
      if (lone_surrogate) *lone_surrogate = true;
      cp = 0xFFFD;
    }
    if (out) utf8::append(*out, static_cast<uint32_t>(cp));
  }
}

// s_[i_] == '"'. Decodes into *out when out is not null.
void JsonLineParser::string_value(std::string* out, bool* lone_surrogate) {
  JsonStringError err;
  if (!decode_json_string(s_, i_, out, lone_surrogate, &err)) fail_at(err.message, err.pos);
}

template <typename F>
void JsonLineParser::members(std::string* key, F&& member) {
  skip_ws();
  if (take('}')) return;
  while (true) {
    if (!at('"')) fail_at("Expecting property name enclosed in double quotes", i_);
    if (key) key->clear();
    string_value(key, nullptr);
    skip_ws();
    expect(':', "Expecting ':' delimiter");
    skip_ws();
    member();
    skip_ws();
    if (take('}')) return;
    expect(',', "Expecting ',' delimiter");
    skip_ws();
  }
}

template <typename F>
void JsonLineParser::elements(F&& element) {
  skip_ws();
  if (take(']')) return;
  while (true) {
    element();
    skip_ws();
    if (take(']')) return;
    expect(',', "Expecting ',' delimiter");
    skip_ws();
  }
}

void JsonLineParser::value(int depth) {
  if (depth > 5000) fail_at("nesting too deep", i_);
  if (i_ >= s_.size()) fail_at("Expecting value", i_);
  switch (s_[i_]) {
    case '"':
      string_value(nullptr, nullptr);
      return;
    case '{':
      ++i_;
      return members(nullptr, [&] { value(depth + 1); });
    case '[':
      ++i_;
      return elements([&] { value(depth + 1); });
    case 'n': return literal("null");
    case 't': return literal("true");
    case 'f': return literal("false");
    case 'N': return literal("NaN");
    case 'I': return literal("Infinity");
    case '-':
      if (s_.compare(i_, 9, "-Infinity") == 0) {
        i_ += 9;
        return;
      }
      return number();
    default:
      return number();
  }
}

namespace {
const char* type_name(char c) {
  switch (c) {
    case '{': return "an object";
    case '[': return "a list";
    case 'n': return "null";
    case 't':
    case 'f': return "a boolean";
    default: return "a number";
  }
}
}  // namespace

// The value of a requested key: a string, or a list of strings (Megatron tokenizes each element
// as a sentence); anything else is recorded as `other`.
void JsonLineParser::field_value(JsonField& f) {
  f = JsonField{};
  if (i_ >= s_.size()) fail_at("Expecting value", i_);
  const char c = s_[i_];
  if (c == '"') {
    f.kind = JsonField::string;
    f.strings.emplace_back();
    string_value(&f.strings.back(), &f.lone_surrogate);
    return;
  }
  if (c == '[') {
    f.kind = JsonField::string_list;
    ++i_;
    elements([&] {
      if (at('"')) {
        f.strings.emplace_back();
        string_value(&f.strings.back(), &f.lone_surrogate);
        return;
      }
      if (f.kind == JsonField::string_list && i_ < s_.size()) {
        f.kind = JsonField::other;
        f.other_type = std::string("a list holding ") + type_name(s_[i_]);
      }
      value(1);
    });
    return;
  }
  f.kind = JsonField::other;
  f.other_type = type_name(c);
  value(1);
}

bool JsonLineParser::parse(std::string_view line, std::vector<JsonField>& fields, std::string& error) {
  s_ = line;
  i_ = 0;
  fields.assign(keys_.size(), JsonField{});
  error_ = &error;
  try {
    if (line.size() >= 3 && std::memcmp(line.data(), "\xEF\xBB\xBF", 3) == 0)
      fail_at("Unexpected UTF-8 BOM (decode using utf-8-sig)", 0);
    skip_ws();
    if (i_ >= s_.size()) fail_at("Expecting value", i_);
    if (s_[i_] != '{') {
      const char c = s_[i_];
      value(0);
      skip_ws();
      if (i_ != s_.size()) fail_at("Extra data", i_);
      error = fmt::format("the line is {}, not a JSON object", c == '"' ? "a string" : type_name(c));
      return false;
    }
    ++i_;
    members(&key_, [&] {
      size_t k = 0;
      while (k < keys_.size() && keys_[k] != key_) ++k;
      if (k < keys_.size()) field_value(fields[k]);  // a repeated key: the last one wins
      else value(1);
    });
    skip_ws();
    if (i_ != s_.size()) fail_at("Extra data", i_);
    return true;
  } catch (const Abort&) {
    // Python reports the position in characters.
    size_t chars = 0;
    for (size_t k = 0; k < error_pos_ && k < s_.size(); ++k)
      if ((static_cast<unsigned char>(s_[k]) & 0xC0) != 0x80) ++chars;
    error = fmt::format("{}: column {} (char {})", error, chars + 1, chars);
    return false;
  }
}

}  // namespace mt
