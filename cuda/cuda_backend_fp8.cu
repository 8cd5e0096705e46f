// CudaBackend's FP8 ops (engine/backend.h, "FP8 linear layers" and "FP8 parameters"): the quantizing
// cast, the three linear-layer GEMMs on cuBLASLt FP8 (cuda/fp8_gemm_cublaslt.h, cuda/fp8_kernels.h),
// and the FP8 weight's transpose and dequantization.
//
// Notes on the mapping to the kernels:
//   - fp8_quantize: delayed scaling is one pass (the cast records max|x| into meta.amax);
//     tensorwise is an amax pass into scratch, a one-thread scale kernel, then the cast.
//   - The GEMMs' scale_inv pointers must be 16-byte aligned (cuBLASLt 13.1 declines others at run
//     time, measured on the H200); entries of the model's flat FP8 state usually are not, so both
//     values are first copied into two aligned slots of a small buffer the backend owns. Ops are
//     ordered on one stream, so the next copy runs after the GEMM that read the slots.
//   - The bias is added in the GEMM's epilogue (bf16 outputs only; float32 FP8 layers, without
//     --bf16, have none); the activation is its own kernel
//     on the stored pre-activation (as linear_forward's non-fused path and the reference do).
//   - Accumulating input gradients go through float32 scratch, a row block at a time, then are
//     added (with the activation derivative when there is one) by the elementwise kernels.
#include <fmt/format.h>

#include <algorithm>
#include <array>

#include "cuda/cuda_backend.h"
#include "cuda/cuda_backend_dispatch.h"
#include "cuda/cuda_check.h"
#include "cuda/fp8_gemm_cublaslt.h"
#include "cuda/fp8_kernels.h"

namespace mt {
namespace {

using cuda_dispatch::on_device;

cuda::Fp8Format fp8_format_of(DType t, const char* op, const char* what) {
  MT_CHECK(is_fp8(t), "{}: {} must be an FP8 tensor (float8_e4m3fn / float8_e5m2), got {}", op, what, dtype_name(t));
  return t == DType::fp8_e4m3 ? cuda::Fp8Format::e4m3 : cuda::Fp8Format::e5m2;
}

const float* scalar_ptr(const Tensor& t, const char* op, const char* what) {
  MT_CHECK(!t.empty() && t.dtype == DType::f32 && t.numel() >= 1, "{}: {} must be a float32 [1] tensor", op, what);
  return t.ptr<const float>();
}

// bf16, or float32 (FP8 layers without --bf16: the GEMMs write float32).
void check_compute_dtype(const Tensor& t, const char* op, const char* what) {
  MT_CHECK(t.dtype == DType::bf16 || t.dtype == DType::f32,
           "{}: {} is {}; the CUDA backend runs FP8 linear layers in bf16 or float32", op, what, dtype_name(t.dtype));
}

}  // namespace

cuda::Fp8GemmRunner& CudaBackend::fp8_gemm() {
  if (!fp8_gemm_) {
    // Made at set-up (prepare_fp8_gemms), never inside a step.
    fp8_gemm_ = std::make_unique<cuda::Fp8GemmRunner>(stream_, kGemmWorkspaceBytes);
    bytes_allocated_ += kGemmWorkspaceBytes;  // (the runner's own cudaMalloc)
    fp8_scale_slots_ = static_cast<float*>(device_alloc(8 * sizeof(float)));
  }
  return *fp8_gemm_;
}

void CudaBackend::fp8_stage_scales(const cuda::KernelContext& ctx, const Tensor& a_scale_inv,
                                   const Tensor& b_scale_inv, const char* op) {
  fp8_gemm();
  cuda::fp8_copy_scale_pair(ctx, fp8_scale_slots_, scalar_ptr(a_scale_inv, op, "first scale_inv"),
                            scalar_ptr(b_scale_inv, op, "second scale_inv"));
}

// The quantizing ops: the values of src (cuda/fp8_kernels.h), dbias (may be empty) += their column sums.
void CudaBackend::fp8_quantize_impl(const char* op, Tensor q, Tensor q_t, const cuda::CastSource& src,
                                    const Fp8TensorMeta& meta, Tensor dbias) {
  const Tensor& x = src.x;
  on_device(op, q, q_t, x, src.pre, meta.scale, meta.scale_inv, meta.amax, dbias, meta.fresh, meta.scale_inv_copy);
  MT_PROFILE_OP("{} {}{}{}", op, x.shape_string(), q.empty() ? "" : " q", q_t.empty() ? "" : " q_t");
  MT_CHECK(!q.empty() || !q_t.empty(), "{}: neither q nor q_t given", op);
  const DType e = !q.empty() ? q.dtype : q_t.dtype;
  MT_CHECK(q.empty() || q_t.empty() || q.dtype == q_t.dtype, "{}: q and q_t have different FP8 dtypes", op);
  const cuda::Fp8Format f = fp8_format_of(e, op, "q");
  MT_CHECK(meta.recipe == Fp8Recipe::delayed || meta.recipe == Fp8Recipe::tensorwise,
           "{}: the CUDA backend quantizes with the delayed or tensorwise recipe only", op);
  const int64_t R = src.rows(), C = src.cols();
  MT_CHECK(q.empty() || (q.rows() == R && q.cols() == C), "{}: q {} for x {}", op, q.shape_string(), x.shape_string());
  MT_CHECK(q_t.empty() || (q_t.rows() == C && q_t.cols() == R), "{}: q_t {} for x {}", op, q_t.shape_string(),
           x.shape_string());
  cuda::check_grad(dbias, C, op, "dbias");
  float* scale = const_cast<float*>(scalar_ptr(meta.scale, op, "meta.scale"));
  float* amax = meta.amax.empty() ? nullptr : meta.amax.ptr<float>();
  const cuda::KernelContext ctx = context();
  const bool plain = src.kind == cuda::CastSource::Kind::plain;
  float* record = amax;
  MT_CHECK(meta.recipe == Fp8Recipe::tensorwise || (meta.fresh.empty() && meta.scale_inv_copy.empty()),
           "{}: a fresh amax slot or scale_inv copy outside tensorwise scaling", op);
  MT_CHECK(!meta.fresh_taken || !meta.fresh.empty(), "{}: fresh_taken without a fresh amax slot", op);
  if (meta.recipe == Fp8Recipe::tensorwise) {
    // The operand's persistent slot (zero between casts) or, without one, zeroed scratch.
    float* fresh = meta.fresh.empty() ? nullptr : const_cast<float*>(scalar_ptr(meta.fresh, op, "meta.fresh"));
    if (!fresh) {
      fresh = ctx.scratch->take_array<float>(1, "fp8_quantize amax");
      MT_CUDA_CHECK(cudaMemsetAsync(fresh, 0, sizeof(float), stream_));
    }
    if (!meta.fresh_taken) {  // the amax pass (else the op that wrote x's source took it)
      if (plain) cuda::fp8_amax(ctx, fresh, x);
      else cuda::cast_transpose_to_fp8(ctx, nullptr, nullptr, f, src, scale, fresh);
    }
    float* copy = meta.scale_inv_copy.empty() ? nullptr
                                              : const_cast<float*>(scalar_ptr(meta.scale_inv_copy, op, "scale_inv_copy"));
    cuda::fp8_tensorwise_scale(ctx, fresh, amax, scale, const_cast<float*>(scalar_ptr(meta.scale_inv, op, "meta.scale_inv")),
                               fp8_max(e), meta.margin, !meta.fresh.empty(), copy);
    record = nullptr;  // meta.amax already holds max(meta.amax, max|x|)
  }
  void* out = q.empty() ? nullptr : q.data;
  void* out_t = q_t.empty() ? nullptr : q_t.data;
  if (plain && !out_t && dbias.empty()) cuda::cast_to_fp8(ctx, out, f, x, scale, record);
  else cuda::cast_transpose_to_fp8(ctx, out, out_t, f, src, scale, record, cuda::GradOut(dbias));
}

void CudaBackend::fp8_quantize(Tensor q, Tensor q_t, Tensor x, const Fp8TensorMeta& meta) {
  fp8_quantize_impl("fp8_quantize", q, q_t, {cuda::CastSource::Kind::plain, x, Tensor()}, meta, Tensor());
}

// Delayed scaling: every group in one launch where the kernel takes the shapes (the per-group
// casts, Backend's default, otherwise: tensorwise scaling's amax passes, odd row counts).
void CudaBackend::fp8_quantize_groups(Tensor q, Tensor q_t, Tensor x, std::span<const int64_t> off,
                                      std::span<const Fp8TensorMeta> metas) {
  const char* op = "fp8_quantize_groups";
  MT_CHECK(!off.empty() && metas.size() + 1 == off.size(), "{}: {} offsets for {} groups", op, off.size(), metas.size());
  bool one_launch = metas.size() <= static_cast<size_t>(cuda::kMaxCastGroups) && (!q.empty() || !q_t.empty());
  for (const Fp8TensorMeta& m : metas)
    one_launch = one_launch && m.recipe == Fp8Recipe::delayed && m.fresh.empty() && m.scale_inv_copy.empty();
  if (one_launch) {
    on_device(op, q, q_t, x);
    MT_PROFILE_OP("{} {} x {} groups{}{}", op, x.shape_string(), metas.size(), q.empty() ? "" : " q",
                  q_t.empty() ? "" : " q_t");
    const DType e = !q.empty() ? q.dtype : q_t.dtype;
    MT_CHECK(q.empty() || q_t.empty() || q.dtype == q_t.dtype, "{}: q and q_t have different FP8 dtypes", op);
    const int64_t R = off.back(), C = x.cols();
    MT_CHECK(x.rows() >= R && (q.empty() || (q.cols() == C && q.rows() >= R)) && (q_t.empty() || q_t.numel() >= R * C),
             "{}: x {}, q {}, q_t {} for {} rows", op, x.shape_string(), q.shape_string(), q_t.shape_string(), R);
    std::array<const float*, cuda::kMaxCastGroups> scales;
    std::array<float*, cuda::kMaxCastGroups> amaxes;
    for (size_t g = 0; g < metas.size(); ++g) {
      on_device(op, metas[g].scale, metas[g].amax);
      scales[g] = scalar_ptr(metas[g].scale, op, "meta.scale");
      amaxes[g] = metas[g].amax.empty() ? nullptr : metas[g].amax.ptr<float>();
    }
    const size_t n = metas.size();
    if (cuda::cast_transpose_groups_to_fp8(context(), q.empty() ? nullptr : q.data, q_t.empty() ? nullptr : q_t.data,
                                           fp8_format_of(e, op, "q"), x, off, std::span(scales.data(), n),
                                           std::span(amaxes.data(), n)))
      return;
  }
  Backend::fp8_quantize_groups(q, q_t, x, off, metas);
}

void CudaBackend::fp8_quantize_with_dbias(Tensor q, Tensor q_t, Tensor dy, const Fp8TensorMeta& meta, Tensor dbias) {
  fp8_quantize_impl("fp8_quantize_with_dbias", q, q_t, {cuda::CastSource::Kind::plain, dy, Tensor()}, meta, dbias);
}

void CudaBackend::fp8_quantize_activation(Tensor q, Tensor q_t, Tensor pre, MlpActivation act,
                                          const Fp8TensorMeta& meta, const Glu& glu) {
  cuda::CastSource src{cuda::CastSource::Kind::activation, pre, Tensor(), act};
  src.glu = glu;
  fp8_quantize_impl("fp8_quantize_activation", q, q_t, src, meta, Tensor());
}

void CudaBackend::fp8_quantize_norm(Tensor q, Tensor q_t, Tensor x, Tensor mean, Tensor rstd, Tensor weight,
                                    Tensor bias, const NormParams& p, const Fp8TensorMeta& meta) {
  on_device("fp8_quantize_norm", mean, rstd, weight, bias);
  cuda::CastSource src{cuda::CastSource::Kind::norm, x, Tensor()};
  src.mean = p.kind == Normalization::rmsnorm ? Tensor() : mean;  // RMSNorm's stored mean is 0
  src.rstd = rstd, src.weight = weight, src.bias = bias, src.one_p = p.one_p;
  fp8_quantize_impl("fp8_quantize_norm", q, q_t, src, meta, Tensor());
}

void CudaBackend::fp8_quantize_activation_backward(Tensor q, Tensor q_t, Tensor dout, Tensor pre, MlpActivation act,
                                             const Fp8TensorMeta& meta, Tensor dbias, const Glu& glu) {
  cuda::CastSource src{cuda::CastSource::Kind::activation_grad, dout, pre, act};
  src.glu = glu;
  fp8_quantize_impl("fp8_quantize_activation_backward", q, q_t, src, meta, dbias);
}

void CudaBackend::fp8_linear_forward(Tensor y, Tensor xq, Tensor x_scale_inv, Tensor wq, Tensor w_scale_inv,
                                     Tensor bias, Activation act, Tensor pre_act) {
  const char* op = "fp8_linear_forward";
  on_device(op, y, xq, x_scale_inv, wq, w_scale_inv, bias, pre_act);
  MT_PROFILE_OP("fp8_linear_forward {}x{}x{}{}{}", xq.rows(), wq.rows(), xq.cols(), bias.empty() ? "" : " +bias",
                act == Activation::none ? "" : " +act");
  const int64_t M = xq.rows(), K = xq.cols(), N = wq.rows();
  MT_CHECK(wq.cols() == K && y.numel() == M * N, "{}: y {} = xq {} . wq {}^T", op, y.shape_string(), xq.shape_string(),
           wq.shape_string());
  check_compute_dtype(y, op, "y");
  // (The bias is the GEMM epilogue's, for bf16 outputs only: float32 FP8 layers have none, app/ refuses them.)
  MT_CHECK(bias.empty() || (bias.numel() == N && bias.dtype == DType::bf16 && y.dtype == DType::bf16),
           "{}: bias {} {} with y {}: the FP8 GEMM adds a bfloat16 bias to a bfloat16 output only", op,
           dtype_name(bias.dtype), bias.shape_string(), dtype_name(y.dtype));
  MT_CHECK(act == Activation::none || (pre_act.numel() == M * N && pre_act.dtype == y.dtype), "{}: pre_act {}", op,
           pre_act.shape_string());
  const cuda::KernelContext ctx = context();
  fp8_stage_scales(ctx, x_scale_inv, w_scale_inv, op);
  const Tensor target = act != Activation::none ? pre_act : y;
  cuda::fp8_linear_forward(fp8_gemm(), target.view({M, N}),
                           {xq.data, fp8_format_of(xq.dtype, op, "xq"), fp8_scale_slots_},
                           {wq.data, fp8_format_of(wq.dtype, op, "wq"), fp8_scale_slots_ + 4}, K, bias.data);
  if (act != Activation::none) cuda::activation_forward(ctx, y, pre_act, act);
}

void CudaBackend::fp8_linear_backward_input(Tensor dx, Tensor dyq, Tensor dy_scale_inv, Tensor wq_t,
                                            Tensor w_scale_inv, bool accumulate, Activation act, Tensor pre_act) {
  const char* op = "fp8_linear_backward_input";
  on_device(op, dx, dyq, dy_scale_inv, wq_t, w_scale_inv, pre_act);
  MT_PROFILE_OP("fp8_linear_backward_input {}x{}x{}{}{}", dyq.rows(), wq_t.rows(), dyq.cols(), accumulate ? " +acc" : "",
                act == Activation::none ? "" : " +act");
  const int64_t M = dyq.rows(), N = dyq.cols(), K = wq_t.rows();
  MT_CHECK(wq_t.cols() == N && dx.numel() == M * K, "{}: dx {} = dyq {} . wq_t {}^T", op, dx.shape_string(),
           dyq.shape_string(), wq_t.shape_string());
  check_compute_dtype(dx, op, "dx");
  MT_CHECK(act == Activation::none || (pre_act.numel() == M * K && pre_act.dtype == dx.dtype), "{}: pre_act {}", op,
           pre_act.shape_string());
  const cuda::KernelContext ctx = context();
  fp8_stage_scales(ctx, dy_scale_inv, w_scale_inv, op);
  const cuda::Fp8Operand dy_op{dyq.data, fp8_format_of(dyq.dtype, op, "dyq"), fp8_scale_slots_};
  const cuda::Fp8Operand w_op{wq_t.data, fp8_format_of(wq_t.dtype, op, "wq_t"), fp8_scale_slots_ + 4};
  const Tensor dx2 = dx.view({M, K});
  if (!accumulate) {
    cuda::fp8_linear_backward_input(fp8_gemm(), dx2, dy_op, w_op, N, false);
    if (act != Activation::none) cuda::activation_grad_multiply(ctx, dx2, dx2, pre_act.view({M, K}), act, false);
    return;
  }
  // dx += (dyq . wq_t^T) [* act'(pre_act)]: the product in float32 scratch, 16-row multiples at a time.
  int64_t chunk = std::min<int64_t>(M, static_cast<int64_t>(ctx.scratch->remaining() / (K * sizeof(float))));
  chunk = chunk / 16 * 16;
  MT_CHECK(chunk >= 16, "{}: scratch too small for 16 rows of {} floats", op, K);
  float* tmp = ctx.scratch->take_array<float>(chunk * K, "fp8_linear_backward_input accumulate");
  for (int64_t r0 = 0; r0 < M; r0 += chunk) {
    const int64_t rows = std::min(chunk, M - r0);
    const Tensor part(tmp, DType::f32, Device::cuda, {rows, K});
    cuda::Fp8Operand dy_rows = dy_op;
    dy_rows.data = static_cast<const uint8_t*>(dyq.data) + r0 * N;
    cuda::fp8_linear_backward_input(fp8_gemm(), part, dy_rows, w_op, N, false);
    const Tensor out = dx2.row_slice(r0, rows);
    if (act != Activation::none)
      cuda::activation_grad_multiply(ctx, out, part, pre_act.view({M, K}).row_slice(r0, rows), act, true);
    else
      cuda::axpby(ctx, out, 1.0f, out, 1.0f, part);
  }
}

void CudaBackend::fp8_linear_backward_weight(Tensor dw, Tensor dbias, Tensor dy, Tensor dyq_t, Tensor dy_scale_inv,
                                             Tensor xq_t, Tensor x_scale_inv, bool accumulate) {
  const char* op = "fp8_linear_backward_weight";
  on_device(op, dw, dbias, dy, dyq_t, dy_scale_inv, xq_t, x_scale_inv);
  MT_PROFILE_OP("fp8_linear_backward_weight {}x{}x{}{}{}", dyq_t.rows(), xq_t.rows(), dyq_t.cols(),
                accumulate ? " +acc" : "", dbias.empty() ? "" : " +dbias");
  const int64_t N = dyq_t.rows(), M = dyq_t.cols(), K = xq_t.rows();
  MT_CHECK(xq_t.cols() == M && dw.numel() == N * K, "{}: dw {} += dyq_t {} . xq_t {}^T", op, dw.shape_string(),
           dyq_t.shape_string(), xq_t.shape_string());
  cuda::check_grad(dw, N * K, op, "dw");
  cuda::check_grad(dbias, N, op, "dbias");
  MT_CHECK(dbias.empty() || dy.numel() == M * N, "{}: dbias {} from dy {}", op, dbias.shape_string(),
           dy.shape_string());
  const cuda::KernelContext ctx = context();
  // A bf16 dw takes float32 scratch for the product: the bias gradient's column sums go first.
  const bool dbias_first = dw.dtype != DType::f32 && !dbias.empty();
  if (dbias_first) {
    cuda::column_sum_accumulate(ctx, dbias, dy.view({M, N}));
    ctx.scratch->reset();  // its kernels precede the GEMMs on the stream
  }
  fp8_stage_scales(ctx, dy_scale_inv, x_scale_inv, op);
  cuda::fp8_linear_backward_weight(fp8_gemm(), dw.view({N, K}),
                                   {dyq_t.data, fp8_format_of(dyq_t.dtype, op, "dyq_t"), fp8_scale_slots_},
                                   {xq_t.data, fp8_format_of(xq_t.dtype, op, "xq_t"), fp8_scale_slots_ + 4}, M,
                                   accumulate, &ctx);
  if (!dbias.empty() && !dbias_first) cuda::column_sum_accumulate(ctx, dbias, dy.view({M, N}));
}

void CudaBackend::fp8_update_scales(Tensor history, Tensor scale, Tensor scale_inv, Tensor fp8_max_t,
                                    const Fp8ScaleUpdate& p) {
  const char* op = "fp8_update_scales";
  on_device(op, history, scale, scale_inv, fp8_max_t);
  MT_PROFILE_OP("fp8_update_scales {}", history.shape_string());
  const int64_t H = history.rows(), n = history.cols();
  for (const Tensor* t : {&history, &scale, &scale_inv, &fp8_max_t})
    MT_CHECK(t->dtype == DType::f32, "{}: float32 tensors only", op);
  MT_CHECK(scale.numel() == n && scale_inv.numel() == n && fp8_max_t.numel() == n,
           "{}: history {} with scale {}, scale_inv {}, fp8_max {}", op, history.shape_string(), scale.shape_string(),
           scale_inv.shape_string(), fp8_max_t.shape_string());
  if (n == 0) return;
  cuda::fp8_update_scales(context(), history.ptr<float>(), static_cast<int>(H), static_cast<int>(n), scale.ptr<float>(),
                          scale_inv.ptr<float>(), 0.0f, p.margin,
                          p.algo == Fp8AmaxAlgo::max ? cuda::Fp8AmaxAlgo::max : cuda::Fp8AmaxAlgo::most_recent, 1,
                          fp8_max_t.ptr<float>());
}

// FP8 parameters (--fp8-param-gather): the weight's transposed copy and its dequantized values.
void CudaBackend::fp8_transpose(Tensor q_t, Tensor q) {
  const char* op = "fp8_transpose";
  on_device(op, q_t, q);
  MT_PROFILE_OP("fp8_transpose {}", q.shape_string());
  MT_CHECK(is_fp8(q.dtype) && q_t.dtype == q.dtype, "{}: q {} and q_t {} must be one FP8 dtype", op,
           dtype_name(q.dtype), dtype_name(q_t.dtype));
  const int64_t R = q.rows(), C = q.cols();
  MT_CHECK(q_t.rows() == C && q_t.cols() == R, "{}: q_t {} for q {}", op, q_t.shape_string(), q.shape_string());
  cuda::fp8_transpose(context(), q_t.data, q.data, R, C);
}

void CudaBackend::fp8_dequantize(Tensor out, Tensor q, Tensor scale_inv) {
  const char* op = "fp8_dequantize";
  on_device(op, out, q, scale_inv);
  MT_PROFILE_OP("fp8_dequantize {} {}", q.shape_string(), dtype_name(out.dtype));
  const cuda::Fp8Format f = fp8_format_of(q.dtype, op, "q");
  MT_CHECK(out.numel() == q.numel(), "{}: out {} for q {}", op, out.shape_string(), q.shape_string());
  MT_CHECK(out.dtype == DType::bf16 || out.dtype == DType::f32 || out.dtype == DType::f16,
           "{}: out is {}; it must be bfloat16, float32 or float16", op, dtype_name(out.dtype));
  // scale_inv stays on the device: the kernel reads it after the stream's earlier writes.
  cuda::cast_from_fp8(context(), out, q.data, f, scalar_ptr(scale_inv, op, "scale_inv"));
}

}  // namespace mt
