// SentencePieceTokenizer / GPTSentencePieceTokenizer / Llama2Tokenizer through libsentencepiece.
// Megatron HEAD maps all three to megatron/core/tokenizers/text/libraries/sentencepiece_tokenizer.py
// with its defaults (legacy=False, ignore_extra_whitespaces=True, no special tokens):
// tokenize(text) = encode_as_ids(text), no BOS/EOS; vocab_size = get_piece_size(); eod = eos_id().
#include <sentencepiece_processor.h>

#include <filesystem>

#include "core/error.h"
#include "data/tokenizer.h"

namespace mt {
namespace {

class SentencePieceTokenizer final : public Tokenizer {
 public:
  SentencePieceTokenizer(std::shared_ptr<const sentencepiece::SentencePieceProcessor> sp, std::string path, std::string type)
      : sp_(std::move(sp)), path_(std::move(path)), type_(std::move(type)) {}

  void encode(std::string_view text, std::vector<int32_t>& out) override {
    std::vector<int> ids;
    const auto status = sp_->Encode(text, &ids);
    if (!status.ok()) fail("{} '{}': encoding failed: {}", type_, path_, status.ToString());
    out.insert(out.end(), ids.begin(), ids.end());
  }
  std::string decode(const std::vector<int32_t>& ids) const override {
    std::vector<int> v(ids.begin(), ids.end());
    for (int id : v)
      if (id < 0 || id >= sp_->GetPieceSize()) fail("{}: token id {} is outside the vocabulary", type_, id);
    std::string text;
    const auto status = sp_->Decode(v, &text);
    if (!status.ok()) fail("{} '{}': decoding failed: {}", type_, path_, status.ToString());
    return text;
  }
  int64_t vocab_size() const override { return sp_->GetPieceSize(); }
  int32_t eod() const override {
    const int eos = sp_->eos_id();
    if (eos < 0) fail("{} '{}' has no end-of-sentence piece (eos_id is -1), so it has no eod", type_, path_);
    return eos;
  }
  std::string name() const override { return type_; }
  std::unique_ptr<Tokenizer> clone() const override { return std::make_unique<SentencePieceTokenizer>(sp_, path_, type_); }

 private:
  std::shared_ptr<const sentencepiece::SentencePieceProcessor> sp_;  // Encode/Decode are const
  std::string path_, type_;
};

}  // namespace

std::unique_ptr<Tokenizer> make_sentencepiece_tokenizer(const std::string& model_file, const std::string& type_name) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(model_file, ec))
    fail("--tokenizer-model '{}': no such file ({} needs a SentencePiece .model file)", model_file, type_name);
  auto sp = std::make_shared<sentencepiece::SentencePieceProcessor>();
  const auto status = sp->Load(model_file);
  if (!status.ok()) fail("--tokenizer-model '{}' is not a SentencePiece model: {}", model_file, status.ToString());
  return std::make_unique<SentencePieceTokenizer>(std::move(sp), model_file, type_name);
}

}  // namespace mt
