// Elementwise kernels: fill, cast, axpby, GeLU (erf and tanh) and squared ReLU forward/backward, SwiGLU
// forward/backward, the attention output gate (its QKV split/merge and sigmoid gate), bias + dropout
// + residual add, dropout backward.
//
// All of them are memory-bound, so each thread moves 8 elements per step with 16-byte accesses
// (the "VEC" instances, taken when every pointer is 16-byte aligned) and the grid strides over
// the tensor. Math is float32; results are rounded once on store.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "cuda/activations.cuh"
#include "cuda/cuda_check.h"
#include "cuda/device_utils.cuh"
#include "cuda/kernels.h"

namespace mt::cuda {
namespace {

constexpr int kBlock = 256;
constexpr int kN = 8;  // elements per thread per step

// Loads/stores elements [base, base + 8) of a flat tensor of n elements: one vector access in
// the aligned interior, element by element at the tail.
template <bool VEC, typename T>
__device__ __forceinline__ Floats<kN> ld(const T* p, int64_t base, int64_t n) {
  if (VEC && base + kN <= n) return load_vec<kN>(p + base);
  return load_partial<kN>(p + base, n - base);
}
template <bool VEC, typename T>
__device__ __forceinline__ void st(T* p, int64_t base, int64_t n, const Floats<kN>& x) {
  if (VEC && base + kN <= n) store_vec<kN>(p + base, x);
  else store_partial<kN>(p + base, x, n - base);
}

#define MT_FLAT_LOOP(n)                                                                     \
  for (int64_t base = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kN; base < (n); \
       base += static_cast<int64_t>(gridDim.x) * blockDim.x * kN)

unsigned flat_grid(const KernelContext& ctx, int64_t n) {
  return grid_for((n + kN - 1) / kN, kBlock, static_cast<int64_t>(ctx.num_sms) * 16);
}

bool all_aligned(std::initializer_list<const void*> ptrs) {
  for (const void* p : ptrs)
    if (p && !aligned16(p)) return false;
  return true;
}

void check_same_numel(const Tensor& a, const Tensor& b, const char* what) {
  MT_CHECK(a.numel() == b.numel(), "{}: element counts differ: {} vs {}", what, a.shape_string(), b.shape_string());
}

// ---- fill -----------------------------------------------------------------------------------------
template <typename Bits>
__global__ void fill_kernel(Bits* p, int64_t n, Bits value) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    p[i] = value;
}

// ---- zero_ranges ----------------------------------------------------------------------------------
constexpr int kZeroRangesPerLaunch = 64;  // 1 KiB of kernel parameters
struct ZeroRangeBatch {
  int64_t begin[kZeroRangesPerLaunch];  // bytes from the buffer's start (a 16-byte aligned address)
  int64_t bytes[kZeroRangesPerLaunch];
};

// Block row y zeroes range y: 16-byte stores over its aligned middle, single bytes at its ends.
__global__ void zero_ranges_kernel(char* base, ZeroRangeBatch batch) {
  const int64_t begin = batch.begin[blockIdx.y], end = begin + batch.bytes[blockIdx.y];
  const int64_t mid_begin = min(end, (begin + 15) & ~int64_t{15});
  const int64_t mid_end = max(mid_begin, end & ~int64_t{15});
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = begin + t; i < mid_begin; i += stride) base[i] = 0;
  for (int64_t i = mid_end + t; i < end; i += stride) base[i] = 0;
  for (int64_t i = mid_begin + 16 * t; i < mid_end; i += 16 * stride)
    *reinterpret_cast<uint4*>(base + i) = make_uint4(0, 0, 0, 0);
}

// ---- cast -----------------------------------------------------------------------------------------
template <typename Tout, typename Tin, bool VEC>
__global__ void cast_kernel(Tout* dst, const Tin* src, int64_t n) {
  MT_FLAT_LOOP(n) { st<VEC>(dst, base, n, ld<VEC>(src, base, n)); }
}

// ---- axpby --------------------------------------------------------------------------------------
template <typename T, bool VEC, bool HAS_B>
__global__ void axpby_kernel(T* out, float alpha, const T* a, float beta, const T* b, int64_t n) {
  MT_FLAT_LOOP(n) {
    Floats<kN> x = ld<VEC>(a, base, n);
    if constexpr (HAS_B) {
      const Floats<kN> y = ld<VEC>(b, base, n);
#pragma unroll
      for (int j = 0; j < kN; ++j) x.v[j] = alpha * x.v[j] + beta * y.v[j];
    } else {
#pragma unroll
      for (int j = 0; j < kN; ++j) x.v[j] = alpha * x.v[j];
    }
    st<VEC>(out, base, n, x);
  }
}

// x *= 1 / max(sqrt(*sumsq), eps), the factor in float32 (Backend::scale_by_rnorm).
template <typename T, typename S>
__global__ void scale_by_rnorm_kernel(T* x, const S* sumsq, float eps, int64_t n) {
  const float factor = 1.0f / fmaxf(sqrtf(static_cast<float>(*sumsq)), eps);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    x[i] = static_cast<T>(x[i] * factor);
}

__device__ __forceinline__ float load_any(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::f32: return static_cast<const float*>(p)[i];
    case DType::bf16: return __bfloat162float(static_cast<const bf16*>(p)[i]);
    case DType::f16: return __half2float(static_cast<const f16*>(p)[i]);
    case DType::f64: return static_cast<float>(static_cast<const double*>(p)[i]);
    default: return 0.0f;
  }
}
__device__ __forceinline__ void store_any(void* p, DType t, int64_t i, float v) {
  switch (t) {
    case DType::f32: static_cast<float*>(p)[i] = v; break;
    case DType::bf16: static_cast<bf16*>(p)[i] = __float2bfloat16_rn(v); break;
    case DType::f16: static_cast<f16*>(p)[i] = __float2half_rn(v); break;
    case DType::f64: static_cast<double*>(p)[i] = v; break;
    default: break;
  }
}
// Mixed dtypes (rare): element by element, each dtype read through a switch.
__global__ void axpby_mixed_kernel(void* out, DType to, float alpha, const void* a, DType ta, float beta,
                                   const void* b, DType tb, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float v = alpha * load_any(a, ta, i);
    if (b) v += beta * load_any(b, tb, i);
    store_any(out, to, i, v);
  }
}

// ---- GeLU and squared ReLU (the ungated activations, cuda/activations.cuh) -------------------------
template <typename T, bool VEC>
__global__ void activation_forward_kernel(T* out, const T* in, int64_t n, Activation act) {
  MT_FLAT_LOOP(n) {
    Floats<kN> x = ld<VEC>(in, base, n);
#pragma unroll
    for (int j = 0; j < kN; ++j) x.v[j] = act_value(x.v[j], act);
    st<VEC>(out, base, n, x);
  }
}

// out (=|+=) g * act'(pre). Also the plain backward (din = dout * act'(in)).
template <typename T, typename G, bool VEC, bool ACC>
__global__ void activation_grad_kernel(T* out, const G* g, const T* pre, int64_t n, Activation act) {
  MT_FLAT_LOOP(n) {
    const Floats<kN> x = ld<VEC>(pre, base, n);
    Floats<kN> d = ld<VEC>(g, base, n);
#pragma unroll
    for (int j = 0; j < kN; ++j) d.v[j] *= act_grad(x.v[j], act);
    if constexpr (ACC) {
      const Floats<kN> o = ld<VEC>(out, base, n);
#pragma unroll
      for (int j = 0; j < kN; ++j) d.v[j] += o.v[j];
    }
    st<VEC>(out, base, n, d);
  }
}

// g = g * act'(pre), out = act(pre): the backward through an activation that also recomputes its
// output (out may alias pre: each element is read before it is written).
template <typename T, bool VEC>
__global__ void activation_grad_recompute_kernel(T* g, T* out, const T* pre, int64_t n, Activation act) {
  MT_FLAT_LOOP(n) {
    const Floats<kN> x = ld<VEC>(pre, base, n);
    Floats<kN> d = ld<VEC>(g, base, n), y;
#pragma unroll
    for (int j = 0; j < kN; ++j) {
      float grad;
      act_and_grad(x.v[j], act, y.v[j], grad);
      d.v[j] *= grad;
    }
    st<VEC>(g, base, n, d);
    st<VEC>(out, base, n, y);
  }
}

// ---- SwiGLU: in[M, 2f] = [gate | up], out[M, f] = silu(gate) * up --------------------------------
// swiglu_value (cuda/activations.cuh): one expression for the forward, the backward's
// recomputation and the FP8 cast of fc2's input (same bits).

// VEC requires f % 8 == 0 so that a vector never crosses a row.
template <typename T, bool VEC>
__global__ void swiglu_forward_kernel(T* out, const T* in, int64_t rows, int64_t f, Glu q) {
  const int64_t n = rows * f;
  MT_FLAT_LOOP(n) {
    if (VEC) {
      const int64_t r = base / f, c = base % f;
      const T* row = in + r * 2 * f;
      const Floats<kN> gate = load_vec<kN>(row + c), up = load_vec<kN>(row + f + c);
      Floats<kN> y;
#pragma unroll
      for (int j = 0; j < kN; ++j) y.v[j] = glu_value(q, gate.v[j], up.v[j]);
      store_vec<kN>(out + base, y);
    } else {
      for (int64_t i = base; i < base + kN && i < n; ++i) {
        const int64_t r = i / f, c = i % f;
        const float gate = to_float(in[r * 2 * f + c]), up = to_float(in[r * 2 * f + f + c]);
        out[i] = from_float<T>(glu_value(q, gate, up));
      }
    }
  }
}

// swiglu_grad: cuda/activations.cuh (shared with the FP8 cast of the gradient).

template <typename T, bool VEC>
__global__ void swiglu_backward_kernel(T* din, const T* dout, const T* in, int64_t rows, int64_t f, Glu q) {
  const int64_t n = rows * f;
  MT_FLAT_LOOP(n) {
    if (VEC) {
      const int64_t r = base / f, c = base % f;
      const T* row = in + r * 2 * f;
      const Floats<kN> gate = load_vec<kN>(row + c), up = load_vec<kN>(row + f + c);
      const Floats<kN> dy = load_vec<kN>(dout + base);
      Floats<kN> dg, du;
#pragma unroll
      for (int j = 0; j < kN; ++j) glu_grad(q, gate.v[j], up.v[j], dy.v[j], dg.v[j], du.v[j]);
      store_vec<kN>(din + r * 2 * f + c, dg);
      store_vec<kN>(din + r * 2 * f + f + c, du);
    } else {
      for (int64_t i = base; i < base + kN && i < n; ++i) {
        const int64_t r = i / f, c = i % f;
        const float gate = to_float(in[r * 2 * f + c]), up = to_float(in[r * 2 * f + f + c]);
        float dg, du;
        glu_grad(q, gate, up, to_float(dout[i]), dg, du);
        din[r * 2 * f + c] = from_float<T>(dg);
        din[r * 2 * f + f + c] = from_float<T>(du);
      }
    }
  }
}

// swiglu_backward plus act = swiglu(in); din may alias in and act may alias dout (every element's
// inputs are loaded before its outputs are stored).
template <typename T, bool VEC>
__global__ void swiglu_backward_recompute_kernel(T* din, T* act, const T* dout, const T* in, int64_t rows, int64_t f,
                                                 Glu q) {
  const int64_t n = rows * f;
  MT_FLAT_LOOP(n) {
    if (VEC) {
      const int64_t r = base / f, c = base % f;
      const T* row = in + r * 2 * f;
      const Floats<kN> gate = load_vec<kN>(row + c), up = load_vec<kN>(row + f + c);
      const Floats<kN> dy = load_vec<kN>(dout + base);
      Floats<kN> dg, du, y;
#pragma unroll
      for (int j = 0; j < kN; ++j) {
        glu_grad(q, gate.v[j], up.v[j], dy.v[j], dg.v[j], du.v[j]);
        y.v[j] = glu_value(q, gate.v[j], up.v[j]);
      }
      store_vec<kN>(din + r * 2 * f + c, dg);
      store_vec<kN>(din + r * 2 * f + f + c, du);
      store_vec<kN>(act + base, y);
    } else {
      for (int64_t i = base; i < base + kN && i < n; ++i) {
        const int64_t r = i / f, c = i % f;
        const float gate = to_float(in[r * 2 * f + c]), up = to_float(in[r * 2 * f + f + c]);
        const float dy = to_float(dout[i]);
        float dg, du;
        glu_grad(q, gate, up, dy, dg, du);
        din[r * 2 * f + c] = from_float<T>(dg);
        din[r * 2 * f + f + c] = from_float<T>(du);
        act[i] = from_float<T>(glu_value(q, gate, up));
      }
    }
  }
}

// ---- out = residual + dropout(x + bias) ---------------------------------------------------------
// bias_vec: the bias is 16-byte aligned and cols % 8 == 0, so a vector never crosses a row and the
// bias comes in one 16-byte load (element by element, it cost ~20% of the kernel's time).
template <typename T, bool VEC, bool HAS_BIAS>
__global__ void bias_dropout_add_kernel(T* out, const T* x, const T* bias, const T* residual, int64_t n,
                                        int64_t cols, float p, float keep_scale, uint64_t key, bool bias_vec) {
  MT_FLAT_LOOP(n) {
    Floats<kN> v = ld<VEC>(x, base, n);
    if constexpr (HAS_BIAS) {
      int64_t c = base % cols;
      if (VEC && bias_vec && base + kN <= n) {
        const Floats<kN> b = load_vec<kN>(bias + c);
#pragma unroll
        for (int j = 0; j < kN; ++j) v.v[j] += b.v[j];
      } else {
#pragma unroll
        for (int j = 0; j < kN; ++j) {
          if (base + j < n) v.v[j] += to_float(bias[c]);
          if (++c == cols) c = 0;
        }
      }
    }
    const Floats<kN> r = ld<VEC>(residual, base, n);
    const DropoutGroup drop(key, base, p, keep_scale);  // (base % kN == 0, kN == 8: one draw)
#pragma unroll
    for (int j = 0; j < kN; ++j) v.v[j] = dropout_add(r.v[j], v.v[j], drop.at(base + j));
    st<VEC>(out, base, n, v);
  }
}

// amax (optional): max |dx as stored| maxed into it (elements past n are zeros of the partial load).
template <typename T, bool VEC>
__global__ void dropout_backward_kernel(T* dx, const T* dout, int64_t n, float p, float keep_scale, uint64_t key,
                                        float* amax) {
  float m = 0.0f;
  MT_FLAT_LOOP(n) {
    Floats<kN> v = ld<VEC>(dout, base, n);
    const DropoutGroup drop(key, base, p, keep_scale);
#pragma unroll
    for (int j = 0; j < kN; ++j) {
      v.v[j] *= drop.at(base + j);
      if (amax) m = fmaxf(m, stored_abs<T>(v.v[j]));  // (uniform branch: no amax, no rounding)
    }
    st<VEC>(dx, base, n, v);
  }
  if (amax) block_amax_atomic(amax, m);
}

__global__ void add_f32_kernel(float* dst, const float* src, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dst[i] += src[i];
}

// dst[i] += src[i] into a bf16 gradient, eight elements a thread (16-byte bf16 and two 16-byte float
// accesses) where VEC8, one otherwise.
template <bool VEC8>
__global__ void add_to_bf16_grad_kernel(bf16* dst, const float* src, int64_t n) {
  constexpr int64_t kPer = VEC8 ? 8 : 1;
  const int64_t groups = n / kPer;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; g < groups;
       g += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = g * kPer;
    if constexpr (VEC8) {
      Floats<8> d = load_vec<8>(dst + i);
      const Floats<8> s = load_vec<8>(src + i);
#pragma unroll
      for (int j = 0; j < 8; ++j) d.v[j] += s.v[j];
      store_vec<8>(dst + i, d);
    } else {
      grad_add(dst + i, src[i]);
    }
  }
  if constexpr (VEC8) {  // the last n % 8 elements
    const int64_t i = groups * kPer + static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i < n) grad_add(dst + i, src[i]);
  }
}

// Calls f.template operator()<VEC>() with VEC = whether all pointers are 16-byte aligned.
template <typename F>
void with_vec(bool aligned, F&& f) {
  if (aligned) f.template operator()<true>();
  else f.template operator()<false>();
}

}  // namespace

void check_amax_slot(const Tensor& amax, const char* op, const char* what) {
  MT_CHECK(amax.empty() || (amax.dtype == DType::f32 && amax.numel() == 1),
           "{}: {} must be a float32 [1] tensor, got {}", op, what, amax.shape_string());
}

float* amax_slot_ptr(const Tensor& amax, const char* op, const char* what) {
  check_amax_slot(amax, op, what);
  return amax.empty() ? nullptr : amax.ptr<float>();
}

// ---- launchers -----------------------------------------------------------------------------------
void fill(const KernelContext& ctx, Tensor t, double value) {
  const int64_t n = t.numel();
  if (n == 0) return;
  if (value == 0.0 && !std::signbit(value)) {  // +0 is all zero bits in every dtype: the driver's memset runs at full rate
    MT_CUDA_CHECK(cudaMemsetAsync(t.data, 0, t.nbytes(), ctx.stream));
    return;
  }
  const unsigned grid = grid_for(n, kBlock, static_cast<int64_t>(ctx.num_sms) * 16);
  auto launch = [&](auto bits) {
    fill_kernel<<<grid, kBlock, 0, ctx.stream>>>(static_cast<decltype(bits)*>(t.data), n, bits);
  };
  switch (t.dtype) {
    case DType::f32: { float v = static_cast<float>(value); uint32_t b; std::memcpy(&b, &v, 4); launch(b); break; }
    case DType::f64: { uint64_t b; std::memcpy(&b, &value, 8); launch(b); break; }
    case DType::bf16: launch(float_to_bf16_bits(static_cast<float>(value))); break;
    case DType::f16: launch(float_to_f16_bits(static_cast<float>(value))); break;
    case DType::i32: launch(static_cast<uint32_t>(static_cast<int32_t>(value))); break;
    case DType::i64: launch(static_cast<uint64_t>(static_cast<int64_t>(value))); break;
    case DType::u8: launch(static_cast<uint8_t>(value)); break;
    case DType::i16: launch(static_cast<uint16_t>(static_cast<int16_t>(value))); break;
    case DType::fp8_e4m3:
    case DType::fp8_e5m2: launch(float_to_fp8_bits(t.dtype, static_cast<float>(value))); break;
  }
  MT_CUDA_CHECK_LAUNCH();
}

void zero_ranges(const KernelContext& ctx, Tensor flat, const std::vector<FlatRange>& ranges) {
  constexpr int64_t kMemsetBytes = int64_t{1} << 20;
  char* base = static_cast<char*>(flat.data);
  const int64_t elem = static_cast<int64_t>(dtype_size(flat.dtype));
  const bool aligned = aligned16(base);
  ZeroRangeBatch batch{};
  int count = 0;
  int64_t largest = 0;
  auto launch = [&] {
    if (count == 0) return;
    const dim3 grid(grid_for((largest + 15) / 16, kBlock, 64), count);
    zero_ranges_kernel<<<grid, kBlock, 0, ctx.stream>>>(base, batch);
    MT_CUDA_CHECK_LAUNCH();
    count = 0;
    largest = 0;
  };
  for (const FlatRange& r : ranges) {
    MT_CHECK(r.offset >= 0 && r.count >= 0 && r.offset + r.count <= flat.numel(),
             "zero_ranges: range [{}, {}) outside the {} elements", r.offset, r.offset + r.count, flat.numel());
    const int64_t bytes = r.count * elem;
    if (bytes == 0) continue;
    if (bytes >= kMemsetBytes || !aligned) {
      MT_CUDA_CHECK(cudaMemsetAsync(base + r.offset * elem, 0, static_cast<size_t>(bytes), ctx.stream));
      continue;
    }
    batch.begin[count] = r.offset * elem;
    batch.bytes[count] = bytes;
    largest = std::max(largest, bytes);
    if (++count == kZeroRangesPerLaunch) launch();
  }
  launch();
}

namespace {
template <typename Tout>
void cast_from(const KernelContext& ctx, Tout* dst, const Tensor& src, int64_t n) {
  const bool vec = all_aligned({dst, src.data});
  auto go = [&](auto* s) {
    using Tin = std::remove_const_t<std::remove_pointer_t<decltype(s)>>;
    if (vec) cast_kernel<Tout, Tin, true><<<flat_grid(ctx, n), kBlock, 0, ctx.stream>>>(dst, s, n);
    else cast_kernel<Tout, Tin, false><<<flat_grid(ctx, n), kBlock, 0, ctx.stream>>>(dst, s, n);
  };
  switch (src.dtype) {
    case DType::f32: go(src.ptr<const float>()); break;
    case DType::f64: go(src.ptr<const double>()); break;
    case DType::bf16: go(src.ptr<const bf16>()); break;
    case DType::f16: go(src.ptr<const f16>()); break;
    default: fail("cast: source dtype {} is not a float type", dtype_name(src.dtype));
  }
}
}  // namespace

void cast(const KernelContext& ctx, Tensor dst, Tensor src) {
  check_same_numel(dst, src, "cast");
  const int64_t n = dst.numel();
  if (n == 0) return;
  if (dst.dtype == src.dtype) {  // a copy (the kernels convert through float32, which float64 would not survive)
    if (dst.data != src.data)
      MT_CUDA_CHECK(cudaMemcpyAsync(dst.data, src.data, dst.nbytes(), cudaMemcpyDeviceToDevice, ctx.stream));
    return;
  }
  switch (dst.dtype) {
    case DType::f32: cast_from(ctx, dst.ptr<float>(), src, n); break;
    case DType::f64: cast_from(ctx, dst.ptr<double>(), src, n); break;
    case DType::bf16: cast_from(ctx, dst.ptr<bf16>(), src, n); break;
    case DType::f16: cast_from(ctx, dst.ptr<f16>(), src, n); break;
    default: fail("cast: destination dtype {} is not a float type", dtype_name(dst.dtype));
  }
  MT_CUDA_CHECK_LAUNCH();
}

void axpby(const KernelContext& ctx, Tensor out, float alpha, Tensor a, float beta, Tensor b) {
  check_same_numel(out, a, "axpby");
  if (!b.empty()) check_same_numel(out, b, "axpby");
  const int64_t n = out.numel();
  if (n == 0) return;
  const bool same = a.dtype == out.dtype && (b.empty() || b.dtype == out.dtype) && out.dtype != DType::f64;
  if (!same) {
    for (const Tensor* t : {&out, &a, &b})
      if (!t->empty() && !is_floating(t->dtype)) fail("axpby: dtype {} is not a float type", dtype_name(t->dtype));
    axpby_mixed_kernel<<<grid_for(n, kBlock, static_cast<int64_t>(ctx.num_sms) * 16), kBlock, 0, ctx.stream>>>(
        out.data, out.dtype, alpha, a.data, a.dtype, beta, b.data, b.dtype, n);
    MT_CUDA_CHECK_LAUNCH();
    return;
  }
  MT_DISPATCH_FLOAT(out.dtype, T, "axpby", {
    with_vec(all_aligned({out.data, a.data, b.data}), [&]<bool V>() {
      if (b.empty())
        axpby_kernel<T, V, false><<<flat_grid(ctx, n), kBlock, 0, ctx.stream>>>(out.ptr<T>(), alpha, a.ptr<const T>(),
                                                                               beta, nullptr, n);
      else
        axpby_kernel<T, V, true><<<flat_grid(ctx, n), kBlock, 0, ctx.stream>>>(out.ptr<T>(), alpha, a.ptr<const T>(),
                                                                              beta, b.ptr<const T>(), n);
    });
  });
  MT_CUDA_CHECK_LAUNCH();
}

void scale_by_rnorm(const KernelContext& ctx, Tensor x, Tensor sumsq, float eps) {
  MT_CHECK(sumsq.numel() == 1 && (sumsq.dtype == DType::f32 || sumsq.dtype == DType::f64),
           "scale_by_rnorm: sumsq must be one float32 or float64 value, got {} {}", dtype_name(sumsq.dtype),
           sumsq.shape_string());
  MT_CHECK(x.dtype == DType::f32 || x.dtype == DType::f64, "scale_by_rnorm: x must be float32 or float64, got {}",
           dtype_name(x.dtype));
  const int64_t n = x.numel();
  if (n == 0) return;
  const unsigned grid = grid_for(n, kBlock, static_cast<int64_t>(ctx.num_sms) * 16);
  const auto go = [&](auto* p) {
    if (sumsq.dtype == DType::f32)
      scale_by_rnorm_kernel<<<grid, kBlock, 0, ctx.stream>>>(p, sumsq.ptr<const float>(), eps, n);
    else
      scale_by_rnorm_kernel<<<grid, kBlock, 0, ctx.stream>>>(p, sumsq.ptr<const double>(), eps, n);
  };
  if (x.dtype == DType::f32) go(x.ptr<float>());
  else go(x.ptr<double>());
  MT_CUDA_CHECK_LAUNCH();
}

void activation_forward(const KernelContext& ctx, Tensor out, Tensor in, Activation act) {
  check_same_numel(out, in, "activation_forward");
  MT_CHECK(out.dtype == in.dtype, "activation_forward: dtypes differ");
  MT_CHECK(act != Activation::none, "activation_forward needs an activation");
  const int64_t n = out.numel();
  if (n == 0) return;
  MT_DISPATCH_FLOAT(out.dtype, T, "activation_forward", {
    with_vec(all_aligned({out.data, in.data}), [&]<bool V>() {
      activation_forward_kernel<T, V><<<flat_grid(ctx, n), kBlock, 0, ctx.stream>>>(out.ptr<T>(), in.ptr<const T>(),
                                                                                    n, act);
    });
  });
  MT_CUDA_CHECK_LAUNCH();
}

void activation_grad_multiply(const KernelContext& ctx, Tensor out, Tensor g, Tensor pre, Activation act,
                              bool accumulate) {
  check_same_numel(out, g, "activation backward");
  check_same_numel(out, pre, "activation backward");
  MT_CHECK(out.dtype == pre.dtype && (g.dtype == out.dtype || g.dtype == DType::f32),
           "activation backward: dtypes {} {} {}", dtype_name(out.dtype), dtype_name(g.dtype), dtype_name(pre.dtype));
  MT_CHECK(act != Activation::none, "activation backward needs an activation");
  const int64_t n = out.numel();
  if (n == 0) return;
  MT_DISPATCH_FLOAT(out.dtype, T, "activation backward", {
    auto go = [&](auto* gp) {
      using G = std::remove_const_t<std::remove_pointer_t<decltype(gp)>>;
      with_vec(all_aligned({out.data, g.data, pre.data}), [&]<bool V>() {
        if (accumulate)
          activation_grad_kernel<T, G, V, true><<<flat_grid(ctx, n), kBlock, 0, ctx.stream>>>(
              out.ptr<T>(), gp, pre.ptr<const T>(), n, act);
        else
          activation_grad_kernel<T, G, V, false><<<flat_grid(ctx, n), kBlock, 0, ctx.stream>>>(
              out.ptr<T>(), gp, pre.ptr<const T>(), n, act);
      });
    };
    if (g.dtype == DType::f32) go(g.ptr<const float>());
    else go(g.ptr<const T>());
  });
  MT_CUDA_CHECK_LAUNCH();
}

void activation_backward(const KernelContext& ctx, Tensor din, Tensor dout, Tensor in, Activation act) {
  MT_CHECK(dout.dtype == din.dtype, "activation_backward: dtypes differ");
  activation_grad_multiply(ctx, din, dout, in, act, false);
}

void swiglu_forward(const KernelContext& ctx, Tensor out, Tensor in, const Glu& q) {
  const int64_t f = out.cols(), rows = out.rows();
  MT_CHECK(in.cols() == 2 * f && in.rows() == rows, "swiglu_forward: in {} must be [rows, 2 * {}]",
           in.shape_string(), f);
  MT_CHECK(out.dtype == in.dtype, "swiglu_forward: dtypes differ");
  const int64_t n = rows * f;
  if (n == 0) return;
  MT_DISPATCH_FLOAT(out.dtype, T, "swiglu_forward", {
    with_vec(all_aligned({out.data, in.data}) && f % kN == 0, [&]<bool V>() {
      swiglu_forward_kernel<T, V><<<flat_grid(ctx, n), kBlock, 0, ctx.stream>>>(out.ptr<T>(), in.ptr<const T>(),
                                                                                rows, f, q);
    });
  });
  MT_CUDA_CHECK_LAUNCH();
}

void swiglu_backward(const KernelContext& ctx, Tensor din, Tensor dout, Tensor in, const Glu& q) {
  const int64_t f = dout.cols(), rows = dout.rows();
  MT_CHECK(in.cols() == 2 * f && in.rows() == rows && din.numel() == in.numel(),
           "swiglu_backward: shapes din {} dout {} in {}", din.shape_string(), dout.shape_string(), in.shape_string());
  MT_CHECK(din.dtype == in.dtype && dout.dtype == in.dtype, "swiglu_backward: dtypes differ");
  const int64_t n = rows * f;
  if (n == 0) return;
  MT_DISPATCH_FLOAT(in.dtype, T, "swiglu_backward", {
    with_vec(all_aligned({din.data, dout.data, in.data}) && f % kN == 0, [&]<bool V>() {
      swiglu_backward_kernel<T, V><<<flat_grid(ctx, n), kBlock, 0, ctx.stream>>>(
          din.ptr<T>(), dout.ptr<const T>(), in.ptr<const T>(), rows, f, q);
    });
  });
  MT_CUDA_CHECK_LAUNCH();
}

void swiglu_backward_recompute(const KernelContext& ctx, Tensor din, Tensor act_out, Tensor dout, Tensor in,
                               const Glu& q) {
  const int64_t f = dout.cols(), rows = dout.rows();
  MT_CHECK(in.cols() == 2 * f && in.rows() == rows && din.numel() == in.numel() && act_out.numel() == dout.numel(),
           "swiglu_backward_recompute: shapes din {} act {} dout {} in {}", din.shape_string(), act_out.shape_string(),
           dout.shape_string(), in.shape_string());
  MT_CHECK(din.dtype == in.dtype && dout.dtype == in.dtype && act_out.dtype == in.dtype,
           "swiglu_backward_recompute: dtypes differ");
  MT_CHECK((din.data == in.data || din.data != dout.data) && act_out.data != in.data && act_out.data != din.data,
           "swiglu_backward_recompute: only din = in and act_out = dout may alias");
  const int64_t n = rows * f;
  if (n == 0) return;
  MT_DISPATCH_FLOAT(in.dtype, T, "swiglu_backward_recompute", {
    with_vec(all_aligned({din.data, act_out.data, dout.data, in.data}) && f % kN == 0, [&]<bool V>() {
      swiglu_backward_recompute_kernel<T, V><<<flat_grid(ctx, n), kBlock, 0, ctx.stream>>>(
          din.ptr<T>(), act_out.ptr<T>(), dout.ptr<const T>(), in.ptr<const T>(), rows, f, q);
    });
  });
  MT_CUDA_CHECK_LAUNCH();
}

void activation_grad_recompute(const KernelContext& ctx, Tensor g, Tensor act_out, Tensor pre, Activation act) {
  check_same_numel(g, pre, "activation_grad_recompute");
  check_same_numel(act_out, pre, "activation_grad_recompute");
  MT_CHECK(g.dtype == pre.dtype && act_out.dtype == pre.dtype, "activation_grad_recompute: dtypes differ");
  MT_CHECK(g.data != pre.data && g.data != act_out.data, "activation_grad_recompute: only act_out = pre may alias");
  MT_CHECK(act != Activation::none, "activation_grad_recompute needs an activation");
  const int64_t n = g.numel();
  if (n == 0) return;
  MT_DISPATCH_FLOAT(g.dtype, T, "activation_grad_recompute", {
    with_vec(all_aligned({g.data, act_out.data, pre.data}), [&]<bool V>() {
      activation_grad_recompute_kernel<T, V><<<flat_grid(ctx, n), kBlock, 0, ctx.stream>>>(
          g.ptr<T>(), act_out.ptr<T>(), pre.ptr<const T>(), n, act);
    });
  });
  MT_CUDA_CHECK_LAUNCH();
}

void bias_dropout_add(const KernelContext& ctx, Tensor out, Tensor x, Tensor bias, Tensor residual, float p,
                      uint64_t key) {
  check_same_numel(out, x, "bias_dropout_add");
  check_same_numel(out, residual, "bias_dropout_add");
  MT_CHECK(out.dtype == x.dtype && residual.dtype == x.dtype && (bias.empty() || bias.dtype == x.dtype),
           "bias_dropout_add: dtypes differ");
  const int64_t n = out.numel(), cols = x.cols();
  if (!bias.empty()) MT_CHECK(bias.numel() == cols, "bias_dropout_add: bias {} vs x {}", bias.shape_string(), x.shape_string());
  if (n == 0) return;
  const float keep_scale = dropout_keep_scale(p);
  MT_DISPATCH_FLOAT(out.dtype, T, "bias_dropout_add", {
    const bool bias_vec = !bias.empty() && aligned16(bias.data) && (cols * static_cast<int64_t>(sizeof(T))) % 16 == 0 &&
                          cols % kN == 0;
    with_vec(all_aligned({out.data, x.data, residual.data}), [&]<bool V>() {
      if (bias.empty())
        bias_dropout_add_kernel<T, V, false><<<flat_grid(ctx, n), kBlock, 0, ctx.stream>>>(
            out.ptr<T>(), x.ptr<const T>(), nullptr, residual.ptr<const T>(), n, cols, p, keep_scale, key, false);
      else
        bias_dropout_add_kernel<T, V, true><<<flat_grid(ctx, n), kBlock, 0, ctx.stream>>>(
            out.ptr<T>(), x.ptr<const T>(), bias.ptr<const T>(), residual.ptr<const T>(), n, cols, p, keep_scale, key,
            bias_vec);
    });
  });
  MT_CUDA_CHECK_LAUNCH();
}

void dropout_backward(const KernelContext& ctx, Tensor dx, Tensor dout, float p, uint64_t key, float* dx_amax) {
  check_same_numel(dx, dout, "dropout_backward");
  MT_CHECK(dx.dtype == dout.dtype, "dropout_backward: dtypes differ");
  const int64_t n = dx.numel();
  if (n == 0) return;
  const float keep_scale = dropout_keep_scale(p);
  MT_DISPATCH_FLOAT(dx.dtype, T, "dropout_backward", {
    with_vec(all_aligned({dx.data, dout.data}), [&]<bool V>() {
      dropout_backward_kernel<T, V><<<flat_grid(ctx, n), kBlock, 0, ctx.stream>>>(dx.ptr<T>(), dout.ptr<const T>(), n,
                                                                                  p, keep_scale, key, dx_amax);
    });
  });
  MT_CUDA_CHECK_LAUNCH();
}

void add_f32(const KernelContext& ctx, float* dst, const float* src, int64_t n) {
  if (n == 0) return;
  add_f32_kernel<<<grid_for(n, kBlock, static_cast<int64_t>(ctx.num_sms) * 8), kBlock, 0, ctx.stream>>>(dst, src, n);
  MT_CUDA_CHECK_LAUNCH();
}

void add_to_grad(const KernelContext& ctx, GradOut dst, const float* src, int64_t n) {
  if (n == 0) return;
  if (dst.dtype == DType::f32) return add_f32(ctx, static_cast<float*>(dst.data), src, n);
  MT_CHECK(dst.dtype == DType::bf16, "add_to_grad: gradient dtype {} (float32 or bfloat16)", dtype_name(dst.dtype));
  bf16* d = static_cast<bf16*>(dst.data);
  const int64_t max_blocks = static_cast<int64_t>(ctx.num_sms) * 8;
  if (aligned16(d) && aligned16(src))
    add_to_bf16_grad_kernel<true><<<grid_for(std::max<int64_t>(n / 8, 1), kBlock, max_blocks), kBlock, 0, ctx.stream>>>(
        d, src, n);
  else
    add_to_bf16_grad_kernel<false><<<grid_for(n, kBlock, max_blocks), kBlock, 0, ctx.stream>>>(d, src, n);
  MT_CUDA_CHECK_LAUNCH();
}

// ---- attention output gate ------------------------------------------------------------------------
namespace {

// One thread moves one unit (U: 2, 4, 8 or 16 bytes) of the gated row layout [q | gate | k | v] per
// group to or from the separate [q | k | v] and gate rows. Widths are in units.
template <typename U, bool SPLIT>
__global__ void gate_copy_kernel(U* qkvg, U* qkv, U* gate, int64_t rows, int64_t q, int64_t kv, int64_t groups) {
  const int64_t blk = 2 * q + kv, w = groups * blk, n = rows * w;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / w, c = i % w, g = c / blk, o = c % blk;
    U* other = o < q        ? qkv + r * groups * (q + kv) + g * (q + kv) + o
               : o < 2 * q ? gate + r * groups * q + g * q + (o - q)
                           : qkv + r * groups * (q + kv) + g * (q + kv) + (o - q);
    if (SPLIT) *other = qkvg[i];
    else qkvg[i] = *other;
  }
}

template <typename T, bool VEC>
__global__ void output_gate_forward_kernel(T* out, const T* x, const T* gate, int64_t n) {
  MT_FLAT_LOOP(n) {
    const Floats<kN> xv = ld<VEC>(x, base, n), g = ld<VEC>(gate, base, n);
    Floats<kN> y;
#pragma unroll
    for (int j = 0; j < kN; ++j) y.v[j] = xv.v[j] * (1.0f / (1.0f + expf(-g.v[j])));
    st<VEC>(out, base, n, y);
  }
}

template <typename T, bool VEC>
__global__ void output_gate_backward_kernel(T* dx, T* dgate, const T* dout, const T* x, const T* gate, int64_t n) {
  MT_FLAT_LOOP(n) {
    const Floats<kN> dy = ld<VEC>(dout, base, n), xv = ld<VEC>(x, base, n), g = ld<VEC>(gate, base, n);
    Floats<kN> a, b;
#pragma unroll
    for (int j = 0; j < kN; ++j) {
      const float sg = 1.0f / (1.0f + expf(-g.v[j]));
      a.v[j] = dy.v[j] * sg;
      b.v[j] = dy.v[j] * xv.v[j] * sg * (1.0f - sg);
    }
    st<VEC>(dx, base, n, a);
    st<VEC>(dgate, base, n, b);
  }
}

void gate_copy(const KernelContext& ctx, Tensor qkvg, Tensor qkv, Tensor gate, const GateShape& s, bool split,
               const char* op) {
  const int64_t rows = qkvg.rows();
  MT_CHECK(qkvg.cols() == s.qkvg_width() && qkv.numel() == rows * s.qkv_width() && gate.numel() == rows * s.gate_width(),
           "{}: shapes qkvg {} qkv {} gate {} do not match {} groups of {} query heads of {}", op, qkvg.shape_string(),
           qkv.shape_string(), gate.shape_string(), s.groups, s.q_per_group, s.head_dim);
  MT_CHECK(qkv.dtype == qkvg.dtype && gate.dtype == qkvg.dtype, "{}: dtypes differ", op);
  if (rows == 0) return;
  const int64_t es = static_cast<int64_t>(dtype_size(qkvg.dtype)), head_bytes = s.head_dim * es;
  // The widest unit that divides a head and to which every pointer is aligned.
  int64_t unit = es;
  for (int64_t u : {16, 8, 4})
    if (u > es && head_bytes % u == 0 &&
        reinterpret_cast<uintptr_t>(qkvg.data) % u == 0 && reinterpret_cast<uintptr_t>(qkv.data) % u == 0 &&
        reinterpret_cast<uintptr_t>(gate.data) % u == 0) {
      unit = u;
      break;
    }
  const int64_t per_head = head_bytes / unit, q = s.q_per_group * per_head, kv = 2 * per_head;
  const int64_t n = rows * s.groups * (2 * q + kv);
  const unsigned grid = grid_for(n, kBlock, static_cast<int64_t>(ctx.num_sms) * 16);
  auto go = [&](auto* tag) {
    using U = std::remove_pointer_t<decltype(tag)>;
    U *a = static_cast<U*>(qkvg.data), *b = static_cast<U*>(qkv.data), *c = static_cast<U*>(gate.data);
    if (split) gate_copy_kernel<U, true><<<grid, kBlock, 0, ctx.stream>>>(a, b, c, rows, q, kv, s.groups);
    else gate_copy_kernel<U, false><<<grid, kBlock, 0, ctx.stream>>>(a, b, c, rows, q, kv, s.groups);
  };
  switch (unit) {
    case 16: go(static_cast<uint4*>(nullptr)); break;
    case 8: go(static_cast<uint2*>(nullptr)); break;
    case 4: go(static_cast<uint32_t*>(nullptr)); break;
    default: go(static_cast<uint16_t*>(nullptr)); break;
  }
  MT_CUDA_CHECK_LAUNCH();
}

}  // namespace

void attention_gate_split(const KernelContext& ctx, Tensor qkv, Tensor gate, Tensor qkvg, const GateShape& s) {
  gate_copy(ctx, qkvg, qkv, gate, s, true, "attention_gate_split");
}

void attention_gate_merge(const KernelContext& ctx, Tensor qkvg, Tensor qkv, Tensor gate, const GateShape& s) {
  gate_copy(ctx, qkvg, qkv, gate, s, false, "attention_gate_merge");
}

void output_gate_forward(const KernelContext& ctx, Tensor out, Tensor x, Tensor gate) {
  check_same_numel(out, x, "output_gate_forward");
  check_same_numel(gate, x, "output_gate_forward");
  MT_CHECK(out.dtype == x.dtype && gate.dtype == x.dtype, "output_gate_forward: dtypes differ");
  const int64_t n = x.numel();
  if (n == 0) return;
  MT_DISPATCH_FLOAT(x.dtype, T, "output_gate_forward", {
    with_vec(all_aligned({out.data, x.data, gate.data}), [&]<bool V>() {
      output_gate_forward_kernel<T, V><<<flat_grid(ctx, n), kBlock, 0, ctx.stream>>>(out.ptr<T>(), x.ptr<const T>(),
                                                                                     gate.ptr<const T>(), n);
    });
  });
  MT_CUDA_CHECK_LAUNCH();
}

void output_gate_backward(const KernelContext& ctx, Tensor dx, Tensor dgate, Tensor dout, Tensor x, Tensor gate) {
  for (const Tensor* t : {&dx, &dgate, &dout, &gate}) {
    check_same_numel(*t, x, "output_gate_backward");
    MT_CHECK(t->dtype == x.dtype, "output_gate_backward: dtypes differ");
  }
  const int64_t n = x.numel();
  if (n == 0) return;
  MT_DISPATCH_FLOAT(x.dtype, T, "output_gate_backward", {
    with_vec(all_aligned({dx.data, dgate.data, dout.data, x.data, gate.data}), [&]<bool V>() {
      output_gate_backward_kernel<T, V><<<flat_grid(ctx, n), kBlock, 0, ctx.stream>>>(
          dx.ptr<T>(), dgate.ptr<T>(), dout.ptr<const T>(), x.ptr<const T>(), gate.ptr<const T>(), n);
    });
  });
  MT_CUDA_CHECK_LAUNCH();
}

}  // namespace mt::cuda
