// ReferenceBackend: mixture of experts (engine/backend.h, "mixture of experts"): top-k routing and
// its backward, the load-balancing statistics (aux and z losses) and their gradient, the
// permutation plan (a stable counting sort of the (row, slot) pairs by expert), and the row ops
// around the experts (gather, combine, scale by the routing weight).
//
// Logits and rows are float32 or float64; routing math runs in double. top-k takes the largest
// value first and, among equal values, the lower index (NaN ranks as -inf); the k picks are k
// passes over the row, each taking the best value ranked after the previous pick, so nothing is
// sorted or allocated. Rows are independent and spread over the thread pool, except the
// statistics, which are summed over rows in row order on one thread (the same bits for any
// number of threads).
#include <cmath>
#include <cstring>
#include <vector>

#include "engine/dropout_mask.h"
#include "engine/moe_routing.h"
#include "engine/reference/reference_backend.h"
#include "engine/reference/tensor_access.h"

namespace mt::reference {

namespace {

constexpr double kSigmoidNormEps = 1e-20;  // Megatron's p / (sum p + 1e-20) for sigmoid top-k > 1

double rank_value(double v) { return std::isnan(v) ? -INFINITY : v; }
// a = (value va, index ia) ranks before b in top-k order.
bool ranks_before(double va, int64_t ia, double vb, int64_t ib) {
  va = rank_value(va);
  vb = rank_value(vb);
  return va > vb || (va == vb && ia < ib);
}

// The k best entries of v[0, n) among those with ok(i), best first: emit(j, i) for pick j.
template <typename Ok, typename Emit>
void top_k(const double* v, int64_t n, int64_t k, Ok&& ok, Emit&& emit, const char* op) {
  int64_t prev = -1;
  for (int64_t j = 0; j < k; ++j) {
    int64_t best = -1;
    for (int64_t i = 0; i < n; ++i) {
      if (!ok(i) || (prev >= 0 && !ranks_before(v[prev], prev, v[i], i))) continue;
      if (best < 0 || ranks_before(v[i], i, v[best], best)) best = i;
    }
    MT_CHECK(best >= 0, "{}: top-{} of {} values found only {}", op, k, n, j);
    emit(j, best);
    prev = best;
  }
}

double sigmoid_of(double z) { return 1.0 / (1.0 + std::exp(-z)); }
// PyTorch's softplus (beta 1, threshold 20: z itself above it).
double softplus_of(double z) { return z > 20.0 ? z : std::log1p(std::exp(z)); }
// The gated score functions: s = g(z) and dg/dz (sigmoid's 1 - s as sigmoid(-z)).
double gated_score(MoeScoreFunction f, double z) {
  return f == MoeScoreFunction::sigmoid ? sigmoid_of(z) : std::sqrt(softplus_of(z));
}
double gated_score_grad(MoeScoreFunction f, double z) {
  if (f == MoeScoreFunction::sigmoid) return sigmoid_of(z) * sigmoid_of(-z);
  return (z > 20.0 ? 1.0 : sigmoid_of(z)) / (2.0 * std::sqrt(softplus_of(z)));
}

// s[e] = softmax(z)[e]; returns logsumexp(z).
double softmax_into(const double* z, int64_t E, double* s) {
  double m = -INFINITY;
  for (int64_t e = 0; e < E; ++e) m = std::max(m, z[e]);
  double sum = 0;
  for (int64_t e = 0; e < E; ++e) {
    s[e] = std::exp(z[e] - m);
    sum += s[e];
  }
  for (int64_t e = 0; e < E; ++e) s[e] /= sum;
  return m + std::log(sum);
}

// The aux score s~ of one row (softmax, or the gated scores normalized over the row) into s; returns
// logsumexp(z) (the z-loss's term).
double aux_scores(const double* z, int64_t E, MoeScoreFunction score, double* s) {
  if (score == MoeScoreFunction::softmax) return softmax_into(z, E, s);
  double m = -INFINITY, sum_exp = 0, sum = 0;
  for (int64_t e = 0; e < E; ++e) m = std::max(m, z[e]);
  for (int64_t e = 0; e < E; ++e) {
    sum_exp += std::exp(z[e] - m);
    s[e] = gated_score(score, z[e]);
    sum += s[e];
  }
  for (int64_t e = 0; e < E; ++e) s[e] /= sum;
  return m + std::log(sum_exp);
}

template <typename T>
void load_row(const T* src, int64_t E, double* z) {
  for (int64_t e = 0; e < E; ++e) z[e] = static_cast<double>(src[e]);
}

void check_indices(const Tensor& idx, int64_t n, const char* op, const char* what) {
  MT_CHECK(idx.dtype == DType::i32 && idx.numel() == n, "{}: {} must be int32 with {} elements, got {} {}", op, what,
           n, dtype_name(idx.dtype), idx.shape_string());
}

}  // namespace

void ReferenceBackend::moe_route(Tensor probs, Tensor idx, Tensor logits, Tensor expert_bias, const MoeRouting& r) {
  const char* op = "moe_route";
  check_moe_routing(r, logits.cols(), op);
  const int64_t N = logits.rows(), E = r.experts, k = r.topk;
  check_numel(probs, N * k, op, "probs");
  check_float_accumulator(probs, op, "probs");
  check_indices(idx, N * k, op, "idx");
  if (!expert_bias.empty()) {
    check_numel(expert_bias, E, op, "expert_bias");
    check_float_accumulator(expert_bias, op, "expert_bias");
  }
  const bool grouped = moe_grouped(r);
  const int64_t G = grouped ? r.num_groups : 0, group_size = grouped ? E / G : E;
  const int64_t group_top = grouped ? k / r.group_topk : 0;
  const double scaling = r.scaling != 0 ? static_cast<double>(r.scaling) : 1.0;
  const Floats fp(probs), fbias(expert_bias);
  dispatch_float(logits, op, [&](auto tag) {
    using T = decltype(tag);
    pool_.parallel_for(N, 16, [&](int64_t rb, int64_t re, int thread) {
      // z, s (the scores), key (what top-k ranks), the group scores and selection, the weights.
      double* z = scratch(thread, static_cast<size_t>(3 * E + 2 * G + k));
      double *s = z + E, *key = s + E, *gscore = key + E, *gsel = gscore + G, *p = gsel + G;
      for (int64_t t = rb; t < re; ++t) {
        load_row(logits.ptr<T>() + t * E, E, z);
        if (r.score == MoeScoreFunction::softmax) {
          softmax_into(z, E, s);
          for (int64_t e = 0; e < E; ++e) key[e] = r.pre_softmax ? s[e] : z[e];
        } else {
          for (int64_t e = 0; e < E; ++e) {
            s[e] = gated_score(r.score, z[e]);
            key[e] = s[e] + (fbias.empty() ? 0.0 : fbias.get(e));
          }
        }
        if (grouped) {
          for (int64_t g = 0; g < G; ++g) {
            double sum = 0;
            top_k(key + g * group_size, group_size, group_top, [](int64_t) { return true; },
                  [&](int64_t, int64_t i) { sum += key[g * group_size + i]; }, op);
            gscore[g] = sum;
            gsel[g] = 0;
          }
          top_k(gscore, G, r.group_topk, [](int64_t) { return true; }, [&](int64_t, int64_t g) { gsel[g] = 1; }, op);
        }
        int32_t* row_idx = idx.ptr<int32_t>() + t * k;
        top_k(key, E, k, [&](int64_t e) { return !grouped || gsel[e / group_size] != 0; },
              [&](int64_t j, int64_t e) { row_idx[j] = static_cast<int32_t>(e); }, op);
        if (r.score == MoeScoreFunction::softmax && !r.pre_softmax) {
          double m = -INFINITY, sum = 0;
          for (int64_t j = 0; j < k; ++j) m = std::max(m, z[row_idx[j]]);
          for (int64_t j = 0; j < k; ++j) sum += (p[j] = std::exp(z[row_idx[j]] - m));
          for (int64_t j = 0; j < k; ++j) p[j] /= sum;
        } else {
          double sum = 0;
          for (int64_t j = 0; j < k; ++j) sum += (p[j] = s[row_idx[j]]);
          if (r.score != MoeScoreFunction::softmax && k > 1)
            for (int64_t j = 0; j < k; ++j) p[j] /= sum + kSigmoidNormEps;
        }
        for (int64_t j = 0; j < k; ++j) fp.set(t * k + j, static_cast<double>(static_cast<T>(p[j] * scaling)));
      }
    });
  });
}

void ReferenceBackend::moe_sinkhorn_route(Tensor probs, Tensor idx, Tensor logits, int topk, int64_t block_rows,
                                          bool training) {
  const char* op = "moe_sinkhorn_route";
  const int64_t N = logits.rows(), E = logits.cols();
  check_sinkhorn_topk(topk, E);
  check_numel(probs, N * topk, op, "probs");
  check_float_accumulator(probs, op, "probs");
  check_indices(idx, N * topk, op, "idx");
  const Floats fz(logits), fp(probs);
  std::vector<double> z(static_cast<size_t>(N * E)), p(static_cast<size_t>(N * topk));
  for (int64_t i = 0; i < N * E; ++i) z[static_cast<size_t>(i)] = fz.get(i);
  const bool f32 = logits.dtype == DType::f32;
  moe_sinkhorn_route_host(p.data(), idx.ptr<int32_t>(), z.data(), N, static_cast<int>(E), topk, block_rows, training,
                          [f32](double v) { return f32 ? static_cast<double>(static_cast<float>(v)) : v; });
  for (int64_t i = 0; i < N * topk; ++i) fp.set(i, p[static_cast<size_t>(i)]);
}

void ReferenceBackend::moe_route_backward(Tensor dlogits, Tensor dprobs, Tensor logits, Tensor idx, Tensor aux_grad,
                                          const MoeRouting& r) {
  const char* op = "moe_route_backward";
  check_moe_routing(r, logits.cols(), op);
  const int64_t N = logits.rows(), E = r.experts, k = r.topk;
  check_numel(dlogits, N * E, op, "dlogits");
  check_same_dtype(logits, dlogits, op);
  check_numel(dprobs, N * k, op, "dprobs");
  check_float_accumulator(dprobs, op, "dprobs");
  check_indices(idx, N * k, op, "idx");
  if (!aux_grad.empty()) {
    check_numel(aux_grad, N * E, op, "aux_grad");
    check_float_accumulator(aux_grad, op, "aux_grad");
  }
  const int32_t* ids = idx.ptr<int32_t>();
  for (int64_t i = 0; i < N * k; ++i)
    MT_CHECK(ids[i] >= 0 && ids[i] < E, "{}: idx[{}] = {} is not an expert of {}", op, i, ids[i], E);
  const double scaling = r.scaling != 0 ? static_cast<double>(r.scaling) : 1.0;
  const Floats fg(dprobs), faux(aux_grad);
  dispatch_float(logits, op, [&](auto tag) {
    using T = decltype(tag);
    pool_.parallel_for(N, 16, [&](int64_t rb, int64_t re, int thread) {
      double* z = scratch(thread, static_cast<size_t>(3 * E + k));
      double *s = z + E, *grad = s + E, *q = grad + E;
      for (int64_t t = rb; t < re; ++t) {
        load_row(logits.ptr<T>() + t * E, E, z);
        const int32_t* row_idx = ids + t * k;
        for (int64_t e = 0; e < E; ++e) grad[e] = faux.empty() ? 0.0 : faux.get(t * E + e);
        auto g = [&](int64_t j) { return fg.get(t * k + j) * scaling; };  // d loss / d unscaled weight j
        if (r.score == MoeScoreFunction::softmax && !r.pre_softmax) {
          // p = softmax of the k selected logits: dz_j = p_j (g_j - sum_i p_i g_i).
          double m = -INFINITY, sum = 0, dot = 0;
          for (int64_t j = 0; j < k; ++j) m = std::max(m, z[row_idx[j]]);
          for (int64_t j = 0; j < k; ++j) sum += (q[j] = std::exp(z[row_idx[j]] - m));
          for (int64_t j = 0; j < k; ++j) dot += (q[j] /= sum) * g(j);
          for (int64_t j = 0; j < k; ++j) grad[row_idx[j]] += q[j] * (g(j) - dot);
        } else if (r.score == MoeScoreFunction::softmax) {
          // p_j = s[idx_j], s = softmax(z) over all E: dz_e = s_e (ds_e - sum_c s_c ds_c).
          softmax_into(z, E, s);
          double dot = 0;
          for (int64_t j = 0; j < k; ++j) dot += s[row_idx[j]] * g(j);
          for (int64_t e = 0; e < E; ++e) grad[e] -= s[e] * dot;
          for (int64_t j = 0; j < k; ++j) grad[row_idx[j]] += s[row_idx[j]] * g(j);
        } else {
          // p_j = s_j / (S + eps) (k > 1) or s_j, s = g(z) (sigmoid or sqrt-softplus): dz = ds * g'(z).
          double S = kSigmoidNormEps, dot = 0;
          for (int64_t j = 0; j < k; ++j) {
            q[j] = gated_score(r.score, z[row_idx[j]]);
            S += q[j];
            dot += q[j] * g(j);
          }
          for (int64_t j = 0; j < k; ++j) {
            const double ds = k > 1 ? g(j) / S - dot / (S * S) : g(j);
            grad[row_idx[j]] += ds * gated_score_grad(r.score, z[row_idx[j]]);
          }
        }
        T* out = dlogits.ptr<T>() + t * E;
        for (int64_t e = 0; e < E; ++e) out[e] = static_cast<T>(grad[e]);
      }
    });
  });
}

void ReferenceBackend::moe_aux_stats(Tensor stats, Tensor logits, const MoeRouting& r) {
  const char* op = "moe_aux_stats";
  check_moe_routing(r, logits.cols(), op);
  const int64_t N = logits.rows(), E = r.experts, k = r.topk;
  check_numel(stats, 2 * E + 1, op, "stats");
  check_float_accumulator(stats, op, "stats");
  const Floats fs(stats);
  dispatch_float(logits, op, [&](auto tag) {
    using T = decltype(tag);
    double* z = scratch(0, static_cast<size_t>(4 * E));
    double *s = z + E, *score_sum = s + E, *count = score_sum + E;
    std::fill(score_sum, score_sum + 2 * E, 0.0);
    double lse_sq = 0;
    for (int64_t t = 0; t < N; ++t) {
      load_row(logits.ptr<T>() + t * E, E, z);
      const double lse = aux_scores(z, E, r.score, s);
      lse_sq += lse * lse;
      for (int64_t e = 0; e < E; ++e) score_sum[e] += s[e];
      top_k(s, E, k, [](int64_t) { return true; }, [&](int64_t, int64_t e) { count[e] += 1; }, op);
    }
    for (int64_t e = 0; e < E; ++e) {
      fs.set(e, score_sum[e]);
      fs.set(E + e, count[e]);
    }
    fs.set(2 * E, lse_sq);
  });
}

void ReferenceBackend::moe_aux_grad(Tensor aux_grad, Tensor logits, Tensor stats, float aux_scale, float z_scale,
                                    const MoeRouting& r) {
  const char* op = "moe_aux_grad";
  check_moe_routing(r, logits.cols(), op);
  const int64_t N = logits.rows(), E = r.experts;
  check_numel(aux_grad, N * E, op, "aux_grad");
  check_float_accumulator(aux_grad, op, "aux_grad");
  check_numel(stats, 2 * E + 1, op, "stats");
  check_float_accumulator(stats, op, "stats");
  const Floats fa(aux_grad), fs(stats);
  const double as = aux_scale, zs = z_scale;
  dispatch_float(logits, op, [&](auto tag) {
    using T = decltype(tag);
    pool_.parallel_for(N, 16, [&](int64_t rb, int64_t re, int thread) {
      double* z = scratch(thread, static_cast<size_t>(3 * E));
      double *sm = z + E, *grad = sm + E;
      for (int64_t t = rb; t < re; ++t) {
        load_row(logits.ptr<T>() + t * E, E, z);
        const double lse = softmax_into(z, E, sm);
        std::fill(grad, grad + E, 0.0);
        if (as != 0) {
          // d/dz of sum_e c_e s~_e with the counts c constant.
          double dot = 0;
          if (r.score == MoeScoreFunction::softmax) {
            for (int64_t e = 0; e < E; ++e) dot += fs.get(E + e) * sm[e];
            for (int64_t e = 0; e < E; ++e) grad[e] = as * sm[e] * (fs.get(E + e) - dot);
          } else {
            double sum = 0;
            for (int64_t e = 0; e < E; ++e) {
              const double sg = gated_score(r.score, z[e]);
              sum += sg;
              dot += fs.get(E + e) * sg;
            }
            for (int64_t e = 0; e < E; ++e)
              grad[e] = as * (fs.get(E + e) / sum - dot / (sum * sum)) * gated_score_grad(r.score, z[e]);
          }
        }
        if (zs != 0)  // d/dz lse^2 = 2 lse softmax(z)
          for (int64_t e = 0; e < E; ++e) grad[e] += zs * 2.0 * lse * sm[e];
        for (int64_t e = 0; e < E; ++e) fa.set(t * E + e, grad[e]);
      }
    });
  });
}

void ReferenceBackend::moe_aux_log(Tensor sums, Tensor stats, float aux_scale, float z_scale) {
  const char* op = "moe_aux_log";
  const int64_t E = (stats.numel() - 1) / 2;
  MT_CHECK(E >= 1 && stats.numel() == 2 * E + 1, "{}: stats {} is not [2E + 1]", op, stats.shape_string());
  check_float_accumulator(stats, op, "stats");
  check_numel(sums, 2, op, "sums");
  check_float_accumulator(sums, op, "sums");
  const Floats fs(stats), fo(sums);
  double aux = 0;
  for (int64_t e = 0; e < E; ++e) aux += fs.get(e) * fs.get(E + e);
  fo.add(0, static_cast<double>(aux_scale) * aux);
  fo.add(1, static_cast<double>(z_scale) * fs.get(2 * E));
}

void ReferenceBackend::moe_count_rows(Tensor counts, Tensor offsets) {
  const char* op = "moe_count_rows";
  const int64_t E = counts.numel();
  MT_CHECK(counts.dtype == DType::f64 && E >= 1, "{}: counts must be float64 [E], got {} {}", op,
           dtype_name(counts.dtype), counts.shape_string());
  check_indices(offsets, E + 1, op, "offsets");
  const int32_t* o = offsets.ptr<const int32_t>();
  double* c = counts.ptr<double>();
  for (int64_t e = 0; e < E; ++e) c[e] += static_cast<double>(o[e + 1] - o[e]);
}

void ReferenceBackend::moe_jitter(Tensor out, Tensor in, float eps, uint64_t key, int64_t index0) {
  MT_CHECK(out.dtype == in.dtype && out.numel() == in.numel() && is_floating(out.dtype) && index0 >= 0,
           "moe_jitter: out {} [{}] and in {} [{}] must be one float dtype and size (index0 {})", dtype_name(out.dtype),
           out.shape_string(), dtype_name(in.dtype), in.shape_string(), index0);
  const Floats o(out), x(in);
  pool_.parallel_for(out.numel(), 1 << 12, [&](int64_t b, int64_t e, int) {
    for (int64_t i = b; i < e; ++i) {
      o.set(i, x.get(i) * static_cast<double>(moe_jitter_factor(key, static_cast<uint64_t>(index0 + i), eps)));
    }
  });
}

void ReferenceBackend::moe_permute_plan(Tensor order, Tensor slot_of, Tensor offsets, Tensor idx, int first_expert,
                                        int num_experts) {
  const char* op = "moe_permute_plan";
  const int64_t M = idx.numel(), E = num_experts;
  MT_CHECK(E >= 1 && first_expert >= 0, "{}: {} experts from {}", op, E, first_expert);
  check_indices(idx, M, op, "idx");
  check_indices(order, M, op, "order");
  check_indices(slot_of, M, op, "slot_of");
  check_indices(offsets, E + 1, op, "offsets");
  MT_CHECK(M < (int64_t{1} << 31), "{}: {} (row, slot) pairs do not fit int32", op, M);
  const int32_t* ids = idx.ptr<int32_t>();
  // The pair's expert within the range, or -1 (routed to an expert outside it: not placed).
  auto local = [&](int64_t p) -> int64_t {
    const int64_t e = int64_t{ids[p]} - first_expert;
    return e >= 0 && e < E ? e : -1;
  };
  int32_t* off = offsets.ptr<int32_t>();
  std::fill(off, off + E + 1, 0);
  for (int64_t p = 0; p < M; ++p)
    if (const int64_t e = local(p); e >= 0) ++off[e + 1];
  for (int64_t e = 0; e < E; ++e) off[e + 1] += off[e];
  // Pairs in ascending order land at their expert's next free position: expert-major, stable.
  double* next = scratch(0, static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) next[e] = off[e];
  int32_t *ord = order.ptr<int32_t>(), *slot = slot_of.ptr<int32_t>();
  for (int64_t p = 0; p < M; ++p) {
    const int64_t e = local(p);
    if (e < 0) {
      slot[p] = -1;
      continue;
    }
    const auto pos = static_cast<int32_t>(next[e]++);
    ord[pos] = static_cast<int32_t>(p);
    slot[p] = pos;
  }
}

void ReferenceBackend::moe_gather_rows(Tensor out, Tensor x, Tensor index, int k) {
  const char* op = "moe_gather_rows";
  const int64_t R = out.rows(), C = out.cols(), X = x.rows();
  MT_CHECK(k >= 1, "{}: k = {}", op, k);
  MT_CHECK(x.cols() == C && x.dtype == out.dtype, "{}: x {} {} for out {} {}", op, dtype_name(x.dtype),
           x.shape_string(), dtype_name(out.dtype), out.shape_string());
  check_indices(index, R, op, "index");
  const int32_t* ids = index.ptr<int32_t>();
  const size_t row_bytes = static_cast<size_t>(C) * dtype_size(out.dtype);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t src = ids[r] / k;
    char* dst = static_cast<char*>(out.data) + r * row_bytes;
    if (ids[r] < 0 || src >= X) std::memset(dst, 0, row_bytes);  // a pair not placed
    else std::memcpy(dst, static_cast<const char*>(x.data) + src * row_bytes, row_bytes);
  }
}

void ReferenceBackend::moe_combine(Tensor out, Tensor y, Tensor slot_of, int k, bool accumulate) {
  const char* op = "moe_combine";
  const int64_t T_rows = out.rows(), C = out.cols(), Y = y.rows();
  MT_CHECK(k >= 1, "{}: k = {}", op, k);
  MT_CHECK(y.cols() == C, "{}: y {} for out {}", op, y.shape_string(), out.shape_string());
  check_same_dtype(out, y, op);
  check_indices(slot_of, T_rows * k, op, "slot_of");
  const int32_t* slots = slot_of.ptr<int32_t>();
  dispatch_float(out, op, [&](auto tag) {
    using T = decltype(tag);
    pool_.parallel_for(T_rows, 16, [&](int64_t rb, int64_t re, int) {
      for (int64_t t = rb; t < re; ++t) {
        T* o = out.ptr<T>() + t * C;
        for (int64_t c = 0; c < C; ++c) {
          double v = 0;
          for (int64_t j = 0; j < k; ++j) {
            const int64_t s = slots[t * k + j];
            if (s >= 0 && s < Y) v += static_cast<double>(y.ptr<T>()[s * C + c]);  // (else not placed here)
          }
          o[c] = static_cast<T>(accumulate ? static_cast<double>(o[c]) + v : v);
        }
      }
    });
  });
}

void ReferenceBackend::moe_scale_rows(Tensor out, Tensor x, Tensor p) {
  const char* op = "moe_scale_rows";
  const int64_t R = x.rows(), C = x.cols();
  check_numel(out, x.numel(), op, "out");
  check_same_dtype(x, out, op);
  check_numel(p, R, op, "p");
  check_float_accumulator(p, op, "p");
  const Floats fp(p);
  dispatch_float(x, op, [&](auto tag) {
    using T = decltype(tag);
    pool_.parallel_for(R, 16, [&](int64_t rb, int64_t re, int) {
      for (int64_t r = rb; r < re; ++r) {
        const double w = fp.get(r);
        const T* xs = x.ptr<T>() + r * C;
        T* o = out.ptr<T>() + r * C;
        for (int64_t c = 0; c < C; ++c) o[c] = static_cast<T>(static_cast<double>(xs[c]) * w);
      }
    });
  });
}

void ReferenceBackend::moe_scale_rows_backward(Tensor dx, Tensor dp, Tensor dout, Tensor x, Tensor p) {
  const char* op = "moe_scale_rows_backward";
  const int64_t R = x.rows(), C = x.cols();
  check_numel(dout, x.numel(), op, "dout");
  check_numel(dx, x.numel(), op, "dx");
  check_same_dtype(x, dout, op);
  check_same_dtype(x, dx, op);
  check_numel(p, R, op, "p");
  check_float_accumulator(p, op, "p");
  check_numel(dp, R, op, "dp");
  check_float_accumulator(dp, op, "dp");
  const Floats fp(p), fdp(dp);
  dispatch_float(x, op, [&](auto tag) {
    using T = decltype(tag);
    pool_.parallel_for(R, 16, [&](int64_t rb, int64_t re, int) {
      for (int64_t r = rb; r < re; ++r) {
        const T* xs = x.ptr<T>() + r * C;
        const T* dy = dout.ptr<T>() + r * C;
        T* d = dx.ptr<T>() + r * C;
        double sum = 0;  // before dx (which may alias dout) is written
        for (int64_t c = 0; c < C; ++c) sum += static_cast<double>(dy[c]) * static_cast<double>(xs[c]);
        fdp.set(r, sum);
        const double w = fp.get(r);
        for (int64_t c = 0; c < C; ++c) d[c] = static_cast<T>(static_cast<double>(dy[c]) * w);
      }
    });
  });
}

}  // namespace mt::reference

namespace mt::reference {

namespace {
// Each row's expert under host offsets [E + 1] (rows past offsets[E]: -1).
std::vector<int32_t> expert_of_rows(std::span<const int64_t> offsets, int64_t rows) {
  std::vector<int32_t> e_of(static_cast<size_t>(rows), -1);
  for (size_t e = 0; e + 1 < offsets.size(); ++e)
    for (int64_t r = offsets[e]; r < offsets[e + 1] && r < rows; ++r) e_of[static_cast<size_t>(r)] = static_cast<int32_t>(e);
  return e_of;
}
void check_grouped_bias(const char* op, const Tensor& y, const Tensor& bias, const Tensor& p, int64_t experts) {
  check_same_dtype(y, bias, op);
  MT_CHECK(bias.numel() == experts * y.cols(), "{}: bias of {} elements for {} experts of {} columns", op,
           bias.numel(), experts, y.cols());
  if (!p.empty()) {
    check_numel(p, y.rows(), op, "p");
    check_float_accumulator(p, op, "p");
  }
}
}  // namespace

void ReferenceBackend::grouped_bias_forward(Tensor y, Tensor bias, Tensor p, const ExpertOffsets& o) {
  const char* op = "grouped_bias_forward";
  std::vector<int64_t> storage;
  const std::span<const int64_t> offsets = expert_offsets_on_host(*this, o, y.rows(), storage);
  const int64_t E = static_cast<int64_t>(offsets.size()) - 1, n = y.cols();
  check_grouped_bias(op, y, bias, p, E);
  const std::vector<int32_t> e_of = expert_of_rows(offsets, y.rows());
  const Floats fy(y), fb(bias), fp(p);
  pool_.parallel_for(y.rows(), 16, [&](int64_t rb, int64_t re, int) {
    for (int64_t r = rb; r < re; ++r) {
      const int32_t e = e_of[static_cast<size_t>(r)];
      if (e < 0) continue;
      const double s = fp.empty() ? 1.0 : fp.get(r);
      for (int64_t c = 0; c < n; ++c) fy.set(r * n + c, fy.get(r * n + c) + s * fb.get(e * n + c));
    }
  });
}

void ReferenceBackend::grouped_bias_backward(Tensor dbias, Tensor dp, Tensor dy, Tensor bias, Tensor p,
                                             const ExpertOffsets& o, bool accumulate) {
  const char* op = "grouped_bias_backward";
  std::vector<int64_t> storage;
  const std::span<const int64_t> offsets = expert_offsets_on_host(*this, o, dy.rows(), storage);
  const int64_t E = static_cast<int64_t>(offsets.size()) - 1, n = dy.cols();
  check_grouped_bias(op, dy, bias, p, E);
  check_numel(dbias, E * n, op, "dbias");
  if (!dp.empty()) {
    MT_CHECK(!p.empty(), "{}: dp without p", op);
    check_numel(dp, dy.rows(), op, "dp");
    check_float_accumulator(dp, op, "dp");
  }
  const Floats fdb(dbias), fdy(dy), fb(bias), fp(p), fdp(dp);
  pool_.parallel_for(E, 1, [&](int64_t eb, int64_t ee, int) {
    for (int64_t e = eb; e < ee; ++e) {
      for (int64_t c = 0; c < n; ++c) {
        double sum = 0;
        for (int64_t r = offsets[static_cast<size_t>(e)]; r < offsets[static_cast<size_t>(e) + 1]; ++r)
          sum += (fp.empty() ? 1.0 : fp.get(r)) * fdy.get(r * n + c);
        fdb.set(e * n + c, accumulate ? fdb.get(e * n + c) + sum : sum);
      }
      if (fdp.empty()) continue;
      for (int64_t r = offsets[static_cast<size_t>(e)]; r < offsets[static_cast<size_t>(e) + 1]; ++r) {
        double dot = 0;
        for (int64_t c = 0; c < n; ++c) dot += fdy.get(r * n + c) * fb.get(e * n + c);
        fdp.set(r, fdp.get(r) + dot);
      }
    }
  });
}

}  // namespace mt::reference
