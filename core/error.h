// Errors: every failure megatrain reports to a user is an mt::Error with a message that names the
// flag, file or rank involved and what to do. main() prints it (prefixed with the rank) and exits 1.
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace mt {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// A flag or flag combination that megatrain understands but does not implement yet.
class Unsupported : public Error {
 public:
  explicit Unsupported(const std::string& what) : Error(what) {}
};

template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> f, Args&&... args) {
  throw Error(fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace mt

// Internal invariant: a failure here is a megatrain bug, not bad input.
#define MT_CHECK(cond, ...)                                                                  \
  do {                                                                                       \
    if (!(cond))                                                                             \
      ::mt::fail("internal error at {}:{}: check '{}' failed: {}", __FILE__, __LINE__, #cond, \
                 ::fmt::format(__VA_ARGS__));                                                \
  } while (0)
