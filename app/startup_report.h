// What a run prints about itself before and just after it starts, in Megatron's formats:
//   * the arguments block (megatron/training/arguments.py _print_args), rank 0, at start-up:
//       ------------------------ arguments ------------------------
//         accumulate_allreduce_grads_in_fp32 .............. False
//         ...
//       -------------------- end of arguments ---------------------
//     one line per argument, "  {name} {dots} {value}" with 48 - len(name) dots, sorted by
//     lower-cased line; names are the flags' names with '-' -> '_' (store_false switches "--no-x"
//     as x with the value negated, as Megatron's dests; a few other dests differ from their
//     flag's name), values as Python prints them;
//   * the estimate before the first step, as Megatron's report_theoretical_memory words it, from
//     the engine's memory plan (weights, gradients, master weights and optimizer states; then
//     activations and workspace):
//       Theoretical memory footprints: weight and optimizer=X MB, activation=Y MB, total=Z MB
//   * the measurement after the first iterations (megatron/training/utils.py report_memory), every
//     model-parallel rank of the first data-parallel replica:
//       [Rank r] (after N iterations) memory (MB) | allocated: A | max allocated: B | reserved: C | max reserved: D
//     MB = 2^20 bytes, values as Python prints floats.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "core/config.h"
#include "engine/memory_plan.h"

namespace mt {

std::string megatron_arguments_block(const Config& cfg);

// The rank layout, rank 0 at start-up: Megatron's "> initialized tensor model parallel with size
// N" / "> initialized pipeline model parallel with size N" lines, then the grid and (up to 64
// ranks) each rank's coordinates.
std::string rank_layout_summary(const Config& cfg);

std::string theoretical_memory_line(const MemoryPlan& plan);

struct MemoryReading {
  double allocated = 0, max_allocated = 0, reserved = 0, max_reserved = 0;  // bytes
  std::optional<double> device_used;  // --log-device-memory-used: the device's memory in use (bytes)
};
std::string format_memory_report(int rank, int64_t iteration, const MemoryReading& m);

}  // namespace mt
