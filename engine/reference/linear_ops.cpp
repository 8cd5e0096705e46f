// ReferenceBackend: linear layers (GEMMs) with bias and fused activation. Row-major loops with
// double accumulators; each output element is summed in a fixed order (deterministic).
#include <algorithm>

#include "engine/reference/activation_math.h"
#include "engine/reference/reference_backend.h"
#include "engine/reference/tensor_access.h"

namespace mt::reference {

void ReferenceBackend::linear_forward(Tensor y, Tensor x, Tensor w, Tensor bias, Activation act, Tensor pre_act) {
  const int64_t M = x.rows(), K = x.cols(), N = w.rows();
  MT_CHECK(w.cols() == K, "linear_forward: x {} and w {} disagree on K", x.shape_string(), w.shape_string());
  check_numel(y, M * N, "linear_forward", "y");
  if (!bias.empty()) check_numel(bias, N, "linear_forward", "bias");
  if (act != Activation::none) check_numel(pre_act, M * N, "linear_forward", "pre_act");
  check_same_dtype(x, w, "linear_forward");
  check_same_dtype(x, y, "linear_forward");
  check_same_dtype(x, bias, "linear_forward");
  check_same_dtype(x, pre_act, "linear_forward");
  dispatch_float(x, "linear_forward", [&](auto tag) {
    using T = decltype(tag);
    const T* px = x.ptr<T>();
    const T* pw = w.ptr<T>();
    const T* pb = bias.empty() ? nullptr : bias.ptr<T>();
    T* py = y.ptr<T>();
    T* pz = act != Activation::none ? pre_act.ptr<T>() : nullptr;
    constexpr int64_t kRows = 4;  // rows of x per tile: one pass over w serves four rows
    const int64_t tiles = (M + kRows - 1) / kRows;
    pool_.parallel_for(tiles, 1, [&](int64_t tb, int64_t te, int) {
      for (int64_t t = tb; t < te; ++t) {
        const int64_t m0 = t * kRows, mr = std::min(kRows, M - m0);
        for (int64_t n = 0; n < N; ++n) {
          const T* wn = pw + n * K;
          double acc[kRows] = {0, 0, 0, 0};
          for (int64_t i = 0; i < mr; ++i) {
            const T* xm = px + (m0 + i) * K;
            double s0 = 0, s1 = 0;  // two chains per row: a fixed, deterministic order
            int64_t k = 0;
            for (; k + 1 < K; k += 2) {
              s0 += static_cast<double>(xm[k]) * wn[k];
              s1 += static_cast<double>(xm[k + 1]) * wn[k + 1];
            }
            if (k < K) s0 += static_cast<double>(xm[k]) * wn[k];
            acc[i] = s0 + s1;
          }
          for (int64_t i = 0; i < mr; ++i) {
            const double z = acc[i] + (pb ? static_cast<double>(pb[n]) : 0.0);
            const int64_t o = (m0 + i) * N + n;
            if (pz) {
              const T zt = static_cast<T>(z);
              pz[o] = zt;
              py[o] = static_cast<T>(activate(act, zt));
            } else {
              py[o] = static_cast<T>(z);
            }
          }
        }
      }
    });
  });
}

void ReferenceBackend::linear_backward_input(Tensor dx, Tensor dy, Tensor w, bool accumulate, Activation act,
                                             Tensor pre_act) {
  const int64_t M = dy.rows(), N = dy.cols(), K = w.cols();
  MT_CHECK(w.rows() == N, "linear_backward_input: dy {} and w {} disagree on N", dy.shape_string(),
           w.shape_string());
  check_numel(dx, M * K, "linear_backward_input", "dx");
  if (act != Activation::none) check_numel(pre_act, M * K, "linear_backward_input", "pre_act");
  check_same_dtype(dy, w, "linear_backward_input");
  check_same_dtype(dy, dx, "linear_backward_input");
  check_same_dtype(dy, pre_act, "linear_backward_input");
  dispatch_float(dy, "linear_backward_input", [&](auto tag) {
    using T = decltype(tag);
    const T* pdy = dy.ptr<T>();
    const T* pw = w.ptr<T>();
    T* pdx = dx.ptr<T>();
    const T* pz = act != Activation::none ? pre_act.ptr<T>() : nullptr;
    pool_.parallel_for(M, 1, [&](int64_t mb, int64_t me, int thread) {
      double* acc = scratch(thread, static_cast<size_t>(K));
      for (int64_t m = mb; m < me; ++m) {
        std::fill(acc, acc + K, 0.0);
        const T* dym = pdy + m * N;
        for (int64_t n = 0; n < N; ++n) {
          const double a = dym[n];
          const T* wn = pw + n * K;
          for (int64_t k = 0; k < K; ++k) acc[k] += a * wn[k];
        }
        T* dxm = pdx + m * K;
        for (int64_t k = 0; k < K; ++k) {
          double v = acc[k];
          if (pz) v *= activation_grad(act, pz[m * K + k]);
          dxm[k] = accumulate ? static_cast<T>(dxm[k] + v) : static_cast<T>(v);
        }
      }
    });
  });
}

void ReferenceBackend::linear_backward_weight(Tensor dw, Tensor dbias, Tensor dy, Tensor x, bool accumulate) {
  const int64_t M = dy.rows(), N = dy.cols(), K = x.cols();
  MT_CHECK(x.rows() == M, "linear_backward_weight: dy {} and x {} disagree on M", dy.shape_string(),
           x.shape_string());
  check_numel(dw, N * K, "linear_backward_weight", "dw");
  if (!dbias.empty()) check_numel(dbias, N, "linear_backward_weight", "dbias");
  check_same_dtype(dy, x, "linear_backward_weight");
  check_grad_accumulator(dw, "linear_backward_weight", "dw");
  check_grad_accumulator(dbias, "linear_backward_weight", "dbias");
  const Floats fdw(dw), fdb(dbias);
  dispatch_float(dy, "linear_backward_weight", [&](auto tag) {
    using T = decltype(tag);
    const T* pdy = dy.ptr<T>();
    const T* px = x.ptr<T>();
    constexpr int64_t kCols = 4;  // output rows n per tile: one pass over x serves four of them
    const int64_t tiles = (N + kCols - 1) / kCols;
    pool_.parallel_for(tiles, 1, [&](int64_t tb, int64_t te, int thread) {
      double* acc = scratch(thread, static_cast<size_t>(kCols * K));
      for (int64_t t = tb; t < te; ++t) {
        const int64_t n0 = t * kCols, nr = std::min(kCols, N - n0);
        std::fill(acc, acc + kCols * K, 0.0);
        double bsum[kCols] = {0, 0, 0, 0};
        for (int64_t m = 0; m < M; ++m) {
          const T* xm = px + m * K;
          for (int64_t j = 0; j < nr; ++j) {
            const double a = pdy[m * N + n0 + j];
            bsum[j] += a;
            double* accj = acc + j * K;
            for (int64_t k = 0; k < K; ++k) accj[k] += a * xm[k];
          }
        }
        for (int64_t j = 0; j < nr; ++j) {
          const int64_t n = n0 + j;
          for (int64_t k = 0; k < K; ++k) {
            if (accumulate) fdw.add(n * K + k, acc[j * K + k]);
            else fdw.set(n * K + k, acc[j * K + k]);
          }
          if (!fdb.empty()) fdb.add(n, bsum[j]);
        }
      }
    });
  });
}

}  // namespace mt::reference
