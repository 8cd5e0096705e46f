// The attention blocks of context parallelism (engine/backend.h, "attention blocks") on the CUDA
// backend, composed from the ordinary attention: no attention kernel of their own.
//
// engine/blocks/attention_cp.cpp forms blocks of c queries against c keys (c = a.seq) that are
// either the diagonal block (the queries' own positions: causal) or lie wholly before their
// queries (every key visible: no mask). Either is plain attention over c packed QKV rows, so a
// block op assembles those rows in a buffer reserved at set-up (the query parts from q, the key
// and value parts from kv), runs attention_forward / attention_backward on them with the
// implementation --attention-backend chose (flash or cuDNN), and the backward scatters the
// gradient rows back: the query parts into dq, the key and value parts into dkv. The backward
// takes the MERGED out and lse of the queries, as flash attention's backward does (P against the
// merged lse, D = rowsum(dO * O) of the merged output), which yields exactly this block's share
// of dQ, dK and dV. A block that no query sees (wholly after its queries) is empty: out = 0,
// lse = -inf, no gradient. Partly visible blocks and sliding windows are refused (Unsupported).
//
// Packed documents: the block's queries get their document starts in the block's key coordinates
// (the whole sequence's starts minus k_begin, clamped to [0, c]), and the attention runs with
// documents: on the diagonal causally, against earlier keys unmasked but for the documents, where
// a query whose document starts after the block's keys sees none of them (lse -inf, out 0).
//
// Dropout: the standard op draws its mask by local indices (engine/attention_dropout.h with the
// block's c positions), so each block draws with its own key, the layer's key mixed with the
// block's first query and key positions: blocks are independent and forward and backward agree,
// but the masks are NOT the reference backend's, which draws by global positions in the whole
// sequence (blk.seq_total). With dropout the CUDA and reference context-parallel runs therefore
// differ (each is a valid dropout); without dropout they compute the same thing.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "core/error.h"
#include "core/philox.h"
#include "cuda/cuda_backend.h"
#include "cuda/cuda_backend_dispatch.h"
#include "cuda/cuda_check.h"
#include "cuda/device_utils.cuh"

namespace mt {

using cuda_dispatch::on_device;

namespace {

constexpr int kThreads = 256;

// ---- packed QKV rows <-> a block's parts ----------------------------------------------------------
// Packed QKV rows: per row and group [q: hpg * d][k: d][v: d]; kv rows: per row and group [k: d][v: d].
enum class Parts {
  assemble,       // packed = q's query parts and kv's key/value parts (a block's rows)
  scatter_add,    // q (dq) query parts += packed's; kv (dkv) += packed's key/value parts
  kv_pack,        // kv = packed's key/value parts
  kv_unpack_add,  // packed's key/value parts += kv
};

struct PartsArgs {
  void* packed = nullptr;  // [rows, groups * (q_units + kv_units) * N]
  void* q = nullptr;       // the packed layout as well: assemble's queries, scatter_add's dq
  void* kv = nullptr;      // [rows, groups * kv_units * N]
  int64_t rows = 0, groups = 0;
  int64_t q_units = 0, kv_units = 0;  // per group, in vectors of N elements
};

// N elements: one 16-byte access where N * sizeof(T) == 16 (16-byte aligned: checked on the host).
template <int N, typename T>
__device__ __forceinline__ void copy_vec(T* dst, const T* src) {
  if constexpr (N * sizeof(T) == 16) {
    *reinterpret_cast<int4*>(dst) = *reinterpret_cast<const int4*>(src);
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) dst[j] = src[j];
  }
}
// dst += src, in float32, rounded once to T.
template <int N, typename T>
__device__ __forceinline__ void add_vec(T* dst, const T* src) {
  cuda::Floats<N> a = cuda::load_vec<N>(dst);
  const cuda::Floats<N> b = cuda::load_vec<N>(src);
#pragma unroll
  for (int j = 0; j < N; ++j) a.v[j] += b.v[j];
  cuda::store_vec<N>(dst, a);
}

// One thread per vector of N elements of the parts the op touches: the whole packed row
// (assemble, scatter_add) or its key/value parts (kv_pack, kv_unpack_add).
template <typename T, int N, Parts OP>
__global__ void __launch_bounds__(kThreads) qkv_parts_kernel(const PartsArgs a) {
  constexpr bool kWhole = OP == Parts::assemble || OP == Parts::scatter_add;
  const int64_t per_group = kWhole ? a.q_units + a.kv_units : a.kv_units;
  const int64_t n = a.rows * a.groups * per_group;
  T* const packed = static_cast<T*>(a.packed);
  T* const kv = static_cast<T*>(a.kv);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t rg = i / per_group;                                  // row * groups + group
    const int64_t o = i - rg * per_group + (kWhole ? 0 : a.q_units);   // vector within the group's run
    const int64_t p = (rg * (a.q_units + a.kv_units) + o) * N;         // element offset in packed rows
    if (kWhole && o < a.q_units) {
      if constexpr (OP == Parts::assemble) copy_vec<N>(packed + p, static_cast<const T*>(a.q) + p);
      else if constexpr (OP == Parts::scatter_add) add_vec<N>(static_cast<T*>(a.q) + p, packed + p);
    } else {
      const int64_t k = (rg * a.kv_units + (o - a.q_units)) * N;       // element offset in kv rows
      if constexpr (OP == Parts::assemble) copy_vec<N>(packed + p, kv + k);
      else if constexpr (OP == Parts::scatter_add) add_vec<N>(kv + k, packed + p);
      else if constexpr (OP == Parts::kv_pack) copy_vec<N>(kv + k, packed + p);
      else add_vec<N>(packed + p, kv + k);
    }
  }
}

unsigned grid_of(int64_t work, int num_sms) {
  return cuda::grid_for(work, kThreads, static_cast<int64_t>(num_sms) * 16);
}

// Vectors of 16 bytes where the head dim allows and every pointer is 16-byte aligned (a row
// slice of any of these tensors keeps the alignment: row widths are multiples of d), else
// single elements.
bool vector_aligned(int64_t head_dim, size_t elem, std::initializer_list<const void*> ptrs) {
  if ((head_dim * static_cast<int64_t>(elem)) % 16 != 0) return false;
  for (const void* p : ptrs)
    if (p && !cuda::aligned16(p)) return false;
  return true;
}

void launch_parts(Parts op, DType dtype, PartsArgs args, int64_t head_dim, int hpg, cudaStream_t stream,
                  int num_sms, const char* what) {
  if (args.rows == 0) return;
  const size_t elem = dtype_size(dtype);
  const bool vec = vector_aligned(head_dim, elem, {args.packed, args.q, args.kv});
  MT_DISPATCH_FLOAT(dtype, T, what, {
    auto go = [&]<int N>() {
      args.q_units = hpg * head_dim / N;
      args.kv_units = 2 * head_dim / N;
      const int64_t per_group = (op == Parts::assemble || op == Parts::scatter_add) ? args.q_units + args.kv_units
                                                                                     : args.kv_units;
      const unsigned grid = grid_of(args.rows * args.groups * per_group, num_sms);
      switch (op) {
        case Parts::assemble: qkv_parts_kernel<T, N, Parts::assemble><<<grid, kThreads, 0, stream>>>(args); break;
        case Parts::scatter_add: qkv_parts_kernel<T, N, Parts::scatter_add><<<grid, kThreads, 0, stream>>>(args); break;
        case Parts::kv_pack: qkv_parts_kernel<T, N, Parts::kv_pack><<<grid, kThreads, 0, stream>>>(args); break;
        case Parts::kv_unpack_add:
          qkv_parts_kernel<T, N, Parts::kv_unpack_add><<<grid, kThreads, 0, stream>>>(args);
          break;
      }
    };
    if (vec) go.template operator()<static_cast<int>(16 / sizeof(T))>();
    else go.template operator()<1>();
  });
  MT_CUDA_CHECK_LAUNCH();
}

// ---- merge -------------------------------------------------------------------------------------
// One sub-warp of `lanes` threads (a power of two <= 32) per (row, head): all its lanes read the
// two lse values, combine the d outputs in vectors of N, and after __syncwarp its first lane
// writes the merged lse (so no lane reads an lse already merged). Loops are uniform per warp.
template <typename T, int N>
__global__ void __launch_bounds__(kThreads) merge_kernel(T* out, float* lse, const T* out_blk, const float* lse_blk,
                                                         int64_t b, int64_t heads, int64_t s, int units, int lanes) {
  const int lane = threadIdx.x % cuda::kWarp, sub = lane / lanes, sl = lane % lanes, per_warp = cuda::kWarp / lanes;
  const int64_t pairs = b * s * heads;  // (row t * b + i, head h), in out's order
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / cuda::kWarp;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.x / cuda::kWarp;
  const float neg_inf = -INFINITY;
  for (int64_t base = warp * per_warp; base < pairs; base += warps * per_warp) {
    const int64_t r = base + sub;
    const bool valid = r < pairs;
    int64_t li = 0;
    float merged = neg_inf;
    if (valid) {
      const int64_t h = r % heads, row = r / heads, i = row % b, t = row / b;
      li = (i * heads + h) * s + t;
      const float l1 = lse[li], l2 = lse_blk[li];
      const float hi = fmaxf(l1, l2), lo = fminf(l1, l2);
      T* dst = out + r * units * N;
      const T* src = out_blk + r * units * N;
      if (hi == neg_inf) {  // neither side saw a key
        const cuda::Floats<N> zero{};
        for (int u = sl; u < units; u += lanes) cuda::store_vec<N>(dst + u * N, zero);
      } else {
        merged = hi + log1pf(expf(lo - hi));
        // A side that saw no key has weight 0 and is not read.
        const float w1 = l1 == neg_inf ? 0.0f : expf(l1 - merged);
        const float w2 = l2 == neg_inf ? 0.0f : expf(l2 - merged);
        for (int u = sl; u < units; u += lanes) {
          cuda::Floats<N> v{};
          if (w1 != 0.0f) {
            const cuda::Floats<N> x = cuda::load_vec<N>(dst + u * N);
#pragma unroll
            for (int j = 0; j < N; ++j) v.v[j] = x.v[j] * w1;
          }
          if (w2 != 0.0f) {
            const cuda::Floats<N> y = cuda::load_vec<N>(src + u * N);
#pragma unroll
            for (int j = 0; j < N; ++j) v.v[j] += y.v[j] * w2;
          }
          cuda::store_vec<N>(dst + u * N, v);
        }
      }
    }
    __syncwarp();
    if (valid && sl == 0) lse[li] = merged;
  }
}

// ---- attention sinks ---------------------------------------------------------------------------
// The sink of head h is a block that every row sees, with lse s_h and output 0: forward merges it
// as merge_kernel does (one sub-warp per (row, head)). Backward first writes each (row, head)'s
// exp(s_h - lse) * rowsum(dout * out) into the scratch, head-major, one sub-warp per pair; then one
// block per head adds its rows in a fixed order (so the result repeats bit for bit).
template <typename S>
__device__ __forceinline__ float sink_of(const S* sink, int64_t h) {
  return sink ? cuda::to_float(sink[h]) : 0.0f;
}

template <typename T, typename S, int N>
__global__ void __launch_bounds__(kThreads) sink_forward_kernel(T* out, float* lse, const S* sink, int64_t b,
                                                                int64_t heads, int64_t s, int units, int lanes) {
  const int lane = threadIdx.x % cuda::kWarp, sub = lane / lanes, sl = lane % lanes, per_warp = cuda::kWarp / lanes;
  const int64_t pairs = b * s * heads;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / cuda::kWarp;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.x / cuda::kWarp;
  for (int64_t base = warp * per_warp; base < pairs; base += warps * per_warp) {
    const int64_t r = base + sub;
    const bool valid = r < pairs;
    int64_t li = 0;
    float merged = 0;
    if (valid) {
      const int64_t h = r % heads, row = r / heads, i = row % b, t = row / b;
      li = (i * heads + h) * s + t;
      const float l = lse[li], sh = sink_of(sink, h);
      const float hi = fmaxf(l, sh), lo = fminf(l, sh);
      merged = hi + log1pf(expf(lo - hi));
      const float w = expf(l - merged);  // 0 for a row that saw no key (l = -inf)
      T* dst = out + r * units * N;
      for (int u = sl; u < units; u += lanes) {
        cuda::Floats<N> x = cuda::load_vec<N>(dst + u * N);
#pragma unroll
        for (int j = 0; j < N; ++j) x.v[j] *= w;
        cuda::store_vec<N>(dst + u * N, x);
      }
    }
    __syncwarp();
    if (valid && sl == 0) lse[li] = merged;
  }
}

// terms[h * rows + (row - row0)] for the rows [row0, row0 + rows) (row t * b + i).
template <typename T, typename S, int N>
__global__ void __launch_bounds__(kThreads) sink_terms_kernel(float* terms, const T* dout, const T* out,
                                                              const float* lse, const S* sink, int64_t b,
                                                              int64_t heads, int64_t s, int64_t row0, int64_t rows,
                                                              int units, int lanes) {
  const int lane = threadIdx.x % cuda::kWarp, sub = lane / lanes, sl = lane % lanes, per_warp = cuda::kWarp / lanes;
  const int64_t pairs = rows * heads;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / cuda::kWarp;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.x / cuda::kWarp;
  for (int64_t base = warp * per_warp; base < pairs; base += warps * per_warp) {
    const int64_t r = base + sub;
    const bool valid = r < pairs;
    const int64_t h = r % heads, rr = r / heads, row = row0 + rr;
    float acc = 0;
    if (valid) {
      const int64_t off = (row * heads + h) * units * N;
      for (int u = sl; u < units; u += lanes) {
        const cuda::Floats<N> g = cuda::load_vec<N>(dout + off + u * N), o = cuda::load_vec<N>(out + off + u * N);
#pragma unroll
        for (int j = 0; j < N; ++j) acc += g.v[j] * o.v[j];
      }
    }
    for (int m = lanes / 2; m > 0; m /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, m);
    if (valid && sl == 0) {
      const int64_t i = row % b, t = row / b;
      terms[h * rows + rr] = expf(sink_of(sink, h) - lse[(i * heads + h) * s + t]) * acc;
    }
  }
}

// dsink[h] -= the sum of terms[h * rows ...]: one block per head, a fixed order.
template <typename G>
__global__ void __launch_bounds__(kThreads) sink_reduce_kernel(G* dsink, const float* terms, int64_t rows) {
  __shared__ float part[kThreads];
  const int64_t h = blockIdx.x;
  float acc = 0;
  for (int64_t j = threadIdx.x; j < rows; j += kThreads) acc += terms[h * rows + j];
  part[threadIdx.x] = acc;
  __syncthreads();
  for (int w = kThreads / 2; w > 0; w /= 2) {
    if (threadIdx.x < w) part[threadIdx.x] += part[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) cuda::grad_add(dsink + h, -part[0]);
}

// ---- the blocks the CUDA backend runs ---------------------------------------------------------
enum class BlockKind { diagonal, full, hidden };

std::string block_text(const AttentionShape& a, const AttentionBlock& blk) {
  return fmt::format("queries [{}, {}) against keys [{}, {})", blk.q_begin, blk.q_begin + a.seq, blk.k_begin,
                     blk.k_begin + blk.kv_len);
}

[[noreturn]] void refuse_window(const AttentionShape& a) {
  throw Unsupported(fmt::format(
      "--context-parallel-size > 1 with a sliding window (--window-size {},0) is not on the CUDA backend yet (its "
      "attention blocks run the causal diagonal and wholly visible blocks only); use --context-parallel-size 1",
      a.window_left));
}

// Which of its kinds a block is, or Unsupported. Also the checks of the reference backend's
// blocks (positions inside the sequence, at least one key).
BlockKind classify_block(const AttentionShape& a, const AttentionBlock& blk, const char* op) {
  if (blk.kv_len <= 0 || blk.q_begin < 0 || blk.k_begin < 0 || blk.q_begin + a.seq > blk.seq_total ||
      blk.k_begin + blk.kv_len > blk.seq_total)
    fail("{}: {} must lie in a sequence of {} positions (and hold at least one key)", op, block_text(a, blk),
         blk.seq_total);
  if (a.windowed()) refuse_window(a);
  if (!a.causal || (blk.k_begin + blk.kv_len - 1 <= blk.q_begin)) {
    if (blk.kv_len == a.seq) return BlockKind::full;
  } else if (blk.q_begin == blk.k_begin && blk.kv_len == a.seq) {
    return BlockKind::diagonal;
  } else if (blk.k_begin > blk.q_begin + a.seq - 1) {
    return BlockKind::hidden;
  }
  throw Unsupported(fmt::format(
      "--context-parallel-size > 1: the CUDA backend's attention blocks are c queries against the same c positions "
      "(causal) or c earlier ones; {} (c = {}) is not one of them (a partly visible block)",
      block_text(a, blk), a.seq));
}

void check_numel(const Tensor& t, int64_t numel, DType dtype, const char* op, const char* name) {
  MT_CHECK(t.numel() == numel && t.dtype == dtype, "{}: {} is {} {}, expected {} elements of {}", op, name,
           dtype_name(t.dtype), t.shape_string(), numel, dtype_name(dtype));
}

int64_t kv_row_width(const AttentionShape& a) { return static_cast<int64_t>(a.groups) * 2 * a.head_dim; }

// The parts kernels' arguments (launch_parts fills in the units).
PartsArgs parts_args(void* packed, void* q, void* kv, int64_t rows, int64_t groups) {
  PartsArgs args;
  args.packed = packed;
  args.q = q;
  args.kv = kv;
  args.rows = rows;
  args.groups = groups;
  return args;
}

void check_shape(const AttentionShape& a, const char* op) {
  if (a.batch <= 0 || a.seq <= 0 || a.heads <= 0 || a.groups <= 0 || a.head_dim <= 0 || a.heads % a.groups != 0)
    fail("{}: invalid shape b={} s={} heads={} groups={} d={} (heads must be a multiple of groups)", op, a.batch,
         a.seq, a.heads, a.groups, a.head_dim);
}

// Packed documents: local[i * c + t] = the document start of global query q_begin + t of sample i,
// in the block's key coordinates (minus k_begin), clamped to [0, c] (c: the block's keys, = its
// queries). doc holds the whole sequence's starts, [b * seq_total].
__global__ void __launch_bounds__(kThreads) block_doc_kernel(int32_t* local, const int32_t* doc, int64_t b, int64_t c,
                                                             int64_t seq_total, int64_t q_begin, int64_t k_begin) {
  for (int64_t x = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; x < b * c;
       x += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = x / c, t = x - i * c;
    const int64_t v = static_cast<int64_t>(doc[i * seq_total + q_begin + t]) - k_begin;
    local[x] = static_cast<int32_t>(v < 0 ? 0 : v > c ? c : v);
  }
}

}  // namespace

// ---- set-up -------------------------------------------------------------------------------------
void CudaBackend::reserve_attention_blocks(const AttentionShape& a, int max_kv_len, DType dtype) {
  check_shape(a, "reserve_attention_blocks");
  if (a.windowed()) refuse_window(a);
  if (max_kv_len != a.seq)
    throw Unsupported(fmt::format(
        "--context-parallel-size > 1: the CUDA backend's attention blocks are c queries against c keys, not {} "
        "queries against up to {} keys",
        a.seq, max_kv_len));
  if (dtype != DType::bf16 && dtype != DType::f16 && dtype != DType::f32)
    throw Unsupported(fmt::format("--context-parallel-size > 1: attention blocks on {} activations (the CUDA "
                                  "backend runs bf16, fp16 and float32)",
                                  dtype_name(dtype)));
  // The blocks' two attentions (diagonal: causal; earlier keys: none masked), with the
  // implementation already chosen (auto unless reserve_attention chose one): their workspace and
  // checks. reserve_attention keeps the larger workspace of every reservation.
  AttentionShape blk = a;
  for (bool causal : {true, false}) {
    blk.causal = causal;
    reserve_attention(blk, attention_backend_, dtype);
  }
  if (a.documents)
    reserve_buffer(block_doc_, block_doc_bytes_, static_cast<size_t>(a.batch) * static_cast<size_t>(a.seq) * sizeof(int32_t));
  const size_t need =
      static_cast<size_t>(a.batch) * static_cast<size_t>(a.seq) * static_cast<size_t>(a.qkv_row_stride()) * dtype_size(dtype);
  size_t dqkv_bytes = block_qkv_bytes_;  // (the two buffers have the same size)
  reserve_buffer(block_dqkv_, dqkv_bytes, need);
  reserve_buffer(block_qkv_, block_qkv_bytes_, need);
}

// ---- the ops ------------------------------------------------------------------------------------
AttentionShape CudaBackend::assemble_attention_block(const char* op, Tensor q, Tensor kv, const AttentionShape& a,
                                                     const AttentionBlock& blk) {
  const int64_t rows = static_cast<int64_t>(a.batch) * a.seq;
  check_numel(q, rows * a.qkv_row_stride(), q.dtype, op, "q");
  check_numel(kv, static_cast<int64_t>(a.batch) * blk.kv_len * kv_row_width(a), q.dtype, op, "kv");
  const size_t need = q.nbytes();
  MT_CHECK(need <= block_qkv_bytes_,
           "{}: a block of {} rows of {} needs {} bytes of block buffer, {} reserved (call reserve_attention_blocks "
           "at set-up)",
           op, rows, dtype_name(q.dtype), need, block_qkv_bytes_);
  AttentionShape ab = a;
  ab.causal = classify_block(a, blk, op) == BlockKind::diagonal;
  if (a.dropout_p > 0)
    ab.dropout_key = mix_key(mix_key(a.dropout_key, static_cast<uint64_t>(blk.q_begin)), static_cast<uint64_t>(blk.k_begin));
  if (a.documents) {
    const int64_t b = a.batch, c = a.seq;
    MT_CHECK(a.doc_start.dtype == DType::i32 && a.doc_start.device == Device::cuda &&
                 a.doc_start.numel() == b * blk.seq_total,
             "{}: documents need doc_start as device int32 [{}] (b * the whole sequence)", op, b * blk.seq_total);
    MT_CHECK(static_cast<size_t>(b * c) * sizeof(int32_t) <= block_doc_bytes_,
             "{}: the block's document starts need {} bytes, {} reserved (reserve_attention_blocks with documents)", op,
             b * c * 4, block_doc_bytes_);
    block_doc_kernel<<<grid_of(b * c, num_sms_), kThreads, 0, stream_>>>(static_cast<int32_t*>(block_doc_),
                                                                         a.doc_start.ptr<int32_t>(), b, c,
                                                                         blk.seq_total, blk.q_begin, blk.k_begin);
    MT_CUDA_CHECK_LAUNCH();
    ab.doc_start = Tensor(block_doc_, DType::i32, Device::cuda, {b * c});
  }
  MT_PROFILE_OP("attention_block assemble b{} s{} h{}/{} d{}", a.batch, a.seq, a.heads, a.groups, a.head_dim);
  launch_parts(Parts::assemble, q.dtype, parts_args(block_qkv_, q.data, kv.data, rows, a.groups), a.head_dim, a.heads / a.groups, stream_, num_sms_, op);
  return ab;
}

void CudaBackend::attention_block_forward(Tensor out, Tensor lse, Tensor q, Tensor kv, const AttentionShape& a,
                                          const AttentionBlock& blk) {
  const char* op = "attention_block_forward";
  on_device(op, out, lse, q, kv);
  check_shape(a, op);
  const int64_t rows = static_cast<int64_t>(a.batch) * a.seq;
  check_numel(out, rows * a.heads * a.head_dim, q.dtype, op, "out");
  check_numel(lse, rows * a.heads, DType::f32, op, "lse");
  if (classify_block(a, blk, op) == BlockKind::hidden) {  // no query sees a key of this block
    MT_PROFILE_OP("attention_block_forward (no visible key) b{} s{}", a.batch, a.seq);
    cuda::fill(context(), out, 0.0);
    cuda::fill(context(), lse, -std::numeric_limits<double>::infinity());
    return;
  }
  const AttentionShape ab = assemble_attention_block(op, q, kv, a, blk);
  attention_forward(out, lse, Tensor(block_qkv_, q.dtype, Device::cuda, {rows, a.qkv_row_stride()}), ab);
}

void CudaBackend::attention_block_backward(Tensor dq, Tensor dkv, Tensor dout, Tensor out, Tensor lse, Tensor q,
                                           Tensor kv, const AttentionShape& a, const AttentionBlock& blk) {
  const char* op = "attention_block_backward";
  on_device(op, dq, dkv, dout, out, lse, q, kv);
  check_shape(a, op);
  const int64_t rows = static_cast<int64_t>(a.batch) * a.seq;
  check_numel(dq, rows * a.qkv_row_stride(), q.dtype, op, "dq");
  check_numel(dkv, static_cast<int64_t>(a.batch) * blk.kv_len * kv_row_width(a), q.dtype, op, "dkv");
  check_numel(dout, rows * a.heads * a.head_dim, q.dtype, op, "dout");
  check_numel(out, rows * a.heads * a.head_dim, q.dtype, op, "out");
  check_numel(lse, rows * a.heads, DType::f32, op, "lse");
  if (classify_block(a, blk, op) == BlockKind::hidden) return;  // no gradient
  const AttentionShape ab = assemble_attention_block(op, q, kv, a, blk);
  const Tensor packed(block_qkv_, q.dtype, Device::cuda, {rows, a.qkv_row_stride()});
  const Tensor dpacked(block_dqkv_, q.dtype, Device::cuda, {rows, a.qkv_row_stride()});
  // With documents, queries whose document starts after these keys get no dQ from the backward
  // (no key block reaches them): zero, as they are.
  if (a.documents && !ab.causal) cuda::fill(context(), dpacked, 0.0);
  attention_backward(dpacked, dout, out, lse, packed, ab);
  MT_PROFILE_OP("attention_block scatter b{} s{} h{}/{} d{}", a.batch, a.seq, a.heads, a.groups, a.head_dim);
  launch_parts(Parts::scatter_add, q.dtype, parts_args(block_dqkv_, dq.data, dkv.data, rows, a.groups), a.head_dim, a.heads / a.groups, stream_, num_sms_, op);
}

namespace {
// The shape [b, heads, s] and head width of an attention output out [s * b, heads * d] and its lse
// [b, heads, s] (float32), checked.
struct LseDims {
  int64_t b, heads, s, d;
};
LseDims lse_dims(const char* op, Tensor out, Tensor lse) {
  MT_CHECK(lse.ndim == 3 && lse.dtype == DType::f32, "{}: lse must be float32 [b, heads, s], got {} {}", op,
           dtype_name(lse.dtype), lse.shape_string());
  const int64_t b = lse.size(0), heads = lse.size(1), s = lse.size(2);
  MT_CHECK(heads > 0 && out.rows() == b * s && out.cols() > 0 && out.cols() % heads == 0,
           "{}: out {} is not [b * s, heads * d] for lse {}", op, out.shape_string(), lse.shape_string());
  return {b, heads, s, out.cols() / heads};
}

// Sub-warp lanes for `units` vectors per (row, head): a power of two up to a warp.
int lanes_for(int units) {
  int lanes = 1;
  while (lanes < units && lanes < cuda::kWarp) lanes *= 2;
  return lanes;
}
}  // namespace

void CudaBackend::attention_merge(Tensor out, Tensor lse, Tensor out_blk, Tensor lse_blk) {
  const char* op = "attention_merge";
  on_device(op, out, lse, out_blk, lse_blk);
  const auto [b, heads, s, d] = lse_dims(op, out, lse);
  MT_CHECK(lse_blk.dtype == DType::f32 && lse_blk.numel() == lse.numel(),
           "{}: lse {} {} and lse_blk {} {} must be float32 of the same size", op, dtype_name(lse.dtype),
           lse.shape_string(), dtype_name(lse_blk.dtype), lse_blk.shape_string());
  MT_CHECK(out_blk.dtype == out.dtype && out_blk.numel() == out.numel(), "{}: out_blk {} {} differs from out {} {}", op,
           dtype_name(out_blk.dtype), out_blk.shape_string(), dtype_name(out.dtype), out.shape_string());
  MT_PROFILE_OP("attention_merge {}", out.shape_string());
  if (lse.numel() == 0) return;
  const bool vec = vector_aligned(d, dtype_size(out.dtype), {out.data, out_blk.data});
  MT_DISPATCH_FLOAT(out.dtype, T, op, {
    auto go = [&]<int N>() {
      const int units = static_cast<int>(d / N), lanes = lanes_for(units);
      const int64_t warps = (b * s * heads + cuda::kWarp / lanes - 1) / (cuda::kWarp / lanes);
      const unsigned grid = grid_of(warps * cuda::kWarp, num_sms_);
      merge_kernel<T, N><<<grid, kThreads, 0, stream_>>>(out.ptr<T>(), lse.ptr<float>(), out_blk.ptr<const T>(),
                                                         lse_blk.ptr<const float>(), b, heads, s, units, lanes);
    };
    if (vec) go.template operator()<static_cast<int>(16 / sizeof(T))>();
    else go.template operator()<1>();
  });
  MT_CUDA_CHECK_LAUNCH();
}

namespace {
// lse_dims plus the sinks [heads] (or empty).
LseDims sink_dims(const char* op, Tensor out, Tensor lse, Tensor sink) {
  const LseDims D = lse_dims(op, out, lse);
  MT_CHECK(sink.empty() || sink.numel() == D.heads, "{}: sink must be [{}], got {}", op, D.heads, sink.shape_string());
  return D;
}
}  // namespace

void CudaBackend::attention_sink_forward(Tensor out, Tensor lse, Tensor sink) {
  const char* op = "attention_sink_forward";
  on_device(op, out, lse);
  if (!sink.empty()) on_device(op, sink);
  const LseDims D = sink_dims(op, out, lse, sink);
  MT_PROFILE_OP("attention_sink_forward {}", out.shape_string());
  if (lse.numel() == 0) return;
  const bool vec = vector_aligned(D.d, dtype_size(out.dtype), {out.data});
  const DType sink_dtype = sink.empty() ? DType::f32 : sink.dtype;
  MT_DISPATCH_FLOAT(out.dtype, T, op, MT_DISPATCH_FLOAT(sink_dtype, S, op, {
    auto go = [&]<int N>() {
      const int units = static_cast<int>(D.d / N), lanes = lanes_for(units);
      const int64_t warps = (D.b * D.s * D.heads + cuda::kWarp / lanes - 1) / (cuda::kWarp / lanes);
      sink_forward_kernel<T, S, N><<<grid_of(warps * cuda::kWarp, num_sms_), kThreads, 0, stream_>>>(
          out.ptr<T>(), lse.ptr<float>(), sink.empty() ? nullptr : sink.ptr<const S>(), D.b, D.heads, D.s, units,
          lanes);
    };
    if (vec) go.template operator()<static_cast<int>(16 / sizeof(T))>();
    else go.template operator()<1>();
  }));
  MT_CUDA_CHECK_LAUNCH();
}

void CudaBackend::attention_sink_backward(Tensor dsink, Tensor dout, Tensor out, Tensor lse, Tensor sink) {
  const char* op = "attention_sink_backward";
  on_device(op, dsink, dout, out, lse);
  if (!sink.empty()) on_device(op, sink);
  const LseDims D = sink_dims(op, out, lse, sink);
  MT_CHECK(dout.dtype == out.dtype && dout.numel() == out.numel(), "{}: dout {} {} differs from out {} {}", op,
           dtype_name(dout.dtype), dout.shape_string(), dtype_name(out.dtype), out.shape_string());
  MT_CHECK(dsink.numel() == D.heads, "{}: dsink must be [{}], got {}", op, D.heads, dsink.shape_string());
  MT_PROFILE_OP("attention_sink_backward {}", out.shape_string());
  const int64_t total_rows = D.b * D.s;
  if (total_rows == 0) return;
  cuda::KernelContext ctx = context();
  // The rows in chunks whose terms fit the scratch, added to dsink chunk after chunk.
  const int64_t chunk = std::min<int64_t>(total_rows, static_cast<int64_t>(ctx.scratch->remaining() / sizeof(float) /
                                                                            static_cast<size_t>(D.heads)));
  MT_CHECK(chunk >= 1, "{}: the scratch cannot hold one row's terms for {} heads", op, D.heads);
  float* terms = ctx.scratch->take_array<float>(static_cast<size_t>(chunk * D.heads), "attention_sink_backward terms");
  const bool vec = vector_aligned(D.d, dtype_size(out.dtype), {out.data, dout.data});
  const DType sink_dtype = sink.empty() ? DType::f32 : sink.dtype;
  for (int64_t row0 = 0; row0 < total_rows; row0 += chunk) {
    const int64_t rows = std::min(chunk, total_rows - row0);
    MT_DISPATCH_FLOAT(out.dtype, T, op, MT_DISPATCH_FLOAT(sink_dtype, S, op, {
      auto go = [&]<int N>() {
        const int units = static_cast<int>(D.d / N), lanes = lanes_for(units);
        const int64_t warps = (rows * D.heads + cuda::kWarp / lanes - 1) / (cuda::kWarp / lanes);
        sink_terms_kernel<T, S, N><<<grid_of(warps * cuda::kWarp, num_sms_), kThreads, 0, stream_>>>(
            terms, dout.ptr<const T>(), out.ptr<const T>(), lse.ptr<const float>(),
            sink.empty() ? nullptr : sink.ptr<const S>(), D.b, D.heads, D.s, row0, rows, units, lanes);
      };
      if (vec) go.template operator()<static_cast<int>(16 / sizeof(T))>();
      else go.template operator()<1>();
    }));
    MT_DISPATCH_GRAD(dsink.dtype, G, "attention_sink_backward dsink", {
      sink_reduce_kernel<G><<<static_cast<unsigned>(D.heads), kThreads, 0, stream_>>>(dsink.ptr<G>(), terms, rows);
    });
  }
  MT_CUDA_CHECK_LAUNCH();
}

namespace {
// kv_pack / kv_unpack_add: the key and value parts of packed QKV rows against kv rows.
void launch_kv_parts(Parts part, const char* op, const char* packed_name, Tensor packed, Tensor kv,
                     const AttentionShape& a, cudaStream_t stream, int num_sms) {
  on_device(op, packed, kv);
  check_shape(a, op);
  const int64_t rows = static_cast<int64_t>(a.batch) * a.seq;
  check_numel(packed, rows * a.qkv_row_stride(), packed.dtype, op, packed_name);
  check_numel(kv, rows * kv_row_width(a), packed.dtype, op, part == Parts::kv_pack ? "kv" : "dkv");
  launch_parts(part, packed.dtype, parts_args(packed.data, nullptr, kv.data, rows, a.groups), a.head_dim, a.heads / a.groups, stream, num_sms, op);
}
}  // namespace

void CudaBackend::attention_kv_pack(Tensor kv, Tensor qkv, const AttentionShape& a) {
  MT_PROFILE_OP("attention_kv_pack {}", qkv.shape_string());
  launch_kv_parts(Parts::kv_pack, "attention_kv_pack", "qkv", qkv, kv, a, stream_, num_sms_);
}

void CudaBackend::attention_kv_unpack_add(Tensor dqkv, Tensor dkv, const AttentionShape& a) {
  MT_PROFILE_OP("attention_kv_unpack_add {}", dqkv.shape_string());
  launch_kv_parts(Parts::kv_unpack_add, "attention_kv_unpack_add", "dqkv", dqkv, dkv, a, stream_, num_sms_);
}

}  // namespace mt
