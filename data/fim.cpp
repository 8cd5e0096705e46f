#include "data/fim.h"

#include <fmt/format.h>

#include <algorithm>

#include "core/config.h"
#include "core/error.h"
#include "data/tokenizer.h"
#include "data/utf8.h"

namespace mt {

namespace {

void append(std::vector<int32_t>& out, std::span<const int32_t> part) { out.insert(out.end(), part.begin(), part.end()); }

}  // namespace

std::string FimConfig::describe() const {
  std::string s = fmt::format("FIM rate {:g}, SPM rate {:g}", spec.rate, spec.spm_rate);
  if (spec.split_sample) s += fmt::format(", split on id {} (fragment rate {:g})", *spec.split_sample, spec.fragment_rate.value_or(0));
  if (spec.no_prefix) s += fmt::format(", none after prefix '{}'", *spec.no_prefix);
  s += fmt::format(", ids prefix {} middle {} suffix {} pad {} eod {}", spec.prefix, spec.middle, spec.suffix, spec.pad, spec.eod);
  return s;
}

std::shared_ptr<const FimConfig> fim_config(const DataConfig& d, uint32_t seed, std::shared_ptr<const Tokenizer> tokenizer,
                                            std::vector<std::string>* notes) {
  MT_CHECK(tokenizer != nullptr, "no tokenizer for --fim-data");
  auto c = std::make_shared<FimConfig>();
  c->seed = seed;
  c->tokenizer = tokenizer;
  FimSpec& s = c->spec;
  s.rate = d.fim_rate;
  s.spm_rate = d.fim_spm_rate;
  s.fragment_rate = d.fim_fragment_rate;
  s.no_prefix = d.fim_no_prefix;
  const auto lookup = [&](const char* flag, const std::string& token) {
    bool unknown = false;
    const std::optional<int32_t> id = tokenizer->convert_token_to_id(token, &unknown);
    if (!id)
      fail("{} '{}' is not in the {} vocabulary, which has no unknown token to stand for it (Megatron's FIM dataset "
           "would get None)", flag, token, tokenizer->name());
    if (unknown && notes)
      notes->push_back(fmt::format("{} '{}' is not in the {} vocabulary: as in Megatron, it is the unknown token (id {})",
                                   flag, token, tokenizer->name(), *id));
    return *id;
  };
  s.prefix = lookup("--fim-prefix-token", d.fim_prefix_token);
  s.middle = lookup("--fim-middle-token", d.fim_middle_token);
  s.suffix = lookup("--fim-suffix-token", d.fim_suffix_token);
  s.pad = lookup("--fim-pad-token", d.fim_pad_token);
  s.eod = lookup("--fim-eod-token", d.fim_eod_token);
  // `if fim_split_sample:`: an empty string splits nothing.
  if (d.fim_split_sample && !d.fim_split_sample->empty()) s.split_sample = lookup("--fim-split-sample", *d.fim_split_sample);
  return c;
}

FimTransform::FimTransform(const FimSpec& spec, std::unique_ptr<Tokenizer> tokenizer)
    : spec_(spec), tokenizer_(std::move(tokenizer)) {
  MT_CHECK(tokenizer_ != nullptr, "no tokenizer for the FIM transform");
}

FimTransform::~FimTransform() = default;
FimTransform::FimTransform(FimTransform&&) noexcept = default;
FimTransform& FimTransform::operator=(FimTransform&&) noexcept = default;

void FimTransform::apply(std::span<int32_t> sample, numpy_random::RandomState& rng) {
  result_.clear();
  const std::span<const int32_t> in(sample.data(), sample.size());
  size_t start = 0;
  bool any_eod = false;
  for (size_t i = 0; i < in.size(); ++i) {
    if (in[i] != spec_.eod) continue;
    any_eod = true;
    // Only non-empty segments are permuted, and only they keep their EOD.
    if (i > start) {
      split_and_permute(in.subspan(start, i - start), rng, result_);
      result_.push_back(spec_.eod);
    }
    start = i + 1;
  }
  // Without an EOD this is the whole sample; else the (possibly empty) part after the last one.
  split_and_permute(any_eod ? in.subspan(start) : in, rng, result_);
  result_.resize(sample.size(), spec_.pad);  // cut, or pad with the FIM pad token
  std::copy(result_.begin(), result_.end(), sample.begin());
}

void FimTransform::split_and_permute(std::span<const int32_t> segment, numpy_random::RandomState& rng,
                                     std::vector<int32_t>& out) {
  if (!spec_.split_sample || std::find(segment.begin(), segment.end(), *spec_.split_sample) == segment.end())
    return permute(segment, spec_.rate, rng, out);
  if (!rng.binomial(1, spec_.rate)) return append(out, segment);
  if (!spec_.fragment_rate) fail("--fim-split-sample needs --fim-fragment-rate");
  const int32_t split = *spec_.split_sample;
  size_t start = 0;
  for (size_t i = 0; i < segment.size(); ++i) {
    if (segment[i] != split) continue;
    if (i > start) {
      permute(segment.subspan(start, i - start), *spec_.fragment_rate, rng, out);
      out.push_back(split);
    }
    start = i + 1;
  }
  permute(segment.subspan(start), *spec_.fragment_rate, rng, out);
}

void FimTransform::permute(std::span<const int32_t> segment, double rate, numpy_random::RandomState& rng,
                           std::vector<int32_t>& out) {
  if (!rng.binomial(1, rate)) return append(out, segment);
  const std::string text = tokenizer_->decode_skip_special(segment);
  if (spec_.no_prefix && text.starts_with(*spec_.no_prefix)) return append(out, segment);
  // Cut points count characters (Python str indices): the byte offset of each code point.
  std::vector<size_t> offsets;
  offsets.reserve(text.size() + 1);
  for (size_t i = 0; i < text.size(); i += utf8::sequence_length(static_cast<unsigned char>(text[i]))) offsets.push_back(i);
  const uint64_t chars = offsets.size();
  offsets.push_back(text.size());
  // randint(low=0, high=chars + 1, size=2), then sorted.
  uint64_t a = rng.random_interval(chars), b = rng.random_interval(chars);
  if (b < a) std::swap(a, b);
  const std::string_view all(text);
  prefix_.clear();
  middle_.clear();
  suffix_.clear();
  tokenizer_->encode(all.substr(0, offsets[a]), prefix_);
  tokenizer_->encode(all.substr(offsets[a], offsets[b] - offsets[a]), middle_);
  tokenizer_->encode(all.substr(offsets[b]), suffix_);
  if (rng.binomial(1, spec_.spm_rate)) {  // SPM
    out.push_back(spec_.prefix);
    out.push_back(spec_.suffix);
    append(out, suffix_);
    out.push_back(spec_.middle);
    append(out, prefix_);
    append(out, middle_);
  } else {  // PSM
    out.push_back(spec_.prefix);
    append(out, prefix_);
    out.push_back(spec_.suffix);
    append(out, suffix_);
    out.push_back(spec_.middle);
    append(out, middle_);
  }
}

struct SampleStreams::Stream {
  const void* owner;
  numpy_random::RandomState rng;
  FimTransform transform;
};

SampleStreams::SampleStreams() = default;
SampleStreams::~SampleStreams() = default;
SampleStreams::SampleStreams(SampleStreams&&) noexcept = default;
SampleStreams& SampleStreams::operator=(SampleStreams&&) noexcept = default;

void SampleStreams::fim(const void* owner, const FimConfig& config, std::span<int32_t> sample) {
  Stream* s = nullptr;
  for (auto& p : streams_)
    if (p->owner == owner) s = p.get();
  if (!s) {
    streams_.push_back(std::unique_ptr<Stream>(
        new Stream{owner, numpy_random::RandomState(config.seed), FimTransform(config.spec, config.tokenizer->clone())}));
    s = streams_.back().get();
  }
  s->transform.apply(sample, s->rng);
}

}  // namespace mt
