// Host side of the flash attention kernels: shape checks, parameters, workspace, dispatch.
#include "cuda/attention_flash.h"

#include <fmt/format.h>

#include <cmath>

#include "cuda/attention.h"
#include "cuda/attention_flash_kernels.h"
#include "cuda/cuda_check.h"

namespace mt::cuda::flash {

std::string ForwardConfig::name() const { return fmt::format("fwd {}x{} w{}", block_m, block_n, warps); }
std::string BackwardConfig::name() const {
  return fmt::format("bwd {}x{}{}", block_m, block_n, deterministic ? "" : " atomic");
}

bool supports_head_dim(int head_dim) { return head_dim == 64 || head_dim == 128; }

// Defaults from bench_attention (bench/RESULTS.md): on an H200 without dropout; with dropout at
// d = 64 on an H100 (bench_attention --configs, 2026-12-07: the same tiles as without it, now that
// one draw decides eight elements). With dropout at d = 128 one 16-row tile per warp.
ForwardConfig default_forward_config(int head_dim, bool dropout) {
  if (head_dim == 64) return ForwardConfig{128, 64, 4};
  return dropout ? ForwardConfig{128, 64, 8} : ForwardConfig{128, 128, 8};
}
BackwardConfig default_backward_config(int head_dim, bool /*dropout: the same tiles*/) {
  if (head_dim == 64) return BackwardConfig{128, 128};
  return BackwardConfig{64, 128};
}

std::vector<ForwardConfig> forward_configs(int head_dim, bool dropout) {
  if (dropout) {
    if (head_dim == 64) return {{128, 64, 4}, {128, 64, 8}};
    if (head_dim == 128) return {{128, 64, 8}, {128, 128, 8}};
    return {};
  }
  if (head_dim == 64) return {{128, 64, 4}, {64, 64, 4}, {128, 64, 8}, {128, 128, 8}};
  if (head_dim == 128) return {{128, 128, 8}, {64, 64, 4}, {128, 32, 4}, {128, 64, 8}};
  return {};
}
std::vector<BackwardConfig> backward_configs(int head_dim, bool dropout) {
  if (dropout) {
    if (head_dim == 64) return {{128, 128}, {64, 128}, {64, 64}};
    if (head_dim == 128) return {{64, 128}};
    return {};
  }
  if (head_dim == 64) return {{128, 128}, {64, 64}, {64, 128}, {64, 128, false}};
  if (head_dim == 128) return {{64, 128}, {32, 128}, {64, 64}, {64, 128, false}};
  return {};
}

void check_shape(const AttentionShape& a, Tensor qkv, Tensor out, Tensor lse) {
  if (a.batch <= 0 || a.seq <= 0 || a.heads <= 0 || a.groups <= 0 || a.heads % a.groups != 0)
    fail("attention: invalid shape b={} s={} heads={} groups={} (heads must be a multiple of groups)", a.batch,
         a.seq, a.heads, a.groups);
  if (!supports_head_dim(a.head_dim))
    throw Unsupported(fmt::format(
        "--attention-backend flash supports head dims 64 and 128, not {} (use --kv-channels 64 or 128)", a.head_dim));
  if (!(a.dropout_p >= 0 && a.dropout_p < 1)) fail("attention: dropout probability {} not in [0, 1)", a.dropout_p);
  if (qkv.dtype != DType::bf16 && qkv.dtype != DType::f16)
    throw Unsupported(fmt::format("flash attention needs bf16 or fp16 activations, got {}", dtype_name(qkv.dtype)));
  const int64_t n = static_cast<int64_t>(a.batch) * a.seq;
  auto check = [&](const Tensor& t, const char* name, int64_t numel, DType dtype) {
    MT_CHECK(t.device == Device::cuda, "attention {} must be device memory", name);
    MT_CHECK(t.numel() == numel, "attention {} has {} elements, shape needs {}", name, t.numel(), numel);
    MT_CHECK(t.dtype == dtype, "attention {} is {}, expected {}", name, dtype_name(t.dtype), dtype_name(dtype));
    MT_CHECK(reinterpret_cast<uintptr_t>(t.data) % 16 == 0, "attention {} must be 16-byte aligned", name);
  };
  check(qkv, "qkv", n * a.qkv_row_stride(), qkv.dtype);
  check(out, "out", n * a.heads * a.head_dim, qkv.dtype);
  check(lse, "lse", n * a.heads, DType::f32);
}

namespace {

size_t align_up(size_t x) { return (x + 255) / 256 * 256; }

struct BackwardWorkspace {
  size_t delta = 0, dq_accum = 0, turn = 0, total = 0;  // byte offsets and total size
  explicit BackwardWorkspace(const AttentionShape& a) {
    const size_t bh = static_cast<size_t>(a.batch) * a.heads;
    const size_t rows = (static_cast<size_t>(a.seq) + kDqRowPad - 1) / kDqRowPad * kDqRowPad;
    dq_accum = align_up(bh * a.seq * sizeof(float));
    turn = dq_accum + align_up(bh * rows * a.head_dim * sizeof(float));
    total = turn + align_up(bh * ((a.seq + kMinBlockM - 1) / kMinBlockM) * kMaxWarps * sizeof(int));
  }
};

Params make_params(const AttentionShape& a, Tensor qkv) {
  Params p;
  p.qkv = qkv.data;
  p.batch = a.batch;
  p.seq = a.seq;
  p.heads = a.heads;
  p.groups = a.groups;
  p.hpg = a.heads / a.groups;
  p.row_stride = a.qkv_row_stride();
  p.seq_stride = static_cast<int64_t>(a.batch) * p.row_stride;
  p.out_seq_stride = static_cast<int64_t>(a.batch) * a.heads * a.head_dim;
  p.softmax_scale = a.softmax_scale;
  p.scale_log2 = a.softmax_scale * kLog2e;
  p.causal = a.causal;
  p.window = a.window_left;
  p.doc_start = document_starts(a);
  p.dropout_p = a.dropout_p;
  p.dropout_scale = 1.0f / (1.0f - a.dropout_p);
  p.dropout_key = a.dropout_key;
  return p;
}

}  // namespace

size_t backward_workspace_bytes(const AttentionShape& a) { return BackwardWorkspace(a).total; }

void forward(Tensor out, Tensor lse, Tensor qkv, const AttentionShape& a, const ForwardConfig& config,
             cudaStream_t stream) {
  check_shape(a, qkv, out, lse);
  Params p = make_params(a, qkv);
  p.out = out.data;
  p.lse = lse.ptr<float>();
  const bool dropout = a.dropout_p > 0;
  bool launched;
  if (qkv.dtype == DType::bf16)
    launched = dropout ? forward_dispatch<__nv_bfloat16, true>(p, a.head_dim, config, stream)
                       : forward_dispatch<__nv_bfloat16, false>(p, a.head_dim, config, stream);
  else
    launched = dropout ? forward_dispatch<__half, true>(p, a.head_dim, config, stream)
                       : forward_dispatch<__half, false>(p, a.head_dim, config, stream);
  MT_CHECK(launched, "no compiled flash forward kernel for d={} {} {}", a.head_dim, dtype_name(qkv.dtype),
           config.name());
}

void backward(Tensor dqkv, Tensor dout, Tensor out, Tensor lse, Tensor qkv, const AttentionShape& a,
              const BackwardConfig& config, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  check_shape(a, qkv, out, lse);
  check_shape(a, dqkv, dout, lse);
  MT_CHECK(dqkv.dtype == qkv.dtype && dout.dtype == qkv.dtype, "attention backward dtypes differ");
  const BackwardWorkspace ws(a);
  MT_CHECK(workspace != nullptr && workspace_bytes >= ws.total,
           "attention backward workspace has {} bytes, needs {} (size it with attention_workspace_bytes)",
           workspace_bytes, ws.total);
  MT_CHECK(reinterpret_cast<uintptr_t>(workspace) % 256 == 0, "attention workspace must be 256-byte aligned");
  Params p = make_params(a, qkv);
  p.out = out.data;
  p.lse = lse.ptr<float>();
  p.dout = dout.data;
  p.dqkv = dqkv.data;
  char* base = static_cast<char*>(workspace);
  p.delta = reinterpret_cast<float*>(base + ws.delta);
  p.dq_accum = reinterpret_cast<float*>(base + ws.dq_accum);
  p.dq_turn = reinterpret_cast<int*>(base + ws.turn);
  const bool dropout = a.dropout_p > 0;
  bool launched;
  if (qkv.dtype == DType::bf16)
    launched = dropout ? backward_dispatch<__nv_bfloat16, true>(p, a.head_dim, config, stream)
                       : backward_dispatch<__nv_bfloat16, false>(p, a.head_dim, config, stream);
  else
    launched = dropout ? backward_dispatch<__half, true>(p, a.head_dim, config, stream)
                       : backward_dispatch<__half, false>(p, a.head_dim, config, stream);
  MT_CHECK(launched, "no compiled flash backward kernel for d={} {} {}", a.head_dim, dtype_name(qkv.dtype),
           config.name());
}

}  // namespace mt::cuda::flash
