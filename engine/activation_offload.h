// Fine-grained activation offloading (--fine-grained-activation-offloading, --offload-modules;
// Megatron-LM's fine_grained_activation_offload.py): what the named modules of a layer keep for
// backward moves to host memory after the layer's forward and comes back before its backward.
//
// megatrain's shape of it. The kept tensors of the offloaded modules live in R device buffers
// ("entries"; layer l's in entry l % R) instead of one per layer and micro-batch in flight. After
// layer l's forward they are copied to host memory (one copy per module, on the backend's offload
// stream); a forward waits for that copy before it writes the entry again. In backward, layer l's
// tensors are copied back while layer l + 1 runs its backward, and layer l waits for them. R is 2,
// or 3 where a layer's tensors are first written by the layer before (its input, or its input norm
// fused into the layer before's closing op), so that a copy out always overlaps one layer's compute.
// With one micro-batch in flight (no pipeline) the last R layers are never copied: their backward
// comes first, with their tensors still in place (Megatron-LM's last-group margin). With several
// (a pipeline's), the entries serve every micro-batch in flight, one forward or backward at a
// time, so every layer is copied: the device holds R layers' worth for all of them; the pipeline
// runner asks for a backward's last layer back as soon as that backward is its chunk's next action
// (GptModel::prefetch_backward), and where a forward's own backward comes next on its chunk (a 1F1B
// pipeline's last stage) that forward's last R layers stay in place (GptModel::backward_follows).
//
// Which tensors (LayerActs fields) a module's group takes, in megatrain's layers:
//   attn_norm   the layer's input (the layer before's output), which ln1's backward reads
//   qkv_linear  ln1's output (the QKV projection's input), or in FP8 layers its kept FP8 copy
//   core_attn   the attention input (after q/k norms and RoPE), its output and log-sum-exp
//   attn_proj   the projection's input is core_attn's output (Megatron-LM requires core_attn with
//               it); in FP8 layers also its kept FP8 copy
//   mlp_norm    the residual after attention, which ln2's backward reads
//   expert_fc1  (MoE layers) ln2's output, the MoE input: megatrain keeps it once per token and
//               gathers the experts' fc1 input from it again in backward, where Megatron-LM keeps
//               the permuted rows (top-k per token)
//   moe_act     (MoE layers) the experts' fc1 output, the activation's input
//   fused_group_mlp  expert_fc1 and moe_act together
// Tensors of fewer elements than --min-offloaded-tensor-size stay where they are. Layers in a full
// recompute group keep nothing to offload, nor do the multi-token-prediction layers.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/dtype.h"

namespace mt {

struct TrainConfig;

enum class OffloadModule : int { attn_norm, qkv_linear, core_attn, attn_proj, mlp_norm, expert_fc1, moe_act, fused_group_mlp, count };
inline constexpr int kOffloadModules = static_cast<int>(OffloadModule::count);
const char* offload_module_name(OffloadModule m);

enum class OffloadField : int { input, ln1_out, fp8_qkv, qkv, attn_out, lse, fp8_proj, h1, moe_in, moe_fc1_pre, count };

struct OffloadOptions {
  bool enabled = false;
  std::array<bool, kOffloadModules> modules{};
  int64_t min_numel = 1024 * 1024;  // --min-offloaded-tensor-size
  double fraction = 1.0;            // --activation-offload-fraction
  int64_t keep_bytes = 0;           // pipeline rank x --delta-offload-bytes-across-pp-ranks
  std::optional<int> max_inflight;  // --fine-grained-offloading-max-inflight-offloads
  // Tests only (no flag sets it): after each copy to host the device copy is overwritten with NaN,
  // so that a read before the copy back shows.
  bool poison = false;

  static OffloadOptions from_config(const TrainConfig& t, int pp_rank);
  // The module whose group takes field f (with fused_group_mlp: the MoE fields are its).
  OffloadModule module_of(OffloadField f) const;
  bool selected(OffloadField f) const { return modules[static_cast<size_t>(module_of(f))]; }
};

// A kept tensor that could be offloaded: found by laying out a layer (GptModel::take_act).
struct OffloadCandidate {
  int layer = 0;  // the layer whose backward reads it first (for `input`: the layer it feeds)
  OffloadField field = OffloadField::input;
  DType dtype = DType::f32;
  int64_t numel = 0;
  size_t bytes = 0;  // rounded up to the arena's alignment
};

// Where each offloaded tensor lives and which layers are copied: the layout of one slot (every
// slot the same), from the candidates of one slot's layers.
struct OffloadPlan {
  struct Piece {
    OffloadModule module;
    OffloadField field;
    size_t offset = 0;  // bytes into the layer's entry (and into its host block)
    size_t bytes = 0;
  };
  struct Group {  // one module's pieces of one layer: one copy each way
    OffloadModule module;
    size_t offset = 0, bytes = 0;
  };
  struct Layer {
    std::vector<Piece> pieces;  // by module, then field
    std::vector<Group> groups;
    size_t bytes = 0;           // of the entry this layer uses
    bool copied = false;        // copied out after forward and back before backward
    size_t host_offset = 0;     // into a micro-batch's host block (copied layers)
  };
  int ring = 0;  // R: the entries; 0: nothing is offloaded
  std::vector<Layer> layers;
  size_t entry_bytes = 0;
  size_t host_bytes_per_slot = 0;   // per micro-batch in flight: what goes to host each forward
  size_t placed_bytes_per_slot = 0;  // per micro-batch in flight: every piece's bytes (copied or not)
  std::array<size_t, kOffloadModules> module_bytes{};  // per micro-batch in flight, by module

  // layers: the stage's decoder layers; early_ln1[l]: layer l's ln1 output is written by the layer
  // before (the fused norm); keep_last: one micro-batch in flight (the last R layers stay).
  // Candidates of other layers or fields not selected are ignored.
  static OffloadPlan make(const OffloadOptions& o, int layers, const std::vector<OffloadCandidate>& candidates,
                          const std::vector<bool>& early_ln1, bool keep_last);
  const Piece* piece(int layer, OffloadField f) const;
  // One line: what goes to host per micro-batch in flight, by module, and the device entries.
  std::string summary() const;
};

}  // namespace mt
