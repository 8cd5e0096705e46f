// Flash attention backward (FA2 scheme on mma.sync), deterministic.
//
// One CTA per (block of BN keys, sample, KV group); one warp per 16 keys. The CTA keeps its K and V
// block in shared memory and walks over every (head of the group, block of BM queries) that can
// see its keys, recomputing the probabilities from q, k and the saved lse:
//   S^T = K Q^T,  P^T = exp(scale*S^T - lse),  dP^T = V dO^T,  dS^T = P^T * (dP^T - delta),
//   dV += P^T dO,  dK += dS^T Q   (registers, summed over the group's heads: GQA),
//   dQ  = dS K                    (dS^T goes through shared memory).
// delta = rowsum(dO * O) comes from a small kernel first.
//
// dq of a query block gets one contribution per key block. Instead of float atomics in whatever
// order the CTAs arrive (FA2), the contributions are added in a FIXED order -- descending key
// block -- with a turn counter per (head, query block, warp tile): the warp whose turn it is adds
// its part to the fp32 accumulator and passes the turn on. The first contributor stores, the last (key block
// 0, or with a sliding window the lowest block the query block sees) adds the accumulator to its part,
// scales and writes the 16-bit result straight into dqkv.
// Why descending: CTA n reaches query block m after (m - m_first(n)) steps and CTA n+1 earlier,
// so with all CTAs of a head running together nobody waits. CTAs are launched in that same order
// (blockIdx.x = last key block first) so a CTA only ever waits for CTAs launched before it: no
// deadlock whatever the occupancy. To keep the protocol's latency off the critical path, a warp
// reads its counter at the start of an item and passes its turn on during the next item (the
// pass never waits for anything, so the no-deadlock argument is unchanged).
#include <cmath>

#include "cuda/attention_flash.h"
#include "cuda/attention_flash_common.cuh"
#include "cuda/attention_flash_kernels.h"
#include "cuda/attention_masks.cuh"
#include "cuda/cuda_check.h"
#include "engine/attention_dropout.h"

namespace mt::cuda::flash {
namespace {

// delta[bh, q] = sum_d dO[q, h, d] * O[q, h, d] in fp32; one warp per row.
template <typename Elem, int D>
__global__ void delta_kernel(const Params p) {
  const int64_t rows = static_cast<int64_t>(p.batch) * p.heads * p.seq;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const int64_t bh = row / p.seq;
  const int q = static_cast<int>(row % p.seq);
  const int i = static_cast<int>(bh / p.heads), h = static_cast<int>(bh % p.heads);
  const int64_t offset = q * p.out_seq_stride + static_cast<int64_t>(i) * p.heads * D + h * D;
  const uint32_t* o = reinterpret_cast<const uint32_t*>(static_cast<const Elem*>(p.out) + offset);
  const uint32_t* dout = reinterpret_cast<const uint32_t*>(static_cast<const Elem*>(p.dout) + offset);
  float sum = 0.f;
#pragma unroll
  for (int c = lane; c < D / 2; c += 32) {
    const float2 a = Pack<Elem>::unpack(o[c]), b = Pack<Elem>::unpack(dout[c]);
    sum += a.x * b.x + a.y * b.y;
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if (lane == 0) p.delta[row] = sum;
}

__device__ __forceinline__ int load_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// `seen` is a value of the counter read (with acquire) earlier; spin only if it was not our turn yet.
__device__ __forceinline__ void wait_for_turn(const int* turn_counter, int turn, int seen) {
  while (seen != turn) {
    __nanosleep(32);
    seen = load_acquire(turn_counter);
  }
}

// Hands the turn on: every lane's adds are visible (fence) before lane 0 bumps the counter.
__device__ __forceinline__ void pass_turn(int* turn_counter, int lane) {
  __threadfence();
  __syncwarp();
  if (lane == 0) atomicAdd(turn_counter, 1);
}

// ORDERED: the deterministic dq (turns, see above). Without it dq contributions are float atomics
// in arrival order into the zeroed accumulator, converted by dq_convert_kernel (FA2's way; only to
// measure what determinism costs).
template <typename Elem, int D, int BM, int BN, bool DROPOUT, bool ORDERED>
__global__ void __launch_bounds__(BN / 16 * 32) backward_kernel(const Params p) {
  constexpr int kWarps = BN / 16, kThreads = kWarps * 32;
  constexpr int QT = BM / 8;          // 8-query column tiles of S^T
  constexpr int DT = D / 8;           // 8-dim column tiles of dK, dV
  constexpr int WM = BM / 16;         // dq = dS K: warps along the queries...
  constexpr int WN = kWarps / WM;     // ... and along the head dims
  constexpr int DQT = DT / WN;        // 8-dim tiles of dq per warp
  static_assert(BM % 16 == 0 && BN % 16 == 0 && kWarps % WM == 0 && DT % WN == 0 && DQT % 2 == 0);
  static_assert(kWarps <= kMaxWarps && BM >= kMinBlockM && BM <= kDqRowPad);

  extern __shared__ __align__(128) unsigned char smem[];
  Elem* sK = reinterpret_cast<Elem*>(smem);           // [BN][D]
  Elem* sV = sK + BN * D;                             // [BN][D]
  Elem* sQ = sV + BN * D;                             // [2][BM][D]
  Elem* sdO = sQ + 2 * BM * D;                        // [2][BM][D]
  Elem* sdS = sdO + 2 * BM * D;                       // [BN][BM]: dS^T
  float* sLse = reinterpret_cast<float*>(sdS + BN * BM);  // [2][BM]
  float* sDelta = sLse + 2 * BM;                      // [2][BM]

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int n_blocks = (p.seq + BN - 1) / BN, m_blocks = (p.seq + BM - 1) / BM;
  const uint32_t drop_threshold = dropout_threshold(p.dropout_p);
  const int n_block = gridDim.x - 1 - blockIdx.x;  // last key block first (see the file comment)
  const int bg = blockIdx.y, i = bg / p.groups, g = bg % p.groups;
  const int n0 = n_block * BN;

  const Elem* group_base = static_cast<const Elem*>(p.qkv) + i * p.row_stride + static_cast<int64_t>(g) * (p.hpg + 2) * D;
  const Elem* k_base = group_base + p.hpg * D;
  const Elem* dout_base = static_cast<const Elem*>(p.dout) + static_cast<int64_t>(i) * p.heads * D;
  load_tile<BN, D, kThreads>(sK, k_base + n0 * p.seq_stride, p.seq_stride, p.seq - n0, tid);
  load_tile<BN, D, kThreads>(sV, k_base + D + n0 * p.seq_stride, p.seq_stride, p.seq - n0, tid);

  // Work items: (head of the group, query block) for query blocks that see at least one key here.
  const int m_first = p.causal ? n0 / BM : 0;
  // With a sliding window the block's last key is seen by no query after n0 + BN - 1 + window;
  // with documents by none from the first query whose document starts after it. (Every query
  // block from m_first to m_last then sees a key of this block, and this key block lies in the
  // range [n_lo, n_first] of each of them below: the dq turns of the file comment hold.)
  const int32_t* doc = p.doc_start ? p.doc_start + static_cast<int64_t>(i) * p.seq : nullptr;
  int m_last = p.window >= 0 ? min(m_blocks - 1, (n0 + BN - 1 + p.window) / BM) : m_blocks - 1;
  if (doc) {
    const int k_last = min(p.seq - 1, n0 + BN - 1);
    const int q_end = first_query_past(doc, p.causal ? k_last : 0, p.seq, k_last);
    m_last = q_end > 0 ? min(m_last, (q_end - 1) / BM) : -1;  // (none: no query sees these keys)
  }
  const int m_count = max(0, m_last - m_first + 1);
  const int items = p.hpg * m_count;
  auto issue_loads = [&](int item, int buf) {
    const int h = g * p.hpg + item / m_count;
    const int m0 = (m_first + item % m_count) * BM;
    load_tile<BM, D, kThreads>(sQ + buf * BM * D, group_base + (h - g * p.hpg) * D + m0 * p.seq_stride,
                               p.seq_stride, p.seq - m0, tid);
    load_tile<BM, D, kThreads>(sdO + buf * BM * D, dout_base + h * D + m0 * p.out_seq_stride, p.out_seq_stride,
                               p.seq - m0, tid);
    // Padding queries (q >= s) get lse = delta = 0 with zero q and dO rows: their p may be
    // nonzero, but every term they feed (p*dO, p*(dP - delta) with dP = V.dO) is exactly 0.
    const int64_t row0 = (static_cast<int64_t>(i) * p.heads + h) * p.seq + m0;
    for (int r = tid; r < BM; r += kThreads) {
      const bool valid = m0 + r < p.seq;
      cp_async_4(smem_u32(sLse + buf * BM + r), p.lse + (valid ? row0 + r : 0), valid);
      cp_async_4(smem_u32(sDelta + buf * BM + r), p.delta + (valid ? row0 + r : 0), valid);
    }
  };
  if (items > 0) issue_loads(0, 0);  // (no item: dK and dV of these keys are zero)
  cp_async_commit();

  float dk[DT][4], dv[DT][4];
#pragma unroll
  for (int dt = 0; dt < DT; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[dt][e] = dv[dt][e] = 0.f;

  const int64_t dq_rows = (static_cast<int64_t>(p.seq) + kDqRowPad - 1) / kDqRowPad * kDqRowPad;
  const int turn_stride = (p.seq + kMinBlockM - 1) / kMinBlockM;
  const int key_row0 = n0 + warp * 16;  // this warp's first key
  // Lane parts of the ldmatrix addresses (see Ldsm): A fragments and transposed B fragments read
  // rows lane%16, chunk lane/16; B fragments and the transposed dS^T read rows lane%8 + 8*(lane/16),
  // chunk (lane/8)%2.
  const uint32_t off_a = Ldsm<D>::lane_offset(lane % 16, lane / 16);
  const uint32_t off_b = Ldsm<D>::lane_offset(lane % 8 + (lane / 16) * 8, (lane / 8) % 2);
  const uint32_t off_s = Ldsm<BM>::lane_offset(lane % 8 + (lane / 16) * 8, (lane / 8) % 2);
  const uint32_t sK_u32 = smem_u32(sK), sV_u32 = smem_u32(sV), sdS_u32 = smem_u32(sdS);

  int* pending_turn = nullptr;  // a dq turn this warp still has to pass on
  for (int item = 0; item < items; ++item) {
    const int buf = item & 1;
    const int h = g * p.hpg + item / m_count;
    const int m_block = m_first + item % m_count;
    const int m0 = m_block * BM;
    if (item + 1 < items) {
      issue_loads(item + 1, buf ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const uint32_t q_tile = smem_u32(sQ + buf * BM * D);
    const uint32_t do_tile = smem_u32(sdO + buf * BM * D);
    const float* lse_tile = sLse + buf * BM;
    const float* delta_tile = sDelta + buf * BM;

    // This item's dq turn (see the file comment): read the counter now, use it at the end, so the
    // load's latency hides behind the item's math.
    const int n_first = p.causal ? min(m0 + BM - 1, p.seq - 1) / BN : n_blocks - 1;
    const int turn = n_first - n_block;
    const int64_t bh = static_cast<int64_t>(i) * p.heads + h;
    int* turn_counter = p.dq_turn + ((bh * turn_stride + m_block) * kMaxWarps + warp);
    // The lowest key block this query block sees: 0, or where its first query's window or
    // document starts.
    const int n_lo = first_visible_key(doc, p.window, m0) / BN;
    const bool first = ORDERED && n_block == n_first, last = ORDERED && n_block == n_lo;
    int seen = turn;
    if (ORDERED && !first && lane == 0) seen = load_acquire(turn_counter);

    // Phase 1: S^T = K Q^T for this warp's 16 keys -> P^T (in place), dropout decisions as bits.
    float st[QT][4];
#pragma unroll
    for (int qt = 0; qt < QT; ++qt)
#pragma unroll
      for (int e = 0; e < 4; ++e) st[qt][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t a[4];
      ldmatrix_x4(a, Ldsm<D>::at(sK_u32, off_a, warp * 16, kk * 2));
#pragma unroll
      for (int qp = 0; qp < QT / 2; ++qp) {
        uint32_t b[4];
        ldmatrix_x4(b, Ldsm<D>::at(q_tile, off_b, qp * 16, kk * 2));
        mma_16816<Elem>(st[2 * qp], a, b[0], b[1]);
        mma_16816<Elem>(st[2 * qp + 1], a, b[2], b[3]);
      }
    }
    const bool need_mask = (key_row0 + 16 > p.seq) || (p.causal && key_row0 + 15 > m0) ||
                           (p.window >= 0 && key_row0 < m0 + BM - 1 - p.window) ||
                           (doc && key_row0 < doc[min(p.seq - 1, m0 + BM - 1)]);
    uint64_t keep_bits = ~0ull;  // bit qt*4+e: element (qt, e) survives dropout
#pragma unroll
    for (int qt = 0; qt < QT; ++qt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = key_row0 + lane / 4 + (e / 2) * 8;
        const int col = qt * 8 + 2 * (lane % 4) + (e % 2);
        float pr = fast_exp2(fmaf(st[qt][e], p.scale_log2, -lse_tile[col] * kLog2e));
        if (need_mask && (key >= p.seq || (p.causal && key > m0 + col) || (p.window >= 0 && key < m0 + col - p.window) ||
                          (doc && m0 + col < p.seq && key < doc[m0 + col])))
          pr = 0.f;
        st[qt][e] = pr;
      }
    if constexpr (DROPOUT) {
      // engine/attention_dropout.h: one draw holds this thread's 8 elements of a 16-query tile u
      // (qt = 2u + t): keys key_row0 + lane/4 + 8 hi, queries m0 + 16u + 8t + 2 (lane % 4) + f,
      // slot (hi * 2 + t) * 2 + f, element e = 2 hi + f.
#pragma unroll
      for (int u = 0; u < QT / 2; ++u) {
        const Philox4 r = attention_dropout_words(
            p.dropout_key, attention_dropout_draw(bh, p.seq, m0 + 16 * u + 2 * (lane % 4), key_row0 + lane / 4));
#pragma unroll
        for (int slot = 0; slot < 8; ++slot) {
          const int hi = slot / 4, t = (slot / 2) % 2, f = slot % 2;
          if (dropout_bits(r, slot) < drop_threshold) keep_bits &= ~(1ull << ((2 * u + t) * 4 + 2 * hi + f));
        }
      }
    }
    // Dropout factor of element (qt, e): 1/(1-p) if kept, 0 if dropped.
    auto drop = [&](int qt, int e) -> float {
      if constexpr (DROPOUT) return (keep_bits >> (qt * 4 + e)) & 1 ? p.dropout_scale : 0.f;
      return 1.f;
    };

    // The previous item's turn is passed on here, once its atomics have had time to land.
    if (ORDERED && pending_turn) {
      pass_turn(pending_turn, lane);
      pending_turn = nullptr;
    }

    // Phase 2: dV += (dropped P)^T dO.
#pragma unroll
    for (int kq = 0; kq < BM / 16; ++kq) {
      uint32_t a[4];
      a[0] = Pack<Elem>::two(st[2 * kq][0] * drop(2 * kq, 0), st[2 * kq][1] * drop(2 * kq, 1));
      a[1] = Pack<Elem>::two(st[2 * kq][2] * drop(2 * kq, 2), st[2 * kq][3] * drop(2 * kq, 3));
      a[2] = Pack<Elem>::two(st[2 * kq + 1][0] * drop(2 * kq + 1, 0), st[2 * kq + 1][1] * drop(2 * kq + 1, 1));
      a[3] = Pack<Elem>::two(st[2 * kq + 1][2] * drop(2 * kq + 1, 2), st[2 * kq + 1][3] * drop(2 * kq + 1, 3));
#pragma unroll
      for (int dp = 0; dp < DT / 2; ++dp) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, Ldsm<D>::at(do_tile, off_a, kq * 16, dp * 2));
        mma_16816<Elem>(dv[2 * dp], a, b[0], b[1]);
        mma_16816<Elem>(dv[2 * dp + 1], a, b[2], b[3]);
      }
    }

    // Phase 3: dP^T = V dO^T, then dS^T = P^T * (dP^T * drop - delta) in place.
    float dpt[QT][4];
#pragma unroll
    for (int qt = 0; qt < QT; ++qt)
#pragma unroll
      for (int e = 0; e < 4; ++e) dpt[qt][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t a[4];
      ldmatrix_x4(a, Ldsm<D>::at(sV_u32, off_a, warp * 16, kk * 2));
#pragma unroll
      for (int qp = 0; qp < QT / 2; ++qp) {
        uint32_t b[4];
        ldmatrix_x4(b, Ldsm<D>::at(do_tile, off_b, qp * 16, kk * 2));
        mma_16816<Elem>(dpt[2 * qp], a, b[0], b[1]);
        mma_16816<Elem>(dpt[2 * qp + 1], a, b[2], b[3]);
      }
    }
#pragma unroll
    for (int qt = 0; qt < QT; ++qt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = qt * 8 + 2 * (lane % 4) + (e % 2);
        dpt[qt][e] = st[qt][e] * (dpt[qt][e] * drop(qt, e) - delta_tile[col]);
      }

    // Phase 4: dK += dS^T Q (unscaled; the softmax scale is applied once at the end).
#pragma unroll
    for (int kq = 0; kq < BM / 16; ++kq) {
      uint32_t a[4];
      a[0] = Pack<Elem>::two(dpt[2 * kq][0], dpt[2 * kq][1]);
      a[1] = Pack<Elem>::two(dpt[2 * kq][2], dpt[2 * kq][3]);
      a[2] = Pack<Elem>::two(dpt[2 * kq + 1][0], dpt[2 * kq + 1][1]);
      a[3] = Pack<Elem>::two(dpt[2 * kq + 1][2], dpt[2 * kq + 1][3]);
#pragma unroll
      for (int dp = 0; dp < DT / 2; ++dp) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, Ldsm<D>::at(q_tile, off_a, kq * 16, dp * 2));
        mma_16816<Elem>(dk[2 * dp], a, b[0], b[1]);
        mma_16816<Elem>(dk[2 * dp + 1], a, b[2], b[3]);
      }
    }

    // dS^T -> shared memory, then dQ = dS K with the warps tiling the BM x D result.
#pragma unroll
    for (int qt = 0; qt < QT; ++qt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = warp * 16 + lane / 4 + half * 8;
        *reinterpret_cast<uint32_t*>(sdS + swizzle<BM>(row, qt) + 2 * (lane % 4)) =
            Pack<Elem>::two(dpt[qt][2 * half], dpt[qt][2 * half + 1]);
      }
    __syncthreads();
    const int wm = warp % WM, wn = warp / WM;
    float dq[DQT][4];
#pragma unroll
    for (int dt = 0; dt < DQT; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) dq[dt][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      uint32_t a[4];
      ldmatrix_x4_trans(a, Ldsm<BM>::at(sdS_u32, off_s, kk * 16, wm * 2));
#pragma unroll
      for (int dp = 0; dp < DQT / 2; ++dp) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, Ldsm<D>::at(sK_u32, off_a, kk * 16, wn * DQT + dp * 2));
        mma_16816<Elem>(dq[2 * dp], a, b[0], b[1]);
        mma_16816<Elem>(dq[2 * dp + 1], a, b[2], b[3]);
      }
    }

    // Add this warp's dq tile in its turn (descending key blocks). Turns are per (head, query
    // block, warp tile), so warps never wait for each other here.
    if (ORDERED && !first) {
      if (lane == 0) wait_for_turn(turn_counter, turn, seen);
      __syncwarp();
    }
    Elem* dq_out = static_cast<Elem*>(p.dqkv) + i * p.row_stride + static_cast<int64_t>(g) * (p.hpg + 2) * D +
                   (h - g * p.hpg) * D;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      // One row per (lane, half); the 8-dim tiles are then constant offsets from its pointers.
      const int q = m0 + wm * 16 + lane / 4 + half * 8;
      if (q >= p.seq) continue;
      const int dim0 = wn * DQT * 8 + 2 * (lane % 4);
      float2* acc = reinterpret_cast<float2*>(p.dq_accum + (bh * dq_rows + q) * D + dim0);
      Elem* dst = dq_out + q * p.seq_stride + dim0;
#pragma unroll
      for (int dt = 0; dt < DQT; ++dt) {
        float2 v = make_float2(dq[dt][2 * half], dq[dt][2 * half + 1]);
        if (last) {
          if (!first) {
            const float2 prev = __ldcg(acc + dt * 4);
            v.x += prev.x;
            v.y += prev.y;
          }
          *reinterpret_cast<uint32_t*>(dst + dt * 8) = Pack<Elem>::two(v.x * p.softmax_scale, v.y * p.softmax_scale);
        } else if (first) {
          __stcg(acc + dt * 4, v);
        } else {
          atomicAdd(acc + dt * 4, v);  // ORDERED: exclusive by turn, the order of these adds is fixed
        }
      }
    }
    if (ORDERED && !last) pending_turn = turn_counter;  // passed on during the next item
  }
  if (ORDERED && pending_turn) pass_turn(pending_turn, lane);

  // dK (scaled) and dV of this key block, for the group's k and v slots.
  Elem* dk_out = static_cast<Elem*>(p.dqkv) + i * p.row_stride + static_cast<int64_t>(g) * (p.hpg + 2) * D + p.hpg * D;
  Elem* dv_out = dk_out + D;
#pragma unroll
  for (int dt = 0; dt < DT; ++dt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int key = key_row0 + lane / 4 + half * 8;
      if (key >= p.seq) continue;
      const int dim = dt * 8 + 2 * (lane % 4);
      *reinterpret_cast<uint32_t*>(dk_out + key * p.seq_stride + dim) =
          Pack<Elem>::two(dk[dt][2 * half] * p.softmax_scale, dk[dt][2 * half + 1] * p.softmax_scale);
      *reinterpret_cast<uint32_t*>(dv_out + key * p.seq_stride + dim) = Pack<Elem>::two(dv[dt][2 * half], dv[dt][2 * half + 1]);
    }
}

// Unordered mode only: dq = scale * accumulator, into dqkv's q slots. One thread per 2 elements.
template <typename Elem, int D>
__global__ void dq_convert_kernel(const Params p) {
  const int64_t pairs = static_cast<int64_t>(p.batch) * p.heads * p.seq * (D / 2);
  const int64_t dq_rows = (static_cast<int64_t>(p.seq) + kDqRowPad - 1) / kDqRowPad * kDqRowPad;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < pairs;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int dim = static_cast<int>(idx % (D / 2)) * 2;
    const int64_t row = idx / (D / 2);  // (i*heads + h)*seq + q
    const int q = static_cast<int>(row % p.seq);
    const int64_t bh = row / p.seq;
    const int i = static_cast<int>(bh / p.heads), h = static_cast<int>(bh % p.heads);
    const int g = h / p.hpg;
    const float2 v = *reinterpret_cast<const float2*>(p.dq_accum + (bh * dq_rows + q) * D + dim);
    Elem* dst = static_cast<Elem*>(p.dqkv) + q * p.seq_stride + i * p.row_stride +
                static_cast<int64_t>(g) * (p.hpg + 2) * D + (h - g * p.hpg) * D + dim;
    *reinterpret_cast<uint32_t*>(dst) = Pack<Elem>::two(v.x * p.softmax_scale, v.y * p.softmax_scale);
  }
}

template <typename Elem, int D, int BM, int BN, bool DROPOUT, bool ORDERED = true>
void launch_backward(const Params& p, cudaStream_t stream) {
  const int64_t rows = static_cast<int64_t>(p.batch) * p.heads * p.seq;
  constexpr int kDeltaWarps = 8;
  delta_kernel<Elem, D><<<static_cast<unsigned>((rows + kDeltaWarps - 1) / kDeltaWarps), kDeltaWarps * 32, 0, stream>>>(p);
  MT_CUDA_CHECK_LAUNCH();
  const size_t turn_bytes =
      static_cast<size_t>(p.batch) * p.heads * ((p.seq + kMinBlockM - 1) / kMinBlockM) * kMaxWarps * sizeof(int);
  if constexpr (ORDERED) {
    MT_CUDA_CHECK(cudaMemsetAsync(p.dq_turn, 0, turn_bytes, stream));
  } else {
    const size_t dq_rows = (static_cast<size_t>(p.seq) + kDqRowPad - 1) / kDqRowPad * kDqRowPad;
    MT_CUDA_CHECK(cudaMemsetAsync(p.dq_accum, 0, static_cast<size_t>(p.batch) * p.heads * dq_rows * D * sizeof(float), stream));
  }

  auto kernel = backward_kernel<Elem, D, BM, BN, DROPOUT, ORDERED>;
  constexpr int smem_bytes =
      (2 * BN * D + 4 * BM * D + BN * BM) * static_cast<int>(sizeof(Elem)) + 4 * BM * static_cast<int>(sizeof(float));
  static bool configured = false;
  if (!configured) {
    MT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
    configured = true;
  }
  const dim3 grid((p.seq + BN - 1) / BN, p.batch * p.groups);
  kernel<<<grid, BN / 16 * 32, smem_bytes, stream>>>(p);
  MT_CUDA_CHECK_LAUNCH();
  if constexpr (!ORDERED) {
    dq_convert_kernel<Elem, D><<<1024, 256, 0, stream>>>(p);
    MT_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace

template <typename Elem, bool DROPOUT>
bool backward_dispatch(const Params& p, int d, const BackwardConfig& c, cudaStream_t stream) {
#define MT_FLASH_BWD(D_, BM_, BN_)                                              \
  if (d == D_ && c.block_m == BM_ && c.block_n == BN_ && c.deterministic) {     \
    launch_backward<Elem, D_, BM_, BN_, DROPOUT>(p, stream);                   \
    return true;                                                               \
  }
#define MT_FLASH_BWD_UNORDERED(D_, BM_, BN_)                                   \
  if (d == D_ && c.block_m == BM_ && c.block_n == BN_ && !c.deterministic) {    \
    launch_backward<Elem, D_, BM_, BN_, DROPOUT, false>(p, stream);            \
    return true;                                                               \
  }
  MT_FLASH_BWD(64, 64, 128)
  MT_FLASH_BWD(128, 64, 128)
  MT_FLASH_BWD(64, 128, 128)
  if constexpr (std::is_same_v<Elem, __nv_bfloat16>) {
    MT_FLASH_BWD(64, 64, 64)
  }
  if constexpr (std::is_same_v<Elem, __nv_bfloat16> && !DROPOUT) {
    MT_FLASH_BWD(128, 32, 128)
    MT_FLASH_BWD(128, 64, 64)
    MT_FLASH_BWD_UNORDERED(64, 64, 128)
    MT_FLASH_BWD_UNORDERED(128, 64, 128)
  }
#undef MT_FLASH_BWD
#undef MT_FLASH_BWD_UNORDERED
  return false;
}

template bool backward_dispatch<__nv_bfloat16, false>(const Params&, int, const BackwardConfig&, cudaStream_t);
template bool backward_dispatch<__nv_bfloat16, true>(const Params&, int, const BackwardConfig&, cudaStream_t);
template bool backward_dispatch<__half, false>(const Params&, int, const BackwardConfig&, cudaStream_t);
template bool backward_dispatch<__half, true>(const Params&, int, const BackwardConfig&, cudaStream_t);

}  // namespace mt::cuda::flash
