// Gated DeltaNet's reference ops (engine/reference/gdn_ops.cpp): the recurrence against Megatron-
// LM's chunked algorithm (its deterministic-mode torch_chunk_gated_delta_rule, restated here in
// float64: a different computation of the same rule), states at chunk starts, and float64
// finite-difference gradients of every input of the convolution, the recurrence and the gate.
#include <catch2/catch.hpp>

#include <cmath>
#include <random>
#include <vector>

#include "engine/backend.h"
#include "tests/gradcheck.h"

using namespace mt;
using mt::test::Buf;

namespace {

GdnShape make_shape(int batch, int seq, int kh, int vh, int dk, int dv, int conv) {
  GdnShape s;
  s.batch = batch;
  s.seq = seq;
  s.key_heads = kh;
  s.value_heads = vh;
  s.dk = dk;
  s.dv = dv;
  s.conv_k = conv;
  s.scale = 1.0f / std::sqrt(static_cast<float>(dk));
  return s;
}

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }
double softplus(double x) { return std::log1p(std::exp(x)); }

// Megatron's chunked gated delta rule for one (sample, value head): inputs per position (q scaled
// and normalized, k normalized, v, beta, g = log decay), output [T, dv]. Chunks of C positions
// (the last zero-padded): within a chunk the WY form, T = (I + strictly-lower(diag(beta) K K^T *
// decay))^-1 by forward substitution; across chunks the state.
std::vector<double> chunked_rule(const std::vector<std::vector<double>>& q, const std::vector<std::vector<double>>& k,
                                 const std::vector<std::vector<double>>& v, const std::vector<double>& beta,
                                 const std::vector<double>& g, int C) {
  const int T = static_cast<int>(q.size()), dk = static_cast<int>(q[0].size()), dv = static_cast<int>(v[0].size());
  std::vector<double> out(static_cast<size_t>(T) * dv, 0.0);
  std::vector<double> S(static_cast<size_t>(dk) * dv, 0.0);
  for (int c0 = 0; c0 < T; c0 += C) {
    // Padded chunk inputs.
    auto at = [&](const std::vector<std::vector<double>>& x, int i, int e) {
      return c0 + i < T ? x[c0 + i][e] : 0.0;
    };
    std::vector<double> gc(C), b(C);
    double run = 0;
    for (int i = 0; i < C; ++i) {
      run += c0 + i < T ? g[c0 + i] : 0.0;
      gc[i] = run;  // cumulative log decay within the chunk
      b[i] = c0 + i < T ? beta[c0 + i] : 0.0;
    }
    // attn[i][j] = -(beta_i k_i . k_j) exp(gc_i - gc_j) for j < i, then the forward substitution.
    std::vector<std::vector<double>> A(C, std::vector<double>(C, 0.0));
    for (int i = 0; i < C; ++i)
      for (int j = 0; j < i; ++j) {
        double kk = 0;
        for (int e = 0; e < dk; ++e) kk += at(k, i, e) * at(k, j, e);
        A[i][j] = -b[i] * kk * std::exp(gc[i] - gc[j]);
      }
    for (int i = 1; i < C; ++i) {
      std::vector<double> row(A[i].begin(), A[i].begin() + i);
      for (int j = 0; j < i; ++j) {
        double add = 0;
        for (int m = 0; m < i; ++m) add += row[m] * A[m][j];
        A[i][j] = row[j] + add;
      }
    }
    for (int i = 0; i < C; ++i) A[i][i] = 1.0;
    // value = A @ (v * beta); k_cumdecay = A @ (k * beta * exp(gc)).
    std::vector<std::vector<double>> val(C, std::vector<double>(dv, 0.0)), kcd(C, std::vector<double>(dk, 0.0));
    for (int i = 0; i < C; ++i)
      for (int j = 0; j <= i; ++j) {
        for (int e = 0; e < dv; ++e) val[i][e] += A[i][j] * at(v, j, e) * b[j];
        for (int e = 0; e < dk; ++e) kcd[i][e] += A[i][j] * at(k, j, e) * b[j] * std::exp(gc[j]);
      }
    // v_new = value - k_cumdecay @ S; out = (q exp(gc)) @ S + (q k^T * decay, causal incl. diag) @ v_new.
    std::vector<std::vector<double>> vn(C, std::vector<double>(dv));
    for (int i = 0; i < C; ++i)
      for (int e = 0; e < dv; ++e) {
        double p = 0;
        for (int m = 0; m < dk; ++m) p += kcd[i][m] * S[static_cast<size_t>(m) * dv + e];
        vn[i][e] = val[i][e] - p;
      }
    for (int i = 0; i < C && c0 + i < T; ++i)
      for (int e = 0; e < dv; ++e) {
        double o = 0;
        for (int m = 0; m < dk; ++m) o += at(q, i, m) * std::exp(gc[i]) * S[static_cast<size_t>(m) * dv + e];
        for (int j = 0; j <= i; ++j) {
          double qk = 0;
          for (int m = 0; m < dk; ++m) qk += at(q, i, m) * at(k, j, m);
          o += qk * std::exp(gc[i] - gc[j]) * vn[j][e];
        }
        out[static_cast<size_t>(c0 + i) * dv + e] = o;
      }
    // S = S exp(gc_last) + (k * exp(gc_last - gc))^T @ v_new.
    const double last = gc[C - 1];
    for (int m = 0; m < dk; ++m)
      for (int e = 0; e < dv; ++e) {
        double s = S[static_cast<size_t>(m) * dv + e] * std::exp(last);
        for (int j = 0; j < C; ++j) s += at(k, j, m) * std::exp(last - gc[j]) * vn[j][e];
        S[static_cast<size_t>(m) * dv + e] = s;
      }
  }
  return out;
}

struct Inputs {
  GdnShape s;
  Buf proj, w, xc, a_log, dt_bias;
  Inputs(const GdnShape& shape, std::mt19937_64& rng) : s(shape) {
    proj = Buf::randn({s.tokens(), s.proj_width()}, rng);
    w = Buf::randn({s.conv_width(), s.conv_k}, rng, 0.5);
    xc = Buf::randn({s.tokens(), s.conv_width()}, rng);
    a_log = Buf::randn({s.value_heads}, rng, 0.5);
    dt_bias = Buf::randn({s.value_heads}, rng, 0.5);
  }
};

}  // namespace

TEST_CASE("gdn_forward equals Megatron's chunked gated delta rule, states at chunk starts", "[gdn][reference]") {
  auto be = make_reference_backend(2);
  std::mt19937_64 rng(7);
  for (const GdnShape& s : {make_shape(2, 70, 2, 4, 5, 3, 4), make_shape(3, 130, 1, 3, 4, 6, 3),
                            make_shape(1, 64, 2, 2, 8, 8, 4)}) {
    Inputs in(s, rng);
    Buf out = Buf::zeros({s.tokens(), s.value_width()}), states = Buf::zeros({s.states_numel()});
    be->gdn_forward(out.t(), states.t(), in.xc.t(), in.proj.t(), in.a_log.t(), in.dt_bias.t(), s);
    double worst = 0;
    for (int i = 0; i < s.batch; ++i)
      for (int v = 0; v < s.value_heads; ++v) {
        const int g = v / s.rep();
        std::vector<std::vector<double>> q(s.seq, std::vector<double>(s.dk)), k = q,
                                         u(s.seq, std::vector<double>(s.dv));
        std::vector<double> beta(s.seq), gl(s.seq);
        for (int t = 0; t < s.seq; ++t) {
          const int64_t row = int64_t{t} * s.batch + i;
          double nq = 0, nk = 0;
          for (int e = 0; e < s.dk; ++e) {
            q[t][e] = in.xc.d[row * s.conv_width() + s.q_col(g) + e];
            k[t][e] = in.xc.d[row * s.conv_width() + s.k_col(g) + e];
            nq += q[t][e] * q[t][e];
            nk += k[t][e] * k[t][e];
          }
          for (int e = 0; e < s.dk; ++e) {
            q[t][e] *= s.scale / std::sqrt(nq + s.l2_eps);
            k[t][e] /= std::sqrt(nk + s.l2_eps);
          }
          for (int e = 0; e < s.dv; ++e) u[t][e] = in.xc.d[row * s.conv_width() + s.v_col(v) + e];
          beta[t] = sigmoid(in.proj.d[row * s.proj_width() + s.beta_col(v)]);
          gl[t] = -std::exp(in.a_log.d[v]) * softplus(in.proj.d[row * s.proj_width() + s.alpha_col(v)] + in.dt_bias.d[v]);
        }
        const std::vector<double> ref = chunked_rule(q, k, u, beta, gl, 16);
        for (int t = 0; t < s.seq; ++t)
          for (int e = 0; e < s.dv; ++e)
            worst = std::max(worst, std::abs(ref[static_cast<size_t>(t) * s.dv + e] -
                                             out.d[(int64_t{t} * s.batch + i) * s.value_width() + int64_t{v} * s.dv + e]));
        // The state kept at a chunk start is the one the rule carries there: the first is zero,
        // and (where there is a second chunk) the output at its first position follows from it.
        const int64_t base = (int64_t{i} * s.value_heads + v) * s.chunks() * s.dk * s.dv;
        for (int64_t x = 0; x < int64_t{s.dk} * s.dv; ++x) CHECK(states.d[static_cast<size_t>(base + x)] == 0.0);
        if (s.chunks() > 1) {
          std::vector<std::vector<double>> q1(q.begin(), q.begin() + GdnShape::kChunk + 1),
              k1(k.begin(), k.begin() + GdnShape::kChunk + 1), u1(u.begin(), u.begin() + GdnShape::kChunk + 1);
          const std::vector<double> prefix = chunked_rule(q1, k1, u1, beta, gl, GdnShape::kChunk);
          // out at position kChunk = S_kChunk^T q with S_kChunk = a (S0 - beta k k^T S0) + beta k u^T,
          // S0 the kept state: recompute it from the kept state and compare.
          const int t = GdnShape::kChunk;
          const double a = std::exp(gl[t]);
          const double* S0 = &states.d[static_cast<size_t>(base + int64_t{s.dk} * s.dv)];
          for (int e = 0; e < s.dv; ++e) {
            double p = 0;
            for (int m = 0; m < s.dk; ++m) p += a * S0[m * s.dv + e] * k[t][m];
            const double du = beta[t] * (u[t][e] - p);
            double o = 0;
            for (int m = 0; m < s.dk; ++m) o += (a * S0[m * s.dv + e] + k[t][m] * du) * q[t][m];
            CHECK(o == Approx(prefix[static_cast<size_t>(t) * s.dv + e]).margin(1e-12));
          }
        }
      }
    INFO("batch " << s.batch << " seq " << s.seq << " heads " << s.key_heads << "/" << s.value_heads);
    CHECK(worst < 1e-11);
  }
}

TEST_CASE("gdn ops: float64 gradients of the convolution, the recurrence and the gate", "[gdn][reference][gradcheck]") {
  auto be = make_reference_backend(2);
  std::mt19937_64 rng(11);
  // A second chunk (seq 70 > 64) so that the backward's recompute from a kept state is exercised;
  // few heads and small dims keep the finite differences cheap.
  for (const GdnShape& s : {make_shape(2, 70, 1, 2, 3, 2, 3), make_shape(1, 9, 2, 4, 2, 3, 4)}) {
    INFO("seq " << s.seq << " heads " << s.key_heads << "/" << s.value_heads);
    Inputs in(s, rng);
    const int64_t N = s.tokens();
    // Convolution: L = <xc, R>.
    {
      Buf xc = Buf::zeros({N, s.conv_width()}), R = Buf::randn({N, s.conv_width()}, rng);
      auto loss = [&] {
        be->gdn_conv_forward(xc.t(), in.proj.t(), in.w.t(), s);
        return mt::test::dot(xc.d, R.d);
      };
      loss();
      Buf dproj = Buf::randn({N, s.proj_width()}, rng), dw = Buf::randn({s.conv_width(), s.conv_k}, rng);
      const Buf dproj0 = dproj, dw0 = dw;
      be->gdn_conv_backward(dproj.t(), dw.t(), R.t(), in.proj.t(), in.w.t(), s, true);
      // accumulate: dw's old values added; dproj's columns outside q, k, v untouched.
      std::vector<double> dw_new(dw.d.size());
      for (size_t x = 0; x < dw.d.size(); ++x) dw_new[x] = dw.d[x] - dw0.d[x];
      mt::test::check_gradient("conv dw", in.w.d, dw_new, loss, 1e-6, 1e-8, 1e-5, 3);
      std::vector<double> dx(dproj.d.size(), 0.0);
      for (int64_t r = 0; r < N; ++r)
        for (int64_t c = 0; c < s.proj_width(); ++c) {
          const bool conv_col = c % s.group_width() < s.conv_group_width();
          const size_t at = static_cast<size_t>(r * s.proj_width() + c);
          if (conv_col) dx[at] = dproj.d[at];
          else CHECK(dproj.d[at] == dproj0.d[at]);
        }
      mt::test::check_gradient("conv dproj", in.proj.d, dx, loss, 1e-6, 1e-8, 1e-5, 5);
      Buf dw2 = Buf::randn({s.conv_width(), s.conv_k}, rng);
      be->gdn_conv_backward(dproj.t(), dw2.t(), R.t(), in.proj.t(), in.w.t(), s, false);
      for (size_t x = 0; x < dw_new.size(); ++x) CHECK(dw2.d[x] == Approx(dw_new[x]).margin(1e-12));
    }
    // Recurrence: L = <out, R>.
    {
      Buf out = Buf::zeros({N, s.value_width()}), states = Buf::zeros({s.states_numel()});
      Buf R = Buf::randn({N, s.value_width()}, rng);
      auto loss = [&] {
        be->gdn_forward(out.t(), states.t(), in.xc.t(), in.proj.t(), in.a_log.t(), in.dt_bias.t(), s);
        return mt::test::dot(out.d, R.d);
      };
      loss();
      Buf dxc = Buf::zeros({N, s.conv_width()}), dproj = Buf::randn({N, s.proj_width()}, rng);
      Buf dal = Buf::zeros({s.value_heads}), ddt = Buf::zeros({s.value_heads});
      const Buf dproj0 = dproj;
      be->gdn_backward(dxc.t(), dproj.t(), dal.t(), ddt.t(), R.t(), in.xc.t(), in.proj.t(), in.a_log.t(),
                       in.dt_bias.t(), states.t(), s, false);
      mt::test::check_gradient("rule dxc", in.xc.d, dxc.d, loss, 1e-6, 1e-8, 1e-5, 3);
      mt::test::check_gradient("rule da_log", in.a_log.d, dal.d, loss);
      mt::test::check_gradient("rule ddt_bias", in.dt_bias.d, ddt.d, loss);
      std::vector<double> dgates(dproj.d.size(), 0.0);
      for (int64_t r = 0; r < N; ++r)
        for (int64_t c = 0; c < s.proj_width(); ++c) {
          const size_t at = static_cast<size_t>(r * s.proj_width() + c);
          const bool gate_col = c % s.group_width() >= s.conv_group_width() + int64_t{s.rep()} * s.dv;
          if (gate_col) dgates[at] = dproj.d[at];
          else CHECK(dproj.d[at] == dproj0.d[at]);
        }
      mt::test::check_gradient("rule dbeta/dalpha", in.proj.d, dgates, loss, 1e-6, 1e-8, 1e-5, 2);
      // accumulate adds to d a_log and d dt_bias.
      Buf dal2 = Buf::zeros({s.value_heads}), ddt2 = Buf::zeros({s.value_heads});
      for (auto* b : {&dal2, &ddt2}) std::fill(b->d.begin(), b->d.end(), 0.5);
      be->gdn_backward(dxc.t(), dproj.t(), dal2.t(), ddt2.t(), R.t(), in.xc.t(), in.proj.t(), in.a_log.t(),
                       in.dt_bias.t(), states.t(), s, true);
      for (int v = 0; v < s.value_heads; ++v) {
        CHECK(dal2.d[v] == Approx(dal.d[v] + 0.5).margin(1e-14));
        CHECK(ddt2.d[v] == Approx(ddt.d[v] + 0.5).margin(1e-14));
      }
    }
    // Gate: L = <y, R>, y = n * silu(z).
    {
      Buf n = Buf::randn({N, s.value_width()}, rng), y = Buf::zeros({N, s.value_width()});
      Buf R = Buf::randn({N, s.value_width()}, rng);
      auto loss = [&] {
        be->gdn_gate_forward(y.t(), n.t(), in.proj.t(), s);
        return mt::test::dot(y.d, R.d);
      };
      loss();
      Buf dn = Buf::zeros({N, s.value_width()}), dproj = Buf::randn({N, s.proj_width()}, rng);
      be->gdn_gate_backward(dn.t(), dproj.t(), R.t(), n.t(), in.proj.t(), s);
      mt::test::check_gradient("gate dn", n.d, dn.d, loss);
      std::vector<double> dz(dproj.d.size(), 0.0);
      for (int64_t r = 0; r < N; ++r)
        for (int v = 0; v < s.value_heads; ++v)
          for (int e = 0; e < s.dv; ++e) {
            const size_t at = static_cast<size_t>(r * s.proj_width() + s.z_col(v) + e);
            dz[at] = dproj.d[at];
          }
      mt::test::check_gradient("gate dz", in.proj.d, dz, loss, 1e-6, 1e-8, 1e-5, 2);
      // In place (dn over dy), as the model runs it.
      Buf d2 = R;
      be->gdn_gate_backward(d2.t(), dproj.t(), d2.t(), n.t(), in.proj.t(), s);
      CHECK(d2.d == dn.d);
    }
  }
}
