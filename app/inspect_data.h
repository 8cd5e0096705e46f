// `megatrain inspect-data <training flags> --num-samples N [--split-name train|valid|test]`:
// builds the datasets exactly as training would and prints, to stdout, one JSON line per sample
// {"index": i, "tokens": [seq_length + 1 ids]} for dataset indices 0 .. N-1 of the split (the order
// training consumes them from the start); statistics go to stderr. Model flags are accepted and
// ignored.
#pragma once

#include <string>
#include <vector>

namespace mt {

int inspect_data_main(const std::vector<std::string>& args);

}  // namespace mt
