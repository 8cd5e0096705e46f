// Where Megatron's distributed optimizer keeps each parameter's state in its default torch_dist
// layout ("dp_reshardable": one flat buffer per model-parallel rank, model chunk, bucket and state),
// worked out from the model, since the checkpoint does not record it.
//
// Megatron-Core's DistributedDataParallel lays out each model chunk's parameters in a buffer:
//  * in reverse registration order (the order gradients arrive in backward);
//  * each parameter's start rounded up to a multiple of 64 elements;
//  * a bucket closes after the parameter that brings it to the bucket size, or at the end;
//  * the tied word-embedding copies of a pipelined model (Megatron marks them `shared_embedding`)
//    get a bucket of their own.
// The checkpoint stores each bucket up to its last parameter's end (the "unpadded" size). The
// bucket size follows from several flags (--ddp-bucket-size, --ddp-num-buckets,
// --overlap-grad-reduce, the pipeline rank, the chunk). Rather than repeat those rules, each bucket
// is closed where its stored size says; a parameter that would run past that end means the model
// megatrain derived is not the one that was saved.
//
// Registration order is the module tree's: the embeddings (word, position), then each layer, then
// the final norm and the output layer. A layer registers its input norm, attention (linear_proj,
// then linear_qkv, then the q and k norms), its pre-MLP norm and MLP (fc1, fc2); with Transformer
// Engine the input norm belongs to linear_qkv (TE's LayerNormLinear registers layer_norm_weight and
// layer_norm_bias before its weight and bias) and so comes after linear_proj. Parameters of the
// same size in a different order would place without complaint, so the import also checks every
// parameter's main weights against its model weights.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace mt {

struct Config;
struct HostArray;
struct PickleValue;
struct PipelineSplit;
class MegatronCheckpoint;

struct FlatParam {
  std::string name;  // "" for a slot that holds no parameter of its own (the tied output copy)
  int64_t numel = 0;
  bool shared_embedding = false;
  bool weight_decay = true;          // Megatron's param group: biases and 1-D parameters have none
  std::vector<int64_t> local_shape;  // the TP shard's shape as Megatron holds it
  // Mixture of experts: one routed expert's part of `name` (megatrain's stacked experts), which
  // Megatron holds as a parameter of its own; -1 otherwise.
  int expert = -1;
};
struct FlatSlot {
  int bucket = 0;
  int64_t offset = 0;  // within the bucket
};

// The slots of `params` (registration order, one model chunk) in buckets whose stored sizes are
// `bucket_sizes`. Throws mt::Error naming `what` when the parameters do not fill them exactly.
std::vector<FlatSlot> megatron_flat_slots(const std::vector<FlatParam>& params, const std::vector<int64_t>& bucket_sizes,
                                          const std::string& what);

// The unpadded sizes of the buckets Megatron makes of `params` (registration order, one model
// chunk) with `bucket_size` (nullopt: one bucket, as without --overlap-grad-reduce, on later
// pipeline stages and for later chunks): for the torch format's distrib_optim.pt, which stores a
// chunk's buckets end to end without their sizes.
std::vector<int64_t> megatron_flat_bucket_sizes(const std::vector<FlatParam>& params, std::optional<int64_t> bucket_size);

// The bucket size Megatron uses for chunk `chunk` of pipeline rank `pp_rank` of a run with `args`
// (a checkpoint's saved args; training.py's bucket-size rule: --ddp-bucket-size, else 40M elements
// or 1M per data-parallel rank, with --overlap-grad-reduce on the first pipeline stage's first
// chunk only); nullopt for one bucket. Throws for --ddp-num-buckets, whose sizes are not rebuilt.
std::optional<int64_t> saved_bucket_size(const PickleValue& args, int pp_rank, int chunk);

// The parameters of `cfg`'s model in Megatron's registration order for one model chunk on tensor
// rank `tp_rank` of `tp` (numel of that rank's shard). `te_spec`: saved by Transformer Engine's
// layer spec (--transformer-impl transformer_engine, Megatron's default) rather than the local one.
std::vector<FlatParam> megatron_chunk_params(const Config& cfg, int tp, int tp_rank, int first_layer, int num_layers,
                                             bool has_embedding, bool has_output, bool pipelined, bool te_spec);

// The torch format's non-distributed optimizer: places every parameter of `cfg`'s model at its
// index in `ck`'s rank files (MegatronCheckpoint::set_indexed_placement). Megatron numbers the
// parameters of a rank through its param groups: those with weight decay, then those without,
// each in registration order over the rank's model chunks. Returns "" or why not.
std::string place_indexed_optimizer_state(MegatronCheckpoint& ck, const Config& cfg, int tp, const PipelineSplit& split,
                                          bool te_spec);

// Places every parameter of `cfg`'s model in `ck`'s flat buffers (MegatronCheckpoint::
// set_flat_placement), the model saved with tensor parallel `tp` and pipeline split `split`.
// Returns "" when done, or why the stored buffers do not fit the model (then nothing is placed).
std::string place_flat_optimizer_state(MegatronCheckpoint& ck, const Config& cfg, int tp, const PipelineSplit& split,
                                       bool te_spec);

// An optimizer's float32 main weights of `name` against its model weights: the same
// values, or them rounded to bf16. Throws mt::Error naming the parameter, how many elements differ
// and --weights-only otherwise (a parameter whose state came from the wrong place fails here).
void check_main_weights(const HostArray& main, const HostArray& model, const std::string& name, const std::string& where);

}  // namespace mt
