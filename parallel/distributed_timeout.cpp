#include "parallel/distributed_timeout.h"

#include <fmt/format.h>

#include <cstdlib>
#include <string>

#include "core/error.h"

namespace mt {

Millis distributed_timeout(int timeout_minutes) {
  if (const char* s = std::getenv("MEGATRAIN_DISTRIBUTED_TIMEOUT_SECONDS"); s && *s) {
    char* end = nullptr;
    const double seconds = std::strtod(s, &end);
    if (end == s || *end != '\0' || !(seconds > 0))
      fail("MEGATRAIN_DISTRIBUTED_TIMEOUT_SECONDS='{}' is not a positive number of seconds", s);
    return Millis(static_cast<int64_t>(seconds * 1000.0 + 0.5));
  }
  if (timeout_minutes <= 0) fail("--distributed-timeout-minutes must be positive (got {})", timeout_minutes);
  return std::chrono::minutes(timeout_minutes);
}

std::string format_duration(Millis d) {
  const int64_t ms = d.count();
  if (ms % 60000 == 0) return fmt::format("{} min", ms / 60000);
  if (ms >= 1000) return fmt::format("{:g} s", ms / 1000.0);
  return fmt::format("{} ms", ms);
}

}  // namespace mt
