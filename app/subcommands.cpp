#include "app/subcommands.h"

namespace mt {

const std::vector<Subcommand>& subcommands() {
  // One line per subcommand: {"name", "summary", &function}. Declare the function in your
  // component's header (e.g. data/preprocess.h) and include it above.
  static const std::vector<Subcommand> table = {
  };
  return table;
}

const Subcommand* find_subcommand(const std::string& name) {
  for (const Subcommand& s : subcommands())
    if (name == s.name) return &s;
  return nullptr;
}

}  // namespace mt
