#include "tests/gpu/gpu_test_util.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>

namespace mt::gputest {

Backend& dev() {
  static std::unique_ptr<Backend> be = make_cuda_backend(0);
  return *be;
}

Backend& ref() {
  static std::unique_ptr<Backend> be = make_reference_backend(0);
  return *be;
}

Buf::Buf(Backend& b, DType dt, std::initializer_list<int64_t> shape) : be(&b) {
  t = Tensor(nullptr, dt, b.device(), shape);
  t.data = b.allocate(std::max<size_t>(t.nbytes(), 16));
}

Buf::Buf(Backend& b, DType dt, const std::vector<int64_t>& shape) : be(&b) {
  MT_CHECK(shape.size() <= static_cast<size_t>(Tensor::kMaxDims), "too many dims");
  t.dtype = dt;
  t.device = b.device();
  t.ndim = static_cast<int>(shape.size());
  for (size_t i = 0; i < shape.size(); ++i) t.shape[i] = shape[i];
  t.data = b.allocate(std::max<size_t>(t.nbytes(), 16));
}

Buf::~Buf() {
  if (be && t.data) be->deallocate(t.data);
}

Buf::Buf(Buf&& o) noexcept : t(o.t), be(o.be) { o.t.data = nullptr; }
Buf& Buf::operator=(Buf&& o) noexcept {
  if (this != &o) {
    if (be && t.data) be->deallocate(t.data);
    t = o.t;
    be = o.be;
    o.t.data = nullptr;
  }
  return *this;
}

std::vector<uint8_t> encode(DType dt, const std::vector<double>& v) {
  std::vector<uint8_t> out(v.size() * dtype_size(dt));
  for (size_t i = 0; i < v.size(); ++i) {
    uint8_t* p = out.data() + i * dtype_size(dt);
    switch (dt) {
      case DType::f32: { const float f = static_cast<float>(v[i]); std::memcpy(p, &f, 4); break; }
      case DType::f64: std::memcpy(p, &v[i], 8); break;
      case DType::bf16: { const uint16_t b = float_to_bf16_bits(static_cast<float>(v[i])); std::memcpy(p, &b, 2); break; }
      case DType::f16: { const uint16_t b = float_to_f16_bits(static_cast<float>(v[i])); std::memcpy(p, &b, 2); break; }
      case DType::i32: { const int32_t x = static_cast<int32_t>(v[i]); std::memcpy(p, &x, 4); break; }
      case DType::i64: { const int64_t x = static_cast<int64_t>(v[i]); std::memcpy(p, &x, 8); break; }
      case DType::u8: *p = static_cast<uint8_t>(v[i]); break;
      case DType::i16: { const int16_t x = static_cast<int16_t>(v[i]); std::memcpy(p, &x, 2); break; }
      case DType::fp8_e4m3:
      case DType::fp8_e5m2: *p = float_to_fp8_bits(dt, static_cast<float>(v[i])); break;
    }
  }
  return out;
}

std::vector<double> decode(DType dt, const uint8_t* b, int64_t n) {
  std::vector<double> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t* p = b + i * dtype_size(dt);
    switch (dt) {
      case DType::f32: { float f; std::memcpy(&f, p, 4); out[i] = f; break; }
      case DType::f64: std::memcpy(&out[i], p, 8); break;
      case DType::bf16: { uint16_t h; std::memcpy(&h, p, 2); out[i] = bf16_bits_to_float(h); break; }
      case DType::f16: { uint16_t h; std::memcpy(&h, p, 2); out[i] = f16_bits_to_float(h); break; }
      case DType::i32: { int32_t x; std::memcpy(&x, p, 4); out[i] = x; break; }
      case DType::i64: { int64_t x; std::memcpy(&x, p, 8); out[i] = static_cast<double>(x); break; }
      case DType::u8: out[i] = *p; break;
      case DType::i16: { int16_t x; std::memcpy(&x, p, 2); out[i] = x; break; }
      case DType::fp8_e4m3:
      case DType::fp8_e5m2: out[i] = fp8_bits_to_float(dt, *p); break;
    }
  }
  return out;
}

double round_to(DType dt, double v) {
  const std::vector<uint8_t> b = encode(dt, {v});
  return decode(dt, b.data(), 1)[0];
}

void upload(Backend& be, const Tensor& t, const std::vector<double>& values) {
  MT_CHECK(static_cast<int64_t>(values.size()) == t.numel(), "upload: {} values for {}", values.size(),
           t.shape_string());
  const std::vector<uint8_t> bytes = encode(t.dtype, values);
  be.copy_from_host(t, bytes.data());
  be.synchronize();
}

std::vector<uint8_t> download_bytes(Backend& be, const Tensor& t) {
  std::vector<uint8_t> bytes(t.nbytes());
  be.copy_to_host(bytes.data(), t);
  return bytes;
}

std::vector<double> download(Backend& be, const Tensor& t) {
  const std::vector<uint8_t> bytes = download_bytes(be, t);
  return decode(t.dtype, bytes.data(), t.numel());
}

Twin twin(DType dt, const std::vector<int64_t>& shape, const std::vector<double>& values) {
  const DType ref_dt = is_floating(dt) ? DType::f32 : dt;
  Twin x{Buf(dev(), dt, shape), Buf(ref(), ref_dt, shape)};
  std::vector<double> rounded(values.size());
  for (size_t i = 0; i < values.size(); ++i) rounded[i] = is_floating(dt) ? round_to(dt, values[i]) : values[i];
  upload(dev(), x.cu.t, rounded);
  upload(ref(), x.ref.t, rounded);
  return x;
}

Twin twin_same(DType dt, const std::vector<int64_t>& shape, const std::vector<double>& values) {
  Twin x{Buf(dev(), dt, shape), Buf(ref(), dt, shape)};
  upload(dev(), x.cu.t, values);
  upload(ref(), x.ref.t, values);
  return x;
}

Twin twin_nan(DType dt, const std::vector<int64_t>& shape) {
  return twin(dt, shape, std::vector<double>(static_cast<size_t>(numel(shape)), std::numeric_limits<double>::quiet_NaN()));
}

Rng::Rng() {
  if (const char* s = std::getenv("MT_TEST_SEED")) seed_ = std::strtoull(s, nullptr, 10);
  else seed_ = (static_cast<uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}();
  gen_.seed(seed_);
}

std::vector<double> Rng::normal(int64_t n, double std) {
  std::normal_distribution<double> d(0.0, std);
  std::vector<double> v(static_cast<size_t>(n));
  for (auto& x : v) x = d(gen_);
  return v;
}

std::vector<double> Rng::uniform(int64_t n, double lo, double hi) {
  std::uniform_real_distribution<double> d(lo, hi);
  std::vector<double> v(static_cast<size_t>(n));
  for (auto& x : v) x = d(gen_);
  return v;
}

std::vector<double> Rng::ints(int64_t n, int64_t lo, int64_t hi) {
  std::uniform_int_distribution<int64_t> d(lo, hi - 1);
  std::vector<double> v(static_cast<size_t>(n));
  for (auto& x : v) x = static_cast<double>(d(gen_));
  return v;
}

int64_t differing(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b, size_t elem_bytes) {
  if (a.size() != b.size()) return static_cast<int64_t>(std::max(a.size(), b.size()) / elem_bytes + 1);
  int64_t n = 0;
  for (size_t i = 0; i < a.size(); i += elem_bytes) n += std::memcmp(&a[i], &b[i], elem_bytes) != 0;
  return n;
}

double rel_err(const std::vector<double>& got, const std::vector<double>& want) {
  if (got.size() != want.size()) return std::numeric_limits<double>::infinity();
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double d = got[i] - want[i];
    num += d * d;
    den += want[i] * want[i];
  }
  if (den == 0) return std::sqrt(num);
  return std::sqrt(num / den);
}

int64_t rows_beyond_term_bound(const std::vector<double>& got, const std::vector<double>& want, int64_t rows,
                               int64_t cols, double rel, const std::function<double(int64_t, int64_t)>& term) {
  int64_t bad = 0;
  for (int64_t r = 0; r < rows; ++r) {
    double mag = 0;
    for (int64_t c = 0; c < cols; ++c) mag += std::fabs(term(r, c));
    const size_t i = static_cast<size_t>(r);
    bad += !(std::fabs(got.at(i) - want.at(i)) <= rel * mag + 1e-30);
  }
  return bad;
}

// Below the smallest normal number of the CUDA side's dtype (fp16: 6.1e-5) a stored value keeps
// only its absolute spacing (fp16 subnormals: 6e-8), not relative precision: a one-element fp16
// output of 5e-6 is off by up to 0.6% after its one rounding. So each element contributes at least
// that normal's square to the denominator; for tensors of normal values this changes nothing.
double rel_err(const Twin& x) {
  std::vector<double> got = download(dev(), x.cu.t), want = download(ref(), x.ref.t);
  const double floor = x.cu.t.dtype == DType::f16 ? 6.103515625e-05 : 0.0;
  if (got.size() != want.size() || floor == 0) return rel_err(got, want);
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double d = got[i] - want[i];
    num += d * d;
    den += std::max(want[i] * want[i], floor * floor);
  }
  return std::sqrt(num / den);
}

double tol_for(DType dt) {
  switch (dt) {
    case DType::bf16: return 1e-2;  // bf16 keeps 8 bits: one rounding is up to 2^-9 relative
    case DType::f16: return 2e-3;   // 11 bits
    default: return 1e-5;           // float32 math in a different order than the float64 reference
  }
}

}  // namespace mt::gputest

namespace mt::gputest {

void check_bf16_grad_close(const std::vector<double>& got, const std::vector<double>& want, const std::string& what) {
  INFO(what << ": bf16 gradient, " << want.size() << " elements");
  REQUIRE(got.size() == want.size());
  if (want.empty()) return;
  double ss = 0;
  for (double w : want) ss += w * w;
  const double rms = std::sqrt(ss / static_cast<double>(want.size()));
  const double abs_tol = 1e-4 * rms, floor = 1e-3 * rms;
  const double step = std::ldexp(1.0, -7);
  int64_t not_bf16 = 0, outside = 0, differ = 0, first = -1;
  double sum_rel = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double g = got[i], w = want[i], err = std::fabs(g - w);
    not_bf16 += !(round_to(DType::bf16, g) == g);  // NaN too
    differ += g != w;
    if (!(err <= step * std::fabs(w) + abs_tol)) {
      if (first < 0) first = static_cast<int64_t>(i);
      ++outside;
    }
    sum_rel += std::isfinite(err) ? err / std::max({std::fabs(w), floor, 1e-30}) : 1.0;
  }
  const double mean_rel = sum_rel / static_cast<double>(want.size());
  INFO("elements not bf16 values: " << not_bf16 << "; outside one bf16 step: " << outside << " (first at " << first
                                    << (first >= 0 ? ": got " + std::to_string(got[static_cast<size_t>(first)]) +
                                                         " want " + std::to_string(want[static_cast<size_t>(first)])
                                                   : std::string())
                                    << "); differing: " << differ << "; mean relative error " << mean_rel
                                    << " (bound 2^-11 = " << std::ldexp(1.0, -11) << "), rms " << rms);
  CHECK(not_bf16 == 0);
  CHECK(outside == 0);
  CHECK(mean_rel <= std::ldexp(1.0, -11));
}

void check_bf16_grad(const Twin& g, const std::string& what) {
  REQUIRE(g.cu.t.dtype == DType::bf16);
  REQUIRE(g.ref.t.dtype == DType::bf16);
  check_bf16_grad_close(download(dev(), g.cu.t), download(ref(), g.ref.t), what);
}

double bf16_accumulate(double old, double sum) {
  return round_to(DType::bf16, static_cast<double>(static_cast<float>(old) + static_cast<float>(sum)));
}

}  // namespace mt::gputest
