#include "engine/rope_table.h"

#include <algorithm>
#include <cmath>

namespace mt {

std::vector<float> rope_inverse_frequencies(int rot_dim, double base) {
  std::vector<float> inv(static_cast<size_t>(rot_dim / 2));
  for (int i = 0; i < rot_dim / 2; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(rot_dim);
    inv[i] = 1.0f / std::pow(static_cast<float>(base), exponent);
  }
  return inv;
}

std::vector<float> llama3_scale_frequencies(const std::vector<float>& inv_freq, double factor) {
  const double low_freq_factor = 1, high_freq_factor = 4, old_context = 8192;
  const double low_freq_wavelen = old_context / low_freq_factor;
  const double high_freq_wavelen = old_context / high_freq_factor;
  std::vector<float> out(inv_freq.size());
  for (size_t i = 0; i < inv_freq.size(); ++i) {
    const float f = inv_freq[i];
    const float wavelen = static_cast<float>(2 * M_PI) / f;
    // Long wavelengths: divided by the factor; short ones: kept; in between: interpolated.
    const float scaled = wavelen > low_freq_wavelen ? static_cast<float>(f / factor) : f;
    const bool medium = !(wavelen < high_freq_wavelen) && !(wavelen > low_freq_wavelen);
    if (medium) {
      const float smooth = static_cast<float>((old_context / wavelen - low_freq_factor) /
                                              (high_freq_factor - low_freq_factor));
      out[i] = (1.0f - smooth) * scaled / static_cast<float>(factor) + smooth * scaled;
    } else {
      out[i] = scaled;
    }
  }
  return out;
}

double yarn_get_mscale(double factor, double mscale) {
  return factor <= 1 ? 1.0 : 0.1 * mscale * std::log(factor) + 1.0;
}

std::vector<float> yarn_inverse_frequencies(int rot_dim, double base, const YarnParams& y) {
  // The correction range: the dims whose wavelength fits beta_fast (beta_slow) rotations in the
  // original context, in double as Python computes them, then floored (ceiled) and clamped.
  const auto correction_dim = [&](double rotations) {
    return rot_dim * std::log(y.original_max_positions / (rotations * 2 * M_PI)) / (2 * std::log(base));
  };
  double low = correction_dim(y.beta_fast), high = correction_dim(y.beta_slow);
  if (y.round_to_int) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(rot_dim - 1));
  if (low == high) high += 0.001;
  const std::vector<float> extra = rope_inverse_frequencies(rot_dim, base);
  std::vector<float> out(extra.size());
  for (size_t i = 0; i < extra.size(); ++i) {
    // Megatron: inv_freq_inter = 1 / (factor * base^(2i/d)), all float32.
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(rot_dim);
    const float inter = 1.0f / (static_cast<float>(y.factor) * std::pow(static_cast<float>(base), exponent));
    const float ramp = std::clamp((static_cast<float>(i) - static_cast<float>(low)) / static_cast<float>(high - low),
                                  0.0f, 1.0f);
    const float mask = 1.0f - ramp;  // 1: the original (extrapolated) frequency
    out[i] = inter * (1.0f - mask) + extra[i] * mask;
  }
  return out;
}

std::vector<float> rope_cos_sin_table(const RopeTableParams& p) {
  std::vector<float> inv = p.yarn ? yarn_inverse_frequencies(p.rot_dim, p.base, *p.yarn)
                                  : rope_inverse_frequencies(p.rot_dim, p.base);
  if (p.llama3_scaling && !p.yarn) inv = llama3_scale_frequencies(inv, p.scaling_factor);
  // YaRN's concentration factor multiplies cos and sin (in float32, as Megatron's).
  const float concentration =
      p.yarn ? static_cast<float>(yarn_get_mscale(p.yarn->factor, p.yarn->mscale) /
                                  yarn_get_mscale(p.yarn->factor, p.yarn->mscale_all_dim))
             : 1.0f;
  const int half = p.rot_dim / 2;
  std::vector<float> table(static_cast<size_t>(p.positions) * p.rot_dim);
  for (int pos = 0; pos < p.positions; ++pos) {
    float t = static_cast<float>(pos);
    if (p.seq_len_interpolation_factor && !p.yarn) t *= 1.0f / static_cast<float>(*p.seq_len_interpolation_factor);
    for (int i = 0; i < half; ++i) {
      const float angle = t * inv[i];  // float32, as the torch outer product
      table[static_cast<size_t>(pos) * p.rot_dim + i] =
          static_cast<float>(std::cos(static_cast<double>(angle))) * concentration;
      table[static_cast<size_t>(pos) * p.rot_dim + half + i] =
          static_cast<float>(std::sin(static_cast<double>(angle))) * concentration;
    }
  }
  return table;
}

}  // namespace mt
