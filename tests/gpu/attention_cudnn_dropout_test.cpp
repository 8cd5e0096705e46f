// cuDNN's fused attention with dropout against the reference backend, given the mask cuDNN drew.
//
// cuDNN draws its own keep mask (Philox, seeded by the shape's dropout_key), which engine/
// attention_dropout.h's rule does not reproduce, so the mask is read back from cuDNN first: with
// Q = K = 0 every visible key has probability 1/n(q) (n(q) the keys query q sees), and with the
// value of key k set to the unit vector e_(k - base) for k in [base, base + d) (zero elsewhere),
// out[q, j] = keep[q, base + j] / (n(q) (1 - p)) (with a sliding window, n(q) counts the keys in
// it). Repeating for base = 0, d, 2d, ... reads the whole [b, heads, s, s] mask, and checks its
// values (0, or 1/(n(q)(1-p)) to bf16 rounding) on the way.
// Then, on fresh random inputs, every forward candidate must draw that same mask (the production
// path times them and may keep any) and match reference_attention_forward_masked, and every
// backward candidate must match reference_attention_backward_masked given the forward's out and
// lse: a backward that redrew another mask would fail. Tolerances as tests/gpu/attention_test.cpp.
#include <catch2/catch.hpp>

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/philox.h"
#include "cuda/attention.h"
#include "cuda/attention_cudnn.h"
#include "cuda/cuda_check.h"
#include "engine/reference/attention.h"
#include "tests/gpu/attention_test_util.h"

using namespace mt;
using namespace mt::test::attention;

namespace {

namespace cd = cuda::cudnn_attention;

struct DropCase {
  std::string name;
  int b, s, heads, groups, d;
  float p;
  DType dtype = DType::bf16;
  bool causal = true;
  int window = -1;
  AttentionShape shape(uint64_t key = 0xd5) const {
    AttentionShape a = AttentionShape::make(b, s, heads, groups, d, causal, p, key);
    a.window_left = window;
    return a;
  }
};

// The keep mask forward candidate `fi` draws for shape a (see the file comment); counts values
// that are neither 0 nor the kept value into *bad.
std::vector<uint8_t> read_mask(const AttentionShape& a, DType dt, int fi, void* ws, size_t ws_bytes, int64_t* bad) {
  const Layout L(a);
  DeviceValues qkv(L.qkv_count(), dt), out(L.out_count(), dt);
  DeviceValues lse(L.lse_count(), DType::f32);
  std::vector<uint8_t> keep(static_cast<size_t>(L.b * L.heads * L.s * L.s), 0);
  cd::pin_candidates(a, dt, fi, -1);
  for (int64_t base = 0; base < L.s; base += L.d) {
    std::vector<float> x(L.qkv_count(), 0.0f);
    for (int64_t i = 0; i < L.b; ++i)
      for (int64_t t = base; t < std::min(L.s, base + L.d); ++t)
        for (int64_t g = 0; g < L.groups; ++g) x[L.v_offset(i, t, g) + (t - base)] = 1.0f;
    qkv.upload(x);
    out.poison();
    cd::forward(out.t(), lse.t(), qkv.t(), a, ws, ws_bytes, nullptr);
    MT_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<float> o = out.download();
    for (int64_t i = 0; i < L.b; ++i)
      for (int64_t h = 0; h < L.heads; ++h)
        for (int64_t q = 0; q < L.s; ++q) {
          const int64_t first = a.first_key(q), visible = a.last_key(q) - first + 1;
          const double kept_value = 1.0 / (visible * (1.0 - a.dropout_p));
          for (int64_t j = 0; j < L.d && base + j < L.s; ++j) {
            const int64_t k = base + j;
            const float v = o[L.out_offset(i, q, h) + j];
            if (k > a.last_key(q) || k < first) {
              *bad += v != 0.0f;  // a key the query does not see
              continue;
            }
            const bool kept = v != 0.0f;
            if (kept && !(std::abs(v - kept_value) <= 1e-2 * kept_value)) ++*bad;
            keep[L.mask_index(i, h, q, k)] = kept;
          }
        }
  }
  return keep;
}

void run_case(const DropCase& c) {
  INFO(c.name);
  const AttentionShape a = c.shape();
  const DType dt = c.dtype;
  std::string why;
  REQUIRE(cd::supported(a, dt, &why));
  CHECK(cuda::resolve_attention_backend(a, AttentionBackend::auto_, dt) == AttentionBackend::fused);
  const Layout L(a);
  const size_t ws_bytes = cd::workspace_bytes(a, dt);
  void* ws = nullptr;
  MT_CUDA_CHECK(cudaMalloc(&ws, std::max<size_t>(ws_bytes, 256)));
  const int nf = static_cast<int>(cd::forward_candidates(a, dt).size());
  const int nb = static_cast<int>(cd::backward_candidates(a, dt).size());

  // The mask of every forward candidate: the same, with values 0 or 1/(n(q)(1-p)).
  int64_t bad = 0;
  const std::vector<uint8_t> keep = read_mask(a, dt, 0, ws, ws_bytes, &bad);
  CHECK(bad == 0);
  for (int fi = 1; fi < nf; ++fi) {
    INFO("forward candidate " << fi);
    CHECK(read_mask(a, dt, fi, ws, ws_bytes, &bad) == keep);
  }
  // Kept fraction of the visible pairs: 1 - p within 5 standard deviations.
  int64_t visible = 0, kept = 0;
  for (int64_t i = 0; i < L.b; ++i)
    for (int64_t h = 0; h < L.heads; ++h)
      for (int64_t q = 0; q < L.s; ++q)
        for (int64_t k = a.first_key(q); k <= a.last_key(q); ++k) {
          ++visible;
          kept += keep[L.mask_index(i, h, q, k)];
        }
  const double frac = double(kept) / visible, sigma = std::sqrt(c.p * (1 - c.p) / visible);
  std::printf("%s | %d forward / %d backward candidates | kept %.4f of %lld visible pairs (1-p = %.2f)\n",
              c.name.c_str(), nf, nb, frac, static_cast<long long>(visible), 1 - c.p);
  CHECK(std::abs(frac - (1 - c.p)) <= 5 * sigma + 1e-9);
  // Another key draws another mask.
  if (c.s > 1) {
    int64_t bad_other = 0;
    CHECK(read_mask(c.shape(0xd6), dt, 0, ws, ws_bytes, &bad_other) != keep);
    CHECK(bad_other == 0);
  }

  // Random inputs, rounded to the 16-bit type; the same rounded values feed the reference.
  std::vector<float> x(L.qkv_count()), dout(L.out_count());
  for (size_t i = 0; i < x.size(); ++i) x[i] = rounded(normal_at(11 + c.s, i), dt);
  for (size_t i = 0; i < dout.size(); ++i) dout[i] = rounded(normal_at(12 + c.s, i), dt);
  DeviceValues d_qkv(L.qkv_count(), dt), d_out(L.out_count(), dt), d_dout(L.out_count(), dt), d_dqkv(L.qkv_count(), dt);
  DeviceValues d_lse(L.lse_count(), DType::f32);
  d_qkv.upload(x);
  d_dout.upload(dout);

  std::vector<float> ref_out(L.out_count()), ref_lse(L.lse_count());
  reference_attention_forward_masked<float>(host(ref_out), host(ref_lse), host(x), a, keep);
  std::vector<float> out0, lse0;
  for (int fi = 0; fi < nf; ++fi) {
    cd::pin_candidates(a, dt, fi, -1);
    d_out.poison();
    d_lse.poison();
    cd::forward(d_out.t(), d_lse.t(), d_qkv.t(), a, ws, ws_bytes, nullptr);
    MT_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<float> out = d_out.download(), lse = d_lse.download();
    const double e_out = rel_l2(out, ref_out), e_lse = max_abs(lse, ref_lse);
    std::printf("%s | forward %s | out %.2e lse %.2e\n", c.name.c_str(), cd::forward_candidates(a, dt)[fi].c_str(),
                e_out, e_lse);
    INFO("forward candidate " << fi);
    CHECK(e_out <= 1e-2);
    CHECK(e_lse <= 1e-3);
    if (fi == 0) out0 = out, lse0 = lse;
  }

  // Every backward from the first forward's out and lse; the reference from the same.
  d_out.upload(out0);
  MT_CUDA_CHECK(cudaMemcpy(d_lse.ptr, lse0.data(), lse0.size() * 4, cudaMemcpyHostToDevice));
  std::vector<float> ref_dqkv(L.qkv_count());
  reference_attention_backward_masked<float>(host(ref_dqkv), host(dout), host(out0), host(lse0), host(x), a, keep);
  for (int bi = 0; bi < nb; ++bi) {
    cd::pin_candidates(a, dt, 0, bi);
    d_dqkv.poison();
    cd::backward(d_dqkv.t(), d_dout.t(), d_out.t(), d_lse.t(), d_qkv.t(), a, ws, ws_bytes, nullptr);
    MT_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<float> dqkv = d_dqkv.download();
    std::vector<float> got[3], want[3];  // q, k, v parts
    for (size_t r = 0; r < dqkv.size(); r += static_cast<size_t>(L.row))
      for (int64_t g = 0; g < L.groups; ++g)
        for (int64_t j = 0; j < (L.hpg + 2) * L.d; ++j) {
          const int part = j < L.hpg * L.d ? 0 : (j < (L.hpg + 1) * L.d ? 1 : 2);
          const size_t at = r + g * (L.hpg + 2) * L.d + j;
          got[part].push_back(dqkv[at]);
          want[part].push_back(ref_dqkv[at]);
        }
    const double eq = rel_l2(got[0], want[0]), ek = rel_l2(got[1], want[1]), ev = rel_l2(got[2], want[2]);
    std::printf("%s | backward %s | dq %.2e dk %.2e dv %.2e\n", c.name.c_str(),
                cd::backward_candidates(a, dt)[bi].c_str(), eq, ek, ev);
    INFO("backward candidate " << bi);
    CHECK(eq <= 1e-2);
    CHECK(ek <= 1e-2);
    CHECK(ev <= 1e-2);
  }
  cd::pin_candidates(a, dt, -1, -1);
  cudaFree(ws);
}

}  // namespace

TEST_CASE("cuDNN fused attention with dropout matches the reference given cuDNN's mask", "[gpu][attention][dropout]") {
  const DType bf16 = DType::bf16;
  const DropCase cases[] = {
      {"d64 b3 s17 MQA 8/1 p0.1", 3, 17, 8, 1, 64, 0.1f},
      {"d64 b2 s200 GQA 8/2 p0.2", 2, 200, 8, 2, 64, 0.2f},
      {"d64 b1 s1 4/4 p0.1", 1, 1, 4, 4, 64, 0.1f},
      {"d64 fp16 b2 s65 4/4 p0.3", 2, 65, 4, 4, 64, 0.3f, DType::f16},
      {"d64 b2 s77 not causal 4/2 p0.1", 2, 77, 4, 2, 64, 0.1f, bf16, false},
      {"d128 b2 s100 4/4 p0.1", 2, 100, 4, 4, 128, 0.1f},
      {"d128 b1 s300 GQA 16/4 p0.1", 1, 300, 16, 4, 128, 0.1f},
      {"d64 b1 s512 GQA 8/2 p0.1", 1, 512, 8, 2, 64, 0.1f},
      {"d192 b1 s130 4/4 p0.1", 1, 130, 4, 4, 192, 0.1f},
  };
  for (const DropCase& c : cases) run_case(c);
}

TEST_CASE("cuDNN fused attention with dropout over sliding windows matches the reference given cuDNN's mask",
          "[gpu][attention][dropout]") {
  const DType bf16 = DType::bf16;
  const DropCase cases[] = {
      {"d64 b2 s200 GQA 8/2 p0.1 window 50", 2, 200, 8, 2, 64, 0.1f, bf16, true, 49},
      {"d128 b1 s300 4/4 p0.2 window 17", 1, 300, 4, 4, 128, 0.2f, bf16, true, 16},
      {"d64 fp16 b3 s77 MQA 6/1 p0.1 window 4", 3, 77, 6, 1, 64, 0.1f, DType::f16, true, 3},
      {"d64 b1 s1100 GQA 8/2 p0.1 window 300", 1, 1100, 8, 2, 64, 0.1f, bf16, true, 299},
  };
  for (const DropCase& c : cases) run_case(c);
}

TEST_CASE("cuDNN attention with dropout: windows taken, the plan keyed by the probability",
          "[gpu][attention][dropout]") {
  AttentionShape a = AttentionShape::make(2, 64, 4, 2, 64, true, 0.1f, 7);
  a.window_left = 16;
  std::string why;
  CHECK(cd::supported(a, DType::bf16, &why));
  CHECK(cuda::resolve_attention_backend(a, AttentionBackend::auto_, DType::bf16) == AttentionBackend::fused);
  CHECK(cd::describe(a, DType::bf16).find("sliding window") != std::string::npos);
  // Without the window: fused. The same shape at two probabilities has two plans (two workspaces
  // of the RNG's slot, two descriptions), and p = 0 has no RNG slot.
  a.window_left = -1;
  CHECK(cuda::resolve_attention_backend(a, AttentionBackend::fused, DType::bf16) == AttentionBackend::fused);
  CHECK(cd::describe(a, DType::bf16).find("dropout 0.1") != std::string::npos);
  AttentionShape b = a;
  b.dropout_p = 0.3f;
  CHECK(cd::describe(b, DType::bf16).find("dropout 0.3") != std::string::npos);
  AttentionShape none = a;
  none.dropout_p = 0;
  CHECK(cd::describe(none, DType::bf16).find("dropout") == std::string::npos);
}
