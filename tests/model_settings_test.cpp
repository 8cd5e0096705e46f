// The model settings declared on the flag table (app/flags.h ModelSetting): the checkpoint's model
// section, the checks on load, --use-checkpoint-args and the Megatron-args mapping read them from
// there, so a setting declared once reaches all of them.
#include <catch2/catch.hpp>

#include <algorithm>
#include <set>
#include <string>

#include "app/checkpoint_args.h"
#include "app/flags.h"
#include "app/megatron_args.h"
#include "checkpoint/megatron_checkpoint.h"
#include "tests/cli_test_util.h"

namespace mt {
namespace {

using nlohmann::json;
using test::Args;
using test::words;

std::vector<const cli::FlagSpec*> model_settings() {
  std::vector<const cli::FlagSpec*> out;
  for (const cli::FlagSpec& f : cli::flag_table().flags())
    if (f.model) out.push_back(&f);
  return out;
}

// A Llama-like model with every recorded setting that has a flag moved off its default where
// the engine builds it.
Args non_default_model() {
  return words(
      "--num-layers 3 --hidden-size 96 --num-attention-heads 6 --group-query-attention --num-query-groups 2 "
      "--kv-channels 8 --ffn-hidden-size 200 --seq-length 32 --max-position-embeddings 64 "
      "--position-embedding-type rope --no-position-embedding --rotary-base 500000 --rotary-percent 0.5 "
      "--rotary-interleaved --rotary-seq-len-interpolation-factor 2 --use-rope-scaling --rope-scaling-factor 4 "
      "--normalization RMSNorm --norm-epsilon 1e-6 --swiglu --disable-bias-linear --add-qkv-bias --qk-layernorm "
      "--untie-embeddings-and-output-weights --make-vocab-size-divisible-by 64 --attention-dropout 0.05 "
      "--hidden-dropout 0.0 --init-method-std 0.01 --embedding-init-method-std 0.03 --attention-output-gate "
      "--window-size 7,0 --window-attn-skip-freq 3 --num-experts 4 --moe-ffn-hidden-size 48 "
      "--moe-layer-freq ([0]+[1]*2) --moe-router-topk 3 --moe-router-score-function sigmoid --moe-router-pre-softmax "
      "--moe-router-topk-scaling-factor 2.5 --moe-router-num-groups 2 --moe-router-group-topk 1 "
      "--moe-shared-expert-intermediate-size 64 --moe-shared-expert-gate --moe-grouped-gemm --mtp-num-layers 1 "
      "--micro-batch-size 2 --lr 1e-3 --train-iters 10 --mock-data --tokenizer-type NullTokenizer --vocab-size 1000");
}

// The settings the model above cannot hold (Gated DeltaNet and MuP; Gated DeltaNet refuses
// multi-token prediction), off their defaults too.
Args non_default_gdn_mup_model() {
  return words(
      "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 64 --swiglu "
      "--experimental-attention-variant gated_delta_net --linear-attention-freq 2 --linear-conv-kernel-dim 3 "
      "--linear-key-head-dim 16 --linear-value-head-dim 8 --linear-num-key-heads 2 --linear-num-value-heads 4 "
      "--use-mup --mup-base-hidden-size 32 --mup-embedding-mult 2.5 --mup-output-mult 0.25 --mup-base-head-dim 8 "
      "--mup-attn-scale-power 0.75 "
      "--micro-batch-size 2 --lr 1e-3 --train-iters 10 --mock-data --tokenizer-type NullTokenizer --vocab-size 1000");
}

TEST_CASE("model settings: one destination and one checkpoint key each, every key recorded", "[args][schema]") {
  std::set<std::string> dests, keys;
  const json recorded = model_config_to_json(test::parse(non_default_model()).model);
  for (const cli::FlagSpec* f : model_settings()) {
    INFO(f->name);
    CHECK(dests.insert(f->model->dest).second);
    if (f->model->key.empty()) continue;
    CHECK(keys.insert(f->model->key).second);
    CHECK(recorded.contains(f->model->key));
    // A setting --use-checkpoint-args takes is read from the checkpoint's flags section.
    if (f->model->take != cli::CheckpointTake::no) CHECK(f->value);
  }
  // Settings loading compares must be in the model section.
  for (const cli::FlagSpec* f : model_settings())
    if (f->model->compare != cli::CheckpointCompare::no) CHECK_FALSE(f->model->key.empty());
}

TEST_CASE("model settings: the model section round trips a model with every setting off its default", "[args][schema]") {
  const Config c = test::parse(non_default_model());
  const json j = model_config_to_json(c.model);
  const json defaults = model_config_to_json(ModelConfig{});
  // The flags above moved these off their defaults; a setting the section dropped or could not
  // read back would come back as the default.
  for (const char* key : {"num_layers", "num_query_groups", "kv_channels", "ffn_hidden_size", "position_embedding_type",
                          "add_position_embedding", "rotary_base", "rotary_percent", "rotary_interleaved",
                          "rotary_seq_len_interpolation_factor", "use_rope_scaling", "rope_scaling_factor",
                          "normalization", "norm_epsilon", "swiglu", "add_bias_linear", "qk_layernorm",
                          "untie_embeddings_and_output_weights", "make_vocab_size_divisible_by", "attention_dropout",
                          "hidden_dropout", "init_method_std", "embedding_init_method_std", "attention_output_gate",
                          "window_size", "window_attn_skip_every", "num_experts", "moe_ffn_hidden_size",
                          "moe_layer_pattern", "moe_router_topk", "moe_router_score_function", "moe_router_pre_softmax",
                          "moe_router_topk_scaling_factor", "moe_router_num_groups", "moe_router_group_topk",
                          "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "moe_expert_ffn",
                          "moe_layer"}) {
    INFO(key);
    CHECK(j.at(key) != defaults.at(key));
  }
  const ModelConfig back = model_config_from_json(j, "m.json");
  CHECK(model_config_to_json(back) == j);
  CHECK(back.normalization == Normalization::rmsnorm);
  CHECK(back.position_embedding_type == PositionEmbedding::rope);
  CHECK(back.window_size == std::make_pair(7, 0));
  CHECK(back.window_attn_skip_every == 3);
  CHECK(back.norm_epsilon == 1e-6);
  CHECK_NOTHROW(check_checkpoint_model(j, c.model, "m.json"));
}

TEST_CASE("model settings: a bad value in the model section names the manifest and the key", "[args][schema]") {
  json j = model_config_to_json(test::parse(non_default_model()).model);
  j["normalization"] = "BatchNorm";
  try {
    model_config_from_json(j, "ck/manifest.json");
    FAIL("an unknown normalization was read");
  } catch (const Error& e) {
    CHECK_THAT(e.what(), Catch::Contains("ck/manifest.json: model setting 'normalization' is malformed"));
    CHECK_THAT(e.what(), Catch::Contains("BatchNorm"));
  }
  j = model_config_to_json(test::parse(non_default_model()).model);
  j.erase("hidden_size");
  CHECK_THROWS_WITH(model_config_from_json(j, "ck/manifest.json"),
                    Catch::Contains("ck/manifest.json: the saved model configuration lacks 'hidden_size'"));
}

TEST_CASE("model settings: loading compares each checked setting, and older checkpoints hold the default of newer ones",
          "[args][schema]") {
  std::set<std::string> exercised;
  for (const Args& args : {non_default_model(), non_default_gdn_mup_model()}) {
  const Config c = test::parse(args);
  const json saved = model_config_to_json(c.model);
  const json defaults = model_config_to_json(ModelConfig{});
  for (const cli::FlagSpec* f : model_settings()) {
    const cli::ModelSetting& m = *f->model;
    if (m.compare != cli::CheckpointCompare::yes) continue;
    // (Each model moves its own settings off their defaults; a switch is flipped below.)
    if (saved.at(m.key) == defaults.at(m.key) && !saved.at(m.key).is_boolean()) continue;
    exercised.insert(f->name);
    INFO(f->name);
    // The saved value edited: loading names the flag (a cleared switch by its key and flag).
    json other = saved;
    json& v = other.at(m.key);
    if (v.is_boolean()) v = !v.get<bool>();
    else if (v.is_number_integer()) v = v.get<int64_t>() + 1;
    else if (v.is_number_float()) v = v.get<double>() * 2 + 1;
    else if (v.is_string()) v = v.get<std::string>() == "rope" ? "learned_absolute" : v.get<std::string>() == "RMSNorm" ? "LayerNorm" : "x";
    else FAIL("no edit for " << v.dump());
    const std::string label = f->store_false ? m.key + " (" + f->name + ")" : f->name;
    CHECK_THROWS_WITH(check_checkpoint_model(other, c.model, "m.json"),
                      Catch::Contains("was saved for another model: " + label + " is "));
    if (!m.added_later) continue;
    // Saved before the setting was recorded: the default, which a run with the switch flipped (or
    // the setting's value above) differs from.
    json older = saved;
    older.erase(m.key);
    const json def = model_config_to_json(ModelConfig{}).at(m.key);
    Config on = c;
    if (def.is_boolean()) f->set_field(on, !def.get<bool>());
    const json want = model_config_to_json(on.model).at(m.key);
    REQUIRE(want != def);
    auto text = [](const json& v) { return v.is_null() ? std::string("None") : v.dump(); };
    CHECK_THROWS_WITH(check_checkpoint_model(older, on.model, "m.json"),
                      Catch::Contains(label + " is " + text(def) + " in the checkpoint but " + text(want) + " in this run"));
    const ModelConfig off = model_config_from_json(older, "m.json");
    CHECK(model_config_to_json(off).at(m.key) == def);
    CHECK_NOTHROW(check_checkpoint_model(older, off, "m.json"));
  }
  }
  for (const cli::FlagSpec* f : model_settings())
    if (f->model->compare == cli::CheckpointCompare::yes) {
      INFO(f->name << " is off its default in neither model");
      CHECK(exercised.count(f->name) == 1);
    }
}

TEST_CASE("model settings: each reaches Megatron's saved args under its destination and comes back as its flag",
          "[args][schema]") {
  const Config c = test::parse(non_default_model());
  const json flags = checkpoint_config_json(c).at("flags");
  const PickleRef args = megatron_args_from_flags(flags);
  const std::vector<std::string> back = megatron_model_flags(*args, "args");
  auto has = [&](const std::string& f) { return std::find(back.begin(), back.end(), f) != back.end(); };
  auto after = [&](const std::string& f) {
    auto it = std::find(back.begin(), back.end(), f);
    return it != back.end() && it + 1 != back.end() ? *(it + 1) : std::string();
  };
  for (const cli::FlagSpec* f : model_settings()) {
    if (!f->value || !flags.contains(f->name) || flags.at(f->name).is_null()) continue;
    INFO(f->name);
    CHECK(megatron_arg(*args, f->model->dest) != nullptr);
  }
  // A store_false switch is saved as its destination's False and comes back as the switch.
  const PickleValue* bias = megatron_arg(*args, "add_bias_linear");
  REQUIRE(bias != nullptr);
  CHECK(bias->is(PickleKind::boolean));
  CHECK_FALSE(bias->boolean);
  CHECK(has("--disable-bias-linear"));
  CHECK(has("--no-position-embedding"));
  CHECK(has("--swiglu"));
  CHECK(has("--qk-layernorm"));
  CHECK(has("--attention-output-gate"));
  CHECK(has("--group-query-attention"));
  CHECK(after("--num-query-groups") == "2");
  CHECK(after("--normalization") == "RMSNorm");
  CHECK(after("--window-size") == "7,0");
  CHECK(after("--window-attn-skip-freq") == "3");
  CHECK(after("--num-experts") == "4");
  CHECK(after("--moe-layer-freq") == "[0,1,1]");  // Megatron saves the list
  CHECK(after("--moe-router-score-function") == "sigmoid");
  CHECK(has("--moe-shared-expert-gate"));
  CHECK_FALSE(has("--moe-grouped-gemm"));  // no effect in megatrain: not imported
  CHECK(megatron_arg(*args, "layernorm_epsilon") != nullptr);
  CHECK(std::stod(after("--norm-epsilon")) == 1e-6);
  // The flags parse back into the same model.
  Args again = back;
  for (const char* w : {"--micro-batch-size", "2", "--lr", "1e-3", "--train-iters", "10", "--mock-data",
                        "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"})
    again.push_back(w);
  CHECK(model_config_to_json(test::parse(again).model) == model_config_to_json(c.model));
}

}  // namespace
}  // namespace mt
