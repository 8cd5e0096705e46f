// ReferenceBackend: vocab-parallel cross-entropy pieces and the masked loss sum.
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

}  // namespace mt::reference
