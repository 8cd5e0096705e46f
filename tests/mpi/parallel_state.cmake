# build_parallel_state over MPI: groups are exactly Megatron's (its 8-rank TP2 PP2 DP2
# example, its --use-tp-pp-dp-mapping twin, TP1 PP4 DP2 with first+last-stage embedding groups, DP3,
# PP2; TP2 DP4 with --num-distributed-optimizer-instances 2), sums within each group cover exactly its members, pp/pp_grad exchange both ways at once.
megatrain_mpi_test(parallel_state_tp2_pp2_dp2 8 $<TARGET_FILE:parallel_state_test> 2 2)
megatrain_mpi_test(parallel_state_tp2_pp2_dp2_tp_pp_dp 8 $<TARGET_FILE:parallel_state_test> 2 2 tp-pp-dp)
megatrain_mpi_test(parallel_state_pp4_dp2 8 $<TARGET_FILE:parallel_state_test> 1 4)
megatrain_mpi_test(parallel_state_dp3 3 $<TARGET_FILE:parallel_state_test> 1 1)
megatrain_mpi_test(parallel_state_pp2 2 $<TARGET_FILE:parallel_state_test> 1 2)
megatrain_mpi_test(parallel_state_tp2_dp4_2instances 8 $<TARGET_FILE:parallel_state_test> 2 1 instances=2)
