// The core of `megatrain inspect-data`: statistics of the built datasets and the token windows of
// one split in the order training consumes them.
#pragma once

#include <array>
#include <cstdint>
#include <ostream>

#include "data/dataset_builder.h"

namespace mt {

// Human-readable statistics (requested and built sizes, per-component split ranges, tokens per
// epoch, epochs, final-epoch handling, cache use), one item per line.
void write_dataset_statistics(const BuiltDatasets& built, const std::array<int64_t, 3>& requested, std::ostream& out);

// One JSON line per sample i = 0 .. n-1 of the split: {"index": i, "tokens": [seq_length + 1 ids]}
// (the raw window: the input tokens and, shifted by one, the labels; pad id where short). FIM
// samples (--fim-data) come out as a run with one data-parallel rank and micro-batches of one
// reads them from the start: sample i from worker i mod `workers`.
void write_sample_windows(const SampleDataset& dataset, int64_t n, std::ostream& out, int workers = 1);

}  // namespace mt
