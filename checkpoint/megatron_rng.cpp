#include "checkpoint/megatron_rng.h"

#include <algorithm>
#include <cstring>

#include "checkpoint/pickle_writer.h"

namespace mt {

namespace {

constexpr int kWords = 624;

// Little-endian bytes of a fixed-size state.
struct Bytes {
  HostArray a;
  explicit Bytes(int64_t n) : a(HostArray::zeros(DType::u8, {n})) {}
  template <typename T>
  void put(size_t at, T v) {
    std::memcpy(a.bytes.data() + at, &v, sizeof v);
  }
};

// A CUDA generator state (Philox): its seed and offset.
HostArray cuda_state(uint64_t seed) {
  Bytes b(16);
  b.put<uint64_t>(0, seed);
  b.put<uint64_t>(8, 0);
  return std::move(b.a);
}

}  // namespace

std::vector<uint32_t> mt19937_init_genrand(uint32_t seed) {
  std::vector<uint32_t> mt(kWords);
  mt[0] = seed;
  for (int i = 1; i < kWords; ++i) mt[i] = 1812433253u * (mt[i - 1] ^ (mt[i - 1] >> 30)) + static_cast<uint32_t>(i);
  return mt;
}

std::vector<uint32_t> python_random_seed_state(uint64_t seed) {
  std::vector<uint32_t> key;
  for (uint64_t s = seed; s != 0; s >>= 32) key.push_back(static_cast<uint32_t>(s));
  if (key.empty()) key.push_back(0);
  std::vector<uint32_t> mt = mt19937_init_genrand(19650218u);
  int i = 1;
  size_t j = 0;
  for (size_t k = std::max<size_t>(kWords, key.size()); k > 0; --k) {
    mt[i] = (mt[i] ^ ((mt[i - 1] ^ (mt[i - 1] >> 30)) * 1664525u)) + key[j] + static_cast<uint32_t>(j);
    if (++i >= kWords) {
      mt[0] = mt[kWords - 1];
      i = 1;
    }
    if (++j >= key.size()) j = 0;
  }
  for (int k = kWords - 1; k > 0; --k) {
    mt[i] = (mt[i] ^ ((mt[i - 1] ^ (mt[i - 1] >> 30)) * 1566083941u)) - static_cast<uint32_t>(i);
    if (++i >= kWords) {
      mt[0] = mt[kWords - 1];
      i = 1;
    }
  }
  mt[0] = 0x80000000u;
  return mt;
}

MegatronRngState megatron_initial_rng(int64_t seed_arg, int tp_rank, int pp_rank, int dp_rank,
                                      bool data_parallel_random_init) {
  const int64_t seed = seed_arg + 100 * pp_rank + (data_parallel_random_init ? 10 * dp_rank : 0);
  auto ints = [](const std::vector<uint32_t>& words) {
    std::vector<PickleRef> out;
    for (uint32_t v : words) out.push_back(pickle_int(v));
    return out;
  };
  std::vector<PickleRef> python = ints(python_random_seed_state(static_cast<uint64_t>(seed < 0 ? -seed : seed)));
  python.push_back(pickle_int(kWords));
  const std::vector<uint32_t> genrand = mt19937_init_genrand(static_cast<uint32_t>(seed));

  // torch's CPU generator: its legacy state struct, then the float normal cache
  Bytes cpu(5056);
  cpu.put<uint64_t>(0, static_cast<uint64_t>(seed));
  cpu.put<int32_t>(8, 1);   // left
  cpu.put<int32_t>(12, 1);  // seeded
  cpu.put<uint64_t>(16, 0); // next
  for (int k = 0; k < kWords; ++k) cpu.put<uint64_t>(24 + 8 * static_cast<size_t>(k), genrand[static_cast<size_t>(k)]);

  MegatronRngState r;
  r.random_rng_state = pickle_tuple({pickle_int(3), pickle_tuple(python), pickle_none()});
  r.np_rng_state = pickle_tuple({pickle_str("MT19937"), pickle_list(ints(genrand)), pickle_int(kWords), pickle_int(0),
                                 pickle_float(0.0)});
  r.torch_rng_state = std::move(cpu.a);
  r.cuda_rng_state = cuda_state(static_cast<uint64_t>(seed));
  r.trackers = {{"data-parallel-rng", cuda_state(static_cast<uint64_t>(seed))},
                {"model-parallel-rng", cuda_state(static_cast<uint64_t>(seed + 2718 + tp_rank))},
                {"expert-parallel-rng", cuda_state(static_cast<uint64_t>(seed + 1024 + tp_rank))}};
  return r;
}

PickleRef megatron_initial_rng_state(TorchSaveWriter& w, int64_t seed, int tp_rank, int pp_rank, int dp_rank,
                                     bool data_parallel_random_init) {
  MegatronRngState r = megatron_initial_rng(seed, tp_rank, pp_rank, dp_rank, data_parallel_random_init);
  PickleRef state = pickle_dict();
  pickle_set(*state, "random_rng_state", r.random_rng_state);
  pickle_set(*state, "np_rng_state", r.np_rng_state);
  pickle_set(*state, "torch_rng_state", w.tensor(std::move(r.torch_rng_state)));
  pickle_set(*state, "cuda_rng_state", w.tensor(std::move(r.cuda_rng_state)));
  PickleRef trackers = pickle_dict();
  for (auto& [name, a] : r.trackers) pickle_set(*trackers, name, w.tensor(std::move(a)));
  pickle_set(*state, "rng_tracker_states", trackers);
  return state;
}

}  // namespace mt
