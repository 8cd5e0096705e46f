# megatrain against Megatron-LM's own loss curves from the same weights: Megatron-LM's
# pretrain_gpt.py ran on the CPU (bench/megatron_cpu.py) from the fixtures' checkpoints with
# --finetune for 4 iterations (tests/fixtures/megatron/make_cpu_curves.sh, its iteration lines in
# tests/fixtures/megatron/curves/); megatrain imports the same checkpoint and trains with the same
# flags, on as many ranks (tests/mpi/megatron_curve_check.cpp). Every lm loss, MoE loss and gradient
# norm Megatron-LM printed must come out the same.
set(curve_common --micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer
    --vocab-size 60 --make-vocab-size-divisible-by 32 --seq-length 32 --max-position-embeddings 32 --split 99,1,0
    --log-interval 1 --eval-iters 0 --eval-interval 1000 --attention-dropout 0 --hidden-dropout 0 --seed 1234
    --train-iters 4)
set(curve_llama --hidden-size 32 --ffn-hidden-size 64 --num-attention-heads 4 --group-query-attention
    --num-query-groups 2 --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear
    --untie-embeddings-and-output-weights)
set(curve_moe --num-layers 3 ${curve_llama} --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 24
    --moe-layer-freq [0,1,1] --moe-aux-loss-coeff 1e-2 --moe-z-loss-coeff 1e-3 --moe-shared-expert-intermediate-size 16
    --moe-shared-expert-gate)
set(curve_moe_bias --num-layers 2 ${curve_llama} --num-experts 8 --moe-router-topk 3 --moe-ffn-hidden-size 16
    --moe-router-score-function sigmoid --moe-router-num-groups 4 --moe-router-group-topk 2
    --moe-router-topk-scaling-factor 2.0 --moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-2
    --moe-aux-loss-coeff 1e-2)

function(megatron_curve_test name nranks checkpoint)
  add_test(NAME megatron_curve_${name}
           COMMAND $<TARGET_FILE:megatron_curve_check> $<TARGET_FILE:megatrain> ${MPIEXEC_EXECUTABLE}
                   ${CMAKE_BINARY_DIR}/megatron_curves/${name} ${nranks}
                   ${PROJECT_SOURCE_DIR}/tests/fixtures/megatron/curves/${name}.log
                   ${PROJECT_SOURCE_DIR}/tests/fixtures/megatron/${checkpoint} ${curve_common} ${ARGN}
           WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
  set_tests_properties(megatron_curve_${name} PROPERTIES LABELS mpi TIMEOUT 300
    ENVIRONMENT "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1;OMPI_MCA_rmaps_base_oversubscribe=1")
endfunction()

# Softmax top-2 with the aux and z-losses and a gated shared expert; sigmoid group-limited routing
# with scaling and the expert bias (updated after every step); token dropping by weight.
megatron_curve_test(moe 1 moe/dist ${curve_moe})
megatron_curve_test(moe_bias 1 moe_bias/dist ${curve_moe_bias})
# The same routing with sqrt(softplus) scores.
set(curve_moe_sqrtsoftplus ${curve_moe_bias})
list(TRANSFORM curve_moe_sqrtsoftplus REPLACE "^sigmoid$" "sqrtsoftplus")
megatron_curve_test(moe_sqrtsoftplus 1 moe_bias/dist ${curve_moe_sqrtsoftplus})
megatron_curve_test(moe_drop 1 moe_drop/torch ${curve_moe} --moe-expert-capacity-factor 0.5 --moe-token-drop-policy probs)
# Data parallel 2: aux_loss with seq_aux_loss; global_aux_loss (its counts summed over DP, its
# gradient averaged over DP as Megatron-LM's). Expert parallel 2 by all-to-all. (MoE under TP + SP:
# below, with the dense TP cases.)
megatron_curve_test(moe_seq_dp2 2 moe/dist ${curve_moe} --moe-router-load-balancing-type aux_loss seq_aux_loss
                    --moe-aux-loss-coeff 1e-2 5e-2)
megatron_curve_test(moe_global_dp2 2 moe/dist ${curve_moe} --moe-router-load-balancing-type global_aux_loss
                    --moe-aux-loss-coeff 1e-2)
megatron_curve_test(moe_ep2_alltoall 2 moe/dist ${curve_moe} --expert-model-parallel-size 2
                    --moe-token-dispatcher-type alltoall)
# Muon (Megatron-LM's from emerging_optimizers) on the dense llama model of make_fixtures.sh.
megatron_curve_test(muon_llama 1 llama/tp1_dist --num-layers 4 ${curve_llama} --qk-layernorm --optimizer muon
                    --muon-fp32-matmul-prec high)
# More of the MoE router and dispatch: token dropping under EP 2 and padded to the capacity,
# Sinkhorn, pre-softmax, sigmoid with scaling, top-1 with the routing weight on the experts' input.
megatron_curve_test(moe_ep2_drop 2 moe/dist ${curve_moe} --expert-model-parallel-size 2 --moe-expert-capacity-factor 0.5)
megatron_curve_test(moe_pad 1 moe/dist ${curve_moe} --moe-expert-capacity-factor 0.5 --moe-pad-expert-input-to-capacity)
# One micro-batch per step on one rank: the experts' squares from their weight-gradient GEMMs
# (ModelOptions::expert_grad_sumsq) in the gradient norm.
megatron_curve_test(moe_mb1 1 moe/dist ${curve_moe} --global-batch-size 2)
megatron_curve_test(moe_sinkhorn 1 moe/dist ${curve_moe} --moe-router-load-balancing-type sinkhorn --moe-aux-loss-coeff 0)
megatron_curve_test(moe_presoftmax 1 moe/dist ${curve_moe} --moe-router-pre-softmax)
megatron_curve_test(moe_sigmoid 1 moe/dist ${curve_moe} --moe-router-score-function sigmoid
                    --moe-router-topk-scaling-factor 2)
megatron_curve_test(moe_top1_input 1 moe/dist ${curve_moe} --moe-router-topk 1 --moe-router-pre-softmax
                    --moe-apply-probs-on-input)
# Full recomputation: the backward's rerun of each layer's forward logs (and counts) nothing again.
megatron_curve_test(moe_recompute_full 1 moe/dist ${curve_moe} --recompute-granularity full --recompute-method uniform
                    --recompute-num-layers 1)
# The dense llama model: packed documents, sliding windows, per-token loss, NoPE layers, the
# decoupled learning rate, WSD decay, RoPE on half of each head, Llama 3's RoPE scaling.
set(curve_llama4 --num-layers 4 ${curve_llama} --qk-layernorm)
megatron_curve_test(llama_documents 1 llama/tp1_dist ${curve_llama4} --reset-attention-mask --reset-position-ids
                    --eod-mask-loss)
megatron_curve_test(llama_window 1 llama/tp1_dist ${curve_llama4} --window-size 4,0 --window-attn-skip-freq 2)
megatron_curve_test(llama_per_token 1 llama/tp1_dist ${curve_llama4} --calculate-per-token-loss)
megatron_curve_test(llama_nope 1 llama/tp1_dist ${curve_llama4} --no-rope-freq 2)
megatron_curve_test(llama_decoupled_lr 1 llama/tp1_dist ${curve_llama4} --decoupled-lr 5e-4 --decoupled-min-lr 1e-4)
megatron_curve_test(llama_wsd 1 llama/tp1_dist ${curve_llama4} --lr-decay-style WSD --lr-wsd-decay-iters 2)
megatron_curve_test(llama_rotary_half 1 llama/tp1_dist ${curve_llama4} --rotary-percent 0.5)
megatron_curve_test(llama_rope_scaling 1 llama/tp1_dist ${curve_llama4} --use-rope-scaling)
# Tensor parallel 2 on both sides, without and with sequence parallelism; MoE under TP 2 + SP, also
# with EP 2 on 4 ranks (Megatron-LM's torch norms under SP: bench/megatron_cpu.py's patch 13).
megatron_curve_test(llama_tp2 2 llama/tp1_dist ${curve_llama4} --tensor-model-parallel-size 2)
megatron_curve_test(llama_tp2_sp 2 llama/tp1_dist ${curve_llama4} --tensor-model-parallel-size 2 --sequence-parallel)
# Pipeline parallel 2 with two virtual stages (interleaved 1F1B over 4 micro-batches of 1), the MoE
# model at PP 3, and data parallel 2 with the distributed optimizer.
megatron_curve_test(llama_pp2_vpp2 2 llama/tp1_dist ${curve_llama4} --pipeline-model-parallel-size 2
                    --num-layers-per-virtual-pipeline-stage 1 --micro-batch-size 1)
megatron_curve_test(moe_pp3 3 moe/dist ${curve_moe} --pipeline-model-parallel-size 3)
megatron_curve_test(llama_dp2_distopt 2 llama/tp1_dist ${curve_llama4} --use-distributed-optimizer)
# The GPT model (LayerNorm, GeLU, learned positions, biases, tied embeddings) on one rank and at
# TP 2 + SP x PP 2; the attention output gate on one rank and at TP 2.
set(curve_gpt --num-layers 4 --hidden-size 32 --num-attention-heads 4)
megatron_curve_test(gpt 1 gpt/tp1_dist ${curve_gpt})
megatron_curve_test(gpt_tp2_sp_pp2 4 gpt/tp1_dist ${curve_gpt} --tensor-model-parallel-size 2 --sequence-parallel
                    --pipeline-model-parallel-size 2)
megatron_curve_test(llama_gate 1 gate/llama_gate ${curve_llama4} --attention-output-gate)
megatron_curve_test(llama_gate_tp2 2 gate/llama_gate ${curve_llama4} --attention-output-gate --tensor-model-parallel-size 2)
megatron_curve_test(moe_tp2_sp 2 moe/dist ${curve_moe} --tensor-model-parallel-size 2 --sequence-parallel)
megatron_curve_test(moe_ep2_tp2_sp 4 moe/dist ${curve_moe} --tensor-model-parallel-size 2 --sequence-parallel
                    --expert-model-parallel-size 2)
# gpt-oss's gated unit: quick-GeGLU with the linear offset and the clamp (dense; MoE experts and the
# shared expert), and SwiGLU clamped in an MoE model (tests/fixtures/megatron/gpt_oss_mlp: one
# finetuned iteration that records the unit).
set(curve_geglu --quick-geglu --glu-linear-offset 1.0 --no-bias-gelu-fusion)
string(REPLACE "--swiglu" "${curve_geglu}" curve_llama_geglu "${curve_llama4}")
string(REPLACE "--swiglu" "${curve_geglu}" curve_moe_geglu "${curve_moe}")
megatron_curve_test(llama_quick_geglu 1 gpt_oss_mlp/llama_quick_geglu ${curve_llama_geglu}
                    --activation-func-clamp-value 0.5)
megatron_curve_test(moe_quick_geglu 1 gpt_oss_mlp/moe_quick_geglu ${curve_moe_geglu} --activation-func-clamp-value 2.0)
# Attention sinks (--softmax-type): learnable sinks drawn by Megatron-LM into the llama checkpoint
# (tests/fixtures/megatron/attention_sinks), on one rank and split over TP 2; off-by-one with
# sliding windows on every other layer.
megatron_curve_test(llama_sinks 1 attention_sinks/llama_sinks ${curve_llama4} --softmax-type learnable)
megatron_curve_test(llama_sinks_tp2 2 attention_sinks/llama_sinks ${curve_llama4} --softmax-type learnable
                    --tensor-model-parallel-size 2)
megatron_curve_test(llama_off_by_one 1 llama/tp1_dist ${curve_llama4} --softmax-type off-by-one --window-size 4,0
                    --window-attn-skip-freq 2)
# Multi-token prediction, one depth and two (loss scaling 0.3), the two also at TP 2: from Megatron-LM's
# own initialization trained one iteration (tests/fixtures/megatron/mtp).
megatron_curve_test(llama_mtp1 1 mtp/llama_mtp1 ${curve_llama4} --mtp-num-layers 1)
megatron_curve_test(llama_mtp1_torch 1 mtp/llama_mtp1_torch ${curve_llama4} --mtp-num-layers 1)  # (torch format)
megatron_curve_test(llama_mtp2 1 mtp/llama_mtp2 ${curve_llama4} --mtp-num-layers 2 --mtp-loss-scaling-factor 0.3)
megatron_curve_test(llama_mtp2_tp2 2 mtp/llama_mtp2 ${curve_llama4} --mtp-num-layers 2 --mtp-loss-scaling-factor 0.3
                    --tensor-model-parallel-size 2)
# DeepSeek-V3's combination: sigmoid group-limited routing with the expert bias and one MTP depth (an
# MoE layer), on one rank and at EP 2.
megatron_curve_test(moe_bias_mtp1 1 mtp/moe_bias_mtp1 ${curve_moe_bias} --mtp-num-layers 1)
megatron_curve_test(moe_bias_mtp1_ep2 2 mtp/moe_bias_mtp1 ${curve_moe_bias} --mtp-num-layers 1 --expert-model-parallel-size 2)
megatron_curve_test(moe_swiglu_clamp 1 moe/dist ${curve_moe} --activation-func-clamp-value 1.0)
# gpt-oss's layer as a whole: clamped quick-GeGLU experts, learnable sinks, windows on every other
# layer (from Megatron-LM's initialization: tests/fixtures/megatron/gptoss), one rank and EP 2.
set(curve_gptoss ${curve_moe_geglu} --activation-func-clamp-value 2.0 --softmax-type learnable --window-size 4,0
    --window-attn-skip-freq 2)
megatron_curve_test(moe_gptoss 1 gptoss/moe_gptoss ${curve_gptoss})
megatron_curve_test(moe_gptoss_ep2 2 gptoss/moe_gptoss ${curve_gptoss} --expert-model-parallel-size 2)
