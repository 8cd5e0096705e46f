// Optimizer kernels on the flat float32 buffers: AdamW and SGD (momentum) as one multi-tensor
// launch each, and the deterministic reductions behind the gradient norm and the zero count.
//
// Multi-tensor layout: the segment list (offset, count, group) is cut into chunks of kOptimChunk
// elements; the grid strides over chunks and each block finds its chunk's segment by binary search
// on the prefix chunk counts. The list comes from a table uploaded once at set-up
// (Backend::register_optim_segments) or, when short, by value with the launch, so a step uploads
// nothing. Per-group learning rate and weight decay are kernel arguments.
//
// AdamW is Megatron's (Apex FusedAdam, adam_w_mode): g = grad * grad_scale;
// m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2; p -= lr * ((m / bc1) / (sqrt(v / bc2) + eps) + wd p)
// with bc = 1 - beta^step; the new p is also written to the bf16/fp16 model copy in the same pass,
// or to an FP8 one (--fp8-param-gather) with each segment's scale. A segment with an amax also gets
// max |new weight| as the next FP8 cast of the weight reads it (one atomic per chunk): of p for an
// FP8 copy (cast from the master weights) or without a copy, of the stored value for a bf16/fp16
// copy (tensorwise scaling's weight casts then skip their amax pass).
// Adam's moments are float32, or bfloat16 (--exp-avg-dtype / --exp-avg-sq-dtype bf16, each on its
// own): read as float32, updated in float32 and stored rounded to nearest even, as Transformer
// Engine's FusedAdam keeps them.
// SGD is torch.optim.SGD's: g = grad * grad_scale + wd p; buf = momentum buf + g; p -= lr buf.
// grad is float32, or bfloat16 (--grad-reduce-in-bf16), each element converted to float32 on load.
//
// sum_squares / count_zeros: a fixed grid (a function of the size only) writes one partial per
// block, and one block adds the partials in order: bit-identical results from run to run.
// hash_bytes: core/byte_hash.h's sum of per-word terms, modulo 2^64, so the blocks' 64-bit atomic
// additions give the same bits in any order.
#include <cuda_fp8.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "core/byte_hash.h"
#include "core/master_remainder.h"
#include "cuda/bench_choice.h"
#include "cuda/cuda_check.h"
#include "cuda/device_utils.cuh"
#include "cuda/kernels.h"

namespace mt::cuda {

constexpr int kOptimThreads = 256;  // threads per block of the update kernels
// Resident blocks per SM of the master-remainder AdamW kernel (registers capped to fit), which keeps
// one group of four elements' loads in flight per thread. (adamw_kernel takes its own count with
// its unroll depth: four groups at two blocks per SM measured faster, bench/RESULTS.md.)
constexpr int kOptimBlocksPerSm = 4;

void build_segment_table(std::span<const OptimSegment> segments, DeviceSegment* out, int64_t* total_chunks) {
  int64_t chunks = 0;
  for (size_t i = 0; i < segments.size(); ++i) {
    const OptimSegment& s = segments[i];
    MT_CHECK(s.offset >= 0 && s.count >= 0, "optimizer segment {} has offset {} count {}", i, s.offset, s.count);
    MT_CHECK(s.group >= 0 && s.group < OptimStepParams::kMaxGroups, "optimizer segment {} has group {} (max {})", i,
             s.group, OptimStepParams::kMaxGroups);
    out[i] = DeviceSegment{s.offset, s.count, chunks, s.group, 0, s.fp8_scale, s.fp8_amax};
    chunks += (s.count + kOptimChunk - 1) / kOptimChunk;
  }
  *total_chunks = chunks;
}

namespace {

__device__ __forceinline__ DeviceSegment segment_at(const SegmentArg& a, int i) {
  return a.table ? a.table[i] : a.inline_segments[i];
}

// The segment of `chunk`, and the chunk's element range [begin, end).
__device__ __forceinline__ DeviceSegment chunk_segment(const SegmentArg& a, int64_t chunk, int64_t& begin,
                                                       int64_t& end) {
  int lo = 0, hi = a.count - 1;  // last segment with first_chunk <= chunk
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (segment_at(a, mid).first_chunk <= chunk) lo = mid;
    else hi = mid - 1;
  }
  const DeviceSegment s = segment_at(a, lo);
  begin = s.offset + (chunk - s.first_chunk) * kOptimChunk;
  end = min(begin + kOptimChunk, s.offset + s.count);
  return s;
}

// The element range [begin, end) of `chunk` and its segment's group.
__device__ __forceinline__ void chunk_range(const SegmentArg& a, int64_t chunk, int64_t& begin, int64_t& end,
                                            int& group) {
  group = chunk_segment(a, chunk, begin, end).group;
}

// The model copy's element type for an FP8 (e4m3) copy: each new master value p is stored as
// e4m3(p * scale) (float32 product, round to nearest even, saturating: fp8_quantize's cast)
// (OptimSegment::fp8_scale).
struct Fp8Copy {};

// |new weight| as the weight's next FP8 cast reads it (OptimSegment::fp8_amax): the stored value
// of a 16-bit copy, else p itself (an FP8 copy is cast from the master weights; without a copy
// the parameters are the master weights).
template <typename M>
__device__ __forceinline__ float cast_source_abs(float p) {
  if constexpr (std::is_void_v<M> || std::is_same_v<M, Fp8Copy> || std::is_same_v<M, float>) return fabsf(p);
  else return stored_abs<M>(p);
}

// The model copy's store of new master value p at element i (M: the copy's type; void: none).
// track: the segment takes the amax; amax: this thread's running max (cast_source_abs).
template <typename M>
__device__ __forceinline__ void store_model(void* model, int64_t i, float p, float scale, bool track, float& amax) {
  if constexpr (std::is_same_v<M, Fp8Copy>) {
    static_cast<uint8_t*>(model)[i] = __nv_cvt_float_to_fp8(p * scale, __NV_SATFINITE, __NV_E4M3);
  } else if constexpr (!std::is_void_v<M>) {
    static_cast<M*>(model)[i] = from_float<M>(p);
  }
  if (track) amax = fmaxf(amax, cast_source_abs<M>(p));
}

template <typename G, typename A, typename V>
struct AdamArgs {
  float* master;
  const G* grad;
  A* exp_avg;     // float or bf16
  V* exp_avg_sq;  // float or bf16
  void* model;
  float lr[OptimStepParams::kMaxGroups];
  float wd[OptimStepParams::kMaxGroups];
  float beta1, beta2, bias_correction1, bias_correction2, grad_scale;
  float eps[OptimStepParams::kMaxGroups];
};

// One element's update (Apex FusedAdam's expression) with every rounding spelled out: products
// fused into the additions as written here, nothing else, so that each kernel variant and the
// element-by-element tail give the same bits whatever the compiler would contract.
__device__ __forceinline__ float adam_one(float& m, float& v, float p, float g, float b1, float b2, float bc1,
                                          float bc2, float eps, float lr, float wd) {
  m = __fmaf_rn(b1, m, __fmul_rn(1.0f - b1, g));                  // b1 m + (1 - b1) g
  v = __fmaf_rn(b2, v, __fmul_rn(__fmul_rn(1.0f - b2, g), g));    // b2 v + (1 - b2) g g
  const float denom = __fadd_rn(__fsqrt_rn(__fdiv_rn(v, bc2)), eps);  // sqrt(v / bc2) + eps
  const float update = __fmaf_rn(wd, p, __fdiv_rn(__fdiv_rn(m, bc1), denom));  // (m / bc1) / denom + wd p
  return __fmaf_rn(-lr, update, p);                                 // p - lr update
}

template <typename M, typename G, typename A, typename V>
__device__ __forceinline__ void adam_update(const AdamArgs<G, A, V>& a, int64_t i, float lr, float wd, float eps, float scale,
                                            bool track, float& amax) {
  float m = to_float(a.exp_avg[i]), v = to_float(a.exp_avg_sq[i]);
  const float p = adam_one(m, v, a.master[i], __fmul_rn(to_float(a.grad[i]), a.grad_scale), a.beta1, a.beta2,
                           a.bias_correction1, a.bias_correction2, eps, lr, wd);
  a.exp_avg[i] = from_float<A>(m);
  a.exp_avg_sq[i] = from_float<V>(v);
  a.master[i] = p;
  store_model<M>(a.model, i, p, scale, track, amax);
}

// Four model-copy values at element i (4-aligned; the copy 16-byte aligned): store_model of each.
template <typename M>
__device__ __forceinline__ void store_model4(void* model, int64_t i, const float4& v, float scale, bool track,
                                             float& amax) {
  if constexpr (std::is_same_v<M, Fp8Copy>) {
    const auto lo = static_cast<uint32_t>(
        __nv_cvt_float2_to_fp8x2(make_float2(v.x * scale, v.y * scale), __NV_SATFINITE, __NV_E4M3));
    const auto hi = static_cast<uint32_t>(
        __nv_cvt_float2_to_fp8x2(make_float2(v.z * scale, v.w * scale), __NV_SATFINITE, __NV_E4M3));
    *reinterpret_cast<uint32_t*>(static_cast<uint8_t*>(model) + i) = lo | (hi << 16);
  } else if constexpr (std::is_same_v<M, float>) {
    *reinterpret_cast<float4*>(static_cast<float*>(model) + i) = v;
  } else if constexpr (!std::is_void_v<M>) {
    M e[4] = {from_float<M>(v.x), from_float<M>(v.y), from_float<M>(v.z), from_float<M>(v.w)};
    *reinterpret_cast<uint2*>(static_cast<M*>(model) + i) = *reinterpret_cast<const uint2*>(e);
  }
  if (track)
    amax = fmaxf(amax, fmaxf(fmaxf(cast_source_abs<M>(v.x), cast_source_abs<M>(v.y)),
                             fmaxf(cast_source_abs<M>(v.z), cast_source_abs<M>(v.w))));
}

// Four gradient or moment values at p (16-byte aligned for float, 8-byte for bfloat16), as float32.
template <typename G>
__device__ __forceinline__ float4 load4(const G* p) {
  if constexpr (std::is_same_v<G, float>) {
    return *reinterpret_cast<const float4*>(p);
  } else {
    const uint2 raw = *reinterpret_cast<const uint2*>(p);
    const G* e = reinterpret_cast<const G*>(&raw);
    return make_float4(to_float(e[0]), to_float(e[1]), to_float(e[2]), to_float(e[3]));
  }
}

// Four moment values to p (as load4's alignment), rounded to nearest even for bfloat16.
template <typename T>
__device__ __forceinline__ void store4(T* p, const float4& v) {
  if constexpr (std::is_same_v<T, float>) {
    *reinterpret_cast<float4*>(p) = v;
  } else {
    const T e[4] = {from_float<T>(v.x), from_float<T>(v.y), from_float<T>(v.z), from_float<T>(v.w)};
    *reinterpret_cast<uint2*>(p) = *reinterpret_cast<const uint2*>(e);
  }
}

// The block's threads over elements [begin, end) of a chunk: groups(nvec) takes the nvec groups of
// four from a 4-aligned start when `vec` (the buffers aligned for four-element accesses; group q is
// elements begin + 4q ..), one(i) the others and the tail.
template <typename Groups, typename One>
__device__ __forceinline__ void for_range_groups(int64_t begin, int64_t end, bool vec, Groups&& groups, One&& one) {
  int64_t scalar_from = begin;
  if (vec && (begin & 3) == 0) {
    const int64_t nvec = (end - begin) / 4;
    groups(nvec);
    scalar_from = begin + 4 * nvec;
  }
  for (int64_t i = scalar_from + threadIdx.x; i < end; i += blockDim.x) one(i);
}

// The same with four(i) for each group of four (element i its first), one group per thread at a time.
template <typename Four, typename One>
__device__ __forceinline__ void for_range_by4(int64_t begin, int64_t end, bool vec, Four&& four, One&& one) {
  for_range_groups(
      begin, end, vec,
      [&](int64_t nvec) {
        for (int64_t q = threadIdx.x; q < nvec; q += blockDim.x) four(begin + 4 * q);
      },
      one);
}

// Loads of four-element groups as float32 (load4), plain or streaming (kStream: ld.global.cs,
// evict-first: each element is read and written once per step, so nothing is worth keeping in L2).
template <bool kStream, typename T>
__device__ __forceinline__ float4 load4s(const T* p) {
  if constexpr (kStream && std::is_same_v<T, float>) return __ldcs(reinterpret_cast<const float4*>(p));
  else if constexpr (kStream) {
    const uint2 raw = __ldcs(reinterpret_cast<const uint2*>(p));
    const T* e = reinterpret_cast<const T*>(&raw);
    return make_float4(to_float(e[0]), to_float(e[1]), to_float(e[2]), to_float(e[3]));
  } else return load4(p);
}

// The groups of four q in [0, nvec) of a chunk, kUnroll per thread at a time: every group's loads
// are issued before any group's update. (The updates store to the buffers the next groups load
// from, as far as the compiler knows, so a plain loop keeps one group's loads in flight per thread;
// AdamW's five streams then fall short of the memory's bandwidth.)
template <int kUnroll, typename Load, typename Update>
__device__ __forceinline__ void for_groups_unrolled(int64_t nvec, Load&& load, Update&& update) {
  for (int64_t q0 = threadIdx.x; q0 < nvec; q0 += kUnroll * static_cast<int64_t>(blockDim.x)) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t q = q0 + u * static_cast<int64_t>(blockDim.x);
      if (q < nvec) load(u, q);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t q = q0 + u * static_cast<int64_t>(blockDim.x);
      if (q < nvec) update(u, q);
    }
  }
}

// Elements [begin, end) of a chunk: 16-byte accesses, kUnroll groups of four per thread at a time,
// from a 4-aligned start when `vec`; element by element otherwise and for the tail.
template <int kUnroll, bool kStream, typename M, typename G, typename A, typename V>
__device__ __forceinline__ void adam_range(const AdamArgs<G, A, V>& a, int64_t begin, int64_t end, float lr, float wd, float eps,
                                           bool vec, float scale, bool track, float& amax) {
  float4 g[kUnroll], m[kUnroll], v[kUnroll], p[kUnroll];
  const float s = a.grad_scale;
  auto one = [&](float& mo, float& vo, float pe, float ge) {
    return adam_one(mo, vo, pe, __fmul_rn(ge, s), a.beta1, a.beta2, a.bias_correction1, a.bias_correction2, eps, lr, wd);
  };
  auto load = [&](int u, int64_t q) {
    const int64_t i = begin + 4 * q;
    g[u] = load4s<kStream>(a.grad + i);
    m[u] = load4s<kStream>(a.exp_avg + i);
    v[u] = load4s<kStream>(a.exp_avg_sq + i);
    p[u] = load4s<kStream>(a.master + i);
  };
  auto update = [&](int u, int64_t q) {
    const int64_t i = begin + 4 * q;
    float4 &P = p[u], &Mo = m[u], &Vo = v[u];
    P.x = one(Mo.x, Vo.x, P.x, g[u].x);
    P.y = one(Mo.y, Vo.y, P.y, g[u].y);
    P.z = one(Mo.z, Vo.z, P.z, g[u].z);
    P.w = one(Mo.w, Vo.w, P.w, g[u].w);
    store4(a.exp_avg + i, Mo);
    store4(a.exp_avg_sq + i, Vo);
    *reinterpret_cast<float4*>(a.master + i) = P;
    store_model4<M>(a.model, i, P, scale, track, amax);
  };
  for_range_groups(
      begin, end, vec, [&](int64_t nvec) { for_groups_unrolled<kUnroll>(nvec, load, update); },
      [&](int64_t i) { adam_update<M>(a, i, lr, wd, eps, scale, track, amax); });
}

// FP8 copies: the segment's scale, read once per chunk (written on the stream by the scale update).
__device__ __forceinline__ float copy_scale(const DeviceSegment& s) { return s.fp8_scale ? *s.fp8_scale : 1.0f; }

template <int kUnroll, bool kStream, int kMinBlocks, typename M, typename G, typename A, typename V>
__global__ void __launch_bounds__(kOptimThreads, kMinBlocks) adamw_kernel(AdamArgs<G, A, V> a, SegmentArg segs, bool vec) {
  for (int64_t chunk = blockIdx.x; chunk < segs.total_chunks; chunk += gridDim.x) {
    int64_t begin, end;
    const DeviceSegment s = chunk_segment(segs, chunk, begin, end);
    float amax = 0.0f;
    const bool track = s.fp8_amax != nullptr;  // (block-uniform)
    adam_range<kUnroll, kStream, M>(a, begin, end, a.lr[s.group], a.wd[s.group], a.eps[s.group], vec, copy_scale(s),
                                    track, amax);
    if (track) block_amax_atomic(s.fp8_amax, amax);
  }
}

// ---- float32 master weights kept as int16 remainders beside bf16 weights ----------------------
// The split and join are core/master_remainder.h's (the host's code). Rounded to nearest even, the
// extra bit per element (where master_tie_ambiguous) lives in a bit array; it is 0 elsewhere, so it
// is read only there, and flipped (atomically: neighbours share its word) only where it changes.
struct TieArg {
  uint32_t* words = nullptr;
  int64_t first = 0;  // the bit of element 0
};
__device__ __forceinline__ bool tie_read(const TieArg& t, int64_t i) { return tie_bit(t.words, t.first + i); }
__device__ __forceinline__ void tie_write(const TieArg& t, int64_t i, bool was, bool now) {
  if (was == now) return;
  const int64_t b = t.first + i;
  atomicXor(t.words + (b >> 5), 1u << (b & 31));
}
// Element i's bit as the invariant above has it (zero unless ambiguous).
__device__ __forceinline__ bool tie_of(const TieArg& t, int64_t i, uint16_t weight, int16_t remainder) {
  return master_tie_ambiguous(weight, remainder) && tie_read(t, i);
}

// AdamW over such master weights: a.master is unused; rem and a.model (bf16) are read and written
// (kEven: with the tie bits `ties`). Four elements per access where the run starts 4-aligned and
// the buffers allow it (`vec`).
template <bool kEven, typename G, typename A, typename V>
__global__ void __launch_bounds__(kOptimThreads, kOptimBlocksPerSm) adamw_remainder_kernel(AdamArgs<G, A, V> a, int16_t* rem,
                                                                       TieArg ties, SegmentArg segs, bool vec) {
  uint16_t* w16 = static_cast<uint16_t*>(a.model);
  for (int64_t chunk = blockIdx.x; chunk < segs.total_chunks; chunk += gridDim.x) {
    int64_t begin, end;
    const DeviceSegment s = chunk_segment(segs, chunk, begin, end);
    const float lr = a.lr[s.group], wd = a.wd[s.group], eps = a.eps[s.group];
    const bool track = s.fp8_amax != nullptr;  // (block-uniform)
    float amax = 0.0f;
    auto one = [&](float& m, float& v, float g, uint16_t& w, int16_t& r, int64_t i) {
      bool was = false;
      float x;
      if constexpr (kEven) {
        was = tie_of(ties, i, w, r);
        x = join_master_even(w, r, was);
      } else {
        x = join_master_bits(w, r);
      }
      const float p = adam_one(m, v, x, __fmul_rn(g, a.grad_scale), a.beta1, a.beta2, a.bias_correction1,
                               a.bias_correction2, eps, lr, wd);
      if constexpr (kEven) {
        const SplitMasterEven out = split_master_even(p);
        w = out.weight;
        r = out.remainder;
        tie_write(ties, i, was, out.up);
      } else {
        const SplitMaster out = split_master_bits(p);
        w = out.weight;
        r = out.remainder;
      }
      if (track) amax = fmaxf(amax, fabsf(__uint_as_float(static_cast<uint32_t>(w) << 16)));
    };
    auto four = [&](int64_t i) {
      const float4 g = load4(a.grad + i);
      float4 m = load4(a.exp_avg + i), v = load4(a.exp_avg_sq + i);
      uint2 wr = *reinterpret_cast<const uint2*>(w16 + i), rr = *reinterpret_cast<const uint2*>(rem + i);
      uint16_t* w = reinterpret_cast<uint16_t*>(&wr);
      int16_t* r = reinterpret_cast<int16_t*>(&rr);
      one(m.x, v.x, g.x, w[0], r[0], i);
      one(m.y, v.y, g.y, w[1], r[1], i + 1);
      one(m.z, v.z, g.z, w[2], r[2], i + 2);
      one(m.w, v.w, g.w, w[3], r[3], i + 3);
      store4(a.exp_avg + i, m);
      store4(a.exp_avg_sq + i, v);
      *reinterpret_cast<uint2*>(w16 + i) = wr;
      *reinterpret_cast<uint2*>(rem + i) = rr;
    };
    for_range_by4(begin, end, vec, four, [&](int64_t i) {
      float m = to_float(a.exp_avg[i]), v = to_float(a.exp_avg_sq[i]);
      one(m, v, to_float(a.grad[i]), w16[i], rem[i], i);
      a.exp_avg[i] = from_float<A>(m);
      a.exp_avg_sq[i] = from_float<V>(v);
    });
    if (track) block_amax_atomic(s.fp8_amax, amax);
  }
}

// (Set-up: every element's bit is written whatever the words held.)
__global__ void split_master_kernel(uint16_t* weight, int16_t* remainder, const float* master, int64_t n,
                                    TieArg ties) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (ties.words) {
      const SplitMasterEven out = split_master_even(master[i]);
      tie_write(ties, i, tie_read(ties, i), out.up);
      weight[i] = out.weight;
      if (remainder) remainder[i] = out.remainder;
    } else {
      const SplitMaster out = split_master_bits(master[i]);
      weight[i] = out.weight;
      if (remainder) remainder[i] = out.remainder;
    }
  }
}

__global__ void join_master_kernel(float* master, const uint16_t* weight, const int16_t* remainder, int64_t n,
                                   TieArg ties) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint16_t w = weight[i];
    const int16_t r = remainder[i];
    master[i] = ties.words ? join_master_even(w, r, tie_of(ties, i, w, r)) : join_master_bits(w, r);
  }
}

template <typename G>
struct SgdArgs {
  float* master;
  const G* grad;
  float* momentum_buf;  // null when momentum == 0
  void* model;
  float lr[OptimStepParams::kMaxGroups];
  float wd[OptimStepParams::kMaxGroups];
  float momentum, grad_scale;
};

template <typename M, typename G>
__global__ void __launch_bounds__(kOptimThreads) sgd_kernel(SgdArgs<G> a, SegmentArg segs) {
  for (int64_t chunk = blockIdx.x; chunk < segs.total_chunks; chunk += gridDim.x) {
    int64_t begin, end;
    const DeviceSegment s = chunk_segment(segs, chunk, begin, end);
    const float lr = a.lr[s.group], wd = a.wd[s.group], scale = copy_scale(s);
    const bool track = s.fp8_amax != nullptr;  // (block-uniform)
    float amax = 0.0f;
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
      float p = a.master[i];
      float d = to_float(a.grad[i]) * a.grad_scale + wd * p;
      if (a.momentum_buf) {
        d = a.momentum * a.momentum_buf[i] + d;
        a.momentum_buf[i] = d;
      }
      p -= lr * d;
      a.master[i] = p;
      store_model<M>(a.model, i, p, scale, track, amax);
    }
    if (track) block_amax_atomic(s.fp8_amax, amax);
  }
}

constexpr int kReduceBlock = 256;

// Where sum_squares reads x: a plain buffer (kVec elements per 16-byte access), or float32 master
// weights joined from remainders (MasterSource: four per access, as a float32 buffer's).
template <typename T>
struct PlainSource {
  static constexpr int kVec = 16 / sizeof(T);
  const T* x;
  __device__ __forceinline__ Floats<kVec> vec(int64_t i) const { return load_vec<kVec>(x + i); }
  __device__ __forceinline__ float one(int64_t i) const { return to_float(x[i]); }
};
struct MasterSource {
  static constexpr int kVec = 4;
  const uint16_t* w;
  const int16_t* r;
  TieArg ties;
  __device__ __forceinline__ float one(int64_t i) const {
    return join_master_even(w[i], r[i], tie_of(ties, i, w[i], r[i]));
  }
  __device__ __forceinline__ Floats<kVec> vec(int64_t i) const {
    const uint2 wr = *reinterpret_cast<const uint2*>(w + i), rr = *reinterpret_cast<const uint2*>(r + i);
    const uint16_t* we = reinterpret_cast<const uint16_t*>(&wr);
    const int16_t* re = reinterpret_cast<const int16_t*>(&rr);
    Floats<kVec> out;
#pragma unroll
    for (int j = 0; j < kVec; ++j) out.v[j] = join_master_even(we[j], re[j], tie_of(ties, i + j, we[j], re[j]));
    return out;
  }
};

template <typename Source>
__global__ void sum_squares_partial_kernel(double* partial, Source x, SegmentArg segs, bool vec) {
  constexpr int kVec = Source::kVec;
  float s = 0.0f;
  for (int64_t chunk = blockIdx.x; chunk < segs.total_chunks; chunk += gridDim.x) {
    int64_t begin, end;
    int group;
    chunk_range(segs, chunk, begin, end, group);
    int64_t scalar_from = begin;
    if (vec && begin % kVec == 0) {
      const int64_t nvec = (end - begin) / kVec;
      // Two vectors in flight per thread where both exist.
      int64_t q = threadIdx.x;
      for (; q + blockDim.x < nvec; q += 2 * blockDim.x) {
        const Floats<kVec> v = x.vec(begin + q * kVec), w = x.vec(begin + (q + blockDim.x) * kVec);
#pragma unroll
        for (int j = 0; j < kVec; ++j) s += v.v[j] * v.v[j];
#pragma unroll
        for (int j = 0; j < kVec; ++j) s += w.v[j] * w.v[j];
      }
      if (q < nvec) {
        const Floats<kVec> v = x.vec(begin + q * kVec);
#pragma unroll
        for (int j = 0; j < kVec; ++j) s += v.v[j] * v.v[j];
      }
      scalar_from = begin + nvec * kVec;
    }
    for (int64_t i = scalar_from + threadIdx.x; i < end; i += blockDim.x) {
      const float v = x.one(i);
      s += v * v;
    }
  }
  const double total = block_sum(static_cast<double>(s));
  if (threadIdx.x == 0) partial[blockIdx.x] = total;
}

template <typename T>
__global__ void count_zeros_partial_kernel(double* partial, const T* x, SegmentArg segs) {
  unsigned long long c = 0;
  for (int64_t chunk = blockIdx.x; chunk < segs.total_chunks; chunk += gridDim.x) {
    int64_t begin, end;
    int group;
    chunk_range(segs, chunk, begin, end, group);
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) c += to_float(x[i]) == 0.0f ? 1 : 0;
  }
  const double total = block_sum(static_cast<double>(c));  // exact: counts < 2^53
  if (threadIdx.x == 0) partial[blockIdx.x] = total;
}

__global__ void finish_sum_kernel(float* out, const double* partial, int blocks, bool accumulate) {
  double s = 0.0;
  for (int i = threadIdx.x; i < blocks; i += blockDim.x) s += partial[i];
  s = block_sum(s);
  if (threadIdx.x == 0) out[0] = static_cast<float>((accumulate ? static_cast<double>(out[0]) : 0.0) + s);
}

void check_flat_f32(const Tensor& t, int64_t n, const char* what, const char* name) {
  MT_CHECK(t.dtype == DType::f32 && t.numel() == n, "{}: {} must be float32 with {} elements, got {}", what, name, n,
           t.shape_string());
}

// An Adam moment: float32 or bfloat16, n elements.
void check_moment(const Tensor& t, int64_t n, const char* name) {
  MT_CHECK((t.dtype == DType::f32 || t.dtype == DType::bf16) && t.numel() == n,
           "adamw_step: {} must be float32 or bfloat16 with {} elements, got {} {}", name, n, dtype_name(t.dtype),
           t.shape_string());
}


// Four-element accesses to a float32 (16-byte) or bfloat16 (8-byte) buffer need its alignment.
bool aligned_for4(const Tensor& t) { return t.dtype == DType::f32 ? aligned16(t.data) : aligned8(t.data); }

// Master remainders: a bf16 model copy and int16 remainders of one size, and tie bits (if any)
// covering them.
void check_remainders(const Tensor& model, const Tensor& remainder, const TieBits& ties, const char* what) {
  const int64_t n = remainder.numel();
  MT_CHECK(remainder.dtype == DType::i16, "{}: remainder is {}, not int16", what, dtype_name(remainder.dtype));
  MT_CHECK(model.dtype == DType::bf16 && model.numel() == n,
           "{}: int16 master remainders need a bf16 model copy of {} elements, got {} {}", what, n,
           model.empty() ? std::string_view("none") : dtype_name(model.dtype), model.shape_string());
  MT_CHECK(ties.empty() || (ties.words.dtype == DType::i32 && ties.first >= 0 &&
                            (ties.first + n + 31) / 32 <= ties.words.numel()),
           "{}: tie bits for {} elements from bit {} in {} int32 words", what, n, ties.first, ties.words.numel());
}
TieArg tie_arg(const TieBits& t) { return TieArg{t.empty() ? nullptr : t.words.ptr<uint32_t>(), t.first}; }

// Calls f.template operator()<T>() with T the C++ type of a float32 or bfloat16 moment.
template <typename F>
void dispatch_moment(const Tensor& t, F&& f) {
  if (t.dtype == DType::bf16) return f.template operator()<bf16>();
  return f.template operator()<float>();
}

// The gradient of an optimizer step: float32, or bfloat16 (--grad-reduce-in-bf16), n elements.
void check_optimizer_grad(const Tensor& g, int64_t n, const char* what) {
  if (g.dtype != DType::f32 && g.dtype != DType::bf16)
    fail("{}: grad is {}; the CUDA backend's optimizer reads float32 or bfloat16 gradients (float32 master weights "
         "and moments)", what, dtype_name(g.dtype));
  MT_CHECK(g.numel() == n, "{}: grad must have {} elements, got {}", what, n, g.shape_string());
}

void check_segments_fit(const SegmentArg& s, int64_t n, const char* what) {
  // Bounds of the segments are checked when the table is built (registry) against this size.
  MT_CHECK(s.count > 0 || s.total_chunks == 0, "{}: empty segment table", what);
  (void)n;
}

unsigned chunk_grid(const KernelContext& ctx, int64_t chunks) {
  const int64_t most = ctx.short_blocks ? int64_t{INT32_MAX} : ctx.num_sms * 8LL;  // (short: a block per chunk)
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(chunks, most)));
}

template <typename F>
void dispatch_model(const Tensor& model, const char* what, F&& f) {
  if (model.empty()) return f.template operator()<void>();
  switch (model.dtype) {
    case DType::f32: return f.template operator()<float>();
    case DType::bf16: return f.template operator()<bf16>();
    case DType::f16: return f.template operator()<f16>();
    case DType::fp8_e4m3: return f.template operator()<Fp8Copy>();  // (segments checked by the caller)
    default: fail("{}: model copy dtype {} is not supported", what, dtype_name(model.dtype));
  }
}

}  // namespace

void adamw_step(const KernelContext& ctx, Tensor master, Tensor grad, Tensor exp_avg, Tensor exp_avg_sq,
                Tensor model_param, const SegmentArg& segs, const OptimStepParams& p, TieBits ties) {
  const int64_t n = master.numel();
  const bool remainders = master.dtype == DType::i16;  // float32 master weights as remainders of bf16 ones
  if (remainders) {
    check_remainders(model_param, master, ties, "adamw_step");
  } else {
    check_flat_f32(master, n, "adamw_step", "master");
    MT_CHECK(ties.empty(), "adamw_step: tie bits with float32 master weights");
  }
  check_optimizer_grad(grad, n, "adamw_step");
  check_moment(exp_avg, n, "exp_avg");
  check_moment(exp_avg_sq, n, "exp_avg_sq");
  MT_CHECK(model_param.empty() || model_param.numel() == n, "adamw_step: model_param {} vs {} elements",
           model_param.shape_string(), n);
  check_segments_fit(segs, n, "adamw_step");
  if (segs.total_chunks == 0) return;
  const unsigned grid = chunk_grid(ctx, segs.total_chunks);
  const bool vec = (remainders ? aligned8(master.data) && aligned8(model_param.data)
                                : aligned16(master.data) && (model_param.empty() || aligned16(model_param.data))) &&
                   aligned_for4(grad) && aligned_for4(exp_avg) && aligned_for4(exp_avg_sq);
  MT_DISPATCH_GRAD(grad.dtype, G, "adamw_step (grad)", {
    dispatch_moment(exp_avg, [&]<typename A>() {
      dispatch_moment(exp_avg_sq, [&]<typename V>() {
        AdamArgs<G, A, V> a{remainders ? nullptr : master.ptr<float>(), grad.ptr<const G>(), exp_avg.ptr<A>(),
                            exp_avg_sq.ptr<V>(),
                            model_param.data, {}, {}, p.beta1, p.beta2,
                            static_cast<float>(1.0 - std::pow(static_cast<double>(p.beta1), static_cast<double>(p.step))),
                            static_cast<float>(1.0 - std::pow(static_cast<double>(p.beta2), static_cast<double>(p.step))),
                            p.grad_scale, {}};
        for (int g = 0; g < OptimStepParams::kMaxGroups; ++g) {
          a.lr[g] = p.lr[g];
          a.wd[g] = p.weight_decay[g];
          a.eps[g] = p.eps_of(g);
        }
        if (remainders) {
          if (ties.empty())
            adamw_remainder_kernel<false, G, A, V><<<grid, kOptimThreads, 0, ctx.stream>>>(a, master.ptr<int16_t>(),
                                                                                          TieArg{}, segs, vec);
          else
            adamw_remainder_kernel<true, G, A, V><<<grid, kOptimThreads, 0, ctx.stream>>>(a, master.ptr<int16_t>(),
                                                                                         tie_arg(ties), segs, vec);
          return;
        }
        dispatch_model(model_param, "adamw_step", [&]<typename M>() {
          // (The alternatives bench_ops compares: bench_choice::adamw_variant.)
          switch (bench_choice::adamw_variant) {
            case 1: adamw_kernel<1, false, 4, M, G, A, V><<<grid, kOptimThreads, 0, ctx.stream>>>(a, segs, vec); break;
            case 2: adamw_kernel<4, false, 2, M, G, A, V><<<grid, kOptimThreads, 0, ctx.stream>>>(a, segs, vec); break;
            case 3: adamw_kernel<8, true, 1, M, G, A, V><<<grid, kOptimThreads, 0, ctx.stream>>>(a, segs, vec); break;
            default: adamw_kernel<4, true, 2, M, G, A, V><<<grid, kOptimThreads, 0, ctx.stream>>>(a, segs, vec);
          }
        });
      });
    });
  });
  MT_CUDA_CHECK_LAUNCH();
}

void split_master(const KernelContext& ctx, Tensor model, Tensor remainder, Tensor master, TieBits ties) {
  const int64_t n = master.numel();
  MT_CHECK(master.dtype == DType::f32, "split_master: master is {}, not float32", dtype_name(master.dtype));
  MT_CHECK(model.dtype == DType::bf16 && model.numel() == n, "split_master: model must be bf16 with {} elements, got "
           "{} {}", n, dtype_name(model.dtype), model.shape_string());
  if (remainder.empty()) MT_CHECK(ties.empty(), "split_master: tie bits without remainders");
  else check_remainders(model, remainder, ties, "split_master");
  if (n == 0) return;
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>((n + 255) / 256, ctx.num_sms * 16LL));
  split_master_kernel<<<grid, 256, 0, ctx.stream>>>(model.ptr<uint16_t>(),
                                                    remainder.empty() ? nullptr : remainder.ptr<int16_t>(),
                                                    master.ptr<const float>(), n, tie_arg(ties));
  MT_CUDA_CHECK_LAUNCH();
}

void join_master(const KernelContext& ctx, Tensor master, Tensor model, Tensor remainder, TieBits ties) {
  const int64_t n = remainder.numel();
  check_remainders(model, remainder, ties, "join_master");
  check_flat_f32(master, n, "join_master", "master");
  if (n == 0) return;
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>((n + 255) / 256, ctx.num_sms * 16LL));
  join_master_kernel<<<grid, 256, 0, ctx.stream>>>(master.ptr<float>(), model.ptr<const uint16_t>(),
                                                   remainder.ptr<const int16_t>(), n, tie_arg(ties));
  MT_CUDA_CHECK_LAUNCH();
}

void sgd_step(const KernelContext& ctx, Tensor master, Tensor grad, Tensor momentum, Tensor model_param,
              const SegmentArg& segs, const OptimStepParams& p) {
  const int64_t n = master.numel();
  check_flat_f32(master, n, "sgd_step", "master");
  check_optimizer_grad(grad, n, "sgd_step");
  const bool use_momentum = p.sgd_momentum != 0.0f && !momentum.empty();  // as the reference: no buffer, plain SGD
  if (use_momentum) check_flat_f32(momentum, n, "sgd_step", "momentum");
  MT_CHECK(model_param.empty() || model_param.numel() == n, "sgd_step: model_param {} vs {} elements",
           model_param.shape_string(), n);
  check_segments_fit(segs, n, "sgd_step");
  if (segs.total_chunks == 0) return;
  const unsigned grid = chunk_grid(ctx, segs.total_chunks);
  MT_DISPATCH_GRAD(grad.dtype, G, "sgd_step (grad)", {
    SgdArgs<G> a{master.ptr<float>(), grad.ptr<const G>(), use_momentum ? momentum.ptr<float>() : nullptr,
                 model_param.data, {}, {}, p.sgd_momentum, p.grad_scale};
    for (int g = 0; g < OptimStepParams::kMaxGroups; ++g) {
      a.lr[g] = p.lr[g];
      a.wd[g] = p.weight_decay[g];
    }
    dispatch_model(model_param, "sgd_step", [&]<typename M>() {
      sgd_kernel<M, G><<<grid, kOptimThreads, 0, ctx.stream>>>(a, segs);
    });
  });
  MT_CUDA_CHECK_LAUNCH();
}

namespace {
template <typename Launch>
void two_stage_sum(const KernelContext& ctx, Tensor out, const SegmentArg& segs, bool accumulate, const char* what,
                   Launch&& launch_partials) {
  MT_CHECK(out.numel() == 1 && out.dtype == DType::f32, "{}: out must be float32 [1]", what);
  const unsigned grid = static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(segs.total_chunks, ctx.num_sms * 8LL)));
  double* partial = ctx.scratch->take_array<double>(grid, what);
  launch_partials(partial, grid);
  MT_CUDA_CHECK_LAUNCH();
  finish_sum_kernel<<<1, kReduceBlock, 0, ctx.stream>>>(out.ptr<float>(), partial, static_cast<int>(grid), accumulate);
  MT_CUDA_CHECK_LAUNCH();
}
// Word j of the n bytes at p (little-endian, the last one zero-padded); aligned: p is 8-byte
// aligned, so whole words load at once.
__device__ __forceinline__ uint64_t load_word(const unsigned char* p, uint64_t n, uint64_t j, bool aligned) {
  const uint64_t at = j * 8;
  if (aligned && at + 8 <= n) return reinterpret_cast<const uint64_t*>(p)[j];
  uint64_t w = 0;
  for (uint64_t b = 0; b < 8 && at + b < n; ++b) w |= static_cast<uint64_t>(p[at + b]) << (8 * b);
  return w;
}

__device__ __forceinline__ unsigned long long warp_sum_u64(unsigned long long v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// out (zeroed before) += byte_hash(p, n): each block sums its words' terms (block 0 also the length
// term) and adds the sum with one atomic.
__global__ void hash_bytes_kernel(unsigned long long* out, const unsigned char* p, uint64_t n, bool aligned) {
  const uint64_t words = (n + 7) / 8;
  unsigned long long s = 0;
  for (uint64_t j = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; j < words;
       j += static_cast<uint64_t>(gridDim.x) * blockDim.x)
    s += byte_hash_term(load_word(p, n, j, aligned), j);
  if (blockIdx.x == 0 && threadIdx.x == 0) s += hash_fmix64(n);
  __shared__ unsigned long long partial[kWarp];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
  s = warp_sum_u64(s);
  if (lane == 0) partial[warp] = s;
  __syncthreads();
  if (warp == 0) {
    s = warp_sum_u64(lane < warps ? partial[lane] : 0ull);
    if (lane == 0) atomicAdd(out, s);
  }
}

}  // namespace

void sum_squares(const KernelContext& ctx, Tensor out, Tensor x, const SegmentArg& segs, bool accumulate) {
  two_stage_sum(ctx, out, segs, accumulate, "sum_squares", [&](double* partial, unsigned grid) {
    MT_DISPATCH_FLOAT(x.dtype, T, "sum_squares", {
      sum_squares_partial_kernel<<<grid, kReduceBlock, 0, ctx.stream>>>(partial, PlainSource<T>{x.ptr<const T>()}, segs,
                                                                        aligned16(x.data));
    });
  });
}

void master_sum_squares(const KernelContext& ctx, Tensor out, Tensor model, Tensor remainder, TieBits ties,
                        const SegmentArg& segs, bool accumulate) {
  check_remainders(model, remainder, ties, "master_sum_squares");
  MT_CHECK(!ties.empty(), "master_sum_squares: the master weights' tie bits");
  two_stage_sum(ctx, out, segs, accumulate, "master_sum_squares", [&](double* partial, unsigned grid) {
    // (Four-element accesses exactly where a float32 buffer at these elements would take them.)
    sum_squares_partial_kernel<<<grid, kReduceBlock, 0, ctx.stream>>>(
        partial, MasterSource{model.ptr<const uint16_t>(), remainder.ptr<const int16_t>(), tie_arg(ties)}, segs,
        aligned8(model.data) && aligned8(remainder.data));
  });
}

void count_zeros(const KernelContext& ctx, Tensor out, Tensor x, const SegmentArg& segs, bool accumulate) {
  two_stage_sum(ctx, out, segs, accumulate, "count_zeros", [&](double* partial, unsigned grid) {
    MT_DISPATCH_FLOAT(x.dtype, T, "count_zeros", {
      count_zeros_partial_kernel<T><<<grid, kReduceBlock, 0, ctx.stream>>>(partial, x.ptr<const T>(), segs);
    });
  });
}

void hash_bytes(const KernelContext& ctx, Tensor out, Tensor x) {
  MT_CHECK(out.dtype == DType::i64 && out.numel() == 1, "hash_bytes: out must be int64 [1], got {} {}",
           dtype_name(out.dtype), out.shape_string());
  const uint64_t n = x.empty() ? 0 : x.nbytes();
  MT_CUDA_CHECK(cudaMemsetAsync(out.data, 0, sizeof(uint64_t), ctx.stream));
  const unsigned grid = grid_for(static_cast<int64_t>((n + 7) / 8), kReduceBlock, ctx.num_sms * 4LL);
  hash_bytes_kernel<<<grid, kReduceBlock, 0, ctx.stream>>>(out.ptr<unsigned long long>(),
                                                           static_cast<const unsigned char*>(x.data), n,
                                                           (reinterpret_cast<uintptr_t>(x.data) & 7u) == 0);
  MT_CUDA_CHECK_LAUNCH();
}

}  // namespace mt::cuda
