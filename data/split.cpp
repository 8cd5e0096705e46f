#include "data/split.h"

#include <cmath>
#include <cstdlib>
#include <vector>

#include "core/error.h"
#include "data/numpy_random.h"

namespace mt {

const char* split_name(Split split) {
  switch (split) {
    case Split::train: return "train";
    case Split::valid: return "valid";
    case Split::test: return "test";
  }
  return "?";
}

std::array<double, 3> parse_split(const std::string& text) {
  std::vector<double> numbers;
  size_t i = 0;
  while (i < text.size()) {
    auto is_number_char = [&](char c) { return c == '.' || (c >= '0' && c <= '9'); };
    if (!is_number_char(text[i])) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < text.size() && is_number_char(text[j])) ++j;
    const std::string match = text.substr(i, j - i);
    char* end = nullptr;
    const double value = std::strtod(match.c_str(), &end);
    if (end != match.c_str() + match.size()) {
      fail("--split '{}': '{}' is not a number (expected proportions like 969,30,1)", text, match);
    }
    numbers.push_back(value);
    i = j;
  }
  if (numbers.empty()) fail("--split '{}' holds no numbers (expected proportions like 969,30,1)", text);
  if (numbers.size() > 3) {
    fail("--split '{}' has {} numbers; give at most three (train,valid,test)", text, numbers.size());
  }
  numbers.resize(3, 0.0);
  if (numpy_random::pairwise_sum(numbers) <= 0.0) fail("--split '{}': the proportions sum to 0", text);
  const std::vector<double> normalized = numpy_random::normalize(numbers);
  return {normalized[0], normalized[1], normalized[2]};
}

SplitMatrix split_matrix(const std::array<double, 3>& proportions) {
  // Running sums in Python's order: [0, w0, w0 + w1, (w0 + w1) + w2].
  double cumulative[4] = {0.0, 0.0, 0.0, 0.0};
  for (int i = 0; i < 3; ++i) cumulative[i + 1] = cumulative[i] + proportions[i];
  SplitMatrix matrix;
  for (int i = 0; i < 3; ++i) {
    if (cumulative[i + 1] <= cumulative[i]) {
      matrix[i] = std::nullopt;
    } else {
      matrix[i] = std::make_pair(cumulative[i], cumulative[i + 1]);
    }
  }
  return matrix;
}

IndexRange split_range(const std::pair<double, double>& bookend, int64_t num_elements) {
  // int(round(x)): Python rounds halves to even, as nearbyint does in the default rounding mode.
  const double n = static_cast<double>(num_elements);
  return {static_cast<int64_t>(std::nearbyint(bookend.first * n)),
          static_cast<int64_t>(std::nearbyint(bookend.second * n))};
}

}  // namespace mt
