// CUDA vs reference: cross-entropy forward/backward over vocab shards (in place too), the fused
// forward-backward,
// logsumexp_combine, masked_loss_sum, logits_argmax and argmax_match_count; AdamW and SGD over segment lists (inline and registered),
// sum_squares and count_zeros (deterministic); hash_bytes (bit for bit).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/byte_hash.h"
#include "core/master_remainder.h"
#include "cuda/bench_choice.h"
#include "tests/gpu/gpu_test_util.h"

using namespace mt;
using namespace mt::gputest;

namespace {
const DType kFloatTypes[] = {DType::f32, DType::bf16, DType::f16};
}  // namespace

TEST_CASE("cuda cross_entropy forward/backward on vocab shards", "[gpu][loss]") {
  MT_RNG(rng);
  for (DType dt : kFloatTypes)
    for (int64_t cols : {1000, 2053, 50304})
      for (int64_t rows : {1, 7, 333})
        for (int64_t vocab_start : {int64_t{0}, cols / 2}) {
          if (rows == 333 && cols == 50304 && dt == DType::f16) continue;  // the reference's time, not coverage
          INFO(dtype_name(dt) << " rows " << rows << " cols " << cols << " vocab_start " << vocab_start);
          Twin logits = twin(dt, {rows, cols}, rng.normal(rows * cols, 3.0));
          // Labels over the whole (2-shard) vocabulary: some fall outside this shard.
          Twin labels = twin(DType::i32, {rows}, rng.ints(rows, 0, cols + vocab_start));
          Twin lse = twin_nan(DType::f32, {rows}), target = twin_nan(DType::f32, {rows});
          dev().cross_entropy_forward(lse.c(), target.c(), logits.c(), labels.c(), vocab_start);
          ref().cross_entropy_forward(lse.r(), target.r(), logits.r(), labels.r(), vocab_start);
          MT_CHECK_CLOSE(lse, 1e-5);
          MT_CHECK_CLOSE(target, 1e-7);  // a copy of one logit (or 0)

          // Backward with the reference's lse on both sides (a global lse would come from logsumexp_combine).
          Twin glse = twin(DType::f32, {rows}, download(ref(), lse.r()));
          Twin dloss = twin(DType::f32, {rows}, rng.uniform(rows, 0.1, 1.0));
          Twin dlogits = twin_nan(dt, {rows, cols});
          dev().cross_entropy_backward(dlogits.c(), logits.c(), labels.c(), glse.c(), dloss.c(), vocab_start);
          ref().cross_entropy_backward(dlogits.r(), logits.r(), labels.r(), glse.r(), dloss.r(), vocab_start);
          MT_CHECK_CLOSE(dlogits, tol_for(dt));
          // In place over the logits.
          dev().cross_entropy_backward(logits.c(), logits.c(), labels.c(), glse.c(), dloss.c(), vocab_start);
          ref().cross_entropy_backward(logits.r(), logits.r(), labels.r(), glse.r(), dloss.r(), vocab_start);
          MT_CHECK_CLOSE(logits, tol_for(dt));
        }
}

// The training path on a whole vocabulary: lse, target and dlogits (over the logits) from one
// kernel, bit for bit those of the forward and backward kernels with that lse, and the reference's
// within tolerance. Labels include ids outside the vocabulary (masked rows carry any label).
TEST_CASE("cuda cross_entropy_forward_backward equals forward then backward, bit for bit", "[gpu][loss]") {
  MT_RNG(rng);
  for (DType dt : kFloatTypes)
    for (int64_t cols : {1000, 2053, 50304, 128256})
      for (int64_t rows : {1, 7, 129}) {
        if (cols == 128256 && dt != DType::bf16) continue;  // the reference's time, not coverage
        INFO(dtype_name(dt) << " rows " << rows << " cols " << cols);
        const std::vector<double> values = rng.normal(rows * cols, 3.0);
        Twin fused = twin(dt, {rows, cols}, values), split = twin(dt, {rows, cols}, values);
        Twin labels = twin(DType::i32, {rows}, rng.ints(rows, -1, cols + 1));
        Twin dloss = twin(DType::f32, {rows}, rng.uniform(rows, 0.1, 1.0));
        Twin lse = twin_nan(DType::f32, {rows}), target = twin_nan(DType::f32, {rows});
        Twin lse2 = twin_nan(DType::f32, {rows}), target2 = twin_nan(DType::f32, {rows});
        dev().cross_entropy_forward_backward(lse.c(), target.c(), fused.c(), labels.c(), dloss.c());
        ref().cross_entropy_forward_backward(lse.r(), target.r(), fused.r(), labels.r(), dloss.r());
        dev().cross_entropy_forward(lse2.c(), target2.c(), split.c(), labels.c(), 0);
        dev().cross_entropy_backward(split.c(), split.c(), labels.c(), lse2.c(), dloss.c(), 0);
        CHECK(download_bytes(dev(), lse.c()) == download_bytes(dev(), lse2.c()));
        CHECK(download_bytes(dev(), target.c()) == download_bytes(dev(), target2.c()));
        CHECK(download_bytes(dev(), fused.c()) == download_bytes(dev(), split.c()));
        MT_CHECK_CLOSE(lse, 1e-5);
        MT_CHECK_CLOSE(target, 1e-7);
        MT_CHECK_CLOSE(fused, tol_for(dt));
      }
}

TEST_CASE("cuda logsumexp_combine and masked_loss_sum", "[gpu][loss]") {
  MT_RNG(rng);
  for (int64_t parts : {1, 2, 4})
    for (int64_t n : {1, 333, 4099}) {
      INFO("parts " << parts << " n " << n);
      Twin in = twin(DType::f32, {parts, n}, rng.normal(parts * n, 5.0)), out = twin_nan(DType::f32, {n});
      dev().logsumexp_combine(out.c(), in.c());
      ref().logsumexp_combine(out.r(), in.r());
      MT_CHECK_CLOSE(out, 1e-6);
    }
  for (int64_t n : {1, 333, 100003}) {
    INFO("masked_loss_sum n " << n);
    std::vector<double> loss = rng.uniform(n, 0.0, 10.0), mask = rng.ints(n, 0, 2);
    for (int64_t i = 0; i < n; i += 7)
      if (mask[i] == 0) loss[i] = std::numeric_limits<double>::quiet_NaN();  // masked rows never count
    Twin l = twin(DType::f32, {n}, loss), m = twin(DType::f32, {n}, mask);
    Twin out = twin_nan(DType::f32, {2});
    dev().masked_loss_sum(out.c(), l.c(), m.c(), false);
    ref().masked_loss_sum(out.r(), l.r(), m.r(), false);
    MT_CHECK_CLOSE(out, 1e-6);
    const auto first = download_bytes(dev(), out.c());
    dev().masked_loss_sum(out.c(), l.c(), m.c(), false);
    CHECK(differing(download_bytes(dev(), out.c()), first, 4) == 0);
    dev().masked_loss_sum(out.c(), l.c(), m.c(), true);
    ref().masked_loss_sum(out.r(), l.r(), m.r(), true);
    MT_CHECK_CLOSE(out, 1e-6);
  }
}

// Multi-token prediction's acceptance: each row's largest logit and its first column (ties placed
// on purpose, odd widths for the scalar path), and the counts over shards, exactly as the reference.
TEST_CASE("cuda logits_argmax and argmax_match_count match the reference exactly", "[gpu][loss][mtp]") {
  MT_RNG(rng);
  for (DType dt : kFloatTypes)
    for (int64_t rows : {1, 37})
      for (int64_t cols : {1, 7, 1000, 32003}) {
        INFO(dtype_name(dt) << " rows " << rows << " cols " << cols);
        std::vector<double> x = rng.normal(rows * cols);
        for (double& v : x) v = round_to(dt, v);
        for (int64_t r = 0; r < rows; r += 2) {  // a tie of the largest value at two columns
          const int64_t a = static_cast<int64_t>(rng.ints(1, 0, cols)[0]), b = static_cast<int64_t>(rng.ints(1, 0, cols)[0]);
          x[r * cols + a] = x[r * cols + b] = 8.0;
        }
        Twin logits = twin(dt, {rows, cols}, x), max = twin_nan(DType::f32, {rows});
        Twin index = twin(DType::i32, {rows}, std::vector<double>(rows, -1));
        dev().logits_argmax(max.c(), index.c(), logits.c(), 5000);
        ref().logits_argmax(max.r(), index.r(), logits.r(), 5000);
        CHECK(download(dev(), max.c()) == download(ref(), max.r()));
        CHECK(download(dev(), index.c()) == download(ref(), index.r()));
      }
  for (int64_t parts : {1, 2, 3})
    for (int64_t n : {1, 333, 5000}) {
      INFO("parts " << parts << " n " << n);
      // Few distinct values: ties between shards are common.
      Twin max_parts = twin(DType::f32, {parts, n}, rng.ints(parts * n, 0, 4));
      Twin index_parts = twin(DType::i32, {parts, n}, rng.ints(parts * n, 0, 6));
      Twin labels = twin(DType::i32, {n}, rng.ints(n, 0, 6)), mask = twin(DType::f32, {n}, rng.ints(n, 0, 2));
      Twin out = twin(DType::f32, {2}, {3.0, 4.0});
      for (bool accumulate : {false, true}) {
        dev().argmax_match_count(out.c(), max_parts.c(), index_parts.c(), labels.c(), mask.c(), accumulate);
        ref().argmax_match_count(out.r(), max_parts.r(), index_parts.r(), labels.r(), mask.r(), accumulate);
        CHECK(download(dev(), out.c()) == download(ref(), out.r()));
      }
    }
}

namespace {
// Segments with gaps between them, groups cycling through 0..groups-1.
std::vector<OptimSegment> segments_with_gaps(Rng& rng, int count, int64_t n, int groups) {
  std::vector<OptimSegment> s;
  const int64_t span = n / count;
  for (int i = 0; i < count; ++i) {
    const int64_t begin = i * span + rng.ints(1, 0, 5)[0];
    const int64_t len = std::max<int64_t>(1, span - 5 - static_cast<int64_t>(rng.ints(1, 0, span / 4 + 1)[0]));
    s.push_back(OptimSegment{begin, std::min(len, n - begin), i % groups});
  }
  return s;
}

OptimStepParams step_params() {
  OptimStepParams p;
  p.lr[0] = 1e-3f, p.lr[1] = 2e-3f, p.lr[2] = 5e-4f;
  p.weight_decay[0] = 0.1f, p.weight_decay[1] = 0.0f, p.weight_decay[2] = 0.01f;
  p.beta1 = 0.9f, p.beta2 = 0.95f, p.eps = 1e-8f;
  // A group's own eps (--use-mup's hidden matrices), large beside sqrt(v) ~ 1e-2 so that it shows.
  p.group_eps[2] = 3e-3f;
  p.step = 3;
  p.grad_scale = 0.5f;
  p.sgd_momentum = 0.9f;
  return p;
}

// Two segment lists with gaps over n elements: 5 segments (passed inline) and 40 (registered on
// both backends first).
struct SegmentLists {
  std::vector<OptimSegment> short_list, long_list;
};
SegmentLists registered_segment_lists(Rng& rng, int64_t n) {
  SegmentLists l{segments_with_gaps(rng, 5, n, 3), segments_with_gaps(rng, 40, n, 3)};
  dev().register_optim_segments(l.long_list);
  ref().register_optim_segments(l.long_list);
  return l;
}

// One update's state on both backends: master weights, moments and the model copy (model_dt; u8:
// none), whose elements outside the segments hold 7 and must keep it.
struct OptimState {
  Twin w, m, v, model;
};
OptimState optim_state(Rng& rng, int64_t n, DType model_dt) {
  return {twin(DType::f32, {n}, rng.normal(n)), twin(DType::f32, {n}, rng.normal(n, 0.001)),
          twin(DType::f32, {n}, rng.uniform(n, 0.0, 1e-4)),
          model_dt != DType::u8 ? twin(model_dt, {n}, std::vector<double>(n, 7.0)) : absent()};
}

// adamw_step with gradient g (gc / gr: the two sides) on both backends: master weights and moments
// within 1e-6, the model copy within its dtype's rounding.
void check_adamw(OptimState& k, Tensor gc, Tensor gr, const std::vector<OptimSegment>& segs, const OptimStepParams& p,
                 DType model_dt) {
  dev().adamw_step(k.w.c(), gc, k.m.c(), k.v.c(), k.model.c(), segs, p);
  ref().adamw_step(k.w.r(), gr, k.m.r(), k.v.r(), k.model.r(), segs, p);
  MT_CHECK_CLOSE(k.w, 1e-6);
  MT_CHECK_CLOSE(k.m, 1e-6);
  MT_CHECK_CLOSE(k.v, 1e-6);
  if (model_dt != DType::u8) MT_CHECK_CLOSE(k.model, tol_for(model_dt));
}

// Then sgd_step from there, with and without momentum.
void check_sgd(Rng& rng, OptimState& k, Tensor gc, Tensor gr, const std::vector<OptimSegment>& segs,
               const OptimStepParams& p, DType model_dt) {
  const int64_t n = k.w.c().numel();
  for (bool momentum : {true, false}) {
    INFO("sgd momentum " << momentum);
    OptimStepParams ps = p;
    if (!momentum) ps.sgd_momentum = 0.0f;
    Twin buf = momentum ? twin(DType::f32, {n}, rng.normal(n, 0.01)) : absent();
    dev().sgd_step(k.w.c(), gc, buf.c(), k.model.c(), segs, ps);
    ref().sgd_step(k.w.r(), gr, buf.r(), k.model.r(), segs, ps);
    MT_CHECK_CLOSE(k.w, 1e-6);
    if (momentum) MT_CHECK_CLOSE(buf, 1e-6);
    if (model_dt != DType::u8) MT_CHECK_CLOSE(k.model, tol_for(model_dt));
  }
}
}  // namespace

TEST_CASE("cuda adamw_step and sgd_step over inline and registered segment lists", "[gpu][optimizer]") {
  MT_RNG(rng);
  const int64_t n = 100003;
  const SegmentLists lists = registered_segment_lists(rng, n);
  const OptimStepParams p = step_params();
  for (const auto* segs : {&lists.short_list, &lists.long_list})
    for (DType model_dt : {DType::bf16, DType::f32, DType::f16, DType::u8 /* u8: no model copy */}) {
      const bool with_model = model_dt != DType::u8;
      INFO(segs->size() << " segments, model copy " << (with_model ? dtype_name(model_dt) : "none"));
      OptimState k = optim_state(rng, n, model_dt);
      Twin g = twin(DType::f32, {n}, rng.normal(n, 0.01));
      check_adamw(k, g.c(), g.r(), *segs, p, model_dt);
      if (with_model) {
        // The model copy is exactly the rounded master inside the segments.
        const std::vector<double> master = download(dev(), k.w.c()), copy = download(dev(), k.model.c());
        int64_t wrong = 0;
        for (const OptimSegment& s : *segs)
          for (int64_t i = s.offset; i < s.offset + s.count; ++i) wrong += copy[i] != round_to(model_dt, master[i]);
        CHECK(wrong == 0);
      }
      check_sgd(rng, k, g.c(), g.r(), *segs, p, model_dt);
    }
  // A long list that was never registered is refused with a message, not silently uploaded.
  const std::vector<OptimSegment> unregistered = segments_with_gaps(rng, 30, n, 2);
  Twin w = twin(DType::f32, {n}, rng.normal(n)), g = twin(DType::f32, {n}, rng.normal(n)),
       m = twin(DType::f32, {n}, rng.normal(n)), v = twin(DType::f32, {n}, rng.uniform(n, 0, 1));
  CHECK_THROWS_WITH(dev().adamw_step(w.c(), g.c(), m.c(), v.c(), Tensor(), unregistered, p),
                    Catch::Contains("register_optim_segments"));
}

// AdamW's kernel variants (cuda/bench_choice.h: loads in flight per thread, cache hints) compute
// the same arithmetic: the same bits as the default kernel in master weights, moments and the model
// copy, for segments starting off the 4-element alignment and tails of 1-3 elements, bf16 and fp16
// copies, float32 and bf16 moments, and no copy.
TEST_CASE("cuda adamw_step kernel variants give the default kernel's bits", "[gpu][optimizer]") {
  MT_RNG(rng);
  const int64_t n = 200011;
  const SegmentLists lists = registered_segment_lists(rng, n);
  const OptimStepParams p = step_params();
  const std::vector<double> w0 = rng.normal(n), m0 = rng.normal(n, 0.001), v0 = rng.uniform(n, 0.0, 1e-4),
                            g0 = rng.normal(n, 0.01);
  for (const auto* segs : {&lists.short_list, &lists.long_list})
    for (const DType model_dt : {DType::bf16, DType::f16, DType::u8 /* none */})
      for (const DType moment_dt : {DType::f32, DType::bf16}) {
        std::vector<std::vector<double>> first;
        for (int variant = 0; variant <= 3; ++variant) {
          INFO(segs->size() << " segments, model copy " << dtype_name(model_dt) << ", moments "
                            << dtype_name(moment_dt) << ", variant " << variant);
          cuda::bench_choice::adamw_variant = variant;
          const Twin w = twin(DType::f32, {n}, w0), m = twin(moment_dt, {n}, m0), v = twin(moment_dt, {n}, v0),
                     g = twin(DType::f32, {n}, g0);
          const Twin model = model_dt != DType::u8 ? twin(model_dt, {n}, std::vector<double>(n, 7.0)) : absent();
          dev().adamw_step(w.c(), g.c(), m.c(), v.c(), model_dt != DType::u8 ? model.c() : Tensor(), *segs, p);
          std::vector<std::vector<double>> got{download(dev(), w.c()), download(dev(), m.c()), download(dev(), v.c())};
          if (model_dt != DType::u8) got.push_back(download(dev(), model.c()));
          if (variant == 0) {
            first = got;
            continue;
          }
          int64_t differ = 0;
          for (size_t t = 0; t < got.size(); ++t)
            for (int64_t i = 0; i < n; ++i) differ += std::memcmp(&got[t][i], &first[t][i], sizeof(double)) != 0;
          CHECK(differ == 0);
        }
      }
  cuda::bench_choice::adamw_variant = 0;
}

// --exp-avg-dtype / --exp-avg-sq-dtype bf16 (precision-aware optimizer): each moment bf16 on its own,
// read as float and stored rounded to nearest even on both backends. The CUDA update computes in
// float32 (as Transformer Engine's), the reference in double, so an element may land one bf16 step
// away where the exact value is a rounding tie, which bf16 inputs (few significant bits) make
// common: measured 0.25% of the elements with bf16 gradients; a wrong rounding mode would move
// about half of them. Near cancellation (m's two terms of opposite sign) float32 leaves an
// absolute error of a few 1e-10 (terms up to ~5e-3).
TEST_CASE("cuda adamw_step with bf16 moments", "[gpu][optimizer][precision-aware]") {
  MT_RNG(rng);
  const int64_t n = 100003;
  const SegmentLists lists = registered_segment_lists(rng, n);
  const OptimStepParams p = step_params();
  for (const auto* segs : {&lists.short_list, &lists.long_list})
    for (auto [bf16_m, bf16_v] : {std::pair{true, true}, std::pair{true, false}, std::pair{false, true}})
      for (DType grad_dt : {DType::f32, DType::bf16}) {
        INFO(segs->size() << " segments, bf16 exp_avg " << bf16_m << ", bf16 exp_avg_sq " << bf16_v << ", grad "
                          << dtype_name(grad_dt));
        auto moment = [&](bool bf16, const std::vector<double>& values) {
          return bf16 ? twin_same(DType::bf16, {n}, values) : twin(DType::f32, {n}, values);
        };
        Twin w = twin(DType::f32, {n}, rng.normal(n)), m = moment(bf16_m, rng.normal(n, 0.001)),
             v = moment(bf16_v, rng.uniform(n, 0.0, 1e-4)), g = twin_same(grad_dt, {n}, rng.normal(n, 0.01));
        Twin model = twin(DType::bf16, {n}, std::vector<double>(n, 7.0));
        const std::vector<uint8_t> m_before = download_bytes(dev(), m.c());
        dev().adamw_step(w.c(), g.c(), m.c(), v.c(), model.c(), *segs, p);
        ref().adamw_step(w.r(), g.r(), m.r(), v.r(), model.r(), *segs, p);
        MT_CHECK_CLOSE(w, 1e-6);
        MT_CHECK_CLOSE(model, tol_for(DType::bf16));
        for (const auto& [x, bf16] : {std::pair<const Twin*, bool>{&m, bf16_m}, std::pair<const Twin*, bool>{&v, bf16_v}}) {
          if (!bf16) {
            MT_CHECK_CLOSE(*x, 1e-6);
            continue;
          }
          const std::vector<double> a = download(dev(), x->c()), b = download(ref(), x->r());
          int64_t far = 0;
          for (int64_t i = 0; i < n; ++i) far += !(std::fabs(a[i] - b[i]) <= std::ldexp(std::fabs(b[i]), -7) + 4e-9);
          CHECK(far == 0);
          CHECK(differing(download_bytes(dev(), x->c()), download_bytes(ref(), x->r()), 2) <= n / 100);
        }
        // Elements outside the segments keep their bytes, and the ones inside changed.
        const std::vector<uint8_t> m_after = download_bytes(dev(), m.c());
        std::vector<char> inside(static_cast<size_t>(n), 0);
        for (const OptimSegment& s : *segs)
          for (int64_t i = s.offset; i < s.offset + s.count; ++i) inside[static_cast<size_t>(i)] = 1;
        const size_t eb = bf16_m ? 2 : 4;
        int64_t outside_changed = 0, inside_same = 0, inside_n = 0;
        for (int64_t i = 0; i < n; ++i) {
          const bool same = std::equal(m_after.begin() + i * eb, m_after.begin() + (i + 1) * eb, m_before.begin() + i * eb);
          if (inside[static_cast<size_t>(i)]) inside_same += same, ++inside_n;
          else outside_changed += !same;
        }
        CHECK(outside_changed == 0);
        CHECK(inside_same < inside_n / 100);
      }
}

// Float32 master weights kept as int16 remainders beside bf16 weights (precision-aware optimizer):
// split_master as the reference's bit for bit, and AdamW over them against the reference's. The
// joined master weights match within float32 (1e-6, as the plain update's); a weight or remainder
// may differ where the two backends' new master values differ in their last bits.
TEST_CASE("cuda split_master and adamw_step over master-weight remainders", "[gpu][optimizer][precision-aware]") {
  MT_RNG(rng);
  for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{100003}}) {
    INFO("n " << n);
    const std::vector<double> values = rng.normal(n, 0.05);
    Twin master = twin_same(DType::f32, {n}, values);
    Twin w = twin_same(DType::bf16, {n}, std::vector<double>(n, 7.0)), w_only = twin_same(DType::bf16, {n}, std::vector<double>(n, 7.0));
    Twin rem = twin_same(DType::i16, {n}, std::vector<double>(n, 3.0));
    dev().split_master(w.c(), rem.c(), master.c());
    ref().split_master(w.r(), rem.r(), master.r());
    dev().split_master(w_only.c(), Tensor(), master.c());
    CHECK(differing(download_bytes(dev(), w.c()), download_bytes(ref(), w.r()), 2) == 0);
    CHECK(differing(download_bytes(dev(), rem.c()), download_bytes(ref(), rem.r()), 2) == 0);
    CHECK(differing(download_bytes(dev(), w_only.c()), download_bytes(ref(), w.r()), 2) == 0);
  }
  const int64_t n = 100003;
  const SegmentLists lists = registered_segment_lists(rng, n);
  const OptimStepParams p = step_params();
  for (const auto* segs : {&lists.short_list, &lists.long_list})
    for (bool bf16_moments : {false, true})
      for (DType grad_dt : {DType::f32, DType::bf16}) {
        INFO(segs->size() << " segments, bf16 moments " << bf16_moments << ", grad " << dtype_name(grad_dt));
        const DType md = bf16_moments ? DType::bf16 : DType::f32;
        Twin master = twin_same(DType::f32, {n}, rng.normal(n, 0.05));
        Twin w = twin_same(DType::bf16, {n}, std::vector<double>(n, 0.0)), rem = twin_same(DType::i16, {n}, std::vector<double>(n, 0.0));
        dev().split_master(w.c(), rem.c(), master.c());
        ref().split_master(w.r(), rem.r(), master.r());
        Twin m = twin_same(md, {n}, rng.normal(n, 0.001)), v = twin_same(md, {n}, rng.uniform(n, 0.0, 1e-4));
        Twin g = twin_same(grad_dt, {n}, rng.normal(n, 0.01));
        const std::vector<uint8_t> w_before = download_bytes(dev(), w.c());
        dev().adamw_step(rem.c(), g.c(), m.c(), v.c(), w.c(), *segs, p);
        ref().adamw_step(rem.r(), g.r(), m.r(), v.r(), w.r(), *segs, p);
        // The joined master weights on both sides (core/master_remainder.h).
        auto joined = [&](Backend& be, const Tensor& wt, const Tensor& rt) {
          const std::vector<uint8_t> wb = download_bytes(be, wt), rb = download_bytes(be, rt);
          std::vector<double> out(static_cast<size_t>(n));
          for (int64_t i = 0; i < n; ++i) {
            uint16_t hi;
            int16_t lo;
            std::memcpy(&hi, wb.data() + 2 * i, 2);
            std::memcpy(&lo, rb.data() + 2 * i, 2);
            out[static_cast<size_t>(i)] = join_master_bits(hi, lo);
          }
          return out;
        };
        const std::vector<double> jc = joined(dev(), w.c(), rem.c()), jr = joined(ref(), w.r(), rem.r());
        CHECK(rel_err(jc, jr) <= 1e-6);
        CHECK(differing(download_bytes(dev(), w.c()), download_bytes(ref(), w.r()), 2) <= n / 1000);
        if (!bf16_moments) {
          CHECK(rel_err(download(dev(), m.c()), download(ref(), m.r())) <= 1e-6);
          CHECK(rel_err(download(dev(), v.c()), download(ref(), v.r())) <= 1e-6);
        }
        // Outside the segments the weights kept their bytes; inside they moved.
        const std::vector<uint8_t> w_after = download_bytes(dev(), w.c());
        std::vector<char> inside(static_cast<size_t>(n), 0);
        for (const OptimSegment& s : *segs)
          for (int64_t i = s.offset; i < s.offset + s.count; ++i) inside[static_cast<size_t>(i)] = 1;
        int64_t outside_changed = 0, inside_changed = 0;
        for (int64_t i = 0; i < n; ++i) {
          const bool same = w_after[2 * i] == w_before[2 * i] && w_after[2 * i + 1] == w_before[2 * i + 1];
          if (inside[static_cast<size_t>(i)]) inside_changed += !same;
          else outside_changed += !same;
        }
        CHECK(outside_changed == 0);
        CHECK(inside_changed > 0);
      }
}

// Master remainders rounded to nearest even (megatrain's default master weights for bf16 runs):
// split_master as the reference's bit for bit (weights, remainders, tie bits), and AdamW over them
// on the GPU as the same GPU's update of float32 master weights with a bf16 copy, bit for bit
// (joined master weights, weights, moments), exact ties included; master_sum_squares as
// sum_squares over the float32 master weights.
TEST_CASE("cuda master remainders to nearest even: a separate float32 copy's bits", "[gpu][optimizer][precision-aware]") {
  MT_RNG(rng);
  // Values with exact ties (the low half 0x8000) every fifth element.
  auto with_ties = [](std::vector<double> v) {
    for (size_t i = 0; i < v.size(); i += 5) {
      uint32_t b;
      const float f = static_cast<float>(v[i]);
      std::memcpy(&b, &f, 4);
      b = (b & 0xFFFF0000u) | 0x8000u;
      float t;
      std::memcpy(&t, &b, 4);
      v[i] = t;
    }
    return v;
  };
  const int64_t first = 37;  // (the elements' bits start inside a word)
  auto words_for = [&](int64_t n) { return twin_same(DType::i32, {(first + n + 31) / 32}, std::vector<double>((first + n + 31) / 32, -1.0)); };
  auto bits_of = [&](Backend& be, const Tensor& words, int64_t n) {
    const std::vector<uint8_t> b = download_bytes(be, words);
    std::vector<uint8_t> out(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) out[static_cast<size_t>(i)] = tie_bit(reinterpret_cast<const uint32_t*>(b.data()), first + i);
    return out;
  };
  for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{100003}}) {
    INFO("n " << n);
    Twin master = twin_same(DType::f32, {n}, with_ties(rng.normal(n, 0.05)));
    Twin w = twin_same(DType::bf16, {n}, std::vector<double>(n, 7.0)), rem = twin_same(DType::i16, {n}, std::vector<double>(n, 3.0));
    Twin words = words_for(n);
    dev().split_master(w.c(), rem.c(), master.c(), TieBits{words.c(), first});
    ref().split_master(w.r(), rem.r(), master.r(), TieBits{words.r(), first});
    CHECK(differing(download_bytes(dev(), w.c()), download_bytes(ref(), w.r()), 2) == 0);
    CHECK(differing(download_bytes(dev(), rem.c()), download_bytes(ref(), rem.r()), 2) == 0);
    CHECK(bits_of(dev(), words.c(), n) == bits_of(ref(), words.r(), n));
    // join_master undoes it, bit for bit (and the ties-away split's join undoes that one).
    Twin back = twin_same(DType::f32, {n}, std::vector<double>(n, 0.0));
    dev().join_master(back.c(), w.c(), rem.c(), TieBits{words.c(), first});
    CHECK(download_bytes(dev(), back.c()) == download_bytes(dev(), master.c()));
    dev().split_master(w.c(), rem.c(), master.c());
    dev().fill(back.c(), 0.0);
    dev().join_master(back.c(), w.c(), rem.c(), TieBits{});
    CHECK(download_bytes(dev(), back.c()) == download_bytes(dev(), master.c()));
  }
  const int64_t n = 100003;
  const SegmentLists lists = registered_segment_lists(rng, n);
  OptimStepParams p = step_params();
  p.lr[1] = 0.0f;  // (a group whose ties stay ties)
  for (const auto* segs : {&lists.short_list, &lists.long_list})
    for (bool bf16_moments : {false, true})
      for (DType grad_dt : {DType::f32, DType::bf16}) {
        INFO(segs->size() << " segments, bf16 moments " << bf16_moments << ", grad " << dtype_name(grad_dt));
        const DType md = bf16_moments ? DType::bf16 : DType::f32;
        const std::vector<double> w0 = with_ties(rng.normal(n, 0.05)), m0 = rng.normal(n, 0.001),
                                  v0 = rng.uniform(n, 0.0, 1e-4);
        Twin master = twin_same(DType::f32, {n}, w0), copy = twin_same(DType::bf16, {n}, w0);
        Twin w = twin_same(DType::bf16, {n}, std::vector<double>(n, 0.0)), rem = twin_same(DType::i16, {n}, std::vector<double>(n, 0.0));
        Twin words = words_for(n);
        const TieBits ties{words.c(), first};
        dev().split_master(w.c(), rem.c(), master.c(), ties);
        Twin m = twin_same(md, {n}, m0), v = twin_same(md, {n}, v0), m2 = twin_same(md, {n}, m0), v2 = twin_same(md, {n}, v0);
        for (int step = 1; step <= 3; ++step) {
          p.step = step;
          Twin g = twin_same(grad_dt, {n}, rng.normal(n, 0.01));
          dev().adamw_step(master.c(), g.c(), m.c(), v.c(), copy.c(), *segs, p);
          dev().adamw_step(rem.c(), g.c(), m2.c(), v2.c(), w.c(), *segs, p, ties);
        }
        const std::vector<uint8_t> mb = download_bytes(dev(), master.c()), wb = download_bytes(dev(), w.c()),
                                   rb = download_bytes(dev(), rem.c()), tb = bits_of(dev(), words.c(), n);
        int64_t wrong_master = 0, stray = 0, ambiguous = 0;
        for (int64_t i = 0; i < n; ++i) {
          uint16_t hi;
          int16_t lo;
          std::memcpy(&hi, wb.data() + 2 * i, 2);
          std::memcpy(&lo, rb.data() + 2 * i, 2);
          const float j = join_master_even(hi, lo, tb[static_cast<size_t>(i)] != 0);
          wrong_master += std::memcmp(&j, mb.data() + 4 * i, 4) != 0;
          stray += tb[static_cast<size_t>(i)] && !master_tie_ambiguous(hi, lo);
          ambiguous += master_tie_ambiguous(hi, lo);
        }
        CHECK(wrong_master == 0);
        CHECK(stray == 0);
        CHECK(ambiguous > 1000);
        CHECK(differing(wb, download_bytes(dev(), copy.c()), 2) == 0);
        CHECK(differing(download_bytes(dev(), m.c()), download_bytes(dev(), m2.c()), 1) == 0);
        CHECK(differing(download_bytes(dev(), v.c()), download_bytes(dev(), v2.c()), 1) == 0);
        Twin plain = twin_same(DType::f32, {1}, {0.0}), joined = twin_same(DType::f32, {1}, {0.0});
        dev().sum_squares(plain.c(), master.c(), *segs, false);
        dev().master_sum_squares(joined.c(), w.c(), rem.c(), ties, *segs, false);
        CHECK(download(dev(), plain.c())[0] > 0);
        CHECK(download_bytes(dev(), plain.c()) == download_bytes(dev(), joined.c()));
      }
}

namespace {
// Checks an FP8 model copy after an update into it (both backends' results): inside each segment
// the e4m3 cast of the new master value times the segment's scale (float32 product), outside the
// bytes left as they were (7.0), and each segment's amax = max(its old value, max |new master|).
void check_fp8_copy(Backend& be, const Tensor& master, const Tensor& model, const Tensor& amax,
                    const std::vector<OptimSegment>& segs, const std::vector<float>& scales, float amax_before) {
  const std::vector<double> w = download(be, master), a = download(be, amax);
  const std::vector<uint8_t> q = download_bytes(be, model);
  const uint8_t seven = float_to_fp8_bits(DType::fp8_e4m3, 7.0f);
  std::vector<char> inside(q.size(), 0);
  int64_t wrong = 0, wrong_amax = 0;
  for (size_t k = 0; k < segs.size(); ++k) {
    float m = amax_before;
    for (int64_t i = segs[k].offset; i < segs[k].offset + segs[k].count; ++i) {
      const float v = static_cast<float>(w[static_cast<size_t>(i)]);
      wrong += q[static_cast<size_t>(i)] != float_to_fp8_bits(DType::fp8_e4m3, v * scales[k]);
      m = std::max(m, std::fabs(v));
      inside[static_cast<size_t>(i)] = 1;
    }
    wrong_amax += static_cast<float>(a[k]) != m;
  }
  for (size_t i = 0; i < q.size(); ++i) wrong += !inside[i] && q[i] != seven;
  CHECK(wrong == 0);
  CHECK(wrong_amax == 0);
}
}  // namespace

// --fp8-param-gather: the update writes the FP8 weights itself, each segment (a weight's piece)
// with its weight's scale, and maxes the new values' |max| into the weight's amax.
TEST_CASE("cuda adamw_step and sgd_step into an FP8 model copy", "[gpu][optimizer][fp8][fp8-param]") {
  MT_RNG(rng);
  const int64_t n = 100003;
  const OptimStepParams p = step_params();
  const float amax_before = 0.25f;  // kept where the new values stay below it
  constexpr int kInlineSegmentsMax = 24;  // (cuda/kernels.h: shorter lists need no registration)
  for (int count : {5, 40}) {     // inline and registered segment lists
    INFO(count << " segments");
    const std::vector<OptimSegment> plain = segments_with_gaps(rng, count, n, 3);
    std::vector<float> scales;
    for (int k = 0; k < count; ++k)  // fp8_max / amax-like values, some powers of two
      scales.push_back(k % 3 == 0 ? std::ldexp(1.0f, 4 + k % 5) : static_cast<float>(rng.uniform(1, 20.0, 900.0)[0]));
    const std::vector<double> scale_values(scales.begin(), scales.end());
    auto with_meta = [&](const Tensor& scale, const Tensor& amax) {
      std::vector<OptimSegment> s = plain;
      for (int k = 0; k < count; ++k) {
        s[static_cast<size_t>(k)].fp8_scale = scale.ptr<float>() + k;
        s[static_cast<size_t>(k)].fp8_amax = amax.ptr<float>() + k;
      }
      return s;
    };
    Twin sc = twin_same(DType::f32, {count}, scale_values);
    for (bool adam : {true, false}) {
      INFO((adam ? "adamw" : "sgd"));
      Twin am = twin_same(DType::f32, {count}, std::vector<double>(static_cast<size_t>(count), amax_before));
      const std::vector<OptimSegment> dsegs = with_meta(sc.c(), am.c()), rsegs = with_meta(sc.r(), am.r());
      if (count > kInlineSegmentsMax) dev().register_optim_segments(dsegs);
      Twin w = twin(DType::f32, {n}, rng.normal(n, 0.05)), g = twin(DType::f32, {n}, rng.normal(n, 0.01));
      Twin m = twin(DType::f32, {n}, rng.normal(n, 0.001)), v = twin(DType::f32, {n}, rng.uniform(n, 0.0, 1e-4));
      Twin model = twin_same(DType::fp8_e4m3, {n}, std::vector<double>(static_cast<size_t>(n), 7.0));
      if (adam) {
        dev().adamw_step(w.c(), g.c(), m.c(), v.c(), model.c(), dsegs, p);
        ref().adamw_step(w.r(), g.r(), m.r(), v.r(), model.r(), rsegs, p);
      } else {
        dev().sgd_step(w.c(), g.c(), m.c(), model.c(), dsegs, p);
        ref().sgd_step(w.r(), g.r(), m.r(), model.r(), rsegs, p);
      }
      MT_CHECK_CLOSE(w, 1e-6);
      check_fp8_copy(dev(), w.c(), model.c(), am.c(), plain, scales, amax_before);
      check_fp8_copy(ref(), w.r(), model.r(), am.r(), plain, scales, amax_before);
    }
  }
  // Both or neither: an FP8 copy with plain segments is refused.
  Twin w = twin(DType::f32, {n}, rng.normal(n)), g = twin(DType::f32, {n}, rng.normal(n));
  Twin m = twin(DType::f32, {n}, rng.normal(n)), v = twin(DType::f32, {n}, rng.uniform(n, 0, 1));
  Twin model = twin_same(DType::fp8_e4m3, {n}, std::vector<double>(static_cast<size_t>(n), 7.0));
  CHECK_THROWS_WITH(dev().adamw_step(w.c(), g.c(), m.c(), v.c(), model.c(), segments_with_gaps(rng, 3, n, 1), p),
                    Catch::Contains("FP8 scale"));
}

// Tensorwise FP8 without FP8 parameters: segments with an amax (OptimSegment::fp8_amax, no scale)
// get max |new weight| as the weight's cast will read it: the stored bf16/fp16 value, or the float32
// master itself without a copy; segments without one, and the bytes of the copy, are as ever.
TEST_CASE("cuda adamw_step and sgd_step take the amax of the weights they write", "[gpu][optimizer][fp8]") {
  MT_RNG(rng);
  const int64_t n = 100003;
  const OptimStepParams p = step_params();
  const float amax_before = 0.125f;  // kept where the new values stay below it
  for (int count : {5, 40}) {        // inline and registered segment lists
    const std::vector<OptimSegment> plain = segments_with_gaps(rng, count, n, 3);
    for (DType model_dt : {DType::bf16, DType::f16, DType::u8 /* u8: no model copy */}) {
      for (bool adam : {true, false}) {
        INFO(count << " segments, model copy " << dtype_name(model_dt) << ", " << (adam ? "adamw" : "sgd"));
        Twin am = twin_same(DType::f32, {count}, std::vector<double>(static_cast<size_t>(count), amax_before));
        auto with_amax = [&](const Tensor& amax) {  // every other segment takes an amax
          std::vector<OptimSegment> s = plain;
          for (int k = 0; k < count; k += 2) s[static_cast<size_t>(k)].fp8_amax = amax.ptr<float>() + k;
          return s;
        };
        const std::vector<OptimSegment> dsegs = with_amax(am.c()), rsegs = with_amax(am.r());
        if (count > 24) dev().register_optim_segments(dsegs);  // (cuda/kernels.h: kInlineSegments)
        Twin w = twin(DType::f32, {n}, rng.normal(n, 0.05)), g = twin(DType::f32, {n}, rng.normal(n, 0.01));
        Twin m = twin(DType::f32, {n}, rng.normal(n, 0.001)), v = twin(DType::f32, {n}, rng.uniform(n, 0.0, 1e-4));
        const bool copy = model_dt != DType::u8;
        const int64_t model_n = copy ? n : 1;
        Twin model = twin_same(copy ? model_dt : DType::f32, {model_n},
                               std::vector<double>(static_cast<size_t>(model_n), 7.0));
        const Tensor mc = copy ? model.c() : Tensor(), mr = copy ? model.r() : Tensor();
        if (adam) {
          dev().adamw_step(w.c(), g.c(), m.c(), v.c(), mc, dsegs, p);
          ref().adamw_step(w.r(), g.r(), m.r(), v.r(), mr, rsegs, p);
        } else {
          dev().sgd_step(w.c(), g.c(), m.c(), mc, dsegs, p);
          ref().sgd_step(w.r(), g.r(), m.r(), mr, rsegs, p);
        }
        MT_CHECK_CLOSE(w, 1e-6);
        // Each backend's amaxes against its own stored weights (the cast's source), bit for bit.
        for (Backend* be : {&dev(), &ref()}) {
          const bool on_dev = be == &dev();
          const std::vector<double> src = download(*be, copy ? (on_dev ? mc : mr) : (on_dev ? w.c() : w.r()));
          const std::vector<double> a = download(*be, on_dev ? am.c() : am.r());
          int64_t wrong = 0;
          for (int k = 0; k < count; ++k) {
            float expect = amax_before;
            const OptimSegment& seg = plain[static_cast<size_t>(k)];
            if (k % 2 == 0)
              for (int64_t i = seg.offset; i < seg.offset + seg.count; ++i)
                expect = std::max(expect, std::fabs(static_cast<float>(src[static_cast<size_t>(i)])));
            wrong += static_cast<float>(a[static_cast<size_t>(k)]) != expect;
          }
          CHECK(wrong == 0);
        }
        if (copy) CHECK(differing(download_bytes(dev(), mc), download_bytes(ref(), mr), 2) <= n / 1000);
      }
    }
  }
}

namespace {
// The gradient-norm tests' values: normal(0, 0.1) with 5% +0 and 5% -0 (count_zeros counts both).
std::vector<double> values_with_zeros(Rng& rng, int64_t n) {
  std::vector<double> values = rng.normal(n, 0.1);
  const std::vector<double> coin = rng.uniform(n, 0.0, 1.0);
  for (size_t i = 0; i < values.size(); ++i)
    if (coin[i] < 0.1) values[i] = coin[i] < 0.05 ? 0.0 : -0.0;
  return values;
}

// Their segment lists over n elements: 7 segments (inline) and 100 (registered on the GPU).
SegmentLists norm_segment_lists(Rng& rng, int64_t n) {
  SegmentLists l{segments_with_gaps(rng, 7, n, 2), segments_with_gaps(rng, 100, n, 2)};
  dev().register_optim_segments(l.long_list);
  return l;
}

// sum_squares and count_zeros of x (xc / xr: the two sides) over all of it and over both lists,
// fresh and accumulating, against the reference; the sum of squares bit for bit again.
void check_sum_squares_and_zeros(Tensor xc, Tensor xr, const SegmentLists& lists) {
  const std::vector<OptimSegment> whole;
  for (const auto* segs : {&whole, &lists.short_list, &lists.long_list})
    for (bool accumulate : {false, true}) {
      INFO(segs->size() << " segments (0 = all), accumulate " << accumulate);
      Twin ss = twin(DType::f32, {1}, {3.0}), nz = twin(DType::f32, {1}, {5.0});
      dev().sum_squares(ss.c(), xc, *segs, accumulate);
      ref().sum_squares(ss.r(), xr, *segs, accumulate);
      MT_CHECK_CLOSE(ss, 1e-6);
      dev().count_zeros(nz.c(), xc, *segs, accumulate);
      ref().count_zeros(nz.r(), xr, *segs, accumulate);
      CHECK(download(dev(), nz.c())[0] == download(ref(), nz.r())[0]);
      const auto first = download_bytes(dev(), ss.c());
      upload(dev(), ss.c(), {3.0});
      dev().sum_squares(ss.c(), xc, *segs, accumulate);
      CHECK(differing(download_bytes(dev(), ss.c()), first, 4) == 0);
    }
}
}  // namespace

TEST_CASE("cuda sum_squares and count_zeros over segments; deterministic", "[gpu][optimizer]") {
  MT_RNG(rng);
  const int64_t n = 1000003;
  const SegmentLists lists = norm_segment_lists(rng, n);
  for (DType dt : kFloatTypes) {
    INFO(dtype_name(dt));
    Twin x = twin(dt, {n}, values_with_zeros(rng, n));
    check_sum_squares_and_zeros(x.c(), x.r(), lists);
  }
}

// --grad-reduce-in-bf16: the optimizers read a bf16 gradient, each element converted to float32 on
// load (master weights, moments and the rest as with a float32 gradient), against the reference
// reading the same bf16 values: as tight as the float32 case. The gradient also starts 8 bytes
// into its buffer (four-element loads) and 2 bytes in (element loads).
TEST_CASE("cuda adamw_step and sgd_step with a bf16 gradient", "[gpu][optimizer][bf16grad]") {
  MT_RNG(rng);
  const int64_t n = 100003;
  const SegmentLists lists = registered_segment_lists(rng, n);
  const std::vector<OptimSegment>& short_list = lists.short_list;
  const OptimStepParams p = step_params();
  for (int64_t offset : {0, 4, 1})
    for (const auto* segs : {&lists.short_list, &lists.long_list})
      for (DType model_dt : {DType::bf16, DType::u8 /* u8: no model copy */}) {
        INFO("gradient at element offset " << offset << ", " << segs->size() << " segments, model copy "
                                           << (model_dt != DType::u8 ? dtype_name(model_dt) : "none"));
        OptimState k = optim_state(rng, n, model_dt);
        Twin gbuf = twin_same(DType::bf16, {n + offset}, rng.normal(n + offset, 0.01));
        const Tensor gc = gbuf.c().flat_slice(offset, n), gr = gbuf.r().flat_slice(offset, n);
        check_adamw(k, gc, gr, *segs, p, model_dt);
        check_sgd(rng, k, gc, gr, *segs, p, model_dt);
      }
  // Other gradient dtypes are refused with the op, the tensor and the dtypes it takes.
  Twin w = twin(DType::f32, {n}, rng.normal(n)), m = twin(DType::f32, {n}, rng.normal(n)),
       v = twin(DType::f32, {n}, rng.uniform(n, 0, 1));
  Buf g16(dev(), DType::f16, {n});
  CHECK_THROWS_WITH(dev().adamw_step(w.c(), g16.t, m.c(), v.c(), Tensor(), short_list, p),
                    Catch::Contains("adamw_step") && Catch::Contains("grad") && Catch::Contains("bfloat16"));
  CHECK_THROWS_WITH(dev().sgd_step(w.c(), g16.t, Tensor(), Tensor(), short_list, p),
                    Catch::Contains("sgd_step") && Catch::Contains("grad") && Catch::Contains("bfloat16"));
}

// The gradient norm and zero count of a bf16 gradient buffer, the reference reading the same bf16
// tensor; at element offsets 0, 8 (vector loads) and 1 (element loads); deterministic.
TEST_CASE("cuda sum_squares and count_zeros of a bf16 gradient", "[gpu][optimizer][bf16grad]") {
  MT_RNG(rng);
  const int64_t n = 1000003;
  const SegmentLists lists = norm_segment_lists(rng, n);
  for (int64_t offset : {0, 8, 1}) {
    INFO("offset " << offset);
    Twin xbuf = twin_same(DType::bf16, {n + offset}, values_with_zeros(rng, n + offset));
    check_sum_squares_and_zeros(xbuf.c().flat_slice(offset, n), xbuf.r().flat_slice(offset, n), lists);
  }
}

// hash_bytes: the device's hash of device memory equals core/byte_hash.h's of the same bytes (and
// so the reference backend's), bit for bit, for sizes around the word, warp and block boundaries,
// at 8-byte-aligned and unaligned starts (a slice one element in), in every parameter dtype
// (FP8 included); flipping one bit anywhere changes it.
TEST_CASE("cuda hash_bytes equals the host hash bit for bit", "[gpu][hash]") {
  MT_RNG(rng);
  Buf out(dev(), DType::i64, {1});
  auto device_hash = [&](Tensor x) {
    dev().hash_bytes(out.t, x);
    uint64_t h = 0;
    dev().copy_to_host(&h, out.t);
    return h;
  };
  for (DType dt : {DType::f32, DType::bf16, DType::f16, DType::fp8_e4m3})
    for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{3}, int64_t{4}, int64_t{7}, int64_t{255}, int64_t{2048},
                      int64_t{100003}, int64_t{3000017}}) {
      INFO(dtype_name(dt) << " elements " << n);
      const size_t es = dtype_size(dt);
      std::vector<uint8_t> bytes((static_cast<size_t>(n) + 1) * es);
      for (auto& b : bytes) b = static_cast<uint8_t>(rng.engine()());
      Buf x(dev(), dt, {n + 1});
      dev().copy_from_host(x.t, bytes.data());
      for (int64_t start : {int64_t{0}, int64_t{1}}) {
        const Tensor view = x.t.flat_slice(start, n);
        const uint64_t want = byte_hash(bytes.data() + start * es, static_cast<uint64_t>(n) * es);
        CHECK(device_hash(view) == want);
        Buf host_out(ref(), DType::i64, {1});
        Buf host_x;
        if (n > 0) {
          host_x = Buf(ref(), dt, {n});
          ref().copy_from_host(host_x.t, bytes.data() + start * es);
        }
        ref().hash_bytes(host_out.t, host_x.t);
        uint64_t r = 0;
        ref().copy_to_host(&r, host_out.t);
        CHECK(r == want);
      }
      if (n == 0) continue;
      // One flipped bit at a random byte: another hash.
      const uint64_t before = device_hash(x.t);
      const size_t at = static_cast<size_t>(rng.engine()() % bytes.size());
      bytes[at] ^= static_cast<uint8_t>(1u << (rng.engine()() % 8));
      dev().copy_from_host(x.t, bytes.data());
      const uint64_t after = device_hash(x.t);
      CHECK(after != before);
      CHECK(after == byte_hash(bytes.data(), bytes.size()));
    }
}
