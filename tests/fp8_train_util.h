// Training a tiny model with FP8 on the reference backend for the FP8 tests: what a run leaves
// behind (losses, grad norms, parameters, FP8 scaling state, memory plan).
#pragma once

#include <vector>

#include "app/training_data.h"
#include "engine/backend.h"
#include "engine/gpt_model.h"
#include "engine/reference/reference_backend.h"
#include "engine/trainer.h"
#include "parallel/parallel_state.h"
#include "tests/engine_test_util.h"

namespace mt::test {

struct Fp8Run {
  std::vector<double> losses, grad_norms;
  std::vector<float> params;  // after the last step (float32 model)
  std::vector<float> scale, scale_inv, history;
  std::vector<float> ex_scale, ex_history;  // the experts' state (GptModel::fp8_expert_state)
  std::vector<float> x_scale;                // the extra GEMMs' state (GptModel::fp8_extra_state)
  std::vector<int> x_layers;                 // its layers
  MemoryPlan plan;
  int64_t amaxes_taken = 0;  // tensorwise casts that used their producer's amax (ReferenceBackend)
};

// keep_inputs: ModelOptions::TestSeams::fp8_keep_inputs (false: the backward casts the FP8 inputs again);
// norm_cast: ModelOptions::TestSeams::fp8_norm_cast (false: the norm outputs are written, then cast).
// producer_amax: ModelOptions::TestSeams::fp8_producer_amax (false: every tensorwise cast takes its own amax).
inline Fp8Run train_fp8(const Config& cfg, bool keep_inputs = true, bool norm_cast = true, bool producer_amax = true) {
  struct Recorder final : Reporter {
    std::vector<double> grad_norms;
    void on_iteration(const IterationStats& s) override { grad_norms.push_back(s.grad_norm.value_or(-1.0)); }
    void on_eval(const EvalStats&) override {}
  };
  Fp8Run run;
  ParallelState ps = make_single_process_state();
  auto be = make_reference_backend(2);
  const ModelDims dims = ModelDims::from_config(cfg, ps);
  ModelOptions o = ModelOptions::from_config(cfg, dims, DType::f32);
  o.seams.fp8_keep_inputs = keep_inputs;
  o.seams.fp8_norm_cast = norm_cast;
  o.seams.fp8_producer_amax = producer_amax;
  GptModel model(dims, o, ps, *be);
  model.init_parameters();
  TrainingData data = build_training_data(cfg, 0, 1, 0);
  Recorder rep;
  Trainer trainer(cfg, ps, model, *data.train, data.valid.get(), rep);  // (evaluates with cfg's eval_iters)
  trainer.train();
  run.losses = trainer.loss_history();
  run.grad_norms = rep.grad_norms;
  run.plan = model.memory_plan();
  run.amaxes_taken = dynamic_cast<reference::ReferenceBackend&>(*be).fp8_amaxes_taken();
  run.params.resize(static_cast<size_t>(model.params_flat().numel()));
  be->copy_to_host(run.params.data(), model.params_flat());
  const Fp8State& st = model.fp8_state();
  if (st.any()) {
    run.scale.resize(static_cast<size_t>(st.scale().numel()));
    run.scale_inv.resize(static_cast<size_t>(st.scale_inv_all().numel()));
    run.history.resize(static_cast<size_t>(st.history().numel()));
    be->copy_to_host(run.scale.data(), st.scale());
    be->copy_to_host(run.scale_inv.data(), st.scale_inv_all());
    be->copy_to_host(run.history.data(), st.history());
  }
  const Fp8State& xs = model.fp8_extra_state();
  if (xs.any()) {
    run.x_scale.resize(static_cast<size_t>(xs.scale().numel()));
    be->copy_to_host(run.x_scale.data(), xs.scale());
    run.x_layers = xs.fp8_global_layers();
  }
  const Fp8State& ex = model.fp8_expert_state();
  if (ex.any()) {
    run.ex_scale.resize(static_cast<size_t>(ex.scale().numel()));
    run.ex_history.resize(static_cast<size_t>(ex.history().numel()));
    be->copy_to_host(run.ex_scale.data(), ex.scale());
    be->copy_to_host(run.ex_history.data(), ex.history());
  }
  return run;
}

}  // namespace mt::test
