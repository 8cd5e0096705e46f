#include "app/flags.h"

namespace mt::cli {

const char* group_title(FlagGroup g) {
  switch (g) {
    case FlagGroup::model: return "model";
    case FlagGroup::parallelism: return "parallelism";
    case FlagGroup::training: return "training";
    case FlagGroup::learning_rate: return "learning rate";
    case FlagGroup::mixed_precision: return "mixed precision";
    case FlagGroup::data: return "data";
    case FlagGroup::tokenizer: return "tokenizer";
    case FlagGroup::checkpointing: return "checkpointing";
    case FlagGroup::logging: return "logging";
    case FlagGroup::recompute: return "recompute";
    case FlagGroup::regularization: return "regularization";
    case FlagGroup::distributed: return "distributed";
    case FlagGroup::moe: return "mixture of experts";
    case FlagGroup::fp8: return "fp8 / fp4 (Transformer Engine)";
    case FlagGroup::megatrain: return "megatrain-specific";
    case FlagGroup::other: return "other Megatron-LM programs and features";
  }
  return "?";
}

std::vector<FlagGroup> all_groups() {
  return {FlagGroup::model,         FlagGroup::parallelism, FlagGroup::training,       FlagGroup::learning_rate,
          FlagGroup::mixed_precision, FlagGroup::data,      FlagGroup::tokenizer,      FlagGroup::checkpointing,
          FlagGroup::logging,       FlagGroup::recompute,   FlagGroup::regularization, FlagGroup::distributed,
          FlagGroup::moe,           FlagGroup::fp8,         FlagGroup::megatrain,      FlagGroup::other};
}

FlagSpec& FlagTable::add(FlagSpec s) {
  for (const std::string& n : s.all_names()) {
    MT_CHECK(n.rfind("--", 0) == 0 || n == "-h", "flag '{}' must start with --", n);
    MT_CHECK(index_.count(n) == 0, "flag {} registered twice", n);
    index_[n] = flags_.size();
  }
  flags_.push_back(std::move(s));
  return flags_.back();
}

const FlagSpec* FlagTable::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &flags_[it->second];
}

FlagSpec& FlagTable::alias(FlagSpec& s, const std::string& spelling) {
  MT_CHECK(index_.count(spelling) == 0, "flag {} registered twice", spelling);
  const auto it = index_.find(s.name);
  MT_CHECK(it != index_.end() && &flags_[it->second] == &s, "alias {} for a flag not in the table", spelling);
  index_[spelling] = it->second;
  s.aliases.push_back(spelling);
  return s;
}

FlagSpec& FlagTable::negative_alias(FlagSpec& s) {
  std::string other;
  if (s.name.rfind("--no-", 0) == 0) other = "--disable-" + s.name.substr(5);
  if (s.name.rfind("--disable-", 0) == 0) other = "--no-" + s.name.substr(10);
  MT_CHECK(!other.empty(), "{} is not a --no-/--disable- flag", s.name);
  return alias(s, other);
}

FlagSpec& FlagTable::recognised(const std::string& name, Arity arity, const std::string& metavar,
                                const std::string& default_text, const std::string& help) {
  FlagSpec s = base(name, help);
  s.kind = FlagKind::recognised;
  s.arity = arity;
  s.metavar = metavar;
  s.default_text = default_text;
  return add(std::move(s));
}

FlagSpec& FlagTable::no_effect(const std::string& name, Arity arity, const std::string& why,
                               const std::string& default_text) {
  FlagSpec s = base(name, why);
  s.kind = FlagKind::no_effect;
  s.arity = arity;
  s.metavar = arity == Arity::none ? "" : (arity == Arity::one ? "VALUE" : "VALUE [VALUE ...]");
  s.note = why;
  s.default_text = default_text;
  return add(std::move(s));
}

FlagSpec& FlagTable::no_effect_checked(const std::string& name, const std::string& metavar,
                                       std::vector<std::string> choices, const std::string& why,
                                       const std::string& default_text) {
  FlagSpec& s = no_effect(name, Arity::one, why, default_text);
  if (!choices.empty()) {
    s.metavar = fmt::format("{{{}}}", fmt::join(choices, ","));
    s.apply = [name, choices = std::move(choices)](CliState&, const FlagValue& v) { parse_choice_arg(name, v.one(), choices); };
  } else {
    s.metavar = metavar;
    if (metavar == "INT") s.apply = [name](CliState&, const FlagValue& v) { parse_int_arg(name, v.one()); };
    if (metavar == "FLOAT") s.apply = [name](CliState&, const FlagValue& v) { parse_float_arg(name, v.one()); };
  }
  return s;
}

FlagSpec& FlagTable::without_effect(FlagSpec& s, const std::string& why) {
  MT_CHECK(s.kind == FlagKind::supported && s.apply, "{}: only a supported flag can be marked without effect", s.name);
  s.kind = FlagKind::no_effect;
  s.note = why;
  return s;
}

FlagSpec& FlagTable::removed(const std::string& name, Arity arity, const std::string& message) {
  FlagSpec s = base(name, message);
  s.kind = FlagKind::removed;
  s.arity = arity;
  s.metavar = arity == Arity::none ? "" : "VALUE";
  s.note = message;
  return add(std::move(s));
}

const FlagTable& flag_table() {
  static const FlagTable table = [] {
    FlagTable t;
    add_model_flags(t);
    add_parallel_flags(t);
    add_training_flags(t);
    add_learning_rate_flags(t);
    add_precision_flags(t);
    add_data_flags(t);
    add_tokenizer_flags(t);
    add_checkpoint_flags(t);
    add_logging_flags(t);
    add_recompute_flags(t);
    add_regularization_flags(t);
    add_distributed_flags(t);
    add_moe_flags(t);
    add_fp8_flags(t);
    add_megatrain_flags(t);
    add_other_megatron_flags(t);
    return t;
  }();
  return table;
}

}  // namespace mt::cli
