// CTest runs each CPU test case by name (catch_discover_tests): a name that starts with '-' is read
// by Catch2 as an option and one with ';' is split by CMake, so that case fails under ./test.sh
// while passing when the test binary runs it directly.
#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>

namespace {

TEST_CASE("test case names are ones CTest can run: no leading dash, no semicolon", "[tests]") {
  const std::filesystem::path dir = std::filesystem::path(MEGATRAIN_SOURCE_DIR) / "tests";
  const std::regex name(R"re(TEST_CASE\(\s*"((?:[^"\\]|\\.)*)")re");
  int cases = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    if (e.path().extension() != ".cpp") continue;
    std::ifstream in(e.path());
    std::stringstream text;
    text << in.rdbuf();
    const std::string s = text.str();
    for (std::sregex_iterator it(s.begin(), s.end(), name), end; it != end; ++it) {
      const std::string n = (*it)[1];
      INFO(e.path().filename().string() << ": \"" << n << "\"");
      CHECK(n.rfind('-', 0) != 0);
      CHECK(n.find(';') == std::string::npos);
      ++cases;
    }
  }
  CHECK(cases > 100);
}

}  // namespace
