// Runs training from a validated Config (the megatrain command without a subcommand).
#pragma once

#include "core/config.h"

namespace mt {

// Returns the process exit code.
int run_training(const Config& cfg);

}  // namespace mt
