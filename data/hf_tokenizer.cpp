// HuggingFaceTokenizer and GPT2BPETokenizer: runs an HfModel (data/hf_model.h) on text, as
// tokenizers' TokenizerImpl::encode does: added tokens matched first, then each remaining piece
// normalized, pre-tokenized and BPE-encoded, then the post-processor's special tokens around it.
#include <fmt/format.h>

#include <algorithm>
#include <cstdio>

#include "core/error.h"
#include "data/byte_level.h"
#include "data/hf_model.h"
#include "data/tokenizer.h"
#include "data/utf8.h"

namespace mt {
namespace {

class HfTokenizer final : public Tokenizer {
 public:
  HfTokenizer(std::shared_ptr<const HfModel> m, bool include_special) : m_(std::move(m)), include_special_(include_special) {}

  void encode(std::string_view text, std::vector<int32_t>& out) override {
    if (include_special_) out.insert(out.end(), m_->prefix_ids.begin(), m_->prefix_ids.end());
    std::vector<AddedTokenMatcher::Piece> pieces;
    m_->raw_matcher.split(text, pieces);
    for (const auto& p : pieces) {
      if (p.id >= 0) out.push_back(p.id);
      else encode_plain(text.substr(p.begin, p.end - p.begin), p.begin == 0, out);
    }
    if (include_special_) out.insert(out.end(), m_->suffix_ids.begin(), m_->suffix_ids.end());
  }

  std::string decode(const std::vector<int32_t>& ids) const override {
    std::vector<std::string> tokens;
    tokens.reserve(ids.size());
    for (int32_t id : ids) {
      if (id < 0 || id >= static_cast<int32_t>(m_->id_to_token.size()))
        fail("{}: token id {} is outside the vocabulary", m_->name, id);
      tokens.push_back(m_->id_to_token[id]);
    }
    return decode_tokens(std::move(tokens));
  }

  std::optional<int32_t> convert_token_to_id(std::string_view token, bool* unknown = nullptr) const override {
    require_special_tokens();
    if (unknown) *unknown = false;
    for (const AddedToken& t : m_->added)
      if (t.content == token) return t.id;
    const int32_t id = m_->bpe->token_to_id(token);
    if (id >= 0) return id;
    if (unknown) *unknown = true;
    if (m_->unk >= 0) return m_->unk;
    return std::nullopt;
  }

  std::string decode_skip_special(std::span<const int32_t> ids) const override {
    const std::vector<std::string>& special = require_special_tokens();
    std::vector<std::string> tokens;
    tokens.reserve(ids.size());
    for (int32_t id : ids) {
      if (id < 0 || id >= static_cast<int32_t>(m_->id_to_token.size())) continue;
      const std::string& t = m_->id_to_token[id];
      if (t.empty() || std::find(special.begin(), special.end(), t) != special.end()) continue;
      tokens.push_back(t);
    }
    return decode_tokens(std::move(tokens));
  }

  int64_t vocab_size() const override { return m_->vocab_size; }
  int32_t eod() const override {
    if (m_->eod < 0) fail("{} '{}' has no end-of-document token: {}", m_->name, m_->source, m_->eod_missing_reason);
    return m_->eod;
  }
  std::string name() const override { return m_->name; }
  std::unique_ptr<Tokenizer> clone() const override { return std::make_unique<HfTokenizer>(m_, include_special_); }

 private:
  void encode_plain(std::string_view segment, bool at_start, std::vector<int32_t>& out) {
    if (m_->normalizers.empty()) return pre_tokenize(0, segment, at_start, out);
    std::string normalized = normalize(segment);
    if (m_->normalized_matcher.empty()) return pre_tokenize(0, normalized, at_start, out);
    std::vector<AddedTokenMatcher::Piece> pieces;
    m_->normalized_matcher.split(normalized, pieces);
    for (const auto& p : pieces) {
      if (p.id >= 0) out.push_back(p.id);
      else pre_tokenize(0, std::string_view(normalized).substr(p.begin, p.end - p.begin), at_start && p.begin == 0, out);
    }
  }

  std::string normalize(std::string_view text) const {
    std::string s(text);
    for (const NormalizerStep& n : m_->normalizers) {
      if (n.kind == NormalizerStep::prepend) {
        if (!s.empty()) s.insert(0, n.a);
      } else if (!n.a.empty()) {
        std::string r;
        size_t pos = 0;
        while (true) {
          const size_t hit = s.find(n.a, pos);
          if (hit == std::string::npos) break;
          r.append(s, pos, hit - pos);
          r += n.b;
          pos = hit + n.a.size();
        }
        r.append(s, pos, std::string::npos);
        s = std::move(r);
      }
    }
    return s;
  }

  // Runs pre-tokenizer step k (and the following ones) on piece, then the model on each word.
  void pre_tokenize(size_t k, std::string_view piece, bool at_start, std::vector<int32_t>& out) {
    if (piece.empty()) return;
    if (k == m_->pre_tokenizers.size()) return m_->bpe->encode_word(piece, out, cache_);
    const PreTokenizerStep& step = m_->pre_tokenizers[k];
    switch (step.kind) {
      case PreTokenizerStep::split:
        split_text(step.pattern, piece, [&](std::string_view w) { pre_tokenize(k + 1, w, at_start && w.data() == piece.data(), out); });
        return;
      case PreTokenizerStep::byte_level: {
        std::string prefixed;
        if (step.add_prefix_space && piece[0] != ' ') {
          prefixed = " ";
          prefixed += piece;
          piece = prefixed;
        }
        if (step.use_regex) split_text(SplitPattern::gpt2, piece, [&](std::string_view w) { pre_tokenize(k + 1, w, false, out); });
        else pre_tokenize(k + 1, piece, false, out);
        return;
      }
      case PreTokenizerStep::metaspace: {
        std::string s;
        for (char c : piece) {
          if (c == ' ') s += step.replacement;
          else s += c;
        }
        const bool starts = s.compare(0, step.replacement.size(), step.replacement) == 0;
        if (!starts && (step.scheme == PreTokenizerStep::always || (step.scheme == PreTokenizerStep::first && at_start)))
          s.insert(0, step.replacement);
        if (!step.split_on_replacement) return pre_tokenize(k + 1, s, false, out);
        // MergedWithNext: every replacement character starts a new piece.
        size_t begin = 0;
        size_t pos = s.find(step.replacement, 1);
        while (pos != std::string::npos) {
          pre_tokenize(k + 1, std::string_view(s).substr(begin, pos - begin), false, out);
          begin = pos;
          pos = s.find(step.replacement, pos + step.replacement.size());
        }
        pre_tokenize(k + 1, std::string_view(s).substr(begin), false, out);
        return;
      }
    }
  }

  const std::vector<std::string>& require_special_tokens() const {
    if (!m_->all_special_tokens)
      throw Unsupported(fmt::format("{} '{}': megatrain does not know this tokenizer's special tokens (needed by "
                                    "--fim-data)", m_->name, m_->source));
    return *m_->all_special_tokens;
  }

  std::string decode_tokens(std::vector<std::string> tokens) const {
    for (const DecoderStep& d : m_->decoders) tokens = apply_decoder(d, std::move(tokens));
    std::string text;
    for (const std::string& t : tokens) text += t;
    return text;
  }

  static std::vector<std::string> apply_decoder(const DecoderStep& d, std::vector<std::string> tokens) {
    switch (d.kind) {
      case DecoderStep::byte_level: {
        std::string bytes;
        for (const std::string& t : tokens) {
          if (auto b = byte_level::decode_token(t)) bytes += *b;
          else bytes += t;
        }
        return {utf8::from_bytes_lossy(bytes)};
      }
      case DecoderStep::replace:
        for (std::string& t : tokens) {
          std::string r;
          size_t pos = 0, hit;
          while (!d.a.empty() && (hit = t.find(d.a, pos)) != std::string::npos) {
            r.append(t, pos, hit - pos);
            r += d.b;
            pos = hit + d.a.size();
          }
          r.append(t, pos, std::string::npos);
          t = std::move(r);
        }
        return tokens;
      case DecoderStep::byte_fallback: {
        std::vector<std::string> out;
        std::string bytes;
        size_t count = 0;
        auto flush = [&] {
          if (count == 0) return;
          if (utf8::is_valid(bytes)) out.push_back(bytes);
          else for (size_t i = 0; i < count; ++i) out.emplace_back("\xEF\xBF\xBD");
          bytes.clear();
          count = 0;
        };
        for (std::string& t : tokens) {
          unsigned value = 0;
          if (t.size() == 6 && t.compare(0, 3, "<0x") == 0 && t[5] == '>' &&
              std::sscanf(t.c_str() + 3, "%2X", &value) == 1 && std::isxdigit(static_cast<unsigned char>(t[3])) &&
              std::isxdigit(static_cast<unsigned char>(t[4]))) {
            bytes += static_cast<char>(value);
            ++count;
          } else {
            flush();
            out.push_back(std::move(t));
          }
        }
        flush();
        return out;
      }
      case DecoderStep::fuse: {
        std::string all;
        for (const std::string& t : tokens) all += t;
        return {all};
      }
      case DecoderStep::strip:
        for (std::string& t : tokens) {
          size_t b = 0, e = t.size();
          for (size_t i = 0; i < d.start && b + d.a.size() <= e && t.compare(b, d.a.size(), d.a) == 0; ++i) b += d.a.size();
          for (size_t i = 0; i < d.stop && e >= b + d.a.size() && t.compare(e - d.a.size(), d.a.size(), d.a) == 0; ++i) e -= d.a.size();
          t = t.substr(b, e - b);
        }
        return tokens;
      case DecoderStep::metaspace:
        for (size_t i = 0; i < tokens.size(); ++i) {
          std::string r;
          size_t pos = 0, hit;
          while ((hit = tokens[i].find(d.a, pos)) != std::string::npos) {
            r.append(tokens[i], pos, hit - pos);
            r += ' ';
            pos = hit + d.a.size();
          }
          r.append(tokens[i], pos, std::string::npos);
          if (i == 0 && d.prepend && !r.empty() && r[0] == ' ') r.erase(0, 1);
          tokens[i] = std::move(r);
        }
        return tokens;
    }
    return tokens;
  }

  std::shared_ptr<const HfModel> m_;
  bool include_special_;
  BpeWordCache cache_;
};

}  // namespace

std::unique_ptr<Tokenizer> make_gpt2_bpe_tokenizer(const std::string& vocab_file, const std::string& merge_file) {
  return std::make_unique<HfTokenizer>(load_gpt2_files(vocab_file, merge_file), true);
}

std::unique_ptr<Tokenizer> make_huggingface_tokenizer(const std::string& tokenizer_model, bool include_special_tokens) {
  return std::make_unique<HfTokenizer>(load_tokenizer_json(tokenizer_model), include_special_tokens);
}

}  // namespace mt
