// bench_fp8_gemm: FP8 (cuBLASLt, cuda/fp8_gemm_cublaslt.h) against bf16 (cuda/gemm_cublaslt.h)
// GEMMs at the linear layers' shapes of gpt-1.3b and llama-1b (bench/run_bench.sh's configs),
// forward / input gradient / weight gradient each, plus the FP8 cast kernels those GEMMs need.
//
// FP8 mapping per layer (see fp8_gemm_cublaslt.h): forward x . w^T (e4m3 x e4m3, bf16 out,
// fast accumulation as Transformer Engine does), input gradient dy . (w^T)^T (e5m2 x e4m3, bf16
// out), weight gradient (dy^T) . (x^T)^T (e5m2 x e4m3, accumulated into fp32). bf16 runs the same
// products through the backend's GEMM mappings (weight gradient into fp32 too).
//
// Method: 5 warm-up calls, then `reps` calls queued behind a GPU-side sleep, CUDA events between
// consecutive calls, median reported. Peaks for the fractions: dense FP8 1979, bf16 989 TFLOP/s
// (H100/H200 SXM datasheets); the measured bf16 GEMM ceiling on the H200 is ~790.
//
// Usage: bench_fp8_gemm [--reps N] [--only SUBSTRING]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "bench/event_timer.cuh"
#include "cuda/cuda_check.h"
#include "cuda/fp8_gemm_cublaslt.h"
#include "cuda/fp8_kernels.h"
#include "cuda/gemm_cublaslt.h"

using namespace mt;
using namespace mt::cuda;

namespace {

__global__ void fill_bytes_kernel(uint8_t* p, int64_t n, uint8_t a, uint8_t b) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    p[i] = static_cast<uint8_t>(a + (i * 2654435761u >> 13) % b);  // small finite codes
}

struct Layer {
  const char* name;
  int64_t n_out, k_in;
};
struct Model {
  const char* name;
  int64_t tokens;
  std::vector<Layer> layers;
};

}  // namespace

int main(int argc, char** argv) {
  mt::bench::KernelBenchArgs args;
  if (!mt::bench::parse_kernel_bench_args(argc, argv, "bench_fp8_gemm", args)) return 2;
  if (!mt::bench::have_gpu()) return 77;
  const int reps = args.reps;
  const std::string& only = args.only;
  cudaDeviceProp prop{};
  MT_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t stream;
  MT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  GemmRunner bf16_gemm(stream, size_t{32} << 20);
  Fp8GemmRunner fp8_gemm(stream, size_t{32} << 20);
  KernelContext ctx;
  ctx.stream = stream;
  ctx.num_sms = prop.multiProcessorCount;
  mt::bench::EventTimer timer(stream, reps);

  // gpt-1.3b: micro-batch 8 x seq 2048; llama-1b: 2 x 4096, 32 heads of 64, 8 query groups,
  // SwiGLU fc1 = 2 x 8192.
  const std::vector<Model> models = {
      {"gpt-1.3b", 8 * 2048, {{"qkv", 3 * 2048, 2048}, {"proj", 2048, 2048}, {"fc1", 8192, 2048}, {"fc2", 2048, 8192}}},
      {"llama-1b", 2 * 4096, {{"qkv", 2048 + 2 * 8 * 64, 2048}, {"proj", 2048, 2048}, {"fc1", 2 * 8192, 2048},
                              {"fc2", 2048, 8192}}}};

  int64_t max_elems = 0;
  for (const Model& m : models)
    for (const Layer& l : m.layers)
      max_elems = std::max({max_elems, m.tokens * l.k_in, m.tokens * l.n_out, l.n_out * l.k_in});
  void *a8, *b8, *a16, *b16, *out;
  float* scales;
  MT_CUDA_CHECK(cudaMalloc(&a8, max_elems));
  MT_CUDA_CHECK(cudaMalloc(&b8, max_elems));
  MT_CUDA_CHECK(cudaMalloc(&a16, max_elems * 2));
  MT_CUDA_CHECK(cudaMalloc(&b16, max_elems * 2));
  MT_CUDA_CHECK(cudaMalloc(&out, max_elems * 4));
  MT_CUDA_CHECK(cudaMalloc(&scales, 64 * sizeof(float)));
  fill_bytes_kernel<<<1024, 256, 0, stream>>>(static_cast<uint8_t*>(a8), max_elems, 0x20, 0x20);
  fill_bytes_kernel<<<1024, 256, 0, stream>>>(static_cast<uint8_t*>(b8), max_elems, 0x20, 0x20);
  // bf16 operands: small values (bytes 0x3c.. as the high half of bf16 words ~ 0.01..1).
  fill_bytes_kernel<<<1024, 256, 0, stream>>>(static_cast<uint8_t*>(a16), max_elems * 2, 0x3a, 4);
  fill_bytes_kernel<<<1024, 256, 0, stream>>>(static_cast<uint8_t*>(b16), max_elems * 2, 0x3a, 4);
  MT_CUDA_CHECK(cudaMemsetAsync(out, 0, max_elems * 4, stream));
  std::vector<float> ones(64, 1.0f);
  MT_CUDA_CHECK(cudaMemcpy(scales, ones.data(), sizeof(float) * 64, cudaMemcpyHostToDevice));
  MT_CUDA_CHECK(cudaStreamSynchronize(stream));

  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  std::printf("GPU: %s (%d SMs)\n", prop.name, prop.multiProcessorCount);
  // Probe: does cuBLASLt offer an FP8 algorithm at these sizes (fast accumulation on/off, the
  // scale pointer 16-byte aligned or at a 4-byte offset)? try_run, no row splitting.
  for (int64_t m : {1024, 4096, 8192, 16384})
    for (int fast = 1; fast >= 0; --fast)
      for (int off = 0; off <= 1; ++off) {
        Fp8GemmCall c;
        c.m = m, c.n = 6144, c.k = 2048;
        c.x = a8, c.x_scale_inv = scales, c.w = b8, c.w_scale_inv = scales + (off ? 5 : 4);
        c.out = out, c.out_type = DType::bf16, c.fast_accum = fast;
        bool ok = false;
        std::string why;
        try {
          ok = fp8_gemm.try_run(c, "probe");
          why = fp8_gemm.last_diagnosis();
        } catch (const std::exception& e) {
          why = e.what();
        }
        std::printf("probe m=%lld n=6144 k=2048 fast=%d scale+%d: %s (%s)\n", (long long)m, fast, off * 4,
                    ok ? "ok" : "NO ALGORITHM", why.c_str());
      }
  MT_CUDA_CHECK(cudaStreamSynchronize(stream));

  std::printf("%-9s %-5s %-6s %6s %6s %6s | %9s %8s | %9s %8s | %6s\n", "model", "layer", "gemm", "M", "N", "K", "bf16 us",
              "TFLOP/s", "fp8 us", "TFLOP/s", "fp8x");
  for (const Model& model : models) {
    double sum_bf16 = 0, sum_fp8 = 0, sum_cast = 0;
    for (const Layer& l : model.layers) {
      const int64_t T = model.tokens, N = l.n_out, K = l.k_in;
      struct G {
        const char* what;
        int64_t m, n, k;  // row-major out[m, n] = x[m, k] . w[n, k]^T for FP8
        cuda::Fp8Format xf, wf;
        DType out_type;
        float beta;
        bool fast;
        GemmCall bf16;
      };
      std::vector<G> gemms;
      {  // forward: y[T, N] = x[T, K] w[N, K]^T
        GemmCall c;
        c.trans_a = true, c.m = N, c.n = T, c.k = K, c.a = a16, c.lda = K, c.b = b16, c.ldb = K, c.d = out, c.ldd = N;
        gemms.push_back({"fprop", T, N, K, cuda::Fp8Format::e4m3, cuda::Fp8Format::e4m3, DType::bf16, 0.0f, true, c});
      }
      {  // input gradient: dx[T, K] = dy[T, N] w[N, K]
        GemmCall c;
        c.m = K, c.n = T, c.k = N, c.a = a16, c.lda = K, c.b = b16, c.ldb = N, c.d = out, c.ldd = K;
        gemms.push_back({"dgrad", T, K, N, cuda::Fp8Format::e5m2, cuda::Fp8Format::e4m3, DType::bf16, 0.0f, false, c});
      }
      {  // weight gradient: dw[N, K] += dy^T x
        GemmCall c;
        c.trans_b = true, c.m = K, c.n = N, c.k = T, c.a = a16, c.lda = K, c.b = b16, c.ldb = N, c.d = out,
        c.d_type = DType::f32, c.ldd = K, c.beta = 1.0f;
        gemms.push_back({"wgrad", N, K, T, cuda::Fp8Format::e5m2, cuda::Fp8Format::e4m3, DType::f32, 1.0f, false, c});
      }
      for (const G& g : gemms) {
        const std::string label = std::string(model.name) + " " + l.name + " " + g.what;
        if (!only.empty() && label.find(only) == std::string::npos) continue;
        const double flops = 2.0 * g.m * g.n * g.k;
        const double us16 = timer.median_us([&] { bf16_gemm.run(g.bf16, "bf16"); });
        Fp8GemmCall c;
        c.m = g.m, c.n = g.n, c.k = g.k;
        c.x = a8, c.x_format = g.xf, c.x_scale_inv = scales;
        c.w = b8, c.w_format = g.wf, c.w_scale_inv = scales + 4;
        c.out = out, c.out_type = g.out_type, c.beta = g.beta, c.fast_accum = g.fast;
        double us8 = 0;
        try {
          us8 = timer.median_us([&] { fp8_gemm.run(c, "fp8"); });
        } catch (const std::exception& e) {
          std::printf("%-9s %-5s %-6s FP8 FAILED: %s\n", model.name, l.name, g.what, e.what());
          if (!c.fast_accum) continue;
          c.fast_accum = false;  // diagnosis: the same GEMM without fast accumulation
          try {
            us8 = timer.median_us([&] { fp8_gemm.run(c, "fp8"); });
            std::printf("%-9s %-5s %-6s (without fast accumulation: runs)\n", model.name, l.name, g.what);
          } catch (const std::exception& e2) {
            std::printf("%-9s %-5s %-6s FP8 FAILED without fast accumulation too: %s\n", model.name, l.name, g.what,
                        e2.what());
            continue;
          }
        }
        sum_bf16 += us16;
        sum_fp8 += us8;
        std::printf("%-9s %-5s %-6s %6lld %6lld %6lld | %9.1f %8.1f | %9.1f %8.1f | %6.2f\n", model.name, l.name, g.what,
                    (long long)g.m, (long long)g.n, (long long)g.k, us16, flops / us16 * 1e-6, us8, flops / us8 * 1e-6,
                    us16 / us8);
      }
      if (!only.empty() && std::string(model.name).find(only) == std::string::npos) continue;
      // Casts an FP8 layer adds: its input x [T, K] to fp8 + transposed copy (forward/wgrad),
      // dy [T, N] to fp8 + transposed copy (dgrad/wgrad); the weight's cast + transpose once per
      // step (amortized over micro-batches, counted here once).
      Tensor x16(a16, DType::bf16, Device::cuda, {T, K}), dy16(a16, DType::bf16, Device::cuda, {T, N}),
          w16(b16, DType::bf16, Device::cuda, {N, K});
      const double us_x = timer.median_us(
          [&] { cast_transpose_to_fp8(ctx, a8, b8, cuda::Fp8Format::e4m3, x16, scales, scales + 16); });
      const double us_dy = timer.median_us(
          [&] { cast_transpose_to_fp8(ctx, a8, b8, cuda::Fp8Format::e5m2, dy16, scales, scales + 17); });
      const double us_w = timer.median_us(
          [&] { cast_transpose_to_fp8(ctx, a8, b8, cuda::Fp8Format::e4m3, w16, scales,
                                      scales + 18); });
      const double gbs_x = (4.0 * T * K) / us_x * 1e-3;  // bytes: 2 read, 1 + 1 written per element
      std::printf("%-9s %-5s casts: x[%lld,%lld] %.1f us (%.0f GB/s), dy[%lld,%lld] %.1f us, w %.1f us\n", model.name,
                  l.name, (long long)T, (long long)K, us_x, gbs_x, (long long)T, (long long)N, us_dy, us_w);
      sum_cast += us_x + us_dy + us_w;
    }
    if (sum_bf16 > 0)
      std::printf("%s linear GEMMs per layer: bf16 %.1f us, fp8 %.1f us (%.2fx), fp8 + casts %.1f us (%.2fx)\n",
                  model.name, sum_bf16, sum_fp8, sum_bf16 / sum_fp8, sum_fp8 + sum_cast,
                  sum_bf16 / (sum_fp8 + sum_cast));
  }
  std::printf("fp8 plans cached: %zu, GEMMs split into row blocks: %lld\n", fp8_gemm.cached_plans(),
              (long long)fp8_gemm.row_splits());
  cudaFree(a8), cudaFree(b8), cudaFree(a16), cudaFree(b16), cudaFree(out), cudaFree(scales);
  cudaStreamDestroy(stream);
  return 0;
}
