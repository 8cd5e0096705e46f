#include "data/cyclic_order.h"

#include <limits>
#include <random>

#include "core/error.h"

namespace mt {

std::vector<int64_t> torch_randperm(int64_t n, uint64_t seed) {
  MT_CHECK(n >= 0, "randperm of a negative count");
  std::mt19937 engine(static_cast<uint32_t>(seed & 0xffffffffu));
  std::vector<int64_t> r(static_cast<size_t>(n));
  if (n < static_cast<int64_t>(std::numeric_limits<uint32_t>::max() / 20)) {
    for (int64_t i = 0; i < n; ++i) r[static_cast<size_t>(i)] = i;
    for (int64_t i = 0; i + 1 < n; ++i) {
      const int64_t z = static_cast<int64_t>(engine()) % (n - i);
      std::swap(r[static_cast<size_t>(i)], r[static_cast<size_t>(z + i)]);
    }
    return r;
  }
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t hi = engine();
    const uint64_t lo = engine();
    const auto z = static_cast<size_t>(((hi << 32) | lo) % static_cast<uint64_t>(i + 1));
    r[static_cast<size_t>(i)] = r[z];
    r[z] = i;
  }
  return r;
}

CyclicOrder::CyclicOrder(CyclicOrderOptions options) : o_(options) {
  if (o_.micro_batch_size <= 0) fail("--micro-batch-size {} must be positive", o_.micro_batch_size);
  if (o_.data_parallel_size <= 0 || o_.data_parallel_rank < 0 || o_.data_parallel_rank >= o_.data_parallel_size)
    fail("data-parallel rank {} of {} is out of range", o_.data_parallel_rank, o_.data_parallel_size);
  chunk_ = static_cast<int64_t>(o_.micro_batch_size) * o_.data_parallel_size;
  active_ = o_.samples - o_.samples % chunk_;
  if (active_ <= 0) {
    fail("--dataloader-type cyclic: the split holds {} samples, fewer than one micro-batch per data-parallel rank "
         "({} x {}); use more data or a smaller --micro-batch-size",
         o_.samples, o_.micro_batch_size, o_.data_parallel_size);
  }
  if (o_.consumed_samples < 0 || o_.consumed_samples % chunk_ != 0) {
    fail("--dataloader-type cyclic: {} consumed samples is not a multiple of micro-batch x data-parallel size ({})",
         o_.consumed_samples, chunk_);
  }
  perm_size_ = o_.data_sharding ? (o_.samples / chunk_) * o_.micro_batch_size
                                : (o_.samples / o_.micro_batch_size) * o_.micro_batch_size;
  pass_ = pass_from(0, o_.consumed_samples);
}

CyclicOrder::Pass CyclicOrder::pass_from(int64_t first_k, int64_t consumed) const {
  Pass p;
  p.first_k = first_k;
  p.consumed = consumed;
  p.epoch = consumed / active_;
  p.start = consumed % active_;
  int64_t taken;  // ids this rank takes in the pass
  if (o_.data_sharding) {
    taken = perm_size_ - p.start / o_.data_parallel_size;
  } else {
    const int64_t left = perm_size_ - p.start - o_.data_parallel_rank;
    taken = left > 0 ? (left + o_.data_parallel_size - 1) / o_.data_parallel_size : 0;
  }
  p.batches = taken / o_.micro_batch_size;
  // e <= active - chunk (both multiples of chunk), so every rank takes at least a micro-batch.
  MT_CHECK(p.batches > 0, "cyclic order: an empty pass");
  return p;
}

void CyclicOrder::use_epoch(int64_t epoch) {
  if (perm_epoch_ == epoch) return;
  perm_ = torch_randperm(perm_size_, static_cast<uint64_t>(epoch));
  perm_epoch_ = epoch;
}

void CyclicOrder::ids(int64_t k, int64_t* out) {
  MT_CHECK(k >= 0, "negative micro-batch index");
  if (k < pass_.first_k) pass_ = pass_from(0, o_.consumed_samples);
  while (k >= pass_.first_k + pass_.batches)
    pass_ = pass_from(pass_.first_k + pass_.batches, pass_.consumed + pass_.batches * chunk_);
  use_epoch(pass_.epoch);
  const int64_t b = o_.micro_batch_size;
  const int64_t j0 = (k - pass_.first_k) * b;  // position in this rank's list of the pass
  for (int64_t i = 0; i < b; ++i) {
    const int64_t j = j0 + i;
    if (o_.data_sharding) {
      out[i] = static_cast<int64_t>(o_.data_parallel_rank) * perm_size_ +
               perm_[static_cast<size_t>(pass_.start / o_.data_parallel_size + j)];
    } else {
      out[i] = perm_[static_cast<size_t>(pass_.start + o_.data_parallel_rank + j * o_.data_parallel_size)];
    }
  }
}

}  // namespace mt
