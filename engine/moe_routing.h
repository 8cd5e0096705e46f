// Checks shared by both backends' mixture-of-experts ops (Backend::moe_route and the ops after it):
// the routing rule against the logits' width, and the limits of what the ops take.
#pragma once

#include <cstdint>

#include "core/error.h"
#include "engine/backend.h"

namespace mt {

// Group-limited routing is on iff num_groups > 0 (then group_topk must be in [1, num_groups]).
inline bool moe_grouped(const MoeRouting& r) { return r.num_groups > 0; }

// The routing rule r for logits of `experts` columns: E = r.experts = experts >= 1, 1 <= k <= E,
// and for group-limited routing E a multiple of num_groups, 1 <= group_topk <= num_groups and at
// least k experts in the group_topk selected groups. `op` names the op in the message.
inline void check_moe_routing(const MoeRouting& r, int64_t experts, const char* op) {
  if (r.experts < 1 || r.experts != experts)
    fail("{}: the routing rule has {} experts but the logits have {} columns (--num-experts)", op, r.experts, experts);
  if (r.topk < 1 || r.topk > r.experts)
    fail("{}: top-k {} must be in [1, {}] (--moe-router-topk at most --num-experts)", op, r.topk, r.experts);
  if (r.num_groups < 0) fail("{}: {} expert groups (--moe-router-num-groups must be positive)", op, r.num_groups);
  if (moe_grouped(r)) {
    if (r.experts % r.num_groups != 0)
      fail("{}: {} experts do not split into {} groups (--num-experts must be a multiple of "
           "--moe-router-num-groups)", op, r.experts, r.num_groups);
    if (r.group_topk < 1 || r.group_topk > r.num_groups)
      fail("{}: group top-k {} must be in [1, {}] (--moe-router-group-topk at most --moe-router-num-groups)", op,
           r.group_topk, r.num_groups);
    if (static_cast<int64_t>(r.group_topk) * (r.experts / r.num_groups) < r.topk)
      fail("{}: {} selected groups of {} experts hold fewer than top-k {} experts (raise --moe-router-group-topk)",
           op, r.group_topk, r.experts / r.num_groups, r.topk);
  }
}

}  // namespace mt

#include <algorithm>
#include <cmath>
#include <vector>

namespace mt {

// Token dropping (Backend::moe_capacity_drop) on host arrays: kept [N, k] from idx [N, k] and the
// routing weights w [N, k]. Within each block of block_rows rows, expert e keeps its `capacity`
// pairs of largest weight (ties: lower row, then lower slot) or, by_position, of the first rows;
// the others get -1.
inline void moe_capacity_drop_host(int32_t* kept, const int32_t* idx, const double* w, int64_t N, int k, int E,
                                   int64_t capacity, int64_t block_rows, bool by_position) {
  MT_CHECK(block_rows > 0 && N % block_rows == 0 && capacity >= 0, "capacity drop: {} rows in blocks of {}, capacity {}",
           N, block_rows, capacity);
  std::vector<std::vector<int64_t>> pairs(static_cast<size_t>(E));  // per expert: its pairs in the block
  for (int64_t b0 = 0; b0 < N; b0 += block_rows) {
    for (auto& p : pairs) p.clear();
    for (int64_t p = b0 * k; p < (b0 + block_rows) * k; ++p) {
      kept[p] = idx[p];
      MT_CHECK(idx[p] >= 0 && idx[p] < E, "capacity drop: idx[{}] = {} is not one of {} experts", p, idx[p], E);
      pairs[static_cast<size_t>(idx[p])].push_back(p);
    }
    for (auto& p : pairs) {
      if (static_cast<int64_t>(p.size()) <= capacity) continue;
      // (pairs are in row order already: the position policy keeps the first `capacity`)
      if (!by_position)
        std::stable_sort(p.begin(), p.end(), [&](int64_t a, int64_t b) { return w[a] > w[b]; });
      for (size_t j = static_cast<size_t>(capacity); j < p.size(); ++j) kept[p[j]] = -1;
    }
  }
}

// Megatron's expert-bias update (aux-loss-free balancing) of one MoE layer: b_e += rate *
// sign(mean(c) - c_e), sign(0) = 0, in float arithmetic; c: the step's token counts per expert.
inline void moe_expert_bias_update(float* bias, const double* counts, int E, float rate) {
  double mean = 0;
  for (int e = 0; e < E; ++e) mean += counts[e];
  mean /= E;
  for (int e = 0; e < E; ++e) {
    const float sign = counts[e] < mean ? 1.0f : counts[e] > mean ? -1.0f : 0.0f;
    bias[e] = bias[e] + rate * sign;
  }
}

// Backend::moe_sinkhorn_route's top-k against the logits' E columns (both backends check it first).
inline void check_sinkhorn_topk(int k, int64_t E) {
  if (k < 1 || k > E)
    fail("moe_sinkhorn_route: top-k {} must be in [1, {}] (--moe-router-topk at most --num-experts)", k, E);
}

// Sinkhorn load balancing (Backend::moe_sinkhorn_route) on host arrays: z [N, E] (the logits'
// values), into probs [N, k] (each weight rounded to the logits' dtype by round_weight) and idx
// [N, k]. Shared by both backends (the CUDA backend runs it on a host copy of the logits).
template <typename Round>
void moe_sinkhorn_route_host(double* probs, int32_t* idx, const double* z, int64_t N, int E, int k, int64_t block_rows,
                             bool training, Round round_weight) {
  MT_CHECK(block_rows > 0 && N % block_rows == 0, "sinkhorn: {} rows in blocks of {}", N, block_rows);
  std::vector<double> key(static_cast<size_t>(N) * E), weight(static_cast<size_t>(N) * E);
  // The weights: k = 1 sigmoid(z), else softmax(z) over all E (Megatron's _sinkhorn_activation).
  for (int64_t t = 0; t < N; ++t) {
    const double* row = z + t * E;
    double* w = weight.data() + t * E;
    if (k == 1) {
      for (int e = 0; e < E; ++e) w[e] = 1.0 / (1.0 + std::exp(-row[e]));
    } else {
      double m = -INFINITY, sum = 0;
      for (int e = 0; e < E; ++e) m = std::max(m, row[e]);
      for (int e = 0; e < E; ++e) sum += std::exp(row[e] - m);
      for (int e = 0; e < E; ++e) w[e] = std::exp(row[e] - m) / sum;
    }
  }
  if (!training) {
    key = weight;
  } else {
    // sinkhorn(z) per block of rows: C = exp(z); d0 = 1/(R (C d1 + 1e-8)), d1 = 1/(E (C^T d0 + 1e-8))
    // until mean |d1 - d1_prev| < 1e-4 (Megatron's tolerance; at most 1000 rounds: never a hang),
    // S = d1 * C * d0, whose top-k selects.
    std::vector<double> d0(static_cast<size_t>(block_rows)), d1(static_cast<size_t>(E)), prev(static_cast<size_t>(E));
    for (int64_t b = 0; b < N; b += block_rows) {
      const int64_t R = block_rows;
      std::fill(d1.begin(), d1.end(), 1.0);
      for (int round = 0; round < 1000; ++round) {
        prev = d1;
        for (int64_t r = 0; r < R; ++r) {
          double s = 0;
          for (int e = 0; e < E; ++e) s += d1[e] * std::exp(z[(b + r) * E + e]);
          d0[r] = 1.0 / (static_cast<double>(R) * (s + 1e-8));
        }
        for (int e = 0; e < E; ++e) {
          double s = 0;
          for (int64_t r = 0; r < R; ++r) s += d0[r] * std::exp(z[(b + r) * E + e]);
          d1[e] = 1.0 / (static_cast<double>(E) * (s + 1e-8));
        }
        double err = 0;
        for (int e = 0; e < E; ++e) err += std::fabs(d1[e] - prev[e]);
        if (err / E < 1e-4) break;
      }
      for (int64_t r = 0; r < R; ++r)
        for (int e = 0; e < E; ++e)
          key[(b + r) * E + e] = d1[e] * std::exp(z[(b + r) * E + e]) * d0[r];
    }
  }
  // top-k of the keys: descending, ties to the lower expert; the weights at the chosen experts.
  for (int64_t t = 0; t < N; ++t) {
    const double* kr = key.data() + t * E;
    std::vector<char> taken(static_cast<size_t>(E), 0);
    for (int j = 0; j < k; ++j) {
      int best = -1;
      for (int e = 0; e < E; ++e)
        if (!taken[e] && (best < 0 || kr[e] > kr[best])) best = e;
      taken[best] = 1;
      idx[t * k + j] = best;
      probs[t * k + j] = round_weight(weight[t * E + best]);
    }
  }
}

}  // namespace mt
