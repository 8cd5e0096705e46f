// Megatron's --data-args-path and --per-split-data-args-path (training/utils.py,
// get_blend_and_blend_per_split): the blends of --data-path and of --train/valid/test-data-path
// read from files, for blends too long for a command line.
//   --data-args-path FILE: the file's whitespace-separated words are --data-path's list.
//   --per-split-data-args-path FILE: a JSON object with the keys "train", "valid" and "test", each
//   a string (split at whitespace), a list of words, or null (no blend for that split).
#pragma once

#include <array>
#include <optional>
#include <string>
#include <vector>

namespace mt::cli {

std::vector<std::string> read_data_args_file(const std::string& path);

// Per split (train, valid, test): its list of words, or nullopt for null.
using PerSplitBlendLists = std::array<std::optional<std::vector<std::string>>, 3>;
PerSplitBlendLists read_per_split_data_args_file(const std::string& path);

}  // namespace mt::cli
