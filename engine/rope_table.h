// The rotary-embedding cos/sin table, computed once on the host (shared by both backends) and
// uploaded: float32 [positions, rot_dim], per row the cos of the rot_dim/2 frequencies, then
// their sin. Frequencies as Megatron's RotaryEmbedding: inv_freq_i = 1 / base^(2i/rot_dim) in
// float32, optionally Llama 3.x scaled (--use-rope-scaling) and position-interpolated.
#pragma once

#include <optional>
#include <vector>

namespace mt {

struct RopeTableParams {
  int positions = 0;
  int rot_dim = 0;
  double base = 10000;
  bool llama3_scaling = false;   // --use-rope-scaling
  double scaling_factor = 8.0;   // --rope-scaling-factor
  std::optional<int> seq_len_interpolation_factor;
};

// Llama 3.x frequency scaling (low_freq_factor 1, high_freq_factor 4, original context 8192).
std::vector<float> llama3_scale_frequencies(const std::vector<float>& inv_freq, double factor);

std::vector<float> rope_inverse_frequencies(int rot_dim, double base);
std::vector<float> rope_cos_sin_table(const RopeTableParams& p);

}  // namespace mt
