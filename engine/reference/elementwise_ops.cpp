// ReferenceBackend: activations, the attention output gate and dropout.
#include <cstring>
#include <utility>

#include "engine/dropout_mask.h"
#include "engine/reference/activation_math.h"
#include "engine/reference/reference_backend.h"
#include "engine/reference/tensor_access.h"

namespace mt::reference {

namespace {
constexpr int64_t kBlock = 1 << 13;  // elements per thread block at least
}

void ReferenceBackend::activation_forward(Tensor out, Tensor in, Activation act) {
  MT_CHECK(act != Activation::none, "activation_forward needs an activation");
  check_numel(out, in.numel(), "activation_forward", "out");
  check_same_dtype(in, out, "activation_forward");
  dispatch_float(in, "activation_forward", [&](auto tag) {
    using T = decltype(tag);
    const T* x = in.ptr<T>();
    T* y = out.ptr<T>();
    pool_.parallel_for(in.numel(), kBlock, [&](int64_t b, int64_t e, int) {
      for (int64_t i = b; i < e; ++i) y[i] = static_cast<T>(activate(act, x[i]));
    });
  });
}

void ReferenceBackend::activation_backward(Tensor din, Tensor dout, Tensor in, Activation act) {
  MT_CHECK(act != Activation::none, "activation_backward needs an activation");
  check_numel(din, in.numel(), "activation_backward", "din");
  check_numel(dout, in.numel(), "activation_backward", "dout");
  check_same_dtype(in, din, "activation_backward");
  check_same_dtype(in, dout, "activation_backward");
  dispatch_float(in, "activation_backward", [&](auto tag) {
    using T = decltype(tag);
    const T* x = in.ptr<T>();
    const T* dy = dout.ptr<T>();
    T* dx = din.ptr<T>();
    pool_.parallel_for(in.numel(), kBlock, [&](int64_t b, int64_t e, int) {
      for (int64_t i = b; i < e; ++i) dx[i] = static_cast<T>(static_cast<double>(dy[i]) * activation_grad(act, x[i]));
    });
  });
}

void ReferenceBackend::swiglu_forward(Tensor out, Tensor in, const Glu& q) {
  const int64_t rows = in.rows(), f = in.cols() / 2;
  MT_CHECK(in.cols() % 2 == 0, "swiglu_forward: odd input width {}", in.cols());
  check_numel(out, rows * f, "swiglu_forward", "out");
  check_same_dtype(in, out, "swiglu_forward");
  const bool plain = q.plain();
  dispatch_float(in, "swiglu_forward", [&](auto tag) {
    using T = decltype(tag);
    pool_.parallel_for(rows, 16, [&](int64_t b, int64_t e, int) {
      for (int64_t r = b; r < e; ++r) {
        const T* gate = in.ptr<T>() + r * 2 * f;
        const T* up = gate + f;
        T* y = out.ptr<T>() + r * f;
        for (int64_t c = 0; c < f; ++c) {
          const double g = gate[c];
          y[c] = plain ? static_cast<T>(g * sigmoid(g) * static_cast<double>(up[c]))
                       : static_cast<T>(glu_eval(q, g, static_cast<double>(up[c])).y);
        }
      }
    });
  });
}

void ReferenceBackend::swiglu_backward(Tensor din, Tensor dout, Tensor in, const Glu& q) {
  swiglu_backward_rows(din, Tensor(), dout, in, q, "swiglu_backward");
}

// Element by element (gate, up and dy of column c read before anything of c is written), so din
// may alias in and act_out may alias dout. act_out repeats swiglu_forward's expression exactly.
void ReferenceBackend::swiglu_backward_recompute(Tensor din, Tensor act_out, Tensor dout, Tensor in, const Glu& q) {
  swiglu_backward_rows(din, act_out, dout, in, q, "swiglu_backward_recompute");
}

// Both of the above; act_out (swiglu(in), written only if given) comes along for free.
void ReferenceBackend::swiglu_backward_rows(Tensor din, Tensor act_out, Tensor dout, Tensor in, const Glu& q,
                                            const char* op) {
  const int64_t rows = in.rows(), f = in.cols() / 2;
  const bool recompute = !act_out.empty(), plain = q.plain();
  check_numel(din, in.numel(), op, "din");
  check_numel(dout, rows * f, op, "dout");
  check_same_dtype(in, din, op);
  check_same_dtype(in, dout, op);
  if (recompute) {
    check_numel(act_out, rows * f, op, "act_out");
    check_same_dtype(in, act_out, op);
  }
  dispatch_float(in, op, [&](auto tag) {
    using T = decltype(tag);
    pool_.parallel_for(rows, 16, [&](int64_t b, int64_t e, int) {
      for (int64_t r = b; r < e; ++r) {
        const T* gate = in.ptr<T>() + r * 2 * f;
        const T* up = gate + f;
        const T* dy = dout.ptr<T>() + r * f;
        T* dgate = din.ptr<T>() + r * 2 * f;
        T* dup = dgate + f;
        T* y = recompute ? act_out.ptr<T>() + r * f : nullptr;
        for (int64_t c = 0; c < f; ++c) {
          const double g = gate[c], u = up[c], d = dy[c];
          if (!plain) {
            const GluEval v = glu_eval(q, g, u);
            // (+ 0.0: a clamped half's gradient is +0 whatever the sign of d, as the GPU's.)
            dgate[c] = static_cast<T>(d * v.dgate + 0.0);
            dup[c] = static_cast<T>(d * v.dup + 0.0);
            if (y) y[c] = static_cast<T>(v.y);
            continue;
          }
          const double s = sigmoid(g);
          const T act = y ? static_cast<T>(g * sigmoid(g) * static_cast<double>(up[c])) : T(0);
          dgate[c] = static_cast<T>(d * u * s * (1.0 + g * (1.0 - s)));
          dup[c] = static_cast<T>(d * g * s);
          if (y) y[c] = act;
        }
      }
    });
  });
}

void ReferenceBackend::bias_dropout_add(Tensor out, Tensor x, Tensor bias, Tensor residual, float dropout_p,
                                        uint64_t dropout_key) {
  const int64_t n = x.numel(), cols = x.cols();
  check_numel(out, n, "bias_dropout_add", "out");
  check_numel(residual, n, "bias_dropout_add", "residual");
  if (!bias.empty()) check_numel(bias, cols, "bias_dropout_add", "bias");
  check_same_dtype(x, out, "bias_dropout_add");
  check_same_dtype(x, residual, "bias_dropout_add");
  check_same_dtype(x, bias, "bias_dropout_add");
  dispatch_float(x, "bias_dropout_add", [&](auto tag) {
    using T = decltype(tag);
    const T* px = x.ptr<T>();
    const T* pb = bias.empty() ? nullptr : bias.ptr<T>();
    const T* pr = residual.ptr<T>();
    T* po = out.ptr<T>();
    const T scale = dropout_p > 0 ? T(1) / (T(1) - static_cast<T>(dropout_p)) : T(1);
    pool_.parallel_for(n, kBlock, [&](int64_t b, int64_t e, int) {
      for (int64_t i = b; i < e; ++i) {
        T v = pb ? px[i] + pb[i % cols] : px[i];
        if (dropout_p > 0) v = dropout_keep(dropout_key, static_cast<uint64_t>(i), dropout_p) ? v * scale : T(0);
        po[i] = pr[i] + v;
      }
    });
  });
}

void ReferenceBackend::dropout_backward(Tensor dx, Tensor dout, float dropout_p, uint64_t dropout_key, Tensor dx_amax) {
  const int64_t n = dout.numel();
  check_numel(dx, n, "dropout_backward", "dx");
  check_same_dtype(dout, dx, "dropout_backward");
  dispatch_float(dout, "dropout_backward", [&](auto tag) {
    using T = decltype(tag);
    const T* dy = dout.ptr<T>();
    T* d = dx.ptr<T>();
    const T scale = dropout_p > 0 ? T(1) / (T(1) - static_cast<T>(dropout_p)) : T(1);
    pool_.parallel_for(n, kBlock, [&](int64_t b, int64_t e, int) {
      for (int64_t i = b; i < e; ++i) {
        if (dropout_p > 0) d[i] = dropout_keep(dropout_key, static_cast<uint64_t>(i), dropout_p) ? dy[i] * scale : T(0);
        else d[i] = dy[i];
      }
    });
  });
  max_abs_into(dx_amax, dx, "dropout_backward");
}

}  // namespace mt::reference

namespace mt::reference {

namespace {

// Copies between the gated projection's rows and the separate [q | k | v] and gate rows, either way.
void gate_copy(Tensor qkvg, Tensor qkv, Tensor gate, const GateShape& s, bool split, const char* op) {
  const int64_t rows = qkvg.rows();
  MT_CHECK(qkvg.cols() == s.qkvg_width(), "{}: qkvg {} is not [rows, {}]", op, qkvg.shape_string(), s.qkvg_width());
  check_numel(qkv, rows * s.qkv_width(), op, "qkv");
  check_numel(gate, rows * s.gate_width(), op, "gate");
  check_same_dtype(qkvg, qkv, op);
  check_same_dtype(qkvg, gate, op);
  const size_t es = dtype_size(qkvg.dtype);
  const int64_t q = static_cast<int64_t>(s.q_per_group) * s.head_dim, kv = 2 * static_cast<int64_t>(s.head_dim);
  auto* all = static_cast<char*>(qkvg.data);
  auto* parts = static_cast<char*>(qkv.data);
  auto* gates = static_cast<char*>(gate.data);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < s.groups; ++g) {
      char* src = all + (r * s.qkvg_width() + g * (2 * q + kv)) * static_cast<int64_t>(es);
      char* qkv_at = parts + (r * s.qkv_width() + g * (q + kv)) * static_cast<int64_t>(es);
      char* gate_at = gates + (r * s.gate_width() + g * q) * static_cast<int64_t>(es);
      const std::pair<char*, char*> moves[3] = {{src, qkv_at}, {src + q * es, gate_at}, {src + 2 * q * es, qkv_at + q * es}};
      const int64_t counts[3] = {q, q, kv};
      for (int i = 0; i < 3; ++i) {
        const size_t bytes = static_cast<size_t>(counts[i]) * es;
        if (split) std::memcpy(moves[i].second, moves[i].first, bytes);
        else std::memcpy(moves[i].first, moves[i].second, bytes);
      }
    }
}

}  // namespace

void ReferenceBackend::attention_gate_split(Tensor qkv, Tensor gate, Tensor qkvg, const GateShape& s) {
  gate_copy(qkvg, qkv, gate, s, true, "attention_gate_split");
}

void ReferenceBackend::attention_gate_merge(Tensor qkvg, Tensor qkv, Tensor gate, const GateShape& s) {
  gate_copy(qkvg, qkv, gate, s, false, "attention_gate_merge");
}

void ReferenceBackend::output_gate_forward(Tensor out, Tensor x, Tensor gate) {
  check_numel(out, x.numel(), "output_gate_forward", "out");
  check_numel(gate, x.numel(), "output_gate_forward", "gate");
  check_same_dtype(x, out, "output_gate_forward");
  check_same_dtype(x, gate, "output_gate_forward");
  dispatch_float(x, "output_gate_forward", [&](auto tag) {
    using T = decltype(tag);
    const T *xs = x.ptr<T>(), *gs = gate.ptr<T>();
    T* y = out.ptr<T>();
    pool_.parallel_for(x.numel(), kBlock, [&](int64_t b, int64_t e, int) {
      for (int64_t i = b; i < e; ++i) y[i] = static_cast<T>(static_cast<double>(xs[i]) * sigmoid(static_cast<double>(gs[i])));
    });
  });
}

void ReferenceBackend::output_gate_backward(Tensor dx, Tensor dgate, Tensor dout, Tensor x, Tensor gate) {
  for (const Tensor* t : {&dx, &dgate, &dout, &gate}) {
    check_numel(*t, x.numel(), "output_gate_backward", "an operand");
    check_same_dtype(x, *t, "output_gate_backward");
  }
  dispatch_float(x, "output_gate_backward", [&](auto tag) {
    using T = decltype(tag);
    const T *xs = x.ptr<T>(), *dy = dout.ptr<T>();
    T *gs = gate.ptr<T>(), *dxs = dx.ptr<T>(), *dgs = dgate.ptr<T>();
    pool_.parallel_for(x.numel(), kBlock, [&](int64_t b, int64_t e, int) {
      for (int64_t i = b; i < e; ++i) {
        const double s = sigmoid(static_cast<double>(gs[i])), d = static_cast<double>(dy[i]), v = static_cast<double>(xs[i]);
        dxs[i] = static_cast<T>(d * s);
        dgs[i] = static_cast<T>(d * v * s * (1.0 - s));
      }
    });
  });
}

}  // namespace mt::reference
