// CUDA vs reference: LayerNorm/RMSNorm forward (plain and fused with the residual add and
// dropout), backward (dx, deterministic dweight/dbias accumulation), and --qk-layernorm.
#include <cmath>

#include "tests/gpu/gpu_test_util.h"

using namespace mt;
using namespace mt::gputest;

namespace {
const DType kFloatTypes[] = {DType::f32, DType::bf16, DType::f16};
// Odd widths take the scalar path; 4099 the widest scalar instance; 8192 a 256-thread team. The
// 16-bit fast paths (aligned widths up to 2048): 16/48 one-warp teams, 768 a 96-thread team,
// 1536/2048 256 threads (1536 with idle threads); 512 and 1024 in the many-rows case below.
const int64_t kWidths[] = {16, 48, 100, 768, 1000, 1536, 2048, 2050, 4099, 8192};
const int64_t kRows[] = {1, 7, 333};

NormParams params(Normalization kind, bool one_p) {
  NormParams p;
  p.kind = kind;
  p.eps = 1e-5f;
  p.one_p = one_p;
  return p;
}

std::vector<double> weights(Rng& rng, int64_t h, bool one_p) {
  std::vector<double> w = rng.normal(h, 0.1);
  if (!one_p)
    for (double& x : w) x += 1.0;
  return w;
}

// Error of CUDA means against reference means relative to the inputs' scale (they are O(1)), not
// to the means themselves: a mean near zero (few values) has only an absolute error to speak of.
double mean_error(const Twin& got, const Twin& want) {
  const std::vector<double> g = download(dev(), got.c()), r = download(ref(), want.r());
  double num = 0, den = static_cast<double>(r.size());
  for (size_t k = 0; k < r.size(); ++k) num += (g[k] - r[k]) * (g[k] - r[k]), den += r[k] * r[k];
  return std::sqrt(num / den);
}

// A fused add + norm's output and rstd against the reference norm of the CUDA side's stored
// (rounded) sum: the reference's own sum is not rounded to 16 bits, which moves the statistics
// by more than their float32 tolerance.
void check_norm_of_stored_sum(const Twin& sum, const Twin& out, const Twin& rstd, const Twin& w, const Twin& b,
                              DType dt, int64_t rows, int64_t h, const NormParams& p) {
  Twin stored = twin(dt, {rows, h}, download(dev(), sum.c()));
  Twin out3 = twin_nan(dt, {rows, h}), mean3 = twin_nan(DType::f32, {rows}), rstd3 = twin_nan(DType::f32, {rows});
  ref().norm_forward(out3.r(), mean3.r(), rstd3.r(), stored.r(), w.r(), b.r(), p);
  const double e_out = rel_err(download(dev(), out.c()), download(ref(), out3.r()));
  const double e_rstd = rel_err(download(dev(), rstd.c()), download(ref(), rstd3.r()));
  INFO("fused add+norm: out " << e_out << " rstd " << e_rstd << " against the norm of the stored sum");
  CHECK(e_out <= tol_for(dt));
  CHECK(e_rstd <= 1e-5);
}

std::vector<double> shifted_normal(Rng& rng, int64_t n) {
  std::vector<double> v = rng.normal(n, 2.0);
  for (double& x : v) x += 0.5;  // a non-zero mean exercises the centring
  return v;
}
// A norm's input and weight on both backends, and the statistics of the reference's forward of
// them on both sides: what the backward tests read.
struct NormBackwardInputs {
  Twin x, w, mean, rstd;
};
NormBackwardInputs norm_backward_inputs(Rng& rng, DType dt, int64_t rows, int64_t h, bool one_p, const NormParams& p) {
  NormBackwardInputs in{twin(dt, {rows, h}, shifted_normal(rng, rows * h)), twin(dt, {h}, weights(rng, h, one_p)), {}, {}};
  Twin out = twin_nan(dt, {rows, h}), mean = twin_nan(DType::f32, {rows}), rstd = twin_nan(DType::f32, {rows});
  ref().norm_forward(out.r(), mean.r(), rstd.r(), in.x.r(), in.w.r(), Tensor(), p);
  in.mean = twin(DType::f32, {rows}, download(ref(), mean.r()));
  in.rstd = twin(DType::f32, {rows}, download(ref(), rstd.r()));
  return in;
}

// --qk-layernorm's set-up: 8 query heads in 2 groups of head_dim d over `rows` rows; the packed QKV
// input, the q and k norms' weights (and LayerNorm's biases) on both backends, and the forward's
// outputs (NaN until written).
struct QkNormCase {
  RopeShape r;
  int64_t width = 0, H = 0;  // QKV columns; normalized heads (q and k) per row
  NormParams p;
  Twin qkv, qw, kw, qb, kb, out, mean, rstd;
  // The reference forward's statistics, uploaded to both sides (the backward's inputs).
  std::pair<Twin, Twin> reference_stats(int64_t rows) const {
    ref().qk_norm_forward(out.r(), mean.r(), rstd.r(), qkv.r(), qw.r(), qb.r(), kw.r(), kb.r(), r, p);
    return {twin(DType::f32, {rows, H}, download(ref(), mean.r())), twin(DType::f32, {rows, H}, download(ref(), rstd.r()))};
  }
};
QkNormCase qk_norm_case(Rng& rng, Normalization kind, DType dt, int64_t rows, int d) {
  QkNormCase c;
  c.r.heads = 8, c.r.groups = 2, c.r.head_dim = d, c.r.rot_dim = d;
  c.width = c.r.groups * (c.r.heads / c.r.groups + 2) * d;
  c.H = c.r.groups * (c.r.heads / c.r.groups + 1);
  c.p = params(kind, false);
  const bool ln = kind == Normalization::layernorm;
  c.qkv = twin(dt, {rows, c.width}, shifted_normal(rng, rows * c.width));
  c.qw = twin(dt, {d}, weights(rng, d, false));
  c.kw = twin(dt, {d}, weights(rng, d, false));
  c.qb = ln ? twin(dt, {d}, rng.normal(d, 0.1)) : absent();
  c.kb = ln ? twin(dt, {d}, rng.normal(d, 0.1)) : absent();
  c.out = twin_nan(dt, {rows, c.width});
  c.mean = twin_nan(DType::f32, {rows, c.H});
  c.rstd = twin_nan(DType::f32, {rows, c.H});
  return c;
}

}  // namespace

TEST_CASE("cuda norm_forward and add_norm_forward match the reference", "[gpu][norm]") {
  MT_RNG(rng);
  for (Normalization kind : {Normalization::layernorm, Normalization::rmsnorm})
      for (DType dt : kFloatTypes)
        for (int64_t rows : kRows)
          for (int64_t h : kWidths) {
            const bool ln = kind == Normalization::layernorm;
            const bool one_p = (h + rows) % 2 == 1;  // --apply-layernorm-1p on about half the cases
            INFO((ln ? "layernorm " : "rmsnorm ") << (one_p ? "1p " : "") << dtype_name(dt) << " rows " << rows
                                                  << " h " << h);
            const NormParams p = params(kind, one_p);
            Twin x = twin(dt, {rows, h}, shifted_normal(rng, rows * h));
            Twin w = twin(dt, {h}, weights(rng, h, one_p));
            Twin b = ln ? twin(dt, {h}, rng.normal(h, 0.1)) : absent();
            Twin out = twin_nan(dt, {rows, h}), mean = twin_nan(DType::f32, {rows}), rstd = twin_nan(DType::f32, {rows});
            dev().norm_forward(out.c(), mean.c(), rstd.c(), x.c(), w.c(), b.c(), p);
            ref().norm_forward(out.r(), mean.r(), rstd.r(), x.r(), w.r(), b.r(), p);
            MT_CHECK_CLOSE(out, tol_for(dt));
            {
              const double e_mean = mean_error(mean, mean);  // same inputs: float32 vs float64 statistics
              INFO("mean: error " << e_mean << " of the inputs' scale (tolerance 1e-5)");
              CHECK(e_mean <= 1e-5);
            }
            MT_CHECK_CLOSE(rstd, 1e-5);

            for (float drop : {0.0f, 0.1f}) {
              INFO("add_norm dropout " << drop);
              const uint64_t key = rng.engine()();
              Twin a = twin(dt, {rows, h}, shifted_normal(rng, rows * h));
              Twin bb = twin(dt, {rows, h}, rng.normal(rows * h));
              Twin sum = twin_nan(dt, {rows, h}), out2 = twin_nan(dt, {rows, h});
              Twin mean2 = twin_nan(DType::f32, {rows}), rstd2 = twin_nan(DType::f32, {rows});
              dev().add_norm_forward(sum.c(), out2.c(), mean2.c(), rstd2.c(), a.c(), bb.c(), drop, key, w.c(), b.c(), p);
              ref().add_norm_forward(sum.r(), out2.r(), mean2.r(), rstd2.r(), a.r(), bb.r(), drop, key, w.r(), b.r(),
                                           p);
              MT_CHECK_CLOSE(sum, tol_for(dt));
              // The CUDA backend normalizes the stored sum (rounded to dt, as a separate add followed by
              // the norm would), so the oracle for the statistics and the output is the reference norm
              // of that stored sum: with the float32 reference sum instead, a mean near zero (16 values
              // of a 16-bit sum) turns the rounding of the sum into a large relative error of the mean.
              Twin stored = twin(dt, {rows, h}, download(dev(), sum.c()));
              Twin out3 = twin_nan(dt, {rows, h}), mean3 = twin_nan(DType::f32, {rows}), rstd3 = twin_nan(DType::f32, {rows});
              ref().norm_forward(out3.r(), mean3.r(), rstd3.r(), stored.r(), w.r(), b.r(), p);
              auto against = [&](const Twin& got, const Twin& want) {
                return rel_err(download(dev(), got.c()), download(ref(), want.r()));
              };
              const double e_out = against(out2, out3), e_mean = mean_error(mean2, mean3), e_rstd = against(rstd2, rstd3);
              INFO("add_norm out " << e_out << " mean " << e_mean << " rstd " << e_rstd);
              CHECK(e_out <= tol_for(dt));
              CHECK(e_mean <= 1e-5);  // same inputs: float32 vs float64 statistics
              CHECK(e_rstd <= 1e-5);
            }
          }
}

// dx_colsum: ds0 + the column sums of the dx the device stored (float32 accumulation), and the
// reference's within the same bound against its own dx.
static void check_dx_colsum(Twin& ds, const std::vector<double>& ds0, Twin& dx, int64_t rows, int64_t h) {
  for (bool device : {true, false}) {
    Backend& be = device ? dev() : ref();
    const std::vector<double> x = download(be, device ? dx.c() : dx.r()), got = download(be, device ? ds.c() : ds.r());
    int64_t bad = 0;
    for (int64_t c = 0; c < h; ++c) {
      double s = ds0[static_cast<size_t>(c)], mag = std::abs(s);
      for (int64_t r = 0; r < rows; ++r) {
        s += x[static_cast<size_t>(r * h + c)];
        mag += std::abs(x[static_cast<size_t>(r * h + c)]);
      }
      bad += !(std::abs(got[static_cast<size_t>(c)] - s) <= 1e-5 * mag + 1e-30);
    }
    INFO((device ? "cuda" : "reference") << " dx column sums");
    CHECK(bad == 0);
  }
}

TEST_CASE("cuda norm_backward matches the reference; dweight/dbias are deterministic", "[gpu][norm]") {
  MT_RNG(rng);
  for (Normalization kind : {Normalization::layernorm, Normalization::rmsnorm})
    for (DType dt : kFloatTypes)
      for (int64_t rows : kRows)
        for (int64_t h : kWidths) {
          const bool ln = kind == Normalization::layernorm;
          const bool one_p = h % 2 == 1;
          INFO((ln ? "layernorm " : "rmsnorm ") << dtype_name(dt) << " rows " << rows << " h " << h);
          const NormParams p = params(kind, one_p);
          NormBackwardInputs in = norm_backward_inputs(rng, dt, rows, h, one_p, p);
          const Twin &x = in.x, &w = in.w, &mean = in.mean, &rstd = in.rstd;
          const std::vector<double> dw0 = rng.normal(h), db0 = rng.normal(h);
          Twin dw = twin(DType::f32, {h}, dw0), db = ln ? twin(DType::f32, {h}, db0) : absent();
          Twin dout = twin(dt, {rows, h}, rng.normal(rows * h));
          Twin dres = twin(dt, {rows, h}, rng.normal(rows * h));
          Twin dx = twin_nan(dt, {rows, h});
          const std::vector<double> ds0 = rng.normal(h);
          Twin ds = twin(DType::f32, {h}, ds0);  // + dx's column sums (a bias gradient)
          dev().norm_backward(dx.c(), dw.c(), db.c(), dout.c(), x.c(), mean.c(), rstd.c(), w.c(), dres.c(), ds.c(), p);
          ref().norm_backward(dx.r(), dw.r(), db.r(), dout.r(), x.r(), mean.r(), rstd.r(), w.r(), dres.r(), ds.r(), p);
          MT_CHECK_CLOSE(dx, tol_for(dt));
          MT_CHECK_CLOSE(dw, 1e-5);  // float32 accumulators
          if (ln) MT_CHECK_CLOSE(db, 1e-5);
          check_dx_colsum(ds, ds0, dx, rows, h);

          // Determinism: the same accumulation again from the same start is bit-identical.
          const auto dw_first = download_bytes(dev(), dw.c());
          const auto dx_first = download_bytes(dev(), dx.c());
          upload(dev(), dw.c(), dw0);
          dev().fill(dx.c(), NAN);
          if (ln) upload(dev(), db.c(), db0);
          dev().norm_backward(dx.c(), dw.c(), db.c(), dout.c(), x.c(), mean.c(), rstd.c(), w.c(), dres.c(), Tensor(), p);
          CHECK(differing(download_bytes(dev(), dw.c()), dw_first, 4) == 0);
          CHECK(differing(download_bytes(dev(), dx.c()), dx_first, dtype_size(dt)) == 0);

          // dx in place over dout and over dresidual; no parameter gradients.
          dev().norm_backward(dout.c(), Tensor(), Tensor(), dout.c(), x.c(), mean.c(), rstd.c(), w.c(), Tensor(), Tensor(), p);
          ref().norm_backward(dout.r(), Tensor(), Tensor(), dout.r(), x.r(), mean.r(), rstd.r(), w.r(), Tensor(), Tensor(), p);
          MT_CHECK_CLOSE(dout, tol_for(dt));
          Twin dout2 = twin(dt, {rows, h}, rng.normal(rows * h));
          dev().norm_backward(dres.c(), Tensor(), Tensor(), dout2.c(), x.c(), mean.c(), rstd.c(), w.c(), dres.c(), Tensor(), p);
          ref().norm_backward(dres.r(), Tensor(), Tensor(), dout2.r(), x.r(), mean.r(), rstd.r(), w.r(), dres.r(), Tensor(),
                                    p);
          MT_CHECK_CLOSE(dres, tol_for(dt));

          // norm_backward_recompute: dx as norm_backward, and the forward's output again from x and
          // the saved statistics, bit for bit what norm_forward wrote (on each backend).
          Twin bias = ln ? twin(dt, {h}, rng.normal(h, 0.1)) : absent();
          Twin fo = twin_nan(dt, {rows, h}), fm = twin_nan(DType::f32, {rows}), fr = twin_nan(DType::f32, {rows});
          dev().norm_forward(fo.c(), fm.c(), fr.c(), x.c(), w.c(), bias.c(), p);
          ref().norm_forward(fo.r(), fm.r(), fr.r(), x.r(), w.r(), bias.r(), p);
          Twin rec = twin_nan(dt, {rows, h}), dx3 = twin_nan(dt, {rows, h});
          Twin dout3 = twin(dt, {rows, h}, rng.normal(rows * h)), dres3 = twin(dt, {rows, h}, rng.normal(rows * h));
          Twin dw3 = twin(DType::f32, {h}, dw0), db3 = ln ? twin(DType::f32, {h}, db0) : absent();
          dev().norm_backward_recompute(rec.c(), dx3.c(), dw3.c(), db3.c(), dout3.c(), x.c(), fm.c(), fr.c(), w.c(),
                                        bias.c(), dres3.c(), Tensor(), p);
          ref().norm_backward_recompute(rec.r(), dx3.r(), dw3.r(), db3.r(), dout3.r(), x.r(), fm.r(), fr.r(), w.r(),
                                        bias.r(), dres3.r(), Tensor(), p);
          CHECK(differing(download_bytes(dev(), rec.c()), download_bytes(dev(), fo.c()), dtype_size(dt)) == 0);
          CHECK(differing(download_bytes(ref(), rec.r()), download_bytes(ref(), fo.r()), 4) == 0);
          MT_CHECK_CLOSE(dx3, tol_for(dt));
          MT_CHECK_CLOSE(dw3, 1e-5);
          if (ln) MT_CHECK_CLOSE(db3, 1e-5);
        }
}

TEST_CASE("cuda qk_norm forward/backward match the reference", "[gpu][norm]") {
  MT_RNG(rng);
  for (Normalization kind : {Normalization::layernorm, Normalization::rmsnorm})
    for (DType dt : kFloatTypes)
      for (int64_t rows : {7, 333})
        for (int d : {36, 64, 128}) {
          const bool ln = kind == Normalization::layernorm;
          INFO((ln ? "layernorm " : "rmsnorm ") << dtype_name(dt) << " rows " << rows << " head_dim " << d);
          QkNormCase k = qk_norm_case(rng, kind, dt, rows, d);
          const RopeShape& r = k.r;
          const NormParams& p = k.p;
          const int64_t width = k.width;
          const Twin &qkv = k.qkv, &qw = k.qw, &kw = k.kw;
          dev().qk_norm_forward(k.out.c(), k.mean.c(), k.rstd.c(), qkv.c(), qw.c(), k.qb.c(), kw.c(), k.kb.c(), r, p);
          const auto [m, s] = k.reference_stats(rows);
          MT_CHECK_CLOSE(k.out, tol_for(dt));
          MT_CHECK_CLOSE(k.mean, 1e-5);
          MT_CHECK_CLOSE(k.rstd, 1e-5);

          Twin dout = twin(dt, {rows, width}, rng.normal(rows * width)), dqkv = twin_nan(dt, {rows, width});
          Twin dqw = twin(DType::f32, {d}, rng.normal(d)), dkw = twin(DType::f32, {d}, rng.normal(d));
          Twin dqb = ln ? twin(DType::f32, {d}, rng.normal(d)) : absent();
          Twin dkb = ln ? twin(DType::f32, {d}, rng.normal(d)) : absent();
          dev().qk_norm_backward(dqkv.c(), dqw.c(), dqb.c(), dkw.c(), dkb.c(), dout.c(), qkv.c(), m.c(), s.c(), qw.c(),
                                  kw.c(), r, p);
          ref().qk_norm_backward(dqkv.r(), dqw.r(), dqb.r(), dkw.r(), dkb.r(), dout.r(), qkv.r(), m.r(), s.r(),
                                       qw.r(), kw.r(), r, p);
          MT_CHECK_CLOSE(dqkv, tol_for(dt));
          MT_CHECK_CLOSE(dqw, 1e-5);
          MT_CHECK_CLOSE(dkw, 1e-5);
          if (ln) {
            MT_CHECK_CLOSE(dqb, 1e-5);
            MT_CHECK_CLOSE(dkb, 1e-5);
          }
          // In place (dqkv aliases dout).
          dev().qk_norm_backward(dout.c(), Tensor(), Tensor(), Tensor(), Tensor(), dout.c(), qkv.c(), m.c(), s.c(),
                                  qw.c(), kw.c(), r, p);
          ref().qk_norm_backward(dout.r(), Tensor(), Tensor(), Tensor(), Tensor(), dout.r(), qkv.r(), m.r(), s.r(),
                                       qw.r(), kw.r(), r, p);
          MT_CHECK_CLOSE(dout, tol_for(dt));
        }
}

// The 16-bit fast paths over many rows: every block walks several rows (the persistent loop, the
// next row's loads issued before the current row's reductions, the double-buffered team
// reductions); in the backward the teams' dweight/dbias are then combined and reduced across blocks.
TEST_CASE("cuda norms over many rows (16-bit fast paths: forward, fused add, backward)", "[gpu][norm]") {
  MT_RNG(rng);
  for (Normalization kind : {Normalization::layernorm, Normalization::rmsnorm})
    for (DType dt : {DType::bf16, DType::f16})
      for (int64_t h : {48, 512, 768, 1024, 2048}) {
        const int64_t rows = h == 48 ? 20011 : 4099;  // enough rows that every block walks several
        const bool ln = kind == Normalization::layernorm;
        const bool one_p = h == 768;
        INFO((ln ? "layernorm " : "rmsnorm ") << dtype_name(dt) << " rows " << rows << " h " << h);
        const NormParams p = params(kind, one_p);
        Twin x = twin(dt, {rows, h}, shifted_normal(rng, rows * h));
        Twin w = twin(dt, {h}, weights(rng, h, one_p));
        Twin bias = ln ? twin(dt, {h}, rng.normal(h, 0.1)) : absent();
        Twin fo = twin_nan(dt, {rows, h}), fm = twin_nan(DType::f32, {rows}), fr = twin_nan(DType::f32, {rows});
        dev().norm_forward(fo.c(), fm.c(), fr.c(), x.c(), w.c(), bias.c(), p);
        ref().norm_forward(fo.r(), fm.r(), fr.r(), x.r(), w.r(), bias.r(), p);
        MT_CHECK_CLOSE(fo, tol_for(dt));  // the fast forward too
        MT_CHECK_CLOSE(fr, 1e-5);
        {
          // The fused bias + dropout + residual + norm over many rows.
          const uint64_t key = rng.engine()();
          Twin res = twin(dt, {rows, h}, shifted_normal(rng, rows * h)), xx = twin(dt, {rows, h}, rng.normal(rows * h));
          Twin xb = twin(dt, {h}, rng.normal(h, 0.5));
          Twin sum = twin_nan(dt, {rows, h}), out = twin_nan(dt, {rows, h});
          Twin mean = twin_nan(DType::f32, {rows}), rstd = twin_nan(DType::f32, {rows});
          dev().bias_dropout_add_norm(sum.c(), out.c(), mean.c(), rstd.c(), res.c(), xx.c(), xb.c(), 0.1f, key, w.c(),
                                      bias.c(), p);
          ref().bias_dropout_add_norm(sum.r(), out.r(), mean.r(), rstd.r(), res.r(), xx.r(), xb.r(), 0.1f, key, w.r(),
                                      bias.r(), p);
          MT_CHECK_CLOSE(sum, tol_for(dt));
          check_norm_of_stored_sum(sum, out, rstd, w, bias, dt, rows, h, p);
        }
        const std::vector<double> dw0 = rng.normal(h), db0 = rng.normal(h);
        Twin dw = twin(DType::f32, {h}, dw0), db = ln ? twin(DType::f32, {h}, db0) : absent();
        Twin dout = twin(dt, {rows, h}, rng.normal(rows * h)), dres = twin(dt, {rows, h}, rng.normal(rows * h));
        Twin rec = twin_nan(dt, {rows, h}), dx = twin_nan(dt, {rows, h});
        const std::vector<double> ds0 = rng.normal(h);
        Twin ds = twin(DType::f32, {h}, ds0);
        dev().norm_backward_recompute(rec.c(), dx.c(), dw.c(), db.c(), dout.c(), x.c(), fm.c(), fr.c(), w.c(), bias.c(),
                                      dres.c(), ds.c(), p);
        ref().norm_backward_recompute(rec.r(), dx.r(), dw.r(), db.r(), dout.r(), x.r(), fm.r(), fr.r(), w.r(), bias.r(),
                                      dres.r(), ds.r(), p);
        CHECK(differing(download_bytes(dev(), rec.c()), download_bytes(dev(), fo.c()), dtype_size(dt)) == 0);
        MT_CHECK_CLOSE(dx, tol_for(dt));
        MT_CHECK_CLOSE(dw, 1e-5);
        if (ln) MT_CHECK_CLOSE(db, 1e-5);
        check_dx_colsum(ds, ds0, dx, rows, h);
        // Bit-identical when run again from the same start.
        const auto dw_first = download_bytes(dev(), dw.c()), dx_first = download_bytes(dev(), dx.c());
        const auto ds_first = download_bytes(dev(), ds.c());
        upload(dev(), dw.c(), dw0);
        upload(dev(), ds.c(), ds0);
        if (ln) upload(dev(), db.c(), db0);
        dev().fill(dx.c(), NAN);
        dev().norm_backward_recompute(rec.c(), dx.c(), dw.c(), db.c(), dout.c(), x.c(), fm.c(), fr.c(), w.c(), bias.c(),
                                      dres.c(), ds.c(), p);
        CHECK(differing(download_bytes(dev(), dw.c()), dw_first, 4) == 0);
        CHECK(differing(download_bytes(dev(), dx.c()), dx_first, dtype_size(dt)) == 0);
        CHECK(differing(download_bytes(dev(), ds.c()), ds_first, 4) == 0);
        // In place over dresidual, no parameter gradients (the first layer's ln1 has dx = dresidual).
        ref().norm_backward(dres.r(), Tensor(), Tensor(), dout.r(), x.r(), fm.r(), fr.r(), w.r(), dres.r(), Tensor(), p);
        dev().norm_backward(dres.c(), Tensor(), Tensor(), dout.c(), x.c(), fm.c(), fr.c(), w.c(), dres.c(), Tensor(), p);
        MT_CHECK_CLOSE(dres, tol_for(dt));
      }
}

// bias_dropout_add_norm (the fused block boundary): the sum bit for bit what bias_dropout_add
// writes, the output and statistics bit for bit norm_forward of that stored sum, and both close to
// the reference (which runs the two ops).
TEST_CASE("cuda bias_dropout_add_norm equals bias_dropout_add then norm_forward", "[gpu][norm]") {
  MT_RNG(rng);
  for (Normalization kind : {Normalization::layernorm, Normalization::rmsnorm})
    for (DType dt : kFloatTypes)
      for (int64_t rows : {7, 333})
        for (int64_t h : {48, 100, 768, 2048})
          for (float drop : {0.0f, 0.1f})
            for (bool with_bias : {true, false}) {
              const bool ln = kind == Normalization::layernorm;
              INFO((ln ? "layernorm " : "rmsnorm ") << dtype_name(dt) << " rows " << rows << " h " << h << " dropout "
                                                    << drop << (with_bias ? " bias" : ""));
              const NormParams p = params(kind, false);
              const uint64_t key = rng.engine()();
              Twin res = twin(dt, {rows, h}, shifted_normal(rng, rows * h)), x = twin(dt, {rows, h}, rng.normal(rows * h));
              Twin xb = with_bias ? twin(dt, {h}, rng.normal(h, 0.5)) : absent();
              Twin w = twin(dt, {h}, weights(rng, h, false)), b = ln ? twin(dt, {h}, rng.normal(h, 0.1)) : absent();
              Twin sum = twin_nan(dt, {rows, h}), out = twin_nan(dt, {rows, h});
              Twin mean = twin_nan(DType::f32, {rows}), rstd = twin_nan(DType::f32, {rows});
              dev().bias_dropout_add_norm(sum.c(), out.c(), mean.c(), rstd.c(), res.c(), x.c(), xb.c(), drop, key, w.c(),
                                          b.c(), p);
              ref().bias_dropout_add_norm(sum.r(), out.r(), mean.r(), rstd.r(), res.r(), x.r(), xb.r(), drop, key, w.r(),
                                          b.r(), p);
              MT_CHECK_CLOSE(sum, tol_for(dt));
              check_norm_of_stored_sum(sum, out, rstd, w, b, dt, rows, h, p);
              // The same bits as the two separate CUDA ops.
              Twin sum2 = twin_nan(dt, {rows, h}), out2 = twin_nan(dt, {rows, h});
              Twin mean2 = twin_nan(DType::f32, {rows}), rstd2 = twin_nan(DType::f32, {rows});
              dev().bias_dropout_add(sum2.c(), x.c(), xb.c(), res.c(), drop, key);
              dev().norm_forward(out2.c(), mean2.c(), rstd2.c(), sum2.c(), w.c(), b.c(), p);
              CHECK(differing(download_bytes(dev(), sum.c()), download_bytes(dev(), sum2.c()), dtype_size(dt)) == 0);
              CHECK(differing(download_bytes(dev(), out.c()), download_bytes(dev(), out2.c()), dtype_size(dt)) == 0);
              CHECK(differing(download_bytes(dev(), rstd.c()), download_bytes(dev(), rstd2.c()), 4) == 0);
              CHECK(differing(download_bytes(dev(), mean.c()), download_bytes(dev(), mean2.c()), 4) == 0);
            }
}

// The FP8 layers' input casts from a norm's statistics (GptModel fp8_norm_cast): a norm_forward or
// bias_dropout_add_norm without out writes the same statistics (and sum) as with it, and
// fp8_quantize_norm from them gives the bytes, amax and scale of norm_forward then fp8_quantize.
// Widths: the fast 16-bit kernels (48, 768, 2048), the general ones (70 and 2056: odd or wide)
// and the cast's unvectorized path (70).
TEST_CASE("cuda fp8_quantize_norm: norm_forward then fp8_quantize, bit for bit; statistics-only norms",
          "[gpu][norm][fp8]") {
  MT_RNG(rng);
  auto scalar = [](float v) {
    Buf b(dev(), DType::f32, {1});
    upload(dev(), b.t, {v});
    return b;
  };
  for (Normalization kind : {Normalization::layernorm, Normalization::rmsnorm})
    for (Fp8Recipe recipe : {Fp8Recipe::delayed, Fp8Recipe::tensorwise})
      for (auto [rows, h] : {std::pair<int64_t, int64_t>{64, 48}, {333, 768}, {40, 2048}, {33, 70}, {24, 2056}}) {
        const bool ln = kind == Normalization::layernorm;
        const bool one_p = ln && rows % 2 == 1;
        INFO((ln ? "layernorm " : "rmsnorm ") << (one_p ? "1p " : "")
                                              << (recipe == Fp8Recipe::delayed ? "delayed " : "tensorwise ") << rows
                                              << " x " << h);
        const NormParams p = params(kind, one_p);
        const DType dt = DType::bf16;
        Twin res = twin_same(dt, {rows, h}, shifted_normal(rng, rows * h));
        Twin x = twin_same(dt, {rows, h}, rng.normal(rows * h)), xb = twin_same(dt, {h}, rng.normal(h, 0.5));
        Twin w = twin_same(dt, {h}, weights(rng, h, one_p));
        Twin b = ln ? twin_same(dt, {h}, rng.normal(h, 0.1)) : absent();
        // The residual add + norm with and without its output.
        Buf sum(dev(), dt, {rows, h}), sum2(dev(), dt, {rows, h}), y(dev(), dt, {rows, h});
        Buf mean(dev(), DType::f32, {rows}), rstd(dev(), DType::f32, {rows});
        Buf mean2(dev(), DType::f32, {rows}), rstd2(dev(), DType::f32, {rows});
        dev().bias_dropout_add_norm(sum.t, y.t, mean.t, rstd.t, res.c(), x.c(), xb.c(), 0.0f, 0, w.c(), b.c(), p);
        dev().bias_dropout_add_norm(sum2.t, Tensor(), mean2.t, rstd2.t, res.c(), x.c(), xb.c(), 0.0f, 0, w.c(), b.c(),
                                    p);
        CHECK(differing(download_bytes(dev(), sum.t), download_bytes(dev(), sum2.t), 2) == 0);
        CHECK(differing(download_bytes(dev(), mean.t), download_bytes(dev(), mean2.t), 4) == 0);
        CHECK(differing(download_bytes(dev(), rstd.t), download_bytes(dev(), rstd2.t), 4) == 0);
        // A plain norm_forward of the sum, statistics only: the same statistics again.
        Buf mean3(dev(), DType::f32, {rows}), rstd3(dev(), DType::f32, {rows});
        dev().norm_forward(Tensor(), mean3.t, rstd3.t, sum.t, w.c(), b.c(), p);
        CHECK(differing(download_bytes(dev(), mean.t), download_bytes(dev(), mean3.t), 4) == 0);
        CHECK(differing(download_bytes(dev(), rstd.t), download_bytes(dev(), rstd3.t), 4) == 0);
        // The casts: written output then fp8_quantize, against fp8_quantize_norm from the statistics.
        struct Cast {
          Buf q, t, scale, scale_inv, amax;
          Fp8TensorMeta meta(Fp8Recipe r) const { return meta_of(scale.t, scale_inv.t, amax.t, r); }
        };
        auto make = [&] {
          return Cast{Buf(dev(), DType::fp8_e4m3, {rows, h}), Buf(dev(), DType::fp8_e4m3, {h, rows}), scalar(24.0f),
                      scalar(1.0f / 24.0f), scalar(0.25f)};
        };
        Cast two_ops = make(), fused = make();
        dev().fp8_quantize(two_ops.q.t, two_ops.t.t, y.t, two_ops.meta(recipe));
        dev().fp8_quantize_norm(fused.q.t, fused.t.t, sum2.t, mean2.t, rstd2.t, w.c(), b.c(), p, fused.meta(recipe));
        CHECK(differing(download_bytes(dev(), fused.q.t), download_bytes(dev(), two_ops.q.t), 1) == 0);
        CHECK(differing(download_bytes(dev(), fused.t.t), download_bytes(dev(), two_ops.t.t), 1) == 0);
        const auto v = [](const Buf& s) { return static_cast<float>(download(dev(), s.t)[0]); };
        CHECK(v(fused.amax) == v(two_ops.amax));
        CHECK(v(fused.amax) > 0.25f);
        CHECK(v(fused.scale) == v(two_ops.scale));
        CHECK(v(fused.scale_inv) == v(two_ops.scale_inv));
        // Against the reference (float32 tensors, its dtypes): a statistics-only norm and the cast
        // from it on both backends, at most 1% of the bytes apart (float32 against float64
        // statistics; the CUDA float32 path of both kernels).
        Twin xf = twin(DType::f32, {rows, h}, shifted_normal(rng, rows * h));
        Twin wf = twin(DType::f32, {h}, weights(rng, h, one_p));
        Twin bf = ln ? twin(DType::f32, {h}, rng.normal(h, 0.1)) : absent();
        Twin mf = twin_nan(DType::f32, {rows}), rf = twin_nan(DType::f32, {rows});
        dev().norm_forward(Tensor(), mf.c(), rf.c(), xf.c(), wf.c(), bf.c(), p);
        ref().norm_forward(Tensor(), mf.r(), rf.r(), xf.r(), wf.r(), bf.r(), p);
        MT_CHECK_CLOSE(rf, 1e-5);
        Buf qc(dev(), DType::fp8_e4m3, {rows, h}), qr(ref(), DType::fp8_e4m3, {rows, h});
        Buf rscale(ref(), DType::f32, {1}), rinv(ref(), DType::f32, {1}), ramax(ref(), DType::f32, {1});
        upload(ref(), rscale.t, {24.0}), upload(ref(), rinv.t, {1.0 / 24.0}), upload(ref(), ramax.t, {0.25});
        Cast on_dev = make();
        dev().fp8_quantize_norm(qc.t, Tensor(), xf.c(), mf.c(), rf.c(), wf.c(), bf.c(), p, on_dev.meta(recipe));
        ref().fp8_quantize_norm(qr.t, Tensor(), xf.r(), mf.r(), rf.r(), wf.r(), bf.r(), p,
                                meta_of(rscale.t, rinv.t, ramax.t, recipe));
        CHECK(differing(download_bytes(dev(), qc.t), download_bytes(ref(), qr.t), 1) <= rows * h / 100);
        CHECK(std::fabs(v(on_dev.amax) - static_cast<float>(download(ref(), ramax.t)[0])) <=
              1e-5f * v(on_dev.amax));
      }
}

// --grad-reduce-in-bf16: dweight, dbias and dx's column sums (a linear layer's bias gradient) are
// bf16 gradients, each element round_bf16(old + the float32 sum). Against the reference with bf16
// gradients; the general kernels (float32, odd and wide rows) and the 16-bit fast ones (with the
// column sums in the same pass, and without them in norm_backward_recompute). The column sums are
// checked against each backend's own stored dx. One case keeps the column sums float32 beside
// bf16 dweight/dbias (each output keeps its own dtype).
namespace {
void check_dx_colsum_bf16(const Twin& ds, const std::vector<double>& ds0, const Twin& dx, int64_t rows, int64_t h) {
  for (bool device : {true, false}) {
    Backend& be = device ? dev() : ref();
    const std::vector<double> x = download(be, device ? dx.c() : dx.r()), got = download(be, device ? ds.c() : ds.r());
    std::vector<double> want(static_cast<size_t>(h));
    for (int64_t c = 0; c < h; ++c) {
      double s = 0;
      for (int64_t r = 0; r < rows; ++r) s += x[static_cast<size_t>(r * h + c)];
      want[static_cast<size_t>(c)] = bf16_accumulate(round_to(DType::bf16, ds0[static_cast<size_t>(c)]), s);
    }
    check_bf16_grad_close(got, want, device ? "cuda dx column sums" : "reference dx column sums");
  }
}
}  // namespace

TEST_CASE("cuda norm_backward into bf16 gradients matches the reference", "[gpu][norm][bf16grad]") {
  MT_RNG(rng);
  for (Normalization kind : {Normalization::layernorm, Normalization::rmsnorm})
    for (DType dt : {DType::bf16, DType::f32})
      for (int64_t rows : {7, 333, 4099})
        for (int64_t h : {16, 48, 100, 768, 1000, 2048, 2050}) {
          if (rows == 4099 && (h == 100 || h == 1000 || h == 2050)) continue;  // the reference's time
          const bool ln = kind == Normalization::layernorm;
          const bool one_p = h % 3 == 0;
          const bool ds_f32 = rows == 333 && h == 768;
          INFO((ln ? "layernorm " : "rmsnorm ") << dtype_name(dt) << " rows " << rows << " h " << h
                                                << (ds_f32 ? " (float32 dx_colsum)" : ""));
          const NormParams p = params(kind, one_p);
          NormBackwardInputs in = norm_backward_inputs(rng, dt, rows, h, one_p, p);
          const Twin &x = in.x, &w = in.w, &mean = in.mean, &rstd = in.rstd;
          // Starting values of the size of one backward's contribution (sums over the rows).
          const double scale = std::sqrt(static_cast<double>(rows));
          const std::vector<double> dw0 = rng.normal(h, scale), db0 = rng.normal(h, scale), ds0 = rng.normal(h, scale);
          Twin dw = twin_same(DType::bf16, {h}, dw0), db = ln ? twin_same(DType::bf16, {h}, db0) : absent();
          Twin ds = ds_f32 ? twin(DType::f32, {h}, ds0) : twin_same(DType::bf16, {h}, ds0);
          Twin dout = twin(dt, {rows, h}, rng.normal(rows * h)), dres = twin(dt, {rows, h}, rng.normal(rows * h));
          Twin dx = twin_nan(dt, {rows, h});
          dev().norm_backward(dx.c(), dw.c(), db.c(), dout.c(), x.c(), mean.c(), rstd.c(), w.c(), dres.c(), ds.c(), p);
          ref().norm_backward(dx.r(), dw.r(), db.r(), dout.r(), x.r(), mean.r(), rstd.r(), w.r(), dres.r(), ds.r(), p);
          MT_CHECK_CLOSE(dx, tol_for(dt));
          check_bf16_grad(dw, "dweight");
          if (ln) check_bf16_grad(db, "dbias");
          if (ds_f32) check_dx_colsum(ds, ds0, dx, rows, h);
          else check_dx_colsum_bf16(ds, ds0, dx, rows, h);

          // Bit-identical when run again from the same start.
          const auto dw_first = download_bytes(dev(), dw.c()), ds_first = download_bytes(dev(), ds.c());
          const auto db_first = ln ? download_bytes(dev(), db.c()) : std::vector<uint8_t>();
          upload(dev(), dw.c(), dw0);
          upload(dev(), ds.c(), ds0);
          if (ln) upload(dev(), db.c(), db0);
          dev().norm_backward(dx.c(), dw.c(), db.c(), dout.c(), x.c(), mean.c(), rstd.c(), w.c(), dres.c(), ds.c(), p);
          CHECK(differing(download_bytes(dev(), dw.c()), dw_first, 2) == 0);
          CHECK(differing(download_bytes(dev(), ds.c()), ds_first, dtype_size(ds.c().dtype)) == 0);
          if (ln) CHECK(differing(download_bytes(dev(), db.c()), db_first, 2) == 0);

          // norm_backward_recompute without the column sums (the fast kernel's other instance).
          Twin bias = ln ? twin(dt, {h}, rng.normal(h, 0.1)) : absent();
          Twin fo = twin_nan(dt, {rows, h}), fm = twin_nan(DType::f32, {rows}), fr = twin_nan(DType::f32, {rows});
          dev().norm_forward(fo.c(), fm.c(), fr.c(), x.c(), w.c(), bias.c(), p);
          ref().norm_forward(fo.r(), fm.r(), fr.r(), x.r(), w.r(), bias.r(), p);
          Twin rec = twin_nan(dt, {rows, h}), dx3 = twin_nan(dt, {rows, h});
          Twin dout3 = twin(dt, {rows, h}, rng.normal(rows * h));
          Twin dw3 = twin_same(DType::bf16, {h}, dw0), db3 = ln ? twin_same(DType::bf16, {h}, db0) : absent();
          dev().norm_backward_recompute(rec.c(), dx3.c(), dw3.c(), db3.c(), dout3.c(), x.c(), fm.c(), fr.c(), w.c(),
                                        bias.c(), Tensor(), Tensor(), p);
          ref().norm_backward_recompute(rec.r(), dx3.r(), dw3.r(), db3.r(), dout3.r(), x.r(), fm.r(), fr.r(), w.r(),
                                        bias.r(), Tensor(), Tensor(), p);
          CHECK(differing(download_bytes(dev(), rec.c()), download_bytes(dev(), fo.c()), dtype_size(dt)) == 0);
          MT_CHECK_CLOSE(dx3, tol_for(dt));
          check_bf16_grad(dw3, "dweight (recompute)");
          if (ln) check_bf16_grad(db3, "dbias (recompute)");
        }
}

// --qk-layernorm's four weight gradients in bf16 (one case with the k gradients float32 beside bf16
// q gradients).
TEST_CASE("cuda qk_norm_backward into bf16 gradients matches the reference", "[gpu][norm][bf16grad]") {
  MT_RNG(rng);
  for (Normalization kind : {Normalization::layernorm, Normalization::rmsnorm})
    for (DType dt : {DType::bf16, DType::f32})
      for (int64_t rows : {7, 333})
        for (int d : {36, 64, 128}) {
          const bool ln = kind == Normalization::layernorm;
          const bool k_f32 = rows == 333 && d == 64;
          INFO((ln ? "layernorm " : "rmsnorm ") << dtype_name(dt) << " rows " << rows << " head_dim " << d
                                                << (k_f32 ? " (float32 k gradients)" : ""));
          QkNormCase k = qk_norm_case(rng, kind, dt, rows, d);
          const RopeShape& r = k.r;
          const NormParams& p = k.p;
          const int64_t width = k.width;
          const Twin &qkv = k.qkv, &qw = k.qw, &kw = k.kw;
          const auto [m, s] = k.reference_stats(rows);
          const double scale = std::sqrt(static_cast<double>(rows * r.heads));
          auto grad = [&](bool f32) {
            return f32 ? twin(DType::f32, {d}, rng.normal(d, scale)) : twin_same(DType::bf16, {d}, rng.normal(d, scale));
          };
          Twin dqw = grad(false), dkw = grad(k_f32);
          Twin dqb = ln ? grad(false) : absent(), dkb = ln ? grad(k_f32) : absent();
          Twin dout = twin(dt, {rows, width}, rng.normal(rows * width)), dqkv = twin_nan(dt, {rows, width});
          dev().qk_norm_backward(dqkv.c(), dqw.c(), dqb.c(), dkw.c(), dkb.c(), dout.c(), qkv.c(), m.c(), s.c(), qw.c(),
                                 kw.c(), r, p);
          ref().qk_norm_backward(dqkv.r(), dqw.r(), dqb.r(), dkw.r(), dkb.r(), dout.r(), qkv.r(), m.r(), s.r(), qw.r(),
                                 kw.r(), r, p);
          MT_CHECK_CLOSE(dqkv, tol_for(dt));
          check_bf16_grad(dqw, "dq_weight");
          if (ln) check_bf16_grad(dqb, "dq_bias");
          if (k_f32) {
            MT_CHECK_CLOSE(dkw, 1e-5);
            if (ln) MT_CHECK_CLOSE(dkb, 1e-5);
          } else {
            check_bf16_grad(dkw, "dk_weight");
            if (ln) check_bf16_grad(dkb, "dk_bias");
          }
        }
}

// Tensorwise FP8 casts take the amax of their source from the op that writes it (GptModel,
// ModelOptions::TestSeams::fp8_producer_amax): norm_forward / bias_dropout_add_norm's out_amax (also with
// statistics only) and norm_backward's dx_amax must be max |value| as stored, bit for bit, maxed
// into what the slot held, over every kernel (the 16-bit fast ones: 48, 768, 2048; the general
// ones: 70, 2056 and float32), with many blocks. Then the cast given that amax (fresh_taken) writes
// the bytes and scales of the cast that takes its own, zeroes the slot and copies its scale_inv.
TEST_CASE("cuda norm amaxes for tensorwise FP8 casts: max |out| and max |dx| as stored", "[gpu][norm][fp8]") {
  MT_RNG(rng);
  auto scalar = [](float v) {
    Buf b(dev(), DType::f32, {1});
    upload(dev(), b.t, {v});
    return b;
  };
  const auto v = [](const Buf& s) { return static_cast<float>(download(dev(), s.t)[0]); };
  for (Normalization kind : {Normalization::layernorm, Normalization::rmsnorm})
    for (DType dt : {DType::bf16, DType::f16, DType::f32})
      for (int64_t h : {48, 70, 768, 2048, 2056}) {
        const int64_t rows = h >= 2048 ? 1031 : 4099;
        const bool ln = kind == Normalization::layernorm;
        INFO((ln ? "layernorm " : "rmsnorm ") << dtype_name(dt) << " rows " << rows << " h " << h);
        const NormParams p = params(kind, false);
        Twin x = twin(dt, {rows, h}, shifted_normal(rng, rows * h)), w = twin(dt, {h}, weights(rng, h, false));
        Twin b = ln ? twin(dt, {h}, rng.normal(h, 0.1)) : absent();
        // Forward: the amax of the written output; statistics only; the fused residual add.
        Buf y(dev(), dt, {rows, h}), mean(dev(), DType::f32, {rows}), rstd(dev(), DType::f32, {rows});
        Buf a_out = scalar(0.0f), a_stats = scalar(0.0f), a_start = scalar(1e4f);
        dev().norm_forward(y.t, mean.t, rstd.t, x.c(), w.c(), b.c(), p, a_out.t);
        dev().norm_forward(Tensor(), mean.t, rstd.t, x.c(), w.c(), b.c(), p, a_stats.t);
        dev().norm_forward(Tensor(), mean.t, rstd.t, x.c(), w.c(), b.c(), p, a_start.t);
        const float want = max_abs_of(dev(), y.t, 0.0f);
        CHECK(v(a_out) == want);
        CHECK(v(a_stats) == want);
        CHECK(v(a_start) == 1e4f);  // maxed into what the slot held
        Twin res = twin(dt, {rows, h}, rng.normal(rows * h)), xb = twin(dt, {h}, rng.normal(h, 0.5));
        Buf sum(dev(), dt, {rows, h}), y2(dev(), dt, {rows, h}), a_fused = scalar(0.0f);
        dev().bias_dropout_add_norm(sum.t, y2.t, mean.t, rstd.t, res.c(), x.c(), xb.c(), 0.0f, 0, w.c(), b.c(), p);
        dev().bias_dropout_add_norm(sum.t, Tensor(), mean.t, rstd.t, res.c(), x.c(), xb.c(), 0.0f, 0, w.c(), b.c(), p,
                                    a_fused.t);
        CHECK(v(a_fused) == max_abs_of(dev(), y2.t, 0.0f));
        // Backward: max |dx| as stored, with and without the column sums (a second kernel variant).
        for (bool colsum : {false, true}) {
          INFO((colsum ? "with dx column sums" : "no column sums"));
          Twin dout = twin(dt, {rows, h}, rng.normal(rows * h)), dres = twin(dt, {rows, h}, rng.normal(rows * h));
          Buf dx(dev(), dt, {rows, h}), a_dx = scalar(0.0f), ds(dev(), DType::f32, {h});
          dev().fill(ds.t, 0.0);
          dev().norm_backward(dx.t, Tensor(), Tensor(), dout.c(), x.c(), mean.t, rstd.t, w.c(), dres.c(),
                              colsum ? ds.t : Tensor(), p, a_dx.t);
          CHECK(v(a_dx) == max_abs_of(dev(), dx.t, 0.0f));
        }
        if (dt != DType::bf16) continue;
        // The cast that takes the norm's amax against the one that takes its own (tensorwise).
        struct Cast {
          Buf q, t, scale, scale_inv, amax;
        };
        auto make = [&] {
          return Cast{Buf(dev(), DType::fp8_e4m3, {rows, h}), Buf(dev(), DType::fp8_e4m3, {h, rows}), scalar(24.0f),
                      scalar(1.0f / 24.0f), scalar(0.25f)};
        };
        Cast own = make(), taken = make();
        Buf fresh = scalar(0.0f), copy = scalar(-1.0f);
        dev().norm_forward(Tensor(), mean.t, rstd.t, x.c(), w.c(), b.c(), p, fresh.t);
        dev().fp8_quantize_norm(own.q.t, own.t.t, x.c(), mean.t, rstd.t, w.c(), b.c(), p,
                                meta_of(own.scale.t, own.scale_inv.t, own.amax.t, Fp8Recipe::tensorwise));
        Fp8TensorMeta m = meta_of(taken.scale.t, taken.scale_inv.t, taken.amax.t, Fp8Recipe::tensorwise);
        m.fresh = fresh.t;
        m.fresh_taken = true;
        m.scale_inv_copy = copy.t;
        dev().fp8_quantize_norm(taken.q.t, taken.t.t, x.c(), mean.t, rstd.t, w.c(), b.c(), p, m);
        CHECK(differing(download_bytes(dev(), taken.q.t), download_bytes(dev(), own.q.t), 1) == 0);
        CHECK(differing(download_bytes(dev(), taken.t.t), download_bytes(dev(), own.t.t), 1) == 0);
        CHECK(v(taken.scale) == v(own.scale));
        CHECK(v(taken.scale_inv) == v(own.scale_inv));
        CHECK(v(taken.amax) == v(own.amax));
        CHECK(v(copy) == v(taken.scale_inv));
        CHECK(v(fresh) == 0.0f);  // zeroed by the cast for the next one
        // A persistent slot without a producer: the cast's own amax pass fills and then zeroes it.
        Cast own2 = make();
        Fp8TensorMeta m2 = meta_of(own2.scale.t, own2.scale_inv.t, own2.amax.t, Fp8Recipe::tensorwise);
        m2.fresh = fresh.t;
        dev().fp8_quantize_norm(own2.q.t, own2.t.t, x.c(), mean.t, rstd.t, w.c(), b.c(), p, m2);
        CHECK(differing(download_bytes(dev(), own2.q.t), download_bytes(dev(), own.q.t), 1) == 0);
        CHECK(v(own2.scale) == v(own.scale));
        CHECK(v(fresh) == 0.0f);
      }
}
