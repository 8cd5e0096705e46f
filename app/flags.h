// The flag table: every Megatron-LM flag megatrain recognises (and megatrain's own), with its
// group, arity, help and how it lands in Config. One FlagSpec per flag; the parser (parse.cpp),
// --help, --list-flags (docs/flags.md) and the dry run's configuration dump all read this table.
//
// Kinds:
//   supported   parsed into Config (unsupported.cpp may still refuse some of its values)
//   recognised  a Megatron flag megatrain does not implement: refused unless left at its
//               default (the refusal rule is in unsupported.cpp, the one table to delete from)
//   no_effect   accepted; it changes nothing in megatrain (rank 0 prints a note saying why); some
//               keep a Config field for Megatron's validation rules (FlagTable::without_effect)
//   removed     gone from Megatron or fatal there: an error with Megatron's advice
//   megatrain   megatrain's own flags
#pragma once

#include <nlohmann/json.hpp>

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "app/cli.h"
#include "app/flag_values.h"
#include "core/config.h"
#include "core/error.h"

namespace mt::cli {

enum class FlagGroup {
  model, parallelism, training, learning_rate, mixed_precision, data, tokenizer, checkpointing,
  logging, recompute, regularization, distributed, moe, fp8, megatrain, other,
};
const char* group_title(FlagGroup g);
std::vector<FlagGroup> all_groups();

// How many values follow the flag (argparse's nargs).
enum class Arity { none, one, one_or_more, zero_or_more, three };

enum class FlagKind { supported, recognised, no_effect, removed, megatrain };

// The values of a flag's last occurrence (argparse: the last one wins).
struct FlagValue {
  std::vector<std::string> values;
  const std::string& one() const { return values.at(0); }
};

// Parsing state: the Config being filled plus values that only the parser needs.
struct CliState {
  Config cfg;
  std::map<std::string, FlagValue> given;  // primary flag name -> last occurrence
  std::optional<int> encoder_num_layers;   // --encoder-num-layers (alias of --num-layers for GPT)
  std::optional<int> encoder_seq_length;   // --encoder-seq-length (alias of --seq-length)
  bool recompute_activations = false;      // --recompute-activations = --recompute-granularity selective
  bool use_rotary_position_embeddings = false;
  std::optional<int> local_rank;           // --local-rank (torch.distributed.launch style)
  std::optional<std::string> nvte_apply_qk_layer_scaling;  // the environment's NVTE_APPLY_QK_LAYER_SCALING
  std::vector<SetupMessage> messages;

  bool has(const std::string& flag) const { return given.count(flag) > 0; }
  void info(std::string t) { messages.push_back({SetupMessage::Kind::info, std::move(t)}); }
  void note(std::string t) { messages.push_back({SetupMessage::Kind::note, std::move(t)}); }
  void warn(std::string t) { messages.push_back({SetupMessage::Kind::warning, std::move(t)}); }
};

using ApplyFn = std::function<void(CliState&, const FlagValue&)>;
using ValueFn = std::function<nlohmann::json(const Config&)>;
using FieldSetFn = std::function<void(Config&, const nlohmann::json&)>;

// What --use-checkpoint-args does with a model setting (Megatron's load_args_from_checkpoint):
// forced = the checkpoint's value wins (_set_arg(..., force=True)); if_absent = only when the
// command line does not give it.
enum class CheckpointTake { no, forced, if_absent };
// Whether loading a checkpoint compares the setting with the run's (check_checkpoint_args):
// always, or only when the model has learned position embeddings (the table's size).
enum class CheckpointCompare { no, yes, with_learned_positions };

// A setting that decides what the model computes, declared on its flag: Megatron's argparse
// destination (checkpoint `args` both ways: import-megatron, export-megatron), its key in the
// "model" section of megatrain's checkpoints (which tools without the training flags rebuild the
// model from), and what loading does with it. Adding a model setting is its Config field and its
// flag with this; the checkpoint's model section, the checks on load, --use-checkpoint-args and
// the Megatron-args mapping all read it from the table.
struct ModelSetting {
  std::string dest;  // Megatron's argparse destination (add_bias_linear for --disable-bias-linear)
  std::string key;   // megatrain's checkpoint model section key; empty: not recorded there
  CheckpointTake take = CheckpointTake::no;
  CheckpointCompare compare = CheckpointCompare::no;
  bool added_later = false;  // older checkpoints lack the key: loading keeps the default
  bool import_flag = true;   // import-megatron turns the saved argument into this flag
};

struct FlagSpec {
  std::string name;                  // primary spelling, "--num-layers"
  std::vector<std::string> aliases;  // other spellings ("--disable-x" for "--no-x", ...)
  FlagGroup group = FlagGroup::model;
  Arity arity = Arity::one;
  std::string metavar;
  std::string help;
  FlagKind kind = FlagKind::supported;
  std::string note;          // no_effect / removed: the message
  std::string default_text;  // recognised / no_effect flags: Megatron's default, for the docs
  ApplyFn apply;             // supported and megatrain flags
  ValueFn value;             // the value in a Config (for dumps); absent for flags without one
  bool store_false = false;  // a switch that clears its field (--disable-bias-linear)
  // The Config field itself as JSON (enums by their flag spelling), both ways; absent for flags
  // without one field.
  ValueFn field;
  FieldSetFn set_field;
  std::optional<ModelSetting> model;

  // Declares the flag a model setting (see ModelSetting); `key` defaults to `dest`.
  FlagSpec& model_setting(const std::string& dest, CheckpointTake take = CheckpointTake::forced,
                          CheckpointCompare compare = CheckpointCompare::no, bool added_later = false) {
    model = ModelSetting{dest, field ? dest : std::string(), take, compare, added_later};
    return *this;
  }
  // import-megatron leaves the saved argument out of the flags it builds (the caller decides).
  FlagSpec& not_imported() {
    MT_CHECK(model.has_value(), "{}: not_imported needs a model setting", name);
    model->import_flag = false;
    return *this;
  }
  // The checkpoint's model section names it `key` (older checkpoints did); "" leaves it out.
  FlagSpec& model_key(const std::string& key) {
    MT_CHECK(model.has_value() && (field || key.empty()), "{}: model_key needs a model setting with a field", name);
    model->key = key;
    return *this;
  }

  std::vector<std::string> all_names() const {
    std::vector<std::string> n{name};
    n.insert(n.end(), aliases.begin(), aliases.end());
    return n;
  }
};

// Value conversions per C++ type (argparse type= semantics).
template <class T> struct ArgTraits;
template <> struct ArgTraits<int> {
  static constexpr Arity arity = Arity::one;
  static const char* metavar() { return "INT"; }
  static void assign(int& t, const std::string& f, const FlagValue& v) { t = parse_int_arg(f, v.one()); }
  static nlohmann::json json(const int& t) { return t; }
};
template <> struct ArgTraits<int64_t> {
  static constexpr Arity arity = Arity::one;
  static const char* metavar() { return "INT"; }
  static void assign(int64_t& t, const std::string& f, const FlagValue& v) { t = parse_int64_arg(f, v.one()); }
  static nlohmann::json json(const int64_t& t) { return t; }
};
template <> struct ArgTraits<double> {
  static constexpr Arity arity = Arity::one;
  static const char* metavar() { return "FLOAT"; }
  static void assign(double& t, const std::string& f, const FlagValue& v) { t = parse_float_arg(f, v.one()); }
  static nlohmann::json json(const double& t) { return t; }
};
template <> struct ArgTraits<std::string> {
  static constexpr Arity arity = Arity::one;
  static const char* metavar() { return "STR"; }
  static void assign(std::string& t, const std::string&, const FlagValue& v) { t = v.one(); }
  static nlohmann::json json(const std::string& t) { return t; }
};
template <class X> struct ArgTraits<std::optional<X>> {
  static constexpr Arity arity = ArgTraits<X>::arity;
  static const char* metavar() { return ArgTraits<X>::metavar(); }
  static void assign(std::optional<X>& t, const std::string& f, const FlagValue& v) {
    X x{};
    ArgTraits<X>::assign(x, f, v);
    t = x;
  }
  static nlohmann::json json(const std::optional<X>& t) { return t ? ArgTraits<X>::json(*t) : nlohmann::json(); }
};
template <> struct ArgTraits<std::vector<std::string>> {
  static constexpr Arity arity = Arity::one_or_more;
  static const char* metavar() { return "STR [STR ...]"; }
  static void assign(std::vector<std::string>& t, const std::string&, const FlagValue& v) { t = v.values; }
  static nlohmann::json json(const std::vector<std::string>& t) { return t; }
};
template <> struct ArgTraits<std::vector<int64_t>> {
  static constexpr Arity arity = Arity::one_or_more;
  static const char* metavar() { return "INT [INT ...]"; }
  static void assign(std::vector<int64_t>& t, const std::string& f, const FlagValue& v) {
    t.clear();
    for (const auto& s : v.values) t.push_back(parse_int64_arg(f, s));
  }
  static nlohmann::json json(const std::vector<int64_t>& t) { return t; }
};

// A Config field as JSON and back (the checkpoint's model section): enums through `choices`.
template <class T>
nlohmann::json field_json(const T& v) {
  if constexpr (requires { v.has_value(); }) return v ? field_json(*v) : nlohmann::json(nullptr);
  else return nlohmann::json(v);
}
template <class T>
void field_from_json(T& v, const nlohmann::json& j) {
  if constexpr (requires { v.has_value(); }) {
    if (j.is_null()) v.reset();
    else {
      typename T::value_type x{};
      field_from_json(x, j);
      v = x;
    }
  } else {
    v = j.get<T>();
  }
}

class FlagTable {
 public:
  FlagSpec& add(FlagSpec s);
  const FlagSpec* find(const std::string& name) const;  // primary name or alias
  const std::vector<FlagSpec>& flags() const { return flags_; }
  void set_group(FlagGroup g) { group_ = g; }

  // A typed flag stored through `acc` (a lambda Config& -> T&).
  template <class Acc>
  FlagSpec& value(const std::string& name, const std::string& help, Acc acc) {
    using T = std::remove_reference_t<decltype(acc(std::declval<Config&>()))>;
    FlagSpec s = base(name, help);
    s.arity = ArgTraits<T>::arity;
    s.metavar = ArgTraits<T>::metavar();
    s.apply = [acc, name](CliState& st, const FlagValue& v) { ArgTraits<T>::assign(acc(st.cfg), name, v); };
    s.value = [acc](const Config& c) { return ArgTraits<T>::json(acc(const_cast<Config&>(c))); };
    s.field = [acc](const Config& c) { return field_json(acc(const_cast<Config&>(c))); };
    s.set_field = [acc](Config& c, const nlohmann::json& j) { field_from_json(acc(c), j); };
    return add(std::move(s));
  }

  // store_true (set_to = true) or store_false (set_to = false) switch on a bool.
  template <class Acc>
  FlagSpec& flag(const std::string& name, const std::string& help, Acc acc, bool set_to = true) {
    FlagSpec s = base(name, help);
    s.arity = Arity::none;
    s.apply = [acc, set_to](CliState& st, const FlagValue&) { acc(st.cfg) = set_to; };
    // Shown as the switch's state: true when the resolved setting is what the flag asks for.
    s.value = [acc, set_to](const Config& c) { return nlohmann::json(acc(const_cast<Config&>(c)) == set_to); };
    s.store_false = !set_to;
    s.field = [acc](const Config& c) { return nlohmann::json(acc(const_cast<Config&>(c))); };
    s.set_field = [acc](Config& c, const nlohmann::json& j) { acc(c) = j.get<bool>(); };
    return add(std::move(s));
  }
  // store_false with Megatron HEAD's two spellings: "--no-x" also answers to "--disable-x" and
  // "--disable-x" to "--no-x" (the dataclass-generated flags).
  template <class Acc>
  FlagSpec& negative_flag(const std::string& name, const std::string& help, Acc acc) {
    FlagSpec& s = flag(name, help, acc, false);
    negative_alias(s);
    return s;
  }

  // A choice stored as an enum (or string) through `acc`; `choices` pairs the spelling with the value.
  template <class Acc, class E>
  FlagSpec& choice(const std::string& name, const std::string& help, std::vector<std::pair<std::string, E>> choices,
                   Acc acc) {
    FlagSpec s = base(name, help);
    s.arity = Arity::one;
    std::vector<std::string> names;
    std::string metavar(1, '{');
    for (auto& [n, e] : choices) {
      if (!names.empty()) metavar.push_back(',');
      metavar.append(n);
      names.push_back(n);
    }
    metavar.push_back('}');
    s.metavar = std::move(metavar);
    s.apply = [acc, name, choices, names](CliState& st, const FlagValue& v) {
      const std::string c = parse_choice_arg(name, v.one(), names);
      for (auto& [n, e] : choices)
        if (n == c) assign_choice(acc(st.cfg), e);
    };
    s.value = [acc, choices](const Config& c) -> nlohmann::json { return choice_json(acc(const_cast<Config&>(c)), choices); };
    s.field = s.value;
    s.set_field = [acc, name, choices](Config& c, const nlohmann::json& j) {
      if (j.is_null()) return reset_choice(acc(c));
      const std::string n = j.get<std::string>();
      for (auto& [spelling, e] : choices)
        if (spelling == n) return assign_choice(acc(c), e);
      fail("{}: unknown value '{}'", name, n);
    };
    return add(std::move(s));
  }

  // A Megatron flag megatrain does not implement (refused by unsupported.cpp unless at default).
  FlagSpec& recognised(const std::string& name, Arity arity, const std::string& metavar, const std::string& default_text,
                       const std::string& help);
  // Accepted and ignored, with a note saying why.
  FlagSpec& no_effect(const std::string& name, Arity arity, const std::string& why, const std::string& default_text = "");
  // The same for a one-value flag whose value Megatron-LM's argparse checks, so a bad one is an
  // error here too: one of `choices` (metavar {a,b,...}), else by metavar INT or FLOAT a number
  // (any other metavar: unchecked).
  FlagSpec& no_effect_checked(const std::string& name, const std::string& metavar, std::vector<std::string> choices,
                              const std::string& why, const std::string& default_text);
  // A flag added above (flag/value/choice) that changes nothing in megatrain: it keeps its Config
  // field (Megatron's validation rules, the configuration dump and checkpoint arguments read it)
  // and is documented and noted as no_effect, `why` being the note.
  FlagSpec& without_effect(FlagSpec& s, const std::string& why);
  // Fatal: removed from Megatron (or fatal there); `message` is the error.
  FlagSpec& removed(const std::string& name, Arity arity, const std::string& message);

  // Another spelling of an added flag.
  FlagSpec& alias(FlagSpec& s, const std::string& spelling);
  // "--no-x" <-> "--disable-x".
  FlagSpec& negative_alias(FlagSpec& s);

 private:
  FlagSpec base(const std::string& name, const std::string& help) const {
    FlagSpec s;
    s.name = name;
    s.help = help;
    s.group = group_;
    return s;
  }
  template <class E> static void assign_choice(E& t, const E& v) { t = v; }
  template <class E> static void assign_choice(std::optional<E>& t, const E& v) { t = v; }
  template <class E> static void reset_choice(E&) { fail("a choice without a value"); }
  template <class E> static void reset_choice(std::optional<E>& t) { t.reset(); }
  template <class E>
  static nlohmann::json choice_json(const E& v, const std::vector<std::pair<std::string, E>>& choices) {
    for (auto& [n, e] : choices)
      if (e == v) return n;
    return nullptr;
  }
  template <class E>
  static nlohmann::json choice_json(const std::optional<E>& v, const std::vector<std::pair<std::string, E>>& choices) {
    return v ? choice_json(*v, choices) : nlohmann::json();
  }

  std::vector<FlagSpec> flags_;
  std::map<std::string, size_t> index_;
  FlagGroup group_ = FlagGroup::model;
};

// The whole table, built once.
const FlagTable& flag_table();

// Accessor for FlagTable::value/flag/choice: MT_FIELD(model.num_layers).
#define MT_FIELD(path) [](::mt::Config& c_) -> auto& { return c_.path; }

// Per-group registration (cli_*.cpp).
void add_model_flags(FlagTable& t);
void add_parallel_flags(FlagTable& t);
void add_training_flags(FlagTable& t);
void add_learning_rate_flags(FlagTable& t);
void add_precision_flags(FlagTable& t);
void add_data_flags(FlagTable& t);
void add_tokenizer_flags(FlagTable& t);
void add_checkpoint_flags(FlagTable& t);
void add_logging_flags(FlagTable& t);
void add_recompute_flags(FlagTable& t);
void add_regularization_flags(FlagTable& t);
void add_distributed_flags(FlagTable& t);
void add_moe_flags(FlagTable& t);
void add_fp8_flags(FlagTable& t);
void add_megatrain_flags(FlagTable& t);
void add_other_megatron_flags(FlagTable& t);  // app/cli_other.cpp

}  // namespace mt::cli
