// Reading Megatron's dataset blend and split arguments (megatron.md sections 3.2 and 3.4).
#pragma once

#include <string>
#include <vector>

namespace mt {

// A blend: dataset prefixes with optional weights (empty: unweighted).
struct BlendSpec {
  std::vector<std::string> prefixes;
  std::vector<double> weights;
};

// Megatron's get_blend_from_list: an odd-length list is all prefixes; an even-length list is
// (weight, prefix) pairs when every weight parses as a number, else all prefixes. Prefixes are
// stripped of surrounding whitespace. `flag` names the flag in errors (negative or all-zero weights).
BlendSpec blend_from_list(const std::vector<std::string>& list, const std::string& flag);

// Megatron's parse_and_normalize_split: every match of [.0-9]+ (so "'99,1,0'" with its quotes
// works), padded with zeros to 3 entries, normalised to sum 1. Errors name --split.
std::vector<double> parse_split(const std::string& split);

}  // namespace mt
