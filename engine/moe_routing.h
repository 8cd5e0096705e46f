// Checks shared by both backends' mixture-of-experts ops (Backend::moe_route and the ops after it):
// the routing rule against the logits' width, and the limits of what the ops take.
#pragma once

#include <cstdint>

#include "core/error.h"
#include "engine/backend.h"

namespace mt {

// Group-limited routing is on iff num_groups > 0 (then group_topk must be in [1, num_groups]).
inline bool moe_grouped(const MoeRouting& r) { return r.num_groups > 0; }

// The routing rule r for logits of `experts` columns: E = r.experts = experts >= 1, 1 <= k <= E,
// and for group-limited routing E a multiple of num_groups, 1 <= group_topk <= num_groups and at
// least k experts in the group_topk selected groups. `op` names the op in the message.
inline void check_moe_routing(const MoeRouting& r, int64_t experts, const char* op) {
  if (r.experts < 1 || r.experts != experts)
    fail("{}: the routing rule has {} experts but the logits have {} columns (--num-experts)", op, r.experts, experts);
  if (r.topk < 1 || r.topk > r.experts)
    fail("{}: top-k {} must be in [1, {}] (--moe-router-topk at most --num-experts)", op, r.topk, r.experts);
  if (r.num_groups < 0) fail("{}: {} expert groups (--moe-router-num-groups must be positive)", op, r.num_groups);
  if (moe_grouped(r)) {
    if (r.experts % r.num_groups != 0)
      fail("{}: {} experts do not split into {} groups (--num-experts must be a multiple of "
           "--moe-router-num-groups)", op, r.experts, r.num_groups);
    if (r.group_topk < 1 || r.group_topk > r.num_groups)
      fail("{}: group top-k {} must be in [1, {}] (--moe-router-group-topk at most --moe-router-num-groups)", op,
           r.group_topk, r.num_groups);
    if (static_cast<int64_t>(r.group_topk) * (r.experts / r.num_groups) < r.topk)
      fail("{}: {} selected groups of {} experts hold fewer than top-k {} experts (raise --moe-router-group-topk)",
           op, r.group_topk, r.experts / r.num_groups, r.topk);
  }
}

}  // namespace mt
