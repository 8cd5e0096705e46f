// FP8 kernels (cuda/fp8_kernels.h) against core/dtype.h's host conversions (float_to_fp8_bits):
// every bf16 bit pattern cast at several scales must give bit-identical fp8 bytes (round to nearest
// even, saturating, NaN stays NaN; NaN codes compared as NaN), the transposed copy must be the
// exact transpose, amax exact, dequantization exact, and the delayed-scaling update must follow
// its formula step by step. A second host oracle, written here from the format definitions
// (fp8_test_util), is checked against core/dtype.h's on the same inputs.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>

#include "cuda/cuda_backend.h"
#include "cuda/fp8_kernels.h"
#include "tests/gpu/fp8_test_util.h"
#include "tests/gpu/gpu_test_util.h"

using namespace mt;
using namespace mt::gputest;

namespace {

const cuda::Fp8Format kFormats[] = {cuda::Fp8Format::e4m3, cuda::Fp8Format::e5m2};

DType dtype_of(cuda::Fp8Format f) { return f == cuda::Fp8Format::e4m3 ? DType::fp8_e4m3 : DType::fp8_e5m2; }

// Host oracle for the whole cast: bytes of fp8(x * scale) for float inputs (core/dtype.h).
std::vector<uint8_t> oracle_cast(const std::vector<float>& in, float scale, cuda::Fp8Format f) {
  std::vector<uint8_t> out(in.size());
  for (size_t i = 0; i < in.size(); ++i) out[i] = float_to_fp8_bits(dtype_of(f), in[i] * scale);
  return out;
}

// Bytes that differ, counting every NaN code as equal to every other NaN code of the format.
int64_t fp8_mismatches(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want, cuda::Fp8Format f,
                       std::string* first) {
  if (got.size() != want.size()) return static_cast<int64_t>(std::max(got.size(), want.size()));
  int64_t n = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] == want[i]) continue;
    if (std::isnan(fp8test::decode_fp8(got[i], f)) && std::isnan(fp8test::decode_fp8(want[i], f))) continue;
    if (n == 0) {
      char buf[96];
      std::snprintf(buf, sizeof(buf), "index %zu: got 0x%02x want 0x%02x", i, got[i], want[i]);
      *first = buf;
    }
    ++n;
  }
  return n;
}

#define CHECK_FP8_SAME(got_, want_, format_)                                              \
  do {                                                                                    \
    std::string mt_first_;                                                                \
    const int64_t mt_bad_ = fp8_mismatches((got_), (want_), (format_), &mt_first_);       \
    INFO("fp8 bytes differing: " << mt_bad_ << "; first " << mt_first_);                  \
    CHECK(mt_bad_ == 0);                                                                  \
  } while (0)

std::vector<float> all_bf16_values() {
  std::vector<float> v(65536);
  for (uint32_t b = 0; b < 65536; ++b) v[b] = bf16_bits_to_float(static_cast<uint16_t>(b));
  return v;
}

std::vector<uint8_t> bf16_bytes(const std::vector<float>& v) {
  std::vector<uint8_t> out(v.size() * 2);
  for (size_t i = 0; i < v.size(); ++i) {
    const uint16_t b = float_to_bf16_bits(v[i]);
    std::memcpy(&out[2 * i], &b, 2);
  }
  return out;
}

float host_amax(const std::vector<float>& v) {
  float m = 0.0f;
  // NaN ignored, as the kernels' fmaxf does (std::fmax would return NaN for a signaling NaN).
  for (float x : v)
    if (!std::isnan(x)) m = std::max(m, std::fabs(x));
  return m;
}

}  // namespace

TEST_CASE("fp8 host oracle: decode/encode round trip of every code", "[gpu][fp8]") {
  for (cuda::Fp8Format f : kFormats) {
    INFO("format " << cuda::fp8_format_name(f));
    int finite = 0;
    for (int c = 0; c < 256; ++c) {
      const double v = fp8test::decode_fp8(static_cast<uint8_t>(c), f);
      if (!std::isfinite(v)) continue;
      ++finite;
      CHECK(fp8test::encode_fp8(static_cast<float>(v), f) == c);
    }
    CHECK(finite == (f == cuda::Fp8Format::e4m3 ? 254 : 248));
    CHECK(fp8test::decode_fp8(fp8test::encode_fp8(1e30f, f), f) == cuda::fp8_format_max(f));
    CHECK(cuda::fp8_format_max(f) == fp8_max(dtype_of(f)));
    // The two host oracles agree: every code decodes alike, every scaled bf16 value encodes alike.
    int64_t bad = 0;
    for (int c = 0; c < 256; ++c) {
      const double a = fp8test::decode_fp8(static_cast<uint8_t>(c), f);
      const float b = fp8_bits_to_float(dtype_of(f), static_cast<uint8_t>(c));
      bad += !(a == b || (std::isnan(a) && std::isnan(b)));
    }
    const std::vector<float> values = all_bf16_values();
    std::string first;
    for (float scale : {1.0f, 0.375f, 1024.0f, 3.0517578e-05f, 7.3f}) {
      std::vector<uint8_t> mine(values.size());
      for (size_t i = 0; i < values.size(); ++i) mine[i] = fp8test::encode_fp8(values[i] * scale, f);
      bad += fp8_mismatches(mine, oracle_cast(values, scale, f), f, &first);
    }
    INFO("first mismatch " << first);
    CHECK(bad == 0);
  }
}

TEST_CASE("fp8 cast: every bf16 value, bit-exact against the host oracle", "[gpu][fp8]") {
  CudaBackend& be = fp8test::cuda_backend();
  const cuda::KernelContext ctx = fp8test::context();
  const std::vector<float> values = all_bf16_values();
  const int64_t n = static_cast<int64_t>(values.size());
  Buf in(be, DType::bf16, {256, 256});
  fp8test::put(in, bf16_bytes(values).data());
  Buf out(be, DType::u8, {n}), out_t(be, DType::u8, {n}), scale(be, DType::f32, {1}), amax(be, DType::f32, {1});
  for (cuda::Fp8Format f : kFormats)
    for (float s : {1.0f, 0.375f, 1024.0f, 3.0517578e-05f, 7.3f}) {
      INFO("format " << cuda::fp8_format_name(f) << " scale " << s);
      fp8test::put_floats(scale, {s});
      fp8test::put_floats(amax, {0.0f});
      const std::vector<uint8_t> want = oracle_cast(values, s, f);

      cuda::cast_to_fp8(ctx, out.t.data, f, in.t, scale.t.ptr<float>(), amax.t.ptr<float>());
      CHECK_FP8_SAME(download_bytes(be, out.t), want, f);
      // amax over all bf16 values: infinity (NaN ignored).
      CHECK(fp8test::get_floats(amax)[0] == host_amax(values));

      // Unaligned, odd-length view: the scalar path.
      Tensor odd = in.t.flat_slice(1, n - 2);
      fp8test::fill_bytes(out, 0xAA);
      cuda::cast_to_fp8(ctx, out.t.data, f, odd, scale.t.ptr<float>(), nullptr);
      std::vector<uint8_t> got = download_bytes(be, out.t);
      got.resize(static_cast<size_t>(n - 2));
      CHECK_FP8_SAME(got, std::vector<uint8_t>(want.begin() + 1, want.end() - 1), f);

      // Cast + transpose of the 256 x 256 view.
      fp8test::fill_bytes(out, 0xAA);
      fp8test::fill_bytes(out_t, 0xAA);
      cuda::cast_transpose_to_fp8(ctx, out.t.data, out_t.t.data, f, in.t, scale.t.ptr<float>(), nullptr);
      CHECK_FP8_SAME(download_bytes(be, out.t), want, f);
      CHECK_FP8_SAME(download_bytes(be, out_t.t), fp8test::transpose_bytes(want, 256, 256), f);
    }
}

TEST_CASE("fp8 cast: float32 inputs over many magnitudes, bit-exact", "[gpu][fp8]") {
  MT_RNG(rng);
  CudaBackend& be = fp8test::cuda_backend();
  const cuda::KernelContext ctx = fp8test::context();
  const int64_t n = 1 << 16;
  std::vector<float> v(static_cast<size_t>(n));
  std::uniform_real_distribution<double> expo(-30.0, 20.0);
  std::normal_distribution<double> mant(0.0, 1.0);
  for (auto& x : v) x = static_cast<float>(mant(rng.engine()) * std::exp2(expo(rng.engine())));
  v[0] = std::numeric_limits<float>::infinity();
  v[1] = -std::numeric_limits<float>::infinity();
  v[2] = -0.0f;
  v[3] = std::numeric_limits<float>::denorm_min();
  Buf in(be, DType::f32, {n / 128, 128}), out(be, DType::u8, {n}), out_t(be, DType::u8, {n}), scale(be, DType::f32, {1});
  fp8test::put(in, v.data());
  for (cuda::Fp8Format f : kFormats)
    for (float s : {1.0f, 0.01f, 5000.0f}) {
      INFO("format " << cuda::fp8_format_name(f) << " scale " << s);
      fp8test::put_floats(scale, {s});
      const std::vector<uint8_t> want = oracle_cast(v, s, f);
      cuda::cast_to_fp8(ctx, out.t.data, f, in.t, scale.t.ptr<float>(), nullptr);
      CHECK_FP8_SAME(download_bytes(be, out.t), want, f);
      cuda::cast_transpose_to_fp8(ctx, nullptr, out_t.t.data, f, in.t, scale.t.ptr<float>(), nullptr);
      CHECK_FP8_SAME(download_bytes(be, out_t.t), fp8test::transpose_bytes(want, n / 128, 128), f);
    }
}

TEST_CASE("fp8 cast_transpose: shapes, exact transpose and amax", "[gpu][fp8]") {
  MT_RNG(rng);
  CudaBackend& be = fp8test::cuda_backend();
  const cuda::KernelContext ctx = fp8test::context();
  struct RC {
    int64_t r, c;
  };
  // Vector path (multiples of 8, partial 64-tiles), scalar path (odd sizes), and a large one.
  for (RC s : {RC{16, 48}, RC{64, 64}, RC{200, 136}, RC{33, 70}, RC{1, 5}, RC{4096, 1024}, RC{520, 2056}})
    for (DType dt : {DType::bf16, DType::f32})
      for (cuda::Fp8Format f : kFormats) {
        INFO("shape " << s.r << " x " << s.c << " " << dtype_name(dt) << " " << cuda::fp8_format_name(f));
        const int64_t n = s.r * s.c;
        std::vector<double> vals = rng.normal(n, 3.0);
        std::vector<float> vf(vals.size());
        for (size_t i = 0; i < vals.size(); ++i) vf[i] = static_cast<float>(round_to(dt, vals[i]));
        Buf in(be, dt, {s.r, s.c}), out(be, DType::u8, {n}), out_t(be, DType::u8, {n});
        Buf scale(be, DType::f32, {1}), amax(be, DType::f32, {1}), amax2(be, DType::f32, {1});
        upload(be, in.t, vals);
        fp8test::put_floats(scale, {37.5f});
        fp8test::put_floats(amax, {0.0f});
        fp8test::put_floats(amax2, {0.0f});
        fp8test::fill_bytes(out, 0xAA);
        fp8test::fill_bytes(out_t, 0xAA);
        cuda::cast_transpose_to_fp8(ctx, out.t.data, out_t.t.data, f, in.t, scale.t.ptr<float>(), amax.t.ptr<float>());
        const std::vector<uint8_t> want = oracle_cast(vf, 37.5f, f);
        CHECK_FP8_SAME(download_bytes(be, out.t), want, f);
        CHECK_FP8_SAME(download_bytes(be, out_t.t), fp8test::transpose_bytes(want, s.r, s.c), f);
        CHECK(fp8test::get_floats(amax)[0] == host_amax(vf));
        cuda::fp8_amax(ctx, amax2.t.ptr<float>(), in.t);
        CHECK(fp8test::get_floats(amax2)[0] == host_amax(vf));
      }
}

TEST_CASE("fp8 amax: accumulates into a running maximum", "[gpu][fp8]") {
  CudaBackend& be = fp8test::cuda_backend();
  const cuda::KernelContext ctx = fp8test::context();
  Buf in(be, DType::f32, {1000}), amax(be, DType::f32, {1});
  std::vector<double> v(1000, 0.5);
  v[777] = -3.25;
  upload(be, in.t, v);
  fp8test::put_floats(amax, {5.0f});  // larger than the tensor's: stays
  cuda::fp8_amax(ctx, amax.t.ptr<float>(), in.t);
  CHECK(fp8test::get_floats(amax)[0] == 5.0f);
  fp8test::put_floats(amax, {1.0f});
  cuda::fp8_amax(ctx, amax.t.ptr<float>(), in.t);
  CHECK(fp8test::get_floats(amax)[0] == 3.25f);
}

TEST_CASE("fp8 dequantize: every code times scale_inv, exact", "[gpu][fp8]") {
  CudaBackend& be = fp8test::cuda_backend();
  const cuda::KernelContext ctx = fp8test::context();
  std::vector<uint8_t> codes(256);
  for (int c = 0; c < 256; ++c) codes[c] = static_cast<uint8_t>(c);
  Buf in(be, DType::u8, {256}), out(be, DType::f32, {256}), sinv(be, DType::f32, {1});
  fp8test::put(in, codes.data());
  for (cuda::Fp8Format f : kFormats) {
    fp8test::put_floats(sinv, {0.125f});
    cuda::cast_from_fp8(ctx, out.t, in.t.data, f, sinv.t.ptr<float>());
    const std::vector<float> got = fp8test::get_floats(out);
    int64_t bad = 0;
    for (int c = 0; c < 256; ++c) {
      const float want = static_cast<float>(fp8test::decode_fp8(static_cast<uint8_t>(c), f)) * 0.125f;
      if (std::isnan(want) ? !std::isnan(got[c]) : got[c] != want) ++bad;
    }
    INFO("format " << cuda::fp8_format_name(f));
    CHECK(bad == 0);
  }
}

TEST_CASE("fp8 delayed scaling update: history roll, max / most_recent, margin, guards", "[gpu][fp8]") {
  CudaBackend& be = fp8test::cuda_backend();
  const cuda::KernelContext ctx = fp8test::context();
  const int H = 4, T = 5;
  // Row-major [H, T]. Tensor 0: ordinary; 1: amax 0 (scale kept); 2: infinite amax (kept); 3: the
  // largest value is an old row; 4: a subnormal amax whose scale overflows (FLT_MAX).
  const float tiny = 1e-40f;
  const std::vector<float> hist0 = {2.0f, 0.0f, INFINITY, 1.0f,  tiny,  //
                                    1.0f, 0.0f, 1.0f,     8.0f,  0.0f,  //
                                    4.0f, 0.0f, 1.0f,     2.0f,  0.0f,  //
                                    0.5f, 0.0f, 1.0f,     0.25f, 0.0f};
  for (cuda::Fp8AmaxAlgo algo : {cuda::Fp8AmaxAlgo::max, cuda::Fp8AmaxAlgo::most_recent})
    for (int margin : {0, 1})
      for (bool per_tensor_max : {false, true}) {
        INFO("algo " << (algo == cuda::Fp8AmaxAlgo::max ? "max" : "most_recent") << " margin " << margin
                     << " per-tensor fp8_max " << per_tensor_max);
        // Per-tensor maxima alternate the formats; the scalar is e4m3's.
        const std::vector<float> maxima = {448.0f, 57344.0f, 448.0f, 57344.0f, 448.0f};
        Buf hist(be, DType::f32, {H, T}), scale(be, DType::f32, {T}), sinv(be, DType::f32, {T}), fmax_buf(be, DType::f32, {T});
        fp8test::put_floats(hist, hist0);
        fp8test::put_floats(scale, std::vector<float>(T, 3.0f));
        fp8test::put_floats(sinv, std::vector<float>(T, 1.0f / 3.0f));
        fp8test::put_floats(fmax_buf, maxima);
        cuda::fp8_update_scales(ctx, hist.t.ptr<float>(), H, T, scale.t.ptr<float>(), sinv.t.ptr<float>(), 448.0f,
                                margin, algo, 1, per_tensor_max ? fmax_buf.t.ptr<float>() : nullptr);
        const std::vector<float> h = fp8test::get_floats(hist), s = fp8test::get_floats(scale),
                                 si = fp8test::get_floats(sinv);
        for (int t = 0; t < T; ++t) {
          float amax = hist0[t];
          if (algo == cuda::Fp8AmaxAlgo::max)
            for (int r = 1; r < H; ++r) amax = std::fmax(amax, hist0[r * T + t]);
          const float m = per_tensor_max ? maxima[t] : 448.0f;
          float want = 3.0f;
          if (amax > 0 && std::isfinite(amax)) {
            want = (m / amax) / std::ldexp(1.0f, margin);
            if (std::isinf(want)) want = FLT_MAX;
          }
          INFO("tensor " << t);
          CHECK(s[t] == want);
          CHECK(si[t] == 1.0f / want);
          CHECK(h[t] == 0.0f);  // row 0 zeroed for the next step
          for (int r = 1; r + 1 < H; ++r) CHECK(h[r * T + t] == hist0[(r + 1) * T + t]);
          CHECK((std::isinf(hist0[t]) ? std::isinf(h[(H - 1) * T + t]) : h[(H - 1) * T + t] == hist0[t]));
        }
        CHECK(s[4] == FLT_MAX);
      }
  // History length 1: the amax becomes the scale right away.
  Buf hist(be, DType::f32, {1, 1}), scale(be, DType::f32, {1}), sinv(be, DType::f32, {1});
  fp8test::put_floats(hist, {7.0f});
  fp8test::put_floats(scale, {1.0f});
  cuda::fp8_update_scales(ctx, hist.t.ptr<float>(), 1, 1, scale.t.ptr<float>(), sinv.t.ptr<float>(), 57344.0f, 0,
                          cuda::Fp8AmaxAlgo::max);
  CHECK(fp8test::get_floats(scale)[0] == 57344.0f / 7.0f);
  CHECK(fp8test::get_floats(hist)[0] == 0.0f);
}

TEST_CASE("fp8 tensorwise scale: fresh amax -> scale, running amax, guards", "[gpu][fp8]") {
  CudaBackend& be = fp8test::cuda_backend();
  const cuda::KernelContext ctx = fp8test::context();
  Buf fresh(be, DType::f32, {1}), amax(be, DType::f32, {1}), scale(be, DType::f32, {1}), sinv(be, DType::f32, {1});
  struct Case {
    float fresh, amax_before, want_scale, want_amax;
  };
  for (Case c : {Case{3.5f, 1.0f, (448.0f / 3.5f) / 2.0f, 3.5f}, Case{0.5f, 9.0f, (448.0f / 0.5f) / 2.0f, 9.0f},
                 Case{0.0f, 2.0f, 5.0f, 2.0f}, Case{1e-40f, 0.0f, FLT_MAX, 1e-40f}}) {
    INFO("fresh amax " << c.fresh);
    fp8test::put_floats(fresh, {c.fresh});
    fp8test::put_floats(amax, {c.amax_before});
    fp8test::put_floats(scale, {5.0f});
    fp8test::put_floats(sinv, {0.2f});
    cuda::fp8_tensorwise_scale(ctx, fresh.t.ptr<float>(), amax.t.ptr<float>(), scale.t.ptr<float>(),
                               sinv.t.ptr<float>(), 448.0f, 1);
    CHECK(fp8test::get_floats(scale)[0] == c.want_scale);
    CHECK(fp8test::get_floats(sinv)[0] == (c.want_scale == 5.0f ? 0.2f : 1.0f / c.want_scale));
    CHECK(fp8test::get_floats(amax)[0] == c.want_amax);
  }
}
