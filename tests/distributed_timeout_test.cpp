// --distributed-timeout-minutes and its seconds override for tests.
#include <catch2/catch.hpp>

#include <cstdlib>

#include "core/error.h"
#include "parallel/distributed_timeout.h"

using namespace mt;

TEST_CASE("distributed timeout: minutes from the flag, seconds from the test override", "[timeout]") {
  unsetenv("MEGATRAIN_DISTRIBUTED_TIMEOUT_SECONDS");
  CHECK(distributed_timeout(10) == std::chrono::minutes(10));
  CHECK_THROWS_WITH(distributed_timeout(0), Catch::Contains("--distributed-timeout-minutes"));
  setenv("MEGATRAIN_DISTRIBUTED_TIMEOUT_SECONDS", "2.5", 1);
  CHECK(distributed_timeout(10) == Millis(2500));
  setenv("MEGATRAIN_DISTRIBUTED_TIMEOUT_SECONDS", "soon", 1);
  CHECK_THROWS_WITH(distributed_timeout(10), Catch::Contains("MEGATRAIN_DISTRIBUTED_TIMEOUT_SECONDS='soon'"));
  unsetenv("MEGATRAIN_DISTRIBUTED_TIMEOUT_SECONDS");
  CHECK(format_duration(std::chrono::minutes(10)) == "10 min");
  CHECK(format_duration(Millis(2500)) == "2.5 s");
  CHECK(format_duration(Millis(1000)) == "1 s");
  CHECK(format_duration(Millis(300)) == "300 ms");
}
