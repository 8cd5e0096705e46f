// Packed documents (--reset-attention-mask) on the GPU: the attention of each document of a packed
// sequence stays inside it. Our flash kernels take the documents (the tensor-core ones for head
// dims 64 and 128 in 16 bits, the generic CUDA-core ones otherwise; cuDNN's graphs refuse them and
// `auto` runs flash); both must equal the reference backend on fresh random inputs with random
// document lengths (documents of length 1 included), float32 and 16-bit activations, GQA, dropout
// (megatrain's own mask, which our kernels and the reference draw alike) and a sliding window. The
// backward is fed the GPU forward's out and lse, and so is the reference's.
#include <catch2/catch.hpp>

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "core/philox.h"
#include "cuda/attention.h"
#include "cuda/attention_flash.h"
#include "cuda/attention_generic.h"
#include "engine/reference/attention.h"
#include "tests/gpu/attention_test_util.h"

using namespace mt;
using namespace mt::test::attention;

namespace {

struct DocCase {
  std::string name;
  int b, s, heads, groups, d;
  DType dtype;
  int max_doc;           // document lengths drawn in [1, max_doc]
  float dropout = 0;
  int window = -1;
};

void run_case(const DocCase& c) {
  INFO(c.name);
  AttentionShape a = AttentionShape::make(c.b, c.s, c.heads, c.groups, c.d, true, c.dropout, 0xd0c);
  a.window_left = c.window;
  a.documents = true;
  std::vector<int32_t> starts = random_documents(c.b, c.s, c.max_doc, 77 + c.s);
  int32_t* d_starts = nullptr;
  MT_CUDA_CHECK(cudaMalloc(&d_starts, starts.size() * 4));
  MT_CUDA_CHECK(cudaMemcpy(d_starts, starts.data(), starts.size() * 4, cudaMemcpyHostToDevice));
  a.doc_start = Tensor(d_starts, DType::i32, Device::cuda, {static_cast<int64_t>(starts.size())});
  AttentionShape ref_shape = a;
  ref_shape.doc_start = Tensor(starts.data(), DType::i32, Device::cpu, {static_cast<int64_t>(starts.size())});
  int documents = 0;
  for (size_t t = 0; t < starts.size(); ++t) documents += starts[t] == static_cast<int32_t>(t % c.s);

  // Which implementation runs: ours, whatever is asked for but fused (refused).
  CHECK(cuda::resolve_attention_backend(a, AttentionBackend::auto_, c.dtype) == AttentionBackend::flash);
  CHECK_THROWS_AS(cuda::resolve_attention_backend(a, AttentionBackend::fused, c.dtype), Unsupported);
  CHECK(cuda::describe_attention(a, AttentionBackend::auto_, c.dtype).find("packed documents") != std::string::npos);

  const Layout L(a);
  std::vector<float> x(L.qkv_count()), dout(L.out_count());
  for (size_t i = 0; i < x.size(); ++i) x[i] = rounded(normal_at(31 + c.s, i), c.dtype);
  for (size_t i = 0; i < dout.size(); ++i) dout[i] = rounded(normal_at(32 + c.s, i), c.dtype);
  DeviceValues d_qkv(L.qkv_count(), c.dtype), d_out(L.out_count(), c.dtype), d_dout(L.out_count(), c.dtype),
      d_dqkv(L.qkv_count(), c.dtype), d_lse(L.lse_count(), DType::f32);
  d_qkv.upload(x);
  d_dout.upload(dout);
  const size_t ws_bytes = std::max(cuda::attention_workspace_bytes(a, AttentionBackend::auto_, c.dtype),
                                   cuda::generic::backward_workspace_bytes(a));
  void* ws = nullptr;
  MT_CUDA_CHECK(cudaMalloc(&ws, std::max<size_t>(ws_bytes, 256)));
  const double tol = c.dtype == DType::f32 ? 1e-4 : 1e-2;
  std::vector<float> out;
  // The production path (the tensor-core kernels where they are compiled), then the generic
  // kernels on the same shape where the production path is the tensor-core one.
  const bool mma = cuda::flash::supports_head_dim(c.d) && c.dtype != DType::f32;
  for (int variant = 0; variant < (mma ? 2 : 1); ++variant) {
    const char* name = variant == 0 ? (mma ? "tensor-core" : "generic") : "generic";
    d_out.poison();
    d_lse.poison();
    d_dqkv.poison();
    if (variant == 0) {
      cuda::attention_forward(d_out.t(), d_lse.t(), d_qkv.t(), a, AttentionBackend::auto_, ws, ws_bytes, nullptr);
      cuda::attention_backward(d_dqkv.t(), d_dout.t(), d_out.t(), d_lse.t(), d_qkv.t(), a, AttentionBackend::auto_, ws,
                               ws_bytes, nullptr);
    } else {
      cuda::generic::forward(d_out.t(), d_lse.t(), d_qkv.t(), a, nullptr);
      cuda::generic::backward(d_dqkv.t(), d_dout.t(), d_out.t(), d_lse.t(), d_qkv.t(), a, ws, ws_bytes, nullptr);
    }
    MT_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<float> o = d_out.download(), lse = d_lse.download(), dqkv = d_dqkv.download();
    std::vector<float> ref_out(L.out_count()), ref_lse(L.lse_count()), ref_dqkv(L.qkv_count());
    reference_attention_forward<float>(host(ref_out), host(ref_lse), host(x), ref_shape);
    reference_attention_backward<float>(host(ref_dqkv), host(dout), host(o), host(lse), host(x), ref_shape);
    const double e_out = rel_l2(o, ref_out), e_lse = max_abs(lse, ref_lse), e_grad = rel_l2(dqkv, ref_dqkv);
    std::printf("%s | %s | %d documents | out %.2e lse %.2e dqkv %.2e\n", c.name.c_str(), name, documents, e_out,
                e_lse, e_grad);
    INFO(name);
    CHECK(e_out <= tol);
    CHECK(e_lse <= 1e-3);
    CHECK(e_grad <= tol);
    if (variant == 0) out = o;
  }

  // The same inputs without the documents give other outputs wherever a sample holds two or more.
  if (documents > c.b) {
    AttentionShape whole = a;
    whole.documents = false;
    whole.doc_start = Tensor();
    cuda::attention_forward(d_out.t(), d_lse.t(), d_qkv.t(), whole, AttentionBackend::flash, ws, ws_bytes, nullptr);
    MT_CUDA_CHECK(cudaDeviceSynchronize());
    CHECK(d_out.download() != out);
  }
  cudaFree(ws);
  cudaFree(d_starts);
}

}  // namespace

TEST_CASE("attention with packed documents matches the reference (our flash kernels)", "[gpu][attention][documents]") {
  const DocCase cases[] = {
      {"bf16 b2 s300 GQA 8/2 d64, documents up to 80", 2, 300, 8, 2, 64, DType::bf16, 80},
      {"f32 b1 s1000 4/4 d128, documents up to 300, dropout 0.1", 1, 1000, 4, 4, 128, DType::f32, 300, 0.1f},
      {"bf16 b3 s77 MQA 6/1 d80, documents up to 4, window 10", 3, 77, 6, 1, 80, DType::bf16, 4, 0.0f, 10},
      {"fp16 b1 s513 4/2 d64, one document", 1, 513, 4, 2, 64, DType::f16, 100000},
      {"bf16 b2 s129 4/4 d128, documents of length 1", 2, 129, 4, 4, 128, DType::bf16, 1},
      {"bf16 b1 s2048 MQA 4/1 d128, documents up to 700, dropout 0.1", 1, 2048, 4, 1, 128, DType::bf16, 700, 0.1f},
      {"bf16 b2 s1500 GQA 4/2 d64, documents up to 200, window 300", 2, 1500, 4, 2, 64, DType::bf16, 200, 0.0f, 300},
  };
  for (const DocCase& c : cases) run_case(c);
}
