// Runs training from a validated Config (the megatrain command without a subcommand).
#pragma once

#include <memory>

#include "core/config.h"
#include "engine/backend.h"

namespace mt {

// The backend --device asks for (the reference backend on the CPU; CUDA on this rank's GPU).
std::unique_ptr<Backend> make_backend(const Config& cfg);

// Returns the process exit code.
int run_training(const Config& cfg);

}  // namespace mt
