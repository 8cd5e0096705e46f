// Data and tokenizer rules: one data source, the split, and the
// dataset files themselves (.bin/.idx of every prefix, .idx header valid).
#include "app/cli_internal.h"
#include "app/data_args_files.h"
#include "data/blend_spec.h"
#include "data/fim.h"
#include "data/idx_header.h"
#include "data/split.h"
#include "data/tokenizer.h"

namespace mt::cli {

namespace {
void check_blend(const std::vector<std::string>& list, const std::string& flag) {
  if (list.empty()) fail("{} needs at least one dataset prefix", flag);
  const BlendSpec b = blend_from_list(list, flag);
  for (const std::string& prefix : b.prefixes) check_indexed_dataset(prefix, flag);
}

// --data-args-path / --per-split-data-args-path: their files' blends into the lists the flags
// they stand for would fill; each exclusive with those flags, as in Megatron.
void read_data_args_files(CliState& st) {
  DataConfig& d = st.cfg.data;
  if (d.data_args_path) {
    if (st.has("--data-path"))
      fail("--data-path and --data-args-path are exclusive (Megatron: only one of data_path or data_args_path should "
           "be specified): give the blend one way");
    d.data_path = read_data_args_file(*d.data_args_path);
    check_blend(d.data_path, fmt::format("--data-args-path '{}'", *d.data_args_path));
    // Megatron's legacy default split is for --data-path alone; without --split its dataset
    // config stops ("split must be provided when blend is not None").
    if (!d.split) fail("--data-args-path needs --split (e.g. --split 969,30,1): Megatron defaults it only with --data-path");
  }
  if (d.per_split_data_args_path) {
    const std::string& file = *d.per_split_data_args_path;
    if (st.has("--train-data-path") || st.has("--valid-data-path") || st.has("--test-data-path"))
      fail("--per-split-data-args-path and --train-data-path/--valid-data-path/--test-data-path are exclusive: give "
           "the per-split blends one way");
    const PerSplitBlendLists lists = read_per_split_data_args_file(file);
    std::vector<std::string>* into[3] = {&d.train_data_path, &d.valid_data_path, &d.test_data_path};
    const char* names[3] = {"train", "valid", "test"};
    bool any = false;
    for (int k = 0; k < 3; ++k) {
      if (!lists[static_cast<size_t>(k)]) continue;
      *into[k] = *lists[static_cast<size_t>(k)];
      check_blend(*into[k], fmt::format("--per-split-data-args-path '{}' \"{}\"", file, names[k]));
      any = true;
    }
    // (Megatron would train on mock data here without a word.)
    if (!any) fail("--per-split-data-args-path '{}': \"train\", \"valid\" and \"test\" are all null: no data", file);
  }
}

// --fim-data (Megatron's validate_args and what its GPTFIMDataset needs to run at all).
void validate_fim(CliState& st) {
  DataConfig& d = st.cfg.data;
  if (!d.fim_data) {
    for (const char* f : {"--fim-rate", "--fim-spm-rate", "--fim-split-sample", "--fim-fragment-rate", "--fim-no-prefix",
                          "--fim-prefix-token", "--fim-middle-token", "--fim-suffix-token", "--fim-pad-token",
                          "--fim-eod-token"})
      if (st.has(f)) st.warn(fmt::format("{} has no effect without --fim-data", f));
    if (st.has("--num-workers"))
      st.note("--num-workers has no effect in megatrain: without --fim-data one background thread per rank stages "
              "the batches");
    return;
  }
  if (d.inter_document_masking)
    throw Unsupported("megatrain does not support --dataloader-inter-document-masking with --fim-data yet (the FIM "
                      "samples' document parts are not tracked)");
  // Megatron's asserts, in its order and words.
  if (d.mock_data) fail("Mock dataset is not supported with FIM dataset.");
  if (d.fim_rate == 0) fail("--fim-rate should be specified.");
  if (d.fim_spm_rate == 0) fail("--fim-spm-rate should be specified.");
  // numpy's binomial(1, p) refuses p outside [0, 1] (and NaN) at the first sample.
  const auto rate = [](const char* flag, double p) {
    if (!(p >= 0 && p <= 1)) fail("{} must be a probability in [0, 1] (got {})", flag, format_float(p));
  };
  rate("--fim-rate", d.fim_rate);
  rate("--fim-spm-rate", d.fim_spm_rate);
  if (d.fim_fragment_rate) rate("--fim-fragment-rate", *d.fim_fragment_rate);
  if (d.fim_split_sample && !d.fim_split_sample->empty() && !d.fim_fragment_rate)
    fail("--fim-split-sample needs --fim-fragment-rate (Megatron draws each fragment's FIM with that rate and stops "
         "without one)");
  if (d.num_workers < 0) fail("--num-workers must be >= 0 (got {})", d.num_workers);
  const std::string& type = *d.tokenizer_type;
  if (type == "NullTokenizer")
    fail("--fim-data needs a tokenizer with text: NullTokenizer has no FIM tokens (Megatron stops converting "
         "'{}' to an id)", d.fim_prefix_token);
  if (type == "SentencePieceTokenizer" || type == "GPTSentencePieceTokenizer" || type == "Llama2Tokenizer")
    fail("--fim-data does not work with --tokenizer-type {}: Megatron's FIM dataset calls ids_to_text(ids, "
         "remove_special_tokens=True), which its SentencePiece tokenizer does not take", type);
  if (type != "GPT2BPETokenizer")
    throw Unsupported(fmt::format("megatrain does not support --fim-data with --tokenizer-type {} yet (supported: "
                                  "GPT2BPETokenizer)", type));
  if (!d.tokenizer_special_tokens.empty())
    throw Unsupported("megatrain does not support --tokenizer-special-tokens with --fim-data yet");
  // The FIM tokens' ids, as the dataset will look them up.
  std::vector<std::string> notes;
  fim_config(d, static_cast<uint32_t>(st.cfg.train.seed), build_tokenizer(tokenizer_options(d)), &notes);
  for (std::string& n : notes) st.note(std::move(n));
}

}  // namespace

void validate_data(CliState& st) {
  Config& c = st.cfg;
  DataConfig& d = c.data;
  read_data_args_files(st);
  const bool data_path = st.has("--data-path") || d.data_args_path;
  const bool per_split = st.has("--train-data-path") || st.has("--valid-data-path") || st.has("--test-data-path") ||
                         d.per_split_data_args_path;
  const int sources = (d.mock_data ? 1 : 0) + (data_path ? 1 : 0) + (per_split ? 1 : 0);
  if (sources > 1)
    fail("--mock-data, --data-path and --train-data-path/--valid-data-path/--test-data-path are exclusive: "
         "a single data source must be provided");
  if (sources == 0)
    fail("no training data: pass --data-path PREFIX (or --train-data-path/--valid-data-path/--test-data-path), or "
         "--mock-data");
  if (!d.data_sharding && d.dataloader_type != "cyclic")
    st.note(fmt::format("--no-data-sharding has no effect with --dataloader-type {}, as in Megatron-LM (it changes "
                        "the cyclic loader's shuffle)", d.dataloader_type));
  // NullTokenizer's pad id (Megatron-LM's build_tokenizer passes it to NullTokenizer alone) and
  // MegatronDataset's rule for a pad id that equals a special token.
  if (d.tokenizer_type.value_or("") != "NullTokenizer") {
    if (st.has("--null-tokenizer-pad-id"))
      st.note("--null-tokenizer-pad-id has no effect without --tokenizer-type NullTokenizer, as in Megatron-LM");
  } else if (d.null_tokenizer_pad_id == d.eod_id) {
    st.warn(d.allow_ambiguous_pad_tokens
                ? fmt::format("--null-tokenizer-pad-id {} is also the EOD id: with --allow-ambiguous-pad-tokens every "
                              "EOD label leaves the loss",
                              d.null_tokenizer_pad_id)
                : fmt::format("--null-tokenizer-pad-id {} is also the EOD id: no pad tokens are masked (Megatron-LM's "
                              "rule; --allow-ambiguous-pad-tokens keeps them)",
                              d.null_tokenizer_pad_id));
  }
  if (per_split && d.split)
    st.warn("--split has no effect with --train-data-path/--valid-data-path/--test-data-path (each split has its own "
            "blend)");
  if (d.split) {
    const auto w = parse_split(*d.split);
    d.split_weights.assign(w.begin(), w.end());
  }
  if (st.has("--data-path")) check_blend(d.data_path, "--data-path");
  if (st.has("--train-data-path")) check_blend(d.train_data_path, "--train-data-path");
  if (st.has("--valid-data-path")) check_blend(d.valid_data_path, "--valid-data-path");
  if (st.has("--test-data-path")) check_blend(d.test_data_path, "--test-data-path");
  if (d.num_dataset_builder_threads <= 0)
    fail("--num-dataset-builder-threads must be > 0 (got {})", d.num_dataset_builder_threads);
  if (d.mid_level_dataset_surplus < 0)
    fail("--mid-level-dataset-surplus must be >= 0 (got {})", format_float(d.mid_level_dataset_surplus));
  if (d.eod_id < 0) {
    for (const char* f : {"--eod-mask-loss", "--reset-position-ids", "--reset-attention-mask"})
      if (st.has(f))
        fail("{} needs an end-of-document token, and tokenizer {} has none known (no eos_token in "
             "tokenizer_config.json)", f, d.tokenizer_model.value_or("?"));
  }
  validate_fim(st);
  const std::string& type = *d.tokenizer_type;
  if (d.vocab_size && type != "NullTokenizer")
    st.warn(fmt::format("--vocab-size has no effect with --tokenizer-type {} (the vocabulary comes from its files)", type));
}

}  // namespace mt::cli
