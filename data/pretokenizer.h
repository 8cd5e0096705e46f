// Pre-tokenization: the regex splits that byte-level BPE tokenizers apply before BPE, as hand
// written matchers (no regex engine). Each reproduces, match for match, Oniguruma's leftmost-first
// backtracking semantics for one pattern, with \p{L}, \p{N}, \s from data/unicode_classes.h.
//   gpt2:   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//   cl100k: (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|
//           \s*[\r\n]+|\s+(?!\S)|\s+            (Llama 3; tiktoken's cl100k_base)
//   qwen2:  the cl100k pattern with \p{N} instead of \p{N}{1,3}
// Every position of a text starts a non-empty match of these patterns, so a split is the chain of
// matches from position 0.
#pragma once

#include <cstddef>
#include <optional>
#include <string_view>

namespace mt {

enum class SplitPattern { gpt2, cl100k, qwen2 };

// The pattern a tokenizer.json regex string is, or nullopt for a pattern megatrain does not know.
std::optional<SplitPattern> recognize_split_pattern(std::string_view regex);
const char* split_pattern_regex(SplitPattern p);

// End (byte offset) of the match of pattern p that starts at byte i < text.size() of valid UTF-8.
size_t split_match_end(SplitPattern p, std::string_view text, size_t i);

// Calls emit(piece) for each consecutive piece of text.
template <typename Emit>
void split_text(SplitPattern p, std::string_view text, Emit&& emit) {
  size_t i = 0;
  while (i < text.size()) {
    const size_t end = split_match_end(p, text, i);
    emit(text.substr(i, end - i));
    i = end;
  }
}

}  // namespace mt
