// Reference backend FP8 ops: quantization (delayed and tensorwise scaling, transposed copies),
// the three FP8 GEMMs against the float GEMMs within FP8 tolerance (and exactly against the
// float GEMM on the dequantized values), and the delayed-scaling update of scales and history.
#include <catch2/catch.hpp>

#include <cfloat>
#include <cmath>
#include <vector>

#include "core/dtype.h"
#include "core/philox.h"
#include "engine/backend.h"

using namespace mt;

namespace {

Tensor f32(std::vector<float>& v, std::initializer_list<int64_t> shape) { return Tensor(v.data(), DType::f32, Device::cpu, shape); }
Tensor u8(std::vector<uint8_t>& v, DType t, std::initializer_list<int64_t> shape) { return Tensor(v.data(), t, Device::cpu, shape); }

std::vector<float> randn(size_t n, uint64_t key, float std) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = std * normal_at(key, i);
  return v;
}

// One operand's scaling state on the host: scale, scale_inv, amax.
struct Meta {
  std::vector<float> s{1.0f}, si{1.0f}, amax{0.0f};
  Fp8TensorMeta view(Fp8Recipe r = Fp8Recipe::delayed, int margin = 0) {
    Fp8TensorMeta m;
    m.scale = f32(s, {1});
    m.scale_inv = f32(si, {1});
    m.amax = f32(amax, {1});
    m.recipe = r;
    m.margin = margin;
    return m;
  }
};

double max_abs(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = std::max(m, std::fabs(static_cast<double>(x)));
  return m;
}

}  // namespace

TEST_CASE("fp8_quantize: delayed scaling casts with the given scale and records amax", "[fp8][reference]") {
  auto be = make_reference_backend(2);
  std::vector<float> x = {1.0f, -3.0f, 0.1f, 500.0f, 2.0f, -0.5f};  // [2, 3]
  std::vector<uint8_t> q(6), qt(6);
  Meta m;
  m.s[0] = 2.0f;
  m.amax[0] = 1000.0f;  // running max of earlier micro-batches: kept
  be->fp8_quantize(u8(q, DType::fp8_e4m3, {2, 3}), u8(qt, DType::fp8_e4m3, {3, 2}), f32(x, {2, 3}), m.view());
  CHECK(m.amax[0] == 1000.0f);
  CHECK(m.s[0] == 2.0f);
  CHECK(m.si[0] == 1.0f);  // delayed: scale_inv is the update's business
  for (int r = 0; r < 2; ++r)
    for (int c = 0; c < 3; ++c) {
      const uint8_t expect = float_to_fp8_bits(DType::fp8_e4m3, x[r * 3 + c] * 2.0f);
      CHECK(q[r * 3 + c] == expect);
      CHECK(qt[c * 2 + r] == expect);
    }
  CHECK(fp8_bits_to_float(DType::fp8_e4m3, q[3]) == 448.0f);  // 1000 saturates
  m.amax[0] = 0.0f;
  be->fp8_quantize(Tensor(), u8(qt, DType::fp8_e5m2, {3, 2}), f32(x, {2, 3}), m.view());
  CHECK(m.amax[0] == 500.0f);
  CHECK(fp8_bits_to_float(DType::fp8_e5m2, qt[1 * 2 + 1]) == 2.0f * 2.0f);  // x[1,1] = 2, transposed
  CHECK(fp8_bits_to_float(DType::fp8_e5m2, qt[0 * 2 + 1]) == 1024.0f);     // x[1,0] = 500: 1000 rounds to 1024
}

TEST_CASE("fp8_quantize: tensorwise scaling takes the scale from this tensor's amax and the margin", "[fp8][reference]") {
  auto be = make_reference_backend(1);
  std::vector<float> x = {0.25f, -7.0f, 3.0f, 1.0f};
  std::vector<uint8_t> q(4);
  Meta m;
  be->fp8_quantize(u8(q, DType::fp8_e4m3, {2, 2}), Tensor(), f32(x, {2, 2}), m.view(Fp8Recipe::tensorwise, 1));
  const float scale = (448.0f / 7.0f) / 2.0f;
  CHECK(m.s[0] == scale);
  CHECK(m.si[0] == 1.0f / scale);
  CHECK(m.amax[0] == 7.0f);
  CHECK(fp8_bits_to_float(DType::fp8_e4m3, q[1]) == round_to_fp8(DType::fp8_e4m3, -7.0f * scale));
  CHECK(fp8_bits_to_float(DType::fp8_e4m3, q[1]) == -224.0f);  // margin 1: amax maps to 448 / 2
  // All zeros: the scale is kept.
  std::vector<float> z(4, 0.0f);
  be->fp8_quantize(u8(q, DType::fp8_e4m3, {2, 2}), Tensor(), f32(z, {2, 2}), m.view(Fp8Recipe::tensorwise, 1));
  CHECK(m.s[0] == scale);
  // A tiny amax would give an infinite scale: FLT_MAX instead.
  std::vector<float> tiny = {1e-40f, 0, 0, 0};
  be->fp8_quantize(u8(q, DType::fp8_e4m3, {2, 2}), Tensor(), f32(tiny, {2, 2}), m.view(Fp8Recipe::tensorwise, 0));
  CHECK(m.s[0] == FLT_MAX);
}

TEST_CASE("fp8_quantize_activation equals the activation op, then fp8_quantize, bit for bit", "[fp8][reference]") {
  auto be = make_reference_backend(2);
  const int64_t R = 5, C = 7;  // odd sizes
  // (SwiGLU also with gpt-oss's gated unit: quick-GeGLU with the linear offset and the clamp.)
  for (const Glu g : {Glu{}, Glu{true, 1.0f, 2.0f}})
  for (MlpActivation act : {MlpActivation::gelu, MlpActivation::gelu_tanh, MlpActivation::swiglu, MlpActivation::squared_relu})
    for (Fp8Recipe recipe : {Fp8Recipe::delayed, Fp8Recipe::tensorwise}) {
      if (!g.plain() && act != MlpActivation::swiglu) continue;
      INFO("activation " << static_cast<int>(act) << " recipe " << static_cast<int>(recipe) << " quick " << g.quick_gelu);
      const int64_t pc = act == MlpActivation::swiglu ? 2 * C : C;
      std::vector<float> pre = randn(static_cast<size_t>(R * pc), 41 + static_cast<uint64_t>(act), 2.5f);
      std::vector<float> x(static_cast<size_t>(R * C));
      if (act == MlpActivation::swiglu) be->swiglu_forward(f32(x, {R, C}), f32(pre, {R, pc}), g);
      else be->activation_forward(f32(x, {R, C}), f32(pre, {R, pc}), ungated_activation(act));
      Meta m1, m2;
      m1.s[0] = m2.s[0] = 37.0f;
      m1.amax[0] = m2.amax[0] = 0.5f;
      std::vector<uint8_t> q1(x.size()), t1(x.size()), q2(x.size()), t2(x.size());
      be->fp8_quantize(u8(q1, DType::fp8_e4m3, {R, C}), u8(t1, DType::fp8_e4m3, {C, R}), f32(x, {R, C}), m1.view(recipe));
      be->fp8_quantize_activation(u8(q2, DType::fp8_e4m3, {R, C}), u8(t2, DType::fp8_e4m3, {C, R}), f32(pre, {R, pc}),
                                  act, m2.view(recipe), g);
      CHECK(q1 == q2);
      CHECK(t1 == t2);
      CHECK(m1.amax[0] == m2.amax[0]);
      CHECK(m1.amax[0] > 0.5f);  // the activation's max was recorded
      CHECK(m1.s[0] == m2.s[0]);
      CHECK(m1.si[0] == m2.si[0]);
    }
}

TEST_CASE("fp8 GEMMs equal the float GEMMs on dequantized operands and follow them within FP8 tolerance",
          "[fp8][reference]") {
  auto be = make_reference_backend(2);
  const int64_t M = 24, K = 40, N = 16;
  std::vector<float> x = randn(M * K, 11, 1.0f), w = randn(N * K, 12, 0.05f), dy = randn(M * N, 13, 1e-3f),
                     bias = randn(N, 14, 0.1f);
  std::vector<uint8_t> xq(M * K), xq_t(M * K), wq(N * K), wq_t(N * K), dyq(M * N), dyq_t(M * N);
  // Tensorwise scales (amax -> fp8_max): the cast of each operand uses its full range.
  Meta mx, mw, mdy;
  be->fp8_quantize(u8(xq, DType::fp8_e4m3, {M, K}), u8(xq_t, DType::fp8_e4m3, {K, M}), f32(x, {M, K}),
                   mx.view(Fp8Recipe::tensorwise));
  be->fp8_quantize(u8(wq, DType::fp8_e4m3, {N, K}), u8(wq_t, DType::fp8_e4m3, {K, N}), f32(w, {N, K}),
                   mw.view(Fp8Recipe::tensorwise));
  be->fp8_quantize(u8(dyq, DType::fp8_e5m2, {M, N}), u8(dyq_t, DType::fp8_e5m2, {N, M}), f32(dy, {M, N}),
                   mdy.view(Fp8Recipe::tensorwise));
  CHECK(mx.amax[0] == static_cast<float>(max_abs(x)));
  // Dequantized operands (what the FP8 GEMM multiplies, exactly).
  auto deq = [](const std::vector<uint8_t>& q, DType t, float si) {
    std::vector<float> v(q.size());
    for (size_t i = 0; i < q.size(); ++i) v[i] = fp8_bits_to_float(t, q[i]) * si;
    return v;
  };
  std::vector<float> xd = deq(xq, DType::fp8_e4m3, mx.si[0]), wd = deq(wq, DType::fp8_e4m3, mw.si[0]),
                     dyd = deq(dyq, DType::fp8_e5m2, mdy.si[0]);

  // Forward, with bias and GeLU.
  std::vector<float> y8(M * N), z8(M * N), yf(M * N), zf(M * N), yd(M * N), zd(M * N);
  be->fp8_linear_forward(f32(y8, {M, N}), u8(xq, DType::fp8_e4m3, {M, K}), f32(mx.si, {1}),
                         u8(wq, DType::fp8_e4m3, {N, K}), f32(mw.si, {1}), f32(bias, {N}), Activation::gelu,
                         f32(z8, {M, N}));
  be->linear_forward(f32(yf, {M, N}), f32(x, {M, K}), f32(w, {N, K}), f32(bias, {N}), Activation::gelu, f32(zf, {M, N}));
  be->linear_forward(f32(yd, {M, N}), f32(xd, {M, K}), f32(wd, {N, K}), f32(bias, {N}), Activation::gelu, f32(zd, {M, N}));
  // FP8 tolerance: e4m3 keeps 3 mantissa bits, a relative error of at most 2^-4 per operand; the
  // errors of the K products are independent, so the sum's error is ~ 2 * 2^-4 * |x||w| / sqrt(K)
  // in norm. Checked as a relative Frobenius error (bounded well below 2 * 2^-4).
  auto rel_err = [](const std::vector<float>& a, const std::vector<float>& b) {
    double num = 0, den = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      num += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
      den += static_cast<double>(b[i]) * b[i];
    }
    return std::sqrt(num / den);
  };
  CHECK(rel_err(z8, zf) < 0.06);
  CHECK(rel_err(z8, zf) > 1e-4);  // it did round to FP8
  for (int64_t i = 0; i < M * N; ++i) {
    INFO("element " << i);
    CHECK(z8[i] == Approx(zd[i]).epsilon(1e-6).margin(1e-6));
    CHECK(y8[i] == Approx(yd[i]).epsilon(1e-6).margin(1e-6));
  }

  // Backward input (accumulating) with the activation gradient.
  std::vector<float> pre = randn(M * K, 15, 1.0f);
  std::vector<float> dx8(M * K, 0.5f), dxf(M * K, 0.5f), dxd(M * K, 0.5f);
  be->fp8_linear_backward_input(f32(dx8, {M, K}), u8(dyq, DType::fp8_e5m2, {M, N}), f32(mdy.si, {1}),
                                u8(wq_t, DType::fp8_e4m3, {K, N}), f32(mw.si, {1}), true, Activation::gelu,
                                f32(pre, {M, K}));
  be->linear_backward_input(f32(dxf, {M, K}), f32(dy, {M, N}), f32(w, {N, K}), true, Activation::gelu, f32(pre, {M, K}));
  be->linear_backward_input(f32(dxd, {M, K}), f32(dyd, {M, N}), f32(wd, {N, K}), true, Activation::gelu, f32(pre, {M, K}));
  for (int64_t i = 0; i < M * K; ++i) CHECK(dx8[i] == Approx(dxd[i]).epsilon(1e-6).margin(1e-9));
  std::vector<float> dx8c(M * K), dxfc(M * K);  // without the accumulated 0.5 for the tolerance check
  for (int64_t i = 0; i < M * K; ++i) dx8c[i] = dx8[i] - 0.5f, dxfc[i] = dxf[i] - 0.5f;
  CHECK(rel_err(dx8c, dxfc) < 0.15);  // e5m2: 2 mantissa bits, up to 2^-3 relative per element

  // Backward weight: accumulates into float32 dw, dbias from the unquantized dy.
  std::vector<float> dw8(N * K, 1.0f), dwd(N * K, 1.0f), dwf(N * K, 1.0f), db8(N, 0.0f), dbf(N, 0.0f);
  be->fp8_linear_backward_weight(f32(dw8, {N, K}), f32(db8, {N}), f32(dy, {M, N}), u8(dyq_t, DType::fp8_e5m2, {N, M}),
                                 f32(mdy.si, {1}), u8(xq_t, DType::fp8_e4m3, {K, M}), f32(mx.si, {1}), true);
  be->linear_backward_weight(f32(dwd, {N, K}), Tensor(), f32(dyd, {M, N}), f32(xd, {M, K}), true);
  be->linear_backward_weight(f32(dwf, {N, K}), f32(dbf, {N}), f32(dy, {M, N}), f32(x, {M, K}), true);
  for (int64_t i = 0; i < N * K; ++i) CHECK(dw8[i] == Approx(dwd[i]).epsilon(1e-6));
  for (int64_t i = 0; i < N; ++i) CHECK(db8[i] == Approx(dbf[i]).epsilon(1e-6));
  std::vector<float> dw8c(N * K), dwfc(N * K);
  for (int64_t i = 0; i < N * K; ++i) dw8c[i] = dw8[i] - 1.0f, dwfc[i] = dwf[i] - 1.0f;
  CHECK(rel_err(dw8c, dwfc) < 0.15);

  // Without accumulate both write dw (NaN before: never read): the accumulated sums less the 1.
  std::vector<float> dw8n(N * K, NAN), dwfn(N * K, NAN);
  be->fp8_linear_backward_weight(f32(dw8n, {N, K}), Tensor(), Tensor(), u8(dyq_t, DType::fp8_e5m2, {N, M}),
                                 f32(mdy.si, {1}), u8(xq_t, DType::fp8_e4m3, {K, M}), f32(mx.si, {1}), false);
  be->linear_backward_weight(f32(dwfn, {N, K}), Tensor(), f32(dy, {M, N}), f32(x, {M, K}), false);
  for (int64_t i = 0; i < N * K; ++i) {
    CHECK(dw8n[i] == Approx(dw8c[i]).epsilon(1e-5).margin(1e-6));
    CHECK(dwfn[i] == Approx(dwfc[i]).epsilon(1e-5).margin(1e-6));
  }
}

TEST_CASE("fp8_update_scales: most_recent and max, margin, zero and non-finite amax, history roll",
          "[fp8][reference]") {
  auto be = make_reference_backend(1);
  // Three operands, history of 3 rows [3, 3]: row 0 is the step just finished.
  std::vector<float> hist = {
      4.0f, 0.0f,     INFINITY,  // row 0 (current)
      1.0f, 8.0f,     2.0f,      // row 1 (oldest)
      16.0f, 2.0f,    1.0f,      // row 2
  };
  std::vector<float> scale = {1.0f, 3.0f, 5.0f}, scale_inv = {1.0f, 1.0f / 3.0f, 0.2f}, fmax = {448.0f, 448.0f, 57344.0f};
  Fp8ScaleUpdate p;
  p.algo = Fp8AmaxAlgo::most_recent;
  p.margin = 0;
  std::vector<float> h1 = hist, s1 = scale, si1 = scale_inv;
  be->fp8_update_scales(f32(h1, {3, 3}), f32(s1, {3}), f32(si1, {3}), f32(fmax, {3}), p);
  CHECK(s1[0] == 448.0f / 4.0f);
  CHECK(si1[0] == 1.0f / (448.0f / 4.0f));
  CHECK(s1[1] == 3.0f);  // amax 0: scale kept
  CHECK(si1[1] == 1.0f / 3.0f);
  CHECK(s1[2] == 5.0f);  // amax inf: scale kept
  // Roll: row 0 <- 0, row 1 <- old row 2, row 2 <- old row 0.
  CHECK(h1 == std::vector<float>{0, 0, 0, 16.0f, 2.0f, 1.0f, 4.0f, 0.0f, INFINITY});

  p.algo = Fp8AmaxAlgo::max;
  p.margin = 2;
  std::vector<float> h2 = hist, s2 = scale, si2 = scale_inv;
  be->fp8_update_scales(f32(h2, {3, 3}), f32(s2, {3}), f32(si2, {3}), f32(fmax, {3}), p);
  CHECK(s2[0] == (448.0f / 16.0f) / 4.0f);
  CHECK(s2[1] == (448.0f / 8.0f) / 4.0f);
  CHECK(s2[2] == 5.0f);  // the max over the history is inf: kept
  CHECK(si2[1] == 1.0f / ((448.0f / 8.0f) / 4.0f));

  // History length 1: the update reads row 0 and zeroes it.
  std::vector<float> h3 = {2.0f, 0.5f}, s3 = {1, 1}, si3 = {1, 1}, fm3 = {57344.0f, 448.0f};
  p.margin = 0;
  be->fp8_update_scales(f32(h3, {1, 2}), f32(s3, {2}), f32(si3, {2}), f32(fm3, {2}), p);
  CHECK(s3[0] == 28672.0f);
  CHECK(s3[1] == 896.0f);
  CHECK(h3 == std::vector<float>{0.0f, 0.0f});
}

TEST_CASE("fp8_quantize_with_dbias: fp8_quantize's bytes, and dbias accumulates the column sums", "[fp8][reference]") {
  auto be = make_reference_backend(2);
  const int64_t R = 6, C = 5;
  std::vector<float> dy = randn(static_cast<size_t>(R * C), 77, 1.5f);
  std::vector<uint8_t> q1(dy.size()), t1(dy.size()), q2(dy.size()), t2(dy.size());
  Meta m1, m2;
  m1.s[0] = m2.s[0] = 100.0f;
  std::vector<float> dbias = {1.0f, -2.0f, 0.5f, 0.0f, 3.0f};
  const std::vector<float> before = dbias;
  be->fp8_quantize(u8(q1, DType::fp8_e5m2, {R, C}), u8(t1, DType::fp8_e5m2, {C, R}), f32(dy, {R, C}), m1.view());
  be->fp8_quantize_with_dbias(u8(q2, DType::fp8_e5m2, {R, C}), u8(t2, DType::fp8_e5m2, {C, R}), f32(dy, {R, C}),
                              m2.view(), f32(dbias, {C}));
  CHECK(q1 == q2);
  CHECK(t1 == t2);
  CHECK(m1.amax[0] == m2.amax[0]);
  for (int64_t c = 0; c < C; ++c) {
    double s = 0;
    for (int64_t r = 0; r < R; ++r) s += dy[static_cast<size_t>(r * C + c)];
    CHECK(dbias[static_cast<size_t>(c)] == static_cast<float>(before[static_cast<size_t>(c)] + static_cast<float>(s)));
  }
}

TEST_CASE("fp8_quantize_activation_backward equals the activation's backward, then fp8_quantize_with_dbias",
          "[fp8][reference]") {
  auto be = make_reference_backend(2);
  const int64_t R = 7, F = 9;  // odd sizes; SwiGLU's gradient is [R, 2F]
  for (const Glu g : {Glu{}, Glu{true, 1.0f, 2.0f}})
  for (MlpActivation act : {MlpActivation::gelu, MlpActivation::gelu_tanh, MlpActivation::swiglu, MlpActivation::squared_relu})
    for (Fp8Recipe recipe : {Fp8Recipe::delayed, Fp8Recipe::tensorwise})
      for (bool with_dbias : {false, true}) {
        if (!g.plain() && act != MlpActivation::swiglu) continue;
        INFO("activation " << static_cast<int>(act) << " recipe " << static_cast<int>(recipe) << " dbias " << with_dbias
                           << " quick " << g.quick_gelu);
        const bool swiglu = act == MlpActivation::swiglu;
        const int64_t C = swiglu ? 2 * F : F;  // the gradient's width (= pre's)
        std::vector<float> dout = randn(static_cast<size_t>(R * F), 5, 0.3f), pre = randn(static_cast<size_t>(R * C), 6, 2.0f);
        std::vector<float> d(static_cast<size_t>(R * C));
        if (swiglu) be->swiglu_backward(f32(d, {R, C}), f32(dout, {R, F}), f32(pre, {R, C}), g);
        else be->activation_backward(f32(d, {R, C}), f32(dout, {R, F}), f32(pre, {R, C}), ungated_activation(act));
        Meta m1, m2;
        m1.s[0] = m2.s[0] = 900.0f;
        std::vector<uint8_t> q1(d.size()), t1(d.size()), q2(d.size()), t2(d.size());
        std::vector<float> b1(static_cast<size_t>(C), 0.25f), b2 = b1;
        if (with_dbias)
          be->fp8_quantize_with_dbias(u8(q1, DType::fp8_e5m2, {R, C}), u8(t1, DType::fp8_e5m2, {C, R}), f32(d, {R, C}),
                                      m1.view(recipe), f32(b1, {C}));
        else
          be->fp8_quantize(u8(q1, DType::fp8_e5m2, {R, C}), u8(t1, DType::fp8_e5m2, {C, R}), f32(d, {R, C}), m1.view(recipe));
        be->fp8_quantize_activation_backward(u8(q2, DType::fp8_e5m2, {R, C}), u8(t2, DType::fp8_e5m2, {C, R}),
                                             f32(dout, {R, F}), f32(pre, {R, C}), act, m2.view(recipe),
                                             with_dbias ? f32(b2, {C}) : Tensor(), g);
        CHECK(q1 == q2);
        CHECK(t1 == t2);
        CHECK(b1 == b2);
        CHECK(m1.amax[0] == m2.amax[0]);
        CHECK(m1.s[0] == m2.s[0]);
        if (with_dbias) CHECK(b1 != std::vector<float>(static_cast<size_t>(C), 0.25f));
      }
}
