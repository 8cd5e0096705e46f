#include "data/bpe_tables_reader.h"

#include <climits>

#include "data/json_line.h"

namespace mt {

size_t skip_json_ws(std::string_view s, size_t i) {
  while (i < s.size() && (s[i] == ' ' || s[i] == '\t' || s[i] == '\n' || s[i] == '\r')) ++i;
  return i;
}

size_t skip_json_value(std::string_view s, size_t i) {
  int depth = 0;
  while (i < s.size()) {
    const char c = s[i];
    if (c == '"') {
      if (!decode_json_string(s, i, nullptr, nullptr, nullptr)) return std::string::npos;
      if (depth == 0) return i;
      continue;
    }
    if (c == '{' || c == '[') {
      ++depth;
    } else if (c == '}' || c == ']') {
      if (depth == 0) return i;  // a scalar ended by its container's close
      if (--depth == 0) return i + 1;
    } else if (depth == 0 && c == ',') {
      return i;  // a scalar ended
    }
    ++i;
  }
  return depth == 0 ? i : std::string::npos;
}

void locate_model_tables(std::string_view s, ValueSpan& vocab, ValueSpan& merges) {
  size_t i = skip_json_ws(s, 0);
  if (i >= s.size() || s[i] != '{') return;
  ++i;
  std::string key;
  while (true) {  // top-level members
    i = skip_json_ws(s, i);
    if (i >= s.size() || s[i] != '"') return;
    key.clear();
    if (!decode_json_string(s, i, &key, nullptr, nullptr)) return;
    i = skip_json_ws(s, i);
    if (i >= s.size() || s[i] != ':') return;
    i = skip_json_ws(s, i + 1);
    if (key == "model" && i < s.size() && s[i] == '{') {
      ++i;
      while (true) {  // model members
        i = skip_json_ws(s, i);
        if (i < s.size() && s[i] == '}') {
          ++i;
          break;
        }
        if (i >= s.size() || s[i] != '"') return;
        key.clear();
        if (!decode_json_string(s, i, &key, nullptr, nullptr)) return;
        i = skip_json_ws(s, i);
        if (i >= s.size() || s[i] != ':') return;
        i = skip_json_ws(s, i + 1);
        const size_t end = skip_json_value(s, i);
        if (end == std::string::npos) return;
        if (key == "vocab" && s[i] == '{') vocab = {i, end};
        if (key == "merges" && s[i] == '[') merges = {i, end};
        i = skip_json_ws(s, end);
        if (i < s.size() && s[i] == ',') ++i;
      }
    } else {
      const size_t end = skip_json_value(s, i);
      if (end == std::string::npos) return;
      i = end;
    }
    i = skip_json_ws(s, i);
    if (i < s.size() && s[i] == ',') {
      ++i;
      continue;
    }
    return;
  }
}

bool read_vocab_object(std::string_view s, ValueSpan span, std::vector<std::pair<std::string, int32_t>>& out) {
  size_t i = skip_json_ws(s, span.begin + 1);
  if (i < span.end && s[i] == '}') return true;
  std::string key;
  while (i < span.end) {
    if (s[i] != '"') return false;
    key.clear();
    if (!decode_json_string(s, i, &key, nullptr, nullptr)) return false;
    i = skip_json_ws(s, i);
    if (i >= span.end || s[i] != ':') return false;
    i = skip_json_ws(s, i + 1);
    bool negative = false;
    if (i < span.end && s[i] == '-') negative = true, ++i;
    int64_t v = 0;
    const size_t digits = i;
    while (i < span.end && s[i] >= '0' && s[i] <= '9' && v < (int64_t{1} << 40)) v = v * 10 + (s[i++] - '0');
    if (i == digits || (i < span.end && (s[i] == '.' || s[i] == 'e' || s[i] == 'E'))) return false;
    if (v > INT32_MAX) return false;
    out.emplace_back(key, static_cast<int32_t>(negative ? -v : v));
    i = skip_json_ws(s, i);
    if (i < span.end && s[i] == ',') {
      i = skip_json_ws(s, i + 1);
      continue;
    }
    return i < span.end && s[i] == '}';
  }
  return false;
}

bool read_merges_array(std::string_view s, ValueSpan span, std::vector<std::pair<std::string, std::string>>& out) {
  size_t i = skip_json_ws(s, span.begin + 1);
  if (i < span.end && s[i] == ']') return true;
  std::string a, b;
  while (i < span.end) {
    a.clear();
    b.clear();
    if (s[i] == '"') {
      if (!decode_json_string(s, i, &a, nullptr, nullptr)) return false;
      const size_t sp = a.find(' ');
      if (sp == std::string::npos) return false;
      b = a.substr(sp + 1);
      a.resize(sp);
    } else if (s[i] == '[') {
      i = skip_json_ws(s, i + 1);
      if (i >= span.end || s[i] != '"' || !decode_json_string(s, i, &a, nullptr, nullptr)) return false;
      i = skip_json_ws(s, i);
      if (i >= span.end || s[i] != ',') return false;
      i = skip_json_ws(s, i + 1);
      if (i >= span.end || s[i] != '"' || !decode_json_string(s, i, &b, nullptr, nullptr)) return false;
      i = skip_json_ws(s, i);
      if (i >= span.end || s[i] != ']') return false;
      ++i;
    } else {
      return false;
    }
    out.emplace_back(a, b);
    i = skip_json_ws(s, i);
    if (i < span.end && s[i] == ',') {
      i = skip_json_ws(s, i + 1);
      continue;
    }
    return i < span.end && s[i] == ']';
  }
  return false;
}

}  // namespace mt
