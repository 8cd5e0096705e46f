// CUDA (cuBLASLt) vs reference: linear forward with bias and GeLU (fused epilogue and separate
// kernel), input gradient (DGELU epilogue, separate kernel, accumulate), weight and bias gradients
// accumulating into float32 (BGRADB epilogue and column-sum kernel; deterministic).
#include <cmath>

#include "cuda/cuda_backend.h"
#include "tests/gpu/gpu_test_util.h"

using namespace mt;
using namespace mt::gputest;

namespace {
const DType kFloatTypes[] = {DType::f32, DType::bf16, DType::f16};
struct GemmShape {
  int64_t M, K, N;
};
// M, K, N that are not multiples of the tile sizes (and one that is).
const GemmShape kShapes[] = {{1, 48, 100}, {7, 768, 1000}, {333, 100, 2050}, {130, 768, 2304}, {64, 2048, 768}};
const Activation kActs[] = {Activation::none, Activation::gelu, Activation::gelu_tanh, Activation::squared_relu};

const char* act_name(Activation a) {
  switch (a) {
    case Activation::none: return "none";
    case Activation::gelu: return "gelu";
    case Activation::gelu_tanh: return "gelu_tanh";
    case Activation::squared_relu: return "squared_relu";
  }
  return "?";
}

CudaBackend& cuda_backend() { return dynamic_cast<CudaBackend&>(dev()); }

std::vector<double> scaled_normal(Rng& rng, int64_t n, double std) { return rng.normal(n, std); }

// The GeLU-epilogue tests' cases: with the fused epilogues and without them (then bf16 with an
// activation only: the fallback path, once), for each dtype, shape, activation and both values of
// the test's own switch (`option`: its name in the case's description).
template <typename Fn>
void for_each_gelu_epilogue_case(const char* option, Fn&& fn) {
  cuda::GemmRunner& gemm = cuda_backend().gemm();
  for (bool fused : {true, false}) {
    gemm.use_gelu_epilogue = fused;
    for (DType dt : kFloatTypes)
      for (const GemmShape& g : kShapes)
        for (bool on : {false, true})
          for (Activation act : kActs) {
            if (!fused && (dt != DType::bf16 || act == Activation::none)) continue;
            INFO(dtype_name(dt) << " M " << g.M << " K " << g.K << " N " << g.N << " " << option << " " << on << " act "
                                << act_name(act) << " fused epilogues " << fused);
            fn(dt, g, on, act);
          }
  }
  gemm.use_gelu_epilogue = true;
}
}  // namespace

TEST_CASE("cuda linear_forward: bias, GeLU (fused and separate)", "[gpu][linear]") {
  MT_RNG(rng);
  for_each_gelu_epilogue_case("bias", [&](DType dt, const GemmShape& g, bool with_bias, Activation act) {
    Twin x = twin(dt, {g.M, g.K}, rng.normal(g.M * g.K));
    Twin w = twin(dt, {g.N, g.K}, scaled_normal(rng, g.N * g.K, 1.0 / std::sqrt(double(g.K))));
    Twin b = with_bias ? twin(dt, {g.N}, rng.normal(g.N, 0.5)) : absent();
    Twin y = twin_nan(dt, {g.M, g.N});
    Twin pre = act != Activation::none ? twin_nan(dt, {g.M, g.N}) : absent();
    dev().linear_forward(y.c(), x.c(), w.c(), b.c(), act, pre.c());
    ref().linear_forward(y.r(), x.r(), w.r(), b.r(), act, pre.r());
    MT_CHECK_CLOSE(y, tol_for(dt));
    if (act != Activation::none) MT_CHECK_CLOSE(pre, tol_for(dt));
  });
}

TEST_CASE("cuda linear_backward_input: plain, accumulate, through GeLU", "[gpu][linear]") {
  MT_RNG(rng);
  for_each_gelu_epilogue_case("accumulate", [&](DType dt, const GemmShape& g, bool accumulate, Activation act) {
    Twin dy = twin(dt, {g.M, g.N}, rng.normal(g.M * g.N));
    Twin w = twin(dt, {g.N, g.K}, scaled_normal(rng, g.N * g.K, 1.0 / std::sqrt(double(g.N))));
    Twin pre = act != Activation::none ? twin(dt, {g.M, g.K}, rng.normal(g.M * g.K, 2.0)) : absent();
    Twin dx = accumulate ? twin(dt, {g.M, g.K}, rng.normal(g.M * g.K)) : twin_nan(dt, {g.M, g.K});
    dev().linear_backward_input(dx.c(), dy.c(), w.c(), accumulate, act, pre.c());
    ref().linear_backward_input(dx.r(), dy.r(), w.r(), accumulate, act, pre.r());
    MT_CHECK_CLOSE(dx, tol_for(dt));
    if (act != Activation::none && !accumulate) {
      // The recomputing variant: the same dx, and the activation over pre in place, bit for
      // bit what activation_forward gives.
      Twin act_fwd = twin_nan(dt, {g.M, g.K}), dx2 = twin_nan(dt, {g.M, g.K});
      dev().activation_forward(act_fwd.c(), pre.c(), act);
      ref().activation_forward(act_fwd.r(), pre.r(), act);
      dev().linear_backward_input_recompute(dx2.c(), pre.c(), dy.c(), w.c(), act, pre.c());
      ref().linear_backward_input_recompute(dx2.r(), pre.r(), dy.r(), w.r(), act, pre.r());
      MT_CHECK_CLOSE(dx2, tol_for(dt));
      CHECK(differing(download_bytes(dev(), pre.c()), download_bytes(dev(), act_fwd.c()), dtype_size(dt)) == 0);
      CHECK(differing(download_bytes(ref(), pre.r()), download_bytes(ref(), act_fwd.r()), 4) == 0);
    }
  });
}

// The bias gradient's column sums over many rows: each thread's four-rows-at-a-time loop (and its
// tail) runs, at the vector (N % 8 == 0) and scalar widths.
TEST_CASE("cuda linear_backward_weight dbias over many rows", "[gpu][linear]") {
  MT_RNG(rng);
  for (DType dt : {DType::bf16, DType::f32})
    for (int64_t N : {2048, 1001}) {
      const int64_t M = 8193, K = 16;
      INFO(dtype_name(dt) << " M " << M << " N " << N);
      Twin dy = twin(dt, {M, N}, rng.normal(M * N)), x = twin(dt, {M, K}, rng.normal(M * K));
      const std::vector<double> dw0 = rng.normal(N * K), db0 = rng.normal(N);
      Twin dw = twin(DType::f32, {N, K}, dw0), db = twin(DType::f32, {N}, db0);
      dev().linear_backward_weight(dw.c(), db.c(), dy.c(), x.c(), true);
      ref().linear_backward_weight(dw.r(), db.r(), dy.r(), x.r(), true);
      MT_CHECK_CLOSE(dw, 1e-5);
      MT_CHECK_CLOSE(db, 1e-5);
      const auto db_first = download_bytes(dev(), db.c());
      upload(dev(), dw.c(), dw0);
      upload(dev(), db.c(), db0);
      dev().linear_backward_weight(dw.c(), db.c(), dy.c(), x.c(), true);
      CHECK(differing(download_bytes(dev(), db.c()), db_first, 4) == 0);
      Twin dw_new = twin_nan(DType::f32, {N, K});  // k = 8193: the guarded form's first GEMM writes
      dev().linear_backward_weight(dw_new.c(), Tensor(), dy.c(), x.c(), false);
      ref().linear_backward_weight(dw_new.r(), Tensor(), dy.r(), x.r(), false);
      MT_CHECK_CLOSE(dw_new, 1e-5);
    }
}

TEST_CASE("cuda linear_backward_weight accumulates dw and dbias deterministically", "[gpu][linear]") {
  MT_RNG(rng);
  cuda::GemmRunner& gemm = cuda_backend().gemm();
  for (bool fused : {true, false}) {
    gemm.use_bias_grad_epilogue = fused;
    for (DType dt : kFloatTypes)
      for (const GemmShape& g : kShapes)
        for (bool with_bias : {true, false}) {
          if (fused && (dt != DType::bf16 || !with_bias)) continue;  // the BGRADB epilogue path, once
          INFO(dtype_name(dt) << " M " << g.M << " K " << g.K << " N " << g.N << " bias " << with_bias
                              << " BGRADB epilogue " << fused);
          Twin dy = twin(dt, {g.M, g.N}, rng.normal(g.M * g.N));
          Twin x = twin(dt, {g.M, g.K}, rng.normal(g.M * g.K));
          const std::vector<double> dw0 = rng.normal(g.N * g.K), db0 = rng.normal(g.N);
          Twin dw = twin(DType::f32, {g.N, g.K}, dw0);
          Twin db = with_bias ? twin(DType::f32, {g.N}, db0) : absent();
          dev().linear_backward_weight(dw.c(), db.c(), dy.c(), x.c(), true);
          ref().linear_backward_weight(dw.r(), db.r(), dy.r(), x.r(), true);
          MT_CHECK_CLOSE(dw, 1e-5);  // float32 accumulation of exact products
          if (with_bias) MT_CHECK_CLOSE(db, 1e-5);
          const auto dw_first = download_bytes(dev(), dw.c());
          const auto db_first = with_bias ? download_bytes(dev(), db.c()) : std::vector<uint8_t>();
          upload(dev(), dw.c(), dw0);
          if (with_bias) upload(dev(), db.c(), db0);
          dev().linear_backward_weight(dw.c(), db.c(), dy.c(), x.c(), true);
          CHECK(differing(download_bytes(dev(), dw.c()), dw_first, 4) == 0);
          if (with_bias) CHECK(differing(download_bytes(dev(), db.c()), db_first, 4) == 0);
          // Without accumulate dw is written (its NaNs never read: beta 0); dbias still adds.
          Twin dw_new = twin_nan(DType::f32, {g.N, g.K});
          Twin db_add = with_bias ? twin(DType::f32, {g.N}, db0) : absent();
          dev().linear_backward_weight(dw_new.c(), db_add.c(), dy.c(), x.c(), false);
          ref().linear_backward_weight(dw_new.r(), db_add.r(), dy.r(), x.r(), false);
          MT_CHECK_CLOSE(dw_new, 1e-5);
          if (with_bias) MT_CHECK_CLOSE(db_add, 1e-5);
        }
  }
  gemm.use_bias_grad_epilogue = false;
}

// GEMM autotuning (a backend of its own, so that every shape is planned, and so tuned, afresh):
// whichever candidate wins, forward (with the bias / GeLU epilogues) and input gradient match the
// reference, a second call gives the same bits, and an accumulating GEMM adds exactly once (it is
// not tuned: timing it would add into its output).
TEST_CASE("cuda GEMM autotuning: tuned GEMMs match the reference and accumulate once", "[gpu][linear]") {
  MT_RNG(rng);
  std::unique_ptr<Backend> tuned_backend = make_cuda_backend(0, true);
  Backend& tuned = *tuned_backend;
  for (DType dt : {DType::bf16, DType::f16})
    for (const GemmShape& g : {GemmShape{333, 100, 2050}, GemmShape{512, 768, 2304}, GemmShape{4096, 1024, 4096}})
      for (Activation act : {Activation::none, Activation::gelu_tanh}) {
        INFO(dtype_name(dt) << " M " << g.M << " K " << g.K << " N " << g.N << " act " << act_name(act));
        Twin x = twin(dt, {g.M, g.K}, rng.normal(g.M * g.K));
        Twin w = twin(dt, {g.N, g.K}, scaled_normal(rng, g.N * g.K, 1.0 / std::sqrt(double(g.K))));
        Twin b = twin(dt, {g.N}, rng.normal(g.N, 0.5));
        Twin y = twin_nan(dt, {g.M, g.N}), pre = act != Activation::none ? twin_nan(dt, {g.M, g.N}) : absent();
        tuned.linear_forward(y.c(), x.c(), w.c(), b.c(), act, pre.c());
        tuned.synchronize();
        ref().linear_forward(y.r(), x.r(), w.r(), b.r(), act, pre.r());
        MT_CHECK_CLOSE(y, tol_for(dt));
        const auto first = download_bytes(dev(), y.c());
        tuned.linear_forward(y.c(), x.c(), w.c(), b.c(), act, pre.c());
        tuned.synchronize();
        CHECK(differing(download_bytes(dev(), y.c()), first, dtype_size(dt)) == 0);

        Twin dy = twin(dt, {g.M, g.N}, rng.normal(g.M * g.N)), dx = twin_nan(dt, {g.M, g.K});
        tuned.linear_backward_input(dx.c(), dy.c(), w.c(), false, Activation::none, Tensor());
        tuned.synchronize();
        ref().linear_backward_input(dx.r(), dy.r(), w.r(), false, Activation::none, Tensor());
        MT_CHECK_CLOSE(dx, tol_for(dt));

        Twin dw = twin(DType::f32, {g.N, g.K}, rng.normal(g.N * g.K)), db = twin(DType::f32, {g.N}, rng.normal(g.N));
        tuned.linear_backward_weight(dw.c(), db.c(), dy.c(), x.c(), true);
        tuned.synchronize();
        ref().linear_backward_weight(dw.r(), db.r(), dy.r(), x.r(), true);
        MT_CHECK_CLOSE(dw, tol_for(dt));
        MT_CHECK_CLOSE(db, tol_for(dt));
        // A first write (beta 0) is tuned: every candidate's run overwrites the same dw.
        Twin dw_new = twin_nan(DType::f32, {g.N, g.K});
        tuned.linear_backward_weight(dw_new.c(), Tensor(), dy.c(), x.c(), false);
        tuned.synchronize();
        ref().linear_backward_weight(dw_new.r(), Tensor(), dy.r(), x.r(), false);
        MT_CHECK_CLOSE(dw_new, tol_for(dt));
      }
  CHECK(dynamic_cast<CudaBackend&>(tuned).gemm().tuned_plans() > 0);
}

// --grad-reduce-in-bf16: dw is a bf16 gradient, round_bf16(dw + dy^T x) with the product in float32
// (accumulate: the GEMM into float32 scratch, then added; without: the GEMM with a bf16 output, beta
// 0), and dbias too (the column sums added in float32, rounded once), against the reference with
// bf16 gradients. bf16 inputs (odd shapes, a k with a tail: 8193 rows), float32 and float16 inputs
// (the float32 scratch path also without accumulate), the BGRADB switch (not taken for bf16
// gradients), one case with a float32 dbias beside a bf16 dw; deterministic.
TEST_CASE("cuda linear_backward_weight into bf16 gradients matches the reference", "[gpu][linear][bf16grad]") {
  MT_RNG(rng);
  cuda::GemmRunner& gemm = cuda_backend().gemm();
  std::vector<GemmShape> shapes(std::begin(kShapes), std::end(kShapes));
  shapes.push_back({8193, 16, 2048});
  shapes.push_back({1001, 64, 100});
  for (bool bgradb : {false, true}) {
    gemm.use_bias_grad_epilogue = bgradb;
    for (DType dt : {DType::bf16, DType::f32, DType::f16})
      for (const GemmShape& g : shapes)
        for (bool with_bias : {true, false})
          for (bool accumulate : {true, false}) {
            if (bgradb && (!with_bias || g.M == 8193 || dt != DType::bf16)) continue;
            if (dt != DType::bf16 && !(g.M == 333 || g.M == 130)) continue;  // the other inputs: two shapes
            const bool db_f32 = with_bias && g.M == 333;
            INFO(dtype_name(dt) << " inputs, M " << g.M << " K " << g.K << " N " << g.N << " bias " << with_bias
                                << (db_f32 ? " (float32)" : "") << " accumulate " << accumulate
                                << " BGRADB epilogue switch " << bgradb);
            Twin dy = twin(dt, {g.M, g.N}, rng.normal(g.M * g.N));
            Twin x = twin(dt, {g.M, g.K}, rng.normal(g.M * g.K));
            // Starting values of about one contribution's size (sums of M products).
            const double scale = std::sqrt(static_cast<double>(g.M));
            const std::vector<double> dw0 =
                accumulate ? rng.normal(g.N * g.K, scale) : std::vector<double>(static_cast<size_t>(g.N * g.K), NAN);
            const std::vector<double> db0 = rng.normal(g.N, scale);
            Twin dw = twin_same(DType::bf16, {g.N, g.K}, dw0);
            Twin db = !with_bias ? absent() : db_f32 ? twin(DType::f32, {g.N}, db0) : twin_same(DType::bf16, {g.N}, db0);
            dev().linear_backward_weight(dw.c(), db.c(), dy.c(), x.c(), accumulate);
            ref().linear_backward_weight(dw.r(), db.r(), dy.r(), x.r(), accumulate);
            check_bf16_grad(dw, accumulate ? "dw (accumulate)" : "dw (written)");
            if (with_bias) {
              if (db_f32) MT_CHECK_CLOSE(db, 1e-5);
              else check_bf16_grad(db, "dbias");
            }
            // The same bits again from the same start.
            const auto dw_first = download_bytes(dev(), dw.c());
            const auto db_first = with_bias ? download_bytes(dev(), db.c()) : std::vector<uint8_t>();
            upload(dev(), dw.c(), dw0);
            if (with_bias) upload(dev(), db.c(), db0);
            dev().linear_backward_weight(dw.c(), db.c(), dy.c(), x.c(), accumulate);
            CHECK(differing(download_bytes(dev(), dw.c()), dw_first, 2) == 0);
            if (with_bias) CHECK(differing(download_bytes(dev(), db.c()), db_first, dtype_size(db.c().dtype)) == 0);
          }
  }
  gemm.use_bias_grad_epilogue = false;
  // Other gradient dtypes are refused, naming the op, the tensor and the dtypes it takes.
  {
    Buf dy(dev(), DType::bf16, {16, 32}), x(dev(), DType::bf16, {16, 8}), dw16(dev(), DType::f16, {32, 8});
    CHECK_THROWS_WITH(dev().linear_backward_weight(dw16.t, Tensor(), dy.t, x.t, true),
                      Catch::Contains("linear_backward_weight") && Catch::Contains("dw") &&
                          Catch::Contains("float32, bfloat16"));
    Buf db16(dev(), DType::f16, {32}), dwf(dev(), DType::f32, {32, 8});
    CHECK_THROWS_WITH(dev().linear_backward_weight(dwf.t, db16.t, dy.t, x.t, true),
                      Catch::Contains("linear_backward_weight") && Catch::Contains("dbias") &&
                          Catch::Contains("float32 or bfloat16"));
  }
}

// Autotuning with a bf16 dw: the first write (beta 0) is tuned on its own buffers, the accumulating
// GEMM (beta 1, a plan of its own keyed by the bf16 output) takes its twin's pick; both match the
// reference and add exactly once.
TEST_CASE("cuda GEMM autotuning with bf16 weight gradients", "[gpu][linear][bf16grad]") {
  MT_RNG(rng);
  std::unique_ptr<Backend> tuned_backend = make_cuda_backend(0, true);
  Backend& tuned = *tuned_backend;
  for (const GemmShape& g : {GemmShape{333, 100, 2050}, GemmShape{512, 768, 2304}, GemmShape{4096, 1024, 1024}}) {
    INFO("M " << g.M << " K " << g.K << " N " << g.N);
    Twin dy = twin(DType::bf16, {g.M, g.N}, rng.normal(g.M * g.N)), x = twin(DType::bf16, {g.M, g.K}, rng.normal(g.M * g.K));
    Twin dw = twin_same(DType::bf16, {g.N, g.K}, std::vector<double>(static_cast<size_t>(g.N * g.K), NAN));
    Twin db = twin_same(DType::bf16, {g.N}, rng.normal(g.N, 10.0));
    tuned.linear_backward_weight(dw.c(), db.c(), dy.c(), x.c(), false);
    tuned.synchronize();
    ref().linear_backward_weight(dw.r(), db.r(), dy.r(), x.r(), false);
    check_bf16_grad(dw, "dw (first write, tuned)");
    check_bf16_grad(db, "dbias");
    // A second micro-batch: accumulates onto the first (the same values on both sides).
    Twin dy2 = twin(DType::bf16, {g.M, g.N}, rng.normal(g.M * g.N)), x2 = twin(DType::bf16, {g.M, g.K}, rng.normal(g.M * g.K));
    upload(ref(), dw.r(), download(dev(), dw.c()));
    tuned.linear_backward_weight(dw.c(), Tensor(), dy2.c(), x2.c(), true);
    tuned.synchronize();
    ref().linear_backward_weight(dw.r(), Tensor(), dy2.r(), x2.r(), true);
    check_bf16_grad(dw, "dw (accumulated, the twin's pick)");
  }
  CHECK(dynamic_cast<CudaBackend&>(tuned).gemm().tuned_plans() > 0);
}

// The accumulating bf16 dw in several float32 chunks of rows (a backend with 2 MiB of scratch: 640
// rows of K 768, 256 of K 2048; the last chunk partial), accumulating and, with float32 inputs,
// written.
TEST_CASE("cuda linear_backward_weight into bf16 gradients in several scratch chunks", "[gpu][linear][bf16grad]") {
  MT_RNG(rng);
  CudaBackend small(0, size_t{2} << 20);
  for (const GemmShape& g : {GemmShape{130, 768, 1000}, GemmShape{64, 2048, 768}, GemmShape{333, 2048, 2050}})
    for (DType dt : {DType::bf16, DType::f32})
      for (bool accumulate : {true, false}) {
        INFO(dtype_name(dt) << " inputs, M " << g.M << " K " << g.K << " N " << g.N << " accumulate " << accumulate);
        Twin dy = twin(dt, {g.M, g.N}, rng.normal(g.M * g.N)), x = twin(dt, {g.M, g.K}, rng.normal(g.M * g.K));
        const double scale = std::sqrt(static_cast<double>(g.M));
        Twin dw = twin_same(DType::bf16, {g.N, g.K},
                            accumulate ? rng.normal(g.N * g.K, scale)
                                       : std::vector<double>(static_cast<size_t>(g.N * g.K), NAN));
        Twin db = twin_same(DType::bf16, {g.N}, rng.normal(g.N, scale));
        small.linear_backward_weight(dw.c(), db.c(), dy.c(), x.c(), accumulate);
        small.synchronize();
        ref().linear_backward_weight(dw.r(), db.r(), dy.r(), x.r(), accumulate);
        check_bf16_grad(dw, "dw");
        check_bf16_grad(db, "dbias");
      }
}
