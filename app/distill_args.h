// Knowledge distillation's settings (Megatron-LM's --export-kd-teacher-load with ModelOpt,
// megatron/post_training/model_builder.py and ModelOpt's distill plugin for Megatron), resolved
// while parsing, after the student's flags are validated:
//   * the distillation config (--export-kd-cfg, YAML): logit_layers, intermediate_layer_pairs,
//     skip_lm_loss, kd_loss_scale, logit_kl_temperature, with ModelOpt's defaults (logits only,
//     skip_lm_loss true, scale 1, temperature 1) without the flag;
//   * the teacher's model: the student's arguments with the teacher's model config applied
//     (--export-kd-teacher-model-config, else <--export-kd-teacher-load>/model_config.yaml where it
//     exists; keys are Megatron's argument names, e.g. num_layers: 3), parsed and validated as a
//     command line of its own;
//   * Megatron's refusals (--manual-gc, --tp-comm-overlap, --cross-entropy-fusion-impl te, an
//     interleaved pipeline) and what megatrain does not build yet, each in one line.
// The teacher's weights are loaded by app/train.cpp (a megatrain or a Megatron-LM checkpoint).
#pragma once

#include <string>
#include <vector>

#include "app/flags.h"
#include "core/environment.h"

namespace mt::cli {

// Fills st.cfg.train.distill from the flags given (a no-op without --export-kd-teacher-load).
// args: the command line as given (the teacher's is made from it).
void derive_distillation(CliState& st, const std::vector<std::string>& args, const Environment& env);

}  // namespace mt::cli
