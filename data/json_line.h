// One JSONL line, read the way Megatron's tools/preprocess_data.py reads it (Python's
// json.loads, strict): the whole line is validated (a line Python rejects is rejected here, with
// Python's reason), and the values of the requested top-level keys are decoded exactly as Python
// decodes them (\uXXXX escapes, surrogate pairs joined). Much faster than building a DOM.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace mt {

// The value of one requested key.
struct JsonField {
  enum Kind { missing, string, string_list, other };
  Kind kind = missing;
  std::vector<std::string> strings;  // string: one element; string_list: the list's elements
  std::string other_type;            // other: "number", "object", "null", "list holding a number", ...
  // A string decoded to a lone UTF-16 surrogate (legal JSON, kept by Python, but no tokenizer can
  // encode it); the UTF-8 in `strings` holds U+FFFD in its place.
  bool lone_surrogate = false;
};

// Decodes the JSON string that starts at s[i] == '"' as Python's json (strict) does, appending
// its UTF-8 to *out when out is not null, and moves i past the closing quote. A lone surrogate
// escape becomes U+FFFD and sets *lone_surrogate. On failure returns false and fills *err.
struct JsonStringError {
  const char* message = "";
  size_t pos = 0;
};
bool decode_json_string(std::string_view s, size_t& i, std::string* out, bool* lone_surrogate, JsonStringError* err);

class JsonLineParser {
 public:
  explicit JsonLineParser(std::vector<std::string> keys);

  // Parses line (its newline may be included). On success fills fields[i] for keys[i] and returns
  // true; on invalid JSON or a top level that is not an object returns false and sets error to
  // Python's message, e.g. "Expecting value: column 1 (char 0)".
  bool parse(std::string_view line, std::vector<JsonField>& fields, std::string& error);

 private:
  void skip_ws();
  void value(int depth);  // validates and skips one value
  void string_value(std::string* out, bool* lone_surrogate);
  void number();
  void literal(std::string_view word);
  void field_value(JsonField& f);
  // After an object's '{' (an array's '['): each member up to the closing brace, its value left to
  // member() (each element to element()), with Python's messages for missing delimiters. key: where
  // the member names are decoded, or null to skip them.
  template <typename F>
  void members(std::string* key, F&& member);
  template <typename F>
  void elements(F&& element);
  bool at(char c) const { return i_ < s_.size() && s_[i_] == c; }
  bool take(char c) {  // consumes c if it is next
    if (!at(c)) return false;
    ++i_;
    return true;
  }
  void expect(char c, const char* message) {
    if (!take(c)) fail_at(message, i_);
  }
  [[noreturn]] void fail_at(const std::string& message, size_t pos);

  std::vector<std::string> keys_;
  std::string_view s_;
  size_t i_ = 0;
  std::string key_;  // scratch
  std::string* error_ = nullptr;
  size_t error_pos_ = 0;
};

}  // namespace mt
