// CUDA vs reference: the mixture-of-experts ops. Routing (softmax pre/post, sigmoid with expert
// bias, scaling, group-limited) with the expert indices compared exactly wherever the selection
// has no near-tie; the routing backward on the same selection; the load-balancing statistics
// (deterministic), their gradient and the logged sums; the permutation plan (exact, empty experts
// included); gather, combine and the routing-weight row scaling.
#include <algorithm>
#include <cmath>
#include <numeric>

#include "tests/gpu/gpu_test_util.h"

using namespace mt;
using namespace mt::gputest;

namespace {
double sq_norm(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x * x;
  return s;
}
}  // namespace

namespace {

// Megatron's gated scores: sigmoid(z), or sqrt(softplus(z)) with torch's softplus threshold of 20.
double gated(MoeScoreFunction f, double z) {
  if (f == MoeScoreFunction::sigmoid) return 1 / (1 + std::exp(-z));
  return std::sqrt(z > 20 ? z : std::log1p(std::exp(z)));
}

std::string describe(const MoeRouting& r) {
  std::string s = "E " + std::to_string(r.experts) + " k " + std::to_string(r.topk);
  s += r.score == MoeScoreFunction::sigmoid        ? " sigmoid"
       : r.score == MoeScoreFunction::sqrtsoftplus ? " sqrtsoftplus"
       : r.pre_softmax                             ? " softmax pre"
                                                   : " softmax post";
  if (r.scaling != 0) s += " scaling " + std::to_string(r.scaling);
  if (r.num_groups > 0) s += " groups " + std::to_string(r.group_topk) + "/" + std::to_string(r.num_groups);
  return s;
}

// The rules each (E, k) runs: the three score functions, scaling, and with E % 8 == 0 eight groups
// of which 3 or 4 are kept (where they hold k experts).
std::vector<MoeRouting> rules_for(int E, int k) {
  std::vector<MoeRouting> rules = {MoeRouting::make(E, k, MoeScoreFunction::softmax, false, 0, 0, 0),
                                   MoeRouting::make(E, k, MoeScoreFunction::softmax, true, 2.5f, 0, 0),
                                   MoeRouting::make(E, k, MoeScoreFunction::sigmoid, false, 0, 0, 0),
                                   MoeRouting::make(E, k, MoeScoreFunction::sqrtsoftplus, false, 2.5f, 0, 0)};
  if (E % 8 == 0)
    for (int gk : {3, 4})
      if (gk * (E / 8) >= k) {
        rules.push_back(MoeRouting::make(E, k, gk == 3 ? MoeScoreFunction::softmax : MoeScoreFunction::sigmoid, false,
                             gk == 3 ? 0.0f : 1.5f, 8, gk));
        if (gk == 4) rules.push_back(MoeRouting::make(E, k, MoeScoreFunction::softmax, true, 0, 8, gk));
      }
  return rules;
}

// A selection boundary between two ranked values is clear when they differ by more than float32
// math can move them (a few roundings of exp, a division, sums of at most 16 terms).
// Exactly equal values come from equal inputs (equal logits, or equal sets of them in a group
// score), so both backends see the tie and break it alike: clear as well.
bool clear_gap(double a, double b) {
  return a == b || std::fabs(a - b) > 1e-5 * (std::fabs(a) + std::fabs(b)) + 1e-12;
}

std::vector<int> ranked(const std::vector<double>& v) {
  std::vector<int> order(v.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return v[a] > v[b]; });
  return order;
}

// Whether the row's routing has only clear boundaries (top-k among the eligible experts, and the
// group selection), from the logits in double.
bool clear_routing(const double* z, const std::vector<double>& bias, const MoeRouting& r) {
  const int E = r.experts, k = r.topk;
  std::vector<double> key(E);
  double m = -INFINITY, sum = 0;
  for (int e = 0; e < E; ++e) m = std::max(m, z[e]);
  for (int e = 0; e < E; ++e) sum += std::exp(z[e] - m);
  for (int e = 0; e < E; ++e) {
    if (r.score != MoeScoreFunction::softmax) key[e] = gated(r.score, z[e]) + (bias.empty() ? 0.0 : bias[e]);
    else key[e] = r.pre_softmax ? std::exp(z[e] - m) / sum : z[e];
  }
  if (r.num_groups > 0) {
    const int G = r.num_groups, size = E / G, top = k / r.group_topk;
    std::vector<double> score(G, 0.0);
    for (int g = 0; g < G; ++g) {
      std::vector<double> vals(key.begin() + g * size, key.begin() + (g + 1) * size);
      std::sort(vals.begin(), vals.end(), std::greater<double>());
      for (int i = 0; i < top; ++i) score[g] += vals[i];  // only the sum ranks the group
    }
    const std::vector<int> groups = ranked(score);
    if (r.group_topk < G && !clear_gap(score[groups[r.group_topk - 1]], score[groups[r.group_topk]])) return false;
    std::vector<char> keep(G, 0);
    for (int i = 0; i < r.group_topk; ++i) keep[groups[i]] = 1;
    for (int e = 0; e < E; ++e)
      if (!keep[e / size]) key[e] = -INFINITY;
  }
  const std::vector<int> order = ranked(key);
  if (k < E && key[order[k]] != -INFINITY && !clear_gap(key[order[k - 1]], key[order[k]])) return false;
  // Inside the top k, slots order by value: adjacent picks must be clear too (or exactly equal,
  // which both backends break to the lower index).
  for (int j = 0; j + 1 < k; ++j)
    if (!clear_gap(key[order[j]], key[order[j + 1]])) return false;
  return true;
}

// One step of dt's precision at |v| (float32: the float32 math's error instead).
double weight_tolerance(DType dt, double v) {
  const double a = std::fabs(v);
  if (dt == DType::f32 || a == 0) return 1e-5 * a + 1e-30;
  const int bits = dt == DType::bf16 ? 7 : 10;
  const double subnormal_step = dt == DType::f16 ? std::ldexp(1.0, -24) : 0.0;
  return std::max(std::ldexp(1.0, std::ilogb(a) - bits), subnormal_step) + 1e-5 * a;
}

std::vector<double> distinct_experts(Rng& rng, int64_t N, int k, const std::vector<int>& pool_in) {
  std::vector<int> pool = pool_in;
  std::vector<double> ids;
  ids.reserve(static_cast<size_t>(N * k));
  for (int64_t t = 0; t < N; ++t) {
    std::shuffle(pool.begin(), pool.end(), rng.engine());
    for (int j = 0; j < k; ++j) ids.push_back(pool[j]);
  }
  return ids;
}

}  // namespace

TEST_CASE("cuda moe_route and moe_route_backward match the reference", "[gpu][moe]") {
  MT_RNG(rng);
  for (DType dt : {DType::f32, DType::bf16, DType::f16})
    for (int64_t N : {1, 7, 333, 4099})
      for (int E : {1, 8, 64, 160})
        for (int k : {1, 2, 6, 8}) {
          if (k > E) continue;
          if (dt == DType::f16 && N != 333) continue;  // f16 on one row count: the conversions, not the shapes
          for (const MoeRouting& r : rules_for(E, k)) {
            INFO(dtype_name(dt) << " N " << N << " " << describe(r));
            std::vector<double> bias;
            Twin bias_t;
            if (r.score != MoeScoreFunction::softmax) {
              bias = rng.normal(E, 0.05);
              for (double& b : bias) b = static_cast<float>(b);
              bias_t = twin(DType::f32, {E}, bias);
            }
            // Rows (as rounded to dt) whose selection has no near-tie: a row with one is redrawn
            // (rare: float32 math could order such a pair either way). Exact ties stay.
            std::vector<double> z(static_cast<size_t>(N * E));
            int64_t redrawn = 0;
            for (int64_t t = 0; t < N; ++t)
              for (int attempt = 0;; ++attempt) {
                REQUIRE(attempt < 100);
                const std::vector<double> row = rng.normal(E, 2.0);
                for (int e = 0; e < E; ++e) z[t * E + e] = round_to(dt, row[e]);
                if (clear_routing(z.data() + t * E, bias, r)) break;
                ++redrawn;
              }
            INFO("rows redrawn for a near-tie: " << redrawn);
            CHECK(redrawn * 10 <= N + 10);  // near-ties are rare
            Twin logits = twin(dt, {N, E}, z);
            Twin probs = twin_nan(DType::f32, {N, k});
            Twin idx = twin(DType::i32, {N, k}, std::vector<double>(static_cast<size_t>(N * k), -1.0));
            dev().moe_route(probs.c(), idx.c(), logits.c(), bias_t.c(), r);
            ref().moe_route(probs.r(), idx.r(), logits.r(), bias_t.r(), r);
            const std::vector<double> gi = download(dev(), idx.c()), ri = download(ref(), idx.r());
            const std::vector<double> gp = download(dev(), probs.c()), rp = download(ref(), probs.r());
            int64_t idx_wrong = 0, p_wrong = 0, first_wrong = -1;
            for (int64_t i = 0; i < N * k; ++i) {
              const double want = round_to(dt, rp[i]), got = gp[i];
              // The GPU's weight is a value of dt (Megatron's cast), within one step of the reference's.
              const bool p_ok = std::fabs(got - want) <= weight_tolerance(dt, want) && round_to(dt, got) == got;
              idx_wrong += gi[i] != ri[i];
              p_wrong += !p_ok;
              if ((gi[i] != ri[i] || !p_ok) && first_wrong < 0) first_wrong = i;
            }
            INFO("first mismatch at row " << (first_wrong < 0 ? -1 : first_wrong / k) << " slot "
                                          << (first_wrong < 0 ? -1 : first_wrong % k));
            CHECK(idx_wrong == 0);
            CHECK(p_wrong == 0);

            // Backward on the GPU's selection, on both sides.
            Twin sel = twin(DType::i32, {N, k}, gi);
            Twin dprobs = twin(DType::f32, {N, k}, rng.normal(N * k));
            Twin aux = twin(DType::f32, {N, E}, rng.normal(N * E, 0.01));
            Twin dlogits = twin_nan(dt, {N, E});
            dev().moe_route_backward(dlogits.c(), dprobs.c(), logits.c(), sel.c(), aux.c(), r);
            ref().moe_route_backward(dlogits.r(), dprobs.r(), logits.r(), sel.r(), aux.r(), r);
            // The gradient may cancel to (near) zero (one expert: the softmax's derivative is 0), so
            // its error is bounded by the tolerance times the size of what it is made of: the
            // result, and the routing weights' gradient times the scaling factor.
            const double scale = (r.scaling != 0 ? r.scaling : 1.0) * std::sqrt(sq_norm(download(ref(), dprobs.r())));
            auto check_grad = [&](const Twin& g) {
              const std::vector<double> got = download(dev(), g.c()), want = download(ref(), g.r());
              double e2 = 0;
              for (size_t i = 0; i < got.size(); ++i) e2 += (got[i] - want[i]) * (got[i] - want[i]);
              INFO("error norm " << std::sqrt(e2) << ", result norm " << std::sqrt(sq_norm(want)) << ", input scale "
                                 << scale);
              CHECK(std::sqrt(e2) <= tol_for(dt) * (std::sqrt(sq_norm(want)) + scale));
            };
            check_grad(dlogits);
            Twin plain = twin_nan(dt, {N, E});
            dev().moe_route_backward(plain.c(), dprobs.c(), logits.c(), sel.c(), Twin().c(), r);
            ref().moe_route_backward(plain.r(), dprobs.r(), logits.r(), sel.r(), Twin().r(), r);
            check_grad(plain);
          }
        }
}

TEST_CASE("cuda moe_route refuses what its kernels cannot take", "[gpu][moe]") {
  Twin logits = twin(DType::bf16, {2, 600}, std::vector<double>(1200, 0.0));
  Twin probs = twin_nan(DType::f32, {2, 2}), idx = twin(DType::i32, {2, 2}, {0, 0, 0, 0});
  CHECK_THROWS_WITH(dev().moe_route(probs.c(), idx.c(), logits.c(), Tensor(),
                                    MoeRouting::make(600, 2, MoeScoreFunction::softmax, false, 0, 0, 0)),
                    Catch::Contains("at most 512") && Catch::Contains("--num-experts"));
  Twin l2 = twin(DType::bf16, {2, 64}, std::vector<double>(128, 0.0));
  Twin p2 = twin_nan(DType::f32, {2, 17}), i2 = twin(DType::i32, {2, 17}, std::vector<double>(34, 0.0));
  CHECK_THROWS_WITH(dev().moe_route(p2.c(), i2.c(), l2.c(), Tensor(),
                                    MoeRouting::make(64, 17, MoeScoreFunction::softmax, false, 0, 0, 0)),
                    Catch::Contains("at most 16") && Catch::Contains("--moe-router-topk"));
}

TEST_CASE("cuda moe_aux_stats (deterministic), moe_aux_grad and moe_aux_log match the reference", "[gpu][moe]") {
  MT_RNG(rng);
  for (DType dt : {DType::f32, DType::bf16})
    for (MoeScoreFunction score : {MoeScoreFunction::softmax, MoeScoreFunction::sigmoid, MoeScoreFunction::sqrtsoftplus})
      for (int64_t N : {1, 7, 333, 4099, 20011})
        for (int E : {1, 8, 64, 160})
          for (int k : {1, 2, 6, 8}) {
            if (k > E) continue;
            if (N == 20011 && (E != 160 || k != 6)) continue;  // many blocks: one shape
            const MoeRouting r = MoeRouting::make(E, k, score, false, 0, 0, 0);
            INFO(dtype_name(dt) << " N " << N << " " << describe(r));
            Twin logits = twin(dt, {N, E}, rng.normal(N * E, 2.0));
            const std::vector<double> zr = download(ref(), logits.r());
            Twin stats = twin_nan(DType::f32, {2 * E + 1});
            dev().moe_aux_stats(stats.c(), logits.c(), r);
            ref().moe_aux_stats(stats.r(), logits.r(), r);
            const std::vector<double> gs = download(dev(), stats.c()), rs = download(ref(), stats.r());
            // Score sums and the z-loss sum: float32 per row, double across rows.
            std::vector<double> g_sums(gs.begin(), gs.begin() + E), r_sums(rs.begin(), rs.begin() + E);
            CHECK(rel_err(g_sums, r_sums) <= 1e-5);
            // (lse per row in float32: an error of ~1e-7 (1 + |lse|), so lse^2 ~2e-7 (1 + lse^2) a row.)
            CHECK(std::fabs(gs[2 * E] - rs[2 * E]) <= 1e-5 * (std::fabs(rs[2 * E]) + static_cast<double>(N)));
            // Counts: exact but for rows whose aux top-k has a near-tie (each moves at most one
            // count from one expert to another).
            int64_t near_ties = 0;
            double max_lse = 0;
            for (int64_t t = 0; t < N; ++t) {
              std::vector<double> s(E);
              const double* z = zr.data() + t * E;
              double m = -INFINITY, sum = 0, total = 0;
              for (int e = 0; e < E; ++e) m = std::max(m, z[e]);
              for (int e = 0; e < E; ++e) sum += std::exp(z[e] - m);
              max_lse = std::max(max_lse, std::fabs(m + std::log(sum)));
              for (int e = 0; e < E; ++e) {
                s[e] = score == MoeScoreFunction::softmax ? std::exp(z[e] - m) / sum : gated(score, z[e]);
                total += s[e];
              }
              if (score != MoeScoreFunction::softmax)
                for (double& v : s) v /= total;
              const std::vector<int> order = ranked(s);
              if (k < E && !clear_gap(s[order[k - 1]], s[order[k]])) ++near_ties;
            }
            int64_t count_diff = 0, count_total = 0;
            for (int e = 0; e < E; ++e) {
              count_diff += static_cast<int64_t>(std::fabs(gs[E + e] - rs[E + e]));
              count_total += static_cast<int64_t>(gs[E + e]);
              CHECK(gs[E + e] == std::round(gs[E + e]));
            }
            INFO("rows with a near-tie in the aux top-k: " << near_ties);
            CHECK(count_diff <= 2 * near_ties);
            CHECK(count_total == N * k);
            // The same bits again (no float atomics).
            Twin again = twin_nan(DType::f32, {2 * E + 1});
            dev().moe_aux_stats(again.c(), logits.c(), r);
            CHECK(differing(download_bytes(dev(), again.c()), download_bytes(dev(), stats.c()), 4) == 0);

            // The gradient from one statistics tensor on both sides: the reference's sums, random
            // counts in [0, 2N] (the gradient takes any counts as constants; equal counts, as with
            // k = E, cancel exactly and leave only rounding noise to compare).
            std::vector<double> st_values = rs;
            double max_count = 0;
            for (int e = 0; e < E; ++e) {
              st_values[E + e] = rng.ints(1, 0, 2 * N + 1)[0];
              max_count = std::max(max_count, st_values[E + e]);
            }
            Twin st = twin(DType::f32, {2 * E + 1}, st_values);
            for (auto [aux_scale, z_scale] :
                 {std::pair{0.01f, 0.0f}, std::pair{0.0f, 1e-3f}, std::pair{0.02f, 2e-3f}}) {
              INFO("aux_scale " << aux_scale << " z_scale " << z_scale);
              Twin grad = twin_nan(DType::f32, {N, E});
              dev().moe_aux_grad(grad.c(), logits.c(), st.c(), aux_scale, z_scale, r);
              ref().moe_aux_grad(grad.r(), logits.r(), st.r(), aux_scale, z_scale, r);
              // Float32 math on terms up to aux_scale * max count and z_scale * 2 |lse| before they
              // cancel: 1e-5 relative, and a floor of a few float32 roundings of those terms.
              const std::vector<double> got = download(dev(), grad.c()), want = download(ref(), grad.r());
              const double floor = 2e-6 * (aux_scale * max_count + z_scale * 2 * max_lse);
              int64_t outside = 0, first = -1;
              for (size_t i = 0; i < got.size(); ++i)
                if (!(std::fabs(got[i] - want[i]) <= 1e-5 * std::fabs(want[i]) + floor)) {
                  if (first < 0) first = static_cast<int64_t>(i);
                  ++outside;
                }
              INFO("outside the bound: " << outside << " (first at " << first << "), floor " << floor);
              CHECK(outside == 0);
            }
            Twin sums = twin(DType::f32, {2}, {1.5, -0.5});
            dev().moe_aux_log(sums.c(), st.c(), 0.01f, 1e-3f);
            ref().moe_aux_log(sums.r(), st.r(), 0.01f, 1e-3f);
            dev().moe_aux_log(sums.c(), st.c(), 0.01f, 1e-3f);
            ref().moe_aux_log(sums.r(), st.r(), 0.01f, 1e-3f);
            MT_CHECK_CLOSE(sums, 1e-6);
          }
}

TEST_CASE("cuda moe_capacity_drop equals the reference's (by weight and by position, blocks of rows)", "[gpu][moe]") {
  MT_RNG(rng);
  for (const int64_t N : {7, 64, 1000})
    for (const int E : {4, 16})
      for (const int k : {1, 2}) {
        std::vector<int> pool;
        for (int e = 0; e < E; ++e) pool.push_back(e);
        Twin idx = twin(DType::i32, {N, k}, distinct_experts(rng, N, k, pool));
        std::vector<double> w = rng.normal(N * k, 1.0);
        for (size_t i = 0; i < w.size(); i += 5) w[i] = 0.25;  // ties
        Twin probs = twin(DType::f32, {N, k}, w);
        for (const int64_t block : {N, N % 2 == 0 ? N / 2 : N})
          for (const bool by_position : {false, true}) {
            INFO("N " << N << " E " << E << " k " << k << " block " << block << " by position " << by_position);
            const int64_t cap = std::max<int64_t>(1, block * k / E / 2);
            Twin kept = twin(DType::i32, {N, k}, std::vector<double>(static_cast<size_t>(N * k), 5.0));
            dev().moe_capacity_drop(kept.c(), idx.c(), probs.c(), E, cap, block, by_position);
            ref().moe_capacity_drop(kept.r(), idx.r(), probs.r(), E, cap, block, by_position);
            const std::vector<double> got = download(dev(), kept.c());
            CHECK(got == download(ref(), kept.r()));
            if (N >= 64) CHECK(std::count(got.begin(), got.end(), -1.0) > 0);  // (half the capacity needed)
          }
      }
}

TEST_CASE("cuda moe_permute_plan equals the reference's, empty experts and k = 1 included", "[gpu][moe]") {
  MT_RNG(rng);
  struct Case {
    int64_t N;
    int E, k;
  };
  std::vector<Case> cases;
  for (int64_t N : {1, 7, 333, 4099})
    for (int E : {1, 8, 64, 160})
      for (int k : {1, 2, 6, 8})
        if (k <= E) cases.push_back({N, E, k});
  cases.push_back({262144, 64, 8});  // 2M pairs: many chunks per expert
  cases.push_back({100003, 512, 6});
  cases.push_back({5000, 3000, 2});  // more experts than the router takes
  for (const Case& c : cases) {
    INFO("N " << c.N << " E " << c.E << " k " << c.k);
    // Distinct experts per row from a pool that leaves experts out where it can (empty experts).
    std::vector<int> pool;
    for (int e = 0; e < c.E; ++e)
      if (c.E < 2 * c.k + 2 || (e % 3 != 1 && e < c.E - 1)) pool.push_back(e);
    const int64_t M = c.N * c.k;
    Twin idx = twin(DType::i32, {c.N, c.k}, distinct_experts(rng, c.N, c.k, pool));
    Twin order = twin(DType::i32, {M}, std::vector<double>(static_cast<size_t>(M), -7.0));
    Twin slot_of = twin(DType::i32, {M}, std::vector<double>(static_cast<size_t>(M), -7.0));
    Twin offsets = twin(DType::i32, {c.E + 1}, std::vector<double>(static_cast<size_t>(c.E + 1), -7.0));
    dev().moe_permute_plan(order.c(), slot_of.c(), offsets.c(), idx.c(), 0, c.E);
    ref().moe_permute_plan(order.r(), slot_of.r(), offsets.r(), idx.r(), 0, c.E);
    CHECK(differing(download_bytes(dev(), order.c()), download_bytes(ref(), order.r()), 4) == 0);
    CHECK(differing(download_bytes(dev(), slot_of.c()), download_bytes(ref(), slot_of.r()), 4) == 0);
    CHECK(differing(download_bytes(dev(), offsets.c()), download_bytes(ref(), offsets.r()), 4) == 0);
    // The experts' rows added to running float64 counts, exactly.
    std::vector<double> start = rng.uniform(c.E, 0.0, 1000.0);
    for (double& v : start) v = std::floor(v);
    Twin counts = twin_same(DType::f64, {c.E}, start);
    dev().moe_count_rows(counts.c(), offsets.c());
    ref().moe_count_rows(counts.r(), offsets.r());
    CHECK(download(dev(), counts.c()) == download(ref(), counts.r()));
    // An expert-parallel rank's range (the second quarter of the experts): only its pairs placed.
    const int first = c.E / 4, count = std::max(1, c.E / 4);
    Twin lorder = twin(DType::i32, {M}, std::vector<double>(static_cast<size_t>(M), -7.0));
    Twin lslot = twin(DType::i32, {M}, std::vector<double>(static_cast<size_t>(M), -7.0));
    Twin loff = twin(DType::i32, {count + 1}, std::vector<double>(static_cast<size_t>(count + 1), -7.0));
    dev().moe_permute_plan(lorder.c(), lslot.c(), loff.c(), idx.c(), first, count);
    ref().moe_permute_plan(lorder.r(), lslot.r(), loff.r(), idx.r(), first, count);
    CHECK(differing(download_bytes(dev(), lorder.c()), download_bytes(ref(), lorder.r()), 4) == 0);
    CHECK(differing(download_bytes(dev(), lslot.c()), download_bytes(ref(), lslot.r()), 4) == 0);
    CHECK(differing(download_bytes(dev(), loff.c()), download_bytes(ref(), loff.r()), 4) == 0);
  }
}

TEST_CASE("cuda moe_gather_rows, moe_combine, moe_scale_rows and its backward match the reference", "[gpu][moe]") {
  MT_RNG(rng);
  for (int64_t N : {1, 7, 333, 4099})
    for (int k : {1, 2, 6, 8})
      for (int64_t C : {1, 7, 64, 1000, 4100}) {
        const int E = 64;
        const int64_t M = N * k;
        if (M * C > (int64_t{1} << 22)) continue;  // the reference's time and host memory, not coverage
        INFO("N " << N << " k " << k << " cols " << C);
        std::vector<int> pool(E);
        std::iota(pool.begin(), pool.end(), 0);
        Twin idx = twin(DType::i32, {N, k}, distinct_experts(rng, N, k, pool));
        Twin order = twin(DType::i32, {M}, std::vector<double>(static_cast<size_t>(M), 0.0));
        Twin slot_of = twin(DType::i32, {M}, std::vector<double>(static_cast<size_t>(M), 0.0));
        Twin offsets = twin(DType::i32, {E + 1}, std::vector<double>(E + 1, 0.0));
        ref().moe_permute_plan(order.r(), slot_of.r(), offsets.r(), idx.r(), 0, E);
        Twin ord = twin(DType::i32, {M}, download(ref(), order.r()));
        Twin slots = twin(DType::i32, {M}, download(ref(), slot_of.r()));

        // Gather moves bytes: every dtype, the same bits as the reference (which copies rows).
        for (DType dt : {DType::f32, DType::bf16, DType::f16, DType::u8, DType::f64}) {
          INFO("gather " << dtype_name(dt));
          const std::vector<double> vals = dt == DType::u8 ? rng.ints(N * C, 0, 256) : rng.normal(N * C);
          Twin x = twin_same(dt, {N, C}, vals);
          Twin out = twin_same(dt, {M, C}, std::vector<double>(static_cast<size_t>(M * C), 3.0));
          dev().moe_gather_rows(out.c(), x.c(), ord.c(), k);
          ref().moe_gather_rows(out.r(), x.r(), ord.r(), k);
          CHECK(differing(download_bytes(dev(), out.c()), download_bytes(ref(), out.r()), dtype_size(dt)) == 0);
        }
        for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
          INFO(dtype_name(dt));
          Twin y = twin(dt, {M, C}, rng.normal(M * C));
          for (bool accumulate : {false, true}) {
            INFO("combine" << (accumulate ? " accumulate" : ""));
            Twin out = twin(dt, {N, C}, rng.normal(N * C));
            dev().moe_combine(out.c(), y.c(), slots.c(), k, accumulate);
            ref().moe_combine(out.r(), y.r(), slots.r(), k, accumulate);
            MT_CHECK_CLOSE(out, tol_for(dt));
            if (k == 1 && !accumulate) {  // one term: a copy, the same bits
              const std::vector<double> got = download(dev(), out.c());
              const std::vector<double> ys = download(dev(), y.c());
              const std::vector<double> sl = download(ref(), slots.r());
              int64_t wrong = 0;
              for (int64_t t = 0; t < N; ++t)
                for (int64_t c = 0; c < C; ++c) wrong += got[t * C + c] != ys[static_cast<int64_t>(sl[t]) * C + c];
              CHECK(wrong == 0);
            }
          }
          // Row scaling by the routing weights (in place too) and its backward.
          Twin p = twin(DType::f32, {M}, rng.uniform(M, 0.0, 1.0));
          Twin x = twin(dt, {M, C}, rng.normal(M * C));
          Twin scaled = twin_nan(dt, {M, C});
          dev().moe_scale_rows(scaled.c(), x.c(), p.c());
          ref().moe_scale_rows(scaled.r(), x.r(), p.r());
          MT_CHECK_CLOSE(scaled, tol_for(dt));
          Twin inplace = twin(dt, {M, C}, download(ref(), x.r()));
          dev().moe_scale_rows(inplace.c(), inplace.c(), p.c());
          CHECK(differing(download_bytes(dev(), inplace.c()), download_bytes(dev(), scaled.c()), dtype_size(dt)) == 0);
          const std::vector<double> dy = rng.normal(M * C);
          Twin dout = twin(dt, {M, C}, dy), dx = twin_nan(dt, {M, C}), dp = twin_nan(DType::f32, {M});
          dev().moe_scale_rows_backward(dx.c(), dp.c(), dout.c(), x.c(), p.c());
          ref().moe_scale_rows_backward(dx.r(), dp.r(), dout.r(), x.r(), p.r());
          MT_CHECK_CLOSE(dx, tol_for(dt));
          {
            // float32 sums of the same products against double: each row's error bounded by the sum
            // of its terms' magnitudes (a row of N(0,1) products cancels to ~sqrt(C) of them).
            const std::vector<double> xs = download(ref(), x.r()), ds = download(ref(), dout.r());
            CHECK(rows_beyond_term_bound(download(dev(), dp.c()), download(ref(), dp.r()), M, C, 1e-6,
                                         [&](int64_t r, int64_t c) { return xs[r * C + c] * ds[r * C + c]; }) == 0);
          }
          Twin d2 = twin(dt, {M, C}, dy), dp2 = twin_nan(DType::f32, {M});
          dev().moe_scale_rows_backward(d2.c(), dp2.c(), d2.c(), x.c(), p.c());  // dx over dout
          CHECK(differing(download_bytes(dev(), d2.c()), download_bytes(dev(), dx.c()), dtype_size(dt)) == 0);
          CHECK(differing(download_bytes(dev(), dp2.c()), download_bytes(dev(), dp.c()), 4) == 0);
        }
      }
}

TEST_CASE("cuda moe_swiglu_forward and _backward: the composed ops' bits, and the reference's values", "[gpu][moe]") {
  MT_RNG(rng);
  for (int64_t R : {1, 7, 333, 2049})
    for (int64_t f : {1, 7, 64, 1000, 5632}) {
      if (R * f > (int64_t{1} << 22)) continue;  // the reference's time
      for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
        INFO("R " << R << " f " << f << " " << dtype_name(dt));
        Twin in = twin(dt, {R, 2 * f}, rng.normal(R * 2 * f, 2.0));
        Twin p = twin(DType::f32, {R}, rng.uniform(R, 0.0, 1.0));
        // Forward: the fused op (CUDA), the composed ops on the same backend, the reference.
        Twin out = twin_nan(dt, {R, f}), composed = twin_nan(dt, {R, f});
        dev().moe_swiglu_forward(out.c(), in.c(), p.c());
        ref().moe_swiglu_forward(out.r(), in.r(), p.r());
        dev().swiglu_forward(composed.c(), in.c());
        dev().moe_scale_rows(composed.c(), composed.c(), p.c());
        CHECK(differing(download_bytes(dev(), out.c()), download_bytes(dev(), composed.c()), dtype_size(dt)) == 0);
        MT_CHECK_CLOSE(out, tol_for(dt));
        // Backward: din in place of fc1's output, as the MoE block calls it.
        const std::vector<double> dy = rng.normal(R * f);
        Twin din = twin(dt, {R, 2 * f}, download(ref(), in.r())), act = twin_nan(dt, {R, f});
        Twin dout = twin(dt, {R, f}, dy), dp = twin_nan(DType::f32, {R});
        dev().moe_swiglu_backward(din.c(), act.c(), dp.c(), dout.c(), din.c(), p.c());
        ref().moe_swiglu_backward(din.r(), act.r(), dp.r(), dout.r(), din.r(), p.r());
        MT_CHECK_CLOSE(din, tol_for(dt));
        MT_CHECK_CLOSE(act, tol_for(dt));
        CHECK(differing(download_bytes(dev(), act.c()), download_bytes(dev(), out.c()), dtype_size(dt)) == 0);
        // dout is only read by the fused op.
        Twin dout_copy = twin(dt, {R, f}, dy);
        CHECK(differing(download_bytes(dev(), dout.c()), download_bytes(dev(), dout_copy.c()), dtype_size(dt)) == 0);
        // The CUDA composition (Backend's default) gives the same bits, dp included.
        Twin cdin = twin(dt, {R, 2 * f}, download(ref(), in.r())), cact = twin_nan(dt, {R, f});
        Twin cdout = twin(dt, {R, f}, dy), cdp = twin_nan(DType::f32, {R});
        dev().Backend::moe_swiglu_backward(cdin.c(), cact.c(), cdp.c(), cdout.c(), cdin.c(), p.c());
        CHECK(differing(download_bytes(dev(), din.c()), download_bytes(dev(), cdin.c()), dtype_size(dt)) == 0);
        CHECK(differing(download_bytes(dev(), act.c()), download_bytes(dev(), cact.c()), dtype_size(dt)) == 0);
        CHECK(differing(download_bytes(dev(), dp.c()), download_bytes(dev(), cdp.c()), 4) == 0);
        // dp against the reference's double sums: each row's error bounded by its terms' magnitudes.
        const std::vector<double> x = download(ref(), in.r());
        const double rel = dt == DType::f32 ? 1e-5 : 1e-2;  // 16-bit: swiglu's rounding may differ by an ulp
        CHECK(rows_beyond_term_bound(download(dev(), dp.c()), download(ref(), dp.r()), R, f, rel,
                                     [&](int64_t r, int64_t c) {
                                       const double g = x[r * 2 * f + c], u = x[r * 2 * f + f + c];
                                       return dy[r * f + c] * g / (1 + std::exp(-g)) * u;
                                     }) == 0);
      }
    }
}

TEST_CASE("cuda moe_sinkhorn_route equals the reference's choice and weights", "[gpu][moe]") {
  Rng rng;
  INFO("random seed " << rng.seed() << " (replay with MT_TEST_SEED=" << rng.seed() << ")");
  for (const DType dt : {DType::f32, DType::bf16})
    for (const int E : {2, 8})
      for (const int k : {1, 2})
        for (const bool training : {true, false}) {
          const int64_t N = 96, block = training ? 48 : N;
          INFO(dtype_name(dt) << " E " << E << " k " << k << (training ? " training" : " evaluation"));
          Twin logits = twin(dt, {N, E}, rng.normal(N * E, 2.0));
          Twin probs = twin_nan(DType::f32, {N, k});
          Twin idx = twin(DType::i32, {N, k}, std::vector<double>(static_cast<size_t>(N * k), -1.0));
          dev().moe_sinkhorn_route(probs.c(), idx.c(), logits.c(), k, block, training);
          ref().moe_sinkhorn_route(probs.r(), idx.r(), logits.r(), k, block, training);
          const std::vector<double> gi = download(dev(), idx.c()), ri = download(ref(), idx.r());
          const std::vector<double> gp = download(dev(), probs.c()), rp = download(ref(), probs.r());
          int64_t wrong = 0;
          for (size_t i = 0; i < gi.size(); ++i) wrong += gi[i] != ri[i] || gp[i] != round_to(dt, rp[i]);
          CHECK(wrong == 0);
        }
}

TEST_CASE("cuda moe_jitter equals the reference's (float32 exactly; 16-bit within one rounding), in place", "[gpu][moe]") {
  Rng rng;
  INFO("seed " << rng.seed());
  for (const DType dt : {DType::f32, DType::bf16, DType::f16})
    for (const int64_t n : {1, 333, 70001}) {
      INFO(dtype_name(dt) << ", " << n << " elements");
      const Twin x = twin(dt, {n}, rng.normal(n));
      Twin y = twin_nan(dt, {n});
      dev().moe_jitter(y.c(), x.c(), 0.05f, 0xabcdefULL, 1234);
      ref().moe_jitter(y.r(), x.r(), 0.05f, 0xabcdefULL, 1234);
      if (dt == DType::f32) CHECK(download(dev(), y.c()) == download(ref(), y.r()));
      else CHECK(rel_err(y) <= tol_for(dt));
      dev().moe_jitter(x.c(), x.c(), 0.05f, 0xabcdefULL, 1234);  // in place: the same values
      CHECK(download(dev(), x.c()) == download(dev(), y.c()));
    }
}

// The experts' linear biases: forward (with and without the routing weights), the bias gradient
// (float32 and bf16 gradients, written and accumulated) and the routing weights' share, with the
// offsets on the device (rows past offsets[E] untouched) and on the host; odd sizes, empty experts.
TEST_CASE("cuda grouped_bias_forward and _backward match the reference (device and host offsets)", "[gpu][moe]") {
  MT_RNG(rng);
  for (int64_t R : {1, 7, 333, 2049})
    for (int E : {1, 3, 8})
      for (int64_t n : {1, 5, 64, 1000}) {
        if (R * n > (int64_t{1} << 21)) continue;  // the reference's time, not coverage
        // Random cuts, some experts empty; on the device the last offset may stop short of R.
        for (bool on_device : {true, false}) {
          std::vector<int64_t> cut = {0};
          const int64_t used = on_device && R > 3 ? R - 3 : R;
          for (int e = 1; e < E; ++e) cut.push_back(rng.ints(1, 0, used + 1)[0]);
          cut.push_back(used);
          std::sort(cut.begin(), cut.end());
          if (E >= 3) cut[2] = cut[1];  // expert 1 without rows
          std::vector<double> cut_d(cut.begin(), cut.end());
          Twin offs = twin(DType::i32, {E + 1}, cut_d);
          const ExpertOffsets oc = on_device ? ExpertOffsets::on_device(offs.c()) : ExpertOffsets(cut);
          const ExpertOffsets orf = on_device ? ExpertOffsets::on_device(offs.r()) : ExpertOffsets(cut);
          const int64_t rows = on_device ? R : used;
          for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
            INFO("R " << R << " E " << E << " n " << n << " " << dtype_name(dt) << (on_device ? " device" : " host")
                      << " offsets");
            Twin bias = twin(dt, {E, n}, rng.normal(E * n));
            Twin p = twin(DType::f32, {rows}, rng.uniform(rows, 0.0, 1.0));
            for (bool scaled : {false, true}) {
              INFO((scaled ? "scaled by p" : "unscaled"));
              const std::vector<double> y0 = rng.normal(rows * n);
              Twin y = twin(dt, {rows, n}, y0);
              dev().grouped_bias_forward(y.c(), bias.c(), scaled ? p.c() : Tensor(), oc);
              ref().grouped_bias_forward(y.r(), bias.r(), scaled ? p.r() : Tensor(), orf);
              MT_CHECK_CLOSE(y, tol_for(dt));
              if (on_device && used < rows) {  // rows past offsets[E]: untouched
                const std::vector<double> got = download(dev(), y.c());
                int64_t moved = 0;
                for (int64_t i = used * n; i < rows * n; ++i) moved += got[i] != round_to(dt, y0[i]);
                CHECK(moved == 0);
              }
              const std::vector<double> dys = rng.normal(rows * n);
              Twin dy = twin(dt, {rows, n}, dys);
              const std::vector<double> dp0 = rng.normal(rows);
              Twin dp = twin(DType::f32, {rows}, dp0);
              for (bool accumulate : {false, true}) {
                INFO((accumulate ? "accumulated" : "written") << " float32 gradient");
                const std::vector<double> old = rng.normal(E * n);
                Twin db = twin(DType::f32, {E, n}, old);
                dev().grouped_bias_backward(db.c(), scaled ? dp.c() : Tensor(), dy.c(), bias.c(), scaled ? p.c() : Tensor(),
                                            oc, accumulate);
                ref().grouped_bias_backward(db.r(), scaled ? dp.r() : Tensor(), dy.r(), bias.r(), scaled ? p.r() : Tensor(),
                                            orf, accumulate);
                // Each element a float32 sum of s_r dy[r, c] over its expert's rows: within a
                // fraction of the terms' magnitudes (plus the old value's).
                const std::vector<double> got = download(dev(), db.c()), want = download(ref(), db.r());
                const std::vector<double> ps = download(ref(), p.r()), dyr = download(ref(), dy.r());
                int64_t wrong = 0;
                for (int e = 0; e < E; ++e)
                  for (int64_t c = 0; c < n; ++c) {
                    double mag = accumulate ? std::fabs(old[e * n + c]) : 0.0;
                    for (int64_t r = cut[e]; r < cut[e + 1]; ++r) mag += std::fabs((scaled ? ps[r] : 1.0) * dyr[r * n + c]);
                    wrong += std::fabs(got[e * n + c] - want[e * n + c]) > 2e-6 * mag + 1e-30;
                  }
                CHECK(wrong == 0);
                if (E >= 3 && !accumulate)  // the empty expert: zero
                  for (int64_t c = 0; c < n; ++c) CHECK(got[1 * n + c] == 0.0);
              }
              if (scaled) {  // dp after two accumulations of dy . b (rows of both calls)
                const std::vector<double> bs = download(ref(), bias.r()), dyr = download(ref(), dy.r());
                std::vector<int> e_of(static_cast<size_t>(rows), -1);
                for (int e = 0; e < E; ++e)
                  for (int64_t r = cut[e]; r < cut[e + 1]; ++r) e_of[r] = e;
                CHECK(rows_beyond_term_bound(download(dev(), dp.c()), download(ref(), dp.r()), rows, n + 1, 1e-6,
                                             [&](int64_t r, int64_t c) {
                                               if (e_of[r] < 0) return c == n ? dp0[r] : 0.0;
                                               return c == n ? dp0[r] : 2 * dyr[r * n + c] * bs[e_of[r] * n + c];
                                             }) == 0);
              }
              // bf16 gradients (--grad-reduce-in-bf16), accumulated.
              Twin db16 = twin_same(DType::bf16, {E, n}, rng.normal(E * n));
              dev().grouped_bias_backward(db16.c(), Tensor(), dy.c(), bias.c(), scaled ? p.c() : Tensor(), oc, true);
              ref().grouped_bias_backward(db16.r(), Tensor(), dy.r(), bias.r(), scaled ? p.r() : Tensor(), orf, true);
              check_bf16_grad(db16, "bias gradient");
            }
          }
        }
      }
}
