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

}  // namespace mt
