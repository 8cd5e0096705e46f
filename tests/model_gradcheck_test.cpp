

// Whole-model float64 gradient checks: a tiny GPT and a tiny Llama on the reference backend,
// every parameter's gradient against central differences on a subset of its elements.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <functional>
#include <utility>
#include <vector>

#include "engine/backend.h"
#include "engine/gpt_model.h"
#include "parallel/parallel_state.h"
#include "tests/engine_test_util.h"
#include "tests/model_gradcheck.h"

using namespace mt;

namespace {

struct Harness {
  Config cfg;
  ParallelState ps = make_single_process_state();
  std::unique_ptr<Backend> be = make_reference_backend(2);
  ModelDims dims;
  std::unique_ptr<GptModel> model;
  MicroBatch mb;

  explicit Harness(const Config& c, int64_t logits_chunk_rows = 0, const std::function<void(ModelOptions&)>& adjust = {})
      : cfg(c) {
    dims = ModelDims::from_config(cfg, ps);
    ModelOptions o = ModelOptions::from_config(cfg, dims, DType::f64);
    o.logits_chunk_rows = logits_chunk_rows;
    if (adjust) adjust(o);
    model = std::make_unique<GptModel>(dims, o, ps, *be);
    model->init_parameters();
    // Bigger weights than the 0.02 init so that every path carries signal.
    std::vector<double> w(static_cast<size_t>(model->params_flat().numel()));
    be->copy_to_host(w.data(), model->params_flat());
    for (size_t i = 0; i < model->params().size(); ++i) {
      const ParamDesc& p = model->params()[i];
      for (int64_t k = 0; k < p.numel(); ++k) {
        double& v = w[static_cast<size_t>(p.offset + k)];
        v = p.init == InitKind::normal ? v * 20.0 : v + 0.1 * std::sin(1.0 + k + 7.0 * i);
      }
    }
    be->copy_from_host(model->params_flat(), w.data());
    test::ArangeBatchSource src(dims.micro_batch, dims.seq, dims.vocab);
    src.next(mb);
    for (size_t k = 0; k < mb.tokens.size(); ++k) {  // less regular tokens, a few masked out
      mb.tokens[k] = static_cast<int32_t>((k * 13 + 5) % dims.vocab);
      mb.labels[k] = static_cast<int32_t>((k * 29 + 3) % dims.vocab);
      mb.loss_mask[k] = (k % 5 == 3) ? 0.0f : 1.0f;
    }
  }

  // The training loss of the micro-batch: sum(masked losses) / tokens.
  double loss() {
    be->fill(model->loss_sums(false), 0.0);
    model->stage_micro_batch(0, mb, 1.0, false, 42, true);
    model->forward(0);
    double s[2];
    be->copy_to_host(s, model->loss_sums(false));
    return s[0] / s[1];
  }

  std::vector<double> analytic_grads() {
    model->zero_grads();
    loss();
    model->backward(0);
    std::vector<double> g(static_cast<size_t>(model->grads_flat().numel()));
    be->copy_to_host(g.data(), model->grads_flat());
    return g;
  }

  // eps: the central differences' step (their error grows with eps^2 times the objective's third
  // derivative).
  void check_all(int samples_per_param, double eps = 1e-5) {
    const std::vector<double> g = analytic_grads();
    test::check_model_gradients(*model, *be, g, [this] { return loss(); }, samples_per_param, eps, 1e-6, 1e-9);
  }
};

}  // namespace

TEST_CASE("model gradient check: tiny GPT (LayerNorm, GeLU, learned positions, tied, biases)", "[model][gradcheck]") {
  Config c = test::tiny_gpt_config();
  Harness h(c);
  h.check_all(6);
}

TEST_CASE("model gradient check: tiny Llama (RMSNorm, SwiGLU, RoPE, GQA, untied, no bias)", "[model][gradcheck]") {
  Config c = test::tiny_llama_config();
  Harness h(c);
  h.check_all(6);
}

TEST_CASE("model gradient check: Gated DeltaNet hybrid (conv, delta rule, gated output norm, 1p LayerNorm)",
          "[model][gradcheck][gdn]") {
  Config c = test::tiny_gdn_config();
  Harness h(c);
  // A smaller step: with the test's 20x weights the delta rule's decays (exp of exp) curve the
  // objective enough that at 1e-5 the differences' own error exceeds the bound (at 1e-6 and 3e-6
  // every element agrees; at 3e-5 more fail: the step's error, not the gradient's).
  h.check_all(6, 2e-6);
}

TEST_CASE("model gradient check: variants (tanh GeLU, 1p, qkv bias, qk-layernorm, interleaved partial rope, dropout)",
          "[model][gradcheck]") {
  Config c = test::tiny_llama_config();
  c.model.normalization = Normalization::layernorm;
  c.model.apply_layernorm_1p = true;
  c.model.add_qkv_bias = true;
  c.model.qk_layernorm = true;
  c.model.rotary_interleaved = true;
  c.model.rotary_percent = 0.5;
  c.model.use_rope_scaling = true;
  c.model.attention_dropout = 0.2;
  c.model.hidden_dropout = 0.2;
  test::derive(c);
  Harness h(c);
  h.check_all(4);
  Config g = test::tiny_gpt_config();
  g.model.openai_gelu = true;
  g.model.kv_channels = 6;  // attention width 24 != hidden 16
  test::derive(g);
  Harness hg(g);
  hg.check_all(4);
  Config e = test::tiny_gpt_config();
  e.model.bias_gelu_fusion = false;  // exact (erf) GeLU; the default with biases is tanh
  test::derive(e);
  Harness he(e);
  he.check_all(4);
}

TEST_CASE("model gradient check: --qk-l2-norm and a sliding window", "[model][gradcheck]") {
  Config c = test::tiny_llama_config();
  c.model.qk_l2_norm = true;
  c.model.window_size = std::make_pair(2, 0);
  c.model.window_attn_skip_every = 2;
  test::derive(c);
  Harness h(c);
  h.check_all(4);
  // LayerNorm models too: L2Norm is RMS normalization whatever --normalization says.
  Config g = test::tiny_gpt_config();
  g.model.qk_l2_norm = true;
  test::derive(g);
  Harness hg(g);
  hg.check_all(4);
}

TEST_CASE("model gradient check: --attention-output-gate (Llama with GQA and q/k layernorm and RoPE, GPT-style)",
          "[model][gradcheck]") {
  Config c = test::tiny_llama_config();
  c.model.attention_output_gate = true;
  c.model.qk_layernorm = true;
  test::derive(c);
  Harness h(c);
  REQUIRE(h.dims.qkv_proj_width_local() == h.dims.qkv_width_local() + h.dims.attn_width_local());
  h.check_all(4);
  Config g = test::tiny_gpt_config();
  g.model.attention_output_gate = true;
  g.model.hidden_dropout = 0.1;
  test::derive(g);
  Harness hg(g);
  hg.check_all(4);
}


TEST_CASE("model gradient check: attention sinks (--softmax-type learnable with the output gate and a window, "
          "off-by-one, with MLA)", "[model][gradcheck]") {
  Config c = test::tiny_llama_config();
  c.model.softmax_type = SoftmaxType::learnable;
  c.model.attention_output_gate = true;
  c.model.window_size = std::make_pair(2, 0);
  c.model.window_attn_skip_every = 2;
  test::derive(c);
  Harness h(c);
  int sinks = 0;
  for (const ParamDesc& p : h.model->params())
    if (p.name.ends_with("self_attention.core_attention.softmax_offset")) {
      ++sinks;
      CHECK(p.global_shape == std::vector<int64_t>{c.model.num_attention_heads});
      CHECK_FALSE(p.weight_decay);
    }
  CHECK(sinks == c.model.num_layers);
  h.check_all(4);
  Config g = test::tiny_gpt_config();
  g.model.softmax_type = SoftmaxType::off_by_one;
  test::derive(g);
  Harness hg(g);
  for (const ParamDesc& p : hg.model->params()) CHECK_FALSE(p.name.ends_with("softmax_offset"));
  hg.check_all(4);
  // Multi-latent attention with learnable sinks (values padded to the query/key head dim).
  Config m = test::tiny_mla_config();
  m.model.softmax_type = SoftmaxType::learnable;
  test::derive(m);
  Harness hm(m);
  hm.check_all(4);
}

TEST_CASE("model gradient check: multi-latent attention (query rank and latent norms with YaRN, then direct queries)",
          "[model][gradcheck][mla]") {
  Config c = test::tiny_mla_config();
  Harness h(c);
  REQUIRE(h.dims.mla);
  REQUIRE(h.dims.head_dim == 10);
  h.check_all(4);
  // Direct query projection with --qk-layernorm (a second norm of the input), LayerNorm, biases,
  // learned positions beside MLA's own RoPE (rope type rope, half of the 4 dims turned), dropout.
  Config d = test::tiny_mla_config();
  d.model.q_lora_rank.reset();
  d.model.normalization = Normalization::layernorm;
  d.model.add_bias_linear = true;
  d.model.position_embedding_type = PositionEmbedding::learned_absolute;
  d.model.rope_type = "rope";
  d.model.rotary_percent = 0.5;
  d.model.attention_dropout = 0.2;
  d.model.hidden_dropout = 0.2;
  test::derive(d);
  Harness hd(d);
  REQUIRE(hd.dims.rot_dim == 2);
  hd.check_all(4);
  // Neither the latent norms nor a query rank.
  Config e = test::tiny_mla_config();
  e.model.q_lora_rank.reset();
  e.model.qk_layernorm = false;
  test::derive(e);
  Harness he(e);
  he.check_all(4);
}

TEST_CASE("model gradient check: multi-token prediction (one and two depths, tied and untied, MLA and MoE layers)",
          "[model][gradcheck][mtp]") {
  // The objective: lm loss plus (scale / D) times each depth's mean loss (Megatron's MTP loss, whose
  // gradient megatrain adds): the model's mtp sums hold the depths' means.
  const auto check = [](Config c, int depths, double scale) {
    c.model.mtp_num_layers = depths;
    c.model.mtp_loss_scaling_factor = scale;
    test::derive(c);
    Harness h(c);
    REQUIRE(h.dims.stage_mtp_layers() == depths);
    REQUIRE(h.dims.decoder_layers() == c.model.num_layers);
    const auto objective = [&] {
      h.be->fill(h.model->mtp_loss_sums(), 0.0);
      const double main = h.loss();
      std::vector<double> m(static_cast<size_t>(2 * depths));
      h.be->copy_to_host(m.data(), h.model->mtp_loss_sums());
      double total = main;
      for (int j = 0; j < depths; ++j) {
        CHECK(m[static_cast<size_t>(2 * j + 1)] == Approx(1.0));  // one micro-batch
        total += scale / depths * m[static_cast<size_t>(2 * j)];
      }
      return total;
    };
    const std::vector<double> g = h.analytic_grads();
    test::check_model_gradients(*h.model, *h.be, g, objective, 4, 1e-5, 1e-6, 1e-9);
  };
  Config llama = test::tiny_llama_config();  // untied, RoPE, SwiGLU
  check(llama, 1, 0.3);
  Config tied = test::tiny_llama_config();
  tied.model.untie_embeddings_and_output_weights = false;
  tied.model.hidden_dropout = 0.1;  // (the rolled embedding's dropout and the layers')
  check(tied, 2, 0.1);
  Config gpt = test::tiny_gpt_config();  // LayerNorm and biases, no position embedding
  gpt.model.position_embedding_type = PositionEmbedding::none;
  check(gpt, 1, 0.5);
  Config mla = test::tiny_mla_config();
  check(mla, 1, 0.2);
  Config windowed = test::tiny_llama_config();  // the MTP layers' own windows (Megatron's numbering)
  windowed.model.window_size = std::make_pair(3, 0);
  windowed.model.window_attn_skip_every = 2;
  check(windowed, 2, 0.4);
  Config moe = test::tiny_llama_config();  // the mtp layer is an MoE layer, as the last decoder layer
  moe.model.moe.num_experts = 4;
  moe.model.moe.router_topk = 4;  // (every expert: no choice for the differences to flip)
  moe.model.moe.ffn_hidden_size = 12;
  moe.model.moe.layer_freq = 1;
  moe.model.moe.moe_layer = {0, 1};
  check(moe, 1, 0.3);
}

TEST_CASE("MLA: recomputing the attention input (mla_up_proj) gives the gradients of keeping it", "[model][mla]") {
  for (const int variant : {0, 1, 2}) {
    Config c = test::tiny_mla_config();
    c.model.num_layers = 3;
    if (variant > 0) c.model.q_lora_rank.reset();
    if (variant == 2) c.model.qk_layernorm = false;  // the up projection reads the input norm's output
    test::derive(c);
    Config r = c;
    r.train.recompute_granularity = RecomputeGranularity::selective;
    r.train.recompute_modules = {"mla_up_proj", "layernorm"};
    Config k = r;
    k.train.recompute_modules = {"layernorm"};
    Harness kept(k), recomputed(r);
    INFO("variant " << variant);
    CHECK(recomputed.model->options().mla_recompute_up);
    CHECK(kept.model->memory_plan().of(MemoryCategory::activations) >
          recomputed.model->memory_plan().of(MemoryCategory::activations));
    const std::vector<double> a = kept.analytic_grads(), b = recomputed.analytic_grads();
    REQUIRE(a.size() == b.size());
    CHECK(test::bit_diff(a, b).differ == 0);
  }
}

TEST_CASE("full recompute gives the same gradients as keeping activations", "[model]") {
  for (const int model : {0, 1, 2})  // Llama, MLA, Llama with learnable attention sinks
  for (RecomputeMethod method : {RecomputeMethod::uniform, RecomputeMethod::block}) {
    Config c = model == 1 ? test::tiny_mla_config() : test::tiny_llama_config();
    if (model == 2) c.model.softmax_type = SoftmaxType::learnable;
    c.model.num_layers = 3;
    c.model.hidden_dropout = 0.1;  // masks must be redrawn identically
    test::derive(c);
    Harness plain(c);
    c.train.recompute_granularity = RecomputeGranularity::full;
    c.train.recompute_method = method;
    c.train.recompute_num_layers = 2;
    Harness recompute(c);
    CHECK(recompute.model->memory_plan().of(MemoryCategory::activations) <
          plain.model->memory_plan().of(MemoryCategory::activations));
    const std::vector<double> a = plain.analytic_grads(), b = recompute.analytic_grads();
    REQUIRE(a.size() == b.size());
    for (size_t i = 0; i < a.size(); ++i) REQUIRE(a[i] == b[i]);
  }
}

TEST_CASE("the output layer in row chunks gives the same loss and gradients", "[model]") {
  for (bool llama : {false, true}) {
    Config c = llama ? test::tiny_llama_config() : test::tiny_gpt_config();
    test::derive(c);
    Harness whole(c);
    const int64_t N = whole.dims.tokens();
    REQUIRE(N > 5);
    Harness chunked(c, 5);  // uneven chunks: 5, 5, ..., the rest
    CHECK(chunked.model->memory_plan().of(MemoryCategory::workspace) <
          whole.model->memory_plan().of(MemoryCategory::workspace));
    CHECK(whole.loss() == chunked.loss());  // every row's logits, loss and their sum: the same operations
    const std::vector<double> a = whole.analytic_grads(), b = chunked.analytic_grads();
    REQUIRE(a.size() == b.size());
    // The output layer's weight gradient sums its rows chunk by chunk (another order): the same
    // up to float64 rounding; every other gradient is the same computation.
    double worst = 0;
    for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(a[i] - b[i]) / (std::abs(a[i]) + 1e-6));
    CHECK(worst < 1e-12);
  }
}

TEST_CASE("weight gradients left to the step's first GEMM never read what the buffer held before", "[model]") {
  // Tied GPT (the embedding gradient gets the head's GEMM and the scatter: zeroed) and untied
  // Llama (the output layer's gradient is written by its first chunk's GEMM); two micro-batches,
  // so the second backward adds; the output layer in chunks of 4 rows. The same step from a buffer
  // of NaNs and from a zeroed one: the same bits.
  for (test::ConfigMaker make : test::kTinyModels) {
    const Config c = make();
    Harness first(c, 4), zeroed(c, 4);
    // What zero_grads leaves alone holds junk (another step's numbers, or a checkpoint read).
    first.be->fill(first.model->grads_flat(), std::nan(""));
    first.model->zero_grads();
    CHECK_THROWS_WITH(first.model->check_grads_written(), Catch::Contains(".weight was not written in this step"));
    zeroed.be->fill(zeroed.model->grads_flat(), 0.0);
    zeroed.model->zero_grads();
    for (int micro = 0; micro < 2; ++micro) {
      for (Harness* h : {&first, &zeroed}) {
        if (micro == 1)
          for (size_t k = 0; k < h->mb.tokens.size(); ++k) h->mb.tokens[k] = static_cast<int32_t>((k * 7 + 2) % h->dims.vocab);
        h->loss();
        h->model->backward(0);
      }
    }
    CHECK_NOTHROW(first.model->check_grads_written());
    CHECK_NOTHROW(zeroed.model->check_grads_written());
    const size_t n = static_cast<size_t>(first.model->grads_flat().numel());
    std::vector<double> a(n), b(n);
    first.be->copy_to_host(a.data(), first.model->grads_flat());
    zeroed.be->copy_to_host(b.data(), zeroed.model->grads_flat());
    size_t differ = 0, nonzero = 0;
    for (size_t i = 0; i < n; ++i) {
      if (std::memcmp(&a[i], &b[i], sizeof(double)) != 0) ++differ;
      if (b[i] != 0.0) ++nonzero;
    }
    CHECK(differ == 0);
    CHECK(nonzero > n / 2);
  }
}

TEST_CASE("fc2 and proj bias gradients summed by the norm backwards equal their own column sums", "[model]") {
  Config c = test::tiny_gpt_config();
  c.model.num_layers = 3;
  test::derive(c);
  Harness fused(c), separate(c, 0, [](ModelOptions& o) { o.seams.bias_grad_from_norm = false; });
  const std::vector<double> a = fused.analytic_grads(), b = separate.analytic_grads();
  REQUIRE(a.size() == b.size());
  CHECK(test::bit_diff(a, b).differ == 0);
  for (const ParamDesc& p : fused.model->params()) {  // the sums are there, not zeros
    if (p.name.find("linear_fc2.bias") == std::string::npos && p.name.find("linear_proj.bias") == std::string::npos)
      continue;
    double norm = 0;
    for (int64_t k = 0; k < p.numel(); ++k) norm += std::abs(a[static_cast<size_t>(p.offset + k)]);
    INFO(p.name);
    CHECK(norm > 1e-6);
  }
}

TEST_CASE("norm outputs kept from forward give the gradients of recomputing them (--recompute-modules layernorm)",
          "[model]") {
  for (const int model : {0, 1, 2}) {
    const bool llama = model == 1;
    Config c = model == 2 ? test::tiny_mla_config() : llama ? test::tiny_llama_config() : test::tiny_gpt_config();
    c.model.num_layers = 3;
    test::derive(c);
    Config r = c;
    r.train.recompute_granularity = RecomputeGranularity::selective;
    r.train.recompute_modules = {"core_attn", "layernorm"};
    Config f = c;  // a full-recompute group: its norm outputs live in the shared scratch
    f.train.recompute_granularity = RecomputeGranularity::full;
    f.train.recompute_method = RecomputeMethod::block;
    f.train.recompute_num_layers = 1;
    Harness kept(c), recomputed(r), kept_full(f), recomputed_full(f, 0, [](ModelOptions& o) { o.keep_norm_outputs = false; });
    const ModelDims& d = kept.dims;
    CHECK(ModelOptions::from_config(c, d, DType::f64).keep_norm_outputs);
    CHECK(ModelOptions::from_config(f, d, DType::f64).keep_norm_outputs);
    CHECK_FALSE(ModelOptions::from_config(r, d, DType::f64).keep_norm_outputs);
    r.train.recompute_modules = {"core_attn"};
    CHECK(ModelOptions::from_config(r, d, DType::f64).keep_norm_outputs);
    for (auto [k, rc] : {std::pair{&kept, &recomputed}, std::pair{&kept_full, &recomputed_full}}) {
      INFO((model == 2 ? "mla" : llama ? "llama" : "gpt") << (k == &kept_full ? ", layer 0 fully recomputed" : ""));
      CHECK(k->model->memory_plan().of(MemoryCategory::activations) >
            rc->model->memory_plan().of(MemoryCategory::activations));
      const std::vector<double> a = k->analytic_grads(), b = rc->analytic_grads();
      REQUIRE(a.size() == b.size());
      const test::BitDiff d = test::bit_diff(a, b);
      CHECK(d.differ == 0);
      CHECK(d.nonzero > a.size() / 2);
    }
  }
}

TEST_CASE("the norm after a layer written by the layer's closing residual add gives the same loss and gradients",
          "[model]") {
  // Fused between kept layers and into the final norm; not around full-recompute groups (layers 0
  // and 1 of 4 recomputed, one group each: 0-1 and 1-2 stay two passes, 2-3 and 3-head fuse).
  for (const bool llama : {false, true}) {
    for (const bool full : {false, true}) {
      Config c = llama ? test::tiny_llama_config() : test::tiny_gpt_config();
      c.model.num_layers = 4;
      if (full) {
        c.train.recompute_granularity = RecomputeGranularity::full;
        c.train.recompute_method = RecomputeMethod::block;
        c.train.recompute_num_layers = 2;
      }
      test::derive(c);
      INFO((llama ? "llama" : "gpt") << (full ? ", full recompute" : ""));
      Harness fused(c), apart(c, 0, [](ModelOptions& o) { o.seams.fuse_next_norm = false; });
      CHECK(fused.loss() == apart.loss());
      const std::vector<double> a = fused.analytic_grads(), b = apart.analytic_grads();
      REQUIRE(a.size() == b.size());
      CHECK(test::bit_diff(a, b).differ == 0);
    }
  }
}

// Packed documents (--reset-attention-mask with --reset-position-ids): a document's losses do not
// depend on the document before it in the packed sequence (to the bit: its attention never reads
// the earlier keys, and every other op is per token), and the gradients are those of the loss.
TEST_CASE("model: packed documents are independent of each other, with their gradients", "[model][gradcheck][documents]") {
  Config c = test::tiny_llama_config();  // RoPE: positions restart in each document
  c.data.reset_attention_mask = true;
  c.data.reset_position_ids = true;
  Harness h(c);
  const int b = h.dims.micro_batch, s = h.dims.seq, k = s / 3;
  REQUIRE(k >= 2);
  h.mb.segments.assign(h.mb.tokens.size(), 0);
  h.mb.positions.assign(h.mb.tokens.size(), 0);
  for (int i = 0; i < b; ++i)
    for (int t = 0; t < s; ++t) {
      const size_t at = static_cast<size_t>(i) * s + t;
      h.mb.segments[at] = t < k ? 0 : 1;
      h.mb.positions[at] = t < k ? t : t - k;
    }
  h.check_all(6);  // (the tiny Llama test's samples: rows of tokens this micro-batch holds)

  // The second document's loss alone, after two different first documents.
  auto second_document_loss = [&](Harness& x, int first_tokens_seed) {
    for (int i = 0; i < b; ++i)
      for (int t = 0; t < s; ++t) {
        const size_t at = static_cast<size_t>(i) * s + t;
        x.mb.loss_mask[at] = t < k ? 0.0f : 1.0f;
        if (t < k) x.mb.tokens[at] = static_cast<int32_t>((t * 7 + first_tokens_seed + i) % x.dims.vocab);
      }
    return x.loss();
  };
  const double after_one = second_document_loss(h, 1), after_other = second_document_loss(h, 5);
  CHECK(after_one == after_other);
  // Without the documents the first document leaks into the second's attention.
  Config plain = c;
  plain.data.reset_attention_mask = false;
  Harness p(plain);
  p.mb = h.mb;
  CHECK(second_document_loss(p, 1) != second_document_loss(p, 5));
}

TEST_CASE("model gradient check: Gated DeltaNet hybrid with a multi-token prediction depth (its layer like the last)",
          "[model][gradcheck][gdn][mtp]") {
  // The objective as in the multi-token prediction check above: lm loss plus scale x the depth's mean.
  for (const std::vector<char>& pattern : {std::vector<char>{1, 0, 1}, std::vector<char>{1, 1, 0}}) {
    INFO("pattern " << int(pattern[0]) << int(pattern[1]) << int(pattern[2]));
    Config c = test::tiny_gdn_config();
    c.model.linear_layer = pattern;
    c.model.mtp_num_layers = 1;
    c.model.mtp_loss_scaling_factor = 0.3;
    test::derive(c);
    Harness h(c);
    REQUIRE(h.dims.is_gdn(3) == (pattern.back() != 0));  // (the depth's layer: like decoder layer 2)
    const auto objective = [&] {
      h.be->fill(h.model->mtp_loss_sums(), 0.0);
      const double main = h.loss();
      double m[2];
      h.be->copy_to_host(m, h.model->mtp_loss_sums());
      return main + 0.3 * m[0];
    };
    const std::vector<double> g = h.analytic_grads();
    // A smaller step than the other checks' 1e-5 (the depth adds curvature), and their absolute
    // bound scaled with it: the objective's float64 rounding divided by the step grows as 1/eps.
    const double eps = 1e-6;
    test::check_model_gradients(*h.model, *h.be, g, objective, 4, eps, 1e-6, 1e-9 * (1e-5 / eps));
  }
}

TEST_CASE("activations laid over lower layers' gradients: the same losses and gradients, step after step", "[model]") {
  // Each model twice, activations over gradients (ModelOptions::acts_over_grads) and in a block of
  // their own; before each step the gradient buffer holds junk (NaN), as after an optimizer step
  // and a forward: three steps, the parameters moved between them, the same bits throughout.
  const auto llama = [](int layers) {
    Config c = test::tiny_llama_config();
    c.model.num_layers = layers;
    test::derive(c);
    return c;
  };
  std::vector<std::pair<std::string, Config>> cases;
  cases.emplace_back("llama, 5 layers", llama(5));
  {
    Config c = test::tiny_gpt_config();  // tied: only the layers' gradients can hold activations
    c.model.num_layers = 5;
    c.model.hidden_dropout = 0.1;
    c.model.attention_dropout = 0.1;
    test::derive(c);
    cases.emplace_back("gpt, tied, dropout", c);
    c.model.untie_embeddings_and_output_weights = true;  // learned positions after the layers too
    cases.emplace_back("gpt, untied", c);
  }
  {
    Config c = llama(5);
    c.train.recompute_granularity = RecomputeGranularity::full;
    c.train.recompute_method = RecomputeMethod::uniform;
    c.train.recompute_num_layers = 2;
    cases.emplace_back("llama, full recompute", c);
    c = llama(5);
    c.train.recompute_granularity = RecomputeGranularity::selective;
    c.train.recompute_modules = {"core_attn", "layernorm"};
    cases.emplace_back("llama, selective recompute", c);
  }
  {
    Config c = llama(5);
    MoeConfig& e = c.model.moe;
    e.num_experts = 4;
    e.router_topk = 2;
    e.ffn_hidden_size = 20;
    e.layer_freq = 1;
    e.moe_layer = {1, 0, 1, 1, 1};
    e.shared_expert_intermediate_size = 12;
    e.aux_loss_coeff = {1e-2};
    cases.emplace_back("moe", c);
  }
  {
    Config c = test::tiny_mla_config();
    c.model.num_layers = 4;
    test::derive(c);
    cases.emplace_back("mla", c);
    c = test::tiny_gdn_config();
    c.model.num_layers = 5;
    c.model.linear_layer = {1, 0, 1, 1, 0};
    test::derive(c);
    cases.emplace_back("gdn", c);
    c = llama(4);
    c.model.mtp_num_layers = 1;
    test::derive(c);
    cases.emplace_back("llama + mtp", c);
  }
  for (const auto& [name, c] : cases) {
    INFO(name);
    Harness over(c, 4, [](ModelOptions& o) { o.acts_over_grads = true; }), apart(c, 4);
    const MemoryPlan &po = over.model->memory_plan(), &pa = apart.model->memory_plan();
    REQUIRE(po.acts_in_grads > 0);  // (else the case tests nothing)
    CHECK(po.of(MemoryCategory::activations) + po.acts_in_grads == pa.of(MemoryCategory::activations));
    CHECK(po.of(MemoryCategory::gradients) == pa.of(MemoryCategory::gradients));
    CHECK(pa.acts_in_grads == 0);
    for (int step = 0; step < 3; ++step) {
      over.be->fill(over.model->grads_flat(), std::nan(""));
      const std::vector<double> a = over.analytic_grads(), b = apart.analytic_grads();
      REQUIRE(a.size() == b.size());
      const test::BitDiff d = test::bit_diff(a, b);
      INFO("step " << step);
      CHECK(d.differ == 0);
      CHECK(d.nonzero > a.size() / 2);
      // A plain gradient step on both (the same parameters again).
      std::vector<double> w(static_cast<size_t>(apart.model->params_flat().numel()));
      apart.be->copy_to_host(w.data(), apart.model->params_flat());
      for (size_t i = 0; i < w.size(); ++i) w[i] -= 1e-2 * b[i];
      apart.be->copy_from_host(apart.model->params_flat(), w.data());
      over.be->copy_from_host(over.model->params_flat(), w.data());
    }
  }
}

TEST_CASE("the experts' weight-gradient GEMMs sum the squares of the gradients they write", "[model][moe]") {
  // ModelOptions::expert_grad_sumsq: GptModel::expert_grad_sumsq() holds, after a backward, the sum
  // of squares of exactly the routed experts' fc1 and fc2 weight gradients (not the shared
  // expert's, the router's or the biases'), whatever it held before the step.
  std::vector<std::pair<std::string, Config>> cases;
  {
    Config c = test::tiny_llama_config();
    c.model.num_layers = 4;
    MoeConfig& e = c.model.moe;
    e.num_experts = 4;
    e.router_topk = 2;
    e.ffn_hidden_size = 20;
    e.layer_freq = 1;
    e.moe_layer = {1, 0, 1, 1};
    e.shared_expert_intermediate_size = 12;
    test::derive(c);
    cases.emplace_back("swiglu experts, a shared expert", c);
    c.model.mtp_num_layers = 1;  // (an MoE layer at the MTP depth too)
    test::derive(c);
    cases.emplace_back("with an MTP depth", c);
  }
  {
    Config c = test::with_moe(test::tiny_gpt_config(), 3, 3, 1, 10, 1);
    c.model.add_bias_linear = true;  // GeLU experts with linear biases
    test::derive(c);
    cases.emplace_back("gelu experts with biases", c);
  }
  for (const auto& [name, c] : cases) {
    INFO(name);
    Harness h(c, 4, [](ModelOptions& o) { o.expert_grad_sumsq = true; });
    const Tensor slot = h.model->expert_grad_sumsq();
    REQUIRE(slot.numel() == 1);
    h.be->fill(slot, 1e3);  // (last step's sum: zeroed with the gradients)
    const std::vector<double> g = h.analytic_grads();
    double want = 0.0;
    int fused = 0, expert_params = 0;
    for (const ParamDesc& p : h.model->params()) {
      expert_params += p.expert ? 1 : 0;
      if (!h.model->sumsq_fused(p)) continue;
      ++fused;
      for (int64_t k = 0; k < p.numel(); ++k) want += g[static_cast<size_t>(p.offset + k)] * g[static_cast<size_t>(p.offset + k)];
    }
    int moe_layers = 0;
    for (int l = 0; l < h.dims.num_layers + h.dims.mtp; ++l) moe_layers += h.dims.is_moe(l) ? 1 : 0;
    CHECK(fused == 2 * moe_layers);
    CHECK(expert_params == (c.model.add_bias_linear ? 2 : 1) * fused);  // (the experts' biases stay out)
    REQUIRE(want > 0.0);
    double got = 0.0;
    h.be->copy_to_host(&got, slot);
    CHECK(got == Approx(want).epsilon(1e-12));
    // Without the option nothing is taken.
    Harness plain(c, 4);
    CHECK(plain.model->expert_grad_sumsq().empty());
  }
}
