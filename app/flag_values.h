// Converting flag values the way Megatron's argparse does (Python int()/float()), with one-line
// errors naming the flag.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mt::cli {

// Python int(): optional sign, decimal digits, single underscores between digits, surrounding
// whitespace. "1e6" or "1.0" fail (as in Megatron, e.g. --rotary-base 1e6).
int64_t parse_int64_arg(const std::string& flag, const std::string& value);
int parse_int_arg(const std::string& flag, const std::string& value);
// Python float(): decimal with optional exponent (".001", "6.0e-5", "1e6"), inf/infinity/nan.
double parse_float_arg(const std::string& flag, const std::string& value);
// One of `choices`, spelled exactly.
std::string parse_choice_arg(const std::string& flag, const std::string& value, const std::vector<std::string>& choices);

// Python's repr-like rendering of a double for messages/config dumps ("6e-05", "0.1", "1.0").
std::string format_float(double v);

}  // namespace mt::cli
