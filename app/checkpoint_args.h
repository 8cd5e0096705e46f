// The run configuration a checkpoint records (manifest.json run_state.config, Megatron's `args`)
// and what loading checks against it (Megatron's check_checkpoint_args).
//
// The "model" section holds every ModelConfig field (derived ones included), so that tools without
// the training flags (export-hf) can rebuild the model; "flags" holds every flag's resolved value
// for people reading the manifest.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "core/config.h"
#include "engine/lr_schedule.h"

namespace mt {

// {"model": {...}, "flags": {"--num-layers": 2, ...}, "derived": {...}}
nlohmann::json checkpoint_config_json(const Config& cfg);

nlohmann::json model_config_to_json(const ModelConfig& m);
// Throws mt::Error naming `where` when a field is missing or malformed.
ModelConfig model_config_from_json(const nlohmann::json& j, const std::string& where);

// Refuses a checkpoint saved for another model shape: every setting that changes the parameters'
// shapes or meaning (layers, hidden size, heads, query groups, head dim, FFN size, padded
// vocabulary, position embedding, normalization, SwiGLU, biases, qk-layernorm, tied embeddings,
// layernorm-1p). The message names `where` (the manifest) and each differing flag with both values.
void check_checkpoint_model(const nlohmann::json& saved_model, const ModelConfig& current, const std::string& where);

// The LR scheduler state (Megatron's OptimizerParamScheduler.state_dict keys, steps in samples).
nlohmann::json lr_schedule_to_json(const LrScheduleParams& p, int64_t num_steps);
LrScheduleParams lr_schedule_params_from_json(const nlohmann::json& j, const std::string& where);
// Megatron's load_state_dict checks: the saved and current schedule must agree unless
// --override-opt-param-scheduler (keep the current values) or --use-checkpoint-opt-param-scheduler
// (take the checkpoint's). Returns the parameters to train with; throws naming the difference.
LrScheduleParams reconcile_lr_schedule(const LrScheduleParams& current, const LrScheduleParams& saved,
                                       const TrainConfig& t, const std::string& where);

}  // namespace mt
