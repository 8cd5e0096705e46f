# The rerun state machine over MPI on 2 data-parallel ranks, the reference backend
# (engine/rerun_state_machine.h): with --error-injection-rate 2 one rank injects per iteration and
# both ranks must agree (one all-reduce) on re-running, continuing or stopping, never hanging.
set(rerun_mpi_args
    "--device cpu --mock-data --tokenizer-type NullTokenizer --vocab-size 64 --seq-length 16 \
--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 4 --lr 1e-2 --seed 7 --log-interval 1 \
--num-layers 2 --hidden-size 32 --num-attention-heads 4 --train-iters 6 --error-injection-rate 2")
# A persistent error in the fatal NaN check: both ranks save nothing (no --save) and exit 16.
add_test(NAME rerun_mpi_dp2_persistent_error_exits_16
         COMMAND sh -c "out=$(\"$0\" -n 2 \"$1\" ${rerun_mpi_args} --error-injection-type persistent_error 2>&1); rc=$?; \
echo \"$out\"; test $rc -eq 16 && echo \"$out\" | grep -q 'Saving a checkpoint and exiting now'"
                 ${MPIEXEC_EXECUTABLE} $<TARGET_FILE:megatrain>)
# A transient error in the (non-fatal) spiky-loss check: re-run, continue, finish with 0.
add_test(NAME rerun_mpi_dp2_transient_error_continues
         COMMAND sh -c "out=$(\"$0\" -n 2 \"$1\" ${rerun_mpi_args} --no-check-for-nan-in-loss-and-grad \
--check-for-spiky-loss 2>&1); rc=$?; echo \"$out\"; test $rc -eq 0 && \
echo \"$out\" | grep -q 'Continuing normal execution because failed validation was not fatal'"
                 ${MPIEXEC_EXECUTABLE} $<TARGET_FILE:megatrain>)
set_tests_properties(rerun_mpi_dp2_persistent_error_exits_16 rerun_mpi_dp2_transient_error_continues
  PROPERTIES LABELS mpi TIMEOUT 300
  ENVIRONMENT "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1;OMPI_MCA_rmaps_base_oversubscribe=1")
