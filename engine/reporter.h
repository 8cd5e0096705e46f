// Reporter: what the training loop tells the outside world. The engine measures and averages;
// app/ formats (Megatron's log line, TensorBoard event files, JSON-lines metrics).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace mt {

// One training iteration. Megatron's training_log runs after every iteration: TensorBoard scalars
// are written every --tensorboard-log-interval iterations from that iteration's own values, and the
// log line every --log-interval iterations (and after the first) from averages over the interval.
// The engine may call on_iteration for every iteration (interval_end marks the log-line ones) or
// only at log intervals (interval_end left true; TensorBoard then sees only those iterations).
// The order of the training losses in Megatron's log line (its total_loss_dict): lm loss, the
// distillation losses, the MoE
// losses as its training loop lists them, then the multi-token prediction depths' mtp_<j> loss.
// Knowledge distillation's losses follow lm loss, in the order of Megatron's report
// (megatron/post_training/loss_func.py).
inline constexpr const char* kDistillLossNames[3] = {"total loss", "logits distillation loss",
                                                     "intermediate distillation loss"};
struct LossOrder {
  static int rank(const std::string& k) {
    if (k == "lm loss") return 0;
    for (int i = 0; i < 3; ++i)
      if (k == kDistillLossNames[i]) return 1 + i;
    constexpr const char* moe[] = {"load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss",
                                   "z_loss"};
    for (int i = 0; i < 4; ++i)
      if (k == moe[i]) return 4 + i;
    return k.rfind("mtp_", 0) == 0 ? 9 : 8;
  }
  bool operator()(const std::string& a, const std::string& b) const {
    return rank(a) != rank(b) ? rank(a) < rank(b) : a < b;
  }
};
using LossMap = std::map<std::string, double, LossOrder>;

struct IterationStats {
  int64_t iteration = 0;
  bool interval_end = true;        // this iteration ends a log interval: the averaged fields are valid
  bool is_first_iteration = false; // the extra log line after the first iteration (HEAD Megatron)
  int64_t train_iters = 0;
  int64_t consumed_samples = 0;
  int64_t skipped_samples = 0;           // printed only when > 0
  double elapsed_ms_per_iteration = 0;   // wall time of the interval / iterations in it
  std::optional<double> tflops_per_gpu;  // with --log-throughput
  // With --log-energy, at log lines: the interval's GPU energy summed over ranks / iterations /
  // world size, and that over the seconds per iteration (Megatron's energy and power per GPU).
  std::optional<double> energy_per_gpu_j;
  std::optional<double> power_per_gpu_w;
  std::optional<double> learning_rate;   // after this iteration's scheduler step
  std::optional<double> decoupled_learning_rate;
  int64_t global_batch_size = 0;
  LossMap losses;  // "lm loss" -> average over the interval
  // This iteration's own reduced losses (what Megatron writes to TensorBoard); empty: use `losses`.
  LossMap iteration_losses;
  // What Megatron-LM's MoE and MTP trackers write to TensorBoard each iteration, tag and this
  // iteration's value (no "vs samples" twin): load_balancing_loss, z_loss, with
  // --moe-per-layer-logging moe/<name>_layer_<i>; mtp_<j> loss, mtp_<j>_acceptance_rate and
  // mtp_<j>_cumulative_acceptance_rate.
  std::vector<std::pair<std::string, double>> tracker_scalars;
  double loss_scale = 1.0;
  std::optional<double> grad_norm;
  std::optional<int64_t> num_zeros;     // --log-num-zeros-in-grad
  std::optional<double> params_norm;    // --log-params-norm
  int64_t skipped_iterations = 0;       // in this interval
  int64_t nan_iterations = 0;           // in this interval
  double weight_decay = 0;
  double tokens_per_second = 0;
  int world_size = 1;
  // Device memory of this rank, bytes (when known).
  std::optional<double> memory_allocated_bytes;
  std::optional<double> memory_peak_bytes;
  std::optional<double> memory_reserved_bytes;
  std::optional<double> memory_allocated_count;  // live allocations (TensorBoard mem-allocated-count)
  // Per-phase timer means in ms (--timing-log-level >= 1), name -> (min, max) over ranks. Names are
  // Megatron's ("forward-backward", "optimizer", ...); they print in Megatron's order.
  std::map<std::string, std::pair<double, double>> timers_ms;
  // With --timing-log-option all: name -> per-rank means in ms (index = rank; <= 0: not timed there).
  std::map<std::string, std::vector<double>> timers_all_ranks_ms;
};

struct EvalStats {
  int64_t iteration = 0;
  std::string split = "validation";   // "validation" or "test"
  bool after_training = false;        // Megatron prints "iteration N on validation set" then
  int64_t consumed_train_samples = 0; // x axis of TensorBoard's "... vs samples" tags
  LossMap losses;             // "lm loss" -> average
};

class Reporter {
 public:
  virtual ~Reporter() = default;
  virtual void on_iteration(const IterationStats& s) = 0;
  virtual void on_eval(const EvalStats& s) = 0;
  virtual void flush() {}
};

}  // namespace mt
