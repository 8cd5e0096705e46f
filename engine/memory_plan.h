// MemoryPlan and Arena: every buffer of a run is laid out before the first step. The model's
// layout code asks the Arena for tensors; the first pass only measures (bytes per category, for
// --dry-run and the start-up summary), the second allocates one block per category and hands out
// real views. Nothing is allocated after that.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <string>

#include "core/tensor.h"

namespace mt {

class Backend;

enum class MemoryCategory : int {
  parameters,        // model weights in the compute dtype
  gradients,         // main grads (Megatron's main_grad): float32, or bf16 with --grad-reduce-in-bf16
  master_weights,    // float32 copies of bf16/fp16 weights
  optimizer_states,  // Adam moments / SGD momentum
  activations,       // what one or more in-flight micro-batches keep for backward
  workspace,         // transient buffers reused by every layer (grads of activations, logits, ...)
  count
};

const char* memory_category_name(MemoryCategory c);

struct MemoryPlan {
  std::array<size_t, static_cast<size_t>(MemoryCategory::count)> bytes{};
  // Activations that lie in the gradient buffer's memory (GptModel: ModelOptions::acts_over_grads),
  // counted in none of the bytes above.
  size_t acts_in_grads = 0;
  // Host memory: offloaded activations (engine/activation_offload.h), in none of the bytes above.
  size_t host = 0;
  size_t of(MemoryCategory c) const { return bytes[static_cast<size_t>(c)]; }
  size_t total() const;
  MemoryPlan& operator+=(const MemoryPlan& o) {
    for (size_t i = 0; i < bytes.size(); ++i) bytes[i] += o.bytes[i];
    acts_in_grads += o.acts_in_grads;
    host += o.host;
    return *this;
  }
  // One line per category, e.g. "  parameters         12.50 MiB".
  std::string summary() const;
};

class Arena {
 public:
  static constexpr size_t kAlignment = 256;

  explicit Arena(Backend& backend) : backend_(backend) {}
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  // Measuring: tensors carry placeholder addresses that must not be dereferenced.
  bool measuring() const { return measuring_; }
  Tensor take(MemoryCategory c, DType dtype, std::initializer_list<int64_t> dims);
  // Ends the measuring pass: allocates each category's block (zero-filled) and rewinds, so the
  // same layout code run again returns real views at the same offsets.
  void allocate();
  const MemoryPlan& plan() const { return plan_; }
  size_t used(MemoryCategory c) const { return used_[static_cast<size_t>(c)]; }
  // Measuring only: `bytes` of category c taken in this pass will not come from c's block in the
  // allocating pass, which takes them inside the gradients' block (begin_overlay); the plan counts
  // them in MemoryPlan::acts_in_grads instead.
  void move_into_grads(MemoryCategory c, size_t bytes);
  // Measuring only: `bytes` of host memory the caller allocates itself (MemoryPlan::host).
  void count_host(size_t bytes);
  // Allocating only: until end_overlay(), take(c, ...) hands out views from `base` on (each
  // rounded to kAlignment, as in the block) instead of c's block; end_overlay() returns the bytes
  // they took. base: memory the caller owns, as aligned as the blocks (a multiple of kAlignment
  // bytes from one of them).
  void begin_overlay(MemoryCategory c, void* base);
  size_t end_overlay();
  // Before allocate(): category c's block comes from `allocate` (freed with `release`) instead of
  // the backend, unless it returns null (e.g. NCCL symmetric memory for the workspace).
  void place(MemoryCategory c, std::function<void*(size_t)> allocate, std::function<void(void*)> release);
  // After allocate(): category c's block (null when empty) and whether place() provided it.
  char* block(MemoryCategory c) const { return base_[static_cast<size_t>(c)]; }
  bool placed(MemoryCategory c) const { return static_cast<bool>(release_[static_cast<size_t>(c)]); }

 private:
  Backend& backend_;
  bool measuring_ = true;
  MemoryPlan plan_;
  std::array<size_t, static_cast<size_t>(MemoryCategory::count)> used_{};
  std::array<size_t, static_cast<size_t>(MemoryCategory::count)> moved_{};  // (move_into_grads)
  int overlay_ = -1;            // the category begin_overlay redirects, or -1
  char* overlay_base_ = nullptr;
  size_t overlay_used_ = 0;
  std::array<char*, static_cast<size_t>(MemoryCategory::count)> base_{};
  std::array<std::function<void*(size_t)>, static_cast<size_t>(MemoryCategory::count)> allocate_{};
  std::array<std::function<void(void*)>, static_cast<size_t>(MemoryCategory::count)> release_{};
};

}  // namespace mt
