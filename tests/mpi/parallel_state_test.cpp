// build_parallel_state over MPI: every group has exactly the members Megatron's rank order gives,
// and a reduction within a group sums exactly those members.
//
// Usage (under mpirun): parallel_state_test <TP> <PP> [tp-pp-dp]
//   DP = world size / (TP x PP). The expected groups below are written out by hand for the shapes
//   the tests run; other shapes are checked against the coordinate formula only.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/error.h"
#include "parallel/mpi_communicator.h"
#include "parallel/parallel_state_builder.h"

using namespace mt;

namespace {

int g_failures = 0;
int g_rank = 0;

void expect(bool ok, const std::string& what) {
  if (!ok) {
    ++g_failures;
    std::fprintf(stderr, "[rank %d] FAIL: %s\n", g_rank, what.c_str());
  }
}

using Groups = std::vector<std::vector<int>>;

// The world ranks of a communicator's members, in group-rank order (all-gather of world ranks).
std::vector<int> members(Communicator& c, int world_rank) {
  std::vector<int32_t> mine{world_rank}, all(c.size());
  c.all_gather(Tensor(all.data(), DType::i32, Device::cpu, {c.size()}), Tensor(mine.data(), DType::i32, Device::cpu, {1}));
  return {all.begin(), all.end()};
}

const std::vector<int>* group_of(const Groups& groups, int rank) {
  for (const auto& g : groups)
    for (int r : g)
      if (r == rank) return &g;
  return nullptr;
}

void check_group(Communicator* c, const Groups& expected, const std::string& name, int world_rank) {
  const std::vector<int>* want = group_of(expected, world_rank);
  if (!want) {
    expect(c == nullptr, fmt::format("{}: rank {} should be in no group", name, world_rank));
    return;
  }
  if (!c) {
    expect(false, fmt::format("{}: no communicator, expected group {}", name, *want));
    return;
  }
  const std::vector<int> got = members(*c, world_rank);
  expect(got == *want, fmt::format("{}: members {} expected {}", name, got, *want));
  // A sum within the group covers exactly its members.
  std::vector<double> v{static_cast<double>(world_rank * world_rank + 1)};
  c->all_reduce(Tensor(v.data(), DType::f64, Device::cpu, {1}));
  double sum = 0;
  for (int r : *want) sum += r * r + 1;
  expect(v[0] == sum, fmt::format("{}: all_reduce gave {} expected {}", name, v[0], sum));
  expect(c->name() == name, fmt::format("communicator named '{}' expected '{}'", c->name(), name));
}

// Megatron's documented example and its tp-pp-dp twin (8 ranks, TP2 PP2 DP2).
std::map<std::string, Groups> expected_groups(int world, int tp, int pp, bool tp_pp_dp) {
  if (world == 8 && tp == 2 && pp == 2 && !tp_pp_dp)
    return {{"tp", {{0, 1}, {2, 3}, {4, 5}, {6, 7}}},
            {"dp", {{0, 2}, {1, 3}, {4, 6}, {5, 7}}},
            {"pp", {{0, 4}, {1, 5}, {2, 6}, {3, 7}}},
            {"pp_grad", {{0, 4}, {1, 5}, {2, 6}, {3, 7}}},
            {"embedding", {{0, 4}, {1, 5}, {2, 6}, {3, 7}}},
            {"model_parallel", {{0, 1, 4, 5}, {2, 3, 6, 7}}}};
  if (world == 8 && tp == 2 && pp == 2 && tp_pp_dp)
    return {{"tp", {{0, 1}, {2, 3}, {4, 5}, {6, 7}}},
            {"pp", {{0, 2}, {1, 3}, {4, 6}, {5, 7}}},
            {"pp_grad", {{0, 2}, {1, 3}, {4, 6}, {5, 7}}},
            {"dp", {{0, 4}, {1, 5}, {2, 6}, {3, 7}}},
            {"embedding", {{0, 2}, {1, 3}, {4, 6}, {5, 7}}},
            {"model_parallel", {{0, 1, 2, 3}, {4, 5, 6, 7}}}};
  if (world == 8 && tp == 1 && pp == 4 && !tp_pp_dp)  // DP2: embedding = first + last stage only
    return {{"tp", {{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}},
            {"dp", {{0, 1}, {2, 3}, {4, 5}, {6, 7}}},
            {"pp", {{0, 2, 4, 6}, {1, 3, 5, 7}}},
            {"pp_grad", {{0, 2, 4, 6}, {1, 3, 5, 7}}},
            {"embedding", {{0, 6}, {1, 7}}},
            {"model_parallel", {{0, 2, 4, 6}, {1, 3, 5, 7}}}};
  if (world == 8 && tp == 2 && pp == 1 && !tp_pp_dp)  // DP4, with --num-distributed-optimizer-instances 2
    return {{"tp", {{0, 1}, {2, 3}, {4, 5}, {6, 7}}},
            {"dp", {{0, 2, 4, 6}, {1, 3, 5, 7}}},
            {"pp", {{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}},
            {"embedding", {{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}},
            {"model_parallel", {{0, 1}, {2, 3}, {4, 5}, {6, 7}}},
            // two instances of two consecutive DP ranks each, and the ranks at the same place of both
            {"dist_opt_intra", {{0, 2}, {4, 6}, {1, 3}, {5, 7}}},
            {"dist_opt_inter", {{0, 4}, {2, 6}, {1, 5}, {3, 7}}}};
  if (world == 3 && tp == 1 && pp == 1)  // DP3
    return {{"tp", {{0}, {1}, {2}}},
            {"dp", {{0, 1, 2}}},
            {"pp", {{0}, {1}, {2}}},
            {"embedding", {{0}, {1}, {2}}},
            {"model_parallel", {{0}, {1}, {2}}}};
  if (world == 2 && tp == 1 && pp == 2)  // PP2
    return {{"tp", {{0}, {1}}},
            {"dp", {{0}, {1}}},
            {"pp", {{0, 1}}},
            {"pp_grad", {{0, 1}}},
            {"embedding", {{0, 1}}},
            {"model_parallel", {{0, 1}}}};
  fail("no hand-written expectation for world {} TP {} PP {}", world, tp, pp);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc < 3) fail("usage: parallel_state_test <TP> <PP> [tp-pp-dp | instances=N]");
    auto world = make_mpi_world_communicator(distributed_timeout(1));
    g_rank = world->rank();
    const int n = world->size();
    Config cfg;
    cfg.parallel.tensor_model_parallel_size = std::atoi(argv[1]);
    cfg.parallel.pipeline_model_parallel_size = std::atoi(argv[2]);
    cfg.parallel.use_tp_pp_dp_mapping = argc > 3 && std::strcmp(argv[3], "tp-pp-dp") == 0;
    // --num-distributed-optimizer-instances N (with the distributed optimizer)
    const int instances = argc > 3 && std::strncmp(argv[3], "instances=", 10) == 0 ? std::atoi(argv[3] + 10) : 1;
    cfg.parallel.use_distributed_optimizer = instances > 1;
    cfg.parallel.num_distributed_optimizer_instances = instances;
    cfg.parallel.world_size = n;
    cfg.parallel.rank = world->rank();
    cfg.parallel.data_parallel_size =
        n / (cfg.parallel.tensor_model_parallel_size * cfg.parallel.pipeline_model_parallel_size);
    cfg.train.device = DeviceKind::cpu;
    const int TP = cfg.parallel.tensor_model_parallel_size, PP = cfg.parallel.pipeline_model_parallel_size;
    const bool tp_pp_dp = cfg.parallel.use_tp_pp_dp_mapping;
    const auto want = expected_groups(n, TP, PP, tp_pp_dp);

    ParallelState s = build_parallel_state(cfg, std::move(world));
    const int r = s.rank;
    // Coordinates from the formula (default order: rank = tp + TP*(dp + DP*pp)).
    const int DP = s.dp_size;
    const int tp = r % TP;
    const int dp = tp_pp_dp ? r / (TP * PP) : (r / TP) % DP;
    const int pp = tp_pp_dp ? (r / TP) % PP : r / (TP * DP);
    expect(s.tp_rank == tp && s.dp_rank == dp && s.pp_rank == pp,
           fmt::format("coordinates tp {} dp {} pp {}, expected {} {} {}", s.tp_rank, s.dp_rank, s.pp_rank, tp, dp, pp));
    expect(s.world->size() == n && s.world->rank() == r, "world communicator");

    check_group(s.tp.get(), want.at("tp"), "tp", r);
    check_group(s.dp.get(), want.at("dp"), "dp", r);
    check_group(s.pp.get(), want.at("pp"), "pp", r);
    if (PP > 1) check_group(s.pp_grad.get(), want.at("pp_grad"), "pp_grad", r);
    else expect(s.pp_grad == nullptr, "pp_grad exists with PP = 1");
    check_group(s.embedding.get(), want.at("embedding"), "embedding", r);
    check_group(s.model_parallel.get(), want.at("model_parallel"), "model_parallel", r);
    expect(s.cp == nullptr && s.dp_cp == nullptr, "cp groups exist with CP = 1");
    if (instances > 1) {
      check_group(s.dist_opt_intra.get(), want.at("dist_opt_intra"), "dist_opt_intra", r);
      check_group(s.dist_opt_inter.get(), want.at("dist_opt_inter"), "dist_opt_inter", r);
      expect(s.dist_opt_instances == instances && s.dist_opt_size() == DP / instances &&
                 s.dist_opt_rank() == s.dp_rank % (DP / instances) && &s.dist_opt_group() == s.dist_opt_intra.get(),
             "distributed optimizer instance sizes");
    } else {
      expect(s.dist_opt_intra == nullptr && s.dist_opt_inter == nullptr && &s.dist_opt_group() == s.dp.get(),
             "distributed optimizer instance groups exist with one instance");
    }

    // Pipeline neighbours exchange over pp and pp_grad in one group (activations one way,
    // gradients the other) without mixing them up.
    if (PP > 1) {
      const int next = (s.pp_rank + 1) % PP, prev = (s.pp_rank + PP - 1) % PP;
      std::vector<float> act_out{100.0f + r}, grad_out{-100.0f - r}, act_in{0}, grad_in{0};
      auto t = [](std::vector<float>& v) { return Tensor(v.data(), DType::f32, Device::cpu, {1}); };
      s.pp->group_start();
      s.pp_grad->group_start();
      s.pp->send(t(act_out), next);
      s.pp_grad->send(t(grad_out), prev);
      s.pp->recv(t(act_in), prev);
      s.pp_grad->recv(t(grad_in), next);
      s.pp_grad->group_end();
      s.pp->group_end();
      const auto pp_members = members(*s.pp, r);
      expect(act_in[0] == 100.0f + pp_members[prev], fmt::format("activation from prev: {}", act_in[0]));
      expect(grad_in[0] == -100.0f - pp_members[next], fmt::format("gradient from next: {}", grad_in[0]));
    }

    std::vector<int32_t> f{g_failures};
    s.world->all_reduce(Tensor(f.data(), DType::i32, Device::cpu, {1}));
    if (r == 0)
      std::printf("%s parallel state TP %d PP %d DP %d (%s) on %d ranks\n", f[0] ? "FAIL" : "PASS", TP, PP, DP,
                  tp_pp_dp ? "tp-cp-ep-pp-dp" : "tp-cp-ep-dp-pp", n);
    s = ParallelState{};
    mpi_finalize();
    return f[0] ? 1 : 0;
  } catch (const Error& e) {
    std::fprintf(stderr, "[rank %d] error: %s\n", g_rank, e.what());
    mpi_abort(1);
  }
}
