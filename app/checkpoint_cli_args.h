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
// (with Megatron's message). megatrain also takes what Megatron's list lacks but which changes what
// the model computes: --qk-layernorm (parameters), --norm-epsilon, --use-rope-scaling,
// --rope-scaling-factor, --openai-gelu and --no-bias-gelu-fusion (the GeLU approximation), so that
// a checkpoint's model is rebuilt as it was trained. import-hf's release checkpoints carry the
// flags of the model they hold (app/hf_commands.h), so --use-checkpoint-args works on them too.
// Non-persistent checkpoints (--non-persistent-ckpt-type global) count as checkpoint_to_load does.
#pragma once

#include "app/flags.h"

namespace mt::cli {

// Applies the checkpoint's arguments to st.given when --use-checkpoint-args is there. Fails when
// neither --load nor --pretrained-checkpoint is given.
void apply_checkpoint_args(CliState& st);

}  // namespace mt::cli
