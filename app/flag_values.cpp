#include "app/flag_values.h"

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <limits>

#include "core/error.h"

namespace mt::cli {
namespace {

std::string strip(const std::string& s) {
  size_t a = 0, b = s.size();
  while (a < b && std::isspace(static_cast<unsigned char>(s[a]))) ++a;
  while (b > a && std::isspace(static_cast<unsigned char>(s[b - 1]))) --b;
  return s.substr(a, b - a);
}

// Removes the underscores Python allows between digits; false if one is misplaced.
bool drop_digit_underscores(const std::string& s, std::string& out) {
  out.clear();
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '_') {
      if (i == 0 || i + 1 == s.size() || !std::isdigit(static_cast<unsigned char>(s[i - 1])) ||
          !std::isdigit(static_cast<unsigned char>(s[i + 1])))
        return false;
      continue;
    }
    out += s[i];
  }
  return true;
}

bool python_float(const std::string& raw, double& out) {
  std::string s;
  if (!drop_digit_underscores(strip(raw), s) || s.empty()) return false;
  std::string lower;
  for (char c : s) lower += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  std::string body = lower;
  double sign = 1;
  if (!body.empty() && (body[0] == '+' || body[0] == '-')) {
    sign = body[0] == '-' ? -1 : 1;
    body = body.substr(1);
  }
  if (body == "inf" || body == "infinity") {
    out = sign * std::numeric_limits<double>::infinity();
    return true;
  }
  if (body == "nan") {
    out = std::numeric_limits<double>::quiet_NaN();
    return true;
  }
  // digits [. digits] [e [sign] digits], with at least one digit in the mantissa.
  size_t i = 0;
  int mantissa_digits = 0;
  while (i < body.size() && std::isdigit(static_cast<unsigned char>(body[i]))) ++i, ++mantissa_digits;
  if (i < body.size() && body[i] == '.') {
    ++i;
    while (i < body.size() && std::isdigit(static_cast<unsigned char>(body[i]))) ++i, ++mantissa_digits;
  }
  if (mantissa_digits == 0) return false;
  if (i < body.size() && body[i] == 'e') {
    ++i;
    if (i < body.size() && (body[i] == '+' || body[i] == '-')) ++i;
    int exp_digits = 0;
    while (i < body.size() && std::isdigit(static_cast<unsigned char>(body[i]))) ++i, ++exp_digits;
    if (exp_digits == 0) return false;
  }
  if (i != body.size()) return false;
  errno = 0;
  out = sign * std::strtod(body.c_str(), nullptr);
  return true;
}

}  // namespace

int64_t parse_int64_arg(const std::string& flag, const std::string& value) {
  std::string s;
  bool ok = drop_digit_underscores(strip(value), s) && !s.empty();
  size_t i = (ok && (s[0] == '+' || s[0] == '-')) ? 1 : 0;
  ok = ok && i < s.size();
  for (size_t j = i; ok && j < s.size(); ++j) ok = std::isdigit(static_cast<unsigned char>(s[j]));
  if (!ok) {
    double d = 0;
    if (python_float(value, d) && std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9e18)
      fail("{} expects an integer (Megatron parses it with int()), got '{}'; write {}", flag, value,
           static_cast<long long>(d));
    fail("{} expects an integer, got '{}'", flag, value);
  }
  errno = 0;
  const long long v = std::strtoll(s.c_str(), nullptr, 10);
  if (errno == ERANGE) fail("{} {} is out of range", flag, value);
  return v;
}

int parse_int_arg(const std::string& flag, const std::string& value) {
  const int64_t v = parse_int64_arg(flag, value);
  if (v > std::numeric_limits<int>::max() || v < std::numeric_limits<int>::min())
    fail("{} {} is out of range for a 32-bit integer", flag, value);
  return static_cast<int>(v);
}

double parse_float_arg(const std::string& flag, const std::string& value) {
  double d = 0;
  if (!python_float(value, d)) fail("{} expects a number, got '{}'", flag, value);
  return d;
}

std::string parse_choice_arg(const std::string& flag, const std::string& value, const std::vector<std::string>& choices) {
  for (const auto& c : choices)
    if (c == value) return c;
  std::string list;
  for (const auto& c : choices) list += (list.empty() ? "" : ", ") + c;
  fail("{} must be one of {}; got '{}'", flag, list, value);
}

std::string format_float(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  if (v == std::floor(v) && std::fabs(v) < 1e16) return fmt::format("{:.1f}", v);
  // Shortest representation that round-trips, like Python's repr.
  for (int prec = 1; prec <= 17; ++prec) {
    std::string s = fmt::format("{:.{}g}", v, prec);
    if (std::strtod(s.c_str(), nullptr) == v) {
      if (s.find_first_of(".en") == std::string::npos) s += ".0";
      return s;
    }
  }
  return fmt::format("{}", v);
}

}  // namespace mt::cli
