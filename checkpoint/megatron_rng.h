// The RNG states a Megatron-LM process holds right after it seeds them at start-up, as its
// checkpoints store them (rng_state: one dict per rank): Megatron seeds Python's `random`, numpy's
// legacy generator, torch's CPU generator and the CUDA generators from --seed + 100 x pipeline rank
// (+ 10 x data-parallel rank with --data-parallel-random-init), the tracker's
// "model-parallel-rng" from that + 2718 + tensor rank and its "expert-parallel-rng" from
// that + 1024 + tensor rank (the expert tensor rank; expert parallelism 1).
//
// Stored as Megatron's loader restores them, in types torch.load's weights-only unpickler reads
// without numpy:
//   random_rng_state    (3, (625 ints: MT19937 words of random.seed(s), then 624), None)
//   np_rng_state        ("MT19937", [624 ints of numpy.random.seed(s)], 624, 0, 0.0)
//   torch_rng_state     uint8 [5056]: torch's CPU generator state (seed u64, left i32 = 1,
//                       seeded i32 = 1, next u64 = 0, 624 u64 words, normal cache cleared)
//   cuda_rng_state      uint8 [16]: (seed u64, offset u64 = 0), likewise each tracker state
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/pickle.h"
#include "checkpoint/torch_writer.h"

namespace mt {

// The MT19937 words of Python's random.seed(seed) (init_by_array of seed's 32-bit words).
std::vector<uint32_t> python_random_seed_state(uint64_t seed);
// The MT19937 words of numpy.random.seed(seed) and torch.manual_seed(seed) (init_genrand).
std::vector<uint32_t> mt19937_init_genrand(uint32_t seed);

// One rank's states, the tensors as arrays (Megatron-FSDP's format stores each as an item of its own).
struct MegatronRngState {
  PickleRef random_rng_state, np_rng_state;
  HostArray torch_rng_state, cuda_rng_state;
  std::vector<std::pair<std::string, HostArray>> trackers;  // rng_tracker_states, by name
};
MegatronRngState megatron_initial_rng(int64_t seed, int tp_rank, int pp_rank, int dp_rank,
                                      bool data_parallel_random_init);

// One rank's rng_state entry; tensors are registered with `w`.
PickleRef megatron_initial_rng_state(TorchSaveWriter& w, int64_t seed, int tp_rank, int pp_rank, int dp_rank,
                                     bool data_parallel_random_init);

}  // namespace mt
