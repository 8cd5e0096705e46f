// Communicator: collectives and point-to-point transfers within one group of ranks.
// Implementations: NCCL (device buffers, ordered on the backend's stream), MPI (host buffers, for
// the reference backend) and Self (a group of one: no communication).
//
// Every rank of a group calls the same collectives in the same order. A collective that does not
// finish within the configured timeout (--distributed-timeout-minutes; after the first iteration
// --distributed-timeout-seconds-after-init where given) raises mt::Error naming the
// group and the operation; it never hangs.
#pragma once

#include <memory>
#include <string>

#include "core/tensor.h"
#include "parallel/distributed_timeout.h"

namespace mt {

enum class ReduceOp { sum, max, min };

// How a new group's collectives run (split()); NCCL reads it, host communicators ignore it.
struct GroupOptions {
  // NCCL CTAs (thread blocks, one per channel) per collective; 0: NCCL's choice. More CTAs move a
  // collective faster but leave fewer SMs to the kernels beside it.
  int ctas = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string name() const = 0;  // e.g. "tp", "dp", "world": used in error messages

  virtual void all_reduce(Tensor t, ReduceOp op = ReduceOp::sum) = 0;        // in place
  virtual void reduce_scatter(Tensor out, Tensor in, ReduceOp op = ReduceOp::sum) = 0;  // in: size x out, rank-major
  virtual void all_gather(Tensor out, Tensor in) = 0;                        // out: size x in, rank-major
  virtual void broadcast(Tensor t, int root) = 0;
  // Point to point. Between group_start() and group_end() sends and receives are issued together,
  // so that pairs of ranks exchanging in both directions cannot deadlock.
  virtual void send(Tensor t, int peer) = 0;
  virtual void recv(Tensor t, int peer) = 0;
  virtual void group_start() = 0;
  virtual void group_end() = 0;
  virtual void barrier() = 0;
  // Ranks with the same color form a new group, ordered by key (collective over this group).
  virtual std::unique_ptr<Communicator> split(int color, int key, const std::string& name,
                                              const GroupOptions& options) = 0;
  std::unique_ptr<Communicator> split(int color, int key, const std::string& name) {
    return split(color, key, name, GroupOptions{});
  }
  // The timeout of every later wait, for this communicator and every one split from the same world
  // (they share it: --distributed-timeout-seconds-after-init). A group of one waits for nothing.
  virtual void set_timeout(Millis timeout) { (void)timeout; }
  // NCCL: enqueue this communicator's later operations on `stream` (a cudaStream_t; e.g. the
  // backend's communication stream, so that data-parallel reductions overlap compute). The caller
  // orders the streams. Host communicators (MPI, a group of one) ignore it.
  virtual void set_stream(void* stream) { (void)stream; }
  // Symmetric memory (NCCL 2.28 windows, one host with NVLink between every pair of GPUs): a block
  // that every member allocates alike with allocate_symmetric and registers with this group
  // (register_symmetric, collective). All-gathers from and into a registered block then run on the
  // copy engines and use no SMs, so they can overlap a GEMM. allocate_symmetric returns nullptr
  // where that is not available (then use ordinary memory); deregister (collective) before freeing.
  virtual void* allocate_symmetric(size_t bytes) {
    (void)bytes;
    return nullptr;
  }
  virtual void free_symmetric(void* p) { (void)p; }
  virtual bool register_symmetric(void* p, size_t bytes) {  // false: not registered (kernels move it)
    (void)p;
    (void)bytes;
    return false;
  }
  virtual void deregister_symmetric(void* p) { (void)p; }
};

// A group of one rank.
std::unique_ptr<Communicator> make_self_communicator(const std::string& name = "self");

}  // namespace mt
