// run_training: the megatrain command without a subcommand. Builds the parallel state, the backend,
// the model with its memory plan, the data streams and the trainer, then trains.
#include "app/train.h"

#include <memory>

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

namespace {

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

  TrainingData data = build_training_data(cfg, ps.dp_rank, ps.dp_size, 0);
  log::info("{}", data.description);
  std::unique_ptr<Reporter> reporter = make_reporters(cfg);
  Trainer trainer(cfg, ps, model, *data.train, data.valid.get(), *reporter);
  trainer.flops_per_iteration = [&cfg] { return num_floating_point_operations(cfg.model, cfg.train.global_batch); };
  log::info("training ...");
  if (!cfg.train.skip_train) trainer.train();
  if (data.valid && cfg.train.eval_iters > 0) trainer.evaluate(true);
  reporter->flush();
  return 0;
}

}  // namespace mt
