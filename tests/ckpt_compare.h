// Comparing megatrain checkpoints tensor by tensor (the checkpoint conversion and export tests).
#pragma once

#include <catch2/catch.hpp>

#include <string>

#include "checkpoint/checkpoint_io.h"
#include "checkpoint/hf_names.h"

namespace mt_test {

// A whole tensor of a megatrain checkpoint, in its stored dtype.
inline mt::HostArray read_whole(mt::CheckpointReader& r, const std::string& name, mt::CheckpointKind kind) {
  const mt::CheckpointTensorInfo& info = r.info(name, kind);
  mt::HostArray a = mt::HostArray::zeros(info.dtype, info.global_shape);
  r.read(name, kind, mt::ShardSlice::whole(mt::ShardIndex::whole(info.global_rows, info.global_cols)),
         mt::Tensor(a.bytes.data(), info.dtype, mt::Device::cpu, {a.numel()}));
  return a;
}

inline bool same(const mt::HostArray& a, const mt::HostArray& b) {
  return a.dtype == b.dtype && a.shape == b.shape && a.bytes == b.bytes;
}

// Every model tensor, Adam moment and main weight, the counters and the scheduler of two
// megatrain checkpoints must be the same.
inline void require_same_state(const std::string& a_dir, const std::string& b_dir, bool optimizer, int at_least = 31) {
  mt::CheckpointReader a(a_dir), b(b_dir);
  if (optimizer) CHECK(a.iteration() == b.iteration());
  int compared = 0;
  for (const auto kind : {mt::CheckpointKind::model, mt::CheckpointKind::optimizer, mt::CheckpointKind::main_params}) {
    if (!optimizer && kind != mt::CheckpointKind::model) continue;
    CHECK(a.names(kind) == b.names(kind));
    for (const std::string& name : a.names(kind)) {
      INFO(name << " (" << mt::checkpoint_kind_name(kind) << ")");
      REQUIRE(b.has(name, kind));
      CHECK(same(read_whole(a, name, kind), read_whole(b, name, kind)));
      ++compared;
    }
  }
  CHECK(compared >= at_least);
  if (!optimizer) return;
  const mt::RunState &ra = a.run_state(), &rb = b.run_state();
  CHECK(ra.consumed_train_samples == rb.consumed_train_samples);
  CHECK(ra.consumed_valid_samples == rb.consumed_valid_samples);
  CHECK(ra.skipped_train_samples == rb.skipped_train_samples);
  CHECK(ra.num_floating_point_operations_so_far == rb.num_floating_point_operations_so_far);
  CHECK(ra.extra.at("optimizer").at("successful_steps") == rb.extra.at("optimizer").at("successful_steps"));
  for (const char* k : {"max_lr", "min_lr", "init_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style", "num_steps",
                        "start_wd", "end_wd", "wd_incr_steps", "wd_incr_style"}) {
    INFO(k);
    CHECK(ra.lr_scheduler.at(k) == rb.lr_scheduler.at(k));
  }
}

}  // namespace mt_test
