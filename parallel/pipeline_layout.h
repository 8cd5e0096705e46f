// Pipeline layout: which transformer layers each pipeline stage (and each virtual stage, the
// "model chunks" of the interleaved schedule) holds. Megatron's rules:
//  - even split: every stage holds (L [+1 embedding] [+1 loss]) / PP layer slots, with
//    --account-for-embedding/loss-in-pipeline-split counting the embedding (first stage) or the
//    loss (last stage) as one slot;
//  - uneven: --decoder-first/last-pipeline-num-layers fix the first/last stage, the middle stages
//    split the rest evenly;
//  - interleaved (VPP = V chunks per stage): each stage's layers are cut into V equal chunks and
//    the model runs chunk (v, p) in the order v-major, p-minor, so with an even split chunk v of
//    stage p holds layers [(v*P + p)*Lc, (v*P + p + 1)*Lc), Lc = L / (P*V).
// The embedding lives on (pp 0, chunk 0); the final norm, output layer and loss on (pp P-1,
// chunk V-1).
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace mt {

struct Config;

struct PipelineSplit {
  int num_layers = 0;
  int pp = 1;
  int vpp = 1;  // model chunks per pipeline rank
  std::optional<int> first_stage_layers;  // --decoder-first-pipeline-num-layers
  std::optional<int> last_stage_layers;   // --decoder-last-pipeline-num-layers
  bool account_for_embedding = false;     // --account-for-embedding-in-pipeline-split
  bool account_for_loss = false;          // --account-for-loss-in-pipeline-split
  std::string vpp_flag = "--num-virtual-stages-per-pipeline-rank";  // named in error messages
  // --pipeline-model-parallel-layout, parsed: PP x VPP stages in model order (stage v * PP + p is
  // chunk v of pipeline rank p), each a string of 'E', 't', 'm' (multi-token prediction: only in the
  // stage with L, after its t's) and 'L'. Empty: the split follows the flags above.
  std::vector<std::string> layout;
  int mtp = 0;  // --mtp-num-layers (the layout's m's count them)

  static PipelineSplit from_config(const Config& cfg);
};

struct ModelChunk {
  int pp_rank = 0;
  int vp_stage = 0;
  int first_layer = 0;  // global index of its first transformer layer
  int num_layers = 0;   // may be 0 (a chunk holding only the embedding or the loss)
  bool has_embedding = false;  // word (and position) embeddings
  bool has_output = false;     // final norm, output layer and loss
};

// Megatron's layout string -> its stages ("E|(tt|)*2,tL" -> "E", "tt", "tt", "tL"): commas are
// dropped, "(...)*n" and then "x*n" unrolled, and the result split at '|'; a character other than
// E, L, t, m fails naming the flag.
std::vector<std::string> parse_pipeline_layout(const std::string& layout);

// Checks the split (mt::Error naming the flags and the rule) and returns every model chunk in
// model order (chunk 0 of stages 0..P-1, then chunk 1 of stages 0..P-1, ...).
std::vector<ModelChunk> pipeline_chunks(const PipelineSplit& split);

// The chunks of one pipeline rank, by virtual stage.
std::vector<ModelChunk> stage_chunks(const PipelineSplit& split, int pp_rank);

// Transformer layers held by each pipeline rank.
std::vector<int> layers_per_stage(const PipelineSplit& split);

}  // namespace mt
