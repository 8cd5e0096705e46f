#include "core/yaml_lite.h"

#include <cctype>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <sstream>
#include <vector>

#include "core/error.h"

namespace mt {

namespace {

struct Line {
  int number = 0;  // 1-based, for errors
  int indent = 0;
  std::string text;  // without indentation and comment
};

// Drops a comment: '#' at the start or after a space, outside quotes.
std::string strip_comment(const std::string& s) {
  char quote = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    if (quote) {
      if (c == quote) quote = 0;
    } else if (c == '"' || c == '\'') {
      quote = c;
    } else if (c == '#' && (i == 0 || std::isspace(static_cast<unsigned char>(s[i - 1])))) {
      return s.substr(0, i);
    }
  }
  return s;
}

std::string trim(const std::string& s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return s.substr(b, e - b);
}

class Parser {
 public:
  Parser(const std::string& text, std::string where) : where_(std::move(where)) {
    std::istringstream in(text);
    std::string raw;
    int n = 0;
    while (std::getline(in, raw)) {
      ++n;
      if (!raw.empty() && raw.back() == '\r') raw.pop_back();
      const size_t text_at = raw.find_first_not_of(" \t");
      if (text_at != std::string::npos && raw.substr(0, text_at).find('\t') != std::string::npos)
        fail_at(n, "a tab in the indentation (YAML indents with spaces)");
      const std::string body = strip_comment(raw);
      const std::string t = trim(body);
      if (t.empty()) continue;
      if (t == "---" && lines_.empty()) continue;
      if (t == "---" || t == "...") fail_at(n, "several YAML documents in one file");
      lines_.push_back({n, static_cast<int>(body.find_first_not_of(' ')), t});
    }
  }

  nlohmann::json parse() {
    if (lines_.empty()) return nullptr;
    nlohmann::json v = block(lines_[0].indent);
    if (pos_ < lines_.size()) fail_at(lines_[pos_].number, "unexpected indentation");
    return v;
  }

 private:
  [[noreturn]] void fail_at(int line, const std::string& what) const {
    fail("{}:{}: {} (megatrain reads plain YAML: mappings, sequences and scalars)", where_, line, what);
  }

  // The block starting at lines_[pos_], all of whose entries sit at `indent`.
  nlohmann::json block(int indent) {
    const Line& first = lines_[pos_];
    if (first.text.rfind("- ", 0) == 0 || first.text == "-") return sequence(indent);
    if (key_split(first.text)) return mapping(indent);
    ++pos_;
    return scalar_or_flow(first.text, first.number);
  }

  nlohmann::json sequence(int indent) {
    nlohmann::json out = nlohmann::json::array();
    while (pos_ < lines_.size() && lines_[pos_].indent == indent &&
           (lines_[pos_].text.rfind("- ", 0) == 0 || lines_[pos_].text == "-")) {
      Line& l = lines_[pos_];
      const std::string rest = l.text == "-" ? "" : trim(l.text.substr(2));
      if (rest.empty()) {  // the item is the indented block below
        ++pos_;
        if (pos_ >= lines_.size() || lines_[pos_].indent <= indent) out.push_back(nullptr);
        else out.push_back(block(lines_[pos_].indent));
        continue;
      }
      // "- x": the item starts on this line, two columns in (also "- - x" and "- k: v").
      l.indent = indent + static_cast<int>(l.text.size() - rest.size());
      l.text = rest;
      out.push_back(block(l.indent));
    }
    return out;
  }

  // Splits "key: value" (value may be empty); false where the line is not a mapping entry.
  bool key_split(const std::string& t, std::string* key = nullptr, std::string* value = nullptr) const {
    if (t.empty() || t[0] == '[' || t[0] == '{') return false;
    char quote = 0;
    for (size_t i = 0; i < t.size(); ++i) {
      const char c = t[i];
      if (quote) {
        if (c == quote) quote = 0;
      } else if ((c == '"' || c == '\'') && i == 0) {
        quote = c;
      } else if (c == ':' && (i + 1 == t.size() || t[i + 1] == ' ')) {
        if (key) *key = unquote(trim(t.substr(0, i)));
        if (value) *value = trim(t.substr(i + 1));
        return true;
      }
    }
    return false;
  }

  nlohmann::json mapping(int indent) {
    nlohmann::json out = nlohmann::json::object();
    while (pos_ < lines_.size() && lines_[pos_].indent == indent) {
      const Line& l = lines_[pos_];
      std::string key, value;
      if (!key_split(l.text, &key, &value)) fail_at(l.number, "expected 'key: value'");
      if (out.contains(key)) fail_at(l.number, "key '" + key + "' given twice");
      ++pos_;
      if (!value.empty()) {
        out[key] = scalar_or_flow(value, l.number);
      } else if (pos_ < lines_.size() && (lines_[pos_].indent > indent ||
                                          (lines_[pos_].indent == indent && lines_[pos_].text.rfind("- ", 0) == 0))) {
        out[key] = block(lines_[pos_].indent);
      } else {
        out[key] = nullptr;
      }
    }
    return out;
  }

  static std::string unquote(const std::string& s) {
    if (s.size() >= 2 && ((s.front() == '"' && s.back() == '"') || (s.front() == '\'' && s.back() == '\'')))
      return s.substr(1, s.size() - 2);
    return s;
  }

  nlohmann::json scalar_or_flow(const std::string& text, int line) {
    if (text[0] == '&' || text[0] == '*' || text[0] == '!') fail_at(line, "anchors, aliases and tags are not read");
    if (text[0] == '|' || text[0] == '>') fail_at(line, "multi-line scalars are not read");
    if (text[0] != '[' && text[0] != '{') return scalar(text, line);
    size_t i = 0;
    nlohmann::json v = flow(text, i, line);
    while (i < text.size() && text[i] == ' ') ++i;
    if (i != text.size()) fail_at(line, "text after a closing bracket");
    return v;
  }

  nlohmann::json flow(const std::string& t, size_t& i, int line) {
    auto skip = [&] {
      while (i < t.size() && t[i] == ' ') ++i;
    };
    skip();
    if (i >= t.size()) fail_at(line, "an unclosed bracket (flow collections must end on their line)");
    if (t[i] == '[' || t[i] == '{') {
      const char close = t[i] == '[' ? ']' : '}';
      nlohmann::json out = close == ']' ? nlohmann::json::array() : nlohmann::json::object();
      ++i;
      skip();
      if (i < t.size() && t[i] == close) {
        ++i;
        return out;
      }
      for (;;) {
        if (close == ']') {
          out.push_back(flow(t, i, line));
        } else {
          const nlohmann::json k = flow(t, i, line);
          skip();
          if (i >= t.size() || t[i] != ':') fail_at(line, "expected ':' in a flow mapping");
          ++i;
          out[k.is_string() ? k.get<std::string>() : k.dump()] = flow(t, i, line);
        }
        skip();
        if (i < t.size() && t[i] == ',') {
          ++i;
          continue;
        }
        if (i < t.size() && t[i] == close) {
          ++i;
          return out;
        }
        fail_at(line, "an unclosed bracket (flow collections must end on their line)");
      }
    }
    // A scalar inside a flow collection: quoted, or up to the next , ] } or ': '.
    size_t b = i;
    if (t[i] == '"' || t[i] == '\'') {
      const char q = t[i];
      const size_t e = t.find(q, i + 1);
      if (e == std::string::npos) fail_at(line, "an unclosed quote");
      i = e + 1;
      return t.substr(b + 1, e - b - 1);
    }
    while (i < t.size() && t[i] != ',' && t[i] != ']' && t[i] != '}' &&
           !(t[i] == ':' && (i + 1 == t.size() || t[i + 1] == ' ')))
      ++i;
    return scalar(trim(t.substr(b, i - b)), line);
  }

  nlohmann::json scalar(const std::string& s, int line) {
    if (s.empty()) return nullptr;
    if (s.front() == '"' || s.front() == '\'') {
      if (s.size() < 2 || s.back() != s.front()) fail_at(line, "an unclosed quote");
      return s.substr(1, s.size() - 2);
    }
    if (s == "null" || s == "Null" || s == "NULL" || s == "~") return nullptr;
    if (s == "true" || s == "True" || s == "TRUE") return true;
    if (s == "false" || s == "False" || s == "FALSE") return false;
    char* end = nullptr;
    const long long i = std::strtoll(s.c_str(), &end, 10);
    if (*end == '\0' && (std::isdigit(static_cast<unsigned char>(s.back())))) return static_cast<int64_t>(i);
    const double d = std::strtod(s.c_str(), &end);
    if (*end == '\0' && s.find_first_of("0123456789") != std::string::npos) return d;
    if (s == ".inf" || s == "+.inf") return std::numeric_limits<double>::infinity();
    if (s == "-.inf") return -std::numeric_limits<double>::infinity();
    return s;
  }

  std::string where_;
  std::vector<Line> lines_;
  size_t pos_ = 0;
};

}  // namespace

nlohmann::json parse_yaml(const std::string& text, const std::string& where) { return Parser(text, where).parse(); }

nlohmann::json read_yaml_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) fail("cannot read {}", path);
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_yaml(ss.str(), path);
}

}  // namespace mt
