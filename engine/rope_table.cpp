#include "engine/rope_table.h"

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

std::vector<float> rope_cos_sin_table(const RopeTableParams& p) {
  std::vector<float> inv = rope_inverse_frequencies(p.rot_dim, p.base);
  if (p.llama3_scaling) inv = llama3_scale_frequencies(inv, p.scaling_factor);
  const int half = p.rot_dim / 2;
  std::vector<float> table(static_cast<size_t>(p.positions) * p.rot_dim);
  for (int pos = 0; pos < p.positions; ++pos) {
    float t = static_cast<float>(pos);
    if (p.seq_len_interpolation_factor) t *= 1.0f / static_cast<float>(*p.seq_len_interpolation_factor);
    for (int i = 0; i < half; ++i) {
      const float angle = t * inv[i];  // float32, as the torch outer product
      table[static_cast<size_t>(pos) * p.rot_dim + i] = static_cast<float>(std::cos(static_cast<double>(angle)));
      table[static_cast<size_t>(pos) * p.rot_dim + half + i] = static_cast<float>(std::sin(static_cast<double>(angle)));
    }
  }
  return table;
}

}  // namespace mt
