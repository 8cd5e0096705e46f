// Reads the big tables of BPE tokenizer files without a JSON DOM: a tokenizer.json's model.vocab
// (128k entries for Llama 3) and model.merges (280k), or a GPT-2 vocab.json. As a DOM they would
// cost most of the start-up (a std::map node per entry, a json value per string).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace mt {

// [begin, end) of one JSON value in a text; not found when begin is npos.
struct ValueSpan {
  size_t begin = std::string::npos, end = std::string::npos;
  bool found() const { return begin != std::string::npos; }
};

size_t skip_json_ws(std::string_view s, size_t i);
// End of the JSON value starting at s[i] (brackets matched, strings skipped), or npos.
size_t skip_json_value(std::string_view s, size_t i);
// Finds the values of "model" -> "vocab" (an object) and "model" -> "merges" (an array) of a
// tokenizer.json. Leaves them not found on anything unexpected (the full parser then reports it).
void locate_model_tables(std::string_view s, ValueSpan& vocab, ValueSpan& merges);
// {"token": id, ...} -> out. False if the span holds anything else.
bool read_vocab_object(std::string_view s, ValueSpan span, std::vector<std::pair<std::string, int32_t>>& out);
// ["a b", ...] or [["a", "b"], ...] -> out. False if the span holds anything else.
bool read_merges_array(std::string_view s, ValueSpan span, std::vector<std::pair<std::string, std::string>>& out);

}  // namespace mt
