// "Did you mean ...?" for unknown flags: only for near misses (a typo, a missing letter, '_' for
// '-', Megatron's other negative spelling), never the least-bad of unrelated flags.
#pragma once

#include <string>
#include <vector>

namespace mt::cli {

// Levenshtein distance (insertions, deletions, substitutions cost 1).
int edit_distance(const std::string& a, const std::string& b);

// The most edits `word` may be away from a flag for that flag to be suggested: 2, or a third of
// the name (without its leading "--") for longer names.
int near_miss_limit(const std::string& word);

// The candidate nearest to `word` when it is a near miss (near_miss_limit), else "". Underscores
// count as dashes and "--no-x" / "--disable-x" as one spelling. Ties: the first in `candidates`.
std::string closest(const std::string& word, const std::vector<std::string>& candidates);

}  // namespace mt::cli
