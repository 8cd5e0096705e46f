#include "app/distill_args.h"

#include <algorithm>
#include <filesystem>
#include <set>

#include <fmt/ranges.h>

#include "app/cli.h"
#include "core/error.h"
#include "core/yaml_lite.h"

namespace mt::cli {

namespace {

const char* const kKdFlags[] = {"--export-kd-teacher-load", "--export-kd-cfg", "--export-kd-teacher-model-config",
                                "--export-kd-teacher-ckpt-format"};

// The distillation config file into cfg (ModelOpt's DistillationConfig fields).
void read_distill_config(DistillConfig& d, const std::string& path) {
  const nlohmann::json j = read_yaml_file(path);
  if (j.is_null()) return;  // (an empty file: the defaults)
  if (!j.is_object()) fail("--export-kd-cfg {}: expected a mapping of DistillationConfig's fields", path);
  const auto bad = [&](const std::string& key, const char* want) {
    fail("--export-kd-cfg {}: {} must be {}, got {}", path, key, want, j.at(key).dump());
  };
  for (const auto& [key, v] : j.items()) {
    if (key == "skip_lm_loss") {
      if (!v.is_boolean()) bad(key, "true or false");
      d.skip_lm_loss = v.get<bool>();
    } else if (key == "kd_loss_scale" || key == "logit_kl_temperature") {
      if (!v.is_number() || v.get<double>() <= 0) bad(key, "a positive number");  // (ModelOpt asserts > 0)
      (key == "kd_loss_scale" ? d.kd_loss_scale : d.logit_kl_temperature) = v.get<double>();
    } else if (key == "logit_layers") {
      if (!v.is_array() || v.size() != 2 || !v[0].is_string() || !v[1].is_string()) bad(key, "two layer names");
      if (v[0] != "output_layer" || v[1] != "output_layer")
        throw Unsupported(fmt::format("--export-kd-cfg {}: logit_layers {} are not supported yet (the output layers' "
                                      "logits are: [\"output_layer\", \"output_layer\"])", path, v.dump()));
    } else if (key == "intermediate_layer_pairs") {
      if (!v.is_array()) bad(key, "a list of [student layer, teacher layer(, cosine|mse)]");
      for (const nlohmann::json& e : v) {
        if (!e.is_array() || (e.size() != 2 && e.size() != 3) ||
            !std::all_of(e.begin(), e.end(), [](const nlohmann::json& x) { return x.is_string(); }))
          fail("--export-kd-cfg {}: each of intermediate_layer_pairs must be [student layer, teacher layer] or "
               "[student, teacher, cosine|mse], got {}", path, e.dump());
        DistillConfig::Pair p{e[0].get<std::string>(), e[1].get<std::string>(), false};
        if (e.size() == 3) {
          const std::string fn = e[2].get<std::string>();
          if (fn != "cosine" && fn != "mse")
            fail("--export-kd-cfg {}: unknown intermediate loss function {} (cosine or mse)", path, fn);
          p.mse = fn == "mse";
        }
        for (const std::string& n : {p.student, p.teacher})
          if (DistillConfig::hidden_state_layer(n) < -1)
            throw Unsupported(fmt::format(
                "--export-kd-cfg {}: the intermediate layer {} is not supported yet (a decoder layer's output, "
                "decoder.layers.N, and the final norm's, decoder.final_layernorm, are)", path, n));
        d.intermediate_layer_pairs.push_back(p);
      }
    } else if (key == "logit_kl_topk" || key == "criterion" || key == "loss_balancer") {
      if (!v.is_null())
        throw Unsupported(fmt::format("--export-kd-cfg {}: {} is not supported yet", path, key));
    } else {
      fail("--export-kd-cfg {}: unknown field {} (DistillationConfig has intermediate_layer_pairs, logit_layers, "
           "skip_lm_loss, kd_loss_scale, logit_kl_temperature, logit_kl_topk)", path, key);
    }
  }
}

// The teacher's model config (Megatron's argument names) as changes to the student's command line:
// value arguments appended (the last occurrence wins, as in argparse), switches added or removed.
std::vector<std::string> teacher_command_line(std::vector<std::string> args, const nlohmann::json& overrides,
                                              const std::string& path, std::vector<std::string>& shown) {
  // The student's distillation flags go (the teacher has none).
  for (const char* f : kKdFlags)
    for (auto it = std::find(args.begin(), args.end(), f); it != args.end(); it = std::find(args.begin(), args.end(), f))
      args.erase(it, std::min(args.end(), it + 2));
  if (overrides.is_null()) return args;
  if (!overrides.is_object()) fail("teacher model config {}: expected a mapping of argument names to values", path);
  const auto remove_flag = [&](const FlagSpec& f) {
    for (const std::string& n : f.all_names())
      args.erase(std::remove(args.begin(), args.end(), n), args.end());
  };
  for (const auto& [key, v] : overrides.items()) {
    const FlagSpec* spec = nullptr;
    for (const FlagSpec& f : flag_table().flags())
      if (f.model && f.model->dest == key) spec = &f;
    if (!spec)
      throw Unsupported(fmt::format("teacher model config {}: {} is not a model argument megatrain's teacher takes (its "
                                    "layout, data and training settings are the student's)", path, key));
    if (spec->arity == Arity::none) {
      if (!v.is_boolean()) fail("teacher model config {}: {} must be true or false, got {}", path, key, v.dump());
      remove_flag(*spec);
      if (v.get<bool>() != spec->store_false) args.push_back(spec->name);
      shown.push_back(fmt::format("{}: {}", key, v.dump()));
      continue;
    }
    std::string text;
    if (v.is_string()) text = v.get<std::string>();
    else if (v.is_number() || v.is_boolean()) text = v.dump();
    else if (v.is_array()) {
      text = "[";
      for (size_t i = 0; i < v.size(); ++i) text += (i ? "," : "") + (v[i].is_string() ? v[i].get<std::string>() : v[i].dump());
      text += "]";
    } else if (v.is_null()) {
      remove_flag(*spec);  // (None: the argument's default)
      shown.push_back(fmt::format("{}: null", key));
      continue;
    } else {
      fail("teacher model config {}: {} has a value megatrain cannot read as {}: {}", path, key, spec->name, v.dump());
    }
    args.push_back(spec->name);
    args.push_back(text);
    shown.push_back(fmt::format("{}: {}", key, text));
  }
  return args;
}

}  // namespace

void derive_distillation(CliState& st, const std::vector<std::string>& args, const Environment& env) {
  Config& cfg = st.cfg;
  DistillConfig& d = cfg.train.distill;
  if (!d.enabled()) {
    if (d.cfg_path || d.teacher_model_config)
      st.note("--export-kd-cfg and --export-kd-teacher-model-config have no effect without --export-kd-teacher-load");
    return;
  }
  // Megatron-LM's own refusals (megatron/post_training/model_builder.py).
  if (st.has("--manual-gc"))
    fail("ModelOpt Distillation currently incompatible with `--manual-gc` option: drop --manual-gc or "
         "--export-kd-teacher-load");
  if (cfg.parallel.tp_comm_overlap)
    fail("ModelOpt Distillation currently incompatible with `--tp-comm-overlap` option: drop --tp-comm-overlap or "
         "--export-kd-teacher-load");
  if (st.has("--cross-entropy-fusion-impl") && st.given.at("--cross-entropy-fusion-impl").one() == "te")
    fail("ModelOpt Distillation currently incompatible with TransformerEngine Cross-Entropy implementation: drop "
         "--cross-entropy-fusion-impl te or --export-kd-teacher-load");
  if (cfg.parallel.pipeline_model_parallel_size > 1 && cfg.parallel.virtual_pipeline_size > 1)
    fail("ModelOpt Distillation currently incompatible with interleaved pipeline schedule: drop the virtual pipeline "
         "flags or --export-kd-teacher-load");
  // What megatrain does not build yet.
  const auto unsupported = [](const std::string& what) {
    throw Unsupported(fmt::format("--export-kd-teacher-load with {} is not supported yet", what));
  };
  if (cfg.parallel.pipeline_model_parallel_size > 1) unsupported("--pipeline-model-parallel-size > 1");
  if (cfg.model.mtp_num_layers.value_or(0) > 0) unsupported("--mtp-num-layers");
  if (cfg.train.fp8_format) unsupported("--fp8-format");
  if (d.cfg_path) {
    if (!std::filesystem::exists(*d.cfg_path)) fail("--export-kd-cfg: distillation config {} not found", *d.cfg_path);
    read_distill_config(d, *d.cfg_path);
  }
  // (Megatron-LM balances the intermediate losses per context-parallel rank, from each rank's
  // sums; its context parallelism needs Transformer Engine, so that is unchecked here.)
  if (cfg.parallel.context_parallel_size > 1 && !d.intermediate_layer_pairs.empty())
    unsupported("intermediate_layer_pairs in --export-kd-cfg and --context-parallel-size > 1");
  if (!d.skip_lm_loss) unsupported("skip_lm_loss: false in --export-kd-cfg (the language-model loss beside the distillation losses)");

  // The teacher's model: the student's command line with the teacher's model config applied.
  std::string path;
  if (d.teacher_model_config) {
    path = *d.teacher_model_config;
    if (!std::filesystem::exists(path)) fail("--export-kd-teacher-model-config: teacher model config {} not found", path);
  } else {
    const std::string guess = (std::filesystem::path(*d.teacher_load) / "model_config.yaml").string();
    if (std::filesystem::exists(guess)) path = guess;
    else
      st.warn(fmt::format("No teacher config provided via --export-kd-teacher-model-config nor found at {}. Assuming "
                          "teacher model architecture same as student's.", guess));
  }
  std::vector<std::string> teacher_args =
      teacher_command_line(args, path.empty() ? nlohmann::json() : read_yaml_file(path), path, d.teacher_flags);
  std::vector<SetupMessage> ignored;
  Config t;
  try {
    t = parse_config(teacher_args, env, &ignored);
  } catch (const Unsupported& e) {
    throw Unsupported(fmt::format("the teacher's model ({}) {}", path.empty() ? "the student's" : path, e.what()));
  } catch (const Error& e) {
    throw Error(fmt::format("the teacher's model ({}): {}", path.empty() ? "the student's" : path, e.what()));
  }
  if (t.model.padded_vocab_size != cfg.model.padded_vocab_size)
    fail("the teacher's padded vocabulary ({}) differs from the student's ({}): distillation compares their logits "
         "token by token", t.model.padded_vocab_size, cfg.model.padded_vocab_size);
  if (t.model.seq_length != cfg.model.seq_length)
    fail("the teacher's --seq-length ({}) differs from the student's ({}): it reads the student's tokens",
         t.model.seq_length, cfg.model.seq_length);
  if (t.model.mtp_num_layers.value_or(0) > 0) unsupported("a teacher with multi-token prediction layers");
  for (const DistillConfig::Pair& p : d.intermediate_layer_pairs) {
    const int sl = DistillConfig::hidden_state_layer(p.student), tl = DistillConfig::hidden_state_layer(p.teacher);
    if (sl >= cfg.model.num_layers)
      fail("--export-kd-cfg {}: the student has no layer {} ({} layers)", *d.cfg_path, p.student, cfg.model.num_layers);
    if (tl >= t.model.num_layers)
      fail("--export-kd-cfg {}: the teacher has no layer {} ({} layers)", *d.cfg_path, p.teacher, t.model.num_layers);
    // (A recomputed layer's output is gone by the time the head compares it.)
    if (sl >= 0 && cfg.train.recompute_granularity == RecomputeGranularity::full)
      unsupported(fmt::format("the intermediate layer {} and --recompute-granularity full", p.student));
  }
  if (!d.intermediate_layer_pairs.empty() && t.model.hidden_size != cfg.model.hidden_size)
    unsupported(fmt::format("intermediate_layer_pairs between hidden sizes {} (student) and {} (teacher) (ModelOpt's "
                            "trainable projection)", cfg.model.hidden_size, t.model.hidden_size));
  d.teacher = t.model;
  st.info(fmt::format("Distillation: Enabled (teacher {}{}{}).", *d.teacher_load,
                      d.teacher_flags.empty() ? "" : ", its model config: ", fmt::format("{}", fmt::join(d.teacher_flags, ", "))));
}

}  // namespace mt::cli
