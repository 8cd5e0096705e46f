// ReferenceBackend: attention entry points (the loops live in engine/reference/attention.cpp).
#include "engine/reference/attention.h"
#include "engine/reference/reference_backend.h"
#include "engine/reference/tensor_access.h"

namespace mt::reference {

void ReferenceBackend::attention_forward(Tensor out, Tensor lse, Tensor qkv, const AttentionShape& a) {
  dispatch_float(qkv, "attention_forward",
                 [&](auto tag) { reference_attention_forward<decltype(tag)>(out, lse, qkv, a); });
}

void ReferenceBackend::attention_backward(Tensor dqkv, Tensor dout, Tensor out, Tensor lse, Tensor qkv,
                                          const AttentionShape& a) {
  dispatch_float(qkv, "attention_backward",
                 [&](auto tag) { reference_attention_backward<decltype(tag)>(dqkv, dout, out, lse, qkv, a); });
}

void ReferenceBackend::attention_block_forward(Tensor out, Tensor lse, Tensor q, Tensor kv, const AttentionShape& a,
                                               const AttentionBlock& blk) {
  dispatch_float(q, "attention_block_forward",
                 [&](auto tag) { reference_attention_block_forward<decltype(tag)>(out, lse, q, kv, a, blk); });
}

void ReferenceBackend::attention_block_backward(Tensor dq, Tensor dkv, Tensor dout, Tensor out, Tensor lse, Tensor q,
                                                Tensor kv, const AttentionShape& a, const AttentionBlock& blk) {
  dispatch_float(q, "attention_block_backward", [&](auto tag) {
    reference_attention_block_backward<decltype(tag)>(dq, dkv, dout, out, lse, q, kv, a, blk);
  });
}

void ReferenceBackend::attention_sink_forward(Tensor out, Tensor lse, Tensor sink) {
  dispatch_float(out, "attention_sink_forward",
                 [&](auto tag) { reference_attention_sink_forward<decltype(tag)>(out, lse, sink); });
}

void ReferenceBackend::attention_sink_backward(Tensor dsink, Tensor dout, Tensor out, Tensor lse, Tensor sink) {
  dispatch_float(out, "attention_sink_backward",
                 [&](auto tag) { reference_attention_sink_backward<decltype(tag)>(dsink, dout, out, lse, sink); });
}

void ReferenceBackend::attention_merge(Tensor out, Tensor lse, Tensor out_blk, Tensor lse_blk) {
  dispatch_float(out, "attention_merge",
                 [&](auto tag) { reference_attention_merge<decltype(tag)>(out, lse, out_blk, lse_blk); });
}

void ReferenceBackend::attention_kv_pack(Tensor kv, Tensor qkv, const AttentionShape& a) {
  dispatch_float(qkv, "attention_kv_pack",
                 [&](auto tag) { reference_attention_kv_pack<decltype(tag)>(kv, qkv, a); });
}

void ReferenceBackend::attention_kv_unpack_add(Tensor dqkv, Tensor dkv, const AttentionShape& a) {
  dispatch_float(dqkv, "attention_kv_unpack_add",
                 [&](auto tag) { reference_attention_kv_unpack_add<decltype(tag)>(dqkv, dkv, a); });
}

// Nothing to reserve on the host: the block ops allocate their few rows of scratch per call. The
// checks are the set-up time ones: the shape, and a data type the loops run in.
void ReferenceBackend::reserve_attention_blocks(const AttentionShape& a, int max_kv_len, DType dtype) {
  check_attention_blocks(a, max_kv_len);
  if (dtype != DType::f32 && dtype != DType::f64)
    throw Unsupported(fmt::format("reference backend: attention blocks on {} tensors (float32 and float64 only)",
                                  dtype_name(dtype)));
}

}  // namespace mt::reference
