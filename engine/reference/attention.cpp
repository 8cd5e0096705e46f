#include "engine/reference/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "core/error.h"
#include "engine/attention_dropout.h"

namespace mt {
namespace {

template <typename T>
constexpr DType dtype_of() {
  return sizeof(T) == 8 ? DType::f64 : DType::f32;
}

// Where each head's vectors live in the packed rows (see the header comment).
struct QkvLayout {
  int64_t b, s, heads, groups, hpg, d, row_stride;
  explicit QkvLayout(const AttentionShape& a)
      : b(a.batch), s(a.seq), heads(a.heads), groups(a.groups), hpg(a.heads / a.groups), d(a.head_dim),
        row_stride(a.qkv_row_stride()) {}
  int64_t row(int64_t i, int64_t t) const { return t * b + i; }
  int64_t q_offset(int64_t i, int64_t t, int64_t h) const {
    return row(i, t) * row_stride + (h / hpg) * (hpg + 2) * d + (h % hpg) * d;
  }
  int64_t k_offset(int64_t i, int64_t t, int64_t g) const {
    return row(i, t) * row_stride + g * (hpg + 2) * d + hpg * d;
  }
  int64_t v_offset(int64_t i, int64_t t, int64_t g) const { return k_offset(i, t, g) + d; }
  int64_t out_offset(int64_t i, int64_t t, int64_t h) const { return row(i, t) * heads * d + h * d; }
  int64_t lse_index(int64_t i, int64_t h, int64_t t) const { return (i * heads + h) * s + t; }
};

// Packed documents (AttentionShape::documents): the first key query t of sample i may see and the
// last query that may see key k, from doc_start (validated here: host int32 [b * s], each entry
// either its predecessor's or its own position). Without documents: 0 and s - 1. s is the
// sequence's length: a.seq, or for attention blocks the whole sequence's (AttentionBlock::seq_total).
struct Documents {
  int64_t s = 0;
  const int32_t* start = nullptr;
  std::vector<int32_t> end;  // last position of each position's document
  explicit Documents(const AttentionShape& a) : Documents(a, a.seq) {}
  Documents(const AttentionShape& a, int64_t seq) : s(seq) {
    if (!a.documents) return;
    const int64_t n = static_cast<int64_t>(a.batch) * seq;
    MT_CHECK(a.doc_start.device == Device::cpu && a.doc_start.dtype == DType::i32 && a.doc_start.numel() == n,
             "attention with documents needs doc_start as host int32 [{}] (b * s)", n);
    start = a.doc_start.ptr<int32_t>();
    end.resize(static_cast<size_t>(n));
    for (int64_t i = 0; i < a.batch; ++i) {
      for (int64_t t = 0; t < s; ++t) {
        const int32_t v = start[i * s + t];
        MT_CHECK(v == t || (t > 0 && v == start[i * s + t - 1]),
                 "attention doc_start[{}][{}] = {}: must be {} or the previous entry", i, t, v, t);
      }
      for (int64_t t = s - 1; t >= 0; --t)
        end[static_cast<size_t>(i * s + t)] = (t == s - 1 || start[i * s + t + 1] == t + 1)
                                                  ? static_cast<int32_t>(t)
                                                  : end[static_cast<size_t>(i * s + t + 1)];
    }
  }
  int64_t first(int64_t i, int64_t t) const { return start ? start[i * s + t] : 0; }
  int64_t last(int64_t i, int64_t t) const { return start ? end[static_cast<size_t>(i * s + t)] : s - 1; }
};

template <typename T>
double dot(const T* x, const T* y, int64_t n) {
  double acc = 0;
  for (int64_t j = 0; j < n; ++j) acc += static_cast<double>(x[j]) * static_cast<double>(y[j]);
  return acc;
}

// An element of a float32 or float64 tensor (an lse; also the sink logits and their gradient).
double read_lse(const Tensor& lse, int64_t index) {
  return lse.dtype == DType::f64 ? lse.ptr<double>()[index] : static_cast<double>(lse.ptr<float>()[index]);
}

void write_lse(const Tensor& lse, int64_t index, double value) {
  if (lse.dtype == DType::f64) lse.ptr<double>()[index] = value;
  else lse.ptr<float>()[index] = static_cast<float>(value);
}

// One query row of attention over the keys [u0, u1): their scores score(u) (kept in `scores`,
// indexed by u), the softmax's log-sum-exp (returned; -inf for an empty range, whose output is 0)
// and dst = sum over u of softmax(u) * drop(u) * value(u) (acc: d doubles of scratch).
template <typename T, class Score, class Value, class Drop>
double attend_row(T* dst, int64_t d, int64_t u0, int64_t u1, std::vector<double>& scores, std::vector<double>& acc,
                  Score score, Value value, Drop drop) {
  if (u0 >= u1) {
    std::fill(dst, dst + d, T(0));
    return -std::numeric_limits<double>::infinity();
  }
  double max_score = -std::numeric_limits<double>::infinity();
  for (int64_t u = u0; u < u1; ++u) {
    scores[static_cast<size_t>(u)] = score(u);
    max_score = std::max(max_score, scores[static_cast<size_t>(u)]);
  }
  double sum = 0;
  for (int64_t u = u0; u < u1; ++u) sum += std::exp(scores[static_cast<size_t>(u)] - max_score);
  const double row_lse = max_score + std::log(sum);
  std::fill(acc.begin(), acc.end(), 0.0);
  for (int64_t u = u0; u < u1; ++u) {
    const double p = std::exp(scores[static_cast<size_t>(u)] - row_lse) * drop(u);
    if (p == 0) continue;
    const T* v = value(u);
    for (int64_t j = 0; j < d; ++j) acc[static_cast<size_t>(j)] += p * static_cast<double>(v[j]);
  }
  for (int64_t j = 0; j < d; ++j) dst[j] = static_cast<T>(acc[static_cast<size_t>(j)]);
  return row_lse;
}

// dK and dV of one key row, summed over the query heads [h0, h1) and the queries [t0, t1) that see
// it: acc_k = scale * sum dS q, acc_v = sum p * drop * dO. element(h, t, p, ds, drop) gives a pair's
// probability, dS and dropout factor; q(h, t) and dout(h, t) the rows; skip(h, t) leaves a query out.
template <typename T, class Element, class QRow, class DoutRow, class Skip>
void key_row_grads(std::vector<double>& acc_k, std::vector<double>& acc_v, int64_t d, double scale, int64_t h0,
                   int64_t h1, int64_t t0, int64_t t1, Element element, QRow q, DoutRow dout, Skip skip) {
  std::fill(acc_k.begin(), acc_k.end(), 0.0);
  std::fill(acc_v.begin(), acc_v.end(), 0.0);
  for (int64_t h = h0; h < h1; ++h)
    for (int64_t t = t0; t < t1; ++t) {
      if (skip(h, t)) continue;
      double p, ds, drop;
      element(h, t, p, ds, drop);
      const T* qq = q(h, t);
      const T* dd = dout(h, t);
      for (int64_t j = 0; j < d; ++j) {
        acc_k[static_cast<size_t>(j)] += scale * ds * static_cast<double>(qq[j]);
        acc_v[static_cast<size_t>(j)] += p * drop * static_cast<double>(dd[j]);
      }
    }
}

// One (query, key) pair of the backward: the probability p (undropped, against the row's lse) and
// dS = p * (drop * dO.v - D), D = rowsum(dO * O) of the query's row.
template <typename T>
void pair_grad(const T* q, const T* k, const T* v, const T* dout, double scale, double lse, double delta, double drop,
               int64_t d, double& p, double& ds) {
  p = std::exp(scale * dot(q, k, d) - lse);
  ds = p * (drop * dot(dout, v, d) - delta);
}

// Multiplier that dropout applies to probability (i, h, q, k) of a sequence of `seq` positions
// (q, k global positions): 0 if dropped, 1/(1-p) if kept.
double dropout_factor(const AttentionShape& a, int64_t seq, int64_t i, int64_t h, int64_t q, int64_t k) {
  if (a.dropout_p == 0) return 1.0;
  return attention_dropout_keep(a.dropout_key, i * a.heads + h, seq, q, k, dropout_threshold(a.dropout_p))
             ? 1.0 / (1.0 - a.dropout_p)
             : 0.0;
}

// The same from an explicit mask keep [b, heads, s, s] where one is given (the masked variants).
double dropout_factor(const AttentionShape& a, const uint8_t* keep, int64_t i, int64_t h, int64_t q, int64_t k) {
  if (!keep || a.dropout_p == 0) return dropout_factor(a, a.seq, i, h, q, k);
  return keep[((i * a.heads + h) * a.seq + q) * a.seq + k] ? 1.0 / (1.0 - a.dropout_p) : 0.0;
}

}  // namespace

void check_attention_shape(const AttentionShape& a) {
  if (a.batch <= 0 || a.seq <= 0 || a.heads <= 0 || a.groups <= 0 || a.head_dim <= 0 || a.heads % a.groups != 0)
    fail("attention: invalid shape b={} s={} heads={} groups={} d={} (heads must be a multiple of groups)",
         a.batch, a.seq, a.heads, a.groups, a.head_dim);
  if (!(a.dropout_p >= 0 && a.dropout_p < 1)) fail("attention: dropout probability {} not in [0, 1)", a.dropout_p);
  if (a.window_left < -1 || (a.windowed() && !a.causal))
    fail("attention: window_left {} (must be -1, or >= 0 with causal attention)", a.window_left);
  if (a.documents && !a.causal) fail("attention: documents (--reset-attention-mask) need causal attention");
}

void check_attention_tensors(const AttentionShape& a, Tensor qkv, Tensor out, Tensor lse, DType element) {
  check_attention_shape(a);
  const int64_t n = static_cast<int64_t>(a.batch) * a.seq;
  auto check = [&](const Tensor& t, const char* name, int64_t numel, bool is_lse) {
    MT_CHECK(t.device == Device::cpu, "attention {} must be host memory", name);
    MT_CHECK(t.numel() == numel, "attention {} has {} elements, shape needs {}", name, t.numel(), numel);
    if (is_lse) MT_CHECK(t.dtype == DType::f32 || t.dtype == DType::f64, "attention lse must be float32/64");
    else MT_CHECK(t.dtype == element, "attention {} is {}, expected {}", name, dtype_name(t.dtype), dtype_name(element));
  };
  check(qkv, "qkv", n * a.qkv_row_stride(), false);
  check(out, "out", n * a.heads * a.head_dim, false);
  check(lse, "lse", n * a.heads, true);
}

namespace {

void check_keep_mask(const AttentionShape& a, const std::vector<uint8_t>& keep) {
  const size_t want = static_cast<size_t>(a.batch) * a.heads * a.seq * a.seq;
  MT_CHECK(keep.size() == want, "attention: the dropout mask has {} entries, the shape needs b*heads*s*s = {}",
           keep.size(), want);
}

template <typename T>
void attention_forward_impl(Tensor out, Tensor lse, Tensor qkv, const AttentionShape& a, const uint8_t* keep) {
  check_attention_tensors(a, qkv, out, lse, dtype_of<T>());
  const QkvLayout L(a);
  const Documents docs(a);
  const T* x = qkv.ptr<T>();
  T* o = out.ptr<T>();
  std::vector<double> scores(L.s), acc(L.d);
  for (int64_t i = 0; i < L.b; ++i)
    for (int64_t h = 0; h < L.heads; ++h) {
      const int64_t g = h / L.hpg;
      for (int64_t q = 0; q < L.s; ++q) {
        const double row_lse = attend_row(
            o + L.out_offset(i, q, h), L.d, std::max(a.first_key(q), docs.first(i, q)), a.last_key(q) + 1, scores, acc,
            [&](int64_t k) { return a.softmax_scale * dot(x + L.q_offset(i, q, h), x + L.k_offset(i, k, g), L.d); },
            [&](int64_t k) { return x + L.v_offset(i, k, g); },
            [&](int64_t k) { return dropout_factor(a, keep, i, h, q, k); });
        write_lse(lse, L.lse_index(i, h, q), row_lse);
      }
    }
}

// Backward, written as two passes so that every gradient is one double-precision sum written
// once: dq row by row, then dk/dv key by key (summing over the heads of the group). The scores and
// probabilities are recomputed from q, k and the saved lse, as the flash kernels do. With
// P = softmax, Pd = dropped P, O = Pd V:
//   dV = Pd^T dO,   dP = (dO V^T) * dropout factor,   dS = P * (dP - D) with D = rowsum(dO * O),
//   dQ = scale * dS K,   dK = scale * dS^T Q.
template <typename T>
void attention_backward_impl(Tensor dqkv, Tensor dout, Tensor out, Tensor lse, Tensor qkv, const AttentionShape& a,
                             const uint8_t* keep) {
  check_attention_tensors(a, qkv, out, lse, dtype_of<T>());
  check_attention_tensors(a, dqkv, dout, lse, dtype_of<T>());
  const QkvLayout L(a);
  const Documents docs(a);
  const T* x = qkv.ptr<T>();
  const T* o = out.ptr<T>();
  const T* dout_p = dout.ptr<T>();
  T* dx = dqkv.ptr<T>();

  // D[i, h, q] = rowsum(dO * O).
  std::vector<double> delta(static_cast<size_t>(L.b * L.heads * L.s));
  for (int64_t i = 0; i < L.b; ++i)
    for (int64_t h = 0; h < L.heads; ++h)
      for (int64_t q = 0; q < L.s; ++q)
        delta[L.lse_index(i, h, q)] = dot(dout_p + L.out_offset(i, q, h), o + L.out_offset(i, q, h), L.d);

  // Probability p (undropped) and dS of element (i, h, q, k); also returns the dropout factor.
  auto element = [&](int64_t i, int64_t h, int64_t q, int64_t k, double& p, double& ds, double& drop) {
    const int64_t g = h / L.hpg;
    drop = dropout_factor(a, keep, i, h, q, k);
    pair_grad(x + L.q_offset(i, q, h), x + L.k_offset(i, k, g), x + L.v_offset(i, k, g), dout_p + L.out_offset(i, q, h),
              a.softmax_scale, read_lse(lse, L.lse_index(i, h, q)), delta[L.lse_index(i, h, q)], drop, L.d, p, ds);
  };

  std::vector<double> acc_k(L.d), acc_v(L.d);
  for (int64_t i = 0; i < L.b; ++i) {
    // dq, one query row at a time.
    for (int64_t h = 0; h < L.heads; ++h)
      for (int64_t q = 0; q < L.s; ++q) {
        std::fill(acc_k.begin(), acc_k.end(), 0.0);
        for (int64_t k = std::max(a.first_key(q), docs.first(i, q)); k <= a.last_key(q); ++k) {
          double p, ds, drop;
          element(i, h, q, k, p, ds, drop);
          const T* kk = x + L.k_offset(i, k, h / L.hpg);
          for (int64_t j = 0; j < L.d; ++j) acc_k[j] += a.softmax_scale * ds * static_cast<double>(kk[j]);
        }
        T* dst = dx + L.q_offset(i, q, h);
        for (int64_t j = 0; j < L.d; ++j) dst[j] = static_cast<T>(acc_k[j]);
      }
    // dk and dv, one key row of one group at a time, summed over the group's heads.
    for (int64_t g = 0; g < L.groups; ++g)
      for (int64_t k = 0; k < L.s; ++k) {
        key_row_grads<T>(
            acc_k, acc_v, L.d, a.softmax_scale, g * L.hpg, (g + 1) * L.hpg, a.first_query(k),
            std::min(a.last_query(k), docs.last(i, k)) + 1,
            [&](int64_t h, int64_t q, double& p, double& ds, double& drop) { element(i, h, q, k, p, ds, drop); },
            [&](int64_t h, int64_t q) { return x + L.q_offset(i, q, h); },
            [&](int64_t h, int64_t q) { return dout_p + L.out_offset(i, q, h); }, [](int64_t, int64_t) { return false; });
        T* dk = dx + L.k_offset(i, k, g);
        T* dv = dx + L.v_offset(i, k, g);
        for (int64_t j = 0; j < L.d; ++j) {
          dk[j] = static_cast<T>(acc_k[j]);
          dv[j] = static_cast<T>(acc_v[j]);
        }
      }
  }
}

}  // namespace

template <typename T>
void reference_attention_forward(Tensor out, Tensor lse, Tensor qkv, const AttentionShape& a) {
  attention_forward_impl<T>(out, lse, qkv, a, nullptr);
}
template <typename T>
void reference_attention_backward(Tensor dqkv, Tensor dout, Tensor out, Tensor lse, Tensor qkv,
                                  const AttentionShape& a) {
  attention_backward_impl<T>(dqkv, dout, out, lse, qkv, a, nullptr);
}
template <typename T>
void reference_attention_forward_masked(Tensor out, Tensor lse, Tensor qkv, const AttentionShape& a,
                                        const std::vector<uint8_t>& keep) {
  check_keep_mask(a, keep);
  attention_forward_impl<T>(out, lse, qkv, a, keep.data());
}
template <typename T>
void reference_attention_backward_masked(Tensor dqkv, Tensor dout, Tensor out, Tensor lse, Tensor qkv,
                                         const AttentionShape& a, const std::vector<uint8_t>& keep) {
  check_keep_mask(a, keep);
  attention_backward_impl<T>(dqkv, dout, out, lse, qkv, a, keep.data());
}

template void reference_attention_forward<float>(Tensor, Tensor, Tensor, const AttentionShape&);
template void reference_attention_forward<double>(Tensor, Tensor, Tensor, const AttentionShape&);
template void reference_attention_backward<float>(Tensor, Tensor, Tensor, Tensor, Tensor, const AttentionShape&);
template void reference_attention_backward<double>(Tensor, Tensor, Tensor, Tensor, Tensor, const AttentionShape&);
template void reference_attention_forward_masked<float>(Tensor, Tensor, Tensor, const AttentionShape&,
                                                        const std::vector<uint8_t>&);
template void reference_attention_forward_masked<double>(Tensor, Tensor, Tensor, const AttentionShape&,
                                                         const std::vector<uint8_t>&);
template void reference_attention_backward_masked<float>(Tensor, Tensor, Tensor, Tensor, Tensor, const AttentionShape&,
                                                         const std::vector<uint8_t>&);
template void reference_attention_backward_masked<double>(Tensor, Tensor, Tensor, Tensor, Tensor,
                                                          const AttentionShape&, const std::vector<uint8_t>&);

// ---- attention blocks (context parallelism) -------------------------------------------------

namespace {

// Rows of the kv tensor of a block (attention_kv_pack's layout): [b * kv_len, groups * 2 * d],
// sequence-major, per row and group the key (d values) then the value (d values).
struct KvLayout {
  int64_t b, groups, d, row_stride;
  explicit KvLayout(const AttentionShape& a)
      : b(a.batch), groups(a.groups), d(a.head_dim), row_stride(static_cast<int64_t>(a.groups) * 2 * a.head_dim) {}
  int64_t k_offset(int64_t i, int64_t u, int64_t g) const { return (u * b + i) * row_stride + g * 2 * d; }
  int64_t v_offset(int64_t i, int64_t u, int64_t g) const { return k_offset(i, u, g) + d; }
};

// The mask of a block on global positions: local query t is at blk.q_begin + t, local key u at
// blk.k_begin + u; packed documents by the whole sequence's document starts. Ranges are half-open
// and empty when begin >= end.
struct BlockMask {
  const AttentionShape& a;
  const AttentionBlock& blk;
  Documents docs{a, blk.seq_total};
  // The local keys [begin, end) that local query t of sample i sees.
  std::pair<int64_t, int64_t> keys(int64_t i, int64_t t) const {
    const int64_t q = blk.q_begin + t;
    int64_t lo = std::max<int64_t>(blk.k_begin, docs.first(i, q)), hi = blk.k_begin + blk.kv_len;
    if (a.windowed()) lo = std::max(lo, q - a.window_left);
    if (a.causal) hi = std::min(hi, q + 1);
    return {lo - blk.k_begin, std::max(lo, hi) - blk.k_begin};
  }
  // The local queries [begin, end) of sample i that see local key u.
  std::pair<int64_t, int64_t> queries(int64_t i, int64_t u) const {
    const int64_t k = blk.k_begin + u;
    int64_t lo = blk.q_begin, hi = std::min<int64_t>(blk.q_begin + a.seq, docs.last(i, k) + 1);
    if (a.causal) lo = std::max(lo, k);
    if (a.windowed()) hi = std::min(hi, k + a.window_left + 1);
    return {lo - blk.q_begin, std::max(lo, hi) - blk.q_begin};
  }
  // Dropout by global positions in the whole sequence (seq_total).
  double dropout(int64_t i, int64_t h, int64_t t, int64_t u) const {
    return dropout_factor(a, blk.seq_total, i, h, blk.q_begin + t, blk.k_begin + u);
  }
};

void check_host_tensor(const Tensor& t, const char* op, const char* name, int64_t numel, DType element) {
  MT_CHECK(t.device == Device::cpu, "{}: {} must be host memory", op, name);
  MT_CHECK(t.numel() == numel, "{}: {} has {} elements, shape needs {}", op, name, t.numel(), numel);
  MT_CHECK(t.dtype == element, "{}: {} is {}, expected {}", op, name, dtype_name(t.dtype), dtype_name(element));
}

void check_block(const AttentionShape& a, const AttentionBlock& blk) {
  if (blk.kv_len <= 0 || blk.q_begin < 0 || blk.k_begin < 0 || blk.q_begin + a.seq > blk.seq_total ||
      blk.k_begin + blk.kv_len > blk.seq_total)
    fail("attention block: queries [{}, +{}) and keys [{}, +{}) must lie in a sequence of {} positions "
         "(and hold at least one key)",
         blk.q_begin, a.seq, blk.k_begin, blk.kv_len, blk.seq_total);
}

// The kv tensor of a block of kv_len keys.
void check_kv(const AttentionShape& a, int64_t kv_len, const Tensor& kv, const char* op, const char* name,
              DType element) {
  check_host_tensor(kv, op, name, static_cast<int64_t>(a.batch) * kv_len * a.groups * 2 * a.head_dim, element);
}

}  // namespace

void check_attention_blocks(const AttentionShape& a, int max_kv_len) {
  check_attention_shape(a);
  if (max_kv_len <= 0) fail("attention blocks: at most {} keys per block (must be at least 1)", max_kv_len);
}

template <typename T>
void reference_attention_block_forward(Tensor out, Tensor lse, Tensor q, Tensor kv, const AttentionShape& a,
                                       const AttentionBlock& blk) {
  check_attention_tensors(a, q, out, lse, dtype_of<T>());
  check_block(a, blk);
  check_kv(a, blk.kv_len, kv, "attention_block_forward", "kv", dtype_of<T>());
  const QkvLayout L(a);
  const KvLayout K(a);
  const BlockMask M{a, blk};
  const T* x = q.ptr<T>();
  const T* y = kv.ptr<T>();
  T* o = out.ptr<T>();
  std::vector<double> scores(static_cast<size_t>(blk.kv_len)), acc(L.d);
  for (int64_t i = 0; i < L.b; ++i)
    for (int64_t h = 0; h < L.heads; ++h) {
      const int64_t g = h / L.hpg;
      for (int64_t t = 0; t < L.s; ++t) {
        const auto [u0, u1] = M.keys(i, t);  // (none visible: an empty softmax, lse -inf and out 0)
        const double row_lse = attend_row(
            o + L.out_offset(i, t, h), L.d, u0, u1, scores, acc,
            [&](int64_t u) { return a.softmax_scale * dot(x + L.q_offset(i, t, h), y + K.k_offset(i, u, g), L.d); },
            [&](int64_t u) { return y + K.v_offset(i, u, g); }, [&](int64_t u) { return M.dropout(i, h, t, u); });
        write_lse(lse, L.lse_index(i, h, t), row_lse);
      }
    }
}

// The backward of reference_attention_backward restricted to one block's (query, key) pairs,
// with the probabilities taken against the merged lse (so they are those of the whole softmax)
// and D = rowsum(dO * O) of the merged output. Two passes again (dq by query row, dk/dv by key row),
// each adding one double-precision sum to the gradient once. Rows whose merged lse is -inf saw no
// key at all and contribute nothing.
template <typename T>
void reference_attention_block_backward(Tensor dq, Tensor dkv, Tensor dout, Tensor out, Tensor lse, Tensor q,
                                        Tensor kv, const AttentionShape& a, const AttentionBlock& blk) {
  check_attention_tensors(a, q, out, lse, dtype_of<T>());
  check_attention_tensors(a, dq, dout, lse, dtype_of<T>());
  check_block(a, blk);
  check_kv(a, blk.kv_len, kv, "attention_block_backward", "kv", dtype_of<T>());
  check_kv(a, blk.kv_len, dkv, "attention_block_backward", "dkv", dtype_of<T>());
  const QkvLayout L(a);
  const KvLayout K(a);
  const BlockMask M{a, blk};
  const T* x = q.ptr<T>();
  const T* y = kv.ptr<T>();
  const T* o = out.ptr<T>();
  const T* dout_p = dout.ptr<T>();
  T* dx = dq.ptr<T>();
  T* dy = dkv.ptr<T>();

  // D[i, h, t] = rowsum(dO * O), and the merged lse (-inf: the row has no visible key anywhere).
  std::vector<double> delta(static_cast<size_t>(L.b * L.heads * L.s)), row_lse(delta.size());
  for (int64_t i = 0; i < L.b; ++i)
    for (int64_t h = 0; h < L.heads; ++h)
      for (int64_t t = 0; t < L.s; ++t) {
        delta[L.lse_index(i, h, t)] = dot(dout_p + L.out_offset(i, t, h), o + L.out_offset(i, t, h), L.d);
        row_lse[L.lse_index(i, h, t)] = read_lse(lse, L.lse_index(i, h, t));
      }
  auto live = [&](int64_t i, int64_t h, int64_t t) {
    return row_lse[L.lse_index(i, h, t)] != -std::numeric_limits<double>::infinity();
  };

  // Probability p (undropped, of the whole softmax) and dS of element (i, h, t, u); also the dropout factor.
  auto element = [&](int64_t i, int64_t h, int64_t t, int64_t u, double& p, double& ds, double& drop) {
    const int64_t g = h / L.hpg;
    drop = M.dropout(i, h, t, u);
    pair_grad(x + L.q_offset(i, t, h), y + K.k_offset(i, u, g), y + K.v_offset(i, u, g), dout_p + L.out_offset(i, t, h),
              a.softmax_scale, row_lse[L.lse_index(i, h, t)], delta[L.lse_index(i, h, t)], drop, L.d, p, ds);
  };

  std::vector<double> acc_k(L.d), acc_v(L.d);
  for (int64_t i = 0; i < L.b; ++i) {
    // dq, one query row at a time.
    for (int64_t h = 0; h < L.heads; ++h)
      for (int64_t t = 0; t < L.s; ++t) {
        const auto [u0, u1] = M.keys(i, t);
        if (u0 >= u1 || !live(i, h, t)) continue;
        std::fill(acc_k.begin(), acc_k.end(), 0.0);
        for (int64_t u = u0; u < u1; ++u) {
          double p, ds, drop;
          element(i, h, t, u, p, ds, drop);
          const T* kk = y + K.k_offset(i, u, h / L.hpg);
          for (int64_t j = 0; j < L.d; ++j) acc_k[j] += a.softmax_scale * ds * static_cast<double>(kk[j]);
        }
        T* dst = dx + L.q_offset(i, t, h);
        for (int64_t j = 0; j < L.d; ++j) dst[j] = static_cast<T>(static_cast<double>(dst[j]) + acc_k[j]);
      }
    // dk and dv, one key row of one group at a time, summed over the group's heads.
    for (int64_t g = 0; g < L.groups; ++g)
      for (int64_t u = 0; u < blk.kv_len; ++u) {
        const auto [t0, t1] = M.queries(i, u);
        if (t0 >= t1) continue;
        key_row_grads<T>(
            acc_k, acc_v, L.d, a.softmax_scale, g * L.hpg, (g + 1) * L.hpg, t0, t1,
            [&](int64_t h, int64_t t, double& p, double& ds, double& drop) { element(i, h, t, u, p, ds, drop); },
            [&](int64_t h, int64_t t) { return x + L.q_offset(i, t, h); },
            [&](int64_t h, int64_t t) { return dout_p + L.out_offset(i, t, h); },
            [&](int64_t h, int64_t t) { return !live(i, h, t); });
        T* dk = dy + K.k_offset(i, u, g);
        T* dv = dy + K.v_offset(i, u, g);
        for (int64_t j = 0; j < L.d; ++j) {
          dk[j] = static_cast<T>(static_cast<double>(dk[j]) + acc_k[j]);
          dv[j] = static_cast<T>(static_cast<double>(dv[j]) + acc_v[j]);
        }
      }
  }
}

namespace {
// The shape [b, heads, s] and head width d of an attention output out [s * b, heads * d] (type T,
// host memory) and its lse [b, heads, s] (float32 or float64, host memory), checked.
struct LseShape {
  int64_t b, heads, s, d;
};
template <typename T>
LseShape lse_shape(const char* op, Tensor out, Tensor lse) {
  MT_CHECK(lse.ndim == 3, "{}: lse must be [b, heads, s], got {}", op, lse.shape_string());
  MT_CHECK(lse.device == Device::cpu && (lse.dtype == DType::f32 || lse.dtype == DType::f64),
           "{}: lse must be float32/64 host memory, got {}", op, dtype_name(lse.dtype));
  const int64_t b = lse.size(0), heads = lse.size(1), s = lse.size(2);
  MT_CHECK(heads > 0 && out.rows() == b * s && out.cols() > 0 && out.cols() % heads == 0,
           "{}: out {} is not [b * s, heads * d] for lse {}", op, out.shape_string(), lse.shape_string());
  check_host_tensor(out, op, "out", out.numel(), dtype_of<T>());
  return {b, heads, s, out.cols() / heads};
}
}  // namespace

template <typename T>
void reference_attention_merge(Tensor out, Tensor lse, Tensor out_blk, Tensor lse_blk) {
  const char* op = "attention_merge";
  const auto [b, heads, s, d] = lse_shape<T>(op, out, lse);
  MT_CHECK(lse_blk.device == Device::cpu && (lse_blk.dtype == DType::f32 || lse_blk.dtype == DType::f64),
           "{}: lse_blk must be float32/64 host memory, got {}", op, dtype_name(lse_blk.dtype));
  MT_CHECK(lse_blk.numel() == lse.numel(), "{}: lse_blk has {} elements, lse {}", op, lse_blk.numel(),
           lse.shape_string());
  check_host_tensor(out_blk, op, "out_blk", out.numel(), dtype_of<T>());
  T* o = out.ptr<T>();
  const T* ob = out_blk.ptr<T>();
  const double neg_inf = -std::numeric_limits<double>::infinity();
  for (int64_t i = 0; i < b; ++i)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t t = 0; t < s; ++t) {
        const int64_t li = (i * heads + h) * s + t;
        T* dst = o + (t * b + i) * heads * d + h * d;
        const T* src = ob + (t * b + i) * heads * d + h * d;
        const double l1 = read_lse(lse, li), l2 = read_lse(lse_blk, li);
        const double m = std::max(l1, l2);
        if (m == neg_inf) {  // neither side saw a key
          write_lse(lse, li, neg_inf);
          std::fill(dst, dst + d, T(0));
          continue;
        }
        const double merged = m + std::log(std::exp(l1 - m) + std::exp(l2 - m));
        // A side that saw no key has weight 0 and is not read (its out may be anything).
        const double w1 = l1 == neg_inf ? 0.0 : std::exp(l1 - merged);
        const double w2 = l2 == neg_inf ? 0.0 : std::exp(l2 - merged);
        for (int64_t j = 0; j < d; ++j) {
          double v = 0;
          if (w1 != 0) v += static_cast<double>(dst[j]) * w1;
          if (w2 != 0) v += static_cast<double>(src[j]) * w2;
          dst[j] = static_cast<T>(v);
        }
        write_lse(lse, li, merged);
      }
}

namespace {
// lse_shape plus the sinks [heads] (float32/64 host memory, or empty).
template <typename T>
LseShape sink_shape(const char* op, Tensor out, Tensor lse, Tensor sink) {
  const LseShape S = lse_shape<T>(op, out, lse);
  if (!sink.empty()) {
    MT_CHECK(sink.device == Device::cpu && sink.numel() == S.heads &&
                 (sink.dtype == DType::f32 || sink.dtype == DType::f64),
             "{}: sink must be float32/64 [{}] host memory, got {} {}", op, S.heads, dtype_name(sink.dtype),
             sink.shape_string());
  }
  return S;
}
}  // namespace

template <typename T>
void reference_attention_sink_forward(Tensor out, Tensor lse, Tensor sink) {
  const LseShape S = sink_shape<T>("attention_sink_forward", out, lse, sink);
  T* o = out.ptr<T>();
  for (int64_t i = 0; i < S.b; ++i)
    for (int64_t h = 0; h < S.heads; ++h) {
      const double sh = sink.empty() ? 0.0 : read_lse(sink, h);
      for (int64_t t = 0; t < S.s; ++t) {
        const int64_t li = (i * S.heads + h) * S.s + t;
        const double l = read_lse(lse, li), m = std::max(l, sh);
        const double merged = m + std::log(std::exp(l - m) + std::exp(sh - m));
        const double w = std::exp(l - merged);
        T* row = o + (t * S.b + i) * S.heads * S.d + h * S.d;
        for (int64_t j = 0; j < S.d; ++j) row[j] = static_cast<T>(static_cast<double>(row[j]) * w);
        write_lse(lse, li, merged);
      }
    }
}

template <typename T>
void reference_attention_sink_backward(Tensor dsink, Tensor dout, Tensor out, Tensor lse, Tensor sink) {
  const char* op = "attention_sink_backward";
  const LseShape S = sink_shape<T>(op, out, lse, sink);
  check_host_tensor(dout, op, "dout", out.numel(), dtype_of<T>());
  MT_CHECK(dsink.device == Device::cpu && dsink.numel() == S.heads &&
               (dsink.dtype == DType::f32 || dsink.dtype == DType::f64),
           "{}: dsink must be float32/64 [{}] host memory, got {} {}", op, S.heads, dtype_name(dsink.dtype),
           dsink.shape_string());
  const T* o = out.ptr<T>();
  const T* g = dout.ptr<T>();
  for (int64_t h = 0; h < S.heads; ++h) {
    const double sh = sink.empty() ? 0.0 : read_lse(sink, h);
    double acc = 0;
    for (int64_t i = 0; i < S.b; ++i)
      for (int64_t t = 0; t < S.s; ++t) {
        const int64_t off = (t * S.b + i) * S.heads * S.d + h * S.d;
        acc += std::exp(sh - read_lse(lse, (i * S.heads + h) * S.s + t)) * dot(g + off, o + off, S.d);
      }
    write_lse(dsink, h, read_lse(dsink, h) - acc);
  }
}

namespace {
// The key and value parts of packed QKV rows against kv rows: kv = those parts (pack), or those
// parts += kv (unpack_add). k and v of a group are adjacent in both layouts: 2 d values per (row, group).
template <typename T>
void move_kv_parts(Tensor packed, Tensor kv, const AttentionShape& a, bool unpack_add) {
  const char* op = unpack_add ? "attention_kv_unpack_add" : "attention_kv_pack";
  check_attention_shape(a);
  const QkvLayout L(a);
  const KvLayout K(a);
  check_host_tensor(packed, op, unpack_add ? "dqkv" : "qkv", L.b * L.s * L.row_stride, dtype_of<T>());
  check_kv(a, a.seq, kv, op, unpack_add ? "dkv" : "kv", dtype_of<T>());
  T* x = packed.ptr<T>();
  T* y = kv.ptr<T>();
  for (int64_t i = 0; i < L.b; ++i)
    for (int64_t t = 0; t < L.s; ++t)
      for (int64_t g = 0; g < L.groups; ++g) {
        T* p = x + L.k_offset(i, t, g);
        T* k = y + K.k_offset(i, t, g);
        if (unpack_add)
          for (int64_t j = 0; j < 2 * L.d; ++j) p[j] += k[j];
        else
          std::copy_n(p, 2 * L.d, k);
      }
}
}  // namespace

template <typename T>
void reference_attention_kv_pack(Tensor kv, Tensor qkv, const AttentionShape& a) {
  move_kv_parts<T>(qkv, kv, a, false);
}

template <typename T>
void reference_attention_kv_unpack_add(Tensor dqkv, Tensor dkv, const AttentionShape& a) {
  move_kv_parts<T>(dqkv, dkv, a, true);
}

#define MT_ATTENTION_BLOCK_INSTANTIATE(T)                                                                      \
  template void reference_attention_block_forward<T>(Tensor, Tensor, Tensor, Tensor, const AttentionShape&,  \
                                                     const AttentionBlock&);                                 \
  template void reference_attention_block_backward<T>(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, \
                                                      const AttentionShape&, const AttentionBlock&);         \
  template void reference_attention_merge<T>(Tensor, Tensor, Tensor, Tensor);                                \
  template void reference_attention_sink_forward<T>(Tensor, Tensor, Tensor);                                \
  template void reference_attention_sink_backward<T>(Tensor, Tensor, Tensor, Tensor, Tensor);                \
  template void reference_attention_kv_pack<T>(Tensor, Tensor, const AttentionShape&);                       \
  template void reference_attention_kv_unpack_add<T>(Tensor, Tensor, const AttentionShape&);
MT_ATTENTION_BLOCK_INSTANTIATE(float)
MT_ATTENTION_BLOCK_INSTANTIATE(double)
#undef MT_ATTENTION_BLOCK_INSTANTIATE

}  // namespace mt
