// ReferenceBackend: vocab-parallel cross-entropy pieces and the masked loss sum.
#include <climits>
#include <cmath>

#include "engine/reference/reference_backend.h"
#include "engine/reference/tensor_access.h"

namespace mt::reference {

void ReferenceBackend::cross_entropy_forward(Tensor lse, Tensor target, Tensor logits, Tensor labels,
                                             int64_t vocab_start) {
  const int64_t N = logits.rows(), C = logits.cols();
  check_numel(lse, N, "cross_entropy_forward", "lse");
  check_numel(target, N, "cross_entropy_forward", "target");
  MT_CHECK(labels.dtype == DType::i32 && labels.numel() == N, "cross_entropy_forward: labels [{}] int32", N);
  check_float_accumulator(lse, "cross_entropy_forward", "lse");
  check_float_accumulator(target, "cross_entropy_forward", "target");
  const Floats fl(lse), ft(target);
  dispatch_float(logits, "cross_entropy_forward", [&](auto tag) {
    using T = decltype(tag);
    const int32_t* lab = labels.ptr<int32_t>();
    pool_.parallel_for(N, 4, [&](int64_t rb, int64_t re, int) {
      for (int64_t r = rb; r < re; ++r) {
        const T* z = logits.ptr<T>() + r * C;
        double m = -INFINITY;
        for (int64_t c = 0; c < C; ++c) m = std::max(m, static_cast<double>(z[c]));
        double s = 0;
        for (int64_t c = 0; c < C; ++c) s += std::exp(z[c] - m);
        fl.set(r, m + std::log(s));
        const int64_t t = static_cast<int64_t>(lab[r]) - vocab_start;
        ft.set(r, (t >= 0 && t < C) ? static_cast<double>(z[t]) : 0.0);
      }
    });
  });
}

void ReferenceBackend::cross_entropy_backward(Tensor dlogits, Tensor logits, Tensor labels, Tensor lse,
                                              Tensor dloss, int64_t vocab_start) {
  const int64_t N = logits.rows(), C = logits.cols();
  check_numel(dlogits, N * C, "cross_entropy_backward", "dlogits");
  check_numel(lse, N, "cross_entropy_backward", "lse");
  check_numel(dloss, N, "cross_entropy_backward", "dloss");
  MT_CHECK(labels.dtype == DType::i32 && labels.numel() == N, "cross_entropy_backward: labels [{}] int32", N);
  check_same_dtype(logits, dlogits, "cross_entropy_backward");
  const Floats fl(lse), fd(dloss);
  dispatch_float(logits, "cross_entropy_backward", [&](auto tag) {
    using T = decltype(tag);
    const int32_t* lab = labels.ptr<int32_t>();
    pool_.parallel_for(N, 4, [&](int64_t rb, int64_t re, int) {
      for (int64_t r = rb; r < re; ++r) {
        const T* z = logits.ptr<T>() + r * C;
        T* dz = dlogits.ptr<T>() + r * C;
        const double l = fl.get(r), g = fd.get(r);
        const int64_t t = static_cast<int64_t>(lab[r]) - vocab_start;
        for (int64_t c = 0; c < C; ++c) {
          const double p = std::exp(z[c] - l);
          dz[c] = static_cast<T>((p - (c == t ? 1.0 : 0.0)) * g);
        }
      }
    });
  });
}

void ReferenceBackend::logsumexp_combine(Tensor lse_out, Tensor lse_parts) {
  const int64_t N = lse_out.numel(), R = lse_parts.numel() / std::max<int64_t>(1, N);
  check_numel(lse_parts, R * N, "logsumexp_combine", "lse_parts");
  const Floats o(lse_out), in(lse_parts);
  for (int64_t n = 0; n < N; ++n) {
    double m = -INFINITY;
    for (int64_t r = 0; r < R; ++r) m = std::max(m, in.get(r * N + n));
    double s = 0;
    for (int64_t r = 0; r < R; ++r) s += std::exp(in.get(r * N + n) - m);
    o.set(n, m + std::log(s));
  }
}

void ReferenceBackend::masked_loss_sum(Tensor out, Tensor loss, Tensor mask, bool accumulate) {
  const int64_t N = loss.numel();
  check_numel(mask, N, "masked_loss_sum", "mask");
  check_numel(out, 2, "masked_loss_sum", "out");
  const Floats o(out), l(loss), m(mask);
  double sum = 0, count = 0;
  for (int64_t i = 0; i < N; ++i) {
    const double mi = m.get(i);
    if (mi != 0.0) sum += l.get(i) * mi;  // masked-out rows never contribute, even if not finite
    count += mi;
  }
  if (accumulate) {
    o.add(0, sum);
    o.add(1, count);
  } else {
    o.set(0, sum);
    o.set(1, count);
  }
}

void ReferenceBackend::logits_argmax(Tensor max, Tensor index, Tensor logits, int64_t vocab_start) {
  const int64_t N = logits.rows(), C = logits.cols();
  check_numel(max, N, "logits_argmax", "max");
  MT_CHECK(max.dtype == DType::f32, "logits_argmax: max must be float32");
  MT_CHECK(index.dtype == DType::i32 && index.numel() == N, "logits_argmax: index [{}] int32", N);
  MT_CHECK(C > 0 && vocab_start + C <= INT32_MAX, "logits_argmax: {} columns from {}", C, vocab_start);
  dispatch_float(logits, "logits_argmax", [&](auto tag) {
    using T = decltype(tag);
    for (int64_t r = 0; r < N; ++r) {
      const T* z = logits.ptr<T>() + r * C;
      int64_t best = 0;
      for (int64_t c = 1; c < C; ++c)
        if (z[c] > z[best]) best = c;  // the first occurrence of the largest
      max.ptr<float>()[r] = static_cast<float>(z[best]);
      index.ptr<int32_t>()[r] = static_cast<int32_t>(vocab_start + best);
    }
  });
}

void ReferenceBackend::argmax_match_count(Tensor out, Tensor max_parts, Tensor index_parts, Tensor labels,
                                          Tensor mask, bool accumulate) {
  const int64_t N = labels.numel(), R = max_parts.numel() / std::max<int64_t>(1, N);
  MT_CHECK(labels.dtype == DType::i32, "argmax_match_count: labels must be int32");
  MT_CHECK(max_parts.dtype == DType::f32 && R >= 1 && max_parts.numel() == R * N,
           "argmax_match_count: max_parts {} must be float32 [R, {}]", max_parts.shape_string(), N);
  MT_CHECK(index_parts.dtype == DType::i32 && index_parts.numel() == R * N,
           "argmax_match_count: index_parts {} must be int32 [{}, {}]", index_parts.shape_string(), R, N);
  check_numel(mask, N, "argmax_match_count", "mask");
  check_numel(out, 2, "argmax_match_count", "out");
  const Floats o(out), m(mask);
  const float* mx = max_parts.ptr<float>();
  const int32_t* ix = index_parts.ptr<int32_t>();
  double correct = 0, total = 0;
  for (int64_t i = 0; i < N; ++i) {
    if (m.get(i) == 0.0) continue;
    int64_t best = 0;
    for (int64_t r = 1; r < R; ++r)
      if (mx[r * N + i] > mx[best * N + i]) best = r;
    total += 1;
    correct += ix[best * N + i] == labels.ptr<int32_t>()[i] ? 1 : 0;
  }
  if (accumulate) {
    o.add(0, correct);
    o.add(1, total);
  } else {
    o.set(0, correct);
    o.set(1, total);
  }
}

}  // namespace mt::reference

// ---- knowledge distillation --------------------------------------------------------------

namespace mt::reference {

void ReferenceBackend::logsumexp_rows(Tensor lse, Tensor logits, float scale) {
  const int64_t N = logits.rows(), C = logits.cols();
  check_numel(lse, N, "logsumexp_rows", "lse");
  check_float_accumulator(lse, "logsumexp_rows", "lse");
  const Floats fl(lse);
  dispatch_float(logits, "logsumexp_rows", [&](auto tag) {
    using T = decltype(tag);
    pool_.parallel_for(N, 4, [&](int64_t rb, int64_t re, int) {
      for (int64_t r = rb; r < re; ++r) {
        const T* z = logits.ptr<T>() + r * C;
        double m = -INFINITY;
        for (int64_t c = 0; c < C; ++c) m = std::max(m, static_cast<double>(z[c]) * scale);
        double sum = 0;
        for (int64_t c = 0; c < C; ++c) sum += std::exp(static_cast<double>(z[c]) * scale - m);
        fl.set(r, m == -INFINITY ? m : m + std::log(sum));  // (a row of -inf: -inf)
      }
    });
  });
}

void ReferenceBackend::kd_logits_kl(Tensor kl, Tensor ds, Tensor s, Tensor t, Tensor lse_s, Tensor lse_t, float scale,
                                    Tensor dloss) {
  const int64_t N = s.rows(), C = s.cols();
  MT_CHECK(t.rows() == N && t.cols() == C, "kd_logits_kl: teacher logits {} unlike the student's {}", t.shape_string(),
           s.shape_string());
  check_same_dtype(s, t, "kd_logits_kl");
  check_numel(kl, N, "kd_logits_kl", "kl");
  check_float_accumulator(kl, "kd_logits_kl", "kl");
  check_numel(lse_s, N, "kd_logits_kl", "lse_s");
  check_numel(lse_t, N, "kd_logits_kl", "lse_t");
  if (!dloss.empty()) {
    check_numel(dloss, N, "kd_logits_kl", "dloss");
    check_numel(ds, N * C, "kd_logits_kl", "ds");
    check_same_dtype(s, ds, "kd_logits_kl");
  }
  const Floats fk(kl), fs(lse_s), ft(lse_t), fd(dloss);
  dispatch_float(s, "kd_logits_kl", [&](auto tag) {
    using T = decltype(tag);
    pool_.parallel_for(N, 4, [&](int64_t rb, int64_t re, int) {
      for (int64_t r = rb; r < re; ++r) {
        const T* zs = s.ptr<T>() + r * C;
        const T* zt = t.ptr<T>() + r * C;
        T* g = dloss.empty() ? nullptr : ds.ptr<T>() + r * C;
        const double ls = fs.get(r), lt = ft.get(r), w = dloss.empty() ? 0.0 : fd.get(r);
        double sum = 0;
        for (int64_t c = 0; c < C; ++c) {
          const double log_ps = static_cast<double>(zs[c]) * scale - ls;
          const double log_pt = static_cast<double>(zt[c]) * scale - lt;
          const double pt = std::exp(log_pt);
          if (pt > 0) sum += pt * (log_pt - log_ps);  // (a teacher logit of -inf adds nothing)
          if (g) g[c] = static_cast<T>((std::exp(log_ps) - pt) * scale * w);  // (after reading zs[c]: ds may alias s)
        }
        fk.set(r, sum);
      }
    });
  });
}

namespace {
// Row r's hidden loss and, with grad, its gradient with respect to a times g (added to da when
// accumulating): torch's cosine_embedding_loss (target 1) or the row's mean squared error.
template <typename T>
double hidden_loss_row(const T* a, const T* b, int64_t h, Backend::HiddenLoss kind, T* da, double g, bool accumulate) {
  if (kind == Backend::HiddenLoss::mse) {
    double sum = 0;
    for (int64_t c = 0; c < h; ++c) {
      const double d = static_cast<double>(a[c]) - static_cast<double>(b[c]);
      sum += d * d;
      if (da) da[c] = static_cast<T>((accumulate ? static_cast<double>(da[c]) : 0.0) + 2.0 * d / h * g);
    }
    return sum / h;
  }
  constexpr double kEps = 1e-12;  // torch's EPSILON in cosine_embedding_loss
  double ab = 0, aa = kEps, bb = kEps;
  for (int64_t c = 0; c < h; ++c) {
    ab += static_cast<double>(a[c]) * b[c];
    aa += static_cast<double>(a[c]) * a[c];
    bb += static_cast<double>(b[c]) * b[c];
  }
  const double denom = std::sqrt(aa * bb), cos = ab / denom;
  if (da)  // d(1 - cos)/da = cos * a / |a|^2 - b / sqrt(|a|^2 |b|^2)
    for (int64_t c = 0; c < h; ++c)
      da[c] = static_cast<T>((accumulate ? static_cast<double>(da[c]) : 0.0) +
                             (cos * a[c] / aa - b[c] / denom) * g);
  return 1.0 - cos;
}

void check_hidden_pair(const Tensor& a, const Tensor& b, const char* op) {
  MT_CHECK(a.rows() == b.rows() && a.cols() == b.cols(), "{}: teacher states {} unlike the student's {}", op,
           b.shape_string(), a.shape_string());
  check_same_dtype(a, b, op);
}
}  // namespace

void ReferenceBackend::hidden_loss_forward(Tensor loss, Tensor a, Tensor b, HiddenLoss kind) {
  check_hidden_pair(a, b, "hidden_loss_forward");
  const int64_t N = a.rows(), h = a.cols();
  check_numel(loss, N, "hidden_loss_forward", "loss");
  check_float_accumulator(loss, "hidden_loss_forward", "loss");
  const Floats fl(loss);
  dispatch_float(a, "hidden_loss_forward", [&](auto tag) {
    using T = decltype(tag);
    for (int64_t r = 0; r < N; ++r)
      fl.set(r, hidden_loss_row<T>(a.ptr<T>() + r * h, b.ptr<T>() + r * h, h, kind, nullptr, 0.0, false));
  });
}

void ReferenceBackend::hidden_loss_backward(Tensor da, Tensor a, Tensor b, Tensor dloss, float scale, HiddenLoss kind,
                                            bool accumulate) {
  check_hidden_pair(a, b, "hidden_loss_backward");
  const int64_t N = a.rows(), h = a.cols();
  check_numel(dloss, N, "hidden_loss_backward", "dloss");
  check_numel(da, N * h, "hidden_loss_backward", "da");
  check_same_dtype(a, da, "hidden_loss_backward");
  const Floats fd(dloss);
  dispatch_float(a, "hidden_loss_backward", [&](auto tag) {
    using T = decltype(tag);
    for (int64_t r = 0; r < N; ++r)
      hidden_loss_row<T>(a.ptr<T>() + r * h, b.ptr<T>() + r * h, h, kind, da.ptr<T>() + r * h,
                         fd.get(r) * static_cast<double>(scale), accumulate);
  });
}

}  // namespace mt::reference
