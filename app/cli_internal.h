// The stages of parse_config (app/parse.cpp), exposed for tests:
//   parse_flags      argv -> CliState: unknown/removed/unsupported flags, typed values, notes
//   resolve_launch   the launcher's environment -> Config::parallel (world, rank, ...)
//   derive           Megatron's derived values (DP, micro-batches, ffn, vocab, ...) and the rules
//                    the derivations depend on
//   validate         every other rule
#pragma once

#include <string>
#include <vector>

#include "app/flags.h"
#include "core/environment.h"

namespace mt::cli {

CliState parse_flags(const std::vector<std::string>& args);
void resolve_launch(CliState& st, const Environment& env);
void derive(CliState& st);
void validate(CliState& st);

// Rules grouped by topic (validate_*.cpp); validate() runs them all.
void validate_model(CliState& st);
// Megatron-LM's FSDP rules, then --use-megatron-fsdp / --use-torch-fsdp2 mapped onto the
// data-parallel settings the other rules read: first.
void validate_fsdp(CliState& st);
// --optimizer muon: its settings checked as Megatron-LM checks them, and the distributed optimizer
// (Megatron's layer-wise one with Muon) replaced by the unsharded update (before validate_parallel).
void validate_muon(CliState& st);
void validate_parallel(CliState& st);
void validate_training(CliState& st);
void validate_data(CliState& st);
void validate_checkpoint_and_logging(CliState& st);
void validate_megatrain(CliState& st);
// Mixture of experts: Megatron's rules, then what megatrain does not build yet (Unsupported); last.
void validate_moe(CliState& st);

}  // namespace mt::cli
