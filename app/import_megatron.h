// megatrain import-megatron --load MEGATRON_DIR --save CKPT [--ckpt-step N]
//   A Megatron-LM checkpoint (torch or torch_dist format, any TP/PP layout; checkpoint/
//   megatron_checkpoint.h reads it) as a megatrain release checkpoint of the same weights, and the
//   Megatron flags of its model (from the checkpoint's saved args).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/config.h"

namespace mt {

struct MegatronImportResult {
  std::string format;  // "torch" or "torch_dist"
  int64_t iteration = 0;
  int tensors = 0;
  ModelConfig model;
  std::vector<std::string> model_flags;      // e.g. --num-layers 2 --hidden-size 128 ...
  std::vector<std::string> tokenizer_flags;  // as saved (paths on the machine that trained)
};

MegatronImportResult import_megatron(const std::string& load_dir, std::optional<int64_t> ckpt_step,
                                     const std::string& save_dir);
int import_megatron_main(const std::vector<std::string>& args);

}  // namespace mt
