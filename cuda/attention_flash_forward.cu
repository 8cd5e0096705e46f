// Flash attention forward (FA2 scheme on mma.sync): one CTA per (block of BM queries, sample, head);
// each warp owns BM/NWARPS query rows and streams the key/value blocks through double-buffered
// shared memory, keeping a running max and sum per row (online softmax). The s x s score matrix
// exists only as registers, one BM x BN block at a time.
#include <cmath>

#include "cuda/attention_flash.h"
#include "cuda/attention_flash_common.cuh"
#include "cuda/attention_flash_kernels.h"
#include "cuda/attention_masks.cuh"
#include "cuda/cuda_check.h"
#include "engine/attention_dropout.h"

namespace mt::cuda::flash {
namespace {

template <typename Elem, int D, int BM, int BN, int NWARPS, bool DROPOUT>
__global__ void __launch_bounds__(NWARPS * 32) forward_kernel(const Params p) {
  constexpr int kThreads = NWARPS * 32;
  constexpr int MI = BM / (16 * NWARPS);  // 16-row MMA tiles per warp
  constexpr int NT = BN / 8;              // 8-key column tiles of the score block
  constexpr int DT = D / 8;               // 8-dim column tiles of the output
  static_assert(MI >= 1 && BM % (16 * NWARPS) == 0 && BN % 16 == 0 && D % 16 == 0);

  extern __shared__ __align__(128) unsigned char smem[];
  Elem* sQ = reinterpret_cast<Elem*>(smem);  // [BM][D], later reused to stage the output
  Elem* sK = sQ + BM * D;                    // [2][BN][D]
  Elem* sV = sK + 2 * BN * D;                // [2][BN][D]

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const uint32_t drop_threshold = dropout_threshold(p.dropout_p);
  // Causal blocks near the end of the sequence have the most keys: start those first.
  const int m_block = gridDim.x - 1 - blockIdx.x;
  const int bh = blockIdx.y, i = bh / p.heads, h = bh % p.heads;
  const int g = h / p.hpg, j = h % p.hpg;
  const int m0 = m_block * BM;
  const Elem* qkv = static_cast<const Elem*>(p.qkv);
  const Elem* group_base = qkv + i * p.row_stride + static_cast<int64_t>(g) * (p.hpg + 2) * D;
  const Elem* q_base = group_base + j * D + m0 * p.seq_stride;
  const Elem* k_base = group_base + p.hpg * D;
  const Elem* v_base = k_base + D;

  const int kv_end = p.causal ? min(p.seq, m0 + BM) : p.seq;
  const int n_blocks = (kv_end + BN - 1) / BN;
  // With a sliding window the block's first query sees nothing before key m0 - window, with
  // documents nothing before its document's start (the block's lowest).
  const int32_t* doc = p.doc_start ? p.doc_start + static_cast<int64_t>(i) * p.seq : nullptr;
  const int n_start = first_visible_key(doc, p.window, m0) / BN;
  // With documents the warp's last query (the highest document start) decides where masks start.
  const int warp_doc_hi = doc ? doc[min(p.seq - 1, m0 + (warp + 1) * MI * 16 - 1)] : 0;

  load_tile<BM, D, kThreads>(sQ, q_base, p.seq_stride, p.seq - m0, tid);
  load_tile<BN, D, kThreads>(sK, k_base + n_start * BN * p.seq_stride, p.seq_stride, p.seq - n_start * BN, tid);
  load_tile<BN, D, kThreads>(sV, v_base + n_start * BN * p.seq_stride, p.seq_stride, p.seq - n_start * BN, tid);
  cp_async_commit();

  const int warp_row0 = warp * MI * 16;  // first row of this warp inside the block
  // Lane parts of the ldmatrix addresses: A fragments and transposed B fragments read rows lane%16,
  // chunk lane/16; B fragments read rows lane%8 + 8*(lane/16), chunk (lane/8)%2.
  const uint32_t off_a = Ldsm<D>::lane_offset(lane % 16, lane / 16);
  const uint32_t off_b = Ldsm<D>::lane_offset(lane % 8 + (lane / 16) * 8, (lane / 8) % 2);
  const uint32_t sQ_u32 = smem_u32(sQ);
  float o[MI][DT][4];
  float row_max[MI][2], row_sum[MI][2];
#pragma unroll
  for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mi][dt][e] = 0.f;
    row_max[mi][0] = row_max[mi][1] = -INFINITY;
    row_sum[mi][0] = row_sum[mi][1] = 0.f;
  }

  for (int nb = n_start; nb < n_blocks; ++nb) {
    const int buf = (nb - n_start) & 1;
    if (nb + 1 < n_blocks) {  // prefetch the next key/value block into the other buffer
      const int n1 = (nb + 1) * BN;
      load_tile<BN, D, kThreads>(sK + (buf ^ 1) * BN * D, k_base + n1 * p.seq_stride, p.seq_stride, p.seq - n1, tid);
      load_tile<BN, D, kThreads>(sV + (buf ^ 1) * BN * D, v_base + n1 * p.seq_stride, p.seq_stride, p.seq - n1, tid);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const uint32_t k_tile = smem_u32(sK + buf * BN * D);
    const uint32_t v_tile = smem_u32(sV + buf * BN * D);
    const int n0 = nb * BN;

    // S = Q K^T for this warp's rows (raw dot products; the scale is folded into exp2 below).
    float s[MI][NT][4];
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mi][nt][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t a[MI][4];
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
        ldmatrix_x4(a[mi], Ldsm<D>::at(sQ_u32, off_a, warp_row0 + mi * 16, kk * 2));
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        uint32_t b[4];
        ldmatrix_x4(b, Ldsm<D>::at(k_tile, off_b, np * 16, kk * 2));
#pragma unroll
        for (int mi = 0; mi < MI; ++mi) {
          mma_16816<Elem>(s[mi][2 * np], a[mi], b[0], b[1]);
          mma_16816<Elem>(s[mi][2 * np + 1], a[mi], b[2], b[3]);
        }
      }
    }

    // Mask keys past the sequence end, (causal) keys after the query and keys before its window,
    // only where a block needs it.
    const bool need_mask = (n0 + BN > p.seq) || (p.causal && n0 + BN - 1 > m0 + warp_row0) ||
                           (p.window >= 0 && n0 < m0 + warp_row0 + MI * 16 - 1 - p.window) ||
                           (doc && n0 < warp_doc_hi);
    if (need_mask) {
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int q = m0 + warp_row0 + mi * 16 + lane / 4 + (e / 2) * 8;
            const int k = n0 + nt * 8 + 2 * (lane % 4) + (e % 2);
            if (k >= p.seq || (p.causal && k > q) || (p.window >= 0 && k < q - p.window) ||
                (doc && q < p.seq && k < doc[q]))
              s[mi][nt][e] = -INFINITY;
          }
    }

    // Online softmax: new running max per row (a row lives in the 4 lanes of a quad), rescale
    // the old sum and output by exp(old max - new max), turn scores into probabilities.
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float mx = row_max[mi][half];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) mx = fmaxf(mx, fmaxf(s[mi][nt][2 * half], s[mi][nt][2 * half + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        // A row with no visible key yet keeps max -inf; subtract 0 then (all its p are 0).
        const float base = mx == -INFINITY ? 0.f : mx * p.scale_log2;
        const float correction = fast_exp2(row_max[mi][half] * p.scale_log2 - base);
        row_max[mi][half] = mx;
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 2 * half; e < 2 * half + 2; ++e) {
            const float pr = fast_exp2(s[mi][nt][e] * p.scale_log2 - base);
            s[mi][nt][e] = pr;
            sum += pr;
          }
        row_sum[mi][half] = row_sum[mi][half] * correction + sum;
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
          o[mi][dt][2 * half] *= correction;
          o[mi][dt][2 * half + 1] *= correction;
        }
      }

    if constexpr (DROPOUT) {  // the sum above is pre-dropout; dropped probabilities just skip V
      // engine/attention_dropout.h: this thread holds rows r = lane/4 and r + 8 (of parity f) of a
      // 16-row tile against keys 8 hi + 2 (lane % 4) + e2 of each 16-key pair of tiles (nt = 2v + hi,
      // e = 2t + e2). The draw of key column e2 holds both rows of both parities for both tiles, in
      // slot (hi * 2 + t) * 2 + parity: this lane draws e2 = f, lane ^ 4 (parity 1 - f, the same
      // keys) draws e2 = 1 - f, and each sends the other the halves of its parity.
      const int f = (lane / 4) % 2;
#pragma unroll
      for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int v = 0; v < NT / 2; ++v) {
          const Philox4 r = attention_dropout_words(
              p.dropout_key,
              attention_dropout_draw(bh, p.seq, m0 + warp_row0 + mi * 16 + lane / 4, n0 + 16 * v + 2 * (lane % 4) + f));
          uint32_t mine[4], theirs[4];  // 16-bit draws of this lane's parity: its own e2 = f, and e2 = 1 - f
#pragma unroll
          for (int w = 0; w < 4; ++w) mine[w] = (r.v[w] >> (16 * f)) & 0xffffu;
          const uint32_t give0 = ((r.v[0] >> (16 * (1 - f))) & 0xffffu) | (r.v[1] >> (16 * (1 - f))) << 16;
          const uint32_t give1 = ((r.v[2] >> (16 * (1 - f))) & 0xffffu) | (r.v[3] >> (16 * (1 - f))) << 16;
          const uint32_t got0 = __shfl_xor_sync(0xffffffffu, give0, 4), got1 = __shfl_xor_sync(0xffffffffu, give1, 4);
          theirs[0] = got0 & 0xffffu;
          theirs[1] = got0 >> 16;
          theirs[2] = got1 & 0xffffu;
          theirs[3] = got1 >> 16;
#pragma unroll
          for (int hi = 0; hi < 2; ++hi)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int w = hi * 2 + e / 2, e2 = e % 2;
              if ((e2 == f ? mine[w] : theirs[w]) < drop_threshold) s[mi][2 * v + hi][e] = 0.f;
            }
        }
    }

    // O += P V: the probabilities' C fragments become A fragments; V^T fragments via ldmatrix.trans.
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      uint32_t a[MI][4];
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) {
        a[mi][0] = Pack<Elem>::two(s[mi][2 * kk][0], s[mi][2 * kk][1]);
        a[mi][1] = Pack<Elem>::two(s[mi][2 * kk][2], s[mi][2 * kk][3]);
        a[mi][2] = Pack<Elem>::two(s[mi][2 * kk + 1][0], s[mi][2 * kk + 1][1]);
        a[mi][3] = Pack<Elem>::two(s[mi][2 * kk + 1][2], s[mi][2 * kk + 1][3]);
      }
#pragma unroll
      for (int dp = 0; dp < DT / 2; ++dp) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, Ldsm<D>::at(v_tile, off_a, kk * 16, dp * 2));
#pragma unroll
        for (int mi = 0; mi < MI; ++mi) {
          mma_16816<Elem>(o[mi][2 * dp], a[mi], b[0], b[1]);
          mma_16816<Elem>(o[mi][2 * dp + 1], a[mi], b[2], b[3]);
        }
      }
    }
    __syncthreads();  // every warp is done with this buffer before it is refilled
  }

  // Epilogue: normalize, write lse, stage the output rows in this warp's part of sQ (only this
  // warp ever read those rows), then store them as 16-byte vectors.
  float* lse = p.lse + static_cast<int64_t>(bh) * p.seq;
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float sum = row_sum[mi][half];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const float inv = sum > 0.f ? p.dropout_scale / sum : 0.f;
      const int row = warp_row0 + mi * 16 + lane / 4 + half * 8;
      const int q = m0 + row;
      if (lane % 4 == 0 && q < p.seq) lse[q] = row_max[mi][half] * p.softmax_scale + logf(sum);
#pragma unroll
      for (int dt = 0; dt < DT; ++dt) {
        const uint32_t packed = Pack<Elem>::two(o[mi][dt][2 * half] * inv, o[mi][dt][2 * half + 1] * inv);
        *reinterpret_cast<uint32_t*>(sQ + swizzle<D>(row, dt) + 2 * (lane % 4)) = packed;
      }
    }
  __syncwarp();
  Elem* out = static_cast<Elem*>(p.out) + static_cast<int64_t>(i) * p.heads * D + h * D;
  constexpr int kChunks = D / 8;
#pragma unroll
  for (int idx = lane; idx < MI * 16 * kChunks; idx += 32) {
    const int r = idx / kChunks, c = idx % kChunks;
    const int q = m0 + warp_row0 + r;
    if (q < p.seq)
      *reinterpret_cast<uint4*>(out + q * p.out_seq_stride + c * 8) =
          *reinterpret_cast<const uint4*>(sQ + swizzle<D>(warp_row0 + r, c));
  }
}

template <typename Elem, int D, int BM, int BN, int NWARPS, bool DROPOUT>
void launch_forward(const Params& p, cudaStream_t stream) {
  auto kernel = forward_kernel<Elem, D, BM, BN, NWARPS, DROPOUT>;
  constexpr int smem_bytes = (BM + 4 * BN) * D * static_cast<int>(sizeof(Elem));
  static bool configured = false;  // the attribute is per kernel and per device; set it once
  if (!configured) {
    MT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
    configured = true;
  }
  const dim3 grid((p.seq + BM - 1) / BM, p.batch * p.heads);
  kernel<<<grid, NWARPS * 32, smem_bytes, stream>>>(p);
  MT_CUDA_CHECK_LAUNCH();
}

}  // namespace

// The compiled forward variants: (d, BM, BN, warps). bf16 without dropout has every config of
// forward_configs(); with dropout bf16 has forward_configs(d, true), fp16 only the defaults.
template <typename Elem, bool DROPOUT>
bool forward_dispatch(const Params& p, int d, const ForwardConfig& c, cudaStream_t stream) {
#define MT_FLASH_FWD(D_, BM_, BN_, W_)                                      \
  if (d == D_ && c.block_m == BM_ && c.block_n == BN_ && c.warps == W_) { \
    launch_forward<Elem, D_, BM_, BN_, W_, DROPOUT>(p, stream);           \
    return true;                                                          \
  }
  MT_FLASH_FWD(64, 128, 64, 4)
  if constexpr (!DROPOUT || std::is_same_v<Elem, __nv_bfloat16>) {
    MT_FLASH_FWD(128, 128, 128, 8)
  }
  MT_FLASH_FWD(64, 128, 64, 8)
  MT_FLASH_FWD(128, 128, 64, 8)
  if constexpr (std::is_same_v<Elem, __nv_bfloat16> && !DROPOUT) {
    MT_FLASH_FWD(64, 64, 64, 4)
    MT_FLASH_FWD(64, 128, 128, 8)
    MT_FLASH_FWD(128, 64, 64, 4)
    MT_FLASH_FWD(128, 128, 32, 4)
  }
#undef MT_FLASH_FWD
  return false;
}

template bool forward_dispatch<__nv_bfloat16, false>(const Params&, int, const ForwardConfig&, cudaStream_t);
template bool forward_dispatch<__nv_bfloat16, true>(const Params&, int, const ForwardConfig&, cudaStream_t);
template bool forward_dispatch<__half, false>(const Params&, int, const ForwardConfig&, cudaStream_t);
template bool forward_dispatch<__half, true>(const Params&, int, const ForwardConfig&, cudaStream_t);

}  // namespace mt::cuda::flash
