// The dry run as text. Large layouts (more than 64 ranks, more than 16 stages) are summarised;
// --json has everything.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <sstream>
#include <string>

#include "app/flags.h"
#include "app/plan.h"
#include "app/version.h"
#include "engine/model_chunks.h"
#include "parallel/launch_env.h"
#include "parallel/rank_position.h"

namespace mt {
namespace {

std::string gib(double bytes) { return fmt::format("{:.2f} GiB", bytes / (1024.0 * 1024.0 * 1024.0)); }

std::string with_commas(int64_t v) {
  const std::string digits = std::to_string(v);
  std::string s;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) s.push_back(',');
    s.push_back(digits[i]);
  }
  return s;
}

std::string count(int64_t v) {
  if (v >= 1000000000) return fmt::format("{:.2f} B ({})", v / 1e9, with_commas(v));
  if (v >= 1000000) return fmt::format("{:.2f} M ({})", v / 1e6, with_commas(v));
  return with_commas(v);
}

std::string group_str(const std::vector<int>& g) {
  if (g.size() <= 8) {
    std::string s = "[";
    for (size_t i = 0; i < g.size(); ++i) {
      if (i > 0) s.push_back(',');
      s.append(std::to_string(g[i]));
    }
    return s + "]";
  }
  return fmt::format("[{},{},...,{}] ({} ranks, stride {})", g[0], g[1], g.back(), g.size(), g[1] - g[0]);
}

std::string groups_str(const std::vector<std::vector<int>>& gs) {
  std::string s = fmt::format("{} x ", gs.size());
  if (gs.size() <= 4) {
    for (size_t i = 0; i < gs.size(); ++i) {
      if (i > 0) s.push_back(' ');
      s.append(group_str(gs[i]));
    }
    return s;
  }
  return s + group_str(gs[0]) + " " + group_str(gs[1]) + " ... " + group_str(gs.back());
}

std::string render(const nlohmann::json& v) {
  if (v.is_null()) return "None";
  if (v.is_string()) return v.get<std::string>();
  if (v.is_number_float()) return cli::format_float(v.get<double>());
  return v.dump();
}

std::string chunk_str(const ModelChunk& c) {
  std::string s = c.num_layers > 0 ? fmt::format("layers {}-{} ({})", c.first_layer, c.first_layer + c.num_layers - 1,
                                                 c.num_layers)
                                   : std::string("no layers");
  if (c.has_embedding) s += " + embedding";
  if (c.has_output) s += " + final norm, output layer, loss";
  return s;
}

}  // namespace

std::string plan_text(const Config& cfg, const Plan& plan, const std::vector<SetupMessage>& messages) {
  std::ostringstream o;
  const RankGrid& g = plan.grid;
  o << "megatrain " << version_string() << " dry run: " << g.world_size() << " rank" << (g.world_size() == 1 ? "" : "s")
    << " (launcher: " << launcher_name(cfg.parallel.launcher)
    << (cfg.run.dry_run_world_size ? ", --world-size" : "") << "), device " << (cfg.train.device == DeviceKind::cpu ? "cpu" : "gpu")
    << "\n";
  for (const SetupMessage& m : messages)
    if (m.kind == SetupMessage::Kind::info) o << m.text << "\n";

  o << "\n== configuration (* = differs from Megatron's default) ==\n";
  const nlohmann::json conf = resolved_config(cfg);
  for (const cli::FlagSpec& f : cli::flag_table().flags()) {
    if (!conf.contains(f.name)) continue;
    const nlohmann::json& e = conf[f.name];
    const bool differs = e["differs"].get<bool>();
    std::string left = "  " + f.name + " ";
    if (left.size() < 52) left += std::string(52 - left.size(), '.');
    o << (differs ? "*" : " ") << left << " " << render(e["value"]) << "\n";
  }

  o << "\n== derived ==\n";
  const nlohmann::json derived = derived_values(cfg);
  for (const auto& [k, v] : derived.items()) o << "  " << k << ": " << render(v) << "\n";

  o << "\n== rank layout (order " << g.order_string() << ", fastest first) ==\n";
  o << fmt::format("  {} ranks = TP {} x CP {} x DP {} x PP {}; virtual pipeline size {}\n", g.world_size(), g.tp, g.cp,
                   g.dp, g.pp, cfg.parallel.virtual_pipeline_size);
  o << "  TP groups: " << groups_str(rank_groups(g, "tp")) << "\n";
  o << "  DP groups: " << groups_str(rank_groups(g, "dp")) << "\n";
  o << "  PP groups: " << groups_str(rank_groups(g, "pp")) << "\n";
  if (g.cp > 1) o << "  CP groups: " << groups_str(rank_groups(g, "cp")) << "\n";
  o << "  embedding groups: " << groups_str(embedding_groups(g)) << "\n";
  const int W = g.world_size();
  auto rank_line = [&](int r) {
    const RankCoord c = rank_coord(g, r);
    o << fmt::format("  rank {:>5}: tp {} cp {} dp {} pp {}\n", r, c.tp, c.cp, c.dp, c.pp);
  };
  if (W <= 64) {
    for (int r = 0; r < W; ++r) rank_line(r);
  } else {
    for (int r = 0; r < 8; ++r) rank_line(r);
    o << "  ... (" << W - 16 << " more; --json lists every rank)\n";
    for (int r = W - 8; r < W; ++r) rank_line(r);
  }

  o << "\n== pipeline stages ==\n";
  const size_t S = plan.stages.size();
  for (size_t i = 0; i < S; ++i) {
    if (S > 16 && i == 4) {
      o << "  ... (" << S - 8 << " more stages)\n";
      i = S - 4;
    }
    const StagePlan& s = plan.stages[i];
    o << fmt::format("  stage {}: {} layers, {} parameters per rank\n", s.pp_rank, s.num_layers, count(s.params_per_rank));
    for (const ModelChunk& c : s.chunks)
      o << "    " << (s.chunks.size() > 1 ? fmt::format("chunk {}: ", c.vp_stage) : std::string()) << chunk_str(c) << "\n";
  }

  const ParamCounts& p = plan.params;
  o << "\n== parameters ==\n";
  o << "  total: " << count(p.total) << (cfg.model.untie_embeddings_and_output_weights ? "" : " (tied embeddings counted once)") << "\n";
  o << "  word embeddings: " << count(p.word_embeddings) << "; position embeddings: " << count(p.position_embeddings)
    << "; output layer: " << count(p.output_layer) << "\n";
  if (p.num_moe_layers == 0) {
    o << "  per layer: " << count(p.layer.total()) << " x " << cfg.model.num_layers << " layers = " << count(p.layers) << "\n";
  } else {
    const MoeConfig& e = cfg.model.moe;
    const LayerParamCounts& ml = p.moe_layer;
    const int dense = cfg.model.num_layers - p.num_moe_layers;
    o << "  active per token: " << count(p.active) << " (top-" << e.router_topk << " of " << e.num_experts
      << " experts in each of " << p.num_moe_layers << " MoE layers)\n";
    o << "  per dense layer: " << count(p.layer.total()) << " x " << dense << " layers; per MoE layer: "
      << count(ml.total()) << " x " << p.num_moe_layers << " layers; all layers: " << count(p.layers) << "\n";
    const int64_t experts = ml.experts_fc1_weight + ml.experts_fc2_weight + ml.experts_bias;
    o << "  per MoE layer: router " << count(ml.router_weight + ml.router_bias) << ", experts " << count(experts) << " ("
      << e.num_experts << " x " << count(experts / e.num_experts) << (ml.experts_bias > 0 ? ", biases included" : "")
      << ")";
    if (ml.shared_fc1_weight > 0)
      o << ", shared expert " << count(ml.shared_fc1_weight + ml.shared_fc2_weight + ml.shared_gate_weight);
    o << "\n";
  }
  if (p.num_gdn_layers > 0) {
    const LayerParamCounts& gl = p.gdn_layer;
    o << "  Gated DeltaNet layers: " << p.num_gdn_layers << " of " << cfg.model.num_layers
      << "; their attention: projections and convolution " << count(gl.qkv_weight) << ", output norm "
      << count(gl.qk_norms) << ", output projection " << count(gl.proj_weight) << "\n";
  }
  if (!cfg.model.untie_embeddings_and_output_weights && g.pp > 1)
    o << "  (the last stage holds its own copy of the word embeddings for the tied output layer)\n";
  if (const DistillConfig& kd = cfg.train.distill; kd.enabled() && kd.teacher)
    o << "  distillation teacher (frozen, forward only, in the memory plan below): " << count(count_parameters(*kd.teacher).total)
      << " (" << kd.teacher->num_layers << " layers)\n";

  o << "\n== FLOPs (Megatron's formula, causal attention halved, recompute not counted) ==\n";
  o << fmt::format("  per iteration: {:.4g} FLOPs (global batch {} x seq {}); per token: {:.4g}\n", plan.flops_per_iteration,
                   cfg.train.global_batch, cfg.model.seq_length, plan.flops_per_token);
  o << fmt::format("  per GPU per iteration: {:.4g} FLOPs\n", plan.flops_per_iteration / W);
  if (p.num_moe_layers > 0)
    o << "  (MoE layers: top-k experts' FFNs and the shared expert; the router, gate and token dispatch are not counted, "
         "as in Megatron)\n";
  if (cfg.model.window_size && cfg.model.window_size->first >= 0)
    o << "  (--window-size: as in Megatron, the formula counts every layer's whole causal attention)\n";

  o << "\n== memory per GPU (the engine's plan: what each rank lays out before its first step) ==\n";
  o << fmt::format("  {:>5} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11} {:>6}\n", "stage", "params", "grads",
                   "master", "optim", "activations", "workspace", "total", "slots");
  const StagePlan* peak = &plan.stages.front();
  for (size_t i = 0; i < S; ++i) {
    if (S > 16 && i == 4) {
      o << "  ...\n";
      i = S - 4;
    }
    const StageMemory& m = plan.stages[i].memory;
    using C = MemoryCategory;
    o << fmt::format("  {:>5} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11} {:>6}\n", plan.stages[i].pp_rank,
                     gib(m.plan.of(C::parameters)), gib(m.plan.of(C::gradients)), gib(m.plan.of(C::master_weights)),
                     gib(m.plan.of(C::optimizer_states)), gib(m.plan.of(C::activations)), gib(m.plan.of(C::workspace)),
                     gib(m.total), m.activation_slots);
  }
  for (const StagePlan& s : plan.stages)
    if (s.memory.total > peak->memory.total) peak = &s;
  std::string setting = cfg.train.recompute_granularity == RecomputeGranularity::full ? "full"
                        : cfg.train.recompute_granularity == RecomputeGranularity::selective ? "selective" : "none";
  if (cfg.train.recompute_granularity == RecomputeGranularity::selective)
    setting += fmt::format(" ({})", fmt::join(cfg.train.recompute_modules, ", "));
  o << fmt::format("  peak: stage {} at {} ({} bytes; recompute {}{}); slots: micro-batches whose activations a rank "
                   "holds at once\n",
                   peak->pp_rank, gib(peak->memory.total), static_cast<int64_t>(peak->memory.total), setting,
                   cfg.parallel.use_distributed_optimizer ? ", optimizer state sharded over DP" : "");
  if (plan.limit)
    o << fmt::format("  limit: {} per GPU ({}): the peak {}\n", gib(plan.limit->bytes), plan.limit->source,
                     plan.over_limit() ? fmt::format("exceeds it (rank {})", plan.peak_rank())
                                       : fmt::format("fits ({:.0f}% of it)", 100.0 * peak->memory.total / plan.limit->bytes));
  if (plan.limit)
    o << fmt::format("  longest sequence that fits: {} (all else as given){}\n",
                     plan.longest_seq > 0 ? fmt::format("--seq-length {}", plan.longest_seq) : std::string("none"),
                     plan.longest_seq_capped_by_positions ? "; --max-position-embeddings stops it (learned positions)" : "");
  else
    o << fmt::format("  limit: not checked ({}; --gpu-memory-gib N checks the plan against N GiB per GPU)\n",
                     cfg.train.device == DeviceKind::cpu ? "--device cpu" : "no GPU visible to this dry run");
  o << "  not in the plan: the CUDA context, cuBLASLt/attention workspaces and kernels (measured +0.2 GiB on an H200),\n"
       "  NCCL buffers\n";
  if (const size_t in_grads = plan.peak_stage().memory.plan.acts_in_grads; in_grads > 0)
    o << fmt::format("  activations: {} more lie in gradient memory the backward writes only once it is done with them\n"
                     "  (one micro-batch per step; docs/numerics.md)\n",
                     gib(static_cast<double>(in_grads)));
  if (const size_t host = plan.peak_stage().memory.plan.host; host > 0)
    o << fmt::format("  activations: {} more go to host memory between forward and backward (--fine-grained-activation-\n"
                     "  offloading; pinned host memory, not in the peak)\n",
                     gib(static_cast<double>(host)));
  // What the master column holds when it is not a float32 copy (engine/model_chunks.cpp decides).
  if (const std::vector<ChunkSpec> specs = model_chunk_specs(cfg, RankPosition::stage(cfg, 0), precision_dtype(cfg));
      !specs.empty() && specs.front().options.master_remainders)
    o << (specs.front().options.master_tie_bits
              ? "  master: the 16 bits each bf16 parameter lacks and a tie bit (a float32 copy's values and bits, 2.125\n"
                "  bytes per parameter instead of 4; docs/numerics.md)\n"
              : "  master: the 16 bits each bf16 parameter lacks (--use-precision-aware-optimizer: Transformer Engine's\n"
                "  remainders, the parameters rounded ties away from zero)\n");
  if (const std::string strategy = fsdp_strategy(cfg.parallel); !strategy.empty()) {
    const StagePlan& peak_stage = plan.peak_stage();
    o << fmt::format("\n== data-parallel sharding: memory per GPU of stage {} under each strategy ({}) ==\n",
                     peak_stage.pp_rank, cfg.parallel.use_torch_fsdp2 ? "--use-torch-fsdp2" : "--use-megatron-fsdp");
    o << fmt::format("  {:<27} {:>11} {:>11} {:>11} {:>11} {:>11}\n", "strategy", "params", "grads", "master", "optim",
                     "total");
    using C = MemoryCategory;
    // What the run lays out (app/validate_fsdp.cpp): its strategy's plan, else the closest one built.
    const std::string grads = unsharded_gradients_reason(cfg).value_or(""),
                      params = unsharded_params_reason(cfg).value_or("-");
    const std::string built = strategy == "no_shard" || strategy == "optim" ? strategy
                              : !grads.empty()                        ? "optim"
                              : strategy == "optim_grads" || !params.empty() ? "optim_grads"
                                                                            : "optim_grads_params";
    for (const StrategyMemory& m : sharding_strategy_memory(cfg, peak_stage.pp_rank)) {
      const bool runs = m.strategy == built;
      o << fmt::format("  {:<27} {:>11} {:>11} {:>11} {:>11} {:>11}  {}\n",
                       fmt::format("{} ({})", m.strategy, m.zero), gib(m.plan.of(C::parameters)),
                       gib(m.plan.of(C::gradients)), gib(m.plan.of(C::master_weights)),
                       gib(m.plan.of(C::optimizer_states)), gib(m.total),
                       runs ? (m.strategy == strategy ? "this run's plan (above)"
                                                      : fmt::format("this run's plan (above): {} not built", strategy))
                       : m.estimate ? "estimate"
                                    : "plan");
    }
    o << "  (totals include the activations and workspace above; the estimates shard the decoder layers' gradients\n"
         "  or parameters and add two whole layers' worth for Megatron-FSDP's double-buffered units)\n";
  }
  return o.str();
}

}  // namespace mt
