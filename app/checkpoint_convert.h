// Megatron-LM's offline checkpoint conversion: `--load CKPT --ckpt-convert-format torch|torch_dist
// --ckpt-convert-save DIR` with a run's flags loads the checkpoint, saves it in that format to
// DIR/FORMAT and exits without training (megatron/training/training.py, setup_model_and_optimizer).
// megatrain writes the checkpoint --load names (megatrain's own, or a Megatron-LM one of any format
// import-megatron reads) as the Megatron-LM checkpoint export-megatron writes (app/export_megatron.h),
// in the run's layout: its TP, PP (virtual stages, first/last stage layers), DP, EP, distributed
// optimizer and buckets; weights only with --no-save-optim. The model the flags describe must be the
// checkpoint's, as Megatron-LM's load requires. World rank 0 writes; the other ranks exit.
#pragma once

#include "core/config.h"

namespace mt {

// Returns the process's exit code.
int convert_checkpoint(const Config& cfg);

}  // namespace mt
