// CUDA vs reference: Gated DeltaNet's ops (the causal convolution, the gated delta rule forward and
// backward, the output gate) at shapes that cross the 64-position chunks, with several value heads
// per key head and head dims that are not powers of two; float32 on every shape and bfloat16 on
// one, each backward with and without accumulation, its bits repeated; init_uniform against the
// host's values.
//
// Tolerances (relative L2 error against the float64 reference, tol_for):
//   float32 (1e-5): the kernels' float32 math in another order than the reference's float64. The
//     recurrence does not amplify rounding errors along the sequence (the decay is in (0, 1], and
//     I - beta k k^T with |k| = 1, 0 < beta < 1 has norm 1), so every output keeps the error of a
//     few float32 roundings of its terms.
//   bfloat16 (1e-2): both sides see the same bf16 inputs; each CUDA output is rounded once to bf16
//     (2^-9 relative at most), the float32 math beneath it as above.
//   Float32 outputs of bf16 inputs (the saved states, the parameter gradients) keep float32's
//     tolerance: the same float32 math on the same values.
//   d a_log and d dt_bias are sums over every row whose terms may cancel: they are checked against
//     the sum of the terms' magnitudes (float32 math: 1e-5 of it; bf16 data: the CUDA backend sums
//     dproj's alpha column as stored, each term rounded to bf16, 2^-8 of it).
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "core/shard.h"
#include "tests/gpu/gpu_test_util.h"

using namespace mt;
using namespace mt::gputest;

namespace {

struct Case {
  int batch, seq, key_heads, value_heads, dk, dv, conv_k;
};

// Odd sizes throughout: 70 and 130 positions end inside a chunk, 256 spans four whole ones; 2 and 3
// value heads per key head; dk 100 pads to 128 rows; dv 12, 24, 72 are no multiple of a column tile.
const Case kCases[] = {
    {3, 70, 2, 4, 8, 12, 4},   {2, 130, 2, 6, 16, 24, 3},  {1, 256, 2, 4, 64, 64, 4},
    {2, 100, 1, 2, 100, 72, 4}, {1, 65, 2, 2, 128, 128, 4},
    // dk 256 (32 lanes per column group) and fewer, longer sub-chunks; dk 24 (4 lanes); dv 10 and 70
    // (a thread's four columns partly padding).
    {1, 130, 1, 1, 256, 256, 4}, {2, 70, 1, 3, 24, 10, 4}, {1, 90, 2, 2, 32, 70, 2},
};
const Case kBf16Case = {2, 130, 2, 6, 16, 24, 3};

GdnShape shape_of(const Case& c) {
  GdnShape s;
  s.batch = c.batch, s.seq = c.seq, s.key_heads = c.key_heads, s.value_heads = c.value_heads;
  s.dk = c.dk, s.dv = c.dv, s.conv_k = c.conv_k;
  s.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.dk)));
  return s;
}

std::string describe(const Case& c, DType dt) {
  return std::string(dtype_name(dt)) + " batch " + std::to_string(c.batch) + " seq " + std::to_string(c.seq) +
         " heads " + std::to_string(c.key_heads) + "/" + std::to_string(c.value_heads) + " dk " +
         std::to_string(c.dk) + " dv " + std::to_string(c.dv) + " conv " + std::to_string(c.conv_k);
}

std::vector<double> log_of_uniform(Rng& rng, int64_t n, double lo, double hi) {
  std::vector<double> v = rng.uniform(n, lo, hi);
  for (double& x : v) x = std::log(x);
  return v;
}

double softplus(double x) { return x > 20.0 ? x : std::log1p(std::exp(x)); }

// Checks a [value_heads] parameter gradient: |got - want| <= rel * (sum of the terms' magnitudes)
// plus a float32 rounding of the result, element by element.
void check_param_grad(const std::vector<double>& got, const std::vector<double>& want,
                      const std::vector<double>& magnitude, double rel, const std::string& what) {
  REQUIRE(got.size() == want.size());
  for (size_t v = 0; v < got.size(); ++v) {
    const double bound = rel * magnitude[v] + 2e-7 * std::fabs(want[v]) + 1e-30;
    INFO(what << " value head " << v << ": got " << got[v] << ", want " << want[v] << ", bound " << bound);
    CHECK(std::fabs(got[v] - want[v]) <= bound);
  }
}

// Columns of a row-major [rows, width] tensor.
std::vector<double> columns_of(const std::vector<double>& x, int64_t width, const std::vector<int64_t>& cols) {
  std::vector<double> out;
  out.reserve(x.size() / static_cast<size_t>(width) * cols.size());
  for (size_t base = 0; base < x.size(); base += static_cast<size_t>(width))
    for (int64_t c : cols) out.push_back(x[base + static_cast<size_t>(c)]);
  return out;
}

// The CUDA side of x [rows, width] against the reference over the columns `cols`.
void check_columns(const Twin& x, int64_t width, const std::vector<int64_t>& cols, double tol, const char* what) {
  const double err =
      rel_err(columns_of(download(dev(), x.c()), width, cols), columns_of(download(ref(), x.r()), width, cols));
  INFO(what << ": relative L2 error " << err << " (tolerance " << tol << ")");
  CHECK(err <= tol);
}

// The columns of x [rows, width] other than `written` still hold `start` on the CUDA side.
void check_untouched(const Twin& x, const std::vector<double>& start, int64_t width,
                     const std::vector<int64_t>& written, const char* what) {
  std::vector<char> is_written(static_cast<size_t>(width), 0);
  for (int64_t c : written) is_written[static_cast<size_t>(c)] = 1;
  const std::vector<double> got = download(dev(), x.c());
  int64_t changed = 0;
  for (size_t i = 0; i < got.size(); ++i)
    if (!is_written[i % static_cast<size_t>(width)] && !(got[i] == start[i])) ++changed;
  INFO(what << ": elements changed outside the op's columns: " << changed);
  CHECK(changed == 0);
}

// Every op of one case and dtype, forward and backward, against the reference.
void run_case(Rng& rng, const Case& c, DType dt) {
  INFO(describe(c, dt));
  const GdnShape s = shape_of(c);
  const int64_t N = s.tokens(), P = s.proj_width(), C = s.conv_width(), K = s.conv_k, W = s.value_width();
  const int VH = s.value_heads;
  const double tol = tol_for(dt);
  const DType f32 = DType::f32;

  Twin proj = twin(dt, {N, P}, rng.normal(N * P));
  // The columns each op writes: of the convolution's output, q, k and v; of the projection, the
  // convolution's inputs, beta and alpha, the output gate.
  std::vector<int64_t> q_cols, k_cols, v_cols, conv_in_cols, gate_param_cols, z_cols;
  for (int g = 0; g < s.key_heads; ++g)
    for (int e = 0; e < s.dk; ++e) q_cols.push_back(s.q_col(g) + e), k_cols.push_back(s.k_col(g) + e);
  for (int v = 0; v < VH; ++v) {
    for (int e = 0; e < s.dv; ++e) v_cols.push_back(s.v_col(v) + e), z_cols.push_back(s.z_col(v) + e);
    gate_param_cols.push_back(s.beta_col(v));
    gate_param_cols.push_back(s.alpha_col(v));
  }
  for (int64_t ch = 0; ch < C; ++ch) conv_in_cols.push_back(s.proj_col_of_conv(ch));
  {
    INFO("gdn_conv_forward");
    Twin w = twin(dt, {C, K}, rng.uniform(C * K, -0.5, 0.5));
    Twin xc = twin_nan(dt, {N, C});
    dev().gdn_conv_forward(xc.c(), proj.c(), w.c(), s);
    ref().gdn_conv_forward(xc.r(), proj.r(), w.r(), s);
    MT_CHECK_CLOSE(xc, tol);
    for (const bool accumulate : {false, true}) {
      INFO("gdn_conv_backward, accumulate " << accumulate);
      Twin dxc = twin(dt, {N, C}, rng.normal(N * C));
      // dproj's other columns keep their values: the same random start on both sides.
      Twin dproj = twin(dt, {N, P}, rng.normal(N * P));
      const std::vector<double> start = download(dev(), dproj.c());
      Twin dw = accumulate ? twin(f32, {C, K}, rng.normal(C * K)) : twin_nan(f32, {C, K});
      dev().gdn_conv_backward(dproj.c(), dw.c(), dxc.c(), proj.c(), w.c(), s, accumulate);
      ref().gdn_conv_backward(dproj.r(), dw.r(), dxc.r(), proj.r(), w.r(), s, accumulate);
      check_columns(dproj, P, conv_in_cols, tol, "dproj's q, k, v columns");
      check_untouched(dproj, start, P, conv_in_cols, "dproj");
      MT_CHECK_CLOSE(dw, 1e-5);  // float32 sums of the same products
    }
  }

  // The recurrence on its own inputs: decays from ~0 to ~1 (exp(a_log) in [1, 16], softplus of
  // alpha + dt_bias from ~0.002 to ~4).
  Twin xc = twin(dt, {N, C}, rng.normal(N * C));
  Twin a_log = twin(dt, {VH}, log_of_uniform(rng, VH, 1.0, 16.0));
  Twin dt_bias = twin(dt, {VH}, rng.uniform(VH, -4.0, 1.0));
  Twin out = twin_nan(dt, {N, W});
  Twin states = twin_nan(f32, {s.states_numel()});
  {
    INFO("gdn_forward");
    dev().gdn_forward(out.c(), states.c(), xc.c(), proj.c(), a_log.c(), dt_bias.c(), s);
    ref().gdn_forward(out.r(), states.r(), xc.r(), proj.r(), a_log.r(), dt_bias.r(), s);
    MT_CHECK_CLOSE(out, tol);
    MT_CHECK_CLOSE(states, 1e-5);
  }
  Twin dout = twin(dt, {N, W}, rng.normal(N * W));
  std::vector<uint8_t> first_bytes[4];
  for (const bool accumulate : {false, true}) {
    INFO("gdn_backward, accumulate " << accumulate);
    Twin dxc = twin_nan(dt, {N, C});  // every column is written
    Twin dproj = twin(dt, {N, P}, rng.normal(N * P));
    const std::vector<double> start = download(dev(), dproj.c());
    Twin da_log = accumulate ? twin(f32, {VH}, rng.normal(VH)) : twin_nan(f32, {VH});
    Twin ddt = accumulate ? twin(f32, {VH}, rng.normal(VH)) : twin_nan(f32, {VH});
    dev().gdn_backward(dxc.c(), dproj.c(), da_log.c(), ddt.c(), dout.c(), xc.c(), proj.c(), a_log.c(), dt_bias.c(),
                       states.c(), s, accumulate);
    ref().gdn_backward(dxc.r(), dproj.r(), da_log.r(), ddt.r(), dout.r(), xc.r(), proj.r(), a_log.r(), dt_bias.r(),
                       states.r(), s, accumulate);
    check_columns(dxc, C, q_cols, tol, "dq");
    check_columns(dxc, C, k_cols, tol, "dk");
    check_columns(dxc, C, v_cols, tol, "dv");
    check_columns(dproj, P, gate_param_cols, tol, "dproj's beta and alpha columns");
    check_untouched(dproj, start, P, gate_param_cols, "dproj");
    // The terms of the two sums, from the reference's dalpha and x = alpha + dt_bias.
    const std::vector<double> gp = download(ref(), dproj.r()), pr = download(ref(), proj.r());
    const std::vector<double> dtb = download(ref(), dt_bias.r());
    std::vector<double> mag_log(VH, 0.0), mag_dt(VH, 0.0);
    for (int64_t r = 0; r < N; ++r)
      for (int v = 0; v < VH; ++v) {
        const int64_t at = r * P + s.alpha_col(v);
        const double dalpha = gp[at], x = pr[at] + dtb[v];
        const double ratio = x < -20 ? 1.0 : softplus(x) * (1.0 + std::exp(-x));
        mag_dt[v] += std::fabs(dalpha);
        mag_log[v] += std::fabs(dalpha * ratio);
      }
    const double rel = dt == DType::bf16 ? std::ldexp(1.0, -8) : 1e-5;
    check_param_grad(download(dev(), da_log.c()), download(ref(), da_log.r()), mag_log, rel, "d a_log");
    check_param_grad(download(dev(), ddt.c()), download(ref(), ddt.r()), mag_dt, rel, "d dt_bias");
    if (!accumulate) {
      first_bytes[0] = download_bytes(dev(), dxc.c());
      first_bytes[1] = download_bytes(dev(), dproj.c());
      first_bytes[2] = download_bytes(dev(), da_log.c());
      first_bytes[3] = download_bytes(dev(), ddt.c());
      // The same bits again (no float atomics), from the same dproj start.
      Twin dxc2 = twin_nan(dt, {N, C});
      Twin dproj2 = twin(dt, {N, P}, download(dev(), dproj.c()));
      Twin da_log2 = twin_nan(f32, {VH}), ddt2 = twin_nan(f32, {VH});
      dev().gdn_backward(dxc2.c(), dproj2.c(), da_log2.c(), ddt2.c(), dout.c(), xc.c(), proj.c(), a_log.c(),
                         dt_bias.c(), states.c(), s, false);
      const size_t es = dtype_size(dt);
      CHECK(differing(download_bytes(dev(), dxc2.c()), first_bytes[0], es) == 0);
      CHECK(differing(download_bytes(dev(), dproj2.c()), first_bytes[1], es) == 0);
      CHECK(differing(download_bytes(dev(), da_log2.c()), first_bytes[2], 4) == 0);
      CHECK(differing(download_bytes(dev(), ddt2.c()), first_bytes[3], 4) == 0);
    }
  }

  {
    INFO("gdn_gate_forward / gdn_gate_backward");
    Twin n = twin(dt, {N, W}, rng.normal(N * W));
    Twin y = twin_nan(dt, {N, W});
    dev().gdn_gate_forward(y.c(), n.c(), proj.c(), s);
    ref().gdn_gate_forward(y.r(), n.r(), proj.r(), s);
    MT_CHECK_CLOSE(y, tol);
    const std::vector<double> g = rng.normal(N * W);
    Twin dy = twin(dt, {N, W}, g), dn = twin_nan(dt, {N, W});
    Twin dproj = twin(dt, {N, P}, rng.normal(N * P));
    const std::vector<double> start = download(dev(), dproj.c());
    dev().gdn_gate_backward(dn.c(), dproj.c(), dy.c(), n.c(), proj.c(), s);
    ref().gdn_gate_backward(dn.r(), dproj.r(), dy.r(), n.r(), proj.r(), s);
    MT_CHECK_CLOSE(dn, tol);
    check_columns(dproj, P, z_cols, tol, "dproj's z columns");
    check_untouched(dproj, start, P, z_cols, "dproj");
    // In place (dn aliasing dy), as the model runs it.
    Twin dy2 = twin(dt, {N, W}, g);
    Twin dproj2 = twin(dt, {N, P}, rng.normal(N * P));
    dev().gdn_gate_backward(dy2.c(), dproj2.c(), dy2.c(), n.c(), proj.c(), s);
    ref().gdn_gate_backward(dy2.r(), dproj2.r(), dy2.r(), n.r(), proj.r(), s);
    MT_CHECK_CLOSE(dy2, tol);
    check_columns(dproj2, P, z_cols, tol, "dproj's z columns (in place)");
  }
}

}  // namespace

TEST_CASE("cuda Gated DeltaNet ops match the reference (float32)", "[gpu][gdn]") {
  MT_RNG(rng);
  for (const Case& c : kCases) run_case(rng, c, DType::f32);
}

TEST_CASE("cuda Gated DeltaNet ops match the reference (bfloat16)", "[gpu][gdn]") {
  MT_RNG(rng);
  run_case(rng, kBf16Case, DType::bf16);
}

TEST_CASE("cuda Gated DeltaNet refuses head dims its kernels cannot take", "[gpu][gdn]") {
  const Case c{1, 8, 1, 1, 300, 8, 4};
  const GdnShape s = shape_of(c);
  const int64_t N = s.tokens();
  Twin xc = twin(DType::f32, {N, s.conv_width()}, std::vector<double>(N * s.conv_width(), 0.5));
  Twin proj = twin(DType::f32, {N, s.proj_width()}, std::vector<double>(N * s.proj_width(), 0.5));
  Twin a_log = twin(DType::f32, {1}, {0.5}), dt_bias = twin(DType::f32, {1}, {0.0});
  Twin out = twin_nan(DType::f32, {N, s.value_width()}), states = twin_nan(DType::f32, {s.states_numel()});
  CHECK_THROWS_WITH(dev().gdn_forward(out.c(), states.c(), xc.c(), proj.c(), a_log.c(), dt_bias.c(), s),
                    Catch::Contains("at most 256"));
}

TEST_CASE("cuda init_uniform equals the host's values for every shard layout", "[gpu][init][gdn]") {
  MT_RNG(rng);
  const uint64_t key = rng.engine()();
  const ShardIndex shard{80, 96, 10, 32, 20, 48, 2};
  const ShardIndex whole = ShardIndex::whole(1000, 1024);
  struct Range {
    float lo, hi;
    bool log_of;
  };
  // PyTorch's Conv1d default (a symmetric range) and Gated DeltaNet's A_log = log(uniform(1, 16)).
  for (const Range rg : {Range{-0.5f, 0.5f, false}, Range{1.0f, 16.0f, true}})
    for (DType dt : {DType::f32, DType::bf16, DType::f16, DType::f64})
      for (const ShardIndex& idx : {shard, whole}) {
        INFO(dtype_name(dt) << " [" << rg.lo << ", " << rg.hi << "]" << (rg.log_of ? " log" : "") << " local "
                            << idx.local_rows * idx.chunks << "x" << idx.local_cols);
        const Shape shp{idx.local_rows * idx.chunks, idx.local_cols};
        Twin t = twin_same(dt, shp, std::vector<double>(numel(shp), NAN));
        dev().init_uniform(t.c(), key, rg.lo, rg.hi, rg.log_of, idx);
        ref().init_uniform(t.r(), key, rg.lo, rg.hi, rg.log_of, idx);
        if (!rg.log_of) {
          // lo + (hi - lo) * u rounded as on the host: the same bits.
          CHECK(differing(download_bytes(dev(), t.c()), download_bytes(ref(), t.r()), dtype_size(dt)) == 0);
        } else {
          // The device's logf is within one float32 step of the host's; rounded to a 16-bit type, a
          // one-step difference may land on the neighbouring 16-bit value.
          const std::vector<double> got = download(dev(), t.c()), want = download(ref(), t.r());
          int64_t outside = 0, first = -1;
          for (size_t i = 0; i < got.size(); ++i) {
            const float wf = static_cast<float>(want[i]);
            double step = std::nextafter(wf, std::numeric_limits<float>::infinity()) - wf;
            if (dt == DType::bf16 || dt == DType::f16)
              step = std::ldexp(1.0, std::ilogb(std::max(std::fabs(want[i]), 1e-4)) - (dt == DType::bf16 ? 7 : 10));
            if (!(std::fabs(got[i] - want[i]) <= step)) {
              if (first < 0) first = static_cast<int64_t>(i);
              ++outside;
            }
          }
          INFO("beyond one step: " << outside << " (first at " << first << ")");
          CHECK(outside == 0);
        }
        // And the values lie in the range.
        const double lo = rg.log_of ? std::log(rg.lo) : rg.lo, hi = rg.log_of ? std::log(rg.hi) : rg.hi;
        int64_t out_of_range = 0;
        for (double x : download(dev(), t.c())) out_of_range += !(x >= lo - 1e-2 && x <= hi + 1e-2);
        CHECK(out_of_range == 0);
      }
}
