// --log-straggler's report (engine/straggler.h): Megatron-LM's StragglerDetector line, the smallest
// and largest of each figure with its rank (the first rank on ties, as Python's min and max), the
// throughput extremes from the ranks sorted by it, and the bottom/top lines for 1 < N < ranks.
#include <catch2/catch.hpp>

#include "engine/straggler.h"

using namespace mt;

TEST_CASE("straggler report: Megatron's line, the ranks of each extreme and the bottom/top lists", "[straggler]") {
  std::vector<StragglerSample> r(4);
  // time, batch, temp, power, util, clock, tflops
  r[0] = {10.0, 0.5, 60, 690.5, 99, 1980, 400.0};
  r[1] = {25.5, 0.2, 71, 700.0, 98, 1755, 160.25};
  r[2] = {10.0, 3.25, 59, 650.0, 100, 1980, 401.5};
  r[3] = {12.0, 0.2, 65, 699.0, 97, 1900, 333.0};
  const std::vector<std::string> lines = straggler_lines(r, 2, "2026-12-03 17:00:00");
  REQUIRE(lines.size() == 3);
  CHECK(lines[0] ==
        "[2026-12-03 17:00:00] | MnRtt/Rnk: 10.00ms/0 | MxRtt/Rnk: 25.50ms/1 | MnPwr/Rnk: 650.00W/2 | "
        "MxPwr/Rnk: 700.00W/1 | MnTmp/Rnk: 59.00C/2 | MxTmp/Rnk: 71.00C/1 | MnUtl/Rnk: 97.00%/3 | "
        "MxUtl/Rnk: 100.00%/2 | MnClk/Rnk: 1755.00MHz/1 | MxClk/Rnk: 1980.00MHz/0 | MnDRtt/Rnk: 0.20ms/1 | "
        "MxDRtt/Rnk: 3.25ms/2 | MnEtpt/Rnk: 160.25TF/1 | MxEtpt/Rnk: 401.50TF/2");
  CHECK(lines[1] == "^^^^ Bottom 2 Ranks with lowest  Etpt(TF): 160.25TF/1, 333.00TF/3,");
  CHECK(lines[2] == "^^^^ Top    2 Ranks with highest Etpt(TF): 400.00TF/0, 401.50TF/2,");
  // The lists only for 1 < N < ranks.
  CHECK(straggler_lines(r, 1, "t").size() == 1);
  CHECK(straggler_lines(r, 4, "t").size() == 1);
  CHECK(straggler_lines(std::vector<StragglerSample>(1), 2, "t").size() == 1);
}
