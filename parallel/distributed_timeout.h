// How long any blocking distributed wait may take before megatrain gives up with an error naming the
// group and the operation (--distributed-timeout-minutes, Megatron's default 10 minutes).
//
// MEGATRAIN_DISTRIBUTED_TIMEOUT_SECONDS=<seconds> (a decimal number) overrides the flag. It exists
// for tests that must see a timeout fire within seconds; it is not a Megatron flag.
#pragma once

#include <chrono>
#include <string>

namespace mt {

using Millis = std::chrono::milliseconds;

Millis distributed_timeout(int timeout_minutes);

// "10 min", "2.5 s", "300 ms": for error messages.
std::string format_duration(Millis d);

}  // namespace mt
