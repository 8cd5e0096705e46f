#include "parallel/launch_env.h"

#include <cctype>
#include <filesystem>

#include "core/error.h"

namespace mt {

const char* launcher_name(Launcher l) {
  switch (l) {
    case Launcher::none: return "none";
    case Launcher::torchrun: return "torchrun";
    case Launcher::openmpi: return "openmpi";
    case Launcher::mpich: return "mpich";
    case Launcher::slurm: return "slurm";
    case Launcher::workstation: return "workstation";
  }
  return "?";
}

namespace {

bool has(const Environment& env, const char* name) { return env.count(name) > 0; }

int env_int(const Environment& env, const char* name) {
  const std::string& v = env.at(name);
  size_t pos = 0;
  long x = 0;
  try {
    x = std::stol(v, &pos);
  } catch (...) {
    pos = 0;
  }
  if (v.empty() || pos != v.size() || x < 0 || x > 1000000000)
    fail("environment variable {}='{}' is not a non-negative integer", name, v);
  return static_cast<int>(x);
}

int env_int_or(const Environment& env, const char* name, int fallback) {
  return has(env, name) ? env_int(env, name) : fallback;
}

void check_ranks(const LaunchInfo& l, const char* rank_var, const char* world_var, const char* local_rank_var,
                 const char* local_world_var) {
  if (l.world_size < 1) fail("environment variable {}={} must be >= 1", world_var, l.world_size);
  if (l.rank >= l.world_size)
    fail("environment variable {}={} is not below {}={}", rank_var, l.rank, world_var, l.world_size);
  if (l.local_world_size < 1 || l.local_world_size > l.world_size)
    fail("environment variable {}={} must be between 1 and {}={}", local_world_var, l.local_world_size, world_var,
         l.world_size);
  if (l.local_rank >= l.local_world_size)
    fail("environment variable {}={} is not below {}={}", local_rank_var, l.local_rank, local_world_var,
         l.local_world_size);
}

void rendezvous_from_env(const Environment& env, LaunchInfo& l, bool multi_node_default_empty) {
  if (has(env, "MASTER_ADDR")) {
    l.master_addr = env.at("MASTER_ADDR");
  } else if (multi_node_default_empty && l.world_size > l.local_world_size) {
    l.master_addr.clear();  // no address known: the NCCL id goes over MPI
  }
  l.master_port = env_int_or(env, "MASTER_PORT", 29500);
}

}  // namespace

std::vector<std::string> expand_slurm_nodelist(const std::string& list) {
  // Split at top-level commas.
  std::vector<std::string> patterns;
  int depth = 0;
  std::string cur;
  for (char c : list) {
    if (c == '[') ++depth;
    if (c == ']') --depth;
    if (depth < 0) fail("SLURM node list '{}': unbalanced ']'", list);
    if (c == ',' && depth == 0) {
      if (!cur.empty()) patterns.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  if (depth != 0) fail("SLURM node list '{}': unbalanced '['", list);
  if (!cur.empty()) patterns.push_back(cur);

  std::vector<std::string> hosts;
  for (const std::string& pat : patterns) {
    std::vector<std::string> partial{""};
    size_t i = 0;
    while (i < pat.size()) {
      if (pat[i] != '[') {
        const size_t j = pat.find('[', i);
        const std::string lit = pat.substr(i, j == std::string::npos ? std::string::npos : j - i);
        for (auto& p : partial) p += lit;
        i = (j == std::string::npos) ? pat.size() : j;
        continue;
      }
      const size_t close = pat.find(']', i);
      const std::string body = pat.substr(i + 1, close - i - 1);
      std::vector<std::string> items;
      size_t s = 0;
      while (s <= body.size()) {
        size_t e = body.find(',', s);
        if (e == std::string::npos) e = body.size();
        const std::string item = body.substr(s, e - s);
        const size_t dash = item.find('-');
        auto digits = [&](const std::string& x) {
          if (x.empty()) fail("SLURM node list '{}': empty range bound in [{}]", list, body);
          for (char c : x)
            if (!std::isdigit(static_cast<unsigned char>(c)))
              fail("SLURM node list '{}': '{}' is not a number in [{}]", list, x, body);
        };
        if (dash == std::string::npos) {
          digits(item);
          items.push_back(item);
        } else {
          const std::string lo = item.substr(0, dash), hi = item.substr(dash + 1);
          digits(lo);
          digits(hi);
          const long a = std::stol(lo), b = std::stol(hi);
          if (b < a) fail("SLURM node list '{}': range {} runs backwards", list, item);
          for (long v = a; v <= b; ++v) {
            std::string n = std::to_string(v);
            if (n.size() < lo.size()) n = std::string(lo.size() - n.size(), '0') + n;
            items.push_back(n);
          }
        }
        s = e + 1;
      }
      std::vector<std::string> next;
      for (const auto& p : partial)
        for (const auto& it : items) next.push_back(p + it);
      partial.swap(next);
      i = close + 1;
    }
    for (auto& p : partial) hosts.push_back(p);
  }
  return hosts;
}

std::vector<int> expand_slurm_tasks_per_node(const std::string& spec) {
  std::vector<int> out;
  size_t s = 0;
  while (s < spec.size()) {
    size_t e = spec.find(',', s);
    if (e == std::string::npos) e = spec.size();
    const std::string item = spec.substr(s, e - s);
    const size_t paren = item.find("(x");
    try {
      const int count = std::stoi(item.substr(0, paren));
      const int times = (paren == std::string::npos) ? 1 : std::stoi(item.substr(paren + 2));
      for (int k = 0; k < times; ++k) out.push_back(count);
    } catch (const std::exception&) {
      fail("SLURM tasks-per-node '{}': cannot read '{}'", spec, item);
    }
    s = e + 1;
  }
  return out;
}

int count_visible_gpus(const Environment& env, const std::string& dev_dir) {
  auto it = env.find("CUDA_VISIBLE_DEVICES");
  if (it != env.end()) {
    int n = 0;
    const std::string& v = it->second;
    size_t s = 0;
    while (s < v.size()) {
      size_t e = v.find(',', s);
      if (e == std::string::npos) e = v.size();
      std::string item = v.substr(s, e - s);
      while (!item.empty() && std::isspace(static_cast<unsigned char>(item.front()))) item.erase(item.begin());
      while (!item.empty() && std::isspace(static_cast<unsigned char>(item.back()))) item.pop_back();
      // An index (non-negative integer) or a GPU/MIG UUID; CUDA stops at the first invalid entry.
      bool valid = !item.empty();
      if (valid && std::isdigit(static_cast<unsigned char>(item[0]))) {
        for (char c : item) valid = valid && std::isdigit(static_cast<unsigned char>(c));
      } else {
        valid = valid && (item.rfind("GPU-", 0) == 0 || item.rfind("MIG-", 0) == 0);
      }
      if (!valid) break;
      ++n;
      s = e + 1;
    }
    return n;
  }
  int n = 0;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dev_dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.size() > 6 && name.rfind("nvidia", 0) == 0) {
      bool all_digits = true;
      for (size_t i = 6; i < name.size(); ++i) all_digits = all_digits && std::isdigit(static_cast<unsigned char>(name[i]));
      if (all_digits) ++n;
    }
  }
  return n;
}

LaunchInfo detect_launch(const Environment& env, std::optional<int> nproc_per_node, DeviceKind device,
                         const std::string& dev_dir) {
  LaunchInfo l;
  if (has(env, "RANK") && has(env, "WORLD_SIZE")) {
    l.launcher = Launcher::torchrun;
    l.source = "torchrun-style environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE)";
    l.world_size = env_int(env, "WORLD_SIZE");
    l.rank = env_int(env, "RANK");
    l.local_world_size = env_int_or(env, "LOCAL_WORLD_SIZE", l.world_size);
    l.local_rank = env_int_or(env, "LOCAL_RANK", l.local_world_size > 0 ? l.rank % l.local_world_size : 0);
    check_ranks(l, "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE");
    l.node_rank = env_int_or(env, "GROUP_RANK", l.rank / l.local_world_size);
    rendezvous_from_env(env, l, false);
  } else if (has(env, "OMPI_COMM_WORLD_RANK") && has(env, "OMPI_COMM_WORLD_SIZE")) {
    l.launcher = Launcher::openmpi;
    l.source = "Open MPI environment (OMPI_COMM_WORLD_*)";
    l.world_size = env_int(env, "OMPI_COMM_WORLD_SIZE");
    l.rank = env_int(env, "OMPI_COMM_WORLD_RANK");
    l.local_world_size = env_int_or(env, "OMPI_COMM_WORLD_LOCAL_SIZE", l.world_size);
    l.local_rank = env_int_or(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0);
    check_ranks(l, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                "OMPI_COMM_WORLD_LOCAL_SIZE");
    l.node_rank = l.rank / l.local_world_size;
    rendezvous_from_env(env, l, true);
  } else if ((has(env, "PMI_RANK") && has(env, "PMI_SIZE")) ||
             (has(env, "MV2_COMM_WORLD_RANK") && has(env, "MV2_COMM_WORLD_SIZE"))) {
    l.launcher = Launcher::mpich;
    const bool pmi = has(env, "PMI_RANK") && has(env, "PMI_SIZE");
    const char* rank_var = pmi ? "PMI_RANK" : "MV2_COMM_WORLD_RANK";
    const char* world_var = pmi ? "PMI_SIZE" : "MV2_COMM_WORLD_SIZE";
    const char* lrank_var = pmi ? "MPI_LOCALRANKID" : "MV2_COMM_WORLD_LOCAL_RANK";
    const char* lworld_var = pmi ? "MPI_LOCALNRANKS" : "MV2_COMM_WORLD_LOCAL_SIZE";
    l.source = pmi ? "MPICH/Hydra environment (PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS)"
                   : "MVAPICH environment (MV2_COMM_WORLD_*)";
    l.world_size = env_int(env, world_var);
    l.rank = env_int(env, rank_var);
    l.local_world_size = env_int_or(env, lworld_var, l.world_size);
    l.local_rank = env_int_or(env, lrank_var, 0);
    check_ranks(l, rank_var, world_var, lrank_var, lworld_var);
    l.node_rank = l.rank / l.local_world_size;
    rendezvous_from_env(env, l, true);
  } else if (has(env, "SLURM_PROCID") && has(env, "SLURM_STEP_NUM_TASKS")) {
    l.launcher = Launcher::slurm;
    l.source = "SLURM srun environment (SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID)";
    l.world_size = env_int(env, "SLURM_STEP_NUM_TASKS");
    l.rank = env_int(env, "SLURM_PROCID");
    l.local_rank = env_int_or(env, "SLURM_LOCALID", 0);
    l.node_rank = env_int_or(env, "SLURM_NODEID", 0);
    l.local_world_size = l.world_size;
    for (const char* var : {"SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"}) {
      if (!has(env, var)) continue;
      const std::vector<int> per_node = expand_slurm_tasks_per_node(env.at(var));
      if (!per_node.empty())
        l.local_world_size = per_node[std::min<size_t>(l.node_rank, per_node.size() - 1)];
      break;
    }
    check_ranks(l, "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID", "SLURM_STEP_TASKS_PER_NODE");
    if (has(env, "MASTER_ADDR")) {
      l.master_addr = env.at("MASTER_ADDR");
    } else {
      for (const char* var : {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"}) {
        if (!has(env, var)) continue;
        const std::vector<std::string> hosts = expand_slurm_nodelist(env.at(var));
        if (!hosts.empty()) l.master_addr = hosts.front();
        break;
      }
    }
    l.master_port = env_int_or(env, "MASTER_PORT", 29500);
  } else {
    int n = 1;
    if (nproc_per_node) {
      n = *nproc_per_node;
      l.source = "--nproc-per-node";
    } else if (device == DeviceKind::gpu) {
      n = count_visible_gpus(env, dev_dir);
      l.source = has(env, "CUDA_VISIBLE_DEVICES") ? "visible GPUs (CUDA_VISIBLE_DEVICES)"
                                                  : "visible GPUs (/dev/nvidia*)";
    } else {
      l.source = "--device cpu (one process)";
    }
    l.world_size = n;
    l.local_world_size = n;
    l.launcher = n > 1 ? Launcher::workstation : Launcher::none;
    l.master_addr = "127.0.0.1";
    l.master_port = env_int_or(env, "MASTER_PORT", 29500);
    return l;
  }
  if (nproc_per_node && *nproc_per_node != l.local_world_size)
    fail("--nproc-per-node {} disagrees with the launcher: {} started {} processes on this node; "
         "--nproc-per-node is for bare launches, drop it", *nproc_per_node, l.source, l.local_world_size);
  return l;
}

}  // namespace mt
