// The rotary-embedding cos/sin table, computed once on the host (shared by both backends) and
// uploaded: float32 [positions, rot_dim], per row the cos of the rot_dim/2 frequencies, then
// their sin. Frequencies as Megatron's RotaryEmbedding: inv_freq_i = 1 / base^(2i/rot_dim) in
// float32, optionally Llama 3.x scaled (--use-rope-scaling) and position-interpolated, or YaRN's.
#pragma once

#include <optional>
#include <vector>

namespace mt {

// YaRN (Megatron's YarnRotaryEmbedding): frequencies blended between the original ones (high
// frequencies) and those divided by `factor` (low ones) over a linear ramp between the correction
// range's ends, and cos and sin multiplied by the concentration factor
// yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim).
struct YarnParams {
  double factor = 1.0;
  int original_max_positions = 4096;
  double beta_fast = 32, beta_slow = 1;
  double mscale = 1.0, mscale_all_dim = 0.0;
  bool round_to_int = true;
};

// 1 for factor <= 1, else 0.1 * mscale * ln(factor) + 1.
double yarn_get_mscale(double factor, double mscale);
// The YaRN frequencies of rot_dim dims (float32, as Megatron's computes them).
std::vector<float> yarn_inverse_frequencies(int rot_dim, double base, const YarnParams& y);

struct RopeTableParams {
  int positions = 0;
  int rot_dim = 0;
  double base = 10000;
  bool llama3_scaling = false;   // --use-rope-scaling
  double scaling_factor = 8.0;   // --rope-scaling-factor
  std::optional<int> seq_len_interpolation_factor;
  std::optional<YarnParams> yarn;  // replaces the above: YaRN frequencies, cos/sin concentrated
};

// Llama 3.x frequency scaling (low_freq_factor 1, high_freq_factor 4, original context 8192).
std::vector<float> llama3_scale_frequencies(const std::vector<float>& inv_freq, double factor);

std::vector<float> rope_inverse_frequencies(int rot_dim, double base);
std::vector<float> rope_cos_sin_table(const RopeTableParams& p);

}  // namespace mt
