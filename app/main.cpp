// megatrain: pretrain GPT- and Llama-style transformers from Megatron-LM's command line.
//   megatrain [SUBCOMMAND] <flags>
// Without a subcommand: parse and validate the flags, then train (or, with --dry-run, print the
// plan). Errors: "[rank N] error: <message>" on stderr and exit code 1; never a stack trace.
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "app/cli.h"
#include "app/plan.h"
#include "app/subcommands.h"
#include "app/train.h"
#include "app/version.h"
#include "core/environment.h"
#include "core/error.h"
#include "core/log.h"
#include "parallel/launch_env.h"

namespace {

bool has_arg(const std::vector<std::string>& args, const char* a) {
  for (const auto& s : args)
    if (s == a) return true;
  return false;
}

// The rank to prefix errors with before the Config exists: the launcher's, else 0.
int rank_from_environment(const mt::Environment& env) {
  try {
    return mt::detect_launch(env, std::nullopt, mt::DeviceKind::cpu).rank;
  } catch (const std::exception&) {
    return 0;
  }
}

int run(const std::vector<std::string>& args) {
  if (!args.empty() && args[0].rfind("-", 0) != 0) {
    if (const mt::Subcommand* sub = mt::find_subcommand(args[0]))
      return sub->run(std::vector<std::string>(args.begin() + 1, args.end()));
    std::string names;
    for (const mt::Subcommand& s : mt::subcommands()) names += (names.empty() ? "" : ", ") + std::string(s.name);
    mt::fail("unknown subcommand '{}' (subcommands in this build: {}; flags start with --)", args[0],
             names.empty() ? "none" : names);
  }
  if (has_arg(args, "--help") || has_arg(args, "-h")) {
    std::fputs(mt::help_text().c_str(), stdout);
    return 0;
  }
  if (has_arg(args, "--version")) {
    std::printf("megatrain %s\n", mt::version_string());
    return 0;
  }
  if (has_arg(args, "--list-flags")) {
    std::fputs(mt::flags_markdown().c_str(), stdout);
    return 0;
  }
  if (args.empty()) mt::fail("no flags given: megatrain takes Megatron-LM's pretrain_gpt.py flags (megatrain --help)");
  std::vector<mt::SetupMessage> messages;
  const mt::Config cfg = mt::parse_config(args, mt::current_environment(), &messages);
  mt::log::set_rank(cfg.parallel.rank, cfg.parallel.world_size);
  if (cfg.run.dry_run) {
    if (cfg.parallel.rank != 0) return 0;  // under a launcher, rank 0 prints the plan
    // Notes and warnings on stderr; info lines are part of the plan (stdout).
    std::vector<mt::SetupMessage> to_stderr;
    for (const auto& m : messages)
      if (m.kind != mt::SetupMessage::Kind::info) to_stderr.push_back(m);
    mt::print_setup_messages(to_stderr, cfg.parallel.rank);
    return mt::run_dry_run(cfg, messages);
  }
  mt::print_setup_messages(messages, cfg.parallel.rank);
  return mt::run_training(cfg);
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  mt::log::set_rank(rank_from_environment(mt::current_environment()), 1);
  try {
    return run(args);
  } catch (const mt::Error& e) {  // mt::Unsupported included
    mt::log::error(e.what());
  } catch (const std::exception& e) {
    mt::log::error(std::string("internal error: ") + e.what());
  }
  return 1;
}
