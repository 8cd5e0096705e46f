// One part of a training run split by a checkpoint, on the reference backend: the resume tests
// (dynamic loss scaler, FP8 scaling state) train (0, to] straight and (0, k] + (k, to] through a
// checkpoint and compare what `collect` read from the model and trainer.
#pragma once

#include <catch2/catch.hpp>

#include <functional>
#include <string>
#include <vector>

#include "app/checkpointing.h"
#include "engine/backend.h"
#include "engine/gpt_model.h"
#include "engine/reporter.h"
#include "engine/trainer.h"
#include "parallel/parallel_state.h"
#include "tests/engine_test_util.h"

namespace mt::test {

struct NullReporter final : Reporter {
  void on_iteration(const IterationStats&) override {}
  void on_eval(const EvalStats&) override {}
};

inline std::vector<float> host_copy(Backend& be, const Tensor& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  REQUIRE(t.dtype == DType::f32);
  be.copy_to_host(v.data(), t);
  return v;
}

// Trains up to iteration `to` of `base` (loading `dir` first when load is set, saving at `to` when
// save is), on a deterministic batch stream that starts at the consumed samples, then hands the
// backend, model and trainer to `collect`.
inline void run_split_part(const Config& base, const std::string& dir, int64_t to, bool load, bool save,
                           const std::function<void(Backend&, GptModel&, Trainer&)>& collect) {
  Config cfg = base;
  if (load) cfg.checkpoint.load = dir;
  if (save) {
    cfg.checkpoint.save = dir;
    cfg.checkpoint.save_interval = 1000;
  }
  ParallelState ps = make_single_process_state();
  auto be = make_reference_backend(1);
  const ModelDims dims = ModelDims::from_config(cfg, ps);
  GptModel model(dims, ModelOptions::from_config(cfg, dims, DType::f32), ps, *be);
  model.init_parameters();
  TrainingCheckpoints ck(cfg, ps, model);
  const ResumePoint r = ck.load();
  ArangeBatchSource src(cfg.train.micro_batch_size, cfg.model.seq_length, cfg.model.vocab_size, -1,
                        r.counters.consumed_samples);
  NullReporter rep;
  Trainer trainer(cfg, ps, model, src, nullptr, rep);
  ck.restore(r, trainer);
  trainer.after_iteration = [&](int64_t it) { return it < to; };
  trainer.train();
  if (save) ck.save(trainer);
  collect(*be, model, trainer);
}

}  // namespace mt::test
