# Multi-rank training on the reference backend over MPI equals one-rank training (same losses,
# gradient norms, parameter norms every iteration, same final parameters and optimizer states):
# tests/mpi/parallel_train_check.cpp runs the real megatrain binary both ways. Tiny model, 8
# iterations; up to 8 ranks oversubscribed on CI's 2 cores.
function(megatrain_parallel_train_test name)
  add_test(NAME ${name}
           COMMAND $<TARGET_FILE:parallel_train_check> $<TARGET_FILE:megatrain> ${MPIEXEC_EXECUTABLE}
                   ${CMAKE_BINARY_DIR}/parallel_train/${name} ${ARGN}
           WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
  set_tests_properties(${name} PROPERTIES LABELS mpi TIMEOUT 300
    ENVIRONMENT "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1;OMPI_MCA_rmaps_base_oversubscribe=1")
endfunction()

megatrain_parallel_train_test(parallel_train_tp2 2 --tensor-model-parallel-size 2)
megatrain_parallel_train_test(parallel_train_tp2_sp 2 --tensor-model-parallel-size 2 --sequence-parallel)
megatrain_parallel_train_test(parallel_train_pp2 2 --pipeline-model-parallel-size 2)
megatrain_parallel_train_test(parallel_train_pp2_vpp2 2 --pipeline-model-parallel-size 2
                              --num-virtual-stages-per-pipeline-rank 2)
# The optimizer's update beside the next forward (MEGATRAIN_OPTIMIZER_OVERLAP=1, both runs): two
# chunks per rank, each cut into its own pieces.
megatrain_parallel_train_test(parallel_train_pp2_vpp2_update_overlap 2 --pipeline-model-parallel-size 2
                              --num-virtual-stages-per-pipeline-rank 2)
set_tests_properties(parallel_train_pp2_vpp2_update_overlap PROPERTIES ENVIRONMENT
  "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1;OMPI_MCA_rmaps_base_oversubscribe=1;MEGATRAIN_OPTIMIZER_OVERLAP=1")
megatrain_parallel_train_test(parallel_train_pp2_vpp2_dp2_distopt 4 --pipeline-model-parallel-size 2
                              --num-virtual-stages-per-pipeline-rank 2 --use-distributed-optimizer
                              --overlap-grad-reduce --ddp-bucket-size 2000)
# An explicit --pipeline-model-parallel-layout: 4 layers as 1, 2, 0 and 1 over PP 2 x 2 virtual
# stages (an empty chunk, and the loss alone with its layer).
megatrain_parallel_train_test(parallel_train_pp2_layout 2 --pipeline-model-parallel-size 2
                              --pipeline-model-parallel-layout "'Et|tt||tL'")
megatrain_parallel_train_test(parallel_train_pp3_uneven 3 --pipeline-model-parallel-size 3
                              --decoder-first-pipeline-num-layers 1 --decoder-last-pipeline-num-layers 1)
megatrain_parallel_train_test(parallel_train_dp2 2)
megatrain_parallel_train_test(parallel_train_dp2_distopt 2 --use-distributed-optimizer)
megatrain_parallel_train_test(parallel_train_dp3 3 --overlap-grad-reduce --ddp-bucket-size 3000)
megatrain_parallel_train_test(parallel_train_dp3_distopt 3 --use-distributed-optimizer --overlap-grad-reduce
                              --ddp-bucket-size 3000)
# bf16 main gradients (--grad-reduce-in-bf16: accumulated over micro-batches and summed in bf16):
# the same run within bf16 rounding.
megatrain_parallel_train_test(parallel_train_dp3_distopt_bf16_reduce --bf16-reduce 3 --use-distributed-optimizer
                              --overlap-grad-reduce --ddp-bucket-size 3000 --grad-reduce-in-bf16)
# ... over TP=2 with sequence parallelism (the norms' partial gradients are summed over TP in bf16),
megatrain_parallel_train_test(parallel_train_tp2_sp_bf16_grads --bf16-reduce 2 --tensor-model-parallel-size 2
                              --sequence-parallel --grad-reduce-in-bf16)
# ... and resumed on another DP size: the sharded optimizer states are read one parameter at a
# time (the bf16 gradient buffer cannot stage float32 tensors).
megatrain_parallel_train_test(parallel_train_resume_dp2distopt_bf16_to_dp3distopt --bf16-reduce --resume
  2 "--use-distributed-optimizer --grad-reduce-in-bf16" 3 "--use-distributed-optimizer --grad-reduce-in-bf16")
# --use-precision-aware-optimizer with bf16 Adam moments (distributed optimizer on every run):
# the one-rank run up to bf16 rounding of the moments; and the sharded bf16 moments resume on
# another DP size.
set(precision_aware_bf16_moments
    "--use-distributed-optimizer --use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16")
megatrain_parallel_train_test(parallel_train_dp2_bf16_moments --bf16-moments --model "${precision_aware_bf16_moments}" 2
                              --overlap-grad-reduce --ddp-bucket-size 3000)
megatrain_parallel_train_test(parallel_train_resume_dp2_to_dp3_bf16_moments --bf16-moments --model "${precision_aware_bf16_moments}"
                              --resume 2 - 3 -)
# ... and with bf16 main gradients, whose sharded states load one parameter at a time.
megatrain_parallel_train_test(parallel_train_resume_dp2_to_dp3_bf16_moments_bf16_grads --bf16-reduce --bf16-moments
                              --model "${precision_aware_bf16_moments} --grad-reduce-in-bf16" --resume 2 - 3 -)
megatrain_parallel_train_test(parallel_train_tp2_pp2_dp2 8 --tensor-model-parallel-size 2
                              --pipeline-model-parallel-size 2 --sequence-parallel --use-distributed-optimizer
                              --overlap-grad-reduce --ddp-bucket-size 3000)
# Llama-style (RMSNorm, SwiGLU, RoPE, GQA, untied output layer, q/k layernorm whose gradients are
# partial on each TP rank) over TP x PP.
megatrain_parallel_train_test(parallel_train_llama_tp2_pp2 --model
  "--normalization RMSNorm --swiglu --position-embedding-type rope --untie-embeddings-and-output-weights --disable-bias-linear --group-query-attention --num-query-groups 2 --ffn-hidden-size 64 --qk-layernorm"
  4 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel)
# Sliding-window attention (window of 4 earlier tokens of 16) on layers 1 and 3 only: each
# pipeline stage must give its layers their global numbers' windows.
# --attention-output-gate: TP splits the gated QKV projection by query groups, [q | gate | k | v]
# each; with q/k layernorm, GQA and sequence parallelism.
megatrain_parallel_train_test(parallel_train_output_gate_tp2_sp_pp2 --model
  "--attention-output-gate --qk-layernorm --group-query-attention --num-query-groups 2 --position-embedding-type rope"
  4 --tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2)
megatrain_parallel_train_test(parallel_train_window_tp2_pp2 --model
  "--normalization RMSNorm --swiglu --position-embedding-type rope --disable-bias-linear --group-query-attention --num-query-groups 2 --ffn-hidden-size 64 --window-size 4,0 --window-attn-skip-freq 2"
  4 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel)
# Packed documents (--reset-attention-mask with --reset-position-ids and --eod-mask-loss): every
# micro-batch's document starts reach each TP rank's attention, with sequence parallelism and DP.
# Sequences of 256 tokens, so that the mock documents (1 to 4095 tokens) end inside some samples.
megatrain_parallel_train_test(parallel_train_documents_tp2_sp_dp2 --model
  "--normalization RMSNorm --swiglu --position-embedding-type rope --disable-bias-linear --group-query-attention --num-query-groups 2 --ffn-hidden-size 64 --reset-attention-mask --reset-position-ids --eod-mask-loss --seq-length 256 --max-position-embeddings 256"
  4 --tensor-model-parallel-size 2 --sequence-parallel)
# ... and over PP 2 x 2 virtual stages with TP 2: every stage reads the micro-batches for the
# document starts and for the restarted RoPE positions.
megatrain_parallel_train_test(parallel_train_documents_tp2_pp2_vpp2 --model
  "--normalization RMSNorm --swiglu --position-embedding-type rope --disable-bias-linear --group-query-attention --num-query-groups 2 --ffn-hidden-size 64 --reset-attention-mask --reset-position-ids --seq-length 256 --max-position-embeddings 256"
  4 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2)
# --reset-position-ids alone with RoPE over PP 3: the middle stage's attention reads the positions.
megatrain_parallel_train_test(parallel_train_reset_positions_rope_pp3 --model
  "--position-embedding-type rope --reset-position-ids --seq-length 256 --max-position-embeddings 256"
  3 --pipeline-model-parallel-size 3 --decoder-first-pipeline-num-layers 1 --decoder-last-pipeline-num-layers 1)
# NoPE layers (--no-rope-freq, Llama 4's) over PP 2 x 2 virtual stages with TP 2: each chunk keys the
# pattern by its global layers.
megatrain_parallel_train_test(parallel_train_nope_tp2_pp2_vpp2 --model
  "--position-embedding-type rope --no-rope-freq [1,0,0,1]" 4 --tensor-model-parallel-size 2
  --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2)
# --qk-l2-norm (no q/k norm weights) over TP=2 with sequence parallelism.
megatrain_parallel_train_test(parallel_train_qk_l2_tp2_sp --model
  "--normalization RMSNorm --swiglu --position-embedding-type rope --disable-bias-linear --ffn-hidden-size 64 --qk-l2-norm"
  2 --tensor-model-parallel-size 2 --sequence-parallel)
# Nemotron-4-style MLP and norms (--squared-relu, --apply-layernorm-1p, half the head dimension
# rotated, no biases) over TP=2 with sequence parallelism x PP=2.
megatrain_parallel_train_test(parallel_train_squared_relu_tp2_sp_pp2 --model
  "--squared-relu --disable-bias-linear --apply-layernorm-1p --position-embedding-type rope --rotary-percent 0.5 --untie-embeddings-and-output-weights --ffn-hidden-size 64"
  4 --tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2)
# Checkpoints move between layouts: 4 iterations in one, the other 4 in another.
megatrain_parallel_train_test(parallel_train_resume_tp2pp2_to_dp2 --resume
  4 "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2" 2 -)
# (--dist-ckpt-optim-fully-reshardable asks Megatron-LM for what megatrain's checkpoints always are:
# the distributed optimizer's states resume on another TP/PP layout.)
megatrain_parallel_train_test(parallel_train_resume_dp2distopt_to_tp2pp2 --resume
  2 "--use-distributed-optimizer --dist-ckpt-optim-fully-reshardable" 4
  "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2")
megatrain_parallel_train_test(parallel_train_resume_dp2_to_dp3distopt --resume
  2 - 3 "--use-distributed-optimizer")
# ... and from a non-persistent checkpoint: the first half's only save is the non-persistent one at
# its exit iteration (the exit saves nothing more), so the second half resumes from it or fails.
megatrain_parallel_train_test(parallel_train_resume_non_persistent_tp2_to_dp2distopt --resume
  2 "--tensor-model-parallel-size 2 --non-persistent-ckpt-type global --non-persistent-save-interval 4"
  2 "--use-distributed-optimizer --non-persistent-ckpt-type global")

# A rank that dies or stops answering ends every rank with a clear error, never a hang
# (MEGATRAIN_DEBUG_FAULT is a hidden fault injection of app/train.cpp).
set(parallel_train_tiny --device cpu --mock-data --tokenizer-type NullTokenizer --vocab-size 128 --num-layers 2
    --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 --micro-batch-size 1
    --global-batch-size 4 --lr 1e-2 --train-iters 20 --eval-iters 0)
# mpirun exits 137 when a rank was killed by SIGKILL, which expect_failure.sh reads as its own
# timeout: the wrapper maps it to 9.
add_test(NAME parallel_train_killed_rank
         COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/expect_failure.sh 120 "exited on signal 9"
                 /bin/sh -c "\"$0\" \"$@\"; s=$?; [ $s -eq 137 ] && s=9; exit $s"
                 ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} 2 --oversubscribe -x MEGATRAIN_DEBUG_FAULT=kill@1:3
                 $<TARGET_FILE:megatrain> ${parallel_train_tiny} --pipeline-model-parallel-size 2
         WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
set_tests_properties(parallel_train_killed_rank PROPERTIES LABELS mpi
  ENVIRONMENT "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1;OMPI_MCA_rmaps_base_oversubscribe=1")
# --test-mode: q/k layernorm replicas are compared over DP and TP before each step; a run whose
# replicas agree trains to the end, and one rank's silently corrupted weight stops every rank.
megatrain_mpi_test(parallel_train_test_mode_tp2_dp2 4 $<TARGET_FILE:megatrain> ${parallel_train_tiny}
  --tensor-model-parallel-size 2 --qk-layernorm --test-mode)
megatrain_mpi_failure_test(parallel_train_test_mode_corrupt_tp2_dp2 4 120
  "error: --test-mode: discrepancy between decoder.layers.0.self_attention.q_layernorm.weight in DP ranks [01] and [01]. Diff: [0-9]"
  -x MEGATRAIN_DEBUG_FAULT=corrupt@1:3
  $<TARGET_FILE:megatrain> ${parallel_train_tiny} --tensor-model-parallel-size 2 --qk-layernorm --test-mode)
# --check-weight-hash-across-dp-replicas-interval: every parameter's hash compared across the DP
# replicas before training and every 2 iterations. A clean TP2 x DP2 run trains as one rank without
# the check (same losses, norms and final state); with the distributed optimizer and overlapped
# parameter gathers too (the check waits for the gathers, then hashes the gathered weights). One
# rank's weight corrupted at the start of iteration 3 (rank 1: TP rank 1, DP rank 0 of the group
# {1, 3}) is caught by the next check, after iteration 4, and stops every rank naming both.
megatrain_parallel_train_test(parallel_train_weight_hash_tp2_dp2 4 --tensor-model-parallel-size 2
                              --check-weight-hash-across-dp-replicas-interval 2)
megatrain_parallel_train_test(parallel_train_weight_hash_dp2_distopt_overlap 2 --use-distributed-optimizer
                              --overlap-grad-reduce --overlap-param-gather --ddp-bucket-size 2000
                              --check-weight-hash-across-dp-replicas-interval 2)
megatrain_mpi_failure_test(parallel_train_weight_hash_corrupt_tp2_dp2 4 120
  "error: Parameter hashes not matching across DP replicas after 4 iterations: rank 3's weights differ from rank 1's \\(data-parallel rank 0 of its group\\) in 1 of [0-9]+ parameters"
  -x MEGATRAIN_DEBUG_FAULT=corrupt@1:3
  $<TARGET_FILE:megatrain> ${parallel_train_tiny} --tensor-model-parallel-size 2
  --check-weight-hash-across-dp-replicas-interval 2)
megatrain_mpi_failure_test(parallel_train_hung_rank 2 120
  "rank 0\\] error: .*timed out after 2 s waiting for .*group '"
  -x MEGATRAIN_DISTRIBUTED_TIMEOUT_SECONDS=2 -x MEGATRAIN_DEBUG_FAULT=hang@1:3
  $<TARGET_FILE:megatrain> ${parallel_train_tiny} --tensor-model-parallel-size 2)
# --distributed-timeout-seconds-after-init: the default 10 minutes until the first iteration has
# finished, then 2 s for every group (Megatron's update_pg_timeout): a rank that stops answering at
# iteration 3 ends the run within seconds, and the error names the flag in force.
megatrain_mpi_failure_test(parallel_train_hung_rank_after_init 2 120
  "rank 0\\] error: .*timed out after 2 s waiting for .*group '.*--distributed-timeout-seconds-after-init"
  -x MEGATRAIN_DEBUG_FAULT=hang@1:3
  $<TARGET_FILE:megatrain> ${parallel_train_tiny} --tensor-model-parallel-size 2
  --distributed-timeout-seconds-after-init 2)

# FP8 (emulated on the reference backend) over TP x PP: the amax is all-reduced (max) over TP, so
# every layout computes the same scales as one rank (also in the checkpoint). Not DP: there each
# rank's loss gradient is scaled by its own micro-batch count (Megatron's 1/num_microbatches, the
# DP average after), so output-gradient amaxes and scales differ by the factor DP (FP8 values
# agree, being scaled by powers of two). --fp8 compares 4 iterations at float32 tolerances
# (tests/mpi/parallel_train_check.cpp says why: after an FP8 rounding-tie flip, at iteration 5 here,
# the trajectories part). Exact (erf) GeLU: with the tanh GeLU such a flip came at iteration 4.
megatrain_parallel_train_test(parallel_train_fp8_tp2_sp_pp2 --fp8 --model
  "--fp8-format hybrid --fp8-amax-history-len 4 --fp8-amax-compute-algo max --no-bias-gelu-fusion"
  4 --tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2)
# ... with squared ReLU: fc2's input cast from fc1's output and fc1's output gradient from fc2's
# input gradient through the squared ReLU (the fused activation casts).
megatrain_parallel_train_test(parallel_train_fp8_squared_relu_tp2_sp --fp8 --model
  "--fp8-format hybrid --fp8-amax-history-len 4 --fp8-amax-compute-algo max --squared-relu --disable-bias-linear"
  2 --tensor-model-parallel-size 2 --sequence-parallel)
# FP8 parameters (--fp8-param-gather, distributed optimizer): each DP rank casts its master shards
# into the FP8 weights, which are all-gathered as FP8 bytes, over DP, over TP x DP with sequence
# parallelism and overlapped gathers (buckets of both regions, interleaved), over interleaved PP x DP
# (a layout per model chunk), and resumed onto
# another DP size (the saved scales recast the same bits). --calculate-per-token-loss makes the
# output gradients, and so their FP8 scales, independent of the DP size (see the FP8 test above).
# The TP x DP run uses seed 1: with the default seed 1234 a float32 rounding difference of the TP
# reduction moves one value across an FP8 rounding tie at iteration 3, after which any two layouts
# part (seeds 3 and 1234 do that; 1, 2 and 42 do not; without --fp8-param-gather the same happens,
# at other iterations).
set(fp8_param_gather_model "--fp8-format hybrid --fp8-amax-history-len 4 --fp8-amax-compute-algo max --no-bias-gelu-fusion --calculate-per-token-loss --use-distributed-optimizer --fp8-param-gather")
megatrain_parallel_train_test(parallel_train_fp8_param_gather_dp2 --fp8 --model "${fp8_param_gather_model}" 2)
megatrain_parallel_train_test(parallel_train_fp8_param_gather_tp2_sp_dp2 --fp8 --model "${fp8_param_gather_model} --seed 1"
  4 --tensor-model-parallel-size 2 --sequence-parallel --overlap-grad-reduce --overlap-param-gather --ddp-bucket-size 2000)
megatrain_parallel_train_test(parallel_train_fp8_param_gather_pp2_vpp2_dp2 --fp8 --model "${fp8_param_gather_model}"
  4 --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 --overlap-grad-reduce
  --overlap-param-gather --ddp-bucket-size 2000)
megatrain_parallel_train_test(parallel_train_resume_fp8_param_gather_dp2_to_dp3 --fp8 --model "${fp8_param_gather_model}"
  --resume 2 - 3 -)
# With tensorwise (current) scaling: each step's weight scales come from the new master weights'
# amax over every DP shard (one rank's scales), the inputs' and gradients' from each tensor (one
# rank casts the same micro-batches). Not over TP: there tensorwise scales each rank's input shard
# by its own amax (engine/fp8_state.h), so the FP8 grids differ from one rank's.
set(fp8_param_gather_tensorwise_model "--fp8-format hybrid --fp8-recipe tensorwise --fp8-margin 1 --no-bias-gelu-fusion --calculate-per-token-loss --use-distributed-optimizer --fp8-param-gather")
megatrain_parallel_train_test(parallel_train_fp8_param_gather_tensorwise_pp2_dp2 --fp8
  --model "${fp8_param_gather_tensorwise_model}" 4 --pipeline-model-parallel-size 2 --overlap-grad-reduce
  --overlap-param-gather --ddp-bucket-size 2000)
megatrain_parallel_train_test(parallel_train_resume_fp8_param_gather_tensorwise_dp2_to_dp3 --fp8
  --model "${fp8_param_gather_tensorwise_model}" --resume 2 - 3 -)
# Tensorwise without FP8 parameters, distributed optimizer: the update takes each FP8 weight's amax
# over this rank's pieces (buckets of 2000 cut weights across shards), maxed over DP for the weights'
# next casts (GptModel::fp8_weights_updated); the reference backend checks each taken amax bit for
# bit against the cast's own, so a piece's amax alone would fail the run.
megatrain_parallel_train_test(parallel_train_fp8_tensorwise_distopt_pp2_dp2 --fp8
  --model "--fp8-format hybrid --fp8-recipe tensorwise --fp8-margin 1 --no-bias-gelu-fusion --calculate-per-token-loss --use-distributed-optimizer"
  4 --pipeline-model-parallel-size 2 --overlap-grad-reduce --overlap-param-gather --ddp-bucket-size 2000)
# --num-distributed-optimizer-instances 2 (Megatron's partial distributed optimizer): DP 4 as two
# instances of two consecutive DP ranks, each sharding the optimizer state over its own ranks
# (reduce-scatter inside the instance, all-reduce of the shards across instances, the parameter
# all-gather inside the instance). Equal to one rank, as DP 4 with one instance is; a checkpoint
# saved with 2 instances (written by the first instance) resumes on one instance; and DP 2 as two
# instances of one rank (every rank holds all state).
megatrain_parallel_train_test(parallel_train_dp4_distopt 4 --use-distributed-optimizer --overlap-grad-reduce
                              --ddp-bucket-size 3000)
megatrain_parallel_train_test(parallel_train_dp4_distopt_2instances 4 --use-distributed-optimizer
                              --num-distributed-optimizer-instances 2 --overlap-grad-reduce --ddp-bucket-size 3000)
megatrain_parallel_train_test(parallel_train_dp2_distopt_2instances 2 --use-distributed-optimizer
                              --num-distributed-optimizer-instances 2)
megatrain_parallel_train_test(parallel_train_resume_dp4_2instances_to_1instance --resume
  4 "--use-distributed-optimizer --num-distributed-optimizer-instances 2 --overlap-grad-reduce --ddp-bucket-size 3000"
  4 "--use-distributed-optimizer --overlap-grad-reduce --ddp-bucket-size 3000")
# Mixture of experts (Llama-style, MoE every other layer: softmax top-2 routing with aux and z-losses
# and a gated shared expert; and sigmoid group-limited routing): DP, the distributed optimizer and
# pipelines (1F1B and interleaved) equal one rank.
set(moe_model "--disable-bias-linear --swiglu --normalization RMSNorm --position-embedding-type rope \
--untie-embeddings-and-output-weights --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 24 \
--moe-layer-freq 2 --moe-aux-loss-coeff 1e-2 --moe-z-loss-coeff 1e-3 --moe-shared-expert-intermediate-size 16 \
--moe-shared-expert-gate --moe-grouped-gemm --moe-token-dispatcher-type alltoall")
set(moe_sigmoid_model "--disable-bias-linear --swiglu --normalization RMSNorm --position-embedding-type rope \
--num-experts 8 --moe-router-topk 3 --moe-ffn-hidden-size 16 --moe-router-score-function sigmoid \
--moe-router-num-groups 4 --moe-router-group-topk 2 --moe-router-topk-scaling-factor 2.0 --moe-aux-loss-coeff 1e-2")
megatrain_parallel_train_test(parallel_train_moe_dp2 --model "${moe_model}" 2)
# --check-weight-hash-across-dp-replicas-interval under expert parallelism: the routed experts'
# hashes are compared over the expert-data-parallel group (ranks {0, 2} and {1, 3}), the others'
# over DP (all four ranks), as Megatron's check_param_hashes_across_dp_replicas groups them; over
# DP, EP ranks would hold different experts and the check would stop a healthy run.
megatrain_parallel_train_test(parallel_train_weight_hash_moe_ep2_dp4 --model "${moe_model}" 4
                              --expert-model-parallel-size 2 --check-weight-hash-across-dp-replicas-interval 2)
# ... and they are compared: rank 2's first expert weight corrupted at the start of iteration 3 is
# caught after iteration 4 against rank 0, its expert-data-parallel rank 0.
separate_arguments(moe_model_words UNIX_COMMAND "${moe_model}")
megatrain_mpi_failure_test(parallel_train_weight_hash_moe_corrupt_expert_ep2_dp4 4 120
  "error: Parameter hashes not matching across DP replicas after 4 iterations: rank 2's weights differ from rank 0's \\(data-parallel rank 0 of its group\\) in 1 of [0-9]+ parameters \\(the"
  -x MEGATRAIN_DEBUG_FAULT=corrupt-expert@2:3
  $<TARGET_FILE:megatrain> ${parallel_train_tiny} ${moe_model_words} --expert-model-parallel-size 2
  --check-weight-hash-across-dp-replicas-interval 2)
megatrain_parallel_train_test(parallel_train_moe_dp2_distopt --model "${moe_model}" 2 --use-distributed-optimizer
                              --overlap-grad-reduce --ddp-bucket-size 3000)
megatrain_parallel_train_test(parallel_train_moe_pp2 --model "${moe_model}" 2 --pipeline-model-parallel-size 2)
megatrain_parallel_train_test(parallel_train_moe_sigmoid_pp2_vpp2_dp2 --model "${moe_sigmoid_model}" 4
                              --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2)
# ... and a checkpoint of MoE layers saved at DP2 resumes on PP2 with the same run.
megatrain_parallel_train_test(parallel_train_moe_resume_dp2_to_pp2 --model "${moe_model}" --resume 2 - 2
                              "--pipeline-model-parallel-size 2")
# ... under tensor parallelism with sequence parallelism (the experts and the shared expert split
# over TP as the dense MLP is; the router and gate run on all rows, their weight gradients on each
# rank's rows), also with the distributed optimizer over TP2 x PP2 x DP2.
megatrain_parallel_train_test(parallel_train_moe_tp2_sp --model "${moe_model}" 2 --tensor-model-parallel-size 2
                              --sequence-parallel)
megatrain_parallel_train_test(parallel_train_moe_tp2_sp_pp2_dp2_distopt --model "${moe_model} --moe-router-dtype fp32" 8
                              --tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2
                              --use-distributed-optimizer)
# Router input jitter: every TP rank draws the same factors (they route the same rows), a row's
# factors follow it under SP, and the pipeline stages key them by the global layer: TP2 with SP
# and PP2 equal one rank.
megatrain_parallel_train_test(parallel_train_moe_jitter_tp2_sp --model "${moe_model} --moe-input-jitter-eps 0.1" 2
                              --tensor-model-parallel-size 2 --sequence-parallel)
megatrain_parallel_train_test(parallel_train_moe_jitter_fp32_pp2 --model "${moe_model} --moe-input-jitter-eps 0.1 \
--moe-router-dtype fp32" 2 --pipeline-model-parallel-size 2)
# MoE recomputation (the experts' and the shared expert's fc1 outputs recomputed in backward):
# under EP2 x TP2 with SP, and with token dropping (--moe-layer-recompute) under EP2 x PP2.
megatrain_parallel_train_test(parallel_train_moe_recompute_ep2_tp2_sp --model "${moe_model} \
--recompute-granularity selective --recompute-modules moe" 4 --expert-model-parallel-size 2 --tensor-model-parallel-size 2
                              --sequence-parallel)
megatrain_parallel_train_test(parallel_train_moe_recompute_drop_ep2_pp2 --model "${moe_model} --moe-layer-recompute \
--moe-expert-capacity-factor 0.5" 4 --expert-model-parallel-size 2 --pipeline-model-parallel-size 2)
# Sinkhorn load balancing (over each micro-batch's rows: the same under DP and PP; under TP with
# SP each rank balances its own rows, as Megatron's router does, so TP changes the routing).
megatrain_parallel_train_test(parallel_train_moe_sinkhorn_pp2_dp2 --model "--disable-bias-linear --swiglu \
--normalization RMSNorm --position-embedding-type rope --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 24 \
--moe-router-load-balancing-type sinkhorn --moe-aux-loss-coeff 0 --moe-z-loss-coeff 1e-3" 4
                              --pipeline-model-parallel-size 2)
# Expert parallelism (${moe_model}: the all-to-all dispatcher; the sigmoid models: all-gather):
# EP = DP = 2 and 4, EP under TP2 with SP, EP x PP2, EP=2 inside DP=4 with the
# distributed optimizer (the experts' gradients reduced and sharded over expert-DP 2, the others
# over DP 4), sigmoid group-limited routing; and a checkpoint saved at EP=2 resumes at EP=1 and
# the other way round (experts saved as global tensors).
megatrain_parallel_train_test(parallel_train_moe_ep2 --model "${moe_model}" 2 --expert-model-parallel-size 2)
megatrain_parallel_train_test(parallel_train_moe_ep4 --model "${moe_model}" 4 --expert-model-parallel-size 4)
megatrain_parallel_train_test(parallel_train_moe_ep2_tp2_sp --model "${moe_model}" 4 --expert-model-parallel-size 2
                              --tensor-model-parallel-size 2 --sequence-parallel)
megatrain_parallel_train_test(parallel_train_moe_ep2_pp2 --model "${moe_model}" 4 --expert-model-parallel-size 2
                              --pipeline-model-parallel-size 2)
megatrain_parallel_train_test(parallel_train_moe_ep2_dp4_distopt --model "${moe_model}" 4 --expert-model-parallel-size 2
                              --use-distributed-optimizer --overlap-grad-reduce --ddp-bucket-size 3000)
megatrain_parallel_train_test(parallel_train_moe_sigmoid_ep4_dp4 --model "${moe_sigmoid_model}" 4
                              --expert-model-parallel-size 4)
megatrain_parallel_train_test(parallel_train_moe_resume_ep2_to_dp2 --model "${moe_model}" --resume
  2 "--expert-model-parallel-size 2 --use-distributed-optimizer" 2 "--use-distributed-optimizer")
megatrain_parallel_train_test(parallel_train_moe_resume_dp2_to_ep4_distopt --model "${moe_model}" --resume
  2 - 4 "--expert-model-parallel-size 4 --use-distributed-optimizer")
# MoE layers with linear biases (Megatron's default --add-bias-linear; expert TP 1): the router's
# bias, each expert's fc1 bias and its fc2 bias times the routing weight, on this rank's experts
# under EP. EP2 (all-to-all), EP4 inside DP4 with the distributed optimizer (the experts' biases
# sharded over expert-DP), EP2 with whole experts under TP2 + SP, EP2 x PP2 with the all-gather
# dispatcher and token dropping, and FP8 at EP2 equal one rank (FP8: seed 1; seeds 3 and 1234 move
# an element across an FP8 rounding tie by iteration 3, as noted for the FP8 MoE tests below).
set(moe_linear_bias_model "--swiglu --normalization RMSNorm --position-embedding-type rope \
--untie-embeddings-and-output-weights --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 24 \
--moe-layer-freq 2 --moe-aux-loss-coeff 1e-2 --moe-z-loss-coeff 1e-3 --moe-grouped-gemm \
--moe-token-dispatcher-type alltoall --expert-tensor-parallel-size 1")
megatrain_parallel_train_test(parallel_train_moe_linear_bias_ep2 --model "${moe_linear_bias_model}" 2 --expert-model-parallel-size 2)
megatrain_parallel_train_test(parallel_train_moe_linear_bias_ep4_dp4_distopt --model "${moe_linear_bias_model}" 4
                              --expert-model-parallel-size 4 --use-distributed-optimizer)
megatrain_parallel_train_test(parallel_train_moe_linear_bias_ep2_tp2_sp --model "${moe_linear_bias_model}" 4
                              --expert-model-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel)
megatrain_parallel_train_test(parallel_train_moe_linear_bias_allgather_drop_ep2_pp2 --model "${moe_linear_bias_model} \
--moe-token-dispatcher-type allgather --moe-expert-capacity-factor 0.5" 4 --expert-model-parallel-size 2
                              --pipeline-model-parallel-size 2)
megatrain_parallel_train_test(parallel_train_fp8_moe_linear_bias_ep2 --fp8 --model "${moe_linear_bias_model} --fp8-format hybrid \
--fp8-amax-history-len 4 --fp8-amax-compute-algo max --calculate-per-token-loss --seed 1" 2 --expert-model-parallel-size 2)
# FP8 MoE layers (--fp8-format; emulated on the reference backend): the attention's GEMMs as in dense
# layers, the routed experts' GEMMs per expert with each expert's own scaling state (its amaxes
# reduced over its replicas and its TP shards), on rows padded to 128 per expert. Delayed scaling
# equals one rank under EP2 (all-to-all; the sigmoid models: all-gather) also with TP2 + SP (the
# experts split over TP, or whole with --expert-tensor-parallel-size 1), EP2 x PP2, token dropping,
# MoE recomputation and --no-fp8-wgrad; a checkpoint saved at EP2 resumes at TP2 + SP (the experts'
# scaling state saved per expert). Tensorwise scaling casts each expert's rows by their own amax,
# which under EP gathers rows from several ranks' micro-batches: equal to one rank at PP2 x DP2.
# --calculate-per-token-loss: the output gradients' amaxes do not depend on the DP size (see the FP8
# notes above). Seeds: as for the dense FP8 tests, a few seeds move an element across an FP8
# rounding tie within the 4 iterations (seed 1234 does with dropping and with the sigmoid model).
set(fp8_moe_model "${moe_model} --fp8-format hybrid --fp8-amax-history-len 4 --fp8-amax-compute-algo max \
--calculate-per-token-loss")
megatrain_parallel_train_test(parallel_train_fp8_moe_ep2 --fp8 --model "${fp8_moe_model}" 2
                              --expert-model-parallel-size 2)
megatrain_parallel_train_test(parallel_train_fp8_moe_ep2_tp2_sp --fp8 --model "${fp8_moe_model}" 4
                              --expert-model-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel)
megatrain_parallel_train_test(parallel_train_fp8_moe_ep2_etp1_tp2_sp --fp8 --model "${fp8_moe_model}" 4
                              --expert-model-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel
                              --expert-tensor-parallel-size 1)
megatrain_parallel_train_test(parallel_train_fp8_moe_sigmoid_ep2_pp2 --fp8 --model "${moe_sigmoid_model} \
--fp8-format hybrid --fp8-amax-history-len 4 --fp8-amax-compute-algo max --calculate-per-token-loss --seed 3" 4
                              --expert-model-parallel-size 2 --pipeline-model-parallel-size 2)
megatrain_parallel_train_test(parallel_train_fp8_moe_drop_recompute_ep2 --fp8 --model "${fp8_moe_model} \
--moe-expert-capacity-factor 0.5 --recompute-granularity selective --recompute-modules moe --seed 1" 2
                              --expert-model-parallel-size 2)
megatrain_parallel_train_test(parallel_train_fp8_moe_no_wgrad_ep2 --fp8 --model "${fp8_moe_model} --no-fp8-wgrad" 2
                              --expert-model-parallel-size 2)
megatrain_parallel_train_test(parallel_train_fp8_moe_tensorwise_pp2_dp2_distopt --fp8 --model "${moe_model} \
--fp8-format hybrid --fp8-recipe tensorwise --fp8-margin 1 --calculate-per-token-loss" 4
                              --pipeline-model-parallel-size 2 --use-distributed-optimizer)
# gpt-oss's MLP in FP8: clamped quick-GeGLU with the linear offset, in the dense layers' fused casts
# and in the experts, with a shared expert: TP 2 + SP and EP 2 equal one rank.
set(fp8_gpt_oss_mlp "--normalization RMSNorm --position-embedding-type rope --disable-bias-linear --quick-geglu \
--glu-linear-offset 1.0 --activation-func-clamp-value 2.0 --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 24 \
--moe-layer-freq 2 --moe-token-dispatcher-type alltoall --moe-shared-expert-intermediate-size 16 --fp8-format hybrid \
--fp8-amax-history-len 4 --fp8-amax-compute-algo max --calculate-per-token-loss")
megatrain_parallel_train_test(parallel_train_fp8_gpt_oss_mlp_tp2_sp --fp8 --model "${fp8_gpt_oss_mlp}" 2
                              --tensor-model-parallel-size 2 --sequence-parallel)
megatrain_parallel_train_test(parallel_train_fp8_gpt_oss_mlp_ep2 --fp8 --model "${fp8_gpt_oss_mlp}" 2
                              --expert-model-parallel-size 2)
megatrain_parallel_train_test(parallel_train_resume_fp8_moe_ep2_to_tp2_sp --fp8 --model "${fp8_moe_model}" --resume
  2 "--expert-model-parallel-size 2" 2 "--tensor-model-parallel-size 2 --sequence-parallel")
# FP8 parameters (--fp8-param-gather) of MoE layers: the routed experts' weights are FP8 parameters,
# each expert's block cast with that expert's own scale (the optimizer's segments cut at expert
# boundaries; under EP in an FP8 region of their own, sharded and all-gathered over the expert-DP
# group), the shared experts' with the extra state's. Equal to one rank: EP 2, DP 2 and EP 2 x DP 2
# with overlapped gathers and buckets that cut weights between shards, gpt-oss's MLP at PP 2 (its
# example's layout, on fewer ranks), tensorwise scaling at PP 2 x DP 2, and a resume from EP 2 to
# TP 2 + SP (the FP8 weights recast from the saved master weights with the saved scales).
set(fp8_params "--use-distributed-optimizer --fp8-param-gather")
megatrain_parallel_train_test(parallel_train_fp8_params_moe_ep2 --fp8 --model "${fp8_moe_model} ${fp8_params}" 2
                              --expert-model-parallel-size 2)
megatrain_parallel_train_test(parallel_train_fp8_params_moe_dp2 --fp8 --model "${fp8_moe_model} ${fp8_params}" 2
                              --overlap-grad-reduce --overlap-param-gather --ddp-bucket-size 2000)
megatrain_parallel_train_test(parallel_train_fp8_params_moe_ep2_dp2 --fp8 --model "${fp8_moe_model} ${fp8_params}" 4
                              --expert-model-parallel-size 2 --overlap-grad-reduce --overlap-param-gather
                              --ddp-bucket-size 2000)
# EP 2 x TP 2 + SP, the experts split over TP (each expert's block of rows a TP shard) or whole
# (expert TP 1); seed 3: seeds 1, 2 and 1234 move an element across an FP8 rounding tie within the
# 4 iterations at this layout, with or without FP8 parameters (the TP reductions' float sums).
megatrain_parallel_train_test(parallel_train_fp8_params_moe_ep2_tp2_sp --fp8 --model "${fp8_moe_model} ${fp8_params} \
--seed 3" 4 --expert-model-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel)
megatrain_parallel_train_test(parallel_train_fp8_params_moe_ep2_etp1_tp2_sp --fp8 --model "${fp8_moe_model} \
${fp8_params} --seed 3" 4 --expert-model-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel
                              --expert-tensor-parallel-size 1)
# The experts split over 2 of TP 4's ranks (expert TP 2, EP 2): the experts' amaxes maxed over their
# own TP group, one writer of each expert's FP8 state per checkpoint; also with FP8 parameters, and a
# resume onto EP 2 alone (seed 1: seed 3 moves an element across an FP8 rounding tie at this layout).
megatrain_parallel_train_test(parallel_train_fp8_moe_etp2_ep2_tp4_sp --fp8 --model "${fp8_moe_model} --seed 1" 4
                              --tensor-model-parallel-size 4 --sequence-parallel --expert-tensor-parallel-size 2
                              --expert-model-parallel-size 2)
megatrain_parallel_train_test(parallel_train_fp8_params_moe_etp2_ep2_tp4_sp --fp8 --model "${fp8_moe_model} ${fp8_params} \
--seed 1" 4 --tensor-model-parallel-size 4 --sequence-parallel --expert-tensor-parallel-size 2 --expert-model-parallel-size 2)
megatrain_parallel_train_test(parallel_train_resume_fp8_moe_etp2_tp4_to_ep2 --fp8 --model "${fp8_moe_model} --seed 1"
  --resume 4 "--tensor-model-parallel-size 4 --sequence-parallel --expert-tensor-parallel-size 2 --expert-model-parallel-size 2"
  2 "--expert-model-parallel-size 2")
megatrain_parallel_train_test(parallel_train_fp8_params_gpt_oss_mlp_pp2 --fp8 --model "${fp8_gpt_oss_mlp} ${fp8_params}"
                              2 --pipeline-model-parallel-size 2)
megatrain_parallel_train_test(parallel_train_fp8_params_moe_tensorwise_pp2_dp2 --fp8 --model "${moe_model} \
--fp8-format hybrid --fp8-recipe tensorwise --fp8-margin 1 --calculate-per-token-loss ${fp8_params}" 4
                              --pipeline-model-parallel-size 2)
megatrain_parallel_train_test(parallel_train_resume_fp8_params_moe_ep2_to_tp2_sp --fp8
  --model "${fp8_moe_model} ${fp8_params}" --resume 2 "--expert-model-parallel-size 2" 2
  "--tensor-model-parallel-size 2 --sequence-parallel")
# Aux-loss-free balancing (sigmoid group-limited routing with an expert bias updated every step, and
# a shared expert) over EP4 and EP2 x PP2; token dropping (the same pairs dropped: capacity per
# rank's rows) by weight under EP2 x PP2 and by position under EP4 with the distributed optimizer.
set(moe_bias_model "${moe_sigmoid_model} --moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-2 \
--moe-shared-expert-intermediate-size 16")
megatrain_parallel_train_test(parallel_train_moe_bias_ep4 --model "${moe_bias_model}" 4 --expert-model-parallel-size 4)
megatrain_parallel_train_test(parallel_train_moe_bias_ep2_pp2 --model "${moe_bias_model}" 4 --expert-model-parallel-size 2
                              --pipeline-model-parallel-size 2)
megatrain_parallel_train_test(parallel_train_moe_bias_resume_ep2_to_pp2 --model "${moe_bias_model}" --resume
  2 "--expert-model-parallel-size 2" 2 "--pipeline-model-parallel-size 2")
megatrain_parallel_train_test(parallel_train_moe_drop_ep2_pp2 --model "${moe_model} --moe-expert-capacity-factor 0.5" 4
                              --expert-model-parallel-size 2 --pipeline-model-parallel-size 2)
megatrain_parallel_train_test(parallel_train_moe_drop_position_ep4_distopt --model "${moe_model} \
--moe-expert-capacity-factor 0.75 --moe-token-drop-policy position" 4 --expert-model-parallel-size 4 --use-distributed-optimizer)
# Whole experts under TP2 with SP (--expert-tensor-parallel-size 1: each rank dispatches its own
# sequence-parallel rows, the EP group spans TP ranks): EP2 on 4 ranks, EP4 with PP2 on 8, and
# without EP (the experts replicated over TP x DP); with the expert bias and the distributed
# optimizer; resumed from TP2 with split experts.
megatrain_parallel_train_test(parallel_train_moe_etp1_ep2_tp2_sp --model "${moe_model}" 4 --tensor-model-parallel-size 2
                              --sequence-parallel --expert-model-parallel-size 2 --expert-tensor-parallel-size 1)
megatrain_parallel_train_test(parallel_train_moe_etp1_ep4_tp2_pp2 --model "${moe_model}" 8 --tensor-model-parallel-size 2
                              --sequence-parallel --pipeline-model-parallel-size 2 --expert-model-parallel-size 4
                              --expert-tensor-parallel-size 1)
megatrain_parallel_train_test(parallel_train_moe_etp1_tp2_sp_dp2 --model "${moe_model}" 4 --tensor-model-parallel-size 2
                              --sequence-parallel --expert-tensor-parallel-size 1)
megatrain_parallel_train_test(parallel_train_moe_bias_etp1_ep2_tp2_distopt --model "${moe_bias_model}" 4
                              --tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2
                              --expert-tensor-parallel-size 1 --use-distributed-optimizer)
megatrain_parallel_train_test(parallel_train_moe_resume_tp2_to_etp1_ep2 --model "${moe_model}" --resume
  2 "--tensor-model-parallel-size 2 --sequence-parallel"
  4 "--tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2 --expert-tensor-parallel-size 1")
# Parallel folding with experts split over 2 of TP 4's ranks (--expert-tensor-parallel-size 2): rows
# gathered over the experts' tp x ep group, outputs partial over the experts' TP pair; EP2 on 8
# ranks (DP 2) and EP1 on 4, with the expert bias.
megatrain_parallel_train_test(parallel_train_moe_etp2_ep2_tp4 --model "${moe_model}" 8 --tensor-model-parallel-size 4
                              --sequence-parallel --expert-model-parallel-size 2 --expert-tensor-parallel-size 2)
megatrain_parallel_train_test(parallel_train_moe_bias_etp2_tp4 --model "${moe_bias_model}" 4 --tensor-model-parallel-size 4
                              --sequence-parallel --expert-tensor-parallel-size 2)
# ... and without a shared expert at DP 1: the experts' gradients are still reduced over the TP
# ranks (their data-parallel group), the routed output alone is the MoE output.
megatrain_parallel_train_test(parallel_train_moe_etp1_tp2_no_shared --model "--disable-bias-linear --swiglu \
--normalization RMSNorm --position-embedding-type rope --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 24 \
--moe-layer-freq 2" 2 --tensor-model-parallel-size 2 --sequence-parallel --expert-tensor-parallel-size 1
                              --use-distributed-optimizer)
# Per-layer MoE logging over PP4 with DP: stages without MoE layers join the per-layer reduction.
megatrain_parallel_train_test(parallel_train_moe_per_layer_logging_pp4 --model "${moe_model} --moe-per-layer-logging" 4
                              --pipeline-model-parallel-size 4)
# The two token dispatchers. ${moe_model} asks for alltoall (each rank sends its pairs' rows to
# the experts' ranks and sums their outputs itself), so the expert-parallel tests above and below
# run it; the all-gather dispatcher (Megatron's default: every EP rank receives the group's tokens)
# equals one rank in the same layouts: EP2 and EP4, EP2 under TP2 with SP (experts split over TP),
# whole experts under TP2 (EP2; EP4 x PP2 on 8 ranks), token dropping with MoE recompute under EP2
# x PP2, by position with the distributed optimizer, seq_aux_loss under EP2 x PP2; and the sigmoid
# models (default allgather) under all-to-all and flex: the expert bias with a shared expert under
# EP4, group-limited routing under EP2 x TP2 with SP.
set(ag "--moe-token-dispatcher-type allgather")
megatrain_parallel_train_test(parallel_train_moe_ag_ep2 --model "${moe_model} ${ag}" 2 --expert-model-parallel-size 2)
megatrain_parallel_train_test(parallel_train_moe_ag_ep4 --model "${moe_model} ${ag}" 4 --expert-model-parallel-size 4)
megatrain_parallel_train_test(parallel_train_moe_ag_ep2_tp2_sp --model "${moe_model} ${ag}" 4
                              --expert-model-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel)
megatrain_parallel_train_test(parallel_train_moe_ag_etp1_ep2_tp2_sp --model "${moe_model} ${ag}" 4
                              --tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2
                              --expert-tensor-parallel-size 1)
megatrain_parallel_train_test(parallel_train_moe_ag_etp1_ep4_tp2_pp2 --model "${moe_model} ${ag}" 8
                              --tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2
                              --expert-model-parallel-size 4 --expert-tensor-parallel-size 1)
megatrain_parallel_train_test(parallel_train_moe_ag_recompute_drop_ep2_pp2 --model "${moe_model} ${ag} \
--moe-layer-recompute --moe-expert-capacity-factor 0.5" 4 --expert-model-parallel-size 2 --pipeline-model-parallel-size 2)
megatrain_parallel_train_test(parallel_train_moe_ag_drop_position_ep4_distopt --model "${moe_model} ${ag} \
--moe-expert-capacity-factor 0.75 --moe-token-drop-policy position" 4 --expert-model-parallel-size 4
                              --use-distributed-optimizer)
megatrain_parallel_train_test(parallel_train_moe_ag_seq_aux_ep2_pp2 --model "${moe_model} ${ag} --micro-batch-size 2 \
--moe-router-load-balancing-type seq_aux_loss" 4 --expert-model-parallel-size 2 --pipeline-model-parallel-size 2)
megatrain_parallel_train_test(parallel_train_moe_a2a_bias_ep4 --model "${moe_bias_model} \
--moe-token-dispatcher-type alltoall" 4 --expert-model-parallel-size 4)
megatrain_parallel_train_test(parallel_train_moe_flex_sigmoid_ep2_tp2_sp --model "${moe_sigmoid_model} \
--moe-token-dispatcher-type flex" 4 --expert-model-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel)
# --moe-apply-probs-on-input (Llama 4's top-1 experts, the routing weight on the input): EP 2 with
# the all-to-all dispatcher, EP 2 under TP 2 with SP (the weights' gradient partial over the experts'
# TP ranks), and whole experts under TP 2 with the all-gather dispatcher.
set(moe_input_model "--disable-bias-linear --swiglu --normalization RMSNorm --position-embedding-type rope \
--num-experts 4 --moe-router-topk 1 --moe-ffn-hidden-size 24 --moe-router-score-function sigmoid \
--moe-apply-probs-on-input --moe-aux-loss-coeff 1e-2 --moe-shared-expert-intermediate-size 16")
megatrain_parallel_train_test(parallel_train_moe_probs_on_input_ep2 --model
  "${moe_input_model} --moe-token-dispatcher-type alltoall" 2 --expert-model-parallel-size 2)
megatrain_parallel_train_test(parallel_train_moe_probs_on_input_ep2_tp2_sp --model "${moe_input_model}" 4
                              --expert-model-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel)
megatrain_parallel_train_test(parallel_train_moe_probs_on_input_etp1_ep2_tp2_sp --model "${moe_input_model}" 4
                              --tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2
                              --expert-tensor-parallel-size 1)
# seq_aux_loss (each sequence's own load balance; micro-batches of 2 sequences) under EP2 x PP2.
megatrain_parallel_train_test(parallel_train_moe_seq_aux_ep2_pp2 --model "${moe_model} --micro-batch-size 2 \
--moe-router-load-balancing-type seq_aux_loss" 4 --expert-model-parallel-size 2 --pipeline-model-parallel-size 2)

# Context parallelism: each rank holds chunks r and 2 CP - 1 - r of every sequence (16 positions:
# 4 chunks of 4 at CP 2, 8 of 2 at CP 4); attention block by block, merged by log-sum-exp, the
# keys and values passed round a ring (p2p) or all-gathered; gradients summed over DP x CP.
set(cp_llama_model "--normalization RMSNorm --swiglu --position-embedding-type rope --disable-bias-linear \
--group-query-attention --num-query-groups 2 --ffn-hidden-size 64")
megatrain_parallel_train_test(parallel_train_cp2 2 --context-parallel-size 2)
megatrain_parallel_train_test(parallel_train_cp2_allgather 2 --context-parallel-size 2 --cp-comm-type allgather)
megatrain_parallel_train_test(parallel_train_cp4 4 --context-parallel-size 4)
megatrain_parallel_train_test(parallel_train_cp4_allgather --model "${cp_llama_model}" 4 --context-parallel-size 4
                              --cp-comm-type allgather)
# With micro-batches of 2 sequences, RoPE, GQA, and a per-layer list of comm types.
megatrain_parallel_train_test(parallel_train_cp2_llama_mixed --model "${cp_llama_model} --micro-batch-size 2" 2
                              --context-parallel-size 2 --cp-comm-type p2p allgather allgather p2p)
# A sliding window of 5 on alternate layers: the blocks a window leaves out are skipped.
megatrain_parallel_train_test(parallel_train_cp4_window --model "${cp_llama_model} --window-size 5,0 --window-attn-skip-freq 2"
                              4 --context-parallel-size 4)
megatrain_parallel_train_test(parallel_train_cp2_tp2_sp --model "${cp_llama_model}" 4 --context-parallel-size 2
                              --tensor-model-parallel-size 2 --sequence-parallel)
megatrain_parallel_train_test(parallel_train_cp2_pp2 4 --context-parallel-size 2 --pipeline-model-parallel-size 2)
megatrain_parallel_train_test(parallel_train_cp2_pp2_vpp2 --model "${cp_llama_model}" 4 --context-parallel-size 2
                              --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2)
megatrain_parallel_train_test(parallel_train_cp2_dp2_distopt 4 --context-parallel-size 2 --use-distributed-optimizer
                              --overlap-grad-reduce --ddp-bucket-size 3000)
# Checkpoints do not depend on CP: a CP 2 run with the distributed optimizer resumes at DP 2.
megatrain_parallel_train_test(parallel_train_resume_cp2_to_dp2 --resume
  2 "--context-parallel-size 2 --use-distributed-optimizer" 2 "--use-distributed-optimizer")
# Ulysses (a2a): an all-to-all over the heads (4 heads: 2 per rank at CP 2, 1 at CP 4, and with
# TP 2 one per rank), then the whole sequence's blocks locally.
megatrain_parallel_train_test(parallel_train_cp2_a2a 2 --context-parallel-size 2 --cp-comm-type a2a)
megatrain_parallel_train_test(parallel_train_cp4_a2a 4 --context-parallel-size 4 --cp-comm-type a2a)
megatrain_parallel_train_test(parallel_train_cp2_a2a_tp2_sp 4 --context-parallel-size 2 --cp-comm-type a2a
                              --tensor-model-parallel-size 2 --sequence-parallel)
# a2a+p2p: the all-to-all inside pairs of CP ranks, a ring across the two pairs (GQA: 2 groups).
megatrain_parallel_train_test(parallel_train_cp4_a2a_p2p --model "${cp_llama_model}" 4 --context-parallel-size 4
                              --cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes 2 2)
# Learnable attention sinks (--softmax-type): their gradient summed over CP (under a2a each rank's
# heads), at every comm type; MLA with sinks under CP 2.
megatrain_parallel_train_test(parallel_train_cp4_sinks_every_comm_type --model "--softmax-type learnable" 4
                              --context-parallel-size 4 --cp-comm-type p2p a2a allgather a2a+p2p
                              --hierarchical-context-parallel-sizes 2 2)
megatrain_parallel_train_test(parallel_train_sinks_tp2_sp_cp2_a2a --model "--softmax-type learnable" 4
                              --tensor-model-parallel-size 2 --sequence-parallel --context-parallel-size 2
                              --cp-comm-type a2a)
# Every comm type in one model, one per layer.
megatrain_parallel_train_test(parallel_train_cp4_every_comm_type 4 --context-parallel-size 4
                              --cp-comm-type p2p a2a allgather a2a+p2p --hierarchical-context-parallel-sizes 2 2)
# Packed documents under CP: each rank holds chunks of a sequence whose documents cross them; the
# blocks mask by the whole sequence's document starts (256 positions, so that documents end inside
# the samples), over every comm type, and with PP. (--eod-mask-loss only with per-token loss: as in
# Megatron-LM, each CP rank's loss is its own masked mean, which a mask makes differ from one rank's.)
set(cp_documents "--reset-attention-mask --reset-position-ids --seq-length 256 --max-position-embeddings 256")
megatrain_parallel_train_test(parallel_train_documents_cp2 --model "${cp_llama_model} ${cp_documents}" 2
                              --context-parallel-size 2)
megatrain_parallel_train_test(parallel_train_documents_cp4_every_comm_type --model "${cp_documents}" 4
                              --context-parallel-size 4 --cp-comm-type p2p a2a allgather a2a+p2p
                              --hierarchical-context-parallel-sizes 2 2)
megatrain_parallel_train_test(parallel_train_documents_cp2_pp2 --model
  "${cp_llama_model} ${cp_documents} --eod-mask-loss --calculate-per-token-loss" 4
  --context-parallel-size 2 --pipeline-model-parallel-size 2)
# --dataloader-inter-document-masking: the data loader's document parts (vocabulary 128, so that
# mock documents hold EOD ids mid-document, which do not split them here) under CP 2 x PP 2 and TP 2
# with SP over PP 2 x 2 virtual stages.
set(inter_doc "--dataloader-inter-document-masking --vocab-size 128 --seq-length 256 --max-position-embeddings 256")
megatrain_parallel_train_test(parallel_train_inter_document_cp2_pp2 --model "${cp_llama_model} ${inter_doc}" 4
                              --context-parallel-size 2 --pipeline-model-parallel-size 2)
megatrain_parallel_train_test(parallel_train_inter_document_tp2_sp_pp2_vpp2 --model
  "--normalization RMSNorm --swiglu --position-embedding-type rope --disable-bias-linear ${inter_doc}" 4
  --tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2
  --num-virtual-stages-per-pipeline-rank 2)
# Mixture of experts with context parallelism: the aux loss's counts summed over the CP ranks of a
# micro-batch (each rank's value its part of the micro-batch's loss, seeded x CP as Megatron), the
# experts' EP x expert-DP ranks folding the dense CP x DP ones (Megatron's parallel folding).
megatrain_parallel_train_test(parallel_train_moe_cp2 --model "${moe_model}" 2 --context-parallel-size 2)
megatrain_parallel_train_test(parallel_train_moe_linear_bias_cp2_ep2_recompute --model "${moe_linear_bias_model} \
--recompute-granularity full --recompute-method uniform --recompute-num-layers 1" 2 --context-parallel-size 2
                              --expert-model-parallel-size 2)
megatrain_parallel_train_test(parallel_train_moe_cp2_ep2 --model "${moe_model}" 2 --context-parallel-size 2
                              --expert-model-parallel-size 2)
# --use-tp-pp-dp-mapping (DP last) with PP 2: EP folding TP (expert TP 1), and EP folding CP (4 ranks
# each; 8 ranks as Megatron-LM's dp_last functional tests is the same rule).
megatrain_parallel_train_test(parallel_train_moe_tp2_ep2_etp1_pp2_dp_last --model "${moe_model}" 4
                              --tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2
                              --expert-tensor-parallel-size 1 --pipeline-model-parallel-size 2 --use-tp-pp-dp-mapping)
megatrain_parallel_train_test(parallel_train_moe_cp2_ep2_pp2_dp_last --model "${moe_model}" 4
                              --context-parallel-size 2 --expert-model-parallel-size 2 --pipeline-model-parallel-size 2
                              --use-tp-pp-dp-mapping)
megatrain_parallel_train_test(parallel_train_moe_seq_aux_cp2_dp2 --model "${moe_model} --micro-batch-size 2 \
--moe-router-load-balancing-type seq_aux_loss --moe-per-layer-logging" 4 --context-parallel-size 2 --use-distributed-optimizer)
megatrain_parallel_train_test(parallel_train_moe_bias_cp2_ep4 --model "${moe_sigmoid_model} --moe-router-enable-expert-bias" 4
                              --context-parallel-size 2 --expert-model-parallel-size 4 --use-distributed-optimizer)
# Load-balancing terms together. aux_loss with seq_aux_loss (micro-batches of 2 sequences) under
# CP 2 x EP 2. global_aux_loss (the counts summed over DP, their running mean over the step's
# micro-batches): without DP (TP 2 + SP x PP 2 x 2 virtual stages, CP 2 x EP 2) the same as one rank;
# with DP each rank's term takes the DP ranks' tokens and Megatron averages the gradients over DP,
# so the term weighs 1 / DP of the one-rank run's with the DP ranks' sequences in one micro-batch:
# at DP 2 global_aux_loss alone equals one rank with micro-batches of 2 and half the coefficient
# (losses, gradients, the logged value: summed over DP), also with full recomputation and EP 2 with
# the distributed optimizer. (aux_loss's counts are each DP rank's own: no such one-rank run.)
set(moe_global "${moe_model} --moe-router-load-balancing-type aux_loss global_aux_loss --moe-aux-loss-coeff 1e-2 0.1")
set(moe_global_only "${moe_model} --moe-router-load-balancing-type global_aux_loss --moe-aux-loss-coeff 0.1")
megatrain_parallel_train_test(parallel_train_moe_aux_seq_cp2_ep2 --model "${moe_model} --micro-batch-size 2 \
--moe-router-load-balancing-type aux_loss seq_aux_loss --moe-aux-loss-coeff 1e-2 5e-2" 4 --context-parallel-size 2
                              --expert-model-parallel-size 2)
megatrain_parallel_train_test(parallel_train_moe_global_aux_tp2_sp_pp2_vpp2 --model "${moe_global} --moe-per-layer-logging" 4
                              --tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2
                              --num-virtual-stages-per-pipeline-rank 2)
megatrain_parallel_train_test(parallel_train_moe_global_aux_cp2_ep2 --model "${moe_global}" 2 --context-parallel-size 2
                              --expert-model-parallel-size 2)
megatrain_parallel_train_test(parallel_train_moe_global_aux_dp2_recompute --model "${moe_global_only} \
--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
                              --one-rank "--micro-batch-size 2 --moe-aux-loss-coeff 5e-2" 2)
megatrain_parallel_train_test(parallel_train_moe_global_aux_ep2_dp2_distopt --model "${moe_global_only}"
                              --one-rank "--micro-batch-size 2 --moe-aux-loss-coeff 5e-2" 2
                              --expert-model-parallel-size 2 --use-distributed-optimizer)
# Megatron-LM's gpt3_mcore_tp2_cp2_pp2_ep2 layout on 8 ranks (TP2+SP x CP2 x PP2, EP2 over the CP pair).
megatrain_parallel_train_test(parallel_train_moe_tp2_cp2_pp2_ep2 --model "${moe_model}" 8 --tensor-model-parallel-size 2
                              --sequence-parallel --context-parallel-size 2 --pipeline-model-parallel-size 2
                              --expert-model-parallel-size 2)
# CP with full recompute (each layer's attention, and its transfers, run again in backward). (Not
# FP8 against one rank: as with DP, each CP rank's loss gradient is its own tokens' mean, so the
# output-gradient amaxes and scales differ from one rank's by the factor CP, while the FP8 values,
# losses and weights agree.)
megatrain_parallel_train_test(parallel_train_cp2_full_recompute --model "${cp_llama_model}" 2 --context-parallel-size 2
                              --recompute-granularity full --recompute-method uniform --recompute-num-layers 1)
# ... and with per-token loss (the gradient normalized by the global batch's tokens over DP x CP).
megatrain_parallel_train_test(parallel_train_cp2_dp2_per_token_loss 4 --context-parallel-size 2
                              --calculate-per-token-loss --use-distributed-optimizer)
# Two distributed-optimizer instances over DP x CP = 4 replicas (Megatron's partial distributed
# optimizer with CP: each instance two consecutive replicas, shards all-reduced across instances).
megatrain_parallel_train_test(parallel_train_cp2_dp2_distopt_instances2 4 --context-parallel-size 2
                              --use-distributed-optimizer --num-distributed-optimizer-instances 2)
# Multi-latent attention (low-rank queries and keys/values with their norms, YaRN as DeepSeek-V3
# sets it): its down projections and latent norms run whole on every TP rank (gradients summed
# over TP), the up projections split the heads; pipelines and context parallelism as the other
# attention (the padded values ride in the key/value blocks).
set(mla_model "--multi-latent-attention --q-lora-rank 24 --kv-lora-rank 16 --qk-head-dim 8 --qk-pos-emb-head-dim 4 \
--v-head-dim 6 --qk-layernorm --normalization RMSNorm --swiglu --position-embedding-type rope --disable-bias-linear \
--rotary-scaling-factor 40 --mscale-all-dim 1.0")
megatrain_parallel_train_test(parallel_train_mla_tp2_sp --iters 20 --model "${mla_model}" 2 --tensor-model-parallel-size 2
                              --sequence-parallel)
megatrain_parallel_train_test(parallel_train_mla_pp2 --iters 20 --model "${mla_model}" 2 --pipeline-model-parallel-size 2)
megatrain_parallel_train_test(parallel_train_mla_cp2 --iters 20 --model "${mla_model}" 2 --context-parallel-size 2)
megatrain_parallel_train_test(parallel_train_mla_sinks_tp2_cp2 --model "${mla_model} --softmax-type learnable" 4
                              --tensor-model-parallel-size 2 --context-parallel-size 2)
# Direct queries with --qk-layernorm's second norm of the input, LayerNorm and biases, TP 2 without SP.
megatrain_parallel_train_test(parallel_train_mla_direct_tp2 --model "--multi-latent-attention --kv-lora-rank 16 \
--qk-head-dim 8 --qk-pos-emb-head-dim 4 --v-head-dim 8 --qk-layernorm" 2 --tensor-model-parallel-size 2)
# ... and recomputing MLA's attention input in backward (the latents kept), with the norm outputs.
megatrain_parallel_train_test(parallel_train_mla_recompute_up_tp2_sp --model "${mla_model}" 2 --tensor-model-parallel-size 2
                              --sequence-parallel --recompute-granularity selective --recompute-modules mla_up_proj layernorm)
# Multi-token prediction (two depths after the decoder, tied embeddings): TP 2 with SP (the input
# projection column-parallel, gathered to whole rows), PP 2 (the depths on the last stage, reading
# its copy of the word embeddings), DP 2 with the distributed optimizer.
set(mtp_model "--normalization RMSNorm --swiglu --position-embedding-type rope --disable-bias-linear \
--mtp-num-layers 2 --mtp-loss-scaling-factor 0.3")
megatrain_parallel_train_test(parallel_train_mtp_tp2_sp --model "${mtp_model}" 2 --tensor-model-parallel-size 2
                              --sequence-parallel)
megatrain_parallel_train_test(parallel_train_mtp_pp2 --iters 20 --model "${mtp_model}" 2 --pipeline-model-parallel-size 2)
megatrain_parallel_train_test(parallel_train_mtp_dp2_distopt --model "${mtp_model}" 2 --use-distributed-optimizer)
# Sliding windows on the decoder layers and on the MTP depths (numbered on their own, as Megatron
# does: depth 1 windowed, depth 2 not), under PP 2 x TP 2 with sequence parallelism.
megatrain_parallel_train_test(parallel_train_mtp_window_tp2_sp_pp2 --model
  "${mtp_model} --window-size 4,0 --window-attn-skip-freq 2" 4 --tensor-model-parallel-size 2 --sequence-parallel
  --pipeline-model-parallel-size 2)
# FP8 (delayed scaling, emulated) with multi-latent attention (its five GEMMs with their own
# scaling state, the extra GEMMs' state) and MTP depths (their layers in FP8 whatever
# --first-last-layers-bf16 says, and the input projection): PP 2, CP 2 and TP 2 (+SP; the down
# projections' output gradients, partial over TP, all-reduced before their FP8 casts as Megatron-LM
# reduces them) equal one rank, MTP under TP 2 + SP too, and checkpoints resume on other layouts (the
# extra state saved per layer). Seeds as for the other FP8 tests (CP's attention and TP's partial
# sums change float sums more than PP does: seeds 42 and 1234 flip a tie within 4 iterations at TP 2).
set(fp8_delayed "--fp8-format hybrid --fp8-amax-history-len 4 --fp8-amax-compute-algo max --calculate-per-token-loss")
megatrain_parallel_train_test(parallel_train_fp8_mla_pp2 --fp8 --model "${mla_model} ${fp8_delayed} --seed 1" 2
                              --pipeline-model-parallel-size 2)
megatrain_parallel_train_test(parallel_train_fp8_mla_cp2 --fp8 --model "${mla_model} ${fp8_delayed} --seed 3" 2
                              --context-parallel-size 2)
megatrain_parallel_train_test(parallel_train_fp8_mla_tp2_sp --fp8 --model "${mla_model} ${fp8_delayed} --seed 2" 2
                              --tensor-model-parallel-size 2 --sequence-parallel)
megatrain_parallel_train_test(parallel_train_fp8_mla_direct_tp2 --fp8 --model "--multi-latent-attention --kv-lora-rank 16 \
--qk-head-dim 8 --qk-pos-emb-head-dim 4 --v-head-dim 8 --qk-layernorm ${fp8_delayed} --seed 3" 2
                              --tensor-model-parallel-size 2)
megatrain_parallel_train_test(parallel_train_resume_fp8_mla_pp2_to_cp2 --fp8 --model "${mla_model} ${fp8_delayed} --seed 1"
  --resume 2 "--pipeline-model-parallel-size 2" 2 "--context-parallel-size 2")
megatrain_parallel_train_test(parallel_train_fp8_mtp_tp2_sp --fp8 --model "${mtp_model} ${fp8_delayed}" 2
                              --tensor-model-parallel-size 2 --sequence-parallel)
megatrain_parallel_train_test(parallel_train_resume_fp8_mtp_pp2_to_tp2_sp --fp8 --model "${mtp_model} ${fp8_delayed}"
  --resume 2 "--pipeline-model-parallel-size 2" 2 "--tensor-model-parallel-size 2 --sequence-parallel")
# ... and with FP8 parameters (--fp8-param-gather): MLA's five weights and the MTP projection's are FP8
# parameters cast with the extra state's scales (the down projections' TP-partial gradients then lie
# in two ranges, the FP8 region's and the others'). MLA at TP 2 + SP (seed 4: seeds 1-3 move an
# element across an FP8 rounding tie by iteration 3, as seed 1 does without FP8 parameters) and at
# PP 2 x DP 2; MTP at TP 2 + SP.
megatrain_parallel_train_test(parallel_train_fp8_params_mla_tp2_sp --fp8
  --model "${mla_model} ${fp8_delayed} ${fp8_params} --seed 4" 2 --tensor-model-parallel-size 2 --sequence-parallel)
megatrain_parallel_train_test(parallel_train_fp8_params_mla_pp2_dp2 --fp8
  --model "${mla_model} ${fp8_delayed} ${fp8_params} --seed 1" 4 --pipeline-model-parallel-size 2)
megatrain_parallel_train_test(parallel_train_fp8_params_mtp_tp2_sp --fp8 --model "${mtp_model} ${fp8_delayed} ${fp8_params}"
                              2 --tensor-model-parallel-size 2 --sequence-parallel)
# NVIDIA's DeepSeek-proxy Megatron-FSDP configuration, small: float32 parameters (FP8 without --bf16),
# e4m3 tensorwise with FP8 parameters, ZeRO-3 (the FP8 weights sharded too, MLA's projections' and
# the experts' transposed at each use), MLA, a dense first layer, sigmoid group-limited routing with
# the expert bias, seq_aux_loss, a shared expert; DP 2 equals one rank with float32 main gradients (Megatron-FSDP's auto picks bf16
# with FP8 parameters, whose DP sums round differently).
megatrain_parallel_train_test(parallel_train_fp8_params_deepseek_proxy_fsdp_dp2 --fp8 --model "${mla_model} \
--num-experts 8 --moe-layer-freq '([0]*1+[1]*3)' --moe-ffn-hidden-size 16 --moe-shared-expert-intermediate-size 16 \
--moe-router-load-balancing-type seq_aux_loss --moe-router-topk 4 --moe-token-dispatcher-type alltoall \
--moe-router-pre-softmax --moe-aux-loss-coeff 1e-4 --moe-router-group-topk 2 --moe-router-num-groups 4 \
--moe-router-topk-scaling-factor 2.0 --moe-router-score-function sigmoid --moe-router-enable-expert-bias \
--moe-router-bias-update-rate 1e-3 --moe-router-dtype fp32 --use-distributed-optimizer --use-megatron-fsdp \
--data-parallel-sharding-strategy optim_grads_params --ckpt-format fsdp_dtensor --megatron-fsdp-main-grads-dtype fp32 \
--fp8-format e4m3 --fp8-recipe tensorwise --fp8-param-gather --calculate-per-token-loss" 2)
# A small DeepSeek-V3 proxy: MLA, sigmoid group-limited routing with the expert bias, a shared
# expert, a dense first layer, one MTP depth (an MoE layer, as the last decoder layer), on 8 ranks:
# TP 2 (+SP) x EP 2 x PP 2. (This and MLA at TP 2 + SP, PP 2 and CP 2, and MTP under PP 2, over 20
# iterations.)
set(dsv3_proxy "--multi-latent-attention --q-lora-rank 24 --kv-lora-rank 16 --qk-head-dim 8 --qk-pos-emb-head-dim 4 \
--v-head-dim 8 --qk-layernorm --normalization RMSNorm --swiglu --position-embedding-type rope --disable-bias-linear \
--rotary-scaling-factor 40 --mscale-all-dim 1.0 --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 16 \
--moe-router-score-function sigmoid --moe-router-num-groups 4 --moe-router-group-topk 2 --moe-router-topk-scaling-factor 2.5 \
--moe-router-enable-expert-bias --moe-shared-expert-intermediate-size 16 --moe-layer-freq '([0]+[1]*3)' --moe-grouped-gemm \
--mtp-num-layers 1")
megatrain_parallel_train_test(parallel_train_dsv3_proxy_tp2_ep2_pp2 --iters 20 --model "${dsv3_proxy}" 8 --tensor-model-parallel-size 2
                              --sequence-parallel --expert-model-parallel-size 2 --pipeline-model-parallel-size 2)
# ... with an untied output layer over PP 2 (the last stage's own copy of the word embeddings, its
# gradient summed with the first stage's over the embedding group), interleaved, and placed by
# Megatron's layout (m after the last stage's decoder layers).
megatrain_parallel_train_test(parallel_train_mtp_pp2_untied --model "${mtp_model} --untie-embeddings-and-output-weights" 2
                              --pipeline-model-parallel-size 2)
megatrain_parallel_train_test(parallel_train_mtp_pp2_vpp2 --model "${mtp_model}" 2 --pipeline-model-parallel-size 2
                              --num-virtual-stages-per-pipeline-rank 2)
megatrain_parallel_train_test(parallel_train_mtp_pp2_layout --model "${mtp_model}" 2 --pipeline-model-parallel-size 2
                              --pipeline-model-parallel-layout "'Ett|ttmmL'")
# (Not with context parallelism against one rank: as Megatron, each CP rank weighs its depth losses by
# its own count of rolled tokens, and the sequence's rolled-off tail falls on one rank's chunk, so
# the gradients differ from one rank's by design.)
# Fully sharded data parallelism (--use-megatron-fsdp, --use-torch-fsdp2; app/validate_fsdp.cpp):
# every sharding strategy at DP 2, 3 and 4 equals one rank (some cases over 20 iterations), also under TP 2 with sequence
# parallelism and with hybrid sharding (outer no_shard: two instances; outer optim: one), and a
# checkpoint saved under one strategy resumes under another.
set(fsdp "--use-megatron-fsdp --ckpt-format fsdp_dtensor --data-parallel-sharding-strategy")
megatrain_parallel_train_test(parallel_train_fsdp_dp3_no_shard 3 ${fsdp} no_shard --overlap-grad-reduce
                              --ddp-bucket-size 3000)
megatrain_parallel_train_test(parallel_train_fsdp_dp2_optim 2 ${fsdp} optim)
megatrain_parallel_train_test(parallel_train_fsdp_dp4_optim_grads --iters 20 4 ${fsdp} optim_grads --overlap-grad-reduce
                              --overlap-param-gather --ddp-bucket-size 3000)
megatrain_parallel_train_test(parallel_train_fsdp_dp2_optim_grads_params --iters 20 2 ${fsdp} optim_grads_params)
megatrain_parallel_train_test(parallel_train_fsdp_dp3_optim_grads_params --iters 20 3 ${fsdp} optim_grads_params
                              --overlap-grad-reduce --overlap-param-gather --ddp-bucket-size 3000)
megatrain_parallel_train_test(parallel_train_fsdp_tp2_sp_dp2_optim_grads_params --iters 20 4 ${fsdp} optim_grads_params
                              --tensor-model-parallel-size 2 --sequence-parallel)
megatrain_parallel_train_test(parallel_train_fsdp_dp4_hsdp --iters 20 4 ${fsdp} optim_grads_params
                              --num-distributed-optimizer-instances 2)
megatrain_parallel_train_test(parallel_train_fsdp_dp4_hfsdp 4 ${fsdp} optim_grads_params
                              --num-distributed-optimizer-instances 2 --outer-dp-sharding-strategy optim)
megatrain_parallel_train_test(parallel_train_torch_fsdp2_dp2 --model "--untie-embeddings-and-output-weights"
                              2 --use-torch-fsdp2 --no-gradient-accumulation-fusion)
megatrain_parallel_train_test(parallel_train_resume_fsdp_zero3_dp2_to_no_shard_dp4 --resume
  2 "${fsdp} optim_grads_params" 4 "${fsdp} no_shard")
megatrain_parallel_train_test(parallel_train_resume_fsdp_no_shard_dp3_to_optim_grads_dp2 --resume
  3 "${fsdp} no_shard" 2 "${fsdp} optim_grads --overlap-grad-reduce")
# Sharded gradients (optim_grads, optim_grads_params: each layer's gradients reduce-scattered in
# every micro-batch) with full recompute (a layer's forward rerun inside the backward), with MoE
# layers (experts in their layer's unit), in bf16 (accumulated and summed in bf16: within bf16
# rounding) and with FP8 layers (tensorwise: the weight-gradient GEMMs add into the slots).
megatrain_parallel_train_test(parallel_train_fsdp_dp2_optim_grads_recompute 2 ${fsdp} optim_grads
                              --recompute-granularity full --recompute-method uniform --recompute-num-layers 2)
megatrain_parallel_train_test(parallel_train_fsdp_moe_dp3_optim_grads_params --model "${moe_model}" 3 ${fsdp}
                              optim_grads_params)
megatrain_parallel_train_test(parallel_train_fsdp_dp3_bf16_main_grads --bf16-reduce 3 ${fsdp} optim_grads
                              --megatron-fsdp-main-grads-dtype bf16)
megatrain_parallel_train_test(parallel_train_fsdp_fp8_tensorwise_dp2 --fp8
  --model "--fp8-format hybrid --fp8-recipe tensorwise --fp8-margin 1 --no-bias-gelu-fusion --calculate-per-token-loss"
  2 ${fsdp} optim_grads_params)
# Sharded FP8 parameters (ZeRO-3 with --fp8-param-gather; float32 main gradients, see the DeepSeek
# proxy above): the update casts each rank's FP8 shard, a layer's FP8 weights are all-gathered as FP8
# bytes before its forward and its backward and transposed in its slot. Delayed scaling at DP 2, and
# with full recompute of all four layers as one group (a layer evicted from its slot is gathered and
# transposed again for its backward); tensorwise at DP 3; resumed onto the distributed optimizer's
# layout at DP 3 (the saved scales recast the same bits).
set(fp8_zero3 "${fsdp} optim_grads_params --megatron-fsdp-main-grads-dtype fp32")
megatrain_parallel_train_test(parallel_train_fsdp_fp8_params_zero3_dp2 --fp8 --model "${fp8_param_gather_model}" 2
                              ${fp8_zero3})
megatrain_parallel_train_test(parallel_train_fsdp_fp8_params_zero3_recompute_dp2 --fp8 --model "${fp8_param_gather_model}"
  2 ${fp8_zero3} --recompute-granularity full --recompute-method uniform --recompute-num-layers 4)
megatrain_parallel_train_test(parallel_train_fsdp_fp8_params_tensorwise_zero3_dp3 --fp8
  --model "${fp8_param_gather_tensorwise_model}" 3 ${fp8_zero3})
megatrain_parallel_train_test(parallel_train_resume_fsdp_fp8_params_zero3_dp2_to_distopt_dp3 --fp8
  --model "${fp8_param_gather_model}" --resume 2 "${fp8_zero3}" 3 -)
# ... of an MoE model (the experts' FP8 weights their layer's unit's: over the expert-data-parallel
# group under EP, each expert's block with its own scale, transposed at each use) at EP 2 x DP 2 and
# DP 3.
megatrain_parallel_train_test(parallel_train_fsdp_fp8_params_moe_ep2_dp2_zero3 --fp8 --model "${fp8_moe_model} ${fp8_params}"
                              4 ${fp8_zero3} --expert-model-parallel-size 2)
megatrain_parallel_train_test(parallel_train_fsdp_fp8_params_moe_dp3_zero3 --fp8 --model "${fp8_moe_model} ${fp8_params}"
                              3 ${fp8_zero3})
# Sharded parameters (optim_grads_params: each layer's all-gathered from the shards before its
# forward and backward) with full recompute of all four layers as one group (a layer evicted from
# its slot by the group's later ones is gathered again for its backward), in bf16 main gradients, and
# resumed from no_shard (the loaded weights go to each rank's shards).
megatrain_parallel_train_test(parallel_train_fsdp_dp2_zero3_recompute 2 ${fsdp} optim_grads_params
                              --recompute-granularity full --recompute-method uniform --recompute-num-layers 4)
megatrain_parallel_train_test(parallel_train_fsdp_dp4_zero3_bf16_main_grads --bf16-reduce 4 ${fsdp} optim_grads_params
                              --megatron-fsdp-main-grads-dtype bf16 --overlap-grad-reduce --overlap-param-gather)
megatrain_parallel_train_test(parallel_train_resume_fsdp_no_shard_dp2_to_zero3_dp3 --resume
  2 "${fsdp} no_shard" 3 "${fsdp} optim_grads_params")
# --log-straggler over 3 ranks: a rank made slow inside its timed forward passes
# (MEGATRAIN_DEBUG_FAULT=slow@1:40, app/train.cpp) is the one with the longest forward time and the
# lowest estimated throughput in Megatron's report line; --disable-straggler-on-startup reports nothing.
set(straggler_run "${MPIEXEC_EXECUTABLE} --oversubscribe -np 3 $<TARGET_FILE:megatrain> --device cpu --mock-data \
--tokenizer-type NullTokenizer --vocab-size 128 --make-vocab-size-divisible-by 32 --num-layers 2 --hidden-size 32 \
--num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 --micro-batch-size 1 --global-batch-size 6 \
--lr 1e-2 --train-iters 4 --eval-iters 0 --log-interval 2 --log-straggler --straggler-minmax-count 2")
add_test(NAME straggler_detector_names_the_slow_rank
         COMMAND bash -c "out=$(MEGATRAIN_DEBUG_FAULT=slow@1:40 ${straggler_run} 2>&1) || { echo \"$out\"; exit 1; }
n=$(echo \"$out\" | grep -cE 'MxRtt/Rnk: [0-9.]+ms/1 .*MnEtpt/Rnk: [0-9.]+TF/1 ')
b=$(echo \"$out\" | grep -c '^^^^^ Bottom 2 Ranks with lowest  Etpt(TF): [0-9.]*TF/1,')
echo \"$out\" | grep -E 'Rtt|\\^\\^\\^\\^'; test \"$n\" = 2 && test \"$b\" = 2")
add_test(NAME straggler_detector_disabled_on_startup
         COMMAND bash -c "out=$(${straggler_run} --disable-straggler-on-startup 2>&1) || { echo \"$out\"; exit 1; }
echo \"$out\" | grep -q 'iteration        4/' && ! echo \"$out\" | grep -q 'MnRtt/Rnk'")
set_tests_properties(straggler_detector_names_the_slow_rank straggler_detector_disabled_on_startup PROPERTIES
  LABELS mpi TIMEOUT 300
  ENVIRONMENT "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1;OMPI_MCA_rmaps_base_oversubscribe=1")
# ... and under expert parallelism: each layer's routed experts are a bucket of their own beside the
# rest of the layer, reduce-scattered and gathered over the expert-data-parallel group (EP 2 of DP 4:
# expert-DP 2), also with TP 2 + SP.
megatrain_parallel_train_test(parallel_train_fsdp_moe_ep2_dp4_zero3 --iters 20 --model "${moe_model}" 4 ${fsdp}
                              optim_grads_params --expert-model-parallel-size 2)
# MoE layers with linear biases (the experts' biases in the experts' bucket, the router's with the
# layer's) under ZeRO-3 at EP 2 of DP 4.
megatrain_parallel_train_test(parallel_train_fsdp_moe_linear_bias_ep2_dp4_zero3 --model "${moe_linear_bias_model}" 4 ${fsdp}
                              optim_grads_params --expert-model-parallel-size 2)
megatrain_parallel_train_test(parallel_train_fsdp_moe_ep2_tp2_sp_zero2 --model "${moe_model}" 4 ${fsdp}
                              optim_grads --expert-model-parallel-size 2 --tensor-model-parallel-size 2
                              --sequence-parallel)
# ... and under pipeline parallelism: each stage's layers sharded over its DP ranks; the tied
# embeddings' copies on the first and last stage (and the MTP stage's copy) summed shard by shard;
# every backward of a stage without the embedding, whose buckets are all final after its first
# layer, reduced once (a mutation reducing them again at the backward's end fails these).
megatrain_parallel_train_test(parallel_train_fsdp_pp2_dp2_zero2 4 ${fsdp} optim_grads --pipeline-model-parallel-size 2)
megatrain_parallel_train_test(parallel_train_fsdp_pp2_vpp2_dp2_zero3 4 ${fsdp} optim_grads_params
                              --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2)
# The same layouts with Megatron-FSDP's overlap flags: each layer's gather prefetched a layer ahead
# into a third slot, its reduce-scatter's sum added when its gradient slot is next zeroed (on the
# reference backend the transfers themselves stay synchronous; the slots' turns are the same code).
set(zero3_overlap "${fsdp} optim_grads_params --overlap-grad-reduce --overlap-param-gather")
megatrain_parallel_train_test(parallel_train_fsdp_overlap_dp2_zero3_recompute 2 ${zero3_overlap}
                              --recompute-granularity full --recompute-method uniform --recompute-num-layers 4)
megatrain_parallel_train_test(parallel_train_fsdp_overlap_moe_ep2_dp4_zero3 --model "${moe_model}" 4 ${zero3_overlap}
                              --expert-model-parallel-size 2)
megatrain_parallel_train_test(parallel_train_fsdp_overlap_pp2_vpp2_dp2_zero3 4 ${zero3_overlap}
                              --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2)
megatrain_parallel_train_test(parallel_train_fsdp_overlap_fp8_params_zero3_recompute_dp2 --fp8
  --model "${fp8_param_gather_model}" 2 ${fp8_zero3} --overlap-grad-reduce --overlap-param-gather
  --recompute-granularity full --recompute-method uniform --recompute-num-layers 3)
megatrain_parallel_train_test(parallel_train_fsdp_pp2_dp2_zero3_mtp
  --model "--position-embedding-type rope --untie-embeddings-and-output-weights --mtp-num-layers 1" 4 ${fsdp}
  optim_grads_params --pipeline-model-parallel-size 2)
megatrain_parallel_train_test(parallel_train_fsdp_moe_ep2_pp2_dp4_zero3 --model "${moe_model}" 8 ${fsdp}
                              optim_grads_params --pipeline-model-parallel-size 2 --expert-model-parallel-size 2)
megatrain_parallel_train_test(parallel_train_fsdp_tp2_sp_pp2_dp2_zero3 8 ${fsdp} optim_grads_params
                              --pipeline-model-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel)
megatrain_parallel_train_test(parallel_train_fsdp_pp3_uneven_dp2_zero2 6 ${fsdp} optim_grads
                              --pipeline-model-parallel-size 3 --decoder-first-pipeline-num-layers 1
                              --decoder-last-pipeline-num-layers 1)
megatrain_parallel_train_test(parallel_train_resume_fsdp_zero3_pp2_dp2_to_no_shard_dp2 --resume
  4 "${fsdp} optim_grads_params --pipeline-model-parallel-size 2" 2 "${fsdp} no_shard")
# ... and with FP8 parameters (--fp8-param-gather): the gradients sharded (ZeRO-2), the FP8 weights
# whole on every rank (ZeRO-3 keeps them so, with a warning), float32 main gradients (Megatron-FSDP's
# auto dtype is bf16 for FP8 parameters, which moves the FP8 scales): delayed scaling at DP 2,
# tensorwise at PP 2 x DP 2, TP 2 + SP x DP 2, and resumed on the plain distributed optimizer at DP 3.
set(fsdp_fp8_params "${fsdp} optim_grads --megatron-fsdp-main-grads-dtype fp32")
megatrain_parallel_train_test(parallel_train_fsdp_fp8_params_dp2_zero2 --fp8 --model "${fp8_param_gather_model}"
                              2 ${fsdp_fp8_params})
megatrain_parallel_train_test(parallel_train_fsdp_fp8_params_tensorwise_pp2_dp2_zero2 --fp8
  --model "${fp8_param_gather_tensorwise_model}" 4 ${fsdp_fp8_params} --pipeline-model-parallel-size 2)
megatrain_parallel_train_test(parallel_train_fsdp_fp8_params_tp2_sp_dp2_zero2 --fp8
  --model "${fp8_param_gather_model} --seed 1" 4 ${fsdp_fp8_params} --tensor-model-parallel-size 2 --sequence-parallel)
megatrain_parallel_train_test(parallel_train_resume_fsdp_fp8_params_zero2_dp2_to_distopt_dp3 --fp8
  --model "${fp8_param_gather_model}" --resume 2 "${fsdp_fp8_params}" 3 -)
# (With the cases above, every strategy at DP 2, 3 and 4.)
megatrain_parallel_train_test(parallel_train_fsdp_dp2_no_shard 2 ${fsdp} no_shard)
megatrain_parallel_train_test(parallel_train_fsdp_dp4_no_shard 4 ${fsdp} no_shard)
megatrain_parallel_train_test(parallel_train_fsdp_dp3_optim 3 ${fsdp} optim --overlap-grad-reduce --overlap-param-gather
                              --ddp-bucket-size 3000)
megatrain_parallel_train_test(parallel_train_fsdp_dp4_optim 4 ${fsdp} optim)
megatrain_parallel_train_test(parallel_train_fsdp_dp2_optim_grads 2 ${fsdp} optim_grads)
megatrain_parallel_train_test(parallel_train_fsdp_dp3_optim_grads 3 ${fsdp} optim_grads)
megatrain_parallel_train_test(parallel_train_fsdp_dp4_optim_grads_params 4 ${fsdp} optim_grads_params)
# --gpu-sniff-test-interval over 3 ranks: the rank made slow inside its GEMM probe is named.
add_test(NAME gpu_sniff_test_names_the_slow_rank
         COMMAND bash -c "out=$(MEGATRAIN_DEBUG_FAULT=slow@2:40 ${straggler_run} --gpu-sniff-test-interval 2 2>&1) || { echo \"$out\"; exit 1; }
echo \"$out\" | grep 'gpu sniff'; test $(echo \"$out\" | grep -c 'GEMM mean .*slower than mean + std: 2 (') = 2")
set_tests_properties(gpu_sniff_test_names_the_slow_rank PROPERTIES LABELS mpi TIMEOUT 300
  ENVIRONMENT "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1;OMPI_MCA_rmaps_base_oversubscribe=1")
# Gated DeltaNet layers among softmax-attention ones (--linear-attention-freq 2: layers 1 and 3 of
# 4 are Gated DeltaNet): TP 2 with SP (the key heads split with their value heads, the output
# norm's gradient summed over TP), PP 2, DP 2 with the distributed optimizer and full recompute,
# with MoE MLPs as Megatron-LM's test model has, and a run saved at TP 2 resumed at DP 2.
set(gdn_model "--experimental-attention-variant gated_delta_net --linear-attention-freq 2 --linear-num-key-heads 2 \
--linear-num-value-heads 4 --linear-key-head-dim 8 --linear-value-head-dim 6 --linear-conv-kernel-dim 4 --swiglu \
--apply-layernorm-1p --disable-bias-linear --position-embedding-type rope --attention-output-gate")
megatrain_parallel_train_test(parallel_train_gdn_tp2_sp --model "${gdn_model}" 2 --tensor-model-parallel-size 2
                              --sequence-parallel)
megatrain_parallel_train_test(parallel_train_gdn_pp2 --model "${gdn_model}" 2 --pipeline-model-parallel-size 2)
megatrain_parallel_train_test(parallel_train_gdn_dp2_distopt_recompute --model "${gdn_model} \
--recompute-granularity full --recompute-method uniform --recompute-num-layers 2" 2 --use-distributed-optimizer)
megatrain_parallel_train_test(parallel_train_gdn_moe_tp2_sp --model "${gdn_model} --num-experts 4 --moe-router-topk 2 \
--moe-ffn-hidden-size 24 --moe-shared-expert-intermediate-size 16 --moe-shared-expert-gate --moe-grouped-gemm \
--moe-aux-loss-coeff 1e-2" 2 --tensor-model-parallel-size 2 --sequence-parallel)
megatrain_parallel_train_test(parallel_train_gdn_resume_tp2_to_dp2 --model "${gdn_model}" --resume 2
                              "--tensor-model-parallel-size 2" 2 -)
# MuP (--use-mup at width 2 with an embedding multiplier): its hidden-matrix optimizer group over TP
# 2 with SP, and sharded by the distributed optimizer over DP 2.
set(mup_model "--use-mup --mup-base-hidden-size 16 --mup-embedding-mult 2.0")
megatrain_parallel_train_test(parallel_train_mup_tp2_sp --model "${mup_model}" 2 --tensor-model-parallel-size 2
                              --sequence-parallel)
megatrain_parallel_train_test(parallel_train_mup_dp2_distopt --model "${mup_model}" 2 --use-distributed-optimizer)
# Expert parallelism with --num-distributed-optimizer-instances 2 (Megatron-LM's intra- and
# inter-partial expert data-parallel groups): the experts' state sharded over an instance of their
# data-parallel group and the shards summed over the instances, as the dense buckets are; at EP 2 x
# TP 2 x DP 4 as Megatron-LM's own test runs it (8 ranks), at EP 2 on DP 4, with Megatron-FSDP's
# hybrid sharding, and a run saved so resumed on DP 2 without instances.
megatrain_parallel_train_test(parallel_train_moe_ep2_tp2_dp4_distopt_instances2 --model "${moe_model}" 8
                              --expert-model-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel
                              --use-distributed-optimizer --num-distributed-optimizer-instances 2)
megatrain_parallel_train_test(parallel_train_moe_ep2_dp4_distopt_instances2 --model "${moe_model}" 4
                              --expert-model-parallel-size 2 --use-distributed-optimizer
                              --num-distributed-optimizer-instances 2 --overlap-grad-reduce --ddp-bucket-size 3000)
megatrain_parallel_train_test(parallel_train_fsdp_moe_ep2_dp4_hsdp --iters 20 --model "${moe_model}" 4 ${fsdp}
                              optim_grads_params --expert-model-parallel-size 2 --num-distributed-optimizer-instances 2)
megatrain_parallel_train_test(parallel_train_moe_resume_ep2_dp4_instances2_to_dp2 --model "${moe_model}" --resume
  4 "--expert-model-parallel-size 2 --use-distributed-optimizer --num-distributed-optimizer-instances 2"
  2 "--use-distributed-optimizer")
# ... with a multi-token prediction depth (its layer Gated DeltaNet, as the last decoder layer is)
# over PP 2 with TP 2 and SP (4 ranks).
set(gdn_mtp_model "--experimental-attention-variant gated_delta_net --linear-attention-freq [0,1,1,1] \
--linear-num-key-heads 2 --linear-num-value-heads 4 --linear-key-head-dim 8 --linear-value-head-dim 6 --swiglu \
--disable-bias-linear --position-embedding-type rope --mtp-num-layers 1")
megatrain_parallel_train_test(parallel_train_gdn_mtp_tp2_sp_pp2 --model "${gdn_mtp_model}" 4 --tensor-model-parallel-size 2
                              --sequence-parallel --pipeline-model-parallel-size 2)
# Knowledge distillation (--export-kd-teacher-load): a 3-layer teacher trained first (its model
# config: tests/fixtures/megatron/kd/teacher/model_config.yaml), the 4-layer student distilled from
# it with the logits' KL divergence and ModelOpt's balancer: over TP 2 with sequence parallelism
# with the intermediate pairs of kd/layers.yaml (student layer 1's output against the teacher's
# layer 2's by mse, the final norms' by cosine), and over DP 2 with the distributed optimizer with
# the final norms' pair; evaluations give the student's language-model loss beside the
# distillation losses.
set(kd_teacher_config "--export-kd-teacher-model-config ${PROJECT_SOURCE_DIR}/tests/fixtures/megatron/kd/teacher/model_config.yaml")
megatrain_parallel_train_test(parallel_train_distill_tp2_sp --teacher "--num-layers 3 --seed 4321"
  --model "${kd_teacher_config} --export-kd-cfg ${PROJECT_SOURCE_DIR}/tests/fixtures/megatron/kd/layers.yaml"
  2 --tensor-model-parallel-size 2 --sequence-parallel)
megatrain_parallel_train_test(parallel_train_distill_dp2_distopt --teacher "--num-layers 3 --seed 4321"
  --model "${kd_teacher_config} --export-kd-cfg ${PROJECT_SOURCE_DIR}/tests/fixtures/megatron/kd/final_ln.yaml"
  2 --use-distributed-optimizer)
# ... and over CP 2 (logits only: Megatron-LM balances intermediate pairs per context-parallel rank,
# which megatrain refuses for now).
megatrain_parallel_train_test(parallel_train_distill_cp2 --teacher "--num-layers 3 --seed 4321"
  --model "${kd_teacher_config} --export-kd-cfg ${PROJECT_SOURCE_DIR}/tests/fixtures/megatron/kd/logits_t2.yaml"
  2 --context-parallel-size 2)

# Fine-grained activation offloading (every kept tensor of the named modules, whatever its size),
# under pipelines whose micro-batches in flight share the device entries (every layer copied to
# host and back): interleaved PP 2 x 2, TP 2 with SP under PP 2, and MoE layers with EP 2 under PP
# 2, each against one rank without offloading.
set(offload_flags --fine-grained-activation-offloading --min-offloaded-tensor-size 0 --offload-modules)
megatrain_parallel_train_test(parallel_train_pp2_vpp2_offload 2 --pipeline-model-parallel-size 2
                              --num-virtual-stages-per-pipeline-rank 2 ${offload_flags} attn_norm qkv_linear core_attn
                              mlp_norm)
megatrain_parallel_train_test(parallel_train_tp2_sp_pp2_offload 4 --tensor-model-parallel-size 2 --sequence-parallel
                              --pipeline-model-parallel-size 2 ${offload_flags} attn_norm core_attn attn_proj mlp_norm)
megatrain_parallel_train_test(parallel_train_moe_ep2_pp2_offload --model "${moe_model}" 4
                              --pipeline-model-parallel-size 2 --expert-model-parallel-size 2 ${offload_flags}
                              expert_fc1 moe_act core_attn qkv_linear)
