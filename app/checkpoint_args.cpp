#include "app/checkpoint_args.h"

#include <fmt/format.h>

#include <utility>
#include <vector>

#include "app/flags.h"
#include "app/plan.h"
#include "core/error.h"

namespace mt {

using nlohmann::json;

namespace {

// Enum spellings as Megatron's flags write them.
template <class E>
using Names = std::vector<std::pair<E, const char*>>;

const Names<LrDecayStyle>& names(LrDecayStyle*) {
  static const Names<LrDecayStyle> n{{LrDecayStyle::constant, "constant"},
                                     {LrDecayStyle::linear, "linear"},
                                     {LrDecayStyle::cosine, "cosine"},
                                     {LrDecayStyle::inverse_square_root, "inverse-square-root"},
                                     {LrDecayStyle::wsd, "WSD"}};
  return n;
}
const Names<WsdDecayStyle>& names(WsdDecayStyle*) {
  static const Names<WsdDecayStyle> n{{WsdDecayStyle::exponential, "exponential"},
                                      {WsdDecayStyle::linear, "linear"},
                                      {WsdDecayStyle::cosine, "cosine"},
                                      {WsdDecayStyle::minus_sqrt, "minus_sqrt"}};
  return n;
}
const Names<WeightDecayIncrStyle>& names(WeightDecayIncrStyle*) {
  static const Names<WeightDecayIncrStyle> n{{WeightDecayIncrStyle::constant, "constant"},
                                             {WeightDecayIncrStyle::linear, "linear"},
                                             {WeightDecayIncrStyle::cosine, "cosine"}};
  return n;
}

template <class E>
const char* enum_name(E e) {
  for (const auto& [v, n] : names(static_cast<E*>(nullptr)))
    if (v == e) return n;
  return "?";
}

template <class E>
E enum_from(const std::string& s, const std::string& what) {
  for (const auto& [v, n] : names(static_cast<E*>(nullptr)))
    if (s == n) return v;
  fail("{}: unknown value '{}'", what, s);
}

// Marks a field newer than the first checkpoints: loading one without it keeps the default.
struct AddedLater {};

// Reads and writes one field; `where` names the manifest in errors.
struct ToJson {
  json& j;
  template <class T>
  void operator()(const char* k, T& v, AddedLater) {
    (*this)(k, v);
  }
  template <class T>
  void operator()(const char* k, T& v) {
    if constexpr (std::is_enum_v<T>) j[k] = enum_name(v);
    else if constexpr (requires { v.has_value(); }) j[k] = v ? json(*v) : json(nullptr);
    else j[k] = v;
  }
};

struct FromJson {
  const json& j;
  const std::string& where;
  template <class T>
  void operator()(const char* k, T& v, AddedLater) {
    if (j.contains(k)) (*this)(k, v);
  }
  template <class T>
  void operator()(const char* k, T& v) {
    if (!j.contains(k)) fail("{}: the saved model configuration lacks '{}'", where, k);
    const json& x = j.at(k);
    try {
      if constexpr (std::is_enum_v<T>) {
        v = enum_from<T>(x.get<std::string>(), fmt::format("{}: model setting '{}'", where, k));
      } else if constexpr (requires { v.has_value(); }) {
        if (x.is_null()) v.reset();
        else v = x.get<typename T::value_type>();
      } else {
        v = x.get<T>();
      }
    } catch (const json::exception& e) {
      fail("{}: model setting '{}' is malformed ({})", where, k, e.what());
    }
  }
};

// The model section's fields that are not one flag's field: the window pattern's two fields
// (--window-attn-skip-freq) and what derive.cpp computes. Every other key is a flag's model
// setting (app/flags.h ModelSetting), read from the flag table.
template <class F>
void visit_derived(ModelConfig& m, F&& f) {
  f("window_attn_skip_every", m.window_attn_skip_every, AddedLater{});
  f("window_attn_pattern", m.window_attn_pattern, AddedLater{});
  // --linear-attention-freq's two fields and the derived Gated DeltaNet layer map.
  f("linear_attention_every", m.linear_attention_every, AddedLater{});
  f("linear_attention_pattern", m.linear_attention_pattern, AddedLater{});
  f("linear_layer", m.linear_layer, AddedLater{});
  // --no-rope-freq's two fields and the derived NoPE layer map.
  f("no_rope_every", m.no_rope_every, AddedLater{});
  f("no_rope_pattern", m.no_rope_pattern, AddedLater{});
  f("nope_layer", m.nope_layer, AddedLater{});
  // --moe-layer-freq's two fields, and what derive.cpp computes for the experts (none: dense).
  f("moe_layer_freq", m.moe.layer_freq, AddedLater{});
  f("moe_layer_pattern", m.moe.layer_pattern, AddedLater{});
  f("moe_expert_ffn", m.moe.expert_ffn, AddedLater{});
  f("moe_layer", m.moe.moe_layer, AddedLater{});
  f("ffn_size", m.ffn_size);
  f("head_dim", m.head_dim);
  f("query_groups", m.query_groups);
  f("vocab_size", m.vocab_size);
  f("padded_vocab_size", m.padded_vocab_size);
}

// The flags whose settings the model section records.
std::vector<const cli::FlagSpec*> recorded_settings() {
  std::vector<const cli::FlagSpec*> out;
  for (const cli::FlagSpec& f : cli::flag_table().flags())
    if (f.model && !f.model->key.empty()) out.push_back(&f);
  return out;
}

std::string value_text(const json& v) {
  if (v.is_null()) return "None";
  return v.is_string() ? v.get<std::string>() : v.dump();
}

}  // namespace

json model_config_to_json(const ModelConfig& m) {
  json j = json::object();
  Config c;
  c.model = m;
  for (const cli::FlagSpec* f : recorded_settings()) j[f->model->key] = f->field(c);
  visit_derived(c.model, ToJson{j});
  return j;
}

ModelConfig model_config_from_json(const json& j, const std::string& where) {
  if (!j.is_object()) fail("{}: the checkpoint records no model configuration", where);
  Config c;
  for (const cli::FlagSpec* f : recorded_settings()) {
    const std::string& k = f->model->key;
    if (!j.contains(k)) {
      if (f->model->added_later) continue;
      fail("{}: the saved model configuration lacks '{}'", where, k);
    }
    try {
      f->set_field(c, j.at(k));
    } catch (const std::exception& e) {
      fail("{}: model setting '{}' is malformed ({})", where, k, e.what());
    }
  }
  visit_derived(c.model, FromJson{j, where});
  return c.model;
}

json checkpoint_config_json(const Config& cfg) {
  json flags = json::object();
  for (const cli::FlagSpec& f : cli::flag_table().flags())
    if (f.value) flags[f.name] = f.value(cfg);
  return json{{"model", model_config_to_json(cfg.model)}, {"flags", flags}, {"derived", derived_values(cfg)}};
}

void check_checkpoint_model(const json& saved, const ModelConfig& current, const std::string& where) {
  const json now = model_config_to_json(current);
  const json defaults = model_config_to_json(ModelConfig{});
  // (key in the model section, the flag a user changes)
  std::vector<std::pair<std::string, std::string>> checked;
  for (const cli::FlagSpec* f : recorded_settings()) {
    const cli::ModelSetting& s = *f->model;
    if (s.compare == cli::CheckpointCompare::no) continue;
    if (s.compare == cli::CheckpointCompare::with_learned_positions &&
        current.position_embedding_type != PositionEmbedding::learned_absolute)
      continue;
    // A switch that clears the setting is named by both (add_bias_linear (--disable-bias-linear)).
    const std::string label = f->store_false ? fmt::format("{} ({})", s.key, f->name) : f->name;
    // A checkpoint from before the setting was recorded was saved with its default.
    if (!saved.contains(s.key) && s.added_later) {
      if (now.at(s.key) != defaults.at(s.key))
        fail("checkpoint {} was saved for another model: {} is {} in the checkpoint but {} in this run", where, label,
             value_text(defaults.at(s.key)), value_text(now.at(s.key)));
      continue;
    }
    checked.emplace_back(s.key, label);
  }
  // Sizes derive.cpp computes from several flags.
  checked.insert(checked.end(),
                 {{"query_groups", "--num-query-groups"},
                  {"head_dim", "--kv-channels"},
                  {"ffn_size", "--ffn-hidden-size"},
                  {"padded_vocab_size", "padded vocabulary size (tokenizer, --make-vocab-size-divisible-by and TP set it)"}});
  std::string diffs;
  for (const auto& [key, flag] : checked) {
    if (!saved.contains(key)) fail("{}: the saved model configuration lacks '{}'", where, key);
    if (saved.at(key) != now.at(key))
      diffs += fmt::format("{}{} is {} in the checkpoint but {} in this run", diffs.empty() ? "" : "; ", flag,
                           value_text(saved.at(key)), value_text(now.at(key)));
  }
  // The experts' sizes and which layers are MoE layers (checkpoints from before MoE: dense).
  for (const auto& [key, flag] : std::vector<std::pair<std::string, std::string>>{
           {"moe_expert_ffn", "the experts' FFN size (--moe-ffn-hidden-size)"},
           {"moe_layer", "the MoE layer map (--moe-layer-freq)"}}) {
    const json& then = saved.contains(key) ? saved.at(key) : defaults.at(key);
    if (then != now.at(key))
      diffs += fmt::format("{}{} is {} in the checkpoint but {} in this run", diffs.empty() ? "" : "; ", flag,
                           value_text(then), value_text(now.at(key)));
  }
  if (!diffs.empty()) fail("checkpoint {} was saved for another model: {}", where, diffs);
}

json lr_schedule_to_json(const LrScheduleParams& p, int64_t num_steps) {
  return json{{"max_lr", p.max_lr},
              {"min_lr", p.min_lr},
              {"init_lr", p.init_lr},
              {"lr_warmup_steps", p.warmup_steps},
              {"lr_decay_steps", p.decay_steps},
              {"lr_decay_style", enum_name(p.decay_style)},
              {"wsd_decay_steps", p.wsd_decay_steps ? json(*p.wsd_decay_steps) : json(nullptr)},
              {"lr_wsd_decay_style", enum_name(p.wsd_style)},
              {"start_wd", p.start_wd},
              {"end_wd", p.end_wd},
              {"wd_incr_steps", p.wd_incr_steps},
              {"wd_incr_style", enum_name(p.wd_incr_style)},
              {"num_steps", num_steps}};
}

LrScheduleParams lr_schedule_params_from_json(const json& j, const std::string& where) {
  LrScheduleParams p;
  try {
    p.max_lr = j.at("max_lr").get<double>();
    p.min_lr = j.at("min_lr").get<double>();
    p.init_lr = j.at("init_lr").get<double>();
    p.warmup_steps = j.at("lr_warmup_steps").get<double>();
    p.decay_steps = j.at("lr_decay_steps").get<double>();
    p.decay_style = enum_from<LrDecayStyle>(j.at("lr_decay_style").get<std::string>(), where + ": lr_decay_style");
    if (!j.at("wsd_decay_steps").is_null()) p.wsd_decay_steps = j.at("wsd_decay_steps").get<double>();
    p.wsd_style = enum_from<WsdDecayStyle>(j.at("lr_wsd_decay_style").get<std::string>(), where + ": lr_wsd_decay_style");
    p.start_wd = j.at("start_wd").get<double>();
    p.end_wd = j.at("end_wd").get<double>();
    p.wd_incr_steps = j.at("wd_incr_steps").get<double>();
    p.wd_incr_style = enum_from<WeightDecayIncrStyle>(j.at("wd_incr_style").get<std::string>(), where + ": wd_incr_style");
  } catch (const json::exception& e) {
    fail("{}: the saved learning-rate scheduler state is malformed ({})", where, e.what());
  }
  return p;
}

LrScheduleParams reconcile_lr_schedule(const LrScheduleParams& current, const LrScheduleParams& saved,
                                       const TrainConfig& t, const std::string& where) {
  if (t.override_opt_param_scheduler) return current;
  if (t.use_checkpoint_opt_param_scheduler) return saved;
  // Megatron's _check_and_set over the same fields (steps in samples).
  std::string diffs;
  auto check = [&](const char* what, const std::string& now, const std::string& then) {
    if (now != then)
      diffs += fmt::format("{}{}: {} in this run, {} in the checkpoint", diffs.empty() ? "" : "; ", what, now, then);
  };
  auto num = [](double v) { return fmt::format("{}", v); };
  check("learning rate (--lr)", num(current.max_lr), num(saved.max_lr));
  check("minimum learning rate (--min-lr)", num(current.min_lr), num(saved.min_lr));
  check("warmup steps (samples)", num(current.warmup_steps), num(saved.warmup_steps));
  check("decay steps (samples)", num(current.decay_steps), num(saved.decay_steps));
  check("--lr-decay-style", enum_name(current.decay_style), enum_name(saved.decay_style));
  check("start weight decay", num(current.start_wd), num(saved.start_wd));
  check("end weight decay", num(current.end_wd), num(saved.end_wd));
  check("weight-decay increment steps (samples)", num(current.wd_incr_steps), num(saved.wd_incr_steps));
  check("--weight-decay-incr-style", enum_name(current.wd_incr_style), enum_name(saved.wd_incr_style));
  if (!diffs.empty())
    fail("checkpoint {}: the learning-rate schedule differs from the checkpoint's ({}); pass "
         "--override-opt-param-scheduler to use this run's values or --use-checkpoint-opt-param-scheduler to use "
         "the checkpoint's", where, diffs);
  return saved;
}

}  // namespace mt
