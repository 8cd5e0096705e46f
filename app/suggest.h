// "Did you mean ...?" for unknown flags.
#pragma once

#include <string>
#include <vector>

namespace mt::cli {

// Levenshtein distance (insertions, deletions, substitutions cost 1).
int edit_distance(const std::string& a, const std::string& b);

// The candidate closest to `word` (ties: the first in `candidates`).
std::string closest(const std::string& word, const std::vector<std::string>& candidates);

}  // namespace mt::cli
