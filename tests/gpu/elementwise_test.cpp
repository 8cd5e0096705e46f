// CUDA vs reference: fill, cast, axpby, init_normal, GeLU, SwiGLU, bias-dropout-add, dropout.
#include <cmath>
#include <cstring>
#include <limits>

#include "core/shard.h"
#include "tests/gpu/gpu_test_util.h"

using namespace mt;
using namespace mt::gputest;

namespace {
const DType kFloatTypes[] = {DType::f32, DType::bf16, DType::f16};
// Row counts and widths that are not multiples of any tile or vector width, and some that are.
const Shape kShapes[] = {{1, 1}, {1, 48}, {7, 100}, {3, 1000}, {17, 13}, {333, 768}, {5, 2050}};
}  // namespace

TEST_CASE("cuda fill writes every element, every dtype", "[gpu][elementwise]") {
  for (DType dt : {DType::f32, DType::f64, DType::bf16, DType::f16, DType::i32, DType::i64, DType::u8}) {
    for (const Shape& s : kShapes) {
      INFO(dtype_name(dt) << " " << s[0] << "x" << s[1]);
      Buf b(dev(), dt, s);
      const double value = is_floating(dt) ? -1.5 : 7.0;
      dev().fill(b.t, value);
      dev().fill(b.t, 0.0);  // the memset path: +0 bits
      int64_t not_zero = 0;
      for (double g : download(dev(), b.t)) not_zero += g != 0.0 || std::signbit(g);
      CHECK(not_zero == 0);
      if (is_floating(dt)) {  // -0 keeps its sign (the kernel path)
        dev().fill(b.t, -0.0);
        int64_t positive = 0;
        for (double g : download(dev(), b.t)) positive += g != 0.0 || !std::signbit(g);
        CHECK(positive == 0);
      }
      dev().fill(b.t, value);
      const std::vector<double> got = download(dev(), b.t);
      int64_t wrong = 0;
      for (double g : got) wrong += g != value;
      CHECK(wrong == 0);
      if (is_floating(dt)) {
        dev().fill(b.t, std::numeric_limits<double>::quiet_NaN());
        int64_t not_nan = 0;
        for (double g : download(dev(), b.t)) not_nan += !std::isnan(g);
        CHECK(not_nan == 0);
      }
    }
  }
}

// fill_ranges with 0 (one launch per 64 small ranges, the driver's memset for ranges of 1 MiB or
// more): exactly the ranges' elements become +0, odd offsets and lengths, 1- to 8-byte dtypes.
TEST_CASE("cuda fill_ranges zeroes exactly its ranges", "[gpu][elementwise]") {
  for (DType dt : {DType::f32, DType::bf16, DType::f64, DType::u8}) {
    const int64_t n = (int64_t{3} << 20) / static_cast<int64_t>(dtype_size(dt)) + 77;  // a 1 MiB+ range fits
    std::vector<FlatRange> ranges;
    int64_t at = 3;
    for (int i = 0; at < n / 2; ++i) {  // 150-odd small ranges of 1 to ~500 elements, gaps between them
      const int64_t len = 1 + (i * 37) % 499;
      ranges.push_back({at, std::min(len, n / 2 - at)});
      at += len + 1 + (i * 13) % 7;
    }
    ranges.push_back({n / 2 + 1, n - n / 2 - 2});  // large: memset (leaves the last element)
    ranges.push_back({n / 2, 0});                  // empty
    INFO(dtype_name(dt) << " " << n << " elements, " << ranges.size() << " ranges");
    REQUIRE(ranges.size() > 130);
    Buf b(dev(), dt, {n});
    dev().fill(b.t, 1.0);
    dev().fill_ranges(b.t, ranges, 0.0);
    std::vector<char> zero(static_cast<size_t>(n), 0);
    for (const FlatRange& r : ranges) std::fill(zero.begin() + r.offset, zero.begin() + r.offset + r.count, 1);
    const std::vector<double> got = download(dev(), b.t);
    int64_t wrong = 0;
    for (int64_t i = 0; i < n; ++i) wrong += zero[static_cast<size_t>(i)] ? (got[i] != 0.0 || std::signbit(got[i])) : got[i] != 1.0;
    CHECK(wrong == 0);
    dev().fill_ranges(b.t, ranges, 2.5);  // another value: fill per range
    const std::vector<double> got2 = download(dev(), b.t);
    wrong = 0;
    for (int64_t i = 0; i < n; ++i) wrong += got2[i] != (zero[static_cast<size_t>(i)] ? (dt == DType::u8 ? 2.0 : 2.5) : 1.0);
    CHECK(wrong == 0);
  }
}

TEST_CASE("cuda cast between float dtypes is bit-identical to the reference", "[gpu][elementwise]") {
  MT_RNG(rng);
  const DType types[] = {DType::f32, DType::f64, DType::bf16, DType::f16};
  for (DType src : types)
    for (DType dst : types)
      for (const Shape& s : kShapes) {
        INFO(dtype_name(src) << " -> " << dtype_name(dst) << " " << s[0] << "x" << s[1]);
        std::vector<double> v = rng.normal(numel(s), 30.0);
        v[0] = 70000.0;  // overflows float16
        if (v.size() > 2) v[1] = -0.0, v[2] = 1e-6;
        Twin in = twin_same(src, s, v);
        Twin out = twin_same(dst, s, std::vector<double>(numel(s), std::numeric_limits<double>::quiet_NaN()));
        dev().cast(out.c(), in.c());
        ref().cast(out.r(), in.r());
        CHECK(differing(download_bytes(dev(), out.c()), download_bytes(ref(), out.r()), dtype_size(dst)) == 0);
      }
}

TEST_CASE("cuda axpby: same dtypes, mixed dtypes, aliasing", "[gpu][elementwise]") {
  MT_RNG(rng);
  for (DType dt : kFloatTypes)
    for (const Shape& s : kShapes) {
      INFO(dtype_name(dt) << " " << s[0] << "x" << s[1]);
      const int64_t n = numel(s);
      Twin a = twin(dt, s, rng.normal(n)), b = twin(dt, s, rng.normal(n));
      Twin out = twin_nan(dt, s);
      dev().axpby(out.c(), 0.75f, a.c(), -1.25f, b.c());
      ref().axpby(out.r(), 0.75f, a.r(), -1.25f, b.r());
      MT_CHECK_CLOSE(out, tol_for(dt));
      // b absent, out aliasing a.
      dev().axpby(a.c(), 3.0f, a.c(), 0.0f, Tensor());
      ref().axpby(a.r(), 3.0f, a.r(), 0.0f, Tensor());
      MT_CHECK_CLOSE(a, tol_for(dt));
    }
  // Mixed dtypes: float32 out from a bf16 and a float32 input (the reference's generic path).
  const Shape s{333, 100};
  Twin a = twin_same(DType::bf16, s, rng.normal(numel(s))), b = twin_same(DType::f32, s, rng.normal(numel(s)));
  Twin out = twin_same(DType::f32, s, std::vector<double>(numel(s), NAN));
  dev().axpby(out.c(), 2.0f, a.c(), 0.5f, b.c());
  ref().axpby(out.r(), 2.0f, a.r(), 0.5f, b.r());
  MT_CHECK_CLOSE(out, 1e-6);
}

TEST_CASE("cuda init_normal equals the host's bits for every shard layout", "[gpu][init]") {
  MT_RNG(rng);
  const uint64_t key = rng.engine()();
  // A block of a chunked global tensor (like a TP shard of the SwiGLU [gate; up] weight), and a
  // whole large tensor.
  const ShardIndex shard{80, 96, 10, 32, 20, 48, 2};
  const ShardIndex whole = ShardIndex::whole(1000, 1024);
  for (DType dt : {DType::f32, DType::bf16, DType::f16, DType::f64}) {
    for (const ShardIndex& idx : {shard, whole}) {
      INFO(dtype_name(dt) << " local " << idx.local_rows * idx.chunks << "x" << idx.local_cols);
      const Shape s{idx.local_rows * idx.chunks, idx.local_cols};
      Twin t = twin_same(dt, s, std::vector<double>(numel(s), NAN));
      dev().init_normal(t.c(), key, 0.02f, idx);
      ref().init_normal(t.r(), key, 0.02f, idx);
      const auto got = download_bytes(dev(), t.c()), want = download_bytes(ref(), t.r());
      int64_t differ = 0;
      for (size_t i = 0; i < got.size(); i += dtype_size(dt)) differ += std::memcmp(&got[i], &want[i], dtype_size(dt)) != 0;
      CHECK(differ == 0);
      // And it is a normal(0, 0.02) sample.
      const std::vector<double> v = download(dev(), t.c());
      double m = 0, q = 0;
      for (double x : v) m += x, q += x * x;
      m /= v.size();
      const double sd = std::sqrt(q / v.size() - m * m);
      CHECK(std::abs(m) < 0.02 * 5 / std::sqrt(static_cast<double>(v.size())));
      CHECK(sd == Approx(0.02).epsilon(0.1));
    }
  }
}

TEST_CASE("cuda activation forward/backward: GeLU erf and tanh, squared ReLU", "[gpu][activation]") {
  MT_RNG(rng);
  for (Activation act : {Activation::gelu, Activation::gelu_tanh, Activation::squared_relu})
    for (DType dt : kFloatTypes)
      for (const Shape& s : kShapes) {
        INFO(dtype_name(dt) << " activation " << static_cast<int>(act) << " " << s[0] << "x" << s[1]);
        const int64_t n = numel(s);
        Twin in = twin(dt, s, rng.normal(n, 3.0)), out = twin_nan(dt, s);
        dev().activation_forward(out.c(), in.c(), act);
        ref().activation_forward(out.r(), in.r(), act);
        MT_CHECK_CLOSE(out, tol_for(dt));
        Twin dout = twin(dt, s, rng.normal(n)), din = twin_nan(dt, s);
        dev().activation_backward(din.c(), dout.c(), in.c(), act);
        ref().activation_backward(din.r(), dout.r(), in.r(), act);
        MT_CHECK_CLOSE(din, tol_for(dt));
        // Squared ReLU in 16 bits: r * r and dy * 2r are exact in float32, so the GPU rounds once:
        // the bits of the exact result rounded to nearest even, computed here on the host.
        if (act == Activation::squared_relu && dt != DType::f32) {
          const auto words = [&](const Tensor& t) {
            const std::vector<uint8_t> b = download_bytes(dev(), t);
            std::vector<uint16_t> w(b.size() / 2);
            std::memcpy(w.data(), b.data(), b.size());
            return w;
          };
          const auto to_float = [&](uint16_t w) { return dt == DType::bf16 ? bf16_bits_to_float(w) : f16_bits_to_float(w); };
          const auto to_bits = [&](float f) { return dt == DType::bf16 ? float_to_bf16_bits(f) : float_to_f16_bits(f); };
          const std::vector<uint16_t> x = words(in.c()), y = words(out.c()), g = words(dout.c()), d = words(din.c());
          int64_t wrong = 0;
          for (size_t i = 0; i < x.size(); ++i) {
            const double v = to_float(x[i]), r = v < 0 ? 0.0 : v;
            wrong += y[i] != to_bits(static_cast<float>(r * r));
            wrong += d[i] != to_bits(static_cast<float>(to_float(g[i]) * 2.0 * r));
          }
          CHECK(wrong == 0);
        }
        // In place: din aliases dout.
        dev().activation_backward(dout.c(), dout.c(), in.c(), act);
        ref().activation_backward(dout.r(), dout.r(), in.r(), act);
        MT_CHECK_CLOSE(dout, tol_for(dt));
      }
}

TEST_CASE("cuda swiglu forward/backward", "[gpu][activation]") {
  MT_RNG(rng);
  for (DType dt : kFloatTypes)
    for (int64_t rows : {1, 7, 333})
      for (int64_t f : {7, 48, 100, 1000, 2048}) {
        INFO(dtype_name(dt) << " rows " << rows << " f " << f);
        const std::vector<double> in_values = rng.normal(rows * 2 * f, 2.0);
        Twin in = twin(dt, {rows, 2 * f}, in_values), out = twin_nan(dt, {rows, f});
        dev().swiglu_forward(out.c(), in.c());
        ref().swiglu_forward(out.r(), in.r());
        MT_CHECK_CLOSE(out, tol_for(dt));
        Twin dout = twin(dt, {rows, f}, rng.normal(rows * f)), din = twin_nan(dt, {rows, 2 * f});
        dev().swiglu_backward(din.c(), dout.c(), in.c());
        ref().swiglu_backward(din.r(), dout.r(), in.r());
        MT_CHECK_CLOSE(din, tol_for(dt));
        // In place (din over in, as GptModel's FP8 layers with kept inputs run it): din as above.
        Twin in_place = twin(dt, {rows, 2 * f}, in_values);
        dev().swiglu_backward(in_place.c(), dout.c(), in_place.c());
        ref().swiglu_backward(in_place.r(), dout.r(), in_place.r());
        CHECK(differing(download_bytes(dev(), in_place.c()), download_bytes(dev(), din.c()), dtype_size(dt)) == 0);
        CHECK(differing(download_bytes(ref(), in_place.r()), download_bytes(ref(), din.r()), 4) == 0);
        // The recomputing backward in place (din over in, the activation over dout): din as above,
        // the activation bit for bit what swiglu_forward wrote.
        const std::vector<uint8_t> fwd = download_bytes(dev(), out.c()), ref_fwd = download_bytes(ref(), out.r());
        dev().swiglu_backward_recompute(in.c(), dout.c(), dout.c(), in.c());
        ref().swiglu_backward_recompute(in.r(), dout.r(), dout.r(), in.r());
        CHECK(differing(download_bytes(dev(), dout.c()), fwd, dtype_size(dt)) == 0);
        CHECK(differing(download_bytes(ref(), dout.r()), ref_fwd, 4) == 0);
        CHECK(differing(download_bytes(dev(), in.c()), download_bytes(dev(), din.c()), dtype_size(dt)) == 0);
        CHECK(differing(download_bytes(ref(), in.r()), download_bytes(ref(), din.r()), 4) == 0);
      }
}

TEST_CASE("cuda gpt-oss gated units (quick-GeGLU, linear offset, clamp) forward/backward and the MoE-weighted ones",
          "[gpu][activation]") {
  MT_RNG(rng);
  for (const Glu g : {Glu{true, 1.0f, 0.0f}, Glu{true, 1.0f, 1.5f}, Glu{false, 0.0f, 1.5f}, Glu{true, 0.0f, 0.0f}})
    for (DType dt : kFloatTypes)
      for (int64_t rows : {1, 7, 333})
        for (int64_t f : {7, 48, 1000}) {
          INFO(dtype_name(dt) << " rows " << rows << " f " << f << " quick " << g.quick_gelu << " offset " << g.offset
                              << " clamp " << g.clamp);
          const std::vector<double> in_values = rng.normal(rows * 2 * f, 2.0);  // (|x| > 1.5 often: clamped)
          Twin in = twin(dt, {rows, 2 * f}, in_values), out = twin_nan(dt, {rows, f});
          dev().swiglu_forward(out.c(), in.c(), g);
          ref().swiglu_forward(out.r(), in.r(), g);
          MT_CHECK_CLOSE(out, tol_for(dt));
          Twin dout = twin(dt, {rows, f}, rng.normal(rows * f)), din = twin_nan(dt, {rows, 2 * f});
          dev().swiglu_backward(din.c(), dout.c(), in.c(), g);
          ref().swiglu_backward(din.r(), dout.r(), in.r(), g);
          MT_CHECK_CLOSE(din, tol_for(dt));
          // The recomputing backward in place: the activation bit for bit what swiglu_forward wrote.
          const std::vector<uint8_t> fwd = download_bytes(dev(), out.c());
          dev().swiglu_backward_recompute(in.c(), dout.c(), dout.c(), in.c(), g);
          CHECK(differing(download_bytes(dev(), dout.c()), fwd, dtype_size(dt)) == 0);
          CHECK(differing(download_bytes(dev(), in.c()), download_bytes(dev(), din.c()), dtype_size(dt)) == 0);
          // The experts' fused unit with the routing weight p per row.
          Twin x = twin(dt, {rows, 2 * f}, in_values), y = twin_nan(dt, {rows, f});
          Twin p = twin(DType::f32, {rows}, rng.uniform(rows, 0.1, 1.0));
          dev().moe_swiglu_forward(y.c(), x.c(), p.c(), g);
          ref().moe_swiglu_forward(y.r(), x.r(), p.r(), g);
          MT_CHECK_CLOSE(y, tol_for(dt));
          const std::vector<double> dy_values = rng.normal(rows * f);
          Twin dy = twin(dt, {rows, f}, dy_values), act = twin_nan(dt, {rows, f});
          Twin dp = twin_nan(DType::f32, {rows}), dx = twin_nan(dt, {rows, 2 * f});
          dev().moe_swiglu_backward(dx.c(), act.c(), dp.c(), dy.c(), x.c(), p.c(), g);
          ref().moe_swiglu_backward(dx.r(), act.r(), dp.r(), dy.r(), x.r(), p.r(), g);
          MT_CHECK_CLOSE(dx, tol_for(dt));
          MT_CHECK_CLOSE(act, tol_for(dt));
          // dp[r] = sum_c dy * swiglu(x) over the activation as stored (16 bits on the GPU): its error is
          // a rounding of each term, so it is bounded by the terms' magnitudes, not dp's (which may
          // cancel: one row of 7 terms).
          const std::vector<double> a = download(ref(), act.r()), pv = download(ref(), p.r());
          CHECK(rows_beyond_term_bound(download(dev(), dp.c()), download(ref(), dp.r()), rows, f, tol_for(dt),
                                       [&](int64_t r, int64_t c) {
                                         const size_t i = static_cast<size_t>(r * f + c);
                                         return dy_values[i] * a[i] / pv[static_cast<size_t>(r)];
                                       }) == 0);
        }
}

TEST_CASE("cuda attention output gate: QKV split/merge and the sigmoid gate", "[gpu][activation]") {
  MT_RNG(rng);
  for (DType dt : kFloatTypes)
    for (const GateShape gs : {GateShape{1, 1, 8}, GateShape{2, 3, 5}, GateShape{3, 2, 64}, GateShape{4, 4, 12}})
      for (int64_t rows : {1, 7, 129}) {
        INFO(dtype_name(dt) << " groups " << gs.groups << " q/group " << gs.q_per_group << " d " << gs.head_dim
                            << " rows " << rows);
        // Split and merge move elements: bit for bit the reference's.
        Twin qkvg = twin(dt, {rows, gs.qkvg_width()}, rng.normal(rows * gs.qkvg_width()));
        Twin qkv = twin_nan(dt, {rows, gs.qkv_width()}), gate = twin_nan(dt, {rows, gs.gate_width()});
        dev().attention_gate_split(qkv.c(), gate.c(), qkvg.c(), gs);
        ref().attention_gate_split(qkv.r(), gate.r(), qkvg.r(), gs);
        MT_CHECK_CLOSE(qkv, 0.0);
        MT_CHECK_CLOSE(gate, 0.0);
        Twin merged = twin_nan(dt, {rows, gs.qkvg_width()});
        dev().attention_gate_merge(merged.c(), qkv.c(), gate.c(), gs);
        CHECK(differing(download_bytes(dev(), merged.c()), download_bytes(dev(), qkvg.c()), dtype_size(dt)) == 0);
        // The gate on odd-width views too (a row of attention output per token).
        const int64_t n = rows * gs.gate_width();
        Twin x = twin(dt, {rows, gs.gate_width()}, rng.normal(n, 2.0)), out = twin_nan(dt, {rows, gs.gate_width()});
        dev().output_gate_forward(out.c(), x.c(), gate.c());
        ref().output_gate_forward(out.r(), x.r(), gate.r());
        MT_CHECK_CLOSE(out, tol_for(dt));
        Twin dout = twin(dt, {rows, gs.gate_width()}, rng.normal(n)), dx = twin_nan(dt, {rows, gs.gate_width()}),
             dgate = twin_nan(dt, {rows, gs.gate_width()});
        dev().output_gate_backward(dx.c(), dgate.c(), dout.c(), x.c(), gate.c());
        ref().output_gate_backward(dx.r(), dgate.r(), dout.r(), x.r(), gate.r());
        MT_CHECK_CLOSE(dx, tol_for(dt));
        MT_CHECK_CLOSE(dgate, tol_for(dt));
        // In place, as the model runs it (dx over dout, dgate over gate): the same bits.
        dev().output_gate_backward(dout.c(), gate.c(), dout.c(), x.c(), gate.c());
        CHECK(differing(download_bytes(dev(), dout.c()), download_bytes(dev(), dx.c()), dtype_size(dt)) == 0);
        CHECK(differing(download_bytes(dev(), gate.c()), download_bytes(dev(), dgate.c()), dtype_size(dt)) == 0);
      }
}

TEST_CASE("cuda bias_dropout_add and dropout_backward draw the reference's mask", "[gpu][activation]") {
  MT_RNG(rng);
  for (DType dt : kFloatTypes)
    for (const Shape& s : kShapes)
      for (float p : {0.0f, 0.1f, 0.5f}) {
        INFO(dtype_name(dt) << " " << s[0] << "x" << s[1] << " p " << p);
        const int64_t n = numel(s);
        const uint64_t key = rng.engine()();
        Twin x = twin(dt, s, rng.normal(n)), bias = twin(dt, {s[1]}, rng.normal(s[1])),
             res = twin(dt, s, rng.normal(n)), out = twin_nan(dt, s);
        dev().bias_dropout_add(out.c(), x.c(), bias.c(), res.c(), p, key);
        ref().bias_dropout_add(out.r(), x.r(), bias.r(), res.r(), p, key);
        MT_CHECK_CLOSE(out, tol_for(dt));
        // No bias, output in place over the residual.
        dev().bias_dropout_add(res.c(), x.c(), Tensor(), res.c(), p, key);
        ref().bias_dropout_add(res.r(), x.r(), Tensor(), res.r(), p, key);
        MT_CHECK_CLOSE(res, tol_for(dt));
        // With the amax a tensorwise FP8 cast of dx takes: max |dx| as stored, maxed into the slot.
        Twin dx = twin_nan(dt, s), amax = twin_same(DType::f32, {1}, {0.125});
        dev().dropout_backward(dx.c(), x.c(), p, key, amax.c());
        ref().dropout_backward(dx.r(), x.r(), p, key, amax.r());
        MT_CHECK_CLOSE(dx, tol_for(dt));
        CHECK(static_cast<float>(download(dev(), amax.c())[0]) == max_abs_of(dev(), dx.c(), 0.125f));
        CHECK(static_cast<float>(download(ref(), amax.r())[0]) == max_abs_of(ref(), dx.r(), 0.125f));
        if (p > 0 && n >= 100000) {  // the kept fraction is 1 - p
          int64_t kept = 0;
          for (double v : download(dev(), dx.c())) kept += v != 0.0;
          CHECK(static_cast<double>(kept) / n == Approx(1.0 - p).margin(0.01));
        }
        // In place.
        dev().dropout_backward(x.c(), x.c(), p, key);
        ref().dropout_backward(x.r(), x.r(), p, key);
        MT_CHECK_CLOSE(x, tol_for(dt));
      }
}
