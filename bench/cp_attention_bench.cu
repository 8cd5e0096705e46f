// bench_cp_attention: what context parallelism's block-by-block attention costs on one GPU. For a
// sequence of S tokens at the llama-1b attention shape (32 heads, 8 query groups, head dim 64,
// bf16), it times the whole sequence's attention (forward + backward, the backend's choice) and
// then, for each CP rank r of the load-balanced split (chunks r and 2 CP - 1 - r), the blocks that
// rank computes in engine/blocks/attention_cp.cpp: its key/value packing, every visible block's
// forward and merge, every block's backward and the gradient's unpacking, run one rank after the
// other on this GPU with all keys at hand (the communication is not timed: the multi-GPU runs
// measure it). The overhead is the slowest rank's time against the whole's / CP, the ideal.
//
// Usage: bench_cp_attention [--cp N] [--seq S ...] [--reps N]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#include "cuda/cuda_backend.h"
#include "cuda/cuda_check.h"

using namespace mt;

namespace {

double time_ms(CudaBackend& be, const std::function<void()>& fn, int reps) {
  cudaStream_t s = be.cuda_stream();
  cudaEvent_t a, b;
  MT_CUDA_CHECK(cudaEventCreate(&a));
  MT_CUDA_CHECK(cudaEventCreate(&b));
  for (int i = 0; i < 2; ++i) fn();  // warm-up (and the attention's first-call candidate timing)
  std::vector<float> t;
  for (int i = 0; i < reps; ++i) {
    MT_CUDA_CHECK(cudaEventRecord(a, s));
    fn();
    MT_CUDA_CHECK(cudaEventRecord(b, s));
    MT_CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    MT_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  MT_CUDA_CHECK(cudaEventDestroy(a));
  MT_CUDA_CHECK(cudaEventDestroy(b));
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

Tensor take(CudaBackend& be, std::vector<void*>& owned, DType dt, std::initializer_list<int64_t> shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  void* p = be.allocate(static_cast<size_t>(n) * dtype_size(dt));
  owned.push_back(p);
  return Tensor(p, dt, Device::cuda, shape);
}

void run(CudaBackend& be, int cp, int64_t S, int reps) {
  const int b = 1, heads = 32, groups = 8, d = 64;
  std::vector<void*> owned;
  AttentionShape a = AttentionShape::make(b, static_cast<int>(S), heads, groups, d);
  const int64_t W = a.qkv_row_stride(), kvw = 2 * int64_t{groups} * d, c = S / (2 * cp);
  const Tensor qkv = take(be, owned, DType::bf16, {S, W}), dqkv = take(be, owned, DType::bf16, {S, W});
  const Tensor out = take(be, owned, DType::bf16, {S, heads * int64_t{d}}), dout = take(be, owned, DType::bf16, {S, heads * int64_t{d}});
  const Tensor lse = take(be, owned, DType::f32, {b, heads, S});
  be.init_normal(qkv, 1, 1.0f, ShardIndex::whole(S, W));
  be.init_normal(dout, 2, 1.0f, ShardIndex::whole(S, heads * int64_t{d}));
  be.reserve_attention(a, AttentionBackend::auto_, DType::bf16);
  const double whole = time_ms(be, [&] {
    be.attention_forward(out, lse, qkv, a);
    be.attention_backward(dqkv, dout, out, lse, qkv, a);
  }, reps);

  // The blocks of each CP rank: c queries x c keys, the sequence's chunks in order in qkv.
  AttentionShape ac = a;
  ac.seq = static_cast<int>(c);
  be.reserve_attention_blocks(ac, static_cast<int>(c), DType::bf16);
  const Tensor kv_all = take(be, owned, DType::bf16, {S, kvw}), dkv_all = take(be, owned, DType::bf16, {S, kvw});
  const Tensor lq = take(be, owned, DType::bf16, {2 * c, W}), ldq = take(be, owned, DType::bf16, {2 * c, W});
  const Tensor lout = take(be, owned, DType::bf16, {2 * c, heads * int64_t{d}});
  const Tensor ldout = take(be, owned, DType::bf16, {2 * c, heads * int64_t{d}});
  const Tensor llse = take(be, owned, DType::f32, {2 * b * heads * c});
  const Tensor ob = take(be, owned, DType::bf16, {c, heads * int64_t{d}}), lb = take(be, owned, DType::f32, {b, heads, c});
  const Tensor lkv = take(be, owned, DType::bf16, {2 * c, kvw}), ldkv = take(be, owned, DType::bf16, {2 * c, kvw});
  AttentionShape whole_kv = a;
  be.attention_kv_pack(kv_all, qkv, whole_kv);  // (every rank's keys, as the ring or the all-gather brings them)
  double slowest = 0, total = 0;
  for (int r = 0; r < cp; ++r) {
    const int64_t mine[2] = {r, 2 * int64_t{cp} - 1 - r};
    for (int i = 0; i < 2; ++i) {
      be.copy(lq.row_slice(i * c, c), qkv.row_slice(mine[i] * c, c));
      be.copy(ldout.row_slice(i * c, c), dout.row_slice(mine[i] * c, c));
    }
    auto blk = [&](int64_t qi, int64_t ki) {
      AttentionBlock k;
      k.q_begin = qi * c;
      k.k_begin = ki * c;
      k.kv_len = static_cast<int>(c);
      k.seq_total = S;
      return k;
    };
    auto lse_of = [&](int i) { return llse.flat_slice(i * b * heads * c, b * heads * c).view({b, heads, c}); };
    const double ms = time_ms(be, [&] {
      AttentionShape al = a;
      al.seq = static_cast<int>(2 * c);
      be.attention_kv_pack(lkv, lq, al);  // this rank's packing (the keys themselves are in kv_all)
      for (int i = 0; i < 2; ++i) {
        bool first = true;
        for (int64_t k = 0; k <= mine[i]; ++k) {
          const Tensor o = lout.row_slice(i * c, c);
          if (first) be.attention_block_forward(o, lse_of(i), lq.row_slice(i * c, c), kv_all.row_slice(k * c, c), ac, blk(mine[i], k));
          else {
            be.attention_block_forward(ob, lb, lq.row_slice(i * c, c), kv_all.row_slice(k * c, c), ac, blk(mine[i], k));
            be.attention_merge(o, lse_of(i), ob, lb);
          }
          first = false;
        }
      }
      be.fill(ldq, 0.0);
      for (int i = 0; i < 2; ++i)
        for (int64_t k = 0; k <= mine[i]; ++k)
          be.attention_block_backward(ldq.row_slice(i * c, c), dkv_all.row_slice(k * c, c), ldout.row_slice(i * c, c),
                                      lout.row_slice(i * c, c), lse_of(i), lq.row_slice(i * c, c),
                                      kv_all.row_slice(k * c, c), ac, blk(mine[i], k));
      be.attention_kv_unpack_add(ldq, ldkv, al);  // (the gradient's return trip: its unpacking)
    }, reps);
    slowest = std::max(slowest, ms);
    total += ms;
  }
  std::printf("| %lld | %d | %.2f | %.2f | %.2f | %.2f | %.3f |\n", static_cast<long long>(S), cp, whole, whole / cp,
              slowest, total, slowest / (whole / cp));
  for (void* p : owned) be.deallocate(p);
}

}  // namespace

int main(int argc, char** argv) {
  int cp = 2, reps = 10;
  std::vector<int64_t> seqs;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--cp") && i + 1 < argc) cp = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) reps = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--seq") && i + 1 < argc) seqs.push_back(std::atoll(argv[++i]));
    else {
      std::fprintf(stderr, "usage: bench_cp_attention [--cp N] [--seq S ...] [--reps N]\n");
      return 2;
    }
  }
  if (seqs.empty()) seqs = {8192, 32768, 65536};
  try {
    CudaBackend be(0);
    cudaDeviceProp prop{};
    MT_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    std::printf("bench_cp_attention on %s: llama-1b attention (b 1, 32 heads, 8 groups, d 64, bf16, causal), "
                "forward + backward, median of %d, ms\n\n", prop.name, reps);
    std::printf("| seq | CP | whole | whole / CP | slowest rank's blocks | all ranks' blocks | overhead |\n");
    std::printf("|---:|---:|---:|---:|---:|---:|---:|\n");
    for (int64_t s : seqs) run(be, cp, s, reps);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_cp_attention: %s\n", e.what());
    return 1;
  }
  return 0;
}
