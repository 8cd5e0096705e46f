// Pipeline schedules as data: Megatron's compute order, warm-up counts, and a whole-pipeline replay
// proving the transfers pair up without deadlock.
#include <catch2/catch.hpp>

#include <fmt/format.h>

#include <algorithm>
#include <string>
#include <vector>

#include "core/error.h"
#include "parallel/schedules.h"

using namespace mt;

namespace {

// Only the forwards and backwards, e.g. "F0.0 F1.0 B0.0 ...".
std::string compute_only(const PipelineSchedule& s) {
  std::string out;
  for (const auto& a : s.actions) {
    if (a.op == PipelineOp::communicate) continue;
    if (!out.empty()) out += ' ';
    out += fmt::format("{}{}.{}{}", a.op == PipelineOp::forward ? "F" : "B", a.microbatch, a.chunk,
                       a.grad_sync ? "*" : "");
  }
  return out;
}

int forwards_before_first_backward(const PipelineSchedule& s) {
  int n = 0;
  for (const auto& a : s.actions) {
    if (a.op == PipelineOp::backward) break;
    if (a.op == PipelineOp::forward) ++n;
  }
  return n;
}

ScheduleSpec spec(int P, int M, int V = 1, int N = 0) {
  ScheduleSpec s;
  s.pp_size = P;
  s.num_microbatches = M;
  s.num_chunks = V;
  s.microbatch_group_size = N;
  return s;
}

}  // namespace

TEST_CASE("interleaved schedule table matches Megatron's example (P=2 M=5 V=2 N=3)", "[schedules]") {
  const auto t = interleaved_schedule_table(5, 2, 3);
  std::vector<int> mb, chunk;
  for (auto [m, c] : t) {
    mb.push_back(m);
    chunk.push_back(c);
  }
  CHECK(mb == std::vector<int>{0, 1, 2, 0, 1, 2, 3, 4, 3, 4});
  CHECK(chunk == std::vector<int>{0, 0, 0, 1, 1, 1, 0, 0, 1, 1});

  // The ranks' compute order follows the table: forward virtual k = table[k], backward virtual k =
  // (table[k].mb, V-1-table[k].chunk); rank 0 warms up with min(10, 2*1 + 1*3) = 5 forwards.
  const auto all = build_pipeline_schedules(spec(2, 5, 2, 3));
  CHECK(all[0].num_warmup == 5);
  CHECK(all[1].num_warmup == 3);
  CHECK(compute_only(all[0]) ==
        "F0.0 F1.0 F2.0 F0.1 F1.1 F2.1 B0.1 F3.0 B1.1 F4.0 B2.1 F3.1 B0.0 F4.1 B1.0 B2.0 B3.1 B4.1* B3.0 B4.0*");
  CHECK(compute_only(all[1]) ==
        "F0.0 F1.0 F2.0 F0.1 B0.1 F1.1 B1.1 F2.1 B2.1 F3.0 B0.0 F4.0 B1.0 F3.1 B2.0 F4.1 B3.1 B4.1* B3.0 B4.0*");
  CHECK(check_pipeline_schedules(all) == "");
}

TEST_CASE("1F1B warm-up counts and compute order per rank", "[schedules]") {
  const auto s = build_pipeline_schedules(spec(4, 8));
  for (int r = 0; r < 4; ++r) {
    CHECK(s[r].kind == ScheduleKind::one_f_one_b);
    CHECK(s[r].num_warmup == 4 - r - 1);
    // W warm-up forwards, then the first steady step's forward, then the first backward.
    CHECK(forwards_before_first_backward(s[r]) == 4 - r);
    CHECK(s[r].peak_inflight_forwards() == 4 - r);  // W + 1 activations held at once
  }
  CHECK(compute_only(s[3]) == "F0.0 B0.0 F1.0 B1.0 F2.0 B2.0 F3.0 B3.0 F4.0 B4.0 F5.0 B5.0 F6.0 B6.0 F7.0 B7.0*");
  CHECK(compute_only(s[1]) == "F0.0 F1.0 F2.0 B0.0 F3.0 B1.0 F4.0 B2.0 F5.0 B3.0 F6.0 B4.0 F7.0 B5.0 B6.0 B7.0*");
  CHECK(check_pipeline_schedules(s) == "");

  // Fewer micro-batches than stages: W = min(P - r - 1, M).
  const auto few = build_pipeline_schedules(spec(4, 2));
  CHECK(few[0].num_warmup == 2);
  CHECK(few[1].num_warmup == 2);
  CHECK(few[2].num_warmup == 1);
  CHECK(few[3].num_warmup == 0);
  CHECK(compute_only(few[0]) == "F0.0 F1.0 B0.0 B1.0*");
  CHECK(check_pipeline_schedules(few) == "");
}

TEST_CASE("1F1B transfers: Megatron's send_forward_recv_backward pattern on a 2-stage pipeline", "[schedules]") {
  const auto s = build_pipeline_schedules(spec(2, 3));
  // Stage 0 sends each activation right after its forward and receives each gradient right before
  // the backward that needs it; stage 1 does the mirror image.
  CHECK(describe(s[0]) ==
        "F0.0 [s a0.0->1] F1.0 [s a1.0->1, r g0.0<-1] B0.0 F2.0 [s a2.0->1, r g1.0<-1] B1.0 [r g2.0<-1] B2.0*");
  CHECK(describe(s[1]) ==
        "[r a0.0<-0] F0.0 [r a1.0<-0] B0.0 [s g0.0->0] F1.0 B1.0 [r a2.0<-0, s g1.0->0] F2.0 B2.0* [s g2.0->0]");
  CHECK(check_pipeline_schedules(s) == "");
}

TEST_CASE("no pipelining: forward and backward alternate, gradient sync on the last backward", "[schedules]") {
  const auto s = build_pipeline_schedule(spec(1, 3), 0);
  CHECK(s.kind == ScheduleKind::no_pipelining);
  CHECK(describe(s) == "F0.0 B0.0 F1.0 B1.0 F2.0 B2.0*");
  CHECK(s.num_warmup == 0);
  CHECK(s.peak_inflight_forwards() == 1);
  CHECK(check_pipeline_schedules({s}) == "");
}

TEST_CASE("every valid pipeline shape replays without deadlock and with matching messages", "[schedules]") {
  int checked = 0;
  for (int P = 1; P <= 5; ++P)
    for (int V = 1; V <= (P == 1 ? 1 : 3); ++V)
      for (int M = 1; M <= 12; ++M)
        for (int N = 0; N <= M; ++N) {
          if (V == 1 && N > 0) continue;
          if (V > 1 && N > 0 && N < P) continue;
          ScheduleSpec sp = spec(P, M, V, N);
          const int n = N > 0 ? N : P;
          if (V > 1 && (n > M || (M % n != 0 && M % n < P))) {
            CHECK_THROWS_AS(build_pipeline_schedules(sp), Error);
            continue;
          }
          const auto all = build_pipeline_schedules(sp);
          INFO("P=" << P << " M=" << M << " V=" << V << " N=" << N);
          REQUIRE(check_pipeline_schedules(all) == "");
          for (int r = 0; r < P; ++r) {
            CHECK(forwards_before_first_backward(all[r]) == std::min(num_warmup_forwards(sp, r) + 1, M * V));
            // Activations held: the warm-up forwards plus the first steady one (Megatron's memory).
            CHECK(all[r].peak_inflight_forwards() == std::min(num_warmup_forwards(sp, r) + 1, M * V));
            // Receive buffers stay small: tensors for a later chunk wait at most a micro-batch group.
            CHECK(all[r].peak_pending_receives() <= n + 2);
          }
          ++checked;
        }
  CHECK(checked > 200);
}

TEST_CASE("the schedule checker catches broken schedules", "[schedules]") {
  const auto good = build_pipeline_schedules(spec(3, 4));
  REQUIRE(check_pipeline_schedules(good) == "");

  SECTION("a compute whose receive was dropped") {
    auto bad = good;
    // Drop the first group of rank 1 (it receives activation 0 from rank 0).
    auto& acts = bad[1].actions;
    REQUIRE(acts[0].op == PipelineOp::communicate);
    acts.erase(acts.begin());
    CHECK(check_pipeline_schedules(bad).find("runs before its input arrived") != std::string::npos);
  }
  SECTION("two backwards swapped are out of order") {
    auto bad = good;
    std::vector<size_t> bwd;
    for (size_t i = 0; i < bad[2].actions.size(); ++i)
      if (bad[2].actions[i].op == PipelineOp::backward) bwd.push_back(i);
    std::swap(bad[2].actions[bwd[0]].microbatch, bad[2].actions[bwd[1]].microbatch);
    CHECK(!check_pipeline_schedules(bad).empty());
  }
  SECTION("a receive expecting another micro-batch is a message order mismatch") {
    auto bad = good;
    for (auto& a : bad[1].actions)
      if (a.op == PipelineOp::communicate && !a.transfers[0].is_send) {
        a.transfers[0].microbatch += 1;
        break;
      }
    CHECK(check_pipeline_schedules(bad).find("mismatch") != std::string::npos);
  }
  SECTION("waiting for a gradient before sending the activation deadlocks") {
    auto bad = good;
    // Rank 0 receives its first gradient before it has run anything: nothing can flow.
    auto& acts = bad[0].actions;
    for (auto& a : acts) {
      if (a.op != PipelineOp::communicate) continue;
      auto it = std::find_if(a.transfers.begin(), a.transfers.end(), [](const P2PTransfer& t) {
        return !t.is_send && t.channel == PipelineChannel::gradient;
      });
      if (it == a.transfers.end()) continue;
      PipelineAction early;
      early.op = PipelineOp::communicate;
      early.transfers.push_back(*it);
      a.transfers.erase(it);
      acts.insert(acts.begin(), early);
      break;
    }
    CHECK(check_pipeline_schedules(bad).find("deadlock") != std::string::npos);
  }
  SECTION("sending an activation before computing it") {
    auto bad = good;
    auto& acts = bad[0].actions;
    std::swap(acts[0], acts[1]);  // [s a0.0->1] before F0.0
    CHECK(check_pipeline_schedules(bad).find("before it was computed") != std::string::npos);
  }
  SECTION("gradient sync flagged twice") {
    auto bad = good;
    for (auto& a : bad[0].actions)
      if (a.op == PipelineOp::backward) {
        a.grad_sync = true;
        break;
      }
    CHECK(!check_pipeline_schedules(bad).empty());
  }
}

TEST_CASE("interleaving rules are Megatron's", "[schedules]") {
  CHECK_THROWS_WITH(validate_schedule_spec(spec(1, 4, 2)), Catch::Contains("--pipeline-model-parallel-size > 1"));
  CHECK_THROWS_WITH(validate_schedule_spec(spec(4, 8, 2, 3)), Catch::Contains("between the pipeline size 4"));
  CHECK_THROWS_WITH(validate_schedule_spec(spec(2, 4, 2, 5)), Catch::Contains("between the pipeline size"));
  // M % N = 1 < P = 2.
  CHECK_THROWS_WITH(validate_schedule_spec(spec(2, 7, 2, 3)), Catch::Contains("modulo"));
  CHECK_NOTHROW(validate_schedule_spec(spec(2, 8, 2, 3)));  // 8 % 3 = 2 >= P
  CHECK_NOTHROW(validate_schedule_spec(spec(4, 8, 2)));     // N defaults to P
  CHECK_THROWS_AS(validate_schedule_spec(spec(4, 6, 2)), Error);  // 6 % 4 = 2 < 4
  CHECK(num_warmup_forwards(spec(4, 8, 2), 0) == 3 * 2 + 1 * 4);
  CHECK(num_warmup_forwards(spec(4, 4, 2), 0) == 8);  // clamped to M*V: all forwards first
}
