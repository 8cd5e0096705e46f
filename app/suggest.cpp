#include "app/suggest.h"

#include <algorithm>

namespace mt::cli {

int edit_distance(const std::string& a, const std::string& b) {
  std::vector<int> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = static_cast<int>(j);
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = static_cast<int>(i);
    for (size_t j = 1; j <= b.size(); ++j)
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
    prev.swap(cur);
  }
  return prev[b.size()];
}

int near_miss_limit(const std::string& word) {
  const size_t dashes = word.rfind("--", 0) == 0 ? 2 : 0;
  return std::max(2, static_cast<int>((word.size() - dashes) / 3));
}

namespace {

// '_' as '-'; "--disable-x" as "--no-x".
std::string canonical(std::string s) {
  std::replace(s.begin(), s.end(), '_', '-');
  static const std::string disable = "--disable-";
  if (s.rfind(disable, 0) == 0) s = "--no-" + s.substr(disable.size());
  return s;
}

}  // namespace

std::string closest(const std::string& word, const std::vector<std::string>& candidates) {
  const std::string w = canonical(word);
  std::string best;
  int best_d = near_miss_limit(word) + 1;
  for (const auto& c : candidates) {
    const int d = edit_distance(w, canonical(c));
    if (d < best_d) {
      best_d = d;
      best = c;
    }
  }
  return best;
}

}  // namespace mt::cli
