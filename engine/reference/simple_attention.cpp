#include "engine/reference/simple_attention.h"

#include <cmath>

#include "engine/dropout_mask.h"
#include "engine/reference/tensor_access.h"

namespace mt::reference {

namespace {

struct Layout {
  int64_t b, s, heads, groups, hpg, d, row;
  int64_t q_off(int64_t h) const { return (h / hpg) * (hpg + 2) * d + (h % hpg) * d; }
  int64_t k_off(int64_t g) const { return g * (hpg + 2) * d + hpg * d; }
  int64_t v_off(int64_t g) const { return k_off(g) + d; }
  int64_t rowi(int64_t t, int64_t i) const { return t * b + i; }  // sequence-major
};

Layout layout_of(const Tensor& qkv, const AttentionShape& a) {
  MT_CHECK(a.groups > 0 && a.heads % a.groups == 0, "attention: heads {} not a multiple of groups {}", a.heads,
           a.groups);
  Layout L{a.batch, a.seq, a.heads, a.groups, a.heads / a.groups, a.head_dim, a.qkv_row_stride()};
  MT_CHECK(qkv.rows() == L.b * L.s && qkv.cols() == L.row, "attention: qkv {} for b={} s={} row={}",
           qkv.shape_string(), L.b, L.s, L.row);
  return L;
}

uint64_t drop_index(const Layout& L, int64_t i, int64_t h, int64_t q, int64_t k) {
  return static_cast<uint64_t>(((i * L.heads + h) * L.s + q) * L.s + k);
}

}  // namespace

void simple_attention_forward(ReferenceBackend& be, Tensor out, Tensor lse, Tensor qkv, const AttentionShape& a) {
  const Layout L = layout_of(qkv, a);
  check_numel(out, L.b * L.s * L.heads * L.d, "attention_forward", "out");
  check_numel(lse, L.b * L.heads * L.s, "attention_forward", "lse");
  check_same_dtype(qkv, out, "attention_forward");
  check_float_accumulator(lse, "attention_forward", "lse");
  const Floats flse(lse);
  const double scale = a.softmax_scale, keep_scale = a.dropout_p > 0 ? 1.0 / (1.0 - a.dropout_p) : 1.0;
  dispatch_float(qkv, "attention_forward", [&](auto tag) {
    using T = decltype(tag);
    const T* x = qkv.ptr<T>();
    T* y = out.ptr<T>();
    be.pool().parallel_for(L.b * L.heads, 1, [&](int64_t pb, int64_t pe, int thread) {
      double* p = be.scratch(thread, static_cast<size_t>(L.s + L.d));
      double* acc = p + L.s;
      for (int64_t pair = pb; pair < pe; ++pair) {
        const int64_t i = pair / L.heads, h = pair % L.heads, g = h / L.hpg;
        for (int64_t q = 0; q < L.s; ++q) {
          const T* qv = x + L.rowi(q, i) * L.row + L.q_off(h);
          const int64_t kend = a.causal ? q + 1 : L.s;
          double m = -INFINITY;
          for (int64_t k = 0; k < kend; ++k) {
            const T* kv = x + L.rowi(k, i) * L.row + L.k_off(g);
            double dot = 0;
            for (int64_t c = 0; c < L.d; ++c) dot += static_cast<double>(qv[c]) * kv[c];
            p[k] = dot * scale;
            m = std::max(m, p[k]);
          }
          double sum = 0;
          for (int64_t k = 0; k < kend; ++k) sum += std::exp(p[k] - m);
          const double l = m + std::log(sum);
          flse.set((i * L.heads + h) * L.s + q, l);
          std::fill(acc, acc + L.d, 0.0);
          for (int64_t k = 0; k < kend; ++k) {
            double w = std::exp(p[k] - l);
            if (a.dropout_p > 0)
              w = dropout_keep(a.dropout_key, drop_index(L, i, h, q, k), a.dropout_p) ? w * keep_scale : 0.0;
            const T* vv = x + L.rowi(k, i) * L.row + L.v_off(g);
            for (int64_t c = 0; c < L.d; ++c) acc[c] += w * vv[c];
          }
          T* o = y + L.rowi(q, i) * (L.heads * L.d) + h * L.d;
          for (int64_t c = 0; c < L.d; ++c) o[c] = static_cast<T>(acc[c]);
        }
      }
    });
  });
}

void simple_attention_backward(ReferenceBackend& be, Tensor dqkv, Tensor dout, Tensor out, Tensor lse, Tensor qkv,
                               const AttentionShape& a) {
  const Layout L = layout_of(qkv, a);
  check_numel(dqkv, qkv.numel(), "attention_backward", "dqkv");
  check_numel(dout, L.b * L.s * L.heads * L.d, "attention_backward", "dout");
  check_numel(out, L.b * L.s * L.heads * L.d, "attention_backward", "out");
  check_same_dtype(qkv, dqkv, "attention_backward");
  check_same_dtype(qkv, dout, "attention_backward");
  check_same_dtype(qkv, out, "attention_backward");
  const Floats flse(lse);
  const double scale = a.softmax_scale, keep_scale = a.dropout_p > 0 ? 1.0 / (1.0 - a.dropout_p) : 1.0;
  dispatch_float(qkv, "attention_backward", [&](auto tag) {
    using T = decltype(tag);
    const T* x = qkv.ptr<T>();
    const T* dy = dout.ptr<T>();
    const T* y = out.ptr<T>();
    T* dx = dqkv.ptr<T>();
    const int64_t od = L.heads * L.d;
    // One (sample, kv group) per task: its k/v gradients collect from all its query heads in a
    // fixed order, with no other task writing them.
    be.pool().parallel_for(L.b * L.groups, 1, [&](int64_t pb, int64_t pe, int thread) {
      double* dk = be.scratch(thread, static_cast<size_t>(2 * L.s * L.d + L.d));
      double* dv = dk + L.s * L.d;
      double* dq = dv + L.s * L.d;
      for (int64_t pair = pb; pair < pe; ++pair) {
        const int64_t i = pair / L.groups, g = pair % L.groups;
        std::fill(dk, dk + 2 * L.s * L.d, 0.0);
        for (int64_t h = g * L.hpg; h < (g + 1) * L.hpg; ++h) {
          for (int64_t q = 0; q < L.s; ++q) {
            const T* qv = x + L.rowi(q, i) * L.row + L.q_off(h);
            const T* dyq = dy + L.rowi(q, i) * od + h * L.d;
            const T* yq = y + L.rowi(q, i) * od + h * L.d;
            double D = 0;  // rowsum(dO * O) = sum_k P_k dP_k
            for (int64_t c = 0; c < L.d; ++c) D += static_cast<double>(dyq[c]) * yq[c];
            const double l = flse.get((i * L.heads + h) * L.s + q);
            std::fill(dq, dq + L.d, 0.0);
            const int64_t kend = a.causal ? q + 1 : L.s;
            for (int64_t k = 0; k < kend; ++k) {
              const T* kv = x + L.rowi(k, i) * L.row + L.k_off(g);
              const T* vv = x + L.rowi(k, i) * L.row + L.v_off(g);
              double dot = 0;
              for (int64_t c = 0; c < L.d; ++c) dot += static_cast<double>(qv[c]) * kv[c];
              const double p = std::exp(dot * scale - l);
              double keep = 1.0;
              if (a.dropout_p > 0)
                keep = dropout_keep(a.dropout_key, drop_index(L, i, h, q, k), a.dropout_p) ? keep_scale : 0.0;
              double dp = 0;  // gradient w.r.t. the dropped probability
              for (int64_t c = 0; c < L.d; ++c) dp += static_cast<double>(dyq[c]) * vv[c];
              for (int64_t c = 0; c < L.d; ++c) dv[k * L.d + c] += p * keep * dyq[c];
              const double ds = p * (dp * keep - D) * scale;
              for (int64_t c = 0; c < L.d; ++c) {
                dq[c] += ds * kv[c];
                dk[k * L.d + c] += ds * qv[c];
              }
            }
            T* dqo = dx + L.rowi(q, i) * L.row + L.q_off(h);
            for (int64_t c = 0; c < L.d; ++c) dqo[c] = static_cast<T>(dq[c]);
          }
        }
        for (int64_t k = 0; k < L.s; ++k) {
          T* dko = dx + L.rowi(k, i) * L.row + L.k_off(g);
          T* dvo = dx + L.rowi(k, i) * L.row + L.v_off(g);
          for (int64_t c = 0; c < L.d; ++c) {
            dko[c] = static_cast<T>(dk[k * L.d + c]);
            dvo[c] = static_cast<T>(dv[k * L.d + c]);
          }
        }
      }
    });
  });
}

}  // namespace mt::reference
