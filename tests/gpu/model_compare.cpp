#include "tests/gpu/model_compare.h"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>

#include "engine/gpt_model.h"
#include "parallel/parallel_state.h"

namespace mt::gputest {

ModelRun run_model_micro_batch(Backend& be, const Config& c, DType T, const std::vector<double>& w,
                               const MicroBatch& mb, std::vector<double>* init) {
  ParallelState ps = make_single_process_state();
  const ModelDims d = ModelDims::from_config(c, ps);
  GptModel model(d, ModelOptions::from_config(c, d, T), ps, be);
  model.init_parameters();
  if (init) {
    *init = download(be, model.master_flat());
  } else {
    // The model copy from the given float values (rounded to T); the master copy too.
    upload(be, model.params_flat(), w);
    if (model.has_master_copy()) upload(be, model.master_flat(), w);
  }
  model.zero_grads();
  be.fill(model.loss_sums(false), 0.0);
  if (!model.moe_loss_sums().empty()) be.fill(model.moe_loss_sums(), 0.0);
  model.moe_begin_step();
  model.stage_micro_batch(0, mb, 1.0, false, 7, true);
  model.forward(0);
  model.backward(0);
  model.check_grads_written();
  be.synchronize();
  ModelRun r;
  const std::vector<double> sums = download(be, model.loss_sums(false));
  r.loss = sums[0] / sums[1];
  if (!model.moe_loss_sums().empty()) {
    const std::vector<double> moe = download(be, model.moe_loss_sums());
    r.aux = moe[0];
    r.z = moe[1];
    r.seq = moe[2];
    r.global = moe[4];
  }
  r.grads = download(be, model.grads_flat());
  return r;
}

Config small_llama_config(int layers, int seq, int batch) {
  Config c;
  ModelConfig& m = c.model;
  m.num_layers = layers;
  m.hidden_size = 64;
  m.num_attention_heads = 4;
  m.max_position_embeddings = seq;
  m.seq_length = seq;
  m.vocab_size = 96;
  m.padded_vocab_size = 96;
  m.attention_dropout = 0;
  m.hidden_dropout = 0;
  m.normalization = Normalization::rmsnorm;
  m.swiglu = true;
  m.position_embedding_type = PositionEmbedding::rope;
  m.untie_embeddings_and_output_weights = true;
  m.add_bias_linear = false;
  m.head_dim = 16;
  m.query_groups = 4;
  m.ffn_size = 96;
  c.train.micro_batch_size = batch;
  c.train.global_batch = batch;
  c.train.num_microbatches = 1;
  c.train.device = DeviceKind::gpu;
  return c;
}

MicroBatch random_micro_batch(Rng& rng, int batch, int seq, int vocab) {
  MicroBatch mb;
  mb.batch = batch;
  mb.seq = seq;
  const int64_t n = int64_t{batch} * seq;
  const std::vector<double> toks = rng.ints(n, 0, vocab), labels = rng.ints(n, 0, vocab);
  for (int64_t i = 0; i < n; ++i) {
    mb.tokens.push_back(static_cast<int32_t>(toks[static_cast<size_t>(i)]));
    mb.labels.push_back(static_cast<int32_t>(labels[static_cast<size_t>(i)]));
    mb.loss_mask.push_back(i % 7 == 3 ? 0.0f : 1.0f);
  }
  return mb;
}

void check_gradients_close(const std::vector<double>& got, const std::vector<double>& want, bool bf16) {
  REQUIRE(got.size() == want.size());
  double gmax = 0, err = 0, diff2 = 0, ref2 = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    gmax = std::max(gmax, std::fabs(want[i]));
    err = std::max(err, std::fabs(got[i] - want[i]));
    diff2 += (got[i] - want[i]) * (got[i] - want[i]);
    ref2 += want[i] * want[i];
  }
  INFO("max |grad| " << gmax << ", max error " << err << ", relative norm error " << std::sqrt(diff2 / ref2));
  CHECK(gmax > 0);
  if (!bf16) CHECK(err <= 5e-3 * gmax);
  CHECK(std::sqrt(diff2 / ref2) <= (bf16 ? 5e-2 : 2e-3));
}

}  // namespace mt::gputest
