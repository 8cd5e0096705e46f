// Reference backend: optimizer steps against hand-computed numbers, reductions, init, basics.
#include <array>

#include "core/shard.h"
#include "engine/backend.h"
#include "tests/gradcheck.h"

using namespace mt;
using mt::test::Buf;

TEST_CASE("reference adamw_step: two steps by hand, per-group lr and weight decay", "[reference][optimizer]") {
  auto be = make_reference_backend(1);
  Buf w = Buf::zeros({2}), g = Buf::zeros({2}), m = Buf::zeros({2}), v = Buf::zeros({2});
  w.d = {1.0, 1.0};
  g.d = {0.5, 0.5};
  std::vector<float> model(2);
  const std::array<OptimSegment, 2> segs{OptimSegment{0, 1, 0}, OptimSegment{1, 1, 1}};
  OptimStepParams p;
  p.lr[0] = 0.1f;
  p.weight_decay[0] = 0.01f;
  p.lr[1] = 0.2f;
  p.weight_decay[1] = 0.0f;
  p.grad_scale = 2.0f;  // g = 1.0
  p.step = 1;
  be->adamw_step(w.t(), g.t(), m.t(), v.t(), mt::test::f32_view(model, {2}), segs, p);
  // The hyper-parameters are float32: use their exact values.
  const double b1 = 0.9f, b2 = 0.999f, eps = 1e-8f, lr0 = 0.1f, lr1 = 0.2f, wd0 = 0.01f;
  // g = 1: m = 1 - b1, v = 1 - b2; both bias-corrected to 1; update = 1/(1 + eps) + wd * w.
  const double u0 = 1.0 / (1.0 + eps);
  const double w1a = 1.0 - lr0 * (u0 + wd0 * 1.0), w1b = 1.0 - lr1 * u0;
  CHECK(m.d[0] == Approx(1 - b1).epsilon(1e-14));
  CHECK(v.d[0] == Approx(1 - b2).epsilon(1e-14));
  CHECK(w.d[0] == Approx(w1a).epsilon(1e-14));
  CHECK(w.d[1] == Approx(w1b).epsilon(1e-14));
  CHECK(model[0] == static_cast<float>(w.d[0]));
  // Step 2 with g = -1: m = b1 (1 - b1) - (1 - b1), v = b2 (1 - b2) + (1 - b2),
  // bias corrections 1 - b1^2 and 1 - b2^2.
  g.d = {-0.5, -0.5};
  p.step = 2;
  be->adamw_step(w.t(), g.t(), m.t(), v.t(), Tensor(), segs, p);
  const double m2 = b1 * (1 - b1) - (1 - b1), v2 = b2 * (1 - b2) + (1 - b2);
  const double mh = m2 / (1 - b1 * b1), vh = v2 / (1 - b2 * b2);
  const double w2a = w1a - lr0 * (mh / (std::sqrt(vh) + eps) + wd0 * w1a);
  const double w2b = w1b - lr1 * (mh / (std::sqrt(vh) + eps));
  CHECK(m2 == Approx(-0.01).epsilon(1e-4));  // the hand numbers: m = -0.01, v = 0.001999
  CHECK(v2 == Approx(0.001999).epsilon(1e-4));
  CHECK(m.d[0] == Approx(m2).epsilon(1e-12));
  CHECK(v.d[0] == Approx(v2).epsilon(1e-12));
  CHECK(w.d[0] == Approx(w2a).epsilon(1e-12));
  CHECK(w.d[1] == Approx(w2b).epsilon(1e-12));
}

TEST_CASE("reference sgd_step with momentum and L2 weight decay", "[reference][optimizer]") {
  auto be = make_reference_backend(1);
  Buf w = Buf::zeros({1}), g = Buf::zeros({1}), buf = Buf::zeros({1});
  w.d = {1.0};
  g.d = {0.5};
  OptimStepParams p;
  p.lr[0] = 0.1f;
  p.weight_decay[0] = 0.01f;
  p.sgd_momentum = 0.9f;
  be->sgd_step(w.t(), g.t(), buf.t(), Tensor(), {}, p);
  CHECK(buf.d[0] == Approx(0.51));
  CHECK(w.d[0] == Approx(0.949));
  be->sgd_step(w.t(), g.t(), buf.t(), Tensor(), {}, p);
  CHECK(buf.d[0] == Approx(0.9 * 0.51 + 0.5 + 0.01 * 0.949));
  CHECK(w.d[0] == Approx(0.852151));
}

TEST_CASE("reference sum_squares and count_zeros over segments, thread-count independent", "[reference]") {
  std::mt19937_64 rng(51);
  const int64_t n = 50000;
  Buf x = Buf::randn({n}, rng);
  for (int64_t i = 0; i < n; i += 7) x.d[i] = 0.0;
  const std::array<OptimSegment, 2> segs{OptimSegment{0, 10000, 0}, OptimSegment{20000, 30000, 0}};
  double expect = 0, zeros = 0;
  for (const auto& s : segs)
    for (int64_t i = s.offset; i < s.offset + s.count; ++i) {
      expect += x.d[i] * x.d[i];
      zeros += x.d[i] == 0.0;
    }
  Buf out1 = Buf::zeros({1}), out2 = Buf::zeros({1}), z = Buf::zeros({1});
  make_reference_backend(1)->sum_squares(out1.t(), x.t(), segs, false);
  auto be = make_reference_backend(3);
  be->sum_squares(out2.t(), x.t(), segs, false);
  CHECK(out1.d[0] == Approx(expect).epsilon(1e-12));
  CHECK(out1.d[0] == out2.d[0]);  // bit-identical across thread counts
  be->sum_squares(out2.t(), x.t(), segs, true);
  CHECK(out2.d[0] == Approx(2 * expect).epsilon(1e-12));
  be->count_zeros(z.t(), x.t(), segs, false);
  CHECK(z.d[0] == zeros);
  be->sum_squares(out1.t(), x.t(), {}, false);  // empty segments: all of x
  double all = 0;
  for (double v : x.d) all += v * v;
  CHECK(out1.d[0] == Approx(all).epsilon(1e-12));
}

TEST_CASE("reference init_normal is layout-independent (row, column and chunked shards)", "[reference]") {
  auto be = make_reference_backend(2);
  const uint64_t key = mix_key(1234, fnv1a64("w"));
  const int64_t R = 8, C = 6;
  std::vector<float> whole(R * C);
  be->init_normal(mt::test::f32_view(whole, {R, C}), key, 0.02f, ShardIndex::whole(R, C));
  double sum = 0, sq = 0;
  for (float v : whole) {
    sum += v;
    sq += double(v) * v;
  }
  CHECK(std::abs(sum / (R * C)) < 0.01);
  CHECK(std::sqrt(sq / (R * C)) == Approx(0.02).epsilon(0.35));
  // Row shard 1 of 2.
  std::vector<float> rows(R / 2 * C);
  be->init_normal(mt::test::f32_view(rows, {R / 2, C}), key, 0.02f, ShardIndex{R, C, R / 2, 0, R / 2, C, 1});
  for (int64_t i = 0; i < R / 2 * C; ++i) REQUIRE(rows[i] == whole[R / 2 * C + i]);
  // Column shard 1 of 3.
  std::vector<float> cols(R * 2);
  be->init_normal(mt::test::f32_view(cols, {R, 2}), key, 0.02f, ShardIndex{R, C, 0, 2, R, 2, 1});
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < 2; ++c) REQUIRE(cols[r * 2 + c] == whole[r * C + 2 + c]);
  // Two chunks of 4 rows, rank 1 of 2 holds rows 2..3 of each chunk.
  std::vector<float> chunked(4 * C);
  be->init_normal(mt::test::f32_view(chunked, {4, C}), key, 0.02f, ShardIndex{R, C, 2, 0, 2, C, 2});
  for (int64_t k = 0; k < 2; ++k)
    for (int64_t c = 0; c < C; ++c) {
      REQUIRE(chunked[(0 + k) * C + c] == whole[(2 + k) * C + c]);
      REQUIRE(chunked[(2 + k) * C + c] == whole[(4 + 2 + k) * C + c]);
    }
  // float64 gets the same float32 values.
  Buf w64 = Buf::zeros({R, C});
  be->init_normal(w64.t(), key, 0.02f, ShardIndex::whole(R, C));
  for (int64_t i = 0; i < R * C; ++i) REQUIRE(w64.d[i] == static_cast<double>(whole[i]));
}

TEST_CASE("reference fill, cast, axpby", "[reference]") {
  auto be = make_reference_backend(1);
  Buf a = Buf::zeros({3}), b = Buf::zeros({3});
  be->fill(a.t(), 2.5);
  CHECK(a.d == std::vector<double>{2.5, 2.5, 2.5});
  b.d = {1, 2, 3};
  be->axpby(a.t(), 2.0f, a.t(), -1.0f, b.t());
  CHECK(a.d == std::vector<double>{4.0, 3.0, 2.0});
  be->axpby(a.t(), 0.5f, a.t(), 0.0f, Tensor());
  CHECK(a.d == std::vector<double>{2.0, 1.5, 1.0});
  std::vector<uint16_t> bf(3);
  Tensor tbf(bf.data(), DType::bf16, Device::cpu, {3});
  be->cast(tbf, a.t());
  be->cast(b.t(), tbf);
  CHECK(b.d == std::vector<double>{2.0, 1.5, 1.0});
}
