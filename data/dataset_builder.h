// Building the train/valid/test datasets from the data flags, as Megatron's
// BlendedMegatronDatasetBuilder does (Megatron-LM's
// megatron/core/datasets/blended_megatron_dataset_builder.py):
//   --mock-data                 MockGPTDataset per split (split 1,1,1, whatever --split says);
//   --data-path P               one GPTDataset per split of P (split by --split);
//   --data-path w1 P1 w2 P2 ... per split, a BlendedDataset over one GPTDataset per prefix, each
//                               asked for ceil(ceil(N * w) * (1 + surplus)) samples, the blend
//                               holding sum_j ceil(N * w_j) samples; without weights, each prefix
//                               gives one epoch and the blend min(N, their total) (or all of them);
//   --train-data-path etc.      the same per split, each blend over whole datasets (no --split).
#pragma once

#include <array>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "data/gpt_dataset.h"
#include "data/split.h"

namespace mt {

struct Config;

// A --data-path style list (get_blend_from_list): an odd count, or any weight that is not a
// number, means prefixes only; otherwise (weight, prefix) pairs.
struct Blend {
  std::vector<std::string> prefixes;
  std::optional<std::vector<double>> weights;
};
// Throws mt::Error naming `flag` for a non-positive or non-finite weight or an empty prefix.
std::optional<Blend> parse_blend(const std::vector<std::string>& items, const char* flag);

// What the datasets need to know about the tokenizer.
struct TokenizerFacts {
  int64_t vocab_size = 0;  // before padding (the mock data's token range)
  int64_t eod = -1;
  int64_t pad = -1;        // Megatron's tokenizer.pad, -1 when the tokenizer has none
};

struct DatasetsConfig {
  std::optional<Blend> blend;                           // --data-path
  std::array<std::optional<Blend>, 3> blend_per_split;  // --train/valid/test-data-path
  bool mock = false;                                    // --mock-data
  std::string split = "969, 30, 1";                     // --split (with --data-path)
  int seq_length = 0;
  uint32_t seed = 1234;
  TokenizerFacts tokenizer;
  std::optional<std::string> data_cache_path;  // unset: <prefix>/cache/GPTDataset_indices (mock: none)
  bool mmap_bin_files = true;
  double mid_level_dataset_surplus = 0.005;
  int num_dataset_builder_threads = 1;
  std::optional<int64_t> token_limit;  // the padded vocabulary: token ids must be below it
  bool full_data_check = false;        // --full-data-check: scan every token at start-up
  std::shared_ptr<const FimConfig> fim;  // --fim-data: every GPTDataset makes FIM samples
};

// The tokenizer facts the CLI derived (ModelConfig::vocab_size, DataConfig::eod_id; no pad id:
// megatrain's tokenizers define none, so Megatron's -1 applies).
TokenizerFacts tokenizer_facts(const Config& config);

// The data settings of a run (flags and derived values) plus the tokenizer's facts. With --fim-data
// it builds the tokenizer and looks the FIM tokens up (data/fim.h).
DatasetsConfig datasets_config(const Config& config, const TokenizerFacts& tokenizer);

// Megatron's get_train_valid_test_num_samples: train = train_samples or train_iters x B;
// valid = (train_iters // eval_interval + 1 - start_eval_at_iter // eval_interval) x eval_iters x B
// (TrainConfig::evaluations; eval_iters x B with --skip-train; HEAD fails when --eval-interval is
// unset, megatrain counts the one final evaluation then);
// test = eval_iters x B; B of valid and test is --eval-global-batch-size when given.
std::array<int64_t, 3> samples_per_split(const Config& config);

// Facts about what was built, for logs and inspect-data.
struct BuiltDatasets {
  std::array<std::shared_ptr<const SampleDataset>, 3> splits;  // null where a split is not built
  std::vector<std::shared_ptr<const GPTDataset>> components;   // every GPTDataset built
};

BuiltDatasets build_datasets(const DatasetsConfig& config, const std::array<std::optional<int64_t>, 3>& sizes);

// A run's datasets: datasets_config(config, tokenizer_facts(config)) sized by samples_per_split.
BuiltDatasets build_datasets_for_run(const Config& config);

// Every GPTDataset reachable from a dataset (itself, or a blend's components).
std::vector<const GPTDataset*> gpt_components(const SampleDataset& dataset);

}  // namespace mt
