#include "data/inspect.h"

#include <fmt/format.h>

#include <algorithm>

#include "data/blended_dataset.h"

namespace mt {

void write_dataset_statistics(const BuiltDatasets& built, const std::array<int64_t, 3>& requested, std::ostream& out) {
  for (int i = 0; i < 3; ++i) {
    const char* name = split_name(kSplits[i]);
    if (!built.splits[i]) {
      out << fmt::format("{}: not built (requested {} samples)\n", name, requested[i]);
      continue;
    }
    const SampleDataset& ds = *built.splits[i];
    out << fmt::format("{}: {} samples of {} tokens (requested {})\n", name, ds.size(), ds.window_length(),
                       requested[i]);
    if (const auto* blend = dynamic_cast<const BlendedDataset*>(&ds)) {
      std::vector<int64_t> drawn(blend->datasets().size(), 0);
      for (int64_t t = 0; t < blend->size(); ++t) ++drawn[static_cast<size_t>(blend->dataset_index()[t])];
      for (size_t j = 0; j < blend->datasets().size(); ++j) {
        out << fmt::format("  blend part {}: weight {:.6g}, {} samples drawn ({:.4f} of the blend)\n", j,
                           blend->weights()[j], drawn[j],
                           blend->size() ? static_cast<double>(drawn[j]) / static_cast<double>(blend->size()) : 0.0);
      }
    }
    for (const GPTDataset* g : gpt_components(ds)) {
      out << fmt::format(
          "  {}: sequences [{}, {}) of {}, {} tokens per epoch, {} epoch(s){}, {} samples (asked {}){}\n",
          g->data().name(), g->indices().begin, g->indices().end, g->data().num_sequences(), g->tokens_per_epoch(),
          g->num_epochs(), g->separate_final_epoch() ? " (last shuffled separately)" : "", g->size(),
          g->num_samples() ? std::to_string(*g->num_samples()) : std::string("one epoch"),
          g->loaded_from_cache() ? ", indices from cache" : "");
    }
  }
}

void write_sample_windows(const SampleDataset& dataset, int64_t n, std::ostream& out, int workers) {
  std::vector<int32_t> window(static_cast<size_t>(dataset.window_length()));
  std::vector<SampleStreams> streams(static_cast<size_t>(std::max(1, workers)));
  fmt::memory_buffer line;
  for (int64_t i = 0; i < n; ++i) {
    dataset.read_window(i, window.data(), streams[static_cast<size_t>(i % static_cast<int64_t>(streams.size()))]);
    line.clear();
    fmt::format_to(std::back_inserter(line), "{{\"index\": {}, \"tokens\": [{}]}}\n", i, fmt::join(window, ", "));
    out.write(line.data(), static_cast<std::streamsize>(line.size()));
  }
}

}  // namespace mt
