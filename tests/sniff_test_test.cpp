// --gpu-sniff-test-interval's report (engine/sniff_test.h): per probe the mean and standard
// deviation over the ranks and the ranks above mean + one standard deviation.
#include <catch2/catch.hpp>

#include "engine/sniff_test.h"

using namespace mt;

TEST_CASE("gpu sniff test report: mean, standard deviation and the slow ranks per probe", "[sniff]") {
  // GEMM: 1, 1, 1, 5 ms: mean 2, std sqrt(3) = 1.732: rank 3 only. All-gather equal: none.
  const std::vector<SniffTimes> t = {{1, 2, 0.5}, {1, 2, 0.5}, {1, 2, 0.5}, {5, 2, 3.5}};
  const std::vector<std::string> lines = sniff_lines(7, t);
  REQUIRE(lines.size() == 3);
  CHECK(lines[0] == "gpu sniff test at iteration 7: GEMM mean 2.000 ms, std 1.732 ms over 4 ranks; slower than mean + "
                    "std: 3 (5.000 ms)");
  CHECK(lines[1] == "gpu sniff test at iteration 7: all-gather mean 2.000 ms, std 0.000 ms over 4 ranks; slower than "
                    "mean + std: none");
  CHECK(lines[2] == "gpu sniff test at iteration 7: send/receive mean 1.250 ms, std 1.299 ms over 4 ranks; slower "
                    "than mean + std: 3 (3.500 ms)");
}
