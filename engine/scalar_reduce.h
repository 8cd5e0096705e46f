// One host number reduced over every rank through a slot of a model's scalar buffer (device
// memory, as NCCL needs): the agreements and logging figures that are a single value (whether a
// save succeeded everywhere, whether any rank has validation data, the interval's GPU energy).
#pragma once

#include "engine/gpt_model.h"
#include "parallel/communicator.h"

namespace mt {

struct ParallelState;

// Slots of GptModel::scalars() used this way, past the optimizer's (engine/optimizer.cpp); then the
// trainer's three exit flags (Trainer::should_exit).
enum ScalarSlot {
  kFirstScalarSlot = 35,
  kSaveAgreementSlot = kFirstScalarSlot,
  kHasValidationSlot,
  kEnergySlot,
  kRerunSlot,
  kExitFlagsSlot
};
static_assert(kExitFlagsSlot + 3 <= GptModel::kScalarCount);

// `value` reduced by `op` over ps.world (the value itself with one rank). In the model's
// accumulation dtype: float32 holds about 7 significant digits.
double all_reduce_scalar(ParallelState& ps, GptModel& model, ScalarSlot slot, double value, ReduceOp op);

}  // namespace mt
