// Megatron-LM's saved args as the Megatron flags that describe the same model (app/megatron_args.h).
#include "app/megatron_args.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <optional>
#include <set>

#include "app/flags.h"
#include "checkpoint/megatron_checkpoint.h"
#include "checkpoint/pickle_writer.h"
#include "core/error.h"

namespace mt {

namespace {

enum class ArgKind { value, store_true, store_false };

struct ModelArg {
  const char* dest;  // argparse's attribute name
  const char* flag;
  ArgKind kind;
};

// The arguments that decide what the model computes (Megatron's argparse dests): the flag
// table's model settings (app/flags.h ModelSetting). Architectures megatrain does not build are
// there too, so that the parser refuses them by flag name.
ArgKind arg_kind(const cli::FlagSpec& f) {
  if (f.arity != cli::Arity::none) return ArgKind::value;
  return f.store_false ? ArgKind::store_false : ArgKind::store_true;
}

const std::vector<ModelArg>& model_args(bool imported_only) {
  static const auto build = [](bool imported) {
    std::vector<ModelArg> out;
    for (const cli::FlagSpec& f : cli::flag_table().flags())
      if (f.model && (!imported || f.model->import_flag)) out.push_back({f.model->dest.c_str(), f.name.c_str(), arg_kind(f)});
    return out;
  };
  static const std::vector<ModelArg> all = build(false), imported = build(true);
  return imported_only ? imported : all;
}

// Tokenizer arguments: printed for the user, recorded for --use-checkpoint-args; not needed to
// build the model (the padded vocabulary comes from the checkpoint).
const std::vector<ModelArg>& tokenizer_args() {
  static const std::vector<ModelArg> args = {
      {"tokenizer_type", "--tokenizer-type", ArgKind::value},
      {"vocab_file", "--vocab-file", ArgKind::value},
      {"merge_file", "--merge-file", ArgKind::value},
      {"tokenizer_model", "--tokenizer-model", ArgKind::value},
      {"vocab_size", "--vocab-size", ArgKind::value},
  };
  return args;
}

// A saved argument as command-line text; nullopt for values with no text form here.
std::optional<std::string> arg_text(const PickleValue& v) {
  switch (v.kind) {
    case PickleKind::integer: return std::to_string(v.integer);
    case PickleKind::floating: return fmt::format("{}", v.floating);
    case PickleKind::string: return v.text;
    case PickleKind::tuple:
    case PickleKind::list: {
      std::vector<std::string> parts;
      for (const auto& i : v.items) {
        auto t = arg_text(*i);
        if (!t) return std::nullopt;
        parts.push_back(*t);
      }
      // --window-size is Megatron's "L,R" tuple; a per-layer pattern is a Python list.
      return v.kind == PickleKind::tuple ? fmt::format("{}", fmt::join(parts, ","))
                                         : fmt::format("[{}]", fmt::join(parts, ","));
    }
    default: return std::nullopt;
  }
}

// The flags for `table`'s arguments as the checkpoint saved them. A store_true argument that is
// set, a store_false one that is cleared and a value that is not None become flags.
std::vector<std::string> flags_from_args(const PickleValue& args, const std::vector<ModelArg>& table,
                                         const std::string& where) {
  std::vector<std::string> out;
  for (const ModelArg* a = table.data(); a != table.data() + table.size(); ++a) {
    const PickleValue* v = megatron_arg(args, a->dest);
    if (!v) continue;
    if (a->kind != ArgKind::value) {
      if (!v->is(PickleKind::boolean)) continue;
      if (v->boolean == (a->kind == ArgKind::store_true)) out.push_back(a->flag);
      continue;
    }
    if (v->is(PickleKind::boolean)) continue;
    const std::optional<std::string> text = arg_text(*v);
    if (!text) fail("{}: the saved argument {} is a {}, which megatrain cannot read as {}", where, a->dest, v->describe(), a->flag);
    out.push_back(a->flag);
    out.push_back(*text);
  }
  return out;
}

// Drops the flags that say nothing about this model: settings of features it does not use
// (RoPE's with learned positions, the scaling factor without --use-rope-scaling), Megatron's own
// derived values (--kv-channels = hidden / heads, GeLU fusion off with SwiGLU, q/k/v biases with
// all biases), and empty architecture options (no experts, no MTP layers).
std::vector<std::string> model_flags_from_args(const PickleValue& args, const std::string& where, bool every_setting) {
  const std::vector<std::string> all = flags_from_args(args, model_args(/*imported_only=*/!every_setting), where);
  auto has = [&](const char* flag) { return std::find(all.begin(), all.end(), flag) != all.end(); };
  auto value = [&](const char* flag) -> std::string {
    auto it = std::find(all.begin(), all.end(), flag);
    return it != all.end() && it + 1 != all.end() ? *(it + 1) : std::string();
  };
  const bool rope = value("--position-embedding-type") == "rope";
  std::set<std::string> drop;
  if (!rope)
    for (const char* f : {"--rotary-base", "--rotary-percent", "--rotary-interleaved",
                          "--rotary-seq-len-interpolation-factor", "--use-rope-scaling", "--rope-scaling-factor"})
      drop.insert(f);
  if (!has("--use-rope-scaling")) drop.insert("--rope-scaling-factor");
  const std::string heads = value("--num-attention-heads"), hidden = value("--hidden-size"), kv = value("--kv-channels");
  if (!heads.empty() && !hidden.empty() && !kv.empty() && std::stoll(kv) * std::stoll(heads) == std::stoll(hidden))
    drop.insert("--kv-channels");
  if (has("--swiglu")) drop.insert("--no-bias-gelu-fusion");
  if (!has("--disable-bias-linear")) drop.insert("--add-qkv-bias");
  // A model without experts: Megatron saves its MoE defaults (--moe-router-topk 2, ...), which say
  // nothing about it.
  if (value("--num-experts").empty() || value("--num-experts") == "0")
    for (const std::string& f : all)
      if (f == "--num-experts" || f.rfind("--moe-", 0) == 0) drop.insert(f);
  if (value("--mtp-num-layers") == "0") drop.insert("--mtp-num-layers");
  drop.insert("--num-query-groups");  // (below, with --group-query-attention only)
  // The settings of architectures the model does not use, which Megatron saves at their defaults:
  // multi-latent attention's (YaRN's without it or --position-embedding-type yarn), Gated DeltaNet's,
  // muP's.
  const auto drop_prefixed = [&](const std::vector<std::string>& prefixes) {
    for (const std::string& f : all)
      for (const std::string& p : prefixes)
        if (f.rfind(p, 0) == 0) drop.insert(f);
  };
  if (!has("--multi-latent-attention")) {
    drop_prefixed({"--q-lora-rank", "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim", "--v-head-dim"});
    if (value("--position-embedding-type") != "yarn") drop_prefixed({"--rotary-scaling-factor", "--mscale"});
  }
  if (value("--experimental-attention-variant").empty()) drop_prefixed({"--linear-"});
  if (!has("--use-mup")) drop_prefixed({"--mup-"});
  // Megatron's defaults of the plain softmax and of a gated unit without an offset.
  if (value("--softmax-type") == "vanilla") drop.insert("--softmax-type");
  if (value("--glu-linear-offset") == "0") drop.insert("--glu-linear-offset");
  std::vector<std::string> out;
  for (size_t i = 0; i < all.size(); ++i) {
    const bool flag_with_value = i + 1 < all.size() && all[i + 1].rfind("--", 0) != 0;
    if (!drop.count(all[i])) {
      out.push_back(all[i]);
      if (flag_with_value) out.push_back(all[i + 1]);
    }
    if (flag_with_value) ++i;
  }
  // num_query_groups means something only with --group-query-attention.
  if (has("--group-query-attention"))
    if (const PickleValue* n = megatron_arg(args, "num_query_groups"); n && n->is(PickleKind::integer)) {
      out.push_back("--num-query-groups");
      out.push_back(std::to_string(n->integer));
    }
  return out;
}

// A recorded flag value (JSON) as the Python value argparse would hold.
PickleRef python_value(const nlohmann::json& v) {
  switch (v.type()) {
    case nlohmann::json::value_t::null: return pickle_none();
    case nlohmann::json::value_t::boolean: return pickle_bool(v.get<bool>());
    case nlohmann::json::value_t::number_integer:
    case nlohmann::json::value_t::number_unsigned: return pickle_int(v.get<int64_t>());
    case nlohmann::json::value_t::number_float: return pickle_float(v.get<double>());
    case nlohmann::json::value_t::string: return pickle_str(v.get<std::string>());
    case nlohmann::json::value_t::array: {
      std::vector<PickleRef> items;
      for (const auto& i : v) items.push_back(python_value(i));
      return pickle_list(std::move(items));
    }
    default: return pickle_none();
  }
}

// Megatron's switches named --no-X whose destination is no_X (store_true); the other --no-X and
// --disable-X switches store False under a destination of their own, written only through
// model_args().
bool store_true_negative(const std::string& flag) {
  static const char* const names[] = {"--no-save-optim", "--no-save-rng", "--no-load-optim", "--no-load-rng",
                                      "--no-initialization"};
  for (const char* n : names)
    if (flag == n) return true;
  return false;
}

// "L,R" -> (L, R); "N" -> N; a per-layer list stays a list (Megatron's tuple_type and
// moe_freq_type values).
PickleRef model_arg_value(const std::string& dest, const nlohmann::json& v) {
  if (!v.is_string()) return python_value(v);
  const std::string t = v.get<std::string>();
  if (dest == "window_size") {
    const size_t comma = t.find(',');
    if (comma != std::string::npos)
      return pickle_tuple({pickle_int(std::stoll(t.substr(0, comma))), pickle_int(std::stoll(t.substr(comma + 1)))});
  }
  if (dest == "window_attn_skip_freq" && !t.empty() && t.find_first_not_of("0123456789") == std::string::npos)
    return pickle_int(std::stoll(t));
  return pickle_str(t);
}

}  // namespace

void set_megatron_arg(PickleValue& args, const std::string& name, PickleRef value) {
  if (!args.state) fail("set_megatron_arg: not an argparse.Namespace");
  for (auto& [k, v] : args.state->entries)
    if (k->is(PickleKind::string) && k->text == name) {
      v = std::move(value);
      return;
    }
  pickle_set(*args.state, name, std::move(value));
}

PickleRef megatron_args_from_flags(const nlohmann::json& flags) {
  PickleRef args = pickle_object("argparse.Namespace", {}, pickle_dict());
  std::set<std::string> model_flags;
  for (const ModelArg& a : model_args(/*imported_only=*/false)) model_flags.insert(a.flag);
  for (const cli::FlagSpec& f : cli::flag_table().flags()) {
    if (!f.value || f.kind == cli::FlagKind::megatrain || model_flags.count(f.name) || !flags.contains(f.name)) continue;
    const nlohmann::json& v = flags.at(f.name);
    std::string dest = f.name.substr(2);
    if (f.arity == cli::Arity::none) {
      const bool negative = dest.compare(0, 3, "no-") == 0 || dest.compare(0, 8, "disable-") == 0;
      if (!v.is_boolean() || (negative && !store_true_negative(f.name))) continue;
    }
    std::replace(dest.begin(), dest.end(), '-', '_');
    set_megatron_arg(*args, dest, python_value(v));
  }
  for (const ModelArg& a : model_args(/*imported_only=*/false)) {
    if (!flags.contains(a.flag)) continue;
    const nlohmann::json& v = flags.at(a.flag);
    if (a.kind == ArgKind::value) {
      set_megatron_arg(*args, a.dest, model_arg_value(a.dest, v));
    } else if (v.is_boolean()) {
      // the recorded value says whether the switch is in effect; store_false's argument is its negation
      set_megatron_arg(*args, a.dest, pickle_bool(v.get<bool>() == (a.kind == ArgKind::store_true)));
    }
  }
  return args;
}

std::vector<std::string> megatron_model_flags(const PickleValue& args, const std::string& where, bool every_setting) {
  return model_flags_from_args(args, where, every_setting);
}

std::vector<std::string> megatron_tokenizer_flags(const PickleValue& args, const std::string& where) {
  return flags_from_args(args, tokenizer_args(), where);
}

}  // namespace mt
