// Mixture-of-experts rules (Megatron-LM's validate_args, parallel_state and
// TransformerConfig.__post_init__), then what megatrain does not build yet. Megatron's rules come
// first, so that a combination Megatron itself refuses gets Megatron's error, and only a valid one
// "megatrain does not support ... yet". Runs last in validate().
#include <algorithm>
#include <string>
#include <vector>

#include "app/cli_internal.h"
#include "app/unsupported.h"
#include "engine/model_dims.h"
#include "parallel/rank_grid.h"

namespace mt::cli {
namespace {

// Megatron's rules. Those of TransformerConfig apply whether or not the model has experts (its
// __post_init__ checks them for every model); the ones about the experts need --num-experts.
void megatron_moe_rules(CliState& st) {
  const Config& c = st.cfg;
  const MoeConfig& e = c.model.moe;
  const ParallelConfig& p = c.parallel;
  const int E = e.num_experts;
  const int tp = p.tensor_model_parallel_size;
  const int ep = p.expert_model_parallel_size;
  const int etp = p.expert_tensor_parallel_size.value_or(tp);

  // Expert parallelism (validate_args, parallel_state).
  if (ep < 1) fail("--expert-model-parallel-size must be >= 1 (got {})", ep);
  if (etp < 1) fail("--expert-tensor-parallel-size must be >= 1 (got {})", etp);
  if (ep > 1 && !e.enabled())
    fail("--expert-model-parallel-size {} needs --num-experts (num_experts must be non None to use expert model "
         "parallelism)", ep);
  if (ep > 1 && E % ep != 0)
    fail("--num-experts {} is not a multiple of --expert-model-parallel-size {} (Number of experts should be a "
         "multiple of expert model parallel_size)", E, ep);
  const int64_t expert_model = int64_t{etp} * ep * p.pipeline_model_parallel_size;
  if (p.world_size % expert_model != 0)
    fail("world size {} is not divisible by --expert-tensor-parallel-size {} x --expert-model-parallel-size {} x "
         "--pipeline-model-parallel-size {} = {}", p.world_size, etp, ep, p.pipeline_model_parallel_size, expert_model);
  // Megatron's partial distributed optimizer splits the experts' data-parallel groups into the
  // instances too.
  const int instances = p.use_distributed_optimizer ? p.num_distributed_optimizer_instances : 1;
  if (e.enabled() && (ep > 1 || etp != tp) && instances > 1 && (p.world_size / expert_model) % instances != 0)
    fail("the experts' data-parallel size {} (world size / (ETP x EP x PP)) is not divisible by "
         "--num-distributed-optimizer-instances {} (Expert data parallel size should be divisible by partial DistOpt "
         "shard factor)", p.world_size / expert_model, instances);
  // Megatron's parallel_state with the experts' own grid: unless PP is the last axis (so with
  // --use-tp-pp-dp-mapping and PP > 1), the experts' data-parallel size is the attention's, and
  // both grids have the same pipeline groups.
  if ((ep > 1 || etp != tp) && p.use_tp_pp_dp_mapping && p.pipeline_model_parallel_size > 1) {
    const int64_t edp = p.world_size / expert_model;
    if (edp != p.data_parallel_size)
      fail("--use-tp-pp-dp-mapping with --pipeline-model-parallel-size {}: the experts' data-parallel size {} (world "
           "size / (ETP x EP x PP)) must equal the data-parallel size {} (When not using pp-last rank ordering, the "
           "data parallel size of the attention and moe layers must be the same)",
           p.pipeline_model_parallel_size, edp, p.data_parallel_size);
    if (rank_groups(RankGrid::from_config(c), "pp") != rank_groups(RankGrid::experts_from_config(c), "pp"))
      fail("--use-tp-pp-dp-mapping: --expert-model-parallel-size {} and --expert-tensor-parallel-size {} give the "
           "experts other pipeline groups than the attention's (Pipeline parallel groups are expected to be the same "
           "for Non-Expert and Expert part)", ep, etp);
  }

  // Routing.
  if (e.router_topk < 1) fail("--moe-router-topk must be >= 1 (got {})", e.router_topk);
  if (e.enabled() && e.router_topk > E)
    fail("--moe-router-topk {} is more than --num-experts {}: each token is routed to k distinct experts",
         e.router_topk, E);
  if (e.enabled() && e.apply_probs_on_input && e.router_topk != 1)  // (Megatron's experts assert it)
    fail("`moe_apply_probs_on_input` only works with `moe_router_topk`=1. (--moe-apply-probs-on-input with "
         "--moe-router-topk {})", e.router_topk);
  const bool only_sinkhorn =
      e.load_balancing_type.size() == 1 && e.load_balancing_type.front() == MoeLoadBalancing::sinkhorn;
  if (e.router_topk == 1 && e.score_function == MoeScoreFunction::softmax && !e.router_pre_softmax && !only_sinkhorn)
    fail("Please use --moe-router-pre-softmax when topk is 1 (--moe-router-topk 1 with --moe-router-score-function "
         "softmax: a softmax over one selected expert has zero gradient)");
  if (e.router_group_topk) {
    if (!e.router_num_groups)
      fail("When using group limited routing, moe_router_num_groups must be specified (--moe-router-group-topk {} "
           "needs --moe-router-num-groups)", *e.router_group_topk);
    const int groups = *e.router_num_groups;
    if (groups < 1) fail("--moe-router-num-groups must be >= 1 (got {})", groups);
    if (e.enabled() && E % groups != 0)
      fail("--num-experts {} is not divisible by --moe-router-num-groups {}", E, groups);
    if (*e.router_group_topk > groups)
      fail("--moe-router-group-topk {} is more than --moe-router-num-groups {}", *e.router_group_topk, groups);
  }
  if (e.input_jitter_eps && !(*e.input_jitter_eps >= 0 && *e.input_jitter_eps < 1))
    fail("--moe-input-jitter-eps must be in [0, 1) (got {}): the router's input is scaled by a uniform factor in "
         "[1 - eps, 1 + eps]", *e.input_jitter_eps);
  if (e.router_enable_expert_bias && e.score_function == MoeScoreFunction::softmax)
    fail("Expert bias for aux-loss-free routing only supports 'sigmoid' and 'sqrtsoftplus' score functions. Please "
         "set --moe-router-score-function to 'sigmoid' or 'sqrtsoftplus', or unset --moe-router-enable-expert-bias.");

  // Load balancing.
  const size_t types = e.load_balancing_type.size(), coeffs = e.aux_loss_coeff.size();
  if ((types > 1 || coeffs > 1) && types != coeffs)
    fail("--moe-aux-loss-coeff gives {} coefficient{} for the {} type{} of --moe-router-load-balancing-type: give one "
         "coefficient per type (moe_aux_loss_coeff must be a list of the same length as "
         "moe_router_load_balancing_type)", coeffs, coeffs == 1 ? "" : "s", types, types == 1 ? "" : "s");
  if (e.expert_capacity_factor)
    for (MoeLoadBalancing t : e.load_balancing_type)
      if (t == MoeLoadBalancing::sinkhorn)
        fail("--moe-expert-capacity-factor only works with aux_loss, seq_aux_loss, global_aux_loss or none load "
             "balancing (--moe-router-load-balancing-type sinkhorn)");
  for (MoeLoadBalancing t : e.load_balancing_type)
    if (t == MoeLoadBalancing::sinkhorn && e.aux_loss_coeff_of(t) != 0)
      fail("--moe-router-load-balancing-type sinkhorn takes no aux loss: pass --moe-aux-loss-coeff 0 (Sinkhorn load "
           "balancing does not support aux loss)");
  if (e.pad_expert_input_to_capacity && !e.expert_capacity_factor)
    fail("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor (moe_expert_capacity_factor must be set "
         "to use moe_pad_expert_input_to_capacity)");

  // Shared experts.
  if (e.shared_expert_intermediate_size) {
    if (*e.shared_expert_intermediate_size <= 0)
      fail("--moe-shared-expert-intermediate-size must be num_shared_experts * ffn_size_of_each_shared_expert, > 0 "
           "(got {})", *e.shared_expert_intermediate_size);
    if (e.shared_expert_overlap && e.token_dispatcher_type == MoeDispatcher::allgather)
      fail("--moe-shared-expert-overlap only works with --moe-token-dispatcher-type alltoall or flex");
  }

  // Expert-parallel communication overlap (TransformerConfig.__post_init__).
  if (e.overlap_expert_parallel_comm) {
    if (p.pipeline_model_parallel_size > 1 && p.virtual_pipeline_size <= 1 && !st.has("--num-layers-per-virtual-pipeline-stage") &&
        !st.has("--num-virtual-stages-per-pipeline-rank"))
      fail("--overlap-moe-expert-parallel-comm with --pipeline-model-parallel-size {} needs a virtual pipeline "
           "(If enabling EP A2A overlap, virtual_pipeline_model_parallel_size must be specified when "
           "pipeline_model_parallel_size > 1)", p.pipeline_model_parallel_size);
    if (ep <= 1)
      fail("--overlap-moe-expert-parallel-comm needs --expert-model-parallel-size > 1 "
           "(overlap_moe_expert_parallel_comm is only supported with expert model parallelism)");
    if (e.token_dispatcher_type == MoeDispatcher::allgather)
      fail("--overlap-moe-expert-parallel-comm needs --moe-token-dispatcher-type alltoall or flex "
           "(overlap_moe_expert_parallel_comm is supported with alltoall/flex token dispatcher)");
    if (c.train.recompute_granularity == RecomputeGranularity::full || c.train.recompute_method != RecomputeMethod::none ||
        c.train.recompute_num_layers)
      fail("--overlap-moe-expert-parallel-comm needs no full recomputation (disable full recomputation when enabling "
           "overlap_moe_expert_parallel_comm)");
    for (const std::string& m : c.train.recompute_modules)
      if (m == "moe")
        fail("--overlap-moe-expert-parallel-comm with --recompute-modules moe (disable moe in recompute_modules when "
             "enabling overlap_moe_expert_parallel_comm)");
    if (c.train.precision == Precision::fp32)
      fail("--overlap-moe-expert-parallel-comm needs --bf16 or --fp16 (overlap_moe_expert_parallel_comm is only "
           "supported with bf16 or fp16 model)");
    if (e.shared_expert_overlap)
      fail("--overlap-moe-expert-parallel-comm with --moe-shared-expert-overlap (disable moe_shared_expert_overlap "
           "when enabling overlap_moe_expert_parallel_comm)");
  }

  // The flex dispatcher's backends (TransformerConfig.__post_init__).
  const std::string backend =
      st.has("--moe-flex-dispatcher-backend") ? st.given.at("--moe-flex-dispatcher-backend").one() : "deepep";
  if (st.has("--moe-enable-deepep")) {
    if (e.token_dispatcher_type != MoeDispatcher::flex)
      fail("--moe-enable-deepep needs --moe-token-dispatcher-type flex (DeepEP backend is only supported with flex "
           "token dispatcher.)");
    if (backend == "hybridep")
      fail("--moe-enable-deepep with --moe-flex-dispatcher-backend hybridep (Only one backend is supported for flex "
           "token dispatcher.)");
  }
  const bool deepep = st.has("--moe-enable-deepep") || backend == "deepep";
  if (e.token_dispatcher_type == MoeDispatcher::flex && e.pad_expert_input_to_capacity && deepep)
    fail("--moe-pad-expert-input-to-capacity with --moe-token-dispatcher-type flex and the deepep backend (Flex token "
         "dispatcher with deepep backend does not support moe_pad_expert_input_to_capacity)");
  if (backend == "ncclep" && e.token_dispatcher_type != MoeDispatcher::flex)
    fail("--moe-flex-dispatcher-backend ncclep needs --moe-token-dispatcher-type flex "
         "(moe_flex_dispatcher_backend='ncclep' requires moe_token_dispatcher_type='flex'.)");

  if (st.has("--delay-wgrad-compute") && !e.overlap_expert_parallel_comm)
    fail("--delay-wgrad-compute needs --overlap-moe-expert-parallel-comm (overlap_moe_expert_parallel_comm must be "
         "enabled when enabling delay_wgrad_compute)");

  // Router padding for FP8/FP4 GEMMs.
  if (e.router_padding_for_fp8) {
    if (!c.train.fp8_format && !st.has("--fp4-format"))
      fail("--moe-router-padding-for-fp8 needs --fp8-format or --fp4-format (fp8/fp4 must be specified when "
           "moe_router_padding_for_quantization is True)");
    if (e.token_dispatcher_type == MoeDispatcher::allgather)
      fail("--moe-router-padding-for-fp8 does not work with --moe-token-dispatcher-type allgather (use alltoall)");
  }

  if (!e.enabled()) return;
  // Sizes the experts split over the expert tensor-parallel ranks, the shared expert over TP.
  if (e.expert_ffn % etp != 0)
    fail("the experts' FFN size {} (--moe-ffn-hidden-size) is not divisible by --expert-tensor-parallel-size {}",
         e.expert_ffn, etp);
  if (e.shared_expert_intermediate_size && *e.shared_expert_intermediate_size % tp != 0)
    fail("--moe-shared-expert-intermediate-size {} is not divisible by --tensor-model-parallel-size {}",
         *e.shared_expert_intermediate_size, tp);
  // Megatron's MoELayer raises in training with TP > 1 and no sequence parallelism.
  if (tp > 1 && !p.sequence_parallel)
    fail("--num-experts with --tensor-model-parallel-size {} needs --sequence-parallel (Megatron's MoE layer raises "
         "without it)", tp);
  if (c.model.add_bias_linear && etp != 1)
    fail("Bias in MoE is only supported when ETP==1 (--num-experts with linear biases needs "
         "--expert-tensor-parallel-size 1, or --disable-bias-linear)");
  // Megatron's SharedExpertMLP asserts it at construction, whatever the implementation.
  if (c.model.add_bias_linear && e.shared_expert_intermediate_size)
    fail("bias is not supported in the shared experts (--moe-shared-expert-intermediate-size with linear biases), "
         "please set '--disable-bias-linear' instead");
}

// What the engine does not build yet: one line each, all at once.
std::vector<std::string> not_built(const CliState& st) {
  std::vector<std::string> out = unsupported_problems(st.given, /*after_validation=*/true);
  const Config& c = st.cfg;
  const MoeConfig& e = c.model.moe;
  // gpt-oss's gated unit with FP4.
  if (c.model.glu_variant() && st.has("--fp4-format"))
    out.push_back("megatrain does not support --quick-geglu, --glu-linear-offset or --activation-func-clamp-value "
                  "with --fp4-format yet");
  if (c.model.gated_delta_net) {
    const std::string gdn = "--experimental-attention-variant gated_delta_net";
    if (c.parallel.context_parallel_size > 1)
      out.push_back(fmt::format("megatrain does not support {} with --context-parallel-size {} yet", gdn,
                                c.parallel.context_parallel_size));
    if (c.train.fp8_format || st.has("--fp4-format"))
      out.push_back(fmt::format("megatrain does not support {} with {} yet (Gated DeltaNet layers run in bf16, fp16 or "
                                "fp32)", gdn, c.train.fp8_format ? "--fp8-format" : "--fp4-format"));
    if (c.model.multi_latent_attention)
      out.push_back(fmt::format("megatrain does not support {} with --multi-latent-attention yet", gdn));
    if (!c.model.swiglu)
      out.push_back(fmt::format("megatrain does not support {} without --swiglu yet (its convolution and output gate "
                                "take the model's activation: megatrain builds SiLU)", gdn));
  }
  if (c.model.use_mup) {
    if (c.model.multi_latent_attention)
      out.push_back("megatrain does not support --use-mup with --multi-latent-attention yet");
    if (c.model.mtp_num_layers && *c.model.mtp_num_layers > 0)
      out.push_back("megatrain does not support --use-mup with --mtp-num-layers yet");
  }
  if (!e.enabled()) return out;
  const ParallelConfig& p = c.parallel;
  const int tp = p.tensor_model_parallel_size;
  const int etp = p.expert_tensor_parallel_size.value_or(tp);
  if (tp % etp != 0)
    out.push_back(fmt::format("megatrain does not support --expert-tensor-parallel-size {} with "
                              "--tensor-model-parallel-size {} yet (MoE: the experts' tensor-parallel size must divide "
                              "the tensor-parallel size)", etp, tp));
  if (st.has("--fp4-format"))
    out.push_back("megatrain does not support --num-experts with --fp4-format yet (MoE layers run in FP8, bf16 or fp32)");
  if (e.load_balancing_type.size() > 1)
    for (MoeLoadBalancing t : e.load_balancing_type)
      if (t == MoeLoadBalancing::sinkhorn)
        out.push_back("megatrain does not support --moe-router-load-balancing-type sinkhorn with other types yet");
  return out;
}

}  // namespace

void validate_moe(CliState& st) {
  megatron_moe_rules(st);
  const std::vector<std::string> refused = not_built(st);
  if (refused.empty()) {
    const MoeConfig& e = st.cfg.model.moe;
    const ParallelConfig& par = st.cfg.parallel;
    const int ep = par.expert_model_parallel_size;
    const int etp = par.expert_tensor_parallel_size.value_or(par.tensor_model_parallel_size);
    const bool a2a_built = ModelDims::moe_alltoall_applies(par.tensor_model_parallel_size, etp);
    if (e.enabled() && e.token_dispatcher_type == MoeDispatcher::flex)
      st.note(fmt::format("--moe-token-dispatcher-type flex: megatrain runs its own all-to-all dispatcher, the same "
                          "routing and results as Megatron's flex dispatcher (dropless unless a capacity factor is "
                          "given), without DeepEP's or HybridEP's kernels{}",
                          ep > 1 && !a2a_built ? "; with the experts' TP size between 1 and TP it dispatches by "
                                                 "all-gather and reduce-scatter"
                                               : ""));
    else if (e.enabled() && ep > 1 && e.token_dispatcher_type == MoeDispatcher::alltoall && !a2a_built)
      st.note(fmt::format("--moe-token-dispatcher-type alltoall with --expert-tensor-parallel-size {} (between 1 and "
                          "TP {}): megatrain dispatches these tokens by all-gather and reduce-scatter (the same "
                          "results, more traffic)",
                          etp, par.tensor_model_parallel_size));
    if (e.enabled() && e.router_padding_for_fp8)
      st.note("--moe-router-padding-for-fp8: megatrain pads each expert's rows in FP8 layers to a multiple of 128 "
              "with zero rows, given or not (Megatron-LM without the flag pads with zero rows too); the flag's "
              "padding routes other tokens with weight 0 instead, which changes only the experts' input amaxes");
    return;
  }
  std::string msg = refused.front();
  if (refused.size() > 1) {
    msg = fmt::format("{} problems with the command line:", refused.size());
    for (const std::string& r : refused) msg += "\n  " + r;
  }
  throw Unsupported(msg);
}

}  // namespace mt::cli
