// The Megatron-compatible command line: flags -> one validated Config with every derived value.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "core/config.h"

namespace mt {

using Environment = std::map<std::string, std::string>;

Environment current_environment();

// Parses Megatron-style training flags (argv without the program name), reads the launcher's
// environment (rank, world size) and validates. Throws mt::Error with a one-line message naming
// the flags and the rule; mt::Unsupported for Megatron flags megatrain does not implement yet.
Config parse_config(const std::vector<std::string>& args, const Environment& env);

}  // namespace mt
