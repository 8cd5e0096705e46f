// Catch2 main for the CPU tests. Whatever the command line asks, a test case that asserts nothing
// fails (it could not have caught anything), and so does a run whose filter matches no test case
// (a CTest entry that ran nothing must not pass). Catch2 v2 takes one --warn on the command line,
// so both are set here. A case that cannot run here reports a skip instead (tests/skip.h).
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

int main(int argc, char* argv[]) {
  Catch::Session session;
  if (const int rc = session.applyCommandLine(argc, argv); rc != 0) return rc;
  Catch::ConfigData& config = session.configData();
  config.warnings = static_cast<Catch::WarnAbout::What>(config.warnings | Catch::WarnAbout::NoAssertions |
                                                        Catch::WarnAbout::NoTests);
  return session.run();
}
