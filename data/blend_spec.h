// Reading Megatron's dataset blend and split arguments.
#pragma once

#include <string>
#include <vector>

#include "data/split.h"  // parse_split

namespace mt {

// A blend: dataset prefixes with optional weights (empty: unweighted).
struct BlendSpec {
  std::vector<std::string> prefixes;
  std::vector<double> weights;
};

// Megatron's get_blend_from_list: an odd-length list is all prefixes; an even-length list is
// (weight, prefix) pairs when every weight parses as a number, else all prefixes. Prefixes are
// stripped of surrounding whitespace. `flag` names the flag in errors (a weight that is not
// positive: Megatron's BlendedDataset rejects it). The rules live in data/dataset_builder.h
// (parse_blend); --split parsing is data/split.h (parse_split).
BlendSpec blend_from_list(const std::vector<std::string>& list, const std::string& flag);

}  // namespace mt
