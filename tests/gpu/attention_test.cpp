// CUDA attention (flash kernels, every compiled tile configuration, and cuDNN's fused attention)
// against the reference implementation, on fresh random inputs.
//
// Method: inputs are drawn in float, rounded to bf16/fp16, and the SAME rounded values feed the GPU
// and the reference (engine/reference/attention.h, float storage, double sums). Outputs are poisoned
// with NaN before every run. The backward of every variant gets the same out/lse (those of the
// default flash forward), and so does the reference backward, so each pass is checked on its own.
// Big shapes are checked on a few (sample, KV group) slices: the reference runs on the extracted
// sub-problem (b = 1, those groups), in parallel threads.
//
// Tolerances (16-bit inputs; P and dS are rounded to 16 bits inside the kernels, outputs too):
//   out, dq, dk, dv: relative L2 error <= 1e-2;  lse: max abs error <= 1e-3.
#include <catch2/catch.hpp>

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <future>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/philox.h"
#include "cuda/attention.h"
#include "cuda/attention_cudnn.h"
#include "cuda/attention_flash.h"
#include "cuda/attention_generic.h"
#include "cuda/cuda_check.h"
#include "engine/reference/attention.h"

using namespace mt;

namespace {

constexpr double kRelTol = 1e-2;
constexpr double kLseTol = 1e-3;

struct Problem {
  std::string name;
  int b, s, heads, groups, d;
  DType dtype = DType::bf16;
  float dropout = 0;
  bool causal = true;
  float input_std = 1.0f;
  std::vector<int> samples = {};         // checked samples; empty: the whole problem
  std::vector<int> checked_groups = {};  // checked KV groups (with samples)
  bool all_configs = false;        // also run every compiled flash tile configuration
  int window = -1;                 // sliding window (AttentionShape::window_left)

  AttentionShape shape() const {
    AttentionShape a = AttentionShape::make(b, s, heads, groups, d, causal, dropout, 0x5eed);
    a.window_left = window;
    return a;
  }
};

Problem windowed(Problem p, int window) {
  p.window = window;
  p.name += fmt::format(" window {}", window);
  return p;
}

uint16_t to_bits(float x, DType t) { return t == DType::bf16 ? float_to_bf16_bits(x) : float_to_f16_bits(x); }
float from_bits(uint16_t x, DType t) { return t == DType::bf16 ? bf16_bits_to_float(x) : f16_bits_to_float(x); }

// Host values of a 16-bit tensor: the bits (for the device) and their float values (for the reference).
struct HostHalf {
  std::vector<uint16_t> bits;
  std::vector<float> values;
  void random(size_t n, uint64_t key, float stddev, DType t) {
    bits.resize(n);
    values.resize(n);
    const size_t parts = 16, chunk = (n + parts - 1) / parts;
    std::vector<std::future<void>> jobs;
    for (size_t begin = 0; begin < n; begin += chunk)
      jobs.push_back(std::async(std::launch::async, [=, this] {
        for (size_t i = begin; i < std::min(n, begin + chunk); ++i) {
          bits[i] = to_bits(stddev * normal_at(key, i), t);
          values[i] = from_bits(bits[i], t);
        }
      }));
    for (auto& j : jobs) j.get();
  }
  void from_device_bits(const std::vector<uint16_t>& b, DType t) {
    bits = b;
    values.resize(b.size());
    for (size_t i = 0; i < b.size(); ++i) values[i] = from_bits(b[i], t);
  }
};

struct DeviceBuffer {
  void* ptr = nullptr;
  size_t bytes = 0;
  explicit DeviceBuffer(size_t n) : bytes(n) { MT_CUDA_CHECK(cudaMalloc(&ptr, std::max<size_t>(n, 256))); }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void poison() { MT_CUDA_CHECK(cudaMemset(ptr, 0xFF, bytes)); }  // NaN in bf16, fp16 and fp32
  template <typename T>
  void upload(const std::vector<T>& v) { MT_CUDA_CHECK(cudaMemcpy(ptr, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice)); }
  template <typename T>
  std::vector<T> download() const {
    std::vector<T> v(bytes / sizeof(T));
    MT_CUDA_CHECK(cudaMemcpy(v.data(), ptr, bytes, cudaMemcpyDeviceToHost));
    return v;
  }
};

// One checked slice: sample i, KV groups G. Maps between the full tensors and the sub-problem's.
struct Slice {
  const Problem& p;
  int sample;
  std::vector<int> groups;
  int hpg() const { return p.heads / p.groups; }
  AttentionShape sub_shape() const {
    AttentionShape a = p.shape();
    a.batch = 1;
    a.groups = static_cast<int>(groups.size());
    a.heads = a.groups * hpg();
    return a;
  }
  // Calls f(full_index, sub_index, count) for each contiguous run of the qkv layout.
  void qkv_runs(const std::function<void(size_t, size_t, size_t)>& f) const {
    const size_t run = static_cast<size_t>(hpg() + 2) * p.d;
    const size_t stride = p.groups * run, sub_stride = groups.size() * run;
    for (int t = 0; t < p.s; ++t)
      for (size_t gi = 0; gi < groups.size(); ++gi)
        f((static_cast<size_t>(t) * p.b + sample) * stride + groups[gi] * run, t * sub_stride + gi * run, run);
  }
  void out_runs(const std::function<void(size_t, size_t, size_t)>& f) const {
    const size_t run = static_cast<size_t>(hpg()) * p.d;
    const size_t stride = static_cast<size_t>(p.heads) * p.d, sub_stride = groups.size() * run;
    for (int t = 0; t < p.s; ++t)
      for (size_t gi = 0; gi < groups.size(); ++gi)
        f((static_cast<size_t>(t) * p.b + sample) * stride + groups[gi] * run, t * sub_stride + gi * run, run);
  }
  void lse_runs(const std::function<void(size_t, size_t, size_t)>& f) const {
    for (size_t gi = 0; gi < groups.size(); ++gi)
      for (int j = 0; j < hpg(); ++j)
        f((static_cast<size_t>(sample) * p.heads + groups[gi] * hpg() + j) * p.s, (gi * hpg() + j) * p.s, p.s);
  }
};

template <typename F>
std::vector<float> gather(const std::vector<float>& full, size_t sub_size, F&& runs) {
  std::vector<float> sub(sub_size);
  runs([&](size_t fi, size_t si, size_t n) { std::copy_n(full.begin() + fi, n, sub.begin() + si); });
  return sub;
}

struct Diff {
  double rel = 0;   // L2 error relative to max(|want|, kRmsFloor * sqrt(n))
  double max_abs = 0;
  bool finite = true;
};
// Where the exact gradient is ~0 (s = 1: softmax of one score is constant, so dq = dk = 0), a
// relative error means nothing; the floor makes it an absolute one of kRmsFloor RMS there. Every
// other checked tensor has RMS >> kRmsFloor, so the floor does not loosen those checks.
constexpr double kRmsFloor = 1e-3;
Diff compare(const std::vector<float>& got, const std::vector<float>& want) {
  double num = 0, den = 0;
  Diff e;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) e.finite = false;
    const double diff = static_cast<double>(got[i]) - want[i];
    num += diff * diff;
    den += static_cast<double>(want[i]) * want[i];
    e.max_abs = std::max(e.max_abs, std::abs(diff));
  }
  e.rel = std::sqrt(num / std::max(den, kRmsFloor * kRmsFloor * static_cast<double>(want.size())));
  return e;
}

// One case's errors against the reference: every value finite; out, dq, dk and dv within rel_tol
// (relative), lse within lse_tol (absolute). `line` (the case and its errors) is printed and
// attached to the checks.
struct AttentionErrors {
  Diff out, lse, dq, dk, dv;
};
void check_attention_errors(const std::string& line, const AttentionErrors& e, double rel_tol, double lse_tol) {
  INFO(line);
  std::printf("%s\n", line.c_str());
  for (const Diff* d : {&e.out, &e.lse, &e.dq, &e.dk, &e.dv}) CHECK(d->finite);
  CHECK(e.out.rel <= rel_tol);
  CHECK(e.lse.max_abs <= lse_tol);
  CHECK(e.dq.rel <= rel_tol);
  CHECK(e.dk.rel <= rel_tol);
  CHECK(e.dv.rel <= rel_tol);
}

// The reference's answers for one slice.
struct SliceReference {
  std::vector<float> out, lse, dqkv;
};

// A GPU implementation under test.
struct Variant {
  std::string name;
  std::function<void(Tensor out, Tensor lse, Tensor qkv, const AttentionShape&, void*, size_t)> forward;
  std::function<void(Tensor dqkv, Tensor dout, Tensor out, Tensor lse, Tensor qkv, const AttentionShape&, void*, size_t)>
      backward;
  size_t workspace = 0;
};

std::vector<Variant> variants_for(const Problem& p) {
  const AttentionShape a = p.shape();
  std::vector<Variant> v;
  auto flash_variant = [&](cuda::flash::ForwardConfig fc, cuda::flash::BackwardConfig bc, std::string name) {
    v.push_back({name,
                 [fc](Tensor out, Tensor lse, Tensor qkv, const AttentionShape& s, void*, size_t) {
                   cuda::flash::forward(out, lse, qkv, s, fc, nullptr);
                 },
                 [bc](Tensor dqkv, Tensor dout, Tensor out, Tensor lse, Tensor qkv, const AttentionShape& s, void* ws,
                      size_t bytes) { cuda::flash::backward(dqkv, dout, out, lse, qkv, s, bc, ws, bytes, nullptr); },
                 cuda::flash::backward_workspace_bytes(a)});
  };
  // The production entry point (cuda::attention_forward / _backward) with backend b.
  const auto production = [&](const char* name, AttentionBackend b) {
    v.push_back({name,
                 [b](Tensor out, Tensor lse, Tensor qkv, const AttentionShape& s, void* ws, size_t bytes) {
                   cuda::attention_forward(out, lse, qkv, s, b, ws, bytes, nullptr);
                 },
                 [b](Tensor dqkv, Tensor dout, Tensor out, Tensor lse, Tensor qkv, const AttentionShape& s, void* ws,
                     size_t bytes) { cuda::attention_backward(dqkv, dout, out, lse, qkv, s, b, ws, bytes, nullptr); },
                 cuda::attention_workspace_bytes(a, b, p.dtype)});
  };
  // The production entry point first (its flash path uses the default configs).
  production("flash", AttentionBackend::flash);
  // The generic CUDA-core kernels on every shape (production uses them where the tensor-core
  // kernels are not compiled, which the "flash" variant above covers then).
  if (cuda::flash::supports_head_dim(p.d)) {
    v.push_back({"generic",
                 [](Tensor out, Tensor lse, Tensor qkv, const AttentionShape& s, void*, size_t) {
                   cuda::generic::forward(out, lse, qkv, s, nullptr);
                 },
                 [](Tensor dqkv, Tensor dout, Tensor out, Tensor lse, Tensor qkv, const AttentionShape& s, void* ws,
                    size_t bytes) { cuda::generic::backward(dqkv, dout, out, lse, qkv, s, ws, bytes, nullptr); },
                 cuda::generic::backward_workspace_bytes(a)});
  }
  if (p.all_configs && p.dtype == DType::bf16 && cuda::flash::supports_head_dim(p.d)) {
    const auto fcs = cuda::flash::forward_configs(p.d, p.dropout > 0);
    const auto bcs = cuda::flash::backward_configs(p.d, p.dropout > 0);
    for (size_t k = 1; k < std::max(fcs.size(), bcs.size()); ++k) {
      const auto fc = fcs[std::min(k, fcs.size() - 1)];
      const auto bc = bcs[std::min(k, bcs.size() - 1)];
      flash_variant(fc, bc, "flash " + fc.name() + " / " + bc.name());
    }
  }
  // With dropout cuDNN draws its own mask, not the reference's: tests/gpu/attention_cudnn_dropout_test.cpp
  // checks it against the reference given that mask.
  if (p.dropout == 0 && cuda::fused_attention_supported(a, p.dtype)) {
    production("fused (cuDNN)", AttentionBackend::fused);
    // Every cuDNN candidate pinned in turn (forward i with backward i, the shorter list repeating
    // its last), since the production path keeps whichever its first call times fastest.
    namespace cd = cuda::cudnn_attention;
    const size_t nf = cd::forward_candidates(a, p.dtype).size(), nb = cd::backward_candidates(a, p.dtype).size();
    for (size_t k = 0; k < std::max(nf, nb) && std::max(nf, nb) > 1; ++k) {
      const int fi = static_cast<int>(std::min(k, nf - 1)), bi = static_cast<int>(std::min(k, nb - 1));
      v.push_back({fmt::format("fused candidates {}/{}", fi, bi),
                   [fi, bi, dtype = p.dtype](Tensor out, Tensor lse, Tensor qkv, const AttentionShape& s, void* ws,
                                             size_t bytes) {
                     cd::pin_candidates(s, dtype, fi, bi);
                     cd::forward(out, lse, qkv, s, ws, bytes, nullptr);
                   },
                   [fi, bi, dtype = p.dtype](Tensor dqkv, Tensor dout, Tensor out, Tensor lse, Tensor qkv,
                                             const AttentionShape& s, void* ws, size_t bytes) {
                     cd::pin_candidates(s, dtype, fi, bi);
                     cd::backward(dqkv, dout, out, lse, qkv, s, ws, bytes, nullptr);
                   },
                   cuda::attention_workspace_bytes(a, AttentionBackend::fused, p.dtype)});
    }
    std::printf("%s | cuDNN candidates: %zu forward, %zu backward\n", p.name.c_str(), nf, nb);
  } else if (p.dropout == 0) {
    WARN(p.name << ": cuDNN fused attention not available for this shape/dtype, not tested");
  }
  return v;
}

void run_problem(const Problem& p) {
  INFO(p.name);
  std::printf("-- %s\n", p.name.c_str());
  std::fflush(stdout);
  const AttentionShape a = p.shape();
  const int hpg = p.heads / p.groups;
  const size_t n = static_cast<size_t>(p.b) * p.s;
  const size_t qkv_count = n * a.qkv_row_stride(), out_count = n * p.heads * p.d, lse_count = n * p.heads;
  const size_t elem = dtype_size(p.dtype);

  HostHalf qkv, dout;
  qkv.random(qkv_count, 1000 + p.s * 7 + p.d, p.input_std, p.dtype);
  dout.random(out_count, 2000 + p.s * 7 + p.d, 1.0f, p.dtype);

  DeviceBuffer d_qkv(qkv_count * elem), d_dout(out_count * elem);
  DeviceBuffer d_out(out_count * elem), d_lse(lse_count * 4), d_out0(out_count * elem), d_lse0(lse_count * 4);
  DeviceBuffer d_dqkv(qkv_count * elem);
  d_qkv.upload(qkv.bits);
  d_dout.upload(dout.bits);
  auto T16 = [&](DeviceBuffer& b, size_t count) { return Tensor(b.ptr, p.dtype, Device::cuda, {static_cast<int64_t>(count)}); };
  auto T32 = [&](DeviceBuffer& b, size_t count) { return Tensor(b.ptr, DType::f32, Device::cuda, {static_cast<int64_t>(count)}); };

  std::vector<Variant> variants = variants_for(p);
  size_t ws_bytes = 0;
  for (const Variant& v : variants) ws_bytes = std::max(ws_bytes, v.workspace);
  DeviceBuffer d_ws(ws_bytes);

  // The default flash forward provides the out/lse that every backward (and the reference's) uses.
  d_out0.poison();
  d_lse0.poison();
  variants[0].forward(T16(d_out0, out_count), T32(d_lse0, lse_count), T16(d_qkv, qkv_count), a, d_ws.ptr, d_ws.bytes);
  MT_CUDA_CHECK(cudaDeviceSynchronize());
  HostHalf out0;
  out0.from_device_bits(d_out0.download<uint16_t>(), p.dtype);
  const std::vector<float> lse0 = d_lse0.download<float>();

  // Reference on each slice, in parallel with the GPU runs below.
  std::vector<Slice> slices;
  if (p.samples.empty()) {
    std::vector<int> all(p.groups);
    for (int g = 0; g < p.groups; ++g) all[g] = g;
    slices.push_back({p, -1, all});  // sample -1: the whole problem, no extraction
  } else {
    for (int i : p.samples) slices.push_back({p, i, p.checked_groups});
  }
  auto whole = [&](const Slice& sl) { return sl.sample < 0; };
  std::vector<std::future<SliceReference>> refs;
  for (const Slice& sl : slices) {
    refs.push_back(std::async(std::launch::async, [&, sl]() {
      const AttentionShape sa = whole(sl) ? a : sl.sub_shape();
      const size_t sn = static_cast<size_t>(sa.batch) * sa.seq;
      auto pick = [&](const std::vector<float>& full, size_t count, auto runs) {
        return whole(sl) ? full : gather(full, count, runs);
      };
      std::vector<float> q = pick(qkv.values, sn * sa.qkv_row_stride(), [&](auto f) { sl.qkv_runs(f); });
      std::vector<float> o_in = pick(out0.values, sn * sa.heads * sa.head_dim, [&](auto f) { sl.out_runs(f); });
      std::vector<float> l_in = pick(lse0, sn * sa.heads, [&](auto f) { sl.lse_runs(f); });
      std::vector<float> dO = pick(dout.values, sn * sa.heads * sa.head_dim, [&](auto f) { sl.out_runs(f); });
      SliceReference r;
      r.out.resize(o_in.size());
      r.lse.resize(l_in.size());
      r.dqkv.resize(q.size());
      auto t = [](std::vector<float>& v) { return Tensor(v.data(), DType::f32, Device::cpu, {static_cast<int64_t>(v.size())}); };
      reference_attention_forward<float>(t(r.out), t(r.lse), t(q), sa);
      reference_attention_backward<float>(t(r.dqkv), t(dO), t(o_in), t(l_in), t(q), sa);
      return r;
    }));
  }

  // GPU runs: forward into fresh poisoned buffers; backward from the common out0/lse0.
  struct Result {
    std::vector<float> out, lse, dqkv;
  };
  auto to_float = [&](const std::vector<uint16_t>& bits) {
    std::vector<float> f(bits.size());
    for (size_t i = 0; i < bits.size(); ++i) f[i] = from_bits(bits[i], p.dtype);
    return f;
  };
  std::vector<Result> results;
  for (const Variant& v : variants) {
    Result r;
    d_out.poison();
    d_lse.poison();
    v.forward(T16(d_out, out_count), T32(d_lse, lse_count), T16(d_qkv, qkv_count), a, d_ws.ptr, d_ws.bytes);
    d_dqkv.poison();
    v.backward(T16(d_dqkv, qkv_count), T16(d_dout, out_count), T16(d_out0, out_count), T32(d_lse0, lse_count),
               T16(d_qkv, qkv_count), a, d_ws.ptr, d_ws.bytes);
    MT_CUDA_CHECK(cudaDeviceSynchronize());
    r.out = to_float(d_out.download<uint16_t>());
    r.lse = d_lse.download<float>();
    const std::vector<uint16_t> dqkv_bits = d_dqkv.download<uint16_t>();
    r.dqkv = to_float(dqkv_bits);
    if (v.name == "fused (cuDNN)")
      std::printf("%s | production cuDNN choice: %s\n", p.name.c_str(), cuda::cudnn_attention::chosen(a, p.dtype).c_str());
    if (v.name.rfind("fused", 0) == 0) {  // reported, not required: cuDNN chooses its own algorithm
      d_dqkv.poison();
      v.backward(T16(d_dqkv, qkv_count), T16(d_dout, out_count), T16(d_out0, out_count), T32(d_lse0, lse_count),
                 T16(d_qkv, qkv_count), a, d_ws.ptr, d_ws.bytes);
      MT_CUDA_CHECK(cudaDeviceSynchronize());
      const std::vector<uint16_t> again = d_dqkv.download<uint16_t>();
      std::printf("%s | %s backward repeats bit-identically: %s\n", p.name.c_str(), v.name.c_str(),
                  std::memcmp(again.data(), dqkv_bits.data(), again.size() * 2) == 0 ? "yes" : "NO");
    }
    if (&v == &variants[0]) {
      // Determinism: the same backward again gives the same bits (no order-dependent float sums).
      d_dqkv.poison();
      v.backward(T16(d_dqkv, qkv_count), T16(d_dout, out_count), T16(d_out0, out_count), T32(d_lse0, lse_count),
                 T16(d_qkv, qkv_count), a, d_ws.ptr, d_ws.bytes);
      MT_CUDA_CHECK(cudaDeviceSynchronize());
      const std::vector<uint16_t> again = d_dqkv.download<uint16_t>();
      CHECK(std::memcmp(again.data(), dqkv_bits.data(), again.size() * 2) == 0);
      // and the forward repeats the out0 it produced first.
      CHECK(to_float(d_out.download<uint16_t>()) == out0.values);
    }
    results.push_back(std::move(r));
  }

  for (size_t si = 0; si < slices.size(); ++si) {
    const Slice& sl = slices[si];
    const SliceReference ref = refs[si].get();
    for (size_t vi = 0; vi < variants.size(); ++vi) {
      const Result& r = results[vi];
      auto pick = [&](const std::vector<float>& full, size_t count, auto runs) {
        return whole(sl) ? full : gather(full, count, runs);
      };
      const std::vector<float> out = pick(r.out, ref.out.size(), [&](auto f) { sl.out_runs(f); });
      const std::vector<float> lse = pick(r.lse, ref.lse.size(), [&](auto f) { sl.lse_runs(f); });
      const std::vector<float> dqkv = pick(r.dqkv, ref.dqkv.size(), [&](auto f) { sl.qkv_runs(f); });
      // Split dqkv into its q, k and v parts.
      std::vector<float> parts[3][2];  // [q,k,v][got,want]
      const size_t run = static_cast<size_t>(hpg + 2) * p.d;
      for (size_t base = 0; base < dqkv.size(); base += run)
        for (size_t j = 0; j < run; ++j) {
          const int part = j < static_cast<size_t>(hpg) * p.d ? 0 : (j < static_cast<size_t>(hpg + 1) * p.d ? 1 : 2);
          parts[part][0].push_back(dqkv[base + j]);
          parts[part][1].push_back(ref.dqkv[base + j]);
        }
      const AttentionErrors e{compare(out, ref.out), compare(lse, ref.lse), compare(parts[0][0], parts[0][1]),
                              compare(parts[1][0], parts[1][1]), compare(parts[2][0], parts[2][1])};
      std::fflush(stdout);
      check_attention_errors(fmt::format("{} | {} | sample {} | out {:.2e} lse {:.2e} dq {:.2e} dk {:.2e} dv {:.2e}",
                                         p.name, variants[vi].name, sl.sample, e.out.rel, e.lse.max_abs, e.dq.rel,
                                         e.dk.rel, e.dv.rel),
                             e, kRelTol, kLseTol);
    }
  }
}

}  // namespace

TEST_CASE("flash attention d=64 matches the reference", "[gpu][attention]") {
  const DType bf16 = DType::bf16;
  const Problem problems[] = {
      {"d64 s=1 12/12", 2, 1, 12, 12, 64, bf16, 0, true, 1, {}, {}, true},
      {"d64 s=17 MQA 8/1", 3, 17, 8, 1, 64, bf16, 0, true, 1, {}, {}, true},
      {"d64 s=17 MQA dropout 0.1", 3, 17, 8, 1, 64, bf16, 0.1f},
      {"d64 s=100 GQA 32/8", 2, 100, 32, 8, 64, bf16, 0, true, 1, {}, {}, true},
      {"d64 s=100 GQA dropout 0.2", 2, 100, 32, 8, 64, bf16, 0.2f},
      {"d64 s=301 GQA dropout 0.1, every config", 2, 301, 8, 2, 64, bf16, 0.1f, true, 1, {}, {}, true},
      {"d64 fp16 s=77 dropout 0.1", 2, 77, 4, 4, 64, DType::f16, 0.1f},
      {"d64 s=100 not causal 4/2", 2, 100, 4, 2, 64, bf16, 0, false},
      {"d64 s=1000 12/12 std 3", 1, 1000, 12, 12, 64, bf16, 0, true, 3, {}, {}, true},
      {"d64 fp16 s=100 12/12", 2, 100, 12, 12, 64, DType::f16},
      {"gpt2-124m b32 s1024 12/12", 32, 1024, 12, 12, 64, bf16, 0, true, 1, {0, 31}, {0, 11}, true},
      {"d64 b1 s2048 16/16", 1, 2048, 16, 16, 64, bf16, 0, true, 1, {0}, {3, 12}},
      {"llama-1b b2 s4096 32/8", 2, 4096, 32, 8, 64, bf16, 0, true, 1, {1}, {5}},
  };
  for (const Problem& p : problems) run_problem(p);
}

TEST_CASE("flash attention d=128 matches the reference", "[gpu][attention]") {
  const DType bf16 = DType::bf16;
  const Problem problems[] = {
      {"d128 s=1 16/16", 2, 1, 16, 16, 128},
      {"d128 s=17 MQA 8/1", 3, 17, 8, 1, 128, bf16, 0, true, 1, {}, {}, true},
      {"d128 s=17 MQA dropout 0.1", 3, 17, 8, 1, 128, bf16, 0.1f},
      {"d128 s=203 GQA dropout 0.15, every config", 2, 203, 4, 2, 128, bf16, 0.15f, true, 1, {}, {}, true},
      {"d128 s=100 GQA 32/8", 2, 100, 32, 8, 128},
      {"d128 s=1000 4/2", 2, 1000, 4, 2, 128, bf16, 0, true, 1, {}, {}, true},
      {"d128 fp16 s=129 16/16", 2, 129, 16, 16, 128, DType::f16},
      {"d128 b2 s1024 16/16", 2, 1024, 16, 16, 128, bf16, 0, true, 1, {0, 1}, {0, 15}, true},
      {"d128 s=1000 MQA 8/1", 2, 1000, 8, 1, 128, bf16, 0, true, 1, {0, 1}, {0}},
      {"gpt-1.3b b8 s2048 16/16", 8, 2048, 16, 16, 128, bf16, 0, true, 1, {7}, {3}},
  };
  for (const Problem& p : problems) run_problem(p);
}

TEST_CASE("attention backends refuse what they do not implement", "[gpu][attention]") {
  AttentionShape a;
  a.batch = 1;
  a.seq = 8;
  a.heads = 2;
  a.groups = 2;
  a.head_dim = 64;
  a.softmax_scale = 0.125f;
  CHECK_THROWS_AS(cuda::resolve_attention_backend(a, AttentionBackend::unfused, DType::bf16), Unsupported);
  CHECK_THROWS_AS(cuda::resolve_attention_backend(a, AttentionBackend::local, DType::bf16), Unsupported);
  CHECK(cuda::resolve_attention_backend(a, AttentionBackend::flash, DType::bf16) == AttentionBackend::flash);
  a.dropout_p = 0.1f;  // cuDNN draws its own mask: auto and fused run it (flash keeps the reference's draws)
  CHECK(cuda::resolve_attention_backend(a, AttentionBackend::auto_, DType::bf16) == AttentionBackend::fused);
  CHECK(cuda::resolve_attention_backend(a, AttentionBackend::fused, DType::bf16) == AttentionBackend::fused);
  CHECK(cuda::resolve_attention_backend(a, AttentionBackend::flash, DType::bf16) == AttentionBackend::flash);
  a.dropout_p = 0;
  // auto: cuDNN where it runs (measured faster), MHA and GQA alike.
  const AttentionBackend mha = cuda::resolve_attention_backend(a, AttentionBackend::auto_, DType::bf16);
  CHECK(mha == (cuda::fused_attention_supported(a, DType::bf16) ? AttentionBackend::fused : AttentionBackend::flash));
  a.heads = 4;
  CHECK(cuda::fused_attention_supported(a, DType::bf16));  // GQA through the folded batch dimension
  CHECK(cuda::resolve_attention_backend(a, AttentionBackend::auto_, DType::bf16) == AttentionBackend::fused);
  // float32: cuDNN takes none; auto and flash run the generic kernels.
  CHECK_THROWS_AS(cuda::resolve_attention_backend(a, AttentionBackend::fused, DType::f32), Unsupported);
  CHECK(cuda::resolve_attention_backend(a, AttentionBackend::auto_, DType::f32) == AttentionBackend::flash);
  CHECK(cuda::attention_workspace_bytes(a, AttentionBackend::auto_, DType::f32) > 0);
  a.heads = 2;
  a.head_dim = 96;  // no tensor-core kernel: the generic one
  CHECK(cuda::attention_workspace_bytes(a, AttentionBackend::flash, DType::bf16) > 0);
  a.head_dim = 264;  // beyond every implementation: refused, naming the flag
  CHECK_THROWS_AS(cuda::attention_workspace_bytes(a, AttentionBackend::flash, DType::bf16), Unsupported);
  CHECK_THROWS_AS(cuda::attention_workspace_bytes(a, AttentionBackend::auto_, DType::f32), Unsupported);
}

TEST_CASE("attention with other head dims (generic kernels, cuDNN where it runs) matches the reference",
          "[gpu][attention]") {
  const DType bf16 = DType::bf16;
  const Problem problems[] = {
      {"d16 s=33 GQA 4/2", 2, 33, 4, 2, 16},
      {"d32 s=128 GQA 4/2", 4, 128, 4, 2, 32},
      {"d32 s=100 dropout 0.1 4/4", 2, 100, 4, 4, 32, bf16, 0.1f},
      {"d80 s=77 MQA 6/1", 2, 77, 6, 1, 80},
      {"d96 s=130 12/12", 1, 130, 12, 12, 96},
      {"d96 s=65 GQA dropout 0.2", 2, 65, 8, 2, 96, bf16, 0.2f},
      {"d48 fp16 s=50 not causal 4/2", 2, 50, 4, 2, 48, DType::f16, 0, false},
      {"d256 s=70 4/2", 1, 70, 4, 2, 256},
      {"d192 s=129 MLA 8/8", 2, 129, 8, 8, 192},  // multi-latent attention's d_qk (128 + 64)
      {"d160 s=64 GQA 4/2", 1, 64, 4, 2, 160},
      {"d8 s=40 2/1", 3, 40, 2, 1, 8},
  };
  for (const Problem& p : problems) run_problem(p);
}

namespace {

// float32 activations: the generic kernels (the only float32 path) against the reference on the
// whole problem. Tolerance: float32 sums against the reference's double sums.
void run_problem_f32(const Problem& p) {
  INFO(p.name);
  std::printf("-- %s (float32)\n", p.name.c_str());
  const AttentionShape a = p.shape();
  const size_t n = static_cast<size_t>(p.b) * p.s;
  const size_t qkv_count = n * a.qkv_row_stride(), out_count = n * p.heads * p.d, lse_count = n * p.heads;
  std::vector<float> qkv(qkv_count), dout(out_count);
  for (size_t i = 0; i < qkv_count; ++i) qkv[i] = p.input_std * normal_at(3000 + p.d, i);
  for (size_t i = 0; i < out_count; ++i) dout[i] = normal_at(4000 + p.d, i);
  DeviceBuffer d_qkv(qkv_count * 4), d_dout(out_count * 4), d_out(out_count * 4), d_lse(lse_count * 4),
      d_dqkv(qkv_count * 4), d_ws(cuda::attention_workspace_bytes(a, AttentionBackend::auto_, DType::f32));
  d_qkv.upload(qkv);
  d_dout.upload(dout);
  d_out.poison();
  d_lse.poison();
  d_dqkv.poison();
  auto T = [](DeviceBuffer& b, size_t count) { return Tensor(b.ptr, DType::f32, Device::cuda, {static_cast<int64_t>(count)}); };
  cuda::attention_forward(T(d_out, out_count), T(d_lse, lse_count), T(d_qkv, qkv_count), a, AttentionBackend::auto_,
                          d_ws.ptr, d_ws.bytes, nullptr);
  cuda::attention_backward(T(d_dqkv, qkv_count), T(d_dout, out_count), T(d_out, out_count), T(d_lse, lse_count),
                           T(d_qkv, qkv_count), a, AttentionBackend::auto_, d_ws.ptr, d_ws.bytes, nullptr);
  MT_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<float> out = d_out.download<float>(), lse = d_lse.download<float>(), dqkv = d_dqkv.download<float>();
  // Determinism: the backward again gives the same bits.
  d_dqkv.poison();
  cuda::attention_backward(T(d_dqkv, qkv_count), T(d_dout, out_count), T(d_out, out_count), T(d_lse, lse_count),
                           T(d_qkv, qkv_count), a, AttentionBackend::auto_, d_ws.ptr, d_ws.bytes, nullptr);
  MT_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<float> again = d_dqkv.download<float>();
  CHECK(std::memcmp(again.data(), dqkv.data(), dqkv.size() * sizeof(float)) == 0);

  std::vector<float> ref_out(out_count), ref_lse(lse_count), ref_dqkv(qkv_count);
  auto H = [](std::vector<float>& v) { return Tensor(v.data(), DType::f32, Device::cpu, {static_cast<int64_t>(v.size())}); };
  reference_attention_forward<float>(H(ref_out), H(ref_lse), H(qkv), a);
  reference_attention_backward<float>(H(ref_dqkv), H(dout), H(out), H(lse), H(qkv), a);
  const int hpg = p.heads / p.groups;
  std::vector<float> parts[3][2];
  const size_t run = static_cast<size_t>(hpg + 2) * p.d;
  for (size_t base = 0; base < dqkv.size(); base += run)
    for (size_t j = 0; j < run; ++j) {
      const int part = j < static_cast<size_t>(hpg) * p.d ? 0 : (j < static_cast<size_t>(hpg + 1) * p.d ? 1 : 2);
      parts[part][0].push_back(dqkv[base + j]);
      parts[part][1].push_back(ref_dqkv[base + j]);
    }
  const AttentionErrors e{compare(out, ref_out), compare(lse, ref_lse), compare(parts[0][0], parts[0][1]),
                          compare(parts[1][0], parts[1][1]), compare(parts[2][0], parts[2][1])};
  constexpr double kTol32 = 1e-5, kLseTol32 = 1e-5;
  check_attention_errors(fmt::format("{} | float32 | out {:.2e} lse {:.2e} dq {:.2e} dk {:.2e} dv {:.2e}", p.name,
                                     e.out.rel, e.lse.max_abs, e.dq.rel, e.dk.rel, e.dv.rel),
                         e, kTol32, kLseTol32);
}

}  // namespace

TEST_CASE("sliding-window attention matches the reference", "[gpu][attention]") {
  const DType bf16 = DType::bf16;
  const Problem problems[] = {
      windowed({"d64 s=300 GQA 8/2", 2, 300, 8, 2, 64, bf16, 0, true, 1, {}, {}, true}, 63),
      windowed({"d64 s=257 12/12 dropout 0.1", 2, 257, 12, 12, 64, bf16, 0.1f}, 100),
      windowed({"d64 s=100 MQA 8/1", 3, 100, 8, 1, 64, bf16, 0, true, 1, {}, {}, true}, 0),
      windowed({"d64 fp16 s=100 12/12", 2, 100, 12, 12, 64, DType::f16}, 5),
      windowed({"d64 b1 s2048 16/16", 1, 2048, 16, 16, 64, bf16, 0, true, 1, {0}, {3, 12}}, 511),
      windowed({"d128 s=1000 4/2", 2, 1000, 4, 2, 128, bf16, 0, true, 1, {}, {}, true}, 127),
      windowed({"d128 s=129 16/16", 2, 129, 16, 16, 128}, 200),
      windowed({"d96 s=130 GQA 12/4", 1, 130, 12, 4, 96}, 17),
      windowed({"d32 s=77 dropout 0.2 4/4", 2, 77, 4, 4, 32, bf16, 0.2f}, 30),
  };
  for (const Problem& p : problems) run_problem(p);
  run_problem_f32(windowed({"d64 s=100 GQA 8/2", 2, 100, 8, 2, 64, DType::f32}, 9));
}

TEST_CASE("float32 attention (generic kernels) matches the reference", "[gpu][attention]") {
  const DType f32 = DType::f32;
  const Problem problems[] = {
      {"d64 s=100 GQA 8/2", 2, 100, 8, 2, 64, f32},
      {"d32 s=128 4/4", 4, 128, 4, 4, 32, f32},
      {"d16 s=12 GQA 4/2", 1, 12, 4, 2, 16, f32},
      {"d128 s=70 dropout 0.1 4/1", 2, 70, 4, 1, 128, f32, 0.1f},
      {"d256 s=40 not causal 2/2", 1, 40, 2, 2, 256, f32, 0, false},
      {"d24 s=3 3/1", 2, 3, 3, 1, 24, f32},
  };
  for (const Problem& p : problems) run_problem_f32(p);
}
