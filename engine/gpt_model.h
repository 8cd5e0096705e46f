// GptModel: one pipeline stage of a GPT- or Llama-style decoder (Megatron-Core's GPTModel), on one
// tensor-parallel rank, written against Backend only. The same code runs on the reference and the
// CUDA backends.
//
// A stage owns a contiguous range of decoder layers (plus the embedding on the first stage and
// the final norm, output layer and loss on the last) and runs forward/backward of ONE micro-batch
// at a time in an activation "slot"; a pipeline schedule decides the order and moves the stage
// input/output tensors between ranks. See engine/README.md for the step as data.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "core/config.h"
#include "core/tensor.h"
#include "data/batch.h"
#include "engine/activation_offload.h"
#include "engine/backend.h"
#include "engine/fp8_state.h"
#include "engine/grad_layout.h"
#include "engine/memory_plan.h"
#include "engine/model_dims.h"
#include "engine/param_layout.h"
#include "engine/rope_table.h"

namespace mt {

struct ParallelState;
class Communicator;
class AttentionCore;
struct AttentionSinks;

// Which layers of the stage are recomputed in backward (--recompute-granularity full): groups of
// consecutive local layers whose inputs alone are kept. Selective recompute (core attention) keeps
// nothing extra here: attention is flash-style and saves only its output and the log-sum-exp, so
// there is nothing large to drop; it is accepted and costs nothing.
struct RecomputePlan {
  std::vector<int> group_of;                 // local layer -> group index, or -1
  std::vector<std::pair<int, int>> groups;   // [begin, end) local layers
  int max_group_size = 0;
  static RecomputePlan from_config(const TrainConfig& t, int stage_layers);
};

struct ModelOptions {
  DType compute = DType::f32;  // parameters and activations
  DType accum = DType::f32;    // main grads, master weights, optimizer states, statistics, losses
  int num_slots = 1;           // micro-batches in flight at once (1 without pipelining)
  RecomputePlan recompute;
  OptimizerKind optimizer = OptimizerKind::adam;
  bool sgd_momentum = true;    // SGD keeps a momentum buffer (--sgd-momentum != 0)
  MuonConfig muon;             // --optimizer muon: its settings (the workspace it needs depends on them)
  RopeTableParams rope;        // positions/rot_dim filled from ModelDims
  AttentionBackend attention_backend = AttentionBackend::auto_;
  bool deterministic = false;  // --deterministic-mode (attention: only bit-reproducible backwards)
  // --reset-attention-mask: attention within each packed document (MicroBatch::segments staged as
  // each position's document start, AttentionShape::doc_start; every pipeline stage reads the
  // data then: every_stage_reads_data). With CP the whole sequence's starts (the attention
  // blocks compare global positions).
  bool documents = false;
  // Rows of logits the output layer holds at once (0: automatic, chunks of at most 512 MiB).
  // logits() needs all of them: forward-logits sets this to the token count.
  int64_t logits_chunk_rows = 0;
  // Data parallelism (engine/grad_layout.h): the flat buffers are cut into DP buckets of
  // bucket_size elements (nullopt: one bucket); with shard_optimizer_state
  // (--use-distributed-optimizer) master weights and optimizer states hold only this rank's shard
  // of each bucket. The shard group: the replicas (DP x CP), or this rank's optimizer instance
  // (--num-distributed-optimizer-instances); shard_rank is the rank's place in it (worked out
  // from its RankPosition by engine/model_chunks.h).
  int shard_size = 1, shard_rank = 0;
  // Expert parallelism: the routed experts' weights (ParamDesc::expert) form a bucket region of
  // their own, reduced and sharded over (an instance of) the expert-data-parallel group of this
  // size (this rank's place in it: expert_shard_rank). 0: no such region (EP = 1).
  int expert_shard_size = 0, expert_shard_rank = 0;
  std::optional<int64_t> bucket_size;
  bool shard_optimizer_state = false;
  // Sharded gradients (--use-megatron-fsdp optim_grads, ZeRO-2; engine/model_chunks.h says when):
  // each decoder layer's gradients are a bucket of their own (a unit), written into one of
  // unit_slots unit-sized staging buffers (layer l into l % unit_slots) and, as soon as the layer's
  // backward is done, in every micro-batch, reduce-scattered over DP and added into this rank's shard of the main
  // gradients (grad_shards()). The parameters outside the layers keep whole staging buffers,
  // reduce-scattered at the end of each backward. Needs shard_optimizer_state and one chunk per
  // rank without pipelining, expert-parallel regions or FP8 parameters.
  bool shard_grads = false;
  // Sharded parameters (--use-megatron-fsdp optim_grads_params, ZeRO-3; with shard_grads): each
  // rank keeps only its shard of every decoder layer's compute-dtype parameters (param_shards(),
  // the optimizer's output) and all-gathers a layer's whole parameters into one of unit_slots
  // layer-sized slots (layer l into l % unit_slots) just before its forward or backward needs them, again after the slot
  // was taken by another layer. The parameters outside the layers stay whole. Always with a float32
  // master copy (also for float32 parameters); not with master-weight remainders.
  bool shard_params = false;
  // Overlapped unit transfers (--overlap-param-gather / --overlap-grad-reduce with sharded
  // parameters / gradients): each layer's gather is issued one layer ahead (the next layer's while
  // this one computes, on the communication stream where the backend has one) and its reduce-
  // scatter finishes while the layers below run backward. The forward's layer l also writes layer
  // l + 1's input norm (it holds two layers' parameters), and the backward's layer l also writes
  // layer l - 1's fc2 bias gradient (two gradient slots), so the transfer in flight needs a third
  // slot: unit_slots is 3 then, else 2 (layer l's slot: l % unit_slots).
  bool prefetch_units = false;
  int unit_slots = 2;
  // The main gradients' dtype: accum, or bf16 with --grad-reduce-in-bf16 (Megatron's grad buffer
  // then has the parameters' dtype: gradients accumulate over micro-batches and are reduced in
  // bf16, and the optimizer reads them as float). Set-up work that needs a parameter's
  // full-precision values then stages them per parameter (GptModel::stage_full_params).
  DType grad = DType::f32;
  // Adam's moments in bf16 instead of accum (--exp-avg-dtype / --exp-avg-sq-dtype bf16, precision-
  // aware optimizer): the update reads them as float, computes in float and stores them rounded
  // to nearest even, as Transformer Engine's FusedAdam does.
  bool bf16_exp_avg = false, bf16_exp_avg_sq = false;
  // The float32 master weights kept as int16 remainders beside the bf16 parameters (Transformer
  // Engine's store_param_remainders, which Megatron's precision-aware optimizer turns on with bf16
  // parameters; core/master_remainder.h): 2 bytes per master element instead of 4, the same master
  // values, and the bf16 parameters rounded to nearest with ties away from zero (not to even).
  // Needs bf16 compute, float32 accum and no FP8 parameters or sharded parameters; without a
  // sharded master copy, float32 main gradients (the set-up stages full values there).
  bool master_remainders = false;
  // ... rounded to nearest even instead, as a cast of a separate float32 master copy: its bits
  // exactly, the exact ties' direction kept in one more bit per element (master_ties(),
  // core/master_remainder.h). megatrain's default for AdamW and Muon with bf16 parameters
  // (engine/model_chunks.cpp).
  bool master_tie_bits = false;
  // One micro-batch per step in one slot (engine/model_chunks.cpp says when): a layer's kept
  // activations may lie in the memory of gradients that the backward writes only once it is done
  // with them (lower layers', the word embeddings'), as PyTorch's allocator reuses freed
  // activations for gradients (GptModel::plan_acts_over_grads).
  bool acts_over_grads = false;
  // One micro-batch per step in one slot, no rank the experts' gradients are reduced with, no FP8
  // (engine/model_chunks.cpp says when): the routed experts' weight-gradient GEMMs also sum the
  // squares of what they write (Backend::grouped_linear_backward_weight's sumsq) into
  // expert_grad_sumsq(), and the gradient norm takes that sum instead of reading those gradients
  // again (engine/optimizer.cpp).
  bool expert_grad_sumsq = false;
  // FP8 linear layers (--fp8-format; engine/fp8_state.h).
  Fp8Options fp8;
  // Layers keep their two norm outputs (the QKV and fc1 inputs) from forward for the weight
  // gradients, as Megatron does unless --recompute-modules names layernorm (with --recompute-
  // granularity selective); then each is recomputed by the norm's backward (the same bits) and
  // every layer shares one [N, h] buffer for them. Not under sequence parallelism (its backward
  // recomputes and re-gathers them, as Megatron's does) nor in FP8 layers whose weight gradients
  // take the kept FP8 copies.
  bool keep_norm_outputs = true;
  // Multi-latent attention with --recompute-modules mla_up_proj (selective): the attention's input
  // (the up projections' outputs with RoPE, packed: LayerActs::qkv) is not kept but recomputed in
  // backward from the kept latents, in one workspace buffer every layer shares.
  bool mla_recompute_up = false;
  // --recompute-modules moe (or --moe-layer-recompute) / shared_experts (selective): MoE layers
  // keep no experts' fc1 output ([Rmax, fc1] each) / no shared expert's fc1 output ([N, fc1_sh]);
  // the backward recomputes it (the same bits) from the re-gathered inputs into one workspace
  // buffer every layer shares. (Megatron recomputes the whole MoE layer; the routing it would
  // recompute is kept here: a few values per token, the same bits.)
  bool moe_recompute_fc1 = false;
  bool moe_recompute_shared = false;
  // Fine-grained activation offloading (engine/activation_offload.h): the named modules' kept
  // tensors go to host memory after each layer's forward and come back before its backward.
  OffloadOptions offload;

  // Knowledge distillation (engine/blocks/distill.cpp; app/distill_args.h). frozen: this model is
  // a teacher: forward only, in evaluation mode, on one slot, with no gradients, master weights or
  // optimizer states; its head stops at the final norm's output (features()), which the student's
  // head turns into logits chunk by chunk (teacher_logits()). distill: this model is a student
  // (one stage), whose head trains on ModelOpt's losses against set_teacher()'s model.
  bool frozen = false;
  struct Distill {
    bool enabled = false;
    float inv_temperature = 1.0f;  // 1 / logit_kl_temperature
    // The intermediate pairs: the student's and the teacher's hidden states compared, each a
    // decoder layer's output (its number) or the final norm's (-1), and the loss between them.
    struct Pair {
      int student = -1, teacher = -1;
      Backend::HiddenLoss loss = Backend::HiddenLoss::cosine;
    };
    std::vector<Pair> pairs;
  } distill;

  // Fused paths whose unfused counterpart other configurations still take (recompute, sequence
  // parallelism, dropout, delayed FP8 scaling, --no-fp8-wgrad). Tests only: no flag and no
  // environment variable sets them; tests turn one off to compare both paths bit for bit.
  struct TestSeams {
    // FP8 layers with FP8 weight gradients keep each linear input's transposed FP8 copy from the
    // forward's cast for the weight-gradient GEMM (GptModel::fp8_keeps_inputs). false: the
    // backward casts each input again from the recomputed compute-dtype input.
    bool fp8_keep_inputs = true;
    // fc2's and proj's bias gradients are summed by the norm backwards that write their output
    // gradients (GptModel::fc2_bias_grad_from_norm). false: a column-sum pass of their own, with
    // the weight gradient (what dropout and sequence parallelism take).
    bool bias_grad_from_norm = true;
    // A layer's closing bias + dropout + residual also writes the norm that reads its output (the
    // next layer's ln1, or the final norm) in the same pass over the rows, where both layers are
    // kept (not in a full-recompute group). false: two passes (what recomputed layers take).
    bool fuse_next_norm = true;
    // Layers with FP8 GEMMs cast their QKV and fc1 inputs (the norm outputs) to FP8 straight from
    // the norms' inputs and statistics (Backend::fp8_quantize_norm; the norms then write only
    // their statistics), where the norm outputs are not kept and without sequence parallelism.
    // false: written, then cast (what sequence parallelism takes).
    bool fp8_norm_cast = true;
    // Tensorwise FP8: the ops that write a cast's source also take its amax, so the cast skips
    // its own amax pass over it (Fp8TensorMeta::fresh): the norm statistics for
    // fp8_quantize_norm, the norm backward or, with hidden dropout, the dropout backward that
    // writes proj's or fc2's output gradient (not with sequence parallelism), and the optimizer's
    // update for the weights (GptModel::weight_cast_amax_slot). false: every cast takes its own.
    bool fp8_producer_amax = true;
  };
  TestSeams seams;

  // The single-process options of this config (the DP fields are set by the caller).
  static ModelOptions from_config(const Config& cfg, const ModelDims& d, DType compute);
};

class GptModel {
 public:
  GptModel(const ModelDims& dims, const ModelOptions& options, ParallelState& ps, Backend& backend);
  // The memory plan of a model without building it (--dry-run): the same layout code as the
  // constructor, measuring only.
  static MemoryPlan plan_memory(const ModelDims& dims, const ModelOptions& options);
  ~GptModel();
  GptModel(const GptModel&) = delete;
  GptModel& operator=(const GptModel&) = delete;

  const ModelDims& dims() const { return d_; }
  const ModelOptions& options() const { return opt_; }
  const std::vector<ParamDesc>& params() const { return descs_; }
  const MemoryPlan& memory_plan() const;
  const OffloadPlan& offload_plan() const { return offload_; }
  Backend& backend() { return be_; }

  // Flat buffers (all parameters of the stage, in params() order with padding).
  // With FP8 parameters (fp8_params()) params_flat() holds the compute-dtype region only,
  // [0, grad_layout().fp8_begin); param_storage() gives any bucket-aligned range of either region.
  // With sharded parameters (ModelOptions::shard_params) params_flat() is empty and param_storage()
  // gives a range inside one bucket: a layer's as its slot holds it.
  Tensor params_flat() const { return params_; }
  Tensor param_storage(int64_t offset, int64_t numel) const;
  // The whole gradient buffer; empty with sharded gradients (ModelOptions::shard_grads), whose
  // buckets have staging buffers of their own and whose main gradients are this rank's shards.
  Tensor grads_flat() const { return grads_; }
  // Bucket b's gradients, in the whole buffer or (sharded gradients) its staging buffer.
  Tensor grad_bucket(int b) const;
  // Sharded gradients: this rank's shard of every bucket's main gradients, laid out like the
  // sharded optimizer states (GradLayout::state_offset); empty otherwise.
  Tensor grad_shards() const { return grad_shards_; }
  // Master weights and optimizer states: indexed like the flat buffers, or, when sharded
  // (grad_layout().sharded), holding this DP rank's shard of each bucket at
  // grad_layout().state_offset[b]. Without a separate master copy (compute == accum) the master
  // weights are the parameters themselves, full size.
  Tensor master_flat() const { return master_; }  // == params_flat() when compute == accum
  // The tie bits of master weights kept as remainders rounded to nearest even
  // (ModelOptions::master_tie_bits) for the elements of master_flat() from `state_offset` on;
  // empty otherwise.
  TieBits master_ties(int64_t state_offset) const {
    return ties_.empty() ? TieBits{} : TieBits{ties_, state_offset};
  }
  Tensor master_tie_words() const { return ties_; }  // (checkpoints: all of them)
  Tensor exp_avg_flat() const { return state1_; }     // Adam m, or SGD momentum
  Tensor exp_avg_sq_flat() const { return state2_; }  // Adam v
  Tensor muon_workspace() const { return muon_workspace_; }  // --optimizer muon's scratch (engine/muon.h)
  // A separate master copy: a compute dtype narrower than accum, or FP8 parameters (their only
  // full-precision values are the master weights, also with float32 compute on the reference backend).
  bool has_master_copy() const {
    return !opt_.frozen && (opt_.compute != opt_.accum || fp8_params() || opt_.shard_params);
  }
  // Sharded parameters (ModelOptions::shard_params): this rank's shard of bucket b's parameters
  // (the compute dtype, or FP8 bytes for an FP8 bucket; only the layers' buckets are used); whether
  // bucket b is one of those; and, after the optimizer step (or anything else that changed the
  // shards), that the gathered layers are stale.
  Tensor param_shard(int b) const { return param_shard_storage_.at(static_cast<size_t>(b)); }
  bool param_shard_bucket(int b) const {
    return opt_.shard_params && grad_layout_.bucket_unit[static_cast<size_t>(b)] >= 0;
  }
  void param_shards_updated();
  bool param_sharded(int i) const { return opt_.shard_params && param_shard_bucket(param_bucket(i)); }
  // The gradient bucket holding params()[i].
  int param_bucket(int i) const { return param_bucket_.at(static_cast<size_t>(i)); }
  // --fp8-param-gather: the FP8 layers' linear weights live only as FP8 (ParamDesc::fp8_storage),
  // in the FP8 region of the flat buffers (engine/grad_layout.h).
  bool fp8_params() const { return grad_layout_.fp8_begin < total_elements_; }
  const GradLayout& grad_layout() const { return grad_layout_; }
  // Per-parameter views. master(i) needs an unsharded master copy.
  Tensor param(int i) const;
  Tensor grad(int i) const;
  Tensor master(int i) const;
  // A small accum-dtype buffer for per-step reductions (loss, grad norm...): [kScalarCount].
  static constexpr int kScalarCount = 43;
  Tensor scalars() const { return scalars_; }
  // ModelOptions::expert_grad_sumsq: [1] of the scalars' dtype, the step's sum of squares of the
  // routed experts' weight gradients (zeroed with the gradients, added to by each expert
  // weight-gradient GEMM); empty otherwise. sumsq_fused(p): whether parameter p's squares are in it.
  Tensor expert_grad_sumsq() const { return expert_sumsq_; }
  bool sumsq_fused(const ParamDesc& p) const;

  // Draws every parameter from its layout-independent stream (and the master copy). With
  // random = false (--no-initialization: a checkpoint is about to overwrite them) the randomly
  // initialized ones are set to zero instead, which is cheaper and leaves nothing undefined.
  void init_parameters(bool random = true);
  // Whether a sharded master copy or optimizer state needs stage_full_params to take full
  // tensors: the gradient buffer, the full-size staging otherwise, holds bf16 main grads.
  bool stages_per_param() const { return grad_layout_.sharded && (opt_.grad != opt_.accum || opt_.shard_grads); }
  // Full-precision (accum) values, one parameter at a time, through a set-up-time scratch of the
  // largest parameter's size: fill(i, v) writes parameter i's values into v (its shape); they are
  // cast into the model weights (to_params) and this rank's pieces go to `sharded` (laid out like
  // the master weights: this rank's shard of each bucket; its padding is zeroed).
  void stage_full_params(const std::function<void(int, Tensor)>& fill, Tensor sharded, bool to_params);
  // Full-precision values of every parameter in `full` (a full-size accum buffer, e.g. the unused
  // gradient buffer): the parameters take them rounded, and a sharded master copy its shards
  // (int16 remainders: split from them). Set-up time (initialization, checkpoint loads).
  void params_from_full_master(Tensor full);
  // This rank's master weights kept as remainders (ModelOptions::master_remainders), as float32 on
  // the host (checkpoints): host copies of params_flat, master_flat and master_tie_words (with
  // master_tie_bits) joined.
  void master_to_host(float* out, const void* params_host, const void* master_host, const void* ties_host) const;

  // ---- FP8 (--fp8-format) ----------------------------------------------------------------
  // The trainer calls fp8_begin_step() before a step's first forward (the FP8 weight cache is
  // rebuilt at each layer's first use after it: once per step, not per micro-batch, and after
  // any change of the parameters: init, checkpoint load, optimizer) and fp8_end_step() after the
  // last backward, before the optimizer step (amax reduction and the delayed-scaling update).
  // No-ops without FP8.
  void fp8_begin_step();
  void fp8_end_step();
  // FP8 parameters (fp8_params()): casts this DP rank's shard of bucket b (no-op outside the FP8
  // region) from the master weights into the FP8 parameters with each weight's current scale,
  // recording its amax (as the optimizer's update does in the same pass, after fp8_end_step's
  // scale update: the trainer ends a step's FP8 state before the optimizer step): set-up, and a
  // step skipped by the loss scaler. The parameters' all-gather follows
  // (engine/distributed_optimizer.h).
  void fp8_cast_shard(int b);
  // The scaling state that casts FP8 parameter params()[i] (its GEMM's weight operand; amax
  // recorded): the dense layers' (fp8_), the routed experts' (fp8_ex_: one per local expert, each a
  // block of rows of the weight) or multi-latent attention's, the MTP projection's and the shared
  // experts' (fp8_extra_). The parameter's elements [offset, offset + numel) fall in pieces of one
  // scaling state each: fn(start, count, meta) per piece, start relative to the parameter.
  void for_each_fp8_param_piece(int i, int64_t offset, int64_t numel,
                                const std::function<void(int64_t, int64_t, const Fp8TensorMeta&)>& fn) const;
  // After an optimizer update cast the FP8 parameters (every rank of the states' amax groups calls
  // these): the weights' amaxes it recorded maxed over each state's groups; then with tensorwise
  // scaling every weight's scale from its amax alone (Fp8State::update_weight_scales).
  void reduce_fp8_param_amax();
  void update_fp8_param_scales();
  // Tensorwise FP8 (ModelOptions::TestSeams::fp8_producer_amax) where the weights are not FP8 parameters: the
  // optimizer's update takes the amax of each FP8 layer's new linear weights (of this rank's pieces
  // with the distributed optimizer) into the amax slot of the weight's next cast
  // (OptimSegment::fp8_amax, Fp8TensorMeta::fresh), and that cast skips its amax pass. The slot of
  // params()[i], or empty where params()[i] is not such a weight.
  Tensor weight_cast_amax_slot(int i) const;
  // The optimizer's update ran with those slots (called after every update, by every rank): with
  // the distributed optimizer the slots are maxed over DP; the next cast of each FP8 layer's
  // weights (training or evaluation, whichever comes first) takes them.
  void fp8_weights_updated();
  // All FP8 parameters from the master weights (set-up time: after init_parameters or a checkpoint
  // load): the shards cast, then all-gathered over DP. fresh_state: a fresh FP8 state (a new run,
  // or a checkpoint without one), whose weights' scales first come from their own amax (over every
  // shard; no scale update has happened yet); else the loaded state, whose scales delayed scaling
  // uses as they are (a resumed run casts the same bits as the run that saved). Tensorwise scaling
  // always takes the weights' scales from their amax (what its optimizer steps do: the same scales).
  void fp8_params_from_master(bool fresh_state);
  const Fp8State& fp8_state() const { return fp8_; }
  Fp8State& fp8_state_mutable() { return fp8_; }  // checkpoint loading
  // The experts' FP8 scaling state (Fp8State::plan_subset; nothing without FP8 MoE layers).
  const Fp8State& fp8_expert_state() const { return fp8_ex_; }
  Fp8State& fp8_expert_state_mutable() { return fp8_ex_; }
  // Multi-latent attention's and the MTP projection's FP8 scaling state (GptModel::Fp8Gemm).
  const Fp8State& fp8_extra_state() const { return fp8_extra_; }
  Fp8State& fp8_extra_state_mutable() { return fp8_extra_; }
  // Starts a step's gradients: zeroes the buffer except the weight gradients the step's first GEMM
  // writes (plan_grad_zeroing). Until the step's backward has written those, the buffer is not the
  // gradient: check_grads_written() says whether it is.
  void zero_grads();
  // The optimizer's update of this chunk runs beside the next step's forward (engine/optimizer.h:
  // Optimizer::step). From update_in_flight() to update_joined() (the compute stream then waits
  // for the update), zero_grads() leaves the gradients it zeroes, which the update reads, to
  // update_joined(). Not with sharded gradients.
  void update_in_flight();
  void update_joined();
  bool update_pending() const { return update_in_flight_; }
  // The parameter indices at which the forward waits (params_needed): 0, each decoder layer's
  // first parameter, the head's first (on the last stage), ascending and distinct, below the
  // parameter count.
  std::vector<int> forward_param_boundaries() const;
  // Fails naming the parameter if a gradient left to its first write was not written since
  // zero_grads() (the optimizer would read stale numbers).
  void check_grads_written() const;

  // ---- one micro-batch -------------------------------------------------------------------
  // Stages mb into `slot`: tokens, labels, positions and loss mask (reordered to the
  // sequence-major rows), and the loss gradient per row: mask * loss_grad_scale / max(1, tokens
  // of mb) (or mask * loss_grad_scale with per_token_loss). `serial` numbers the micro-batch in the
  // run (dropout keys); training = false runs forward only without dropout (evaluation).
  void stage_micro_batch(int slot, const MicroBatch& mb, double loss_grad_scale, bool per_token_loss,
                         uint64_t serial, bool training);
  // The same for a chunk that needs no data (neither embedding nor loss: a middle pipeline
  // stage): positions 0..s-1 (RoPE) and the dropout key only.
  // loss_grad_scale: as stage_micro_batch's (the MoE aux losses' gradient seed).
  void stage_without_data(int slot, uint64_t serial, bool training, double loss_grad_scale = 1.0);
  // Forward through this stage. On the last stage it adds the masked loss sum and token count to
  // loss_sums(!training) and, when training, also runs the output layer's backward at once (the
  // loss gradient is known), leaving the gradient of the last layer's output in the slot: the
  // logits never outlive the call.
  void forward(int slot);
  // grad_sync: the last backward of the step for this chunk. The TP-partial gradients are summed
  // over the TP group as each layer finishes, and on_grads_final reports the progress.
  void backward(int slot, bool grad_sync = false);
  // Activation offloading with every layer copied (several micro-batches in flight): issues the
  // copy back of the last layer's offloaded tensors for slot's backward now, so that the backward
  // does not begin by waiting for it. Call it when no forward of this chunk comes before that
  // backward (the pipeline runner does); a no-op otherwise.
  void prefetch_backward(int slot);
  // ... and where the chunk's next action after slot's forward is slot's own backward (a 1F1B
  // pipeline's last stage), call this before that forward: its last layers' offloaded tensors then
  // stay in their entries (as with one micro-batch in flight) instead of going to host and back.
  void backward_follows(int slot) { offload_stay_ = slot; }

  // Hooks of the data-parallel code (engine/dp_grad_sync.h, engine/distributed_optimizer.h).
  // In a grad_sync backward: on_grads_final(i) when the gradients of params()[i..] are final.
  // With sharded gradients (ModelOptions::shard_grads) every backward reports, and first calls
  // on_grads_final(kBackwardBegins): a stage's buckets may all be final before its backward ends
  // (no embedding on the stage), so the next backward's start is said, not guessed.
  static constexpr int kBackwardBegins = -1;
  std::function<void(int first_final_param)> on_grads_final;
  // In forward, before params()[..end) are used (--overlap-param-gather waits for them there, and
  // an update beside the forward: Optimizer::step); at the start of backward with end = params().size().
  std::function<void(int end)> on_params_needed;
  // Sharded gradients: before gradient slot `slot` is zeroed for another layer (and in
  // zero_grads()), so that a reduce-scatter from it still in flight is finished first.
  std::function<void(int slot)> on_grad_slot_reuse;
  int grad_unit_slot(int local) const { return local % opt_.unit_slots; }
  // Sharded parameters with prefetch (ModelOptions::prefetch_units): the groups that gather the
  // layers' parameters on the backend's communication stream (the routed experts' bucket over
  // `expert`), and comm marks first_mark + slot saying when a slot's gather has landed; set by
  // engine/dp_grad_sync.h. Unset: the optimizer's groups, on the compute stream.
  struct UnitGather {
    Communicator* dense = nullptr;
    Communicator* expert = nullptr;
    int first_mark = -1;
  };
  void set_unit_gather(const UnitGather& g) { unit_gather_ = g; }

  // Stage boundary tensors are [tokens_local(), h] (sequence shards with --sequence-parallel).
  Tensor stage_input(int slot) const;   // non-first stages: receive the previous stage's output here
  Tensor stage_output(int slot) const;  // non-last stages: send this forward
  Tensor output_grad(int slot) const;   // non-last stages: receive the next stage's input grad here
  Tensor input_grad() const;            // non-first stages: send this back after backward()
  Tensor loss_sums(bool eval) const { return eval ? eval_loss_ : train_loss_; }  // [sum, tokens]
  // MoE layers: the logged load-balancing losses of this step's training forwards, summed over
  // micro-batches and this chunk's MoE layers, kMoeTerms pairs (float32 [2 x kMoeTerms]): {aux_loss,
  // z-loss}, {seq_aux_loss, 0}, {global_aux_loss, 0}, each divided by its coefficient (Megatron's
  // load_balancing_loss, z_loss, seq_load_balancing_loss and global_load_balancing_loss before their
  // reduction over ranks). The trainer zeroes it at each step's start.
  static constexpr int kMoeTerms = 3;
  // Each pair's place: pair t at 2 t; the z-loss is the second of the aux_loss pair.
  enum MoeLossTerm : int { kMoeAuxTerm = 0, kMoeSeqTerm = 1, kMoeGlobalTerm = 2 };
  Tensor moe_loss_sums() const { return moe_loss_; }
  // With --moe-per-layer-logging: the same per global layer, [2 kMoeTerms x num_layers] (layer l's
  // from 2 kMoeTerms l; zero for the layers of other chunks and dense layers). Empty otherwise.
  Tensor moe_layer_loss_sums() const { return moe_layer_loss_; }
  // At each step's start: global_aux_loss's running counts begin again (Megatron resets them in
  // finalize_model_grads).
  void moe_begin_step();
  int moe_layers() const;  // MoE layers of this chunk
  // Multi-token prediction: per depth j {the sum over this step's micro-batches of depth j's mean
  // loss (its tokens' losses over their count), the micro-batches} (accum dtype [2 D]; zeroed by the
  // trainer at each step's start). Empty without --mtp-num-layers or off the last stage.
  Tensor mtp_loss_sums() const { return mtp_loss_; }
  // ... and per depth {the rows whose prediction (the argmax of the depth's logits) is their label,
  // the rows counted (mask != 0)} over this step's micro-batches: Megatron-LM's MTP acceptance
  // counts (accum dtype [2 D], zeroed with mtp_loss_sums()).
  Tensor mtp_accept_counts() const { return mtp_accept_; }

  // Aux-loss-free load balancing (ModelDims::moe_expert_bias): each MoE layer's expert bias [E]
  // (float32; kept on the host, the device copy follows it) and the step's token counts per
  // expert (after dropping), counted by each training micro-batch's backward.
  bool has_expert_bias() const { return d_.moe_expert_bias && d_.any_moe(); }
  // Megatron's _update_router_expert_bias, once per step after the gradient reduction: the counts
  // summed over DP (under expert parallelism every rank counts its own experts) and TP (the
  // experts' TP rank 0 counts; with experts split over fewer ranks than TP, TP ranks dispatched
  // other rows), then b_e += rate * sign(mean_e c - c_e) for each MoE layer, and the counts zeroed.
  void update_expert_bias();
  // Layer `layer`'s (global number) bias on the host [E]: read for checkpoints; after writing it
  // call expert_bias_loaded().
  std::span<float> expert_bias(int layer);
  void expert_bias_loaded();
  // This step's token counts so far, per MoE layer of this chunk [E] each (tests; copied from the
  // device, where the backward counts them).
  const std::vector<double>& expert_token_counts();
  // ---- knowledge distillation (ModelOptions::frozen / distill) --------------------------------
  // A student's teacher (frozen, the same parallel layout, one stage): each micro-batch staged into
  // this model is staged into the teacher too, and each forward runs the teacher's first.
  void set_teacher(GptModel* teacher);
  // A student's distillation losses over this step's training forwards (eval: the evaluation's),
  // {total loss, logits distillation loss, intermediate distillation loss} as ModelOpt's loss
  // balancer reports them (masked sums over tokens; accum dtype [3]); zeroed with loss_sums() by
  // the trainer. Empty without ModelOptions::distill.
  Tensor kd_loss_sums(bool eval) const { return eval ? kd_eval_loss_ : kd_train_loss_; }
  // A frozen model's final-norm output of its last forward, all rows [N, h] (sequence-major).
  Tensor features() const;
  // This rank's rows [tokens_local, h] of a hidden state of slot `slot`'s last forward: decoder
  // layer `layer`'s output, or (-1) the final norm's.
  Tensor hidden_state(int slot, int layer) const;
  // A frozen model's logits of rows [r0, r0 + rows) of that output (this rank's vocabulary shard).
  void teacher_logits(Tensor out, int64_t r0, int64_t rows) const;

  // Last stage: the logits [N, V/tp] (sequence-major rows, this rank's vocabulary shard) of the
  // last forward(slot) with training = false (a training forward overwrites them with dlogits).
  // Only when the head keeps all rows at once (ModelOptions::logits_chunk_rows >= N).
  Tensor logits() const;

 private:
  struct LayerParams;
  struct MtpParams;
  struct MtpActs;
  struct MoeActs;
  struct MoeExchange;
  struct LayerActs;
  struct Slot;
  struct Workspace;

  struct MeasureOnly {};
  GptModel(const ModelDims& dims, const ModelOptions& options, ParallelState& ps, Backend& backend, MeasureOnly);
  void plan_params();
  void layout(Arena& a);
  // ModelOptions::acts_over_grads. Every element of the gradient buffer has an owner: the local
  // decoder layer whose backward writes it (a parameter's padding goes with the parameter before
  // it), kAfterLayers (the word and position embeddings, written after every layer's backward:
  // untied, first stage, no MTP) or kNoOwner (written in the forward or by several layers: the
  // head's, MTP's). Layer i's activations may lie only over elements that layers 0..i-2 or
  // kAfterLayers own: the backward of layer i + 1 reads layer i's output and writes layer i's fc2
  // bias gradient (prev_fc2_bias_grad), so layer i's activations are dead before any write to
  // layer i - 2's gradients; the zeroed ranges of layer j are zeroed before layer j + 1's backward
  // (before the embeddings' backward for kAfterLayers), not at the step's start.
  static constexpr int kAfterLayers = 1 << 30, kNoOwner = -1;
  struct GradOwnerSegment {
    int64_t begin = 0, end = 0;  // elements of grads_
    int owner = kNoOwner;
  };
  std::vector<GradOwnerSegment> grad_owner_segments() const;
  // Measuring pass, after the slots: places the layers' activations (act_bytes_) first-fit from
  // the top layer down and moves their bytes out of the activations' block.
  void plan_acts_over_grads(Arena& a);
  void zero_layer_grads(int owner);  // the zeroed ranges of `owner` left to the backward
  // dense / moe: the layer (or, for the recompute scratch, one of the layers it serves) has a dense
  // MLP / an MoE block; softmax / gdn: softmax attention / a Gated DeltaNet block.
  struct LayerKinds {
    bool dense = true, moe = false, softmax = true, gdn = false;
  };
  LayerKinds layer_kinds(int local) const;
  LayerActs layout_layer_acts(Arena& a, MemoryCategory c, bool keep_out, bool fp8_inputs, bool keep_act,
                              LayerKinds kinds);
  // Each block's part of it (the norm outputs are the layer's own where A.norm_kept, else shared).
  void layout_attention_acts(Arena& a, MemoryCategory c, LayerActs& A, bool softmax, bool gdn);
  void layout_mlp_acts(Arena& a, MemoryCategory c, LayerActs& A, bool keep_act, bool keep_out, bool dense, bool moe);
  void layout_fp8_inputs(Arena& a, MemoryCategory c, LayerActs& A, bool dense_mlp, bool dense_attention);
  // An MoE layer's part (engine/blocks/moe.cpp): layout_mlp_acts' for MoE layers.
  void layout_moe_acts(Arena& a, MemoryCategory c, LayerActs& A);
  void layout_moe_workspace(Arena& a);
  // Whether a layer keeps its norm outputs (ModelOptions::keep_norm_outputs); fp8_inputs: the
  // layer keeps its FP8 inputs instead.
  bool keeps_norm_outputs(bool fp8_inputs) const;
  // Whether a layer (FP8 or not) keeps its GeLU activation (GeLU or squared ReLU: yes, but in FP8 layers).
  bool keeps_gelu_activation(bool fp8_layer) const;
  void bind_params();

  uint64_t site_key(const Slot& s, int layer, int site) const;
  AttentionShape attention_shape(const Slot* s, int layer) const;
  void embedding_forward(Slot& s);
  void embedding_backward(Slot& s, Tensor grad);
  void set_slot_key(Slot& s, uint64_t serial, bool training);
  uint64_t hidden_key(const Slot& s, int layer, int site) const;
  Tensor local_rows(Tensor t) const;
  void gather_rows(Tensor full);
  Tensor reduce_rows(Tensor full);
  // The tail of a column-parallel linear layer's backward under sequence parallelism (fc1, QKV).
  void column_parallel_backward_sp(int local, Fp8State::Gemm fp8_slot, const LayerActs& A, Tensor norm_out, Tensor norm_mean, Tensor norm_rstd,
                                   Tensor norm_in, Tensor norm_w, Tensor norm_b, Tensor norm_dw, Tensor norm_db,
                                   Tensor d_out, Tensor weight, Tensor dweight, Tensor dbias, Tensor dx,
                                   Tensor dresidual);
  Tensor expand_grad(Tensor local, float p, uint64_t key, Tensor amax = Tensor());
  void reduce_tp_partial(int layer);
  void grads_final(int first_param);
  void params_needed(int end);
  // The norm that follows a layer's output: the next layer's ln1 or, after the stage's last layer
  // of the last stage, the final norm; the layer's closing bias + dropout + residual writes it in
  // the same pass (ModelOptions::TestSeams::fuse_next_norm) where `fused`. out empty: its statistics only
  // (the next layer casts its output to FP8 from them: fp8_norm_cast).
  struct NextNorm {
    bool fused;  // (value-initialized by {}: false)
    Tensor out, mean, rstd, weight, bias;
    Tensor amax;  // the next layer's QKV cast's amax slot (norm_cast_amax), or empty
  };
  // A norm's input, statistics and parameters: what fp8_quantize_norm casts its output from.
  struct NormInput {
    Tensor x, mean, rstd, weight, bias;
  };
  // Whether layer `local` (activations A) casts its norm outputs to FP8 straight from the norms'
  // inputs and statistics, never writing them in the compute dtype (ModelOptions::TestSeams::fp8_norm_cast):
  // FP8 GEMMs now, the norm outputs not kept, no sequence parallelism.
  bool fp8_norm_cast(int local, const LayerActs& A) const;
  // Tensorwise FP8 with fp8_norm_cast (ModelOptions::TestSeams::fp8_producer_amax): the norm statistics op
  // also takes the amax of the output its cast reads into the cast's slot. norm_cast_amax: that
  // slot of GEMM g's input (g: qkv or fc1), or empty where the norm does not take it.
  bool norm_takes_cast_amax(int local, const LayerActs& A) const;
  Tensor norm_cast_amax(int local, const LayerActs& A, Fp8State::Gemm g) const;
  // Tensorwise FP8 (ModelOptions::TestSeams::fp8_producer_amax): whether the output gradient of GEMM g (proj
  // or fc2) of layer `local` comes with its amax from the norm backward that writes it (proj: ln2's
  // of the same layer; fc2: the next layer's ln1), and that slot (or empty).
  bool dy_amax_from_norm(const Slot& s, int local, Fp8State::Gemm g) const;
  Tensor dy_amax_slot(const Slot& s, int local, Fp8State::Gemm g) const;
  // The same where hidden dropout's backward (expand_grad) writes that gradient (no SP: a rank's
  // rows alone would give its rows' amax): the slot expand_grad's dropout_backward takes, or empty.
  Tensor dy_amax_from_dropout(int local, Fp8State::Gemm g) const;
  NextNorm next_norm(const Slot& s, int local) const;
  // Whether layer `local`'s input norm was written by its predecessor's forward (next_norm).
  bool norm_from_previous(int local) const;
  // One decoder layer (engine/gpt_model.cpp): the attention block (engine/blocks/attention.cpp),
  // then the MLP block (engine/blocks/mlp.cpp); backward in the reverse order.
  void layer_forward(int local, Slot& s, const LayerActs& A, Tensor x, const NextNorm& next = {});
  void layer_backward(int local, Slot& s, const LayerActs& A, Tensor x, Tensor dy, Tensor dx);
  void attention_forward(int local, Slot& s, const LayerActs& A, Tensor x);
  // Multi-latent attention's block (engine/blocks/mla.cpp) in place of the attention block's.
  void layout_mla_acts(Arena& a, MemoryCategory c, LayerActs& A);
  void layout_mla_workspace(Arena& a);
  MlaShape mla_shape() const;
  void mla_up_projections(int local, const Slot& s, const LayerActs& A, const LayerParams& P);
  void mla_forward(int local, Slot& s, const LayerActs& A, Tensor x);
  void mla_backward(int local, Slot& s, const LayerActs& A, Tensor x, Tensor dx);
  // Gated DeltaNet's block (engine/blocks/gdn.cpp) in place of the attention block's in the layers
  // ModelDims::is_gdn marks.
  void layout_gdn_acts(Arena& a, MemoryCategory c, LayerActs& A);
  void layout_gdn_workspace(Arena& a);
  void gdn_gated_norm(const LayerActs& A, const LayerParams& P);
  void gdn_forward(int local, Slot& s, const LayerActs& A, Tensor x);
  void gdn_backward(int local, Slot& s, const LayerActs& A, Tensor x, Tensor dx);
  void mlp_forward(int local, Slot& s, const LayerActs& A, const NextNorm& next);
  void mlp_backward(int local, Slot& s, const LayerActs& A, Tensor dy);  // -> the workspace's gH
  // The MoE block (engine/blocks/moe.cpp), in place of the MLP block in MoE layers.
  void moe_forward(int local, Slot& s, const LayerActs& A, const NextNorm& next);
  void moe_backward(int local, Slot& s, const LayerActs& A, Tensor dy);  // -> the workspace's gH
  MoeRouting moe_routing() const;
  MoeRouting gate_routing() const;
  Tensor layer_expert_bias(int local) const;
  // seq_aux_loss: the router logits in sequence order (ws_->moe_seq_logits), the permutations
  // uploaded at the first call.
  Tensor moe_sequence_logits(const Tensor& logits);
  bool moe_seq_index_ready_ = false;
  int64_t moe_group_tokens() const;  // the rows the dispatch group gathers (N x EP, or Nl x ETP x EP)
  Communicator* moe_dispatch_group() const;
  int64_t moe_dispatch_rows() const;  // the rows this rank dispatches (N, or its own Nl)
  int64_t moe_max_rows() const;      // the most (token, slot) pairs this rank's experts receive
  // The grouped GEMMs' expert offsets of a layer's MoeActs and the rows the MoE block's ops run
  // on: on the device (the host never waits for the routing) without expert parallelism, R =
  // moe_max_rows() (with token dropping a bound); else the host copy the forward made (R exact).
  ExpertOffsets moe_offsets(const MoeActs& M, int64_t& rows) const;
  bool moe_offsets_on_device() const;
  // FP8 experts (the routed experts of an FP8 MoE layer, engine/blocks/moe.cpp): each expert's rows
  // start at a multiple of kFp8ExpertRows in the permuted layout, the rows between one expert's
  // last and the next one's first zeros (Transformer Engine's Fp8Padding pads to 16, what the FP8
  // GEMMs need). 128 rather than 16: each expert's GEMMs are cuBLASLt calls whose plans are cached
  // per shape, and the row counts in multiples of 128 bound those shapes (R / 128 per GEMM), where
  // multiples of 16 made a new plan, with its heuristic, at almost every call (measured: FP8 experts
  // 0.67x bf16 on moe-fine-grained, bench/RESULTS.md). The zero rows cost at most 127 rows an expert.
  static constexpr int64_t kFp8ExpertRows = 128;
  bool fp8_experts(int local) const { return fp8_ex_.layer_fp8(local); }
  bool fp8_expert_gemms(int local) const { return fp8_experts(local) && !fp8_ex_.calibrating(); }
  int64_t moe_row_align() const { return fp8_ex_.any() ? kFp8ExpertRows : 1; }
  // The padded offsets of the non-all-to-all dispatch: from the permutation's (host copy in
  // M.host_offsets, each rounded up), with order and slot_of moved to the padded rows.
  void moe_pad_permutation(const MoeActs& M);
  // All-to-all dispatch: zeros into the padding rows of `perm` (rows received from the experts'
  // sources fill each expert's first rows only).
  void moe_zero_padding(const MoeActs& M, Tensor perm);
  // The experts' GEMMs (which: 0 = fc1, 1 = fc2): the grouped compute-dtype ops, or per expert the
  // FP8 casts and GEMMs with the expert's own scaling state. x / dy as the grouped ops take them.
  void expert_linear_fwd(int local, int which, Tensor y, Tensor x, Tensor w, const ExpertOffsets& offsets);
  void expert_quantize_dy(int local, int which, Tensor dy, const ExpertOffsets& offsets);  // before the two below
  void expert_linear_bwd_input(int local, int which, Tensor dx, Tensor dy, Tensor w, const ExpertOffsets& offsets);
  void expert_linear_bwd_weight(int local, int which, Tensor dw, Tensor dy, Tensor x, const ExpertOffsets& offsets);

  // FP8 GEMMs beyond a dense layer's four (engine/blocks/fp8_gemms.cpp): the routed experts' (a
  // group of rows per local expert, in fp8_ex_) and multi-latent attention's and the MTP
  // projection's (one group of all rows, in fp8_extra_). Group e's GEMM is first + stride * e of
  // `state`, with its own scaling state; w holds the groups' weights one below the other; off: the
  // groups' row offsets (each group a multiple of 16 rows: the FP8 GEMMs' granularity). They run
  // the compute-dtype ops while the state calibrates (delayed scaling's first step; the casts record
  // the amaxes) and in layers the state does not cover.
  struct Fp8Gemm {
    Fp8State* state = nullptr;
    int first = 0, stride = 1;
  };
  Fp8Gemm expert_gemm(int which) { return {&fp8_ex_, which, 2}; }
  // Multi-latent attention's GEMMs (kMla*), the MTP projection's and an MoE layer's shared expert's
  // (fc1, fc2), in fp8_extra_.
  enum ExtraGemm { kMlaQDown = 0, kMlaQ = 1, kMlaKvDown = 2, kMlaKvUp = 3, kMlaProj = 4 };
  int extra_eh_gemm() const { return d_.mla ? 5 : 0; }
  int extra_shared_gemm(int which) const { return (d_.mla ? 5 : 0) + (d_.mtp > 0 ? 1 : 0) + which; }
  int extra_gemms() const { return extra_shared_gemm(0) + (d_.shared_ffn > 0 ? 2 : 0); }
  Fp8Gemm extra_gemm(int g) { return {&fp8_extra_, g, 1}; }
  void fp8g_forward(const Fp8Gemm& f, int local, Tensor y, Tensor x, Tensor w, std::span<const int64_t> off);
  void fp8g_quantize_dy(const Fp8Gemm& f, int local, Tensor dy, std::span<const int64_t> off);
  void fp8g_backward_input(const Fp8Gemm& f, int local, Tensor dx, Tensor dy, Tensor w, std::span<const int64_t> off,
                           bool accumulate);
  void fp8g_backward_weight(const Fp8Gemm& f, int local, Tensor dw, Tensor dbias, Tensor dy, Tensor x,
                            std::span<const int64_t> off);
  Fp8TensorMeta fp8g_meta(const Fp8Gemm& f, int local, int group, Fp8State::Role r) const;
  void fp8g_cast_weights(const Fp8Gemm& f, int local, Tensor w, int groups, bool transposed);
  Tensor fp8g_weight(Tensor w, int groups, int e) const;
  std::span<const Fp8TensorMeta> fp8g_metas(const Fp8Gemm& f, int local, int groups, Fp8State::Role r);
  Tensor fp8g_compute_weight(const Fp8Gemm& f, int local, Tensor w, int groups, int e);
  // One linear layer of an MLA or MTP block through fp8_extra_ GEMM g (the compute-dtype ops
  // outside FP8 layers): forward, and backward (the weight gradient, with dbias where given, then
  // the input gradient, added to dx with accumulate).
  void extra_linear_fwd(int local, int g, Tensor y, Tensor x, Tensor w);
  void extra_linear_bwd(int local, int g, Tensor dw, Tensor dbias, Tensor dx, Tensor dy, Tensor x, Tensor w,
                        bool accumulate_dx);
  // ... its two halves, for a layer that needs another op between them: the input gradient (dy cast
  // first), then the weight gradient (from that cast).
  void extra_linear_bwd_input(int local, int g, Tensor dx, Tensor dy, Tensor w, bool accumulate_dx);
  void extra_linear_bwd_weight(int local, int g, Tensor dw, Tensor dy, Tensor x);
  bool fp8_extra_layer(int local) const { return fp8_extra_.layer_fp8(local); }
  void layout_fp8_gemm_workspace(Arena& a);
  // All-to-all dispatch (ModelDims::moe_alltoall under expert parallelism, each member of the
  // dispatch group holding experts of its own): the plan of a layer's exchange (this rank's pairs
  // sorted by expert, the group's chunk sizes, this rank's expert offsets; returns R), and one
  // exchange of rows between the sorted pairs [P, c] and this rank's expert-major rows [R, c].
  bool moe_alltoall() const;
  int64_t moe_exchange_plan(const MoeActs& M, Tensor idx, Communicator& g);
  void moe_exchange(Communicator& g, const MoeActs& M, Tensor sorted, Tensor perm, bool to_experts);
  // The gating GEMM's operands. Its input: x itself, or (a float32 router, input jitter) x's rows
  // cast and jittered into `buffer` (moe_x32 or moe_xj, or their local rows), the jitter's flat
  // indices from index0. Its weight: the router's, or its float32 copy (cast here).
  Tensor router_input(Tensor x, Tensor buffer, uint64_t jitter_key, int64_t index0);
  Tensor router_weight(const LayerParams& P);
  Tensor router_bias(const LayerParams& P);  // (empty without linear biases)
  void expert_bias_fwd(const LayerParams& P, int which, Tensor y, Tensor p_perm, const ExpertOffsets& offsets);
  void expert_bias_bwd(const LayerParams& P, const LayerParams& G, int which, Tensor dp, Tensor dy, Tensor p_perm,
                       const ExpertOffsets& offsets);
  struct MoeLossFactors {
    int64_t sequences = 1, rows = 0;  // the micro-batch's sequences, this rank's rows of each
    double aux = 0, seq = 0, global = 0, z = 0;
  };
  MoeLossFactors moe_loss_factors() const;
  int64_t moe_stats_blocks() const;
  // The load-balancing statistics of a micro-batch, and in a training forward their logged values.
  void moe_balance_forward(int local, const Slot& s, const MoeActs& M);
  // global_aux_loss: each MoE layer's counts summed over this step's micro-batches [layers x E], and
  // the micro-batches counted.
  Tensor moe_global_sum_;
  std::vector<int> moe_global_steps_;
  // In backward, rerunning a recomputed group's forward (which logs and counts nothing again).
  bool recomputing_ = false;
  DType router_dtype() const;
  Tensor shared_gate_forward(const LayerParams& P, const LayerActs& A);
  void attention_backward(int local, Slot& s, const LayerActs& A, Tensor x, Tensor dx);  // from gH
  void head_forward(Slot& s, Tensor x, bool norm_done);
  // The language-model loss of one chunk of logits (rows from r0 of the micro-batch): this shard's
  // log-sum-exp and target logit, the log-sum-exp made global over TP; returns the rows' global
  // log-sum-exps. After the last chunk, lm_loss_sum adds the rows' losses under `mask` to `sums`.
  Tensor lm_loss_forward_chunk(Tensor logits, Tensor labels, int64_t r0);
  void lm_loss_sum(Tensor sums, Tensor mask);
  // Per-row log-sum-exps of this rank's vocabulary shard (`part`) combined over TP into `out` (may
  // be `part`), gathered through the workspace's lse_parts.
  void combine_lse_over_tp(Tensor out, Tensor part);
  // The output layer and the loss over y (all N rows; the head's chunks of rows) against `labels`,
  // the masked loss sum and weight sum added to sums[0..1]; in training also its backward: dlogits
  // from dloss, the output layer's weight gradient, and y's gradient (all rows, TP-partial) in gT.
  // accept (multi-token prediction): the rows whose argmax is their label among those with
  // accept_mask != 0, and those rows, added to accept[0..1].
  void output_layer_loss(Slot& s, Tensor y, Tensor labels, Tensor mask, Tensor dloss, Tensor sums,
                         Tensor accept = Tensor(), Tensor accept_mask = Tensor());
  // Multi-token prediction (engine/blocks/mtp.cpp), in a training head_forward: every depth's
  // forward, loss and backward; dy0 (the gradient of the decoder's output after the final norm,
  // this rank's rows) gets the depths' part.
  void mtp_forward_backward(Slot& s, Tensor dy0);
  void layout_mtp(Arena& a);
  bool mtp_layer(int local) const { return d_.is_mtp(d_.layer_begin + local); }
  Tensor mtp_loss_ = Tensor();  // per depth {sum of the micro-batches' mean losses, their count}
  Tensor mtp_accept_ = Tensor();  // per depth {rows predicted right, rows counted}
  std::vector<MtpParams> mtp_params_, mtp_grads_;
  Tensor layer_input(const Slot& s, int local) const;
  LayerActs acts(const Slot& s, int local) const;
  // Linear layers of decoder layers: FP8 GEMMs in FP8 layers, the compute-dtype ones elsewhere.
  bool fp8_layer(int local) const { return fp8_.layer_fp8(local); }
  // An FP8 layer whose GEMMs run in FP8 now: not while delayed scaling calibrates (its first
  // step: the compute-dtype GEMMs, amaxes recorded; engine/fp8_state.h).
  bool fp8_gemms(int local) const { return fp8_layer(local) && !fp8_.calibrating(); }
  void fp8_refresh_weights(int local);
  // The weight w of GEMM g of FP8 layer `local` for a compute-dtype GEMM (calibrating): w itself,
  // or, for an FP8 parameter, its values dequantized into a workspace (valid until the next call).
  Tensor compute_weight(int local, Fp8State::Gemm g, Tensor w);
  Fp8TensorMeta fp8_meta(int local, Fp8State::Gemm g, Fp8State::Role r) const;
  // FP8 layers whose weight-gradient GEMMs take the linear inputs quantized and transposed by the
  // forward's cast and kept with the layer's activations (LayerActs::fp8_xq_t): FP8 GEMMs with
  // FP8 weight gradients. Then the backward neither quantizes the inputs again nor recomputes
  // them (the GeLU output, the gathered norm outputs) for those GEMMs.
  bool fp8_keeps_inputs() const { return opt_.seams.fp8_keep_inputs && opt_.fp8.wgrad && fp8_.any(); }
  bool fp8_kept_inputs(int local) const { return fp8_gemms(local) && fp8_keeps_inputs(); }
  // A layer whose weight gradients are FP8 GEMMs now (not --no-fp8-wgrad). Their output
  // gradients' casts also take the bias gradients (linear_quantize_dy).
  bool fp8_wgrad(int local) const { return fp8_gemms(local) && opt_.fp8.wgrad; }
  // A: the layer's activations (where the kept transposed input goes).
  // norm: the FP8 GEMM's input is that norm's output (fp8_norm_cast), x is then not read.
  void linear_fwd(int local, Fp8State::Gemm g, const LayerActs& A, Tensor y, Tensor x, Tensor w, Tensor bias,
                  Activation act, Tensor pre_act, const NormInput* norm = nullptr);
  // The FP8 cast of GEMM g's input x (act(x) when act is given; the norm's output when norm is),
  // and its kept transposed copy.
  Tensor fp8_quantize_input(int local, Fp8State::Gemm g, const LayerActs& A, Tensor x, const MlpActivation* act,
                            const NormInput* norm = nullptr);
  // fc2's forward in a layer with FP8 GEMMs (fp8_gemms(local)): its input act(fc1_pre) is cast to
  // FP8 straight from fc1's output and never written in the compute dtype.
  void fc2_fwd_from_fc1(int local, const LayerActs& A, Tensor y, Tensor fc1_pre, MlpActivation act);
  // FP8 layers: quantizes dy (and its transpose for the weight gradient) for the two backward GEMMs
  // of gemm g that follow; no-op elsewhere. With FP8 weight gradients (fp8_wgrad) the cast also
  // adds dy's column sums to dbias (the bias gradient, if the layer has one), and
  // linear_bwd_weight does not.
  // amax_taken: dy's amax is already in the cast's slot (dy_amax_from_norm / dy_amax_from_dropout).
  void linear_quantize_dy(int local, Fp8State::Gemm g, Tensor dy, Tensor dbias, bool amax_taken = false);
  // fc1's output gradient (the activation's input gradient from dout, its output gradient, and
  // pre, its input) quantized for fc1's backward GEMMs (with fc1's bias gradient) without writing
  // it: layers where fp8_wgrad(local).
  void linear_quantize_dy_activation(int local, Tensor dout, Tensor pre, MlpActivation act, Tensor dbias);
  void linear_bwd_input(int local, Fp8State::Gemm g, Tensor dx, Tensor dy, Tensor w, Activation act, Tensor pre_act);
  // x: the input in the compute dtype (used unless fp8_kept_inputs(local): then A's kept copy).
  void linear_bwd_weight(int local, Fp8State::Gemm g, const LayerActs& A, Tensor dw, Tensor dbias, Tensor dy, Tensor x);
  // Whether a weight-gradient GEMM into dw adds to it (false: the step's first write of a gradient
  // left unzeroed by zero_grads; marks it written).
  bool accumulate_weight_grad(const Tensor& dw);
  // Whether the norm backward producing fc2's / proj's output gradient also takes its bias gradient.
  bool fc2_bias_grad_from_norm(int local) const;
  // The layer before `local`'s fc2 bias gradient where the input norm's backward of `local` takes
  // it (its dx is that layer's output gradient), else empty; never for an mtp layer, whose input
  // is its depth's projection.
  Tensor prev_fc2_bias_grad(int local) const;
  bool proj_bias_grad_from_norm(int local) const;
  // Before an op that only adds into g: zeroes g if it is left to its first write and not written.
  void zero_grad_if_unwritten(const Tensor& g);
  void plan_grad_zeroing();

  ModelDims d_;
  ModelOptions opt_;
  ParallelState& ps_;
  Backend& be_;
  // Sequence parallelism: the TP communicator on the backend's TP stream (CUDA), or ps_.tp itself
  // where the backend has none (the reference backend: synchronous, same order of operations).
  std::unique_ptr<Communicator> tp_overlap_own_;
  Communicator* tp_overlap_ = nullptr;
  std::unique_ptr<Arena> arena_;
  std::unique_ptr<AttentionCore> attention_core_;  // the layers' attention core (engine/blocks/attention_core.h)
  std::vector<std::unique_ptr<AttentionCore>> cp_cores_;  // context parallelism: by CpCommType
  AttentionCore& attention_core(int layer) const;  // global layer
  AttentionSinks attention_sinks(int local) const;  // the layer's sinks (--softmax-type)
  void layout_cp_buffers(Arena& a);
  std::vector<ParamDesc> descs_;
  int64_t total_elements_ = 0;
  int64_t logits_rows_ = 0;  // rows per output-layer chunk
  GradLayout grad_layout_;
  // params() index of the first parameter of each local layer, and of the head (final norm,
  // output layer; params().size() on other stages).
  std::vector<int> layer_first_param_;
  int head_first_param_ = 0;
  std::vector<std::pair<int, FlatRange>> tp_partial_;  // (global layer or -1, range)
  // Gradients left to their step's first write (the linear layers' and embeddings' weights): a GEMM
  // with beta 0, or zero_grad_if_unwritten before an op that adds; and the ranges of the gradient
  // buffer zero_grads() zeroes (all the rest, padding included).
  struct FirstWriteGrad {
    int param = 0;
    const void* data = nullptr;
    bool written = true;  // until the first zero_grads(): every GEMM adds, as before
  };
  std::vector<FirstWriteGrad> first_write_grads_;
  FirstWriteGrad* first_write_entry(const Tensor& g);  // null: g is zeroed by zero_grads()
  std::vector<FlatRange> zeroed_grad_ranges_;
  // ModelOptions::acts_over_grads: each local layer's kept activations' bytes (the measuring pass)
  // and where they lie in grads_ (bytes, -1: the activations' block); the zeroed ranges zero_grads()
  // leaves to the backward, by owner (decoder layers 0..L-1, then kAfterLayers at L), and the rest.
  std::vector<size_t> act_bytes_;
  std::vector<int64_t> act_in_grads_;
  bool any_act_in_grads_ = false;
  std::vector<std::vector<FlatRange>> backward_zeroed_ranges_;
  std::vector<FlatRange> step_zeroed_ranges_;
  bool update_in_flight_ = false, grad_zeroing_deferred_ = false;  // (update_in_flight)
  void zero_grad_buffer();  // the device part of zero_grads
  // Sharded gradients (ModelOptions::shard_grads): per bucket its staging buffer (the layers' are
  // views of the two unit slots), the slots, the local layer each slot holds this micro-batch (-1:
  // none yet), and the main gradients' shards. prepare_grad_unit(l) zeroes layer l's slot before
  // the micro-batch's first write to it.
  std::vector<Tensor> grad_bucket_storage_;
  std::vector<int> param_bucket_;  // params() index -> its bucket
  static constexpr int kMaxUnitSlots = 3;
  Tensor grad_slots_[kMaxUnitSlots];
  int slot_unit_[kMaxUnitSlots] = {-1, -1, -1};
  Tensor grad_shards_;
  void prepare_grad_unit(int local);
  Tensor grad_range(int64_t offset, int64_t count) const;  // a range of the flat layout inside one bucket
  // Sharded parameters: per bucket its storage (the layers' are views of the slots), the
  // slots, the local layer each slot holds (-1: none, or stale), the shards; per local layer its
  // buckets. gather_unit(l) makes layer l's slot hold its current parameters.
  std::vector<Tensor> param_bucket_storage_;
  Tensor param_slots_[kMaxUnitSlots], fp8_param_slots_[kMaxUnitSlots];
  int param_slot_unit_[kMaxUnitSlots] = {-1, -1, -1};
  // Per slot: a gather issued on the communication stream and not yet waited for; FP8 transposes
  // still to make from the gathered weights (made once the gather has landed).
  bool gather_pending_[kMaxUnitSlots] = {}, refresh_pending_[kMaxUnitSlots] = {};
  UnitGather unit_gather_;
  Tensor param_shards_, fp8_param_shards_;  // (compute dtype, FP8)
  std::vector<Tensor> param_shard_storage_;  // per bucket: its shard, a view of one of the two
  std::vector<std::vector<int>> unit_buckets_;  // (two under expert parallelism: the experts' and the rest)
  // Layer `local`'s parameters in its slot, gathered now unless the slot holds them; then, with
  // prefetch_units, layer `prefetch`'s gather issued (-1 or outside the layers: none).
  void gather_unit(int local, int prefetch = -1);
  void issue_unit_gather(int local);
  void wait_unit_gather(int local);
  NormParams norm_;
  // --qk-l2-norm: RMS normalization of q and k without weights, as an RMSNorm whose weights are
  // qk_l2_ones_ (bound as every layer's q/k norm weights; no parameter, no gradient).
  NormParams qk_l2_norm_;
  Tensor qk_l2_ones_;
  const NormParams& qk_norm_params() const { return d_.qk_l2 ? qk_l2_norm_ : norm_; }
  GateShape gate_shape() const { return {d_.groups_local(), d_.heads / d_.groups, d_.head_dim}; }

  Tensor muon_workspace_;
  Tensor ties_;  // ModelOptions::master_tie_bits: int32 words, a bit per master element
  // The parameters rounded from full-precision values: a cast, or the ties-away rounding of
  // Transformer Engine's remainders (master_remainders without master_tie_bits).
  void round_params(Tensor params, Tensor values);
  Tensor expert_sumsq_;
  Tensor params_, grads_, master_, state1_, state2_, scalars_, train_loss_, eval_loss_, rope_table_, moe_loss_,
      moe_layer_loss_;
  // Knowledge distillation (engine/blocks/distill.cpp): the teacher, the loss sums, and per micro-
  // batch the intermediate loss's gradient scale (ModelOpt's dynamic scale: the logits loss over the
  // intermediate loss, both masked sums), which the head's backward applies.
  GptModel* teacher_ = nullptr;
  Tensor kd_train_loss_, kd_eval_loss_;
  double kd_intermediate_scale_ = 1.0;
  std::vector<double> kd_host_;      // the micro-batch's distillation sums read back (Workspace::kd_sums)
  std::vector<float> kd_host_f32_;
  void distill_head(Slot& s, Tensor y);
  // Adds the intermediate losses' gradients of the student's hidden state `layer` (a decoder
  // layer's output, or -1: the final norm's) to `grad` (this rank's rows).
  void distill_intermediate_backward(Slot& s, int layer, Tensor grad);
  Tensor hidden_state_of(const Slot& s, int layer) const;
  // Expert bias (has_expert_bias()): per MoE layer of this chunk in layer order, [E] each.
  // The step's token counts on the device (the backward adds each micro-batch's), their host copy.
  Tensor moe_bias_, moe_counts_dev_;
  std::vector<float> moe_bias_host_;
  std::vector<double> moe_counts_;
  int moe_index(int local) const;  // a local layer's place among this chunk's MoE layers
  // Host copies of the MoE layers' expert offsets, one per LayerActs with MoE (MoeActs::host_offsets).
  std::vector<std::unique_ptr<std::vector<int64_t>>> moe_host_offsets_;
  std::vector<int32_t> moe_off32_;  // the device offsets' host copy
  std::vector<std::unique_ptr<MoeExchange>> moe_exchanges_;  // one per LayerActs with MoE (all-to-all)
  std::vector<int32_t> moe_offs_g_;                          // the group's offsets' host copy
  std::vector<LayerParams> layer_params_, layer_grads_;
  struct Globals;
  std::unique_ptr<Globals> globals_;  // embedding / final norm / output params and grads
  std::vector<Slot> slots_;
  std::vector<LayerActs> scratch_;    // recompute scratch: one set per layer of the largest group

  // Activation offloading (engine/activation_offload.h; ModelOptions::offload): where the
  // offloaded tensors live (found by the measuring pass from the layers' candidates), the device
  // entries every slot shares and per entry the (slot, layer) whose forward wrote it last, the host
  // block (slot k's at k x OffloadPlan::host_bytes_per_slot), and per module the copies to host
  // not yet waited for, oldest first (--fine-grained-offloading-max-inflight-offloads).
  OffloadPlan offload_;
  std::vector<Tensor> offload_ring_;
  std::vector<std::pair<int, int>> offload_writer_;
  void* offload_host_ = nullptr;
  int offload_stay_ = -1;  // backward_follows: this forward's slot
  std::array<std::vector<std::pair<int, int>>, kOffloadModules> offload_inflight_;  // (slot, layer)
  // Layout: the local layer being laid out (-1: none, or the recompute scratch), and where
  // take_act records candidates (the measuring pass's probe) or finds the slot's entries.
  int layout_layer_ = -1;
  std::vector<OffloadCandidate>* offload_probe_ = nullptr;
  const std::vector<Tensor>* offload_entries_ = nullptr;
  // A kept tensor of the layer being laid out that offloading may take (for `ahead` = 1: the next
  // layer's, its input): a view of the slot's entry where the plan places it, else a.take(...).
  Tensor take_act(Arena& a, MemoryCategory c, OffloadField f, DType t, std::initializer_list<int64_t> dims, int ahead = 0);
  void plan_offload(const std::vector<OffloadCandidate>& candidates);
  int offload_mark(int slot, int local, int module) const;
  char* offload_device(int local) const;          // layer `local`'s entry
  char* offload_host(int slot, int local) const;  // slot's host copy of layer `local`'s tensors
  void offload_wait_out(Slot& s, int slot, int local);   // the copies of layer `local` to host
  void offload_copy_back(Slot& s, int slot, int local);  // issued once per backward
  void offload_before_forward(int slot, int local);
  void offload_after_forward(Slot& s, int slot, int local);
  void offload_before_backward(Slot& s, int slot, int local);
  std::unique_ptr<Workspace> ws_;
  Tensor last_input_grad_;

  // FP8: scaling state, the weight cache (per local layer and GEMM: wq [N, K] and wq_t [K, N]),
  // and workspaces for the quantized input (xq; xq_t only without ModelOptions::TestSeams::fp8_keep_inputs) and
  // output gradient (dyq / dyq_t) of the GEMM at hand (one GEMM's forward or backward pair at a
  // time). The transposed inputs the weight gradients use are kept per layer (LayerActs).
  Fp8State fp8_;
  // FP8 experts: their scaling state and the workspaces of one grouped op at a time: the inputs
  // (row-major, and each expert's rows transposed as its own [K, rows] block, for the weight
  // gradient), the output gradients likewise, and the experts' weights (row-major, or transposed).
  Fp8State fp8_ex_;
  // Multi-latent attention's and the MTP projection's FP8 GEMMs (Fp8Gemm): their scaling state.
  Fp8State fp8_extra_;
  Tensor fp8_ex_q_, fp8_ex_q_t_, fp8_ex_dq_, fp8_ex_dq_t_, fp8_ex_w_, fp8_ex_acc_, fp8_ex_wc_;
  std::vector<int32_t> moe_order_host_, moe_slot_host_;  // moe_pad_permutation's host copies
  std::vector<Fp8TensorMeta> fp8g_metas_;  // the grouped casts' metas and weight row offsets
  std::vector<int64_t> fp8g_w_off_;
  struct Fp8Weights {
    Tensor q[Fp8State::kGemms], q_t[Fp8State::kGemms];
  };
  std::vector<Fp8Weights> fp8_w_;
  std::vector<char> fp8_fresh_;  // per local layer: the weight cache holds this step's weights
                                 // (1: cast in training, amax recorded; 2: cast by an evaluation)
  std::vector<char> fp8_weight_amax_taken_;  // per local layer: the update took the weights' amaxes
  bool weights_amax_from_update() const;     // see weight_cast_amax_slot
  bool fp8_training_ = true;     // the forward at hand is a training one (records amaxes)
  bool fp8_keep_inputs_now_ = true;  // false in the first forward of a recomputed layer (see linear_fwd)
  Tensor fp8_xq_, fp8_xq_t_, fp8_dyq_, fp8_dyq_t_;
  // FP8 parameters: the FP8 region of the flat buffers and the workspace compute_weight
  // dequantizes into (delayed scaling only). Per parameter: the (local layer, GEMM) of an FP8
  // layer's linear weight, (-1, -1) elsewhere.
  Tensor fp8_params_, fp8_w_compute_;
  std::vector<std::pair<int, int>> fp8_weight_gemm_;
  // Per parameter (FP8 parameters only, else state null): the state and GEMMs casting it, by
  // groups of group_numel elements (GptModel::Fp8Gemm's numbering).
  struct Fp8ParamSlot {
    const Fp8State* state = nullptr;
    int local = -1, first = 0, stride = 1;
    int64_t group_numel = 0;
  };
  std::vector<Fp8ParamSlot> fp8_param_slot_;
  Fp8ParamSlot fp8_param_slot(const ParamDesc& p) const;
  void plan_fp8_states();
  // The three scaling states: the dense layers', the routed experts' and the extra GEMMs'.
  std::array<Fp8State*, 3> fp8_states() { return {&fp8_, &fp8_ex_, &fp8_extra_}; }
};

}  // namespace mt
