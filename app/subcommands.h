// megatrain's subcommands: `megatrain <name> <args...>`. Each change that adds one puts a line in
// the table in subcommands.cpp (an explicit table: static self-registration would be dropped by
// the linker from a static library).
#pragma once

#include <string>
#include <vector>

namespace mt {

using SubcommandFn = int (*)(const std::vector<std::string>& args);

struct Subcommand {
  const char* name;     // "preprocess-data"
  const char* summary;  // one line for `megatrain --help`
  SubcommandFn run;     // returns the exit code; args exclude the subcommand's name
};

const std::vector<Subcommand>& subcommands();

// The subcommand called `name`, or nullptr.
const Subcommand* find_subcommand(const std::string& name);

}  // namespace mt
