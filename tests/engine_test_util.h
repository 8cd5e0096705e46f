// Tiny model configurations and a local micro-batch source for the engine's CPU tests.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "core/config.h"
#include "data/batch.h"

namespace mt::test {

// Two float64 vectors of one size compared bit for bit: how many elements differ (NaN included) and
// how many of b's are nonzero (that a comparison of equal vectors compared something).
struct BitDiff {
  size_t differ = 0, nonzero = 0;
};
inline BitDiff bit_diff(const std::vector<double>& a, const std::vector<double>& b) {
  BitDiff d;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    d.differ += std::memcmp(&a[i], &b[i], sizeof(double)) != 0;
    d.nonzero += b[i] != 0.0;
  }
  return d;
}

// Fills the values the flag parser derives (head dim, groups, ffn, padded vocab, batch counts).
inline void derive(Config& c) {
  ModelConfig& m = c.model;
  m.head_dim = m.kv_channels.value_or(m.hidden_size / m.num_attention_heads);
  m.query_groups = m.group_query_attention ? m.num_query_groups : m.num_attention_heads;
  m.ffn_size = m.ffn_hidden_size.value_or(m.swiglu ? (4 * m.hidden_size * 2 / 3) / 64 * 64 : 4 * m.hidden_size);
  m.padded_vocab_size = m.vocab_size;
  if (m.add_bias_linear) m.add_qkv_bias = true;
  TrainConfig& t = c.train;
  t.global_batch = t.global_batch_size.value_or(t.micro_batch_size);
  t.num_microbatches = t.global_batch / t.micro_batch_size;
  t.total_iters = t.train_iters.value_or(0);
}

inline Config tiny_gpt_config() {
  Config c;
  ModelConfig& m = c.model;
  m.num_layers = 2;
  m.hidden_size = 16;
  m.num_attention_heads = 4;
  m.max_position_embeddings = 16;
  m.seq_length = 8;
  m.vocab_size = 64;
  m.attention_dropout = 0.0;
  m.hidden_dropout = 0.0;
  c.train.micro_batch_size = 2;
  c.train.global_batch_size = 2;
  c.train.train_iters = 10;
  c.train.lr = 1e-3;
  c.train.device = DeviceKind::cpu;
  derive(c);
  return c;
}

inline Config tiny_llama_config() {
  Config c = tiny_gpt_config();
  ModelConfig& m = c.model;
  m.hidden_size = 32;
  m.ffn_hidden_size = 48;
  m.group_query_attention = true;
  m.num_query_groups = 2;
  m.normalization = Normalization::rmsnorm;
  m.swiglu = true;
  m.position_embedding_type = PositionEmbedding::rope;
  m.untie_embeddings_and_output_weights = true;
  m.add_bias_linear = false;
  m.add_qkv_bias = false;
  derive(c);
  return c;
}

// c with MoE layers: `experts` routed experts, top-k routing, expert FFN width `ffn`, every
// `freq`-th layer MoE (Megatron's --moe-layer-freq N: layer i when i % N == 0).
inline Config with_moe(Config c, int layers, int experts, int topk, int ffn, int freq) {
  c.model.num_layers = layers;
  MoeConfig& e = c.model.moe;
  e.num_experts = experts;
  e.router_topk = topk;
  e.ffn_hidden_size = ffn;
  e.layer_freq = freq;
  return c;
}

// A tiny multi-latent-attention Llama: 4 heads of 6 + 4 query/key dims (RoPE on the 4) and 5 value
// dims, query rank 12, key/value rank 8, latent norms, YaRN with DeepSeek-V3's terms.
inline Config tiny_mla_config() {
  Config c = tiny_llama_config();
  ModelConfig& m = c.model;
  m.group_query_attention = false;
  m.multi_latent_attention = true;
  m.q_lora_rank = 12;
  m.kv_lora_rank = 8;
  m.qk_head_dim = 6;
  m.qk_pos_emb_head_dim = 4;
  m.v_head_dim = 5;
  m.qk_layernorm = true;
  m.rotary_scaling_factor = 40;  // YaRN (MLA's default rope type)
  m.mscale = 1.0;
  m.mscale_all_dim = 1.0;
  derive(c);
  return c;
}

// Makes a three-layer model a Gated DeltaNet hybrid (Qwen3-Next's layout): the first and last
// layers Gated DeltaNet with the given heads and convolution taps, the middle one softmax attention
// with the output gate; LayerNorm with zero-centred weights, as Megatron-LM's test.
inline void set_gdn_hybrid(ModelConfig& m, int key_heads, int value_heads, int dk, int dv, int conv_taps) {
  m.num_layers = 3;
  m.normalization = Normalization::layernorm;
  m.apply_layernorm_1p = true;
  m.attention_output_gate = true;
  m.gated_delta_net = true;
  m.linear_attention_every = 2;
  m.linear_layer = {1, 0, 1};
  m.linear_num_key_heads = key_heads;
  m.linear_num_value_heads = value_heads;
  m.linear_key_head_dim = dk;
  m.linear_value_head_dim = dv;
  m.linear_conv_kernel_dim = conv_taps;
}

// A tiny one: 2 key heads of 4, 4 value heads of 3, 3 convolution taps.
inline Config tiny_gdn_config() {
  Config c = tiny_llama_config();
  set_gdn_hybrid(c.model, 2, 4, 4, 3, 3);
  derive(c);
  return c;
}

// Both tiny models, for tests that run each: a Config is made in place by its function, because
// copying Configs out of an initializer list trips GCC 12's -Wmaybe-uninitialized on their
// std::optional members (a false positive).
using ConfigMaker = Config (*)();
inline constexpr ConfigMaker kTinyModels[] = {&tiny_gpt_config, &tiny_llama_config};

// Mock data (NullTokenizer, EOD = the last token) for a tiny model: sequences of 16, two
// micro-batches of 2 per step, lr 1e-2 decaying (cosine) to 1e-3, a log line every 10 iterations.
// Callers set the iterations and the rest, then derive().
inline Config with_mock_training(Config c) {
  c.data.mock_data = true;
  c.data.tokenizer_type = "NullTokenizer";
  c.data.vocab_size = c.model.vocab_size;
  c.data.eod_id = c.model.vocab_size - 1;  // NullTokenizer's default EOD
  c.model.seq_length = 16;
  c.model.max_position_embeddings = 16;
  c.train.micro_batch_size = 2;
  c.train.global_batch_size = 4;
  c.train.lr = 1e-2;
  c.train.min_lr = 1e-3;
  c.train.lr_decay_style = LrDecayStyle::cosine;
  c.logging.log_interval = 10;
  return c;
}

// Arange documents: sample k of the stream is (k * 7 + t) mod vocab for t = 0..s, so the next
// token is always the current one plus one (learnable by a tiny model). Deterministic.
class ArangeBatchSource final : public BatchSource {
 public:
  ArangeBatchSource(int batch, int seq, int vocab, int64_t limit = -1, int64_t first_sample = 0)
      : b_(batch), s_(seq), v_(vocab), limit_(limit), next_(first_sample) {}
  bool next(MicroBatch& mb) override {
    if (limit_ >= 0 && produced_ >= limit_) return false;
    mb.resize(b_, s_);
    for (int i = 0; i < b_; ++i, ++next_) {
      const int64_t start = next_ * 7;
      for (int t = 0; t < s_; ++t) {
        const size_t k = static_cast<size_t>(i) * s_ + t;
        mb.tokens[k] = static_cast<int32_t>((start + t) % v_);
        mb.labels[k] = static_cast<int32_t>((start + t + 1) % v_);
        mb.loss_mask[k] = 1.0f;
        mb.positions[k] = t;
      }
    }
    ++produced_;
    return true;
  }
  int64_t produced() const { return produced_; }  // micro-batches handed out

 private:
  int b_, s_, v_;
  int64_t limit_, next_, produced_ = 0;
};

}  // namespace mt::test
