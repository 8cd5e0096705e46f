#include "app/startup_report.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <vector>

#include "app/flag_values.h"
#include "app/flags.h"
#include "app/plan.h"

namespace mt {

namespace {

// A JSON value as Python's str() prints the argument.
std::string python_str(const nlohmann::json& v, bool nested = false) {
  if (v.is_null()) return "None";
  if (v.is_boolean()) return v.get<bool>() ? "True" : "False";
  if (v.is_number_float()) return cli::format_float(v.get<double>());
  if (v.is_number()) return v.dump();
  if (v.is_string()) return nested ? "'" + v.get<std::string>() + "'" : v.get<std::string>();
  if (v.is_array()) {
    std::string s = "[";
    for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + python_str(v[i], true);
    return s + "]";
  }
  return v.dump();
}

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

}  // namespace

std::string megatron_arguments_block(const Config& cfg) {
  std::vector<std::pair<std::string, std::string>> args;  // name -> value
  auto has = [&](const std::string& name) {
    return std::any_of(args.begin(), args.end(), [&](const auto& a) { return a.first == name; });
  };
  const nlohmann::json conf = resolved_config(cfg);
  for (const cli::FlagSpec& f : cli::flag_table().flags()) {
    if (!conf.contains(f.name)) continue;
    nlohmann::json value = conf[f.name]["value"];
    std::string name = f.name.substr(2);
    // Megatron's store_false switches ("--no-x", also spelled "--disable-x") store into x.
    const bool store_false = name.rfind("no-", 0) == 0 && value.is_boolean() &&
                             std::find(f.aliases.begin(), f.aliases.end(), "--disable-" + name.substr(3)) != f.aliases.end();
    if (store_false) {
      name = name.substr(3);
      value = !value.get<bool>();
    }
    std::replace(name.begin(), name.end(), '-', '_');
    if (!has(name)) args.emplace_back(name, python_str(value));
  }
  // Values Megatron derives into args (data_parallel_size, padded_vocab_size, ...).
  const nlohmann::json derived = derived_values(cfg);
  for (const auto& [k, v] : derived.items())
    if (!has(k)) args.emplace_back(k, python_str(v));
  std::vector<std::string> lines;
  for (const auto& [name, value] : args) {
    const std::string dots(name.size() < 48 ? 48 - name.size() : 0, '.');
    lines.push_back(fmt::format("  {} {} {}", name, dots, value));
  }
  std::stable_sort(lines.begin(), lines.end(), [](const std::string& a, const std::string& b) { return lower(a) < lower(b); });
  std::string out = "------------------------ arguments ------------------------\n";
  for (const std::string& l : lines) out += l + "\n";
  out += "-------------------- end of arguments ---------------------";
  return out;
}

std::string rank_layout_summary(const Config& cfg) {
  const RankGrid g = RankGrid::from_config(cfg);
  std::string out = fmt::format("> initialized tensor model parallel with size {}\n", g.tp);
  out += fmt::format("> initialized pipeline model parallel with size {}\n", g.pp);
  out += fmt::format("> rank layout (order {}, fastest first): {} ranks = TP {} x CP {} x DP {} x PP {}; virtual "
                     "pipeline size {}",
                     g.order_string(), g.world_size(), g.tp, g.cp, g.dp, g.pp, cfg.parallel.virtual_pipeline_size);
  const int shown = std::min(g.world_size(), 64);
  for (int r = 0; r < shown; ++r) {
    const RankCoord c = rank_coord(g, r);
    out += fmt::format("\n  rank {:>5}: tp {} cp {} dp {} pp {}", r, c.tp, c.cp, c.dp, c.pp);
  }
  if (shown < g.world_size()) out += fmt::format("\n  ... ({} more; --dry-run --json lists every rank)", g.world_size() - shown);
  return out;
}

std::string theoretical_memory_line(const MemoryPlan& plan) {
  using C = MemoryCategory;
  const double mb = 1024.0 * 1024.0;
  const double weights = static_cast<double>(plan.of(C::parameters) + plan.of(C::gradients) +
                                             plan.of(C::master_weights) + plan.of(C::optimizer_states));
  const double acts = static_cast<double>(plan.of(C::activations) + plan.of(C::workspace));
  return fmt::format("Theoretical memory footprints: weight and optimizer={:.2f} MB, activation={:.2f} MB, total={:.2f} MB",
                     weights / mb, acts / mb, (weights + acts) / mb);
}

// Megatron-LM's report_memory (megatron/training/utils/common_utils.py): MB with two decimals.
std::string format_memory_report(int rank, int64_t iteration, const MemoryReading& m) {
  const double mb = 1024.0 * 1024.0;
  std::string s = fmt::format("[Rank {}] (after {} iterations) memory (MB) | allocated: {:.2f} | max allocated: {:.2f} | "
                              "reserved: {:.2f} | max reserved: {:.2f}",
                              rank, iteration, m.allocated / mb, m.max_allocated / mb, m.reserved / mb,
                              m.max_reserved / mb);
  if (m.device_used) s += fmt::format(" | total device memory used: {:.2f}", *m.device_used / mb);
  return s;
}

}  // namespace mt
