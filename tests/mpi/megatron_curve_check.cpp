// megatrain against Megatron-LM's own loss curve from the same weights: imports a Megatron-LM
// checkpoint (import-megatron), trains it with the given flags and --finetune (weights only, fresh
// optimizer, data from the first sample, as Megatron-LM's run that made the log), on one process or
// under `mpirun -np N`, and compares every iteration line with Megatron-LM's: the lm loss and the
// MoE losses (Megatron prints 7 significant digits: relative 3e-6) and the gradient norm (printed
// with 3 decimals: 1.5e-3).
//
// Usage: megatron_curve_check <megatrain> <mpirun> <work dir> <nranks> <megatron log> <megatron checkpoint>
//                             [megatrain flags...]
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "tests/mpi/check_util.h"

using mt_check::check;
using mt_check::failures;
using mt_check::run;

namespace {

// The "key: value" fields of each iteration line (" | "-separated), by iteration.
std::map<int, std::map<std::string, double>> iterations(const std::string& path) {
  std::map<int, std::map<std::string, double>> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    const size_t it = line.find("iteration ");
    if (it == std::string::npos || line.find("lm loss:") == std::string::npos) continue;
    const int number = std::atoi(line.c_str() + it + 10);
    std::map<std::string, double>& fields = out[number];
    std::stringstream ss(line.substr(line.find('|', it) + 1));
    std::string part;
    while (std::getline(ss, part, '|')) {
      const size_t colon = part.find(':');
      if (colon == std::string::npos) continue;
      std::string key = part.substr(0, colon);
      key.erase(0, key.find_first_not_of(' '));
      key.erase(key.find_last_not_of(' ') + 1);
      char* end = nullptr;
      const double v = std::strtod(part.c_str() + colon + 1, &end);
      if (end != part.c_str() + colon + 1) fields[key] = v;
    }
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 7) {
    std::cerr << "usage: megatron_curve_check <megatrain> <mpirun> <work dir> <nranks> <megatron log> "
                 "<megatron checkpoint> [flags...]\n";
    return 2;
  }
  const std::string megatrain = argv[1], mpirun = argv[2], work = argv[3], megatron_log = argv[5], ckpt = argv[6];
  const int nranks = std::atoi(argv[4]);
  std::string flags;
  for (int i = 7; i < argc; ++i) flags += std::string(" '") + argv[i] + "'";
  std::filesystem::remove_all(work);
  std::filesystem::create_directories(work);
  if (run(megatrain + " import-megatron --load " + ckpt + " --save " + work + "/imported", work + "/import.log") != 0)
    return 1;
  const std::string launch = nranks > 1 ? mpirun + " --oversubscribe -np " + std::to_string(nranks) + " " : "";
  if (run(launch + megatrain + " --device cpu" + flags + " --load " + work + "/imported --finetune",
          work + "/megatrain.log") != 0)
    return 1;
  const auto theirs = iterations(megatron_log), ours = iterations(work + "/megatrain.log");
  check(!theirs.empty(), "Megatron-LM's log " + megatron_log + " has iteration lines");
  for (const auto& [it, fields] : theirs) {
    const auto o = ours.find(it);
    if (o == ours.end()) {
      check(false, "megatrain logged iteration " + std::to_string(it));
      continue;
    }
    for (const auto& [key, want] : fields) {
      const bool loss = key.find("loss") != std::string::npos && key != "loss scale";
      const bool norm = key == "grad norm";
      if (!loss && !norm) continue;
      const auto got = o->second.find(key);
      if (got == o->second.end()) {
        check(false, "megatrain's iteration " + std::to_string(it) + " logs " + key);
        continue;
      }
      const double d = std::fabs(got->second - want);
      const bool ok = norm ? d <= 1.5e-3 : d <= 3e-6 * std::max(std::fabs(want), 1e-30) + 1e-12;
      std::printf("  iteration %d %s: Megatron-LM %.7g, megatrain %.7g%s\n", it, key.c_str(), want, got->second,
                  ok ? "" : "  <--");
      check(ok, key + " of iteration " + std::to_string(it));
    }
  }
  std::cout << (failures ? "FAILED" : "PASSED") << "\n";
  return failures ? 1 : 0;
}
