// ReferenceBackend: token/position embeddings and rotary position embeddings.
#include <algorithm>
#include <vector>

#include "engine/reference/reference_backend.h"
#include "engine/reference/tensor_access.h"

namespace mt::reference {

void ReferenceBackend::embedding_forward(Tensor out, Tensor tokens, Tensor positions, Tensor wte, Tensor wpe,
                                         int64_t vocab_start) {
  const int64_t N = tokens.numel(), H = wte.cols(), V = wte.rows();
  MT_CHECK(tokens.dtype == DType::i32, "embedding_forward: tokens must be int32");
  check_numel(out, N * H, "embedding_forward", "out");
  if (!wpe.empty()) {
    MT_CHECK(positions.dtype == DType::i32 && positions.numel() == N, "embedding_forward: positions [{}] int32", N);
    MT_CHECK(wpe.cols() == H, "embedding_forward: wpe width {} != {}", wpe.cols(), H);
  }
  check_same_dtype(wte, out, "embedding_forward");
  check_same_dtype(wte, wpe, "embedding_forward");
  dispatch_float(wte, "embedding_forward", [&](auto tag) {
    using T = decltype(tag);
    const int32_t* tok = tokens.ptr<int32_t>();
    const int32_t* pos = wpe.empty() ? nullptr : positions.ptr<int32_t>();
    const int64_t P = wpe.empty() ? 0 : wpe.rows();
    for (int64_t r = 0; pos && r < N; ++r)  // checked here: worker threads must not throw
      MT_CHECK(pos[r] >= 0 && pos[r] < P, "embedding_forward: position {} outside the table of {}", pos[r], P);
    pool_.parallel_for(N, 16, [&](int64_t rb, int64_t re, int) {
      for (int64_t r = rb; r < re; ++r) {
        T* y = out.ptr<T>() + r * H;
        const int64_t t = static_cast<int64_t>(tok[r]) - vocab_start;
        const T* e = (t >= 0 && t < V) ? wte.ptr<T>() + t * H : nullptr;
        const T* pe = pos ? wpe.ptr<T>() + static_cast<int64_t>(pos[r]) * H : nullptr;
        for (int64_t c = 0; c < H; ++c) y[c] = (e ? e[c] : T(0)) + (pe ? pe[c] : T(0));
      }
    });
  });
}

void ReferenceBackend::embedding_backward(Tensor dwte, Tensor dwpe, Tensor dout, Tensor tokens, Tensor positions,
                                          int64_t vocab_start) {
  const int64_t N = tokens.numel(), H = dout.cols();
  const int64_t V = dwte.empty() ? 0 : dwte.rows();
  MT_CHECK(tokens.dtype == DType::i32, "embedding_backward: tokens must be int32");
  check_numel(dout, N * H, "embedding_backward", "dout");
  check_grad_accumulator(dwte, "embedding_backward", "dwte");
  check_grad_accumulator(dwpe, "embedding_backward", "dwpe");
  const int64_t P = dwpe.empty() ? 0 : dwpe.rows();
  // A bf16 gradient takes each element's sum over the batch in one rounding (as the CUDA
  // backend adds its float32 sums): the sums go to double buffers first. float32/float64 ones
  // are added to row by row, as before.
  const bool wide = (dwte.empty() || dwte.dtype != DType::bf16) && (dwpe.empty() || dwpe.dtype != DType::bf16);
  std::vector<double> sum_wte, sum_wpe;
  if (!wide) {
    sum_wte.assign(static_cast<size_t>(dwte.empty() ? 0 : V * H), 0.0);
    sum_wpe.assign(static_cast<size_t>(P * H), 0.0);
  }
  const Floats fwte(dwte), fwpe(dwpe);
  dispatch_float(dout, "embedding_backward", [&](auto tag) {
    using T = decltype(tag);
    const int32_t* tok = tokens.ptr<int32_t>();
    const int32_t* pos = dwpe.empty() ? nullptr : positions.ptr<int32_t>();
    // Columns over threads; rows in order within a column (fixed summation order).
    pool_.parallel_for(H, 16, [&](int64_t cb, int64_t ce, int) {
      for (int64_t r = 0; r < N; ++r) {
        const T* g = dout.ptr<T>() + r * H;
        const int64_t t = static_cast<int64_t>(tok[r]) - vocab_start;
        if (!fwte.empty() && t >= 0 && t < V)
          for (int64_t c = cb; c < ce; ++c) {
            if (wide) fwte.add(t * H + c, g[c]);
            else sum_wte[static_cast<size_t>(t * H + c)] += g[c];
          }
        if (pos && pos[r] >= 0 && pos[r] < P)
          for (int64_t c = cb; c < ce; ++c) {
            const int64_t i = static_cast<int64_t>(pos[r]) * H + c;
            if (wide) fwpe.add(i, g[c]);
            else sum_wpe[static_cast<size_t>(i)] += g[c];
          }
      }
    });
  });
  if (wide) return;
  // Only the rows the batch touched change (a zero sum elsewhere leaves the value as it is).
  std::vector<char> seen_t(static_cast<size_t>(V), 0), seen_p(static_cast<size_t>(P), 0);
  const int32_t* tok = tokens.ptr<int32_t>();
  for (int64_t r = 0; r < N; ++r) {
    const int64_t t = static_cast<int64_t>(tok[r]) - vocab_start;
    if (!fwte.empty() && t >= 0 && t < V) seen_t[static_cast<size_t>(t)] = 1;
    if (!dwpe.empty()) {
      const int32_t p = positions.ptr<int32_t>()[r];
      if (p >= 0 && p < P) seen_p[static_cast<size_t>(p)] = 1;
    }
  }
  for (int64_t t = 0; t < V; ++t)
    if (seen_t[static_cast<size_t>(t)])
      for (int64_t c = 0; c < H; ++c) fwte.add(t * H + c, sum_wte[static_cast<size_t>(t * H + c)]);
  for (int64_t p = 0; p < P; ++p)
    if (seen_p[static_cast<size_t>(p)])
      for (int64_t c = 0; c < H; ++c) fwpe.add(p * H + c, sum_wpe[static_cast<size_t>(p * H + c)]);
}

namespace {

// Rotates (or, with sign = -1, un-rotates) the first rot_dim values of one head in place.
template <typename T>
void rotate_head(T* x, const Floats& table, int64_t pos, const RopeShape& r, double sign) {
  const int64_t half = r.rot_dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    const double c = table.get(pos * r.rot_dim + i), s = sign * table.get(pos * r.rot_dim + half + i);
    const int64_t a = r.interleaved ? 2 * i : i, b = r.interleaved ? 2 * i + 1 : i + half;
    const double x1 = x[a], x2 = x[b];
    x[a] = static_cast<T>(x1 * c - x2 * s);
    x[b] = static_cast<T>(x2 * c + x1 * s);
  }
}

template <typename T>
void rope_apply(ThreadPool& pool, Tensor qkv, Tensor positions, Tensor cos_sin, const RopeShape& r, double sign) {
  const int64_t hpg = r.heads / r.groups, d = r.head_dim;
  const int64_t row = static_cast<int64_t>(r.groups) * (hpg + 2) * d;
  MT_CHECK(qkv.cols() == row, "rope: packed qkv has {} columns, expected {}", qkv.cols(), row);
  MT_CHECK(r.rot_dim % 2 == 0 && r.rot_dim <= d, "rope: rot_dim {} must be even and <= head_dim {}", r.rot_dim, d);
  MT_CHECK(cos_sin.cols() == r.rot_dim, "rope: table width {} != rot_dim {}", cos_sin.cols(), r.rot_dim);
  MT_CHECK(positions.dtype == DType::i32 && positions.numel() == qkv.rows(), "rope: positions [{}] int32",
           qkv.rows());
  const Floats table(cos_sin);
  const int32_t* pos = positions.ptr<int32_t>();
  const int64_t P = cos_sin.rows();
  for (int64_t n = 0; n < qkv.rows(); ++n)  // checked here: worker threads must not throw
    MT_CHECK(pos[n] >= 0 && pos[n] < P, "rope: position {} outside the table of {}", pos[n], P);
  pool.parallel_for(qkv.rows(), 8, [&](int64_t rb, int64_t re, int) {
    for (int64_t n = rb; n < re; ++n) {
      T* x = qkv.ptr<T>() + n * row;
      for (int64_t g = 0; g < r.groups; ++g)
        for (int64_t j = 0; j <= hpg; ++j)  // hpg q heads, then the group's k head
          rotate_head(x + (g * (hpg + 2) + j) * d, table, pos[n], r, sign);
    }
  });
}

}  // namespace

void ReferenceBackend::rope_forward(Tensor qkv, Tensor positions, Tensor cos_sin, const RopeShape& r) {
  dispatch_float(qkv, "rope_forward", [&](auto tag) { rope_apply<decltype(tag)>(pool_, qkv, positions, cos_sin, r, 1.0); });
}

// The rotation is orthogonal: its transpose is the rotation by the opposite angle.
void ReferenceBackend::rope_backward(Tensor dqkv, Tensor positions, Tensor cos_sin, const RopeShape& r) {
  dispatch_float(dqkv, "rope_backward",
                 [&](auto tag) { rope_apply<decltype(tag)>(pool_, dqkv, positions, cos_sin, r, -1.0); });
}

namespace {

void check_mla(const char* what, Tensor qkv, Tensor q, Tensor kv, Tensor down, Tensor positions, Tensor cos_sin,
               const MlaShape& m) {
  const int64_t N = qkv.rows();
  check_mla_qkv_args(what, qkv, q, kv, down, positions, cos_sin, m);
  const int32_t* pos = positions.ptr<int32_t>();
  for (int64_t n = 0; n < N; ++n)  // checked here: worker threads must not throw
    MT_CHECK(pos[n] >= 0 && pos[n] < cos_sin.rows(), "{}: position {} outside the table of {}", what, pos[n],
             cos_sin.rows());
}

// MLA's RoPE of one rope_dim vector x into y (sign -1: the transpose, y de-interleaved -> x layout).
void mla_rotate(const double* x, double* y, const Floats& table, int64_t pos, const MlaShape& m, double sign) {
  const int64_t half = m.rot_dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    const double c = table.get(pos * m.rot_dim + i), s = table.get(pos * m.rot_dim + half + i);
    if (sign > 0) {
      const double a = x[2 * i], b = x[2 * i + 1];
      y[i] = a * c - b * s;
      y[half + i] = b * c + a * s;
    } else {  // x holds the de-interleaved gradient; y gets the pairs back
      const double a = x[i], b = x[half + i];
      y[2 * i] = a * c + b * s;
      y[2 * i + 1] = b * c - a * s;
    }
  }
  for (int64_t i = m.rot_dim; i < m.rope_dim; ++i) y[i] = x[i];
}

}  // namespace

void ReferenceBackend::mla_qkv_forward(Tensor qkv, Tensor q, Tensor kv, Tensor down, Tensor positions, Tensor cos_sin,
                                       const MlaShape& m) {
  check_mla("mla_qkv_forward", qkv, q, kv, down, positions, cos_sin, m);
  const Floats table(cos_sin), fq(q), fkv(kv), fdown(down);
  const int32_t* pos = positions.ptr<int32_t>();
  const int64_t D = m.qk_dim(), dn = m.nope_dim, dr = m.rope_dim;
  dispatch_float(qkv, "mla_qkv_forward", [&](auto tag) {
    using T = decltype(tag);
    pool_.parallel_for(qkv.rows(), 8, [&](int64_t rb, int64_t re, int) {
      std::vector<double> x(static_cast<size_t>(dr)), kr(static_cast<size_t>(dr)), qr(static_cast<size_t>(dr));
      for (int64_t n = rb; n < re; ++n) {
        for (int64_t j = 0; j < dr; ++j) x[j] = fdown.get(n * down.cols() + m.kr_col + j);
        mla_rotate(x.data(), kr.data(), table, pos[n], m, 1.0);
        T* out = qkv.ptr<T>() + n * qkv.cols();
        for (int64_t h = 0; h < m.heads; ++h) {
          T* Q = out + h * 3 * D;
          T* K = Q + D;
          T* V = K + D;
          const int64_t qo = n * q.cols() + h * D, ko = n * kv.cols() + h * (dn + m.v_dim);
          for (int64_t j = 0; j < dn; ++j) Q[j] = static_cast<T>(fq.get(qo + j));
          for (int64_t j = 0; j < dr; ++j) x[j] = fq.get(qo + dn + j);
          mla_rotate(x.data(), qr.data(), table, pos[n], m, 1.0);
          for (int64_t j = 0; j < dr; ++j) Q[dn + j] = static_cast<T>(qr[j]);
          for (int64_t j = 0; j < dn; ++j) K[j] = static_cast<T>(fkv.get(ko + j));
          for (int64_t j = 0; j < dr; ++j) K[dn + j] = static_cast<T>(kr[j]);
          for (int64_t j = 0; j < D; ++j) V[j] = j < m.v_dim ? static_cast<T>(fkv.get(ko + dn + j)) : T(0);
        }
      }
    });
  });
}

void ReferenceBackend::mla_qkv_backward(Tensor dq, Tensor dkv, Tensor ddown, Tensor dqkv, Tensor positions,
                                        Tensor cos_sin, const MlaShape& m) {
  check_mla("mla_qkv_backward", dqkv, dq, dkv, ddown, positions, cos_sin, m);
  const Floats table(cos_sin), g(dqkv);
  const int32_t* pos = positions.ptr<int32_t>();
  const int64_t D = m.qk_dim(), dn = m.nope_dim, dr = m.rope_dim;
  dispatch_float(dq, "mla_qkv_backward", [&](auto tag) {
    using T = decltype(tag);
    pool_.parallel_for(dqkv.rows(), 8, [&](int64_t rb, int64_t re, int) {
      std::vector<double> y(static_cast<size_t>(dr)), x(static_cast<size_t>(dr)), kr(static_cast<size_t>(dr));
      for (int64_t n = rb; n < re; ++n) {
        std::fill(kr.begin(), kr.end(), 0.0);
        const int64_t row = n * dqkv.cols();
        T* Q = dq.ptr<T>() + n * dq.cols();
        T* KV = dkv.ptr<T>() + n * dkv.cols();
        for (int64_t h = 0; h < m.heads; ++h) {
          const int64_t o = row + h * 3 * D;
          for (int64_t j = 0; j < dn; ++j) Q[h * D + j] = static_cast<T>(g.get(o + j));
          for (int64_t j = 0; j < dr; ++j) y[j] = g.get(o + dn + j);
          mla_rotate(y.data(), x.data(), table, pos[n], m, -1.0);
          for (int64_t j = 0; j < dr; ++j) Q[h * D + dn + j] = static_cast<T>(x[j]);
          T* K = KV + h * (dn + m.v_dim);
          for (int64_t j = 0; j < dn; ++j) K[j] = static_cast<T>(g.get(o + D + j));
          for (int64_t j = 0; j < m.v_dim; ++j) K[dn + j] = static_cast<T>(g.get(o + 2 * D + j));
          for (int64_t j = 0; j < dr; ++j) y[j] = g.get(o + D + dn + j);
          mla_rotate(y.data(), x.data(), table, pos[n], m, -1.0);
          for (int64_t j = 0; j < dr; ++j) kr[j] += x[j];
        }
        T* K = ddown.ptr<T>() + n * ddown.cols() + m.kr_col;
        for (int64_t j = 0; j < dr; ++j) K[j] = static_cast<T>(kr[j]);
      }
    });
  });
}

}  // namespace mt::reference
