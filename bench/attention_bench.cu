// bench_attention: forward and backward throughput of the attention backends at our model shapes
// and at the comparison shapes of bench/RESULTS.md.
//
// FLOP convention (that of the PyTorch/cuDNN figures we compare with): causal forward = 2*B*H*T^2*D
// (half of the dense 4*B*H*T^2*D), backward = 2.5x forward. Times: CUDA events around each call,
// warm-up first, median of the timed repetitions. The backward time includes its small helpers
// (delta = rowsum(dO*O), counter reset) since a training step pays them.
//
// Sliding window (--window N: a query sees N earlier keys and itself): FLOPs count the visible
// (query, key) pairs, 4*B*H*pairs*D forward (the causal convention's T^2/2 pairs without it).
//
// Usage: bench_attention [--configs] [--candidates] [--reps N] [--quick] [--only SHAPE-SUBSTRING] [--window N]
//   --configs     also time every compiled flash tile configuration (tuning)
//   --candidates  also time every cuDNN candidate (K/V layout, dQ algorithm, engine config) pinned;
//                 the "fused (cuDNN)" row is the production path, which times them at its first call
//   --quick    only the three model shapes
//   --only     only the shapes whose label contains the string (e.g. "gpt2-124m B32")
//   --window   sliding-window attention (--window-size N,0) on every shape
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "core/philox.h"
#include "cuda/attention.h"
#include "cuda/attention_cudnn.h"
#include "cuda/attention_flash.h"
#include "cuda/cuda_check.h"

using namespace mt;

namespace {

struct Shape {
  std::string name;
  int b, heads, groups, s, d;
  float dropout = 0;
  // PyTorch 2.11 SDPA (cuDNN 9.19) measured on an H200, TFLOP/s; 0 = not measured.
  double fa2_fwd = 0, fa2_bwd = 0, cudnn_fwd = 0, cudnn_bwd = 0;
};

__global__ void init_normal_bf16(__nv_bfloat16* x, size_t n, uint64_t key, float stddev) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n; i += static_cast<size_t>(gridDim.x) * blockDim.x)
    x[i] = __float2bfloat16(stddev * normal_at(key, i));
}

double median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median milliseconds of fn over reps calls, after warm-up.
double time_ms(const std::function<void()>& fn, int reps) {
  for (int i = 0; i < 3; ++i) fn();
  std::vector<cudaEvent_t> ev(2 * reps);
  for (auto& e : ev) MT_CUDA_CHECK(cudaEventCreate(&e));
  for (int i = 0; i < reps; ++i) {
    MT_CUDA_CHECK(cudaEventRecord(ev[2 * i]));
    fn();
    MT_CUDA_CHECK(cudaEventRecord(ev[2 * i + 1]));
  }
  MT_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<float> ms(reps);
  for (int i = 0; i < reps; ++i) MT_CUDA_CHECK(cudaEventElapsedTime(&ms[i], ev[2 * i], ev[2 * i + 1]));
  for (auto& e : ev) MT_CUDA_CHECK(cudaEventDestroy(e));
  return median(ms);
}

struct Row {
  std::string shape, variant;
  double fwd_ms, fwd_tflops, bwd_ms, bwd_tflops;
  const Shape* ref;
};

}  // namespace

int run(int argc, char** argv) {
  bool configs = false, quick = false, candidates = false;
  int reps = 20, window = -1;
  std::string only;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--configs")) configs = true;
    else if (!std::strcmp(argv[i], "--candidates")) candidates = true;
    else if (!std::strcmp(argv[i], "--quick")) quick = true;
    else if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) reps = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--only") && i + 1 < argc) only = argv[++i];
    else if (!std::strcmp(argv[i], "--window") && i + 1 < argc) window = std::atoi(argv[++i]);
    else {
      fmt::print(stderr, "usage: bench_attention [--configs] [--candidates] [--quick] [--reps N] [--only SHAPE-SUBSTRING] "
                         "[--window N]\n");
      return 2;
    }
  }
  cudaDeviceProp prop{};
  MT_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  fmt::print("device: {} ({} SMs), cuDNN runtime {}\n", prop.name, prop.multiProcessorCount,
             cuda::cudnn_attention::runtime_version());

  std::vector<Shape> shapes = {
      {"gpt2-124m", 32, 12, 12, 1024, 64},
      {"gpt-1.3b", 8, 16, 16, 2048, 128},
      {"llama-1b", 2, 32, 8, 4096, 64},
  };
  if (!quick) {
    const std::vector<Shape> more = {
        {"cmp", 16, 12, 12, 1024, 64, 0, 151, 171, 307, 229},
        {"cmp", 16, 32, 32, 1024, 64, 0, 216, 183, 333, 248},
        {"cmp", 16, 16, 16, 1024, 128, 0, 248, 207, 443, 317},
        {"cmp", 4, 32, 32, 4096, 64, 0, 283, 248, 433, 386},
        {"cmp", 2, 16, 16, 8192, 128, 0, 320, 290, 606, 516},
        {"gpt2-124m dropout 0.1", 32, 12, 12, 1024, 64, 0.1f},
        {"llama-1b", 1, 32, 8, 8192, 64},
        {"llama-1b dropout 0.1", 1, 32, 8, 8192, 64, 0.1f},
        {"llama-1b", 1, 32, 8, 32768, 64},
        {"llama-1b dropout 0.1", 1, 32, 8, 32768, 64, 0.1f},
    };
    shapes.insert(shapes.end(), more.begin(), more.end());
  }

  std::vector<Row> rows;
  for (const Shape& sh : shapes) {
    if (!only.empty() && fmt::format("{} B{} H{}/{} T{} D{}", sh.name, sh.b, sh.heads, sh.groups, sh.s, sh.d).find(only) ==
                             std::string::npos)
      continue;
    AttentionShape a = AttentionShape::make(sh.b, sh.s, sh.heads, sh.groups, sh.d, /*causal=*/true, sh.dropout, 7);
    a.window_left = window;
    const size_t n = static_cast<size_t>(sh.b) * sh.s;
    const size_t qkv_n = n * a.qkv_row_stride(), out_n = n * sh.heads * sh.d, lse_n = n * sh.heads;
    const std::string label = fmt::format("{} B{} H{}/{} T{} D{}{}", sh.name, sh.b, sh.heads, sh.groups, sh.s, sh.d,
                                          window >= 0 ? fmt::format(" W{}", window) : "");

    struct Variant {
      std::string name;
      std::function<void(Tensor, Tensor, Tensor, void*, size_t)> fwd;               // out, lse, qkv, ws
      std::function<void(Tensor, Tensor, Tensor, Tensor, Tensor, void*, size_t)> bwd;  // dqkv, dout, out, lse, qkv
      size_t workspace;
    };
    std::vector<Variant> variants;
    variants.push_back(
        {"flash",
         [&](Tensor o, Tensor l, Tensor x, void* w, size_t b) {
           cuda::attention_forward(o, l, x, a, AttentionBackend::flash, w, b, nullptr);
         },
         [&](Tensor dx, Tensor dout, Tensor o, Tensor l, Tensor x, void* ws, size_t bytes) {
           cuda::attention_backward(dx, dout, o, l, x, a, AttentionBackend::flash, ws, bytes, nullptr);
         },
         cuda::attention_workspace_bytes(a, AttentionBackend::flash)});
    if (configs) {
      for (const auto& fc : cuda::flash::forward_configs(sh.d, sh.dropout > 0))
        variants.push_back({"flash " + fc.name(),
                            [&, fc](Tensor o, Tensor l, Tensor x, void*, size_t) {
                              cuda::flash::forward(o, l, x, a, fc, nullptr);
                            },
                            nullptr, 0});
      for (const auto& bc : cuda::flash::backward_configs(sh.d, sh.dropout > 0))
        variants.push_back({"flash " + bc.name(), nullptr,
                            [&, bc](Tensor dx, Tensor dout, Tensor o, Tensor l, Tensor x, void* ws, size_t bytes) {
                              cuda::flash::backward(dx, dout, o, l, x, a, bc, ws, bytes, nullptr);
                            },
                            cuda::flash::backward_workspace_bytes(a)});
    }
    std::string why;
    if (cuda::cudnn_attention::supported(a, DType::bf16, &why)) {
      variants.push_back(
          {"fused (cuDNN)",
           [&](Tensor o, Tensor l, Tensor x, void* w, size_t b) {
             cuda::attention_forward(o, l, x, a, AttentionBackend::fused, w, b, nullptr);
           },
           [&](Tensor dx, Tensor dout, Tensor o, Tensor l, Tensor x, void* ws, size_t bytes) {
             cuda::attention_backward(dx, dout, o, l, x, a, AttentionBackend::fused, ws, bytes, nullptr);
           },
           cuda::attention_workspace_bytes(a, AttentionBackend::fused)});
      if (candidates) {
        namespace cd = cuda::cudnn_attention;
        const size_t ws_fused = cuda::attention_workspace_bytes(a, AttentionBackend::fused);
        const std::vector<std::string> fc = cd::forward_candidates(a, DType::bf16), bc = cd::backward_candidates(a, DType::bf16);
        for (size_t i = 0; i < fc.size(); ++i)
          variants.push_back({fmt::format("cuDNN fwd {}: {}", i, fc[i]),
                              [&, i](Tensor o, Tensor l, Tensor x, void* w, size_t b) {
                                cd::pin_candidates(a, DType::bf16, static_cast<int>(i), 0);
                                cd::forward(o, l, x, a, w, b, nullptr);
                              },
                              nullptr, ws_fused});
        for (size_t j = 0; j < bc.size(); ++j)
          variants.push_back({fmt::format("cuDNN bwd {}: {}", j, bc[j]), nullptr,
                              [&, j](Tensor dx, Tensor dout, Tensor o, Tensor l, Tensor x, void* ws, size_t bytes) {
                                cd::pin_candidates(a, DType::bf16, 0, static_cast<int>(j));
                                cd::backward(dx, dout, o, l, x, a, ws, bytes, nullptr);
                              },
                              ws_fused});
      }
    } else {
      fmt::print("{}: fused (cuDNN) not run: {}\n", label, why);
    }

    size_t ws_bytes = 256;
    for (const auto& v : variants) ws_bytes = std::max(ws_bytes, v.workspace);
    void *qkv, *out, *lse, *dout, *dqkv, *ws;
    MT_CUDA_CHECK(cudaMalloc(&qkv, qkv_n * 2));
    MT_CUDA_CHECK(cudaMalloc(&out, out_n * 2));
    MT_CUDA_CHECK(cudaMalloc(&lse, lse_n * 4));
    MT_CUDA_CHECK(cudaMalloc(&dout, out_n * 2));
    MT_CUDA_CHECK(cudaMalloc(&dqkv, qkv_n * 2));
    MT_CUDA_CHECK(cudaMalloc(&ws, ws_bytes));
    init_normal_bf16<<<1024, 256>>>(static_cast<__nv_bfloat16*>(qkv), qkv_n, 1, 1.0f);
    init_normal_bf16<<<1024, 256>>>(static_cast<__nv_bfloat16*>(dout), out_n, 2, 1.0f);
    MT_CUDA_CHECK_LAUNCH();
    const Tensor t_qkv(qkv, DType::bf16, Device::cuda, {static_cast<int64_t>(qkv_n)});
    const Tensor t_out(out, DType::bf16, Device::cuda, {static_cast<int64_t>(out_n)});
    const Tensor t_lse(lse, DType::f32, Device::cuda, {static_cast<int64_t>(lse_n)});
    const Tensor t_dout(dout, DType::bf16, Device::cuda, {static_cast<int64_t>(out_n)});
    const Tensor t_dqkv(dqkv, DType::bf16, Device::cuda, {static_cast<int64_t>(qkv_n)});
    // Every backward starts from the default flash forward's out/lse.
    variants[0].fwd(t_out, t_lse, t_qkv, ws, ws_bytes);

    double pairs = 0.5 * static_cast<double>(sh.s) * sh.s;  // (query, key) pairs per head
    if (window >= 0) {
      pairs = 0;
      for (int q = 0; q < sh.s; ++q) pairs += std::min(q, window) + 1;
    }
    const double fwd_flop = 4.0 * sh.b * sh.heads * pairs * sh.d;
    const double bwd_flop = 2.5 * fwd_flop;
    for (const auto& v : variants) {
      Row r{label, v.name, NAN, NAN, NAN, NAN, &sh};
      if (v.fwd) {
        // A separate out/lse for timing so the backward inputs stay those of the default forward.
        void *o2, *l2;
        MT_CUDA_CHECK(cudaMalloc(&o2, out_n * 2));
        MT_CUDA_CHECK(cudaMalloc(&l2, lse_n * 4));
        const Tensor t_o2(o2, DType::bf16, Device::cuda, {static_cast<int64_t>(out_n)});
        const Tensor t_l2(l2, DType::f32, Device::cuda, {static_cast<int64_t>(lse_n)});
        r.fwd_ms = time_ms([&] { v.fwd(t_o2, t_l2, t_qkv, ws, ws_bytes); }, reps);
        r.fwd_tflops = fwd_flop / (r.fwd_ms * 1e-3) / 1e12;
        MT_CUDA_CHECK(cudaFree(o2));
        MT_CUDA_CHECK(cudaFree(l2));
      }
      if (v.bwd) {
        r.bwd_ms = time_ms([&] { v.bwd(t_dqkv, t_dout, t_out, t_lse, t_qkv, ws, ws_bytes); }, reps);
        r.bwd_tflops = bwd_flop / (r.bwd_ms * 1e-3) / 1e12;
      }
      fmt::print("{:<40} {:<26} fwd {:8.3f} ms {:6.1f} TFLOP/s   bwd {:8.3f} ms {:6.1f} TFLOP/s\n", label, v.name,
                 r.fwd_ms, r.fwd_tflops, r.bwd_ms, r.bwd_tflops);
      if (v.name == "fused (cuDNN)")
        fmt::print("{:<40} chosen: {}\n", label, cuda::cudnn_attention::chosen(a, DType::bf16));
      std::fflush(stdout);
      rows.push_back(r);
    }
    for (void* p : {qkv, out, lse, dout, dqkv, ws}) MT_CUDA_CHECK(cudaFree(p));
  }

  fmt::print("\n| shape | backend | fwd ms | fwd TFLOP/s | bwd ms | bwd TFLOP/s | PyTorch FA2 fwd/bwd | cuDNN (PyTorch) fwd/bwd |\n");
  fmt::print("|---|---|---|---|---|---|---|---|\n");
  for (const Row& r : rows) {
    auto num = [](double x, const char* f) { return std::isnan(x) ? std::string("-") : fmt::format(fmt::runtime(f), x); };
    const std::string fa2 = r.ref->fa2_fwd > 0 ? fmt::format("{:.0f} / {:.0f}", r.ref->fa2_fwd, r.ref->fa2_bwd) : "-";
    const std::string cud = r.ref->cudnn_fwd > 0 ? fmt::format("{:.0f} / {:.0f}", r.ref->cudnn_fwd, r.ref->cudnn_bwd) : "-";
    fmt::print("| {} | {} | {} | {} | {} | {} | {} | {} |\n", r.shape, r.variant, num(r.fwd_ms, "{:.3f}"),
               num(r.fwd_tflops, "{:.0f}"), num(r.bwd_ms, "{:.3f}"), num(r.bwd_tflops, "{:.0f}"), fa2, cud);
  }
  return 0;
}

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    fmt::print(stderr, "bench_attention: {}\n", e.what());
    return 1;
  }
}
