// Attention blocks on the reference backend (context parallelism, engine/backend.h): a sequence
// split into 2 CP chunks, rank r holding chunks r and 2 CP - 1 - r (load-balanced context
// parallelism), every (query chunk, key chunk) block computed with attention_block_forward and
// merged with attention_merge, must give attention_forward's out and lse on the whole sequence; the
// blocks' attention_block_backward (with the merged out and lse), their dK, dV gathered per owner
// and added back with attention_kv_unpack_add, must give attention_backward's dqkv. MHA, GQA, MQA,
// causal or not, sliding windows, dropout, packed documents (the whole sequence's document starts);
// float64 and float32. Also the edge cases: a block a row
// of which sees no key, merges with such a block, masks taken from global positions, and the checks.
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "core/philox.h"
#include "engine/backend.h"

using namespace mt;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

template <typename T>
constexpr DType dtype_of() {
  return sizeof(T) == 8 ? DType::f64 : DType::f32;
}

template <typename T>
Tensor view(std::vector<T>& v, std::initializer_list<int64_t> dims) {
  return Tensor(v.data(), dtype_of<T>(), Device::cpu, dims);
}

AttentionShape shape(int b, int s, int heads, int groups, int d, bool causal, float dropout = 0, int window = -1) {
  AttentionShape a = AttentionShape::make(b, s, heads, groups, d, causal, dropout, 4321);
  a.window_left = window;
  return a;
}

// Packed documents: each sample's document starts (position 0 first), as the whole sequence's
// doc_start (kept alive for the test run).
AttentionShape with_documents(AttentionShape a, const std::vector<std::vector<int32_t>>& starts) {
  static std::vector<std::vector<int32_t>> storage;
  std::vector<int32_t> doc(static_cast<size_t>(a.batch) * a.seq);
  for (int i = 0; i < a.batch; ++i) {
    const std::vector<int32_t>& st = starts.at(static_cast<size_t>(i));
    for (int t = 0; t < a.seq; ++t) {
      int32_t v = 0;
      for (int32_t x : st)
        if (x <= t) v = x;
      doc[static_cast<size_t>(i) * a.seq + t] = v;
    }
  }
  storage.reserve(64);  // (the tensors point into the vectors: no reallocation of the list)
  storage.push_back(std::move(doc));
  a.documents = true;
  a.doc_start = Tensor(storage.back().data(), DType::i32, Device::cpu, {static_cast<int64_t>(storage.back().size())});
  return a;
}

AttentionShape with_seq(AttentionShape a, int64_t seq) {
  a.seq = static_cast<int>(seq);
  return a;
}

int64_t out_cols(const AttentionShape& a) { return static_cast<int64_t>(a.heads) * a.head_dim; }
int64_t kv_cols(const AttentionShape& a) { return static_cast<int64_t>(a.groups) * 2 * a.head_dim; }

// The whole sequence through attention_forward and attention_backward: the oracle.
template <typename T>
struct Whole {
  AttentionShape a;
  int64_t n;  // rows b * s
  std::vector<T> qkv, out, lse, dout, dqkv;
  Whole(const AttentionShape& shape, uint64_t seed) : a(shape), n(static_cast<int64_t>(shape.batch) * shape.seq) {
    qkv.resize(n * a.qkv_row_stride());
    out.resize(n * out_cols(a));
    lse.resize(n * a.heads);
    dout.resize(out.size());
    dqkv.assign(qkv.size(), static_cast<T>(NAN));
    for (size_t i = 0; i < qkv.size(); ++i) qkv[i] = static_cast<T>(normal_at(seed, i));
    for (size_t i = 0; i < dout.size(); ++i) dout[i] = static_cast<T>(normal_at(seed + 1, i));
  }
  void run(Backend& be) {
    const Tensor out_t = view(out, {n, out_cols(a)}), lse_t = view(lse, {a.batch, a.heads, a.seq});
    be.attention_forward(out_t, lse_t, view(qkv, {n, a.qkv_row_stride()}), a);
    be.attention_backward(view(dqkv, {n, a.qkv_row_stride()}), view(dout, {n, out_cols(a)}), out_t, lse_t,
                          view(qkv, {n, a.qkv_row_stride()}), a);
  }
};

// 2 cp chunks of a sequence of s positions (sizes differing by at most one when 2 cp does not
// divide s): chunk k holds positions [begin(k), begin(k) + len(k)).
struct Split {
  int64_t s;
  int cp;
  int64_t begin(int k) const { return k * s / (2 * cp); }
  int64_t len(int k) const { return begin(k + 1) - begin(k); }
  int chunks() const { return 2 * cp; }
  // Rank r holds chunks r and 2 cp - 1 - r, in that order: the owner of chunk k and where the
  // chunk starts among the owner's positions.
  int owner(int k) const { return k < cp ? k : 2 * cp - 1 - k; }
  int64_t local_begin(int k) const { return k < cp ? 0 : len(owner(k)); }
  int64_t local_len(int r) const { return len(r) + len(2 * cp - 1 - r); }
};

// What one rank holds: its positions' packed QKV rows and their gradient, the packed K/V of them
// (attention_kv_pack) and its gradient; per local query chunk, the merged out and lse.
template <typename T>
struct Rank {
  AttentionShape local;  // the rank's shape: its 2 chunks' positions
  std::vector<T> qkv, dqkv, kv, dkv;
  std::vector<T> out[2], lse[2];
};

struct Errors {
  double out = 0, lse = 0, dqkv = 0, max_grad = 0;
};

// Runs the context-parallel computation on the reference backend and returns its largest
// deviations from the whole sequence's results.
template <typename T>
Errors context_parallel_errors(Backend& be, const AttentionShape& a, int cp, uint64_t seed) {
  Whole<T> whole(a, seed);
  whole.run(be);
  const Split split{a.seq, cp};
  const int64_t b = a.batch, stride = a.qkv_row_stride(), oc = out_cols(a), kc = kv_cols(a);

  // Each rank's rows: its two chunks, sequence-major, so each chunk is a contiguous block of rows.
  std::vector<Rank<T>> ranks(static_cast<size_t>(cp));
  for (int r = 0; r < cp; ++r) {
    Rank<T>& R = ranks[r];
    R.local = with_seq(a, split.local_len(r));
    const int64_t rows = b * R.local.seq;
    for (int k : {r, 2 * cp - 1 - r})
      R.qkv.insert(R.qkv.end(), whole.qkv.begin() + split.begin(k) * b * stride,
                   whole.qkv.begin() + (split.begin(k) + split.len(k)) * b * stride);
    R.dqkv.assign(R.qkv.size(), T(0));
    R.kv.assign(rows * kc, static_cast<T>(NAN));
    R.dkv.assign(rows * kc, T(0));
    be.attention_kv_pack(view(R.kv, {rows, kc}), view(R.qkv, {rows, stride}), R.local);
  }
  // Global chunk k as stored by its owner: its query rows, its K/V rows and their gradient.
  auto chunk_rows = [&](std::vector<T>& v, int k, int64_t cols) {
    const Rank<T>& R = ranks[split.owner(k)];
    return view(v, {b * R.local.seq, cols}).row_slice(split.local_begin(k) * b, split.len(k) * b);
  };
  auto block = [&](int qk, int kk) {
    AttentionBlock blk;
    blk.q_begin = split.begin(qk);
    blk.k_begin = split.begin(kk);
    blk.kv_len = static_cast<int>(split.len(kk));
    blk.seq_total = a.seq;
    return blk;
  };

  // Forward: every query chunk against every key chunk, the first block written, the others merged.
  for (int qk = 0; qk < split.chunks(); ++qk) {
    Rank<T>& R = ranks[split.owner(qk)];
    const int slot = qk < cp ? 0 : 1;
    const AttentionShape ac = with_seq(a, split.len(qk));
    const int64_t rows = b * ac.seq;
    R.out[slot].assign(rows * oc, static_cast<T>(NAN));
    R.lse[slot].assign(rows * a.heads, static_cast<T>(NAN));
    std::vector<T> out_blk(rows * oc), lse_blk(rows * a.heads);
    const Tensor out = view(R.out[slot], {rows, oc}), lse = view(R.lse[slot], {b, a.heads, ac.seq});
    const Tensor q = chunk_rows(R.qkv, qk, stride);
    for (int kk = 0; kk < split.chunks(); ++kk) {
      const Tensor kv = chunk_rows(ranks[split.owner(kk)].kv, kk, kc);
      if (kk == 0) {
        be.attention_block_forward(out, lse, q, kv, ac, block(qk, kk));
      } else {
        const Tensor ob = view(out_blk, {rows, oc}), lb = view(lse_blk, {b, a.heads, ac.seq});
        be.attention_block_forward(ob, lb, q, kv, ac, block(qk, kk));
        be.attention_merge(out, lse, ob, lb);
      }
    }
  }

  // Backward of every block with the merged out and lse: dQ into the rank's dqkv, dK and dV into
  // the key chunk owner's dkv (what the ring or the reduce-scatter delivers), then dkv into dqkv.
  for (int qk = 0; qk < split.chunks(); ++qk) {
    Rank<T>& R = ranks[split.owner(qk)];
    const int slot = qk < cp ? 0 : 1;
    const AttentionShape ac = with_seq(a, split.len(qk));
    const int64_t rows = b * ac.seq;
    const Tensor dout = view(whole.dout, {b * a.seq, oc}).row_slice(split.begin(qk) * b, rows);
    for (int kk = 0; kk < split.chunks(); ++kk) {
      Rank<T>& owner = ranks[split.owner(kk)];
      be.attention_block_backward(chunk_rows(R.dqkv, qk, stride), chunk_rows(owner.dkv, kk, kc), dout,
                                  view(R.out[slot], {rows, oc}), view(R.lse[slot], {b, a.heads, ac.seq}),
                                  chunk_rows(R.qkv, qk, stride), chunk_rows(owner.kv, kk, kc), ac, block(qk, kk));
    }
  }
  for (Rank<T>& R : ranks) {
    const int64_t rows = b * R.local.seq;
    be.attention_kv_unpack_add(view(R.dqkv, {rows, stride}), view(R.dkv, {rows, kc}), R.local);
  }

  // Compare with the whole sequence, position by position.
  Errors e;
  for (int k = 0; k < split.chunks(); ++k) {
    Rank<T>& R = ranks[split.owner(k)];
    const int slot = k < cp ? 0 : 1;
    const int64_t len = split.len(k), lb = split.local_begin(k);
    for (int64_t t = 0; t < len; ++t)
      for (int64_t i = 0; i < b; ++i) {
        const int64_t row = (split.begin(k) + t) * b + i, local_row = (lb + t) * b + i;
        for (int64_t c = 0; c < oc; ++c)
          e.out = std::max(e.out,
                           std::abs(double(R.out[slot][(t * b + i) * oc + c]) - double(whole.out[row * oc + c])));
        for (int64_t h = 0; h < a.heads; ++h)
          e.lse = std::max(e.lse, std::abs(double(R.lse[slot][(i * a.heads + h) * len + t]) -
                                           double(whole.lse[(i * a.heads + h) * a.seq + split.begin(k) + t])));
        for (int64_t c = 0; c < stride; ++c) {
          const double want = whole.dqkv[row * stride + c];
          e.dqkv = std::max(e.dqkv, std::abs(double(R.dqkv[local_row * stride + c]) - want));
          e.max_grad = std::max(e.max_grad, std::abs(want));
        }
      }
  }
  return e;
}

struct Case {
  const char* name;
  AttentionShape a;
};

const std::vector<Case>& cases() {
  static const std::vector<Case> list = {
      {"GQA causal b=2 s=12 d=8", shape(2, 12, 4, 2, 8, true)},
      {"MQA causal b=1 s=10 d=5", shape(1, 10, 3, 1, 5, true)},
      {"MQA not causal b=2 s=12 d=5", shape(2, 12, 3, 1, 5, false)},
      {"GQA not causal dropout b=2 s=10 d=5", shape(2, 10, 4, 2, 5, false, 0.3f)},
      {"GQA causal dropout b=1 s=12 d=5", shape(1, 12, 4, 2, 5, true, 0.3f)},
      {"GQA causal window 3 b=2 s=10 d=8", shape(2, 10, 4, 2, 8, true, 0, 3)},
      {"MQA causal window 2 dropout b=2 s=10 d=8", shape(2, 10, 3, 1, 8, true, 0.3f, 2)},
      {"GQA causal window 0 b=1 s=12 d=8", shape(1, 12, 4, 2, 8, true, 0, 0)},
      {"GQA causal window 5 dropout b=2 s=12 d=5", shape(2, 12, 4, 2, 5, true, 0.3f, 5)},
      // Packed documents: documents across chunks, starting inside one, of one token, and chunks
      // of which no query sees an earlier chunk.
      {"GQA causal documents b=2 s=12 d=8", with_documents(shape(2, 12, 4, 2, 8, true), {{0, 5, 6, 11}, {0, 3}})},
      {"MQA causal documents dropout b=2 s=12 d=5",
       with_documents(shape(2, 12, 3, 1, 5, true, 0.3f), {{0, 2, 9}, {0}})},
      {"GQA causal documents window 3 b=1 s=12 d=8", with_documents(shape(1, 12, 4, 2, 8, true, 0, 3), {{0, 7}})},
      {"MHA causal documents b=1 s=10 d=5", with_documents(shape(1, 10, 2, 2, 5, true), {{0, 1, 4, 5, 6}})},
  };
  return list;
}

}  // namespace

TEST_CASE("attention blocks of a context-parallel split equal whole-sequence attention (float64)",
          "[attention_block]") {
  auto be = make_reference_backend(1);
  for (const Case& c : cases())
    for (int cp : {2, 3}) {
      INFO(c.name << ", CP " << cp);
      const Errors e = context_parallel_errors<double>(*be, c.a, cp, 17);
      CHECK(e.out < 1e-12);
      CHECK(e.lse < 1e-12);
      CHECK(e.dqkv < 1e-12);
      CHECK(e.max_grad > 1e-2);  // a vanishing gradient would make the comparison vacuous
    }
}

TEST_CASE("attention blocks of a context-parallel split equal whole-sequence attention (float32)",
          "[attention_block]") {
  auto be = make_reference_backend(1);
  for (const Case& c : cases())
    for (int cp : {2, 3}) {
      INFO(c.name << ", CP " << cp);
      const Errors e = context_parallel_errors<float>(*be, c.a, cp, 23);
      CHECK(e.out < 1e-5);
      CHECK(e.lse < 1e-5);
      CHECK(e.dqkv < 1e-4);
      CHECK(e.max_grad > 1e-2);
    }
}

TEST_CASE("attention block: a row that sees no key gets lse -inf and out 0, and merges as the identity",
          "[attention_block]") {
  auto be = make_reference_backend(1);
  const AttentionShape whole = shape(2, 8, 4, 2, 3, true);
  const AttentionShape ac = with_seq(whole, 4);
  Whole<double> w(whole, 5);
  const int64_t b = 2, rows = b * 4, stride = whole.qkv_row_stride(), oc = out_cols(whole), kc = kv_cols(whole);
  std::vector<double> kv(b * 8 * kc);
  be->attention_kv_pack(view(kv, {b * 8, kc}), view(w.qkv, {b * 8, stride}), whole);
  const Tensor q_first = view(w.qkv, {b * 8, stride}).row_slice(0, rows);   // positions 0..3
  const Tensor kv_last = view(kv, {b * 8, kc}).row_slice(rows, rows);        // positions 4..7
  const Tensor kv_first = view(kv, {b * 8, kc}).row_slice(0, rows);

  // Queries 0..3 against keys 4..7, causal: every key is in the future.
  std::vector<double> out_m(rows * oc, NAN), lse_m(rows * whole.heads, NAN);
  const Tensor om = view(out_m, {rows, oc}), lm = view(lse_m, {b, whole.heads, 4});
  be->attention_block_forward(om, lm, q_first, kv_last, ac, AttentionBlock{0, 4, 4, 8});
  for (double v : lse_m) CHECK(v == -kInf);
  for (double v : out_m) CHECK(v == 0.0);

  // The same queries against keys 0..3: a finite block; merging the masked one changes nothing, bit for bit.
  std::vector<double> out(rows * oc), lse(rows * whole.heads);
  const Tensor o = view(out, {rows, oc}), l = view(lse, {b, whole.heads, 4});
  be->attention_block_forward(o, l, q_first, kv_first, ac, AttentionBlock{0, 0, 4, 8});
  const std::vector<double> out0 = out, lse0 = lse;
  be->attention_merge(o, l, om, lm);
  CHECK(out == out0);
  CHECK(lse == lse0);
  // The other way round: a masked running result takes the block's values.
  be->attention_merge(om, lm, o, l);
  CHECK(out_m == out0);
  CHECK(lse_m == lse0);
  // -inf on both sides: out 0 (whatever was there), lse -inf.
  std::vector<double> out_a(rows * oc, NAN), lse_a(rows * whole.heads, -kInf);
  std::vector<double> out_b(rows * oc, NAN), lse_b(rows * whole.heads, -kInf);
  be->attention_merge(view(out_a, {rows, oc}), view(lse_a, {b, whole.heads, 4}), view(out_b, {rows, oc}),
                      view(lse_b, {b, whole.heads, 4}));
  for (double v : out_a) CHECK(v == 0.0);
  for (double v : lse_a) CHECK(v == -kInf);

  // Backward of the masked block adds nothing, whatever the merged out and lse.
  std::vector<double> dq(rows * stride, 1.5), dkv(rows * kc, -2.5);
  be->attention_block_backward(view(dq, {rows, stride}), view(dkv, {rows, kc}),
                               view(w.dout, {b * 8, oc}).row_slice(0, rows), o, l, q_first, kv_last, ac,
                               AttentionBlock{0, 4, 4, 8});
  for (double v : dq) CHECK(v == 1.5);
  for (double v : dkv) CHECK(v == -2.5);
}

TEST_CASE("attention block: a sliding window leaves some rows of a block without keys", "[attention_block]") {
  // Queries 6..9 against keys 0..3 with window 4: query 6 sees keys 2, 3; query 7 key 3; 8 and 9 none.
  auto be = make_reference_backend(1);
  const AttentionShape whole = shape(1, 10, 2, 1, 4, true, 0, 4);
  Whole<double> w(whole, 9);
  const int64_t stride = whole.qkv_row_stride(), oc = out_cols(whole), kc = kv_cols(whole);
  std::vector<double> kv(10 * kc);
  be->attention_kv_pack(view(kv, {10, kc}), view(w.qkv, {10, stride}), whole);
  std::vector<double> out(4 * oc, NAN), lse(4 * whole.heads, NAN);
  be->attention_block_forward(view(out, {4, oc}), view(lse, {1, whole.heads, 4}),
                              view(w.qkv, {10, stride}).row_slice(6, 4), view(kv, {10, kc}).row_slice(0, 4),
                              with_seq(whole, 4), AttentionBlock{6, 0, 4, 10});
  const int64_t d = whole.head_dim;
  for (int h = 0; h < whole.heads; ++h) {
    CHECK(std::isfinite(lse[h * 4 + 0]));
    CHECK(std::isfinite(lse[h * 4 + 1]));
    CHECK(lse[h * 4 + 2] == -kInf);
    CHECK(lse[h * 4 + 3] == -kInf);
    // Query 7 sees key 3 alone: out = v3, lse = its score.
    const double* q7 = &w.qkv[7 * stride + h * d];
    const double* k3 = &w.qkv[3 * stride + 2 * d];
    double qk = 0;
    for (int j = 0; j < d; ++j) {
      qk += q7[j] * k3[j];
      CHECK(out[1 * oc + h * d + j] == Approx(k3[d + j]).margin(1e-14));
      CHECK(out[2 * oc + h * d + j] == 0.0);
      CHECK(out[3 * oc + h * d + j] == 0.0);
    }
    CHECK(lse[h * 4 + 1] == Approx(whole.softmax_scale * qk).margin(1e-12));
  }
}

TEST_CASE("attention block: the causal mask compares global positions", "[attention_block]") {
  // Queries 6..8 against keys 3..5, causal: every key precedes every query, so the block equals the
  // same block without a mask. Comparing local indices (key u <= query t) would mask most of it.
  auto be = make_reference_backend(1);
  const AttentionShape whole = shape(2, 9, 4, 2, 5, true);
  Whole<double> w(whole, 31);
  const int64_t b = 2, rows = b * 3, stride = whole.qkv_row_stride(), oc = out_cols(whole), kc = kv_cols(whole);
  std::vector<double> kv(b * 9 * kc);
  be->attention_kv_pack(view(kv, {b * 9, kc}), view(w.qkv, {b * 9, stride}), whole);
  const Tensor q = view(w.qkv, {b * 9, stride}).row_slice(6 * b, rows);
  const AttentionShape ac = with_seq(whole, 3);
  AttentionShape open = ac;
  open.causal = false;
  auto run = [&](const AttentionShape& s, const AttentionBlock& blk, std::vector<double>& out,
                 std::vector<double>& lse) {
    out.assign(rows * oc, NAN);
    lse.assign(rows * whole.heads, NAN);
    be->attention_block_forward(view(out, {rows, oc}), view(lse, {b, whole.heads, 3}), q,
                                view(kv, {b * 9, kc}).row_slice(blk.k_begin * b, rows), s, blk);
  };
  std::vector<double> out_c, lse_c, out_o, lse_o, out_d, lse_d;
  run(ac, AttentionBlock{6, 3, 3, 9}, out_c, lse_c);
  run(open, AttentionBlock{6, 3, 3, 9}, out_o, lse_o);
  CHECK(out_c == out_o);
  CHECK(lse_c == lse_o);
  // The same queries and keys placed on the diagonal (queries 3..5 of keys 3..5) are masked.
  run(ac, AttentionBlock{3, 3, 3, 9}, out_d, lse_d);
  CHECK(out_d != out_o);
  // ... and a block entirely in the future sees nothing.
  run(ac, AttentionBlock{0, 3, 3, 9}, out_d, lse_d);
  for (double v : lse_d) CHECK(v == -kInf);
}

TEST_CASE("attention_kv_pack and attention_kv_unpack_add move the key and value slots", "[attention_block]") {
  auto be = make_reference_backend(1);
  const AttentionShape a = shape(2, 3, 4, 2, 2, true);  // per row: [q0 q1 k v | q2 q3 k v], d = 2
  Whole<double> w(a, 3);
  const int64_t n = 6, stride = a.qkv_row_stride(), kc = kv_cols(a), d = 2;
  std::vector<double> kv(n * kc, NAN);
  be->attention_kv_pack(view(kv, {n, kc}), view(w.qkv, {n, stride}), a);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t g = 0; g < 2; ++g)
      for (int64_t j = 0; j < 2 * d; ++j)
        CHECK(kv[r * kc + g * 2 * d + j] == w.qkv[r * stride + g * 4 * d + 2 * d + j]);
  // unpack_add: the k and v slots gain dkv, the q slots keep their values.
  std::vector<double> dqkv(n * stride, 1.0);
  be->attention_kv_unpack_add(view(dqkv, {n, stride}), view(kv, {n, kc}), a);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t g = 0; g < 2; ++g)
      for (int64_t j = 0; j < 4 * d; ++j) {
        const double* row = &dqkv[r * stride + g * 4 * d];
        if (j < 2 * d) CHECK(row[j] == 1.0);
        else CHECK(row[j] == 1.0 + w.qkv[r * stride + g * 4 * d + j]);
      }
}

TEST_CASE("attention blocks reject bad blocks and mismatched tensors", "[attention_block]") {
  auto be = make_reference_backend(1);
  const AttentionShape a = shape(1, 4, 2, 1, 3, true);
  Whole<double> w(a, 1);
  const int64_t stride = a.qkv_row_stride(), oc = out_cols(a), kc = kv_cols(a);
  std::vector<double> kv(4 * kc), out(4 * oc), lse(4 * a.heads);
  const Tensor q = view(w.qkv, {4, stride}), kvt = view(kv, {4, kc}), o = view(out, {4, oc}),
               l = view(lse, {1, a.heads, 4});
  CHECK_NOTHROW(be->attention_block_forward(o, l, q, kvt, a, AttentionBlock{4, 0, 4, 8}));
  // Queries or keys past the end of the sequence, or no keys.
  CHECK_THROWS_WITH(be->attention_block_forward(o, l, q, kvt, a, AttentionBlock{6, 0, 4, 8}),
                    Catch::Contains("sequence of 8 positions"));
  CHECK_THROWS_AS(be->attention_block_forward(o, l, q, kvt, a, AttentionBlock{0, 5, 4, 8}), Error);
  CHECK_THROWS_AS(be->attention_block_forward(o, l, q, kvt, a, AttentionBlock{0, 0, 0, 8}), Error);
  // kv of another length than the block's, or another dtype.
  CHECK_THROWS_WITH(be->attention_block_forward(o, l, q, kvt, a, AttentionBlock{0, 0, 3, 8}), Catch::Contains("kv"));
  std::vector<float> kv32(kv.size());
  CHECK_THROWS_AS(be->attention_block_forward(o, l, q, view(kv32, {4, kc}), a, AttentionBlock{0, 0, 4, 8}), Error);
  // A window without causal masking.
  AttentionShape bad = a;
  bad.causal = false;
  bad.window_left = 1;
  CHECK_THROWS_WITH(be->attention_block_forward(o, l, q, kvt, bad, AttentionBlock{0, 0, 4, 8}),
                    Catch::Contains("window_left 1"));
  // merge: lse must be [b, heads, s] and out [b * s, heads * d].
  std::vector<double> out2(out), lse2(lse);
  CHECK_THROWS_WITH(be->attention_merge(o, view(lse, {4 * a.heads}), view(out2, {4, oc}), view(lse2, {4 * a.heads})),
                    Catch::Contains("[b, heads, s]"));
  CHECK_THROWS_AS(be->attention_merge(view(out, {2, 2 * oc}), l, view(out2, {2, 2 * oc}), view(lse2, {1, a.heads, 4})),
                  Error);
  // kv_pack: a kv of the wrong width.
  std::vector<double> narrow(4 * (kc - 1));
  CHECK_THROWS_AS(be->attention_kv_pack(view(narrow, {4, kc - 1}), q, a), Error);
  // reserve: float32/64 only; at least one key.
  CHECK_NOTHROW(be->reserve_attention_blocks(a, 4, DType::f32));
  CHECK_NOTHROW(be->reserve_attention_blocks(a, 4, DType::f64));
  CHECK_THROWS_AS(be->reserve_attention_blocks(a, 4, DType::bf16), Unsupported);
  CHECK_THROWS_AS(be->reserve_attention_blocks(a, 0, DType::f32), Error);
}
