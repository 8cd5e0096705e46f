// The dry run as one JSON object (--dry-run --json): everything, every rank included.
#include "app/plan.h"
#include "app/version.h"

namespace mt {
namespace {

nlohmann::json memory_json(const StageMemory& m) {
  using C = MemoryCategory;
  return {{"parameters_bytes", m.plan.of(C::parameters)},
          {"gradients_bytes", m.plan.of(C::gradients)},
          {"master_weights_bytes", m.plan.of(C::master_weights)},
          {"optimizer_states_bytes", m.plan.of(C::optimizer_states)},
          {"activations_bytes", m.plan.of(C::activations)},
          {"activations_in_gradients_bytes", m.plan.acts_in_grads},
          {"workspace_bytes", m.plan.of(C::workspace)},
          {"total_bytes", m.plan.total()},
          {"host_offloaded_activations_bytes", m.plan.host},
          {"activation_slots", m.activation_slots}};
}

}  // namespace

nlohmann::json plan_json(const Config& cfg, const Plan& plan, const std::vector<SetupMessage>& messages) {
  nlohmann::json j;
  j["megatrain_version"] = version_string();
  nlohmann::json msgs = nlohmann::json::array();
  for (const SetupMessage& m : messages)
    msgs.push_back({{"kind", m.kind == SetupMessage::Kind::info ? "info" : m.kind == SetupMessage::Kind::note ? "note" : "warning"},
                    {"text", m.text}});
  j["messages"] = msgs;
  j["config"] = resolved_config(cfg);
  j["derived"] = derived_values(cfg);

  const RankGrid& g = plan.grid;
  nlohmann::json ranks = nlohmann::json::array();
  for (int r = 0; r < g.world_size(); ++r) {
    const RankCoord c = rank_coord(g, r);
    ranks.push_back({{"rank", r}, {"tp", c.tp}, {"cp", c.cp}, {"dp", c.dp}, {"pp", c.pp}});
  }
  j["rank_grid"] = {{"order", g.order_string()},
                    {"tp", g.tp}, {"cp", g.cp}, {"ep", g.ep}, {"dp", g.dp}, {"pp", g.pp},
                    {"vpp", cfg.parallel.virtual_pipeline_size},
                    {"ranks", ranks},
                    {"groups",
                     {{"tp", rank_groups(g, "tp")},
                      {"dp", rank_groups(g, "dp")},
                      {"pp", rank_groups(g, "pp")},
                      {"cp", rank_groups(g, "cp")},
                      {"model_parallel", rank_groups(g, "tp-pp")},
                      {"embedding", embedding_groups(g)},
                      {"position_embedding", position_embedding_groups(g)}}}};

  nlohmann::json stages = nlohmann::json::array();
  for (const StagePlan& s : plan.stages) {
    nlohmann::json chunks = nlohmann::json::array();
    for (const ModelChunk& c : s.chunks)
      chunks.push_back({{"vp_stage", c.vp_stage}, {"first_layer", c.first_layer}, {"num_layers", c.num_layers},
                        {"embedding", c.has_embedding}, {"output", c.has_output}});
    stages.push_back({{"pp_rank", s.pp_rank}, {"num_layers", s.num_layers}, {"chunks", chunks},
                      {"params_per_rank", s.params_per_rank}, {"memory", memory_json(s.memory)}});
  }
  j["pipeline"] = {{"stages", stages}};

  const ParamCounts& p = plan.params;
  int64_t max_rank = 0;
  for (const StagePlan& s : plan.stages) max_rank = std::max(max_rank, s.params_per_rank);
  j["parameters"] = {{"total", p.total},
                     {"word_embeddings", p.word_embeddings},
                     {"position_embeddings", p.position_embeddings},
                     {"per_layer", p.layer.total()},
                     {"layers", p.layers},
                     {"final_norm", p.final_norm},
                     {"output_layer", p.output_layer},
                     {"max_per_rank", max_rank},
                     {"active", p.active}};
  if (p.num_gdn_layers > 0)
    j["parameters"]["gated_delta_net"] = {{"num_gdn_layers", p.num_gdn_layers},
                                          {"per_dense_gdn_layer", p.gdn_layer.total()},
                                          {"per_moe_gdn_layer", p.num_moe_layers > 0 ? p.gdn_moe_layer.total() : 0}};
  if (p.num_moe_layers > 0) {
    const LayerParamCounts& ml = p.moe_layer;
    j["parameters"]["moe"] = {{"num_moe_layers", p.num_moe_layers},
                              {"per_moe_layer", ml.total()},
                              {"router", ml.router_weight},
                              {"experts_fc1", ml.experts_fc1_weight},
                              {"experts_fc2", ml.experts_fc2_weight},
                              {"router_bias", ml.router_bias},
                              {"experts_bias", ml.experts_bias},
                              {"shared_expert_fc1", ml.shared_fc1_weight},
                              {"shared_expert_fc2", ml.shared_fc2_weight},
                              {"shared_expert_gate", ml.shared_gate_weight}};
  }
  j["flops"] = {{"per_iteration", plan.flops_per_iteration},
                {"per_token", plan.flops_per_token},
                {"formula", "Megatron-LM num_floating_point_operations (HEAD, causal attention halved), recompute not counted"}};
  const StagePlan* peak = &plan.stages.front();
  for (const StagePlan& s : plan.stages)
    if (s.memory.total > peak->memory.total) peak = &s;
  j["memory"] = {{"peak_stage", peak->pp_rank}, {"peak_total_bytes", peak->memory.plan.total()},
                 {"use_distributed_optimizer", cfg.parallel.use_distributed_optimizer},
                 {"source", "the engine's memory plan (engine/memory_plan.h), the same the training run reports"},
                 {"not_counted", "CUDA context, cuBLASLt/attention workspaces and kernels, NCCL buffers"}};
  if (plan.limit)
    j["memory"]["limit"] = {{"bytes", plan.limit->bytes}, {"source", plan.limit->source},
                            {"fits", !plan.over_limit()}, {"peak_rank", plan.peak_rank()},
                            {"longest_seq_length", plan.longest_seq},
                            {"longest_seq_capped_by_positions", plan.longest_seq_capped_by_positions}};
  return j;
}

}  // namespace mt
