// CudaBackend's FP8 ops against the reference backend's (engine/backend.h "FP8 linear layers"):
// the same emulated rounding, so quantized bytes, scales and amaxes must agree bit for bit (float32
// scale arithmetic on both sides) and the GEMM results to accumulation-order tolerance.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

#include "cuda/cuda_backend.h"
#include "tests/gpu/gpu_test_util.h"

using namespace mt;
using namespace mt::gputest;

namespace {

// One float32 scalar on both backends.
struct Scalar2 {
  Buf c, r;
};
Scalar2 scalar2(float v) {
  Scalar2 s{Buf(dev(), DType::f32, {1}), Buf(ref(), DType::f32, {1})};
  upload(dev(), s.c.t, {v});
  upload(ref(), s.r.t, {v});
  return s;
}
float value(Backend& be, const Buf& b) { return static_cast<float>(download(be, b.t)[0]); }

// A quantized operand on both backends: q (and q_t) bytes plus its meta.
struct Quant2 {
  Buf qc, qr, tc, tr;
  Scalar2 scale, scale_inv, amax;
};

Quant2 quantize2(const Twin& x, DType e, Fp8Recipe recipe, float scale, bool row_major, bool transposed) {
  const int64_t R = x.cu.t.rows(), C = x.cu.t.cols();
  Quant2 q{Buf(dev(), e, {R, C}), Buf(ref(), e, {R, C}), Buf(dev(), e, {C, R}), Buf(ref(), e, {C, R}),
           scalar2(scale), scalar2(1.0f / scale), scalar2(0.0f)};
  Fp8TensorMeta mc = meta_of(q.scale.c.t, q.scale_inv.c.t, q.amax.c.t, recipe);
  Fp8TensorMeta mr = meta_of(q.scale.r.t, q.scale_inv.r.t, q.amax.r.t, recipe);
  dev().fp8_quantize(row_major ? q.qc.t : Tensor(), transposed ? q.tc.t : Tensor(), x.cu.t, mc);
  ref().fp8_quantize(row_major ? q.qr.t : Tensor(), transposed ? q.tr.t : Tensor(), x.ref.t, mr);
  return q;
}

// A linear layer's operands in dtype dt (x [M, K], w [N, K], dy [M, N]) and their tensorwise casts
// (x and w e4m3, dy e5m2; row-major and transposed).
struct LinearOperands {
  Twin x, w, dy;
  Quant2 xq, wq, dyq;
};
LinearOperands linear_operands(Rng& rng, DType dt, int64_t M, int64_t K, int64_t N) {
  LinearOperands o{twin(dt, {M, K}, rng.normal(M * K, 1.0)), twin(dt, {N, K}, rng.normal(N * K, 0.1)),
                   twin(dt, {M, N}, rng.normal(M * N, 0.01)), {}, {}, {}};
  o.xq = quantize2(o.x, DType::fp8_e4m3, Fp8Recipe::tensorwise, 1.0f, true, true);
  o.wq = quantize2(o.w, DType::fp8_e4m3, Fp8Recipe::tensorwise, 1.0f, true, true);
  o.dyq = quantize2(o.dy, DType::fp8_e5m2, Fp8Recipe::tensorwise, 1.0f, true, true);
  return o;
}

// One cast's outputs (q [R, C], t [C, R] in FP8 dtype e) and scaling state, on ONE backend (the
// scalars exist on both; meta() picks this side's).
struct CastOut {
  Buf q, t;
  Scalar2 scale, scale_inv, amax;
  bool on_dev;
  Fp8TensorMeta meta(Fp8Recipe recipe) const {
    return on_dev ? meta_of(scale.c.t, scale_inv.c.t, amax.c.t, recipe)
                  : meta_of(scale.r.t, scale_inv.r.t, amax.r.t, recipe);
  }
};
CastOut cast_out(Backend& be, DType e, int64_t R, int64_t C, float scale, float amax) {
  return CastOut{Buf(be, e, {R, C}), Buf(be, e, {C, R}), scalar2(scale), scalar2(1.0f / scale), scalar2(amax),
                 &be == &dev()};
}

// The same FP8 bytes [R, C] on both backends: `codes` (every code, NaN and infinity patterns too).
struct Bytes2 {
  Buf c, r;
};
Bytes2 bytes2(DType e, int64_t R, int64_t C, const std::vector<uint8_t>& codes) {
  Bytes2 q{Buf(dev(), e, {R, C}), Buf(ref(), e, {R, C})};
  dev().copy_from_host(q.c.t, codes.data());
  ref().copy_from_host(q.r.t, codes.data());
  dev().synchronize();  // the copy is asynchronous; codes may go out of scope
  return q;
}
std::vector<uint8_t> random_codes(Rng& rng, int64_t n) {
  std::uniform_int_distribution<int> byte(0, 255);
  std::vector<uint8_t> v(static_cast<size_t>(n));
  for (uint8_t& b : v) b = static_cast<uint8_t>(byte(rng.engine()));
  return v;
}

// Elements (of dtype dt) whose bytes differ, any NaN matching any NaN (payloads may differ).
int64_t differing_values(DType dt, const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  const size_t w = dtype_size(dt);
  if (a.size() != b.size()) return static_cast<int64_t>(std::max(a.size(), b.size()) / w);
  const int64_t n = static_cast<int64_t>(a.size() / w);
  const std::vector<double> va = decode(dt, a.data(), n), vb = decode(dt, b.data(), n);
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i)
    if (!(std::isnan(va[i]) && std::isnan(vb[i])) && std::memcmp(&a[i * w], &b[i * w], w) != 0) ++bad;
  return bad;
}

}  // namespace

TEST_CASE("cuda FP8 ops vs reference: quantize (delayed, tensorwise), bit for bit", "[gpu][fp8]") {
  MT_RNG(rng);
  for (Fp8Recipe recipe : {Fp8Recipe::delayed, Fp8Recipe::tensorwise})
    for (DType e : {DType::fp8_e4m3, DType::fp8_e5m2})
      for (auto [R, C] : {std::pair<int64_t, int64_t>{64, 48}, {200, 136}, {33, 70}}) {
        INFO((recipe == Fp8Recipe::delayed ? "delayed " : "tensorwise ") << dtype_name(e) << " " << R << " x " << C);
        Twin x = twin(DType::bf16, {R, C}, rng.normal(R * C, 3.0));
        Quant2 q = quantize2(x, e, recipe, 20.0f, true, true);
        CHECK(differing(download_bytes(dev(), q.qc.t), download_bytes(ref(), q.qr.t), 1) == 0);
        CHECK(differing(download_bytes(dev(), q.tc.t), download_bytes(ref(), q.tr.t), 1) == 0);
        CHECK(value(dev(), q.scale.c) == value(ref(), q.scale.r));
        CHECK(value(dev(), q.scale_inv.c) == value(ref(), q.scale_inv.r));
        CHECK(value(dev(), q.amax.c) == value(ref(), q.amax.r));
      }
}

TEST_CASE("cuda FP8 ops vs reference: linear forward, input and weight gradients", "[gpu][fp8]") {
  MT_RNG(rng);
  const int64_t M = 96, K = 80, N = 112;
  LinearOperands o = linear_operands(rng, DType::bf16, M, K, N);
  const Twin& dy = o.dy;
  Quant2 &xq = o.xq, &wq = o.wq, &dyq = o.dyq;

  for (Activation act : {Activation::none, Activation::gelu, Activation::gelu_tanh})
    for (bool with_bias : {false, true}) {
      INFO("forward act " << static_cast<int>(act) << " bias " << with_bias);
      Twin b = with_bias ? twin(DType::bf16, {N}, rng.normal(N, 0.5)) : absent();
      Twin y = twin_nan(DType::bf16, {M, N});
      Twin pre = act != Activation::none ? twin_nan(DType::bf16, {M, N}) : absent();
      dev().fp8_linear_forward(y.c(), xq.qc.t, xq.scale_inv.c.t, wq.qc.t, wq.scale_inv.c.t, b.c(), act, pre.c());
      ref().fp8_linear_forward(y.r(), xq.qr.t, xq.scale_inv.r.t, wq.qr.t, wq.scale_inv.r.t, b.r(), act, pre.r());
      MT_CHECK_CLOSE(y, tol_for(DType::bf16));
      if (act != Activation::none) MT_CHECK_CLOSE(pre, tol_for(DType::bf16));
    }

  for (Activation act : {Activation::none, Activation::gelu})
    for (bool accumulate : {false, true}) {
      INFO("input gradient act " << static_cast<int>(act) << " accumulate " << accumulate);
      Twin pre = act != Activation::none ? twin(DType::bf16, {M, K}, rng.normal(M * K, 1.0)) : absent();
      Twin dx = accumulate ? twin(DType::bf16, {M, K}, rng.normal(M * K, 0.01)) : twin_nan(DType::bf16, {M, K});
      dev().fp8_linear_backward_input(dx.c(), dyq.qc.t, dyq.scale_inv.c.t, wq.tc.t, wq.scale_inv.c.t, accumulate, act,
                                      pre.c());
      ref().fp8_linear_backward_input(dx.r(), dyq.qr.t, dyq.scale_inv.r.t, wq.tr.t, wq.scale_inv.r.t, accumulate, act,
                                      pre.r());
      MT_CHECK_CLOSE(dx, tol_for(DType::bf16));
    }

  Twin dw = twin(DType::f32, {N, K}, rng.normal(N * K, 1e-3));
  Twin db = twin(DType::f32, {N}, rng.normal(N, 1e-3));
  dev().fp8_linear_backward_weight(dw.c(), db.c(), dy.c(), dyq.tc.t, dyq.scale_inv.c.t, xq.tc.t, xq.scale_inv.c.t, true);
  ref().fp8_linear_backward_weight(dw.r(), db.r(), dy.r(), dyq.tr.t, dyq.scale_inv.r.t, xq.tr.t, xq.scale_inv.r.t, true);
  MT_CHECK_CLOSE(dw, 1e-3);  // FP8 tensor-core accumulation vs exact sums
  MT_CHECK_CLOSE(db, 1e-5);
}

// The grouped cast of the routed experts' rows: one launch for every group (delayed scaling, row
// counts multiples of 8), the same bytes, transposed blocks and amaxes as a cast per group, and as
// the reference's; empty groups and a group count above one launch's (the per-group casts) too.
TEST_CASE("cuda fp8_quantize_groups: one launch, the bytes and amaxes of a cast per group", "[gpu][fp8]") {
  MT_RNG(rng);
  struct Case {
    std::vector<int64_t> rows;  // per group
    int64_t C;
    DType in;
  };
  std::vector<int64_t> many(300, 8);
  many[7] = 0;
  for (const Case& k : {Case{{128, 0, 256, 8, 1024}, 48, DType::bf16}, Case{{16, 16, 0}, 2048, DType::f32},
                        Case{{512, 640}, 136, DType::bf16}, Case{many, 16, DType::bf16}, Case{{24, 33}, 40, DType::bf16}})
    for (DType e : {DType::fp8_e4m3, DType::fp8_e5m2}) {
      const int G = static_cast<int>(k.rows.size());
      std::vector<int64_t> off{0};
      for (int64_t r : k.rows) off.push_back(off.back() + r);
      const int64_t R = off.back(), C = k.C;
      INFO(G << " groups, " << R << " x " << C << " " << dtype_name(k.in) << " -> " << dtype_name(e));
      Twin x = twin(k.in, {R + 3, C}, rng.normal((R + 3) * C, 2.0));
      std::vector<Scalar2> scale, amax_one, amax_groups, amax_ref;
      std::vector<Fp8TensorMeta> one, groups, reference;
      for (int g = 0; g < G; ++g) {
        const float sc = 8.0f + g % 7;
        scale.push_back(scalar2(sc));
        amax_one.push_back(scalar2(0.5f));
        amax_groups.push_back(scalar2(0.5f));
        amax_ref.push_back(scalar2(0.5f));
      }
      Scalar2 inv = scalar2(1.0f);  // (the cast reads the scale only)
      for (int g = 0; g < G; ++g) {
        one.push_back(meta_of(scale[g].c.t, inv.c.t, amax_one[g].c.t, Fp8Recipe::delayed));
        groups.push_back(meta_of(scale[g].c.t, inv.c.t, amax_groups[g].c.t, Fp8Recipe::delayed));
        reference.push_back(meta_of(scale[g].r.t, inv.r.t, amax_ref[g].r.t, Fp8Recipe::delayed));
      }
      Buf q1(dev(), e, {R, C}), t1(dev(), e, {R * C}), qg(dev(), e, {R, C}), tg(dev(), e, {R * C});
      Buf qr(ref(), e, {R, C}), tr(ref(), e, {R * C});
      dev().Backend::fp8_quantize_groups(q1.t, t1.t, x.c(), off, one);  // a cast per group
      dev().fp8_quantize_groups(qg.t, tg.t, x.c(), off, groups);
      ref().fp8_quantize_groups(qr.t, tr.t, x.r(), off, reference);
      CHECK(differing(download_bytes(dev(), qg.t), download_bytes(dev(), q1.t), 1) == 0);
      CHECK(differing(download_bytes(dev(), tg.t), download_bytes(dev(), t1.t), 1) == 0);
      CHECK(differing(download_bytes(dev(), qg.t), download_bytes(ref(), qr.t), 1) == 0);
      CHECK(differing(download_bytes(dev(), tg.t), download_bytes(ref(), tr.t), 1) == 0);
      for (int g = 0; g < G; ++g) {
        INFO("group " << g);
        CHECK(value(dev(), amax_groups[g].c) == value(dev(), amax_one[g].c));
        CHECK(value(dev(), amax_groups[g].c) == value(ref(), amax_ref[g].r));
      }
      // Only q, then only the transposed blocks.
      Buf q2(dev(), e, {R, C}), t2(dev(), e, {R * C});  // (every byte written: the groups cover the rows)
      dev().fp8_quantize_groups(q2.t, Tensor(), x.c(), off, groups);
      dev().fp8_quantize_groups(Tensor(), t2.t, x.c(), off, groups);
      CHECK(differing(download_bytes(dev(), q2.t), download_bytes(dev(), q1.t), 1) == 0);
      CHECK(differing(download_bytes(dev(), t2.t), download_bytes(dev(), t1.t), 1) == 0);
    }
}

// FP8 layers without --bf16 (float32 activations, Transformer Engine's FP8 around float32): the casts
// read float32 (the same bytes, scales and amaxes as the reference), the GEMMs write float32, and the
// activation's fused cast reads float32 pre-activations.
TEST_CASE("cuda FP8 ops vs reference: float32 activations (FP8 without --bf16)", "[gpu][fp8]") {
  MT_RNG(rng);
  for (Fp8Recipe recipe : {Fp8Recipe::delayed, Fp8Recipe::tensorwise})
    for (auto [R, C] : {std::pair<int64_t, int64_t>{64, 48}, {33, 70}}) {
      INFO((recipe == Fp8Recipe::delayed ? "delayed " : "tensorwise ") << R << " x " << C);
      Twin x = twin(DType::f32, {R, C}, rng.normal(R * C, 3.0));
      Quant2 q = quantize2(x, DType::fp8_e4m3, recipe, 20.0f, true, true);
      CHECK(differing(download_bytes(dev(), q.qc.t), download_bytes(ref(), q.qr.t), 1) == 0);
      CHECK(differing(download_bytes(dev(), q.tc.t), download_bytes(ref(), q.tr.t), 1) == 0);
      CHECK(value(dev(), q.amax.c) == value(ref(), q.amax.r));
      CHECK(value(dev(), q.scale.c) == value(ref(), q.scale.r));
    }
  const int64_t M = 96, K = 80, N = 112;
  LinearOperands o = linear_operands(rng, DType::f32, M, K, N);
  Quant2 &xq = o.xq, &wq = o.wq, &dyq = o.dyq;
  for (Activation act : {Activation::none, Activation::gelu}) {
    INFO("forward act " << static_cast<int>(act));
    Twin y = twin_nan(DType::f32, {M, N});
    Twin pre = act != Activation::none ? twin_nan(DType::f32, {M, N}) : absent();
    dev().fp8_linear_forward(y.c(), xq.qc.t, xq.scale_inv.c.t, wq.qc.t, wq.scale_inv.c.t, Tensor(), act, pre.c());
    ref().fp8_linear_forward(y.r(), xq.qr.t, xq.scale_inv.r.t, wq.qr.t, wq.scale_inv.r.t, Tensor(), act, pre.r());
    // (The same FP8 products, float32 outputs: accumulation only, the forward's with Hopper's fast
    // FP8 accumulation.)
    MT_CHECK_CLOSE(y, 2e-3);
    if (act != Activation::none) MT_CHECK_CLOSE(pre, 2e-3);
  }
  for (bool accumulate : {false, true}) {
    INFO("input gradient, accumulate " << accumulate);
    Twin dx = accumulate ? twin(DType::f32, {M, K}, rng.normal(M * K, 0.01)) : twin_nan(DType::f32, {M, K});
    dev().fp8_linear_backward_input(dx.c(), dyq.qc.t, dyq.scale_inv.c.t, wq.tc.t, wq.scale_inv.c.t, accumulate,
                                    Activation::none, Tensor());
    ref().fp8_linear_backward_input(dx.r(), dyq.qr.t, dyq.scale_inv.r.t, wq.tr.t, wq.scale_inv.r.t, accumulate,
                                    Activation::none, Tensor());
    // (Hopper's FP8 tensor-core accumulation is not float32's: 1.0e-4 measured on an H200 for these
    // 112-term sums of exact products.)
    MT_CHECK_CLOSE(dx, 5e-4);
  }
  // The fused casts of SwiGLU's output and of its input gradient from float32.
  const int64_t F = 48;
  Twin pre = twin_same(DType::f32, {M, 2 * F}, rng.normal(M * 2 * F, 2.0));
  auto make = [&](Backend& be) { return cast_out(be, DType::fp8_e4m3, M, F, 24.0f, 0.25f); };
  CastOut fused = make(dev()), reference = make(ref());
  dev().fp8_quantize_activation(fused.q.t, fused.t.t, pre.c(), MlpActivation::swiglu, fused.meta(Fp8Recipe::delayed));
  ref().fp8_quantize_activation(reference.q.t, reference.t.t, pre.r(), MlpActivation::swiglu,
                                reference.meta(Fp8Recipe::delayed));
  CHECK(differing(download_bytes(dev(), fused.q.t), download_bytes(ref(), reference.q.t), 1) <= M * F / 100);
  CHECK(std::fabs(value(dev(), fused.amax.c) - value(ref(), reference.amax.r)) <= 1e-5f * value(ref(), reference.amax.r));
}

TEST_CASE("cuda FP8 ops vs reference: delayed-scaling update, bit for bit", "[gpu][fp8]") {
  const int64_t H = 3, n = 4;
  const std::vector<double> hist = {2, 0, 1e-40, 5, 1, 0, 0, 7, 4, 0, 0, 0.5};
  for (Fp8AmaxAlgo algo : {Fp8AmaxAlgo::max, Fp8AmaxAlgo::most_recent}) {
    Twin h = twin_same(DType::f32, {H, n}, hist);
    Twin s = twin_same(DType::f32, {n}, {1, 2, 3, 4});
    Twin si = twin_same(DType::f32, {n}, {1, 0.5, 1.0 / 3, 0.25});
    Twin fm = twin_same(DType::f32, {n}, {448, 57344, 448, 57344});
    const Fp8ScaleUpdate p{algo, 1};
    dev().fp8_update_scales(h.c(), s.c(), si.c(), fm.c(), p);
    ref().fp8_update_scales(h.r(), s.r(), si.r(), fm.r(), p);
    CHECK(differing(download_bytes(dev(), h.c()), download_bytes(ref(), h.r()), 4) == 0);
    CHECK(differing(download_bytes(dev(), s.c()), download_bytes(ref(), s.r()), 4) == 0);
    CHECK(differing(download_bytes(dev(), si.c()), download_bytes(ref(), si.r()), 4) == 0);
  }
}

// fc2's input cast straight from fc1's output (the FP8 MLP's forward): the same bytes, amax and
// scales as the activation op followed by the plain cast on the GPU, and the reference's (its
// activation in double: a byte may differ where float32 and double round to different bf16).
TEST_CASE("cuda fp8_quantize_activation: the activation op then fp8_quantize, bit for bit", "[gpu][fp8]") {
  MT_RNG(rng);
  for (MlpActivation act : {MlpActivation::gelu, MlpActivation::gelu_tanh, MlpActivation::swiglu, MlpActivation::squared_relu})
    for (Fp8Recipe recipe : {Fp8Recipe::delayed, Fp8Recipe::tensorwise})
      for (auto [R, C] : {std::pair<int64_t, int64_t>{64, 48}, {200, 136}, {33, 70}, {8, 4104}}) {
        INFO("activation " << static_cast<int>(act) << (recipe == Fp8Recipe::delayed ? " delayed " : " tensorwise ") << R
                           << " x " << C);
        const int64_t pc = act == MlpActivation::swiglu ? 2 * C : C;
        Twin pre = twin_same(DType::bf16, {R, pc}, rng.normal(R * pc, 2.0));
        Buf x(dev(), DType::bf16, {R, C});
        if (act == MlpActivation::swiglu) dev().swiglu_forward(x.t, pre.c());
        else dev().activation_forward(x.t, pre.c(), ungated_activation(act));
        auto make = [&](Backend& be) { return cast_out(be, DType::fp8_e4m3, R, C, 24.0f, 0.25f); };
        CastOut two_ops = make(dev()), fused = make(dev()), reference = make(ref());
        dev().fp8_quantize(two_ops.q.t, two_ops.t.t, x.t, two_ops.meta(recipe));
        dev().fp8_quantize_activation(fused.q.t, fused.t.t, pre.c(), act, fused.meta(recipe));
        ref().fp8_quantize_activation(reference.q.t, reference.t.t, pre.r(), act, reference.meta(recipe));
        CHECK(differing(download_bytes(dev(), fused.q.t), download_bytes(dev(), two_ops.q.t), 1) == 0);
        CHECK(differing(download_bytes(dev(), fused.t.t), download_bytes(dev(), two_ops.t.t), 1) == 0);
        CHECK(value(dev(), fused.amax.c) == value(dev(), two_ops.amax.c));
        CHECK(value(dev(), fused.amax.c) > 0.25f);
        CHECK(value(dev(), fused.scale.c) == value(dev(), two_ops.scale.c));
        CHECK(value(dev(), fused.scale_inv.c) == value(dev(), two_ops.scale_inv.c));
        // Against the reference: at most 1% of the bytes, and the transposed copy the same as q.
        const int64_t n = R * C;
        CHECK(differing(download_bytes(dev(), fused.q.t), download_bytes(ref(), reference.q.t), 1) <= n / 100);
        CHECK(differing(download_bytes(dev(), fused.t.t), download_bytes(ref(), reference.t.t), 1) <= n / 100);
        CHECK(std::fabs(value(dev(), fused.amax.c) - value(ref(), reference.amax.r)) <= 1e-2f * value(ref(), reference.amax.r));
      }
}

// ... and with gpt-oss's gated units (quick-GeGLU, with the linear offset and the clamp): forward and
// backward casts the same bytes, amax and scales as the GPU's swiglu_forward / swiglu_backward with
// that unit followed by the plain casts, and the reference's within 1% of the bytes.
TEST_CASE("cuda fp8_quantize_activation(_backward) with gpt-oss's gated unit: the ops then the cast", "[gpu][fp8]") {
  MT_RNG(rng);
  for (const Glu g : {Glu{true, 1.0f, 2.0f}, Glu{true, 0.0f, 0.0f}, Glu{false, 0.5f, 1.5f}})
    for (Fp8Recipe recipe : {Fp8Recipe::delayed, Fp8Recipe::tensorwise})
      for (auto [R, C] : {std::pair<int64_t, int64_t>{64, 48}, {33, 35}, {200, 136}}) {
        INFO("quick " << g.quick_gelu << " offset " << g.offset << " clamp " << g.clamp
                      << (recipe == Fp8Recipe::delayed ? " delayed " : " tensorwise ") << R << " x " << C);
        const int64_t n = R * C;
        Twin pre = twin_same(DType::bf16, {R, 2 * C}, rng.normal(R * 2 * C, 2.0));
        // Forward: fc2's input.
        Buf x(dev(), DType::bf16, {R, C});
        dev().swiglu_forward(x.t, pre.c(), g);
        auto make = [&](Backend& be) { return cast_out(be, DType::fp8_e4m3, R, C, 24.0f, 0.25f); };
        CastOut two_ops = make(dev()), fused = make(dev()), reference = make(ref());
        dev().fp8_quantize(two_ops.q.t, two_ops.t.t, x.t, two_ops.meta(recipe));
        dev().fp8_quantize_activation(fused.q.t, fused.t.t, pre.c(), MlpActivation::swiglu, fused.meta(recipe), g);
        ref().fp8_quantize_activation(reference.q.t, reference.t.t, pre.r(), MlpActivation::swiglu,
                                      reference.meta(recipe), g);
        CHECK(differing(download_bytes(dev(), fused.q.t), download_bytes(dev(), two_ops.q.t), 1) == 0);
        CHECK(differing(download_bytes(dev(), fused.t.t), download_bytes(dev(), two_ops.t.t), 1) == 0);
        CHECK(value(dev(), fused.amax.c) == value(dev(), two_ops.amax.c));
        CHECK(value(dev(), fused.scale.c) == value(dev(), two_ops.scale.c));
        CHECK(differing(download_bytes(dev(), fused.q.t), download_bytes(ref(), reference.q.t), 1) <= n / 100);
        // Backward: fc1's output gradient [R, 2C] from dout [R, C].
        Twin dout = twin_same(DType::bf16, {R, C}, rng.normal(R * C, 0.2));
        Buf d(dev(), DType::bf16, {R, 2 * C});
        dev().swiglu_backward(d.t, dout.c(), pre.c(), g);
        auto make_g = [&](Backend& be) { return cast_out(be, DType::fp8_e5m2, R, 2 * C, 2000.0f, 0.0f); };
        CastOut two_g = make_g(dev()), fused_g = make_g(dev()), ref_g = make_g(ref());
        dev().fp8_quantize(two_g.q.t, two_g.t.t, d.t, two_g.meta(recipe));
        dev().fp8_quantize_activation_backward(fused_g.q.t, fused_g.t.t, dout.c(), pre.c(), MlpActivation::swiglu,
                                               fused_g.meta(recipe), Tensor(), g);
        ref().fp8_quantize_activation_backward(ref_g.q.t, ref_g.t.t, dout.r(), pre.r(), MlpActivation::swiglu,
                                               ref_g.meta(recipe), Tensor(), g);
        CHECK(differing(download_bytes(dev(), fused_g.q.t), download_bytes(dev(), two_g.q.t), 1) == 0);
        CHECK(differing(download_bytes(dev(), fused_g.t.t), download_bytes(dev(), two_g.t.t), 1) == 0);
        CHECK(value(dev(), fused_g.amax.c) == value(dev(), two_g.amax.c));
        CHECK(differing(download_bytes(dev(), fused_g.q.t), download_bytes(ref(), ref_g.q.t), 1) <= 2 * n / 100);
      }
}

// The output gradient's cast with the bias gradient (float32, or bf16 with --grad-reduce-in-bf16) in
// the same pass, twice: the same bytes, amax and scale as fp8_quantize, the bias gradient against the
// reference's, and the same bits on the second run (fixed order). Shapes: odd (no vector path), and
// one tall enough that row tiles go in groups (the last group partial).
namespace {
void check_quantize_with_dbias(DType db_dtype) {
  MT_RNG(rng);
  for (Fp8Recipe recipe : {Fp8Recipe::delayed, Fp8Recipe::tensorwise})
    for (auto [R, C] : {std::pair<int64_t, int64_t>{33, 70}, {200, 136}, {16392, 1032}}) {
      INFO((recipe == Fp8Recipe::delayed ? "delayed " : "tensorwise ") << R << " x " << C);
      Twin dy = twin_same(DType::bf16, {R, C}, rng.normal(R * C, 0.5));
      // (bf16: first values as large as the sums, so that the rounding of old + sums matters)
      const std::vector<double> b0 =
          rng.normal(C, db_dtype == DType::bf16 ? 0.5 * std::sqrt(static_cast<double>(R)) : 1.0);
      Quant2 plain = quantize2(dy, DType::fp8_e5m2, recipe, 300.0f, true, true);
      std::vector<uint8_t> first_bits;
      for (int run = 0; run < 2; ++run) {
        Twin db = twin_same(db_dtype, {C}, b0);
        Quant2 q{Buf(dev(), DType::fp8_e5m2, {R, C}), Buf(ref(), DType::fp8_e5m2, {R, C}), Buf(dev(), DType::fp8_e5m2, {C, R}),
                 Buf(ref(), DType::fp8_e5m2, {C, R}), scalar2(300.0f), scalar2(1.0f / 300.0f), scalar2(0.0f)};
        dev().fp8_quantize_with_dbias(q.qc.t, q.tc.t, dy.c(), meta_of(q.scale.c.t, q.scale_inv.c.t, q.amax.c.t, recipe),
                                      db.c());
        ref().fp8_quantize_with_dbias(q.qr.t, q.tr.t, dy.r(), meta_of(q.scale.r.t, q.scale_inv.r.t, q.amax.r.t, recipe),
                                      db.r());
        CHECK(differing(download_bytes(dev(), q.qc.t), download_bytes(dev(), plain.qc.t), 1) == 0);
        CHECK(differing(download_bytes(dev(), q.tc.t), download_bytes(dev(), plain.tc.t), 1) == 0);
        CHECK(differing(download_bytes(dev(), q.qc.t), download_bytes(ref(), q.qr.t), 1) == 0);
        CHECK(value(dev(), q.amax.c) == value(dev(), plain.amax.c));
        CHECK(value(dev(), q.scale.c) == value(dev(), plain.scale.c));
        // float32: the reference's sums in another order (relative 1e-5); bf16: round_bf16(old + sums).
        if (db_dtype == DType::bf16) check_bf16_grad(db, "dbias");
        else MT_CHECK_CLOSE(db, 1e-5);
        const std::vector<uint8_t> bits = download_bytes(dev(), db.c());
        if (run == 0) first_bits = bits;
        else CHECK(bits == first_bits);
      }
    }
}
}  // namespace

TEST_CASE("cuda fp8_quantize_with_dbias: the cast's bytes and the column sums, deterministic", "[gpu][fp8]") {
  check_quantize_with_dbias(DType::f32);
}

// The cases of fc1's output-gradient cast (fp8_quantize_activation_backward), for each activation,
// recipe and (R, F) (SwiGLU's gradient is [R, 2F]; {33, 70} / {33, 35} take the paths without
// vectors): dout and pre on both backends, d = the GPU's activation backward of them (the two-op
// path's input) and b0, the bias gradient's first values (standard deviation bias_std(R)).
namespace {
struct ActivationBackwardCase {
  MlpActivation act;
  Fp8Recipe recipe;
  int64_t R, C;
  Twin dout, pre;
  Buf d;
  std::vector<double> b0;
  CastOut cast(Backend& be) const { return cast_out(be, DType::fp8_e5m2, R, C, 2000.0f, 0.0f); }
};
template <typename BiasStd, typename Fn>
void for_each_activation_backward_case(Rng& rng, BiasStd bias_std, Fn&& fn) {
  for (MlpActivation act : {MlpActivation::gelu, MlpActivation::gelu_tanh, MlpActivation::swiglu, MlpActivation::squared_relu})
    for (Fp8Recipe recipe : {Fp8Recipe::delayed, Fp8Recipe::tensorwise})
      for (auto [R, F] : {std::pair<int64_t, int64_t>{64, 48}, {33, 70}, {33, 35}, {4104, 1032}}) {
        INFO("activation " << static_cast<int>(act) << (recipe == Fp8Recipe::delayed ? " delayed " : " tensorwise ") << R
                           << " x " << F);
        const int64_t C = act == MlpActivation::swiglu ? 2 * F : F;
        ActivationBackwardCase k{act, recipe, R, C, twin_same(DType::bf16, {R, F}, rng.normal(R * F, 0.2)),
                                 twin_same(DType::bf16, {R, C}, rng.normal(R * C, 2.0)), Buf(dev(), DType::bf16, {R, C}),
                                 {}};
        k.b0 = rng.normal(C, bias_std(R));
        if (act == MlpActivation::swiglu) dev().swiglu_backward(k.d.t, k.dout.c(), k.pre.c());
        else dev().activation_backward(k.d.t, k.dout.c(), k.pre.c(), ungated_activation(act));
        fn(k);
      }
}
}  // namespace

// fc1's output gradient cast straight from fc2's input gradient and fc1's output (the FP8 GeLU
// MLP's backward): the same bytes, scales and bias gradient bits as activation_backward followed by
// fp8_quantize_with_dbias on the GPU, and the reference's within 1% of the bytes.
TEST_CASE("cuda fp8_quantize_activation_backward: the activation's backward then the cast with dbias, bit for bit",
          "[gpu][fp8]") {
  MT_RNG(rng);
  for_each_activation_backward_case(rng, [](int64_t) { return 1.0; }, [](const ActivationBackwardCase& k) {
    const Fp8Recipe recipe = k.recipe;
    CastOut two_ops = k.cast(dev()), fused = k.cast(dev()), reference = k.cast(ref());
    Twin db_two = twin_same(DType::f32, {k.C}, k.b0), db_fused = twin_same(DType::f32, {k.C}, k.b0);
    dev().fp8_quantize_with_dbias(two_ops.q.t, two_ops.t.t, k.d.t, two_ops.meta(recipe), db_two.c());
    dev().fp8_quantize_activation_backward(fused.q.t, fused.t.t, k.dout.c(), k.pre.c(), k.act, fused.meta(recipe),
                                           db_fused.c());
    ref().fp8_quantize_activation_backward(reference.q.t, reference.t.t, k.dout.r(), k.pre.r(), k.act,
                                           reference.meta(recipe), db_fused.r());
    CHECK(differing(download_bytes(dev(), fused.q.t), download_bytes(dev(), two_ops.q.t), 1) == 0);
    CHECK(differing(download_bytes(dev(), fused.t.t), download_bytes(dev(), two_ops.t.t), 1) == 0);
    CHECK(download_bytes(dev(), db_fused.c()) == download_bytes(dev(), db_two.c()));
    CHECK(value(dev(), fused.amax.c) == value(dev(), two_ops.amax.c));
    CHECK(value(dev(), fused.scale.c) == value(dev(), two_ops.scale.c));
    const int64_t n = k.R * k.C;
    CHECK(differing(download_bytes(dev(), fused.q.t), download_bytes(ref(), reference.q.t), 1) <= n / 100);
    CHECK(std::fabs(value(dev(), fused.amax.c) - value(ref(), reference.amax.r)) <= 1e-2f * value(ref(), reference.amax.r));
    // The summands are bf16 values that float32 and double activation math may round one bf16 step
    // apart, so against the reference the bias gradient is within bf16 rounding (on the GPU
    // itself it is bit for bit the two-op path's, above).
    MT_CHECK_CLOSE(db_fused, tol_for(DType::bf16));
  });
}

// --grad-reduce-in-bf16 for the FP8 weight gradient: dw bf16 (the FP8 GEMM with C and D bf16: beta * dw
// + the product in float32, rounded once) and dbias bf16 (column sums of dy). The operands are small
// integers, exact in e4m3/e5m2 with scale 1 (delayed scaling), so both backends' contributions are
// exact and the rounded results agree bit for bit; the generic bf16-gradient check too. Shapes:
// multiples of 16, one with a k (tokens) that is not a multiple of 256.
TEST_CASE("cuda fp8_linear_backward_weight into bf16 gradients matches the reference", "[gpu][fp8][bf16grad]") {
  MT_RNG(rng);
  struct MKN {
    int64_t M, K, N;
  };
  // The last shape on a backend with 2 MiB of scratch: the accumulating form's float32 product in
  // chunks of 256 rows of dw (256, 256, 16).
  CudaBackend small(0, size_t{2} << 20);
  for (MKN g : {MKN{96, 80, 112}, MKN{512, 272, 208}, MKN{4112, 64, 128}, MKN{96, 2048, 528}})
    for (bool accumulate : {true, false}) {
      Backend& be = g.K == 2048 ? static_cast<Backend&>(small) : dev();
      INFO("M " << g.M << " K " << g.K << " N " << g.N << " accumulate " << accumulate
                << (g.K == 2048 ? " (small scratch)" : ""));
      Twin x = twin(DType::bf16, {g.M, g.K}, rng.ints(g.M * g.K, -8, 9));
      Twin dy = twin(DType::bf16, {g.M, g.N}, rng.ints(g.M * g.N, -8, 9));
      Quant2 xq = quantize2(x, DType::fp8_e4m3, Fp8Recipe::delayed, 1.0f, false, true);
      Quant2 dyq = quantize2(dy, DType::fp8_e5m2, Fp8Recipe::delayed, 1.0f, false, true);
      const double scale = 25.0 * std::sqrt(static_cast<double>(g.M));
      const std::vector<double> dw0 =
          accumulate ? rng.normal(g.N * g.K, scale) : std::vector<double>(static_cast<size_t>(g.N * g.K), NAN);
      Twin dw = twin_same(DType::bf16, {g.N, g.K}, dw0);
      Twin db = twin_same(DType::bf16, {g.N}, rng.normal(g.N, scale));
      be.fp8_linear_backward_weight(dw.c(), db.c(), dy.c(), dyq.tc.t, dyq.scale_inv.c.t, xq.tc.t, xq.scale_inv.c.t,
                                    accumulate);
      be.synchronize();
      ref().fp8_linear_backward_weight(dw.r(), db.r(), dy.r(), dyq.tr.t, dyq.scale_inv.r.t, xq.tr.t, xq.scale_inv.r.t,
                                       accumulate);
      check_bf16_grad(dw, "dw");
      check_bf16_grad(db, "dbias");
      CHECK(differing(download_bytes(dev(), dw.c()), download_bytes(ref(), dw.r()), 2) == 0);
      CHECK(differing(download_bytes(dev(), db.c()), download_bytes(ref(), db.r()), 2) == 0);
    }
}

// The same into a bf16 bias gradient (--grad-reduce-in-bf16).
TEST_CASE("cuda fp8_quantize_with_dbias into a bf16 bias gradient", "[gpu][fp8][bf16grad]") {
  check_quantize_with_dbias(DType::bf16);
}

// fc1's output-gradient cast with a bf16 bias gradient: bit for bit the two-op path (the activation's
// backward, then fp8_quantize_with_dbias into bf16) on the GPU; that path against the reference's
// fp8_quantize_with_dbias of the same gradient values; the fused reference within bf16 rounding.
TEST_CASE("cuda fp8_quantize_activation_backward into a bf16 bias gradient", "[gpu][fp8][bf16grad]") {
  MT_RNG(rng);
  const auto bias_std = [](int64_t R) { return 0.1 * std::sqrt(static_cast<double>(R)); };
  for_each_activation_backward_case(rng, bias_std, [](const ActivationBackwardCase& k) {
    const Fp8Recipe recipe = k.recipe;
    CastOut two_ops = k.cast(dev()), fused = k.cast(dev()), reference = k.cast(ref()), ref_two = k.cast(ref());
    Twin db_two = twin_same(DType::bf16, {k.C}, k.b0), db_fused = twin_same(DType::bf16, {k.C}, k.b0);
    dev().fp8_quantize_with_dbias(two_ops.q.t, two_ops.t.t, k.d.t, two_ops.meta(recipe), db_two.c());
    dev().fp8_quantize_activation_backward(fused.q.t, fused.t.t, k.dout.c(), k.pre.c(), k.act, fused.meta(recipe),
                                           db_fused.c());
    CHECK(differing(download_bytes(dev(), fused.q.t), download_bytes(dev(), two_ops.q.t), 1) == 0);
    CHECK(download_bytes(dev(), db_fused.c()) == download_bytes(dev(), db_two.c()));
    // The two-op path's bias gradient against the reference's on the same gradient values.
    Buf d_ref(ref(), DType::bf16, {k.R, k.C});
    upload(ref(), d_ref.t, download(dev(), k.d.t));
    ref().fp8_quantize_with_dbias(ref_two.q.t, ref_two.t.t, d_ref.t, ref_two.meta(recipe), db_two.r());
    check_bf16_grad(db_two, "dbias (gradient values as the GPU stored them)");
    // The reference's fused op: its activation math in double may move a summand one bf16 step.
    ref().fp8_quantize_activation_backward(reference.q.t, reference.t.t, k.dout.r(), k.pre.r(), k.act,
                                           reference.meta(recipe), db_fused.r());
    MT_CHECK_CLOSE(db_fused, tol_for(DType::bf16));
  });
}

// FP8 parameters (--fp8-param-gather): the weight's transposed copy, the bytes as they are. Shapes:
// odd and unaligned ones (the byte kernel), multiples of 4 with partial tiles and the model's (the
// 4-byte kernel), and a view at an odd address (the byte kernel on an otherwise aligned shape).
TEST_CASE("cuda fp8_transpose vs reference: the bytes, both FP8 dtypes, odd shapes", "[gpu][fp8][fp8-param]") {
  MT_RNG(rng);
  for (DType e : {DType::fp8_e4m3, DType::fp8_e5m2})
    for (auto [R, C] : {std::pair<int64_t, int64_t>{1, 1}, {3, 5}, {127, 129}, {64, 64}, {1000, 37}, {4, 8},
                        {200, 136}, {68, 4}, {2048, 8192}}) {
      INFO(dtype_name(e) << " " << R << " x " << C);
      Bytes2 q = bytes2(e, R, C, random_codes(rng, R * C));
      Buf tc(dev(), e, {C, R}), tr(ref(), e, {C, R});
      dev().fp8_transpose(tc.t, q.c.t);
      ref().fp8_transpose(tr.t, q.r.t);
      CHECK(differing(download_bytes(dev(), tc.t), download_bytes(ref(), tr.t), 1) == 0);
    }
  const int64_t R = 64, C = 64;
  Bytes2 q = bytes2(DType::u8, 1, R * C + 1, random_codes(rng, R * C + 1));
  const Tensor qc(static_cast<uint8_t*>(q.c.t.data) + 1, DType::fp8_e4m3, Device::cuda, {R, C});
  const Tensor qr(static_cast<uint8_t*>(q.r.t.data) + 1, DType::fp8_e4m3, q.r.t.device, {R, C});
  Buf tc(dev(), DType::fp8_e4m3, {C, R}), tr(ref(), DType::fp8_e4m3, {C, R});
  dev().fp8_transpose(tc.t, qc);
  ref().fp8_transpose(tr.t, qr);
  CHECK(differing(download_bytes(dev(), tc.t), download_bytes(ref(), tr.t), 1) == 0);
}

// The weight in the compute dtype (or float32, float16): float(q) * scale_inv in float32, rounded
// once; the same bits as the reference, NaN as NaN. Every code in order, random codes at a shape
// without the vector path (33 x 70) and with it, and 512 (e5m2's large codes overflow float16).
TEST_CASE("cuda fp8_dequantize vs reference: bit for bit, every code", "[gpu][fp8][fp8-param]") {
  MT_RNG(rng);
  std::vector<uint8_t> every(256);
  for (int c = 0; c < 256; ++c) every[static_cast<size_t>(c)] = static_cast<uint8_t>(c);
  for (DType e : {DType::fp8_e4m3, DType::fp8_e5m2})
    for (auto [R, C] : {std::pair<int64_t, int64_t>{1, 256}, {33, 70}, {128, 520}}) {
      Bytes2 q = bytes2(e, R, C, R * C == 256 ? every : random_codes(rng, R * C));
      for (DType out : {DType::bf16, DType::f32, DType::f16})
        for (float s : {1.0f, 0.37f, 0x1p-10f, 512.0f}) {
          INFO(dtype_name(e) << " " << R << " x " << C << " to " << dtype_name(out) << ", scale_inv " << s);
          Scalar2 si = scalar2(s);
          // 60000 is no product of a code and these scales: an element left unwritten fails.
          Twin y = twin_same(out, {R, C}, std::vector<double>(static_cast<size_t>(R * C), 60000.0));
          dev().fp8_dequantize(y.c(), q.c.t, si.c.t);
          ref().fp8_dequantize(y.r(), q.r.t, si.r.t);
          CHECK(differing_values(out, download_bytes(dev(), y.c()), download_bytes(ref(), y.r())) == 0);
        }
    }
}

// scale_inv as the engine has it: written on the stream by the delayed-scaling update just before,
// with no synchronization between (the op reads it on the device).
TEST_CASE("cuda fp8_dequantize reads scale_inv on the stream", "[gpu][fp8][fp8-param]") {
  MT_RNG(rng);
  const int64_t R = 96, C = 200;
  Bytes2 q = bytes2(DType::fp8_e4m3, R, C, random_codes(rng, R * C));
  Twin h = twin_same(DType::f32, {1, 1}, {3.0});
  Twin s = twin_same(DType::f32, {1}, {1.0}), si = twin_same(DType::f32, {1}, {1.0});
  Twin fm = twin_same(DType::f32, {1}, {448.0});
  Twin y = twin_same(DType::bf16, {R, C}, std::vector<double>(static_cast<size_t>(R * C), 60000.0));
  dev().fp8_update_scales(h.c(), s.c(), si.c(), fm.c(), {Fp8AmaxAlgo::max, 0});
  dev().fp8_dequantize(y.c(), q.c.t, si.c());
  ref().fp8_update_scales(h.r(), s.r(), si.r(), fm.r(), {Fp8AmaxAlgo::max, 0});
  ref().fp8_dequantize(y.r(), q.r.t, si.r());
  CHECK(download(ref(), si.r())[0] != 1.0);
  CHECK(differing_values(DType::bf16, download_bytes(dev(), y.c()), download_bytes(ref(), y.r())) == 0);
}
