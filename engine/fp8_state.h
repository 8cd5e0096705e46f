// Fp8State: the scaling state of a model chunk's FP8 GEMMs (--fp8-format), planned up front.
// Every FP8 layer (a decoder layer not kept in bf16 by --first-last-layers-bf16) has four FP8
// GEMMs (QKV, proj, fc1, fc2), each with three scaled operands (input x, weight w, output
// gradient dy): 12 operands per layer, numbered (fp8_layer * 4 + gemm) * 3 + role. Per operand:
//   scale, scale_inv   float32 [n]
//   amax history       float32 [H, n]: row 0 is the running max |x| of the current step (every
//                      fp8_quantize of the operand maxes into it), rows 1.. earlier steps
//   fp8_max            float32 [n]: 448 (e4m3) or 57344 (e5m2: dy with --fp8-format hybrid)
//   fresh              float32 [n], tensorwise only: the amax slot of the cast in progress
//                      (Fp8TensorMeta::fresh; zero between casts, not part of the checkpoint)
// The initial scale is 1 (Transformer Engine's), but delayed scaling never casts with it: until
// the first scale update the FP8 layers calibrate, i.e. run their GEMMs in the compute dtype and
// only record the amaxes (Transformer Engine's fp8_autocast(calibrating=True)), so the first step
// is the bf16 step and the first update has real amaxes. Casting the first step with scale 1, as
// Transformer Engine does by default, flushes most e5m2 gradients and small e4m3 weights to zero
// (gpt-1.3b: a grad norm of 3.9 against bf16's 48.7 at iteration 1) and sent a 300-iteration run
// 1.1% away from bf16's loss (bench/RESULTS.md). Scaling each tensor by its own amax in that step
// instead would make the step depend on the TP layout (the shards' amaxes differ). The rule reads
// only the saved state (all scales 1 = no update yet), so a resumed run repeats a straight one.
// Delayed scaling updates the scales once per step (end_step): the amax row is all-reduced (max) over the tensor- and data-parallel groups (as
// Megatron's default amax reduction group, DP x TP), then Backend::fp8_update_scales. Tensorwise
// scaling sets scale/scale_inv at each cast; end_step only clears the amax row.
// Differences from Transformer Engine, deliberate: TE rolls the history and updates the scales at
// each fp8_autocast exit (per micro-batch forward, gradients per backward); here once per
// optimizer step, the step's amax being the max over its micro-batches (so every micro-batch of a
// step uses the same scales, and the weights, cast once per step, one scale). Tensorwise over TP
// scales each rank's shard by its own amax (no amax all-reduce inside the cast): the numbers are
// right, the FP8 grids differ slightly from TP=1's. (FP8 parameters are the exception: their
// scales come from the amax over TP and DP, set once per step by update_weight_scales.)
#pragma once

#include <optional>
#include <vector>

#include "core/config.h"
#include "engine/backend.h"
#include "engine/memory_plan.h"

namespace mt {

struct ParallelState;

struct Fp8Options {
  std::optional<Fp8Format> format;  // unset: no FP8
  Fp8Recipe recipe = Fp8Recipe::delayed;
  int margin = 0;
  int history_len = 1;
  Fp8AmaxAlgo algo = Fp8AmaxAlgo::most_recent;
  bool wgrad = true;                // false (--no-fp8-wgrad): weight gradients by the bf16 GEMM
  bool param_gather = false;        // --fp8-param-gather: FP8 layers' weights stored only as FP8
  std::vector<char> layer_fp8;      // per GLOBAL decoder layer: 1 = FP8 linear layers
  static Fp8Options from_config(const Config& cfg);
  bool enabled() const { return format.has_value(); }
  bool global_layer_fp8(int layer) const {
    return enabled() && layer >= 0 && static_cast<size_t>(layer) < layer_fp8.size() && layer_fp8[layer];
  }
};

class Fp8State {
 public:
  enum Gemm { qkv = 0, proj = 1, fc1 = 2, fc2 = 3 };
  enum Role { x = 0, w = 1, dy = 2 };
  static constexpr int kGemms = 4, kRoles = 3, kPerLayer = kGemms * kRoles;

  // Which of the chunk's layers [layer_begin, layer_end) run in FP8.
  void plan(const Fp8Options& o, int layer_begin, int layer_end);
  // Another set of GEMMs instead (further Fp8States of the model): the FP8 layers among those whose
  // `only` entry (per GLOBAL layer) is set, each with `gemms` GEMMs of three operands. experts: the
  // routed experts' state (GptModel::expert_gemm: 2 GEMMs per local expert, expert e's fc1 as GEMM
  // 2e and its fc2 as 2e + 1, each with its own scaling state, as Transformer Engine's grouped linear
  // layers keep one per GEMM), its amaxes reduced over the experts' replicas (the
  // expert-data-parallel group) and the experts' TP group, every rank of which holds the same
  // experts; otherwise over TP and DP as the dense state's.
  void plan_subset(const Fp8Options& o, int layer_begin, int layer_end, const std::vector<char>& only, int gemms,
                   bool experts);
  bool experts() const { return experts_; }
  int gemms() const { return gemms_; }        // per FP8 layer
  int per_layer() const { return gemms_ * kRoles; }
  void layout(Arena& a);       // takes the buffers (nothing when no layer is FP8)
  void initialize(Backend& be);  // scale 1, history 0, fp8_max per role (set-up time)

  bool any() const { return n_layers_ > 0; }
  bool layer_fp8(int local) const { return local >= 0 && static_cast<size_t>(local) < slot_.size() && slot_[local] >= 0; }
  int operands() const { return n_layers_ * per_layer(); }
  DType dtype(Role r) const;
  Fp8TensorMeta meta(int local, Gemm g, Role r) const { return meta(local, static_cast<int>(g), r); }
  Tensor scale_inv(int local, Gemm g, Role r) const { return scale_inv(local, static_cast<int>(g), r); }
  Fp8TensorMeta meta(int local, int gemm, Role r) const;
  Tensor scale_inv(int local, int gemm, Role r) const;
  // The operand's producer amax slot (meta(...).fresh): empty unless tensorwise.
  Tensor fresh(int local, Gemm g, Role r) const;
  // Global layer numbers of the FP8 layers in operand order (for the checkpoint).
  const std::vector<int>& fp8_global_layers() const { return global_; }
  const Fp8Options& options() const { return opt_; }
  // Delayed scaling before its first scale update: the FP8 layers calibrate (see above).
  bool calibrating() const { return first_step_; }

  // Once per optimizer step, before its update (every rank of the amax groups calls it): the
  // amax reduction, then (delayed) the scale update.
  void end_step(Backend& be, ParallelState& ps);
  // The amax row's max over TP and DP (every rank of those groups calls it).
  void reduce_amax(ParallelState& ps);
  // FP8 parameters at set-up: each weight's scale (and scale_inv) from its amax in row 0 alone, by
  // fp8_update_scales' rule, without rolling the history (that update still sees the amax).
  // Inputs' and gradients' scales stay as they are.
  void set_weight_scales_from_amax(Backend& be);
  // FP8 parameters with tensorwise scaling, once per optimizer step after the update recorded the
  // new master weights' amaxes in row 0 and reduce_amax: on the device, every operand with an amax
  // in row 0 gets its scale from it alone (fp8_update_scales' rule; the inputs' and gradients' rows
  // were cleared by end_step, and their casts set their own scales anyway); row 0 is cleared.
  void update_weight_scales(Backend& be);
  // Tensorwise producers' amax slots (Fp8TensorMeta::fresh) maxed over DP: after the distributed
  // optimizer's update took each weight's amax over this rank's shards only (the other slots are
  // zero then; every rank of the DP group calls it).
  void reduce_fresh_over_dp(ParallelState& ps);

  // Checkpoint form: per FP8 layer j (fp8_global_layers() order) a block of
  // layer_floats() floats: amax_history [H, P], then scale [P], then scale_inv [P] (P = per_layer():
  // 12 for the dense state).
  int64_t layer_floats() const { return static_cast<int64_t>(opt_.history_len + 2) * per_layer(); }
  // Copies the device state into `packed` (operands() / 12 blocks; waits for the copy).
  void save_to_host(Backend& be, float* packed) const;
  // Uploads `packed` into the device state (set-up / load time).
  void load_from_host(Backend& be, const float* packed);

  // The whole state: history [H, n], scale [n], scale_inv [n].
  Tensor history() const { return history_; }
  Tensor scale() const { return scale_; }
  Tensor scale_inv_all() const { return scale_inv_; }

 private:
  int index(int local, int gemm, Role r) const;
  void plan_layers(const Fp8Options& o, int layer_begin, int layer_end, const std::vector<char>* only);
  Fp8Options opt_;
  int gemms_ = kGemms;
  bool experts_ = false;
  std::vector<int> slot_;    // local layer -> FP8 layer index, or -1
  std::vector<int> global_;  // FP8 layer index -> global layer
  int n_layers_ = 0;
  bool first_step_ = false;  // see the header comment (delayed scaling, no update yet)
  Tensor history_, scale_, scale_inv_, fp8_max_, fresh_;
};

}  // namespace mt
