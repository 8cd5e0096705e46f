# --optimizer muon (engine/muon.h) over MPI equals one rank: the momentum's shards gathered over TP
# (a SwiGLU fc1 and a GQA QKV weight split into its query, key and value parts, the row-parallel
# weights gathered by columns), the experts' over their TP group under EP, the pipeline's stages
# each with their parameters, and with --use-distributed-optimizer the states sharded (the
# updates all-gathered over DP, the experts' over expert-DP); a run saved at DP2 resumes at TP2,
# and one saved with sharded states at DP2 resumes at DP3 (the momentum in the checkpoint).
# Float32 Newton-Schulz products (--muon-fp32-matmul-prec high): bfloat16 rounding would turn
# last-bit differences of the order of a sum into bfloat16 steps.
set(muon "--optimizer muon --muon-fp32-matmul-prec high --muon-extra-scale-factor 0.2")
set(muon_llama "${muon} --normalization RMSNorm --swiglu --position-embedding-type rope --untie-embeddings-and-output-weights \
--disable-bias-linear --group-query-attention --num-query-groups 2 --ffn-hidden-size 64")
megatrain_parallel_train_test(parallel_train_muon_llama_tp2_sp --model "${muon_llama}" 2 --tensor-model-parallel-size 2
                              --sequence-parallel)
megatrain_parallel_train_test(parallel_train_muon_nesterov_pp2_dp2_distopt --model "${muon} --muon-nesterov" 4
                              --pipeline-model-parallel-size 2 --use-distributed-optimizer --overlap-grad-reduce
                              --ddp-bucket-size 3000)
megatrain_parallel_train_test(parallel_train_muon_moe_ep2_tp2 --model "${moe_model} ${muon}" 4
                              --expert-model-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel)
megatrain_parallel_train_test(parallel_train_muon_moe_ep2_dp4_distopt --model "${moe_model} ${muon}" 4
                              --expert-model-parallel-size 2 --use-distributed-optimizer)
megatrain_parallel_train_test(parallel_train_muon_resume_dp2_to_tp2 --model "${muon_llama}" --resume 2 - 2
                              "--tensor-model-parallel-size 2")
megatrain_parallel_train_test(parallel_train_muon_resume_dp2distopt_to_dp3distopt --model "${muon_llama}" --resume
                              2 "--use-distributed-optimizer" 3 "--use-distributed-optimizer")
# ... with multi-latent attention (its up projections gathered over TP, the down projections whole
# on every rank), context parallelism (the gradients summed over DP x CP first), multi-token
# prediction under PP, and an interleaved pipeline with learned position embeddings (a 2-D
# parameter Muon takes, as Megatron-LM's rule does).
megatrain_parallel_train_test(parallel_train_muon_mla_tp2_sp --model "${mla_model} ${muon}" 2 --tensor-model-parallel-size 2
                              --sequence-parallel)
megatrain_parallel_train_test(parallel_train_muon_cp2_dp2 --model "${cp_llama_model} ${muon}" 4 --context-parallel-size 2)
megatrain_parallel_train_test(parallel_train_muon_mtp_pp2 --model "${mtp_model} ${muon}" 2 --pipeline-model-parallel-size 2)
megatrain_parallel_train_test(parallel_train_muon_pp2_vpp2 --model "${muon}" 2 --pipeline-model-parallel-size 2
                              --num-virtual-stages-per-pipeline-rank 2)
# ... and with two distributed-optimizer instances (the updates gathered within each instance).
megatrain_parallel_train_test(parallel_train_muon_dp4_distopt_instances2 --model "${muon}" 4 --use-distributed-optimizer
                              --num-distributed-optimizer-instances 2)
# ... with FP8 GEMMs (emulated on the reference backend, delayed scaling) over TP2 with SP, three
# iterations: an FP8 rounding-tie flip (tests/mpi/parallel_train_check.cpp) moves one gradient
# element, and Muon's orthogonalization spreads it over the whole matrix.
megatrain_parallel_train_test(parallel_train_muon_fp8_delayed_tp2_sp --fp8 --iters 3 --model
  "${muon} --fp8-format hybrid --fp8-amax-history-len 4 --fp8-amax-compute-algo max --no-bias-gelu-fusion"
  2 --tensor-model-parallel-size 2 --sequence-parallel)
# ... with Gated DeltaNet layers: the input projection gathered over TP by key heads (a row
# permutation of Megatron's gathered shards, which Newton-Schulz commutes with), the convolution's
# taps left to AdamW (a 3-D tensor in Megatron-LM).
megatrain_parallel_train_test(parallel_train_muon_gdn_tp2_sp --model "${gdn_model} ${muon}" 2
                              --tensor-model-parallel-size 2 --sequence-parallel)
