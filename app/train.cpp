// run_training: the megatrain command without a subcommand. Builds the parallel state, the backend,
// the model with its memory plan, the data streams and the trainer, then trains.
#include "app/train.h"

#include <memory>

#include "app/checkpointing.h"
#include "app/reporters.h"
#include "app/training_data.h"
#include "core/error.h"
#include "core/log.h"
#include "engine/backend.h"
#include "engine/flops.h"
#include "engine/gpt_model.h"
#include "engine/trainer.h"
#include "parallel/parallel_state.h"

#if MEGATRAIN_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace mt {

std::unique_ptr<Backend> make_backend(const Config& cfg) {
  if (cfg.train.device == DeviceKind::cpu) return make_reference_backend(0);
#if MEGATRAIN_WITH_CUDA
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0)
    fail("no CUDA GPU is visible ({}); check CUDA_VISIBLE_DEVICES and the driver, or train on the CPU with "
         "--device cpu", err != cudaSuccess ? cudaGetErrorString(err) : "0 devices");
  return make_cuda_backend(cfg.parallel.local_rank);
#else
  fail("this megatrain was built without CUDA; use --device cpu");
#endif
}

namespace {

DType compute_dtype(const Config& cfg) {
  switch (cfg.train.precision) {
    case Precision::fp32: return DType::f32;
    case Precision::bf16:
      if (cfg.train.device == DeviceKind::cpu) fail("--bf16 needs --device gpu (the CPU reference backend computes in float32)");
      return DType::bf16;
    case Precision::fp16:
      if (cfg.train.device == DeviceKind::cpu) fail("--fp16 needs --device gpu (the CPU reference backend computes in float32)");
      return DType::f16;
  }
  return DType::f32;
}

// Adds what the memory plan knows to every iteration's statistics: the step allocates nothing,
// so the planned buffers are both the current and the peak allocation; on CUDA the device's
// memory in use (this process's context and buffers, and any other process's) stands for
// Megatron's "reserved" bytes.
class MemoryStatsReporter : public Reporter {
 public:
  MemoryStatsReporter(Reporter& inner, const MemoryPlan& plan) : inner_(inner) {
    allocated_ = static_cast<double>(plan.total());
    for (size_t b : plan.bytes) blocks_ += b > 0 ? 1 : 0;
  }
  void on_iteration(const IterationStats& s) override {
    IterationStats t = s;
    t.memory_allocated_bytes = allocated_;
    t.memory_peak_bytes = allocated_;
    t.memory_allocated_count = blocks_;
#if MEGATRAIN_WITH_CUDA
    size_t free_bytes = 0, total_bytes = 0;
    if (cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess)
      t.memory_reserved_bytes = static_cast<double>(total_bytes - free_bytes);
#endif
    inner_.on_iteration(t);
  }
  void on_eval(const EvalStats& e) override { inner_.on_eval(e); }
  void flush() override { inner_.flush(); }

 private:
  Reporter& inner_;
  double allocated_ = 0, blocks_ = 0;
};

}  // namespace

int run_training(const Config& cfg) {
  if (cfg.parallel.world_size > 1)
    throw Unsupported("training on more than one process is not wired up yet (world size " +
                      std::to_string(cfg.parallel.world_size) + ")");
  ParallelState ps = make_single_process_state();
  log::set_rank(ps.rank, ps.world_size);

  std::unique_ptr<Backend> backend = make_backend(cfg);
  const DType compute = compute_dtype(cfg);
  const ModelDims dims = ModelDims::from_config(cfg, ps);
  ModelOptions options = ModelOptions::from_config(cfg, dims, compute);
  GptModel model(dims, options, ps, *backend);
  model.init_parameters();

  int64_t params = 0;
  for (const ParamDesc& p : model.params()) params += p.numel();
  log::info(" > number of parameters on (tensor, pipeline) model parallel rank ({}, {}): {}", ps.tp_rank,
            ps.pp_rank, params);
  log::info(" > memory plan on rank {} ({} backend):\n{}", ps.rank, backend->name(), model.memory_plan().summary());

  // Checkpoint loading comes before the data streams: they start at the consumed samples.
  TrainingCheckpoints checkpoints(cfg, ps, model);
  const ResumePoint resume = checkpoints.load();

  TrainingData data = build_training_data(cfg, ps.dp_rank, ps.dp_size, resume.counters.consumed_samples,
                                          resume.counters.consumed_valid_samples);
  log::info("{}", data.description);
  std::unique_ptr<Reporter> reporters = make_reporters(cfg);
  MemoryStatsReporter reporter(*reporters, model.memory_plan());
  Trainer trainer(cfg, ps, model, *data.train, data.valid.get(), reporter);
  const double flops = num_floating_point_operations(cfg.model, cfg.train.global_batch);
  trainer.flops_per_iteration = [flops] { return flops; };
  checkpoints.set_flops_per_iteration(flops);
  checkpoints.restore(resume, trainer);

  // Megatron's checkpoint_and_decide_exit: a save every --save-interval iterations; before an
  // early exit (--exit-interval, --exit-duration-in-mins, SIGTERM with --exit-signal-handler) a
  // save unless this iteration was just saved; after the last iteration a save unless it was one
  // of the interval's. An early exit skips the final evaluation, as Megatron exits right there.
  const CheckpointConfig& k = cfg.checkpoint;
  bool exited_early = false;
  trainer.after_iteration = [&](int64_t iteration) {
    checkpoints.poll();
    if (k.save && iteration % *k.save_interval == 0) checkpoints.save(trainer);
    return true;
  };
  trainer.before_early_exit = [&](int64_t iteration) {
    exited_early = true;
    if (k.save && checkpoints.last_saved_iteration() != iteration) checkpoints.save(trainer);
  };

  log::info("training ...");
  if (!cfg.train.skip_train) {
    const int64_t last = trainer.train();
    if (!exited_early && k.save && last != 0 && last % *k.save_interval != 0) checkpoints.save(trainer);
  }
  if (!exited_early && data.valid && cfg.train.eval_iters > 0) trainer.evaluate(true);
  checkpoints.finish();
  reporter.flush();
  return 0;
}

}  // namespace mt
