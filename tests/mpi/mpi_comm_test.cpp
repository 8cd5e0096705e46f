// MPI communicator tests, run under mpirun (tests/mpi/*.cmake). Usage: mpi_comm_test <mode>
//   collectives        every collective's result on world and on split groups, p2p rings
//   timeout-collective the last rank never joins an all_reduce: the others must fail with the
//                      timeout message (MEGATRAIN_DISTRIBUTED_TIMEOUT_SECONDS) and the job must end
//   timeout-recv       rank 0 waits for a message rank 1 never sends
// Exit 0 when every check passed on every rank.
#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "parallel/mpi_communicator.h"

using namespace mt;

namespace {

int g_failures = 0;
int g_rank = 0;

#define EXPECT(cond, ...)                                                                                   \
  do {                                                                                                      \
    if (!(cond)) {                                                                                          \
      ++g_failures;                                                                                         \
      std::fprintf(stderr, "[rank %d] FAIL %s:%d: %s: %s\n", g_rank, __FILE__, __LINE__, #cond,             \
                   fmt::format(__VA_ARGS__).c_str());                                                       \
    }                                                                                                       \
  } while (0)

template <typename T>
Tensor host(std::vector<T>& v, DType t) {
  return Tensor(v.data(), t, Device::cpu, {static_cast<int64_t>(v.size())});
}

void test_all_reduce(Communicator& c) {
  const int n = c.size(), r = c.rank();
  const int len = 37;
  {
    std::vector<float> v(len);
    for (int i = 0; i < len; ++i) v[i] = 10.0f * r + i;
    c.all_reduce(host(v, DType::f32), ReduceOp::sum);
    for (int i = 0; i < len; ++i) EXPECT(v[i] == 10.0f * n * (n - 1) / 2 + n * i, "{} f32 sum [{}] = {}", c.name(), i, v[i]);
  }
  {
    std::vector<double> v(len);
    for (int i = 0; i < len; ++i) v[i] = (r == i % n) ? 1e300 : -1.5 * r;
    c.all_reduce(host(v, DType::f64), ReduceOp::max);
    for (int i = 0; i < len; ++i) EXPECT(v[i] == 1e300, "{} f64 max [{}] = {}", c.name(), i, v[i]);
  }
  {
    std::vector<int32_t> v(len);
    for (int i = 0; i < len; ++i) v[i] = (r + 1) * (i + 1) - 7;
    c.all_reduce(host(v, DType::i32), ReduceOp::min);
    for (int i = 0; i < len; ++i) EXPECT(v[i] == (i + 1) - 7, "{} i32 min [{}] = {}", c.name(), i, v[i]);
  }
  {
    std::vector<int64_t> v(len);
    for (int i = 0; i < len; ++i) v[i] = (int64_t{1} << 40) * (r + 1) + i;
    c.all_reduce(host(v, DType::i64), ReduceOp::sum);
    for (int i = 0; i < len; ++i)
      EXPECT(v[i] == (int64_t{1} << 40) * n * (n + 1) / 2 + int64_t{n} * i, "{} i64 sum [{}]", c.name(), i);
  }
  {
    // bf16: small integers are exact, so the sum is too.
    std::vector<uint16_t> v(len);
    for (int i = 0; i < len; ++i) v[i] = float_to_bf16_bits(static_cast<float>(r + i % 4));
    c.all_reduce(host(v, DType::bf16), ReduceOp::sum);
    for (int i = 0; i < len; ++i) {
      const float want = n * (n - 1) / 2.0f + n * (i % 4);
      EXPECT(bf16_bits_to_float(v[i]) == want, "{} bf16 sum [{}] = {} want {}", c.name(), i, bf16_bits_to_float(v[i]), want);
    }
  }
  {
    std::vector<uint16_t> v(len);
    for (int i = 0; i < len; ++i) v[i] = float_to_f16_bits(static_cast<float>(r * 2 - i));
    c.all_reduce(host(v, DType::f16), ReduceOp::max);
    for (int i = 0; i < len; ++i) EXPECT(f16_bits_to_float(v[i]) == (n - 1) * 2.0f - i, "{} f16 max [{}]", c.name(), i);
  }
}

void test_reduce_scatter_all_gather(Communicator& c) {
  const int n = c.size(), r = c.rank();
  const int chunk = 5;
  // Out of place: in[j] = r * 1000 + j; rank r gets sum over ranks of in[r*chunk + k].
  std::vector<float> in(n * chunk), out(chunk, -1.0f);
  for (int j = 0; j < n * chunk; ++j) in[j] = 1000.0f * r + j;
  c.reduce_scatter(host(out, DType::f32), host(in, DType::f32), ReduceOp::sum);
  for (int k = 0; k < chunk; ++k) {
    const float want = 1000.0f * n * (n - 1) / 2 + n * (r * chunk + k);
    EXPECT(out[k] == want, "{} reduce_scatter [{}] = {} want {}", c.name(), k, out[k], want);
  }
  // In place (NCCL's form: out = in + rank * chunk).
  std::vector<double> buf(n * chunk);
  for (int j = 0; j < n * chunk; ++j) buf[j] = r + 0.5 * j;
  Tensor whole = host(buf, DType::f64);
  c.reduce_scatter(whole.flat_slice(r * chunk, chunk), whole, ReduceOp::sum);
  for (int k = 0; k < chunk; ++k) {
    const double want = n * (n - 1) / 2.0 + n * 0.5 * (r * chunk + k);
    EXPECT(buf[r * chunk + k] == want, "{} in-place reduce_scatter [{}] = {}", c.name(), k, buf[r * chunk + k]);
  }
  // All-gather, out of place and in place.
  std::vector<int32_t> mine(chunk), all(n * chunk, -1);
  for (int k = 0; k < chunk; ++k) mine[k] = r * 100 + k;
  c.all_gather(host(all, DType::i32), host(mine, DType::i32));
  for (int j = 0; j < n * chunk; ++j) EXPECT(all[j] == (j / chunk) * 100 + j % chunk, "{} all_gather [{}]", c.name(), j);
  std::vector<int64_t> inplace(n * chunk, -1);
  for (int k = 0; k < chunk; ++k) inplace[r * chunk + k] = r * 100 + k;
  Tensor ip = host(inplace, DType::i64);
  c.all_gather(ip, ip.flat_slice(r * chunk, chunk));
  for (int j = 0; j < n * chunk; ++j)
    EXPECT(inplace[j] == (j / chunk) * 100 + j % chunk, "{} in-place all_gather [{}]", c.name(), j);
}

void test_broadcast_barrier(Communicator& c) {
  for (int root = 0; root < c.size(); ++root) {
    std::vector<uint8_t> v(19, static_cast<uint8_t>(c.rank() == root ? 200 + root : 0));
    c.broadcast(host(v, DType::u8), root);
    for (auto x : v) EXPECT(x == 200 + root, "{} broadcast from {} got {}", c.name(), root, int(x));
  }
  c.barrier();
}

// Ring: each rank sends to the next and receives from the previous in one group; then both
// directions at once (what a pipeline stage does with activations and gradients).
void test_p2p(Communicator& c) {
  const int n = c.size(), r = c.rank();
  if (n == 1) return;
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  std::vector<float> out(1000), in(1000, -1.0f);
  for (int i = 0; i < 1000; ++i) out[i] = r * 1e4f + i;
  c.group_start();
  c.send(host(out, DType::f32), next);
  c.recv(host(in, DType::f32), prev);
  c.group_end();
  for (int i = 0; i < 1000; ++i) EXPECT(in[i] == prev * 1e4f + i, "{} ring recv [{}]", c.name(), i);

  std::vector<double> to_next(3, r), to_prev(3, -r), from_prev(3, 0), from_next(3, 0);
  c.group_start();
  c.recv(host(from_next, DType::f64), next);
  c.send(host(to_prev, DType::f64), prev);
  c.send(host(to_next, DType::f64), next);
  c.recv(host(from_prev, DType::f64), prev);
  c.group_end();
  EXPECT(from_prev[0] == prev, "{} bidirectional from prev {}", c.name(), from_prev[0]);
  EXPECT(from_next[0] == -next, "{} bidirectional from next {}", c.name(), from_next[0]);

  // Outside a group a send/recv pair is ordered by rank parity so it cannot deadlock.
  if (n >= 2 && r < 2) {
    std::vector<int32_t> x(4, r);
    if (r == 0) {
      c.send(host(x, DType::i32), 1);
      c.recv(host(x, DType::i32), 1);
      EXPECT(x[0] == 1, "blocking recv got {}", x[0]);
    } else {
      std::vector<int32_t> got(4, -1);
      c.recv(host(got, DType::i32), 0);
      c.send(host(x, DType::i32), 0);
      EXPECT(got[0] == 0, "blocking recv got {}", got[0]);
    }
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
  const int n = world.size(), r = world.rank();
  // Even and odd ranks, ordered backwards by key: group rank = reverse order of world ranks.
  auto parity = world.split(r % 2, -r, "parity");
  EXPECT(parity != nullptr, "split returned no group");
  const int members = (n - r % 2 + 1) / 2;
  EXPECT(parity->size() == members, "parity group size {} want {}", parity->size(), members);
  int higher_same_parity = 0;
  for (int q = r + 1; q < n; ++q) higher_same_parity += (q % 2 == r % 2);
  EXPECT(parity->rank() == higher_same_parity, "parity rank {} want {}", parity->rank(), higher_same_parity);
  run_all(*parity);
  // The sum within the group is over its members only.
  std::vector<int64_t> v{r};
  parity->all_reduce(host(v, DType::i64));
  int64_t want = 0;
  for (int q = r % 2; q < n; q += 2) want += q;
  EXPECT(v[0] == want, "parity sum {} want {}", v[0], want);
  // Ranks without a color get no communicator.
  auto some = world.split(r == 0 ? -1 : 0, r, "all-but-0");
  EXPECT((r == 0) == (some == nullptr), "color -1 handling");
  if (some) {
    EXPECT(some->size() == n - 1, "all-but-0 size {}", some->size());
    run_all(*some);
  }
  // A split of a split.
  auto pairs = parity->split(parity->rank() / 2, parity->rank(), "pairs");
  run_all(*pairs);
}

void timeout_collective(Communicator& world) {
  std::vector<float> v(8, 1.0f);
  world.all_reduce(host(v, DType::f32));  // everyone: works
  if (world.rank() == world.size() - 1) {
    // Never joins the next collective: stands for a rank stuck elsewhere.
    std::this_thread::sleep_for(std::chrono::seconds(120));
    return;
  }
  world.all_reduce(host(v, DType::f32));
  std::fprintf(stderr, "[rank %d] FAIL: the all_reduce completed without the last rank\n", g_rank);
  ++g_failures;
}

void timeout_recv(Communicator& world) {
  if (world.rank() == 0) {
    std::vector<float> v(8);
    world.recv(host(v, DType::f32), 1);
    ++g_failures;
  } else {
    std::this_thread::sleep_for(std::chrono::seconds(120));
  }
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "collectives";
  try {
    auto world = make_mpi_world_communicator(distributed_timeout(1));
    g_rank = world->rank();
    if (mode == "collectives") collectives(*world);
    else if (mode == "timeout-collective") timeout_collective(*world);
    else if (mode == "timeout-recv") timeout_recv(*world);
    else fail("unknown mode '{}'", mode);
    // Agree on the outcome so that every rank exits the same way.
    std::vector<int32_t> f{g_failures};
    world->all_reduce(host(f, DType::i32));
    if (g_rank == 0) std::printf("%s %s with %d ranks\n", f[0] == 0 ? "PASS" : "FAIL", mode.c_str(), world->size());
    world.reset();
    mpi_finalize();
    return f[0] == 0 ? 0 : 1;
  } catch (const Error& e) {
    std::fprintf(stderr, "[rank %d] error: %s\n", g_rank, e.what());
    mpi_abort(1);
  }
}
