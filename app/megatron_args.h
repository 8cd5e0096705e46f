// The Megatron flags of a Megatron-LM checkpoint's model, from its saved args (the argparse
// Namespace checkpoint/megatron_checkpoint.h reads): the arguments that decide what the model
// computes become the flags a launch script gives, so that megatrain's own parser can validate
// them and a user can train with them. Settings of features the model does not use, and values
// Megatron derives itself, are left out; architectures megatrain does not build stay in, for the
// parser to refuse by name.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "checkpoint/pickle.h"

namespace mt {

// e.g. --num-layers 4 --hidden-size 32 ... --swiglu --num-query-groups 2. `where` names the
// checkpoint in errors (an argument of a type megatrain cannot read as its flag). every_setting:
// also the model settings Megatron-LM's checkpoint arguments leave out (app/flags.h
// ModelSetting::import_flag: the router's groups, the shared expert's gate, ...), for args that
// megatrain wrote itself (megatron_args_from_flags below).
std::vector<std::string> megatron_model_flags(const PickleValue& args, const std::string& where,
                                              bool every_setting = false);
// --tokenizer-type, --vocab-file, --merge-file, --tokenizer-model, --vocab-size as saved.
std::vector<std::string> megatron_tokenizer_flags(const PickleValue& args, const std::string& where);

// The other direction, for export-megatron: the argparse.Namespace Megatron-LM saves as a
// checkpoint's `args`, from megatrain's resolved flag values (`flags`: checkpoint_config_json's
// "flags" of the run that saved it). The model's arguments go under the destinations the table
// above reads them from; every other Megatron flag megatrain records under its name with '_' for
// '-' (switches spelled --no-X / --disable-X, whose destinations differ, only where known). What
// Megatron derives (layout, sizes, counters) the caller sets with set_megatron_arg.
PickleRef megatron_args_from_flags(const nlohmann::json& flags);
// Sets or replaces argument `name` of such a Namespace.
void set_megatron_arg(PickleValue& args, const std::string& name, PickleRef value);

}  // namespace mt
