// The CUDA backend's grouped GEMMs (Backend::grouped_linear_*, cuda/grouped_gemm.h: our grouped
// MMA kernels (the TMA-fed warp-specialized one for the row-grouped ops, cp.async-fed wgmma,
// mma.sync), cuBLAS's grouped batched GEMM, or one GEMM per expert for large experts; each case
// through every path that takes it) against the reference backend's per-expert GEMMs, on fresh
// random inputs: odd row counts, empty experts (their weight gradient zeroed, or kept with
// accumulate), feature sizes off the kernel's tile sizes, float32, bf16 and fp16 (float32 main
// gradients); the offsets on the host, and on the device with rows past the experts' left alone.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <vector>

#include "cuda/bench_choice.h"
#include "cuda/grouped_gemm_mma.h"
#include "tests/gpu/gpu_test_util.h"

using namespace mt;
using namespace mt::gputest;

TEST_CASE("cuda grouped_linear_* (grouped batched GEMM) match the reference", "[gpu][moe][grouped]") {
  Rng rng;
  INFO("seed " << rng.seed());
  dev().prepare_grouped_gemms(64);
  struct Case {
    std::vector<int64_t> rows;  // per expert
    int64_t N, K;
  };
  const Case cases[] = {{{5, 0, 17, 1, 0, 33, 2, 9}, 24, 40},
                        {{0, 0, 129}, 48, 16},
                        {{1}, 8, 8},
                        {std::vector<int64_t>(64, 0), 16, 16},
                        {{300, 257, 0, 511, 64, 3, 0, 100, 7, 1, 1, 90}, 96, 72},
                        // several 128-wide tiles, partial in every dimension (K not a multiple of 32)
                        {{130, 0, 257, 1, 128, 383}, 136, 264},
                        {{127, 129, 0, 0, 255}, 264, 136},
                        // a feature size off the kernel's multiples of 8: cuBLAS alone
                        {{33, 0, 70}, 12, 40},
                        // >= 2048 rows per expert with rows, host offsets: one cublasGemmEx per expert
                        {{2100, 0, 2501}, 40, 24},
                        // more 128 x 256 tiles than an H200 has SMs (the TMA kernel's CTAs take several
                        // each), a 47-step reduction for the input gradient
                        {{600, 0, 700, 13}, 3000, 64}};
  int tma_ops = 0;    // ops the TMA kernel took
  int sumsq_tma = 0;  // weight gradients whose squares it summed
  for (const Case& c : cases) {
    std::vector<int64_t> off{0};
    for (int64_t r : c.rows) off.push_back(off.back() + r);
    const int64_t E = static_cast<int64_t>(c.rows.size()), R = off.back(), N = c.N, K = c.K;
    if (R == 0) off.back() = 0;
    using Path = cuda::bench_choice::GroupedGemmPath;
    struct Variant {
      DType dt;
      Path path;
      bool register_epilogue;  // the TMA kernel's fragments all stored from registers
    };
    for (const auto& [dt, path, register_epilogue] :
         {Variant{DType::f32, Path::automatic, false}, Variant{DType::bf16, Path::automatic, false},
          Variant{DType::bf16, Path::mma, false}, Variant{DType::bf16, Path::mma, true},
          Variant{DType::bf16, Path::mma_cp_async, false}, Variant{DType::bf16, Path::mma_sync, false},
          Variant{DType::bf16, Path::cublas, false}, Variant{DType::f16, Path::mma, false},
          Variant{DType::f16, Path::mma_sync, false}}) {
      cuda::bench_choice::grouped_gemm_path = path;
      cuda::bench_choice::grouped_register_epilogue = register_epilogue;
      for (const bool on_device : {false, true}) {
        // Device offsets (int32, as the MoE block passes them) bound the operands' rows: here `pad`
        // rows follow the experts' and stay as they were.
        const int64_t pad = on_device ? 37 : 0, Rp = R + pad;
        INFO("experts " << E << ", rows " << R << ", N " << N << ", K " << K << ", " << dtype_name(dt) << ", path "
                        << static_cast<int>(path) << (register_epilogue ? " (register stores)" : "")
                        << (on_device ? ", device offsets" : ", host offsets"));
        const Twin offd = twin(DType::i32, {E + 1}, std::vector<double>(off.begin(), off.end()));
        const ExpertOffsets off_c = on_device ? ExpertOffsets::on_device(offd.c()) : ExpertOffsets(off);
        const ExpertOffsets off_r = on_device ? ExpertOffsets::on_device(offd.r()) : ExpertOffsets(off);
        const Twin x = twin(dt, {std::max<int64_t>(Rp, 1), K}, rng.normal(std::max<int64_t>(Rp, 1) * K));
        const Twin w = twin(dt, {E * N, K}, rng.normal(E * N * K, 0.2));
        const Twin dy = twin(dt, {std::max<int64_t>(Rp, 1), N}, rng.normal(std::max<int64_t>(Rp, 1) * N));
        const Tensor xc = x.c().row_slice(0, Rp), xr = x.r().row_slice(0, Rp);
        const Tensor dyc = dy.c().row_slice(0, Rp), dyr = dy.r().row_slice(0, Rp);
        // An output's elements past the experts' rows that are no longer zero (device offsets).
        const auto pad_changed = [&](const Twin& t) {
          const std::vector<double> got = download(dev(), t.c());
          int64_t changed = 0;
          for (size_t i = static_cast<size_t>(R * t.c().cols()); i < got.size(); ++i) changed += got[i] != 0.0;
          return changed;
        };
        const auto zeros = [&](int64_t n) { return std::vector<double>(static_cast<size_t>(n), 0.0); };
        if (Rp > 0) {
          if (path == Path::mma && dt != DType::f32 && !register_epilogue)
            tma_ops += cuda::grouped_tma_takes(cuda::GroupedOp::forward, dyc, xc, w.c(), E) +
                       cuda::grouped_tma_takes(cuda::GroupedOp::backward_input, xc, dyc, w.c(), E) +
                       cuda::grouped_tma_takes(cuda::GroupedOp::backward_weight, w.c(), dyc, xc, E);
          Twin y = on_device ? twin(dt, {Rp, N}, zeros(Rp * N)) : twin_nan(dt, {R, N});
          dev().grouped_linear_forward(y.c(), xc, w.c(), off_c);
          ref().grouped_linear_forward(y.r(), xr, w.r(), off_r);
          CHECK(rel_err(y) <= tol_for(dt));
          CHECK(pad_changed(y) == 0);
          Twin dx = on_device ? twin(dt, {Rp, K}, zeros(Rp * K)) : twin_nan(dt, {R, K});
          dev().grouped_linear_backward_input(dx.c(), dyc, w.c(), off_c);
          ref().grouped_linear_backward_input(dx.r(), dyr, w.r(), off_r);
          CHECK(rel_err(dx) <= tol_for(dt));
          CHECK(pad_changed(dx) == 0);
        }
        for (const bool accumulate : {false, true}) {
          INFO((accumulate ? "accumulate" : "write"));
          // float32 main gradients; with accumulate they start from values, else from NaN (not read).
          const std::vector<double> start = rng.normal(E * N * K);
          Twin dw = accumulate ? twin(DType::f32, {E * N, K}, start) : twin_nan(DType::f32, {E * N, K});
          dev().grouped_linear_backward_weight(dw.c(), dyc, xc, off_c, accumulate);
          ref().grouped_linear_backward_weight(dw.r(), dyr, xr, off_r, accumulate);
          const std::vector<double> got = download(dev(), dw.c()), want = download(ref(), dw.r());
          int64_t bad = 0;
          for (int64_t e = 0; e < E; ++e)
            for (int64_t i = e * N * K; i < (e + 1) * N * K; ++i) {
              const size_t k = static_cast<size_t>(i);
              if (c.rows[static_cast<size_t>(e)] == 0) {  // untouched (accumulate) or zeroed, exactly
                bad += got[k] != (accumulate ? round_to(DType::f32, start[k]) : 0.0);
              } else {
                // 16-bit inputs: the tensor cores' float32 sums run sequentially over up to 2,500 rows
                // in steps of 16 (cuBLAS may split them), more rounding than float32 GEMMs see.
                bad += !(std::fabs(got[k] - want[k]) <= 1e-4 * (1.0 + std::fabs(want[k])) * (dt != DType::f32 ? 10 : 1));
              }
            }
          CHECK(bad == 0);
          if (!accumulate) {
            // The gradient norm's share (Backend::grouped_linear_backward_weight's sumsq, summed in
            // the TMA kernel's epilogue where it runs): += the squares of dw as written, the same
            // bits again on a second run.
            double want = 0.25;
            for (const double v : got) want += v * v;
            const Twin sq = twin(DType::f32, {1}, {0.25}), again = twin(DType::f32, {1}, {0.25});
            Twin dw2 = twin_nan(DType::f32, {E * N, K});
            dev().grouped_linear_backward_weight(dw2.c(), dyc, xc, off_c, false, sq.c());
            dev().grouped_linear_backward_weight(dw2.c(), dyc, xc, off_c, false, again.c());
            const double got_sq = download(dev(), sq.c())[0], again_sq = download(dev(), again.c())[0];
            CHECK(got_sq == Approx(want).epsilon(2e-6));
            CHECK(std::memcmp(&got_sq, &again_sq, sizeof(double)) == 0);
            CHECK(download(dev(), dw2.c()) == got);  // (the same gradient with the squares taken)
            if (path == Path::mma && dt != DType::f32 && Rp > 0)
              sumsq_tma += cuda::grouped_tma_takes(cuda::GroupedOp::backward_weight, w.c(), dyc, xc, E);
          }
        }
        if (dt != DType::f32 && Rp > 0 && c.rows[0] > 0) {
          // A 16-bit weight gradient (written, not accumulated): the kernels' 16-bit stores of it.
          Twin dw16 = twin_nan(dt, {E * N, K});
          dev().grouped_linear_backward_weight(dw16.c(), dyc, xc, off_c, false);
          ref().grouped_linear_backward_weight(dw16.r(), dyr, xr, off_r, false);
          CHECK(rel_err(dw16) <= tol_for(dt));
        }
      }
    }
  }
  // The four cases above that are large enough for its boxes, three ops each, bf16 and fp16, host
  // and device offsets.
  cuda::bench_choice::grouped_gemm_path = cuda::bench_choice::GroupedGemmPath::automatic;
  cuda::bench_choice::grouped_register_epilogue = false;
  CHECK(tma_ops >= 48);
  CHECK(sumsq_tma >= 8);
}
