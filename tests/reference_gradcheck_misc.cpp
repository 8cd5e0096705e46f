// Float64 gradient checks: embeddings, rotary embeddings, dropout, vocab-parallel cross-entropy.
#include <array>

#include "engine/backend.h"
#include "engine/dropout_mask.h"
#include "tests/gradcheck.h"

using namespace mt;
using mt::test::Buf;

TEST_CASE("reference embedding forward/backward gradients (vocab shard, positions)", "[reference][gradcheck]") {
  auto be = make_reference_backend(2);
  std::mt19937_64 rng(41);
  const int64_t V = 6, H = 4, P = 5, vocab_start = 3;  // this shard holds tokens 3..8
  Buf tokens = Buf::ints({7}, {3, 8, 0, 4, 4, 9, 5});
  Buf positions = Buf::ints({7}, {0, 1, 2, 3, 4, 0, 1});
  Buf wte = Buf::randn({V, H}, rng), wpe = Buf::randn({P, H}, rng);
  Buf out = Buf::zeros({7, H}), dout = Buf::randn({7, H}, rng);
  auto loss = [&] {
    be->embedding_forward(out.t(), tokens.t(), positions.t(), wte.t(), wpe.t(), vocab_start);
    return mt::test::dot(out.d, dout.d);
  };
  loss();
  // Token 0 and 9 are outside the shard: only the position embedding.
  CHECK(out.d[2 * H] == wpe.d[2 * H]);
  CHECK(out.d[5 * H + 1] == wpe.d[1]);
  CHECK(out.d[0] == wte.d[0] + wpe.d[0]);
  Buf dwte = Buf::zeros({V, H}), dwpe = Buf::zeros({P, H});
  be->embedding_backward(dwte.t(), dwpe.t(), dout.t(), tokens.t(), positions.t(), vocab_start);
  mt::test::check_gradient("embedding dwte", wte.d, dwte.d, loss);
  mt::test::check_gradient("embedding dwpe", wpe.d, dwpe.d, loss);
}

TEST_CASE("reference rope forward/backward gradients (halves, interleaved, partial)", "[reference][gradcheck]") {
  auto be = make_reference_backend(2);
  std::mt19937_64 rng(42);
  for (bool interleaved : {false, true}) {
    for (int rot : {4, 2}) {
      RopeShape r;
      r.heads = 4;
      r.groups = 2;
      r.head_dim = 4;
      r.rot_dim = rot;
      r.interleaved = interleaved;
      const int64_t N = 5, row = r.groups * (r.heads / r.groups + 2) * r.head_dim, P = 8;
      Buf table = Buf::zeros({P, rot});
      for (int64_t pos = 0; pos < P; ++pos)
        for (int i = 0; i < rot / 2; ++i) {
          const double ang = pos * std::pow(10000.0, -2.0 * i / rot);
          table.d[pos * rot + i] = std::cos(ang);
          table.d[pos * rot + rot / 2 + i] = std::sin(ang);
        }
      Buf positions = Buf::ints({N}, {0, 3, 7, 1, 2});
      Buf x = Buf::randn({N, row}, rng), y = Buf::zeros({N, row}), dy = Buf::randn({N, row}, rng);
      auto loss = [&] {
        y.d = x.d;
        be->rope_forward(y.t(), positions.t(), table.t(), r);
        return mt::test::dot(y.d, dy.d);
      };
      loss();
      // Value check: q head 0 of row 1 (position 3), first pair.
      const double ang = 3.0, c = std::cos(ang), s = std::sin(ang);
      const int64_t a = interleaved ? 0 : 0, b = interleaved ? 1 : rot / 2;
      CHECK(y.d[row + a] == Approx(x.d[row + a] * c - x.d[row + b] * s));
      CHECK(y.d[row + b] == Approx(x.d[row + b] * c + x.d[row + a] * s));
      // v (last head_dim values of each group) is untouched.
      CHECK(y.d[row + 3 * r.head_dim + 1] == x.d[row + 3 * r.head_dim + 1]);
      Buf dx = Buf::zeros({N, row});
      dx.d = dy.d;
      be->rope_backward(dx.t(), positions.t(), table.t(), r);
      mt::test::check_gradient("rope dx", x.d, dx.d, loss);
    }
  }
}

TEST_CASE("reference MLA attention input: packing, Megatron's MLA RoPE, gradients (whole and partial rotation)",
          "[reference][gradcheck][mla]") {
  auto be = make_reference_backend(2);
  std::mt19937_64 rng(44);
  for (int rot : {6, 2}) {
    MlaShape m{3, 5, 6, rot, 4, 7};  // 3 heads, d_nope 5, d_rope 6, d_v 4; k_rope at column 7
    const int64_t N = 4, P = 9, D = m.qk_dim(), down_cols = 7 + 6 + 2;
    Buf table = Buf::zeros({P, rot});
    for (int64_t pos = 0; pos < P; ++pos)
      for (int i = 0; i < rot / 2; ++i) {
        const double ang = 0.7 * pos / (i + 1);
        table.d[pos * rot + i] = 1.3 * std::cos(ang);  // (YaRN's concentration scales both)
        table.d[pos * rot + rot / 2 + i] = 1.3 * std::sin(ang);
      }
    Buf positions = Buf::ints({N}, {0, 5, 8, 2});
    Buf q = Buf::randn({N, m.q_width()}, rng), kv = Buf::randn({N, m.kv_width()}, rng);
    Buf down = Buf::randn({N, down_cols}, rng), qkv = Buf::zeros({N, m.qkv_width()});
    Buf dy = Buf::randn({N, m.qkv_width()}, rng);
    auto loss = [&] {
      be->mla_qkv_forward(qkv.t(), q.t(), kv.t(), down.t(), positions.t(), table.t(), m);
      return mt::test::dot(qkv.d, dy.d);
    };
    loss();
    // Row 1 (position 5), head 2: q_nope copied; the first RoPE pair (q_rope values 0 and 1) turned
    // and written de-interleaved at RoPE outputs 0 and rot/2; k_nope and v copied, v's padding 0.
    const int64_t r = 1, h = 2, o = r * m.qkv_width() + h * 3 * D;
    const double* qr = &q.d[r * m.q_width() + h * D + 5];
    const double c = table.d[5 * rot], sn = table.d[5 * rot + rot / 2];
    CHECK(qkv.d[o + 1] == q.d[r * m.q_width() + h * D + 1]);
    CHECK(qkv.d[o + 5] == Approx(qr[0] * c - qr[1] * sn));
    CHECK(qkv.d[o + 5 + rot / 2] == Approx(qr[1] * c + qr[0] * sn));
    if (rot < 6) CHECK(qkv.d[o + 5 + 4] == qr[4]);  // past the rotated dims: passed through
    const double* kr = &down.d[r * down_cols + 7];
    CHECK(qkv.d[o + D + 5] == Approx(kr[0] * c - kr[1] * sn));  // the shared key, every head
    CHECK(qkv.d[o + D + 2] == kv.d[r * m.kv_width() + h * 9 + 2]);
    CHECK(qkv.d[o + 2 * D + 3] == kv.d[r * m.kv_width() + h * 9 + 5 + 3]);
    CHECK(qkv.d[o + 2 * D + 4] == 0.0);
    CHECK(qkv.d[o + 2 * D + D - 1] == 0.0);
    Buf dq = Buf::zeros({N, m.q_width()}), dkv = Buf::zeros({N, m.kv_width()}), ddown = Buf::zeros({N, down_cols});
    for (double& v : ddown.d) v = 5.0;  // columns outside k_rope stay as they are
    be->mla_qkv_backward(dq.t(), dkv.t(), ddown.t(), dy.t(), positions.t(), table.t(), m);
    CHECK(ddown.d[7 - 1] == 5.0);
    CHECK(ddown.d[down_cols - 1] == 5.0);
    mt::test::check_gradient("mla dq", q.d, dq.d, loss);
    mt::test::check_gradient("mla dkv", kv.d, dkv.d, loss);
    Buf dk = Buf::zeros({N, down_cols});
    for (int64_t n = 0; n < N; ++n)
      for (int64_t j = 7; j < 13; ++j) dk.d[n * down_cols + j] = ddown.d[n * down_cols + j];
    std::vector<double> saved = down.d;
    // (The columns outside k_rope have no gradient, numerically zero too.)
    mt::test::check_gradient("mla d k_rope", down.d, dk.d, loss);
    CHECK(down.d == saved);
  }
}

TEST_CASE("reference bias_dropout_add and dropout_backward", "[reference][gradcheck]") {
  auto be = make_reference_backend(2);
  std::mt19937_64 rng(43);
  const int64_t R = 40, C = 50;
  const float p = 0.3f;
  const uint64_t key = 99;
  Buf x = Buf::randn({R, C}, rng), bias = Buf::randn({C}, rng), res = Buf::randn({R, C}, rng);
  Buf out = Buf::zeros({R, C}), dout = Buf::randn({R, C}, rng);
  auto loss = [&] {
    be->bias_dropout_add(out.t(), x.t(), bias.t(), res.t(), p, key);
    return mt::test::dot(out.d, dout.d);
  };
  loss();
  int kept = 0;
  for (int64_t i = 0; i < R * C; ++i) {
    const bool keep = dropout_keep(key, static_cast<uint64_t>(i), p);
    kept += keep;
    const double expect = res.d[i] + (keep ? (x.d[i] + bias.d[i % C]) / (1 - p) : 0.0);
    REQUIRE(out.d[i] == Approx(expect).epsilon(1e-12));
  }
  CHECK(std::abs(kept / double(R * C) - (1 - p)) < 0.05);  // 2000 draws: about 70 % kept
  Buf dx = Buf::zeros({R, C});
  be->dropout_backward(dx.t(), dout.t(), p, key);
  mt::test::check_gradient("dropout dx", x.d, dx.d, loss, 1e-6, 1e-8, 1e-5, 7);
  mt::test::check_gradient("dropout dresidual", res.d, dout.d, loss, 1e-6, 1e-8, 1e-5, 7);
  // p = 0 is the identity (no mask work) and residual may be aliased by out.
  out.d = res.d;
  be->bias_dropout_add(out.t(), x.t(), Tensor(), out.t(), 0.0f, key);
  for (int64_t i = 0; i < R * C; ++i) REQUIRE(out.d[i] == res.d[i] + x.d[i]);
}

// engine/dropout_mask.h: one draw decides eight consecutive elements, 16 bits each.
TEST_CASE("dropout: a draw decides eight elements, each slot keeps a 1-p fraction", "[reference][dropout]") {
  const uint64_t key = 1234;
  const float p = 0.1f;
  CHECK(dropout_threshold(p) == 6554);  // round(0.1f * 65536)
  const int64_t n = 8 * 40000;
  std::array<int64_t, 8> kept{};
  int64_t total = 0, same_as_first = 0;
  for (int64_t g = 0; g < n / 8; ++g) {
    const Philox4 r = dropout_words(key, static_cast<uint64_t>(g));
    for (int s = 0; s < 8; ++s) {
      const uint64_t i = static_cast<uint64_t>(g * 8 + s);
      const bool keep = dropout_keep(key, i, p);
      REQUIRE(keep == (dropout_bits(r, i) >= dropout_threshold(p)));
      kept[s] += keep;
      total += keep;
      if (s > 0) same_as_first += keep == dropout_keep(key, static_cast<uint64_t>(g * 8), p);
    }
    REQUIRE(dropout_keep(key, static_cast<uint64_t>(g * 8), 0.0f));  // p = 0 keeps everything
  }
  CHECK(std::abs(total / double(n) - (1 - p)) < 0.003);
  for (int s = 0; s < 8; ++s) CHECK(std::abs(kept[s] / double(n / 8) - (1 - p)) < 0.01);
  // The slots of a draw are independent: two of them agree as often as two coin flips of 1-p would.
  const double agree = (1 - p) * (1 - p) + p * p;
  CHECK(std::abs(same_as_first / double(n / 8 * 7) - agree) < 0.01);
  // Another key draws another mask.
  int64_t differ = 0;
  for (int64_t i = 0; i < 10000; ++i) differ += dropout_keep(key, i, p) != dropout_keep(key + 1, i, p);
  CHECK(differ > 1000);
}

TEST_CASE("reference vocab-parallel cross-entropy gradients over two shards", "[reference][gradcheck]") {
  auto be = make_reference_backend(2);
  std::mt19937_64 rng(44);
  const int64_t N = 6, V = 10, half = 5;
  Buf logits = Buf::randn({N, V}, rng, 2.0), dloss = Buf::randn({N}, rng);
  Buf labels = Buf::ints({N}, {0, 4, 5, 9, 2, 7});
  // The two shards live in separate buffers (columns [0,5) and [5,10)).
  auto split = [&](int shard) {
    Buf s = Buf::zeros({N, half});
    for (int64_t r = 0; r < N; ++r)
      for (int64_t c = 0; c < half; ++c) s.d[r * half + c] = logits.d[r * V + shard * half + c];
    return s;
  };
  Buf lse = Buf::zeros({N}), target = Buf::zeros({N});
  auto loss = [&] {
    Buf parts = Buf::zeros({2, N}), tsum = Buf::zeros({N});
    for (int shard = 0; shard < 2; ++shard) {
      Buf s = split(shard), l = Buf::zeros({N}), t = Buf::zeros({N});
      be->cross_entropy_forward(l.t(), t.t(), s.t(), labels.t(), shard * half);
      for (int64_t r = 0; r < N; ++r) {
        parts.d[shard * N + r] = l.d[r];
        tsum.d[r] += t.d[r];  // the all-reduce of the target logit
      }
    }
    be->logsumexp_combine(lse.t(), parts.t());
    target.d = tsum.d;
    double total = 0;
    for (int64_t r = 0; r < N; ++r) total += dloss.d[r] * (lse.d[r] - target.d[r]);
    return total;
  };
  loss();
  // Against a direct log-softmax.
  for (int64_t r = 0; r < N; ++r) {
    double z = 0;
    for (int64_t c = 0; c < V; ++c) z += std::exp(logits.d[r * V + c]);
    CHECK(lse.d[r] == Approx(std::log(z)).epsilon(1e-12));
    CHECK(target.d[r] == logits.d[r * V + labels.i[r]]);
  }
  Buf dlogits = Buf::zeros({N, V});
  for (int shard = 0; shard < 2; ++shard) {
    Buf s = split(shard);
    be->cross_entropy_backward(s.t(), s.t(), labels.t(), lse.t(), dloss.t(), shard * half);  // in place
    for (int64_t r = 0; r < N; ++r)
      for (int64_t c = 0; c < half; ++c) dlogits.d[r * V + shard * half + c] = s.d[r * half + c];
  }
  mt::test::check_gradient("cross_entropy dlogits", logits.d, dlogits.d, loss);
}

TEST_CASE("reference masked_loss_sum", "[reference]") {
  auto be = make_reference_backend(1);
  Buf loss = Buf::zeros({4}), mask = Buf::zeros({4}), out = Buf::zeros({2});
  loss.d = {1.0, 2.0, NAN, 4.0};
  mask.d = {1.0, 1.0, 0.0, 1.0};
  be->masked_loss_sum(out.t(), loss.t(), mask.t(), false);
  CHECK(out.d[0] == 7.0);
  CHECK(out.d[1] == 3.0);
  be->masked_loss_sum(out.t(), loss.t(), mask.t(), true);
  CHECK(out.d[0] == 14.0);
  CHECK(out.d[1] == 6.0);
}

TEST_CASE("reference logits_argmax and argmax_match_count: torch's first maximum, the first shard on ties",
          "[reference][mtp]") {
  auto be = make_reference_backend(1);
  // Three rows of five logits of a shard starting at vocabulary id 10: a tie (the first wins), the
  // largest last, all equal (column 0).
  std::vector<double> logits = {1, 3, 0, 3, -1, -2, -1, 0, 1, 2, 5, 5, 5, 5, 5};
  std::vector<float> max(3, NAN);
  std::vector<int32_t> index(3, -1);
  be->logits_argmax(Tensor(max.data(), DType::f32, Device::cpu, {3}), Tensor(index.data(), DType::i32, Device::cpu, {3}),
                    Tensor(logits.data(), DType::f64, Device::cpu, {3, 5}), 10);
  CHECK(max == std::vector<float>{3, 2, 5});
  CHECK(index == std::vector<int32_t>{11, 14, 10});

  // Two shards of four rows: row 0's largest on shard 1, row 1's tied (shard 0 wins), row 2 masked
  // out, row 3's on shard 0 but not its label.
  std::vector<float> max_parts = {1, 4, 9, 7, /* shard 1 */ 2, 4, 9, 6};
  std::vector<int32_t> index_parts = {0, 1, 2, 3, /* shard 1 */ 50, 51, 52, 53};
  std::vector<int32_t> labels = {50, 1, 2, 53};
  std::vector<double> mask = {1, 1, 0, 1}, out = {NAN, NAN};
  auto count = [&](bool accumulate) {
    be->argmax_match_count(Tensor(out.data(), DType::f64, Device::cpu, {2}),
                           Tensor(max_parts.data(), DType::f32, Device::cpu, {2, 4}),
                           Tensor(index_parts.data(), DType::i32, Device::cpu, {2, 4}),
                           Tensor(labels.data(), DType::i32, Device::cpu, {4}), Tensor(mask.data(), DType::f64, Device::cpu, {4}),
                           accumulate);
  };
  count(false);
  CHECK(out == std::vector<double>{2, 3});  // rows 0 and 1 right, row 3 wrong, row 2 not counted
  count(true);
  CHECK(out == std::vector<double>{4, 6});
  // One shard: its own argmax decides.
  be->argmax_match_count(Tensor(out.data(), DType::f64, Device::cpu, {2}), Tensor(max_parts.data(), DType::f32, Device::cpu, {4}),
                         Tensor(index_parts.data(), DType::i32, Device::cpu, {4}),
                         Tensor(labels.data(), DType::i32, Device::cpu, {4}), Tensor(mask.data(), DType::f64, Device::cpu, {4}),
                         false);
  CHECK(out == std::vector<double>{1, 3});  // row 1 only
}

TEST_CASE("reference attention output gate: Megatron's [q | gate | k | v] split and merge, sigmoid gate gradients",
          "[reference][gradcheck]") {
  auto be = make_reference_backend(2);
  std::mt19937_64 rng(44);
  // Two groups of two query heads of dimension 1, two rows: the layout by hand.
  const GateShape s{2, 2, 1};
  REQUIRE(s.qkvg_width() == 12);
  Buf qkvg = Buf::zeros({2, 12});
  for (int64_t i = 0; i < 24; ++i) qkvg.d[static_cast<size_t>(i)] = static_cast<double>(i);
  Buf qkv = Buf::zeros({2, 8}), gate = Buf::zeros({2, 4});
  be->attention_gate_split(qkv.t(), gate.t(), qkvg.t(), s);
  CHECK(qkv.d == std::vector<double>{0, 1, 4, 5, 6, 7, 10, 11, 12, 13, 16, 17, 18, 19, 22, 23});
  CHECK(gate.d == std::vector<double>{2, 3, 8, 9, 14, 15, 20, 21});
  Buf back = Buf::zeros({2, 12});
  be->attention_gate_merge(back.t(), qkv.t(), gate.t(), s);
  CHECK(back.d == qkvg.d);

  const int64_t R = 9, C = 20;
  Buf x = Buf::randn({R, C}, rng), g = Buf::randn({R, C}, rng), out = Buf::zeros({R, C}), dout = Buf::randn({R, C}, rng);
  auto loss = [&] {
    be->output_gate_forward(out.t(), x.t(), g.t());
    return mt::test::dot(out.d, dout.d);
  };
  loss();
  CHECK(out.d[7] == Approx(x.d[7] / (1.0 + std::exp(-g.d[7]))).epsilon(1e-14));
  Buf dx = Buf::zeros({R, C}), dg = Buf::zeros({R, C});
  be->output_gate_backward(dx.t(), dg.t(), dout.t(), x.t(), g.t());
  mt::test::check_gradient("output gate dx", x.d, dx.d, loss);
  mt::test::check_gradient("output gate dgate", g.d, dg.d, loss);
  // In place, as the model runs it: dx over dout, dgate over gate.
  Buf d2 = dout, g2 = g;
  be->output_gate_backward(d2.t(), g2.t(), d2.t(), x.t(), g2.t());
  CHECK(d2.d == dx.d);
  CHECK(g2.d == dg.d);
}
