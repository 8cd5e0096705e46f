// The EXPERIMENTAL FP8 linears (cuda/fp8_experimental.h) against the CUDA backend's bf16 linear
// ops on the same inputs: FP8 tolerance for the GEMM results, tight for what both paths compute
// with the same kernels (bias gradient, recomputed activation), the fall-back (returns false) for
// shapes that do not qualify, and the delayed recipe's slots across steps.
#include <cmath>

#include "cuda/cuda_backend.h"
#include "cuda/fp8_experimental.h"
#include "tests/gpu/fp8_test_util.h"
#include "tests/gpu/gpu_test_util.h"

using namespace mt;
using namespace mt::gputest;

TEST_CASE("experimental FP8 linears vs the bf16 linear ops", "[gpu][fp8]") {
  MT_RNG(rng);
  CudaBackend& be = fp8test::cuda_backend();
  const auto recipe = GENERATE(cuda::ExperimentalFp8::Recipe::current, cuda::ExperimentalFp8::Recipe::delayed);
  INFO("recipe " << (recipe == cuda::ExperimentalFp8::Recipe::current ? "current" : "delayed"));
  cuda::ExperimentalFp8 fp8(be.cuda_stream(), cuda::Fp8Format::e5m2, recipe, 4);
  Buf scratch_mem(be, DType::u8, {int64_t{16} << 20});
  cuda::Scratch scratch(scratch_mem.t.data, scratch_mem.t.nbytes());
  cuda::KernelContext ctx = fp8test::context();
  ctx.scratch = &scratch;
  const int64_t M = 512, K = 256, N = 384;
  Buf x(be, DType::bf16, {M, K}), w(be, DType::bf16, {N, K}), b(be, DType::bf16, {N});
  upload(be, x.t, rng.normal(M * K, 1.0));
  upload(be, w.t, rng.normal(N * K, 0.05));
  upload(be, b.t, rng.normal(N, 0.1));

  // Forward with bias and GeLU (tanh), keeping the pre-activation.
  Buf y(be, DType::bf16, {M, N}), pre(be, DType::bf16, {M, N}), y8(be, DType::bf16, {M, N}), pre8(be, DType::bf16, {M, N});
  be.linear_forward(y.t, x.t, w.t, b.t, Activation::gelu_tanh, pre.t);
  REQUIRE(fp8.linear_forward(ctx, y8.t, x.t, w.t, b.t, Activation::gelu_tanh, pre8.t));
  const double e_pre = rel_err(download(be, pre8.t), download(be, pre.t)), e_y = rel_err(download(be, y8.t), download(be, y.t));
  INFO("forward errors: pre-activation " << e_pre << ", output " << e_y);
  CHECK(e_pre < 0.08);
  CHECK(e_y < 0.08);

  // Input gradient through the GeLU (dy is [M, N], w [N, K] -> dx [M, K]; pre is [M, K]).
  Buf dy(be, DType::bf16, {M, N}), pre_in(be, DType::bf16, {M, K});
  upload(be, dy.t, rng.normal(M * N, 1e-2));
  upload(be, pre_in.t, rng.normal(M * K, 1.0));
  Buf dx(be, DType::bf16, {M, K}), dx8(be, DType::bf16, {M, K});
  be.linear_backward_input(dx.t, dy.t, w.t, false, Activation::gelu, pre_in.t);
  REQUIRE(fp8.linear_backward_input(ctx, dx8.t, dy.t, w.t, false, Activation::gelu, pre_in.t));
  const double e_dx = rel_err(download(be, dx8.t), download(be, dx.t));
  INFO("input-gradient error " << e_dx);
  CHECK(e_dx < 0.12);

  // The recomputing variant: dx and the activation recomputed from pre_in.
  Buf act(be, DType::bf16, {M, K}), act8(be, DType::bf16, {M, K}), dxr(be, DType::bf16, {M, K}), dxr8(be, DType::bf16, {M, K});
  be.linear_backward_input_recompute(dxr.t, act.t, dy.t, w.t, Activation::gelu, pre_in.t);
  REQUIRE(fp8.linear_backward_input_recompute(ctx, dxr8.t, act8.t, dy.t, w.t, Activation::gelu, pre_in.t));
  CHECK(rel_err(download(be, dxr8.t), download(be, dxr.t)) < 0.12);
  CHECK(rel_err(download(be, act8.t), download(be, act.t)) < 1e-2);

  // Weight and bias gradients, accumulating into float32.
  const std::vector<double> dw0 = rng.normal(N * K, 1e-3), db0 = rng.normal(N, 1e-3);
  Buf dw(be, DType::f32, {N, K}), dw8(be, DType::f32, {N, K}), db(be, DType::f32, {N}), db8(be, DType::f32, {N});
  for (Buf* t : {&dw, &dw8}) upload(be, t->t, dw0);
  for (Buf* t : {&db, &db8}) upload(be, t->t, db0);
  be.linear_backward_weight(dw.t, db.t, dy.t, x.t);
  REQUIRE(fp8.linear_backward_weight(ctx, dw8.t, db8.t, dy.t, x.t));
  std::vector<double> g = download(be, dw8.t), r = download(be, dw.t);
  for (size_t i = 0; i < g.size(); ++i) g[i] -= dw0[i], r[i] -= dw0[i];
  const double e_dw = rel_err(g, r);
  INFO("weight-gradient error " << e_dw);
  CHECK(e_dw < 0.12);
  CHECK(rel_err(download(be, db8.t), download(be, db.t)) < 1e-5);  // same column-sum kernel, same dy
  std::printf("experimental FP8 linears, M %lld K %lld N %lld: relative L2 error forward %.4f, input grad %.4f, "
              "weight grad %.4f\n",
              (long long)M, (long long)K, (long long)N, e_y, e_dx, e_dw);

  // Not qualifying (24 rows): nothing done, counted as bf16.
  const int64_t before = fp8.bf16_calls();
  Buf x24(be, DType::bf16, {24, K}), y24(be, DType::bf16, {24, N});
  CHECK_FALSE(fp8.linear_forward(ctx, y24.t, x24.t, w.t, Tensor(), Activation::none, Tensor()));
  CHECK(fp8.bf16_calls() == before + 1);
  CHECK(fp8.fp8_calls() == 4);

  // Next step (delayed: the scales now come from the amax the casts recorded, the same tensors'):
  // the forward again gives the same bytes.
  fp8.end_step(ctx);
  Buf y8b(be, DType::bf16, {M, N}), pre8b(be, DType::bf16, {M, N});
  REQUIRE(fp8.linear_forward(ctx, y8b.t, x.t, w.t, b.t, Activation::gelu_tanh, pre8b.t));
  CHECK(differing(download_bytes(be, pre8b.t), download_bytes(be, pre8.t), 2) == 0);
}
