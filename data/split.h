// --split: train/valid/test proportions of one dataset, as Megatron parses and applies them
// (Megatron-LM's megatron/core/datasets/blended_megatron_dataset_config.py and
// blended_megatron_dataset_builder.py): the numbers are every match of [.0-9]+ (so quotes, spaces
// and any separators are tolerated), padded with zeros to three, normalised in float64; the split
// matrix holds running-sum bookends, and a dataset of E sequences gives split i the contiguous
// sequence ids [round(c_i * E), round(c_{i+1} * E)) with Python's round-half-to-even.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>

namespace mt {

enum class Split { train = 0, valid = 1, test = 2 };
constexpr std::array<Split, 3> kSplits{Split::train, Split::valid, Split::test};
const char* split_name(Split split);  // "train", "valid", "test"

// parse_and_normalize_split. Throws mt::Error naming --split for text without numbers, a match
// that is not a number ("1.2.3"), more than three numbers, or proportions summing to zero.
std::array<double, 3> parse_split(const std::string& text);

// convert_split_vector_to_split_matrix: (start, end) per split, or nullopt where end <= start
// (that split is not built).
using SplitBookend = std::optional<std::pair<double, double>>;
using SplitMatrix = std::array<SplitBookend, 3>;
SplitMatrix split_matrix(const std::array<double, 3>& proportions);

// The sequence ids [begin, end) a split takes from a dataset of num_elements sequences.
struct IndexRange {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
  bool operator==(const IndexRange&) const = default;
};
IndexRange split_range(const std::pair<double, double>& bookend, int64_t num_elements);

}  // namespace mt
