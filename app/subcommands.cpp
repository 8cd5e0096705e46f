#include "app/subcommands.h"

#include "app/inspect_data.h"
#include "app/preprocess_data.h"

namespace mt {

const std::vector<Subcommand>& subcommands() {
  // One line per subcommand: {"name", "summary", &function}. Declare the function in your
  // component's header (e.g. data/preprocess.h) and include it above.
  static const std::vector<Subcommand> table = {
      {"preprocess-data", "tokenize a JSONL corpus into Megatron's .bin/.idx (tools/preprocess_data.py's flags)",
       &preprocess_data_main},
      {"inspect-data", "print the token windows training would read: <training flags> --num-samples N "
                       "[--split-name train|valid|test]",
       &inspect_data_main},
  };
  return table;
}

const Subcommand* find_subcommand(const std::string& name) {
  for (const Subcommand& s : subcommands())
    if (name == s.name) return &s;
  return nullptr;
}

}  // namespace mt
