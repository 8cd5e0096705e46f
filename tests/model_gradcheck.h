// The whole-model float64 gradient check shared by the model tests: every parameter's gradient
// against central differences of the objective on a subset of its elements.
#pragma once

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <functional>
#include <vector>

#include "engine/backend.h"
#include "engine/gpt_model.h"

namespace mt::test {

// g: the analytic gradient (model.grads_flat() after backward, float64). objective(): the value
// whose gradient g is, for the model's current parameters. Each parameter gets samples_per_param
// elements checked (|analytic - numeric| <= atol + rtol * max(|analytic|, |numeric|)), and must have
// some gradient (a check of zeros would prove nothing: where every sample's analytic gradient is
// zero, the first element with one is checked too); the parameters are restored afterwards.
inline void check_model_gradients(GptModel& model, Backend& be, const std::vector<double>& g,
                                  const std::function<double()>& objective, int samples_per_param, double eps,
                                  double rtol, double atol) {
  std::vector<double> w(static_cast<size_t>(model.params_flat().numel()));
  be.copy_to_host(w.data(), model.params_flat());
  for (const ParamDesc& p : model.params()) {
    const int64_t n = p.numel(), stride = std::max<int64_t>(1, n / samples_per_param);
    double worst = 0, max_grad = 0;
    // The evenly spaced samples; where dropout or absent tokens zero all of them, also the first
    // element with an analytic gradient (an ordinary one, not the largest: the differences' own
    // error grows with the gradient).
    std::vector<int64_t> ks;
    bool live = false;
    for (int64_t k = (n > samples_per_param ? 1 : 0); k < n; k += stride) {
      ks.push_back(k);
      live = live || g[static_cast<size_t>(p.offset + k)] != 0;
    }
    for (int64_t k = 0; k < n && !live; ++k)
      if (g[static_cast<size_t>(p.offset + k)] != 0) {
        ks.push_back(k);
        live = true;
      }
    for (const int64_t k : ks) {
      const size_t i = static_cast<size_t>(p.offset + k);
      const double saved = w[i];
      w[i] = saved + eps;
      be.copy_from_host(model.params_flat(), w.data());
      const double lp = objective();
      w[i] = saved - eps;
      be.copy_from_host(model.params_flat(), w.data());
      const double lm = objective();
      w[i] = saved;
      const double numeric = (lp - lm) / (2 * eps);
      const double bound = atol + rtol * std::max(std::fabs(numeric), std::fabs(g[i]));
      worst = std::max(worst, std::fabs(numeric - g[i]) / bound);
      max_grad = std::max(max_grad, std::fabs(g[i]));
      if (std::fabs(numeric - g[i]) > bound) {
        INFO(p.name << "[" << k << "]: analytic " << g[i] << " numeric " << numeric);
        CHECK(std::fabs(numeric - g[i]) <= bound);
      }
    }
    be.copy_from_host(model.params_flat(), w.data());
    INFO(p.name << ": worst error/bound " << worst << ", largest |grad| " << max_grad);
    CHECK(worst <= 1.0);
    CHECK(max_grad > 1e-7);
  }
}

}  // namespace mt::test
