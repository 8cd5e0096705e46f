// --distributed-timeout-minutes and its seconds override for tests; the timeout the groups share.
#include <catch2/catch.hpp>

#include <cstdlib>
#include <string>

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

TEST_CASE("distributed timeout: one value shared by every copy, and the flag in force", "[timeout]") {
  const SharedTimeout world(std::chrono::minutes(10));
  const SharedTimeout group = world;  // a communicator split from the world
  CHECK(group.get() == std::chrono::minutes(10));
  CHECK(std::string(group.flag()) == "--distributed-timeout-minutes");
  world.set_after_init(std::chrono::seconds(30));
  CHECK(group.get() == Millis(30000));
  CHECK(std::string(group.flag()) == "--distributed-timeout-seconds-after-init");
  const SharedTimeout other(std::chrono::minutes(1));  // another world
  CHECK(other.get() == std::chrono::minutes(1));
}
