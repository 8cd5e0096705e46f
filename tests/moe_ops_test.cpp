// Reference backend, mixture-of-experts ops: routing against a brute-force router written here
// (sorts, no shared code), the routing and load-balancing gradients against float64 central
// differences with the selection held fixed, the permutation plan's properties, gather/combine
// round trips and the routing-weight row scaling.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include <fmt/format.h>

#include "core/philox.h"
#include "engine/backend.h"
#include "engine/moe_routing.h"
#include "tests/gradcheck.h"

using namespace mt;
using mt::test::Buf;

namespace {

// Indices of v sorted by value descending, equal values by index ascending (a stable sort).
std::vector<int> ranked(const std::vector<double>& v) {
  std::vector<int> order(v.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return v[a] > v[b]; });
  return order;
}

struct Routed {
  std::vector<int> idx;
  std::vector<double> p;     // before rounding to the logits' dtype
  double kth_gap = INFINITY;  // key[k-th] - key[(k+1)-th] among the eligible experts
  double group_gap = INFINITY;  // the same for the group scores at the group_topk boundary
};

// Megatron's gated scores: sigmoid(z), or sqrt(softplus(z)) with torch's softplus threshold of 20.
double gated(MoeScoreFunction f, double z) {
  if (f == MoeScoreFunction::sigmoid) return 1.0 / (1.0 + std::exp(-z));
  return std::sqrt(z > 20 ? z : std::log(1.0 + std::exp(z)));
}

const char* score_name(MoeScoreFunction f) {
  return f == MoeScoreFunction::softmax ? "softmax" : f == MoeScoreFunction::sigmoid ? "sigmoid" : "sqrtsoftplus";
}

// Megatron's router on one row, brute force: sorts instead of selection passes.
Routed brute_route(const std::vector<double>& z, const std::vector<double>& bias, const MoeRouting& r) {
  const int E = static_cast<int>(z.size()), k = r.topk;
  std::vector<double> s(E), key(E);
  if (r.score == MoeScoreFunction::softmax) {
    const double m = *std::max_element(z.begin(), z.end());
    double sum = 0;
    for (int e = 0; e < E; ++e) sum += std::exp(z[e] - m);
    for (int e = 0; e < E; ++e) s[e] = std::exp(z[e] - m) / sum;
    key = r.pre_softmax ? s : z;
  } else {
    for (int e = 0; e < E; ++e) {
      s[e] = gated(r.score, z[e]);
      key[e] = s[e] + (bias.empty() ? 0.0 : bias[e]);
    }
  }
  Routed out;
  std::vector<double> masked = key;
  if (r.num_groups > 0) {
    const int G = r.num_groups, size = E / G, m = k / r.group_topk;
    std::vector<double> score(G);
    for (int g = 0; g < G; ++g) {
      std::vector<double> vals(key.begin() + g * size, key.begin() + (g + 1) * size);
      std::sort(vals.begin(), vals.end(), std::greater<double>());
      for (int i = 0; i < m; ++i) score[g] += vals[i];
    }
    const std::vector<int> groups = ranked(score);
    // (m = 0: every group scores 0 whatever the logits; the lowest groups win, no boundary.)
    if (r.group_topk < G && m > 0) out.group_gap = score[groups[r.group_topk - 1]] - score[groups[r.group_topk]];
    std::vector<char> keep(G, 0);
    for (int i = 0; i < r.group_topk; ++i) keep[groups[i]] = 1;
    for (int e = 0; e < E; ++e)
      if (!keep[e / size]) masked[e] = -INFINITY;
  }
  const std::vector<int> order = ranked(masked);
  out.idx.assign(order.begin(), order.begin() + k);
  if (k < E && masked[order[k]] != -INFINITY) out.kth_gap = masked[order[k - 1]] - masked[order[k]];
  out.p.resize(k);
  if (r.score == MoeScoreFunction::softmax && !r.pre_softmax) {
    double m = -INFINITY, sum = 0;
    for (int j = 0; j < k; ++j) m = std::max(m, z[out.idx[j]]);
    for (int j = 0; j < k; ++j) sum += std::exp(z[out.idx[j]] - m);
    for (int j = 0; j < k; ++j) out.p[j] = std::exp(z[out.idx[j]] - m) / sum;
  } else {
    double sum = 0;
    for (int j = 0; j < k; ++j) sum += s[out.idx[j]];
    for (int j = 0; j < k; ++j) {
      out.p[j] = s[out.idx[j]];
      if (r.score != MoeScoreFunction::softmax && k > 1) out.p[j] /= sum + 1e-20;
    }
  }
  if (r.scaling != 0)
    for (double& p : out.p) p *= r.scaling;
  return out;
}

std::vector<double> row_of(const std::vector<double>& x, int64_t t, int64_t E) {
  return std::vector<double>(x.begin() + t * E, x.begin() + (t + 1) * E);
}

// The routing rules the tests sweep: every score function, pre/post softmax, scaling, groups.
std::vector<MoeRouting> rules_for(int E, int k) {
  std::vector<MoeRouting> rules;
  for (float scaling : {0.0f, 2.5f}) {
    rules.push_back(MoeRouting::make(E, k, MoeScoreFunction::softmax, false, scaling));
    rules.push_back(MoeRouting::make(E, k, MoeScoreFunction::softmax, true, scaling));
    rules.push_back(MoeRouting::make(E, k, MoeScoreFunction::sigmoid, false, scaling));
    rules.push_back(MoeRouting::make(E, k, MoeScoreFunction::sqrtsoftplus, false, scaling));
  }
  if (E % 4 == 0)
    for (int gk : {1, 2, 3})
      if (gk * (E / 4) >= k) {
        rules.push_back(MoeRouting::make(E, k, MoeScoreFunction::softmax, false, 0, 4, gk));
        rules.push_back(MoeRouting::make(E, k, MoeScoreFunction::softmax, true, 0, 4, gk));
        rules.push_back(MoeRouting::make(E, k, MoeScoreFunction::sigmoid, false, 1.5f, 4, gk));
        rules.push_back(MoeRouting::make(E, k, MoeScoreFunction::sqrtsoftplus, false, 1.5f, 4, gk));
      }
  return rules;
}

std::string describe(const MoeRouting& r) {
  return fmt::format("E {} k {} {}{} scaling {} groups {}/{}", r.experts, r.topk,
                     score_name(r.score),
                     r.score == MoeScoreFunction::softmax ? (r.pre_softmax ? " pre" : " post") : "", r.scaling,
                     r.group_topk, r.num_groups);
}

// Logits whose rows have no near-ties at any selection boundary (top-k and groups), the bias
// included: redrawn row by row until every gap is at least min_gap.
std::vector<double> separated_logits(std::mt19937_64& rng, int64_t N, const MoeRouting& r,
                                     const std::vector<double>& bias, double min_gap) {
  const int64_t E = r.experts;
  std::vector<double> z(static_cast<size_t>(N * E));
  std::normal_distribution<double> normal(0.0, 1.5);
  for (int64_t t = 0; t < N; ++t) {
    for (int attempt = 0;; ++attempt) {
      REQUIRE(attempt < 1000);
      for (int64_t e = 0; e < E; ++e) z[t * E + e] = normal(rng);
      const Routed rt = brute_route(row_of(z, t, E), bias, r);
      if (rt.kth_gap >= min_gap && rt.group_gap >= min_gap) break;
    }
  }
  return z;
}

}  // namespace

TEST_CASE("reference moe_route matches a brute-force router (ties to the lower index)", "[moe][reference]") {
  auto be = make_reference_backend(2);
  std::mt19937_64 rng(7001);
  for (int E : {1, 5, 8, 16})
    for (int k : {1, 2, 3, 4}) {
      if (k > E) continue;
      for (const MoeRouting& r : rules_for(E, k))
        for (bool integer_logits : {true, false})
          for (bool with_bias : {false, true}) {
            if (with_bias && r.score == MoeScoreFunction::softmax) continue;
            INFO(describe(r) << (integer_logits ? " integer logits" : " normal logits")
                             << (with_bias ? " bias" : ""));
            const int64_t N = 37;
            // Integer logits tie often: ties within rows and between group scores.
            std::uniform_int_distribution<int> small(-3, 3);
            Buf logits = integer_logits ? Buf::zeros({N, E}) : Buf::randn({N, E}, rng, 2.0);
            if (integer_logits)
              for (double& v : logits.d) v = small(rng);
            Buf bias = Buf::zeros({E});
            if (with_bias)
              for (double& v : bias.d) v = 0.25 * small(rng);
            Buf probs = Buf::zeros({N, k});
            Buf idx = Buf::ints({N, k}, std::vector<int32_t>(static_cast<size_t>(N * k), -1));
            be->moe_route(probs.t(), idx.t(), logits.t(), with_bias ? bias.t() : Tensor(), r);
            for (int64_t t = 0; t < N; ++t) {
              const Routed want = brute_route(row_of(logits.d, t, E), with_bias ? bias.d : std::vector<double>(), r);
              for (int j = 0; j < k; ++j) {
                INFO("row " << t << " slot " << j);
                REQUIRE(idx.i[t * k + j] == want.idx[j]);
                REQUIRE(probs.d[t * k + j] == Approx(want.p[j]).epsilon(1e-13).margin(1e-300));
              }
            }
          }
    }
}

TEST_CASE("reference moe_route: hand-made rows (ties, groups, the bias only selects)", "[moe][reference]") {
  auto be = make_reference_backend(1);
  SECTION("ties go to the lower expert, slot 0 is the largest") {
    Buf logits = Buf::zeros({1, 5});
    logits.d = {1, 3, 3, 0, 3};
    Buf probs = Buf::zeros({1, 2}), idx = Buf::ints({1, 2}, {0, 0});
    be->moe_route(probs.t(), idx.t(), logits.t(), Tensor(), MoeRouting::make(5, 2));
    CHECK(idx.i == std::vector<int32_t>{1, 2});
    CHECK(probs.d[0] == Approx(0.5));  // the softmax of two equal logits
    CHECK(probs.d[1] == Approx(0.5));
  }
  SECTION("group-limited: the best groups by the sum of their top floor(k / group_topk) logits") {
    // 3 groups of 2; k = 2, group_topk = 1: group scores are each group's top-2 sum: 1+1, 5-9, 1.5+0.
    Buf logits = Buf::zeros({1, 6});
    logits.d = {1, 1, 5, -9, 1.5, 0};
    Buf probs = Buf::zeros({1, 2}), idx = Buf::ints({1, 2}, {0, 0});
    be->moe_route(probs.t(), idx.t(), logits.t(), Tensor(), MoeRouting::make(6, 2, MoeScoreFunction::softmax, false, 0, 3, 1));
    CHECK(idx.i == std::vector<int32_t>{0, 1});  // group 0 (score 2) beats group 1 (-4) and group 2 (1.5)
    // Without groups expert 2 (logit 5) would lead.
    be->moe_route(probs.t(), idx.t(), logits.t(), Tensor(), MoeRouting::make(6, 2));
    CHECK(idx.i == std::vector<int32_t>{2, 4});
  }
  SECTION("sigmoid: the expert bias changes the selection, not the weights") {
    Buf logits = Buf::zeros({1, 4});
    logits.d = {2.0, 1.0, 0.0, -1.0};
    Buf bias = Buf::zeros({4});
    bias.d = {0, 0, 0, 10};  // expert 3 always selected
    Buf probs = Buf::zeros({1, 2}), idx = Buf::ints({1, 2}, {0, 0});
    be->moe_route(probs.t(), idx.t(), logits.t(), bias.t(), MoeRouting::make(4, 2, MoeScoreFunction::sigmoid));
    CHECK(idx.i == std::vector<int32_t>{3, 0});
    const double s3 = 1 / (1 + std::exp(1.0)), s0 = 1 / (1 + std::exp(-2.0));
    CHECK(probs.d[0] == Approx(s3 / (s3 + s0)).epsilon(1e-14));
    CHECK(probs.d[1] == Approx(s0 / (s3 + s0)).epsilon(1e-14));
    // k = 1: the raw sigmoid, times the scaling factor.
    Buf p1 = Buf::zeros({1, 1}), i1 = Buf::ints({1, 1}, {0});
    be->moe_route(p1.t(), i1.t(), logits.t(), bias.t(), MoeRouting::make(4, 1, MoeScoreFunction::sigmoid, false, 2.0f));
    CHECK(i1.i[0] == 3);
    CHECK(p1.d[0] == Approx(2.0 * s3).epsilon(1e-14));
  }
  SECTION("pre-softmax weights are not renormalized") {
    Buf logits = Buf::zeros({1, 3});
    logits.d = {0.0, 1.0, 2.0};
    Buf probs = Buf::zeros({1, 2}), idx = Buf::ints({1, 2}, {0, 0});
    be->moe_route(probs.t(), idx.t(), logits.t(), Tensor(), MoeRouting::make(3, 2, MoeScoreFunction::softmax, true));
    const double den = 1 + std::exp(1.0) + std::exp(2.0);
    CHECK(idx.i == std::vector<int32_t>{2, 1});
    CHECK(probs.d[0] == Approx(std::exp(2.0) / den).epsilon(1e-14));
    CHECK(probs.d[1] == Approx(std::exp(1.0) / den).epsilon(1e-14));
  }
}

TEST_CASE("reference moe_route: float32 logits round the weights to float32", "[moe][reference]") {
  auto be = make_reference_backend(2);
  std::mt19937_64 rng(7002);
  const int64_t N = 20, E = 8, k = 3;
  Buf logits64 = Buf::randn({N, E}, rng, 1.0);
  std::vector<float> logits32 = logits64.as_f32();
  for (const MoeRouting& r : rules_for(E, k)) {
    INFO(describe(r));
    Buf probs = Buf::zeros({N, k}), idx = Buf::ints({N, k}, std::vector<int32_t>(N * k, -1));
    be->moe_route(probs.t(), idx.t(), mt::test::f32_view(logits32, {N, E}), Tensor(), r);
    int64_t not_float = 0;
    for (int64_t t = 0; t < N; ++t) {
      std::vector<double> z(logits32.begin() + t * E, logits32.begin() + (t + 1) * E);
      const Routed want = brute_route(z, {}, r);
      for (int64_t j = 0; j < k; ++j) {
        const double got = probs.d[t * k + j];
        not_float += got != static_cast<double>(static_cast<float>(got));
        CHECK(idx.i[t * k + j] == want.idx[j]);
        CHECK(got == Approx(want.p[j]).epsilon(1e-7));  // one float32 rounding
      }
    }
    CHECK(not_float == 0);
  }
}

TEST_CASE("reference moe_route_backward matches central differences (selection fixed)", "[moe][reference][gradcheck]") {
  auto be = make_reference_backend(2);
  std::mt19937_64 rng(7003);
  const int64_t N = 6;
  for (int E : {4, 8, 12})
    for (int k : {1, 2, 3}) {
      for (const MoeRouting& r : rules_for(E, k))
        for (bool with_bias : {false, true}) {
          if (with_bias && r.score == MoeScoreFunction::softmax) continue;
          INFO(describe(r) << (with_bias ? " bias" : ""));
          Buf bias = Buf::randn({E}, rng, 0.05);
          const std::vector<double> no_bias;
          Buf logits = Buf::zeros({N, E});
          logits.d = separated_logits(rng, N, r, with_bias ? bias.d : no_bias, 1e-3);
          Buf probs = Buf::zeros({N, k}), dprobs = Buf::randn({N, k}, rng);
          Buf idx = Buf::ints({N, k}, std::vector<int32_t>(N * k, -1));
          Buf aux = Buf::randn({N, E}, rng, 0.1);
          const Tensor bias_t = with_bias ? bias.t() : Tensor();
          be->moe_route(probs.t(), idx.t(), logits.t(), bias_t, r);
          const std::vector<int32_t> fixed = idx.i;
          Buf dlogits = Buf::zeros({N, E});
          be->moe_route_backward(dlogits.t(), dprobs.t(), logits.t(), idx.t(), aux.t(), r);
          auto loss = [&] {
            be->moe_route(probs.t(), idx.t(), logits.t(), bias_t, r);
            REQUIRE(idx.i == fixed);  // the selection must not move under the perturbation
            return mt::test::dot(probs.d, dprobs.d) + mt::test::dot(aux.d, logits.d);
          };
          mt::test::check_gradient("moe_route dlogits", logits.d, dlogits.d, loss, 1e-6, 1e-9);
          // Without aux_grad: the routing part alone, zero outside the selection for post-softmax
          // and sigmoid.
          Buf plain = Buf::zeros({N, E});
          be->moe_route_backward(plain.t(), dprobs.t(), logits.t(), idx.t(), Tensor(), r);
          for (int64_t i = 0; i < N * E; ++i) CHECK(plain.d[i] == Approx(dlogits.d[i] - aux.d[i]).margin(1e-12));
          if (r.score != MoeScoreFunction::softmax || !r.pre_softmax)
            for (int64_t t = 0; t < N; ++t)
              for (int64_t e = 0; e < E; ++e)
                if (std::find(fixed.begin() + t * k, fixed.begin() + (t + 1) * k, e) == fixed.begin() + (t + 1) * k)
                  CHECK(plain.d[t * E + e] == 0.0);
        }
    }
}

namespace {
// The aux scores s~ of one row and logsumexp(z), brute force.
std::vector<double> brute_aux_scores(const std::vector<double>& z, MoeScoreFunction score, double* lse) {
  const size_t E = z.size();
  double m = -INFINITY;
  for (double v : z) m = std::max(m, v);
  double sum = 0;
  for (double v : z) sum += std::exp(v - m);
  *lse = m + std::log(sum);
  std::vector<double> s(E);
  double total = 0;
  for (size_t e = 0; e < E; ++e) {
    s[e] = score == MoeScoreFunction::softmax ? std::exp(z[e] - *lse) : gated(score, z[e]);
    total += s[e];
  }
  if (score != MoeScoreFunction::softmax)
    for (double& v : s) v /= total;
  return s;
}
}  // namespace

TEST_CASE("reference moe_aux_stats, moe_aux_log against brute force", "[moe][reference]") {
  auto be = make_reference_backend(2);
  std::mt19937_64 rng(7004);
  for (MoeScoreFunction score : {MoeScoreFunction::softmax, MoeScoreFunction::sigmoid, MoeScoreFunction::sqrtsoftplus})
    for (int E : {1, 6, 16})
      for (int k : {1, 2, 4}) {
        if (k > E) continue;
        INFO(score_name(score) << " E " << E << " k " << k);
        const int64_t N = 41;
        // Groups and bias never enter the statistics: a grouped rule gives the same numbers.
        MoeRouting r = MoeRouting::make(E, k, score);
        Buf logits = Buf::randn({N, E}, rng, 2.0);
        for (int64_t i = 0; i < N * E; i += 5) logits.d[i] = std::round(logits.d[i]);  // some ties
        Buf stats = Buf::zeros({2 * E + 1});
        be->moe_aux_stats(stats.t(), logits.t(), r);
        std::vector<double> sums(E), counts(E);
        double lse_sq = 0;
        for (int64_t t = 0; t < N; ++t) {
          double lse = 0;
          const std::vector<double> s = brute_aux_scores(row_of(logits.d, t, E), score, &lse);
          lse_sq += lse * lse;
          const std::vector<int> order = ranked(s);
          for (int e = 0; e < E; ++e) sums[e] += s[e];
          for (int j = 0; j < k; ++j) counts[order[j]] += 1;
        }
        for (int e = 0; e < E; ++e) {
          CHECK(stats.d[e] == Approx(sums[e]).epsilon(1e-12));
          CHECK(stats.d[E + e] == counts[e]);
        }
        CHECK(std::accumulate(stats.d.begin() + E, stats.d.begin() + 2 * E, 0.0) == static_cast<double>(N * k));
        CHECK(stats.d[2 * E] == Approx(lse_sq).epsilon(1e-12));
        if (E % 2 == 0 && k <= E / 2) {
          Buf grouped = Buf::zeros({2 * E + 1});
          be->moe_aux_stats(grouped.t(), logits.t(), MoeRouting::make(E, k, score, false, 3.0f, 2, 1));
          CHECK(grouped.d == stats.d);
        }

        Buf log = Buf::zeros({2});
        log.d = {0.5, -0.25};
        be->moe_aux_log(log.t(), stats.t(), 0.3f, 0.02f);
        be->moe_aux_log(log.t(), stats.t(), 0.3f, 0.02f);
        double aux = 0;
        for (int e = 0; e < E; ++e) aux += stats.d[e] * stats.d[E + e];
        CHECK(log.d[0] == Approx(0.5 + 2 * static_cast<double>(0.3f) * aux).epsilon(1e-13));
        CHECK(log.d[1] == Approx(-0.25 + 2 * static_cast<double>(0.02f) * stats.d[2 * E]).epsilon(1e-13));
      }
}

TEST_CASE("reference moe_aux_grad matches central differences of the aux and z losses", "[moe][reference][gradcheck]") {
  auto be = make_reference_backend(2);
  std::mt19937_64 rng(7005);
  const int64_t N = 7;
  for (MoeScoreFunction score : {MoeScoreFunction::softmax, MoeScoreFunction::sigmoid, MoeScoreFunction::sqrtsoftplus})
    for (int E : {1, 5, 8})
      for (int k : {1, 2})
        for (auto [aux_scale, z_scale] : {std::pair{0.7f, 0.0f}, std::pair{0.0f, 0.3f}, std::pair{1.3f, 0.05f}}) {
          if (k > E) continue;
          INFO(score_name(score)
               << " E " << E << " k " << k << " aux " << aux_scale << " z " << z_scale);
          const MoeRouting r = MoeRouting::make(E, k, score);
          Buf logits = Buf::randn({N, E}, rng, 1.5);
          Buf stats = Buf::zeros({2 * E + 1});
          be->moe_aux_stats(stats.t(), logits.t(), r);
          const std::vector<double> counts(stats.d.begin() + E, stats.d.begin() + 2 * E);  // held constant
          Buf grad = Buf::zeros({N, E});
          be->moe_aux_grad(grad.t(), logits.t(), stats.t(), aux_scale, z_scale, r);
          Buf probe = Buf::zeros({2 * E + 1});
          auto loss = [&] {
            be->moe_aux_stats(probe.t(), logits.t(), r);
            double l = 0;
            for (int e = 0; e < E; ++e) l += aux_scale * counts[e] * probe.d[e];
            return l + z_scale * probe.d[2 * E];
          };
          mt::test::check_gradient("moe_aux_grad", logits.d, grad.d, loss, 1e-6, 1e-9);
        }
  SECTION("a zero scale ignores its statistics (NaN counts with aux_scale 0)") {
    const int64_t E = 4;
    Buf logits = Buf::randn({3, E}, rng), stats = Buf::zeros({2 * E + 1}), grad = Buf::zeros({3, E});
    be->moe_aux_stats(stats.t(), logits.t(), MoeRouting::make(E, 2));
    for (int64_t e = 0; e < E; ++e) stats.d[E + e] = NAN;
    be->moe_aux_grad(grad.t(), logits.t(), stats.t(), 0.0f, 0.1f, MoeRouting::make(E, 2));
    for (double g : grad.d) CHECK(std::isfinite(g));
  }
}

namespace {
Tensor i32_view(std::vector<int32_t>& v, std::initializer_list<int64_t> dims) {
  return Tensor(v.data(), DType::i32, Device::cpu, dims);
}

// Checks a permutation plan of idx (M pairs) over experts [first, first + E) by its defining
// properties: the pairs routed inside the range placed expert-major, the others not placed.
void check_plan(const std::vector<int32_t>& idx, int first, int E, const std::vector<int32_t>& order,
                const std::vector<int32_t>& slot_of, const std::vector<int32_t>& offsets) {
  const int64_t M = static_cast<int64_t>(idx.size());
  REQUIRE(static_cast<int64_t>(order.size()) == M);
  REQUIRE(offsets.size() == static_cast<size_t>(E + 1));
  std::vector<int32_t> count(E, 0), inside;
  for (int64_t p = 0; p < M; ++p)
    if (idx[p] >= first && idx[p] < first + E) {
      ++count[idx[p] - first];
      inside.push_back(static_cast<int32_t>(p));
    } else {
      REQUIRE(slot_of[p] == -1);  // not placed
    }
  const int64_t placed = static_cast<int64_t>(inside.size());
  std::vector<int32_t> sorted(order.begin(), order.begin() + placed);
  std::sort(sorted.begin(), sorted.end());
  CHECK(sorted == inside);  // a permutation of the pairs inside the range
  CHECK(offsets[0] == 0);
  for (int e = 0; e < E; ++e) CHECK(offsets[e + 1] - offsets[e] == count[e]);
  CHECK(offsets[E] == placed);
  for (int e = 0; e < E; ++e)
    for (int32_t r = offsets[e]; r < offsets[e + 1]; ++r) {
      REQUIRE(idx[order[r]] == first + e);                 // expert-major
      if (r > offsets[e]) REQUIRE(order[r - 1] < order[r]);  // row (pair) ascending inside an expert
    }
  for (int64_t r = 0; r < placed; ++r) REQUIRE(slot_of[order[r]] == r);  // the inverse
}
}  // namespace

TEST_CASE("reference moe_permute_plan: expert-major, stable, inverse, offsets", "[moe][reference]") {
  auto be = make_reference_backend(1);
  std::mt19937_64 rng(7006);
  for (int E : {1, 3, 8, 33})
    for (int k : {1, 2, 3}) {
      if (k > E) continue;
      for (int64_t N : {0, 1, 9, 200}) {
        INFO("E " << E << " k " << k << " N " << N);
        // Distinct experts per row from a subset: the experts above E/2 (and expert 1) stay empty
        // when the subset allows.
        std::vector<int> pool;
        for (int e = 0; e < E; ++e)
          if (e != 1 && (e <= E / 2 || E < 2 * k + 2)) pool.push_back(e);
        if (static_cast<int>(pool.size()) < k) {
          pool.resize(E);
          std::iota(pool.begin(), pool.end(), 0);
        }
        std::vector<int32_t> ids;
        for (int64_t t = 0; t < N; ++t) {
          std::shuffle(pool.begin(), pool.end(), rng);
          for (int j = 0; j < k; ++j) ids.push_back(pool[j]);
        }
        const int64_t M = N * k;
        // Plain int32 views (no rows: empty views of int32 type).
        std::vector<int32_t> order(M, -1), slot_of(M, -1), offsets(E + 1, -1);
        be->moe_permute_plan(i32_view(order, {M}), i32_view(slot_of, {M}), i32_view(offsets, {E + 1}),
                             i32_view(ids, {N, k}), 0, E);
        check_plan(ids, 0, E, order, slot_of, offsets);
        // One expert-parallel rank's range of the experts (the middle third, or the last expert).
        const int first = E / 3, count = std::max(1, E / 3);
        std::vector<int32_t> lorder(M, -1), lslot(M, 7), loff(count + 1, -1);
        be->moe_permute_plan(i32_view(lorder, {M}), i32_view(lslot, {M}), i32_view(loff, {count + 1}),
                             i32_view(ids, {N, k}), first, count);
        check_plan(ids, first, count, lorder, lslot, loff);
      }
    }
  SECTION("a hand-checked plan") {
    // rows: (2, 0), (0, 1), (2, 1) over 3 experts.
    Buf idx = Buf::ints({3, 2}, {2, 0, 0, 1, 2, 1});
    Buf order = Buf::ints({6}, std::vector<int32_t>(6)), slot_of = Buf::ints({6}, std::vector<int32_t>(6));
    Buf offsets = Buf::ints({4}, std::vector<int32_t>(4));
    be->moe_permute_plan(order.t(), slot_of.t(), offsets.t(), idx.t(), 0, 3);
    CHECK(order.i == std::vector<int32_t>{1, 2, 3, 5, 0, 4});
    CHECK(slot_of.i == std::vector<int32_t>{4, 0, 1, 2, 5, 3});
    CHECK(offsets.i == std::vector<int32_t>{0, 2, 4, 6});
    // moe_count_rows adds each expert's rows to running float64 counts.
    Buf counts = Buf::zeros({3});
    counts.d = {10, 0, 2.5};
    be->moe_count_rows(counts.t(), offsets.t());
    CHECK(counts.d == std::vector<double>{12, 2, 4.5});
    be->moe_count_rows(counts.t(), offsets.t());
    CHECK(counts.d == std::vector<double>{14, 4, 6.5});
    Buf counts32 = Buf::ints({3}, {0, 0, 0});  // counts must be float64
    CHECK_THROWS(be->moe_count_rows(counts32.t(), offsets.t()));
  }
  SECTION("a hand-checked plan of experts 1 and 2 (an expert-parallel rank's): expert 0's pairs not placed") {
    Buf idx = Buf::ints({3, 2}, {2, 0, 0, 1, 2, 1});
    Buf order = Buf::ints({6}, std::vector<int32_t>(6, 9)), slot_of = Buf::ints({6}, std::vector<int32_t>(6));
    Buf offsets = Buf::ints({3}, std::vector<int32_t>(3));
    be->moe_permute_plan(order.t(), slot_of.t(), offsets.t(), idx.t(), 1, 2);
    CHECK(order.i == std::vector<int32_t>{3, 5, 0, 4, 9, 9});
    CHECK(slot_of.i == std::vector<int32_t>{2, -1, -1, 0, 3, 1});
    CHECK(offsets.i == std::vector<int32_t>{0, 2, 4});
  }
  SECTION("an expert index outside the range is not placed") {
    Buf idx = Buf::ints({2}, {0, 3});
    Buf order = Buf::ints({2}, {5, 5}), slot_of = Buf::ints({2}, {0, 0}), offsets = Buf::ints({4}, {9, 9, 9, 9});
    be->moe_permute_plan(order.t(), slot_of.t(), offsets.t(), idx.t(), 0, 3);
    CHECK(slot_of.i == std::vector<int32_t>{0, -1});
    CHECK(order.i == std::vector<int32_t>{0, 5});
    CHECK(offsets.i == std::vector<int32_t>{0, 1, 1, 1});
  }
}

TEST_CASE("reference moe_gather_rows and moe_combine: round trips", "[moe][reference]") {
  auto be = make_reference_backend(2);
  std::mt19937_64 rng(7007);
  for (int k : {1, 2, 4}) {
    INFO("k " << k);
    const int64_t N = 13, E = 6, C = 5, M = N * k;
    Buf logits = Buf::randn({N, E}, rng);
    Buf probs = Buf::zeros({N, k}), idx = Buf::ints({N, k}, std::vector<int32_t>(M));
    be->moe_route(probs.t(), idx.t(), logits.t(), Tensor(), MoeRouting::make(E, k, MoeScoreFunction::softmax, k == 1));
    Buf order = Buf::ints({M}, std::vector<int32_t>(M)), slot_of = Buf::ints({M}, std::vector<int32_t>(M));
    Buf offsets = Buf::ints({E + 1}, std::vector<int32_t>(E + 1));
    be->moe_permute_plan(order.t(), slot_of.t(), offsets.t(), idx.t(), 0, static_cast<int>(E));

    Buf x = Buf::randn({N, C}, rng), xp = Buf::zeros({M, C});
    be->moe_gather_rows(xp.t(), x.t(), order.t(), k);
    for (int64_t r = 0; r < M; ++r)
      for (int64_t c = 0; c < C; ++c) REQUIRE(xp.d[r * C + c] == x.d[(order.i[r] / k) * C + c]);
    // The routing weights in permuted order: a k = 1 gather of probs viewed [M, 1].
    Buf pp = Buf::zeros({M, 1});
    Tensor probs_rows = probs.t().view({M, 1});
    be->moe_gather_rows(pp.t(), probs_rows, order.t(), 1);
    for (int64_t r = 0; r < M; ++r) REQUIRE(pp.d[r] == probs.d[order.i[r]]);
    // Any dtype: int32 rows move bit for bit.
    std::vector<int32_t> xi(static_cast<size_t>(N * C)), xo(static_cast<size_t>(M * C));
    for (auto& v : xi) v = static_cast<int32_t>(rng());
    be->moe_gather_rows(Tensor(xo.data(), DType::i32, Device::cpu, {M, C}),
                        Tensor(xi.data(), DType::i32, Device::cpu, {N, C}), order.t(), k);
    for (int64_t r = 0; r < M; ++r) REQUIRE(xo[r * C + 2] == xi[(order.i[r] / k) * C + 2]);

    // Weighted by the routing weights inside the "experts", combined: sum_j p_j x.
    Buf y = Buf::zeros({M, C});
    be->moe_scale_rows(y.t(), xp.t(), pp.t().view({M}));
    Buf out = Buf::zeros({N, C});
    be->moe_combine(out.t(), y.t(), slot_of.t(), k, false);
    for (int64_t t = 0; t < N; ++t) {
      double psum = 0;
      for (int j = 0; j < k; ++j) psum += probs.d[t * k + j];
      for (int64_t c = 0; c < C; ++c) REQUIRE(out.d[t * C + c] == Approx(psum * x.d[t * C + c]).epsilon(1e-14));
    }
    // Unweighted: the k copies of each row sum to k x; with accumulate, added to what is there.
    Buf acc = Buf::randn({N, C}, rng);
    const std::vector<double> before = acc.d;
    be->moe_combine(acc.t(), xp.t(), slot_of.t(), k, true);
    for (int64_t i = 0; i < N * C; ++i) REQUIRE(acc.d[i] == Approx(before[i] + k * x.d[i]).epsilon(1e-14));
    // The backward of the gather: combine of a gradient over the permuted rows.
    Buf dxp = Buf::randn({M, C}, rng), dx = Buf::zeros({N, C});
    be->moe_combine(dx.t(), dxp.t(), slot_of.t(), k, false);
    auto loss = [&] {
      be->moe_gather_rows(xp.t(), x.t(), order.t(), k);
      return mt::test::dot(xp.d, dxp.d);
    };
    mt::test::check_gradient("moe_gather_rows dx", x.d, dx.d, loss);
    if (k == 1) {  // a plain permutation: exact round trip
      Buf back = Buf::zeros({N, C});
      be->moe_gather_rows(xp.t(), x.t(), order.t(), 1);
      be->moe_combine(back.t(), xp.t(), slot_of.t(), 1, false);
      CHECK(back.d == x.d);
    }
  }
}

TEST_CASE("moe_capacity_drop: each expert keeps its capacity of pairs by weight or by position, per block",
          "[moe][reference]") {
  auto be = make_reference_backend(1);
  // 4 rows x top-2 over 3 experts; expert 0 is chosen by every row.
  Buf idx = Buf::ints({4, 2}, {0, 1, 2, 0, 0, 1, 0, 2});
  Buf probs = Buf::zeros({4, 2});
  probs.d = {0.5, 0.2, 0.6, 0.3, 0.9, 0.1, 0.3, 0.25};
  Buf kept = Buf::ints({4, 2}, std::vector<int32_t>(8, 7));
  SECTION("by weight, capacity 2 over all 4 rows: expert 0 keeps rows 2 (0.9) and 0 (0.5); expert 1 its 2, expert 2 its 2") {
    be->moe_capacity_drop(kept.t(), idx.t(), probs.t(), 3, 2, 4, false);
    CHECK(kept.i == std::vector<int32_t>{0, 1, 2, -1, 0, 1, -1, 2});
  }
  SECTION("by position, capacity 2: expert 0 keeps rows 0 and 1") {
    be->moe_capacity_drop(kept.t(), idx.t(), probs.t(), 3, 2, 4, true);
    CHECK(kept.i == std::vector<int32_t>{0, 1, 2, 0, -1, 1, -1, 2});
  }
  SECTION("by weight, capacity 1 in blocks of 2 rows (two sequence-parallel ranks' rows)") {
    // Block 0 (rows 0, 1): expert 0 keeps row 0 (0.5 > 0.3). Block 1 (rows 2, 3): row 2 (0.9 > 0.3).
    be->moe_capacity_drop(kept.t(), idx.t(), probs.t(), 3, 1, 2, false);
    CHECK(kept.i == std::vector<int32_t>{0, 1, 2, -1, 0, 1, -1, 2});
  }
  SECTION("equal weights keep the lower row; a capacity at least the count drops nothing") {
    probs.d = {0.5, 0.2, 0.6, 0.5, 0.5, 0.1, 0.5, 0.25};
    be->moe_capacity_drop(kept.t(), idx.t(), probs.t(), 3, 1, 4, false);
    CHECK(kept.i == std::vector<int32_t>{0, 1, 2, -1, -1, -1, -1, -1});
    be->moe_capacity_drop(kept.t(), idx.t(), probs.t(), 3, 4, 4, false);
    CHECK(kept.i == idx.i);
  }
}

TEST_CASE("moe_expert_bias_update: Megatron's sign rule towards the mean load", "[moe]") {
  // Counts 6, 2, 4, 4 (mean 4): the busy expert's bias falls, the idle one's rises, the others stay.
  std::vector<float> b = {0.5f, -0.25f, 0.0f, 1.0f};
  const std::vector<double> c = {6, 2, 4, 4};
  moe_expert_bias_update(b.data(), c.data(), 4, 0.125f);
  CHECK(b == std::vector<float>{0.375f, -0.125f, 0.0f, 1.0f});
  // Float arithmetic: a rate below the bias's resolution leaves it unchanged.
  std::vector<float> big = {1024.0f, 1024.0f};
  const std::vector<double> c2 = {1, 3};
  moe_expert_bias_update(big.data(), c2.data(), 2, 1e-5f);
  CHECK(big == std::vector<float>{1024.0f, 1024.0f});
}

TEST_CASE("reference moe ops under expert parallelism: ranks' partial combines sum to the whole", "[moe][reference]") {
  // Each expert-parallel rank plans only its experts' pairs, gathers only those rows (a not-placed
  // index gives a zero row), and its combine skips the other ranks' slots; the ranks' combined
  // outputs sum to the one-rank combine.
  auto be = make_reference_backend(1);
  std::mt19937_64 rng(7008);
  const int64_t N = 17, E = 6, C = 4, k = 2, M = N * k;
  Buf logits = Buf::randn({N, E}, rng);
  Buf probs = Buf::zeros({N, k}), idx = Buf::ints({N, k}, std::vector<int32_t>(M));
  be->moe_route(probs.t(), idx.t(), logits.t(), Tensor(), MoeRouting::make(E, k));
  Buf x = Buf::randn({N, C}, rng);
  Buf order = Buf::ints({M}, std::vector<int32_t>(M)), slot_of = Buf::ints({M}, std::vector<int32_t>(M));
  Buf offsets = Buf::ints({E + 1}, std::vector<int32_t>(E + 1));
  be->moe_permute_plan(order.t(), slot_of.t(), offsets.t(), idx.t(), 0, static_cast<int>(E));
  Buf xp = Buf::zeros({M, C}), whole = Buf::zeros({N, C});
  be->moe_gather_rows(xp.t(), x.t(), order.t(), k);
  be->moe_combine(whole.t(), xp.t(), slot_of.t(), k, false);
  Buf sum = Buf::zeros({N, C});
  int64_t placed_total = 0;
  for (int first : {0, 2, 4}) {  // EP = 3: two experts per rank
    Buf lorder = Buf::ints({M}, std::vector<int32_t>(M, -5)), lslot = Buf::ints({M}, std::vector<int32_t>(M));
    Buf loff = Buf::ints({3}, std::vector<int32_t>(3));
    be->moe_permute_plan(lorder.t(), lslot.t(), loff.t(), idx.t(), first, 2);
    const int64_t R = loff.i[2];
    placed_total += R;
    Buf lx = Buf::zeros({R, C});
    be->moe_gather_rows(lx.t(), x.t(), lorder.t().flat_slice(0, R), k);
    be->moe_combine(sum.t(), lx.t(), lslot.t(), k, true);
    // The whole order as the index: the rows past R are not placed here and come back zero.
    Buf all = Buf::randn({M, C}, rng);
    Buf lorder_neg = lorder;
    for (int64_t r = R; r < M; ++r) lorder_neg.i[static_cast<size_t>(r)] = -1;
    be->moe_gather_rows(all.t(), x.t(), lorder_neg.t(), k);
    for (int64_t r = R; r < M; ++r)
      for (int64_t c = 0; c < C; ++c) REQUIRE(all.d[r * C + c] == 0.0);
  }
  CHECK(placed_total == M);
  for (int64_t i = 0; i < N * C; ++i) REQUIRE(sum.d[i] == Approx(whole.d[i]).epsilon(1e-14));
}

TEST_CASE("reference moe_scale_rows and its backward (central differences, in place)", "[moe][reference][gradcheck]") {
  auto be = make_reference_backend(2);
  std::mt19937_64 rng(7008);
  const int64_t R = 9, C = 7;
  Buf x = Buf::randn({R, C}, rng), p = Buf::randn({R}, rng), y = Buf::zeros({R, C}), dy = Buf::randn({R, C}, rng);
  auto loss = [&] {
    be->moe_scale_rows(y.t(), x.t(), p.t());
    return mt::test::dot(y.d, dy.d);
  };
  loss();
  for (int64_t r = 0; r < R; ++r) CHECK(y.d[r * C + 3] == x.d[r * C + 3] * p.d[r]);
  Buf dx = Buf::zeros({R, C}), dp = Buf::zeros({R});
  be->moe_scale_rows_backward(dx.t(), dp.t(), dy.t(), x.t(), p.t());
  mt::test::check_gradient("moe_scale_rows dx", x.d, dx.d, loss);
  mt::test::check_gradient("moe_scale_rows dp", p.d, dp.d, loss);
  // In place: out over x, dx over dout.
  loss();  // y of the unperturbed x and p
  Buf xi = Buf::zeros({R, C});
  xi.d = x.d;
  be->moe_scale_rows(xi.t(), xi.t(), p.t());
  CHECK(xi.d == y.d);
  Buf d2 = Buf::zeros({R, C}), dp2 = Buf::zeros({R});
  d2.d = dy.d;
  be->moe_scale_rows_backward(d2.t(), dp2.t(), d2.t(), x.t(), p.t());
  CHECK(d2.d == dx.d);
  CHECK(dp2.d == dp.d);
  // float32 rows: one rounding of the double product; dp stays float32 of the double sum.
  std::vector<float> x32 = x.as_f32(), out32(static_cast<size_t>(R * C));
  std::vector<float> p32 = p.as_f32();
  be->moe_scale_rows(mt::test::f32_view(out32, {R, C}), mt::test::f32_view(x32, {R, C}), mt::test::f32_view(p32, {R}));
  for (int64_t i = 0; i < R * C; ++i)
    CHECK(out32[i] == static_cast<float>(static_cast<double>(x32[i]) * static_cast<double>(p32[i / C])));
}

TEST_CASE("reference moe_swiglu_forward and _backward: swiglu(in) * p and its gradients (central differences)",
          "[moe][reference][gradcheck]") {
  auto be = make_reference_backend(2);
  std::mt19937_64 rng(7019);
  const int64_t R = 5, f = 6;
  Buf in = Buf::randn({R, 2 * f}, rng), p = Buf::randn({R}, rng), y = Buf::zeros({R, f}), dy = Buf::randn({R, f}, rng);
  auto loss = [&] {
    be->moe_swiglu_forward(y.t(), in.t(), p.t());
    return mt::test::dot(y.d, dy.d);
  };
  loss();
  for (int64_t r = 0; r < R; ++r) {
    const double g = in.d[r * 2 * f + 2], u = in.d[r * 2 * f + f + 2];
    CHECK(y.d[r * f + 2] == Approx(g / (1 + std::exp(-g)) * u * p.d[r]).epsilon(1e-12));
  }
  // The backward: din in place of a copy of in, act = the forward's output again, dout clobbered.
  Buf din = Buf::zeros({R, 2 * f}), act = Buf::zeros({R, f}), dp = Buf::zeros({R}), dout = Buf::zeros({R, f});
  din.d = in.d;
  dout.d = dy.d;
  be->moe_swiglu_backward(din.t(), act.t(), dp.t(), dout.t(), din.t(), p.t());
  CHECK(act.d == y.d);
  mt::test::check_gradient("moe_swiglu in", in.d, din.d, loss);
  mt::test::check_gradient("moe_swiglu p", p.d, dp.d, loss);
}

TEST_CASE("reference moe ops refuse bad routing rules with a clear message", "[moe][reference]") {
  auto be = make_reference_backend(1);
  Buf logits = Buf::zeros({2, 6}), probs = Buf::zeros({2, 2}), idx = Buf::ints({2, 2}, {0, 0, 0, 0});
  CHECK_THROWS_WITH(be->moe_route(probs.t(), idx.t(), logits.t(), Tensor(), MoeRouting::make(5, 2)),
                    Catch::Contains("6 columns"));
  Buf p7 = Buf::zeros({2, 7}), i7 = Buf::ints({2, 7}, std::vector<int32_t>(14));
  CHECK_THROWS_WITH(be->moe_route(p7.t(), i7.t(), logits.t(), Tensor(), MoeRouting::make(6, 7)),
                    Catch::Contains("--moe-router-topk"));
  CHECK_THROWS_WITH(be->moe_route(probs.t(), idx.t(), logits.t(), Tensor(), MoeRouting::make(6, 2, MoeScoreFunction::softmax,
                                                                                   false, 0, 4, 1)),
                    Catch::Contains("--moe-router-num-groups"));
  CHECK_THROWS_WITH(be->moe_route(probs.t(), idx.t(), logits.t(), Tensor(), MoeRouting::make(6, 2, MoeScoreFunction::softmax,
                                                                                   false, 0, 3, 4)),
                    Catch::Contains("--moe-router-group-topk"));
  // 1 of 6 groups holds one expert: fewer than k = 2.
  CHECK_THROWS_WITH(be->moe_route(probs.t(), idx.t(), logits.t(), Tensor(), MoeRouting::make(6, 2, MoeScoreFunction::softmax,
                                                                                   false, 0, 6, 1)),
                    Catch::Contains("fewer than top-k"));
}

TEST_CASE("reference grouped linear ops: one GEMM per expert, offsets on the host or on the device",
          "[moe][reference]") {
  auto be = make_reference_backend(1);
  std::mt19937_64 rng(7017);
  const int64_t E = 3, N = 4, K = 3, R = 5, pad = 2;  // experts of 2, 0 and 3 rows
  const std::vector<int64_t> off{0, 2, 2, 5};
  Buf off32 = Buf::ints({E + 1}, {0, 2, 2, 5});
  const ExpertOffsets on_device = ExpertOffsets::on_device(off32.t());
  Buf x = Buf::randn({R + pad, K}, rng), w = Buf::randn({E * N, K}, rng), dy = Buf::randn({R + pad, N}, rng);
  const auto expert_of = [&](int64_t r) { return r < 2 ? 0 : 2; };

  // Forward: y[r, n] = x[r] . w[e N + n]; with device offsets the rows past offsets[E] stay as they were.
  Buf y_host = Buf::zeros({R, N}), y_dev = Buf::zeros({R + pad, N});
  be->grouped_linear_forward(y_host.t(), x.t().row_slice(0, R), w.t(), off);
  be->grouped_linear_forward(y_dev.t(), x.t(), w.t(), on_device);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t n = 0; n < N; ++n) {
      double want = 0;
      for (int64_t k = 0; k < K; ++k) want += x.d[r * K + k] * w.d[(expert_of(r) * N + n) * K + k];
      CHECK(y_host.d[r * N + n] == Approx(want).epsilon(1e-12));
      CHECK(y_dev.d[r * N + n] == y_host.d[r * N + n]);
    }
  for (int64_t i = R * N; i < (R + pad) * N; ++i) CHECK(y_dev.d[i] == 0.0);

  // Input gradient: dx[r] = dy[r] . w_e, the same both ways, the padding rows untouched.
  Buf dx_host = Buf::zeros({R, K}), dx_dev = Buf::zeros({R + pad, K});
  be->grouped_linear_backward_input(dx_host.t(), dy.t().row_slice(0, R), w.t(), off);
  be->grouped_linear_backward_input(dx_dev.t(), dy.t(), w.t(), on_device);
  for (int64_t i = 0; i < R * K; ++i) CHECK(dx_dev.d[i] == dx_host.d[i]);
  for (int64_t i = R * K; i < (R + pad) * K; ++i) CHECK(dx_dev.d[i] == 0.0);
  double dx00 = 0;  // dx[0, 0] = sum_n dy[0, n] w[n, 0] (expert 0)
  for (int64_t n = 0; n < N; ++n) dx00 += dy.d[n] * w.d[n * K];
  CHECK(dx_host.d[0] == Approx(dx00).epsilon(1e-12));

  // Weight gradient: the empty expert's zeroed (written) or kept (accumulated), the padding rows not read.
  for (const bool accumulate : {false, true}) {
    INFO((accumulate ? "accumulate" : "write"));
    Buf dw_host = Buf::randn({E * N, K}, rng);
    Buf dw_dev = dw_host;
    const std::vector<double> start = dw_host.d;
    be->grouped_linear_backward_weight(dw_host.t(), dy.t().row_slice(0, R), x.t().row_slice(0, R), off,
                                       accumulate);
    be->grouped_linear_backward_weight(dw_dev.t(), dy.t(), x.t(), on_device, accumulate);
    CHECK(dw_dev.d == dw_host.d);
    for (int64_t i = N * K; i < 2 * N * K; ++i) CHECK(dw_host.d[i] == (accumulate ? start[i] : 0.0));
    double want = accumulate ? start[0] : 0.0;  // dw[0, 0] = sum over expert 0's rows of dy[r, 0] x[r, 0]
    for (int64_t r = 0; r < 2; ++r) want += dy.d[r * N] * x.d[r * K];
    CHECK(dw_host.d[0] == Approx(want).epsilon(1e-12));
  }

  // Host offsets must end at the operands' rows; device offsets must not pass them.
  Buf y_short = Buf::zeros({R + pad, N});
  CHECK_THROWS(be->grouped_linear_forward(y_short.t(), x.t(), w.t(), off));
  Buf far = Buf::ints({E + 1}, {0, 2, 2, static_cast<int32_t>(R + pad + 1)});
  CHECK_THROWS(be->grouped_linear_forward(y_short.t(), x.t(), w.t(), ExpertOffsets::on_device(far.t())));
}

TEST_CASE("reference moe_jitter: factors in [1 - eps, 1 + eps] from the key and flat index, in place, by slices",
          "[moe][reference]") {
  auto be = make_reference_backend(2);
  std::mt19937_64 rng(7021);
  const float eps = 0.25f;
  const uint64_t key = 0x5eedULL;
  Buf x = Buf::randn({37, 11}, rng), y = Buf::zeros({37, 11});
  be->moe_jitter(y.t(), x.t(), eps, key, 0);
  double mean = 0;
  int64_t outside = 0, unchanged = 0;
  for (size_t i = 0; i < x.d.size(); ++i) {
    const float factor = (1.0f - eps) + (2.0f * eps) * uniform_at(key, i);
    CHECK(y.d[i] == x.d[i] * static_cast<double>(factor));
    const double f = y.d[i] / x.d[i];
    outside += f < 1.0 - eps - 1e-6 || f > 1.0 + eps + 1e-6;
    unchanged += f == 1.0;
    mean += f;
  }
  CHECK(outside == 0);
  CHECK(unchanged == 0);
  CHECK(std::fabs(mean / static_cast<double>(x.d.size()) - 1.0) < 0.03);  // 407 draws, sd of the mean 0.007
  // Rows 20.. with index0 = 20 * 11 draw the same factors as those rows of the whole tensor.
  Buf tail = Buf::zeros({17, 11}), out = Buf::zeros({17, 11});
  std::copy(x.d.begin() + 20 * 11, x.d.end(), tail.d.begin());
  be->moe_jitter(out.t(), tail.t(), eps, key, 20 * 11);
  CHECK(std::equal(out.d.begin(), out.d.end(), y.d.begin() + 20 * 11));
  // In place; another key draws other factors; eps 0 is the identity.
  Buf z = x;
  be->moe_jitter(z.t(), z.t(), eps, key, 0);
  CHECK(z.d == y.d);
  be->moe_jitter(z.t(), x.t(), eps, key + 1, 0);
  CHECK(z.d != y.d);
  be->moe_jitter(z.t(), x.t(), 0.0f, key, 0);
  CHECK(z.d == x.d);
  Buf small = Buf::zeros({5, 11});
  CHECK_THROWS(be->moe_jitter(small.t(), x.t(), eps, key, 0));
}
