// Float64 gradient checks: LayerNorm / RMSNorm (plain, fused residual add, per-head qk norm).
#include "engine/backend.h"
#include "tests/gradcheck.h"

using namespace mt;
using mt::test::Buf;

namespace {

NormParams norm_params(Normalization kind, bool one_p) {
  NormParams p;
  p.kind = kind;
  p.eps = 1e-5f;
  p.one_p = one_p;
  return p;
}

}  // namespace

TEST_CASE("reference norm_forward/backward gradients (LayerNorm, RMSNorm, 1p)", "[reference][gradcheck]") {
  auto be = make_reference_backend(2);
  std::mt19937_64 rng(11);
  const int64_t R = 5, C = 7;
  for (Normalization kind : {Normalization::layernorm, Normalization::rmsnorm}) {
    for (bool one_p : {false, true}) {
      const NormParams p = norm_params(kind, one_p);
      const bool has_bias = kind == Normalization::layernorm;
      Buf x = Buf::randn({R, C}, rng, 2.0), w = Buf::randn({C}, rng), b = Buf::randn({C}, rng);
      for (auto& v : x.d) v += 0.5;  // a non-zero mean
      Buf out = Buf::zeros({R, C}), mean = Buf::zeros({R}), rstd = Buf::zeros({R});
      Buf dout = Buf::randn({R, C}, rng), dres = Buf::randn({R, C}, rng);
      auto loss = [&] {
        be->norm_forward(out.t(), mean.t(), rstd.t(), x.t(), w.t(), has_bias ? b.t() : Tensor(), p);
        return mt::test::dot(out.d, dout.d);
      };
      loss();
      Buf dx = Buf::zeros({R, C}), dw = Buf::zeros({C}), db = Buf::zeros({C});
      be->norm_backward(dx.t(), dw.t(), has_bias ? db.t() : Tensor(), dout.t(), x.t(), mean.t(), rstd.t(), w.t(),
                        dres.t(), Tensor(), p);
      // dresidual is added to dx.
      std::vector<double> dx_only(dx.d);
      for (size_t k = 0; k < dx_only.size(); ++k) dx_only[k] -= dres.d[k];
      const std::string tag = std::string(kind == Normalization::layernorm ? "layernorm" : "rmsnorm") +
                              (one_p ? " 1p" : "");
      mt::test::check_gradient(tag + " dx", x.d, dx_only, loss);
      mt::test::check_gradient(tag + " dweight", w.d, dw.d, loss);
      if (has_bias) mt::test::check_gradient(tag + " dbias", b.d, db.d, loss);

      // Parameter grads accumulate; dx may alias dout.
      be->norm_backward(dout.t(), dw.t(), has_bias ? db.t() : Tensor(), dout.t(), x.t(), mean.t(), rstd.t(), w.t(),
                        Tensor(), Tensor(), p);
      mt::test::require_close(dout.d, dx_only, 1e-12, 1e-12, tag + " aliased dx");
    }
  }
}

TEST_CASE("reference norm: forward values of LayerNorm and RMSNorm", "[reference]") {
  auto be = make_reference_backend(1);
  Buf x = Buf::zeros({1, 4}), w = Buf::zeros({4}), b = Buf::zeros({4});
  x.d = {1, 2, 3, 4};
  w.d = {1, 1, 2, 0};
  b.d = {0, 1, 0, 0};
  Buf out = Buf::zeros({1, 4}), mean = Buf::zeros({1}), rstd = Buf::zeros({1});
  NormParams p;
  p.eps = 0;
  be->norm_forward(out.t(), mean.t(), rstd.t(), x.t(), w.t(), b.t(), p);
  const double sd = std::sqrt(1.25);
  CHECK(mean.d[0] == Approx(2.5));
  CHECK(rstd.d[0] == Approx(1 / sd));
  CHECK(out.d[0] == Approx(-1.5 / sd));
  CHECK(out.d[1] == Approx(-0.5 / sd + 1));
  CHECK(out.d[2] == Approx(2 * 0.5 / sd));
  CHECK(out.d[3] == Approx(0.0));
  p.kind = Normalization::rmsnorm;
  p.one_p = true;  // weight stored as gamma - 1
  be->norm_forward(out.t(), Tensor(), rstd.t(), x.t(), w.t(), Tensor(), p);
  const double rms = std::sqrt((1 + 4 + 9 + 16) / 4.0);
  CHECK(out.d[0] == Approx(1 / rms * 2));
  CHECK(out.d[3] == Approx(4 / rms * 1));
}

TEST_CASE("reference add_norm_forward gradients (residual add with dropout, then norm)", "[reference][gradcheck]") {
  auto be = make_reference_backend(2);
  std::mt19937_64 rng(12);
  const int64_t R = 4, C = 6;
  for (float p_drop : {0.0f, 0.3f}) {
    NormParams p = norm_params(Normalization::layernorm, false);
    Buf a = Buf::randn({R, C}, rng), bb = Buf::randn({R, C}, rng), w = Buf::randn({C}, rng), bias = Buf::randn({C}, rng);
    Buf sum = Buf::zeros({R, C}), out = Buf::zeros({R, C}), mean = Buf::zeros({R}), rstd = Buf::zeros({R});
    Buf dout = Buf::randn({R, C}, rng), dsum = Buf::randn({R, C}, rng);
    const uint64_t key = 77;
    auto loss = [&] {
      be->add_norm_forward(sum.t(), out.t(), mean.t(), rstd.t(), a.t(), bb.t(), p_drop, key, w.t(), bias.t(), p);
      return mt::test::dot(out.d, dout.d) + mt::test::dot(sum.d, dsum.d);
    };
    loss();
    // d/da = norm_backward( Tensor(),dout) + dsum; d/db = dropout_backward(d/da).
    Buf da = Buf::zeros({R, C}), db = Buf::zeros({R, C}), dw = Buf::zeros({C}), dbias = Buf::zeros({C});
    be->norm_backward(da.t(), dw.t(), dbias.t(), dout.t(), sum.t(), mean.t(), rstd.t(), w.t(), dsum.t(), Tensor(), p);
    be->dropout_backward(db.t(), da.t(), p_drop, key);
    mt::test::check_gradient("add_norm da", a.d, da.d, loss);
    mt::test::check_gradient("add_norm db", bb.d, db.d, loss);
    mt::test::check_gradient("add_norm dweight", w.d, dw.d, loss);
    mt::test::check_gradient("add_norm dbias", bias.d, dbias.d, loss);
    if (p_drop > 0) {
      int dropped = 0;
      for (double v : db.d) dropped += v == 0.0;
      CHECK(dropped > 0);
    }
  }
}

TEST_CASE("reference qk_norm_forward/backward gradients", "[reference][gradcheck]") {
  auto be = make_reference_backend(2);
  std::mt19937_64 rng(13);
  RopeShape r;
  r.heads = 4;
  r.groups = 2;
  r.head_dim = 3;
  const int64_t N = 3, row = r.groups * (r.heads / r.groups + 2) * r.head_dim, H = r.groups * (r.heads / r.groups + 1);
  for (Normalization kind : {Normalization::layernorm, Normalization::rmsnorm}) {
    const NormParams p = norm_params(kind, false);
    const bool ln = kind == Normalization::layernorm;
    Buf qkv = Buf::randn({N, row}, rng), qw = Buf::randn({r.head_dim}, rng), kw = Buf::randn({r.head_dim}, rng);
    Buf qb = Buf::randn({r.head_dim}, rng), kb = Buf::randn({r.head_dim}, rng);
    Buf out = Buf::zeros({N, row}), mean = Buf::zeros({N, H}), rstd = Buf::zeros({N, H}), dout = Buf::randn({N, row}, rng);
    auto loss = [&] {
      be->qk_norm_forward(out.t(), mean.t(), rstd.t(), qkv.t(), qw.t(), ln ? qb.t() : Tensor(), kw.t(),
                          ln ? kb.t() : Tensor(), r, p);
      return mt::test::dot(out.d, dout.d);
    };
    loss();
    Buf dqkv = Buf::zeros({N, row}), dqw = Buf::zeros({r.head_dim}), dkw = Buf::zeros({r.head_dim});
    Buf dqb = Buf::zeros({r.head_dim}), dkb = Buf::zeros({r.head_dim});
    be->qk_norm_backward(dqkv.t(), dqw.t(), ln ? dqb.t() : Tensor(), dkw.t(), ln ? dkb.t() : Tensor(), dout.t(),
                         qkv.t(), mean.t(), rstd.t(), qw.t(), kw.t(), r, p);
    mt::test::check_gradient("qk_norm dqkv", qkv.d, dqkv.d, loss);
    mt::test::check_gradient("qk_norm dq_weight", qw.d, dqw.d, loss);
    mt::test::check_gradient("qk_norm dk_weight", kw.d, dkw.d, loss);
    if (ln) {
      mt::test::check_gradient("qk_norm dq_bias", qb.d, dqb.d, loss);
      mt::test::check_gradient("qk_norm dk_bias", kb.d, dkb.d, loss);
    }
    // v passes through unchanged.
    const int64_t hpg = r.heads / r.groups, d = r.head_dim;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t g = 0; g < r.groups; ++g)
        for (int64_t c = 0; c < d; ++c) {
          const int64_t o = n * row + g * (hpg + 2) * d + (hpg + 1) * d + c;
          CHECK(out.d[o] == qkv.d[o]);
        }
  }
}
