// Attention sinks (--softmax-type off-by-one / learnable) on the CUDA backend against the reference
// backend, on fresh random inputs.
//
// 1. The ops alone: attention_sink_forward / attention_sink_backward on random out, lse and dout
//    (bf16 and float32 activations; head dims on the vector path and off it; odd head and row
//    counts; sinks in the activation dtype, float32, or none (off-by-one); the gradient float32 or
//    bf16, accumulated into; rows whose lse is -inf).
// 2. Whole attention with sinks: attention_forward + attention_sink_forward, then
//    attention_sink_backward + attention_backward from the sinks' out and lse, on the automatic
//    choice (cuDNN where it runs) and on the flash kernels, against the reference on the same
//    rounded inputs: out, lse, dQKV and the sinks' gradient. This checks that each backward,
//    given the sinks' out and lse, computes the sinks' attention gradient.
// Tolerances as tests/gpu/attention_test.cpp's: relative L2 error <= 1e-2 for 16-bit data
// (1e-5 in float32), lse within 1e-3 (1e-5).
#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "tests/gpu/gpu_test_util.h"

using namespace mt;
using namespace mt::gputest;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

double tol_of(DType dt) { return dt == DType::f32 ? 1e-5 : 1e-2; }

double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i)
    if (!(a[i] == b[i])) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

// A CUDA backend of its own per attention choice (each case reserves its shape's workspace).
Backend& attention_backend(AttentionBackend kind) {
  static std::unique_ptr<Backend> automatic = make_cuda_backend(0), flash = make_cuda_backend(0);
  return kind == AttentionBackend::flash ? *flash : *automatic;
}

}  // namespace

TEST_CASE("CUDA attention_sink_forward and attention_sink_backward match the reference", "[gpu][attention][sinks]") {
  MT_RNG(rng);
  struct Case {
    DType dt;
    int b, s, heads, d;
    DType sink;  // f32, the activation dtype, or i32 for none (off-by-one)
    DType grad;
  };
  const Case cases[] = {
      {DType::bf16, 2, 37, 4, 64, DType::bf16, DType::f32}, {DType::bf16, 1, 53, 3, 36, DType::f32, DType::f32},
      {DType::bf16, 3, 17, 5, 128, DType::i32, DType::f32}, {DType::bf16, 2, 29, 2, 5, DType::bf16, DType::bf16},
      {DType::f32, 2, 37, 4, 64, DType::f32, DType::f32},   {DType::f32, 1, 41, 3, 7, DType::i32, DType::f32},
  };
  for (const Case& c : cases) {
    INFO(fmt::format("{} b{} s{} heads {} d{} sink {} grad {}", dtype_name(c.dt), c.b, c.s, c.heads, c.d,
                     c.sink == DType::i32 ? "none" : dtype_name(c.sink), dtype_name(c.grad)));
    const int64_t rows = int64_t{c.b} * c.s, cols = int64_t{c.heads} * c.d;
    std::vector<double> out = rng.normal(rows * cols), dout = rng.normal(rows * cols);
    std::vector<double> lse = rng.uniform(int64_t{c.b} * c.heads * c.s, -2, 4);
    for (size_t i = 0; i < lse.size(); i += 11) lse[i] = -kInf;  // rows that saw no key
    const std::vector<double> sinks = rng.uniform(c.heads, -3, 3), dsink0 = rng.normal(c.heads);
    const bool has_sink = c.sink != DType::i32;
    Twin o = c.dt == DType::f32 ? twin_same(c.dt, {rows, cols}, out) : twin(c.dt, {rows, cols}, out);
    Twin g = c.dt == DType::f32 ? twin_same(c.dt, {rows, cols}, dout) : twin(c.dt, {rows, cols}, dout);
    Twin l = twin(DType::f32, {c.b, c.heads, c.s}, lse);
    Twin sk = has_sink ? twin(c.sink, {c.heads}, sinks) : absent();
    Twin ds = twin(c.grad, {c.heads}, dsink0);
    dev().attention_sink_forward(o.c(), l.c(), sk.c());
    ref().attention_sink_forward(o.r(), l.r(), sk.r());
    const std::vector<double> got_o = download(dev(), o.c()), want_o = download(ref(), o.r());
    const std::vector<double> got_l = download(dev(), l.c()), want_l = download(ref(), l.r());
    CHECK(rel_err(got_o, want_o) <= tol_of(c.dt));
    CHECK(max_abs_diff(got_l, want_l) <= 1e-5);
    // The sinks' backward from the sinks' out and lse (the reference from the CUDA forward's).
    Twin o2 = twin(c.dt, {rows, cols}, got_o), l2 = twin(DType::f32, {c.b, c.heads, c.s}, got_l);
    if (c.dt == DType::f32) o2 = twin_same(c.dt, {rows, cols}, got_o);
    dev().attention_sink_backward(ds.c(), g.c(), o2.c(), l2.c(), sk.c());
    ref().attention_sink_backward(ds.r(), g.r(), o2.r(), l2.r(), sk.r());
    const std::vector<double> got_d = download(dev(), ds.c()), want_d = download(ref(), ds.r());
    double scale = 0;
    for (double v : want_d) scale = std::max(scale, std::abs(v));
    INFO("dsink " << fmt::format("{}", fmt::join(got_d, " ")) << " | reference " << fmt::format("{}", fmt::join(want_d, " ")));
    CHECK(max_abs_diff(got_d, want_d) <= (c.grad == DType::bf16 ? 1e-2 : 1e-4) * std::max(1.0, scale));
    // Bit for bit again (a fixed summation order).
    Twin ds2 = twin(c.grad, {c.heads}, dsink0);
    dev().attention_sink_backward(ds2.c(), g.c(), o2.c(), l2.c(), sk.c());
    CHECK(download(dev(), ds2.c()) == got_d);
  }
}

TEST_CASE("CUDA attention with sinks (cuDNN and flash) matches the reference", "[gpu][attention][sinks]") {
  MT_RNG(rng);
  struct Named {
    AttentionBackend kind;
    const char* name;
  };
  const Named backends[] = {{AttentionBackend::auto_, "auto"}, {AttentionBackend::flash, "flash"}};
  struct Case {
    int b, s, heads, groups, d, window;
  };
  for (const Case c : {Case{2, 128, 8, 2, 64, -1}, Case{1, 77, 4, 4, 128, -1}, Case{2, 96, 8, 2, 64, 31}})
    for (const Named& n : backends) {
      INFO(fmt::format("{} b{} s{} heads {}/{} d{} window {}", n.name, c.b, c.s, c.heads, c.groups, c.d, c.window));
      AttentionShape a = AttentionShape::make(c.b, c.s, c.heads, c.groups, c.d);
      a.window_left = c.window;
      const DType T = DType::bf16;
      Backend* be = &attention_backend(n.kind);
      be->reserve_attention(a, n.kind, T);
      const int64_t N = int64_t{c.b} * c.s, oc = int64_t{c.heads} * c.d, rs = a.qkv_row_stride();
      Twin qkv = twin(T, {N, rs}, rng.normal(N * rs)), dout = twin(T, {N, oc}, rng.normal(N * oc));
      Twin sink = twin(T, {c.heads}, rng.uniform(c.heads, -1, 3));
      Twin out = twin_nan(T, {N, oc}), lse = twin_nan(DType::f32, {c.b, c.heads, c.s});
      be->attention_forward(out.c(), lse.c(), qkv.c(), a);
      be->attention_sink_forward(out.c(), lse.c(), sink.c());
      ref().attention_forward(out.r(), lse.r(), qkv.r(), a);
      ref().attention_sink_forward(out.r(), lse.r(), sink.r());
      const std::vector<double> out_g = download(*be, out.c()), lse_g = download(*be, lse.c());
      const double e_out = rel_err(out_g, download(ref(), out.r())),
                   e_lse = max_abs_diff(lse_g, download(ref(), lse.r()));
      // Backward from the CUDA forward's out and lse on both sides.
      Twin out_in = twin(T, {N, oc}, out_g), lse_in = twin(DType::f32, {c.b, c.heads, c.s}, lse_g);
      Twin dqkv = twin_nan(T, {N, rs}), dsink = twin(DType::f32, {c.heads}, std::vector<double>(c.heads, 0.0));
      be->attention_sink_backward(dsink.c(), dout.c(), out_in.c(), lse_in.c(), sink.c());
      be->attention_backward(dqkv.c(), dout.c(), out_in.c(), lse_in.c(), qkv.c(), a);
      ref().attention_sink_backward(dsink.r(), dout.r(), out_in.r(), lse_in.r(), sink.r());
      ref().attention_backward(dqkv.r(), dout.r(), out_in.r(), lse_in.r(), qkv.r(), a);
      const double e_dqkv = rel_err(download(*be, dqkv.c()), download(ref(), dqkv.r()));
      const double e_dsink = rel_err(download(*be, dsink.c()), download(ref(), dsink.r()));
      const std::string errors =
          fmt::format("errors: out {:.2e} lse {:.2e} dqkv {:.2e} dsink {:.2e}", e_out, e_lse, e_dqkv, e_dsink);
      std::printf("%s b%d s%d heads %d/%d d%d window %d | %s\n", n.name, c.b, c.s, c.heads, c.groups, c.d, c.window,
                  errors.c_str());
      INFO(errors);
      CHECK(e_out <= 1e-2);
      CHECK(e_lse <= 1e-3);
      CHECK(e_dqkv <= 1e-2);
      CHECK(e_dsink <= 1e-2);
    }
}
