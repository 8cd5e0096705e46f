// THE table of what megatrain does not support yet: Megatron flags (or flag values) that are
// recognised and refused with "megatrain does not support --X yet". Implementing a feature means
// deleting its line here (and parsing the flag into Config, app/cli_*.cpp).
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "app/flags.h"

namespace mt::cli {

struct UnsupportedRule {
  enum class When {
    any_use,     // the flag itself is refused (switches: any occurrence; valued flags: any value)
    other_than,  // refused unless every value is one of `values` (Megatron's default/off values)
    values,      // refused when a value is one of `values` (other values are supported)
    conditional, // refused by a validation rule in combination with other flags (app/validate_moe.cpp);
                 // the entry only documents it (`summary`) and matches nothing here
  };
  std::string flag;
  When when = When::any_use;
  std::vector<std::string> values;
  std::string why;  // optional hint printed with the refusal
  // Checked after Megatron's own rules for the flag (the end of validation), so that a combination
  // Megatron refuses gets Megatron's error and only a valid one "not supported yet". Such flags
  // are parsed into Config first.
  bool after_validation = false;
  std::string summary;  // When::conditional: the docs' description of what is refused

  UnsupportedRule(std::string flag_, When when_, std::vector<std::string> values_, std::string why_,
                  bool after_validation_ = false, std::string summary_ = "")
      : flag(std::move(flag_)), when(when_), values(std::move(values_)), why(std::move(why_)),
        after_validation(after_validation_), summary(std::move(summary_)) {}
};

const std::vector<UnsupportedRule>& unsupported_rules();

// The refusals for the given flags, one line per refused use in table order ("megatrain does not
// support --fp8-recipe mxfp8 yet (hint)"); empty when everything given is supported. The parser
// checks the rules without after_validation; validation ends with the others (after_validation).
std::vector<std::string> unsupported_problems(const std::map<std::string, FlagValue>& given,
                                              bool after_validation = false);

// Describes the rule for one flag for docs/flags.md ("" when the flag has none).
std::string unsupported_summary(const std::string& flag);

// True when the rule refuses the flag whatever its value (the flag is "not supported yet").
bool fully_unsupported(const std::string& flag);

}  // namespace mt::cli
