// Muon (engine/muon.h) on the reference backend: the Newton-Schulz iteration against a float64
// host iteration written here from emerging_optimizers' definition (normalize, then X = a X +
// (b A + c A A) X with A = X X^T, over the smaller dimension), with and without bfloat16 rounding;
// one update of a parameter list (decoupled weight decay, momentum, Nesterov, the QKV split, the
// scale, the parameters Muon leaves to AdamW) against the same host arithmetic, and with its states
// in shards laid out in another order.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "engine/backend.h"
#include "engine/muon.h"
#include "tests/gradcheck.h"

using namespace mt;
using mt::test::Buf;

namespace {

using Mat = std::vector<double>;  // row-major

double bf16_round(double v) {
  const float f = static_cast<float>(v);
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  bits = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  float r;
  std::memcpy(&r, &bits, 4);
  return r;
}

// C [n, m] = A [n, k] B [k, m]
Mat matmul(const Mat& a, const Mat& b, int64_t n, int64_t k, int64_t m) {
  Mat c(static_cast<size_t>(n * m), 0.0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < m; ++j) {
      double s = 0;
      for (int64_t t = 0; t < k; ++t) s += a[i * k + t] * b[t * m + j];
      c[i * m + j] = s;
    }
  return c;
}
Mat transpose(const Mat& a, int64_t n, int64_t m) {
  Mat t(a.size());
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < m; ++j) t[j * n + i] = a[i * m + j];
  return t;
}

// emerging_optimizers' newton_schulz in float64, optionally rounding where bfloat16 tensors are
// stored: each product, then each addmm's sum (engine/muon.cpp: both backends round twice there).
Mat host_ns(Mat x, int64_t rows, int64_t cols, const MuonConfig& cfg) {
  const bool tr = rows > cols;
  if (tr) {
    x = transpose(x, rows, cols);
    std::swap(rows, cols);
  }
  const bool bf = cfg.fp32_matmul_prec == MuonMatmulPrecision::medium;
  auto round_all = [&](Mat& m) {
    if (bf)
      for (double& v : m) v = bf16_round(v);
  };
  double ss = 0;
  for (double v : x) ss += v * v;
  const double norm = std::max(std::sqrt(ss), 1e-7);
  for (double& v : x) v /= norm;
  round_all(x);
  for (const MuonCoefficients& k : muon_coefficients(cfg.coefficient_type, cfg.num_ns_steps)) {
    Mat A = matmul(x, transpose(x, rows, cols), rows, cols, rows);
    round_all(A);
    Mat B = A;
    if (k[2] != 0.0f) {
      Mat AA = matmul(A, A, rows, rows, rows);
      round_all(AA);
      for (size_t i = 0; i < B.size(); ++i) B[i] = k[1] * A[i] + k[2] * AA[i];
    } else {
      for (double& v : B) v *= k[1];
    }
    round_all(B);
    Mat BX = matmul(B, x, rows, rows, cols);
    round_all(BX);
    for (size_t i = 0; i < x.size(); ++i) x[i] = k[0] * x[i] + BX[i];
    round_all(x);
  }
  return tr ? transpose(x, rows, cols) : x;
}

std::vector<float> to_f32(const Mat& m) { return std::vector<float>(m.begin(), m.end()); }

double max_abs_diff(const std::vector<float>& a, const Mat& b) {
  double d = 0;
  for (size_t i = 0; i < b.size(); ++i) d = std::max(d, std::fabs(static_cast<double>(a[i]) - b[i]));
  return d;
}

}  // namespace

TEST_CASE("muon coefficients: cycled or with the last repeated, as emerging_optimizers iterates them", "[muon]") {
  const auto q = muon_coefficients("quintic", 7);
  REQUIRE(q.size() == 7);
  CHECK(q[0] == MuonCoefficients{4.0848f, -6.8946f, 2.9270f});
  CHECK(q[4] == MuonCoefficients{2.8366f, -3.0525f, 1.2012f});
  CHECK(q[5] == q[0]);  // cycled
  CHECK(q[6] == q[1]);
  const auto pe = muon_coefficients("polar_express", 10);
  CHECK(pe[7] == MuonCoefficients{1.8750f, -1.2500f, 0.3750f});
  CHECK(pe[9] == pe[7]);  // the last repeated
  const auto ds = muon_coefficients("deepseekv4", 12);
  CHECK(ds[7] == MuonCoefficients{3.4445f, -4.7750f, 2.0315f});
  CHECK(ds[8] == MuonCoefficients{2.0f, -1.5f, 0.5f});
  CHECK(ds[11] == ds[9]);
  CHECK(muon_coefficients("simple", 3)[2] == MuonCoefficients{3.4445f, -4.7750f, 2.0315f});
  CHECK(muon_coefficients_known("aol"));
  CHECK(muon_coefficients_known("cans"));
  CHECK_FALSE(muon_coefficients_known("custom"));  // needs coefficient sets Megatron-LM never passes
  CHECK(muon_scale(MuonScaleMode::spectral, 8, 32) == Approx(std::sqrt(32.0)));
  CHECK(muon_scale(MuonScaleMode::unit_rms_norm, 8, 32) == Approx(0.5));
  CHECK(muon_scale(MuonScaleMode::shape_scaling, 8, 32) == Approx(1.0));
  CHECK(muon_scale(MuonScaleMode::shape_scaling, 32, 8) == Approx(2.0));
}

TEST_CASE("scale_by_rnorm: x times 1 / max(sqrt(sumsq), eps) read from backend memory", "[muon][reference]") {
  auto be = make_reference_backend(2);
  std::vector<float> x = {3.0f, -4.0f, 0.5f}, ss = {25.0f};
  be->scale_by_rnorm(test::f32_view(x, {3}), test::f32_view(ss, {1}), 1e-7f);
  CHECK(x[0] == 3.0f * (1.0f / 5.0f));
  CHECK(x[1] == -4.0f * (1.0f / 5.0f));
  std::vector<float> y = {1.0f, 2.0f}, zero = {0.0f};
  be->scale_by_rnorm(test::f32_view(y, {2}), test::f32_view(zero, {1}), 0.5f);  // eps bounds the norm
  CHECK(y[0] == 2.0f);
  CHECK(y[1] == 4.0f);
}

TEST_CASE("newton_schulz on the reference backend equals the float64 iteration (wide, tall, square, one row)",
          "[muon][reference]") {
  auto be = make_reference_backend(2);
  std::mt19937_64 rng(9110);
  for (const auto& [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{5, 9}, {9, 5}, {6, 6}, {1, 7}, {13, 3}})
    for (const char* type : {"quintic", "polar_express", "simple"}) {
      INFO(rows << " x " << cols << " " << type);
      Buf x = Buf::randn({rows, cols}, rng, 3.0);
      MuonConfig cfg;
      cfg.coefficient_type = type;
      cfg.fp32_matmul_prec = MuonMatmulPrecision::high;
      std::vector<float> work(static_cast<size_t>(newton_schulz_workspace(rows, cols, cfg)));
      std::vector<float> got = to_f32(x.d);
      newton_schulz(*be, test::f32_view(got, {rows, cols}), test::f32_view(work, {static_cast<int64_t>(work.size())}), cfg);
      const std::vector<float> x32 = to_f32(x.d);
      const Mat x0(x32.begin(), x32.end());
      const Mat want = host_ns(x0, rows, cols, cfg);
      double scale = 0;
      for (double v : want) scale = std::max(scale, std::fabs(v));
      CHECK(scale > 0.1);  // an orthogonalized matrix, not zeros
      CHECK(max_abs_diff(got, want) <= 1e-4 * scale);
      // bfloat16 operands and results ("medium", Megatron-LM's default): within bf16 rounding of
      // the same rounded iteration, and visibly not the float32 result.
      MuonConfig mcfg = cfg;
      mcfg.fp32_matmul_prec = MuonMatmulPrecision::medium;
      std::vector<float> work16(static_cast<size_t>(newton_schulz_workspace(rows, cols, mcfg)));
      std::vector<float> got16 = to_f32(x.d);
      newton_schulz(*be, test::f32_view(got16, {rows, cols}),
                    test::f32_view(work16, {static_cast<int64_t>(work16.size())}), mcfg);
      const Mat want16 = host_ns(x0, rows, cols, mcfg);
      CHECK(max_abs_diff(got16, want16) <= 3e-2 * scale);
      for (float v : got16) CHECK(static_cast<double>(v) == bf16_round(v));  // every value a bfloat16
      CHECK(max_abs_diff(got16, want) > 1e-5 * scale);
    }
}

TEST_CASE("muon_momentum and muon_orthogonalize: weight decay, momentum, Nesterov, the QKV split and the scale against the host",
          "[muon][reference]") {
  auto be = make_reference_backend(2);
  std::mt19937_64 rng(9111);
  // A GQA model's pieces: 4 heads in 2 groups of head_dim 2 (a group's rows [q q | k | v] of 2
  // each: 4 + 2 + 2), hidden 6; an fc2 weight [5, 7]; a norm and the word embeddings (AdamW's).
  ModelDims d;
  d.heads = 4;
  d.groups = 2;
  d.head_dim = 2;
  d.hidden = 6;
  std::vector<ParamDesc> params(4);
  auto set = [&](ParamDesc& p, const char* name, std::vector<int64_t> shape, int64_t offset) {
    p.name = name;
    p.global_shape = shape;
    p.shard = ShardIndex::whole(shape[0], shape.size() > 1 ? shape[1] : 1);
    p.offset = offset;
  };
  set(params[0], "decoder.layers.0.self_attention.linear_qkv.weight", {16, 6}, 0);
  set(params[1], "decoder.layers.0.input_layernorm.weight", {6}, 96);
  set(params[2], "decoder.layers.0.mlp.linear_fc2.weight", {5, 7}, 102);
  set(params[3], "embedding.word_embeddings.weight", {8, 6}, 137);
  params[3].decoupled_lr = true;
  const int64_t total = 185;
  MuonConfig cfg;
  cfg.fp32_matmul_prec = MuonMatmulPrecision::high;
  cfg.nesterov = true;
  cfg.momentum = 0.9;
  cfg.extra_scale_factor = 0.2;
  const std::vector<MuonMatrix> mats = muon_matrices(params, d, cfg);
  REQUIRE(mats.size() == 4);  // q, k, v of the QKV weight; fc2
  CHECK(mats[0].global_rows == 8);
  CHECK(mats[1].global_rows == 4);
  CHECK(mats[3].global_rows == 5);

  Buf master = Buf::randn({total}, rng, 0.5), grad = Buf::randn({total}, rng, 2.0), mom = Buf::randn({total}, rng, 0.1);
  std::vector<float> m32 = to_f32(master.d), g32 = to_f32(grad.d), b32 = to_f32(mom.d), copy(total, -1.0f);
  std::vector<float> work(static_cast<size_t>(muon_workspace_elements(mats, cfg)));
  const std::vector<char> all(mats.size(), 1);
  MuonViews v;
  v.grad = test::f32_view(g32, {total});
  v.workspace = test::f32_view(work, {static_cast<int64_t>(work.size())});
  const float lr = 0.1f, wd = 0.05f, gs = 0.5f;
  const std::vector<float> lrs(4, lr), wds(4, wd);
  const std::vector<MuonRange> whole_buffer = {
      MuonRange{0, total, test::f32_view(m32, {total}), test::f32_view(b32, {total}), test::f32_view(copy, {total})}};
  muon_momentum(*be, cfg, params, v, whole_buffer, lrs, wds, gs);
  const std::vector<float> updates = g32;  // before their orthogonalization
  muon_orthogonalize(*be, cfg, params, mats, all, v, nullptr);
  {
    // Split over two data-parallel ranks: each orthogonalizes its share and zeroes the others'
    // rows; their sum (what the reduce-scatter hands the shards) is the whole result, exactly.
    std::vector<float> sum(updates.size(), 0.0f);
    int64_t owners = 0;
    const std::vector<char> own0 = muon_owned(params, mats, 0, 2, 0, 2), own1 = muon_owned(params, mats, 1, 2, 1, 2);
    for (size_t k = 0; k < mats.size(); ++k) owners += own0[k] + own1[k];
    CHECK(owners == static_cast<int64_t>(mats.size()));
    CHECK(std::count(own0.begin(), own0.end(), 1) == 2);
    for (const std::vector<char>* own : {&own0, &own1}) {
      std::vector<float> gk = updates;
      MuonViews vk = v;
      vk.grad = test::f32_view(gk, {total});
      muon_orthogonalize(*be, cfg, params, mats, *own, vk, nullptr);
      for (int64_t i = 0; i < total; ++i)
        if (i < 96 || (i >= 102 && i < 137)) sum[static_cast<size_t>(i)] += gk[static_cast<size_t>(i)];
    }
    int64_t differ = 0;
    for (int64_t i = 0; i < total; ++i)
      if (i < 96 || (i >= 102 && i < 137)) differ += sum[static_cast<size_t>(i)] != g32[static_cast<size_t>(i)];
    CHECK(differ == 0);
  }
  muon_apply(*be, params, v, whole_buffer, lrs);

  // The host: p -= lr wd p; m = mu m + (1 - mu) g gs; u = (1 - mu) g gs + mu m; p -= lr s 0.2 NS(u).
  const double mu = 0.9;
  Mat p(m32.size()), m(m32.size()), u(m32.size());
  for (int64_t i = 0; i < total; ++i) {
    const double g = static_cast<float>(grad.d[i]) * static_cast<double>(gs);
    p[i] = static_cast<float>(master.d[i]);
    m[i] = mu * static_cast<float>(mom.d[i]) + (1 - mu) * g;
    u[i] = (1 - mu) * g + mu * m[i];
  }
  Mat want = p;
  auto apply = [&](const std::vector<int64_t>& rows_of, int64_t cols, int64_t base) {
    const int64_t R = static_cast<int64_t>(rows_of.size());
    Mat x;
    for (int64_t r : rows_of)
      for (int64_t c = 0; c < cols; ++c) x.push_back(u[base + r * cols + c]);
    const Mat o = host_ns(x, R, cols, cfg);
    const double s = std::sqrt(static_cast<double>(std::max(R, cols))) * 0.2;
    for (int64_t k = 0; k < R; ++k)
      for (int64_t c = 0; c < cols; ++c) {
        const int64_t i = base + rows_of[k] * cols + c;
        want[i] = p[i] - lr * wd * p[i] - lr * s * o[k * cols + c];
      }
  };
  apply({0, 1, 2, 3, 8, 9, 10, 11}, 6, 0);  // the queries of both groups
  apply({4, 5, 12, 13}, 6, 0);              // keys
  apply({6, 7, 14, 15}, 6, 0);              // values
  apply({0, 1, 2, 3, 4}, 7, 102);
  for (int64_t i = 0; i < total; ++i) {
    INFO("element " << i);
    const bool muons = i < 96 || (i >= 102 && i < 137);
    if (muons) {
      CHECK(m32[i] == Approx(want[i]).margin(1e-5));
      CHECK(b32[i] == Approx(m[i]).margin(1e-6));
      CHECK(copy[i] == m32[i]);
    } else {  // AdamW's: untouched here
      CHECK(m32[i] == static_cast<float>(master.d[i]));
      CHECK(b32[i] == static_cast<float>(mom.d[i]));
      CHECK(copy[i] == -1.0f);
    }
  }
  // Sharded states (the distributed optimizer): the flat range in two pieces whose states lie in
  // the other order, [100, 185) first, then [0, 100): the same update, element for element.
  {
    std::vector<float> sm(static_cast<size_t>(total)), sb(static_cast<size_t>(total)), sg = to_f32(grad.d),
        scopy(static_cast<size_t>(total), -1.0f);
    // (flat range, its state offset)
    const std::vector<std::pair<int64_t, int64_t>> at = {{100, 0}, {0, 85}};
    const std::vector<int64_t> count = {85, 100};
    std::vector<MuonRange> shards;
    for (size_t k = 0; k < at.size(); ++k) {
      const auto [flat, state] = at[k];
      for (int64_t i = 0; i < count[k]; ++i) {
        sm[static_cast<size_t>(state + i)] = static_cast<float>(master.d[flat + i]);
        sb[static_cast<size_t>(state + i)] = static_cast<float>(mom.d[flat + i]);
      }
      shards.push_back(MuonRange{flat, count[k], test::f32_view(sm, {total}).flat_slice(state, count[k]),
                                 test::f32_view(sb, {total}).flat_slice(state, count[k]),
                                 test::f32_view(scopy, {total}).flat_slice(flat, count[k])});
    }
    MuonViews sv = v;
    sv.grad = test::f32_view(sg, {total});
    muon_momentum(*be, cfg, params, sv, shards, lrs, wds, gs);
    muon_orthogonalize(*be, cfg, params, mats, all, sv, nullptr);
    muon_apply(*be, params, sv, shards, lrs);
    int64_t differ = 0;
    for (size_t k = 0; k < at.size(); ++k)
      for (int64_t i = 0; i < count[k]; ++i) {
        const size_t st = static_cast<size_t>(at[k].second + i), fl = static_cast<size_t>(at[k].first + i);
        differ += sm[st] != m32[fl] || sb[st] != b32[fl] || scopy[fl] != copy[fl];
      }
    CHECK(differ == 0);
  }
  // Without the split the QKV weight is one [16, 6] matrix: another update.
  MuonConfig whole = cfg;
  whole.split_qkv = false;
  CHECK(muon_matrices(params, d, whole).size() == 2);

  // AdamW's segments: the whole range minus the two Muon parameters.
  const std::vector<OptimSegment> segs = without_muon_params({OptimSegment{0, total, 0}}, params, 0);
  REQUIRE(segs.size() == 2);
  CHECK(segs[0].offset == 96);
  CHECK(segs[0].count == 6);
  CHECK(segs[1].offset == 137);
  CHECK(segs[1].count == 48);
}
