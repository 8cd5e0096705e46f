// Knowledge distillation's pieces: the YAML reader of its config files, the reference backend's
// distillation ops against direct formulas and finite differences, and the command line
// (app/distill_args.h): defaults, the config file, the teacher's model config, the refusals.
#include <cmath>
#include <fstream>
#include <random>

#include "core/yaml_lite.h"
#include "engine/backend.h"
#include "tests/cli_test_util.h"
#include "tests/gradcheck.h"

using namespace mt;
using mt::test::Buf;
using mt::test::operator+;

TEST_CASE("parse_yaml reads block and flow YAML as yq -P writes it", "[yaml]") {
  const nlohmann::json j = parse_yaml(
      "# the distillation config\n"
      "intermediate_layer_pairs:\n"
      "  - - decoder.final_layernorm\n"
      "    - decoder.final_layernorm\n"
      "  - [\"decoder.layers.1\", 'decoder.layers.2', mse]\n"
      "logit_layers:\n"
      "- output_layer   # same indentation as the key\n"
      "- output_layer\n"
      "skip_lm_loss: true\n"
      "kd_loss_scale: 1.0\n"
      "logit_kl_topk: null\n"
      "nested: {a: 1, b: [x, -2.5e-1]}\n"
      "empty:\n"
      "text: \"a: b # not a comment\"\n",
      "t.yaml");
  CHECK(j.at("intermediate_layer_pairs") ==
        nlohmann::json::parse(R"([["decoder.final_layernorm","decoder.final_layernorm"],["decoder.layers.1","decoder.layers.2","mse"]])"));
  CHECK(j.at("logit_layers") == nlohmann::json::parse(R"(["output_layer","output_layer"])"));
  CHECK(j.at("skip_lm_loss") == true);
  CHECK(j.at("kd_loss_scale").is_number_float());
  CHECK(j.at("kd_loss_scale").get<double>() == 1.0);
  CHECK(j.at("logit_kl_topk").is_null());
  CHECK(j.at("nested") == nlohmann::json::parse(R"({"a":1,"b":["x",-0.25]})"));
  CHECK(j.at("empty").is_null());
  CHECK(j.at("text") == "a: b # not a comment");
  CHECK(parse_yaml("num_layers: 3\nswiglu: false\n", "m.yaml") == nlohmann::json::parse(R"({"num_layers":3,"swiglu":false})"));
  CHECK(parse_yaml("{intermediate_layer_pairs: [[a, b]], skip_lm_loss: false}", "f.yaml") ==
        nlohmann::json::parse(R"({"intermediate_layer_pairs":[["a","b"]],"skip_lm_loss":false})"));
  CHECK(parse_yaml("", "e.yaml").is_null());
  const auto error = [](const std::string& text) {
    try {
      parse_yaml(text, "bad.yaml");
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(parsed)");
  };
  CHECK_THAT(error("a:\n\t- 1\n"), Catch::Contains("bad.yaml:2") && Catch::Contains("tab"));
  CHECK_THAT(error("a: &x 1\n"), Catch::Contains("anchors"));
  CHECK_THAT(error("a: [1, 2\n"), Catch::Contains("unclosed bracket"));
  CHECK_THAT(error("a: 1\na: 2\n"), Catch::Contains("given twice"));
  CHECK_THAT(error("a: |\n  text\n"), Catch::Contains("multi-line"));
  CHECK_THAT(error("a: 1\n---\nb: 2\n"), Catch::Contains("several YAML documents"));
}

namespace {
// The row's KL(softmax(t s) || softmax(x s)) over all columns, directly.
double kl_row(const double* x, const double* t, int64_t C, double scale) {
  double mx = -INFINITY, mt_ = -INFINITY;
  for (int64_t c = 0; c < C; ++c) mx = std::max(mx, x[c] * scale), mt_ = std::max(mt_, t[c] * scale);
  double sx = 0, st = 0;
  for (int64_t c = 0; c < C; ++c) sx += std::exp(x[c] * scale - mx), st += std::exp(t[c] * scale - mt_);
  double kl = 0;
  for (int64_t c = 0; c < C; ++c) {
    const double lp = x[c] * scale - mx - std::log(sx), lq = t[c] * scale - mt_ - std::log(st);
    kl += std::exp(lq) * (lq - lp);
  }
  return kl;
}
}  // namespace

TEST_CASE("reference kd_logits_kl: KL(teacher || student), its gradient, over vocabulary shards", "[reference][distill]") {
  auto be = make_reference_backend(1);
  std::mt19937_64 rng(7);
  const int64_t N = 3, C = 11, half = 5;
  for (double scale : {1.0, 0.5}) {
    Buf s = Buf::randn({N, C}, rng, 2.0), t = Buf::randn({N, C}, rng, 2.0), w = Buf::randn({N}, rng);
    Buf lse_s = Buf::zeros({N}), lse_t = Buf::zeros({N}), kl = Buf::zeros({N}), ds = Buf::zeros({N, C});
    be->logsumexp_rows(lse_s.t(), s.t(), static_cast<float>(scale));
    be->logsumexp_rows(lse_t.t(), t.t(), static_cast<float>(scale));
    be->kd_logits_kl(kl.t(), ds.t(), s.t(), t.t(), lse_s.t(), lse_t.t(), static_cast<float>(scale), w.t());
    for (int64_t r = 0; r < N; ++r) {
      CHECK(kl.d[r] == Approx(kl_row(&s.d[r * C], &t.d[r * C], C, scale)).epsilon(1e-12));
      CHECK(kl.d[r] > 0);
      // d/ds of sum_r w_r KL_r by central differences (the log-sum-exps move with s).
      for (int64_t c = 0; c < C; ++c) {
        std::vector<double> x(s.d.begin() + r * C, s.d.begin() + (r + 1) * C);
        const double h = 1e-5;
        x[c] += h;
        const double up = kl_row(x.data(), &t.d[r * C], C, scale);
        x[c] -= 2 * h;
        const double down = kl_row(x.data(), &t.d[r * C], C, scale);
        CHECK(ds.d[r * C + c] == Approx(w.d[r] * (up - down) / (2 * h)).epsilon(1e-6).margin(1e-9));
      }
    }
    // In place (the gradient over the logits) gives the same.
    Buf s2 = s;
    be->kd_logits_kl(kl.t(), s2.t(), s2.t(), t.t(), lse_s.t(), lse_t.t(), static_cast<float>(scale), w.t());
    for (size_t i = 0; i < ds.d.size(); ++i) CHECK(s2.d[i] == ds.d[i]);
    // Two vocabulary shards with the global log-sum-exps: their parts add up to the whole.
    Buf s_a = Buf::zeros({N, half}), s_b = Buf::zeros({N, C - half}), t_a = Buf::zeros({N, half}),
        t_b = Buf::zeros({N, C - half});
    for (int64_t r = 0; r < N; ++r)
      for (int64_t c = 0; c < C; ++c) {
        (c < half ? s_a.d[r * half + c] : s_b.d[r * (C - half) + c - half]) = s.d[r * C + c];
        (c < half ? t_a.d[r * half + c] : t_b.d[r * (C - half) + c - half]) = t.d[r * C + c];
      }
    Buf kl_a = Buf::zeros({N}), kl_b = Buf::zeros({N});
    be->kd_logits_kl(kl_a.t(), Tensor(), s_a.t(), t_a.t(), lse_s.t(), lse_t.t(), static_cast<float>(scale), Tensor());
    be->kd_logits_kl(kl_b.t(), Tensor(), s_b.t(), t_b.t(), lse_s.t(), lse_t.t(), static_cast<float>(scale), Tensor());
    for (int64_t r = 0; r < N; ++r) CHECK(kl_a.d[r] + kl_b.d[r] == Approx(kl.d[r]).epsilon(1e-12));
  }
  // Equal logits: no divergence, no gradient.
  Buf s = Buf::randn({2, 6}, rng), lse = Buf::zeros({2}), kl = Buf::zeros({2}), w = Buf::randn({2}, rng);
  Buf ds = Buf::zeros({2, 6});
  be->logsumexp_rows(lse.t(), s.t(), 1.0f);
  be->kd_logits_kl(kl.t(), ds.t(), s.t(), s.t(), lse.t(), lse.t(), 1.0f, w.t());
  CHECK(std::abs(kl.d[0]) < 1e-15);
  for (double g : ds.d) CHECK(std::abs(g) < 1e-15);
}

TEST_CASE("reference hidden_loss: cosine (torch's cosine_embedding_loss) and mse, their gradients", "[reference][distill]") {
  auto be = make_reference_backend(1);
  std::mt19937_64 rng(11);
  const int64_t N = 4, h = 9;
  Buf a = Buf::randn({N, h}, rng), b = Buf::randn({N, h}, rng), w = Buf::randn({N}, rng);
  const auto direct = [&](const double* x, const double* y, Backend::HiddenLoss k) {
    double xy = 0, xx = 1e-12, yy = 1e-12, se = 0;
    for (int64_t c = 0; c < h; ++c) xy += x[c] * y[c], xx += x[c] * x[c], yy += y[c] * y[c], se += (x[c] - y[c]) * (x[c] - y[c]);
    return k == Backend::HiddenLoss::mse ? se / h : 1.0 - xy / std::sqrt(xx * yy);
  };
  for (Backend::HiddenLoss kind : {Backend::HiddenLoss::cosine, Backend::HiddenLoss::mse}) {
    Buf loss = Buf::zeros({N}), da = Buf::zeros({N, h});
    be->hidden_loss_forward(loss.t(), a.t(), b.t(), kind);
    for (int64_t r = 0; r < N; ++r) CHECK(loss.d[r] == Approx(direct(&a.d[r * h], &b.d[r * h], kind)).epsilon(1e-13));
    const float scale = 0.75f;
    be->hidden_loss_backward(da.t(), a.t(), b.t(), w.t(), scale, kind, false);
    for (int64_t r = 0; r < N; ++r)
      for (int64_t c = 0; c < h; ++c) {
        std::vector<double> x(a.d.begin() + r * h, a.d.begin() + (r + 1) * h);
        const double eps = 1e-6;
        x[c] += eps;
        const double up = direct(x.data(), &b.d[r * h], kind);
        x[c] -= 2 * eps;
        const double down = direct(x.data(), &b.d[r * h], kind);
        CHECK(da.d[r * h + c] == Approx(w.d[r] * scale * (up - down) / (2 * eps)).epsilon(1e-6).margin(1e-10));
      }
    // Accumulating adds to what is there.
    Buf acc = Buf::zeros({N, h});
    for (auto& v : acc.d) v = 1.0;
    be->hidden_loss_backward(acc.t(), a.t(), b.t(), w.t(), scale, kind, true);
    for (size_t i = 0; i < acc.d.size(); ++i) CHECK(acc.d[i] == Approx(1.0 + da.d[i]).epsilon(1e-14));
  }
  // Parallel states: no cosine loss; a scaled copy neither.
  Buf loss = Buf::zeros({N}), a2 = a;
  for (auto& v : a2.d) v *= 3.0;
  be->hidden_loss_forward(loss.t(), a2.t(), a.t(), Backend::HiddenLoss::cosine);
  for (double v : loss.d) CHECK(std::abs(v) < 1e-12);
}

namespace {
using mt::test::Args;
using mt::test::words;

struct KdFiles {
  mt::test::TempDir dir;
  std::string path(const std::string& name) const { return (std::filesystem::path(dir.path) / name).string(); }
  std::string write(const std::string& name, const std::string& text) const {
    std::ofstream(path(name)) << text;
    return path(name);
  }
};

Args kd_model() {
  return words("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
               "--micro-batch-size 2 --lr 1e-3 --train-iters 10 --mock-data --tokenizer-type NullTokenizer "
               "--vocab-size 1000 --normalization RMSNorm --swiglu");
}
}  // namespace

TEST_CASE("distillation flags: ModelOpt's defaults, the config file, the teacher's model config", "[cli][distill]") {
  KdFiles f;
  std::filesystem::create_directories(f.path("teacher"));
  {  // no config: logits only, skip_lm_loss; no model_config.yaml: the student's model, with Megatron's warning
    std::vector<SetupMessage> ms;
    const Config c = mt::test::parse(kd_model() + Args{"--export-kd-teacher-load", f.path("teacher")}, 1, &ms);
    const DistillConfig& d = c.train.distill;
    CHECK(d.enabled());
    CHECK(d.skip_lm_loss);
    CHECK(d.kd_loss_scale == 1.0);
    CHECK(d.logit_kl_temperature == 1.0);
    CHECK(d.intermediate_layer_pairs.empty());
    REQUIRE(d.teacher);
    CHECK(d.teacher->num_layers == 2);
    CHECK(mt::test::has_message(ms, SetupMessage::Kind::warning, "Assuming teacher model architecture same as student's"));
  }
  // The teacher's model_config.yaml in its directory: Megatron's argument names over the student's.
  f.write("teacher/model_config.yaml", "num_layers: 3\nffn_hidden_size: 96\nswiglu: false\n");
  const std::string cfg = f.write("kd.yaml",
                                  "intermediate_layer_pairs:\n  - - decoder.final_layernorm\n    - decoder.final_layernorm\n"
                                  "    - mse\nlogit_layers:\n  - output_layer\n  - output_layer\nskip_lm_loss: true\n"
                                  "logit_kl_temperature: 2.0\n");
  const Args kd = kd_model() + Args{"--export-kd-teacher-load", f.path("teacher"), "--export-kd-cfg", cfg};
  const Config c = mt::test::parse(kd);
  const DistillConfig& d = c.train.distill;
  REQUIRE(d.intermediate_layer_pairs.size() == 1);
  CHECK(d.intermediate_layer_pairs[0].mse);
  CHECK(d.logit_kl_temperature == 2.0);
  REQUIRE(d.teacher);
  CHECK(d.teacher->num_layers == 3);
  CHECK(d.teacher->ffn_hidden_size == 96);
  CHECK_FALSE(d.teacher->swiglu);
  CHECK(c.model.num_layers == 2);  // (the student's own)
  CHECK(c.model.swiglu);
  // --export-kd-teacher-model-config overrides the directory's file.
  const std::string other = f.write("other.yaml", "num_layers: 5\n");
  CHECK(mt::test::parse(kd + Args{"--export-kd-teacher-model-config", other}).train.distill.teacher->num_layers == 5);
  CHECK_THAT(mt::test::parse_error(kd + Args{"--export-kd-teacher-model-config", f.path("none.yaml")}),
             Catch::Contains("teacher model config") && Catch::Contains("not found"));
}

TEST_CASE("distillation flags refused: Megatron's, and what megatrain does not build yet", "[cli][distill]") {
  KdFiles f;
  std::filesystem::create_directories(f.path("teacher"));
  const Args kd = kd_model() + Args{"--export-kd-teacher-load", f.path("teacher")};
  using mt::test::parse_error;
  using mt::test::unsupported_error;
  CHECK_THAT(parse_error(kd + words("--manual-gc")), Catch::Contains("--manual-gc"));
  CHECK_THAT(parse_error(kd + words("--cross-entropy-fusion-impl te")), Catch::Contains("TransformerEngine Cross-Entropy"));
  CHECK_THAT(unsupported_error(kd + words("--pipeline-model-parallel-size 2"), 2),
             Catch::Contains("--pipeline-model-parallel-size"));
  CHECK_NOTHROW(mt::test::parse(kd + words("--context-parallel-size 2"), 2));  // (logits only)
  const auto with_cfg = [&](const std::string& text) {
    return kd + Args{"--export-kd-cfg", f.write("c.yaml", text)};
  };
  CHECK_THAT(unsupported_error(with_cfg("skip_lm_loss: false\n")), Catch::Contains("skip_lm_loss"));
  CHECK_THAT(unsupported_error(with_cfg("intermediate_layer_pairs: [[decoder.layers.1.mlp, decoder.layers.1]]\n")),
             Catch::Contains("decoder.layers.1.mlp"));
  CHECK_THAT(parse_error(with_cfg("intermediate_layer_pairs: [[decoder.layers.2, decoder.layers.1]]\n")),
             Catch::Contains("the student has no layer decoder.layers.2"));
  CHECK_THAT(parse_error(with_cfg("intermediate_layer_pairs: [[decoder.layers.1, decoder.layers.2]]\n")),
             Catch::Contains("the teacher has no layer decoder.layers.2"));
  CHECK_THAT(unsupported_error(with_cfg("intermediate_layer_pairs: [[decoder.layers.1, decoder.final_layernorm]]\n") +
                               words("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1")),
             Catch::Contains("--recompute-granularity full"));
  CHECK_NOTHROW(mt::test::parse(with_cfg("intermediate_layer_pairs: [[decoder.layers.0, decoder.final_layernorm, mse]]\n")));
  CHECK_THAT(unsupported_error(with_cfg("logit_kl_topk: 16\n")), Catch::Contains("logit_kl_topk"));
  CHECK_THAT(unsupported_error(with_cfg("intermediate_layer_pairs: [[decoder.final_layernorm, decoder.final_layernorm]]\n") +
                                   words("--context-parallel-size 2"), 2),
             Catch::Contains("--context-parallel-size"));
  CHECK_THAT(parse_error(with_cfg("kd_loss_scale: 0\n")), Catch::Contains("kd_loss_scale must be a positive number"));
  CHECK_THAT(parse_error(with_cfg("skip_lm: true\n")), Catch::Contains("unknown field skip_lm"));
  CHECK_THAT(parse_error(with_cfg("intermediate_layer_pairs: [[decoder.final_layernorm, decoder.final_layernorm, l1]]\n")),
             Catch::Contains("unknown intermediate loss function l1"));
  // The teacher's model: its vocabulary must be the student's; a projection between widths is not built.
  f.write("teacher/model_config.yaml", "hidden_size: 128\n");
  CHECK_THAT(unsupported_error(with_cfg("intermediate_layer_pairs: [[decoder.final_layernorm, decoder.final_layernorm]]\n")),
             Catch::Contains("projection"));
  CHECK_NOTHROW(mt::test::parse(kd));  // (logits only: any width)
  f.write("teacher/model_config.yaml", "micro_batch_size: 4\n");
  CHECK_THAT(unsupported_error(kd), Catch::Contains("micro_batch_size is not a model argument"));
  f.write("teacher/model_config.yaml", "num_layers: [1\n");
  CHECK_THAT(parse_error(kd), Catch::Contains("model_config.yaml:1"));
}
