// --attention-backend dispatch: our flash kernels or cuDNN's fused attention.
#include "cuda/attention.h"

#include <fmt/format.h>

#include "cuda/attention_cudnn.h"
#include "cuda/attention_flash.h"
#include "cuda/attention_generic.h"

namespace mt::cuda {
namespace {

// What `auto` prefers where both paths can run, per head dim: bench/RESULTS.md (H200, cuDNN 9.14)
// has cuDNN ahead at d = 64 and 128 in both passes (e.g. GPT-2 shape 309/213 TFLOP/s vs 198/122).
AttentionBackend measured_faster(int /*head_dim*/) { return AttentionBackend::fused; }

// Within the flash backend: our tensor-core kernels where they are compiled (head dims 64 and 128,
// 16-bit activations), the generic CUDA-core kernels for everything else.
bool use_mma_kernels(const AttentionShape& a, DType dtype) {
  return flash::supports_head_dim(a.head_dim) && (dtype == DType::bf16 || dtype == DType::f16);
}

}  // namespace

bool fused_attention_supported(const AttentionShape& a, DType dtype) { return cudnn_attention::supported(a, dtype); }

AttentionBackend resolve_attention_backend(const AttentionShape& a, AttentionBackend requested, DType dtype) {
  switch (requested) {
    case AttentionBackend::flash:
      return AttentionBackend::flash;
    case AttentionBackend::fused: {
      std::string why;
      if (!cudnn_attention::supported(a, dtype, &why))
        throw Unsupported(fmt::format("--attention-backend fused cannot run this attention (heads={} groups={} d={} "
                                      "dropout={}): {}; use --attention-backend flash or auto",
                                      a.heads, a.groups, a.head_dim, a.dropout_p, why));
      return AttentionBackend::fused;
    }
    case AttentionBackend::auto_: {
      if (measured_faster(a.head_dim) == AttentionBackend::fused && cudnn_attention::supported(a, dtype))
        return AttentionBackend::fused;
      if (!use_mma_kernels(a, dtype) && cudnn_attention::supported(a, dtype)) return AttentionBackend::fused;
      return AttentionBackend::flash;
    }
    case AttentionBackend::unfused:
    case AttentionBackend::local:
      throw Unsupported(fmt::format("--attention-backend {} is not supported by megatrain (its attention never "
                                    "materializes the scores): use flash, fused or auto",
                                    requested == AttentionBackend::unfused ? "unfused" : "local"));
  }
  throw Unsupported("unknown --attention-backend");
}

size_t attention_workspace_bytes(const AttentionShape& a, AttentionBackend backend, DType dtype) {
  switch (resolve_attention_backend(a, backend, dtype)) {
    case AttentionBackend::fused:
      return cudnn_attention::workspace_bytes(a, dtype);
    default:
      if (use_mma_kernels(a, dtype)) return flash::backward_workspace_bytes(a);
      if (!generic::supports_head_dim(a.head_dim))
        throw Unsupported(fmt::format("attention supports head dims 1 to {}, not {} (--kv-channels)",
                                      generic::kMaxHeadDim, a.head_dim));
      return generic::backward_workspace_bytes(a);
  }
}

const int32_t* document_starts(const AttentionShape& a) {
  if (!a.documents) return nullptr;
  const int64_t n = static_cast<int64_t>(a.batch) * a.seq;
  MT_CHECK(a.doc_start.dtype == DType::i32 && a.doc_start.device == Device::cuda && a.doc_start.numel() == n,
           "attention with documents needs doc_start as device int32 [{}] (b * s)", n);
  return a.doc_start.ptr<int32_t>();
}

std::string window_text(const AttentionShape& a) {
  return a.windowed() ? fmt::format(", sliding window of {} keys", a.window_left + 1) : std::string();
}

std::string describe_attention(const AttentionShape& a, AttentionBackend backend, DType dtype) {
  if (resolve_attention_backend(a, backend, dtype) == AttentionBackend::fused) return cudnn_attention::describe(a, dtype);
  const std::string documents =
      a.documents ? ", packed documents (--reset-attention-mask; cuDNN's fused attention takes none here)" : "";
  if (use_mma_kernels(a, dtype))
    return fmt::format("flash: our tensor-core kernels (d={}, {}{}{}), deterministic backward", a.head_dim,
                       dtype_name(dtype), window_text(a), documents);
  return fmt::format("flash: our generic CUDA-core kernels (d={}, {}{}{}, float32 math), deterministic backward",
                     a.head_dim, dtype_name(dtype), window_text(a), documents);
}

void attention_forward(Tensor out, Tensor lse, Tensor qkv, const AttentionShape& a, AttentionBackend backend,
                       void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (resolve_attention_backend(a, backend, qkv.dtype) == AttentionBackend::fused)
    cudnn_attention::forward(out, lse, qkv, a, workspace, workspace_bytes, stream);
  else if (use_mma_kernels(a, qkv.dtype))
    flash::forward(out, lse, qkv, a, flash::default_forward_config(a.head_dim, a.dropout_p > 0), stream);
  else
    generic::forward(out, lse, qkv, a, stream);
}

void attention_backward(Tensor dqkv, Tensor dout, Tensor out, Tensor lse, Tensor qkv, const AttentionShape& a,
                        AttentionBackend backend, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (resolve_attention_backend(a, backend, qkv.dtype) == AttentionBackend::fused)
    cudnn_attention::backward(dqkv, dout, out, lse, qkv, a, workspace, workspace_bytes, stream);
  else if (!use_mma_kernels(a, qkv.dtype))
    generic::backward(dqkv, dout, out, lse, qkv, a, workspace, workspace_bytes, stream);
  else
    flash::backward(dqkv, dout, out, lse, qkv, a, flash::default_backward_config(a.head_dim, a.dropout_p > 0), workspace,
                    workspace_bytes, stream);
}

}  // namespace mt::cuda
