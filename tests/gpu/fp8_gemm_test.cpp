// FP8 GEMMs (cuda/fp8_gemm_cublaslt.h):
//   1. against a float64 GEMM on the dequantized inputs: the same math, so the tolerance only
//      covers accumulation order/precision (Hopper's FP8 tensor cores keep fewer bits between the
//      fp32 promotions; more with fast accumulation) and the output rounding;
//   2. the three linear-layer mappings (forward, input gradient with the transposed weight copy,
//      weight gradient from two transposed copies, accumulating into fp32) with current scaling,
//      against the bf16 linear ops of the CUDA backend, at FP8 tolerance;
//   3. the requirement checks.
#include <algorithm>
#include <cmath>
#include <cstdio>

#include "cuda/cuda_backend.h"
#include "cuda/fp8_gemm_cublaslt.h"
#include "cuda/fp8_kernels.h"
#include "tests/gpu/fp8_test_util.h"
#include "tests/gpu/gpu_test_util.h"

using namespace mt;
using namespace mt::gputest;

namespace {

struct Shape3 {
  int64_t m, n, k;
};
// Multiples of 16, most of them not of 64 or 128.
const Shape3 kShapes[] = {{16, 16, 16}, {48, 80, 112}, {272, 208, 336}, {128, 256, 4096}, {1040, 784, 2064}};

struct FormatPair {
  cuda::Fp8Format x, w;
};
const FormatPair kPairs[] = {{cuda::Fp8Format::e4m3, cuda::Fp8Format::e4m3},
                             {cuda::Fp8Format::e5m2, cuda::Fp8Format::e4m3},
                             {cuda::Fp8Format::e4m3, cuda::Fp8Format::e5m2}};

cuda::Fp8GemmRunner& runner() {
  static cuda::Fp8GemmRunner r(fp8test::cuda_backend().cuda_stream(), size_t{32} << 20);
  return r;
}

// Random fp8 codes of normal(0, std) values.
std::vector<uint8_t> random_codes(Rng& rng, int64_t n, double std, cuda::Fp8Format f) {
  const std::vector<double> v = rng.normal(n, std);
  std::vector<uint8_t> c(v.size());
  for (size_t i = 0; i < v.size(); ++i) c[i] = fp8test::encode_fp8(static_cast<float>(v[i]), f);
  return c;
}

std::vector<double> decode_all(const std::vector<uint8_t>& c, cuda::Fp8Format f) {
  std::vector<double> v(c.size());
  for (size_t i = 0; i < c.size(); ++i) v[i] = fp8test::decode_fp8(c[i], f);
  return v;
}

}  // namespace

TEST_CASE("fp8 gemm: against float64 on the dequantized inputs (bf16/f32 out, bias, accumulate)", "[gpu][fp8]") {
  MT_RNG(rng);
  CudaBackend& be = fp8test::cuda_backend();
  enum class Mode { bf16, bf16_bias, bf16_fast, f32, f32_accumulate };
  const float sx = 0.37f, sw = 1.7f;
  // Both scales in one buffer, 16 bytes apart (cuBLASLt declines 4-byte offsets: see the checks).
  Buf scales(be, DType::f32, {8});
  fp8test::put_floats(scales, {sx, 0, 0, 0, sw, 0, 0, 0});
  const float* sx_ptr = scales.t.ptr<float>();
  const float* sw_ptr = sx_ptr + 4;
  for (const Shape3& s : kShapes)
    for (const FormatPair& fp : kPairs) {
      const std::vector<uint8_t> xc = random_codes(rng, s.m * s.k, 2.0, fp.x), wc = random_codes(rng, s.n * s.k, 1.0, fp.w);
      const std::vector<double> xv = decode_all(xc, fp.x), wv = decode_all(wc, fp.w);
      // Reference: exact dot products (float64) and the sum of |terms| per element for the bound.
      std::vector<double> dot(static_cast<size_t>(s.m * s.n)), mag(dot.size());
      for (int64_t i = 0; i < s.m; ++i)
        for (int64_t j = 0; j < s.n; ++j) {
          double acc = 0, a = 0;
          for (int64_t q = 0; q < s.k; ++q) {
            const double t = xv[i * s.k + q] * wv[j * s.k + q];
            acc += t;
            a += std::fabs(t);
          }
          dot[i * s.n + j] = acc * sx * sw;
          mag[i * s.n + j] = a * sx * sw;
        }
      Buf x(be, DType::u8, {s.m, s.k}), w(be, DType::u8, {s.n, s.k});
      fp8test::put(x, xc.data());
      fp8test::put(w, wc.data());
      const std::vector<double> bias = rng.normal(s.n, 3.0), d0 = rng.normal(s.m * s.n, 5.0);
      for (Mode mode : {Mode::bf16, Mode::bf16_bias, Mode::bf16_fast, Mode::f32, Mode::f32_accumulate}) {
        const bool f32 = mode == Mode::f32 || mode == Mode::f32_accumulate;
        INFO("m " << s.m << " n " << s.n << " k " << s.k << " x " << cuda::fp8_format_name(fp.x) << " w "
                  << cuda::fp8_format_name(fp.w) << " mode " << static_cast<int>(mode));
        Buf out(be, f32 ? DType::f32 : DType::bf16, {s.m, s.n});
        Buf bias_buf(be, DType::bf16, {s.n});
        upload(be, bias_buf.t, bias);
        if (mode == Mode::f32_accumulate) upload(be, out.t, d0);
        cuda::Fp8GemmCall c;
        c.m = s.m, c.n = s.n, c.k = s.k;
        c.x = x.t.data, c.x_format = fp.x, c.x_scale_inv = sx_ptr;
        c.w = w.t.data, c.w_format = fp.w, c.w_scale_inv = sw_ptr;
        c.out = out.t.data, c.out_type = out.t.dtype;
        c.beta = mode == Mode::f32_accumulate ? 1.0f : 0.0f;
        c.bias = mode == Mode::bf16_bias ? bias_buf.t.data : nullptr;
        c.fast_accum = mode == Mode::bf16_fast;
        runner().run(c, "test");
        const std::vector<double> got = download(be, out.t);
        // Per element: accumulation error relative to sum |terms|, plus the output rounding for
        // bf16. Hopper's FP8 MMA keeps fewer than fp32's bits in its accumulator between the
        // promotions to fp32 (measured on the H200: up to 1.5e-4 x sum |terms| over k = 112 with
        // float32 output), and fast accumulation promotes never; a wrong operand layout or scale
        // gives errors of the order of the result itself.
        const double acc_tol = mode == Mode::bf16_fast ? 2e-3 : 4e-4;
        int64_t bad = 0, first = -1;
        double worst = 0;
        for (int64_t i = 0; i < s.m; ++i)
          for (int64_t j = 0; j < s.n; ++j) {
            const int64_t e = i * s.n + j;
            double want = dot[e], bound = acc_tol * mag[e] + 1e-30;
            if (mode == Mode::bf16_bias) {
              want += round_to(DType::bf16, bias[j]);
              bound += acc_tol * std::fabs(bias[j]);
            }
            if (mode == Mode::f32_accumulate) want += static_cast<float>(d0[e]), bound += 1e-6 * std::fabs(d0[e]);
            if (!f32) bound += std::ldexp(std::fabs(want), -8);
            const double err = std::fabs(got[e] - want);
            worst = std::max(worst, err / bound);
            if (!(err <= bound)) {
              if (first < 0) first = e;
              ++bad;
            }
          }
        INFO("elements outside the bound: " << bad << " (first at " << first << "); worst err/bound " << worst);
        CHECK(bad == 0);
      }
    }
  CHECK(runner().cached_plans() > 0);
}

TEST_CASE("fp8 gemm: amax of the output", "[gpu][fp8]") {
  MT_RNG(rng);
  CudaBackend& be = fp8test::cuda_backend();
  const Shape3 s{256, 128, 512};
  const std::vector<uint8_t> xc = random_codes(rng, s.m * s.k, 1.0, cuda::Fp8Format::e4m3),
                             wc = random_codes(rng, s.n * s.k, 1.0, cuda::Fp8Format::e4m3);
  Buf x(be, DType::u8, {s.m, s.k}), w(be, DType::u8, {s.n, s.k}), one(be, DType::f32, {1}), amax(be, DType::f32, {1});
  Buf out(be, DType::bf16, {s.m, s.n});
  fp8test::put(x, xc.data());
  fp8test::put(w, wc.data());
  fp8test::put_floats(one, {1.0f});
  fp8test::put_floats(amax, {0.0f});
  cuda::Fp8GemmCall c;
  c.m = s.m, c.n = s.n, c.k = s.k;
  c.x = x.t.data, c.x_scale_inv = one.t.ptr<float>();
  c.w = w.t.data, c.w_scale_inv = one.t.ptr<float>();
  c.out = out.t.data, c.out_type = DType::bf16;
  c.amax_out = amax.t.ptr<float>();
  const bool supported = runner().try_run(c, "test amax");
  if (!supported) {
    WARN("cuBLASLt offers no FP8 GEMM with AMAX_D for a bf16 output: callers use fp8_amax instead");
    return;
  }
  const std::vector<double> got = download(be, out.t);
  double m = 0;
  for (double v : got) m = std::max(m, std::fabs(v));
  // amax is taken before the bf16 rounding: within one bf16 rounding of the stored maximum.
  CHECK(std::fabs(fp8test::get_floats(amax)[0] - m) <= std::ldexp(m, -8));
}

TEST_CASE("fp8 gemm: requirement checks", "[gpu][fp8]") {
  CudaBackend& be = fp8test::cuda_backend();
  Buf x(be, DType::u8, {64, 64}), w(be, DType::u8, {64, 64}), out(be, DType::f32, {64, 64}), one(be, DType::f32, {4});
  cuda::Fp8GemmCall c;
  c.m = 64, c.n = 64, c.k = 64;
  c.x = x.t.data, c.x_scale_inv = one.t.ptr<float>();
  c.w = w.t.data, c.w_scale_inv = one.t.ptr<float>();
  c.out = out.t.data, c.out_type = DType::f32;
  cuda::Fp8GemmCall bad = c;
  bad.m = 40;
  CHECK_THROWS_WITH(runner().run(bad, "test"), Catch::Contains("multiple of 16"));
  bad = c;
  bad.x_format = bad.w_format = cuda::Fp8Format::e5m2;
  CHECK_THROWS_WITH(runner().run(bad, "test"), Catch::Contains("e5m2 x e5m2"));
  bad = c;
  bad.x = static_cast<const char*>(c.x) + 8;
  CHECK_THROWS_WITH(runner().run(bad, "test"), Catch::Contains("16-byte aligned"));
  bad = c;
  bad.w_scale_inv = c.w_scale_inv + 1;  // cuBLASLt declines scale pointers at 4-byte offsets (H200 run)
  CHECK_THROWS_WITH(runner().run(bad, "test"), Catch::Contains("scale_inv pointers must be 16-byte aligned"));
  bad = c;
  bad.out_type = DType::bf16;
  bad.beta = 1.0f;
  CHECK_THROWS_WITH(runner().run(bad, "test"), Catch::Contains("float32 output"));
  CHECK_NOTHROW(runner().run(c, "test"));
}

namespace {

// A bf16 tensor quantized with current scaling: amax -> scale -> cast (and the transposed copy).
struct Quantized {
  Buf q, q_t, amax, scale, scale_inv;
};

Quantized quantize(CudaBackend& be, const Tensor& src, cuda::Fp8Format f, bool row_major, bool transposed) {
  const cuda::KernelContext ctx = fp8test::context();
  Quantized r{Buf(be, DType::u8, {src.numel()}), Buf(be, DType::u8, {src.numel()}), Buf(be, DType::f32, {1}),
              Buf(be, DType::f32, {1}), Buf(be, DType::f32, {1})};
  fp8test::put_floats(r.amax, {0.0f});
  fp8test::put_floats(r.scale, {1.0f});
  cuda::fp8_amax(ctx, r.amax.t.ptr<float>(), src);
  cuda::fp8_update_scales(ctx, r.amax.t.ptr<float>(), 1, 1, r.scale.t.ptr<float>(), r.scale_inv.t.ptr<float>(),
                          cuda::fp8_format_max(f), 0, cuda::Fp8AmaxAlgo::most_recent);
  cuda::cast_transpose_to_fp8(ctx, row_major ? r.q.t.data : nullptr, transposed ? r.q_t.t.data : nullptr, f, src,
                              r.scale.t.ptr<float>(), nullptr);
  return r;
}

std::vector<double> minus(std::vector<double> a, const std::vector<double>& b) {
  for (size_t i = 0; i < a.size(); ++i) a[i] -= b[i];
  return a;
}

}  // namespace

TEST_CASE("fp8 linear mappings (forward, input grad, weight grad) vs the bf16 linear ops", "[gpu][fp8]") {
  MT_RNG(rng);
  CudaBackend& be = fp8test::cuda_backend();
  struct MKN {
    int64_t M, K, N;
  };
  for (MKN g : {MKN{256, 384, 272}, MKN{1040, 208, 528}, MKN{512, 2048, 768}}) {
    INFO("M " << g.M << " K " << g.K << " N " << g.N);
    Buf x(be, DType::bf16, {g.M, g.K}), w(be, DType::bf16, {g.N, g.K}), dy(be, DType::bf16, {g.M, g.N});
    upload(be, x.t, rng.normal(g.M * g.K, 1.0));
    upload(be, w.t, rng.normal(g.N * g.K, 0.02));
    upload(be, dy.t, rng.normal(g.M * g.N, 1e-3));
    // Hybrid recipe: activations and weights e4m3, gradients e5m2.
    Quantized xq = quantize(be, x.t, cuda::Fp8Format::e4m3, true, true);
    Quantized wq = quantize(be, w.t, cuda::Fp8Format::e4m3, true, true);
    Quantized dyq = quantize(be, dy.t, cuda::Fp8Format::e5m2, true, true);

    // Forward: y = x . w^T.
    Buf y(be, DType::bf16, {g.M, g.N}), y8(be, DType::bf16, {g.M, g.N});
    be.linear_forward(y.t, x.t, w.t, Tensor(), Activation::none, Tensor());
    cuda::fp8_linear_forward(runner(), y8.t, {xq.q.t.data, cuda::Fp8Format::e4m3, xq.scale_inv.t.ptr<float>()},
                             {wq.q.t.data, cuda::Fp8Format::e4m3, wq.scale_inv.t.ptr<float>()}, g.K, nullptr);
    const double e_fwd = rel_err(download(be, y8.t), download(be, y.t));
    INFO("forward relative L2 error " << e_fwd);
    CHECK(e_fwd < 0.08);  // e4m3 x e4m3: ~0.05 expected (two roundings of up to 2^-4 relative)

    // Input gradient: dx = dy . w = dy . (w^T)^T, w^T [K, N] being the transposed copy.
    Buf dx(be, DType::bf16, {g.M, g.K}), dx8(be, DType::bf16, {g.M, g.K});
    be.linear_backward_input(dx.t, dy.t, w.t, false, Activation::none, Tensor());
    cuda::fp8_linear_backward_input(runner(), dx8.t, {dyq.q.t.data, cuda::Fp8Format::e5m2, dyq.scale_inv.t.ptr<float>()},
                                    {wq.q_t.t.data, cuda::Fp8Format::e4m3, wq.scale_inv.t.ptr<float>()}, g.N, false);
    const double e_dgrad = rel_err(download(be, dx8.t), download(be, dx.t));
    INFO("input-gradient relative L2 error " << e_dgrad);
    CHECK(e_dgrad < 0.12);  // e5m2 x e4m3: ~0.08 expected

    // Weight gradient: dw += dy^T . x = (dy^T)[N, M] . ((x^T)[K, M])^T, into float32.
    const std::vector<double> dw0 = rng.normal(g.N * g.K, 1e-3);
    Buf dw(be, DType::f32, {g.N, g.K}), dw8(be, DType::f32, {g.N, g.K});
    upload(be, dw.t, dw0);
    upload(be, dw8.t, dw0);
    be.linear_backward_weight(dw.t, Tensor(), dy.t, x.t, true);
    cuda::fp8_linear_backward_weight(runner(), dw8.t, {dyq.q_t.t.data, cuda::Fp8Format::e5m2, dyq.scale_inv.t.ptr<float>()},
                                     {xq.q_t.t.data, cuda::Fp8Format::e4m3, xq.scale_inv.t.ptr<float>()}, g.M, true);
    const double e_wgrad = rel_err(minus(download(be, dw8.t), dw0), minus(download(be, dw.t), dw0));
    INFO("weight-gradient relative L2 error " << e_wgrad);
    CHECK(e_wgrad < 0.12);
    std::printf("fp8 vs bf16 linear ops, M %lld K %lld N %lld: relative L2 error forward %.4f, input grad %.4f, "
                "weight grad %.4f\n",
                (long long)g.M, (long long)g.K, (long long)g.N, e_fwd, e_dgrad, e_wgrad);
  }
}
