// The Reporter that prints Megatron's per-iteration log line and validation block on stdout
// (megatron.md section 2), from the last rank. A minimal stand-in until the observability code
// (TensorBoard, JSONL, ...) provides the full set of reporters.
#pragma once

#include <memory>
#include <string>

#include "engine/reporter.h"

namespace mt {

// The exact text of one iteration's log line (without the trailing newline); timestamp is the
// "[YYYY-mm-dd HH:MM:SS.ffffff]" part.
std::string format_iteration_line(const IterationStats& s, const std::string& timestamp);
// The validation line (without the framing dashes).
std::string format_validation_line(const EvalStats& e);

std::unique_ptr<Reporter> make_log_reporter();

}  // namespace mt
