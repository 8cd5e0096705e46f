// Reference attention: float64 finite-difference gradient checks (MHA, GQA, MQA, dropout, causal, sliding windows
// and not), GQA equivalence with replicated K/V, the dropout rule, and closed-form cases.
#include <catch2/catch.hpp>

#include <array>
#include <cmath>
#include <map>
#include <vector>

#include "core/philox.h"
#include "engine/attention_dropout.h"
#include "engine/reference/attention.h"

using namespace mt;

namespace {

struct Buffers {
  AttentionShape a;
  std::vector<double> qkv, out, lse, dout, dqkv;
  explicit Buffers(const AttentionShape& shape, uint64_t seed) : a(shape) {
    const int64_t n = static_cast<int64_t>(a.batch) * a.seq;
    qkv.resize(n * a.qkv_row_stride());
    out.resize(n * a.heads * a.head_dim);
    lse.resize(n * a.heads);
    dout.resize(out.size());
    dqkv.assign(qkv.size(), NAN);
    for (size_t i = 0; i < qkv.size(); ++i) qkv[i] = normal_at(seed, i);
    for (size_t i = 0; i < dout.size(); ++i) dout[i] = normal_at(seed + 1, i);
  }
  Tensor t(std::vector<double>& v) { return Tensor(v.data(), DType::f64, Device::cpu, {static_cast<int64_t>(v.size())}); }
  void forward() { reference_attention_forward<double>(t(out), t(lse), t(qkv), a); }
  void backward() { reference_attention_backward<double>(t(dqkv), t(dout), t(out), t(lse), t(qkv), a); }
  // The scalar whose gradient the backward computes: sum(out * dout).
  double loss() {
    forward();
    double l = 0;
    for (size_t i = 0; i < out.size(); ++i) l += out[i] * dout[i];
    return l;
  }
};

AttentionShape shape(int b, int s, int heads, int groups, int d, bool causal, float dropout = 0) {
  return AttentionShape::make(b, s, heads, groups, d, causal, dropout, 1234);
}

AttentionShape windowed(AttentionShape a, int window_left) {
  a.window_left = window_left;
  return a;
}

// Max over all qkv entries of |analytic - central difference|, relative to the largest gradient.
double gradient_error(const AttentionShape& a) {
  Buffers buf(a, 7);
  buf.forward();
  buf.backward();
  const std::vector<double> analytic = buf.dqkv;
  const double h = 1e-6;
  double max_err = 0, max_grad = 0;
  for (size_t i = 0; i < buf.qkv.size(); ++i) {
    const double x0 = buf.qkv[i];
    buf.qkv[i] = x0 + h;
    const double lp = buf.loss();
    buf.qkv[i] = x0 - h;
    const double lm = buf.loss();
    buf.qkv[i] = x0;
    const double numeric = (lp - lm) / (2 * h);
    REQUIRE(std::isfinite(analytic[i]));
    max_err = std::max(max_err, std::abs(numeric - analytic[i]));
    max_grad = std::max(max_grad, std::abs(analytic[i]));
  }
  REQUIRE(max_grad > 1e-3);  // a vanishing gradient would make the check vacuous
  return max_err / max_grad;
}

}  // namespace

TEST_CASE("reference attention backward matches finite differences (float64)", "[attention]") {
  struct Case {
    const char* name;
    AttentionShape a;
  };
  const Case cases[] = {
      {"MHA causal", shape(2, 5, 2, 2, 3, true)},
      {"GQA causal", shape(2, 4, 4, 2, 3, true)},
      {"MQA causal", shape(1, 5, 3, 1, 2, true)},
      {"GQA not causal", shape(2, 3, 4, 2, 4, false)},
      {"MHA causal dropout", shape(2, 5, 2, 2, 3, true, 0.3f)},
      {"GQA causal dropout", shape(1, 6, 4, 2, 2, true, 0.5f)},
      {"MQA not causal dropout", shape(1, 4, 2, 1, 3, false, 0.2f)},
      {"MHA causal window 1", windowed(shape(2, 6, 2, 2, 3, true), 1)},
      {"GQA causal window 2", windowed(shape(1, 7, 4, 2, 3, true), 2)},
      {"MQA causal window 0 (itself only)", windowed(shape(1, 4, 2, 1, 2, true), 0)},
      {"GQA causal window 3 dropout", windowed(shape(2, 6, 4, 2, 2, true, 0.3f), 3)},
  };
  for (const Case& c : cases) {
    INFO(c.name);
    CHECK(gradient_error(c.a) < 1e-7);
  }
}

TEST_CASE("reference attention GQA equals MHA with replicated K/V", "[attention]") {
  // groups = 1 with 3 heads vs groups = 3 where every group holds the same k and v.
  const AttentionShape mqa = shape(2, 6, 3, 1, 4, true, 0.25f);
  AttentionShape mha = mqa;
  mha.groups = 3;
  Buffers g(mqa, 11), m(mha, 12);
  const int64_t d = 4, n = 12;
  for (int64_t r = 0; r < n; ++r) {
    const double* src = &g.qkv[r * mqa.qkv_row_stride()];  // [q0 q1 q2 | k | v]
    double* dst = &m.qkv[r * mha.qkv_row_stride()];        // [q0 k v | q1 k v | q2 k v]
    for (int h = 0; h < 3; ++h)
      for (int j = 0; j < d; ++j) {
        dst[h * 3 * d + j] = src[h * d + j];
        dst[h * 3 * d + d + j] = src[3 * d + j];
        dst[h * 3 * d + 2 * d + j] = src[4 * d + j];
      }
  }
  m.dout = g.dout;
  g.forward();
  m.forward();
  for (size_t i = 0; i < g.out.size(); ++i) REQUIRE(g.out[i] == Approx(m.out[i]).margin(1e-12));
  for (size_t i = 0; i < g.lse.size(); ++i) REQUIRE(g.lse[i] == Approx(m.lse[i]).margin(1e-12));
  g.backward();
  m.backward();
  for (int64_t r = 0; r < n; ++r) {
    const double* gq = &g.dqkv[r * mqa.qkv_row_stride()];
    const double* mq = &m.dqkv[r * mha.qkv_row_stride()];
    for (int j = 0; j < d; ++j) {
      double dk = 0, dv = 0;
      for (int h = 0; h < 3; ++h) {
        REQUIRE(gq[h * d + j] == Approx(mq[h * 3 * d + j]).margin(1e-12));
        dk += mq[h * 3 * d + d + j];
        dv += mq[h * 3 * d + 2 * d + j];
      }
      REQUIRE(gq[3 * d + j] == Approx(dk).margin(1e-12));
      REQUIRE(gq[4 * d + j] == Approx(dv).margin(1e-12));
    }
  }
}

TEST_CASE("attention dropout keeps a 1-p fraction, keyed by element", "[attention]") {
  // Every (query, key) of two heads of an odd-length sequence gets its own (draw, slot), eight
  // elements to a draw; each slot keeps a 1-p fraction.
  const int64_t seq = 301;
  const float p = 0.3f;
  const uint32_t threshold = dropout_threshold(p);
  CHECK(threshold == 19661);  // round(0.3f * 65536)
  CHECK(dropout_threshold(0.1f) == 6554);
  CHECK(dropout_threshold(0.0f) == 0);
  std::map<std::pair<uint64_t, int>, int> seen;
  std::map<uint64_t, int> per_draw;
  std::array<int64_t, 8> kept_in_slot{}, in_slot{};
  int64_t kept = 0, n = 0;
  for (int64_t bh = 0; bh < 2; ++bh)
    for (int64_t q = 0; q < seq; ++q)
      for (int64_t k = 0; k < seq; ++k) {
        const uint64_t draw = attention_dropout_draw(bh, seq, q, k);
        const int slot = attention_dropout_slot(q, k);
        REQUIRE(slot >= 0);
        REQUIRE(slot < 8);
        ++seen[{draw, slot}];
        ++per_draw[draw];
        const bool keep = attention_dropout_keep(99, bh, seq, q, k, threshold);
        CHECK(keep == (dropout_bits(attention_dropout_words(99, draw), slot) >= threshold));
        kept += keep;
        ++n;
        kept_in_slot[slot] += keep;
        ++in_slot[slot];
        CHECK(attention_dropout_keep(99, bh, seq, q, k, 0));  // p = 0 keeps everything
      }
  CHECK(seen.size() == static_cast<size_t>(n));  // no two elements share a (draw, slot)
  int full = 0;
  for (const auto& [draw, count] : per_draw) {
    REQUIRE(count <= 8);
    full += count == 8;
  }
  CHECK(full > static_cast<int>(per_draw.size()) * 9 / 10);  // eight to a draw away from the edges
  CHECK(std::abs(kept / double(n) - (1 - p)) < 0.005);
  for (int s = 0; s < 8; ++s) CHECK(std::abs(kept_in_slot[s] / double(in_slot[s]) - (1 - p)) < 0.01);
  // The draw's place in the layout: query and key 16-blocks, then (q % 8) / 2 and k % 8.
  CHECK(attention_dropout_draw(1, 40, 17, 35) == ((1 * 3 + 1) * 3 + 2) * 32 + 0 * 8 + 3);
  CHECK(attention_dropout_slot(9, 12) == (1 * 2 + 1) * 2 + 1);

  // Dropout changes the output; the same key reproduces it.
  Buffers a(shape(1, 8, 2, 2, 4, true, 0.5f), 3), b(shape(1, 8, 2, 2, 4, true, 0.0f), 3);
  a.forward();
  b.forward();
  double diff = 0;
  for (size_t i = 0; i < a.out.size(); ++i) diff += std::abs(a.out[i] - b.out[i]);
  CHECK(diff > 1e-3);
  for (size_t i = 0; i < a.lse.size(); ++i) CHECK(a.lse[i] == b.lse[i]);  // lse is pre-dropout
  const std::vector<double> first = a.out;
  a.forward();
  CHECK(first == a.out);
}

TEST_CASE("reference attention closed forms: first query, one key", "[attention]") {
  Buffers buf(shape(2, 4, 2, 1, 3, true), 5);
  buf.forward();
  const AttentionShape& a = buf.a;
  const int64_t stride = a.qkv_row_stride(), d = 3;
  for (int i = 0; i < 2; ++i) {
    // Query 0 sees only key 0: out = v0, lse = scale * q0.k0.
    const double* row = &buf.qkv[i * stride];  // t = 0, sample i: row i = [q0 q1 k v]
    for (int h = 0; h < 2; ++h) {
      double qk = 0;
      for (int j = 0; j < d; ++j) {
        CHECK(buf.out[(i * 2 + h) * d + j] == Approx(row[3 * d + j]).margin(1e-14));
        qk += row[h * d + j] * row[2 * d + j];
      }
      CHECK(buf.lse[(i * 2 + h) * 4 + 0] == Approx(a.softmax_scale * qk).margin(1e-12));
    }
  }
}

TEST_CASE("reference attention float32 agrees with float64", "[attention]") {
  const AttentionShape a = shape(2, 9, 4, 2, 8, true, 0.1f);
  Buffers d(a, 21);
  d.forward();
  d.backward();
  std::vector<float> qkv(d.qkv.begin(), d.qkv.end()), dout(d.dout.begin(), d.dout.end());
  std::vector<float> out(d.out.size()), lse(d.lse.size()), dqkv(d.dqkv.size());
  auto t = [](std::vector<float>& v) { return Tensor(v.data(), DType::f32, Device::cpu, {static_cast<int64_t>(v.size())}); };
  reference_attention_forward<float>(t(out), t(lse), t(qkv), a);
  reference_attention_backward<float>(t(dqkv), t(dout), t(out), t(lse), t(qkv), a);
  for (size_t i = 0; i < out.size(); ++i) REQUIRE(out[i] == Approx(d.out[i]).margin(1e-5));
  for (size_t i = 0; i < lse.size(); ++i) REQUIRE(lse[i] == Approx(d.lse[i]).margin(1e-5));
  for (size_t i = 0; i < dqkv.size(); ++i) REQUIRE(dqkv[i] == Approx(d.dqkv[i]).margin(1e-4));
}

TEST_CASE("reference attention refuses a window without causal masking", "[attention]") {
  Buffers buf(windowed(shape(1, 4, 2, 2, 2, false), 1), 5);
  REQUIRE_THROWS_WITH(buf.forward(), Catch::Contains("window_left 1"));
  Buffers bad(windowed(shape(1, 4, 2, 2, 2, true), -2), 5);
  REQUIRE_THROWS_WITH(bad.forward(), Catch::Contains("window_left -2"));
}

TEST_CASE("reference attention rejects mismatched tensors", "[attention]") {
  Buffers buf(shape(1, 4, 2, 2, 3, true), 1);
  std::vector<double> short_out(5);
  CHECK_THROWS_AS(reference_attention_forward<double>(buf.t(short_out), buf.t(buf.lse), buf.t(buf.qkv), buf.a), Error);
  CHECK_THROWS_AS(reference_attention_forward<float>(buf.t(buf.out), buf.t(buf.lse), buf.t(buf.qkv), buf.a), Error);
  AttentionShape bad = buf.a;
  bad.groups = 3;
  CHECK_THROWS_AS(reference_attention_forward<double>(buf.t(buf.out), buf.t(buf.lse), buf.t(buf.qkv), bad), Error);
}

// The masked variants (the oracle for cuDNN's own dropout masks): given the mask the Philox rule
// draws they compute the same bits as the unmasked functions; given another mask, their backward
// is still the gradient of their forward (central differences, float64).
TEST_CASE("reference attention with an explicit dropout mask", "[attention]") {
  const AttentionShape a = shape(2, 7, 4, 2, 3, true, 0.3f);
  const size_t entries = static_cast<size_t>(a.batch) * a.heads * a.seq * a.seq;
  std::vector<uint8_t> rule(entries), other(entries);
  for (int64_t i = 0; i < a.batch; ++i)
    for (int64_t h = 0; h < a.heads; ++h)
      for (int64_t q = 0; q < a.seq; ++q)
        for (int64_t k = 0; k < a.seq; ++k) {
          const size_t e = static_cast<size_t>(((i * a.heads + h) * a.seq + q) * a.seq + k);
          rule[e] = attention_dropout_keep(a.dropout_key, i * a.heads + h, a.seq, q, k,
                                           dropout_threshold(a.dropout_p));
          other[e] = normal_at(55, e) > -0.5;  // about 69% kept, unrelated to the rule
        }
  Buffers plain(a, 3), masked(a, 3);
  plain.forward();
  plain.backward();
  reference_attention_forward_masked<double>(masked.t(masked.out), masked.t(masked.lse), masked.t(masked.qkv), a, rule);
  reference_attention_backward_masked<double>(masked.t(masked.dqkv), masked.t(masked.dout), masked.t(masked.out),
                                              masked.t(masked.lse), masked.t(masked.qkv), a, rule);
  CHECK(plain.out == masked.out);
  CHECK(plain.lse == masked.lse);
  CHECK(plain.dqkv == masked.dqkv);

  Buffers buf(a, 9);
  auto forward = [&] {
    reference_attention_forward_masked<double>(buf.t(buf.out), buf.t(buf.lse), buf.t(buf.qkv), a, other);
    double l = 0;
    for (size_t i = 0; i < buf.out.size(); ++i) l += buf.out[i] * buf.dout[i];
    return l;
  };
  forward();
  CHECK(buf.out != plain.out);
  reference_attention_backward_masked<double>(buf.t(buf.dqkv), buf.t(buf.dout), buf.t(buf.out), buf.t(buf.lse),
                                              buf.t(buf.qkv), a, other);
  const std::vector<double> analytic = buf.dqkv;
  double max_err = 0, max_grad = 0;
  for (size_t i = 0; i < buf.qkv.size(); ++i) {
    const double x0 = buf.qkv[i], h = 1e-6;
    buf.qkv[i] = x0 + h;
    const double lp = forward();
    buf.qkv[i] = x0 - h;
    const double lm = forward();
    buf.qkv[i] = x0;
    max_err = std::max(max_err, std::abs((lp - lm) / (2 * h) - analytic[i]));
    max_grad = std::max(max_grad, std::abs(analytic[i]));
  }
  REQUIRE(max_grad > 1e-3);
  CHECK(max_err / max_grad < 1e-6);
  CHECK_THROWS(reference_attention_forward_masked<double>(buf.t(buf.out), buf.t(buf.lse), buf.t(buf.qkv), a,
                                                          std::vector<uint8_t>(entries - 1, 1)));
}

namespace {

// Document starts of a sample made of documents of the given lengths, appended to `starts`.
void append_documents(std::vector<int32_t>& starts, const std::vector<int>& lengths) {
  int32_t t = 0;
  for (int len : lengths) {
    for (int j = 0; j < len; ++j) starts.push_back(t);
    t += len;
  }
}

}  // namespace

// Packed documents (--reset-attention-mask): each document's rows are exactly those of attention
// run on that document alone (out, lse and every gradient), and the backward is the forward's
// gradient (central differences), with GQA, dropout and a window too.
TEST_CASE("reference attention with packed documents equals attention per document", "[attention]") {
  const std::vector<std::vector<int>> samples = {{3, 1, 5, 2}, {11}, {1, 1, 9}};
  const int s = 11, heads = 4, groups = 2, d = 3;
  std::vector<int32_t> starts;
  for (const auto& docs : samples) append_documents(starts, docs);
  AttentionShape a = shape(3, s, heads, groups, d, true);
  a.documents = true;
  a.doc_start = Tensor(starts.data(), DType::i32, Device::cpu, {static_cast<int64_t>(starts.size())});
  Buffers packed(a, 21);
  packed.forward();
  packed.backward();
  const int64_t row = a.qkv_row_stride(), orow = heads * d;
  for (int i = 0; i < 3; ++i) {
    int t0 = 0;
    for (int len : samples[static_cast<size_t>(i)]) {
      INFO("sample " << i << ", document at " << t0 << " of length " << len);
      Buffers one(shape(1, len, heads, groups, d, true), 0);
      for (int t = 0; t < len; ++t) {
        for (int64_t j = 0; j < row; ++j) one.qkv[t * row + j] = packed.qkv[((t0 + t) * 3 + i) * row + j];
        for (int64_t j = 0; j < orow; ++j) one.dout[t * orow + j] = packed.dout[((t0 + t) * 3 + i) * orow + j];
      }
      one.forward();
      one.backward();
      double worst = 0;
      for (int t = 0; t < len; ++t) {
        for (int64_t j = 0; j < orow; ++j)
          worst = std::max(worst, std::abs(one.out[t * orow + j] - packed.out[((t0 + t) * 3 + i) * orow + j]));
        for (int64_t j = 0; j < row; ++j)
          worst = std::max(worst, std::abs(one.dqkv[t * row + j] - packed.dqkv[((t0 + t) * 3 + i) * row + j]));
        for (int h = 0; h < heads; ++h)
          worst = std::max(worst, std::abs(one.lse[h * len + t] - packed.lse[(i * heads + h) * s + t0 + t]));
      }
      CHECK(worst < 1e-12);
      t0 += len;
    }
  }
  // Without the documents the first sample's later rows see earlier documents: different outputs.
  AttentionShape whole = a;
  whole.documents = false;
  whole.doc_start = Tensor();
  Buffers plain(whole, 21);
  plain.forward();
  CHECK(plain.out != packed.out);

  // Gradients by central differences, with dropout and with a window.
  for (float p : {0.0f, 0.3f})
    for (int window : {-1, 2}) {
      INFO("dropout " << p << ", window " << window);
      AttentionShape g = a;
      g.dropout_p = p;
      g.window_left = window;
      CHECK(gradient_error(g) < 1e-7);
    }
  // Malformed starts are refused.
  std::vector<int32_t> bad = starts;
  bad[5] = 2;  // neither its own position nor its predecessor's entry
  AttentionShape wrong = a;
  wrong.doc_start = Tensor(bad.data(), DType::i32, Device::cpu, {static_cast<int64_t>(bad.size())});
  Buffers w(wrong, 1);
  CHECK_THROWS(w.forward());
}
