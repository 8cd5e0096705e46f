// How megatrain's parameters map onto Megatron-LM's checkpoints, in both directions
// (import-megatron reads them, export-megatron writes them): the one place that says how a
// parameter is named in the local transformer spec's state dict and how Megatron splits it over
// tensor-parallel ranks.
//
// Names. megatrain uses Megatron-Core's names with Transformer Engine's fused norms and global
// layer numbers ("decoder.layers.7.self_attention.linear_qkv.layer_norm_weight"). The local spec
// (--transformer-impl local), whose state dicts the torch format holds, keeps the norms as modules
// of their own (input_layernorm, pre_mlp_layernorm), and numbers the layers of each model chunk
// from 0 (virtual stages as "model0", "model1", ... beside each other).
//
// Tensor-parallel splits (the torch format stores each rank's shard; torch_dist global tensors):
// linear_qkv (grouped per query group), linear_fc1, the word embeddings and the output layer by
// rows (an MTP depth's eh_proj too); linear_proj and linear_fc2 by columns; SwiGLU's fc1 by rows of each half, a rank holding
// [gate_t; up_t]; everything else (norms, biases of row-parallel layers, position embeddings)
// replicated.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/shard.h"

namespace mt {

enum class MegatronTpSplit { replicated, rows, columns, swiglu_rows };

// The split of parameter `name` (either naming) in a model with or without SwiGLU.
MegatronTpSplit megatron_tp_split(const std::string& name, bool swiglu);

// Where tensor rank `rank` of `tp` holds its shard of a tensor of `global_shape` split as `split`
// (a 1-D tensor of n is an [n, 1] matrix). Throws mt::Error naming `name` when the split dimension
// does not divide by tp.
ShardIndex megatron_tp_shard(MegatronTpSplit split, const std::vector<int64_t>& global_shape, int tp, int rank,
                             const std::string& name);
// The shard's shape as Megatron holds it (the global shape with the split dimension divided).
std::vector<int64_t> megatron_shard_shape(const ShardIndex& shard, const std::vector<int64_t>& global_shape);
// Mixture of experts: expert `expert`'s TP shard `rank` of `tp` of a layer's stacked experts
// (megatrain's mlp.experts.linear_fc{1,2}.weight, [E x rows, cols]), as Megatron's expert linear of
// that rank holds it: fc1's rows ([gate; up] halves with SwiGLU) split over TP as the dense fc1,
// fc2's columns.
ShardIndex megatron_expert_shard(bool fc1, const std::vector<int64_t>& global_shape, int experts, int expert,
                                 bool swiglu, int tp, int rank);

// "decoder.layers.12.mlp..." -> (12, "mlp..."); nullopt for names outside the layers.
std::optional<std::pair<int, std::string>> megatron_split_layer_name(const std::string& name);
// "mtp.layers.<j>.transformer_layer.<rest>" (torch_dist's key) or "mtp.layers.<j>.mtp_model_layer.<rest>"
// (the torch format's: the module's attribute) -> (j, rest); nullopt for any other name.
std::optional<std::pair<int, std::string>> megatron_split_mtp_layer_name(const std::string& name);

// An MoE layer's expert bias (Megatron's router buffer, float32 [E]) as megatrain's checkpoints name
// it: Megatron's name for decoder layer `layer`; MTP depth j is layer num_layers + j there.
std::string expert_bias_name(int layer);

// The part of a layer's parameter name after "decoder.layers.N.", from the local spec's naming
// (input_layernorm.weight) to megatrain's (self_attention.linear_qkv.layer_norm_weight), and back.
std::string megatron_te_layer_name(const std::string& local);
std::string megatron_local_layer_name(const std::string& te);

// The modules of the local spec whose state dict entry "<module>._extra_state" (None) follows their
// parameters: the tensor-parallel linear layers, `module` given as its name before ".weight"
// ("decoder.layers.0.mlp.linear_fc1", "output_layer").
bool megatron_has_extra_state(const std::string& module);

}  // namespace mt
