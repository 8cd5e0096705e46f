// At unit level: Megatron's timer names, levels and order; the p2p timer
// names; the timers' level gating; the arguments block, theoretical-memory and report_memory lines.
#include <catch2/catch.hpp>

#include <regex>

#include "app/megatron_log.h"
#include "app/startup_report.h"
#include "engine/phase_timers.h"
#include "tests/cli_test_util.h"

using namespace mt;
using namespace mt::test;
using Catch::Contains;
using Catch::EndsWith;

TEST_CASE("timers: Megatron's timers_to_log order and levels", "[obs][timers]") {
  const std::vector<std::string> expected = {
      "forward-backward", "forward-compute", "backward-compute", "batch-generator", "forward-recv", "forward-send",
      "backward-recv", "backward-send", "forward-send-forward-recv", "forward-send-backward-recv",
      "backward-send-forward-recv", "backward-send-backward-recv", "forward-backward-send-forward-backward-recv",
      "layernorm-grads-all-reduce", "embedding-grads-all-reduce", "all-grads-sync", "params-all-gather",
      "optimizer-copy-to-main-grad", "optimizer-unscale-and-check-inf", "optimizer-clip-main-grad",
      "optimizer-count-zeros", "optimizer-inner-step", "optimizer-copy-main-to-model-params", "optimizer"};
  CHECK(megatron_timer_order() == expected);
  for (const char* n : {"forward-backward", "all-grads-sync", "params-all-gather", "optimizer-inner-step", "optimizer",
                        "embedding-grads-all-reduce"})
    CHECK(megatron_timer_level(n) == 1);
  for (const char* n : {"forward-compute", "backward-compute", "batch-generator", "forward-recv",
                        "forward-backward-send-forward-backward-recv"})
    CHECK(megatron_timer_level(n) == 2);
  // The report prints in that order (batch-generator after backward-compute, optimizer last).
  IterationStats s;
  s.timers_ms = {{"optimizer", {1, 1}}, {"batch-generator", {2, 2}}, {"forward-compute", {3, 3}},
                 {"all-grads-sync", {4, 4}}, {"forward-backward", {5, 5}}};
  const std::string r = format_timers(s, "max");
  std::vector<size_t> at;
  for (const char* n : {"forward-backward ", "forward-compute ", "batch-generator ", "all-grads-sync ", "optimizer "})
    at.push_back(r.find(std::string("    ") + n));
  for (size_t i = 0; i < at.size(); ++i) {
    REQUIRE(at[i] != std::string::npos);
    if (i) CHECK(at[i - 1] < at[i]);
  }
}

TEST_CASE("timers: p2p names as Megatron's p2p_communication calls", "[obs][timers]") {
  CHECK(std::string(p2p_timer_name(true, false, false, false)) == "forward-send");
  CHECK(std::string(p2p_timer_name(false, true, false, false)) == "forward-recv");
  CHECK(std::string(p2p_timer_name(false, false, true, false)) == "backward-send");
  CHECK(std::string(p2p_timer_name(false, false, false, true)) == "backward-recv");
  CHECK(std::string(p2p_timer_name(true, false, false, true)) == "forward-send-backward-recv");
  CHECK(std::string(p2p_timer_name(false, true, true, false)) == "backward-send-forward-recv");
  CHECK(std::string(p2p_timer_name(true, true, false, false)) == "forward-send-forward-recv");
  CHECK(std::string(p2p_timer_name(false, false, true, true)) == "backward-send-backward-recv");
  CHECK(std::string(p2p_timer_name(true, true, true, true)) == "forward-backward-send-forward-backward-recv");
}

TEST_CASE("timers: a level gates names and device syncs", "[obs][timers]") {
  for (int level : {0, 1, 2}) {
    int syncs = 0;
    PhaseTimers t(level, [&] { ++syncs; });
    for (const char* n : {"forward-backward", "forward-compute"}) {
      t.start(n);
      t.stop(n);
    }
    INFO("level " << level);
    CHECK(t.elapsed_ms().count("forward-backward") == (level >= 1 ? 1u : 0u));
    CHECK(t.elapsed_ms().count("forward-compute") == (level >= 2 ? 1u : 0u));
    CHECK(syncs == 2 * static_cast<int>(t.elapsed_ms().size()));  // level 0: no syncs at all
  }
  PhaseTimers t(1, nullptr);
  CHECK_THROWS(t.stop("optimizer"));  // stopped without a start
}

TEST_CASE("startup: Megatron's arguments block", "[obs][startup]") {
  const Config c = parse_env(small_gpt() + words("--device cpu --no-mmap-bin-files --no-save-optim"), {});
  const std::string b = megatron_arguments_block(c);
  CHECK(b.rfind("------------------------ arguments ------------------------\n", 0) == 0);
  CHECK(b.size() > 60);
  CHECK(b.substr(b.size() - 59) == "-------------------- end of arguments ---------------------");
  // "  name <48 - len(name) dots> value", Python's str() of the value.
  CHECK_THAT(b, Contains("\n  num_layers " + std::string(48 - 10, '.') + " 2\n"));
  CHECK_THAT(b, Contains("\n  hidden_size " + std::string(48 - 11, '.') + " 64\n"));
  CHECK_THAT(b, Contains("\n  mmap_bin_files " + std::string(48 - 14, '.') + " False\n"));  // store_false
  CHECK_THAT(b, Contains("\n  no_save_optim " + std::string(48 - 13, '.') + " True\n"));    // store_true
  CHECK_THAT(b, Contains("\n  data_parallel_size " + std::string(48 - 18, '.') + " 1\n"));
  CHECK_THAT(b, Contains("\n  load " + std::string(48 - 4, '.') + " None\n"));
  // Sorted by the lower-cased line.
  std::vector<std::string> lines;
  size_t pos = b.find('\n') + 1;
  while (true) {
    const size_t e = b.find('\n', pos);
    if (e == std::string::npos) break;
    lines.push_back(b.substr(pos, e - pos));
    pos = e + 1;
  }
  REQUIRE(lines.size() > 100);
  for (size_t i = 1; i < lines.size(); ++i) {
    std::string a = lines[i - 1], z = lines[i];
    for (auto* s : {&a, &z})
      for (char& ch : *s) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    INFO(lines[i - 1] << " / " << lines[i]);
    CHECK(a <= z);
  }
}

TEST_CASE("startup: report_memory and theoretical memory lines", "[obs][startup]") {
  MemoryReading m;
  m.allocated = m.max_allocated = 1024.0 * 1024.0 * 1.5;
  m.reserved = m.max_reserved = 1024.0 * 1024.0 * 2;
  CHECK(format_memory_report(3, 10, m) ==
        "[Rank 3] (after 10 iterations) memory (MB) | allocated: 1.50 | max allocated: 1.50 | reserved: 2.00 | "
        "max reserved: 2.00");
  m.allocated = 12345678;  // 11.773756027221680 MB: two decimals, as Megatron-LM's f"{x:.2f}"
  CHECK_THAT(format_memory_report(0, 1, m), Contains("| allocated: 11.77 |"));
  // --log-device-memory-used appends the device's memory in use.
  m.device_used = 1024.0 * 1024.0 * 3.25;
  CHECK_THAT(format_memory_report(0, 1, m), EndsWith("| max reserved: 2.00 | total device memory used: 3.25"));
  MemoryPlan p;
  p.bytes[static_cast<size_t>(MemoryCategory::parameters)] = 1 << 20;
  p.bytes[static_cast<size_t>(MemoryCategory::optimizer_states)] = 2 << 20;
  p.bytes[static_cast<size_t>(MemoryCategory::activations)] = 3 << 20;
  p.bytes[static_cast<size_t>(MemoryCategory::workspace)] = 1 << 19;
  CHECK(theoretical_memory_line(p) ==
        "Theoretical memory footprints: weight and optimizer=3.00 MB, activation=3.50 MB, total=6.50 MB");
}

TEST_CASE("startup: rank layout lines", "[obs][startup]") {
  const Config c = parse_env(small_gpt() + words("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
                                                 "--dry-run --world-size 8"),
                             {});
  const std::string s = rank_layout_summary(c);
  CHECK_THAT(s, Contains("> initialized tensor model parallel with size 2\n"));
  CHECK_THAT(s, Contains("> initialized pipeline model parallel with size 2\n"));
  CHECK_THAT(s, Contains("8 ranks = TP 2 x CP 1 x DP 2 x PP 2"));
  CHECK_THAT(s, Contains("rank     7: tp 1 cp 0 dp 1 pp 1"));
}
