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

std::string closest(const std::string& word, const std::vector<std::string>& candidates) {
  std::string best;
  int best_d = -1;
  for (const auto& c : candidates) {
    const int d = edit_distance(word, c);
    if (best_d < 0 || d < best_d) {
      best_d = d;
      best = c;
    }
  }
  return best;
}

}  // namespace mt::cli
