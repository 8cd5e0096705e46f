// MicroBatch: one micro-batch as training consumes it, in host memory, sample-major
// ([b][s]: element i * s + t). The engine reorders it to its sequence-major rows when staging.
#pragma once

#include <cstdint>
#include <vector>

namespace mt {

struct MicroBatch {
  int batch = 0;  // b
  int seq = 0;    // s
  std::vector<int32_t> tokens;     // [b * s]
  std::vector<int32_t> labels;     // [b * s]
  std::vector<float> loss_mask;    // [b * s]: 0 for padding (and EOD with --eod-mask-loss)
  std::vector<int32_t> positions;  // [b * s]: 0..s-1, restarted after EOD with --reset-position-ids
  // [b * s]: with --reset-attention-mask, the number of EOD tokens before each position in its
  // sample (else 0). Megatron's mask is causal within equal segments: position t attends to u <= t
  // only when segments[u] == segments[t] (a block-diagonal causal mask).
  std::vector<int32_t> segments;

  void resize(int b, int s) {
    batch = b;
    seq = s;
    const size_t n = static_cast<size_t>(b) * s;
    tokens.resize(n);
    labels.resize(n);
    loss_mask.resize(n);
    positions.resize(n);
    segments.resize(n);
  }
};

// A stream of micro-batches for this data-parallel rank, in training order.
class BatchSource {
 public:
  virtual ~BatchSource() = default;
  // Fills mb with the next micro-batch. Returns false when the data is exhausted.
  virtual bool next(MicroBatch& mb) = 0;
};

}  // namespace mt
