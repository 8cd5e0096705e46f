// A small "--name value" / "--switch" parser for subcommands that take a handful of their own
// flags (export-hf, import-hf, forward-logits). Unknown flags and missing values are errors that
// name the subcommand and the flag.
#pragma once

#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "core/error.h"

namespace mt {

class SubcommandArgs {
 public:
  // `values`: flags that take one value; `switches`: flags that take none.
  SubcommandArgs(std::string command, const std::vector<std::string>& args, std::set<std::string> values,
                 std::set<std::string> switches = {})
      : command_(std::move(command)) {
    for (size_t i = 0; i < args.size(); ++i) {
      std::string a = args[i], v;
      const size_t eq = a.find('=');
      const bool inline_value = a.rfind("--", 0) == 0 && eq != std::string::npos;
      if (inline_value) {
        v = a.substr(eq + 1);
        a = a.substr(0, eq);
      }
      if (switches.count(a)) {
        if (inline_value) fail("{}: {} takes no value", command_, a);
        switches_.insert(a);
      } else if (values.count(a)) {
        if (!inline_value) {
          if (i + 1 >= args.size() || args[i + 1].rfind("--", 0) == 0) fail("{}: {} needs a value", command_, a);
          v = args[++i];
        }
        values_[a] = v;
      } else {
        std::string known;
        for (const auto& s : values) known += " " + s;
        for (const auto& s : switches) known += " " + s;
        fail("{}: unknown argument '{}' (its flags:{})", command_, args[i], known);
      }
    }
  }

  std::optional<std::string> get(const std::string& flag) const {
    auto it = values_.find(flag);
    return it == values_.end() ? std::nullopt : std::optional<std::string>(it->second);
  }
  std::string required(const std::string& flag, const std::string& what) const {
    auto v = get(flag);
    if (!v || v->empty()) fail("{} needs {} {}", command_, flag, what);
    return *v;
  }
  bool has(const std::string& flag) const { return switches_.count(flag) > 0; }
  int64_t integer(const std::string& flag, int64_t fallback) const {
    auto v = get(flag);
    if (!v) return fallback;
    size_t used = 0;
    int64_t x = 0;
    try {
      x = std::stoll(*v, &used);
    } catch (...) {
      used = 0;
    }
    if (used != v->size() || v->empty()) fail("{}: {} '{}' is not an integer", command_, flag, *v);
    return x;
  }

 private:
  std::string command_;
  std::map<std::string, std::string> values_;
  std::set<std::string> switches_;
};

// Flags as one shell line for the user to copy: values a shell would split or expand (a [0,1]
// list is a glob) are single-quoted.
inline std::string shell_quoted_line(const std::vector<std::string>& flags) {
  std::string line;
  for (const auto& f : flags)
    line += (line.empty() ? "" : " ") + (f.find_first_of("[]*?() ") == std::string::npos ? f : "'" + f + "'");
  return line;
}

}  // namespace mt
