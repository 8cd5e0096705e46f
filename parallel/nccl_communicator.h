// Communicator over NCCL: device buffers, every operation enqueued on the backend's CUDA stream
// (host calls return at once; ordering with the kernels around them comes from the stream).
//
// Bootstrap without MPI: rank 0 calls ncclGetUniqueId and hands the 128 bytes to the other ranks
// over the TCP rendezvous at MASTER_ADDR:MASTER_PORT (parallel/tcp_rendezvous.h); before that the
// ranks exchange host name and GPU UUID, so two ranks on one GPU fail with a message naming them.
// Then every rank calls ncclCommInitRankConfig. Sub-groups get a fresh unique id from their first
// member over the parent (collective over the parent: every parent rank calls split(), in the same
// order). Communicators are blocking: a non-blocking one launches each collective from a thread
// created for it, which cost tens of microseconds per collective.
//
// No hangs: a watchdog thread (one per process) records a CUDA event after each operation and polls
// cudaEventQuery and ncclCommGetAsyncError, and it watches every blocking NCCL call in progress
// (initialization, enqueue, finalize) against its deadline. Past --distributed-timeout-minutes for
// one operation or call, or on an asynchronous NCCL error, it prints which group, which operation
// and which world ranks, calls ncclCommAbort on every communicator and exits the process with
// status 1. Every rank has its own watchdog, so every rank of a stuck job ends. (ncclCommDestroy
// could block forever on a hung collective; abort does not.)
//
// NVLink multicast stays off: NCCL_NVLS_ENABLE=0 is set before NCCL initializes unless the user set
// it. NVLink SHARP (NVLS) collectives use GPU multicast objects; on shared GPU hosts a program using
// them can put the host's GPUs out of service, and the collectives here gain little from them.
//
// Element types: bfloat16, float16, float32, float64, int32, int64, uint8.
#pragma once

#include <memory>

#include "parallel/communicator.h"
#include "parallel/distributed_timeout.h"

struct CUstream_st;  // cudaStream_t is CUstream_st*

namespace mt {

class TcpRendezvous;

// True when megatrain was built with CUDA and NCCL.
bool nccl_available();

// The world communicator of all rendezvous ranks on `device` (cudaSetDevice is called), with
// operations ordered on `stream`. Collective over all ranks.
std::unique_ptr<Communicator> make_nccl_world_communicator(TcpRendezvous& rendezvous, int device, CUstream_st* stream,
                                                           Millis timeout);

// How often the watchdog polls (default 100 ms; MEGATRAIN_NCCL_WATCHDOG_POLL_MS overrides).
Millis nccl_watchdog_poll_interval();

}  // namespace mt
