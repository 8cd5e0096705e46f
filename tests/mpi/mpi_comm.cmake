# MPI communicator: every collective, split groups and p2p rings on 2, 3 and 8 ranks (8 are
# oversubscribed on CI's 2 cores: the test is tiny), and the timeout errors: a rank that never joins
# a collective, or never sends, must end the job within seconds with a message naming the group
# and the operation.
megatrain_mpi_test(mpi_comm_collectives_np2 2 $<TARGET_FILE:mpi_comm_test> collectives)
megatrain_mpi_test(mpi_comm_collectives_np3 3 $<TARGET_FILE:mpi_comm_test> collectives)
megatrain_mpi_test(mpi_comm_collectives_np8 8 $<TARGET_FILE:mpi_comm_test> collectives)
megatrain_mpi_failure_test(mpi_comm_timeout_collective 3 60
  "timed out after 1 s waiting for all_reduce.*group 'world'"
  -x MEGATRAIN_DISTRIBUTED_TIMEOUT_SECONDS=1 $<TARGET_FILE:mpi_comm_test> timeout-collective)
megatrain_mpi_failure_test(mpi_comm_timeout_recv 2 60
  "timed out after 1 s waiting for recv from rank 1.*group 'world'"
  -x MEGATRAIN_DISTRIBUTED_TIMEOUT_SECONDS=1 $<TARGET_FILE:mpi_comm_test> timeout-recv)
