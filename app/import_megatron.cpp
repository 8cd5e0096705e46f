// megatrain import-megatron: a Megatron-LM checkpoint (torch, torch_dist, fsdp_dtensor or torch_dcp format, any
// tensor and pipeline layout) as a megatrain checkpoint, and the Megatron flags of its model.
//
// The model is rebuilt from the checkpoint's saved args: the model-shaping arguments become the
// same Megatron flags a launch script gives, and megatrain's own command-line parser validates them
// (so a model megatrain cannot build is refused naming the flag). With Adam's state in a layout
// megatrain reads (by parameter name; or by position, placed by checkpoint/megatron_flat_layout.h:
// the distributed optimizer's flat buffers, the torch format's index-keyed state), everything a
// resume needs is carried over; otherwise the
// weights only, as a release checkpoint: iteration 0 with fresh optimizer state, which is what
// Megatron does when it loads a checkpoint with --finetune or a converted release checkpoint.
#include "app/import_megatron.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <deque>
#include <memory>
#include <set>

#include "app/checkpoint_args.h"
#include "app/cli.h"
#include "app/megatron_args.h"
#include "app/subcommand_args.h"
#include "checkpoint/checkpoint_io.h"
#include "checkpoint/file_io.h"
#include "checkpoint/megatron_checkpoint.h"
#include "checkpoint/megatron_flat_layout.h"
#include "checkpoint/megatron_names.h"
#include "core/error.h"
#include "core/log.h"
#include "core/shape_text.h"
#include "engine/model_dims.h"
#include "engine/param_layout.h"
#include "parallel/pipeline_layout.h"

namespace mt {

namespace {

double number_arg(const PickleValue& v, const std::string& what) {
  if (v.is(PickleKind::floating)) return v.floating;
  if (v.is(PickleKind::integer)) return static_cast<double>(v.integer);
  fail("{} is a {}, not a number", what, v.describe());
}

// --loss-scale (Megatron's constant scaler, which saves no state), or nullopt.
std::optional<double> constant_loss_scale(const PickleValue& args) {
  const PickleValue* v = megatron_arg(args, "loss_scale");
  if (!v || v->is(PickleKind::none)) return std::nullopt;
  return number_arg(*v, "loss_scale");
}

// The pipeline split the checkpoint was saved with (its args), as megatrain's pipeline layout reads it.
std::optional<PipelineSplit> saved_pipeline_split(const PickleValue& args, int num_layers, std::string* why) {
  if (megatron_arg(args, "pipeline_model_parallel_layout")) {
    *why = "it was saved with a custom --pipeline-model-parallel-layout";
    return std::nullopt;
  }
  PipelineSplit s;
  s.num_layers = num_layers;
  s.pp = static_cast<int>(megatron_int_arg(args, "pipeline_model_parallel_size", 1));
  s.vpp = static_cast<int>(megatron_int_arg(args, "virtual_pipeline_model_parallel_size", 1));
  if (const PickleValue* v = megatron_arg(args, "decoder_first_pipeline_num_layers"); v && v->is(PickleKind::integer))
    s.first_stage_layers = static_cast<int>(v->integer);
  if (const PickleValue* v = megatron_arg(args, "decoder_last_pipeline_num_layers"); v && v->is(PickleKind::integer))
    s.last_stage_layers = static_cast<int>(v->integer);
  s.account_for_embedding = megatron_bool_arg(args, "account_for_embedding_in_pipeline_split");
  s.account_for_loss = megatron_bool_arg(args, "account_for_loss_in_pipeline_split");
  return s;
}

// Why the optimizer state cannot be carried over ("" when it can). The distributed optimizer's
// flat buffers are placed onto the model's parameters here (checkpoint/megatron_flat_layout.h).
std::string why_not_resumable(MegatronCheckpoint& ck, const Config& cfg) {
  const PickleValue& args = ck.args();
  if (ck.release()) return "it is a release checkpoint";
  if (ck.optimizer_layout() == "none") return "it holds no optimizer state: saved with --no-save-optim?";
  if (cfg.model.moe.enabled() && ck.optimizer_layout() != "by parameter" &&
      !(ck.optimizer_layout() == "flat buckets" && ck.format() == "torch_dist"))
    return "megatrain reads the optimizer state of Megatron-LM's mixture-of-experts checkpoints by parameter name or "
           "in the distributed optimizer's flat buckets of torch_dist, not as " + ck.optimizer_layout() + " yet";
  if (ck.optimizer_layout() == "flat buckets" || ck.optimizer_layout() == "by index") {
    // Where each parameter's state is follows from the model and its parallel layout.
    std::string why;
    const std::optional<PipelineSplit> split = saved_pipeline_split(args, cfg.model.num_layers, &why);
    if (!split) return why;
    const PickleValue* impl = megatron_arg(args, "transformer_impl");
    const bool te_spec = !impl || !impl->is(PickleKind::string) || impl->text != "local";
    const int tp = static_cast<int>(megatron_int_arg(args, "tensor_model_parallel_size", 1));
    why = ck.optimizer_layout() == "flat buckets" ? place_flat_optimizer_state(ck, cfg, tp, *split, te_spec)
                                                   : place_indexed_optimizer_state(ck, cfg, tp, *split, te_spec);
    if (!why.empty()) return why;
  } else if (ck.optimizer_layout() != "by parameter") {
    return "its optimizer state is stored as " + ck.optimizer_layout() + ", which megatrain does not read yet";
  }
  const PickleValue* opt = megatron_arg(args, "optimizer");
  if (opt && opt->is(PickleKind::string) && opt->text != "adam") return "its optimizer is " + opt->text + ", not adam";
  if (!ck.optimizer_step())
    return "its optimizer state has no step count: an optimizer that never stepped, e.g. a format conversion's";
  if (megatron_bool_arg(args, "fp16") && !constant_loss_scale(args) && !ck.grad_scaler())
    return "it was trained with --fp16 but holds no state of its dynamic loss scaler";
  return "";
}

// Megatron's saved scheduler (OptimizerParamScheduler.state_dict, steps in samples) in the form
// lr_schedule_params_from_json reads; what Megatron does not save there comes from its args.
nlohmann::json lr_scheduler_json(const PickleValue& sched, const PickleValue& args, const std::string& where) {
  auto num = [&](const char* k) { return number_arg(sched.at(k, where), where + ": " + k); };
  auto text = [&](const char* k) {
    const PickleValue& v = sched.at(k, where);
    if (!v.is(PickleKind::string)) fail("{}: {} is a {}, not a string", where, k, v.describe());
    return v.text;
  };
  nlohmann::json wsd = nullptr;
  const PickleValue* global_batch = megatron_arg(args, "global_batch_size");
  if (const PickleValue* v = megatron_arg(args, "lr_wsd_decay_samples")) wsd = number_arg(*v, "lr_wsd_decay_samples");
  else if (const PickleValue* it = megatron_arg(args, "lr_wsd_decay_iters"); it && global_batch)
    wsd = number_arg(*it, "lr_wsd_decay_iters") * number_arg(*global_batch, "global_batch_size");
  const PickleValue* init = megatron_arg(args, "lr_warmup_init");
  const PickleValue* wsd_style = megatron_arg(args, "lr_wsd_decay_style");
  return nlohmann::json{{"max_lr", num("max_lr")},
                        {"min_lr", num("min_lr")},
                        {"init_lr", init ? number_arg(*init, "lr_warmup_init") : 0.0},
                        {"lr_warmup_steps", num("lr_warmup_steps")},
                        {"lr_decay_steps", num("lr_decay_steps")},
                        {"lr_decay_style", text("lr_decay_style")},
                        {"wsd_decay_steps", wsd},
                        {"lr_wsd_decay_style", wsd_style && wsd_style->is(PickleKind::string) ? wsd_style->text
                                                                                              : std::string("exponential")},
                        {"start_wd", num("start_wd")},
                        {"end_wd", num("end_wd")},
                        {"wd_incr_steps", num("wd_incr_steps")},
                        {"wd_incr_style", text("wd_incr_style")},
                        {"num_steps", static_cast<int64_t>(num("num_steps"))}};
}

// The run configuration a Megatron-LM checkpoint's saved args describe: its model flags parsed as a
// training run would (single process, the tokenizer replaced by a NullTokenizer of the padded size:
// the files the checkpoint names may not be on this machine), with the tokenizer as saved.
Config megatron_checkpoint_config(const MegatronCheckpoint& ck, MegatronImportResult& r) {
  const PickleValue& args = ck.args();
  const std::string where = "the Megatron-LM checkpoint " + ck.directory();
  const PickleValue* padded = megatron_arg(args, "padded_vocab_size");
  if (!padded || !padded->is(PickleKind::integer))
    fail("{} does not record padded_vocab_size in its args: megatrain cannot size the embedding", where);
  r.model_flags = megatron_model_flags(args, where);
  r.tokenizer_flags = megatron_tokenizer_flags(args, where);
  r.format = ck.format();
  r.iteration = ck.iteration();
  std::vector<std::string> parse = r.model_flags;
  for (const char* f : {"--tokenizer-type", "NullTokenizer", "--vocab-size"}) parse.push_back(f);
  parse.push_back(std::to_string(padded->integer));
  // The batch sizes as saved (recorded for --override-ckpt-iteration's check).
  for (const char* name : {"micro_batch_size", "global_batch_size"})
    if (const PickleValue* v = megatron_arg(args, name); v && v->is(PickleKind::integer)) {
      parse.push_back(std::string("--") + (name[0] == 'm' ? "micro-batch-size" : "global-batch-size"));
      parse.push_back(std::to_string(v->integer));
    }
  // Which parameters its optimizer decays decides the distributed optimizer's param groups.
  if (const PickleValue* v = megatron_arg(args, "apply_wd_to_qk_layernorm"); v && v->is(PickleKind::boolean) && v->boolean)
    parse.push_back("--apply-wd-to-qk-layernorm");
  for (const char* f : {"--train-iters", "1", "--mock-data", "--lr", "1e-4", "--device", "cpu"}) parse.push_back(f);
  Config cfg;
  std::vector<SetupMessage> messages;
  try {
    cfg = parse_config(parse, Environment{}, &messages);
  } catch (const Unsupported& e) {
    throw Unsupported(fmt::format("{} holds a model megatrain does not build: {}", where, e.what()));
  } catch (const Error& e) {
    throw Error(fmt::format("{}: its saved args do not make a valid model: {}", where, e.what()));
  }
  if (cfg.model.gated_delta_net)
    throw Unsupported(fmt::format("{} holds Gated DeltaNet layers (experimental_attention_variant gdn): megatrain does "
                                  "not import them from Megatron-LM yet", where));
  cfg.model.padded_vocab_size = static_cast<int>(padded->integer);
  cfg.model.vocab_size = static_cast<int>(padded->integer);
  // The tokenizer as the run that saved the checkpoint had it (for --use-checkpoint-args).
  cfg.data.tokenizer_type.reset();
  cfg.data.vocab_size.reset();
  auto text_arg = [&](const char* name) -> std::optional<std::string> {
    const PickleValue* v = megatron_arg(args, name);
    if (v && v->is(PickleKind::string)) return v->text;
    return std::nullopt;
  };
  cfg.data.tokenizer_type = text_arg("tokenizer_type");
  cfg.data.vocab_file = text_arg("vocab_file");
  cfg.data.merge_file = text_arg("merge_file");
  cfg.data.tokenizer_model = text_arg("tokenizer_model");
  if (const PickleValue* v = megatron_arg(args, "vocab_size"); v && v->is(PickleKind::integer))
    cfg.data.vocab_size = static_cast<int>(v->integer);
  r.model = cfg.model;
  return cfg;
}

}  // namespace

bool is_megatron_checkpoint(const std::string& load_dir, std::optional<int64_t> ckpt_step) {
  const std::optional<CheckpointLocation> loc = locate_checkpoint(load_dir, ckpt_step);
  return loc && !path_exists(join_path(loc->directory, "manifest.json"));
}

void read_megatron_weights(const std::string& load_dir, const ModelConfig& model, const std::string& flag,
                           const std::vector<ParamDesc>& descs,
                           const std::function<void(size_t, const std::vector<float>&)>& fill) {
  MegatronCheckpoint ck(load_dir, std::nullopt);
  MegatronImportResult r;
  const Config cfg = megatron_checkpoint_config(ck, r);
  const std::string where = fmt::format("{} {} (a Megatron-LM {} checkpoint)", flag, ck.directory(), ck.format());
  check_checkpoint_model(model_config_to_json(cfg.model), model, where);
  std::set<std::string> unused;
  for (const std::string& n : ck.parameter_names()) unused.insert(n);
  std::vector<float> whole, local;
  for (size_t i = 0; i < descs.size(); ++i) {
    const ParamDesc& p = descs[i];
    const std::string& name = p.shared_copy ? p.init_name : p.name;
    unused.erase(name);
    const HostArray g = ck.parameter(name);
    if (g.shape != p.global_shape)
      fail("{}: '{}' is {} but this run's model has it {}", where, name, shape_text(g.shape), shape_text(p.global_shape));
    if (!is_floating(g.dtype) || is_fp8(g.dtype))  // (what convert_copy converts)
      fail("{}: '{}' is stored as {}, which megatrain does not read", where, name, dtype_name(g.dtype));
    whole.resize(static_cast<size_t>(g.numel()));
    convert_copy(g.bytes.data(), g.dtype, whole.data(), DType::f32, g.numel());
    local.resize(static_cast<size_t>(p.shard.local_numel()));
    for (size_t j = 0; j < local.size(); ++j) local[j] = whole[static_cast<size_t>(shard_global_index(p.shard, static_cast<int64_t>(j)))];
    fill(i, local);
  }
  if (!unused.empty())
    fail("{} holds {} tensor(s) this run's model does not have, e.g. '{}': check the model's flags", where,
         unused.size(), *unused.begin());
}

MegatronImportResult import_megatron(const std::string& load_dir, std::optional<int64_t> ckpt_step,
                                     const std::string& save_dir, bool weights_only, uint64_t max_part_bytes) {
  MegatronCheckpoint ck(load_dir, ckpt_step);
  const PickleValue& args = ck.args();
  const std::string where = "the Megatron-LM checkpoint " + ck.directory();
  MegatronImportResult r;
  const Config cfg = megatron_checkpoint_config(ck, r);

  // Every parameter of the model, unsharded, in forward order.
  const ModelDims dims = ModelDims::from_config(cfg, RankPosition::split(cfg, 1, 0));
  int64_t total = 0;
  const std::vector<ParamDesc> descs = build_param_descs(dims, &total);
  std::set<std::string> unused;
  for (const std::string& n : ck.parameter_names()) unused.insert(n);

  const std::string why_not = weights_only ? std::string() : why_not_resumable(ck, cfg);
  r.resumable = !weights_only && why_not.empty();
  if (!weights_only) r.weights_only_reason = why_not;
  const int64_t step = r.resumable ? *ck.optimizer_step() : 0;  // read before anything is written
  if (r.resumable) {
    const std::string& layout = ck.optimizer_layout();
    const std::string which = ck.distributed_optimizer() ? "the distributed optimizer's " : "the optimizer's ";
    if (layout == "flat buckets")
      r.optimizer_source = which + (ck.flat_coalesced() ? "distrib_optim.pt" : "flat buckets");
    else if (layout == "by index")
      r.optimizer_source = which + "state keyed by parameter index";
    else
      r.optimizer_source = which + "state by parameter name";
  }

  // The checkpoint is written in parts ("ranks" of one save, each its own files) of at most
  // max_part_bytes of tensors, so that only one part is in memory at a time: an 8B model with
  // its Adam state is over 100 GB.
  const int64_t per_element = 4 + (r.resumable ? 12 : 0);  // model (at most float32), moments, main weights
  std::vector<std::vector<const ParamDesc*>> parts(1);
  uint64_t part_bytes = 0;
  for (const ParamDesc& p : descs) {
    if (p.shared_copy) continue;
    const uint64_t bytes = static_cast<uint64_t>(shape_numel(p.global_shape) * per_element);
    if (!parts.back().empty() && part_bytes + bytes > max_part_bytes) {
      parts.emplace_back();
      part_bytes = 0;
    }
    parts.back().push_back(&p);
    part_bytes += bytes;
  }
  const int world = static_cast<int>(parts.size());
  const int64_t iteration = r.resumable ? ck.iteration() : 0;

  RunState rs;
  nlohmann::json rank_state = nullptr;
  rs.config = checkpoint_config_json(cfg);
  rs.config["imported_from"] = ck.directory();
  if (r.resumable) {
    const std::string common = where + "'s common state";
    auto count = [&](const char* name) { return megatron_int_arg(args, name, 0); };
    rs.iteration = ck.iteration();
    rs.consumed_train_samples = count("consumed_train_samples");
    rs.consumed_valid_samples = count("consumed_valid_samples");
    rs.skipped_train_samples = count("skipped_train_samples");
    if (const PickleValue* f = ck.common_state()->find("num_floating_point_operations_so_far"))
      rs.num_floating_point_operations_so_far = number_arg(*f, common + ": num_floating_point_operations_so_far");
    rs.lr_scheduler = lr_scheduler_json(ck.common_state()->at("opt_param_scheduler", common), args, common);
    rs.loss_scaler = nlohmann::json{{"kind", megatron_bool_arg(args, "bf16") ? "constant" : "none"}, {"scale", 1.0}, {"growth_tracker", 0},
                                    {"hysteresis_tracker", 0}};
    if (megatron_bool_arg(args, "fp16")) {
      // --fp16: Megatron's constant scaler (--loss-scale) saves nothing; its dynamic one its scale
      // and trackers, which the resumed run continues from.
      if (const std::optional<double> constant = constant_loss_scale(args)) {
        rs.loss_scaler["kind"] = "constant";
        rs.loss_scaler["scale"] = *constant;
      } else {
        const MegatronCheckpoint::GradScalerState g = *ck.grad_scaler();
        rs.loss_scaler = nlohmann::json{{"kind", "dynamic"}, {"scale", g.scale}, {"growth_tracker", g.growth_tracker},
                                        {"hysteresis_tracker", g.hysteresis_tracker}};
      }
    }
    rs.extra["optimizer"] = nlohmann::json{{"kind", "adam"}, {"successful_steps", step}};
    // Megatron's RNG states do not carry over: dropout masks continue from megatrain's own stream
    // at the micro-batch count a megatrain run would have reached.
    const int64_t dp = std::max<int64_t>(1, count("data_parallel_size"));
    const int64_t micro = std::max<int64_t>(1, count("micro_batch_size"));
    const int64_t per_step = std::max<int64_t>(1, count("global_batch_size") / (micro * dp));
    rank_state = nlohmann::json{
        {"dropout_rng", {{"seed", count("seed")}, {"micro_batch_serial", ck.iteration() * per_step}}}};
  }

  CheckpointWriter first(save_dir, iteration, 0, world, /*release=*/!r.resumable);
  remove_tree(first.temp_directory());  // an earlier import's interrupted parts
  first.set_run_state(rs);
  if (!rank_state.is_null()) first.set_rank_state(rank_state);
  try {
    for (int part = 0; part < world; ++part) {
      std::unique_ptr<CheckpointWriter> other;
      if (part > 0) other = std::make_unique<CheckpointWriter>(save_dir, iteration, part, world, !r.resumable);
      CheckpointWriter& writer = part == 0 ? first : *other;
      std::deque<HostArray> held;  // the writer reads them in write_local()
      auto add = [&](const ParamDesc& p, CheckpointKind kind, const std::string& name, HostArray a) {
        const HostArray& h = held.emplace_back(std::move(a));
        if (h.shape != p.global_shape)
          fail("{}: '{}' ({}) is {} but the model its args describe has it {}", where, p.name,
               checkpoint_kind_name(kind), shape_text(h.shape), shape_text(p.global_shape));
        const int64_t rows = h.shape[0], cols = h.shape.size() == 2 ? h.shape[1] : 1;
        writer.add(name, kind, ShardIndex::whole(rows, cols),
                   Tensor(const_cast<unsigned char*>(h.bytes.data()), h.dtype, Device::cpu, {h.numel()}),
                   p.global_shape);
      };
      for (const ParamDesc* p : parts[static_cast<size_t>(part)]) {
        HostArray a = ck.parameter(p->name);
        unused.erase(p->name);
        if (a.dtype != DType::f32 && a.dtype != DType::bf16 && a.dtype != DType::f16)
          fail("{}: '{}' is stored as {}, not a floating-point type megatrain trains in", where, p->name,
               dtype_name(a.dtype));
        const DType model_dtype = a.dtype;
        std::optional<HostArray> main;
        if (r.resumable) {
          // The model weights are the optimizer's main weights, rounded (the distributed
          // optimizer keeps them for every parameter, the others for bf16 models): a parameter
          // whose state came from the wrong place fails here.
          main = ck.optimizer_state("fp32_param", p->name);
          if (!main && ck.distributed_optimizer()) fail("{} has no main weights ('param' state) for '{}'", where, p->name);
          if (main) check_main_weights(*main, a, p->name, where);
        }
        add(*p, CheckpointKind::model, p->name, std::move(a));
        ++r.tensors;
        if (!r.resumable) continue;
        // Adam's moments and the float32 main weights (bf16/fp16 models only), under the names
        // and kinds megatrain's own checkpoints use.
        for (const char* state : {"exp_avg", "exp_avg_sq"}) {
          std::optional<HostArray> m = ck.optimizer_state(state, p->name);
          if (!m) fail("{} has no optimizer state '{}' for '{}'", where, state, p->name);
          add(*p, CheckpointKind::optimizer, p->name + "." + state, std::move(*m));
        }
        if (main && model_dtype != DType::f32) add(*p, CheckpointKind::main_params, p->name, std::move(*main));
      }
      // The aux-loss-free expert biases (Megatron's router buffer expert_bias, float32 [E]; part 0),
      // the multi-token prediction depths' too (an MTP layer is MoE as the last decoder layer is;
      // megatrain numbers depth j's layer L + j).
      const int L = cfg.model.num_layers;
      if (part == 0 && cfg.model.moe.enabled() && cfg.model.moe.router_enable_expert_bias)
        for (int l = 0; l < L + cfg.model.mtp_num_layers.value_or(0); ++l) {
          const std::string source = l < L ? expert_bias_name(l)
                                           : fmt::format("mtp.layers.{}.transformer_layer.mlp.router.expert_bias", l - L);
          const std::string name = expert_bias_name(l);
          if (!cfg.model.moe.is_moe_layer(std::min(l, L - 1)) || !unused.count(source)) continue;
          unused.erase(source);
          const HostArray& b = held.emplace_back(ck.parameter(source));
          const int64_t E = cfg.model.moe.num_experts;
          if (b.dtype != DType::f32 || b.numel() != E)
            fail("{}: '{}' is {} {}, not float32 [{}]", where, name, dtype_name(b.dtype), shape_text(b.shape), E);
          writer.add(name, CheckpointKind::model, ShardIndex::whole(E, 1),
                     Tensor(const_cast<unsigned char*>(b.bytes.data()), DType::f32, Device::cpu, {E}), {E});
          ++r.tensors;
        }
      writer.write_local();  // throws on failure (this process writes every part itself)
    }
    for (const std::string& n : unused)
      log::warn0("import-megatron: {} holds '{}', which the model its args describe does not have; not imported",
                 ck.directory(), n);
    first.commit(SaveGroup{0, world, [](bool ok) { return ok; }});
  } catch (...) {
    try {
      remove_tree(first.temp_directory());  // nothing half-written is left behind
    } catch (...) {
    }
    throw;
  }
  return r;
}

int import_megatron_main(const std::vector<std::string>& args) {
  const SubcommandArgs a("import-megatron", args, {"--load", "--save", "--ckpt-step"}, {"--weights-only"});
  const std::string load = a.required("--load", "DIR (the directory Megatron-LM's --save wrote)");
  const std::string save = a.required("--save", "CKPT (where the megatrain checkpoint goes)");
  std::optional<int64_t> step;
  if (a.get("--ckpt-step")) step = a.integer("--ckpt-step", 0);
  const MegatronImportResult r = import_megatron(load, step, save, a.has("--weights-only"));
  std::vector<std::string> flags = r.model_flags;
  flags.insert(flags.end(), r.tokenizer_flags.begin(), r.tokenizer_flags.end());
  flags.push_back("--load");
  flags.push_back(save);
  std::printf("imported %s (Megatron-LM %s format, iteration %lld, %d tensors) into %s as %s\n", load.c_str(),
              r.format.c_str(), static_cast<long long>(r.iteration), r.tensors, save.c_str(),
              r.resumable ? "a checkpoint to resume from" : "a release checkpoint");
  if (r.resumable)
    std::printf("with the optimizer state (Adam moments and step, float32 main weights; from %s), the "
                "learning-rate schedule and the consumed samples: training with --load resumes at iteration %lld "
                "as Megatron would (its RNG states do not carry over: dropout masks differ)\n",
                r.optimizer_source.c_str(), static_cast<long long>(r.iteration));
  else
    std::printf("weights only, as %s: training from it starts at iteration 0 with fresh optimizer state, as "
                "Megatron's --finetune does\n",
                r.weights_only_reason.empty() ? "--weights-only asks" : r.weights_only_reason.c_str());
  std::printf("train from it with these model flags (plus your data, batch and optimizer flags):\n%s\n",
              shell_quoted_line(flags).c_str());
  return 0;
}

}  // namespace mt
