#include "engine/memory_plan.h"

#include <fmt/format.h>

#include "core/error.h"
#include "engine/backend.h"

namespace mt {

const char* memory_category_name(MemoryCategory c) {
  switch (c) {
    case MemoryCategory::parameters: return "parameters";
    case MemoryCategory::gradients: return "gradients";
    case MemoryCategory::master_weights: return "master weights";
    case MemoryCategory::optimizer_states: return "optimizer states";
    case MemoryCategory::activations: return "activations";
    case MemoryCategory::workspace: return "workspace";
    case MemoryCategory::count: break;
  }
  return "?";
}

size_t MemoryPlan::total() const {
  size_t t = 0;
  for (size_t b : bytes) t += b;
  return t;
}

std::string MemoryPlan::summary() const {
  std::string s;
  for (int i = 0; i < static_cast<int>(MemoryCategory::count); ++i)
    s += fmt::format("  {:<18} {:>12.2f} MiB\n", memory_category_name(static_cast<MemoryCategory>(i)),
                     bytes[i] / 1048576.0);
  if (acts_in_grads > 0)
    s += fmt::format("  {:<18} {:>12.2f} MiB (more activations, in the gradients' memory: not in the total)\n",
                     "  + in gradients", acts_in_grads / 1048576.0);
  s += fmt::format("  {:<18} {:>12.2f} MiB\n", "total", total() / 1048576.0);
  if (host > 0)
    s += fmt::format("  {:<18} {:>12.2f} MiB (offloaded activations: host memory, not in the total)\n", "host", host / 1048576.0);
  return s;
}

Arena::~Arena() {
  if (measuring_) return;
  for (size_t i = 0; i < base_.size(); ++i) {
    if (!base_[i]) continue;
    if (release_[i]) release_[i](base_[i]);
    else backend_.deallocate(base_[i]);
  }
}

void Arena::place(MemoryCategory c, std::function<void*(size_t)> allocate, std::function<void(void*)> release) {
  MT_CHECK(measuring_, "Arena::place after allocate()");
  allocate_[static_cast<size_t>(c)] = std::move(allocate);
  release_[static_cast<size_t>(c)] = std::move(release);
}

Tensor Arena::take(MemoryCategory c, DType dtype, std::initializer_list<int64_t> dims) {
  const size_t i = static_cast<size_t>(c);
  Tensor t(nullptr, dtype, backend_.device(), dims);
  const size_t bytes = (t.nbytes() + kAlignment - 1) / kAlignment * kAlignment;
  if (overlay_ == static_cast<int>(c)) {
    t.data = overlay_base_ + overlay_used_;
    overlay_used_ += bytes;
    return t;
  }
  const size_t offset = used_[i];
  used_[i] += bytes;
  if (measuring_) {
    plan_.bytes[i] = used_[i] - moved_[i];
    // A placeholder that is not null (so that "absent" checks see a present tensor).
    t.data = reinterpret_cast<void*>(static_cast<uintptr_t>(kAlignment) + offset);
  } else {
    MT_CHECK(used_[i] <= plan_.bytes[i], "arena: layout changed between the measuring and the allocating pass");
    t.data = base_[i] + offset;
  }
  return t;
}

void Arena::move_into_grads(MemoryCategory c, size_t bytes) {
  const size_t i = static_cast<size_t>(c);
  MT_CHECK(measuring_ && moved_[i] + bytes <= used_[i], "Arena::move_into_grads: {} of {} bytes", moved_[i] + bytes,
           used_[i]);
  moved_[i] += bytes;
  plan_.bytes[i] = used_[i] - moved_[i];
  plan_.acts_in_grads += bytes;
}

void Arena::count_host(size_t bytes) {
  MT_CHECK(measuring_, "Arena::count_host after allocate()");
  plan_.host += bytes;
}

void Arena::begin_overlay(MemoryCategory c, void* base) {
  MT_CHECK(!measuring_ && overlay_ < 0 && base, "Arena::begin_overlay: while measuring, or nested");
  overlay_ = static_cast<int>(c);
  overlay_base_ = static_cast<char*>(base);
  overlay_used_ = 0;
}

size_t Arena::end_overlay() {
  MT_CHECK(overlay_ >= 0, "Arena::end_overlay without begin_overlay");
  overlay_ = -1;
  return overlay_used_;
}

void Arena::allocate() {
  MT_CHECK(measuring_, "arena allocated twice");
  for (size_t i = 0; i < base_.size(); ++i) {
    if (plan_.bytes[i] == 0) continue;
    if (allocate_[i]) base_[i] = static_cast<char*>(allocate_[i](plan_.bytes[i]));
    if (base_[i] == nullptr) {
      release_[i] = nullptr;
      base_[i] = static_cast<char*>(backend_.allocate(plan_.bytes[i]));
    }
    // Sizes are multiples of kAlignment: zero the block as float32 words.
    Tensor whole(base_[i], DType::f32, backend_.device(), {static_cast<int64_t>(plan_.bytes[i] / 4)});
    backend_.fill(whole, 0.0);
  }
  measuring_ = false;
  used_ = {};
  moved_ = {};
}

}  // namespace mt
