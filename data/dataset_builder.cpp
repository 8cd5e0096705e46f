#include "data/dataset_builder.h"

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <exception>
#include <map>
#include <mutex>
#include <thread>

#include "core/config.h"
#include "core/error.h"
#include "core/log.h"
#include "data/blended_dataset.h"
#include "data/indexed_dataset.h"
#include "data/mock_dataset.h"
#include "data/numpy_random.h"
#include "data/tokenizer.h"

namespace mt {

namespace {

std::string strip(const std::string& s) {
  const char* ws = " \t\n\r\f\v";
  const size_t b = s.find_first_not_of(ws);
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(ws) - b + 1);
}

std::optional<double> parse_number(const std::string& text) {
  const std::string t = strip(text);
  // Python's float() takes no hexadecimal (strtod would).
  if (t.empty() || t.find_first_of("xX") != std::string::npos) return std::nullopt;
  char* end = nullptr;
  const double v = std::strtod(t.c_str(), &end);
  if (end != t.c_str() + t.size()) return std::nullopt;
  return v;
}

// _get_size_per_split_per_dataset: per dataset, per split, ceil(ceil(N * w) * (1 + surplus)).
std::vector<std::array<std::optional<int64_t>, 3>> sizes_per_dataset(const std::vector<double>& weights,
                                                                     const std::array<std::optional<int64_t>, 3>& sizes,
                                                                     double surplus) {
  std::vector<std::array<std::optional<int64_t>, 3>> out(weights.size());
  for (size_t j = 0; j < weights.size(); ++j) {
    for (int i = 0; i < 3; ++i) {
      if (!sizes[i]) continue;
      const double target = std::ceil(static_cast<double>(*sizes[i]) * weights[j]);
      out[j][i] = static_cast<int64_t>(std::ceil(target * (1.0 + surplus)));
    }
  }
  return out;
}

class Builder {
 public:
  Builder(const DatasetsConfig& config, const std::array<std::optional<int64_t>, 3>& sizes)
      : config_(config), sizes_(sizes) {}

  BuiltDatasets build() {
    BuiltDatasets out;
    if (config_.mock) {
      auto mock = std::make_shared<MockLowLevelDataset>(config_.tokenizer.vocab_size, config_.tokenizer.eod);
      auto mids = mid_level(mock, "", split_matrix(parse_split("1,1,1")), sizes_);
      for (int i = 0; i < 3; ++i) out.splits[i] = mids[i];
    } else if (config_.blend) {
      const SplitMatrix matrix = split_matrix(parse_split(config_.split));
      const Blend& blend = *config_.blend;
      if (blend.prefixes.size() == 1 && !blend.weights) {
        auto mids = mid_level(open(blend.prefixes[0]), blend.prefixes[0], matrix, sizes_);
        for (int i = 0; i < 3; ++i) out.splits[i] = mids[i];
      } else {
        out.splits = top_level(blend, matrix, sizes_, std::nullopt);
      }
    } else {
      for (int i = 0; i < 3; ++i) {
        if (!config_.blend_per_split[i]) continue;
        const Blend& blend = *config_.blend_per_split[i];
        SplitMatrix matrix;
        matrix[i] = std::make_pair(0.0, 1.0);
        std::array<std::optional<int64_t>, 3> sizes{int64_t{0}, int64_t{0}, int64_t{0}};
        sizes[i] = sizes_[i];
        if (blend.prefixes.size() == 1) {
          out.splits[i] = mid_level(open(blend.prefixes[0]), blend.prefixes[0], matrix, sizes)[i];
        } else {
          out.splits[i] = top_level(blend, matrix, sizes, i)[i];
        }
      }
    }
    out.components = components_;
    return out;
  }

 private:
  std::shared_ptr<const LowLevelDataset> open(const std::string& prefix) {
    std::unique_lock lock(mutex_);
    auto it = low_level_.find(prefix);
    if (it != low_level_.end()) return it->second;
    lock.unlock();
    auto ds = std::make_shared<IndexedDataset>(prefix, IndexedDataset::Options{.mmap_bin = config_.mmap_bin_files});
    if (config_.token_limit) {
      ds->check_tokens(*config_.token_limit, config_.full_data_check);
      ds->set_token_limit(*config_.token_limit);
    }
    lock.lock();
    return low_level_.emplace(prefix, std::move(ds)).first->second;
  }

  GPTDatasetOptions gpt_options(const std::string& prefix) const {
    GPTDatasetOptions o;
    o.seq_length = config_.seq_length;
    o.seed = config_.seed;
    o.pad_token_id = static_cast<int32_t>(config_.tokenizer.pad);
    o.fim = config_.fim;
    if (config_.data_cache_path) {
      o.cache_dir = config_.data_cache_path;
    } else if (!prefix.empty()) {
      o.cache_dir = prefix + "/cache/GPTDataset_indices";  // Megatron's default, under the prefix
    }
    return o;
  }

  // _build_megatron_dataset_splits: one GPTDataset per split the matrix keeps.
  std::array<std::shared_ptr<const SampleDataset>, 3> mid_level(std::shared_ptr<const LowLevelDataset> data,
                                                                const std::string& prefix, const SplitMatrix& matrix,
                                                                const std::array<std::optional<int64_t>, 3>& sizes) {
    std::array<std::shared_ptr<const SampleDataset>, 3> out;
    for (int i = 0; i < 3; ++i) {
      if (!matrix[i]) continue;
      const IndexRange range = split_range(*matrix[i], data->num_sequences());
      auto ds = std::make_shared<const GPTDataset>(data, kSplits[i], range, sizes[i], gpt_options(prefix));
      {
        std::lock_guard lock(mutex_);
        components_.push_back(ds);
      }
      out[i] = std::move(ds);
    }
    return out;
  }

  std::array<std::shared_ptr<const SampleDataset>, 3> top_level(const Blend& blend, const SplitMatrix& matrix,
                                                                const std::array<std::optional<int64_t>, 3>& sizes,
                                                                std::optional<int> only_split) {
    const size_t n = blend.prefixes.size();
    std::optional<std::vector<double>> weights;
    std::vector<std::array<std::optional<int64_t>, 3>> target, buffer(n);
    if (blend.weights) {
      weights = numpy_random::normalize(*blend.weights);
      for (int i = 0; i < 3; ++i) {
        if (matrix[i] && !sizes[i]) fail("a weighted blend needs a sample count for the {} split", split_name(kSplits[i]));
      }
      target = sizes_per_dataset(*weights, sizes, 0.0);
      buffer = sizes_per_dataset(*weights, sizes, config_.mid_level_dataset_surplus);
    }

    // The components, built --num-dataset-builder-threads at a time.
    std::vector<std::array<std::shared_ptr<const SampleDataset>, 3>> mids(n);
    std::vector<std::exception_ptr> errors(n);
    std::atomic<size_t> next{0};
    auto work = [&] {
      for (size_t j = next++; j < n; j = next++) {
        try {
          mids[j] = mid_level(open(blend.prefixes[j]), blend.prefixes[j], matrix, buffer[j]);
        } catch (...) {
          errors[j] = std::current_exception();
        }
      }
    };
    const size_t threads = std::min<size_t>(n, static_cast<size_t>(std::max(1, config_.num_dataset_builder_threads)));
    std::vector<std::thread> pool;
    for (size_t t = 1; t < threads; ++t) pool.emplace_back(work);
    work();
    for (auto& t : pool) t.join();
    for (auto& e : errors) {
      if (e) std::rethrow_exception(e);
    }

    std::array<std::shared_ptr<const SampleDataset>, 3> out;
    for (int i = 0; i < 3; ++i) {
      if (!matrix[i] || (only_split && *only_split != i)) continue;
      std::vector<std::shared_ptr<const SampleDataset>> parts;
      for (size_t j = 0; j < n; ++j) parts.push_back(mids[j][i]);
      std::vector<double> blend_weights;
      std::optional<int64_t> size;
      if (weights) {
        blend_weights = *weights;
        int64_t total = 0;
        for (size_t j = 0; j < n; ++j) total += *target[j][i];
        size = total;
      } else {
        int64_t total = 0;
        for (const auto& p : parts) {
          if (p->size() == 0) {
            fail("{} has no {} samples: it cannot take part in an unweighted blend (change --split or drop it)",
                 p->describe(), split_name(kSplits[i]));
          }
          blend_weights.push_back(static_cast<double>(p->size()));
          total += p->size();
        }
        if (sizes[i]) size = std::min(*sizes[i], total);
      }
      out[i] = std::make_shared<const BlendedDataset>(std::move(parts), std::move(blend_weights), size, kSplits[i],
                                                      config_.mid_level_dataset_surplus, config_.data_cache_path);
    }
    return out;
  }

  const DatasetsConfig& config_;
  std::array<std::optional<int64_t>, 3> sizes_;
  std::mutex mutex_;
  std::map<std::string, std::shared_ptr<const LowLevelDataset>> low_level_;
  std::vector<std::shared_ptr<const GPTDataset>> components_;
};

}  // namespace

std::optional<Blend> parse_blend(const std::vector<std::string>& items, const char* flag) {
  if (items.empty()) return std::nullopt;
  Blend blend;
  bool weighted = items.size() % 2 == 0;
  std::vector<double> weights;
  if (weighted) {
    std::optional<size_t> first_word;
    for (size_t k = 0; k < items.size(); k += 2) {
      const auto w = parse_number(items[k]);
      if (!w) {
        if (!first_word) first_word = k;
      } else if (first_word) {
        fail("{}: '{}' is a weight but '{}' before it is not; give 'weight prefix' pairs or prefixes only", flag,
             items[k], items[*first_word]);
      } else {
        weights.push_back(*w);
      }
    }
    weighted = !first_word;
  }
  if (weighted) {
    for (size_t k = 0; k < items.size(); k += 2) {
      const double w = weights[k / 2];
      if (!std::isfinite(w) || w <= 0) {
        fail("{}: the weight {} of '{}' {}: every weight must be a positive number (drop the prefix or raise its "
             "weight)",
             flag, strip(items[k]), strip(items[k + 1]), w < 0 ? "is negative" : "is not positive");
      }
      blend.prefixes.push_back(strip(items[k + 1]));
    }
    blend.weights = std::move(weights);
  } else {
    for (const auto& p : items) blend.prefixes.push_back(strip(p));
  }
  for (const auto& p : blend.prefixes) {
    if (p.empty()) fail("{}: empty data prefix", flag);
  }
  return blend;
}

TokenizerFacts tokenizer_facts(const Config& config) {
  TokenizerFacts t;
  t.vocab_size = config.model.vocab_size;
  t.eod = config.data.eod_id;
  // Megatron's tokenizer.pad: NullTokenizer's --null-tokenizer-pad-id; none for the others here.
  t.pad = config.data.tokenizer_type.value_or("") == "NullTokenizer" ? config.data.null_tokenizer_pad_id : -1;
  return t;
}

BuiltDatasets build_datasets_for_run(const Config& config) {
  const DatasetsConfig data = datasets_config(config, tokenizer_facts(config));
  const std::array<int64_t, 3> n = samples_per_split(config);
  return build_datasets(data, {n[0], n[1], n[2]});
}

DatasetsConfig datasets_config(const Config& config, const TokenizerFacts& tokenizer) {
  const DataConfig& d = config.data;
  DatasetsConfig c;
  c.blend = parse_blend(d.data_path, "--data-path");
  c.blend_per_split[0] = parse_blend(d.train_data_path, "--train-data-path");
  c.blend_per_split[1] = parse_blend(d.valid_data_path, "--valid-data-path");
  c.blend_per_split[2] = parse_blend(d.test_data_path, "--test-data-path");
  c.mock = d.mock_data;
  const bool per_split = c.blend_per_split[0] || c.blend_per_split[1] || c.blend_per_split[2];
  const int sources = (c.mock ? 1 : 0) + (c.blend ? 1 : 0) + (per_split ? 1 : 0);
  if (sources > 1) {
    fail("give one data source: --mock-data, --data-path, or --train-data-path/--valid-data-path/--test-data-path");
  }
  if (sources == 0) {
    fail("no training data: give --data-path (or --train-data-path/--valid-data-path/--test-data-path), or "
         "--mock-data");
  }
  if (per_split && d.split) fail("--split does not apply to --train-data-path/--valid-data-path/--test-data-path");
  if (c.mock && d.split) {
    log::warn0("--split {} has no effect with --mock-data: Megatron always splits mock data 1,1,1", *d.split);
  }
  if (d.split) c.split = *d.split;
  c.seq_length = config.model.seq_length;
  c.seed = static_cast<uint32_t>(config.train.seed);
  if (config.train.seed < 0) fail("--seed {} must not be negative (numpy's RandomState takes 0..2^32-1)", config.train.seed);
  c.tokenizer = tokenizer;
  // Megatron drops a pad id that collides with EOD, unless --allow-ambiguous-pad-tokens.
  if (c.tokenizer.pad == c.tokenizer.eod && !d.allow_ambiguous_pad_tokens) c.tokenizer.pad = -1;
  c.data_cache_path = d.data_cache_path;
  c.mmap_bin_files = d.mmap_bin_files;
  c.mid_level_dataset_surplus = d.mid_level_dataset_surplus;
  c.num_dataset_builder_threads = d.num_dataset_builder_threads;
  if (config.model.padded_vocab_size > 0) c.token_limit = config.model.padded_vocab_size;
  c.full_data_check = d.full_data_check;
  if (d.fim_data) {
    if (c.mock) fail("Mock dataset is not supported with FIM dataset.");
    c.fim = fim_config(d, c.seed, build_tokenizer(tokenizer_options(d)));
  }
  return c;
}

std::array<int64_t, 3> samples_per_split(const Config& config) {
  const TrainConfig& t = config.train;
  int64_t batch = t.global_batch;
  if (batch <= 0) {
    batch = t.global_batch_size.value_or(t.micro_batch_size * config.parallel.data_parallel_size);
  }
  const int64_t train = (t.train_samples && *t.train_samples != 0) ? *t.train_samples : t.train_iters.value_or(0) * batch;
  int64_t eval_iters_total;
  if (t.skip_train) {
    eval_iters_total = t.eval_iters;
  } else {
    // update_train_iters: sample-based runs train train_samples // B iterations.
    // (with --step-batch-size-schedule: the iterations the scheduled batches take)
    const int64_t iters = t.train_iters && *t.train_iters != 0 ? *t.train_iters
                          : t.batch_size_schedule.empty()      ? t.train_samples.value_or(0) / batch
                                                               : t.total_iters;
    eval_iters_total = t.evaluations(iters) * t.eval_iters;
  }
  const int64_t eval_batch = t.eval_global_batch_size.value_or(batch);  // --eval-global-batch-size
  return {train, eval_iters_total * eval_batch, static_cast<int64_t>(t.eval_iters) * eval_batch};
}

BuiltDatasets build_datasets(const DatasetsConfig& config, const std::array<std::optional<int64_t>, 3>& sizes) {
  if (config.seq_length < 2) fail("--seq-length {} is too short (at least 2)", config.seq_length);
  return Builder(config, sizes).build();
}

std::vector<const GPTDataset*> gpt_components(const SampleDataset& dataset) {
  if (const auto* gpt = dynamic_cast<const GPTDataset*>(&dataset)) return {gpt};
  std::vector<const GPTDataset*> out;
  if (const auto* blend = dynamic_cast<const BlendedDataset*>(&dataset)) {
    for (const auto& d : blend->datasets()) {
      for (const GPTDataset* g : gpt_components(*d)) out.push_back(g);
    }
  }
  return out;
}

}  // namespace mt
