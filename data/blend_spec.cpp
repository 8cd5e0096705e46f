#include "data/blend_spec.h"

#include <cctype>
#include <cstdlib>
#include <regex>

#include "core/error.h"

namespace mt {
namespace {

std::string strip(const std::string& s) {
  size_t a = 0, b = s.size();
  while (a < b && std::isspace(static_cast<unsigned char>(s[a]))) ++a;
  while (b > a && std::isspace(static_cast<unsigned char>(s[b - 1]))) --b;
  return s.substr(a, b - a);
}

bool as_number(const std::string& s, double& out) {
  const std::string t = strip(s);
  if (t.empty()) return false;
  char* end = nullptr;
  out = std::strtod(t.c_str(), &end);
  return *end == '\0' && t.find_first_of("xX") == std::string::npos;
}

}  // namespace

BlendSpec blend_from_list(const std::vector<std::string>& list, const std::string& flag) {
  BlendSpec b;
  bool weighted = !list.empty() && list.size() % 2 == 0;
  std::vector<double> w;
  for (size_t i = 0; weighted && i < list.size(); i += 2) {
    double x = 0;
    if (!as_number(list[i], x)) weighted = false;
    w.push_back(x);
  }
  if (!weighted) {
    for (const auto& p : list) b.prefixes.push_back(strip(p));
    return b;
  }
  double sum = 0;
  for (size_t i = 0; i < list.size(); i += 2) {
    const double x = w[i / 2];
    if (!(x >= 0)) fail("{}: weight {} of {} is negative", flag, list[i], strip(list[i + 1]));
    sum += x;
    b.weights.push_back(x);
    b.prefixes.push_back(strip(list[i + 1]));
  }
  if (!(sum > 0)) fail("{}: the blend weights sum to 0", flag);
  return b;
}

std::vector<double> parse_split(const std::string& split) {
  static const std::regex number(R"([.0-9]+)");
  std::vector<double> w;
  for (auto it = std::sregex_iterator(split.begin(), split.end(), number); it != std::sregex_iterator(); ++it) {
    const std::string s = it->str();
    double x = 0;
    if (!as_number(s, x)) fail("--split '{}': '{}' is not a number", split, s);
    w.push_back(x);
  }
  if (w.size() > 3) fail("--split '{}' has {} numbers; it takes train,valid,test proportions", split, w.size());
  while (w.size() < 3) w.push_back(0.0);
  const double sum = w[0] + w[1] + w[2];
  if (!(sum > 0)) fail("--split '{}': the proportions sum to 0", split);
  for (double& x : w) x /= sum;
  return w;
}

}  // namespace mt
