// Mixture of experts (engine/backend.h, "mixture of experts"): top-k routing and its backward,
// the load-balancing statistics and their gradient, the permutation plan, and the row ops around
// the experts.
//
// Routing, its backward, the statistics and their gradient: one warp per token row. A row of
// E <= 512 experts lives in registers, VPL = ceil(E / 32) values per lane (element lane + 32 i in
// slot i). top-k is k rounds of a warp arg-max under the order "larger value first, then the
// lower index" (NaN ranks as -inf), each round excluding the picks before it; lane j keeps pick j.
// Group-limited routing stages the row's ranking keys in shared memory: lane g sums the top
// floor(k / group_topk) keys of group g (descending), the groups take a warp top-k of their own,
// and only the chosen groups' experts stay eligible. Math in float32.
//
// The statistics reduce over rows without float atomics: each warp sums its rows (a fixed
// row-to-warp assignment) in double, the block adds its warps in warp order into a scratch
// partial, and a second kernel adds the block partials in block order. The block count depends
// only on N and E (and the scratch size), so the result repeats bit for bit.
//
// The permutation plan is a counting sort that needs no atomics: the N * k (row, slot) pairs are
// cut into chunks of one warp each. Pass 1 counts each chunk's pairs per expert (warp match: the
// lowest lane of each expert's peers adds their number to the warp's counter in shared memory);
// pass 2 turns each expert's per-chunk counts into exclusive prefix sums over the chunks; pass 3
// scans the experts' totals into offsets; pass 4 replays each chunk in pair order, placing pair p
// at offsets[e] + (its chunk's prefix) + (earlier pairs of e in the chunk). Stable, deterministic.
//
// Gather, combine and row scaling: a team of up to 32 threads (a power of two) per row, 16-byte
// vectors where rows and pointers allow.
#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <climits>
#include <cmath>
#include <type_traits>

#include "cuda/activations.cuh"
#include "cuda/cuda_check.h"
#include "cuda/device_utils.cuh"
#include "cuda/kernels.h"
#include "engine/dropout_mask.h"
#include "engine/moe_routing.h"

namespace mt::cuda {
namespace {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kMaxExperts = 512;  // 16 values per lane
constexpr int kMaxTopk = 16;
constexpr int kRowWarps = 4;  // warps (rows) per block of the routing kernels
constexpr float kSigmoidNormEps = 1e-20f;

enum RouteMode : int { kPostSoftmax = 0, kPreSoftmax = 1, kSigmoid = 2, kSqrtSoftplus = 3 };

__device__ __forceinline__ float rank_value(float v) { return isnan(v) ? -INFINITY : v; }
__device__ __forceinline__ bool ranks_before(float va, int ca, float vb, int cb) {
  return va > vb || (va == vb && ca < cb);
}
__device__ __forceinline__ float sigmoid_of(float z) { return 1.0f / (1.0f + expf(-z)); }
// PyTorch's softplus (beta 1, threshold 20: z itself above it).
__device__ __forceinline__ float softplus_of(float z) { return z > 20.0f ? z : log1pf(expf(z)); }
// The gated scores s = g(z) (MoeScoreFunction sigmoid, or sqrtsoftplus: sqrt(softplus(z))) and
// dg/dz (sigmoid's 1 - s as sigmoid(-z): no cancellation near s = 1).
__device__ __forceinline__ float gated_score(MoeScoreFunction f, float z) {
  return f == MoeScoreFunction::sqrtsoftplus ? sqrtf(softplus_of(z)) : sigmoid_of(z);
}
__device__ __forceinline__ float gated_score_grad(MoeScoreFunction f, float z) {
  if (f != MoeScoreFunction::sqrtsoftplus) return sigmoid_of(z) * sigmoid_of(-z);
  return (z > 20.0f ? 1.0f : sigmoid_of(z)) / (2.0f * sqrtf(softplus_of(z)));
}
// The gated score function of a route mode (kSigmoid or kSqrtSoftplus).
__device__ __forceinline__ MoeScoreFunction gated_function(int mode) {
  return mode == kSqrtSoftplus ? MoeScoreFunction::sqrtsoftplus : MoeScoreFunction::sigmoid;
}

// The warp's best (value, index) pair; every lane gets it.
__device__ __forceinline__ void warp_best(float& v, int& c) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o /= 2) {
    const float v2 = __shfl_xor_sync(kFull, v, o);
    const int c2 = __shfl_xor_sync(kFull, c, o);
    if (ranks_before(v2, c2, v, c)) {
      v = v2;
      c = c2;
    }
  }
}

// The k best of the warp's values (element lane + 32 i in key[i], eligible where bit i of ok),
// best first: lane j < k gets pick j in (pick_v, pick_c). Returns the bits of this lane's picks.
template <int VPL>
__device__ __forceinline__ uint32_t warp_top_k(const float (&key)[VPL], uint32_t ok, int k, float& pick_v,
                                               int& pick_c) {
  const int lane = threadIdx.x % kWarp;
  uint32_t taken = 0;
  for (int j = 0; j < k; ++j) {
    float bv = -INFINITY;
    int bc = INT_MAX;
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
      const int c = lane + kWarp * i;
      if (((ok & ~taken) >> i) & 1u)
        if (ranks_before(key[i], c, bv, bc)) {
          bv = key[i];
          bc = c;
        }
    }
    warp_best(bv, bc);
    if (bc != INT_MAX && (bc % kWarp) == lane) taken |= 1u << (bc / kWarp);
    if (lane == j) {
      pick_v = bv;
      pick_c = bc;
    }
  }
  return taken;
}

// Loads row z (E values) into the lanes' slots; returns the bits of the slots that hold an expert.
template <typename T, int VPL>
__device__ __forceinline__ uint32_t load_row(const T* row, int E, float (&z)[VPL]) {
  const int lane = threadIdx.x % kWarp;
  uint32_t present = 0;
#pragma unroll
  for (int i = 0; i < VPL; ++i) {
    const int c = lane + kWarp * i;
    z[i] = -INFINITY;
    if (c < E) {
      z[i] = to_float(row[c]);
      present |= 1u << i;
    }
  }
  return present;
}

// max and sum of exp(z - max) over the row (present slots); every lane gets both.
template <int VPL>
__device__ __forceinline__ void row_softmax_stats(const float (&z)[VPL], uint32_t present, float& m, float& sum) {
  float lm = -INFINITY;
#pragma unroll
  for (int i = 0; i < VPL; ++i)
    if ((present >> i) & 1u) lm = fmaxf(lm, z[i]);
  m = warp_max(lm);
  float ls = 0.0f;
#pragma unroll
  for (int i = 0; i < VPL; ++i)
    if ((present >> i) & 1u) ls += expf(z[i] - m);
  sum = warp_sum(ls);
}

struct RouteArgs {
  int experts = 0, topk = 0, mode = kPostSoftmax;
  int groups = 0, group_topk = 0, group_size = 0, group_top = 0;  // group_top = floor(k / group_topk)
  float scaling = 1.0f;
  int warp_smem_bytes = 0;  // grouped: the row's keys (E floats) and the group flags
};

template <typename T, int VPL>
__global__ void moe_route_kernel(float* probs, int32_t* idx, const T* logits, const float* bias, int64_t rows,
                                 RouteArgs a) {
  extern __shared__ __align__(16) unsigned char route_smem[];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kRowWarps + warp;
  if (t >= rows) return;  // whole warps only
  const int E = a.experts, k = a.topk;
  const T* row = logits + t * E;
  float z[VPL], key[VPL];
  const uint32_t present = load_row<T, VPL>(row, E, z);
  float m = 0, sum = 1;
  if (a.mode == kPreSoftmax) row_softmax_stats<VPL>(z, present, m, sum);
#pragma unroll
  for (int i = 0; i < VPL; ++i) {
    const int c = lane + kWarp * i;
    if (a.mode == kPostSoftmax) key[i] = rank_value(z[i]);
    else if (a.mode == kPreSoftmax) key[i] = rank_value(expf(z[i] - m) / sum);
    else key[i] = rank_value(gated_score(gated_function(a.mode), z[i]) + (bias && c < E ? bias[c] : 0.0f));
  }
  uint32_t ok = present;
  if (a.groups > 0) {
    float* keys = reinterpret_cast<float*>(route_smem + warp * a.warp_smem_bytes);
    unsigned char* chosen = reinterpret_cast<unsigned char*>(keys + E);
#pragma unroll
    for (int i = 0; i < VPL; ++i)
      if ((present >> i) & 1u) keys[lane + kWarp * i] = key[i];
    __syncwarp();
    float gscore[VPL];
    uint32_t gok = 0;
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
      const int g = lane + kWarp * i;
      gscore[i] = -INFINITY;
      if (g < a.groups) {
        const float* gk = keys + g * a.group_size;
        float total = 0, pv = 0;
        int pc = -1;
        for (int q = 0; q < a.group_top; ++q) {  // the q-th largest key of the group
          float bv = -INFINITY;
          int bc = INT_MAX;
          for (int e = 0; e < a.group_size; ++e) {
            const float v = gk[e];
            if (pc >= 0 && !ranks_before(pv, pc, v, e)) continue;
            if (ranks_before(v, e, bv, bc)) {
              bv = v;
              bc = e;
            }
          }
          total += bv;
          pv = bv;
          pc = bc;
        }
        gscore[i] = rank_value(total);
        gok |= 1u << i;
      }
    }
    float unused_v;
    int unused_c;
    const uint32_t picked = warp_top_k<VPL>(gscore, gok, a.group_topk, unused_v, unused_c);
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
      const int g = lane + kWarp * i;
      if (g < a.groups) chosen[g] = (picked >> i) & 1u;
    }
    __syncwarp();
    ok = 0;
#pragma unroll
    for (int i = 0; i < VPL; ++i)
      if (((present >> i) & 1u) && chosen[(lane + kWarp * i) / a.group_size]) ok |= 1u << i;
  }
  float pick_v = 0;
  int pick_c = 0;
  warp_top_k<VPL>(key, ok, k, pick_v, pick_c);
  const bool mine = lane < k;
  float p = 0;
  if (a.mode == kPostSoftmax) {
    const float zj = mine ? to_float(row[pick_c]) : -INFINITY;
    const float mk = warp_max(zj);
    const float ej = mine ? expf(zj - mk) : 0.0f;
    p = ej / warp_sum(ej);
  } else if (a.mode == kPreSoftmax) {
    p = pick_v;  // the softmax value itself
  } else {
    const float sj = mine ? gated_score(gated_function(a.mode), to_float(row[pick_c])) : 0.0f;
    p = k > 1 ? sj / (warp_sum(sj) + kSigmoidNormEps) : sj;
  }
  p *= a.scaling;
  if (mine) {
    probs[t * k + lane] = to_float(from_float<T>(p));
    idx[t * k + lane] = pick_c;
  }
}

template <typename T, int VPL>
__global__ void moe_route_backward_kernel(T* dlogits, const float* dprobs, const T* logits, const int32_t* idx,
                                          const float* aux_grad, int64_t rows, RouteArgs a) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kRowWarps + warp;
  if (t >= rows) return;
  const int E = a.experts, k = a.topk;
  const T* row = logits + t * E;
  float grad[VPL];
#pragma unroll
  for (int i = 0; i < VPL; ++i) {
    const int c = lane + kWarp * i;
    grad[i] = aux_grad && c < E ? aux_grad[t * E + c] : 0.0f;
  }
  const bool mine = lane < k;
  const int id = mine ? idx[t * k + lane] : -1;
  const bool valid = id >= 0 && id < E;  // (an index outside the row contributes nothing)
  const float g = valid ? dprobs[t * k + lane] * a.scaling : 0.0f;
  const float zj = valid ? to_float(row[id]) : -INFINITY;
  float d = 0;  // d loss / d z[id] from the routing weights
  if (a.mode == kPostSoftmax) {
    const float mk = warp_max(zj);
    const float q = valid ? expf(zj - mk) : 0.0f;
    const float qn = q / warp_sum(q);
    const float dot = warp_sum(qn * g);
    d = qn * (g - dot);
  } else if (a.mode == kPreSoftmax) {
    float z[VPL];
    const uint32_t present = load_row<T, VPL>(row, E, z);
    float m, sum;
    row_softmax_stats<VPL>(z, present, m, sum);
    const float sj = valid ? expf(zj - m) / sum : 0.0f;
    const float dot = warp_sum(sj * g);
#pragma unroll
    for (int i = 0; i < VPL; ++i)
      if ((present >> i) & 1u) grad[i] -= expf(z[i] - m) / sum * dot;
    d = sj * g;
  } else {
    const MoeScoreFunction f = gated_function(a.mode);
    const float sj = valid ? gated_score(f, zj) : 0.0f;
    const float S = warp_sum(sj) + kSigmoidNormEps, dot = warp_sum(sj * g);
    const float ds = k > 1 ? g / S - dot / (S * S) : g;
    d = valid ? ds * gated_score_grad(f, zj) : 0.0f;
  }
  for (int j = 0; j < k; ++j) {  // (a select per slot keeps grad[] in registers)
    const int e = __shfl_sync(kFull, valid ? id : -1, j);
    const float dj = __shfl_sync(kFull, d, j);
#pragma unroll
    for (int i = 0; i < VPL; ++i) grad[i] += lane + kWarp * i == e ? dj : 0.0f;
  }
#pragma unroll
  for (int i = 0; i < VPL; ++i) {
    const int c = lane + kWarp * i;
    if (c < E) dlogits[t * E + c] = from_float<T>(grad[i]);
  }
}

// The aux scores s~ of the row into s (present slots); returns logsumexp(z).
template <int VPL>
__device__ __forceinline__ float aux_scores(const float (&z)[VPL], uint32_t present, MoeScoreFunction score,
                                            float (&s)[VPL]) {
  float m, sum;
  row_softmax_stats<VPL>(z, present, m, sum);
  if (score == MoeScoreFunction::softmax) {
#pragma unroll
    for (int i = 0; i < VPL; ++i) s[i] = (present >> i) & 1u ? expf(z[i] - m) / sum : 0.0f;
  } else {
    float ls = 0;
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
      s[i] = (present >> i) & 1u ? gated_score(score, z[i]) : 0.0f;
      ls += s[i];
    }
    const float total = warp_sum(ls);
#pragma unroll
    for (int i = 0; i < VPL; ++i) s[i] /= total;
  }
  return m + logf(sum);
}

// Block partials of the statistics over rows blockIdx.x * W + warp + j * gridDim.x * W.
// Shared: double sums[W][E], double lse2[W], int counts[W][E].
template <typename T, int VPL>
__global__ void moe_aux_stats_kernel(double* part_sums, int* part_counts, double* part_lse2, const T* logits,
                                     int64_t rows, int E, int k, MoeScoreFunction score) {
  extern __shared__ __align__(16) unsigned char stats_smem[];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  double* sums = reinterpret_cast<double*>(stats_smem);
  double* lse2 = sums + kRowWarps * E;
  int* counts = reinterpret_cast<int*>(lse2 + kRowWarps);
  double acc[VPL];
  int cnt[VPL];
#pragma unroll
  for (int i = 0; i < VPL; ++i) acc[i] = 0, cnt[i] = 0;
  double acc_lse2 = 0;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kRowWarps + warp; t < rows;
       t += static_cast<int64_t>(gridDim.x) * kRowWarps) {
    float z[VPL], s[VPL];
    const uint32_t present = load_row<T, VPL>(logits + t * E, E, z);
    const float lse = aux_scores<VPL>(z, present, score, s);
    acc_lse2 += static_cast<double>(lse) * lse;
    float key[VPL];
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
      acc[i] += s[i];
      key[i] = rank_value(s[i]);
    }
    float unused_v;
    int unused_c;
    const uint32_t picked = warp_top_k<VPL>(key, present, k, unused_v, unused_c);
#pragma unroll
    for (int i = 0; i < VPL; ++i) cnt[i] += (picked >> i) & 1u;
  }
#pragma unroll
  for (int i = 0; i < VPL; ++i) {
    const int c = lane + kWarp * i;
    if (c < E) {
      sums[warp * E + c] = acc[i];
      counts[warp * E + c] = cnt[i];
    }
  }
  if (lane == 0) lse2[warp] = acc_lse2;
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    double total = 0;
    int n = 0;
    for (int w = 0; w < kRowWarps; ++w) {
      total += sums[w * E + e];
      n += counts[w * E + e];
    }
    part_sums[static_cast<int64_t>(blockIdx.x) * E + e] = total;
    part_counts[static_cast<int64_t>(blockIdx.x) * E + e] = n;
  }
  if (threadIdx.x == 0) {
    double total = 0;
    for (int w = 0; w < kRowWarps; ++w) total += lse2[w];
    part_lse2[blockIdx.x] = total;
  }
}

// One warp per statistic (E score sums, E counts, the z-loss sum): its lanes add every 32nd
// block's partial in block order, then warp_sum (the same order at every call).
__global__ void moe_aux_stats_finish_kernel(float* stats, const double* part_sums, const int* part_counts,
                                            const double* part_lse2, int blocks, int E) {
  const int i = static_cast<int>((blockIdx.x * blockDim.x + threadIdx.x) / kWarp), lane = threadIdx.x % kWarp;
  if (i >= 2 * E + 1) return;
  double total = 0;
  for (int b = lane; b < blocks; b += kWarp) {
    if (i < E) total += part_sums[static_cast<int64_t>(b) * E + i];
    else if (i < 2 * E) total += part_counts[static_cast<int64_t>(b) * E + (i - E)];
    else total += part_lse2[b];
  }
  total = warp_sum(total);
  if (lane == 0) stats[i] = static_cast<float>(total);
}

template <typename T, int VPL>
__global__ void moe_aux_grad_kernel(float* aux_grad, const T* logits, const float* stats, int64_t rows, int E,
                                    MoeScoreFunction score, float aux_scale, float z_scale) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kRowWarps + warp;
  if (t >= rows) return;
  float z[VPL], grad[VPL];
  const uint32_t present = load_row<T, VPL>(logits + t * E, E, z);
  float m, sum;
  row_softmax_stats<VPL>(z, present, m, sum);
  const float lse = m + logf(sum);
#pragma unroll
  for (int i = 0; i < VPL; ++i) grad[i] = 0;
  if (aux_scale != 0) {
    float count[VPL];
#pragma unroll
    for (int i = 0; i < VPL; ++i) count[i] = (present >> i) & 1u ? stats[E + lane + kWarp * i] : 0.0f;
    if (score == MoeScoreFunction::softmax) {
      float ld = 0;
#pragma unroll
      for (int i = 0; i < VPL; ++i)
        if ((present >> i) & 1u) ld += count[i] * (expf(z[i] - m) / sum);
      const float dot = warp_sum(ld);
#pragma unroll
      for (int i = 0; i < VPL; ++i)
        if ((present >> i) & 1u) grad[i] = aux_scale * (expf(z[i] - m) / sum) * (count[i] - dot);
    } else {
      float ls = 0, ld = 0;
#pragma unroll
      for (int i = 0; i < VPL; ++i)
        if ((present >> i) & 1u) {
          const float sg = gated_score(score, z[i]);
          ls += sg;
          ld += count[i] * sg;
        }
      const float total = warp_sum(ls), dot = warp_sum(ld);
#pragma unroll
      for (int i = 0; i < VPL; ++i)
        if ((present >> i) & 1u)
          grad[i] = aux_scale * (count[i] / total - dot / (total * total)) * gated_score_grad(score, z[i]);
    }
  }
  if (z_scale != 0) {
#pragma unroll
    for (int i = 0; i < VPL; ++i)
      if ((present >> i) & 1u) grad[i] += z_scale * 2.0f * lse * (expf(z[i] - m) / sum);
  }
#pragma unroll
  for (int i = 0; i < VPL; ++i) {
    const int c = lane + kWarp * i;
    if (c < E) aux_grad[t * E + c] = grad[i];
  }
}

// One warp: sums[0] += aux_scale * sum_e stats[e] stats[E + e], sums[1] += z_scale * stats[2E].
__global__ void moe_aux_log_kernel(float* sums, const float* stats, int E, float aux_scale, float z_scale) {
  const int lane = threadIdx.x;
  double local = 0;
  for (int e = lane; e < E; e += kWarp) local += static_cast<double>(stats[e]) * stats[E + e];
  const double aux = warp_sum(local);
  if (lane == 0) {
    sums[0] += static_cast<float>(static_cast<double>(aux_scale) * aux);
    sums[1] += static_cast<float>(static_cast<double>(z_scale) * stats[2 * E]);
  }
}

// counts[e] += offsets[e + 1] - offsets[e], one thread per expert.
__global__ void moe_count_rows_kernel(double* counts, const int32_t* offsets, int E) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e < E) counts[e] += static_cast<double>(offsets[e + 1] - offsets[e]);
}

// The router's input jitter: one element per thread, grid-strided.
template <typename T>
__global__ void moe_jitter_kernel(T* out, const T* in, float eps, uint64_t key, int64_t index0, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float factor = moe_jitter_factor(key, static_cast<uint64_t>(index0 + i), eps);
    out[i] = from_float<T>(__fmul_rn(to_float(in[i]), factor));
  }
}

// ---- the permutation plan -------------------------------------------------------------------
constexpr int kPlanWarps = 4;
constexpr int kPlanScanThreads = 256;

__device__ __forceinline__ int expert_of(const int32_t* idx, int64_t p, int64_t end, int first, int E) {
  if (p >= end) return -1;
  const int e = idx[p] - first;
  return e >= 0 && e < E ? e : -1;
}

// Pass 1: hist[chunk * E + e] = the number of the chunk's pairs that go to expert e.
__global__ void plan_count_kernel(int* hist, const int32_t* idx, int64_t pairs, int64_t chunk_size, int64_t chunks,
                                  int first, int E) {
  extern __shared__ int plan_counts[];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int64_t chunk = static_cast<int64_t>(blockIdx.x) * kPlanWarps + warp;
  if (chunk >= chunks) return;
  int* count = plan_counts + warp * E;
  for (int e = lane; e < E; e += kWarp) count[e] = 0;
  __syncwarp();
  const int64_t begin = chunk * chunk_size, end = std::min(pairs, begin + chunk_size);
  for (int64_t base = begin; base < end; base += kWarp) {
    const int e = expert_of(idx, base + lane, end, first, E);
    const unsigned peers = __match_any_sync(kFull, e);
    if (e >= 0 && lane == __ffs(peers) - 1) count[e] += __popc(peers);
    __syncwarp();
  }
  for (int e = lane; e < E; e += kWarp) hist[chunk * E + e] = count[e];
}

// Pass 2 (one block per expert): hist[c * E + e] = the count of e over chunks before c; totals[e].
__global__ void plan_chunk_scan_kernel(int* hist, int* totals, int64_t chunks, int E) {
  using Scan = cub::BlockScan<int, kPlanScanThreads>;
  __shared__ typename Scan::TempStorage temp;
  const int e = blockIdx.x;
  const int64_t per = (chunks + kPlanScanThreads - 1) / kPlanScanThreads;
  const int64_t first = threadIdx.x * per, last = std::min(chunks, first + per);
  int local = 0;
  for (int64_t c = first; c < last; ++c) local += hist[c * E + e];
  int running = 0, total = 0;
  Scan(temp).ExclusiveSum(local, running, total);
  for (int64_t c = first; c < last; ++c) {
    const int n = hist[c * E + e];
    hist[c * E + e] = running;
    running += n;
  }
  if (threadIdx.x == 0) totals[e] = total;
}

// Pass 3 (one block): offsets[e] = the exclusive prefix sum of totals, offsets[E] = their sum.
__global__ void plan_offsets_kernel(int32_t* offsets, const int* totals, int E) {
  using Scan = cub::BlockScan<int, 1024>;
  __shared__ typename Scan::TempStorage temp;
  int carry = 0;
  for (int base = 0; base < E; base += 1024) {
    const int e = base + threadIdx.x;
    const int v = e < E ? totals[e] : 0;
    int excl = 0, total = 0;
    Scan(temp).ExclusiveSum(v, excl, total);
    if (e < E) offsets[e] = carry + excl;
    carry += total;
    __syncthreads();  // temp is reused by the next tile
  }
  if (threadIdx.x == 0) offsets[E] = carry;
}

// Pass 4: each chunk's pairs in order; pair p of expert e goes to offsets[e] + hist[chunk][e] +
// (the chunk's earlier pairs of e). A pair with an expert outside [first, first + E) gets slot_of = -1.
__global__ void plan_scatter_kernel(int32_t* order, int32_t* slot_of, const int* hist, const int32_t* offsets,
                                    const int32_t* idx, int64_t pairs, int64_t chunk_size, int64_t chunks, int first,
                                    int E) {
  extern __shared__ int plan_next[];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int64_t chunk = static_cast<int64_t>(blockIdx.x) * kPlanWarps + warp;
  if (chunk >= chunks) return;
  int* next = plan_next + warp * E;
  for (int e = lane; e < E; e += kWarp) next[e] = offsets[e] + hist[chunk * E + e];
  __syncwarp();
  const int64_t begin = chunk * chunk_size, end = std::min(pairs, begin + chunk_size);
  const unsigned lower = (1u << lane) - 1u;
  for (int64_t base = begin; base < end; base += kWarp) {
    const int64_t p = base + lane;
    const int e = expert_of(idx, p, end, first, E);
    const unsigned peers = __match_any_sync(kFull, e);
    const int pos = e >= 0 ? next[e] + __popc(peers & lower) : -1;
    __syncwarp();
    if (e >= 0 && lane == __ffs(peers) - 1) next[e] += __popc(peers);
    __syncwarp();
    if (p < end) {
      slot_of[p] = pos;
      if (pos >= 0) order[pos] = static_cast<int32_t>(p);
    }
  }
}

// ---- row ops ---------------------------------------------------------------------------------
constexpr int kRowOpThreads = 256;

// Threads per row: a power of two from 1 to 32 covering `units` vectors.
int team_for(int64_t units) {
  int tpr = 1;
  while (tpr < kWarp && tpr < units) tpr *= 2;
  return tpr;
}

struct RowTeams {
  int tpr = 1, rows_per_block = 1;
  unsigned grid = 1;
};
RowTeams row_teams(int64_t rows, int64_t units, int num_sms) {
  RowTeams r;
  r.tpr = team_for(units);
  r.rows_per_block = kRowOpThreads / r.tpr;
  r.grid = grid_for(rows, r.rows_per_block, num_sms * 16LL);
  return r;
}

// out[r] = x[index[r] / k] in units of U (rows of `units` U each); an index outside x zeroes the row.
template <typename U>
__global__ void gather_rows_kernel(U* out, const U* x, const int32_t* index, int64_t rows, int64_t x_rows,
                                   int64_t units, int k, int tpr) {
  const int team = threadIdx.x / tpr, member = threadIdx.x % tpr;
  const int rows_per_block = blockDim.x / tpr;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * rows_per_block + team; r < rows;
       r += static_cast<int64_t>(gridDim.x) * rows_per_block) {
    const int32_t id = index[r];
    const int64_t src = id / k;
    U* o = out + r * units;
    if (id < 0 || src >= x_rows) {
      for (int64_t u = member; u < units; u += tpr) o[u] = U{};
      continue;
    }
    const U* s = x + src * units;
    for (int64_t u = member; u < units; u += tpr) o[u] = s[u];
  }
}

template <typename T, int VEC>
__global__ void combine_kernel(T* out, const T* y, const int32_t* slot_of, int64_t rows, int64_t y_rows, int64_t cols,
                               int k, bool accumulate, int tpr) {
  const int team = threadIdx.x / tpr, member = threadIdx.x % tpr;
  const int rows_per_block = blockDim.x / tpr;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * rows_per_block + team; t < rows;
       t += static_cast<int64_t>(gridDim.x) * rows_per_block) {
    const int32_t* slots = slot_of + t * k;
    T* o = out + t * cols;
    for (int64_t c = static_cast<int64_t>(member) * VEC; c < cols; c += static_cast<int64_t>(tpr) * VEC) {
      Floats<VEC> acc;
#pragma unroll
      for (int v = 0; v < VEC; ++v) acc.v[v] = 0.0f;
      for (int j = 0; j < k; ++j) {
        const int32_t s = slots[j];
        if (s < 0 || s >= y_rows) continue;
        const Floats<VEC> yv = load_vec<VEC>(y + s * cols + c);
#pragma unroll
        for (int v = 0; v < VEC; ++v) acc.v[v] += yv.v[v];
      }
      if (accumulate) {
        const Floats<VEC> ov = load_vec<VEC>(o + c);
#pragma unroll
        for (int v = 0; v < VEC; ++v) acc.v[v] = ov.v[v] + acc.v[v];
      }
      store_vec<VEC>(o + c, acc);
    }
  }
}

// out = x * p[row] (out may be x). Backward (dx given): dp[row] = sum dout * x (team sum in a fixed
// order), dx = dout * p (dx may be dout: each element is read before the same thread writes it).
template <typename T, int VEC>
__global__ void scale_rows_kernel(T* out, const T* x, const float* p, int64_t rows, int64_t cols, int tpr) {
  const int team = threadIdx.x / tpr, member = threadIdx.x % tpr;
  const int rows_per_block = blockDim.x / tpr;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * rows_per_block + team; r < rows;
       r += static_cast<int64_t>(gridDim.x) * rows_per_block) {
    const float w = p[r];
    for (int64_t c = static_cast<int64_t>(member) * VEC; c < cols; c += static_cast<int64_t>(tpr) * VEC) {
      Floats<VEC> v = load_vec<VEC>(x + r * cols + c);
#pragma unroll
      for (int j = 0; j < VEC; ++j) v.v[j] *= w;
      store_vec<VEC>(out + r * cols + c, v);
    }
  }
}

// The backward row ops' loop: rows in teams of tpr threads; dot(r, member) returns this thread's
// share of row r's sum, and the team's sum (xor shuffles, a fixed order) goes to dp[r]. Every lane
// runs the same number of iterations (the team sum shuffles across the warp).
template <typename Dot>
__device__ __forceinline__ void row_team_sums(float* dp, int64_t rows, int tpr, Dot&& dot) {
  const int team = threadIdx.x / tpr, member = threadIdx.x % tpr;
  const int rows_per_block = blockDim.x / tpr;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * rows_per_block; base < rows;
       base += static_cast<int64_t>(gridDim.x) * rows_per_block) {
    const int64_t r = base + team;
    const bool active = r < rows;
    float sum = active ? dot(r, member) : 0.0f;
    for (int o = tpr / 2; o > 0; o /= 2) sum += __shfl_xor_sync(kFull, sum, o);
    if (active && member == 0) dp[r] = sum;
  }
}

template <typename T, int VEC>
__global__ void scale_rows_backward_kernel(T* dx, float* dp, const T* dout, const T* x, const float* p, int64_t rows,
                                           int64_t cols, int tpr) {
  row_team_sums(dp, rows, tpr, [&](int64_t r, int member) {
    float dot = 0.0f;
    const float w = p[r];
    for (int64_t c = static_cast<int64_t>(member) * VEC; c < cols; c += static_cast<int64_t>(tpr) * VEC) {
      Floats<VEC> d = load_vec<VEC>(dout + r * cols + c);
      const Floats<VEC> xv = load_vec<VEC>(x + r * cols + c);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        dot += d.v[j] * xv.v[j];
        d.v[j] *= w;
      }
      store_vec<VEC>(dx + r * cols + c, d);
    }
    return dot;
  });
}

// The SwiGLU experts' activation and routing weight (Backend::moe_swiglu_*), in[r] = [gate | up]
// (2f wide). Each value is rounded where the composed ops store it (swiglu's output, d act), and
// the rows split into the teams of scale_rows_backward_kernel (the same row_teams, the same
// vectors), so that dp sums the same products in the same order: the composed ops' bits.
template <typename T>
__device__ __forceinline__ float stored(float v) { return to_float(from_float<T>(v)); }

template <typename T, int VEC>
__global__ void swiglu_scale_kernel(T* out, const T* in, const float* p, int64_t rows, int64_t f, int tpr, Glu q) {
  const int team = threadIdx.x / tpr, member = threadIdx.x % tpr;
  const int rows_per_block = blockDim.x / tpr;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * rows_per_block + team; r < rows;
       r += static_cast<int64_t>(gridDim.x) * rows_per_block) {
    const float w = p[r];
    const T* row = in + r * 2 * f;
    for (int64_t c = static_cast<int64_t>(member) * VEC; c < f; c += static_cast<int64_t>(tpr) * VEC) {
      const Floats<VEC> gate = load_vec<VEC>(row + c), up = load_vec<VEC>(row + f + c);
      Floats<VEC> y;
#pragma unroll
      for (int j = 0; j < VEC; ++j) y.v[j] = stored<T>(glu_value(q, gate.v[j], up.v[j])) * w;
      store_vec<VEC>(out + r * f + c, y);
    }
  }
}

// din may be in (each element's gate and up are read before the same thread writes them).
template <typename T, int VEC>
__global__ void swiglu_scale_backward_kernel(T* din, T* act, float* dp, const T* dout, const T* in, const float* p,
                                             int64_t rows, int64_t f, int tpr, Glu q) {
  row_team_sums(dp, rows, tpr, [&](int64_t r, int member) {
    float dot = 0.0f;
    const float w = p[r];
    const T* row = in + r * 2 * f;
    T* drow = din + r * 2 * f;
    for (int64_t c = static_cast<int64_t>(member) * VEC; c < f; c += static_cast<int64_t>(tpr) * VEC) {
      const Floats<VEC> gate = load_vec<VEC>(row + c), up = load_vec<VEC>(row + f + c);
      const Floats<VEC> d = load_vec<VEC>(dout + r * f + c);
      Floats<VEC> y, dg, du;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float a = stored<T>(glu_value(q, gate.v[j], up.v[j]));
        dot += d.v[j] * a;
        glu_grad(q, gate.v[j], up.v[j], stored<T>(d.v[j] * w), dg.v[j], du.v[j]);
        y.v[j] = a * w;
      }
      store_vec<VEC>(drow + c, dg);
      store_vec<VEC>(drow + f + c, du);
      store_vec<VEC>(act + r * f + c, y);
    }
    return dot;
  });
}


// ---- the experts' linear biases ------------------------------------------------------------
// Rows [0, rows) of a grouped op; a row's expert from the device offsets (binary search: the last
// e with offsets[e] <= r; -1 past offsets[E]), or `fixed` (>= 0: every row is that expert's, the
// launch covering only its rows under host offsets).
__device__ __forceinline__ int bias_expert_of(const int32_t* offs, int E, int fixed, int64_t r) {
  if (fixed >= 0) return fixed;
  if (r >= offs[E]) return -1;
  int lo = 0, hi = E - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (offs[mid] <= r) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// y[r, :] += s_r * bias[e(r), :] (one fused multiply-add, rounded once): rows grid-strided over
// blocks, columns over the block's threads, V consecutive columns (16 bytes) per access where y's
// rows and the bias are 16-byte aligned (V = 1 otherwise).
template <typename T, int V>
__global__ void grouped_bias_forward_kernel(T* y, const T* bias, const float* p, const int32_t* offs, int E, int fixed,
                                            int64_t rows, int64_t n) {
  static_assert(V == 1 || V * sizeof(T) == 16, "16-byte accesses");
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int e = bias_expert_of(offs, E, fixed, r);
    if (e < 0) continue;
    const float s = p ? p[r] : 1.0f;
    T* yr = y + r * n;
    const T* b = bias + static_cast<int64_t>(e) * n;
    for (int64_t c = static_cast<int64_t>(threadIdx.x) * V; c < n; c += static_cast<int64_t>(blockDim.x) * V) {
      if constexpr (V == 1) {
        yr[c] = from_float<T>(__fmaf_rn(s, to_float(b[c]), to_float(yr[c])));
      } else {
        union Pack {
          int4 raw;
          T v[V];
        } yv, bv;
        yv.raw = *reinterpret_cast<const int4*>(yr + c);
        bv.raw = __ldg(reinterpret_cast<const int4*>(b + c));
#pragma unroll
        for (int i = 0; i < V; ++i) yv.v[i] = from_float<T>(__fmaf_rn(s, to_float(bv.v[i]), to_float(yv.v[i])));
        *reinterpret_cast<int4*>(yr + c) = yv.raw;
      }
    }
  }
}

// dbias[e, c] (+)= sum over e's rows of s_r * dy[r, c], in two passes so that many blocks share an
// expert's rows (a hot expert may hold them all): each expert's rows are cut into `chunks` runs of
// consecutive rows (run k: [r0 + len k / chunks, r0 + len (k + 1) / chunks)); block (column block,
// expert, run) adds its run's rows in ascending order, a column per thread, into out[e, k, c]; then
// each column's runs are added in order (run 0 first) onto the old value. Fixed orders: the same
// bits from run to run for a given run count. With one run the first pass writes dbias itself
// (O = G, accumulate as asked); otherwise it writes float partials (O = float, no accumulate).
// `fixed` >= 0: one expert's launch under host offsets, its rows [begin, end).
template <typename T, typename O>
__global__ void grouped_bias_grad_rows_kernel(O* out, const T* dy, const float* p, const int32_t* offs, int fixed,
                                              int64_t begin, int64_t end, int64_t n, int chunks, bool accumulate) {
  const int e = fixed >= 0 ? fixed : static_cast<int>(blockIdx.y), k = static_cast<int>(blockIdx.z);
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= n) return;
  const int64_t r0 = fixed >= 0 ? begin : offs[e], len = (fixed >= 0 ? end : offs[e + 1]) - r0;
  const int64_t a = r0 + len * k / chunks, b = r0 + len * (k + 1) / chunks;
  float sum = 0.0f;
  for (int64_t r = a; r < b; ++r) sum += (p ? p[r] : 1.0f) * to_float(dy[r * n + c]);
  O* d = out + (static_cast<int64_t>(e) * chunks + k) * n + c;
  *d = from_float<O>(accumulate ? to_float(*d) + sum : sum);
}

template <typename G>
__global__ void grouped_bias_grad_finish_kernel(G* dbias, const float* partial, int64_t n, int chunks,
                                                bool accumulate) {
  const int e = static_cast<int>(blockIdx.y);
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= n) return;
  const float* part = partial + static_cast<int64_t>(e) * chunks * n + c;
  float sum = 0.0f;
  for (int k = 0; k < chunks; ++k) sum += part[static_cast<int64_t>(k) * n];
  G* d = dbias + static_cast<int64_t>(e) * n + c;
  *d = from_float<G>(accumulate ? to_float(*d) + sum : sum);
}

// dp[r] += sum_c dy[r, c] * bias[e(r), c]: a warp per row.
template <typename T>
__global__ void grouped_bias_dp_kernel(float* dp, const T* dy, const T* bias, const int32_t* offs, int E, int fixed,
                                       int64_t row0, int64_t rows, int64_t n) {
  const int lane = threadIdx.x & 31, warps = blockDim.x / 32;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * warps + threadIdx.x / 32; i < rows;
       i += static_cast<int64_t>(gridDim.x) * warps) {
    const int64_t r = row0 + i;
    const int e = bias_expert_of(offs, E, fixed, r);
    if (e < 0) continue;
    float dot = 0.0f;
    for (int64_t c = lane; c < n; c += 32) dot += to_float(dy[r * n + c]) * to_float(bias[static_cast<int64_t>(e) * n + c]);
    for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(kFull, dot, o);
    if (lane == 0) dp[r] += dot;
  }
}

// ---- host side ---------------------------------------------------------------------------------
void check_i32(const Tensor& t, int64_t n, const char* op, const char* what) {
  MT_CHECK(t.dtype == DType::i32 && t.numel() == n, "{}: {} must be int32 with {} elements, got {} {}", op, what, n,
           dtype_name(t.dtype), t.shape_string());
}
void check_f32(const Tensor& t, int64_t n, const char* op, const char* what) {
  MT_CHECK(t.dtype == DType::f32 && t.numel() == n, "{}: {} must be float32 with {} elements, got {} {}", op, what,
           n, dtype_name(t.dtype), t.shape_string());
}

// The CUDA limits of the routing kernels (one warp per row) on top of the rule's own checks.
void check_route_limits(const MoeRouting& r, int64_t cols, int64_t rows, const char* op) {
  check_moe_routing(r, cols, op);
  if (r.experts > kMaxExperts)
    fail("{}: {} experts; the CUDA router takes at most {} (--num-experts)", op, r.experts, kMaxExperts);
  if (r.topk > kMaxTopk)
    fail("{}: top-k {}; the CUDA router takes at most {} (--moe-router-topk)", op, r.topk, kMaxTopk);
  MT_CHECK(rows / kRowWarps < (int64_t{1} << 31) - 1, "{}: too many rows ({})", op, rows);
}

RouteArgs route_args(const MoeRouting& r) {
  RouteArgs a;
  a.experts = r.experts;
  a.topk = r.topk;
  a.mode = r.score == MoeScoreFunction::sigmoid        ? kSigmoid
           : r.score == MoeScoreFunction::sqrtsoftplus ? kSqrtSoftplus
           : r.pre_softmax                             ? kPreSoftmax
                                                       : kPostSoftmax;
  a.scaling = r.scaling != 0 ? r.scaling : 1.0f;
  if (moe_grouped(r)) {
    a.groups = r.num_groups;
    a.group_topk = r.group_topk;
    a.group_size = r.experts / r.num_groups;
    a.group_top = r.topk / r.group_topk;
    a.warp_smem_bytes = (r.experts * 4 + r.num_groups + 15) / 16 * 16;
  }
  return a;
}

unsigned row_blocks(int64_t rows) {
  return static_cast<unsigned>(std::max<int64_t>(1, (rows + kRowWarps - 1) / kRowWarps));
}

// Calls f(std::integral_constant<int, VPL>) with the values per lane for E experts.
template <typename F>
void dispatch_vpl(int E, F&& f) {
  if (E <= 32) f(std::integral_constant<int, 1>{});
  else if (E <= 64) f(std::integral_constant<int, 2>{});
  else if (E <= 128) f(std::integral_constant<int, 4>{});
  else if (E <= 256) f(std::integral_constant<int, 8>{});
  else f(std::integral_constant<int, 16>{});
}

// The vector width for rows of `cols` elements of T at these pointers: 16 bytes, or 1 element.
template <typename T>
bool vectorizable(int64_t cols, std::initializer_list<const void*> ptrs) {
  constexpr int kVec = 16 / sizeof(T);
  if (cols % kVec != 0) return false;
  for (const void* p : ptrs)
    if (p && !aligned16(p)) return false;
  return true;
}

// The row ops' launch: launch(width, teams) with width std::integral_constant<int, 16 bytes of T>
// where `vec` (vectorizable), else of 1, and the row teams for rows of cols / width vectors.
template <typename T, typename F>
void launch_rows(const KernelContext& ctx, int64_t rows, int64_t cols, bool vec, F&& launch) {
  constexpr int kVec = 16 / sizeof(T);
  if (vec) launch(std::integral_constant<int, kVec>{}, row_teams(rows, cols / kVec, ctx.num_sms));
  else launch(std::integral_constant<int, 1>{}, row_teams(rows, cols, ctx.num_sms));
}

void check_swiglu_rows(const Tensor& in, const Tensor& rows_f, const char* op, const char* what) {
  MT_CHECK(in.cols() % 2 == 0 && rows_f.dtype == in.dtype && rows_f.numel() == in.numel() / 2,
           "{}: {} {} {} for in {} {} (in is [R, 2f] = [gate | up], {} [R, f])", op, what, dtype_name(rows_f.dtype),
           rows_f.shape_string(), dtype_name(in.dtype), in.shape_string(), what);
}

}  // namespace

void moe_route(const KernelContext& ctx, Tensor probs, Tensor idx, Tensor logits, Tensor expert_bias,
               const MoeRouting& r) {
  const char* op = "moe_route";
  const int64_t N = logits.rows();
  check_route_limits(r, logits.cols(), N, op);
  check_f32(probs, N * r.topk, op, "probs");
  check_i32(idx, N * r.topk, op, "idx");
  if (!expert_bias.empty()) check_f32(expert_bias, r.experts, op, "expert_bias");
  if (N == 0) return;
  const RouteArgs a = route_args(r);
  const size_t smem = static_cast<size_t>(a.warp_smem_bytes) * kRowWarps;
  MT_DISPATCH_FLOAT(logits.dtype, T, op, {
    dispatch_vpl(r.experts, [&](auto vpl) {
      moe_route_kernel<T, decltype(vpl)::value><<<row_blocks(N), kRowWarps * kWarp, smem, ctx.stream>>>(
          probs.ptr<float>(), idx.ptr<int32_t>(), logits.ptr<const T>(),
          expert_bias.empty() ? nullptr : expert_bias.ptr<const float>(), N, a);
    });
  });
  MT_CUDA_CHECK_LAUNCH();
}

void moe_route_backward(const KernelContext& ctx, Tensor dlogits, Tensor dprobs, Tensor logits, Tensor idx,
                        Tensor aux_grad, const MoeRouting& r) {
  const char* op = "moe_route_backward";
  const int64_t N = logits.rows();
  check_route_limits(r, logits.cols(), N, op);
  MT_CHECK(dlogits.dtype == logits.dtype && dlogits.numel() == logits.numel(), "{}: dlogits {} {} for logits {} {}",
           op, dtype_name(dlogits.dtype), dlogits.shape_string(), dtype_name(logits.dtype), logits.shape_string());
  check_f32(dprobs, N * r.topk, op, "dprobs");
  check_i32(idx, N * r.topk, op, "idx");
  if (!aux_grad.empty()) check_f32(aux_grad, N * r.experts, op, "aux_grad");
  if (N == 0) return;
  const RouteArgs a = route_args(r);
  MT_DISPATCH_FLOAT(logits.dtype, T, op, {
    dispatch_vpl(r.experts, [&](auto vpl) {
      moe_route_backward_kernel<T, decltype(vpl)::value><<<row_blocks(N), kRowWarps * kWarp, 0, ctx.stream>>>(
          dlogits.ptr<T>(), dprobs.ptr<const float>(), logits.ptr<const T>(), idx.ptr<const int32_t>(),
          aux_grad.empty() ? nullptr : aux_grad.ptr<const float>(), N, a);
    });
  });
  MT_CUDA_CHECK_LAUNCH();
}

void moe_aux_stats(const KernelContext& ctx, Tensor stats, Tensor logits, const MoeRouting& r) {
  const char* op = "moe_aux_stats";
  const int64_t N = logits.rows();
  check_route_limits(r, logits.cols(), N, op);
  const int E = r.experts;
  check_f32(stats, 2 * E + 1, op, "stats");
  // Up to 1024 blocks (fewer if the scratch cannot hold their partials): a function of N and E.
  const size_t per_block = static_cast<size_t>(E) * (sizeof(double) + sizeof(int)) + sizeof(double) + 3 * 256;
  const int64_t fit = static_cast<int64_t>(ctx.scratch->remaining() / per_block);
  MT_CHECK(fit >= 1, "{}: scratch too small for one block's partial sums", op);
  const int64_t row_groups = std::max<int64_t>(1, (N + kRowWarps - 1) / kRowWarps);
  const int blocks = static_cast<int>(std::min<int64_t>({int64_t{1024}, fit, row_groups}));
  double* part_sums = ctx.scratch->take_array<double>(static_cast<size_t>(blocks) * E, "moe_aux_stats partial sums");
  int* part_counts = ctx.scratch->take_array<int>(static_cast<size_t>(blocks) * E, "moe_aux_stats partial counts");
  double* part_lse2 = ctx.scratch->take_array<double>(static_cast<size_t>(blocks), "moe_aux_stats partial z-loss");
  const size_t smem = static_cast<size_t>(kRowWarps) * E * (sizeof(double) + sizeof(int)) + kRowWarps * sizeof(double);
  MT_DISPATCH_FLOAT(logits.dtype, T, op, {
    dispatch_vpl(E, [&](auto vpl) {
      constexpr int kVpl = decltype(vpl)::value;
      moe_aux_stats_kernel<T, kVpl><<<static_cast<unsigned>(blocks), kRowWarps * kWarp, smem, ctx.stream>>>(
          part_sums, part_counts, part_lse2, logits.ptr<const T>(), N, E, r.topk,
          r.score);
    });
  });
  MT_CUDA_CHECK_LAUNCH();
  const int finish_warps = 2 * E + 1, warps_per_block = 8;
  moe_aux_stats_finish_kernel<<<(finish_warps + warps_per_block - 1) / warps_per_block, warps_per_block * kWarp, 0,
                                ctx.stream>>>(
      stats.ptr<float>(), part_sums, part_counts, part_lse2, blocks, E);
  MT_CUDA_CHECK_LAUNCH();
}

void moe_aux_grad(const KernelContext& ctx, Tensor aux_grad, Tensor logits, Tensor stats, float aux_scale,
                  float z_scale, const MoeRouting& r) {
  const char* op = "moe_aux_grad";
  const int64_t N = logits.rows();
  check_route_limits(r, logits.cols(), N, op);
  const int E = r.experts;
  check_f32(aux_grad, N * E, op, "aux_grad");
  check_f32(stats, 2 * E + 1, op, "stats");
  if (N == 0) return;
  MT_DISPATCH_FLOAT(logits.dtype, T, op, {
    dispatch_vpl(E, [&](auto vpl) {
      moe_aux_grad_kernel<T, decltype(vpl)::value><<<row_blocks(N), kRowWarps * kWarp, 0, ctx.stream>>>(
          aux_grad.ptr<float>(), logits.ptr<const T>(), stats.ptr<const float>(), N, E,
          r.score, aux_scale, z_scale);
    });
  });
  MT_CUDA_CHECK_LAUNCH();
}

void moe_aux_log(const KernelContext& ctx, Tensor sums, Tensor stats, float aux_scale, float z_scale) {
  const char* op = "moe_aux_log";
  const int64_t E = (stats.numel() - 1) / 2;
  MT_CHECK(E >= 1 && stats.numel() == 2 * E + 1 && stats.dtype == DType::f32,
           "{}: stats {} {} is not float32 [2E + 1]", op, dtype_name(stats.dtype), stats.shape_string());
  check_f32(sums, 2, op, "sums");
  moe_aux_log_kernel<<<1, kWarp, 0, ctx.stream>>>(sums.ptr<float>(), stats.ptr<const float>(), static_cast<int>(E),
                                                  aux_scale, z_scale);
  MT_CUDA_CHECK_LAUNCH();
}

void moe_count_rows(const KernelContext& ctx, Tensor counts, Tensor offsets) {
  const char* op = "moe_count_rows";
  const int64_t E = counts.numel();
  MT_CHECK(counts.dtype == DType::f64 && E >= 1 && E < (int64_t{1} << 30), "{}: counts must be float64 [E], got {} {}",
           op, dtype_name(counts.dtype), counts.shape_string());
  check_i32(offsets, E + 1, op, "offsets");
  constexpr int kThreads = 256;
  moe_count_rows_kernel<<<static_cast<unsigned>((E + kThreads - 1) / kThreads), kThreads, 0, ctx.stream>>>(
      counts.ptr<double>(), offsets.ptr<const int32_t>(), static_cast<int>(E));
  MT_CUDA_CHECK_LAUNCH();
}

void moe_jitter(const KernelContext& ctx, Tensor out, Tensor in, float eps, uint64_t key, int64_t index0) {
  const char* op = "moe_jitter";
  MT_CHECK(out.dtype == in.dtype && out.numel() == in.numel() && index0 >= 0,
           "{}: out {} [{}] and in {} [{}] must be one dtype and size (index0 {})", op, dtype_name(out.dtype),
           out.shape_string(), dtype_name(in.dtype), in.shape_string(), index0);
  const int64_t n = out.numel();
  if (n == 0) return;
  constexpr int kThreads = 256;
  const auto blocks = static_cast<unsigned>(std::min<int64_t>((n + kThreads - 1) / kThreads, int64_t{ctx.num_sms} * 16));
  MT_DISPATCH_FLOAT(out.dtype, T, op, {
    moe_jitter_kernel<T><<<blocks, kThreads, 0, ctx.stream>>>(out.ptr<T>(), in.ptr<const T>(), eps, key, index0, n);
  });
  MT_CUDA_CHECK_LAUNCH();
}

void moe_permute_plan(const KernelContext& ctx, Tensor order, Tensor slot_of, Tensor offsets, Tensor idx,
                      int first_expert, int num_experts) {
  const char* op = "moe_permute_plan";
  const int64_t M = idx.numel();
  const int E = num_experts;
  MT_CHECK(E >= 1, "{}: {} experts", op, E);
  check_i32(idx, M, op, "idx");
  check_i32(order, M, op, "order");
  check_i32(slot_of, M, op, "slot_of");
  check_i32(offsets, int64_t{E} + 1, op, "offsets");
  MT_CHECK(M < (int64_t{1} << 31), "{}: {} (row, slot) pairs do not fit int32", op, M);
  // Per-warp expert counters in shared memory: at most 48 KiB per block.
  constexpr int kMaxPlanExperts = 48 * 1024 / (kPlanWarps * static_cast<int>(sizeof(int)));
  if (E > kMaxPlanExperts)
    fail("{}: {} experts; the CUDA permutation takes at most {} (--num-experts)", op, E, kMaxPlanExperts);
  if (M == 0) {
    MT_CUDA_CHECK(cudaMemsetAsync(offsets.data, 0, offsets.nbytes(), ctx.stream));
    return;
  }
  // Chunks of at least 1024 pairs, about 8 warps' worth per SM (fewer, longer chunks where the
  // per-chunk counts would not fit the scratch).
  const size_t room = ctx.scratch->remaining() - std::min<size_t>(ctx.scratch->remaining(), 2 * 256 + E * sizeof(int));
  const int64_t per_warp = (M + ctx.num_sms * 8LL - 1) / (ctx.num_sms * 8LL);
  int64_t chunk_size = std::max<int64_t>(1024, (per_warp + kWarp - 1) / kWarp * kWarp);
  int64_t chunks = (M + chunk_size - 1) / chunk_size;
  while (static_cast<size_t>(chunks) * E * sizeof(int) > room) {
    chunk_size *= 2;
    chunks = (M + chunk_size - 1) / chunk_size;
    MT_CHECK(chunk_size <= (int64_t{1} << 30), "{}: scratch too small for the per-expert counts of {} experts", op, E);
  }
  int* hist = ctx.scratch->take_array<int>(static_cast<size_t>(chunks) * E, "moe_permute_plan chunk counts");
  int* totals = ctx.scratch->take_array<int>(static_cast<size_t>(E), "moe_permute_plan expert totals");
  const unsigned chunk_blocks = static_cast<unsigned>((chunks + kPlanWarps - 1) / kPlanWarps);
  const size_t smem = static_cast<size_t>(kPlanWarps) * E * sizeof(int);
  plan_count_kernel<<<chunk_blocks, kPlanWarps * kWarp, smem, ctx.stream>>>(hist, idx.ptr<const int32_t>(), M,
                                                                           chunk_size, chunks, first_expert, E);
  MT_CUDA_CHECK_LAUNCH();
  plan_chunk_scan_kernel<<<static_cast<unsigned>(E), kPlanScanThreads, 0, ctx.stream>>>(hist, totals, chunks, E);
  MT_CUDA_CHECK_LAUNCH();
  plan_offsets_kernel<<<1, 1024, 0, ctx.stream>>>(offsets.ptr<int32_t>(), totals, E);
  MT_CUDA_CHECK_LAUNCH();
  plan_scatter_kernel<<<chunk_blocks, kPlanWarps * kWarp, smem, ctx.stream>>>(
      order.ptr<int32_t>(), slot_of.ptr<int32_t>(), hist, offsets.ptr<const int32_t>(), idx.ptr<const int32_t>(), M,
      chunk_size, chunks, first_expert, E);
  MT_CUDA_CHECK_LAUNCH();
}

void moe_gather_rows(const KernelContext& ctx, Tensor out, Tensor x, Tensor index, int k) {
  const char* op = "moe_gather_rows";
  const int64_t R = out.rows(), C = out.cols();
  MT_CHECK(k >= 1, "{}: k = {}", op, k);
  MT_CHECK(x.cols() == C && x.dtype == out.dtype, "{}: x {} {} for out {} {}", op, dtype_name(x.dtype),
           x.shape_string(), dtype_name(out.dtype), out.shape_string());
  check_i32(index, R, op, "index");
  const int64_t row_bytes = C * static_cast<int64_t>(dtype_size(out.dtype));
  if (R == 0 || row_bytes == 0) return;
  auto launch = [&](auto unit) {
    using U = decltype(unit);
    const int64_t units = row_bytes / static_cast<int64_t>(sizeof(U));
    const RowTeams teams = row_teams(R, units, ctx.num_sms);
    gather_rows_kernel<U><<<teams.grid, kRowOpThreads, 0, ctx.stream>>>(
        static_cast<U*>(out.data), static_cast<const U*>(x.data), index.ptr<const int32_t>(), R, x.rows(), units, k,
        teams.tpr);
  };
  const auto fits = [&](size_t unit) {
    return row_bytes % static_cast<int64_t>(unit) == 0 && reinterpret_cast<uintptr_t>(out.data) % unit == 0 &&
           reinterpret_cast<uintptr_t>(x.data) % unit == 0;
  };
  if (fits(16)) launch(int4{});
  else if (fits(8)) launch(int2{});
  else if (fits(4)) launch(int{});
  else if (fits(2)) launch(short{});
  else launch(char{});
  MT_CUDA_CHECK_LAUNCH();
}

void moe_combine(const KernelContext& ctx, Tensor out, Tensor y, Tensor slot_of, int k, bool accumulate) {
  const char* op = "moe_combine";
  const int64_t N = out.rows(), C = out.cols();
  MT_CHECK(k >= 1, "{}: k = {}", op, k);
  MT_CHECK(y.cols() == C && y.dtype == out.dtype, "{}: y {} {} for out {} {}", op, dtype_name(y.dtype),
           y.shape_string(), dtype_name(out.dtype), out.shape_string());
  check_i32(slot_of, N * k, op, "slot_of");
  if (N == 0 || C == 0) return;
  MT_DISPATCH_FLOAT(out.dtype, T, op, {
    launch_rows<T>(ctx, N, C, vectorizable<T>(C, {out.data, y.data}), [&](auto width, const RowTeams& teams) {
      combine_kernel<T, width><<<teams.grid, kRowOpThreads, 0, ctx.stream>>>(
          out.ptr<T>(), y.ptr<const T>(), slot_of.ptr<const int32_t>(), N, y.rows(), C, k, accumulate, teams.tpr);
    });
  });
  MT_CUDA_CHECK_LAUNCH();
}

void moe_scale_rows(const KernelContext& ctx, Tensor out, Tensor x, Tensor p) {
  const char* op = "moe_scale_rows";
  const int64_t R = x.rows(), C = x.cols();
  MT_CHECK(out.dtype == x.dtype && out.numel() == x.numel(), "{}: out {} {} for x {} {}", op, dtype_name(out.dtype),
           out.shape_string(), dtype_name(x.dtype), x.shape_string());
  check_f32(p, R, op, "p");
  if (R == 0 || C == 0) return;
  MT_DISPATCH_FLOAT(x.dtype, T, op, {
    launch_rows<T>(ctx, R, C, vectorizable<T>(C, {out.data, x.data}), [&](auto width, const RowTeams& teams) {
      scale_rows_kernel<T, width><<<teams.grid, kRowOpThreads, 0, ctx.stream>>>(out.ptr<T>(), x.ptr<const T>(),
                                                                                 p.ptr<const float>(), R, C, teams.tpr);
    });
  });
  MT_CUDA_CHECK_LAUNCH();
}

void moe_scale_rows_backward(const KernelContext& ctx, Tensor dx, Tensor dp, Tensor dout, Tensor x, Tensor p) {
  const char* op = "moe_scale_rows_backward";
  const int64_t R = x.rows(), C = x.cols();
  MT_CHECK(dout.dtype == x.dtype && dout.numel() == x.numel() && dx.dtype == x.dtype && dx.numel() == x.numel(),
           "{}: dx {} {} and dout {} {} for x {} {}", op, dtype_name(dx.dtype), dx.shape_string(),
           dtype_name(dout.dtype), dout.shape_string(), dtype_name(x.dtype), x.shape_string());
  check_f32(p, R, op, "p");
  check_f32(dp, R, op, "dp");
  if (R == 0) return;
  if (C == 0) {
    MT_CUDA_CHECK(cudaMemsetAsync(dp.data, 0, dp.nbytes(), ctx.stream));
    return;
  }
  MT_DISPATCH_FLOAT(x.dtype, T, op, {
    launch_rows<T>(ctx, R, C, vectorizable<T>(C, {dx.data, dout.data, x.data}), [&](auto width, const RowTeams& teams) {
      scale_rows_backward_kernel<T, width><<<teams.grid, kRowOpThreads, 0, ctx.stream>>>(
          dx.ptr<T>(), dp.ptr<float>(), dout.ptr<const T>(), x.ptr<const T>(), p.ptr<const float>(), R, C, teams.tpr);
    });
  });
  MT_CUDA_CHECK_LAUNCH();
}

void moe_swiglu_forward(const KernelContext& ctx, Tensor out, Tensor in, Tensor p, const Glu& q) {
  const char* op = "moe_swiglu_forward";
  const int64_t R = in.rows(), f = in.cols() / 2;
  check_swiglu_rows(in, out, op, "out");
  check_f32(p, R, op, "p");
  if (R == 0 || f == 0) return;
  MT_DISPATCH_FLOAT(in.dtype, T, op, {
    launch_rows<T>(ctx, R, f, vectorizable<T>(f, {out.data, in.data}), [&](auto width, const RowTeams& teams) {
      swiglu_scale_kernel<T, width><<<teams.grid, kRowOpThreads, 0, ctx.stream>>>(out.ptr<T>(), in.ptr<const T>(),
                                                                                   p.ptr<const float>(), R, f, teams.tpr,
                                                                                   q);
    });
  });
  MT_CUDA_CHECK_LAUNCH();
}

void moe_swiglu_backward(const KernelContext& ctx, Tensor din, Tensor act, Tensor dp, Tensor dout, Tensor in,
                         Tensor p, const Glu& q) {
  const char* op = "moe_swiglu_backward";
  const int64_t R = in.rows(), f = in.cols() / 2;
  check_swiglu_rows(in, act, op, "act");
  check_swiglu_rows(in, dout, op, "dout");
  MT_CHECK(din.dtype == in.dtype && din.numel() == in.numel(), "{}: din {} {} for in {} {}", op,
           dtype_name(din.dtype), din.shape_string(), dtype_name(in.dtype), in.shape_string());
  check_f32(p, R, op, "p");
  check_f32(dp, R, op, "dp");
  if (R == 0) return;
  if (f == 0) {
    MT_CUDA_CHECK(cudaMemsetAsync(dp.data, 0, dp.nbytes(), ctx.stream));
    return;
  }
  MT_DISPATCH_FLOAT(in.dtype, T, op, {
    // (The vector width scale_rows_backward would take for these rows: dp's summation order.)
    const bool vec = vectorizable<T>(f, {din.data, act.data, dout.data, in.data});
    launch_rows<T>(ctx, R, f, vec, [&](auto width, const RowTeams& teams) {
      swiglu_scale_backward_kernel<T, width><<<teams.grid, kRowOpThreads, 0, ctx.stream>>>(
          din.ptr<T>(), act.ptr<T>(), dp.ptr<float>(), dout.ptr<const T>(), in.ptr<const T>(), p.ptr<const float>(), R,
          f, teams.tpr, q);
    });
  });
  MT_CUDA_CHECK_LAUNCH();
}

// ---- the experts' linear biases (host side) ------------------------------------------------
namespace {
constexpr int kBiasThreads = 256;
constexpr int64_t kBiasMaxChunks = 64;  // runs of an expert's rows in the bias gradient's first pass
// Checks the operands (y: the rows, y or dy) against the offsets; the device offsets, or null with
// host offsets.
const int32_t* check_grouped_bias(const char* op, const Tensor& y, const Tensor& bias, const Tensor& p,
                                  const ExpertOffsets& offsets) {
  const int64_t E = offsets.experts();
  if (offsets.on_host())
    MT_CHECK(offsets.host.front() == 0 && offsets.host.back() == y.rows(), "{}: offsets end at {} for {} rows", op,
             offsets.host.back(), y.rows());
  MT_CHECK(bias.dtype == y.dtype && bias.numel() == E * y.cols(), "{}: bias {} {} for {} experts of {} columns ({})",
           op, dtype_name(bias.dtype), bias.shape_string(), E, y.cols(), dtype_name(y.dtype));
  if (!p.empty()) check_f32(p, y.rows(), op, "p");
  return offsets.on_host() ? nullptr : offsets.device.ptr<const int32_t>();
}
unsigned bias_row_blocks(const KernelContext& ctx, int64_t rows) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(rows, int64_t{ctx.num_sms} * 32)));
}
}  // namespace

void grouped_bias_forward(const KernelContext& ctx, Tensor y, Tensor bias, Tensor p, const ExpertOffsets& offsets) {
  const char* op = "grouped_bias_forward";
  const int E = static_cast<int>(offsets.experts());
  const int32_t* dev_offsets = check_grouped_bias(op, y, bias, p, offsets);
  const std::span<const int64_t> host_offsets = offsets.host;
  const int64_t n = y.cols();
  if (n == 0 || y.rows() == 0) return;
  const float* pp = p.empty() ? nullptr : p.ptr<const float>();
  // 16-byte accesses where every row of y and of the bias starts 16-byte aligned.
  const bool vec = (n * dtype_size(y.dtype)) % 16 == 0 && reinterpret_cast<uintptr_t>(y.data) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(bias.data) % 16 == 0;
  MT_DISPATCH_FLOAT(y.dtype, T, op, {
    constexpr int kV = 16 / static_cast<int>(sizeof(T));
    auto* kernel = vec ? grouped_bias_forward_kernel<T, kV> : grouped_bias_forward_kernel<T, 1>;
    if (dev_offsets) {
      kernel<<<bias_row_blocks(ctx, y.rows()), kBiasThreads, 0, ctx.stream>>>(y.ptr<T>(), bias.ptr<const T>(), pp,
                                                                             dev_offsets, E, -1, y.rows(), n);
    } else {
      for (int e = 0; e < E; ++e) {
        const int64_t b = host_offsets[static_cast<size_t>(e)], rows = host_offsets[static_cast<size_t>(e) + 1] - b;
        if (rows <= 0) continue;
        kernel<<<bias_row_blocks(ctx, rows), kBiasThreads, 0, ctx.stream>>>(
            y.ptr<T>() + b * n, bias.ptr<const T>(), pp ? pp + b : nullptr, nullptr, E, e, rows, n);
      }
    }
  });
  MT_CUDA_CHECK_LAUNCH();
}

void grouped_bias_backward(const KernelContext& ctx, Tensor dbias, Tensor dp, Tensor dy, Tensor bias, Tensor p,
                           const ExpertOffsets& offsets, bool accumulate) {
  const char* op = "grouped_bias_backward";
  const int64_t n = dy.cols();
  const int E = static_cast<int>(offsets.experts());
  const int32_t* dev_offsets = check_grouped_bias(op, dy, bias, p, offsets);
  const std::span<const int64_t> host_offsets = offsets.host;
  MT_CHECK(dbias.numel() == E * n, "{}: dbias {} for {} experts of {} columns", op, dbias.shape_string(), E, n);
  if (!dp.empty()) {
    MT_CHECK(!p.empty(), "{}: dp without p", op);
    check_f32(dp, dy.rows(), op, "dp");
  }
  if (n == 0 || E == 0) return;
  const float* pp = p.empty() ? nullptr : p.ptr<const float>();
  const auto col_blocks = static_cast<unsigned>((n + kBiasThreads - 1) / kBiasThreads);
  // Runs per expert: about four blocks per SM even when one expert holds every row, at most one run
  // per 16 rows, as many as the scratch holds (one run: no scratch, the first pass writes dbias).
  const int64_t fit = static_cast<int64_t>(ctx.scratch->remaining() / sizeof(float)) / (int64_t{E} * n);
  const int64_t spread = (4 * int64_t{ctx.num_sms} + col_blocks - 1) / col_blocks;
  const int chunks =
      static_cast<int>(std::max<int64_t>(1, std::min<int64_t>({kBiasMaxChunks, spread, dy.rows() / 16, fit})));
  MT_DISPATCH_FLOAT(dy.dtype, T, op, {
    MT_DISPATCH_GRAD(dbias.dtype, G, "grouped_bias_backward: dbias", {
      // The first pass into out (dbias with one run, the partials otherwise).
      auto rows_pass = [&](auto* out, bool acc) {
        using O = std::remove_pointer_t<decltype(out)>;
        if (dev_offsets) {
          grouped_bias_grad_rows_kernel<T, O>
              <<<dim3(col_blocks, static_cast<unsigned>(E), static_cast<unsigned>(chunks)), kBiasThreads, 0,
                 ctx.stream>>>(out, dy.ptr<const T>(), pp, dev_offsets, -1, 0, 0, n, chunks, acc);
        } else {
          for (int e = 0; e < E; ++e)
            grouped_bias_grad_rows_kernel<T, O><<<dim3(col_blocks, 1, static_cast<unsigned>(chunks)), kBiasThreads, 0,
                                                  ctx.stream>>>(out, dy.ptr<const T>(), pp, nullptr, e,
                                                                host_offsets[static_cast<size_t>(e)],
                                                                host_offsets[static_cast<size_t>(e) + 1], n, chunks, acc);
        }
      };
      if (chunks == 1) {
        rows_pass(dbias.ptr<G>(), accumulate);
      } else {
        float* partial =
            ctx.scratch->take_array<float>(static_cast<size_t>(E) * chunks * n, "grouped_bias_backward partials");
        rows_pass(partial, false);
        grouped_bias_grad_finish_kernel<G><<<dim3(col_blocks, static_cast<unsigned>(E)), kBiasThreads, 0,
                                             ctx.stream>>>(dbias.ptr<G>(), partial, n, chunks, accumulate);
      }
    });
    if (!dp.empty() && dy.rows() > 0) {
      if (dev_offsets) {
        grouped_bias_dp_kernel<T><<<bias_row_blocks(ctx, dy.rows()), kBiasThreads, 0, ctx.stream>>>(
            dp.ptr<float>(), dy.ptr<const T>(), bias.ptr<const T>(), dev_offsets, E, -1, 0, dy.rows(), n);
      } else {
        for (int e = 0; e < E; ++e) {
          const int64_t b = host_offsets[static_cast<size_t>(e)], rows = host_offsets[static_cast<size_t>(e) + 1] - b;
          if (rows > 0)
            grouped_bias_dp_kernel<T><<<bias_row_blocks(ctx, rows), kBiasThreads, 0, ctx.stream>>>(
                dp.ptr<float>(), dy.ptr<const T>(), bias.ptr<const T>(), nullptr, E, e, b, rows, n);
        }
      }
    }
  });
  MT_CUDA_CHECK_LAUNCH();
}

}  // namespace mt::cuda
