#include "app/checkpoint_cli_args.h"

#include <fmt/format.h>

#include <optional>
#include <string>
#include <vector>

#include "checkpoint/checkpoint_io.h"
#include "checkpoint/file_io.h"
#include "core/error.h"

namespace mt::cli {

namespace {

enum class Take { forced, if_absent };

struct CheckpointArg {
  const char* megatron_name;  // the args attribute, as Megatron's messages name it
  const char* flag;           // megatrain's flag holding it (its resolved value in the manifest)
  Take take;
  bool inverted = false;      // the flag is a switch that turns the argument off
};

// Megatron's load_args_from_checkpoint list (the entries megatrain has flags for, and megatrain's
// additions that change what the model computes): the flag table's model settings with a take
// rule (app/flags.h ModelSetting).
const std::vector<CheckpointArg>& model_args() {
  static const std::vector<CheckpointArg> args = [] {
    std::vector<CheckpointArg> out;
    for (const FlagSpec& f : flag_table().flags()) {
      if (!f.model || f.model->take == CheckpointTake::no) continue;
      out.push_back({f.model->dest.c_str(), f.name.c_str(),
                     f.model->take == CheckpointTake::forced ? Take::forced : Take::if_absent, f.store_false});
    }
    return out;
  }();
  return args;
}

// Unless --no-use-tokenizer-model-from-checkpoint-args.
const std::vector<CheckpointArg>& tokenizer_args() {
  static const std::vector<CheckpointArg> args = {
      {"tokenizer_type", "--tokenizer-type", Take::forced},
      {"tokenizer_model", "--tokenizer-model", Take::forced},
  };
  return args;
}

const std::vector<CheckpointArg>& model_parallel_args() {
  static const std::vector<CheckpointArg> args = {
      {"tensor_model_parallel_size", "--tensor-model-parallel-size", Take::forced},
      {"pipeline_model_parallel_size", "--pipeline-model-parallel-size", Take::forced},
  };
  return args;
}

// Python's str() of a value, for the messages.
std::string python_text(const nlohmann::json& v) {
  if (v.is_boolean()) return v.get<bool>() ? "True" : "False";
  if (v.is_string()) return v.get<std::string>();
  return v.dump();
}

std::string raw_value(const CliState& st, const char* flag) {
  auto it = st.given.find(flag);
  return it == st.given.end() || it->second.values.empty() ? std::string() : it->second.one();
}

// Sets `flag` in st.given to the checkpoint's `value`, as its command-line spelling would.
void give(CliState& st, const FlagSpec& spec, const nlohmann::json& value) {
  if (spec.arity == Arity::none) {
    if (!value.is_boolean()) fail("--use-checkpoint-args: the checkpoint's {} is {}, not a switch", spec.name, value.dump());
    if (value.get<bool>()) st.given[spec.name] = FlagValue{};
    else st.given.erase(spec.name);
    return;
  }
  st.given[spec.name] = FlagValue{{value.is_string() ? value.get<std::string>() : value.dump()}};
}

void take(CliState& st, const nlohmann::json& saved, const CheckpointArg& a) {
  const FlagSpec* spec = flag_table().find(a.flag);
  MT_CHECK(spec != nullptr, "no flag {}", a.flag);
  if (!saved.contains(a.flag) || saved.at(a.flag).is_null()) {
    st.info(fmt::format("Checkpoint did not provide arguments {}", a.megatron_name));
    return;
  }
  if (a.take == Take::if_absent && st.has(a.flag)) return;  // Megatron fills only what is None
  const nlohmann::json& v = saved.at(a.flag);
  give(st, *spec, v);
  st.info(fmt::format("Setting {} to {} from checkpoint", a.megatron_name,
                      python_text(a.inverted && v.is_boolean() ? nlohmann::json(!v.get<bool>()) : v)));
}

}  // namespace

void apply_checkpoint_args(CliState& st) {
  if (!st.has("--use-checkpoint-args")) return;
  const std::string load = raw_value(st, "--load"), pretrained = raw_value(st, "--pretrained-checkpoint");
  if (load.empty() && pretrained.empty()) fail("--use-checkpoint-args requires --load or --pretrained-checkpoint argument");
  std::optional<int64_t> step;
  if (st.has("--ckpt-step")) step = parse_int64_arg("--ckpt-step", raw_value(st, "--ckpt-step"));
  // The checkpoint the run will load (checkpoint_to_load): a newer non-persistent one, --load's,
  // or the pretrained one when --load has none.
  std::optional<CheckpointLocation> loc;
  auto given = [](const std::string& v) { return v.empty() ? std::nullopt : std::optional<std::string>(v); };
  if (raw_value(st, "--non-persistent-ckpt-type") == "global" && !step)
    loc = newer_non_persistent(given(raw_value(st, "--non-persistent-global-ckpt-dir")), given(load), /*report=*/false);
  if (!loc) {
    const bool from_load = !load.empty() && path_exists(checkpoint_tracker_path(load));
    const std::string dir = from_load || pretrained.empty() ? load : pretrained;
    loc = locate_checkpoint(dir, step);
  }
  if (!loc) {
    st.info("Checkpoint not found to provide arguments, using provided arguments.");
    return;
  }
  const CheckpointReader reader = CheckpointReader::open_directory(loc->directory);
  const nlohmann::json& config = reader.run_state().config;
  if (!config.contains("flags")) {
    st.info("Checkpoint provided does not have arguments saved, using provided arguments.");
    return;
  }
  const nlohmann::json& saved = config.at("flags");
  const bool saved_experts = saved.contains("--num-experts") && !saved.at("--num-experts").is_null();
  for (const CheckpointArg& a : model_args()) {
    // Megatron takes the experts' FFN size from a checkpoint with experts, and clears it otherwise.
    if (std::string(a.flag) == "--moe-ffn-hidden-size" && !saved_experts) {
      st.given.erase(a.flag);
      continue;
    }
    take(st, saved, a);
  }
  if (!st.has("--no-use-tokenizer-model-from-checkpoint-args"))
    for (const CheckpointArg& a : tokenizer_args()) take(st, saved, a);
  if (!st.has("--use-mp-args-from-checkpoint-args")) return;
  for (const CheckpointArg& a : model_parallel_args()) take(st, saved, a);
  // The virtual pipeline split, in the spelling the checkpoint's run used, unless this command
  // line chose one (the two spellings exclude each other).
  static const CheckpointArg split[] = {
      {"num_layers_per_virtual_pipeline_stage", "--num-layers-per-virtual-pipeline-stage", Take::if_absent},
      {"num_virtual_stages_per_pipeline_rank", "--num-virtual-stages-per-pipeline-rank", Take::if_absent}};
  if (st.has(split[0].flag) || st.has(split[1].flag)) return;
  for (const CheckpointArg& a : split)
    if (saved.contains(a.flag) && !saved.at(a.flag).is_null()) return take(st, saved, a);
}

}  // namespace mt::cli
