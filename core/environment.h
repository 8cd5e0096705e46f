// The process environment as a map, so that launcher detection and the CLI are pure functions
// of their inputs (tests pass their own maps).
#pragma once

#include <map>
#include <optional>
#include <string>

namespace mt {

using Environment = std::map<std::string, std::string>;

// A copy of this process's environment variables.
Environment current_environment();

// The value of `name`, or nullopt when unset.
std::optional<std::string> env_get(const Environment& env, const std::string& name);

}  // namespace mt
