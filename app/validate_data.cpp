// Data and tokenizer rules (megatron.md sections 1.5, 3, 4): one data source, the split, and the
// dataset files themselves (.bin/.idx of every prefix, .idx header valid).
#include "app/cli_internal.h"
#include "app/data_args_files.h"
#include "data/blend_spec.h"
#include "data/idx_header.h"
#include "data/split.h"

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
    for (const char* f : {"--eod-mask-loss", "--reset-position-ids"})
      if (st.has(f))
        fail("{} needs an end-of-document token, and tokenizer {} has none known (no eos_token in "
             "tokenizer_config.json)", f, d.tokenizer_model.value_or("?"));
  }
  const std::string& type = *d.tokenizer_type;
  if (d.vocab_size && type != "NullTokenizer")
    st.warn(fmt::format("--vocab-size has no effect with --tokenizer-type {} (the vocabulary comes from its files)", type));
}

}  // namespace mt::cli
