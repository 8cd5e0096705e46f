#include "app/layer_pattern.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cctype>

#include "app/flag_values.h"
#include "core/error.h"

namespace mt::cli {

std::vector<int> parse_int_tuple(const std::string& flag, const std::string& text) {
  size_t begin = 0, end = text.size();
  while (begin < end && (text[begin] == '(' || text[begin] == ')')) ++begin;
  while (end > begin && (text[end - 1] == '(' || text[end - 1] == ')')) --end;
  std::vector<int> values;
  const std::string body = text.substr(begin, end - begin);
  size_t start = 0;
  while (true) {
    const size_t comma = body.find(',', start);
    const size_t length = comma == std::string::npos ? std::string::npos : comma - start;
    values.push_back(parse_int_arg(flag, body.substr(start, length)));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return values;
}

namespace {

// Recursive descent over the list expression; every value is a list of ints, or an int (only as
// a repetition count).
class ListExpression {
 public:
  ListExpression(const std::string& flag, const std::string& text) : flag_(flag), text_(text) {}

  std::vector<int> parse() {
    Value v = sum();
    skip_space();
    if (pos_ != text_.size()) error(fmt::format("unexpected '{}'", text_.substr(pos_)));
    if (!v.is_list) error("it is a number, not a list");
    return v.list;
  }

 private:
  struct Value {
    bool is_list = false;
    std::vector<int> list;
    long long number = 0;
  };

  [[noreturn]] void error(const std::string& what) const {
    fail("{} '{}' is not a list expression megatrain can read ({}): give an integer N, or a list such as "
         "\"[1,1,1,0]*3\" or \"([1]*3+[0])*3\" with one entry per layer",
         flag_, text_, what);
  }
  void skip_space() {
    while (pos_ < text_.size() && std::isspace(static_cast<unsigned char>(text_[pos_]))) ++pos_;
  }
  bool accept(char c) {
    skip_space();
    if (pos_ < text_.size() && text_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  long long number() {
    skip_space();
    const size_t start = pos_;
    if (pos_ < text_.size() && (text_[pos_] == '-' || text_[pos_] == '+')) ++pos_;
    while (pos_ < text_.size() && std::isdigit(static_cast<unsigned char>(text_[pos_]))) ++pos_;
    if (pos_ == start) error(pos_ < text_.size() ? fmt::format("unexpected '{}'", text_[pos_]) : "it ends early");
    return parse_int64_arg(flag_, text_.substr(start, pos_ - start));
  }
  Value atom() {
    Value v;
    if (accept('[')) {
      v.is_list = true;
      if (!accept(']')) {
        do {
          if (accept(']')) return v;  // trailing comma
          v.list.push_back(static_cast<int>(number()));
        } while (accept(','));
        if (!accept(']')) error("a list is not closed");
      }
      return v;
    }
    if (accept('(')) {
      v = sum();
      if (!accept(')')) error("a parenthesis is not closed");
      return v;
    }
    v.number = number();
    return v;
  }
  Value product() {
    Value v = atom();
    while (accept('*')) {
      Value r = atom();
      if (v.is_list == r.is_list) error("'*' needs a list and a number");
      Value& list = v.is_list ? v : r;
      const long long times = v.is_list ? r.number : v.number;
      if (times > 1000000) error("a repetition count is too large");
      Value out;
      out.is_list = true;
      for (long long t = 0; t < times; ++t) out.list.insert(out.list.end(), list.list.begin(), list.list.end());
      v = out;
    }
    return v;
  }
  Value sum() {
    Value v = product();
    while (accept('+')) {
      Value r = product();
      if (!v.is_list || !r.is_list) error("'+' joins lists here");
      v.list.insert(v.list.end(), r.list.begin(), r.list.end());
    }
    return v;
  }

  const std::string& flag_;
  const std::string& text_;
  size_t pos_ = 0;
};

}  // namespace

std::vector<int> parse_int_list_expression(const std::string& flag, const std::string& text) {
  return ListExpression(flag, text).parse();
}

LayerFrequency parse_layer_frequency(const std::string& flag, const std::string& text) {
  LayerFrequency f;
  if (text.find('[') == std::string::npos) {
    f.every = parse_int_arg(flag, text);
    return f;
  }
  for (int v : ListExpression(flag, text).parse()) f.pattern.push_back(v != 0 ? 1 : 0);  // Python bool()
  if (f.pattern.empty()) fail("{} '{}' is an empty list: give one entry per layer", flag, text);
  return f;
}

std::string layer_frequency_text(const LayerFrequency& f) {
  if (f.every) return std::to_string(*f.every);
  return fmt::format("[{}]", fmt::join(f.pattern, ","));
}

}  // namespace mt::cli
