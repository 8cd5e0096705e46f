// Activation offloading in a GptModel stage (engine/activation_offload.h): the layout of the
// offloaded tensors in each slot's entries, and the copies to host memory and back around each
// layer's forward and backward.
#include <algorithm>
#include <limits>

#include "core/error.h"
#include "engine/gpt_model.h"
#include "engine/gpt_model_parts.h"

namespace mt {

Tensor GptModel::take_act(Arena& a, MemoryCategory c, OffloadField f, DType t, std::initializer_list<int64_t> dims,
                          int ahead) {
  if (layout_layer_ < 0) return a.take(c, t, dims);
  const int layer = layout_layer_ + ahead;
  if (offload_probe_) {
    const Tensor x = a.take(c, t, dims);
    const size_t bytes = (x.nbytes() + Arena::kAlignment - 1) / Arena::kAlignment * Arena::kAlignment;
    offload_probe_->push_back({layer, f, t, x.numel(), bytes});
    return x;
  }
  if (offload_entries_) {
    if (const OffloadPlan::Piece* p = offload_.piece(layer, f)) {
      const Tensor& e = offload_entries_->at(static_cast<size_t>(layer % offload_.ring));
      Tensor x(static_cast<char*>(e.data) + p->offset, t, e.device, dims);
      MT_CHECK(x.nbytes() <= p->bytes && p->offset + p->bytes <= static_cast<size_t>(e.nbytes()),
               "offloaded tensor of layer {}: {} bytes at {} of a {}-byte piece, entry of {}", layer, x.nbytes(),
               p->offset, p->bytes, e.nbytes());
      return x;
    }
  }
  return a.take(c, t, dims);
}

// The candidates the plan may take: a layer's input only where both it and the layer before run
// their forward once (a recompute group's input is its kept input) and no distillation pair reads
// the layer before's output (the head's loss reads it after all layers).
void GptModel::plan_offload(const std::vector<OffloadCandidate>& candidates) {
  const int L = d_.decoder_layers();
  const auto& g = opt_.recompute.group_of;
  std::vector<OffloadCandidate> usable;
  for (const OffloadCandidate& c : candidates) {
    if (c.field == OffloadField::input) {
      if (c.layer < 1 || c.layer >= L || g[static_cast<size_t>(c.layer)] >= 0 || g[static_cast<size_t>(c.layer - 1)] >= 0)
        continue;
      const bool read_by_distill =
          std::any_of(opt_.distill.pairs.begin(), opt_.distill.pairs.end(),
                      [&](const ModelOptions::Distill::Pair& p) { return p.student == d_.layer_begin + c.layer - 1; });
      if (read_by_distill) continue;
    }
    usable.push_back(c);
  }
  std::vector<bool> early_ln1(static_cast<size_t>(std::max(L, 0)), false);
  for (int l = 0; l < L; ++l) early_ln1[static_cast<size_t>(l)] = norm_from_previous(l);
  offload_ = OffloadPlan::make(opt_.offload, L, usable, early_ln1, opt_.num_slots == 1);
}

// Marks: per slot and local layer, one per module for its copy to host, then one for the copy back.
int GptModel::offload_mark(int slot, int local, int module) const {
  return (slot * d_.decoder_layers() + local) * (kOffloadModules + 1) + module;
}

// Layer `local`'s tensors: in its entry, and slot's copy in host memory.
char* GptModel::offload_device(int local) const {
  return static_cast<char*>(offload_ring_.at(static_cast<size_t>(local % offload_.ring)).data);
}
char* GptModel::offload_host(int slot, int local) const {
  return static_cast<char*>(offload_host_) + static_cast<size_t>(slot) * offload_.host_bytes_per_slot +
         offload_.layers[static_cast<size_t>(local)].host_offset;
}

void GptModel::offload_wait_out(Slot& s, int slot, int local) {
  if (local < 0 || s.offload_out[static_cast<size_t>(local)] == 0) return;
  for (int m = 0; m < kOffloadModules; ++m)
    if (s.offload_out[static_cast<size_t>(local)] & (1u << m)) be_.compute_wait_for_offload_mark(offload_mark(slot, local, m));
  s.offload_out[static_cast<size_t>(local)] = 0;
}

// Layer `local` writes its own entry and, with three entries, through its closing op the next
// layer's (its input, its fused ln1): the copy to host of what a forward wrote there before (this
// micro-batch's layer R below, or another's) is waited for. (What a copy back put there was read by
// a backward before.)
void GptModel::offload_before_forward(int slot, int local) {
  if (offload_.ring == 0) return;
  const int ahead = offload_.ring == 3 ? 1 : 0;
  for (int k = local; k <= local + ahead && k < d_.decoder_layers(); ++k) {
    std::pair<int, int>& w = offload_writer_[static_cast<size_t>(k % offload_.ring)];
    if (w.first >= 0) offload_wait_out(slots_[static_cast<size_t>(w.first)], w.first, w.second);
    w = {slot, k};
  }
}

void GptModel::offload_after_forward(Slot& s, int slot, int local) {
  if (offload_.ring == 0 || !s.training) return;
  const OffloadPlan::Layer& ly = offload_.layers[static_cast<size_t>(local)];
  if (!ly.copied) return;
  // (backward_follows: the last R layers' entries are not written again before this backward.)
  const bool stay = offload_stay_ == slot && local >= d_.decoder_layers() - offload_.ring;
  s.offload_stayed[static_cast<size_t>(local)] = stay;
  s.offload_back[static_cast<size_t>(local)] = 0;
  if (stay) return;
  char* dev = offload_device(local);
  char* host = offload_host(slot, local);
  for (const OffloadPlan::Group& g : ly.groups) {
    const int m = static_cast<int>(g.module);
    be_.offload_copy(host + g.offset, dev + g.offset, g.bytes, offload_mark(slot, local, m));
    s.offload_out[static_cast<size_t>(local)] |= 1u << m;
    if (!opt_.offload.max_inflight) continue;
    // --fine-grained-offloading-max-inflight-offloads: the compute runs at most that many copies of
    // this module ahead (the oldest first).
    std::vector<std::pair<int, int>>& q = offload_inflight_[static_cast<size_t>(m)];
    const auto pending = [&](const std::pair<int, int>& e) {
      return (slots_[static_cast<size_t>(e.first)].offload_out[static_cast<size_t>(e.second)] & (1u << m)) != 0;
    };
    q.erase(std::remove_if(q.begin(), q.end(), [&](const std::pair<int, int>& e) { return !pending(e); }), q.end());
    q.emplace_back(slot, local);
    while (static_cast<int>(q.size()) > *opt_.offload.max_inflight) {
      const auto [s2, l2] = q.front();
      q.erase(q.begin());
      be_.compute_wait_for_offload_mark(offload_mark(s2, l2, m));
      slots_[static_cast<size_t>(s2)].offload_out[static_cast<size_t>(l2)] &= ~(1u << m);
    }
  }
  if (opt_.offload.poison)  // (tests: the reference backend has copied; nothing may read these now)
    be_.fill(Tensor(dev, DType::f32, be_.device(), {static_cast<int64_t>(ly.bytes / 4)}),
             std::numeric_limits<double>::quiet_NaN());
}

void GptModel::offload_copy_back(Slot& s, int slot, int local) {
  if (local < 0 || s.offload_back[static_cast<size_t>(local)] || s.offload_stayed[static_cast<size_t>(local)]) return;
  const OffloadPlan::Layer& ly = offload_.layers[static_cast<size_t>(local)];
  if (!ly.copied) return;
  be_.offload_copy(offload_device(local), offload_host(slot, local), ly.bytes, offload_mark(slot, local, kOffloadModules));
  s.offload_back[static_cast<size_t>(local)] = 1;
}

// (The last layer's entry holds no resident layer when that layer is copied: every layer is.)
void GptModel::prefetch_backward(int slot) {
  const int L = d_.decoder_layers();
  if (offload_.ring == 0 || L == 0 || !offload_.layers[static_cast<size_t>(L - 1)].copied) return;
  Slot& s = slots_.at(static_cast<size_t>(slot));
  MT_CHECK(s.staged && s.training, "prefetch_backward of slot {} without a training forward", slot);
  offload_copy_back(s, slot, L - 1);
}

// Layer `local`'s tensors back (copied while the layer above ran its backward), and the layer
// below's copy back issued: into an entry whose last readers (the layers above, or a forward's copy
// to host, earlier on the offload stream) are enqueued.
void GptModel::offload_before_backward(Slot& s, int slot, int local) {
  if (offload_.ring == 0 || local >= d_.decoder_layers()) return;
  if (offload_.layers[static_cast<size_t>(local)].copied && !s.offload_stayed[static_cast<size_t>(local)]) {
    offload_copy_back(s, slot, local);
    be_.compute_wait_for_offload_mark(offload_mark(slot, local, kOffloadModules));
  }
  offload_copy_back(s, slot, local - 1);
}

}  // namespace mt
