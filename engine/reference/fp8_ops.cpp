// ReferenceBackend: FP8 ops, emulated. Quantization writes real FP8 bits (core/dtype.h's
// conversions: round to nearest even, saturating); the GEMMs decode those bits and sum the exact
// products in double, then apply the two scale_inv factors. This is the oracle for the CUDA FP8
// kernels and lets CI train "in FP8" on a CPU. The scaling arithmetic (amax, scale, history roll)
// is done in float32 exactly as backend.h specifies it, so that the two backends agree bit for bit
// on the scales given the same amaxes.
#include <algorithm>
#include <array>
#include <cfloat>
#include <cmath>
#include <vector>

#include "engine/reference/activation_math.h"
#include "engine/reference/norm_math.h"
#include "engine/reference/reference_backend.h"
#include "engine/reference/tensor_access.h"

namespace mt::reference {
namespace {

// The 256 values of an FP8 format, for decoding in the GEMM loops.
const std::array<float, 256>& decode_table(DType t) {
  auto make = [](DType e) {
    std::array<float, 256> v{};
    for (int b = 0; b < 256; ++b) v[static_cast<size_t>(b)] = fp8_bits_to_float(e, static_cast<uint8_t>(b));
    return v;
  };
  static const std::array<float, 256> e4 = make(DType::fp8_e4m3), e5 = make(DType::fp8_e5m2);
  MT_CHECK(is_fp8(t), "FP8 op on a {} tensor", dtype_name(t));
  return t == DType::fp8_e4m3 ? e4 : e5;
}

float read_scalar(const Tensor& t, const char* op, const char* what) {
  MT_CHECK(!t.empty() && t.dtype == DType::f32 && t.numel() >= 1, "{}: {} must be a float32 [1] tensor", op, what);
  return *t.ptr<float>();
}

// scale = (fp8_max / amax) / 2^margin in float32; infinite (amax tiny) -> FLT_MAX.
float scale_from_amax(float fmax, float amax, int margin) {
  float s = (fmax / amax) / std::ldexp(1.0f, margin);
  if (std::isinf(s)) s = FLT_MAX;
  return s;
}

// out(r, c) for r < R, c < C: sum_k a[r, k] * b[c, k] (both row-major FP8, K contiguous), exact in
// double, times scale. f(r, c, value) stores it.
template <typename F>
void fp8_gemm_tn(ThreadPool& pool, const Tensor& a, const Tensor& b, double scale, F&& f) {
  const int64_t R = a.rows(), K = a.cols(), C = b.rows();
  MT_CHECK(b.cols() == K, "FP8 GEMM: operands {} and {} disagree on K", a.shape_string(), b.shape_string());
  const std::array<float, 256>& da = decode_table(a.dtype);
  const std::array<float, 256>& db = decode_table(b.dtype);
  const uint8_t* pa = static_cast<const uint8_t*>(a.data);
  const uint8_t* pb = static_cast<const uint8_t*>(b.data);
  pool.parallel_for(R, 1, [&](int64_t rb, int64_t re, int) {
    for (int64_t r = rb; r < re; ++r) {
      const uint8_t* ar = pa + r * K;
      for (int64_t c = 0; c < C; ++c) {
        const uint8_t* bc = pb + c * K;
        double s = 0;
        for (int64_t k = 0; k < K; ++k) s += static_cast<double>(da[ar[k]]) * db[bc[k]];
        f(r, c, s * scale);
      }
    }
  });
}

// Tensorwise scaling's amax slot (backend.h, Fp8TensorMeta::fresh). The reference computes max|x|
// itself (a) either way; it checks what the slot says against it, so that a CPU run proves the
// engine's pairing of producers and casts: with fresh_taken the producer's amax must be a, bit for
// bit, and without it the slot must be zero (a producer wrote into a slot no cast was told about).
// Then the slot is zeroed, as the CUDA cast does. Returns whether the producer's amax was used.
bool take_fresh_amax(const Fp8TensorMeta& meta, float a, const char* op) {
  MT_CHECK(!meta.fresh_taken || !meta.fresh.empty(), "{}: fresh_taken without a fresh amax slot", op);
  if (meta.fresh.empty()) return false;
  MT_CHECK(meta.recipe == Fp8Recipe::tensorwise, "{}: a fresh amax slot outside tensorwise scaling", op);
  read_scalar(meta.fresh, op, "meta.fresh");  // (checks its type and size)
  float* slot = meta.fresh.ptr<float>();
  if (meta.fresh_taken)
    MT_CHECK(*slot == a || (std::isnan(*slot) && std::isnan(a)),
             "{}: the amax the producing op took ({}) is not max |x| of the tensor cast ({}): the engine paired a "
             "producer with the wrong cast",
             op, *slot, a);
  else
    MT_CHECK(*slot == 0.0f, "{}: the fresh amax slot holds {} though no producer was paired with this cast", op, *slot);
  *slot = 0.0f;
  return meta.fresh_taken;
}

// fp8_quantize of an R x C tensor whose element i is x(i) (a float in the tensor's dtype).
template <typename X>
void quantize_values(ThreadPool& pool, int64_t& amaxes_taken, Tensor q, Tensor q_t, int64_t R, int64_t C, X&& x,
                     const Fp8TensorMeta& meta, const char* op) {
  MT_CHECK(!q.empty() || !q_t.empty(), "{}: neither q nor q_t given", op);
  const DType e = !q.empty() ? q.dtype : q_t.dtype;
  MT_CHECK(is_fp8(e) && (q.empty() || q_t.empty() || q.dtype == q_t.dtype), "{}: q {} / q_t {}", op,
           q.empty() ? "-" : dtype_name(q.dtype), q_t.empty() ? "-" : dtype_name(q_t.dtype));
  if (!q.empty()) MT_CHECK(q.rows() == R && q.cols() == C, "{}: q {} for x [{}, {}]", op, q.shape_string(), R, C);
  if (!q_t.empty())
    MT_CHECK(q_t.rows() == C && q_t.cols() == R, "{}: q_t {} for x [{}, {}]", op, q_t.shape_string(), R, C);
  // max |x| over this tensor (NaN is not a maximum: comparisons with it are false).
  float a = 0.0f;
  for (int64_t i = 0; i < R * C; ++i) a = std::max(a, std::fabs(x(i)));
  amaxes_taken += take_fresh_amax(meta, a, op) ? 1 : 0;
  float* amax = meta.amax.empty() ? nullptr : meta.amax.ptr<float>();
  if (amax) *amax = std::max(*amax, a);
  float scale = read_scalar(meta.scale, op, "meta.scale");
  if (meta.recipe == Fp8Recipe::tensorwise && a > 0.0f && std::isfinite(a)) {
    scale = scale_from_amax(fp8_max(e), a, meta.margin);
    *meta.scale.ptr<float>() = scale;
    *meta.scale_inv.ptr<float>() = 1.0f / scale;
  }
  if (!meta.scale_inv_copy.empty()) {
    MT_CHECK(meta.recipe == Fp8Recipe::tensorwise, "{}: a scale_inv copy outside tensorwise scaling", op);
    *meta.scale_inv_copy.ptr<float>() = read_scalar(meta.scale_inv, op, "meta.scale_inv");
  }
  uint8_t* pq = q.empty() ? nullptr : static_cast<uint8_t*>(q.data);
  uint8_t* pt = q_t.empty() ? nullptr : static_cast<uint8_t*>(q_t.data);
  pool.parallel_for(R, 16, [&](int64_t rb, int64_t re, int) {
    for (int64_t r = rb; r < re; ++r)
      for (int64_t c = 0; c < C; ++c) {
        const uint8_t b = float_to_fp8_bits(e, x(r * C + c) * scale);
        if (pq) pq[r * C + c] = b;
        if (pt) pt[c * R + r] = b;
      }
  });
}

// dbias[N] += column sums of the M x N values dy(i) (in double, one rounding per column).
template <typename Dy>
void add_column_sums_of(Tensor dbias, int64_t M, int64_t N, Dy&& dy, const char* op) {
  check_grad_accumulator(dbias, op, "dbias");
  check_numel(dbias, N, op, "dbias");
  const Floats fdb(dbias);
  for (int64_t n = 0; n < N; ++n) {
    double b = 0;
    for (int64_t m = 0; m < M; ++m) b += dy(m * N + n);
    fdb.add(n, b);
  }
}

void add_column_sums(Tensor dbias, Tensor dy, const char* op) {
  const Floats fdy(dy);
  add_column_sums_of(dbias, dy.rows(), dy.cols(), [&](int64_t i) { return fdy.get(i); }, op);
}

// v rounded to dtype t, as a float (what an op writing a t tensor stores).
float round_to(DType t, double v) {
  switch (t) {
    case DType::bf16: return bf16_bits_to_float(float_to_bf16_bits(static_cast<float>(v)));
    case DType::f16: return f16_bits_to_float(float_to_f16_bits(static_cast<float>(v)));
    default: return static_cast<float>(v);  // float32 (float64 inputs quantize from their float32 value)
  }
}

}  // namespace

void ReferenceBackend::fp8_quantize(Tensor q, Tensor q_t, Tensor x, const Fp8TensorMeta& meta) {
  const Floats fx(x);
  quantize_values(pool_, fp8_amaxes_taken_, q, q_t, x.rows(), x.cols(),
                  [&](int64_t i) { return static_cast<float>(fx.get(i)); }, meta, "fp8_quantize");
}

void ReferenceBackend::fp8_quantize_with_dbias(Tensor q, Tensor q_t, Tensor dy, const Fp8TensorMeta& meta,
                                               Tensor dbias) {
  fp8_quantize(q, q_t, dy, meta);
  add_column_sums(dbias, dy, "fp8_quantize_with_dbias");
}

// d = the activation's input gradient exactly as activation_backward / swiglu_backward compute it
// (double math, one rounding to pre's dtype).
void ReferenceBackend::fp8_quantize_activation_backward(Tensor q, Tensor q_t, Tensor dout, Tensor pre,
                                                        MlpActivation act, const Fp8TensorMeta& meta, Tensor dbias,
                                                        const Glu& glu) {
  const char* op = "fp8_quantize_activation_backward";
  const Floats fd(dout), fp(pre);
  const int64_t R = dout.rows();
  if (act == MlpActivation::swiglu) {
    const int64_t f = dout.cols();
    check_numel(pre, 2 * dout.numel(), op, "pre");
    const auto d = [&](int64_t i) {  // element (r, c) of [dgate | dup], [R, 2f]
      const int64_t r = i / (2 * f), c = i % (2 * f), j = c < f ? c : c - f;
      const double g = fp.get(r * 2 * f + j), u = fp.get(r * 2 * f + f + j), dy = fd.get(r * f + j);
      if (!glu.plain()) {
        const GluEval v = glu_eval(glu, g, u);
        return round_to(pre.dtype, dy * (c < f ? v.dgate : v.dup) + 0.0);  // (+0 where clamped, as swiglu_backward)
      }
      const double s = sigmoid(g);
      return round_to(pre.dtype, c < f ? dy * u * s * (1.0 + g * (1.0 - s)) : dy * g * s);
    };
    quantize_values(pool_, fp8_amaxes_taken_, q, q_t, R, 2 * f, d, meta, op);
    if (!dbias.empty()) add_column_sums_of(dbias, R, 2 * f, d, op);
    return;
  }
  check_numel(pre, dout.numel(), op, "pre");
  const Activation a = ungated_activation(act);
  const auto d = [&](int64_t i) { return round_to(pre.dtype, fd.get(i) * activation_grad(a, fp.get(i))); };
  quantize_values(pool_, fp8_amaxes_taken_, q, q_t, R, dout.cols(), d, meta, op);
  if (!dbias.empty()) add_column_sums_of(dbias, R, dout.cols(), d, op);
}

// The activations exactly as activation_forward / swiglu_forward compute them (double math, one
// rounding to pre's dtype).
void ReferenceBackend::fp8_quantize_activation(Tensor q, Tensor q_t, Tensor pre, MlpActivation act,
                                               const Fp8TensorMeta& meta, const Glu& glu) {
  const char* op = "fp8_quantize_activation";
  const Floats fp(pre);
  const int64_t R = pre.rows();
  if (act == MlpActivation::swiglu) {
    MT_CHECK(pre.cols() % 2 == 0, "{}: odd SwiGLU input width {}", op, pre.cols());
    const int64_t f = pre.cols() / 2;
    quantize_values(pool_, fp8_amaxes_taken_, q, q_t, R, f, [&](int64_t i) {
      const int64_t r = i / f, c = i % f;
      const double g = fp.get(r * 2 * f + c), u = fp.get(r * 2 * f + f + c);
      return round_to(pre.dtype, glu.plain() ? g * sigmoid(g) * u : glu_eval(glu, g, u).y);
    }, meta, op);
  } else {
    const Activation a = ungated_activation(act);
    quantize_values(pool_, fp8_amaxes_taken_, q, q_t, R, pre.cols(),
                    [&](int64_t i) { return round_to(pre.dtype, activate(a, fp.get(i))); }, meta, op);
  }
}

// The norm's output exactly as norm_forward computes it (the row statistics again from x, in
// double: the values norm_forward wrote, whatever precision mean and rstd were stored in).
void ReferenceBackend::fp8_quantize_norm(Tensor q, Tensor q_t, Tensor x, Tensor mean, Tensor rstd, Tensor weight,
                                         Tensor bias, const NormParams& p, const Fp8TensorMeta& meta) {
  const char* op = "fp8_quantize_norm";
  const int64_t R = x.rows(), C = x.cols();
  check_numel(rstd, R, op, "rstd");
  if (!mean.empty()) check_numel(mean, R, op, "mean");
  check_numel(weight, C, op, "weight");
  if (!bias.empty()) check_numel(bias, C, op, "bias");
  check_same_dtype(x, weight, op);
  check_same_dtype(x, bias, op);
  dispatch_float(x, op, [&](auto tag) {
    using T = decltype(tag);
    const T* px = x.ptr<T>();
    const T* w = weight.ptr<T>();
    const T* b = bias.empty() ? nullptr : bias.ptr<T>();
    std::vector<RowStats> stats(static_cast<size_t>(R));
    pool_.parallel_for(R, 8, [&](int64_t rb, int64_t re, int) {
      for (int64_t r = rb; r < re; ++r) stats[static_cast<size_t>(r)] = norm_row_stats(px + r * C, C, p);
    });
    quantize_values(pool_, fp8_amaxes_taken_, q, q_t, R, C, [&](int64_t i) {
      const int64_t r = i / C;
      return static_cast<float>(norm_row_value(px + r * C, i % C, stats[static_cast<size_t>(r)], w, b, p));
    }, meta, op);
  });
}

void ReferenceBackend::fp8_linear_forward(Tensor y, Tensor xq, Tensor x_scale_inv, Tensor wq, Tensor w_scale_inv,
                                          Tensor bias, Activation act, Tensor pre_act) {
  const char* op = "fp8_linear_forward";
  const int64_t M = xq.rows(), N = wq.rows();
  check_numel(y, M * N, op, "y");
  if (!bias.empty()) check_numel(bias, N, op, "bias");
  if (act != Activation::none) check_numel(pre_act, M * N, op, "pre_act");
  const double s = static_cast<double>(read_scalar(x_scale_inv, op, "x_scale_inv")) * read_scalar(w_scale_inv, op, "w_scale_inv");
  const Floats fy(y), fb(bias), fz(pre_act);
  fp8_gemm_tn(pool_, xq, wq, s, [&](int64_t m, int64_t n, double v) {
    // float32 accumulation on the GPU: round the sum to float, then the epilogue in float32.
    float z = static_cast<float>(v);
    if (!fb.empty()) z += static_cast<float>(fb.get(n));
    const int64_t o = m * N + n;
    if (act != Activation::none) {
      fz.set(o, z);
      fy.set(o, activate(act, fz.get(o)));
    } else {
      fy.set(o, z);
    }
  });
}

void ReferenceBackend::fp8_linear_backward_input(Tensor dx, Tensor dyq, Tensor dy_scale_inv, Tensor wq_t,
                                                 Tensor w_scale_inv, bool accumulate, Activation act, Tensor pre_act) {
  const char* op = "fp8_linear_backward_input";
  const int64_t M = dyq.rows(), K = wq_t.rows();
  check_numel(dx, M * K, op, "dx");
  if (act != Activation::none) check_numel(pre_act, M * K, op, "pre_act");
  const double s = static_cast<double>(read_scalar(dy_scale_inv, op, "dy_scale_inv")) * read_scalar(w_scale_inv, op, "w_scale_inv");
  const Floats fdx(dx), fz(pre_act);
  fp8_gemm_tn(pool_, dyq, wq_t, s, [&](int64_t m, int64_t k, double v) {
    const int64_t o = m * K + k;
    double g = static_cast<float>(v);
    if (act != Activation::none) g *= activation_grad(act, fz.get(o));
    fdx.set(o, accumulate ? fdx.get(o) + g : g);
  });
}

void ReferenceBackend::fp8_linear_backward_weight(Tensor dw, Tensor dbias, Tensor dy, Tensor dyq_t, Tensor dy_scale_inv,
                                                  Tensor xq_t, Tensor x_scale_inv, bool accumulate) {
  const char* op = "fp8_linear_backward_weight";
  const int64_t N = dyq_t.rows(), K = xq_t.rows();
  check_numel(dw, N * K, op, "dw");
  check_grad_accumulator(dw, op, "dw");
  check_grad_accumulator(dbias, op, "dbias");
  const double s = static_cast<double>(read_scalar(dy_scale_inv, op, "dy_scale_inv")) * read_scalar(x_scale_inv, op, "x_scale_inv");
  const Floats fdw(dw);
  fp8_gemm_tn(pool_, dyq_t, xq_t, s, [&](int64_t n, int64_t k, double v) {
    if (accumulate) fdw.add(n * K + k, static_cast<float>(v));
    else fdw.set(n * K + k, static_cast<float>(v));
  });
  if (dbias.empty()) return;
  check_numel(dy, dyq_t.cols() * N, op, "dy");
  add_column_sums(dbias, dy.view({dyq_t.cols(), N}), op);
}

void ReferenceBackend::fp8_update_scales(Tensor history, Tensor scale, Tensor scale_inv, Tensor fp8_max_t,
                                         const Fp8ScaleUpdate& p) {
  const int64_t H = history.rows(), n = history.cols();
  for (const Tensor* t : {&history, &scale, &scale_inv, &fp8_max_t})
    MT_CHECK(t->dtype == DType::f32, "fp8_update_scales: float32 tensors only");
  check_numel(scale, n, "fp8_update_scales", "scale");
  check_numel(scale_inv, n, "fp8_update_scales", "scale_inv");
  check_numel(fp8_max_t, n, "fp8_update_scales", "fp8_max");
  float* h = history.ptr<float>();
  float* sc = scale.ptr<float>();
  float* si = scale_inv.ptr<float>();
  const float* fm = fp8_max_t.ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    float a = h[i];
    if (p.algo == Fp8AmaxAlgo::max)
      for (int64_t j = 1; j < H; ++j) a = std::max(a, h[j * n + i]);
    if (a > 0.0f && std::isfinite(a)) {
      sc[i] = scale_from_amax(fm[i], a, p.margin);
      si[i] = 1.0f / sc[i];
    }
    const float first = h[i];
    for (int64_t j = 0; j + 1 < H; ++j) h[j * n + i] = h[(j + 1) * n + i];
    h[(H - 1) * n + i] = first;
    h[i] = 0.0f;
  }
}

void ReferenceBackend::fp8_transpose(Tensor q_t, Tensor q) {
  MT_CHECK(is_fp8(q.dtype) && q_t.dtype == q.dtype, "fp8_transpose: q {} and q_t {} must be one FP8 dtype",
           dtype_name(q.dtype), dtype_name(q_t.dtype));
  const int64_t R = q.rows(), C = q.cols();
  MT_CHECK(q_t.rows() == C && q_t.cols() == R, "fp8_transpose: q_t {} for q {}", q_t.shape_string(), q.shape_string());
  const uint8_t* src = static_cast<const uint8_t*>(q.data);
  uint8_t* dst = static_cast<uint8_t*>(q_t.data);
  pool_.parallel_for(C, 1, [&](int64_t cb, int64_t ce, int) {
    for (int64_t c = cb; c < ce; ++c)
      for (int64_t r = 0; r < R; ++r) dst[c * R + r] = src[r * C + c];
  });
}

void ReferenceBackend::fp8_dequantize(Tensor out, Tensor q, Tensor scale_inv) {
  const char* op = "fp8_dequantize";
  MT_CHECK(is_fp8(q.dtype), "{}: q must be an FP8 tensor, got {}", op, dtype_name(q.dtype));
  check_numel(out, q.numel(), op, "out");
  const float s = read_scalar(scale_inv, op, "scale_inv");
  const std::array<float, 256>& d = decode_table(q.dtype);
  const uint8_t* src = static_cast<const uint8_t*>(q.data);
  const Floats o(out);
  pool_.parallel_for(q.numel(), 4096, [&](int64_t b, int64_t e, int) {
    for (int64_t i = b; i < e; ++i) o.set(i, d[src[i]] * s);  // float32 product, one rounding
  });
}

}  // namespace mt::reference
