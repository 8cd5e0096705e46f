// megatrain export-megatron --load CKPT --save MEGATRON_DIR [--ckpt-step N] [--ckpt-format torch_dist|torch]
//     [--tensor-model-parallel-size T] [--pipeline-model-parallel-size P]
//     [--num-virtual-stages-per-pipeline-rank V] [--decoder-first-pipeline-num-layers N]
//     [--decoder-last-pipeline-num-layers N] [--data-parallel-size D]
//     [--use-distributed-optimizer | --no-use-distributed-optimizer] [--overlap-grad-reduce]
//     [--ddp-bucket-size N] [--expert-model-parallel-size E]
//     [--make-vocab-size-divisible-by N] [--weights-only]
//   A megatrain checkpoint (any layout) as a Megatron-LM checkpoint that pretrain_gpt.py
//   --transformer-impl local --load MEGATRON_DIR continues from. --ckpt-format torch: the per-rank
//   iter_N/mp_rank_TT[_PPP]/model_optim_rng.pt (and distrib_optim.pt with the distributed
//   optimizer) in the tensor x pipeline layout asked for (the checkpoint's own by default), with
//   the model weights, Adam's moments and step, the float32 main weights, the learning-rate
//   scheduler, the iteration, consumed samples and FLOP count, the loss scaler of --fp16 runs, the
//   args namespace Megatron reads, and the RNG states Megatron seeds at start-up from --seed. The
//   weights only (a release checkpoint, as Megatron's converters write) where the optimizer state
//   cannot go over (SGD, saved with --no-save-optim, a release checkpoint; in the torch format also
//   MoE and MTP models) or with --weights-only. Mixture-of-experts layers are the local spec's
//   SequentialMLP: each expert-parallel rank's files (mp_rank_TT[_PPP]_EEE) hold its local experts.
//   --ckpt-format torch_dist (the default, as Megatron-LM's): the same state in one PyTorch
//   Distributed Checkpoint (iter_N/__0_0.distcp, .metadata, metadata.json; checkpoint/dcp_writer.h)
//   under Megatron-Core's global keys, which a Megatron-LM run of any TP x PP x DP layout loads; the
//   optimizer state by parameter, with --use-distributed-optimizer in its fully reshardable layout.
// Names and tensor-parallel splits: checkpoint/megatron_names.h (shared with import-megatron);
// the distributed optimizer's buffers: checkpoint/megatron_flat_layout.h.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace mt {

struct MegatronExportOptions {
  std::string load;
  std::optional<int64_t> ckpt_step;
  std::string save;
  std::string format = "torch_dist";  // Megatron-LM's default; or "torch"
  // The Megatron-LM run's layout; unset: the checkpoint's own.
  std::optional<int> tp, pp, vpp, first_stage_layers, last_stage_layers, dp;
  std::optional<int> ep;  // mixture of experts: --expert-model-parallel-size
  std::optional<bool> distributed_optimizer;
  // The distributed optimizer's buckets (they decide where distrib_optim.pt holds each parameter):
  // Megatron's --overlap-grad-reduce and --ddp-bucket-size, added to the checkpoint's own.
  bool overlap_grad_reduce = false;
  std::optional<int64_t> ddp_bucket_size;
  std::optional<int> make_vocab_size_divisible_by;
  bool weights_only = false;
};

struct MegatronExportResult {
  int64_t iteration = 0;
  bool release = false;           // weights only
  std::string weights_only_reason;  // why, when not asked for
  int tp = 1, pp = 1, vpp = 1, dp = 1, ep = 1;
  bool distributed_optimizer = false;
  std::string directory;            // the iteration directory written
  std::vector<std::string> files;   // relative to it
  // The Megatron flags of the model and layout to load it with (pretrain_gpt.py's).
  std::vector<std::string> megatron_flags;
};

MegatronExportResult export_megatron(const MegatronExportOptions& o);
int export_megatron_main(const std::vector<std::string>& args);

}  // namespace mt
