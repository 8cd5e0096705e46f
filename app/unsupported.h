// THE table of what megatrain does not support yet: Megatron flags (or flag values) that are
// recognised and refused with "megatrain does not support --X yet". Implementing a feature means
// deleting its line here (and parsing the flag into Config, app/cli_*.cpp).
#pragma once

#include <map>
#include <string>
#include <vector>

#include "app/flags.h"

namespace mt::cli {

struct UnsupportedRule {
  enum class When {
    any_use,     // the flag itself is refused (switches: any occurrence; valued flags: any value)
    other_than,  // refused unless every value is one of `values` (Megatron's default/off values)
    values,      // refused when a value is one of `values` (other values are supported)
  };
  std::string flag;
  When when = When::any_use;
  std::vector<std::string> values;
  std::string why;  // optional hint printed with the refusal
};

const std::vector<UnsupportedRule>& unsupported_rules();

// The refusals for the given flags, one line per refused use in table order ("megatrain does not
// support --fp8-recipe mxfp8 yet (hint)"); empty when everything given is supported.
std::vector<std::string> unsupported_problems(const std::map<std::string, FlagValue>& given);

// Describes the rule for one flag for docs/flags.md ("" when the flag has none).
std::string unsupported_summary(const std::string& flag);

// True when the rule refuses the flag whatever its value (the flag is "not supported yet").
bool fully_unsupported(const std::string& flag);

}  // namespace mt::cli
