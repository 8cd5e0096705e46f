// Float64 gradient checks: causal GQA attention on packed QKV (with and without dropout).
#include "engine/backend.h"
#include "tests/gradcheck.h"

using namespace mt;
using mt::test::Buf;

namespace {

AttentionShape shape(int b, int s, int heads, int groups, int d, float p, bool causal) {
  return AttentionShape::make(b, s, heads, groups, d, causal, p, 1234);
}

// A gradient check's attention: sizes, dropout, causal, sliding window (-1: none).
struct Case {
  int b, s, heads, groups, d;
  float p;
  bool causal;
  int window = -1;
  AttentionShape shape() const {
    AttentionShape a = ::shape(b, s, heads, groups, d, p, causal);
    a.window_left = window;
    return a;
  }
};

// Independent forward: softmax over the causal scores, written from the layout description. With
// sinks (Megatron's SoftmaxOne), head h's softmax also has the column sinks[h], without a value.
std::vector<double> naive_attention(const std::vector<double>& qkv, const AttentionShape& a,
                                    const std::vector<double>* sinks = nullptr) {
  const int hpg = a.heads / a.groups, d = a.head_dim;
  const int64_t row = a.qkv_row_stride();
  std::vector<double> out(static_cast<size_t>(a.batch) * a.seq * a.heads * d, 0.0);
  for (int i = 0; i < a.batch; ++i)
    for (int h = 0; h < a.heads; ++h) {
      const int g = h / hpg;
      for (int q = 0; q < a.seq; ++q) {
        const double* qv = &qkv[(q * a.batch + i) * row + g * (hpg + 2) * d + (h % hpg) * d];
        std::vector<double> sc;
        // Every key, the masked ones at -inf (causal: later keys; window: more than window_left back).
        for (int k = 0; k < a.seq; ++k) {
          const bool masked = (a.causal && k > q) || (a.window_left >= 0 && q - k > a.window_left);
          const double* kv = &qkv[(k * a.batch + i) * row + g * (hpg + 2) * d + hpg * d];
          double s = 0;
          for (int c = 0; c < d; ++c) s += qv[c] * kv[c];
          sc.push_back(masked ? -INFINITY : s * a.softmax_scale);
        }
        const size_t keys = sc.size();
        if (sinks) sc.push_back((*sinks)[static_cast<size_t>(h)]);
        double mx = *std::max_element(sc.begin(), sc.end()), z = 0;
        for (double s : sc) z += std::exp(s - mx);
        for (size_t k = 0; k < keys; ++k) {
          const double p = std::exp(sc[k] - mx) / z;
          const double* vv = &qkv[(k * a.batch + i) * row + g * (hpg + 2) * d + (hpg + 1) * d];
          for (int c = 0; c < d; ++c) out[(q * a.batch + i) * a.heads * d + h * d + c] += p * vv[c];
        }
      }
    }
  return out;
}

}  // namespace

TEST_CASE("reference attention forward matches a naive softmax(QK^T)V", "[reference]") {
  auto be = make_reference_backend(2);
  std::mt19937_64 rng(31);
  for (bool causal : {true, false}) {
    const AttentionShape a = shape(2, 5, 4, 2, 3, 0.0f, causal);
    const int64_t N = a.batch * a.seq;
    Buf qkv = Buf::randn({N, a.qkv_row_stride()}, rng);
    Buf out = Buf::zeros({N, a.heads * a.head_dim}), lse = Buf::zeros({a.batch, a.heads, a.seq});
    be->attention_forward(out.t(), lse.t(), qkv.t(), a);
    mt::test::require_close(out.d, naive_attention(qkv.d, a), 1e-12, 1e-12, "attention out");
  }
}

TEST_CASE("reference attention with a sliding window matches the naive masked softmax", "[reference]") {
  auto be = make_reference_backend(2);
  std::mt19937_64 rng(33);
  for (int window : {0, 1, 3, 6}) {
    INFO("window_left " << window);
    AttentionShape a = shape(2, 7, 4, 2, 3, 0.0f, true);
    a.window_left = window;
    const int64_t N = a.batch * a.seq;
    Buf qkv = Buf::randn({N, a.qkv_row_stride()}, rng);
    Buf out = Buf::zeros({N, a.heads * a.head_dim}), lse = Buf::zeros({a.batch, a.heads, a.seq});
    be->attention_forward(out.t(), lse.t(), qkv.t(), a);
    mt::test::require_close(out.d, naive_attention(qkv.d, a), 1e-12, 1e-12, "windowed attention out");
    // A window that reaches the first token of every query is plain causal attention, bit for bit;
    // a shorter one is not.
    AttentionShape full = a;
    full.window_left = -1;
    Buf out_full = Buf::zeros({N, a.heads * a.head_dim});
    be->attention_forward(out_full.t(), lse.t(), qkv.t(), full);
    if (window >= a.seq - 1) CHECK(out.d == out_full.d);
    else CHECK(out.d != out_full.d);
  }
}

TEST_CASE("reference attention_backward gradients (causal GQA, dropout)", "[reference][gradcheck]") {
  auto be = make_reference_backend(2);
  std::mt19937_64 rng(32);
  for (const Case c : {Case{2, 5, 4, 2, 3, 0.0f, true}, Case{1, 6, 2, 1, 4, 0.25f, true}, Case{2, 4, 3, 3, 2, 0.0f, false}}) {
    const AttentionShape a = c.shape();
    const int64_t N = a.batch * a.seq, od = a.heads * a.head_dim;
    Buf qkv = Buf::randn({N, a.qkv_row_stride()}, rng), dout = Buf::randn({N, od}, rng);
    Buf out = Buf::zeros({N, od}), lse = Buf::zeros({a.batch, a.heads, a.seq});
    auto loss = [&] {
      be->attention_forward(out.t(), lse.t(), qkv.t(), a);
      return mt::test::dot(out.d, dout.d);
    };
    loss();
    Buf dqkv = Buf::randn({N, a.qkv_row_stride()}, rng);  // overwritten, not accumulated
    be->attention_backward(dqkv.t(), dout.t(), out.t(), lse.t(), qkv.t(), a);
    mt::test::check_gradient("attention dqkv", qkv.d, dqkv.d, loss);
  }
}

TEST_CASE("reference attention sinks: a naive softmax with a sink column, gradients of qkv and the sinks",
          "[reference][gradcheck]") {
  auto be = make_reference_backend(2);
  std::mt19937_64 rng(34);
  for (const Case c : {Case{2, 5, 4, 2, 3, 0.0f, true}, Case{1, 6, 2, 1, 4, 0.25f, true},
                       Case{2, 4, 3, 3, 2, 0.0f, false}, Case{2, 7, 2, 1, 3, 0.0f, true, 2}}) {
    const AttentionShape a = c.shape();
    const int64_t N = a.batch * a.seq, od = a.heads * a.head_dim;
    Buf qkv = Buf::randn({N, a.qkv_row_stride()}, rng), dout = Buf::randn({N, od}, rng);
    Buf sink = Buf::randn({a.heads}, rng, 1.5);
    Buf out = Buf::zeros({N, od}), lse = Buf::zeros({a.batch, a.heads, a.seq});
    auto forward = [&](Tensor sinks) {
      be->attention_forward(out.t(), lse.t(), qkv.t(), a);
      be->attention_sink_forward(out.t(), lse.t(), sinks);
    };
    if (c.p == 0.0f) {
      // The forward against the naive softmax with the sink's column; off-by-one is a sink of 0.
      forward(sink.t());
      mt::test::require_close(out.d, naive_attention(qkv.d, a, &sink.d), 1e-12, 1e-12, "attention with sinks");
      const std::vector<double> zeros(static_cast<size_t>(a.heads), 0.0);
      forward(Tensor());
      mt::test::require_close(out.d, naive_attention(qkv.d, a, &zeros), 1e-12, 1e-12, "off-by-one attention");
      CHECK(out.d != naive_attention(qkv.d, a));
    }
    auto loss = [&] {
      forward(sink.t());
      return mt::test::dot(out.d, dout.d);
    };
    loss();
    Buf dqkv = Buf::zeros({N, a.qkv_row_stride()});
    Buf dsink = Buf::randn({a.heads}, rng);  // accumulated into
    const std::vector<double> dsink0 = dsink.d;
    be->attention_sink_backward(dsink.t(), dout.t(), out.t(), lse.t(), sink.t());
    be->attention_backward(dqkv.t(), dout.t(), out.t(), lse.t(), qkv.t(), a);
    for (size_t h = 0; h < dsink.d.size(); ++h) dsink.d[h] -= dsink0[h];
    mt::test::check_gradient("attention-with-sinks dqkv", qkv.d, dqkv.d, loss);
    mt::test::check_gradient("attention dsink", sink.d, dsink.d, loss);
  }
}
