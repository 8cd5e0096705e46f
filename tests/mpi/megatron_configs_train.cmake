# Megatron-LM's own training configurations, trained: bench/megatron_configs.py --train 2
# --train-max-ranks 8 --write-train-fixture wrote every configuration of at most 8 ranks that passes
# the dry run as it trains for two iterations on the reference backend at shrunk widths
# (tests/fixtures/megatron_configs_train.txt: all 207 of them trained; the two distillation tests'
# lines were added by --only distill, each with a teacher of its own model made first). These, one
# per kind of run, train here on their layouts' ranks and must finish with their last iteration and an evaluation.
set(megatron_configs_trained
  gpt/gpt3_15b_8t_release_sm_gb200                                   # TP 4 x PP 2 interleaved, samples schedule
  gpt/gpt3_mcore_te_tp1_pp1_dist_optimizer_fim_dataset               # fill-in-the-middle data
  gpt/gpt3_mcore_te_tp1_pp4_vp2_account_for_embedding_loss_in_pipeline_split
  gpt/gpt3_mcore_te_tp1_pp4_vp1_tunable_overlap                      # micro-batch groups of 5
  gpt/gpt3_mcore_te_tp2_pp2_cp2_etp4_calculate_per_token_loss_dp_last # CP 2, rank order tp-cp-ep-pp-dp
  gpt/gpt3_weekly_mcore_tp4_cp2_current_scaling_native_fp8_tp_sp_cp_tp_overlap
  gpt/gpt3_mcore_te_tp2_zp_z3_resume_fsdp_dtensor                    # Megatron-FSDP ZeRO-3
  gpt/gpt3_mcore_te_tp2_pp2_mla                                      # multi-latent attention
  gpt/gpt3_mcore_te_tp2_pp1_modelopt_distill_resume                  # knowledge distillation (ModelOpt)
  moe/gpt3_moe_mcore_te_ep8_resume_torch_dist_muon                   # EP 8, Muon, weight-hash checks
  moe/gpt3_mcore_te_tp2_pp1_te_a2a_ovlp_8experts_etp1_ep4            # expert TP 1 under TP 2
  moe/gpt3_mcore_tp2_cp2_pp2_ep2_te_4experts2parallel
  moe/deepseek_proxy_fsdp_ep2_fsdp2_ep_overlap                       # MLA, FSDP (ZeRO-3) with EP 2
  examples/llama/train_llama3_8b_h100_fp8.sh                         # FP8 (emulated)
  examples/gptoss/02_train.sh)                                       # gpt-oss: windows, quick GeGLU, MoE on PP 4
foreach(config IN LISTS megatron_configs_trained)
  string(REGEX REPLACE "[^A-Za-z0-9_]" "_" test_name "${config}")
  add_test(NAME megatron_config_train_${test_name}
           COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/megatron_config_train.sh
                   ${CMAKE_CURRENT_SOURCE_DIR}/fixtures/megatron_configs_train.txt ${config} ${MPIEXEC_EXECUTABLE}
                   $<TARGET_FILE:megatrain> ${PROJECT_SOURCE_DIR}
                   ${CMAKE_CURRENT_BINARY_DIR}/megatron_config_train/${test_name}
           WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
  set_tests_properties(megatron_config_train_${test_name} PROPERTIES LABELS mpi
    ENVIRONMENT "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1;OMPI_MCA_rmaps_base_oversubscribe=1;OMPI_MCA_mpi_yield_when_idle=1")
endforeach()
