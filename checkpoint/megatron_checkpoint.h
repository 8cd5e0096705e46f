// Megatron-LM checkpoints (megatron/training/checkpointing.py), read without Python: the
// tracker file, the iteration directory, the saved `args`, and every model parameter as one
// global tensor under its Megatron-Core name with global layer numbers (megatrain's own names).
//
// Both of Megatron's formats:
//  * torch (legacy): iter_N/mp_rank_TT[_PPP]/model_optim_rng.pt, one torch.save'd dict per
//    tensor x pipeline rank. Tensors are TP shards, layer numbers are local to their pipeline stage
//    (virtual stages as model0, model1, ...), and the local transformer spec names its norms
//    input_layernorm / pre_mlp_layernorm where Transformer Engine fuses them into linear_qkv /
//    linear_fc1. Shards are joined as Megatron splits them (checkpoint/megatron_names.h).
//  * torch_dist (the default): PyTorch Distributed Checkpoint (.metadata + __R_K.distcp, each
//    stored item a torch.save archive) with global, unsharded keys; the transformer layers are
//    stacked along a leading dimension ("decoder.layers.mlp.linear_fc1.weight" is [L, 2f, h]) and
//    stored as chunks, which are assembled here. The args come from the common state (common.pt
//    in older versions, a "common_state" item in newer ones).
//  * fsdp_dtensor (Megatron-FSDP's): PyTorch Distributed Checkpoint without metadata.json, the
//    model's own state dict (every layer its own key, SwiGLU's linear_fc1 in two halves, each
//    expert its own tensor) holding the main weights, Adam's state by parameter beside it, and
//    the args, iteration and scheduler as objects of their own (open_fsdp_dtensor). torch FSDP2's
//    torch_dcp shares the container: the unwrapped model's state dict (fc1 whole) and torch's
//    optimizer state keyed by index into the param groups, placed by the model's parameter order.
// Optimizer state (torch_dist and fsdp_dtensor; the torch format's index-keyed state is not read):
//  * by parameter: the non-distributed optimizer ("optimizer.state.{exp_avg,exp_avg_sq,fp32_param}.
//    <param>", the step as the common state's optimizer.state.common_step) and the distributed
//    optimizer's fully reshardable layout (--dist-ckpt-optim-fully-reshardable: the main weights as
//    "param", the step in the param groups);
//  * flat buckets: the distributed optimizer's default ("dp_reshardable") layout, one flat buffer
//    per model-parallel rank, model chunk, bucket and state, holding each TP rank's parameter
//    shards with padding. The checkpoint does not say which parameter lies where: the caller works
//    that out from the model (checkpoint/megatron_flat_layout.h) and hands it over with
//    set_flat_placement().
#pragma once

#include <compare>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/hf_names.h"
#include "checkpoint/pickle.h"
#include "core/shard.h"

namespace mt {

class MegatronCheckpoint {
 public:
  // `load_dir` as Megatron's --load, `ckpt_step` as its --ckpt-step. Throws naming the directory
  // when it holds no Megatron checkpoint, or one in a format megatrain does not read.
  MegatronCheckpoint(const std::string& load_dir, std::optional<int64_t> ckpt_step);
  ~MegatronCheckpoint();
  // Placements read through this object: not copied or moved.
  MegatronCheckpoint(const MegatronCheckpoint&) = delete;
  MegatronCheckpoint& operator=(const MegatronCheckpoint&) = delete;

  // "torch", "torch_dist", "fsdp_dtensor" or "torch_dcp"
  const std::string& format() const { return format_; }
  const std::string& directory() const { return directory_; }
  int64_t iteration() const { return iteration_; }  // 0 for a release checkpoint
  bool release() const { return release_; }
  // The saved argparse.Namespace (an object whose state is a dict of argument names).
  const PickleValue& args() const { return *args_; }

  // The model's parameters (global names), sorted; and one as a dense global tensor.
  std::vector<std::string> parameter_names() const;
  HostArray parameter(const std::string& name) const;

  // The common (non-sharded) state: iteration, opt_param_scheduler, optimizer (param groups,
  // common_step), num_floating_point_operations_so_far (the torch format: the first rank file's).
  const PickleValue* common_state() const { return common_.get(); }
  // How the optimizer state is stored: "by parameter", "flat buckets" or "by index" (readable),
  // "none", or a description of a layout megatrain does not read.
  const std::string& optimizer_layout() const { return optimizer_layout_; }
  // Whether the distributed optimizer saved it (its "param" states are main weights even for a
  // float32 model).
  bool distributed_optimizer() const { return distributed_optimizer_; }
  // `state` ("exp_avg", "exp_avg_sq", "fp32_param") of a parameter, as parameter(); nullopt when
  // the checkpoint has none for it (fp32_param of the non-distributed optimizer's float32 model).
  // Flat buckets and by index: only for parameters given to set_flat_placement() or
  // set_indexed_placement().
  std::optional<HostArray> optimizer_state(const std::string& state, const std::string& name) const;
  // Adam's step count (optimizer.state.common_step, or the param groups' "step" for the distributed
  // optimizer); nullopt when the state has none (an optimizer that never stepped).
  std::optional<int64_t> optimizer_step() const;
  // --fp16's dynamic loss scaler (Megatron's DynamicGradScaler.state_dict() beside the optimizer's
  // state: scale, growth_tracker, hysteresis_tracker); nullopt when the checkpoint has none.
  struct GradScalerState {
    double scale = 1;
    int64_t growth_tracker = 0, hysteresis_tracker = 0;
  };
  std::optional<GradScalerState> grad_scaler() const;

  // Flat buckets. A bucket: Megatron's dp_group_idx (the model-parallel rank tp + TP * pp; of the
  // experts' optimizer, the experts' model-parallel rank), gbuf_idx (the model chunk), bucket_idx,
  // and the optimizer of a ChainedOptimizer it belongs to (its keys' chained_<i> prefix; 0 without:
  // with expert parallelism 0 holds the dense parameters, 1 the routed experts').
  struct FlatBucket {
    int mp_rank = 0, gbuf = 0, bucket = 0, chain = 0;
    auto operator<=>(const FlatBucket&) const = default;
  };
  // Every stored bucket with its size (the unpadded number of elements of each state).
  std::map<FlatBucket, int64_t> flat_buckets() const;
  // The torch format's distrib_optim.pt stores each chunk's buckets end to end (bucket-end padding
  // stripped) as one "bucket" 0, without their sizes.
  bool flat_coalesced() const { return flat_coalesced_; }
  // One TP rank's shard of a parameter in a bucket: `count` elements from `offset`.
  struct FlatPiece {
    FlatBucket bucket;
    int64_t offset = 0, count = 0;
  };
  // Places a parameter: its shard on each TP rank, and where each shard lies in the global tensor
  // (`shards[t]`, megatrain's own TP layout, which is Megatron's).
  void set_flat_placement(const std::string& name, std::vector<FlatPiece> pieces, std::vector<int64_t> global_shape,
                          std::vector<ShardIndex> shards);

  // By index: the torch format's non-distributed optimizer, torch's optimizer state in each rank
  // file keyed by a parameter's index in the concatenated param groups; bf16 models' main weights
  // in fp32_from_fp16_params[group][position].
  struct IndexedGroup {
    double wd_mult = 1;
    bool decoupled_lr = false;
    int64_t size = 0;
  };
  // The param groups saved in the rank file of tensor rank `tp`, pipeline rank `pp`.
  std::vector<IndexedGroup> indexed_groups(int tp, int pp) const;
  struct IndexedPiece {
    int pp = 0, group = 0;
    int64_t position = 0;               // within the group
    std::vector<int64_t> local_shape;   // the TP shard's shape, checked against the stored state
  };
  void set_indexed_placement(const std::string& name, std::vector<IndexedPiece> pieces,
                             std::vector<int64_t> global_shape, std::vector<ShardIndex> shards);

  struct Source;  // where a parameter's pieces are (format-specific)

 private:
  void open_torch();
  void open_torch_optimizer(const std::map<std::pair<int, int>, std::string>& rank_dirs, int tp, int pp);
  void open_torch_dist();
  void open_fsdp_dtensor();
  void rename_layer_keys(const std::function<std::optional<std::string>(const std::string&, const std::string&)>& to);
  void rename_mla_local_norms();
  void rename_moe_norms();

  std::string format_, directory_;
  int64_t iteration_ = 0;
  bool release_ = false;
  PickleRef args_;
  PickleRef common_;
  std::string optimizer_layout_ = "none";
  std::map<std::string, std::shared_ptr<const Source>> params_;
  std::map<std::string, std::shared_ptr<const Source>> optim_;  // "<state>/<name>"
  bool distributed_optimizer_ = false;
  bool flat_coalesced_ = false;
  std::map<std::pair<FlatBucket, std::string>, std::shared_ptr<const Source>> flat_;  // (bucket, state)
  struct Placement;
  std::map<std::string, std::shared_ptr<const Placement>> placements_;
  using PieceReader = std::function<std::optional<HostArray>(const std::string&)>;
  void place(const std::string& name, std::vector<PieceReader> readers, std::vector<int64_t> global_shape,
             std::vector<ShardIndex> shards);
  HostArray read_flat(const FlatPiece& piece, const std::string& state) const;
  std::optional<HostArray> read_indexed(int tp, const IndexedPiece& piece, const std::string& state) const;
  HostArray read(const Source& s, const std::string& name) const;
  // The box [offsets, offsets + region) of a torch_dist tensor; `what` goes into error messages.
  HostArray read_region(const Source& s, const std::vector<int64_t>& offsets, const std::vector<int64_t>& region,
                        const std::string& what) const;
  struct Files;
  std::shared_ptr<Files> files_;
};

// Megatron's args as values: the argument `name` of the namespace, or nullptr when absent or None;
// an int argument (`fallback` when absent or not an int); a switch (false when absent).
const PickleValue* megatron_arg(const PickleValue& args, const std::string& name);
int64_t megatron_int_arg(const PickleValue& args, const std::string& name, int64_t fallback);
bool megatron_bool_arg(const PickleValue& args, const std::string& name);

}  // namespace mt
