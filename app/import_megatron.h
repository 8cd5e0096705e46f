// megatrain import-megatron --load MEGATRON_DIR --save CKPT [--ckpt-step N]
//   A Megatron-LM checkpoint (torch or torch_dist format, any TP/PP layout; checkpoint/
//   megatron_checkpoint.h reads it) as a megatrain release checkpoint of the same weights, and the
//   Megatron flags of its model (from the checkpoint's saved args). Where the checkpoint holds
//   Adam's state in a layout megatrain reads (torch_dist, bf16 or float32: the non-distributed
//   optimizer's, or the distributed optimizer's flat buckets or fully reshardable tensors), the
//   result is a full checkpoint at the same iteration that training resumes from as Megatron's
//   --load would (Adam moments and step, float32 main weights, LR scheduler, consumed samples);
//   otherwise, or with --weights-only, a release checkpoint of the weights (iteration 0, fresh
//   optimizer, as Megatron's --finetune).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "core/config.h"
#include "engine/param_layout.h"

namespace mt {

struct MegatronImportResult {
  std::string format;  // "torch", "torch_dist", "fsdp_dtensor" or "torch_dcp"
  int64_t iteration = 0;
  int tensors = 0;
  bool resumable = false;      // a full checkpoint at `iteration` (else a release checkpoint)
  std::string weights_only_reason;  // why not, when not asked for by --weights-only
  // Where the optimizer state came from (resumable only): e.g. "the distributed optimizer's flat
  // buckets (torch_dist)".
  std::string optimizer_source;
  ModelConfig model;
  std::vector<std::string> model_flags;      // e.g. --num-layers 2 --hidden-size 128 ...
  std::vector<std::string> tokenizer_flags;  // as saved (paths on the machine that trained)
};

// The result is written in parts of at most max_part_bytes of tensors (one file set each), so
// that memory holds one part at a time.
MegatronImportResult import_megatron(const std::string& load_dir, std::optional<int64_t> ckpt_step,
                                     const std::string& save_dir, bool weights_only = false,
                                     uint64_t max_part_bytes = uint64_t{4} << 30);
int import_megatron_main(const std::vector<std::string>& args);

// Whether `load_dir` (as --load names it) holds a Megatron-LM checkpoint rather than megatrain's.
bool is_megatron_checkpoint(const std::string& load_dir, std::optional<int64_t> ckpt_step);
// A model's weights straight from a Megatron-LM checkpoint (a distillation teacher's; `flag` names
// the directory's flag in errors): the model its args describe must be `model`
// (check_checkpoint_model), and every tensor must be one of `descs`; fill(i, values) gets this rank's
// block of descs[i] (ParamDesc::shard) as float32.
void read_megatron_weights(const std::string& load_dir, const ModelConfig& model, const std::string& flag,
                           const std::vector<ParamDesc>& descs,
                           const std::function<void(size_t, const std::vector<float>&)>& fill);

}  // namespace mt
