// bench_fp8_cast: the FP8 cast-transpose kernels (cuda/fp8_kernels.h) at the shapes gpt-1.3b and
// llama-1b run them in training, against the GPU's device-to-device copy rate.
//
// Each case: bf16 input(s) -> fp8 [R, C] and its transpose [C, R] (and the bias gradient where the
// model takes it from the cast), one call = what one layer runs once per micro-batch. Bytes counted:
// every input byte read once and both fp8 outputs written once (the kernels' minimum).
// Inputs are uniform in [-2, 2) (fc1 outputs in [-3, 3)): the erf GeLU's cost depends on the values. Method: 5
// warm-up calls, then `reps` calls queued behind a GPU-side sleep, CUDA events between consecutive
// calls, median reported; the copy ceiling is cudaMemcpyAsync of 512 MiB timed the same way.
// A hash of each case's fp8 bytes (and the sum of its bias gradient) is printed so that runs under
// different kernels (MEGATRAIN_FP8_CAST_KERNEL=tiles) can be checked to write the same bytes.
// Last, the FP8 weight transpose (fp8_transpose, --fp8-param-gather) at the models' weight shapes.
//
// Usage: bench_fp8_cast [--reps N] [--only SUBSTRING]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "bench/event_timer.cuh"
#include "cuda/bench_choice.h"
#include "cuda/cuda_check.h"
#include "cuda/fp8_kernels.h"

using namespace mt;
using namespace mt::cuda;

namespace {

// Pseudo-random bf16 in [lo, hi) from the element index (a fixed, seedable pattern).
__global__ void fill_bf16_kernel(__nv_bfloat16* p, int64_t n, uint32_t seed, float lo, float hi) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 15, h *= 2246822519u, h ^= h >> 13;
    p[i] = __float2bfloat16(lo + (hi - lo) * (h & 0xffffff) / 16777216.0f);
  }
}

__global__ void fill_f32_kernel(float* p, int64_t n, float v) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    p[i] = v;
}

uint64_t fnv1a(const std::vector<uint8_t>& bytes, uint64_t h = 1469598103934665603ull) {
  for (uint8_t b : bytes) h = (h ^ b) * 1099511628211ull;
  return h;
}

struct Case {
  std::string name;
  CastSource::Kind kind;
  MlpActivation act;
  int64_t R, C;  // the cast's [R, C] output
  cuda::Fp8Format format;
  bool dbias;
};

}  // namespace

int main(int argc, char** argv) {
  mt::bench::KernelBenchArgs args;
  if (!mt::bench::parse_kernel_bench_args(argc, argv, "bench_fp8_cast", args)) return 2;
  if (!mt::bench::have_gpu()) return 77;
  const int reps = args.reps;
  const std::string& only = args.only;
  cudaDeviceProp prop{};
  MT_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t stream;
  MT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const size_t scratch_bytes = size_t{64} << 20;
  void* scratch_mem = nullptr;
  MT_CUDA_CHECK(cudaMalloc(&scratch_mem, scratch_bytes));
  Scratch scratch(scratch_mem, scratch_bytes);
  KernelContext ctx;
  ctx.stream = stream;
  ctx.num_sms = prop.multiProcessorCount;
  ctx.scratch = &scratch;
  mt::bench::EventTimer timer(stream, reps);
  // This program's own knob (the megatrain binary has none): which cast-transpose kernel every
  // reader takes (cuda/bench_choice.h).
  const char* knob = std::getenv("MEGATRAIN_FP8_CAST_KERNEL");
  if (knob && std::string(knob) == "tiles") bench_choice::fp8_cast_kernel = bench_choice::Fp8CastKernel::tiles;
  if (knob && std::string(knob) == "blocks") bench_choice::fp8_cast_kernel = bench_choice::Fp8CastKernel::blocks;
  std::printf("GPU %s, %d SMs; MEGATRAIN_FP8_CAST_KERNEL=%s\n", prop.name, prop.multiProcessorCount,
              knob ? knob : "(unset)");

  // The copy ceiling: bytes read + written per second.
  const size_t copy_bytes = size_t{512} << 20;
  void *ca = nullptr, *cb = nullptr;
  MT_CUDA_CHECK(cudaMalloc(&ca, copy_bytes));
  MT_CUDA_CHECK(cudaMalloc(&cb, copy_bytes));
  const double copy_us =
      timer.median_us([&] { MT_CUDA_CHECK(cudaMemcpyAsync(cb, ca, copy_bytes, cudaMemcpyDeviceToDevice, stream)); });
  const double copy_gbs = 2.0 * copy_bytes / copy_us * 1e-3;
  cudaFree(ca), cudaFree(cb);
  std::printf("device-to-device copy: %.1f us for 2 x %zu MiB = %.0f GB/s\n", copy_us, copy_bytes >> 20, copy_gbs);

  using K = CastSource::Kind;
  const std::vector<Case> cases = {
      {"gpt-1.3b layernorm -> qkv/fc1 x", K::norm, MlpActivation::gelu, 16384, 2048, cuda::Fp8Format::e4m3, false},
      // Megatron's default GeLU with a bias is the fused tanh form (--no-bias-gelu-fusion: erf).
      {"gpt-1.3b gelu(fc1) -> fc2 x", K::activation, MlpActivation::gelu_tanh, 16384, 8192, cuda::Fp8Format::e4m3, false},
      {"gpt-1.3b fc1 dy (gelu grad) +dbias", K::activation_grad, MlpActivation::gelu_tanh, 16384, 8192,
       cuda::Fp8Format::e5m2, true},
      {"erf-gelu(fc1) -> fc2 x", K::activation, MlpActivation::gelu, 16384, 8192, cuda::Fp8Format::e4m3, false},
      {"erf-gelu fc1 dy +dbias", K::activation_grad, MlpActivation::gelu, 16384, 8192, cuda::Fp8Format::e5m2, true},
      {"gpt-1.3b qkv dy +dbias", K::plain, MlpActivation::gelu, 16384, 6144, cuda::Fp8Format::e5m2, true},
      {"gpt-1.3b proj/fc2 dy +dbias", K::plain, MlpActivation::gelu, 16384, 2048, cuda::Fp8Format::e5m2, true},
      {"gpt-1.3b fc1 weight", K::plain, MlpActivation::gelu, 8192, 2048, cuda::Fp8Format::e4m3, false},
      {"llama-1b rmsnorm -> qkv/fc1 x", K::norm, MlpActivation::swiglu, 8192, 2048, cuda::Fp8Format::e4m3, false},
      {"llama-1b swiglu(fc1) -> fc2 x", K::activation, MlpActivation::swiglu, 8192, 8192, cuda::Fp8Format::e4m3, false},
      {"llama-1b fc1 dy (swiglu grad)", K::activation_grad, MlpActivation::swiglu, 8192, 16384, cuda::Fp8Format::e5m2,
       false},
      {"llama-1b proj/fc2 dy", K::plain, MlpActivation::swiglu, 8192, 2048, cuda::Fp8Format::e5m2, false},
      {"odd 1000 x 2056 plain", K::plain, MlpActivation::gelu, 1000, 2056, cuda::Fp8Format::e4m3, false},
  };

  // Buffers for the largest case: inputs up to 2 x 256 MiB of bf16, outputs 2 x 128 MiB.
  const int64_t max_elems = 16384LL * 16384;
  __nv_bfloat16 *x = nullptr, *pre = nullptr, *w = nullptr, *b = nullptr;
  float *mean = nullptr, *rstd = nullptr, *scales = nullptr, *dbias = nullptr;
  uint8_t *q = nullptr, *qt = nullptr;
  MT_CUDA_CHECK(cudaMalloc(&x, max_elems * 2));
  MT_CUDA_CHECK(cudaMalloc(&pre, max_elems * 2));
  MT_CUDA_CHECK(cudaMalloc(&w, 16384 * 2));
  MT_CUDA_CHECK(cudaMalloc(&b, 16384 * 2));
  MT_CUDA_CHECK(cudaMalloc(&mean, 16384 * 4));
  MT_CUDA_CHECK(cudaMalloc(&rstd, 16384 * 4));
  MT_CUDA_CHECK(cudaMalloc(&scales, 64 * 4));
  MT_CUDA_CHECK(cudaMalloc(&dbias, 16384 * 4));
  MT_CUDA_CHECK(cudaMalloc(&q, max_elems));
  MT_CUDA_CHECK(cudaMalloc(&qt, max_elems));
  fill_bf16_kernel<<<1024, 256, 0, stream>>>(x, max_elems, 1u, -2.0f, 2.0f);
  fill_bf16_kernel<<<1024, 256, 0, stream>>>(pre, max_elems, 2u, -3.0f, 3.0f);
  fill_bf16_kernel<<<64, 256, 0, stream>>>(w, 16384, 3u, 0.5f, 1.5f);
  fill_bf16_kernel<<<64, 256, 0, stream>>>(b, 16384, 4u, -0.1f, 0.1f);
  fill_f32_kernel<<<64, 256, 0, stream>>>(mean, 16384, 0.01f);
  fill_f32_kernel<<<64, 256, 0, stream>>>(rstd, 16384, 0.9f);
  fill_f32_kernel<<<1, 64, 0, stream>>>(scales, 64, 64.0f);
  MT_CUDA_CHECK(cudaStreamSynchronize(stream));

  std::printf("%-38s %14s %9s %9s %8s %7s  %s\n", "case", "shape", "us", "MB", "GB/s", "% copy", "output hash");
  for (const Case& c : cases) {
    if (!only.empty() && c.name.find(only) == std::string::npos) continue;
    const bool swiglu = c.act == MlpActivation::swiglu;
    Tensor xt, pt;
    double in_bytes = 0;
    if (c.kind == K::plain || c.kind == K::norm) {
      xt = Tensor(x, DType::bf16, Device::cuda, {c.R, c.C});
      in_bytes = 2.0 * c.R * c.C;
    } else if (c.kind == K::activation) {
      xt = Tensor(x, DType::bf16, Device::cuda, {c.R, swiglu ? 2 * c.C : c.C});
      in_bytes = 2.0 * xt.numel();
    } else {  // activation_grad: dout [R, C] (GeLU) or [R, C/2] (SwiGLU), pre [R, C]
      xt = Tensor(x, DType::bf16, Device::cuda, {c.R, swiglu ? c.C / 2 : c.C});
      pt = Tensor(pre, DType::bf16, Device::cuda, {c.R, c.C});
      in_bytes = 2.0 * (xt.numel() + pt.numel());
    }
    CastSource src(c.kind, xt, pt, c.act);
    if (c.kind == K::norm) {
      src.rstd = Tensor(rstd, DType::f32, Device::cuda, {c.R});
      src.weight = Tensor(w, DType::bf16, Device::cuda, {c.C});
      if (!swiglu) {  // LayerNorm (gpt) has a mean and a bias; RMSNorm (llama) neither
        src.mean = Tensor(mean, DType::f32, Device::cuda, {c.R});
        src.bias = Tensor(b, DType::bf16, Device::cuda, {c.C});
      }
    }
    const auto run = [&] {
      scratch.reset();
      cast_transpose_to_fp8(ctx, q, qt, c.format, src, scales, scales + 32, c.dbias ? dbias : nullptr);
    };
    const double us = timer.median_us(run);
    const double bytes = in_bytes + 2.0 * c.R * c.C;
    const double gbs = bytes / us * 1e-3;
    // One more call from a zeroed bias gradient, then the hash of q, q_t (and the bias gradient).
    MT_CUDA_CHECK(cudaMemsetAsync(dbias, 0, 16384 * 4, stream));
    run();
    std::vector<uint8_t> host(static_cast<size_t>(c.R * c.C));
    MT_CUDA_CHECK(cudaMemcpyAsync(host.data(), q, host.size(), cudaMemcpyDeviceToHost, stream));
    MT_CUDA_CHECK(cudaStreamSynchronize(stream));
    uint64_t h = fnv1a(host);
    MT_CUDA_CHECK(cudaMemcpyAsync(host.data(), qt, host.size(), cudaMemcpyDeviceToHost, stream));
    MT_CUDA_CHECK(cudaStreamSynchronize(stream));
    h = fnv1a(host, h);
    char dbias_note[64] = "";
    if (c.dbias) {  // the bias gradient apart: its bits depend on the kernel's summation order
      std::vector<float> db(static_cast<size_t>(c.C));
      MT_CUDA_CHECK(cudaMemcpy(db.data(), dbias, db.size() * 4, cudaMemcpyDeviceToHost));
      double sum = 0;
      for (float v : db) sum += v;
      std::snprintf(dbias_note, sizeof dbias_note, "  dbias sum %.9g", sum);
    }
    char shape[32];
    std::snprintf(shape, sizeof shape, "%lldx%lld", static_cast<long long>(c.R), static_cast<long long>(c.C));
    std::printf("%-38s %14s %9.1f %9.1f %8.0f %6.1f%%  %016llx%s\n", c.name.c_str(), shape, us, bytes * 1e-6, gbs,
                100.0 * gbs / copy_gbs, static_cast<unsigned long long>(h), dbias_note);
  }

  // The FP8 weight transpose (--fp8-param-gather: q_t [C, R] from the FP8 weight [R, C], once per
  // step per weight): bytes read + written, 2 R C.
  struct Transpose {
    const char* name;
    int64_t R, C;
  };
  const std::vector<Transpose> transposes = {
      {"transpose gpt-1.3b qkv weight", 6144, 2048},   {"transpose gpt-1.3b proj weight", 2048, 2048},
      {"transpose gpt-1.3b fc1 weight", 8192, 2048},   {"transpose gpt-1.3b fc2 weight", 2048, 8192},
      {"transpose llama-1b qkv weight", 3072, 2048},   {"transpose llama-1b fc1 weight", 16384, 2048},
      {"transpose llama-1b fc2 weight", 2048, 8192},
  };
  for (const Transpose& c : transposes) {
    if (!only.empty() && std::string(c.name).find(only) == std::string::npos) continue;
    // Consecutive calls take the next of up to 64 slots of x's bytes (as fp8) and of qt, so that the
    // working set (>= 256 MiB) outgrows the L2 cache as the model's many weights do: DRAM rates.
    const int64_t n = c.R * c.C, slots = std::min<int64_t>(64, max_elems / n);
    int64_t call = 0;
    const double us = timer.median_us([&] {
      const int64_t k = call++ % slots;
      fp8_transpose(ctx, qt + k * n, reinterpret_cast<const uint8_t*>(x) + k * n, c.R, c.C);
    });
    const double bytes = 2.0 * c.R * c.C, gbs = bytes / us * 1e-3;
    char shape[32];
    std::snprintf(shape, sizeof shape, "%lldx%lld", static_cast<long long>(c.R), static_cast<long long>(c.C));
    std::printf("%-38s %14s %9.1f %9.1f %8.0f %6.1f%%\n", c.name, shape, us, bytes * 1e-6, gbs, 100.0 * gbs / copy_gbs);
  }
  cudaFree(x), cudaFree(pre), cudaFree(w), cudaFree(b), cudaFree(mean), cudaFree(rstd), cudaFree(scales);
  cudaFree(dbias), cudaFree(q), cudaFree(qt), cudaFree(scratch_mem);
  cudaStreamDestroy(stream);
  return 0;
}
