// Megatron-LM checkpoints (../shared/reference/megatron.md section 5), read without Python: the
// tracker file, the iteration directory, the saved `args`, and every model parameter as one
// global tensor under its Megatron-Core name with global layer numbers (megatrain's own names).
//
// Both of Megatron's formats:
//  * torch (legacy): iter_N/mp_rank_TT[_PPP]/model_optim_rng.pt, one torch.save'd dict per
//    tensor x pipeline rank. Tensors are TP shards, layer numbers are local to their pipeline stage
//    (virtual stages as model0, model1, ...), and the local transformer spec names its norms
//    input_layernorm / pre_mlp_layernorm where Transformer Engine fuses them into linear_qkv /
//    linear_fc1. Shards are joined as Megatron splits them: QKV (grouped per query group), fc1,
//    embedding and output rows; proj and fc2 columns; SwiGLU's fc1 shards are [gate_i; up_i] and
//    become [gate; up].
//  * torch_dist (the default): PyTorch Distributed Checkpoint (.metadata + __R_K.distcp, each
//    stored item a torch.save archive) with global, unsharded keys; the transformer layers are
//    stacked along a leading dimension ("decoder.layers.mlp.linear_fc1.weight" is [L, 2f, h]) and
//    stored as chunks, which are assembled here. The args come from the common state (common.pt
//    in older versions, a "common_state" item in newer ones).
// Optimizer state is read where Megatron stores it under parameter names: torch_dist checkpoints
// of the non-distributed optimizer ("optimizer.state.{exp_avg,exp_avg_sq,fp32_param}.<param>",
// the Adam step as the common state's optimizer.state.common_step). The distributed optimizer's
// default layout (flat per-bucket buffers) and the torch format's index-keyed state are not.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/hf_names.h"
#include "checkpoint/pickle.h"

namespace mt {

class MegatronCheckpoint {
 public:
  // `load_dir` as Megatron's --load, `ckpt_step` as its --ckpt-step. Throws naming the directory
  // when it holds no Megatron checkpoint, or one in a format megatrain does not read.
  MegatronCheckpoint(const std::string& load_dir, std::optional<int64_t> ckpt_step);
  ~MegatronCheckpoint();

  const std::string& format() const { return format_; }  // "torch" or "torch_dist"
  const std::string& directory() const { return directory_; }
  int64_t iteration() const { return iteration_; }  // 0 for a release checkpoint
  bool release() const { return release_; }
  // The saved argparse.Namespace (an object whose state is a dict of argument names).
  const PickleValue& args() const { return *args_; }

  // The model's parameters (global names), sorted; and one as a dense global tensor.
  std::vector<std::string> parameter_names() const;
  HostArray parameter(const std::string& name) const;

  // The common (non-sharded) state: iteration, opt_param_scheduler, optimizer (param groups,
  // common_step), num_floating_point_operations_so_far; nullptr for the torch format.
  const PickleValue* common_state() const { return common_.get(); }
  // How the optimizer state is stored: "by parameter" (readable), "none", or a description of a
  // layout megatrain does not read.
  const std::string& optimizer_layout() const { return optimizer_layout_; }
  // `state` ("exp_avg", "exp_avg_sq", "fp32_param") of a parameter, as parameter(); nullopt when
  // the checkpoint has none for it (fp32_param of a float32 model).
  std::optional<HostArray> optimizer_state(const std::string& state, const std::string& name) const;
  // Adam's step count (the common state's optimizer.state.common_step); nullopt when the state
  // has none (an optimizer that never stepped).
  std::optional<int64_t> optimizer_step() const;

  struct Source;  // where a parameter's pieces are (format-specific)

 private:
  void open_torch();
  void open_torch_dist();

  std::string format_, directory_;
  int64_t iteration_ = 0;
  bool release_ = false;
  PickleRef args_;
  PickleRef common_;
  std::string optimizer_layout_ = "none";
  std::map<std::string, std::shared_ptr<const Source>> params_;
  std::map<std::string, std::shared_ptr<const Source>> optim_;  // "<state>/<name>"
  HostArray read(const Source& s, const std::string& name) const;
  struct Files;
  std::shared_ptr<Files> files_;
};

// Megatron's args as values: the argument `name` of the namespace, or nullptr when absent or None;
// an int argument (`fallback` when absent or not an int); a switch (false when absent).
const PickleValue* megatron_arg(const PickleValue& args, const std::string& name);
int64_t megatron_int_arg(const PickleValue& args, const std::string& name, int64_t fallback);
bool megatron_bool_arg(const PickleValue& args, const std::string& name);

}  // namespace mt
