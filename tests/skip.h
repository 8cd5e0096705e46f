// A test case that cannot run here (a missing tokenizer file, no Python oracle, no GPU...) is
// reported as SKIPPED by CTest, never as passed: MT_SKIP prints one line with the marker
// "MEGATRAIN-TEST-SKIPPED:" and the reason, and returns from the test case. tests/CMakeLists.txt
// registers every CPU test case with that marker as CTest's SKIP_REGULAR_EXPRESSION.
//
// CTest reports a case whose output carries the marker as skipped whatever else it did, so a case
// skips before its first assertion: a check that could fail never runs ahead of a skip.
// A case that asserts nothing fails (tests/main.cpp turns on Catch's NoAssertions check); the
// report counts as the case's one assertion (SUCCEED), since CTest reports it as skipped anyway.
#pragma once

#include <catch2/catch.hpp>

#include <cstdio>
#include <sstream>
#include <string>

namespace mt::test {

inline constexpr const char* kSkipMarker = "MEGATRAIN-TEST-SKIPPED:";

inline void report_skip(const std::string& why) {
  std::printf("%s %s\n", kSkipMarker, why.c_str());
  std::fflush(stdout);
  SUCCEED("skipped: " << why);
}

}  // namespace mt::test

// MT_SKIP("no tokenizer files under " << dir): reports the skip and returns from the test case.
#define MT_SKIP(why)                       \
  do {                                     \
    std::ostringstream mt_skip_why_;       \
    mt_skip_why_ << why;                   \
    ::mt::test::report_skip(mt_skip_why_.str()); \
    return;                                \
  } while (0)
