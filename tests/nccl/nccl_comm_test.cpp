// NCCL communicator tests on several GPUs (one process per GPU).
//
// Usage: nccl_comm_test [--nproc N] <mode>
//   Without RANK in the environment it starts N workers itself through the workstation launcher
//   (default N = 2) and exits 77 ("skipped") when fewer than N GPUs are visible. With RANK,
//   WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT set (torchrun-style, or started by hand) it
//   is one worker and meets the others at the TCP rendezvous.
// Modes:
//   collectives  every collective and dtype, in-place forms, broadcast from each root, barrier,
//                split groups (and a rank left out of a split), grouped p2p in both directions,
//                build_parallel_state for every TP x PP x DP shape of the world;
//                exit 0 when all checks pass on all ranks
//   timeout      the last rank never joins an all_reduce: the watchdog must end the other ranks
//                with a message naming the group and operation (use a small
//                MEGATRAIN_DISTRIBUTED_TIMEOUT_SECONDS); expected exit status non-zero
//   crash        the last rank aborts after the first all_reduce while the others wait in the
//                next one; the job must end (launcher or watchdog), expected exit status non-zero

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "core/log.h"
#include "parallel/gpu_worker_program.h"
#include "core/config.h"
#include "parallel/nccl_communicator.h"
#include "parallel/parallel_state_builder.h"
#include "parallel/tcp_rendezvous.h"

#include <cuda_runtime.h>

using namespace mt;

namespace {

int g_failures = 0;
int g_rank = 0;
cudaStream_t g_stream = nullptr;

#define EXPECT(cond, ...)                                                                       \
  do {                                                                                          \
    if (!(cond)) {                                                                              \
      ++g_failures;                                                                             \
      std::fprintf(stderr, "[rank %d] FAIL %s:%d: %s: %s\n", g_rank, __FILE__, __LINE__, #cond, \
                   fmt::format(__VA_ARGS__).c_str());                                           \
    }                                                                                           \
  } while (0)

void cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) fail("{}: {}", what, cudaGetErrorString(e));
}

// A device buffer holding a copy of host values.
template <typename T>
struct DeviceVec {
  std::vector<T> host;
  T* dev = nullptr;
  DType dtype;
  DeviceVec(std::vector<T> h, DType t) : host(std::move(h)), dtype(t) {
    cuda(cudaMalloc(&dev, host.size() * sizeof(T)), "cudaMalloc");
    cuda(cudaMemcpy(dev, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), "H2D");
  }
  ~DeviceVec() { cudaFree(dev); }
  Tensor tensor() { return Tensor(dev, dtype, Device::cuda, {static_cast<int64_t>(host.size())}); }
  Tensor slice(int64_t begin, int64_t n) { return tensor().flat_slice(begin, n); }
  std::vector<T>& fetch() {
    cuda(cudaStreamSynchronize(g_stream), "sync");
    cuda(cudaMemcpy(host.data(), dev, host.size() * sizeof(T), cudaMemcpyDeviceToHost), "D2H");
    return host;
  }
};

float bf(uint16_t b) { return bf16_bits_to_float(b); }
float hf(uint16_t b) { return f16_bits_to_float(b); }

void test_all_reduce(Communicator& c) {
  const int n = c.size(), r = c.rank();
  const int len = 1000;
  {
    std::vector<float> v(len);
    for (int i = 0; i < len; ++i) v[i] = 10.0f * r + i;
    DeviceVec<float> d(v, DType::f32);
    c.all_reduce(d.tensor());
    auto& got = d.fetch();
    for (int i = 0; i < len; ++i) EXPECT(got[i] == 10.0f * n * (n - 1) / 2 + n * i, "{} f32 sum [{}]={}", c.name(), i, got[i]);
  }
  {
    std::vector<uint16_t> v(len);
    for (int i = 0; i < len; ++i) v[i] = float_to_bf16_bits(static_cast<float>(r + i % 8));
    DeviceVec<uint16_t> d(v, DType::bf16);
    c.all_reduce(d.tensor());
    auto& got = d.fetch();
    for (int i = 0; i < len; ++i)
      EXPECT(bf(got[i]) == n * (n - 1) / 2.0f + n * (i % 8), "{} bf16 sum [{}]={}", c.name(), i, bf(got[i]));
  }
  {
    std::vector<uint16_t> v(len);
    for (int i = 0; i < len; ++i) v[i] = float_to_f16_bits(static_cast<float>(r * 3 - i % 5));
    DeviceVec<uint16_t> d(v, DType::f16);
    c.all_reduce(d.tensor(), ReduceOp::max);
    auto& got = d.fetch();
    for (int i = 0; i < len; ++i) EXPECT(hf(got[i]) == (n - 1) * 3.0f - i % 5, "{} f16 max [{}]", c.name(), i);
  }
  {
    std::vector<double> v(len);
    for (int i = 0; i < len; ++i) v[i] = -1.0 * (r + 1) * (i + 1);
    DeviceVec<double> d(v, DType::f64);
    c.all_reduce(d.tensor(), ReduceOp::min);
    auto& got = d.fetch();
    for (int i = 0; i < len; ++i) EXPECT(got[i] == -1.0 * n * (i + 1), "{} f64 min [{}]", c.name(), i);
  }
  {
    std::vector<int32_t> v(len);
    for (int i = 0; i < len; ++i) v[i] = r * 100000 + i;
    DeviceVec<int32_t> d(v, DType::i32);
    c.all_reduce(d.tensor());
    auto& got = d.fetch();
    for (int i = 0; i < len; ++i) EXPECT(got[i] == 100000 * n * (n - 1) / 2 + n * i, "{} i32 sum [{}]", c.name(), i);
  }
}

void test_reduce_scatter_all_gather(Communicator& c) {
  const int n = c.size(), r = c.rank();
  const int chunk = 257;
  std::vector<float> in(n * chunk);
  for (int j = 0; j < n * chunk; ++j) in[j] = 1000.0f * r + j;
  DeviceVec<float> din(in, DType::f32), dout(std::vector<float>(chunk, -1.0f), DType::f32);
  c.reduce_scatter(dout.tensor(), din.tensor());
  auto& out = dout.fetch();
  for (int k = 0; k < chunk; ++k)
    EXPECT(out[k] == 1000.0f * n * (n - 1) / 2 + n * (r * chunk + k), "{} reduce_scatter [{}]", c.name(), k);
  // In place: out = in + rank * chunk.
  c.reduce_scatter(din.slice(r * chunk, chunk), din.tensor());
  auto& inplace = din.fetch();
  for (int k = 0; k < chunk; ++k)
    EXPECT(inplace[r * chunk + k] == 1000.0f * n * (n - 1) / 2 + n * (r * chunk + k), "{} in-place reduce_scatter [{}]",
           c.name(), k);

  std::vector<uint16_t> mine(chunk);
  for (int k = 0; k < chunk; ++k) mine[k] = float_to_bf16_bits(static_cast<float>(r * 16 + k % 16));
  DeviceVec<uint16_t> dmine(mine, DType::bf16), dall(std::vector<uint16_t>(n * chunk, 0), DType::bf16);
  c.all_gather(dall.tensor(), dmine.tensor());
  auto& all = dall.fetch();
  for (int j = 0; j < n * chunk; ++j)
    EXPECT(bf(all[j]) == (j / chunk) * 16 + (j % chunk) % 16, "{} all_gather [{}]", c.name(), j);
  // In place: in = out + rank * chunk.
  std::vector<int64_t> ip(n * chunk, -1);
  for (int k = 0; k < chunk; ++k) ip[r * chunk + k] = r * 1000 + k;
  DeviceVec<int64_t> dip(ip, DType::i64);
  c.all_gather(dip.tensor(), dip.slice(r * chunk, chunk));
  auto& got = dip.fetch();
  for (int j = 0; j < n * chunk; ++j) EXPECT(got[j] == (j / chunk) * 1000 + j % chunk, "{} in-place all_gather [{}]", c.name(), j);
}

void test_broadcast_barrier(Communicator& c) {
  for (int root = 0; root < c.size(); ++root) {
    DeviceVec<uint8_t> d(std::vector<uint8_t>(333, static_cast<uint8_t>(c.rank() == root ? 100 + root : 1)), DType::u8);
    c.broadcast(d.tensor(), root);
    for (auto x : d.fetch()) EXPECT(x == 100 + root, "{} broadcast from {}", c.name(), root);
  }
  c.barrier();
}

void test_p2p(Communicator& c) {
  const int n = c.size(), r = c.rank();
  if (n == 1) return;
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  std::vector<float> out(4096);
  for (int i = 0; i < 4096; ++i) out[i] = r * 1e4f + i;
  DeviceVec<float> dout(out, DType::f32), din(std::vector<float>(4096, -1), DType::f32);
  // Rank 0 comes late to this communicator's first transfer, as a pipeline's first stage does
  // (it computes a forward first): the others wait inside their non-blocking group for the
  // connection while the watchdog polls. That once broke every PP=2 training run with NCCL
  // "internal error ... job error 3" (two threads reaping one group job).
  if (r == 0) std::this_thread::sleep_for(std::chrono::milliseconds(800));
  c.group_start();
  c.send(dout.tensor(), next);
  c.recv(din.tensor(), prev);
  c.group_end();
  auto& in = din.fetch();
  for (int i = 0; i < 4096; ++i) EXPECT(in[i] == prev * 1e4f + i, "{} ring [{}]", c.name(), i);

  // Both directions with the same peer in one group (a 2-stage pipeline's activations + grads).
  DeviceVec<double> to_next(std::vector<double>(8, r), DType::f64), to_prev(std::vector<double>(8, -r - 1), DType::f64);
  DeviceVec<double> from_prev(std::vector<double>(8, 0), DType::f64), from_next(std::vector<double>(8, 0), DType::f64);
  c.group_start();
  c.recv(from_next.tensor(), next);
  c.send(to_prev.tensor(), prev);
  c.send(to_next.tensor(), next);
  c.recv(from_prev.tensor(), prev);
  c.group_end();
  if (n > 2) {
    EXPECT(from_prev.fetch()[0] == prev, "{} from prev", c.name());
    EXPECT(from_next.fetch()[0] == -next - 1, "{} from next", c.name());
  }
}

void run_all(Communicator& c) {
  test_all_reduce(c);
  test_reduce_scatter_all_gather(c);
  test_broadcast_barrier(c);
  test_p2p(c);
}

void collectives(Communicator& world) {
  run_all(world);
  const int r = world.rank(), n = world.size();
  auto reversed = world.split(0, n - 1 - r, "reversed");
  EXPECT(reversed && reversed->rank() == n - 1 - r, "reversed split rank");
  if (reversed) run_all(*reversed);
  auto alone = world.split(r, 0, "alone");  // groups of one
  EXPECT(alone && alone->size() == 1, "groups of one");
  if (alone) {
    DeviceVec<float> d(std::vector<float>(5, 2.0f), DType::f32);
    alone->all_reduce(d.tensor());
    EXPECT(d.fetch()[0] == 2.0f, "all_reduce in a group of one");
  }
  auto some = world.split(r == 0 ? -1 : 0, r, "without-0");
  EXPECT((r == 0) == (some == nullptr), "no color, no communicator");
  if (some && some->size() > 1) run_all(*some);
}

// The world ranks of a group's members, in group-rank order.
std::vector<int> members(Communicator& c, int world_rank) {
  DeviceVec<int32_t> mine(std::vector<int32_t>{world_rank}, DType::i32), all(std::vector<int32_t>(c.size(), -1), DType::i32);
  c.all_gather(all.tensor(), mine.tensor());
  auto& got = all.fetch();
  return {got.begin(), got.end()};
}

// build_parallel_state over NCCL for every way to split the world (TP x PP x DP = world): each
// group holds the ranks the coordinate formula says (default order tp-dp-pp), sums within it cover
// exactly them, and pp/pp_grad carry activations and gradients both ways at once.
void parallel_states(Communicator& world) {
  const int n = world.size(), r = world.rank();
  for (int tp = 1; tp <= n; ++tp) {
    for (int pp = 1; tp * pp <= n; ++pp) {
      if (n % (tp * pp) != 0) continue;
      const int dp = n / (tp * pp);
      Config cfg;
      cfg.parallel.tensor_model_parallel_size = tp;
      cfg.parallel.pipeline_model_parallel_size = pp;
      cfg.parallel.data_parallel_size = dp;
      cfg.parallel.world_size = n;
      cfg.parallel.rank = r;
      ParallelState s = build_parallel_state(cfg, world.split(0, r, "world"));
      const std::string shape = fmt::format("TP{} PP{} DP{}", tp, pp, dp);
      EXPECT(s.tp_rank == r % tp && s.dp_rank == (r / tp) % dp && s.pp_rank == r / (tp * dp), "{} coordinates", shape);
      auto same = [&](Communicator* c, auto in_group, const char* name) {
        std::vector<int> want;
        for (int q = 0; q < n; ++q)
          if (in_group(q)) want.push_back(q);
        EXPECT(c != nullptr, "{} {}: no communicator", shape, name);
        if (!c) return;
        EXPECT(members(*c, r) == want, "{} {}: members {} expected {}", shape, name, members(*c, r), want);
      };
      auto tp_of = [&](int q) { return q % tp; };
      auto dp_of = [&](int q) { return (q / tp) % dp; };
      auto pp_of = [&](int q) { return q / (tp * dp); };
      same(s.tp.get(), [&](int q) { return dp_of(q) == s.dp_rank && pp_of(q) == s.pp_rank; }, "tp");
      same(s.dp.get(), [&](int q) { return tp_of(q) == s.tp_rank && pp_of(q) == s.pp_rank; }, "dp");
      same(s.pp.get(), [&](int q) { return tp_of(q) == s.tp_rank && dp_of(q) == s.dp_rank; }, "pp");
      same(s.model_parallel.get(), [&](int q) { return dp_of(q) == s.dp_rank; }, "model_parallel");
      if (s.pp_rank == 0 || s.pp_rank == pp - 1)
        same(s.embedding.get(), [&](int q) {
          return tp_of(q) == s.tp_rank && dp_of(q) == s.dp_rank && (pp_of(q) == 0 || pp_of(q) == pp - 1);
        }, "embedding");
      else
        EXPECT(s.embedding == nullptr, "{}: a middle stage has an embedding group", shape);
      if (pp > 1) {
        const int next = (s.pp_rank + 1) % pp, prev = (s.pp_rank + pp - 1) % pp;
        DeviceVec<float> act(std::vector<float>(64, 100.0f + r), DType::f32), grad(std::vector<float>(64, -100.0f - r), DType::f32);
        DeviceVec<float> act_in(std::vector<float>(64, 0), DType::f32), grad_in(std::vector<float>(64, 0), DType::f32);
        s.pp->group_start();
        s.pp->send(act.tensor(), next);
        s.pp->recv(act_in.tensor(), prev);
        s.pp->group_end();
        s.pp_grad->group_start();
        s.pp_grad->send(grad.tensor(), prev);
        s.pp_grad->recv(grad_in.tensor(), next);
        s.pp_grad->group_end();
        const auto ring = members(*s.pp, r);
        EXPECT(act_in.fetch()[0] == 100.0f + ring[prev], "{} activation from prev", shape);
        EXPECT(grad_in.fetch()[0] == -100.0f - ring[next], "{} gradient from next", shape);
      }
    }
  }
}

int worker(const std::string& mode) {
  const WorkerPlace place = worker_place();
  const int rank = place.rank, world_size = place.world_size, device = place.device;
  g_rank = rank;
  try {
    cuda(cudaSetDevice(device), "cudaSetDevice");
    cuda(cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking), "cudaStreamCreate");
    const Millis timeout = distributed_timeout(1);
    TcpRendezvous rv(place.master_addr, place.master_port, rank, world_size, timeout);
    auto world = make_nccl_world_communicator(rv, device, g_stream, timeout);
    if (mode == "collectives") {
      collectives(*world);
      parallel_states(*world);
    } else if (mode == "timeout" || mode == "crash") {
      DeviceVec<float> d(std::vector<float>(1 << 20, 1.0f), DType::f32);
      world->all_reduce(d.tensor());
      d.fetch();
      if (rank == world_size - 1) {
        if (mode == "crash") std::abort();
        std::this_thread::sleep_for(std::chrono::seconds(600));  // never joins
      }
      world->all_reduce(d.tensor());
      d.fetch();  // the watchdog ends this process before this returns
      std::fprintf(stderr, "[rank %d] FAIL: the all_reduce finished without the last rank\n", rank);
      return 1;
    } else {
      fail("unknown mode '{}'", mode);
    }
    // Agree on the outcome (a host-side all-gather), so every rank exits the same way.
    int total = 0;
    for (const auto& f : rv.all_gather(std::to_string(g_failures))) total += std::atoi(f.c_str());
    if (rank == 0) std::printf("%s nccl %s with %d ranks\n", total == 0 ? "PASS" : "FAIL", mode.c_str(), world_size);
    world.reset();
    return total == 0 ? 0 : 1;
  } catch (const Error& e) {
    std::fprintf(stderr, "[rank %d] error: %s\n", rank, e.what());
    return 1;
  }
}

}  // namespace

int main(int argc, char** argv) {
  int nproc = 2;
  std::string mode = "collectives";
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--nproc") == 0 && i + 1 < argc) nproc = std::atoi(argv[++i]);
    else mode = argv[i];
  }
  if (is_worker()) return worker(mode);
  return launch_self("nccl_comm_test", nproc, argc, argv);
}
