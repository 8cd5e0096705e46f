// FP8 element kernels for the CUDA backend: quantizing casts (with the absolute maximum needed
// for the next scale), the cast that also writes the transposed copy the FP8 GEMMs need, the
// amax-only reduction and the delayed-scaling scale update.
//
// Conventions (shared with the FP8 GEMMs in fp8_gemm_cublaslt.h):
//   - FP8 data are raw bytes (OCP e4m3 / e5m2). A quantized tensor q holds round(x * scale);
//     x ~= q * scale_inv with scale_inv = 1 / scale.
//   - Conversion: x * scale in float32, then round to nearest even, SATURATING to the format's
//     largest finite value (+-448 e4m3, +-57344 e5m2; infinities saturate too); NaN stays NaN.
//     This is the hardware's cvt.rn.satfinite, the conversion Transformer Engine uses.
//   - scale, scale_inv and amax are DEVICE pointers to float (one per tensor), so a step runs
//     without host synchronization. amax is the max |x| of the UNSCALED input; the kernels fold it
//     in with atomicMax (on the float bits: non-negative floats order like their bit patterns), so
//     the caller zeroes it first (the scale update zeroes history row 0 for the next step).
#pragma once

#include <cstdint>
#include <span>

#include "core/tensor.h"
#include "cuda/fp8_gemm_cublaslt.h"  // Fp8Format
#include "cuda/kernels.h"           // KernelContext

namespace mt::cuda {

// out[i] = fp8(in[i] * *scale); *amax = max(*amax, max |in|) when amax is not null.
// in: float32 or bfloat16 (any shape, contiguous); out: in.numel() bytes.
void cast_to_fp8(const KernelContext& ctx, void* out, Fp8Format format, Tensor in, const float* scale, float* amax);

// in [R, C] (float32 or bfloat16, row-major) -> out [R, C] and out_t [C, R] (row-major, i.e. the
// transpose), both fp8 of the same values, in one pass; either output may be null. amax as above.
// dbias ([C], float32 or bfloat16), when not null: dbias += the column sums of in (float32 sums in a
// fixed order: deterministic; a bfloat16 dbias gets old + sum rounded once), in the same pass (an
// output gradient's bias gradient).
void cast_transpose_to_fp8(const KernelContext& ctx, void* out, void* out_t, Fp8Format format, Tensor in,
                           const float* scale, float* amax, GradOut dbias = GradOut());

// cast_transpose_to_fp8 of groups of rows in one launch, each group with its own scale and amax
// slot (the routed experts' rows): group g is rows [row0[g], row0[g + 1]) of in [R, C] (row0[0] =
// 0), cast into the same rows of out [R, C] and into the [C, M_g] block at element row0[g] * C of
// out_t (either may be null); amax[g] may be null. The bytes and amaxes of the per-group calls.
// Only where every group's row count and C are multiples of 8, in is 16-byte aligned and there are
// at most kMaxCastGroups groups: returns false (nothing launched) otherwise.
constexpr int kMaxCastGroups = 256;
bool cast_transpose_groups_to_fp8(const KernelContext& ctx, void* out, void* out_t, Fp8Format format, Tensor in,
                                  std::span<const int64_t> row0, std::span<const float* const> scale,
                                  std::span<float* const> amax);

// What a fused cast quantizes, read from the tensors that define it (never written itself):
//   plain:           x;
//   activation:      act(x), x = fc1's output ([R, C] for GeLU and squared ReLU, [R, 2C] =
//                    [gate | up] for SwiGLU), the values activation_forward / swiglu_forward would
//                    store in x's dtype;
//   activation_grad: the gradient of act's input from x, the gradient of its output: GeLU and
//                    squared ReLU x * act'(pre), x and pre [R, C]; SwiGLU [dgate | dup] [R, 2F]
//                    from x [R, F] and pre [R, 2F]: the values activation_backward /
//                    swiglu_backward would store;
//   norm:            norm(x) from x and its statistics (below).
struct CastSource {
  enum class Kind { plain, activation, activation_grad, norm };
  CastSource(Kind k, Tensor x_, Tensor pre_ = Tensor(), MlpActivation act_ = MlpActivation::gelu)
      : kind(k), x(x_), pre(pre_), act(act_) {}
  Kind kind = Kind::plain;
  Tensor x, pre;
  MlpActivation act = MlpActivation::gelu;
  Glu glu;  // SwiGLU: the gated unit (engine/activation.h), as swiglu_forward / swiglu_backward take it
  // norm: the output of a LayerNorm / RMSNorm of x [R, C] with the statistics its norm_forward
  // wrote (float32 [R]; mean empty or zeros for RMSNorm) and its weight and bias (bias may be
  // empty; one_p: the weight is stored as gamma - 1), the values norm_forward would store.
  Tensor mean, rstd, weight, bias;
  bool one_p = false;
  int64_t rows() const { return x.rows(); }
  int64_t cols() const {
    if (act != MlpActivation::swiglu || kind == Kind::plain || kind == Kind::norm) return x.cols();
    return kind == Kind::activation ? x.cols() / 2 : 2 * x.cols();
  }
};

// cast_transpose_to_fp8 of a CastSource's [R, C] values (float32 or bfloat16 tensors). out and
// out_t may both be null: then only *amax is taken. dbias as above (of the source's values).
void cast_transpose_to_fp8(const KernelContext& ctx, void* out, void* out_t, Fp8Format format, const CastSource& src,
                           const float* scale, float* amax, GradOut dbias = GradOut());

// *amax = max(*amax, max |in|) (the caller zeroes *amax for a fresh maximum).
void fp8_amax(const KernelContext& ctx, float* amax, Tensor in);

// out[i] = fp8 value of in[i] * *scale_inv (float32 product), rounded once to out's dtype: float32,
// bfloat16 or float16 (dequantization: fp8_dequantize, tests). out.numel() codes are read.
void cast_from_fp8(const KernelContext& ctx, Tensor out, const void* in, Fp8Format format, const float* scale_inv);

// out_t [C, R] = in [R, C], row-major bytes (the transposed copy of an FP8 weight; fp8_transpose).
// Any R and C; 4-byte accesses where R and C are multiples of 4 and both pointers 4-byte aligned.
void fp8_transpose(const KernelContext& ctx, void* out_t, const void* in, int64_t R, int64_t C);

// Delayed scaling (Megatron --fp8-recipe delayed, Transformer Engine semantics) for `count`
// tensors sharing one format. amax_history is [history_len, count] row-major; row 0 holds the
// amax the casts collected this step. Per tensor t:
//   amax  = max over the history (algo max) or row 0 (algo most_recent)
//   roll the history up by one row (row 0 moves to the last row) and zero row 0 for the next step
//   if amax > 0 and finite: scale = (fp8_max / amax) / 2^margin (FLT_MAX where that overflows, as
//           Transformer Engine does), scale_inv = 1 / scale; otherwise both keep their values.
// A history of length 1 gives scales from the last amax alone. scale_stride spaces the scale and
// scale_inv entries (4: each scale_inv 16-byte aligned for the GEMMs' scale pointers).
// fp8_max_per_tensor (device, [count]), when not null, replaces fp8_max per tensor.
enum class Fp8AmaxAlgo : uint8_t { max, most_recent };
void fp8_update_scales(const KernelContext& ctx, float* amax_history, int history_len, int count, float* scale,
                       float* scale_inv, float fp8_max, int margin, Fp8AmaxAlgo algo, int scale_stride = 1,
                       const float* fp8_max_per_tensor = nullptr);

// Tensorwise scaling of one operand (one thread): a = *fresh_amax (this call's tensor only); if
// a > 0 and finite, scale = (fp8_max / a) / 2^margin (FLT_MAX where that overflows) and
// scale_inv = 1 / scale; then *amax = max(*amax, a) when amax is not null. reset_fresh: then
// *fresh_amax = 0 (a persistent slot, zero between casts). scale_inv_copy (may be null) = the
// scale_inv after this call.
void fp8_tensorwise_scale(const KernelContext& ctx, float* fresh_amax, float* amax, float* scale, float* scale_inv,
                          float fp8_max, int margin, bool reset_fresh = false, float* scale_inv_copy = nullptr);

// dst[0] = *a, dst[4] = *b (one thread): copies two scale_inv values into 16-byte aligned slots
// for the FP8 GEMM (cuBLASLt declines scale pointers at 4-byte offsets).
void fp8_copy_scale_pair(const KernelContext& ctx, float* dst, const float* a, const float* b);

}  // namespace mt::cuda
