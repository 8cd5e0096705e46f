// Muon's Newton-Schulz iteration (engine/muon.h) on the CUDA backend against the reference, on
// random matrices wide, tall, square and of one row; float32 products and bfloat16-rounded ones.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "engine/muon.h"
#include "tests/gpu/gpu_test_util.h"

using namespace mt;
using namespace mt::gputest;

TEST_CASE("cuda newton_schulz matches the reference (float32 and bfloat16 products)", "[gpu][muon]") {
  MT_RNG(rng);
  for (const auto& [R, C] : std::vector<std::pair<int64_t, int64_t>>{{7, 19}, {19, 7}, {64, 64}, {1, 33}, {300, 96}})
    for (const MuonMatmulPrecision prec : {MuonMatmulPrecision::high, MuonMatmulPrecision::medium}) {
      const bool bf = prec == MuonMatmulPrecision::medium;
      INFO(R << " x " << C << (bf ? " medium" : " high"));
      MuonConfig cfg;
      cfg.fp32_matmul_prec = prec;
      Twin x = twin(DType::f32, {R, C}, rng.normal(R * C, 2.0));
      const int64_t n = newton_schulz_workspace(R, C, cfg);
      Twin work = twin(DType::f32, {n}, std::vector<double>(static_cast<size_t>(n), 0.0));
      newton_schulz(dev(), x.c(), work.c(), cfg);
      newton_schulz(ref(), x.r(), work.r(), cfg);
      // float32: the GEMMs' summation orders; bfloat16: an element may round the other way and move
      // the iteration by about a bf16 step.
      CHECK(rel_err(x) < (bf ? 2e-2 : 1e-4));
      if (bf) {
        const std::vector<double> got = download(dev(), x.c());
        int64_t not_bf16 = 0;
        for (double v : got) {
          const float f = static_cast<float>(v);
          uint32_t bits;
          std::memcpy(&bits, &f, 4);
          not_bf16 += (bits & 0xFFFFu) != 0;
        }
        CHECK(not_bf16 == 0);
      }
    }
}

TEST_CASE("cuda scale_by_rnorm matches the reference", "[gpu][muon]") {
  MT_RNG(rng);
  for (const int64_t n : {1, 7, 1000, 100003}) {
    INFO(n);
    Twin x = twin(DType::f32, {n}, rng.normal(n, 3.0));
    Twin ss = twin(DType::f32, {1}, {static_cast<double>(n) * 9.0});
    dev().scale_by_rnorm(x.c(), ss.c(), 1e-7f);
    ref().scale_by_rnorm(x.r(), ss.r(), 1e-7f);
    CHECK(rel_err(x) < 1e-6);
  }
}
