// Float64 gradient checks: linear layers with bias and fused activations, GeLU, squared ReLU, SwiGLU.
#include "engine/backend.h"
#include "tests/gradcheck.h"

using namespace mt;
using mt::test::Buf;

TEST_CASE("reference linear_forward/backward gradients (bias, GeLU erf/tanh, squared ReLU fused)",
          "[reference][gradcheck]") {
  auto be = make_reference_backend(2);
  std::mt19937_64 rng(21);
  const int64_t M = 7, K = 5, N = 6;
  for (Activation act : {Activation::none, Activation::gelu, Activation::gelu_tanh, Activation::squared_relu}) {
    Buf x = Buf::randn({M, K}, rng), w = Buf::randn({N, K}, rng), b = Buf::randn({N}, rng);
    Buf y = Buf::zeros({M, N}), pre = Buf::zeros({M, N}), dy = Buf::randn({M, N}, rng);
    auto loss = [&] {
      be->linear_forward(y.t(), x.t(), w.t(), b.t(), act, act == Activation::none ? Tensor() : pre.t());
      return mt::test::dot(y.d, dy.d);
    };
    loss();
    // Gradient through the activation: dz = dy * act'(pre) (activation_backward), then the GEMM grads.
    Buf dz = Buf::zeros({M, N});
    if (act == Activation::none) dz.d = dy.d;
    else be->activation_backward(dz.t(), dy.t(), pre.t(), act);
    Buf dx = Buf::zeros({M, K}), dw = Buf::randn({N, K}, rng), db = Buf::randn({N}, rng);
    const std::vector<double> dw0 = dw.d, db0 = db.d;  // grads accumulate onto what is there
    be->linear_backward_input(dx.t(), dz.t(), w.t(), false, Activation::none, Tensor());
    be->linear_backward_weight(dw.t(), db.t(), dz.t(), x.t(), true);
    for (size_t k = 0; k < dw.d.size(); ++k) dw.d[k] -= dw0[k];
    for (size_t k = 0; k < db.d.size(); ++k) db.d[k] -= db0[k];
    mt::test::check_gradient("linear dx", x.d, dx.d, loss);
    mt::test::check_gradient("linear dw", w.d, dw.d, loss);
    mt::test::check_gradient("linear dbias", b.d, db.d, loss);
    // accumulate=true adds.
    Buf dx2 = Buf::zeros({M, K});
    dx2.d = dx.d;
    be->linear_backward_input(dx2.t(), dz.t(), w.t(), true, Activation::none, Tensor());
    for (size_t k = 0; k < dx.d.size(); ++k) CHECK(dx2.d[k] == Approx(2 * dx.d[k]).margin(1e-12));
  }
}

TEST_CASE("reference linear_backward_input through a preceding activation", "[reference][gradcheck]") {
  // h = act(u); y = h . w^T. linear_backward_input with act gives dL/du directly.
  auto be = make_reference_backend(2);
  std::mt19937_64 rng(22);
  const int64_t M = 4, K = 6, N = 3;
  for (Activation act : {Activation::gelu, Activation::gelu_tanh, Activation::squared_relu}) {
    Buf u = Buf::randn({M, K}, rng, 1.5), w = Buf::randn({N, K}, rng), h = Buf::zeros({M, K});
    Buf y = Buf::zeros({M, N}), dy = Buf::randn({M, N}, rng);
    auto loss = [&] {
      be->activation_forward(h.t(), u.t(), act);
      be->linear_forward(y.t(), h.t(), w.t(), Tensor(), Activation::none, Tensor());
      return mt::test::dot(y.d, dy.d);
    };
    loss();
    Buf du = Buf::zeros({M, K});
    be->linear_backward_input(du.t(), dy.t(), w.t(), false, act, u.t());
    mt::test::check_gradient(act == Activation::gelu_tanh ? "gelu_tanh du"
                             : act == Activation::gelu    ? "gelu du"
                                                          : "squared_relu du",
                             u.d, du.d, loss);
  }
}

TEST_CASE("reference gelu forward values", "[reference]") {
  auto be = make_reference_backend(1);
  Buf x = Buf::zeros({3}), y = Buf::zeros({3});
  x.d = {-1.0, 0.0, 2.0};
  be->activation_forward(y.t(), x.t(), Activation::gelu);
  CHECK(y.d[0] == Approx(-0.15865525393145707));
  CHECK(y.d[1] == 0.0);
  CHECK(y.d[2] == Approx(1.9544997361036416));
  be->activation_forward(y.t(), x.t(), Activation::gelu_tanh);
  CHECK(y.d[0] == Approx(-0.15880800939172324));
  CHECK(y.d[2] == Approx(1.9545976940871322));
  // The negative tail keeps its relative precision (1 + erf and 1 + tanh would give 0 here).
  x.d = {-10.0, 0.0, 0.0};
  be->activation_forward(y.t(), x.t(), Activation::gelu);
  CHECK(y.d[0] == Approx(-7.619853024160593e-23).epsilon(1e-12));
  be->activation_forward(y.t(), x.t(), Activation::gelu_tanh);
  CHECK(y.d[0] == Approx(-1.2040923482098023e-37).epsilon(1e-12));
}

TEST_CASE("reference squared_relu forward and backward values", "[reference]") {
  // Megatron's squared_relu: relu(x)^2; derivative 2 relu(x). A NaN stays NaN, as in torch.
  auto be = make_reference_backend(1);
  Buf x = Buf::zeros({5}), y = Buf::zeros({5}), dy = Buf::zeros({5}), dx = Buf::zeros({5});
  x.d = {-3.0, -0.0, 0.5, 3.0, std::nan("")};
  dy.d = {1.0, 1.0, 2.0, -1.0, 1.0};
  be->activation_forward(y.t(), x.t(), Activation::squared_relu);
  CHECK(y.d[0] == 0.0);
  CHECK(y.d[1] == 0.0);
  CHECK(y.d[2] == 0.25);
  CHECK(y.d[3] == 9.0);
  CHECK(std::isnan(y.d[4]));
  be->activation_backward(dx.t(), dy.t(), x.t(), Activation::squared_relu);
  CHECK(dx.d[0] == 0.0);
  CHECK(dx.d[1] == 0.0);
  CHECK(dx.d[2] == 2.0);   // 2 * 0.5 * 2
  CHECK(dx.d[3] == -6.0);  // 2 * 3 * -1
  CHECK(std::isnan(dx.d[4]));
}

TEST_CASE("reference swiglu forward/backward gradients", "[reference][gradcheck]") {
  auto be = make_reference_backend(2);
  std::mt19937_64 rng(23);
  const int64_t M = 5, F = 4;
  Buf in = Buf::randn({M, 2 * F}, rng, 1.5), out = Buf::zeros({M, F}), dout = Buf::randn({M, F}, rng);
  auto loss = [&] {
    be->swiglu_forward(out.t(), in.t());
    return mt::test::dot(out.d, dout.d);
  };
  loss();
  const double g = in.d[0], u = in.d[F];
  CHECK(out.d[0] == Approx(g / (1 + std::exp(-g)) * u));
  Buf din = Buf::zeros({M, 2 * F});
  be->swiglu_backward(din.t(), dout.t(), in.t());
  mt::test::check_gradient("swiglu din", in.d, din.d, loss);
}

TEST_CASE("reference float32 linear agrees with float64", "[reference]") {
  auto be = make_reference_backend(2);
  std::mt19937_64 rng(24);
  const int64_t M = 9, K = 33, N = 5;
  Buf x = Buf::randn({M, K}, rng), w = Buf::randn({N, K}, rng), b = Buf::randn({N}, rng);
  Buf y = Buf::zeros({M, N}), pre = Buf::zeros({M, N});
  be->linear_forward(y.t(), x.t(), w.t(), b.t(), Activation::gelu, pre.t());
  auto xf = x.as_f32(), wf = w.as_f32(), bf = b.as_f32();
  std::vector<float> yf(M * N), pref(M * N);
  be->linear_forward(mt::test::f32_view(yf, {M, N}), mt::test::f32_view(xf, {M, K}), mt::test::f32_view(wf, {N, K}),
                     mt::test::f32_view(bf, {N}), Activation::gelu, mt::test::f32_view(pref, {M, N}));
  for (int64_t k = 0; k < M * N; ++k) CHECK(yf[k] == Approx(y.d[k]).epsilon(1e-5).margin(1e-5));
}
