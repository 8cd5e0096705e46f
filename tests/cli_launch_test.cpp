// Launcher environments -> world size, rank, local rank, rendezvous (parallel/launch_env.h).
#include "tests/cli_test_util.h"

#include "parallel/launch_env.h"

using namespace mt;
using namespace mt::test;
using Catch::Contains;

namespace {
std::string launch_error(const Environment& env, std::optional<int> nproc = std::nullopt) {
  try {
    detect_launch(env, nproc, DeviceKind::gpu, "/nonexistent");
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}
}  // namespace

TEST_CASE("launch: torchrun environment", "[cli][launch]") {
  const LaunchInfo l = detect_launch({{"RANK", "5"}, {"WORLD_SIZE", "16"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "4"},
                                      {"GROUP_RANK", "1"}, {"MASTER_ADDR", "node0"}, {"MASTER_PORT", "6000"}},
                                     std::nullopt, DeviceKind::gpu);
  CHECK(l.launcher == Launcher::torchrun);
  CHECK(l.world_size == 16);
  CHECK(l.rank == 5);
  CHECK(l.local_rank == 1);
  CHECK(l.local_world_size == 4);
  CHECK(l.node_rank == 1);
  CHECK(l.master_addr == "node0");
  CHECK(l.master_port == 6000);
  CHECK_THAT(launch_error({{"RANK", "16"}, {"WORLD_SIZE", "16"}}), Contains("RANK=16 is not below WORLD_SIZE=16"));
  CHECK_THAT(launch_error({{"RANK", "x"}, {"WORLD_SIZE", "16"}}), Contains("environment variable RANK='x' is not"));
  CHECK_THAT(launch_error({{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_WORLD_SIZE", "4"}}, 2),
             Contains("--nproc-per-node 2 disagrees with the launcher"));
}

TEST_CASE("launch: Open MPI environment", "[cli][launch]") {
  const LaunchInfo l = detect_launch({{"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "8"},
                                      {"OMPI_COMM_WORLD_LOCAL_RANK", "3"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}},
                                     std::nullopt, DeviceKind::gpu);
  CHECK(l.launcher == Launcher::openmpi);
  CHECK(l.rank == 3);
  CHECK(l.world_size == 8);
  CHECK(l.local_rank == 3);
  CHECK(l.local_world_size == 4);
  CHECK(l.master_addr.empty());  // several nodes, no MASTER_ADDR: the NCCL id goes over MPI
  const LaunchInfo one = detect_launch({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"},
                                        {"OMPI_COMM_WORLD_LOCAL_RANK", "0"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}},
                                       std::nullopt, DeviceKind::cpu);
  CHECK(one.master_addr == "127.0.0.1");
}

TEST_CASE("launch: MPICH/Hydra and MVAPICH environments", "[cli][launch]") {
  const LaunchInfo l = detect_launch({{"PMI_RANK", "2"}, {"PMI_SIZE", "4"}, {"MPI_LOCALRANKID", "0"},
                                      {"MPI_LOCALNRANKS", "2"}, {"MASTER_ADDR", "10.0.0.1"}},
                                     std::nullopt, DeviceKind::gpu);
  CHECK(l.launcher == Launcher::mpich);
  CHECK(l.rank == 2);
  CHECK(l.world_size == 4);
  CHECK(l.local_world_size == 2);
  CHECK(l.node_rank == 1);
  CHECK(l.master_addr == "10.0.0.1");
  const LaunchInfo m = detect_launch({{"MV2_COMM_WORLD_RANK", "1"}, {"MV2_COMM_WORLD_SIZE", "2"}}, std::nullopt,
                                     DeviceKind::gpu);
  CHECK(m.launcher == Launcher::mpich);
  CHECK(m.rank == 1);
}

TEST_CASE("launch: SLURM srun environment and MASTER_ADDR from the node list", "[cli][launch]") {
  const LaunchInfo l = detect_launch({{"SLURM_PROCID", "9"}, {"SLURM_STEP_NUM_TASKS", "16"}, {"SLURM_NTASKS", "16"},
                                      {"SLURM_LOCALID", "1"}, {"SLURM_NODEID", "1"}, {"SLURM_STEP_TASKS_PER_NODE", "8(x2)"},
                                      {"SLURM_JOB_NODELIST", "gpu[007-008]"}},
                                     std::nullopt, DeviceKind::gpu);
  CHECK(l.launcher == Launcher::slurm);
  CHECK(l.rank == 9);
  CHECK(l.world_size == 16);
  CHECK(l.local_rank == 1);
  CHECK(l.local_world_size == 8);
  CHECK(l.node_rank == 1);
  CHECK(l.master_addr == "gpu007");
  CHECK(l.master_port == 29500);
  // A batch script without srun has SLURM_* but no step: not a multi-process launch.
  const LaunchInfo batch = detect_launch({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "16"}, {"CUDA_VISIBLE_DEVICES", "0"}},
                                         std::nullopt, DeviceKind::gpu);
  CHECK(batch.launcher == Launcher::none);
  CHECK(batch.world_size == 1);
}

TEST_CASE("launch: precedence torchrun > Open MPI > MPICH > SLURM", "[cli][launch]") {
  const Environment slurm = {{"SLURM_PROCID", "0"}, {"SLURM_STEP_NUM_TASKS", "2"}, {"SLURM_LOCALID", "0"}};
  Environment e = slurm;
  e.emplace("PMI_RANK", "1");
  e.emplace("PMI_SIZE", "4");
  CHECK(detect_launch(e, std::nullopt, DeviceKind::gpu).launcher == Launcher::mpich);
  e.emplace("OMPI_COMM_WORLD_RANK", "2");
  e.emplace("OMPI_COMM_WORLD_SIZE", "4");
  CHECK(detect_launch(e, std::nullopt, DeviceKind::gpu).launcher == Launcher::openmpi);
  CHECK(detect_launch(e, std::nullopt, DeviceKind::gpu).rank == 2);
  e.emplace("RANK", "3");
  e.emplace("WORLD_SIZE", "8");
  CHECK(detect_launch(e, std::nullopt, DeviceKind::gpu).launcher == Launcher::torchrun);
  CHECK(detect_launch(e, std::nullopt, DeviceKind::gpu).rank == 3);
  CHECK(detect_launch(slurm, std::nullopt, DeviceKind::gpu).launcher == Launcher::slurm);
}

TEST_CASE("launch: bare workstation counts visible GPUs or takes --nproc-per-node", "[cli][launch]") {
  TempDir dev;
  for (const char* n : {"nvidia0", "nvidia1", "nvidia2", "nvidiactl", "nvidia-uvm", "nvidia3"})
    std::ofstream(dev.str(n)) << "";
  CHECK(count_visible_gpus({}, dev.path.string()) == 4);
  CHECK(count_visible_gpus({{"CUDA_VISIBLE_DEVICES", "0,2"}}, dev.path.string()) == 2);
  CHECK(count_visible_gpus({{"CUDA_VISIBLE_DEVICES", ""}}, dev.path.string()) == 0);
  CHECK(count_visible_gpus({{"CUDA_VISIBLE_DEVICES", "1,-1,2"}}, dev.path.string()) == 1);  // CUDA stops at -1
  CHECK(count_visible_gpus({{"CUDA_VISIBLE_DEVICES", "GPU-8f3a,GPU-11aa"}}, dev.path.string()) == 2);
  const LaunchInfo w = detect_launch({}, std::nullopt, DeviceKind::gpu, dev.path.string());
  CHECK(w.launcher == Launcher::workstation);
  CHECK(w.world_size == 4);
  CHECK(w.rank == 0);
  const LaunchInfo n = detect_launch({}, 2, DeviceKind::gpu, dev.path.string());
  CHECK(n.world_size == 2);
  const LaunchInfo cpu = detect_launch({}, std::nullopt, DeviceKind::cpu, dev.path.string());
  CHECK(cpu.world_size == 1);
  CHECK(cpu.launcher == Launcher::none);
}

TEST_CASE("launch: the CLI fills Config::parallel and refuses a GPU run without GPUs", "[cli][launch]") {
  const Config c = parse_env(small_gpt(), {{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"},
                                              {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}});
  CHECK(c.parallel.launcher == Launcher::openmpi);
  CHECK(c.parallel.rank == 1);
  CHECK(c.parallel.world_size == 2);
  CHECK(c.parallel.local_rank == 1);
  CHECK(parse_env(small_gpt() + words("--local-rank 1"), torchrun_env(2)).parallel.local_rank == 1);
  try {
    parse_env(small_gpt(), {{"CUDA_VISIBLE_DEVICES", ""}});
    FAIL("expected an error");
  } catch (const Error& e) {
    CHECK_THAT(std::string(e.what()), Contains("no GPU is visible"));
    CHECK_THAT(std::string(e.what()), Contains("--device cpu"));
  }
  CHECK(parse_env(small_gpt() + words("--device cpu --nproc-per-node 3"), {}).parallel.world_size == 3);
}

TEST_CASE("launch: SLURM node lists expand with zero padding", "[cli][launch]") {
  CHECK(expand_slurm_nodelist("gnode[10,20,25,37]") == std::vector<std::string>{"gnode10", "gnode20", "gnode25", "gnode37"});
  CHECK(expand_slurm_nodelist("node[001-003,7],login") ==
        std::vector<std::string>{"node001", "node002", "node003", "node7", "login"});
  CHECK(expand_slurm_nodelist("rack[1-2]-n[08-09]") ==
        std::vector<std::string>{"rack1-n08", "rack1-n09", "rack2-n08", "rack2-n09"});
  CHECK(expand_slurm_nodelist("a,b") == std::vector<std::string>{"a", "b"});
  CHECK(expand_slurm_nodelist("gpu[098-101]") == std::vector<std::string>{"gpu098", "gpu099", "gpu100", "gpu101"});
  CHECK_THROWS_AS(expand_slurm_nodelist("gpu[1-"), Error);
  CHECK_THROWS_AS(expand_slurm_nodelist("gpu[3-1]"), Error);
  CHECK(expand_slurm_tasks_per_node("4(x2),3") == std::vector<int>{4, 4, 3});
}
