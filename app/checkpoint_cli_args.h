// Megatron's --use-checkpoint-args (and --use-mp-args-from-checkpoint-args): the model's arguments
// come from the checkpoint being loaded (megatron/training/checkpointing.py load_args_from_checkpoint),
// read from its manifest's resolved flags (app/checkpoint_args.h) while parsing, before derivation
// and validation, exactly as if they had been given on the command line:
//   * most are forced: the checkpoint's value replaces the command line's (normalization, SwiGLU,
//     biases, position embeddings, query groups, dropouts, ...), the tokenizer's type and model
//     too unless --no-use-tokenizer-model-from-checkpoint-args;
//   * the sizes (--num-layers, --hidden-size, --ffn-hidden-size, --seq-length,
//     --num-attention-heads, --kv-channels, --max-position-embeddings) only fill what the command
//     line left out;
//   * with --use-mp-args-from-checkpoint-args also the tensor and pipeline sizes (forced) and the
//     virtual pipeline split (filled in).
// Each value taken prints "Setting <arg> to <value> from checkpoint". A checkpoint directory
// without a checkpoint, or a checkpoint without saved flags, leaves the command line as it is
// (with Megatron's message). megatrain also takes --qk-layernorm, which Megatron's list lacks but
// which changes the parameters.
#pragma once

#include "app/flags.h"

namespace mt::cli {

// Applies the checkpoint's arguments to st.given when --use-checkpoint-args is there. Fails when
// neither --load nor --pretrained-checkpoint is given.
void apply_checkpoint_args(CliState& st);

}  // namespace mt::cli
