// `megatrain preprocess-data`: Megatron's tools/preprocess_data.py as a megatrain subcommand.
#pragma once

#include <string>
#include <vector>

namespace mt {

// args: the arguments after "preprocess-data" (Megatron's tool's flags). Prints progress to
// stderr; returns the process exit code (errors are printed, one line, and give 1).
int preprocess_data_main(const std::vector<std::string>& args);

}  // namespace mt
