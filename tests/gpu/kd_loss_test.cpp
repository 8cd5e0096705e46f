// CUDA vs reference: knowledge distillation's losses (engine/backend.h, "knowledge distillation"):
// logsumexp_rows, kd_logits_kl (forward only, with the gradient, in place over the student logits,
// on vocab shards with the whole row's lse), hidden_loss_forward / _backward (cosine and MSE,
// written and accumulated), for float32, bfloat16 and float16 inputs of odd and even widths (the
// scalar and the 16-byte paths; warp-per-row and block-per-row hidden widths).
#include <cmath>
#include <cstdint>
#include <vector>

#include "tests/gpu/gpu_test_util.h"

using namespace mt;
using namespace mt::gputest;

namespace {
const DType kFloatTypes[] = {DType::f32, DType::bf16, DType::f16};

// Student logits near the teacher's (a distillation's usual state; KL of order 0.1-1 per row).
std::vector<double> student_of(Rng& rng, const std::vector<double>& teacher) {
  std::vector<double> s = rng.normal(static_cast<int64_t>(teacher.size()), 1.0);
  for (size_t i = 0; i < s.size(); ++i) s[i] += 0.8 * teacher[i];
  return s;
}

// Columns [begin, begin + count) of each row of a [rows, cols] matrix.
std::vector<double> columns(const std::vector<double>& x, int64_t rows, int64_t cols, int64_t begin, int64_t count) {
  std::vector<double> out(static_cast<size_t>(rows * count));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < count; ++c) out[r * count + c] = x[r * cols + begin + c];
  return out;
}

double rms(const std::vector<double>& x) {
  double s = 0;
  for (double v : x) s += v * v;
  return x.empty() ? 0.0 : std::sqrt(s / static_cast<double>(x.size()));
}

// A shard's KL (its sign and size depend on the shard; it may be ~0 however large its terms) checked
// row by row against the reference within rel times the sum over the row of p_t (|log p_t| +
// |log p_s| + 1): what float32 log-probabilities and a float32 sum of their products can err by.
// Values: the shard's logits before rounding to dt; lse: the reference's whole-row values.
int64_t kl_rows_beyond_bound(const Twin& kl, DType dt, const std::vector<double>& s, const std::vector<double>& t,
                             const std::vector<double>& lse_s, const std::vector<double>& lse_t, double scale,
                             int64_t rows, int64_t cols, double rel) {
  return rows_beyond_term_bound(download(dev(), kl.c()), download(ref(), kl.r()), rows, cols, rel,
                                [&](int64_t r, int64_t c) {
                                  const double ys = round_to(dt, s[r * cols + c]) * scale - lse_s[r];
                                  const double yt = round_to(dt, t[r * cols + c]) * scale - lse_t[r];
                                  return std::exp(yt) * (std::fabs(yt) + std::fabs(ys) + 1.0);
                                });
}

const char* kind_name(Backend::HiddenLoss k) { return k == Backend::HiddenLoss::cosine ? "cosine" : "mse"; }
}  // namespace

TEST_CASE("cuda logsumexp_rows and kd_logits_kl match the reference", "[gpu][loss][kd]") {
  MT_RNG(rng);
  for (DType dt : kFloatTypes)
    for (int64_t cols : {1000, 2053, 50304})
      for (int64_t rows : {1, 7, 333}) {
        if (rows == 333 && cols == 50304 && dt != DType::bf16) continue;  // the reference's time, not coverage
        const std::vector<double> tv = rng.normal(rows * cols, 3.0), sv = student_of(rng, tv);
        Twin t = twin(dt, {rows, cols}, tv);
        Twin dloss = twin(DType::f32, {rows}, rng.uniform(rows, 0.1, 1.0));
        for (float scale : {1.0f, 0.5f}) {
          INFO(dtype_name(dt) << " rows " << rows << " cols " << cols << " scale " << scale);
          Twin s = twin(dt, {rows, cols}, sv);
          Twin lse_s = twin_nan(DType::f32, {rows}), lse_t = twin_nan(DType::f32, {rows});
          dev().logsumexp_rows(lse_s.c(), s.c(), scale);
          ref().logsumexp_rows(lse_s.r(), s.r(), scale);
          dev().logsumexp_rows(lse_t.c(), t.c(), scale);
          ref().logsumexp_rows(lse_t.r(), t.r(), scale);
          MT_CHECK_CLOSE(lse_s, 1e-5);
          MT_CHECK_CLOSE(lse_t, 1e-5);

          // The reference's lse on both sides (so the KL compares the kernels alone).
          Twin ls = twin(DType::f32, {rows}, download(ref(), lse_s.r()));
          Twin lt = twin(DType::f32, {rows}, download(ref(), lse_t.r()));

          // Forward only: no dloss, no ds.
          Twin kl0 = twin_nan(DType::f32, {rows});
          dev().kd_logits_kl(kl0.c(), Tensor(), s.c(), t.c(), ls.c(), lt.c(), scale, Tensor());
          ref().kd_logits_kl(kl0.r(), Tensor(), s.r(), t.r(), ls.r(), lt.r(), scale, Tensor());
          MT_CHECK_CLOSE(kl0, 1e-4);

          // With the gradient into a separate ds.
          Twin kl = twin_nan(DType::f32, {rows}), ds = twin_nan(dt, {rows, cols});
          dev().kd_logits_kl(kl.c(), ds.c(), s.c(), t.c(), ls.c(), lt.c(), scale, dloss.c());
          ref().kd_logits_kl(kl.r(), ds.r(), s.r(), t.r(), ls.r(), lt.r(), scale, dloss.r());
          MT_CHECK_CLOSE(kl, 1e-4);
          MT_CHECK_CLOSE(ds, tol_for(dt));
          // The same KL with and without the gradient, bit for bit (one reduction order).
          CHECK(differing(download_bytes(dev(), kl.c()), download_bytes(dev(), kl0.c()), 4) == 0);

          // In place over the student logits: the same KL and gradient, bit for bit.
          Twin kl_in = twin_nan(DType::f32, {rows});
          dev().kd_logits_kl(kl_in.c(), s.c(), s.c(), t.c(), ls.c(), lt.c(), scale, dloss.c());
          ref().kd_logits_kl(kl_in.r(), s.r(), s.r(), t.r(), ls.r(), lt.r(), scale, dloss.r());
          MT_CHECK_CLOSE(kl_in, 1e-4);
          MT_CHECK_CLOSE(s, tol_for(dt));
          CHECK(differing(download_bytes(dev(), kl_in.c()), download_bytes(dev(), kl.c()), 4) == 0);
          CHECK(differing(download_bytes(dev(), s.c()), download_bytes(dev(), ds.c()), dtype_size(dt)) == 0);
        }
      }
}

// Vocab-parallel use: each shard's lse (logsumexp_rows) combined into the row's (logsumexp_combine),
// then each shard's KL and gradient with that global lse; the shards' KLs add up to the whole row's.
// Splits: an even one (16-byte path) and an odd one (scalar path).
TEST_CASE("cuda kd_logits_kl on vocab shards with the whole row's lse", "[gpu][loss][kd]") {
  MT_RNG(rng);
  for (DType dt : {DType::f32, DType::bf16})
    for (int64_t rows : {1, 7, 129})
      for (int64_t first : {25152, 1001}) {
        const int64_t cols = 50304, second = cols - first;
        const float scale = 0.5f;
        INFO(dtype_name(dt) << " rows " << rows << " shards " << first << " + " << second);
        const std::vector<double> tv = rng.normal(rows * cols, 3.0), sv = student_of(rng, tv);
        Twin s = twin(dt, {rows, cols}, sv), t = twin(dt, {rows, cols}, tv);
        Twin dloss = twin(DType::f32, {rows}, rng.uniform(rows, 0.1, 1.0));
        const int64_t widths[2] = {first, second}, starts[2] = {0, first};
        std::vector<Twin> ss, ts;
        for (int i = 0; i < 2; ++i) {
          ss.push_back(twin(dt, {rows, widths[i]}, columns(sv, rows, cols, starts[i], widths[i])));
          ts.push_back(twin(dt, {rows, widths[i]}, columns(tv, rows, cols, starts[i], widths[i])));
        }
        // Whole rows on the reference; shards then logsumexp_combine on CUDA.
        Twin lse_s = twin_nan(DType::f32, {rows}), lse_t = twin_nan(DType::f32, {rows});
        ref().logsumexp_rows(lse_s.r(), s.r(), scale);
        ref().logsumexp_rows(lse_t.r(), t.r(), scale);
        Twin parts_s = twin_nan(DType::f32, {2, rows}), parts_t = twin_nan(DType::f32, {2, rows});
        for (int i = 0; i < 2; ++i) {
          dev().logsumexp_rows(parts_s.c().flat_slice(i * rows, rows), ss[i].c(), scale);
          dev().logsumexp_rows(parts_t.c().flat_slice(i * rows, rows), ts[i].c(), scale);
        }
        dev().logsumexp_combine(lse_s.c(), parts_s.c());
        dev().logsumexp_combine(lse_t.c(), parts_t.c());
        MT_CHECK_CLOSE(lse_s, 1e-5);
        MT_CHECK_CLOSE(lse_t, 1e-5);

        Twin ls = twin(DType::f32, {rows}, download(ref(), lse_s.r()));
        Twin lt = twin(DType::f32, {rows}, download(ref(), lse_t.r()));
        Twin kl_whole = twin_nan(DType::f32, {rows});
        dev().kd_logits_kl(kl_whole.c(), Tensor(), s.c(), t.c(), ls.c(), lt.c(), scale, Tensor());
        ref().kd_logits_kl(kl_whole.r(), Tensor(), s.r(), t.r(), ls.r(), lt.r(), scale, Tensor());
        MT_CHECK_CLOSE(kl_whole, 1e-4);
        std::vector<double> kl_sum(static_cast<size_t>(rows), 0.0);
        for (int i = 0; i < 2; ++i) {
          INFO("shard " << i);
          Twin kl = twin_nan(DType::f32, {rows});
          dev().kd_logits_kl(kl.c(), ss[i].c(), ss[i].c(), ts[i].c(), ls.c(), lt.c(), scale, dloss.c());
          ref().kd_logits_kl(kl.r(), ss[i].r(), ss[i].r(), ts[i].r(), ls.r(), lt.r(), scale, dloss.r());
          CHECK(kl_rows_beyond_bound(kl, dt, columns(sv, rows, cols, starts[i], widths[i]),
                                     columns(tv, rows, cols, starts[i], widths[i]), download(ref(), ls.r()),
                                     download(ref(), lt.r()), scale, rows, widths[i], 1e-5) == 0);
          MT_CHECK_CLOSE(ss[i], tol_for(dt));
          const std::vector<double> k = download(dev(), kl.c());
          for (int64_t r = 0; r < rows; ++r) kl_sum[r] += k[r];
        }
        const double err = rel_err(kl_sum, download(ref(), kl_whole.r()));
        INFO("shards' KL sum vs the whole row's: relative L2 error " << err);
        CHECK(err <= 1e-4);
      }
}

TEST_CASE("cuda hidden_loss_forward and hidden_loss_backward match the reference", "[gpu][loss][kd]") {
  MT_RNG(rng);
  for (DType dt : kFloatTypes)
    for (int64_t h : {64, 80, 1023, 4096, 4097})
      for (int64_t rows : {1, 7, 333}) {
        // Student states correlated with the teacher's (cosine ~0.8: 1 - cos is not all cancellation).
        const std::vector<double> bv = rng.normal(rows * h, 1.0);
        std::vector<double> av = rng.normal(rows * h, 0.6);
        for (size_t i = 0; i < av.size(); ++i) av[i] += 0.8 * bv[i];
        Twin a = twin(dt, {rows, h}, av), b = twin(dt, {rows, h}, bv);
        Twin dloss = twin(DType::f32, {rows}, rng.uniform(rows, 0.1, 1.0));
        for (Backend::HiddenLoss kind : {Backend::HiddenLoss::cosine, Backend::HiddenLoss::mse}) {
          INFO(dtype_name(dt) << " rows " << rows << " h " << h << " " << kind_name(kind));
          Twin loss = twin_nan(DType::f32, {rows});
          dev().hidden_loss_forward(loss.c(), a.c(), b.c(), kind);
          ref().hidden_loss_forward(loss.r(), a.r(), b.r(), kind);
          MT_CHECK_CLOSE(loss, 3e-5);
          for (float scale : {1.0f, 0.5f}) {
            INFO("scale " << scale);
            Twin da = twin_nan(dt, {rows, h});
            dev().hidden_loss_backward(da.c(), a.c(), b.c(), dloss.c(), scale, kind, false);
            ref().hidden_loss_backward(da.r(), a.r(), b.r(), dloss.r(), scale, kind, false);
            MT_CHECK_CLOSE(da, tol_for(dt));
            // Accumulated into a gradient of the same magnitude as the contribution.
            const double g = rms(download(ref(), da.r()));
            Twin acc = twin(dt, {rows, h}, rng.normal(rows * h, g));
            dev().hidden_loss_backward(acc.c(), a.c(), b.c(), dloss.c(), scale, kind, true);
            ref().hidden_loss_backward(acc.r(), a.r(), b.r(), dloss.r(), scale, kind, true);
            INFO("accumulate");
            MT_CHECK_CLOSE(acc, tol_for(dt));
          }
        }
      }
}

TEST_CASE("cuda knowledge distillation ops refuse mismatched arguments", "[gpu][loss][kd]") {
  MT_RNG(rng);
  Twin s = twin(DType::bf16, {3, 64}, rng.normal(192)), t = twin(DType::bf16, {3, 64}, rng.normal(192));
  Twin t32 = twin(DType::f32, {3, 64}, rng.normal(192));
  Twin v = twin(DType::f32, {3}, {0.0, 0.0, 0.0}), v2 = twin(DType::f32, {2}, {0.0, 0.0});
  // dloss without ds; teacher of another dtype; lse of the wrong length.
  CHECK_THROWS_WITH(dev().kd_logits_kl(v.c(), Tensor(), s.c(), t.c(), v.c(), v.c(), 1.0f, v.c()),
                    Catch::Contains("kd_logits_kl") && Catch::Contains("ds"));
  CHECK_THROWS_WITH(dev().kd_logits_kl(v.c(), Tensor(), s.c(), t32.c(), v.c(), v.c(), 1.0f, Tensor()),
                    Catch::Contains("kd_logits_kl"));
  CHECK_THROWS_WITH(dev().kd_logits_kl(v.c(), Tensor(), s.c(), t.c(), v2.c(), v.c(), 1.0f, Tensor()),
                    Catch::Contains("kd_logits_kl") && Catch::Contains("lse_s"));
  CHECK_THROWS_WITH(dev().logsumexp_rows(v2.c(), s.c(), 1.0f), Catch::Contains("logsumexp_rows"));
  CHECK_THROWS_WITH(dev().hidden_loss_forward(v.c(), s.c(), t32.c(), Backend::HiddenLoss::cosine),
                    Catch::Contains("hidden_loss_forward"));
  CHECK_THROWS_WITH(dev().hidden_loss_backward(t32.c(), s.c(), t.c(), v.c(), 1.0f, Backend::HiddenLoss::mse, false),
                    Catch::Contains("hidden_loss_backward") && Catch::Contains("da"));
  CHECK_THROWS_WITH(dev().hidden_loss_backward(s.c(), s.c(), t.c(), v2.c(), 1.0f, Backend::HiddenLoss::mse, true),
                    Catch::Contains("hidden_loss_backward") && Catch::Contains("dloss"));
}
