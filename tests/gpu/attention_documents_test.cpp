// Packed documents (--reset-attention-mask) on the GPU: the attention of each document of a packed
// sequence stays inside it. Our flash kernels take the documents (the tensor-core ones for head
// dims 64 and 128 in 16 bits, the generic CUDA-core ones otherwise), and so do cuDNN's graphs as a
// ragged batch (`auto`'s choice in 16 bits); each must equal the reference backend on fresh random
// inputs with random document lengths (documents of length 1 included), float32 and 16-bit
// activations, GQA, dropout (our kernels' case: megatrain's own mask, which the reference draws
// alike; cuDNN's with its own mask is in attention_cudnn_dropout_test.cpp) and a sliding window.
// The backward is fed the GPU forward's out and lse, and so is the reference's.
#include <catch2/catch.hpp>

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "core/philox.h"
#include "cuda/attention.h"
#include "cuda/attention_cudnn.h"
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
  for (size_t t = 0; t < starts.size(); ++t) {
    const int32_t pos = static_cast<int32_t>(t % c.s);
    documents += starts[t] == pos;
    a.doc_longest = std::max(a.doc_longest, pos - starts[t] + 1);
  }
  a.doc_count = documents;
  ref_shape.doc_count = a.doc_count, ref_shape.doc_longest = a.doc_longest;

  // Which implementation runs: `auto` takes cuDNN's ragged batch wherever cuDNN can (16 bits, head
  // dims a multiple of 8, no dropout here: its mask is its own).
  const bool fused = c.dtype != DType::f32 && c.d % 8 == 0;
  CHECK((cuda::resolve_attention_backend(a, AttentionBackend::auto_, c.dtype) == AttentionBackend::fused) == fused);
  CHECK(cuda::describe_attention(a, AttentionBackend::flash, c.dtype).find("packed documents") != std::string::npos);
  if (fused) CHECK(cuda::cudnn_attention::documents_fit(a, c.dtype));
  const AttentionBackend first = fused && c.dropout == 0 ? AttentionBackend::fused : AttentionBackend::flash;

  const Layout L(a);
  std::vector<float> x(L.qkv_count()), dout(L.out_count());
  for (size_t i = 0; i < x.size(); ++i) x[i] = rounded(normal_at(31 + c.s, i), c.dtype);
  for (size_t i = 0; i < dout.size(); ++i) dout[i] = rounded(normal_at(32 + c.s, i), c.dtype);
  DeviceValues d_qkv(L.qkv_count(), c.dtype), d_out(L.out_count(), c.dtype), d_dout(L.out_count(), c.dtype),
      d_dqkv(L.qkv_count(), c.dtype), d_lse(L.lse_count(), DType::f32);
  d_qkv.upload(x);
  d_dout.upload(dout);
  const size_t ws_bytes = std::max({cuda::attention_workspace_bytes(a, AttentionBackend::auto_, c.dtype),
                                    cuda::attention_workspace_bytes(a, AttentionBackend::flash, c.dtype),
                                    cuda::generic::backward_workspace_bytes(a)});
  void* ws = nullptr;
  MT_CUDA_CHECK(cudaMalloc(&ws, std::max<size_t>(ws_bytes, 256)));
  const double tol = c.dtype == DType::f32 ? 1e-4 : 1e-2;
  std::vector<float> out;
  // cuDNN's ragged batch where it runs (without dropout), our flash backend (the tensor-core
  // kernels where they are compiled), then the generic kernels on the same shape where the flash
  // backend is the tensor-core one.
  const bool mma = cuda::flash::supports_head_dim(c.d) && c.dtype != DType::f32;
  struct Variant {
    const char* name;
    AttentionBackend backend;
    bool generic_kernels;  // the generic kernels called directly
  };
  std::vector<Variant> variants;
  if (first == AttentionBackend::fused) variants.push_back({"cuDNN", AttentionBackend::fused, false});
  variants.push_back({mma ? "tensor-core" : "generic", AttentionBackend::flash, false});
  if (mma) variants.push_back({"generic", AttentionBackend::flash, true});
  for (const auto& [name, backend, generic_kernels] : variants) {
    d_out.poison();
    d_lse.poison();
    d_dqkv.poison();
    if (!generic_kernels) {
      cuda::attention_forward(d_out.t(), d_lse.t(), d_qkv.t(), a, backend, ws, ws_bytes, nullptr);
      cuda::attention_backward(d_dqkv.t(), d_dout.t(), d_out.t(), d_lse.t(), d_qkv.t(), a, backend, ws, ws_bytes,
                               nullptr);
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
    if (out.empty()) out = o;
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

TEST_CASE("attention with packed documents matches the reference (cuDNN and our flash kernels)", "[gpu][attention][documents]") {
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

TEST_CASE("cuDNN's ragged batch: each document's entries, lengths and offsets", "[gpu][attention][documents]") {
  namespace cd = cuda::cudnn_attention;
  for (const auto& [b, s, heads, groups, max_doc] : std::vector<std::tuple<int, int, int, int, int>>{
           {1, 1, 4, 4, 1}, {2, 300, 8, 2, 80}, {3, 77, 6, 1, 4}, {1, 2500, 4, 4, 100000}, {2, 1100, 32, 8, 1}}) {
    INFO(fmt::format("b={} s={} heads={}/{} documents up to {}", b, s, heads, groups, max_doc));
    const AttentionShape a = AttentionShape::make(b, s, heads, groups, 64);
    const std::vector<int32_t> starts = random_documents(b, s, max_doc, 5 + s);
    const int fold = heads == groups ? 1 : groups, hpe = heads / fold, d = 64;
    // Expected: documents in sample-major order, each times the folded groups.
    std::vector<int32_t> want_len;
    std::vector<int64_t> want_qkv, want_out, want_stats;
    for (int i = 0; i < b; ++i)
      for (int t = 0; t < s; ++t) {
        if (starts[static_cast<size_t>(i) * s + t] != t) continue;
        int end = t + 1;
        while (end < s && starts[static_cast<size_t>(i) * s + end] == t) ++end;
        for (int g = 0; g < fold; ++g) {
          want_len.push_back(end - t);
          want_qkv.push_back((int64_t(t) * b + i) * a.qkv_row_stride() + (fold > 1 ? g * (heads / groups + 2) * d : 0));
          want_out.push_back((int64_t(t) * b + i) * heads * d + g * hpe * d);
          want_stats.push_back((int64_t(i) * heads + g * hpe) * s + t);
        }
      }
    int64_t entries = 1;
    while (entries < static_cast<int64_t>(want_len.size()) / fold) entries *= 2;
    entries *= fold;
    int32_t* d_starts = nullptr;
    void* arrays = nullptr;
    const size_t n = static_cast<size_t>(entries);
    MT_CUDA_CHECK(cudaMalloc(&d_starts, starts.size() * 4));
    MT_CUDA_CHECK(cudaMemcpy(d_starts, starts.data(), starts.size() * 4, cudaMemcpyHostToDevice));
    MT_CUDA_CHECK(cudaMalloc(&arrays, n * 4 + 3 * (n + 1) * 8 + starts.size() * 4));
    MT_CUDA_CHECK(cudaMemset(arrays, 0x7f, n * 4 + 3 * (n + 1) * 8 + starts.size() * 4));
    cd::DocumentIndexArgs p;
    p.batch = b, p.seq = s, p.fold = fold, p.heads = heads, p.heads_per_entry = hpe, p.head_dim = d;
    p.qkv_row = a.qkv_row_stride(), p.qkv_group = fold > 1 ? (heads / groups + 2) * d : 0;
    p.entries = entries, p.max_docs = static_cast<int>(entries / fold);
    p.off_qkv = static_cast<int64_t*>(arrays);
    p.off_out = p.off_qkv + n + 1;
    p.off_stats = p.off_out + n + 1;
    p.seq_len = reinterpret_cast<int32_t*>(p.off_stats + n + 1);
    p.first = p.seq_len + n;
    cd::document_index(d_starts, p, nullptr);
    MT_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<int32_t> len(n);
    std::vector<int64_t> qkv(n + 1), out(n + 1), stats(n + 1);
    MT_CUDA_CHECK(cudaMemcpy(len.data(), p.seq_len, n * 4, cudaMemcpyDeviceToHost));
    MT_CUDA_CHECK(cudaMemcpy(qkv.data(), p.off_qkv, (n + 1) * 8, cudaMemcpyDeviceToHost));
    MT_CUDA_CHECK(cudaMemcpy(out.data(), p.off_out, (n + 1) * 8, cudaMemcpyDeviceToHost));
    MT_CUDA_CHECK(cudaMemcpy(stats.data(), p.off_stats, (n + 1) * 8, cudaMemcpyDeviceToHost));
    want_len.resize(n, 0);
    for (auto* v : {&want_qkv, &want_out, &want_stats}) v->resize(n + 1, 0);
    CHECK(len == want_len);
    CHECK(qkv == want_qkv);
    CHECK(out == want_out);
    CHECK(stats == want_stats);
    cudaFree(arrays);
    cudaFree(d_starts);
  }
}
