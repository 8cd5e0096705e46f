#include "parallel/schedules.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <set>
#include <tuple>

#include "core/error.h"

namespace mt {
namespace {

// Stage numbering of the virtual pipeline: chunk c of pipeline rank r is stage c * P + r. An
// activation leaves stage s for s + 1, a gradient for s - 1.
int stage_of(int P, int rank, int chunk) { return chunk * P + rank; }
int rank_of_stage(int P, int stage) { return stage % P; }
int chunk_of_stage(int P, int stage) { return stage / P; }

int group_size_or_default(const ScheduleSpec& s) {
  return s.microbatch_group_size > 0 ? s.microbatch_group_size : s.pp_size;
}

// The order of forwards and backwards on one rank (no transfers yet).
std::vector<PipelineAction> compute_order(const ScheduleSpec& spec, int r) {
  const int P = spec.pp_size, M = spec.num_microbatches, V = spec.num_chunks;
  std::vector<PipelineAction> out;
  // The backward of micro-batch M-1 is the last one of its chunk in every schedule below.
  auto backward = [&](int mb, int chunk) { return PipelineAction::backward(mb, chunk, mb == M - 1); };
  switch (schedule_kind(spec)) {
    case ScheduleKind::no_pipelining:
      for (int i = 0; i < M; ++i) {
        out.push_back(PipelineAction::forward(i, 0));
        out.push_back(backward(i, 0));
      }
      break;
    case ScheduleKind::one_f_one_b: {
      const int W = num_warmup_forwards(spec, r);
      for (int i = 0; i < W; ++i) out.push_back(PipelineAction::forward(i, 0));
      for (int i = 0; i < M - W; ++i) {
        out.push_back(PipelineAction::forward(W + i, 0));
        out.push_back(backward(i, 0));
      }
      for (int i = M - W; i < M; ++i) out.push_back(backward(i, 0));
      break;
    }
    case ScheduleKind::interleaved: {
      const auto table = interleaved_schedule_table(M, V, group_size_or_default(spec));
      const int T = M * V;
      const int W = num_warmup_forwards(spec, r);
      auto fwd = [&](int k) { return PipelineAction::forward(table[k].first, table[k].second); };
      auto bwd = [&](int k) { return backward(table[k].first, V - 1 - table[k].second); };
      for (int k = 0; k < W; ++k) out.push_back(fwd(k));
      for (int k = 0; k < T - W; ++k) {
        out.push_back(fwd(k + W));
        out.push_back(bwd(k));
      }
      for (int k = T - W; k < T; ++k) out.push_back(bwd(k));
      break;
    }
  }
  (void)P;
  return out;
}

// A received tensor waiting in a buffer: (channel, micro-batch, consuming chunk).
using Arrival = std::tuple<PipelineChannel, int, int>;

// The input a compute needs from a neighbour, if any.
bool needs_input(int P, int V, int rank, const PipelineAction& a, Arrival* need) {
  const int s = stage_of(P, rank, a.chunk);
  if (a.op == PipelineOp::forward && s > 0) {
    *need = {PipelineChannel::activation, a.microbatch, a.chunk};
    return true;
  }
  if (a.op == PipelineOp::backward && s < P * V - 1) {
    *need = {PipelineChannel::gradient, a.microbatch, a.chunk};
    return true;
  }
  return false;
}

// Where the output of a compute goes, if anywhere: (peer rank, transfer as the receiver sees it).
bool output_goes_to(int P, int V, int rank, const PipelineAction& a, P2PTransfer* send, P2PTransfer* recv) {
  const int s = stage_of(P, rank, a.chunk);
  int to = -1;
  PipelineChannel ch;
  if (a.op == PipelineOp::forward) {
    if (s == P * V - 1) return false;  // the loss is computed here
    to = s + 1;
    ch = PipelineChannel::activation;
  } else {
    if (s == 0) return false;  // the embedding's input needs no gradient
    to = s - 1;
    ch = PipelineChannel::gradient;
  }
  *send = {true, ch, rank_of_stage(P, to), a.microbatch, a.chunk};
  *recv = {false, ch, rank, a.microbatch, chunk_of_stage(P, to)};
  return true;
}

void merge_adjacent_groups(std::vector<PipelineAction>& actions) {
  std::vector<PipelineAction> merged;
  for (auto& a : actions) {
    if (a.op == PipelineOp::communicate && !merged.empty() && merged.back().op == PipelineOp::communicate) {
      auto& t = merged.back().transfers;
      t.insert(t.end(), a.transfers.begin(), a.transfers.end());
    } else {
      merged.push_back(std::move(a));
    }
  }
  actions = std::move(merged);
}

std::string transfer_string(const P2PTransfer& t) {
  return fmt::format("{} {}{}.{}{}{}", t.is_send ? "s" : "r", t.channel == PipelineChannel::activation ? "a" : "g",
                     t.microbatch, t.chunk, t.is_send ? "->" : "<-", t.peer);
}

std::string action_string(const PipelineAction& a) {
  switch (a.op) {
    case PipelineOp::forward: return fmt::format("F{}.{}", a.microbatch, a.chunk);
    case PipelineOp::backward: return fmt::format("B{}.{}{}", a.microbatch, a.chunk, a.grad_sync ? "*" : "");
    case PipelineOp::communicate: {
      std::string s = "[";
      for (size_t i = 0; i < a.transfers.size(); ++i) s += (i ? ", " : "") + transfer_string(a.transfers[i]);
      return s + "]";
    }
  }
  return "?";
}

}  // namespace

ScheduleKind schedule_kind(const ScheduleSpec& spec) {
  if (spec.pp_size == 1) return ScheduleKind::no_pipelining;
  return spec.num_chunks > 1 ? ScheduleKind::interleaved : ScheduleKind::one_f_one_b;
}

void validate_schedule_spec(const ScheduleSpec& spec) {
  const int P = spec.pp_size, M = spec.num_microbatches, V = spec.num_chunks;
  if (P < 1) fail("--pipeline-model-parallel-size must be at least 1 (got {})", P);
  if (M < 1) fail("the number of micro-batches must be at least 1 (got {})", M);
  if (V < 1) fail("the number of model chunks per pipeline rank must be at least 1 (got {})", V);
  if (V > 1 && P == 1)
    fail("an interleaved (virtual) pipeline needs --pipeline-model-parallel-size > 1; drop "
         "--num-layers-per-virtual-pipeline-stage / --num-virtual-stages-per-pipeline-rank");
  if (spec.microbatch_group_size < 0)
    fail("--microbatch-group-size-per-virtual-pipeline-stage must be positive (got {})", spec.microbatch_group_size);
  if (V == 1) return;
  const int N = group_size_or_default(spec);
  if (N < P || N > M)
    fail("--microbatch-group-size-per-virtual-pipeline-stage is {} but must lie between the pipeline size "
         "{} and the number of micro-batches {} (global batch / (micro batch x DP)); raise the global batch "
         "size or change the group size",
         N, P, M);
  const int rest = M % N;
  if (rest != 0 && rest < P)
    fail("with the interleaved schedule the number of micro-batches {} modulo "
         "--microbatch-group-size-per-virtual-pipeline-stage {} is {}, which must be 0 or at least the "
         "pipeline size {} (Megatron's rule: a smaller last group stalls the pipeline)",
         M, N, rest, P);
}

std::vector<std::pair<int, int>> interleaved_schedule_table(int M, int V, int N) {
  MT_CHECK(M > 0 && V > 0 && N > 0, "bad table arguments M={} V={} N={}", M, V, N);
  std::vector<std::pair<int, int>> table;
  for (int g = 0; g < M; g += N) {
    const int end = std::min(g + N, M);
    for (int c = 0; c < V; ++c)
      for (int mb = g; mb < end; ++mb) table.emplace_back(mb, c);
  }
  return table;
}

int num_warmup_forwards(const ScheduleSpec& spec, int r) {
  const int P = spec.pp_size, M = spec.num_microbatches, V = spec.num_chunks;
  switch (schedule_kind(spec)) {
    case ScheduleKind::no_pipelining: return 0;
    case ScheduleKind::one_f_one_b: return std::min(P - r - 1, M);
    case ScheduleKind::interleaved:
      return std::min(M * V, (P - r - 1) * 2 + (V - 1) * group_size_or_default(spec));
  }
  return 0;
}

std::vector<PipelineSchedule> build_pipeline_schedules(const ScheduleSpec& spec) {
  validate_schedule_spec(spec);
  const int P = spec.pp_size, V = spec.num_chunks;

  std::vector<std::vector<PipelineAction>> order(P);
  std::vector<PipelineSchedule> out(P);
  for (int r = 0; r < P; ++r) {
    order[r] = compute_order(spec, r);
    out[r].kind = schedule_kind(spec);
    out[r].pp_size = P;
    out[r].pp_rank = r;
    out[r].num_chunks = V;
    out[r].num_microbatches = spec.num_microbatches;
    out[r].num_warmup = num_warmup_forwards(spec, r);
  }

  // Replay in rounds. In a round each rank runs its next compute if its input has arrived; every
  // tensor produced in the round is sent in the sender's group of that round and received in the
  // receiver's group of the same round (buffered until its consumer runs).
  std::vector<size_t> next(P, 0);
  std::vector<std::set<Arrival>> arrived(P);
  size_t remaining = 0;
  for (auto& o : order) remaining += o.size();
  const size_t max_rounds = 4 * remaining + 16;
  for (size_t round = 0; remaining > 0; ++round) {
    MT_CHECK(round < max_rounds, "pipeline schedule P={} M={} V={} does not drain", P, spec.num_microbatches, V);
    std::vector<PipelineAction> groups(P);
    for (auto& g : groups) g.op = PipelineOp::communicate;
    std::vector<std::pair<int, Arrival>> delivered;
    bool progress = false;
    for (int r = 0; r < P; ++r) {
      if (next[r] == order[r].size()) continue;
      const PipelineAction& a = order[r][next[r]];
      Arrival need;
      if (needs_input(P, V, r, a, &need)) {
        auto it = arrived[r].find(need);
        if (it == arrived[r].end()) continue;  // waits for its input
        arrived[r].erase(it);
      }
      out[r].actions.push_back(a);
      ++next[r];
      --remaining;
      progress = true;
      P2PTransfer send, recv;
      if (output_goes_to(P, V, r, a, &send, &recv)) {
        groups[r].transfers.push_back(send);
        groups[send.peer].transfers.push_back(recv);
        delivered.push_back({send.peer, Arrival{recv.channel, recv.microbatch, recv.chunk}});
      }
    }
    MT_CHECK(progress, "pipeline schedule P={} M={} V={} stalls: a compute waits for an input nobody sends", P,
             spec.num_microbatches, V);
    for (int r = 0; r < P; ++r)
      if (!groups[r].transfers.empty()) out[r].actions.push_back(std::move(groups[r]));
    for (auto& [r, arr] : delivered) arrived[r].insert(arr);
  }
  for (auto& s : out) merge_adjacent_groups(s.actions);
  return out;
}

PipelineSchedule build_pipeline_schedule(const ScheduleSpec& spec, int pp_rank) {
  MT_CHECK(pp_rank >= 0 && pp_rank < spec.pp_size, "pipeline rank {} of {}", pp_rank, spec.pp_size);
  return build_pipeline_schedules(spec)[pp_rank];
}

int PipelineSchedule::peak_inflight_forwards() const {
  int live = 0, peak = 0;
  for (const auto& a : actions) {
    if (a.op == PipelineOp::forward) peak = std::max(peak, ++live);
    if (a.op == PipelineOp::backward) --live;
  }
  return peak;
}

int PipelineSchedule::peak_pending_receives() const {
  int pending = 0, peak = 0;
  for (const auto& a : actions) {
    if (a.op == PipelineOp::communicate) {
      for (const auto& t : a.transfers)
        if (!t.is_send) ++pending;
      peak = std::max(peak, pending);
    } else {
      Arrival need;
      if (needs_input(pp_size, num_chunks, pp_rank, a, &need)) --pending;
    }
  }
  return peak;
}

std::string check_pipeline_schedules(const std::vector<PipelineSchedule>& s) {
  const int P = static_cast<int>(s.size());
  if (P == 0) return "no schedules";
  const int V = s[0].num_chunks, M = s[0].num_microbatches;
  for (int r = 0; r < P; ++r) {
    if (s[r].pp_rank != r || s[r].pp_size != P || s[r].num_chunks != V || s[r].num_microbatches != M)
      return fmt::format("rank {}: schedule header disagrees with the others", r);
  }

  // Issue index of every transfer within its (sender, receiver, channel) stream.
  using Stream = std::tuple<int, int, PipelineChannel>;
  std::map<std::tuple<int, size_t, size_t>, int> seq;  // (rank, action, transfer) -> index in stream
  {
    std::map<std::pair<Stream, bool>, int> count;
    for (int r = 0; r < P; ++r)
      for (size_t i = 0; i < s[r].actions.size(); ++i)
        for (size_t j = 0; j < s[r].actions[i].transfers.size(); ++j) {
          const auto& t = s[r].actions[i].transfers[j];
          if (t.peer < 0 || t.peer >= P || t.peer == r)
            return fmt::format("rank {}: {} names an invalid peer", r, transfer_string(t));
          Stream st = t.is_send ? Stream{r, t.peer, t.channel} : Stream{t.peer, r, t.channel};
          seq[{r, i, j}] = count[{st, t.is_send}]++;
        }
  }

  // Replay with grouped-transfer semantics.
  std::vector<size_t> pc(P, 0);
  std::vector<std::vector<bool>> matched(P);
  std::vector<std::multiset<Arrival>> buffered(P), produced(P);
  std::vector<bool> sends_checked(P, false);
  std::vector<std::set<std::pair<int, int>>> forwarded(P), backwarded(P);
  std::vector<std::vector<int>> last_backward_mb(P, std::vector<int>(V, -1));
  std::vector<std::vector<int>> sync_count(P, std::vector<int>(V, 0));
  auto current = [&](int r) -> const PipelineAction* {
    return pc[r] < s[r].actions.size() ? &s[r].actions[pc[r]] : nullptr;
  };
  auto enter = [&](int r) {
    const PipelineAction* a = current(r);
    matched[r].assign(a && a->op == PipelineOp::communicate ? a->transfers.size() : 0, false);
    sends_checked[r] = false;
  };
  for (int r = 0; r < P; ++r) enter(r);

  bool progress = true;
  while (progress) {
    progress = false;
    // Run computes until each rank reaches a group (or its end).
    for (int r = 0; r < P; ++r) {
      while (const PipelineAction* a = current(r)) {
        if (a->op == PipelineOp::communicate) {
          if (!sends_checked[r]) {
            sends_checked[r] = true;
            for (const auto& t : a->transfers) {
              if (!t.is_send) continue;
              auto it = produced[r].find({t.channel, t.microbatch, t.chunk});
              if (it == produced[r].end())
                return fmt::format("rank {}: {} is sent before it was computed", r, transfer_string(t));
              produced[r].erase(it);
            }
          }
          break;
        }
        const std::pair<int, int> key{a->microbatch, a->chunk};
        if (a->microbatch < 0 || a->microbatch >= M || a->chunk < 0 || a->chunk >= V)
          return fmt::format("rank {}: {} is out of range", r, action_string(*a));
        Arrival need;
        if (needs_input(P, V, r, *a, &need)) {
          auto it = buffered[r].find(need);
          if (it == buffered[r].end())
            return fmt::format("rank {}: {} runs before its input arrived", r, action_string(*a));
          buffered[r].erase(it);
        }
        if (a->op == PipelineOp::forward) {
          if (!forwarded[r].insert(key).second) return fmt::format("rank {}: {} runs twice", r, action_string(*a));
        } else {
          if (!forwarded[r].count(key))
            return fmt::format("rank {}: {} runs before its forward", r, action_string(*a));
          if (!backwarded[r].insert(key).second) return fmt::format("rank {}: {} runs twice", r, action_string(*a));
          if (a->microbatch <= last_backward_mb[r][a->chunk])
            return fmt::format("rank {}: {} runs after the backward of micro-batch {} of that chunk", r,
                               action_string(*a), last_backward_mb[r][a->chunk]);
          last_backward_mb[r][a->chunk] = a->microbatch;
          if (a->grad_sync) {
            ++sync_count[r][a->chunk];
            if (a->microbatch != M - 1)
              return fmt::format("rank {}: {} enables gradient sync before the chunk's last backward", r,
                                 action_string(*a));
          }
        }
        P2PTransfer send, recv;
        if (output_goes_to(P, V, r, *a, &send, &recv)) produced[r].insert({send.channel, send.microbatch, send.chunk});
        ++pc[r];
        enter(r);
        progress = true;
      }
    }
    // Pair transfers of groups that are current on both sides.
    for (int r = 0; r < P; ++r) {
      const PipelineAction* a = current(r);
      if (!a) continue;
      for (size_t j = 0; j < a->transfers.size(); ++j) {
        const P2PTransfer& t = a->transfers[j];
        if (matched[r][j] || !t.is_send) continue;
        const PipelineAction* b = current(t.peer);
        if (!b || b->op != PipelineOp::communicate) continue;
        const int k = seq.at({r, pc[r], j});
        for (size_t q = 0; q < b->transfers.size(); ++q) {
          const P2PTransfer& u = b->transfers[q];
          if (u.is_send || u.peer != r || u.channel != t.channel || matched[t.peer][q]) continue;
          if (seq.at({t.peer, pc[t.peer], q}) != k) continue;
          // The pair meets: check the receiver expects exactly this tensor.
          const int from = stage_of(P, r, t.chunk);
          const int to = t.channel == PipelineChannel::activation ? from + 1 : from - 1;
          if (to < 0 || to >= P * V || rank_of_stage(P, to) != t.peer)
            return fmt::format("rank {}: {} goes to a rank that does not hold the neighbouring stage", r,
                               transfer_string(t));
          if (u.microbatch != t.microbatch || u.chunk != chunk_of_stage(P, to))
            return fmt::format("rank {}: {} pairs with rank {}: {} (message order mismatch)", r,
                               transfer_string(t), t.peer, transfer_string(u));
          matched[r][j] = true;
          matched[t.peer][q] = true;
          progress = true;
          break;
        }
      }
    }
    // Complete groups whose transfers all met.
    for (int r = 0; r < P; ++r) {
      const PipelineAction* a = current(r);
      if (!a || a->op != PipelineOp::communicate) continue;
      if (!std::all_of(matched[r].begin(), matched[r].end(), [](bool m) { return m; })) continue;
      for (const auto& t : a->transfers)
        if (!t.is_send) buffered[r].insert({t.channel, t.microbatch, t.chunk});
      ++pc[r];
      enter(r);
      progress = true;
    }
  }

  std::string stuck;
  for (int r = 0; r < P; ++r)
    if (const PipelineAction* a = current(r))
      stuck += fmt::format("{}rank {} waits at action {} {}", stuck.empty() ? "" : "; ", r, pc[r], action_string(*a));
  if (!stuck.empty()) return "deadlock: " + stuck;

  for (int r = 0; r < P; ++r) {
    if (static_cast<int>(forwarded[r].size()) != M * V || static_cast<int>(backwarded[r].size()) != M * V)
      return fmt::format("rank {}: {} forwards and {} backwards, expected {} each", r, forwarded[r].size(),
                         backwarded[r].size(), M * V);
    if (!buffered[r].empty()) return fmt::format("rank {}: {} received tensors never used", r, buffered[r].size());
    if (!produced[r].empty()) return fmt::format("rank {}: {} computed tensors never sent", r, produced[r].size());
    for (int c = 0; c < V; ++c)
      if (sync_count[r][c] != 1)
        return fmt::format("rank {}: chunk {} enables gradient sync {} times, expected once", r, c, sync_count[r][c]);
  }
  return "";
}

std::string describe(const PipelineSchedule& schedule) {
  std::string out;
  for (const auto& a : schedule.actions) {
    if (!out.empty()) out += ' ';
    out += action_string(a);
  }
  return out;
}

}  // namespace mt
