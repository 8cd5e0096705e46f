// run_training: the megatrain command without a subcommand. Builds the backend, the parallel state
// (the world communicator: MPI for the reference backend under mpirun, NCCL between GPUs), this
// rank's model chunks with their memory plans, the data streams (on the ranks that read data), the
// trainer and the checkpoints, then trains.
#include "app/train.h"

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "app/checkpoint_convert.h"
#include "app/checkpointing.h"
#include "app/energy_meter.h"
#include "app/import_megatron.h"
#include "app/reporters.h"
#include "app/startup_report.h"
#include "app/training_data.h"
#include "core/error.h"
#include "core/log.h"
#include "engine/backend.h"
#include "engine/flops.h"
#include "engine/gpt_model.h"
#include "engine/model_chunks.h"
#include "engine/pipeline_runner.h"
#include "engine/scalar_reduce.h"
#include "engine/trainer.h"
#include "parallel/mpi_communicator.h"
#include "parallel/parallel_state.h"
#include "parallel/parallel_state_builder.h"

#if MEGATRAIN_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace mt {

namespace {
// This rank's GPU: LOCAL_RANK modulo the visible devices (0 without CUDA).
int gpu_ordinal(const Config& cfg) {
#if MEGATRAIN_WITH_CUDA
  int count = 0;
  if (cfg.train.device != DeviceKind::cpu && cudaGetDeviceCount(&count) == cudaSuccess && count > 0)
    return cfg.parallel.local_rank % count;
#endif
  (void)cfg;
  return 0;
}

// The PCI bus id of this rank's GPU (NVML's handle for it).
std::string gpu_bus_id(const Config& cfg, const char* flag) {
#if MEGATRAIN_WITH_CUDA
  char bus_id[64] = {};
  const cudaError_t err = cudaDeviceGetPCIBusId(bus_id, sizeof bus_id, gpu_ordinal(cfg));
  if (err != cudaSuccess) fail("{}: cannot read the GPU's PCI bus id: {}", flag, cudaGetErrorString(err));
  return bus_id;
#else
  (void)cfg;
  fail("{} reads GPU counters and this megatrain was built without CUDA: drop {}", flag, flag);
#endif
}

// --log-energy: the energy counter of this rank's GPU.
std::unique_ptr<EnergyMeter> energy_meter(const Config& cfg) {
  if (!cfg.logging.log_energy) return nullptr;
  return std::make_unique<EnergyMeter>(gpu_bus_id(cfg, "--log-energy"));
}

// --log-straggler: this rank's GPU readings (none on the CPU: its readings stay 0).
std::unique_ptr<GpuSensors> gpu_sensors(const Config& cfg) {
  if (!cfg.logging.log_straggler || cfg.train.device != DeviceKind::gpu) return nullptr;
  return std::make_unique<GpuSensors>(gpu_bus_id(cfg, "--log-straggler"));
}
}  // namespace

std::unique_ptr<Backend> make_backend(const Config& cfg) {
  if (cfg.train.device == DeviceKind::cpu) {
    // Ranks sharing a host share its cores.
    const int per_rank = static_cast<int>(std::thread::hardware_concurrency()) / std::max(1, cfg.parallel.local_world_size);
    return make_reference_backend(cfg.parallel.world_size > 1 ? std::max(1, per_rank) : 0);
  }
#if MEGATRAIN_WITH_CUDA
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0)
    fail("no CUDA GPU is visible ({}); check CUDA_VISIBLE_DEVICES and the driver, or train on the CPU with "
         "--device cpu", err != cudaSuccess ? cudaGetErrorString(err) : "0 devices");
  // GEMM autotuning picks algorithms by timing, so it is off where runs must repeat bit for bit
  // (--deterministic-mode).
  return make_cuda_backend(gpu_ordinal(cfg), !cfg.train.deterministic_mode);
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

// Adds the memory figures to every iteration's statistics: "allocated" is what the backend
// measures it has allocated on the device (the models' planned buffers and its own workspaces;
// the plan itself on the reference backend, whose buffers are host memory); a step allocates
// nothing (the trainer checks), so it is also the peak. On CUDA the device's memory in use (this
// process's context and buffers, NCCL's, and any other process's) stands for Megatron's
// "reserved" bytes. On the reference backend nothing is cached: reserved = allocated.
// Also prints, as Megatron's training_log, on the first data-parallel replica: report_memory at
// the log lines of this run's first iteration and the next logged one (then the optimizer state
// exists), with report_theoretical_memory's line (the plan) on rank 0 before the first; and with
// --log-memory-interval N at log lines whose iteration is a multiple of N.
class MemoryStatsReporter : public Reporter {
 public:
  MemoryStatsReporter(Reporter& inner, const std::vector<GptModel*>& chunks, const ParallelState& ps,
                      std::optional<int> interval, bool device_used)
      : inner_(inner), backend_(chunks.front()->backend()), rank_(ps.rank), prints_(ps.dp_rank == 0),
        interval_(interval), device_used_(device_used), plan_(total_memory_plan(chunks)) {
    for (const GptModel* m : chunks) {
      allocated_ += static_cast<double>(m->memory_plan().total());
      for (size_t b : m->memory_plan().bytes) blocks_ += b > 0 ? 1 : 0;
    }
  }
  void on_iteration(const IterationStats& s) override {
    if (const size_t measured = backend_.bytes_allocated(); measured > 0) allocated_ = static_cast<double>(measured);
    IterationStats t = s;
    t.memory_allocated_bytes = allocated_;
    t.memory_peak_bytes = allocated_;
    t.memory_allocated_count = blocks_;
#if MEGATRAIN_WITH_CUDA
    size_t free_bytes = 0, total_bytes = 0;
    if (backend_.device() == Device::cuda && cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess)
      t.memory_reserved_bytes = static_cast<double>(total_bytes - free_bytes);
#endif
    inner_.on_iteration(t);
    if (!first_iteration_) first_iteration_ = s.iteration;
    const bool first_reports = !reported_;
    const bool on_interval = interval_ && s.iteration % *interval_ == 0;
    if (s.interval_end && prints_ && (first_reports || on_interval)) {
      if (first_reports && rank_ == 0 && s.iteration == *first_iteration_) log::write_stdout(theoretical_memory_line(plan_));
      MemoryReading m;
      m.allocated = m.max_allocated = allocated_;
      const double in_use = static_cast<double>(backend_.memory_in_use());
      m.reserved = in_use > 0 ? in_use : allocated_;
      max_reserved_ = std::max(max_reserved_, m.reserved);
      m.max_reserved = max_reserved_;
      // --log-device-memory-used: the whole device's memory in use (torch.cuda.device_memory_used);
      // on the reference backend the host memory the plan holds.
      if (device_used_) m.device_used = t.memory_reserved_bytes.value_or(allocated_);
      log::write_stdout(format_memory_report(rank_, s.iteration, m));
      if (s.iteration > *first_iteration_) reported_ = true;
    }
  }
  void on_eval(const EvalStats& e) override { inner_.on_eval(e); }
  void flush() override { inner_.flush(); }

 private:
  Reporter& inner_;
  Backend& backend_;
  int rank_;
  bool prints_, reported_ = false;
  std::optional<int> interval_;
  bool device_used_;
  std::optional<int64_t> first_iteration_;
  MemoryPlan plan_;
  double allocated_ = 0, blocks_ = 0, max_reserved_ = 0;
};

// A hidden fault injection for the tests of failure handling: MEGATRAIN_DEBUG_FAULT=kill@R:I kills
// rank R (SIGKILL) at the start of iteration I; hang@R:I makes it stop communicating there (it
// sleeps), so that its peers must time out; corrupt@R:I flips the sign of the first element of
// its first q/k layernorm weight (else of its first parameter), a silent memory error that only
// --test-mode's check or the weight hash check (--check-weight-hash-across-dp-replicas-interval)
// notices (corrupt-expert@R:I: of its first routed expert's weight instead); slow@R:MS (the
// straggler detector's and the sniff test's tests) makes rank R sleep MS ms inside each timed
// training forward pass and GEMM probe (*in_forward).
std::function<void(int64_t)> debug_fault(int rank, const std::vector<GptModel*>& chunks,
                                         std::function<void()>* in_forward) {
  const char* env = std::getenv("MEGATRAIN_DEBUG_FAULT");
  if (!env || !*env) return nullptr;
  const std::string spec(env);
  const size_t at = spec.find('@'), colon = spec.find(':');
  if (at == std::string::npos || colon == std::string::npos || colon < at)
    fail("MEGATRAIN_DEBUG_FAULT={}: expected kill@RANK:ITERATION, hang@RANK:ITERATION, corrupt@RANK:ITERATION or "
         "slow@RANK:MILLISECONDS", spec);
  const std::string kind = spec.substr(0, at);
  const int target = std::stoi(spec.substr(at + 1, colon - at - 1));
  const int64_t iteration = std::stoll(spec.substr(colon + 1));
  if (kind != "kill" && kind != "hang" && kind != "corrupt" && kind != "corrupt-expert" && kind != "slow")
    fail("MEGATRAIN_DEBUG_FAULT={}: the fault is kill, hang, corrupt, corrupt-expert or slow", spec);
  if (target != rank) return nullptr;
  if (kind == "slow") {
    const auto ms = std::chrono::milliseconds(iteration);
    *in_forward = [ms] { std::this_thread::sleep_for(ms); };
    return nullptr;
  }
  return [kind, iteration, rank, chunks](int64_t next) {
    if (next != iteration) return;
    log::write_stderr(fmt::format("[rank {}] MEGATRAIN_DEBUG_FAULT: {} at iteration {}", rank, kind, next));
    if (kind == "kill") std::raise(SIGKILL);
    if (kind == "corrupt" || kind == "corrupt-expert") {
      GptModel& m = *chunks.front();
      const bool expert = kind == "corrupt-expert";
      int victim = -1;
      for (size_t i = 0; i < m.params().size() && victim < 0; ++i) {
        const ParamDesc& d = m.params()[i];
        if (expert ? d.expert
                   : d.name.find("_layernorm.weight") != std::string::npos &&
                         d.name.find("self_attention.") != std::string::npos)
          victim = static_cast<int>(i);
      }
      MT_CHECK(victim >= 0 || !expert, "MEGATRAIN_DEBUG_FAULT=corrupt-expert: rank {} holds no routed expert", rank);
      victim = std::max(victim, 0);
      const Tensor t = m.param(victim).flat_slice(0, 1);
      std::vector<uint8_t> bytes(t.nbytes());
      m.backend().copy_to_host(bytes.data(), t);
      bytes.back() ^= 0x80;  // the sign bit (little-endian)
      m.backend().copy_from_host(t, bytes.data());
      m.backend().synchronize();
      return;
    }
    std::this_thread::sleep_for(std::chrono::hours(1));
  };
}

// Whether any rank has a validation split (ranks that read no data have no source of their own).
bool any_rank(ParallelState& ps, GptModel& m, bool mine) {
  return all_reduce_scalar(ps, m, kHasValidationSlot, mine ? 1.0 : 0.0, ReduceOp::max) > 0.5;
}

int train_with(const Config& cfg, Backend* backend, ParallelState& ps);

// Knowledge distillation: the teacher's weights from --export-kd-teacher-load, a megatrain
// checkpoint (its weights, as --finetune loads them) or a Megatron-LM one (read directly: the
// model its args describe checked against the teacher's, then each parameter's block for this rank).
void load_teacher(const Config& cfg, ParallelState& ps, GptModel& teacher) {
  const std::string& dir = *cfg.train.distill.teacher_load;
  log::info("Loading teacher as GPTModel from {} ...", dir);
  const Config teacher_cfg = distill_teacher_config(cfg);  // (TrainingCheckpoints keeps a reference)
  if (is_megatron_checkpoint(dir, std::nullopt)) {
    Backend& be = teacher.backend();
    int64_t largest = 1;
    for (const ParamDesc& p : teacher.params()) largest = std::max(largest, p.numel());
    void* mem = be.allocate(static_cast<size_t>(largest) * sizeof(float));  // (set-up time)
    read_megatron_weights(dir, teacher_cfg.model, "--export-kd-teacher-load", teacher.params(),
                          [&](size_t i, const std::vector<float>& values) {
                            const Tensor staged(mem, DType::f32, be.device(), {static_cast<int64_t>(values.size())});
                            be.copy_from_host(staged, values.data());
                            const Tensor w = teacher.param(static_cast<int>(i));
                            be.cast(w.flat_slice(0, w.numel()), staged);
                          });
    be.synchronize();
    be.deallocate(mem);
    log::info("  loaded the teacher's weights from Megatron-LM checkpoint {}", dir);
    return;
  }
  TrainingCheckpoints teacher_checkpoint(teacher_cfg, ps, teacher);
  ResumePoint loaded;
  try {
    loaded = teacher_checkpoint.load();
  } catch (const Error& e) {
    fail("--export-kd-teacher-load {}: {}", dir, e.what());
  }
  if (!loaded.loaded)
    fail("--export-kd-teacher-load {}: no checkpoint there (a megatrain or Megatron-LM checkpoint directory, as --save "
         "wrote it)", dir);
}

int train_on_this_rank(const Config& cfg) {
  std::unique_ptr<Backend> backend = make_backend(cfg);
  // Declared after the backend: the communicators finish their work on its streams first.
  ParallelState ps = cfg.parallel.world_size == 1
                         ? make_single_process_state()
                         : build_parallel_state(cfg, make_world_communicator(cfg, gpu_ordinal(cfg),
                                                                              static_cast<CUstream_st*>(backend->stream())));
  log::set_rank(ps.rank, ps.world_size);
  try {
    return train_with(cfg, backend.get(), ps);
  } catch (const std::exception& e) {
    // A rank that stops with an error would leave its peers waiting in a collective until their
    // timeout: under MPI take the whole job down now, before the communicators are torn down (NCCL
    // runs: the launcher and the watchdogs end the others).
    if (ps.world_size > 1 && mpi_initialized()) {
      log::error(dynamic_cast<const Error*>(&e) ? std::string(e.what()) : std::string("internal error: ") + e.what());
      mpi_abort(1);
    }
    throw;
  }
}

// Everything after the parallel state (the models, data and trainer are destroyed before it).
int train_with(const Config& cfg, Backend* backend, ParallelState& ps) {
  log::info("{}", megatron_arguments_block(cfg));
  log::info("{}", rank_layout_summary(cfg));
  const DType compute = compute_dtype(cfg);
  std::vector<std::unique_ptr<GptModel>> owned = build_model_chunks(cfg, ps, *backend, compute);
  const std::vector<GptModel*> chunks = chunk_pointers(owned);
  // Knowledge distillation: the frozen teacher beside the student (app/distill_args.h), its weights
  // loaded below.
  std::unique_ptr<GptModel> teacher;
  if (const std::optional<ChunkSpec> ts = teacher_chunk_spec(cfg, ps, compute)) {
    teacher = std::make_unique<GptModel>(ts->dims, ts->options, ps, *backend);
    teacher->init_parameters(false);
  }

  int64_t params = 0;
  double planned = 0;
  for (const GptModel* m : chunks) {
    for (const ParamDesc& p : m->params()) params += p.numel();
    planned += static_cast<double>(m->memory_plan().total());
  }
  if (teacher) planned += static_cast<double>(teacher->memory_plan().total());
  // Megatron prints this from every model-parallel rank of the first data-parallel replica.
  if (ps.dp_rank == 0)
    log::write_stdout(fmt::format(" > number of parameters on (tensor, pipeline) model parallel rank ({}, {}): {}",
                                  ps.tp_rank, ps.pp_rank, params));
  // The same plan --dry-run prints for this rank's stage (app/plan_memory.cpp): one computation.
  MemoryPlan rank_plan = total_memory_plan(chunks);
  if (teacher) rank_plan += teacher->memory_plan();
  // Printed, like the parameter count, by every model-parallel rank of the first replica.
  if (ps.dp_rank == 0)
    log::write_stdout(fmt::format(" > memory plan on rank {} (tensor, pipeline) ({}, {}): {} bytes ({:.2f} GiB; {} "
                                  "backend, {} model chunk(s))",
                                  ps.rank, ps.tp_rank, ps.pp_rank, rank_plan.total(), rank_plan.total() / 1073741824.0,
                                  backend->name(), chunks.size()));
  log::info("{}", rank_plan.summary());
  if (cfg.train.fine_grained_activation_offloading && ps.dp_rank == 0)
    for (size_t c = 0; c < chunks.size(); ++c)
      log::write_stdout(fmt::format(" > rank {} (tensor, pipeline) ({}, {}){}: {}", ps.rank, ps.tp_rank, ps.pp_rank,
                                    chunks.size() > 1 ? fmt::format(" model chunk {}", c) : std::string(),
                                    chunks[c]->offload_plan().summary()));

  // Checkpoint loading comes before the data streams: they start at the consumed samples.
  TrainingCheckpoints checkpoints(cfg, ps, chunks);
  const ResumePoint resume = checkpoints.load();
  if (teacher) {
    load_teacher(cfg, ps, *teacher);
    chunks.front()->set_teacher(teacher.get());
  }

  // Data: the ranks whose chunks hold the embedding or the loss (first and last pipeline stage)
  // read their DP rank's micro-batches; the middle stages too where their layers read the data
  // (every_stage_reads_data: documents, or positions with rotary embeddings).
  bool reads_data = false;
  for (const GptModel* m : chunks)
    reads_data = reads_data || m->dims().first_stage || m->dims().last_stage || every_stage_reads_data(cfg);
  TrainingData data;
  if (reads_data) {
    data = build_training_data(cfg, ps.dp_rank, ps.dp_size, resume.counters.consumed_samples,
                               resume.counters.consumed_valid_samples);
    log::info("{}", data.description);
  }
  std::unique_ptr<Reporter> reporters = make_reporters(cfg);
  MemoryStatsReporter reporter(*reporters, chunks, ps, cfg.logging.log_memory_interval,
                               cfg.logging.log_device_memory_used);
  const std::unique_ptr<EnergyMeter> energy = energy_meter(cfg);
  Trainer trainer(cfg, ps, chunks, data.train.get(), data.valid.get(), reporter);
  if (energy) trainer.energy_joules = [m = energy.get()] { return m->joules(); };
  const std::unique_ptr<GpuSensors> sensors = gpu_sensors(cfg);
  if (sensors && trainer.straggler()) trainer.straggler()->readings = [g = sensors.get()] { return g->read(); };
  trainer.set_has_validation(any_rank(ps, *chunks.front(), data.valid != nullptr));
  trainer.flops_per_iteration = [&cfg](int64_t batch) { return num_floating_point_operations(cfg.model, batch); };
  checkpoints.set_flops_per_sample(num_floating_point_operations(cfg.model, 1));
  checkpoints.restore(resume, trainer);
  // Megatron's checkpoint_and_decide_exit: a save every --save-interval iterations, else a
  // non-persistent one every --non-persistent-save-interval iterations; before an early exit
  // (--exit-interval, --exit-duration-in-mins, SIGTERM with --exit-signal-handler) a save unless
  // this iteration was just saved (non-persistently too, as Megatron); after the last iteration a
  // save unless it was one of the interval's. An early exit skips the final evaluation, as
  // Megatron exits right there.
  const CheckpointConfig& k = cfg.checkpoint;
  bool exited_early = false;
  std::function<void()> slow;
  const std::function<void(int64_t)> fault = debug_fault(ps.rank, chunks, &slow);
  if (slow && trainer.straggler()) trainer.straggler()->inside_forward = slow;
  if (slow && trainer.sniff_test()) trainer.sniff_test()->inside_gemm = slow;
  // Saves stay out of the log interval's time and energy, as Megatron's save_checkpoint_and_time.
  auto save = [&](bool non_persistent = false) {
    trainer.outside_interval([&] { checkpoints.save(trainer, non_persistent); });
  };
  trainer.after_iteration = [&](int64_t iteration) {
    checkpoints.poll();
    if (k.save && iteration % *k.save_interval == 0) save();
    else if (k.save && k.non_persistent_save_interval && iteration % *k.non_persistent_save_interval == 0) save(true);
    if (fault) {
      trainer.optimizer().wait_for_params();  // (a corrupted weight lands after the update)
      fault(iteration + 1);
    }
    return true;
  };
  // --step-batch-size-schedule: Megatron saves a checkpoint where the number of micro-batches changes.
  trainer.on_microbatches_change = [&](int64_t iteration) {
    if (k.save && iteration != 0 && checkpoints.last_saved_iteration() != iteration) save();
  };
  trainer.before_early_exit = [&](int64_t iteration) {
    exited_early = true;
    if (trainer.shutdown_requested()) return;  // (--exit-signal-handler-for-training: an orderly stop, no save)
    if (k.save && checkpoints.last_saved_iteration() != iteration) save();
  };

  // The rerun state machine's stop (engine/rerun_state_machine.h): Megatron saves a checkpoint of
  // the last completed iteration when it exits 16 (with --save; megatrain stores no rerun state in it).
  trainer.before_rerun_exit = [&](int64_t iteration, bool checkpoint) {
    exited_early = true;
    if (!checkpoint) return;
    if (!k.save) log::warn0("no checkpoint saved for the rerun state machine: --save is not set");
    else if (checkpoints.last_saved_iteration() != iteration) save();
  };
  log::info("training ...");
  if (!cfg.train.skip_train) {
    if (fault) fault(trainer.iteration() + 1);
    const int64_t last = trainer.train();
    if (!exited_early && k.save && last != 0 && last % *k.save_interval != 0) checkpoints.save(trainer);
  }
  if (!exited_early && trainer.has_validation() && cfg.train.eval_iters > 0) trainer.evaluate(true);
  checkpoints.finish();
  reporter.flush();
  backend->synchronize();
  // One line per rank after the run: what each GPU held (bench/run_parallel_gpu.sh reads it). The
  // step allocates nothing, so the memory in use now (communicator buffers included, which NCCL
  // sets up at the first collectives) is the run's peak.
  log::write_stdout(fmt::format(
      "[rank {}] memory: planned {:.1f} MiB, allocated {:.1f} MiB, device in use {:.1f} MiB (tp {} pp {} dp {})",
      ps.rank, planned / 1048576.0, static_cast<double>(backend->bytes_allocated()) / 1048576.0,
      static_cast<double>(backend->memory_in_use()) / 1048576.0, ps.tp_rank, ps.pp_rank, ps.dp_rank));
  return trainer.exit_code();
}

}  // namespace

int run_training(const Config& cfg) {
  int rc = 0;
  try {
    rc = cfg.checkpoint.ckpt_convert_format ? convert_checkpoint(cfg) : train_on_this_rank(cfg);
  } catch (const Error& e) {
    // Errors before the parallel state existed (e.g. setting up the world communicator).
    if (cfg.parallel.world_size == 1 || !mpi_initialized()) throw;
    log::error(e.what());
    mpi_abort(1);
  }
  mpi_finalize();  // the communicators are closed (no-op without MPI)
  return rc;
}

}  // namespace mt
