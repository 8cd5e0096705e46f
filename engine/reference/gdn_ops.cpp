// Gated DeltaNet's ops (engine/backend.h, GdnShape): the causal convolution, the gated delta rule
// position by position with its exact reverse-mode backward, and the output gate. Float64 math;
// each (sample, key head) is one task, its value heads looped inside it (they share q and k).
#include <cmath>
#include <vector>

#include "engine/gdn_shape_check.h"
#include "engine/reference/activation_math.h"
#include "engine/reference/reference_backend.h"
#include "engine/reference/tensor_access.h"

namespace mt::reference {

namespace {

double softplus(double x) { return x > 20.0 ? x : std::log1p(std::exp(x)); }
double silu(double x) { return x * sigmoid(x); }
double silu_grad(double x) {
  const double s = sigmoid(x);
  return s * (1.0 + x * (1.0 - s));
}

void check_gdn(const GdnShape& s, const char* op) { check_gdn_shape(s, op); }

void check_2d(const Tensor& t, int64_t rows, int64_t cols, const char* op, const char* what) {
  MT_CHECK(t.numel() == rows * cols, "{}: {} has {} elements, expected [{}, {}]", op, what, t.numel(), rows, cols);
}

// One (sample, value head)'s inputs at position t, read from xc, proj and the head's parameters.
struct Step {
  std::vector<double> q, k, u;  // q scaled, k normalized; u the values
  std::vector<double> xq, xk;   // q and k before their norms
  double rq = 0, rk = 0;        // 1 / sqrt(|x|^2 + eps) of q and k
  double beta = 0, a = 0, gl = 0, alpha_in = 0;
};

struct Reader {
  const GdnShape& s;
  Floats xc, proj, a_log, dt_bias;

  void load(Step& st, int64_t row, int v) const {
    const int g = v / s.rep();
    st.xq.resize(static_cast<size_t>(s.dk));
    st.xk.resize(static_cast<size_t>(s.dk));
    st.q.resize(static_cast<size_t>(s.dk));
    st.k.resize(static_cast<size_t>(s.dk));
    st.u.resize(static_cast<size_t>(s.dv));
    const int64_t base = row * s.conv_width();
    double sq = 0, sk = 0;
    for (int e = 0; e < s.dk; ++e) {
      st.xq[e] = xc.get(base + s.q_col(g) + e);
      st.xk[e] = xc.get(base + s.k_col(g) + e);
      sq += st.xq[e] * st.xq[e];
      sk += st.xk[e] * st.xk[e];
    }
    st.rq = 1.0 / std::sqrt(sq + s.l2_eps);
    st.rk = 1.0 / std::sqrt(sk + s.l2_eps);
    for (int e = 0; e < s.dk; ++e) {
      st.q[e] = st.xq[e] * st.rq * s.scale;
      st.k[e] = st.xk[e] * st.rk;
    }
    for (int e = 0; e < s.dv; ++e) st.u[e] = xc.get(base + s.v_col(v) + e);
    const int64_t prow = row * s.proj_width();
    st.beta = sigmoid(proj.get(prow + s.beta_col(v)));
    st.alpha_in = proj.get(prow + s.alpha_col(v)) + dt_bias.get(v);
    st.gl = -std::exp(a_log.get(v)) * softplus(st.alpha_in);
    st.a = std::exp(st.gl);
  }
};

// S = a S + k (beta (u - a S^T k))^T; writes S^T q into o (if given). S [dk, dv] row-major.
void step_forward(std::vector<double>& S, const Step& st, int dk, int dv, double* o) {
  for (double& x : S) x *= st.a;
  for (int j = 0; j < dv; ++j) {
    double p = 0;
    for (int e = 0; e < dk; ++e) p += S[static_cast<size_t>(e) * dv + j] * st.k[e];
    const double u = st.beta * (st.u[j] - p);
    for (int e = 0; e < dk; ++e) S[static_cast<size_t>(e) * dv + j] += st.k[e] * u;
  }
  if (o)
    for (int j = 0; j < dv; ++j) {
      double acc = 0;
      for (int e = 0; e < dk; ++e) acc += S[static_cast<size_t>(e) * dv + j] * st.q[e];
      o[j] = acc;
    }
}

}  // namespace

void ReferenceBackend::gdn_conv_forward(Tensor xc, Tensor proj, Tensor w, const GdnShape& s) {
  check_gdn(s, "gdn_conv_forward");
  const int64_t N = s.tokens(), C = s.conv_width(), K = s.conv_k;
  check_2d(xc, N, C, "gdn_conv_forward", "xc");
  check_2d(proj, N, s.proj_width(), "gdn_conv_forward", "proj");
  check_2d(w, C, K, "gdn_conv_forward", "w");
  const Floats out(xc), x(proj), wt(w);
  const int64_t B = s.batch, P = s.proj_width();
  pool_.parallel_for(N, 16, [&](int64_t b, int64_t e, int) {
    for (int64_t r = b; r < e; ++r) {
      const int64_t t = r / B;
      for (int64_t c = 0; c < C; ++c) {
        double acc = 0;
        for (int64_t j = 0; j < K; ++j) {
          const int64_t tt = t - (K - 1) + j;
          if (tt >= 0) acc += wt.get(c * K + j) * x.get((tt * B + r % B) * P + s.proj_col_of_conv(c));
        }
        out.set(r * C + c, silu(acc));
      }
    }
  });
}

void ReferenceBackend::gdn_conv_backward(Tensor dproj, Tensor dw, Tensor dxc, Tensor proj, Tensor w,
                                         const GdnShape& s, bool accumulate) {
  check_gdn(s, "gdn_conv_backward");
  const int64_t N = s.tokens(), C = s.conv_width(), K = s.conv_k, B = s.batch, P = s.proj_width();
  check_2d(dproj, N, P, "gdn_conv_backward", "dproj");
  check_2d(proj, N, P, "gdn_conv_backward", "proj");
  check_2d(dxc, N, C, "gdn_conv_backward", "dxc");
  check_2d(w, C, K, "gdn_conv_backward", "w");
  check_2d(dw, C, K, "gdn_conv_backward", "dw");
  const Floats dx(dproj), gw(dw), dy(dxc), x(proj), wt(w);
  // Per channel: the pre-activation's gradient along each sample, then both gradients.
  pool_.parallel_for(C, 1, [&](int64_t cb, int64_t ce, int) {
    std::vector<double> dpre(static_cast<size_t>(N));
    for (int64_t c = cb; c < ce; ++c) {
      const int64_t col = s.proj_col_of_conv(c);
      for (int64_t r = 0; r < N; ++r) {
        const int64_t t = r / B, i = r % B;
        double pre = 0;
        for (int64_t j = 0; j < K; ++j) {
          const int64_t tt = t - (K - 1) + j;
          if (tt >= 0) pre += wt.get(c * K + j) * x.get((tt * B + i) * P + col);
        }
        dpre[static_cast<size_t>(r)] = dy.get(r * C + c) * silu_grad(pre);
      }
      for (int64_t j = 0; j < K; ++j) {
        double acc = accumulate ? gw.get(c * K + j) : 0.0;
        for (int64_t r = 0; r < N; ++r) {
          const int64_t tt = r / B - (K - 1) + j;
          if (tt >= 0) acc += dpre[static_cast<size_t>(r)] * x.get((tt * B + r % B) * P + col);
        }
        gw.set(c * K + j, acc);
      }
      // Input position t' feeds outputs t' + K - 1 - j.
      for (int64_t r = 0; r < N; ++r) {
        const int64_t t = r / B, i = r % B;
        double acc = 0;
        for (int64_t j = 0; j < K; ++j) {
          const int64_t to = t + (K - 1) - j;
          if (to < s.seq) acc += wt.get(c * K + j) * dpre[static_cast<size_t>(to * B + i)];
        }
        dx.set(r * P + col, acc);
      }
    }
  });
}

void ReferenceBackend::gdn_forward(Tensor out, Tensor states, Tensor xc, Tensor proj, Tensor a_log, Tensor dt_bias,
                                   const GdnShape& s) {
  check_gdn(s, "gdn_forward");
  const int64_t N = s.tokens();
  check_2d(out, N, s.value_width(), "gdn_forward", "out");
  check_2d(xc, N, s.conv_width(), "gdn_forward", "xc");
  check_2d(proj, N, s.proj_width(), "gdn_forward", "proj");
  MT_CHECK(states.numel() == s.states_numel(), "gdn_forward: states has {} elements, expected {}", states.numel(),
           s.states_numel());
  MT_CHECK(a_log.numel() == s.value_heads && dt_bias.numel() == s.value_heads,
           "gdn_forward: a_log and dt_bias need {} values", s.value_heads);
  const Reader rd{s, Floats(xc), Floats(proj), Floats(a_log), Floats(dt_bias)};
  const Floats o(out), st_out(states);
  const int dk = s.dk, dv = s.dv;
  const int64_t SS = int64_t{dk} * dv;
  pool_.parallel_for(int64_t{s.batch} * s.value_heads, 1, [&](int64_t b, int64_t e, int) {
    std::vector<double> S(static_cast<size_t>(SS)), y(static_cast<size_t>(dv));
    Step st;
    for (int64_t task = b; task < e; ++task) {
      const int64_t i = task / s.value_heads;
      const int v = static_cast<int>(task % s.value_heads);
      std::fill(S.begin(), S.end(), 0.0);
      for (int64_t t = 0; t < s.seq; ++t) {
        if (t % GdnShape::kChunk == 0) {
          const int64_t at = (task * s.chunks() + t / GdnShape::kChunk) * SS;
          for (int64_t x = 0; x < SS; ++x) st_out.set(at + x, S[static_cast<size_t>(x)]);
        }
        const int64_t row = t * s.batch + i;
        rd.load(st, row, v);
        step_forward(S, st, dk, dv, y.data());
        for (int j = 0; j < dv; ++j) o.set(row * s.value_width() + int64_t{v} * dv + j, y[j]);
      }
    }
  });
}

void ReferenceBackend::gdn_backward(Tensor dxc, Tensor dproj, Tensor da_log, Tensor ddt_bias, Tensor dout,
                                    Tensor xc, Tensor proj, Tensor a_log, Tensor dt_bias, Tensor states,
                                    const GdnShape& s, bool accumulate) {
  check_gdn(s, "gdn_backward");
  const int64_t N = s.tokens();
  check_2d(dxc, N, s.conv_width(), "gdn_backward", "dxc");
  check_2d(xc, N, s.conv_width(), "gdn_backward", "xc");
  check_2d(dproj, N, s.proj_width(), "gdn_backward", "dproj");
  check_2d(proj, N, s.proj_width(), "gdn_backward", "proj");
  check_2d(dout, N, s.value_width(), "gdn_backward", "dout");
  MT_CHECK(states.numel() == s.states_numel(), "gdn_backward: states has {} elements, expected {}",
           states.numel(), s.states_numel());
  MT_CHECK(a_log.numel() == s.value_heads && dt_bias.numel() == s.value_heads && da_log.numel() == s.value_heads &&
               ddt_bias.numel() == s.value_heads,
           "gdn_backward: a_log, dt_bias and their gradients need {} values", s.value_heads);
  const Reader rd{s, Floats(xc), Floats(proj), Floats(a_log), Floats(dt_bias)};
  const Floats gxc(dxc), gproj(dproj), gy(dout), st_in(states);
  const int dk = s.dk, dv = s.dv, rep = s.rep();
  const int64_t SS = int64_t{dk} * dv, C = GdnShape::kChunk;
  // Per (sample, value head): d a_log and d dt_bias partials, summed over the samples afterwards.
  std::vector<double> dalog_part(static_cast<size_t>(s.batch) * s.value_heads),
      ddt_part(static_cast<size_t>(s.batch) * s.value_heads);
  // One task per (sample, key head): its value heads one after the other, adding into the shared
  // q and k gradients (float64 accumulators for the group, written at the end).
  pool_.parallel_for(int64_t{s.batch} * s.key_heads, 1, [&](int64_t tb, int64_t te, int) {
    std::vector<double> dq_acc, dk_acc;
    std::vector<std::vector<double>> Sprev(static_cast<size_t>(C), std::vector<double>(static_cast<size_t>(SS)));
    std::vector<double> S(static_cast<size_t>(SS)), dS(static_cast<size_t>(SS)), Sc(static_cast<size_t>(SS));
    std::vector<Step> steps(static_cast<size_t>(C));
    std::vector<double> dqn(static_cast<size_t>(dk)), dkn(static_cast<size_t>(dk)), du(static_cast<size_t>(dv)),
        dp(static_cast<size_t>(dv)), p(static_cast<size_t>(dv));
    for (int64_t task = tb; task < te; ++task) {
      const int64_t i = task / s.key_heads;
      const int g = static_cast<int>(task % s.key_heads);
      dq_acc.assign(static_cast<size_t>(s.seq * dk), 0.0);
      dk_acc.assign(static_cast<size_t>(s.seq * dk), 0.0);
      for (int v = g * rep; v < (g + 1) * rep; ++v) {
        const int64_t head_task = i * s.value_heads + v;
        double dalog = 0, ddt = 0;
        std::fill(dS.begin(), dS.end(), 0.0);
        for (int64_t c = s.chunks() - 1; c >= 0; --c) {
          const int64_t t0 = c * C, t1 = std::min<int64_t>(s.seq, t0 + C);
          // The chunk's states, recomputed from the one kept at its start.
          const int64_t at = (head_task * s.chunks() + c) * SS;
          for (int64_t x = 0; x < SS; ++x) S[static_cast<size_t>(x)] = st_in.get(at + x);
          for (int64_t t = t0; t < t1; ++t) {
            Step& st = steps[static_cast<size_t>(t - t0)];
            rd.load(st, t * s.batch + i, v);
            Sprev[static_cast<size_t>(t - t0)] = S;
            step_forward(S, st, dk, dv, nullptr);
          }
          // Backward through the chunk; S holds the state after position t.
          for (int64_t t = t1 - 1; t >= t0; --t) {
            const Step& st = steps[static_cast<size_t>(t - t0)];
            const std::vector<double>& Sp = Sprev[static_cast<size_t>(t - t0)];
            const int64_t row = t * s.batch + i;
            // The state after t: S after the recompute for the chunk's last position, else the
            // state before t + 1.
            if (t < t1 - 1) S = Sprev[static_cast<size_t>(t + 1 - t0)];
            // o = S^T q: dS += q do^T, dq = S do.
            for (int j = 0; j < dv; ++j) {
              const double d = gy.get(row * s.value_width() + int64_t{v} * dv + j);
              for (int e = 0; e < dk; ++e) dS[static_cast<size_t>(e) * dv + j] += st.q[e] * d;
            }
            for (int e = 0; e < dk; ++e) {
              double acc = 0;
              for (int j = 0; j < dv; ++j)
                acc += S[static_cast<size_t>(e) * dv + j] * gy.get(row * s.value_width() + int64_t{v} * dv + j);
              dqn[e] = acc * s.scale;
            }
            // S = S' + k u^T with S' = a Sp, p = S'^T k, u = beta (val - p).
            for (int j = 0; j < dv; ++j) {
              double acc = 0, pj = 0;
              for (int e = 0; e < dk; ++e) {
                acc += dS[static_cast<size_t>(e) * dv + j] * st.k[e];
                pj += st.a * Sp[static_cast<size_t>(e) * dv + j] * st.k[e];
              }
              du[j] = acc;
              p[j] = pj;
            }
            double dbeta = 0;
            for (int e = 0; e < dk; ++e) {
              double acc = 0;
              for (int j = 0; j < dv; ++j) acc += dS[static_cast<size_t>(e) * dv + j] * st.beta * (st.u[j] - p[j]);
              dkn[e] = acc;
            }
            for (int j = 0; j < dv; ++j) {
              gxc.set(row * s.conv_width() + s.v_col(v) + j, st.beta * du[j]);
              dbeta += du[j] * (st.u[j] - p[j]);
              dp[j] = -st.beta * du[j];
            }
            // dS' = dS + k dp^T; dk += S' dp; da = <dS', Sp>; dSp = a dS'.
            double da = 0;
            for (int e = 0; e < dk; ++e) {
              double acc = 0;
              for (int j = 0; j < dv; ++j) {
                const size_t x = static_cast<size_t>(e) * dv + j;
                acc += st.a * Sp[x] * dp[j];
                dS[x] += st.k[e] * dp[j];
                da += dS[x] * Sp[x];
                dS[x] *= st.a;
              }
              dkn[e] += acc;
            }
            const double dgl = da * st.a;
            dalog += dgl * st.gl;
            const double dalpha = dgl * -std::exp(rd.a_log.get(v)) * sigmoid(st.alpha_in);
            ddt += dalpha;
            const int64_t prow = row * s.proj_width();
            gproj.set(prow + s.alpha_col(v), dalpha);
            gproj.set(prow + s.beta_col(v), dbeta * st.beta * (1.0 - st.beta));
            // Through the l2 norms (q also through its scale, already in dqn).
            double qd = 0, kd = 0;
            for (int e = 0; e < dk; ++e) {
              qd += st.xq[e] * st.rq * dqn[e];
              kd += st.k[e] * dkn[e];
            }
            for (int e = 0; e < dk; ++e) {
              dq_acc[static_cast<size_t>(t * dk + e)] += st.rq * (dqn[e] - st.xq[e] * st.rq * qd);
              dk_acc[static_cast<size_t>(t * dk + e)] += st.rk * (dkn[e] - st.k[e] * kd);
            }
          }
        }
        dalog_part[static_cast<size_t>(head_task)] = dalog;
        ddt_part[static_cast<size_t>(head_task)] = ddt;
      }
      for (int64_t t = 0; t < s.seq; ++t) {
        const int64_t base = (t * s.batch + i) * s.conv_width();
        for (int e = 0; e < dk; ++e) {
          gxc.set(base + s.q_col(g) + e, dq_acc[static_cast<size_t>(t * dk + e)]);
          gxc.set(base + s.k_col(g) + e, dk_acc[static_cast<size_t>(t * dk + e)]);
        }
      }
    }
  });
  const Floats gal(da_log), gdt(ddt_bias);
  for (int v = 0; v < s.value_heads; ++v) {
    double a = accumulate ? gal.get(v) : 0.0, d = accumulate ? gdt.get(v) : 0.0;
    for (int i = 0; i < s.batch; ++i) {
      a += dalog_part[static_cast<size_t>(i) * s.value_heads + v];
      d += ddt_part[static_cast<size_t>(i) * s.value_heads + v];
    }
    gal.set(v, a);
    gdt.set(v, d);
  }
}

void ReferenceBackend::gdn_gate_forward(Tensor y, Tensor n, Tensor proj, const GdnShape& s) {
  check_gdn(s, "gdn_gate_forward");
  const int64_t N = s.tokens(), W = s.value_width();
  check_2d(y, N, W, "gdn_gate_forward", "y");
  check_2d(n, N, W, "gdn_gate_forward", "n");
  check_2d(proj, N, s.proj_width(), "gdn_gate_forward", "proj");
  const Floats out(y), x(n), z(proj);
  pool_.parallel_for(N, 16, [&](int64_t b, int64_t e, int) {
    for (int64_t r = b; r < e; ++r)
      for (int v = 0; v < s.value_heads; ++v)
        for (int j = 0; j < s.dv; ++j) {
          const int64_t at = r * W + int64_t{v} * s.dv + j;
          out.set(at, x.get(at) * silu(z.get(r * s.proj_width() + s.z_col(v) + j)));
        }
  });
}

void ReferenceBackend::gdn_gate_backward(Tensor dn, Tensor dproj, Tensor dy, Tensor n, Tensor proj,
                                         const GdnShape& s) {
  check_gdn(s, "gdn_gate_backward");
  const int64_t N = s.tokens(), W = s.value_width();
  check_2d(dn, N, W, "gdn_gate_backward", "dn");
  check_2d(dy, N, W, "gdn_gate_backward", "dy");
  check_2d(n, N, W, "gdn_gate_backward", "n");
  check_2d(proj, N, s.proj_width(), "gdn_gate_backward", "proj");
  check_2d(dproj, N, s.proj_width(), "gdn_gate_backward", "dproj");
  const Floats gn(dn), gz(dproj), g(dy), x(n), z(proj);
  pool_.parallel_for(N, 16, [&](int64_t b, int64_t e, int) {
    for (int64_t r = b; r < e; ++r)
      for (int v = 0; v < s.value_heads; ++v)
        for (int j = 0; j < s.dv; ++j) {
          const int64_t at = r * W + int64_t{v} * s.dv + j, zat = r * s.proj_width() + s.z_col(v) + j;
          const double d = g.get(at), zz = z.get(zat), xx = x.get(at);
          gz.set(zat, d * xx * silu_grad(zz));
          gn.set(at, d * silu(zz));
        }
  });
}

}  // namespace mt::reference
