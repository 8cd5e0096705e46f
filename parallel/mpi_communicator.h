// Communicator over MPI on host buffers: the transport of the reference (CPU) backend when several
// ranks run under mpirun (`mpirun -np N megatrain --device cpu ...`).
//
// Every blocking wait is a non-blocking MPI call polled until the distributed timeout; past it the
// call throws mt::Error naming the group, the operation and the group's world ranks (it never
// hangs). After such an error the process must not call MPI_Finalize (a peer may never arrive):
// print the message and call mpi_abort(), which takes every rank of the job down.
//
// Element types: float32, float64, int32, int64, uint8 for everything; bfloat16 and float16 too (sum,
// max and min reduce in float32 and round once per combining step, like a ring of bf16 partial sums).
//
// MPI is initialized lazily by make_mpi_world_communicator(); megatrain runs without mpirun
// whenever it does not need MPI (single process, or NCCL on GPUs).
#pragma once

#include <memory>

#include "parallel/communicator.h"
#include "parallel/distributed_timeout.h"

namespace mt {

// True when an MPI launcher started this process (OMPI_COMM_WORLD_SIZE, PMI_SIZE or PMIX_RANK set).
bool launched_by_mpi();

// Initializes MPI if needed and returns MPI_COMM_WORLD as the group "world".
std::unique_ptr<Communicator> make_mpi_world_communicator(Millis timeout);

bool mpi_initialized();
// Normal exit: MPI_Finalize if MPI was initialized (no-op otherwise).
void mpi_finalize();
// Error exit of a multi-rank job: MPI_Abort on MPI_COMM_WORLD (every rank exits), or std::exit(code)
// when MPI is not initialized.
[[noreturn]] void mpi_abort(int code);

}  // namespace mt
