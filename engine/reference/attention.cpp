#include "engine/reference/attention.h"

#include <cmath>
#include <limits>
#include <vector>

#include "engine/attention_dropout.h"

namespace mt {
namespace {

template <typename T>
constexpr DType dtype_of() {
  return sizeof(T) == 8 ? DType::f64 : DType::f32;
}

// Where each head's vectors live in the packed rows (see the header comment).
struct QkvLayout {
  int64_t b, s, heads, groups, hpg, d, row_stride;
  explicit QkvLayout(const AttentionShape& a)
      : b(a.batch), s(a.seq), heads(a.heads), groups(a.groups), hpg(a.heads / a.groups), d(a.head_dim),
        row_stride(a.qkv_row_stride()) {}
  int64_t row(int64_t i, int64_t t) const { return t * b + i; }
  int64_t q_offset(int64_t i, int64_t t, int64_t h) const {
    return row(i, t) * row_stride + (h / hpg) * (hpg + 2) * d + (h % hpg) * d;
  }
  int64_t k_offset(int64_t i, int64_t t, int64_t g) const {
    return row(i, t) * row_stride + g * (hpg + 2) * d + hpg * d;
  }
  int64_t v_offset(int64_t i, int64_t t, int64_t g) const { return k_offset(i, t, g) + d; }
  int64_t out_offset(int64_t i, int64_t t, int64_t h) const { return row(i, t) * heads * d + h * d; }
  int64_t lse_index(int64_t i, int64_t h, int64_t t) const { return (i * heads + h) * s + t; }
};

template <typename T>
double dot(const T* x, const T* y, int64_t n) {
  double acc = 0;
  for (int64_t j = 0; j < n; ++j) acc += static_cast<double>(x[j]) * static_cast<double>(y[j]);
  return acc;
}

double read_lse(const Tensor& lse, int64_t index) {
  return lse.dtype == DType::f64 ? lse.ptr<double>()[index] : static_cast<double>(lse.ptr<float>()[index]);
}

void write_lse(const Tensor& lse, int64_t index, double value) {
  if (lse.dtype == DType::f64) lse.ptr<double>()[index] = value;
  else lse.ptr<float>()[index] = static_cast<float>(value);
}

// Multiplier that dropout applies to probability (i, h, q, k): 0 if dropped, 1/(1-p) if kept.
double dropout_factor(const AttentionShape& a, int64_t i, int64_t h, int64_t q, int64_t k) {
  if (a.dropout_p == 0) return 1.0;
  const uint64_t index = attention_dropout_index(i, h, a.heads, a.seq, q, k);
  return attention_dropout_keep(a.dropout_key, index, a.dropout_p) ? 1.0 / (1.0 - a.dropout_p) : 0.0;
}

}  // namespace

void check_attention_tensors(const AttentionShape& a, Tensor qkv, Tensor out, Tensor lse, DType element) {
  if (a.batch <= 0 || a.seq <= 0 || a.heads <= 0 || a.groups <= 0 || a.head_dim <= 0 || a.heads % a.groups != 0)
    fail("attention: invalid shape b={} s={} heads={} groups={} d={} (heads must be a multiple of groups)",
         a.batch, a.seq, a.heads, a.groups, a.head_dim);
  if (!(a.dropout_p >= 0 && a.dropout_p < 1)) fail("attention: dropout probability {} not in [0, 1)", a.dropout_p);
  if (a.window_left < -1 || (a.windowed() && !a.causal))
    fail("attention: window_left {} (must be -1, or >= 0 with causal attention)", a.window_left);
  const int64_t n = static_cast<int64_t>(a.batch) * a.seq;
  auto check = [&](const Tensor& t, const char* name, int64_t numel, bool is_lse) {
    MT_CHECK(t.device == Device::cpu, "attention {} must be host memory", name);
    MT_CHECK(t.numel() == numel, "attention {} has {} elements, shape needs {}", name, t.numel(), numel);
    if (is_lse) MT_CHECK(t.dtype == DType::f32 || t.dtype == DType::f64, "attention lse must be float32/64");
    else MT_CHECK(t.dtype == element, "attention {} is {}, expected {}", name, dtype_name(t.dtype), dtype_name(element));
  };
  check(qkv, "qkv", n * a.qkv_row_stride(), false);
  check(out, "out", n * a.heads * a.head_dim, false);
  check(lse, "lse", n * a.heads, true);
}

template <typename T>
void reference_attention_forward(Tensor out, Tensor lse, Tensor qkv, const AttentionShape& a) {
  check_attention_tensors(a, qkv, out, lse, dtype_of<T>());
  const QkvLayout L(a);
  const T* x = qkv.ptr<T>();
  T* o = out.ptr<T>();
  std::vector<double> scores(L.s), acc(L.d);
  for (int64_t i = 0; i < L.b; ++i)
    for (int64_t h = 0; h < L.heads; ++h) {
      const int64_t g = h / L.hpg;
      for (int64_t q = 0; q < L.s; ++q) {
        const int64_t k0 = a.first_key(q), keys = a.last_key(q) + 1;
        double max_score = -std::numeric_limits<double>::infinity();
        for (int64_t k = k0; k < keys; ++k) {
          scores[k] = a.softmax_scale * dot(x + L.q_offset(i, q, h), x + L.k_offset(i, k, g), L.d);
          max_score = std::max(max_score, scores[k]);
        }
        double sum = 0;
        for (int64_t k = k0; k < keys; ++k) sum += std::exp(scores[k] - max_score);
        const double row_lse = max_score + std::log(sum);
        write_lse(lse, L.lse_index(i, h, q), row_lse);

        std::fill(acc.begin(), acc.end(), 0.0);
        for (int64_t k = k0; k < keys; ++k) {
          const double p = std::exp(scores[k] - row_lse) * dropout_factor(a, i, h, q, k);
          if (p == 0) continue;
          const T* v = x + L.v_offset(i, k, g);
          for (int64_t j = 0; j < L.d; ++j) acc[j] += p * static_cast<double>(v[j]);
        }
        T* dst = o + L.out_offset(i, q, h);
        for (int64_t j = 0; j < L.d; ++j) dst[j] = static_cast<T>(acc[j]);
      }
    }
}

// Backward, written as two passes so that every gradient is one double-precision sum written
// once: dq row by row, then dk/dv key by key (summing over the heads of the group). The scores and
// probabilities are recomputed from q, k and the saved lse, as the flash kernels do. With
// P = softmax, Pd = dropped P, O = Pd V:
//   dV = Pd^T dO,   dP = (dO V^T) * dropout factor,   dS = P * (dP - D) with D = rowsum(dO * O),
//   dQ = scale * dS K,   dK = scale * dS^T Q.
template <typename T>
void reference_attention_backward(Tensor dqkv, Tensor dout, Tensor out, Tensor lse, Tensor qkv,
                                  const AttentionShape& a) {
  check_attention_tensors(a, qkv, out, lse, dtype_of<T>());
  check_attention_tensors(a, dqkv, dout, lse, dtype_of<T>());
  const QkvLayout L(a);
  const T* x = qkv.ptr<T>();
  const T* o = out.ptr<T>();
  const T* dout_p = dout.ptr<T>();
  T* dx = dqkv.ptr<T>();

  // D[i, h, q] = rowsum(dO * O).
  std::vector<double> delta(static_cast<size_t>(L.b * L.heads * L.s));
  for (int64_t i = 0; i < L.b; ++i)
    for (int64_t h = 0; h < L.heads; ++h)
      for (int64_t q = 0; q < L.s; ++q)
        delta[L.lse_index(i, h, q)] = dot(dout_p + L.out_offset(i, q, h), o + L.out_offset(i, q, h), L.d);

  // Probability p (undropped) and dS of element (i, h, q, k); also returns the dropout factor.
  auto element = [&](int64_t i, int64_t h, int64_t q, int64_t k, double& p, double& ds, double& drop) {
    const int64_t g = h / L.hpg;
    const double score = a.softmax_scale * dot(x + L.q_offset(i, q, h), x + L.k_offset(i, k, g), L.d);
    p = std::exp(score - read_lse(lse, L.lse_index(i, h, q)));
    drop = dropout_factor(a, i, h, q, k);
    const double dp = drop * dot(dout_p + L.out_offset(i, q, h), x + L.v_offset(i, k, g), L.d);
    ds = p * (dp - delta[L.lse_index(i, h, q)]);
  };

  std::vector<double> acc_k(L.d), acc_v(L.d);
  for (int64_t i = 0; i < L.b; ++i) {
    // dq, one query row at a time.
    for (int64_t h = 0; h < L.heads; ++h)
      for (int64_t q = 0; q < L.s; ++q) {
        std::fill(acc_k.begin(), acc_k.end(), 0.0);
        for (int64_t k = a.first_key(q); k <= a.last_key(q); ++k) {
          double p, ds, drop;
          element(i, h, q, k, p, ds, drop);
          const T* kk = x + L.k_offset(i, k, h / L.hpg);
          for (int64_t j = 0; j < L.d; ++j) acc_k[j] += a.softmax_scale * ds * static_cast<double>(kk[j]);
        }
        T* dst = dx + L.q_offset(i, q, h);
        for (int64_t j = 0; j < L.d; ++j) dst[j] = static_cast<T>(acc_k[j]);
      }
    // dk and dv, one key row of one group at a time, summed over the group's heads.
    for (int64_t g = 0; g < L.groups; ++g)
      for (int64_t k = 0; k < L.s; ++k) {
        std::fill(acc_k.begin(), acc_k.end(), 0.0);
        std::fill(acc_v.begin(), acc_v.end(), 0.0);
        for (int64_t h = g * L.hpg; h < (g + 1) * L.hpg; ++h)
          for (int64_t q = a.first_query(k); q <= a.last_query(k); ++q) {
            double p, ds, drop;
            element(i, h, q, k, p, ds, drop);
            const T* qq = x + L.q_offset(i, q, h);
            const T* dd = dout_p + L.out_offset(i, q, h);
            for (int64_t j = 0; j < L.d; ++j) {
              acc_k[j] += a.softmax_scale * ds * static_cast<double>(qq[j]);
              acc_v[j] += p * drop * static_cast<double>(dd[j]);
            }
          }
        T* dk = dx + L.k_offset(i, k, g);
        T* dv = dx + L.v_offset(i, k, g);
        for (int64_t j = 0; j < L.d; ++j) {
          dk[j] = static_cast<T>(acc_k[j]);
          dv[j] = static_cast<T>(acc_v[j]);
        }
      }
  }
}

template void reference_attention_forward<float>(Tensor, Tensor, Tensor, const AttentionShape&);
template void reference_attention_forward<double>(Tensor, Tensor, Tensor, const AttentionShape&);
template void reference_attention_backward<float>(Tensor, Tensor, Tensor, Tensor, Tensor, const AttentionShape&);
template void reference_attention_backward<double>(Tensor, Tensor, Tensor, Tensor, Tensor, const AttentionShape&);

}  // namespace mt
