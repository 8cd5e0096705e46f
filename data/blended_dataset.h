// BlendedDataset: samples drawn from several datasets in proportion to weights, in Megatron's
// exact order (Megatron-LM's megatron/core/datasets/blended_dataset.py, helpers.cpp
// build_blending_indices). Sample t comes from the dataset whose deficit
// w_j * max(t, 1) - drawn_j is largest (the first one on ties), as that dataset's next sample.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "data/gpt_dataset.h"
#include "data/npy.h"

namespace mt {

class BlendedDataset : public SampleDataset {
 public:
  // weights: one per dataset, > 0. With a size, they are normalised and `size` samples are drawn
  // greedily; without one (exhaustive), each weight must be a whole number and dataset j gives
  // exactly weights[j] samples. Throws mt::Error naming the dataset when the blend asks one for
  // more samples than it has (what to change: --mid-level-dataset-surplus). cache_dir: where the
  // blending indices are cached (Megatron caches them only under --data-cache-path).
  BlendedDataset(std::vector<std::shared_ptr<const SampleDataset>> datasets, std::vector<double> weights,
                 std::optional<int64_t> size, Split split, double mid_level_dataset_surplus,
                 std::optional<std::string> cache_dir = std::nullopt);

  int64_t size() const override { return dataset_index_.size(); }
  int window_length() const override { return datasets_.front()->window_length(); }
  void window(int64_t idx, int32_t* out) const override;
  void read_window(int64_t idx, int32_t* out, SampleStreams& streams) const override;
  void document_parts(int64_t idx, std::vector<int32_t>& lengths) const override;
  std::string describe() const override;
  std::string cache_key() const override { return key_; }

  const std::vector<std::shared_ptr<const SampleDataset>>& datasets() const { return datasets_; }
  const std::vector<double>& weights() const { return weights_; }
  const IndexArray& dataset_index() const { return dataset_index_; }          // int16
  const IndexArray& dataset_sample_index() const { return dataset_sample_index_; }  // int64
  bool loaded_from_cache() const { return loaded_from_cache_; }

 private:
  std::vector<std::shared_ptr<const SampleDataset>> datasets_;
  std::vector<double> weights_;
  Split split_;
  IndexArray dataset_index_;
  IndexArray dataset_sample_index_;
  bool loaded_from_cache_ = false;
  std::string key_;
};

// helpers.cpp build_blending_indices: size samples by the greedy deficit rule.
void build_blending_indices(const std::vector<double>& weights, int64_t size, std::vector<int16_t>& dataset_index,
                            std::vector<int64_t>& dataset_sample_index);
// helpers.cpp build_exhaustive_blending_indices: exactly sizes[j] samples from dataset j.
void build_exhaustive_blending_indices(const std::vector<int64_t>& sizes, std::vector<int16_t>& dataset_index,
                                       std::vector<int64_t>& dataset_sample_index);

}  // namespace mt
