// parse_config: Megatron's argparse semantics on top of CLI11 (which tokenises argv, matches the
// spellings and collects values), then launch detection, derivations and validation.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cctype>
#include <regex>
#include <set>

#include "app/cli.h"
#include "app/distill_args.h"
#include "app/checkpoint_cli_args.h"
#include "app/cli_internal.h"
#include "app/suggest.h"
#include "app/unsupported.h"
#include "core/log.h"

namespace mt::cli {
namespace {

// argparse takes "-5" or "-.5" as a value, any other leading '-' as an option.
bool looks_like_option(const std::string& v) {
  static const std::regex negative_number(R"(^-\d+$|^-\d*\.\d+$)");
  return v.size() > 1 && v[0] == '-' && !std::regex_match(v, negative_number);
}

std::string join(const std::vector<std::string>& v, const char* sep = " ") {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : sep) + x;
  return s;
}

// One line for an unknown flag: a suggestion only when it is a near miss (app/suggest.h).
std::string unknown_flag(const std::string& token) {
  const std::string name = token.substr(0, token.find('='));
  if (name.rfind("--retro-", 0) == 0)
    return fmt::format("{}: Retro was removed from Megatron-LM and megatrain does not support it", name);
  std::vector<std::string> names;
  for (const FlagSpec& f : flag_table().flags())
    for (const auto& n : f.all_names()) names.push_back(n);
  const std::string near = closest(name, names);
  if (near.empty()) return fmt::format("unrecognized argument {}", name);
  return fmt::format("unrecognized argument {} (did you mean {}?)", name, near);
}

// Words that follow an unknown flag on the command line are taken as its values (argparse would
// not know either), so "--mscale 1.0" is one problem, not two.
std::multiset<std::string> values_of_unknown_flags(const std::vector<std::string>& args, const FlagTable& table) {
  std::multiset<std::string> values;
  bool in_unknown = false;
  for (const std::string& a : args) {
    if (looks_like_option(a)) {
      in_unknown = a.find('=') == std::string::npos && table.find(a) == nullptr;
      continue;
    }
    if (in_unknown) values.insert(a);
  }
  return values;
}

// Every problem found before any value is interpreted, in one error: the first line says how
// many, then one line each. A single problem is its line alone. Only unsupported flags: Unsupported.
[[noreturn]] void refuse(const std::vector<std::string>& problems, bool all_unsupported) {
  std::string msg = problems.front();
  if (problems.size() > 1) {
    msg = fmt::format("{} problems with the command line:", problems.size());
    for (const std::string& p : problems) msg += "\n  " + p;
  }
  if (all_unsupported) throw Unsupported(msg);
  throw Error(msg);
}

}  // namespace

CliState parse_flags(const std::vector<std::string>& args) {
  const FlagTable& table = flag_table();
  CLI::App app;
  app.allow_extras();
  app.set_help_flag();
  std::map<std::string, FlagValue> given;
  for (const FlagSpec& f : table.flags()) {
    const std::string name = f.name;
    const Arity arity = f.arity;
    CLI::Option* o = app.add_option(join(f.all_names(), ","), [&given, name, arity](const CLI::results_t& r) {
      FlagValue v{r};
      if (arity == Arity::none) {
        // CLI11 may record an empty result for a switch; "--switch=value" gives a non-empty one.
        for (const std::string& x : r)
          if (!x.empty()) fail("{} takes no value (got '{}')", name, x);
        v.values.clear();
      }
      if (arity == Arity::one && looks_like_option(r.front()))
        fail("{} expects a value (got the flag {})", name, r.front());
      given[name] = v;
      return true;
    });
    o->trigger_on_parse();
    switch (arity) {
      case Arity::none: o->expected(0, 0); break;
      case Arity::one: o->expected(1, 1); break;
      case Arity::three: o->expected(3, 3); break;
      case Arity::one_or_more:
        o->expected(1, CLI::detail::expected_max_vector_size);
        o->allow_extra_args(true);
        break;
      case Arity::zero_or_more:
        o->expected(0, CLI::detail::expected_max_vector_size);
        o->allow_extra_args(true);
        break;
    }
  }
  std::vector<std::string> reversed(args.rbegin(), args.rend());
  try {
    app.parse(std::move(reversed));
  } catch (const CLI::ParseError& e) {
    // CLI11 says "--lr: 1 required  missing" or "--x: At least 3 required but received 2".
    const std::string what = e.what();
    static const std::regex missing(R"(^([^:,]+)[^:]*: (\d+) required.*missing)");
    static const std::regex too_few(R"(^([^:,]+)[^:]*: At least (\d+) required but received (\d+))");
    std::smatch m;
    if (std::regex_search(what, m, missing)) fail("{} expects a value", m[1].str());
    if (std::regex_search(what, m, too_few)) fail("{} expects {} values, got {}", m[1].str(), m[2].str(), m[3].str());
    fail("{}", what.empty() ? e.get_name() : what);
  }
  // Unknown, removed and unsupported flags: all of them named at once.
  std::vector<std::string> problems;
  std::vector<std::string> stray;
  std::multiset<std::string> unknown_values = values_of_unknown_flags(args, table);
  for (const std::string& x : app.remaining()) {
    if (looks_like_option(x)) {
      problems.push_back(unknown_flag(x));
    } else if (auto it = unknown_values.find(x); it != unknown_values.end()) {
      unknown_values.erase(it);
    } else {
      stray.push_back(x);
    }
  }
  if (!stray.empty())
    problems.push_back(fmt::format("unrecognized arguments: {} (a value containing spaces must be quoted as one argument)",
                                   join(stray)));

  CliState st;
  st.given = std::move(given);

  // Flags removed from Megatron (or fatal there): Megatron's advice.
  for (const FlagSpec& f : table.flags())
    if (f.kind == FlagKind::removed && st.has(f.name)) problems.push_back(f.note);

  // What megatrain does not implement yet: one line per refused use.
  const std::vector<std::string> refused = unsupported_problems(st.given);
  const bool all_unsupported = problems.empty();
  problems.insert(problems.end(), refused.begin(), refused.end());
  if (!problems.empty()) refuse(problems, all_unsupported);

  // --use-checkpoint-args: the checkpoint's model arguments, before any flag is applied.
  apply_checkpoint_args(st);

  for (const FlagSpec& f : table.flags()) {
    auto it = st.given.find(f.name);
    if (it == st.given.end()) continue;
    if (f.kind == FlagKind::no_effect) st.note(fmt::format("{} has no effect in megatrain: {}", f.name, f.note));
    if (f.apply) f.apply(st, it->second);
  }
  return st;
}

void validate(CliState& st) {
  validate_fsdp(st);
  validate_muon(st);
  validate_model(st);
  validate_parallel(st);
  validate_training(st);
  validate_data(st);
  validate_checkpoint_and_logging(st);
  validate_megatrain(st);
  validate_moe(st);
}

}  // namespace mt::cli

namespace mt {

void print_setup_messages(const std::vector<SetupMessage>& messages, int rank) {
  if (rank != 0) return;
  for (const SetupMessage& m : messages) {
    switch (m.kind) {
      case SetupMessage::Kind::info: log::write_stdout(m.text); break;
      case SetupMessage::Kind::note: log::write_stderr(fmt::format("[rank {}] note: {}", rank, m.text)); break;
      case SetupMessage::Kind::warning: log::write_stderr(fmt::format("[rank {}] warning: {}", rank, m.text)); break;
    }
  }
}

Config parse_config(const std::vector<std::string>& args, const Environment& env, std::vector<SetupMessage>* messages) {
  cli::CliState st = cli::parse_flags(args);
  cli::resolve_launch(st, env);
  cli::derive(st);
  cli::validate(st);
  cli::derive_distillation(st, args, env);
  if (messages != nullptr)
    messages->insert(messages->end(), st.messages.begin(), st.messages.end());
  else
    print_setup_messages(st.messages, st.cfg.parallel.rank);
  return st.cfg;
}

}  // namespace mt
