// The Megatron-compatible command line: flags -> one validated Config with every derived value.
#pragma once

#include <string>
#include <vector>

#include "core/config.h"
#include "core/environment.h"

namespace mt {

// A setup line for rank 0: info goes to stdout (Megatron's print_rank_0 messages such as
// " > padded vocab ..."), notes and warnings to stderr ("[rank 0] note: ...").
struct SetupMessage {
  enum class Kind { info, note, warning } kind;
  std::string text;
};

// Parses Megatron-style training flags (argv without the program name), reads the launcher's
// environment (rank, world size) and validates. Throws mt::Error with a one-line message naming
// the flags and the rule; mt::Unsupported for Megatron flags megatrain does not implement yet.
// Setup messages go to `messages` when given, else straight to the log (rank 0 only).
Config parse_config(const std::vector<std::string>& args, const Environment& env,
                    std::vector<SetupMessage>* messages = nullptr);

// Prints setup messages as rank 0 would (info on stdout, notes and warnings on stderr).
void print_setup_messages(const std::vector<SetupMessage>& messages, int rank);

// `megatrain --help`: flags grouped like Megatron's argument groups, and the subcommands.
std::string help_text();
// `megatrain --list-flags`: docs/flags.md (supported, no-effect and not-yet-supported flags).
std::string flags_markdown();

}  // namespace mt
