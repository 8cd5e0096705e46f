#include "engine/activation_offload.h"

#include <algorithm>

#include <fmt/format.h>

#include "core/config.h"
#include "core/error.h"

namespace mt {

const char* offload_module_name(OffloadModule m) {
  switch (m) {
    case OffloadModule::attn_norm: return "attn_norm";
    case OffloadModule::qkv_linear: return "qkv_linear";
    case OffloadModule::core_attn: return "core_attn";
    case OffloadModule::attn_proj: return "attn_proj";
    case OffloadModule::mlp_norm: return "mlp_norm";
    case OffloadModule::expert_fc1: return "expert_fc1";
    case OffloadModule::moe_act: return "moe_act";
    case OffloadModule::fused_group_mlp: return "fused_group_mlp";
    case OffloadModule::count: break;
  }
  return "?";
}

OffloadOptions OffloadOptions::from_config(const TrainConfig& t, int pp_rank) {
  OffloadOptions o;
  o.enabled = t.fine_grained_activation_offloading;
  if (!o.enabled) return o;
  for (const std::string& name : t.offload_modules)
    for (int m = 0; m < kOffloadModules; ++m)
      if (name == offload_module_name(static_cast<OffloadModule>(m))) o.modules[static_cast<size_t>(m)] = true;
  o.min_numel = t.min_offloaded_tensor_size;
  o.fraction = t.activation_offload_fraction;
  o.keep_bytes = static_cast<int64_t>(pp_rank) * t.delta_offload_bytes_across_pp_ranks;
  o.max_inflight = t.fine_grained_offloading_max_inflight_offloads;
  return o;
}

OffloadModule OffloadOptions::module_of(OffloadField f) const {
  const bool fused = modules[static_cast<size_t>(OffloadModule::fused_group_mlp)];
  switch (f) {
    case OffloadField::input: return OffloadModule::attn_norm;
    case OffloadField::ln1_out:
    case OffloadField::fp8_qkv: return OffloadModule::qkv_linear;
    case OffloadField::qkv:
    case OffloadField::attn_out:
    case OffloadField::lse: return OffloadModule::core_attn;
    case OffloadField::fp8_proj: return OffloadModule::attn_proj;
    case OffloadField::h1: return OffloadModule::mlp_norm;
    case OffloadField::moe_in: return fused ? OffloadModule::fused_group_mlp : OffloadModule::expert_fc1;
    case OffloadField::moe_fc1_pre: return fused ? OffloadModule::fused_group_mlp : OffloadModule::moe_act;
    case OffloadField::count: break;
  }
  MT_CHECK(false, "OffloadOptions::module_of: field {}", static_cast<int>(f));
  return OffloadModule::count;
}

OffloadPlan OffloadPlan::make(const OffloadOptions& o, int layers, const std::vector<OffloadCandidate>& candidates,
                              const std::vector<bool>& early_ln1, bool keep_last) {
  OffloadPlan p;
  p.layers.resize(static_cast<size_t>(std::max(layers, 0)));
  if (!o.enabled || layers <= 0) return p;
  const int L = layers;
  std::vector<std::vector<Piece>> want(static_cast<size_t>(L));
  bool early = false;
  for (const OffloadCandidate& c : candidates) {
    if (c.layer < 0 || c.layer >= L || c.numel <= 0 || c.numel < o.min_numel || !o.selected(c.field)) continue;
    want[static_cast<size_t>(c.layer)].push_back({o.module_of(c.field), c.field, 0, c.bytes});
    early |= c.field == OffloadField::input ||
             (c.field == OffloadField::ln1_out && static_cast<size_t>(c.layer) < early_ln1.size() &&
              early_ln1[static_cast<size_t>(c.layer)]);
  }
  const int R = early ? 3 : 2;
  const int last = keep_last ? L - R : L;  // layers [last, L) stay on the device
  for (std::vector<Piece>& w : want)
    std::stable_sort(w.begin(), w.end(), [](const Piece& a, const Piece& b) {
      return a.module != b.module ? a.module < b.module : a.field < b.field;
    });

  // The (layer, module) groups that may be copied, in forward order (not the last R layers' with
  // keep_last).
  struct Eligible {
    int layer;
    OffloadModule module;
    size_t bytes;
    bool on;
  };
  std::vector<Eligible> eligible;
  for (int l = 0; l < last; ++l)
    for (const Piece& pc : want[static_cast<size_t>(l)]) {
      if (eligible.empty() || eligible.back().layer != l || eligible.back().module != pc.module)
        eligible.push_back({l, pc.module, 0, true});
      eligible.back().bytes += pc.bytes;
    }
  // Megatron-LM's order: the pipeline rank's bytes kept on the device first (the earliest groups),
  // then the fraction (the latest of those still on are kept).
  int64_t keep = o.keep_bytes;
  for (Eligible& g : eligible)
    if (g.on && keep > 0) {
      keep -= static_cast<int64_t>(g.bytes);
      g.on = false;
    }
  const int64_t on = std::count_if(eligible.begin(), eligible.end(), [](const Eligible& g) { return g.on; });
  int64_t disable = static_cast<int64_t>(static_cast<double>(on) * (1.0 - o.fraction));
  for (auto it = eligible.rbegin(); it != eligible.rend() && disable > 0; ++it)
    if (it->on) {
      it->on = false;
      --disable;
    }
  if (std::none_of(eligible.begin(), eligible.end(), [](const Eligible& g) { return g.on; })) return p;

  p.ring = R;
  const auto group_on = [&](int l, OffloadModule m) {
    if (l >= last) return true;  // (resident: never copied, but in its entry)
    for (const Eligible& g : eligible)
      if (g.layer == l && g.module == m) return g.on;
    return false;
  };
  for (int l = 0; l < L; ++l) {
    Layer& ly = p.layers[static_cast<size_t>(l)];
    for (const Piece& pc : want[static_cast<size_t>(l)]) {
      if (!group_on(l, pc.module)) continue;
      Piece q = pc;
      q.offset = ly.bytes;
      ly.bytes += q.bytes;
      if (ly.groups.empty() || ly.groups.back().module != q.module) ly.groups.push_back({q.module, q.offset, 0});
      ly.groups.back().bytes += q.bytes;
      ly.pieces.push_back(q);
    }
    ly.copied = l < last && !ly.pieces.empty();
    p.entry_bytes = std::max(p.entry_bytes, ly.bytes);
    p.placed_bytes_per_slot += ly.bytes;
    if (!ly.copied) continue;
    ly.host_offset = p.host_bytes_per_slot;
    p.host_bytes_per_slot += ly.bytes;
    for (const Group& g : ly.groups) p.module_bytes[static_cast<size_t>(g.module)] += g.bytes;
  }
  return p;
}

const OffloadPlan::Piece* OffloadPlan::piece(int layer, OffloadField f) const {
  if (ring == 0 || layer < 0 || layer >= static_cast<int>(layers.size())) return nullptr;
  for (const Piece& pc : layers[static_cast<size_t>(layer)].pieces)
    if (pc.field == f) return &pc;
  return nullptr;
}

namespace {
std::string size_text(size_t bytes) {
  return bytes >= 1048576 ? fmt::format("{:.1f} MiB", bytes / 1048576.0) : fmt::format("{:.1f} KiB", bytes / 1024.0);
}
}  // namespace

std::string OffloadPlan::summary() const {
  if (ring == 0) return "activation offloading: nothing to offload on this stage (no kept tensor of the --offload-modules "
                        "is large enough outside its last layers)";
  int copied = 0;
  for (const Layer& l : layers) copied += l.copied ? 1 : 0;
  std::string by_module;
  for (int m = 0; m < kOffloadModules; ++m)
    if (module_bytes[static_cast<size_t>(m)] > 0)
      by_module += fmt::format("{}{} {}", by_module.empty() ? "" : ", ", offload_module_name(static_cast<OffloadModule>(m)),
                               size_text(module_bytes[static_cast<size_t>(m)]));
  return fmt::format("activation offloading: {} per micro-batch in flight to host memory from {} of {} layers ({}); {} "
                     "device entries of {}",
                     size_text(host_bytes_per_slot), copied, layers.size(), by_module, ring, size_text(entry_bytes));
}

}  // namespace mt
