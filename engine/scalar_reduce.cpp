#include "engine/scalar_reduce.h"

#include "parallel/parallel_state.h"

namespace mt {

double all_reduce_scalar(ParallelState& ps, GptModel& model, ScalarSlot slot, double value, ReduceOp op) {
  if (ps.world_size == 1) return value;
  Backend& be = model.backend();
  const Tensor s = model.scalars().flat_slice(slot, 1);
  if (model.options().accum == DType::f64) {
    be.copy_from_host(s, &value);
    ps.world->all_reduce(s, op);
    be.copy_to_host(&value, s);
    return value;
  }
  float v = static_cast<float>(value);
  be.copy_from_host(s, &v);
  ps.world->all_reduce(s, op);
  be.copy_to_host(&v, s);
  return v;
}

}  // namespace mt
