// Added (special) tokens of a Hugging Face tokenizer: found in the text before the model runs,
// leftmost first and longest among those starting at one position (the aho-corasick
// LeftmostLongest search of tokenizers' added_vocabulary.rs), with lstrip/rstrip whitespace
// absorption.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace mt {

struct AddedToken {
  std::string content;
  int32_t id = 0;
  bool special = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = false;
};

class AddedTokenMatcher {
 public:
  AddedTokenMatcher() = default;
  explicit AddedTokenMatcher(const std::vector<AddedToken>& tokens);
  bool empty() const { return tokens_.empty(); }

  struct Piece {
    size_t begin, end;
    int32_t id;  // -1: plain text between added tokens
  };
  // Splits text into plain pieces and added tokens (appended to out, in order; empty plain
  // pieces are not emitted).
  void split(std::string_view text, std::vector<Piece>& out) const;

 private:
  struct Node {
    int32_t token = -1;  // index into tokens_ if a token ends here
    std::vector<std::pair<unsigned char, int32_t>> children;
  };
  int32_t child(int32_t node, unsigned char b) const;
  std::vector<AddedToken> tokens_;
  std::vector<Node> nodes_;
  bool first_byte_[256] = {};
};

}  // namespace mt
