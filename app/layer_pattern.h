// Megatron's structured flag values: tuple_type ("4095,0" or "(4095,0)") and the per-layer
// frequencies of moe_freq_type ("4", or a Python list expression such as "([1]*3+[0])*6"), read
// without a Python interpreter.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace mt::cli {

// tuple(int(i) for i in text.strip('()').split(',')), with errors naming the flag.
std::vector<int> parse_int_tuple(const std::string& flag, const std::string& text);

// An integer N, or a list with one entry per layer.
struct LayerFrequency {
  std::optional<int> every;
  std::vector<int> pattern;
};

// moe_freq_type: text with a '[' is a list expression of integer lists, '+' (concatenation),
// '*' with an integer (repetition) and parentheses; anything else is int(text).
LayerFrequency parse_layer_frequency(const std::string& flag, const std::string& text);

// A list expression alone (ints, '+', '*' with an integer, parentheses), its integers as written:
// "([1]*3+[0])*2" -> {1,1,1,0,1,1,1,0}. Errors name the flag.
std::vector<int> parse_int_list_expression(const std::string& flag, const std::string& text);

// The value as it could be given again ("4" or "[1,1,0]"), for checkpoints' recorded flags.
std::string layer_frequency_text(const LayerFrequency& f);

}  // namespace mt::cli
