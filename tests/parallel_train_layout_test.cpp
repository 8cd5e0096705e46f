// The pure planning behind multi-rank training: the DP bucket layout of a model chunk's buffers
// (engine/grad_layout.h), the optimizer's ranges with and without the distributed optimizer
// (engine/distributed_optimizer.h) and the activation slots of a pipeline schedule
// (engine/pipeline_runner.h). The equivalence of whole runs is tested over MPI (tests/mpi/).
#include <catch2/catch.hpp>

#include <algorithm>
#include <map>
#include <set>

#include "engine/distributed_optimizer.h"
#include "engine/gpt_model.h"
#include "engine/grad_layout.h"
#include "engine/pipeline_runner.h"
#include "parallel/parallel_state.h"
#include "tests/engine_test_util.h"

using namespace mt;

namespace {

ModelDims dims_of(const Config& c, int tp_size, int tp_rank, bool sp, bool first = true, bool last = true) {
  Config k = c;
  k.parallel.sequence_parallel = sp;
  ModelDims d = ModelDims::from_config(k, RankPosition::split(k, tp_size, tp_rank));
  d.first_stage = first;
  d.last_stage = last;
  d.pipeline = !(first && last);
  return d;
}

}  // namespace

TEST_CASE("grad layout: buckets in backward order, every parameter placed once, aligned", "[parallel-train]") {
  const ModelDims d = dims_of(test::tiny_gpt_config(), 1, 0, false);
  int64_t total = 0;
  std::vector<ParamDesc> params = build_param_descs(d, &total);
  const GradLayout L = layout_grad_buffer(params, 3, 1, 300, false, false, &total);
  CHECK(total == L.plan.numel);
  CHECK(L.num_buckets() > 2);
  std::set<int> placed(L.plan_param.begin(), L.plan_param.end());
  CHECK(placed.size() == params.size());
  // Parameters do not overlap and each bucket is a multiple of lcm(3, 128).
  std::vector<std::pair<int64_t, int64_t>> spans;
  for (const ParamDesc& p : params) {
    CHECK(p.offset % kParamAlignment == 0);
    spans.emplace_back(p.offset, p.offset + p.numel());
  }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i) CHECK(spans[i - 1].second <= spans[i].first);
  for (const GradBucket& b : L.plan.buckets) CHECK(b.numel % 384 == 0);
  // Backward order: the first bucket holds the last parameters (the head), the last the embedding.
  CHECK(L.bucket_first_param.front() > L.bucket_first_param.back());
  CHECK(L.bucket_first_param.back() == 0);
  // Not sharded: the states are indexed like the flat buffers.
  CHECK(L.state_numel == total);
}

TEST_CASE("grad layout: TP-partial gradients of a layer form one range, tied copies get their own bucket",
          "[parallel-train]") {
  Config c = test::tiny_llama_config();
  c.model.qk_layernorm = true;
  c.model.untie_embeddings_and_output_weights = false;
  const ModelDims d = dims_of(c, 2, 1, true, false, true);  // last pipeline stage, TP 2, SP
  int64_t total = 0;
  std::vector<ParamDesc> params = build_param_descs(d, &total);
  const GradLayout L = layout_grad_buffer(params, 2, 0, std::nullopt, true, true, &total);
  int partial = 0;
  for (const ParamDesc& p : params) {
    const bool norm = p.name.find("layernorm") != std::string::npos || p.name.find("layer_norm") != std::string::npos;
    CHECK(p.tp_partial_grad == norm);  // SP: every norm; q/k layernorms: heads split over TP
    partial += p.tp_partial_grad;
  }
  CHECK(partial > 0);
  const auto ranges = tp_partial_ranges(params);  // throws when another parameter lies inside
  CHECK(ranges.size() == static_cast<size_t>(d.stage_layers()) + 1);  // each layer and the final norm
  // The last stage's copy of the tied embeddings is alone in its bucket.
  const int out = find_param(params, "output_layer.weight");
  REQUIRE(out >= 0);
  CHECK(params[static_cast<size_t>(out)].shared_copy);
  for (const GradBucket& b : L.plan.buckets) {
    bool has_out = false;
    for (int k : b.params) has_out = has_out || L.plan_param[static_cast<size_t>(k)] == out;
    if (has_out) CHECK(b.params.size() == 1);
  }
  // Sharded: each rank's shards are half of every bucket, packed one after the other.
  int64_t sum = 0;
  for (int b = 0; b < L.num_buckets(); ++b) {
    CHECK(L.state_offset[static_cast<size_t>(b)] == sum);
    sum += L.shard_numel(b);
  }
  CHECK(L.state_numel * 2 == total);
}

TEST_CASE("optimizer ranges: the DP shards of all ranks cover each parameter exactly once", "[parallel-train]") {
  const Config c = test::tiny_gpt_config();
  const ModelDims d = dims_of(c, 1, 0, false);
  for (int dp : {1, 2, 3, 5}) {
    std::map<int, int64_t> covered;  // param -> elements updated over all ranks
    int64_t total = 0;
    std::vector<ParamDesc> params = build_param_descs(d, &total);
    for (int r = 0; r < dp; ++r) {
      std::vector<ParamDesc> ps = build_param_descs(d, &total);
      const GradLayout L = layout_grad_buffer(ps, dp, r, 500, true, false, &total);
      for (int b = 0; b < L.num_buckets(); ++b)
        for (const ShardSegment& s : L.shard_segments(b)) covered[s.param] += s.numel;
    }
    for (size_t i = 0; i < params.size(); ++i) CHECK(covered[static_cast<int>(i)] == params[i].numel());
  }
}

TEST_CASE("optimizer ranges of a model: norm segments skip TP duplicates off TP rank 0", "[parallel-train]") {
  const Config c = test::tiny_gpt_config();
  std::unique_ptr<Backend> be = make_reference_backend(1);
  ParallelState ps = make_single_process_state();
  ModelDims d = dims_of(c, 2, 1, false);
  for (int tp_rank : {0, 1}) {
    int64_t counted = 0, updated = 0, shard_params = 0, shard_counted = 0;
    for (int dp_rank : {0, 1}) {
    ModelOptions o = ModelOptions::from_config(c, d, DType::f32);
    o.shard_size = 2;
    o.shard_rank = dp_rank;
    o.bucket_size = 400;
    o.shard_optimizer_state = true;
    GptModel m(d, o, ps, *be);
    for (const OptimRange& r : plan_optim_ranges(m, 0, tp_rank, false)) {
      CHECK(r.bucket >= 0);
      CHECK(r.numel == m.grad_layout().shard_numel(r.bucket));
      for (const OptimSegment& s : r.update) {
        CHECK(s.offset >= 0);
        CHECK(s.offset + s.count <= r.numel);
        updated += s.count;
      }
      for (const OptimSegment& s : r.norm) counted += s.count;
    }
    for (int b = 0; b < m.grad_layout().num_buckets(); ++b)
      for (const ShardSegment& s : m.grad_layout().shard_segments(b)) {
        shard_params += s.numel;
        if (!m.params()[static_cast<size_t>(s.param)].tp_duplicated || tp_rank == 0) shard_counted += s.numel;
      }
    }
    CHECK(updated >= shard_params);
    CHECK(counted == shard_counted);
    if (tp_rank == 1) CHECK(shard_counted < shard_params);  // the duplicated norms count on TP rank 0 only
  }
}

TEST_CASE("pipeline slot plan: one slot per live micro-batch, bounded by the schedule's peaks", "[parallel-train]") {
  for (int P : {1, 2, 3, 4})
    for (int V : {1, 2})
      for (int M : {1, 2, 4, 5, 8}) {
        if (V > 1 && (P == 1 || M < P || (M % P != 0 && M % P < P))) continue;
        ScheduleSpec spec{P, M, V, 0};
        for (int r = 0; r < P; ++r) {
          INFO("P " << P << " V " << V << " M " << M << " rank " << r);
          const PipelinePlan plan = PipelinePlan::from_schedule(build_pipeline_schedule(spec, r));
          REQUIRE(plan.slots.size() == plan.schedule.actions.size());
          std::map<std::pair<int, int>, int> live;  // (mb, chunk) -> slot
          std::vector<int> peak(static_cast<size_t>(V), 0), now(static_cast<size_t>(V), 0);
          std::map<std::pair<int, int>, int> owner;  // (chunk, slot) -> mb
          auto hold = [&](int mb, int c, int s) {
            REQUIRE(s >= 0);
            REQUIRE(s < plan.num_slots[static_cast<size_t>(c)]);
            auto it = live.find({mb, c});
            if (it != live.end()) {
              CHECK(it->second == s);
              return;
            }
            CHECK(owner.count({c, s}) == 0);  // nobody else holds it
            live[{mb, c}] = s;
            owner[{c, s}] = mb;
            peak[static_cast<size_t>(c)] = std::max(peak[static_cast<size_t>(c)], ++now[static_cast<size_t>(c)]);
          };
          for (size_t i = 0; i < plan.schedule.actions.size(); ++i) {
            const PipelineAction& a = plan.schedule.actions[i];
            if (a.op == PipelineOp::forward) hold(a.microbatch, a.chunk, plan.slots[i][0]);
            if (a.op == PipelineOp::backward) {
              CHECK(live.at({a.microbatch, a.chunk}) == plan.slots[i][0]);
              owner.erase({a.chunk, plan.slots[i][0]});
              live.erase({a.microbatch, a.chunk});
              --now[static_cast<size_t>(a.chunk)];
            }
            if (a.op == PipelineOp::communicate)
              for (size_t t = 0; t < a.transfers.size(); ++t) {
                const P2PTransfer& x = a.transfers[t];
                if (x.channel == PipelineChannel::gradient && x.is_send) CHECK(plan.slots[i][t] == -1);
                else hold(x.microbatch, x.chunk, plan.slots[i][t]);
              }
          }
          CHECK(live.empty());
          // No slot is wasted: each chunk has as many as it ever holds at once.
          for (int c = 0; c < V; ++c) CHECK(plan.num_slots[static_cast<size_t>(c)] == std::max(1, peak[static_cast<size_t>(c)]));
          // 1F1B: at most P - r forwards in flight, plus one activation received early.
          if (V == 1 && P > 1) CHECK(plan.num_slots[0] <= std::min(M, P - r + 1));
        }
      }
}
