// --test-mode (Megatron-LM's real-time consistency test): the parameters every rank of a group
// must hold identically, compared across the data-parallel group and the tensor-parallel group.
// A difference (silent memory corruption, a bad checkpoint load, a corrupted transfer) stops the
// run on every rank of the group with the parameter, the two ranks and the norm of the difference.
//
// Megatron-LM runs the test in each attention forward with --qk-layernorm, on the q/k layernorm
// weights and biases; megatrain runs it on the same parameters before each training step's and
// each evaluation's forward passes (the parameters change only in the optimizer step, so that is
// the same test). Its buffers are allocated here, at set-up; a check allocates nothing.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace mt {

class Backend;
class Communicator;
class GptModel;
struct ParallelState;

class ReplicaCheck {
 public:
  // The q/k layernorm parameters of every chunk (none without --qk-layernorm: empty()).
  ReplicaCheck(ParallelState& ps, const std::vector<GptModel*>& chunks);
  ~ReplicaCheck();
  ReplicaCheck(const ReplicaCheck&) = delete;
  ReplicaCheck& operator=(const ReplicaCheck&) = delete;

  bool empty() const { return params_.empty(); }
  // Gathers the parameters over DP, then over TP, and fails naming the first difference.
  void run() const;

 private:
  struct Param {
    std::string name;
    Tensor t;
    int64_t offset;  // in the packed buffer
  };
  void compare(Communicator& group, const char* parallelism) const;

  ParallelState& ps_;
  Backend* be_ = nullptr;
  std::vector<Param> params_;
  DType dtype_ = DType::f32;
  int64_t numel_ = 0;
  void* packed_ = nullptr;    // this rank's parameters, one after the other
  void* gathered_ = nullptr;  // max(DP, TP) x packed
};

// --check-weight-hash-across-dp-replicas-interval N (Megatron-LM's
// check_param_hashes_across_dp_replicas, megatron/core/utils.py, called by
// megatron/training/training.py before the first iteration and after every N-th, between the
// evaluation and the checkpoint save): every parameter this rank holds is hashed where it lives
// (Backend::hash_bytes on device memory; with the distributed optimizer the model weights after
// their all-gather, which every DP replica holds whole), the hashes are all-gathered over the
// data-parallel group and each replica's are compared with DP rank 0's; the routed experts'
// (ParamDesc::expert) over the expert-data-parallel group instead, whose members hold the same
// experts (under expert parallelism a DP group's ranks hold different ones). Where they differ, every
// rank whose weights differ names the parameters (Megatron's "[Rank R] Hash not matching for NAME
// in model chunkC" lines) and then every rank of the run stops with one message naming the ranks
// and the iteration. Its buffers are allocated here, at set-up; a check allocates nothing.
class WeightHashCheck {
 public:
  // chunks empty: the check is off (enabled() false).
  WeightHashCheck(ParallelState& ps, const std::vector<GptModel*>& chunks);
  ~WeightHashCheck();
  WeightHashCheck(const WeightHashCheck&) = delete;
  WeightHashCheck& operator=(const WeightHashCheck&) = delete;

  bool enabled() const { return be_ != nullptr; }
  // Collective over every rank. The parameters must be current (Optimizer::wait_for_params).
  // When every replica agrees, rank 0 prints ">>> Weight hashes match after N iterations...";
  // else every rank fails with the same message.
  void run(int64_t iteration);

 private:
  struct Param {
    std::string name;
    int chunk;
    Tensor t;
  };
  // The parameters compared over one group (the dense ones over DP, the routed experts' over the
  // expert-data-parallel group) and its buffers.
  struct Group {
    Communicator* comm = nullptr;
    std::vector<Param> params;
    int64_t row = 0;            // 1 + parameters: [global rank, hash of each parameter]
    void* hashes = nullptr;     // int64 [row]
    void* gathered = nullptr;   // int64 [group size x row]
    std::vector<int64_t> host;  // the gathered rows
  };
  // Hashes the group's parameters, gathers them over its communicator and names those that differ
  // from its rank 0's; returns how many differ and sets `first` to that rank 0's global rank.
  int64_t compare(Group& g, int64_t& first);

  ParallelState& ps_;
  Backend* be_ = nullptr;
  Group dense_, experts_;
  void* verdict_ = nullptr;      // int64 [4]: this rank's verdict (below)
  void* verdicts_ = nullptr;     // int64 [world x 4]
  std::vector<int64_t> host_verdicts_;
};

}  // namespace mt
