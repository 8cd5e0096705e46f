// Muon (--optimizer muon): Megatron-LM's TensorParallelMuon over emerging_optimizers 0.3, on the
// Backend's ops, so both backends run the same code.
//
// Which parameters: Megatron-LM's rule, every 2-D parameter except the word embeddings and the
// output layer (so also learned position embeddings, the MoE router and the shared expert's gate);
// the others take AdamW with Megatron's parameter groups. Each routed expert is its own matrix. The
// fused QKV weight is orthogonalized as its query, (gate,) key and value parts unless
// --muon-no-split-qkv.
//
// One step of a Muon parameter p with gradient g (after clipping), momentum buffer m, the group's
// learning rate lr and weight decay wd, momentum mu (decoupled weight decay, as the optimizer's
// WeightDecayMixin applies it, first):
//   p -= lr wd p;  m = mu m + (1 - mu) g;  u = nesterov ? (1 - mu) g + mu m : m;
//   p -= lr * scale(rows, cols) * extra * NS(u)
// NS (Newton-Schulz): X = u / max(|u|_F, 1e-7) (the norm read on the stream, no host wait; over
// the smaller dimension: u transposed when it has more rows than columns), then for each step's coefficients (a, b, c): A = X X^T,
// X = a X + (b A + c A A) X. --muon-fp32-matmul-prec medium runs these on bfloat16 values, as
// Megatron-LM does (X rounded to bfloat16 after the normalization and every product and sum
// rounded to it); high keeps float32 (Megatron-LM: TF32 products on a GPU).
//
// Under TP (duplicated and distributed modes: the whole matrix's NS, the same update as one rank)
// every TP rank all-gathers the matrix's shards and runs the whole NS, then applies its own shard:
// Megatron-LM's duplicated mode (its distributed mode splits the NS products over the ranks; the
// update is the same up to rounding). blockwise: each shard alone, scaled by its own shape.
// With the distributed optimizer the states are sharded as AdamW's (ZeRO-1): each DP rank updates
// the momentum of its shards, the updates u are all-gathered, each DP rank orthogonalizes its share
// of the matrices, and the results are reduce-scattered back to the shards (Megatron-LM's
// layer-wise distributed optimizer gives each rank whole parameters instead; the update is the same).
// The momentum buffer is the first optimizer-state buffer (Adam's exp_avg for the other parameters).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "core/config.h"
#include "engine/backend.h"
#include "engine/model_dims.h"
#include "engine/param_layout.h"

namespace mt {

class Communicator;

// (a, b, c) of one Newton-Schulz step.
using MuonCoefficients = std::array<float, 3>;
bool muon_coefficients_known(const std::string& type);
std::string muon_coefficient_types();  // the names, comma-separated
// The coefficients of `steps` steps: the type's list cycled (simple, quintic, aol) or with its
// last entry repeated (polar_express, cans, deepseekv4), as emerging_optimizers iterates them.
std::vector<MuonCoefficients> muon_coefficients(const std::string& type, int steps);

bool muon_param(const ParamDesc& p);
// The update's scale for a [rows, cols] matrix (--muon-scale-mode).
double muon_scale(MuonScaleMode mode, int64_t rows, int64_t cols);

// One matrix Muon orthogonalizes, in a parameter's local block (rows of `cols` elements): pieces
// rows long, the first at local row row0, each `stride` rows after the last (a QKV part: one piece
// per local query group; else one piece), gathered over the TP group along shard_dim (0: rows,
// 1: columns, -1: not gathered) into a [global_rows, global_cols] matrix.
struct MuonMatrix {
  int param = 0;  // index in the model's parameters
  int64_t row0 = 0, rows = 0, stride = 0, cols = 0;
  int pieces = 1;
  int shard_dim = -1;
  int64_t global_rows = 0, global_cols = 0;
  int64_t local_rows() const { return rows * pieces; }
};
// The matrices of a chunk's Muon parameters; tp: the size of the group the parameters' shards
// are gathered over (1: none). Refuses what it cannot gather (an expert TP size other than 1 or TP).
std::vector<MuonMatrix> muon_matrices(const std::vector<ParamDesc>& params, const ModelDims& d, const MuonConfig& cfg);
// Elements (of the master weights' dtype) of the workspace muon_orthogonalize needs for these.
int64_t muon_workspace_elements(const std::vector<MuonMatrix>& matrices, const MuonConfig& cfg);

// NS of x [rows, cols] in place (float32 or float64). work: at least newton_schulz_workspace
// elements of x's dtype.
void newton_schulz(Backend& be, Tensor x, Tensor work, const MuonConfig& cfg);
int64_t newton_schulz_workspace(int64_t rows, int64_t cols, const MuonConfig& cfg);

// The views one chunk's update works on: grad, the flat gradient buffer (float32 like the master
// weights: Muon leaves its update there), and the workspace (muon_workspace_elements of the
// master weights' dtype).
struct MuonViews {
  Tensor grad, workspace;
};
// A piece of the flat buffers this rank updates (the whole buffer, or with the distributed
// optimizer its shard of a bucket): its flat range and its views of the master weights, the
// momentum and the compute-dtype parameters (empty: the parameters are the master weights).
// Master weights kept as int16 remainders beside bf16 parameters (core/master_remainder.h, with
// `ties` to nearest even): each update joins a piece into float32 in the workspace, updates it
// there as a float32 master weight, and splits it back.
struct MuonRange {
  int64_t flat_offset = 0, numel = 0;
  Tensor master, momentum, model_copy;
  TieBits ties;
};
// A Muon step in three phases. With the distributed optimizer each bucket's updates are
// all-gathered from the shards after the first, and reduce-scattered back to them after the second.
//   muon_momentum: on this rank's pieces of the Muon parameters, p -= lr wd p, the momentum from
//     the gradient times grad_scale (the clipped gradient), and the update u (Nesterov's or the
//     momentum) written over the gradient;
//   muon_orthogonalize: per matrix this rank owns, u gathered over TP, orthogonalized and scaled,
//     written over u's rows; the rows of the matrices it does not own zeroed (so the reduce-scatter
//     hands every shard its owner's result: the orthogonalization is split over the data-parallel
//     ranks, as Megatron-LM's layer-wise distributed optimizer splits it);
//   muon_apply: p -= lr times that, on this rank's pieces, and their compute-dtype copies.
// lr, wd: per parameter (the optimizer's groups). tp: the group a sharded matrix's shards are
// gathered over (the experts' too: muon_matrices gathers them only when their TP group is TP's).
void muon_momentum(Backend& be, const MuonConfig& cfg, const std::vector<ParamDesc>& params, const MuonViews& v,
                   const std::vector<MuonRange>& ranges, const std::vector<float>& lr, const std::vector<float>& wd,
                   float grad_scale);
void muon_orthogonalize(Backend& be, const MuonConfig& cfg, const std::vector<ParamDesc>& params,
                        const std::vector<MuonMatrix>& matrices, const std::vector<char>& owned, const MuonViews& v,
                        Communicator* tp);
void muon_apply(Backend& be, const std::vector<ParamDesc>& params, const MuonViews& v,
                const std::vector<MuonRange>& ranges, const std::vector<float>& lr);
// Which matrices this rank orthogonalizes: dealt round-robin over the group its parameter's
// buckets are sharded over (the routed experts' group, or the dense one), in order.
std::vector<char> muon_owned(const std::vector<ParamDesc>& params, const std::vector<MuonMatrix>& matrices,
                             int dense_rank, int dense_size, int expert_rank, int expert_size);

// A range's AdamW segments without the Muon parameters (offsets relative to flat_offset).
std::vector<OptimSegment> without_muon_params(const std::vector<OptimSegment>& segments,
                                              const std::vector<ParamDesc>& params, int64_t flat_offset);

}  // namespace mt
