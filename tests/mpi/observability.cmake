# Dry-run memory estimate == the training run's plan, report_memory and the level-2 timer report
# (p2p timers) over MPI on 4 ranks (TP 2 x PP 2), the reference backend: tests/mpi/observability_check.cpp.
add_test(NAME observability_tp2_pp2
         COMMAND $<TARGET_FILE:observability_check> $<TARGET_FILE:megatrain> ${MPIEXEC_EXECUTABLE}
                 ${CMAKE_BINARY_DIR}/observability/tp2_pp2
         WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
set_tests_properties(observability_tp2_pp2 PROPERTIES LABELS mpi TIMEOUT 300
  ENVIRONMENT "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1;OMPI_MCA_rmaps_base_oversubscribe=1")
