#include "data/blended_dataset.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/log.h"
#include "data/hash.h"

namespace mt {

void build_blending_indices(const std::vector<double>& weights, int64_t size, std::vector<int16_t>& dataset_index,
                            std::vector<int64_t>& dataset_sample_index) {
  const size_t n = weights.size();
  dataset_index.resize(static_cast<size_t>(size));
  dataset_sample_index.resize(static_cast<size_t>(size));
  std::vector<int64_t> drawn(n, 0);
  for (int64_t t = 0; t < size; ++t) {
    const double x = std::max(static_cast<double>(t), 1.0);
    size_t best = 0;
    double best_error = weights[0] * x - static_cast<double>(drawn[0]);
    for (size_t j = 1; j < n; ++j) {
      const double error = weights[j] * x - static_cast<double>(drawn[j]);
      if (error > best_error) {
        best_error = error;
        best = j;
      }
    }
    dataset_index[static_cast<size_t>(t)] = static_cast<int16_t>(best);
    dataset_sample_index[static_cast<size_t>(t)] = drawn[best]++;
  }
}

void build_exhaustive_blending_indices(const std::vector<int64_t>& sizes, std::vector<int16_t>& dataset_index,
                                       std::vector<int64_t>& dataset_sample_index) {
  const size_t n = sizes.size();
  int64_t total = 0;
  std::set<size_t> unspent;
  for (size_t j = 0; j < n; ++j) {
    total += sizes[j];
    unspent.insert(j);
  }
  std::vector<double> weights(n);
  for (size_t j = 0; j < n; ++j) weights[j] = static_cast<double>(sizes[j]) / static_cast<double>(total);
  dataset_index.resize(static_cast<size_t>(total));
  dataset_sample_index.resize(static_cast<size_t>(total));
  std::vector<int64_t> drawn(n, 0);
  int64_t t = 0;
  while (!unspent.empty()) {
    const double x = std::max(static_cast<double>(t), 1.0);
    int64_t best = -1;
    double best_error = std::numeric_limits<double>::lowest();
    for (size_t j : unspent) {
      const double error = weights[j] * x - static_cast<double>(drawn[j]);
      if (error > best_error) {
        best = static_cast<int64_t>(j);
        best_error = error;
      }
    }
    MT_CHECK(best >= 0 && t < total, "exhaustive blending at sample {}", t);
    dataset_index[static_cast<size_t>(t)] = static_cast<int16_t>(best);
    dataset_sample_index[static_cast<size_t>(t)] = drawn[static_cast<size_t>(best)]++;
    if (static_cast<double>(sizes[static_cast<size_t>(best)]) - static_cast<double>(drawn[static_cast<size_t>(best)]) == 0) {
      unspent.erase(static_cast<size_t>(best));
    }
    ++t;
  }
}

BlendedDataset::BlendedDataset(std::vector<std::shared_ptr<const SampleDataset>> datasets, std::vector<double> weights,
                               std::optional<int64_t> size, Split split, double mid_level_dataset_surplus,
                               std::optional<std::string> cache_dir)
    : datasets_(std::move(datasets)), weights_(std::move(weights)), split_(split) {
  MT_CHECK(!datasets_.empty() && datasets_.size() == weights_.size(), "{} datasets, {} weights", datasets_.size(),
           weights_.size());
  if (datasets_.size() >= 32767) fail("a blend of {} datasets is too many (at most 32766)", datasets_.size());
  for (size_t j = 0; j < datasets_.size(); ++j) {
    if (!(weights_[j] > 0) || !std::isfinite(weights_[j])) {
      fail("the {} blend gives {} the weight {}: every weight must be positive (drop the dataset or raise its weight)",
           split_name(split_), datasets_[j]->describe(), weights_[j]);
    }
    if (datasets_[j]->window_length() != datasets_.front()->window_length()) {
      fail("the {} blend mixes window lengths {} and {}", split_name(split_), datasets_.front()->window_length(),
           datasets_[j]->window_length());
    }
  }
  if (size) {
    weights_ = numpy_random::normalize(weights_);
  } else {
    for (double w : weights_) {
      if (w != std::floor(w)) fail("an exhaustive {} blend needs whole-number sizes, got {}", split_name(split_), w);
    }
  }

  nlohmann::ordered_json key;
  key["class"] = "BlendedDataset";
  key["format"] = 1;
  auto& parts = key["datasets"] = nlohmann::ordered_json::array();
  for (const auto& d : datasets_) parts.push_back(d->cache_key());
  key["split"] = split_name(split_);
  key["weights"] = weights_;
  key["size"] = size ? nlohmann::ordered_json(*size) : nlohmann::ordered_json(nullptr);
  key_ = key.dump();

  std::string cache_prefix;
  if (cache_dir) {
    cache_prefix = fmt::format("{}/{}-BlendedDataset-{}-", *cache_dir, hash_hex(key_), split_name(split_));
    std::ifstream description(cache_prefix + "description.txt");
    std::string first_line;
    if (description && std::getline(description, first_line) && first_line == key_) {
      IndexArray index = IndexArray::map_npy(cache_prefix + "dataset_index.npy");
      IndexArray sample = IndexArray::map_npy(cache_prefix + "dataset_sample_index.npy");
      // window() trusts the arrays: every dataset id must name a component and every sample id lie
      // within that component's samples. The length is what the build makes: `size`, or without one
      // (exhaustive) the sum of the whole-number weights.
      int64_t expected_size = 0;
      if (size) {
        expected_size = *size;
      } else {
        for (double w : weights_) expected_size += static_cast<int64_t>(w);
      }
      std::string damage;
      if (!index.valid() || index.type() != IndexType::i16 || index.cols() != 1 || index.size() != expected_size) {
        damage = cache_prefix + "dataset_index.npy: missing, not int16, or of the wrong length";
      } else if (!sample.valid() || sample.type() != IndexType::i64 || sample.cols() != 1 ||
                 sample.size() != index.size()) {
        damage = cache_prefix + "dataset_sample_index.npy: missing, not int64, or of the wrong length";
      } else {
        const int64_t n = static_cast<int64_t>(datasets_.size());
        for (int64_t i = 0; i < index.size() && damage.empty(); ++i) {
          const int64_t j = index[i], k = sample[i];
          if (j < 0 || j >= n) {
            damage = fmt::format("{}dataset_index.npy: element {} is {}, but the blend has {} datasets", cache_prefix,
                                 i, j, n);
          } else if (k < 0 || k >= datasets_[static_cast<size_t>(j)]->size()) {
            damage = fmt::format("{}dataset_sample_index.npy: element {} is {}, outside dataset {}'s {} samples",
                                 cache_prefix, i, k, j, datasets_[static_cast<size_t>(j)]->size());
          }
        }
      }
      if (damage.empty()) {
        dataset_index_ = std::move(index);
        dataset_sample_index_ = std::move(sample);
        loaded_from_cache_ = true;
        return;
      }
      log::warn("ignoring the damaged blend cache {}; rebuilding it", damage);
    }
  }

  std::vector<int16_t> index;
  std::vector<int64_t> sample;
  if (size) {
    build_blending_indices(weights_, *size, index, sample);
  } else {
    std::vector<int64_t> sizes;
    for (double w : weights_) sizes.push_back(static_cast<int64_t>(w));
    build_exhaustive_blending_indices(sizes, index, sample);
  }
  std::vector<int64_t> drawn(datasets_.size(), 0);
  for (int16_t j : index) ++drawn[static_cast<size_t>(j)];
  for (size_t j = 0; j < datasets_.size(); ++j) {
    if (drawn[j] > datasets_[j]->size()) {
      fail("the {} blend asks {} for {} samples but it has only {}: increase --mid-level-dataset-surplus (now {}), "
           "e.g. to {}",
           split_name(split_), datasets_[j]->describe(), drawn[j], datasets_[j]->size(), mid_level_dataset_surplus,
           std::max(0.01, 2 * mid_level_dataset_surplus));
    }
  }
  dataset_index_ = IndexArray::from_vector(std::move(index));
  dataset_sample_index_ = IndexArray::from_vector(std::move(sample));

  if (cache_dir) {
    std::error_code ec;
    std::filesystem::create_directories(*cache_dir, ec);
    try {
      if (ec) fail("{}: {}", *cache_dir, ec.message());
      dataset_index_.write_npy(cache_prefix + "dataset_index.npy");
      dataset_sample_index_.write_npy(cache_prefix + "dataset_sample_index.npy");
      write_cache_file_atomically(cache_prefix + "description.txt", key_ + "\n");
    } catch (const Error& e) {
      log::warn("cannot write the blend cache ({}); continuing without it", e.what());
    }
  }
}

void BlendedDataset::window(int64_t idx, int32_t* out) const {
  MT_CHECK(idx >= 0 && idx < size(), "blended sample {} of {}", idx, size());
  datasets_[static_cast<size_t>(dataset_index_[idx])]->window(dataset_sample_index_[idx], out);
}

void BlendedDataset::document_parts(int64_t idx, std::vector<int32_t>& lengths) const {
  MT_CHECK(idx >= 0 && idx < size(), "blended sample {} of {}", idx, size());
  datasets_[static_cast<size_t>(dataset_index_[idx])]->document_parts(dataset_sample_index_[idx], lengths);
}

void BlendedDataset::read_window(int64_t idx, int32_t* out, SampleStreams& streams) const {
  MT_CHECK(idx >= 0 && idx < size(), "blended sample {} of {}", idx, size());
  datasets_[static_cast<size_t>(dataset_index_[idx])]->read_window(dataset_sample_index_[idx], out, streams);
}

std::string BlendedDataset::describe() const {
  std::string parts;
  for (size_t j = 0; j < datasets_.size(); ++j) {
    parts += fmt::format("{}{:.6g} x {}", j ? ", " : "", weights_[j], datasets_[j]->describe());
  }
  return fmt::format("BlendedDataset({} split: {})", split_name(split_), parts);
}

}  // namespace mt
