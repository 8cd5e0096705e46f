// --dataloader-type cyclic: the sample order of Megatron-LM's MegatronPretrainingRandomSampler
// (megatron/training/datasets/data_samplers.py) behind its cyclic_iter, for one data-parallel rank.
//
// A pass starts from the sampler's consumed-sample count c (the run's consumed samples when the
// loader is built, then advanced by micro_batch x DP per micro-batch handed out). With n samples in
// the split and chunk = micro_batch x DP:
//   active = n - n mod chunk, epoch = c div active, e = c mod active (a multiple of chunk);
//   with data sharding (the default; --no-data-sharding turns it off):
//     bucket = (n div chunk) x micro_batch, rank r owns ids [r x bucket, (r + 1) x bucket) and takes
//     r x bucket + p[j] for j = e / DP, e / DP + 1, ..., bucket - 1, with p = randperm(bucket);
//   without:
//     full = (n div micro_batch) x micro_batch, and rank r takes p[e + r], p[e + r + DP], ... below
//     full, with p = randperm(full);
//   both with randperm seeded with the epoch (torch.Generator().manual_seed(epoch)); the ids go out
//   in micro-batches of micro_batch, an incomplete last one dropped. When a pass runs out the next
//   starts from the advanced count: the next epoch, or (without sharding, where ranks can take
//   different counts) wherever the count has got to. No pass comes up empty: e <= active - chunk.
// Passes never end: a cyclic loader has no last micro-batch.
#pragma once

#include <cstdint>
#include <vector>

namespace mt {

// torch.randperm(n, generator=g) on the CPU with g = torch.Generator().manual_seed(seed), bit for
// bit: std::mt19937 seeded with the seed's low 32 bits (at::mt19937), a Fisher-Yates shuffle drawing
// one 32-bit number per position for n < 2^32 / 20, above that the inside-out variant drawing 64 bits
// (two numbers, the first the high half) per position.
std::vector<int64_t> torch_randperm(int64_t n, uint64_t seed);

struct CyclicOrderOptions {
  int64_t samples = 0;         // samples in the split (the dataset's length)
  int micro_batch_size = 1;
  int data_parallel_rank = 0;
  int data_parallel_size = 1;
  int64_t consumed_samples = 0;  // global samples consumed before (resume): a multiple of micro_batch x DP
  bool data_sharding = true;
};

class CyclicOrder {
 public:
  // Throws mt::Error (naming --dataloader-type cyclic) when the split holds fewer samples than one
  // micro-batch per data-parallel rank, or consumed_samples is not a multiple of micro_batch x DP.
  explicit CyclicOrder(CyclicOrderOptions options);

  // The dataset indices of this rank's k-th micro-batch (k counted from where the loader starts),
  // micro_batch_size of them into out. Cheapest when k only grows (one permutation per epoch is
  // kept); an earlier k walks the passes again from the start.
  void ids(int64_t k, int64_t* out);

 private:
  struct Pass {
    int64_t first_k = 0;   // loader micro-batch index of the pass's first micro-batch
    int64_t batches = 0;   // micro-batches the pass yields on this rank
    int64_t consumed = 0;  // the sampler's count when the pass starts
    int64_t epoch = 0;
    int64_t start = 0;     // e: samples of the epoch consumed when the pass starts
  };
  Pass pass_from(int64_t first_k, int64_t consumed) const;
  void use_epoch(int64_t epoch);

  CyclicOrderOptions o_;
  int64_t chunk_ = 0;
  int64_t active_ = 0;
  int64_t perm_size_ = 0;   // bucket (sharded) or full (not)
  Pass pass_;
  int64_t perm_epoch_ = -1;
  std::vector<int64_t> perm_;
};

}  // namespace mt
