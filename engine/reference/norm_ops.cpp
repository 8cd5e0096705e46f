// ReferenceBackend: LayerNorm / RMSNorm forward and backward, plain and fused with the residual
// add, and the per-head norm of --qk-layernorm.
#include <cmath>
#include <vector>

#include "engine/dropout_mask.h"
#include "engine/reference/norm_math.h"
#include "engine/reference/reference_backend.h"
#include "engine/reference/tensor_access.h"

namespace mt::reference {

namespace {

// Normalizes one row of C values: out = norm(x) * w (+ b) (out null: the statistics only); with
// amax, *amax = max |out| over the row (the values as stored, whether or not out is given).
template <typename T>
RowStats norm_row(const T* x, T* out, int64_t C, const T* w, const T* b, const NormParams& p, float* amax) {
  const RowStats s = norm_row_stats(x, C, p);
  if (!out && !amax) return s;
  float m = 0.0f;
  for (int64_t c = 0; c < C; ++c) {
    const T v = norm_row_value(x, c, s, w, b, p);
    if (out) out[c] = v;
    m = std::fmax(m, std::fabs(static_cast<float>(v)));  // (fmax: NaN is not a maximum)
  }
  if (amax) *amax = m;
  return s;
}

// *amax = max(*amax, the rows' maxima) (amax: an optional float32 [1]).
void max_into(Tensor amax, const std::vector<float>& row_max, const char* op) {
  if (amax.empty()) return;
  MT_CHECK(amax.dtype == DType::f32 && amax.numel() == 1, "{}: the amax must be a float32 [1] tensor, got {} {}", op,
           dtype_name(amax.dtype), amax.shape_string());
  float m = *amax.ptr<float>();
  for (float v : row_max) m = std::fmax(m, v);
  *amax.ptr<float>() = m;
}

// Input gradient of one row: dx = d norm / dx . dout (+ dres). dx may alias dout or dres.
template <typename T>
void norm_row_backward(T* dx, const T* dout, const T* x, double mean, double rstd, const T* w, const T* dres,
                       int64_t C, const NormParams& p) {
  const bool ln = p.kind == Normalization::layernorm;
  double sum_g = 0, sum_gx = 0;
  for (int64_t c = 0; c < C; ++c) {
    const double wc = (w ? static_cast<double>(w[c]) : 1.0) + (p.one_p ? 1.0 : 0.0);
    const double g = dout[c] * wc;
    const double xhat = (x[c] - (ln ? mean : 0.0)) * rstd;
    sum_g += g;
    sum_gx += g * xhat;
  }
  const double mean_g = ln ? sum_g / C : 0.0, mean_gx = sum_gx / C;
  for (int64_t c = 0; c < C; ++c) {
    const double wc = (w ? static_cast<double>(w[c]) : 1.0) + (p.one_p ? 1.0 : 0.0);
    const double g = dout[c] * wc;
    const double xhat = (x[c] - (ln ? mean : 0.0)) * rstd;
    double v = rstd * (g - mean_g - xhat * mean_gx);
    if (dres) v += dres[c];
    dx[c] = static_cast<T>(v);
  }
}

}  // namespace

void ReferenceBackend::norm_forward(Tensor out, Tensor mean, Tensor rstd, Tensor x, Tensor weight, Tensor bias,
                                    const NormParams& p, Tensor out_amax) {
  const int64_t R = x.rows(), C = x.cols();
  if (!out.empty()) check_numel(out, R * C, "norm_forward", "out");
  check_numel(weight, C, "norm_forward", "weight");
  if (!bias.empty()) check_numel(bias, C, "norm_forward", "bias");
  check_numel(rstd, R, "norm_forward", "rstd");
  if (!mean.empty()) check_numel(mean, R, "norm_forward", "mean");
  check_same_dtype(x, out, "norm_forward");
  check_same_dtype(x, weight, "norm_forward");
  check_same_dtype(x, bias, "norm_forward");
  check_float_accumulator(mean, "norm_forward", "mean");
  check_float_accumulator(rstd, "norm_forward", "rstd");
  const Floats fm(mean), fr(rstd);
  std::vector<float> row_max(out_amax.empty() ? 0 : static_cast<size_t>(R));
  dispatch_float(x, "norm_forward", [&](auto tag) {
    using T = decltype(tag);
    const T* w = weight.ptr<T>();
    const T* b = bias.empty() ? nullptr : bias.ptr<T>();
    pool_.parallel_for(R, 8, [&](int64_t rb, int64_t re, int) {
      for (int64_t r = rb; r < re; ++r) {
        const RowStats s = norm_row(x.ptr<T>() + r * C, out.empty() ? nullptr : out.ptr<T>() + r * C, C, w, b, p,
                                    row_max.empty() ? nullptr : &row_max[static_cast<size_t>(r)]);
        if (!fm.empty()) fm.set(r, s.mean);  // RMSNorm: 0 (as the CUDA backend writes)
        fr.set(r, s.rstd);
      }
    });
  });
  max_into(out_amax, row_max, "norm_forward");
}

void ReferenceBackend::add_norm_forward(Tensor sum, Tensor out, Tensor mean, Tensor rstd, Tensor a, Tensor b,
                                        float dropout_p, uint64_t dropout_key, Tensor weight, Tensor bias,
                                        const NormParams& p) {
  const int64_t R = a.rows(), C = a.cols();
  check_numel(b, R * C, "add_norm_forward", "b");
  check_numel(sum, R * C, "add_norm_forward", "sum");
  check_same_dtype(a, b, "add_norm_forward");
  check_same_dtype(a, sum, "add_norm_forward");
  dispatch_float(a, "add_norm_forward", [&](auto tag) {
    using T = decltype(tag);
    const T* pa = a.ptr<T>();
    const T* pb = b.ptr<T>();
    T* ps = sum.ptr<T>();
    const T scale = dropout_p > 0 ? T(1) / (T(1) - static_cast<T>(dropout_p)) : T(1);
    pool_.parallel_for(R * C, 1 << 13, [&](int64_t s, int64_t e, int) {
      for (int64_t i = s; i < e; ++i) {
        T v = pb[i];
        if (dropout_p > 0) v = dropout_keep(dropout_key, static_cast<uint64_t>(i), dropout_p) ? v * scale : T(0);
        ps[i] = pa[i] + v;
      }
    });
  });
  norm_forward(out, mean, rstd, sum, weight, bias, p);
}

void ReferenceBackend::norm_backward(Tensor dx, Tensor dweight, Tensor dbias, Tensor dout, Tensor x, Tensor mean,
                                     Tensor rstd, Tensor weight, Tensor dresidual, Tensor dx_colsum, const NormParams& p,
                                     Tensor dx_amax) {
  const int64_t R = x.rows(), C = x.cols();
  const bool ln = p.kind == Normalization::layernorm;
  check_numel(dx, R * C, "norm_backward", "dx");
  check_numel(dout, R * C, "norm_backward", "dout");
  check_numel(weight, C, "norm_backward", "weight");
  check_numel(rstd, R, "norm_backward", "rstd");
  if (ln) check_numel(mean, R, "norm_backward", "mean");
  if (!dresidual.empty()) check_numel(dresidual, R * C, "norm_backward", "dresidual");
  if (!dweight.empty()) check_numel(dweight, C, "norm_backward", "dweight");
  if (!dbias.empty()) check_numel(dbias, C, "norm_backward", "dbias");
  check_same_dtype(x, dx, "norm_backward");
  check_same_dtype(x, dout, "norm_backward");
  check_same_dtype(x, weight, "norm_backward");
  check_same_dtype(x, dresidual, "norm_backward");
  check_grad_accumulator(dweight, "norm_backward", "dweight");
  check_grad_accumulator(dbias, "norm_backward", "dbias");
  check_grad_accumulator(dx_colsum, "norm_backward", "dx_colsum");
  if (!dx_colsum.empty()) check_numel(dx_colsum, C, "norm_backward", "dx_colsum");
  const Floats fm(mean), fr(rstd), fdw(dweight), fdb(dbias);
  dispatch_float(x, "norm_backward", [&](auto tag) {
    using T = decltype(tag);
    // Parameter gradients first: dx may overwrite dout. Columns are split over threads; each
    // column sums its rows in order (deterministic).
    if (!fdw.empty() || !fdb.empty()) {
      pool_.parallel_for(C, 64, [&](int64_t cb, int64_t ce, int thread) {
        const int64_t w = ce - cb;
        double* acc_w = scratch(thread, static_cast<size_t>(2 * w));
        double* acc_b = acc_w + w;
        std::fill(acc_w, acc_w + 2 * w, 0.0);
        for (int64_t r = 0; r < R; ++r) {
          const T* xr = x.ptr<T>() + r * C;
          const T* dy = dout.ptr<T>() + r * C;
          const double m = ln ? fm.get(r) : 0.0, rs = fr.get(r);
          for (int64_t c = cb; c < ce; ++c) {
            acc_w[c - cb] += static_cast<double>(dy[c]) * (xr[c] - m) * rs;
            acc_b[c - cb] += dy[c];
          }
        }
        for (int64_t c = cb; c < ce; ++c) {
          if (!fdw.empty()) fdw.add(c, acc_w[c - cb]);
          if (!fdb.empty()) fdb.add(c, acc_b[c - cb]);
        }
      });
    }
    const T* w = weight.ptr<T>();
    pool_.parallel_for(R, 8, [&](int64_t rb, int64_t re, int) {
      for (int64_t r = rb; r < re; ++r) {
        norm_row_backward(dx.ptr<T>() + r * C, dout.ptr<T>() + r * C, x.ptr<T>() + r * C, ln ? fm.get(r) : 0.0,
                          fr.get(r), w, dresidual.empty() ? static_cast<const T*>(nullptr) : dresidual.ptr<T>() + r * C,
                          C, p);
      }
    });
    if (!dx_amax.empty()) {  // max |dx| as stored
      std::vector<float> row_max(static_cast<size_t>(R), 0.0f);
      const Floats fdx(dx);
      pool_.parallel_for(R, 8, [&](int64_t rb, int64_t re, int) {
        for (int64_t r = rb; r < re; ++r)
          for (int64_t c = 0; c < C; ++c)
            row_max[static_cast<size_t>(r)] =
                std::fmax(row_max[static_cast<size_t>(r)], std::fabs(static_cast<float>(fdx.get(r * C + c))));
      });
      max_into(dx_amax, row_max, "norm_backward");
    }
    if (dx_colsum.empty()) return;
    const Floats fds(dx_colsum), fdx(dx);  // the column sums of dx as stored, rows in order
    pool_.parallel_for(C, 64, [&](int64_t cb, int64_t ce, int) {
      for (int64_t c = cb; c < ce; ++c) {
        double s = 0.0;
        for (int64_t r = 0; r < R; ++r) s += fdx.get(r * C + c);
        fds.add(c, s);
      }
    });
  });
}

namespace {

struct HeadLayout {
  int64_t groups, hpg, d, row;  // row = packed row width
  int64_t heads_normed() const { return groups * (hpg + 1); }
  // Offset in the packed row of normalized head j (q heads of each group, then its k).
  int64_t offset(int64_t j) const {
    const int64_t g = j / (hpg + 1), k = j % (hpg + 1);
    return g * (hpg + 2) * d + k * d;
  }
  bool is_k(int64_t j) const { return j % (hpg + 1) == hpg; }
  int64_t v_offset(int64_t g) const { return g * (hpg + 2) * d + (hpg + 1) * d; }
};

HeadLayout head_layout(const Tensor& qkv, const RopeShape& r) {
  MT_CHECK(r.groups > 0 && r.heads % r.groups == 0, "heads {} not a multiple of groups {}", r.heads, r.groups);
  HeadLayout h{r.groups, r.heads / r.groups, r.head_dim, 0};
  h.row = h.groups * (h.hpg + 2) * h.d;
  MT_CHECK(qkv.cols() == h.row, "packed qkv has {} columns, expected {}", qkv.cols(), h.row);
  return h;
}

}  // namespace

void ReferenceBackend::qk_norm_forward(Tensor out, Tensor mean, Tensor rstd, Tensor qkv, Tensor q_weight,
                                       Tensor q_bias, Tensor k_weight, Tensor k_bias, const RopeShape& r,
                                       const NormParams& p) {
  const HeadLayout L = head_layout(qkv, r);
  const int64_t R = qkv.rows(), H = L.heads_normed();
  MT_CHECK(out.data != qkv.data, "qk_norm_forward: out must not alias qkv");
  check_numel(out, qkv.numel(), "qk_norm_forward", "out");
  check_numel(rstd, R * H, "qk_norm_forward", "rstd");
  check_numel(q_weight, L.d, "qk_norm_forward", "q_weight");
  check_numel(k_weight, L.d, "qk_norm_forward", "k_weight");
  check_same_dtype(qkv, out, "qk_norm_forward");
  const Floats fm(mean), fr(rstd);
  dispatch_float(qkv, "qk_norm_forward", [&](auto tag) {
    using T = decltype(tag);
    pool_.parallel_for(R, 4, [&](int64_t rb, int64_t re, int) {
      for (int64_t row = rb; row < re; ++row) {
        const T* x = qkv.ptr<T>() + row * L.row;
        T* y = out.ptr<T>() + row * L.row;
        for (int64_t j = 0; j < H; ++j) {
          const bool k = L.is_k(j);
          const Tensor& w = k ? k_weight : q_weight;
          const Tensor& b = k ? k_bias : q_bias;
          const RowStats s = norm_row(x + L.offset(j), y + L.offset(j), L.d, w.ptr<T>(),
                                      b.empty() ? static_cast<const T*>(nullptr) : b.ptr<T>(), p, nullptr);
          if (!fm.empty()) fm.set(row * H + j, s.mean);
          fr.set(row * H + j, s.rstd);
        }
        for (int64_t g = 0; g < L.groups; ++g)
          for (int64_t c = 0; c < L.d; ++c) y[L.v_offset(g) + c] = x[L.v_offset(g) + c];
      }
    });
  });
}

void ReferenceBackend::qk_norm_backward(Tensor dqkv, Tensor dq_weight, Tensor dq_bias, Tensor dk_weight,
                                        Tensor dk_bias, Tensor dout, Tensor qkv, Tensor mean, Tensor rstd,
                                        Tensor q_weight, Tensor k_weight, const RopeShape& r, const NormParams& p) {
  const HeadLayout L = head_layout(qkv, r);
  const int64_t R = qkv.rows(), H = L.heads_normed();
  const bool ln = p.kind == Normalization::layernorm;
  check_numel(dqkv, qkv.numel(), "qk_norm_backward", "dqkv");
  check_numel(dout, qkv.numel(), "qk_norm_backward", "dout");
  check_same_dtype(qkv, dqkv, "qk_norm_backward");
  check_same_dtype(qkv, dout, "qk_norm_backward");
  const Floats fm(mean), fr(rstd);
  dispatch_float(qkv, "qk_norm_backward", [&](auto tag) {
    using T = decltype(tag);
    // Weight/bias gradients (serial over rows and heads: fixed order; sizes are d).
    const Tensor* dws[2] = {&dq_weight, &dk_weight};
    const Tensor* dbs[2] = {&dq_bias, &dk_bias};
    for (int kind = 0; kind < 2; ++kind) {
      double* acc = scratch(0, static_cast<size_t>(2 * L.d));
      std::fill(acc, acc + 2 * L.d, 0.0);
      for (int64_t row = 0; row < R; ++row)
        for (int64_t j = 0; j < H; ++j) {
          if (L.is_k(j) != (kind == 1)) continue;
          const T* x = qkv.ptr<T>() + row * L.row + L.offset(j);
          const T* dy = dout.ptr<T>() + row * L.row + L.offset(j);
          const double m = ln ? fm.get(row * H + j) : 0.0, rs = fr.get(row * H + j);
          for (int64_t c = 0; c < L.d; ++c) {
            acc[c] += static_cast<double>(dy[c]) * (x[c] - m) * rs;
            acc[L.d + c] += dy[c];
          }
        }
      const Floats fw(*dws[kind]), fb(*dbs[kind]);
      for (int64_t c = 0; c < L.d; ++c) {
        if (!fw.empty()) fw.add(c, acc[c]);
        if (!fb.empty()) fb.add(c, acc[L.d + c]);
      }
    }
    pool_.parallel_for(R, 4, [&](int64_t rb, int64_t re, int) {
      for (int64_t row = rb; row < re; ++row) {
        const T* x = qkv.ptr<T>() + row * L.row;
        const T* dy = dout.ptr<T>() + row * L.row;
        T* dx = dqkv.ptr<T>() + row * L.row;
        for (int64_t j = 0; j < H; ++j) {
          const T* w = (L.is_k(j) ? k_weight : q_weight).template ptr<T>();
          norm_row_backward(dx + L.offset(j), dy + L.offset(j), x + L.offset(j), ln ? fm.get(row * H + j) : 0.0,
                            fr.get(row * H + j), w, static_cast<const T*>(nullptr), L.d, p);
        }
        if (dx != dy)
          for (int64_t g = 0; g < L.groups; ++g)
            for (int64_t c = 0; c < L.d; ++c) dx[L.v_offset(g) + c] = dy[L.v_offset(g) + c];
      }
    });
  });
}

}  // namespace mt::reference
