// Who launched this process and where it sits: world size, rank, local rank, node, rendezvous
// address, read from the launcher's environment or, bare on a
// workstation, from the visible GPUs / --nproc-per-node.
//
// Precedence when several launchers' variables are present (checked in this order):
//   1. torchrun-style  RANK + WORLD_SIZE (LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR/PORT)
//   2. Open MPI        OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE
//   3. MPICH / Hydra   PMI_RANK/PMI_SIZE, MPI_LOCALRANKID/MPI_LOCALNRANKS (MVAPICH: MV2_COMM_WORLD_*)
//   4. SLURM srun      SLURM_PROCID + SLURM_STEP_NUM_TASKS (SLURM_LOCALID, SLURM_NODEID,
//                      SLURM_STEP_TASKS_PER_NODE, first host of SLURM_STEP_NODELIST/SLURM_JOB_NODELIST)
//   5. none: a workstation; --nproc-per-node or the visible GPUs (CUDA_VISIBLE_DEVICES, else
//      /dev/nvidia<N>) give the number of local workers the first process starts.
// Why this order: launchers nest, and the innermost one made this process. torchrun run by srun
// (one task per node) gives each worker RANK/WORLD_SIZE while the SLURM_* of the node task are
// merely inherited; mpirun/mpiexec inside an sbatch or salloc allocation inherit the allocation's
// SLURM_* variables (the same SLURM_PROCID in every process), whereas srun never sets OMPI_* or
// Hydra's variables. SLURM counts only inside an srun step (SLURM_STEP_NUM_TASKS): a bare run
// inside a batch script is not a multi-process launch.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/environment.h"

namespace mt {

struct LaunchInfo {
  Launcher launcher = Launcher::none;
  int world_size = 1;
  int rank = 0;
  int local_rank = 0;
  int local_world_size = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";  // empty: none known (Open MPI/Hydra across nodes)
  int master_port = 29500;
  std::string source;  // what was read, for messages ("torchrun (RANK, WORLD_SIZE)")
};

// device: with --device cpu a bare run starts one process unless --nproc-per-node says more.
// dev_dir: where to count nvidia<N> device nodes ("/dev"; tests pass their own).
LaunchInfo detect_launch(const Environment& env, std::optional<int> nproc_per_node, DeviceKind device,
                         const std::string& dev_dir = "/dev");

// GPUs this process may use without asking the CUDA runtime: the entries of CUDA_VISIBLE_DEVICES
// up to the first invalid one (as CUDA does; empty = none), else the /dev/nvidia<N> nodes.
int count_visible_gpus(const Environment& env, const std::string& dev_dir = "/dev");

// Expands a SLURM host list ("gpu[01-03,7],login", "rack[1-2]-n[08-09]") in order, keeping the
// zero padding of range bounds.
std::vector<std::string> expand_slurm_nodelist(const std::string& list);

// Expands SLURM_TASKS_PER_NODE-style counts ("4(x2),3" -> 4 4 3).
std::vector<int> expand_slurm_tasks_per_node(const std::string& spec);

const char* launcher_name(Launcher l);

}  // namespace mt
