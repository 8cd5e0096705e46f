// bench_ops: times every CUDA backend op (attention excepted: see the attention benchmarks) at
// the shapes of three models, and prints achieved bandwidth against the measured device-to-device
// copy ceiling and GEMM throughput against the bf16 dense peak (Gated DeltaNet's recurrence, which
// runs on the CUDA cores in float32, against their float32 peak).
//
// Method: per op, 3 warm-up calls, then `reps` calls queued back to back behind a GPU-side sleep
// (so the host is ahead and launch latency is not timed), a CUDA event between consecutive calls,
// and the median interval reported. Memory-bound ops rotate over enough copies of their tensors
// that the working set exceeds the L2 several times, so every call reads from DRAM. Byte counts are
// the op's compulsory traffic (each input read once, each output written once).
//
// Usage: bench_ops [--reps N] [--only SUBSTRING[|SUBSTRING...]] [--peak-tflops 790]
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "cuda/bench_choice.h"
#include "cuda/cuda_backend.h"
#include "cuda/cuda_check.h"

using namespace mt;

namespace {

__global__ void gpu_sleep_kernel(long long ns) {
  const long long start = clock64();
  // clock64 counts SM cycles; ~2 GHz is close enough for "make the host run ahead".
  while (clock64() - start < ns * 2) {
  }
}

struct Row {
  std::string model, op, shape;
  double us = 0, gbps = 0, tflops = 0;
  double peak = 0;  // TFLOP/s the row is measured against (0: --peak-tflops, the bf16 dense peak)
};

struct Options {
  int reps = 20;
  std::string only;
  double peak_tflops = 790.0;
};

class Bench {
 public:
  Bench(CudaBackend& be, Options opt) : be_(be), opt_(opt) {
    MT_CUDA_CHECK(cudaDeviceGetAttribute(&l2_bytes_, cudaDevAttrL2CacheSize, be.device_ordinal()));
    events_.resize(static_cast<size_t>(opt.reps) + 1);
    for (auto& e : events_) MT_CUDA_CHECK(cudaEventCreate(&e));
  }
  ~Bench() {
    free_all();
    for (auto& e : events_) cudaEventDestroy(e);
  }

  // A tensor of `sets` rotating copies: at(k) is copy k.
  struct Rot {
    Tensor base;
    int sets = 1;
    Tensor at(int k) const {
      Tensor t = base;
      const size_t one = base.nbytes();
      t.data = static_cast<char*>(base.data) + (k % sets) * one;
      return t;
    }
  };

  Tensor alloc(DType dt, std::initializer_list<int64_t> shape, double fill = 0.01) { return alloc_rot(dt, shape, 1, fill).base; }
  Rot alloc_rot(DType dt, std::initializer_list<int64_t> shape, int sets, double fill = 0.01) {
    Tensor t(nullptr, dt, Device::cuda, shape);
    void* p = be_.allocate(std::max<size_t>(t.nbytes() * sets, 16));
    owned_.push_back(p);
    t.data = p;
    Tensor all = t.view({static_cast<int64_t>(t.numel())});
    for (int k = 0; k < sets; ++k) {
      Tensor one = all;
      one.data = static_cast<char*>(p) + k * t.nbytes();
      if (is_floating(dt)) be_.init_normal(one, 1234 + k, static_cast<float>(fill), ShardIndex::whole(1, t.numel()));
      else be_.fill(one, 0);
    }
    return Rot{t, sets};
  }
  void upload_ints(Tensor t, const std::vector<int32_t>& v) {
    be_.copy_from_host(t, v.data());
    be_.synchronize();
  }
  void free_all() {
    be_.synchronize();
    for (void* p : owned_) be_.deallocate(p);
    owned_.clear();
  }
  // Copies needed so that `bytes` of working set per call exceeds the L2 four times over.
  int sets_for(double bytes) const {
    return static_cast<int>(std::clamp(std::ceil(4.0 * l2_bytes_ / std::max(bytes, 1.0)), 1.0, 8.0));
  }

  // Median time (us) of f(k) over reps calls; k cycles through the rotating copies.
  double time(const std::function<void(int)>& f) {
    cudaStream_t s = be_.cuda_stream();
    for (int i = 0; i < 3; ++i) f(i);
    be_.synchronize();
    gpu_sleep_kernel<<<1, 1, 0, s>>>(3000000);  // 3 ms: the host queues every rep meanwhile
    MT_CUDA_CHECK_LAUNCH();
    MT_CUDA_CHECK(cudaEventRecord(events_[0], s));
    for (int i = 0; i < opt_.reps; ++i) {
      f(i + 3);
      MT_CUDA_CHECK(cudaEventRecord(events_[i + 1], s));
    }
    MT_CUDA_CHECK(cudaEventSynchronize(events_.back()));
    std::vector<float> ms(opt_.reps);
    for (int i = 0; i < opt_.reps; ++i) MT_CUDA_CHECK(cudaEventElapsedTime(&ms[i], events_[i], events_[i + 1]));
    std::sort(ms.begin(), ms.end());
    return 1000.0 * ms[ms.size() / 2];
  }

  // --only "a|b": any of the '|'-separated substrings.
  bool wanted(const std::string& name) const {
    if (opt_.only.empty()) return true;
    size_t from = 0;
    while (true) {
      const size_t bar = opt_.only.find('|', from);
      const std::string part = opt_.only.substr(from, bar == std::string::npos ? std::string::npos : bar - from);
      if (!part.empty() && name.find(part) != std::string::npos) return true;
      if (bar == std::string::npos) return false;
      from = bar + 1;
    }
  }

  void memory_op(const std::string& model, const std::string& op, const std::string& shape, double bytes,
                 const std::function<void(int)>& f) {
    if (!wanted(model + " " + op)) return;
    const double us = time(f);
    rows_.push_back({model, op, shape, us, bytes / (us * 1e3), 0});
    print_last();
  }
  void gemm_op(const std::string& model, const std::string& op, int64_t m, int64_t n, int64_t k,
               const std::function<void(int)>& f) {
    if (!wanted(model + " " + op)) return;
    const double us = time(f);
    const double flops = 2.0 * m * n * k;
    rows_.push_back({model, op, std::to_string(m) + "x" + std::to_string(n) + "x" + std::to_string(k), us, 0,
                     flops / (us * 1e6)});
    print_last();
  }
  // An op of `flops` floating-point operations, against `peak` TFLOP/s.
  void flop_op(const std::string& model, const std::string& op, const std::string& shape, double flops, double peak,
               const std::function<void(int)>& f) {
    if (!wanted(model + " " + op)) return;
    const double us = time(f);
    rows_.push_back({model, op, shape, us, 0, flops / (us * 1e6), peak});
    print_last();
  }
  void print_last() const {
    const Row& r = rows_.back();
    std::printf("  %-10s %-34s %-22s %10.1f us", r.model.c_str(), r.op.c_str(), r.shape.c_str(), r.us);
    if (r.tflops > 0) std::printf("  %7.1f TFLOP/s\n", r.tflops);
    else std::printf("  %7.0f GB/s\n", r.gbps);
    std::fflush(stdout);
  }

  CudaBackend& be() { return be_; }
  std::vector<Row>& rows() { return rows_; }

 private:
  CudaBackend& be_;
  Options opt_;
  int l2_bytes_ = 50 << 20;
  std::vector<cudaEvent_t> events_;
  std::vector<void*> owned_;
  std::vector<Row> rows_;
};

struct Model {
  std::string name;
  int64_t rows, hidden, ffn, vocab, heads, groups, head_dim, params;
  bool llama;  // RMSNorm, RoPE, SwiGLU, no biases; else LayerNorm, learned positions, GeLU, biases
};

std::string shape2(int64_t a, int64_t b) { return std::to_string(a) + "x" + std::to_string(b); }

void bench_model(Bench& B, const Model& M) {
  CudaBackend& be = B.be();
  const DType bf = DType::bf16;
  const int64_t R = M.rows, H = M.hidden, F = M.ffn, V = M.vocab;
  const int64_t qkv_cols = (M.heads + 2 * M.groups) * M.head_dim;
  const int64_t fc1_cols = M.llama ? 2 * F : F;
  const std::string mn = M.name;
  std::printf("%s: rows %lld, hidden %lld, ffn %lld, vocab %lld\n", mn.c_str(), (long long)R, (long long)H,
              (long long)F, (long long)V);
  std::mt19937 gen(7);

  // ---- GEMMs: forward, input gradient, weight gradient of each linear layer ----
  struct Linear {
    const char* name;
    int64_t n, k;
    bool bias;
    Activation act;
  };
  std::vector<Linear> linears = {
      {"qkv", qkv_cols, H, !M.llama, Activation::none},
      {"attn_proj", H, M.heads * M.head_dim, !M.llama, Activation::none},
      {"fc1", fc1_cols, H, !M.llama, M.llama ? Activation::none : Activation::gelu},
      {"fc2", H, F, !M.llama, Activation::none},
      {"lm_head", V, H, false, Activation::none},
  };
  if (!M.llama) linears.insert(linears.begin() + 3, Linear{"fc1_tanh", fc1_cols, H, true, Activation::gelu_tanh});
  for (const Linear& L : linears) {
    Tensor x = B.alloc(bf, {R, L.k}, 1.0), w = B.alloc(bf, {L.n, L.k}, 0.02), y = B.alloc(bf, {R, L.n});
    Tensor bias = L.bias ? B.alloc(bf, {L.n}) : Tensor();
    Tensor pre = L.act != Activation::none ? B.alloc(bf, {R, L.n}) : Tensor();
    B.gemm_op(mn, std::string("fwd ") + L.name + (L.bias ? " +bias" : "") +
                      (L.act == Activation::gelu ? " +gelu" : L.act == Activation::gelu_tanh ? " +gelu_tanh" : ""),
              R, L.n, L.k, [&](int) { be.linear_forward(y, x, w, bias, L.act, pre); });
    B.gemm_op(mn, std::string("bwd_input ") + L.name, R, L.k, L.n,
              [&](int) { be.linear_backward_input(x, y, w, false, Activation::none, Tensor()); });
    Tensor dw = B.alloc(DType::f32, {L.n, L.k});
    Tensor db = L.bias ? B.alloc(DType::f32, {L.n}) : Tensor();
    B.gemm_op(mn, std::string("bwd_weight ") + L.name + (L.bias ? " +dbias" : ""), L.k, L.n, R,
              [&](int) { be.linear_backward_weight(dw, db, y, x, true); });
    if (L.bias && std::string(L.name) == "fc2") {  // the column-sum kernel (default) against the BGRADB epilogue
      be.gemm().use_bias_grad_epilogue = true;
      B.gemm_op(mn, std::string("bwd_weight ") + L.name + " +dbias (BGRADB epilogue)", L.k, L.n, R,
                [&](int) { be.linear_backward_weight(dw, db, y, x, true); });
      be.gemm().use_bias_grad_epilogue = false;
    }
    if (L.act == Activation::gelu_tanh) {
      be.gemm().use_gelu_epilogue = false;
      B.gemm_op(mn, std::string("fwd ") + L.name + " +bias +gelu_tanh (kernel)", R, L.n, L.k,
                [&](int) { be.linear_forward(y, x, w, bias, L.act, pre); });
      be.gemm().use_gelu_epilogue = true;
      // dgelu epilogue on the FC2 input gradient (dx[R,F] = dy[R,H] w2[H,F] * gelu'(pre)).
      Tensor dy = B.alloc(bf, {R, H}, 1.0), w2 = B.alloc(bf, {H, F}, 0.02), dx = B.alloc(bf, {R, F});
      B.gemm_op(mn, "bwd_input fc2 +dgelu_tanh", R, F, H,
                [&](int) { be.linear_backward_input(dx, dy, w2, false, Activation::gelu_tanh, pre); });
      be.gemm().use_gelu_epilogue = false;
      B.gemm_op(mn, "bwd_input fc2 +dgelu_tanh (kernel)", R, F, H,
                [&](int) { be.linear_backward_input(dx, dy, w2, false, Activation::gelu_tanh, pre); });
      be.gemm().use_gelu_epilogue = true;
    }
    B.free_all();
  }

  // ---- memory-bound ops ----
  const double act = static_cast<double>(R) * H * 2;  // bytes of one [R, H] bf16 activation
  {
    const int S = B.sets_for(4 * act);
    auto x = B.alloc_rot(bf, {R, H}, S, 1.0), out = B.alloc_rot(bf, {R, H}, S), b = B.alloc_rot(bf, {R, H}, S, 1.0),
         sum = B.alloc_rot(bf, {R, H}, S);
    Tensor w = B.alloc(bf, {H}, 1.0), bias = M.llama ? Tensor() : B.alloc(bf, {H});
    Tensor mean = B.alloc(DType::f32, {R}), rstd = B.alloc(DType::f32, {R});
    NormParams p;
    p.kind = M.llama ? Normalization::rmsnorm : Normalization::layernorm;
    const std::string norm = M.llama ? "rmsnorm" : "layernorm";
    B.memory_op(mn, "add_" + norm + " fwd (p=0.1)", shape2(R, H), 4 * act, [&](int k) {
      be.add_norm_forward(sum.at(k), out.at(k), mean, rstd, x.at(k), b.at(k), 0.1f, 99, w, bias, p);
    });
    Tensor dw = B.alloc(DType::f32, {H}), db = M.llama ? Tensor() : B.alloc(DType::f32, {H});
    auto rec = B.alloc_rot(bf, {R, H}, S);
    Tensor bias_h = B.alloc(bf, {H});
    // The 16-bit fast path (the default) and the general kernel (bench_choice::norm_general).
    for (const bool general : {false, true}) {
      mt::cuda::bench_choice::norm_general = general;
      const std::string tag = general ? " (general kernel)" : "";
      B.memory_op(mn, norm + " fwd" + tag, shape2(R, H), 2 * act,
                  [&](int k) { be.norm_forward(out.at(k), mean, rstd, x.at(k), w, bias, p); });
      B.memory_op(mn, "bias_dropout_add_" + norm + " (p=0, fused)" + tag, shape2(R, H), 4 * act, [&](int k) {
        be.bias_dropout_add_norm(sum.at(k), out.at(k), mean, rstd, b.at(k), x.at(k), bias_h, 0.0f, 5, w, bias, p);
      });
      B.memory_op(mn, norm + " bwd (+dresidual)" + tag, shape2(R, H), 4 * act, [&](int k) {
        be.norm_backward(sum.at(k), dw, db, out.at(k), x.at(k), mean, rstd, w, b.at(k), Tensor(), p);
      });
      // As the training step runs it: the norm output recomputed too (5 tensors of traffic).
      B.memory_op(mn, norm + " bwd recompute (+dresidual)" + tag, shape2(R, H), 5 * act, [&](int k) {
        be.norm_backward_recompute(rec.at(k), sum.at(k), dw, db, out.at(k), x.at(k), mean, rstd, w, bias, b.at(k), Tensor(), p);
      });
      mt::cuda::bench_choice::norm_general = false;
    }
    B.memory_op(mn, "bias_dropout_add (p=0.1)", shape2(R, H), 3 * act,
                [&](int k) { be.bias_dropout_add(out.at(k), x.at(k), bias_h, b.at(k), 0.1f, 5); });
    // The benchmark configs' setting (dropout 0), separately and fused with the next norm.
    B.memory_op(mn, "bias_dropout_add (p=0)", shape2(R, H), 3 * act,
                [&](int k) { be.bias_dropout_add(out.at(k), x.at(k), bias_h, b.at(k), 0.0f, 5); });
    B.memory_op(mn, "bias_dropout_add + " + norm + " fwd (p=0, two ops)", shape2(R, H), 5 * act, [&](int k) {
      be.bias_dropout_add(sum.at(k), x.at(k), bias_h, b.at(k), 0.0f, 5);
      be.norm_forward(out.at(k), mean, rstd, sum.at(k), w, bias, p);
    });

    B.memory_op(mn, "dropout_backward (p=0.1)", shape2(R, H), 2 * act,
                [&](int k) { be.dropout_backward(out.at(k), x.at(k), 0.1f, 5); });
    B.free_all();
  }
  {
    const double ff = static_cast<double>(R) * F * 2;
    if (M.llama) {
      const int S = B.sets_for(5 * ff);
      auto in = B.alloc_rot(bf, {R, 2 * F}, S, 1.0), out = B.alloc_rot(bf, {R, F}, S), din = B.alloc_rot(bf, {R, 2 * F}, S);
      B.memory_op(mn, "swiglu fwd", shape2(R, 2 * F), 3 * ff, [&](int k) { be.swiglu_forward(out.at(k), in.at(k)); });
      B.memory_op(mn, "swiglu bwd", shape2(R, 2 * F), 5 * ff,
                  [&](int k) { be.swiglu_backward(din.at(k), out.at(k), in.at(k)); });
    } else {
      const int S = B.sets_for(3 * ff);
      auto in = B.alloc_rot(bf, {R, F}, S, 1.0), out = B.alloc_rot(bf, {R, F}, S), dout = B.alloc_rot(bf, {R, F}, S);
      const auto fwd = [&](const char* name, Activation act) {
        B.memory_op(mn, name, shape2(R, F), 2 * ff, [&](int k) { be.activation_forward(out.at(k), in.at(k), act); });
      };
      fwd("gelu fwd (erf)", Activation::gelu);
      B.memory_op(mn, "gelu bwd (erf)", shape2(R, F), 3 * ff,
                  [&](int k) { be.activation_backward(out.at(k), dout.at(k), in.at(k), Activation::gelu); });
      fwd("gelu fwd (tanh)", Activation::gelu_tanh);
      fwd("squared relu fwd", Activation::squared_relu);
      B.memory_op(mn, "squared relu bwd", shape2(R, F), 3 * ff,
                  [&](int k) { be.activation_backward(out.at(k), dout.at(k), in.at(k), Activation::squared_relu); });
    }
    B.free_all();
  }
  {
    // The attention output gate (--attention-output-gate): the gated QKV projection's output split
    // into qkv and gate, the gradients merged back, and the sigmoid gate on the attention output.
    const GateShape gs{static_cast<int>(M.groups), static_cast<int>(M.heads / M.groups), static_cast<int>(M.head_dim)};
    const double qkvg = static_cast<double>(R) * gs.qkvg_width() * 2, att = static_cast<double>(R) * gs.gate_width() * 2;
    const int S = B.sets_for(2 * qkvg);
    auto all = B.alloc_rot(bf, {R, gs.qkvg_width()}, S, 1.0), qkv = B.alloc_rot(bf, {R, gs.qkv_width()}, S),
         gate = B.alloc_rot(bf, {R, gs.gate_width()}, S, 1.0), x = B.alloc_rot(bf, {R, gs.gate_width()}, S, 1.0),
         dy = B.alloc_rot(bf, {R, gs.gate_width()}, S, 1.0);
    B.memory_op(mn, "attention gate split", shape2(R, gs.qkvg_width()), 2 * qkvg,
                [&](int k) { be.attention_gate_split(qkv.at(k), gate.at(k), all.at(k), gs); });
    B.memory_op(mn, "attention gate merge", shape2(R, gs.qkvg_width()), 2 * qkvg,
                [&](int k) { be.attention_gate_merge(all.at(k), qkv.at(k), gate.at(k), gs); });
    B.memory_op(mn, "output gate fwd", shape2(R, gs.gate_width()), 3 * att,
                [&](int k) { be.output_gate_forward(dy.at(k), x.at(k), gate.at(k)); });
    // In place as the model runs it: 3 tensors read, 2 written.
    B.memory_op(mn, "output gate bwd (in place)", shape2(R, gs.gate_width()), 5 * att,
                [&](int k) { be.output_gate_backward(dy.at(k), gate.at(k), dy.at(k), x.at(k), gate.at(k)); });
    B.free_all();
  }
  if (M.llama) {
    const int64_t width = qkv_cols;
    const double bytes = static_cast<double>(R) * (M.heads + M.groups) * M.head_dim * 2 * 2;
    const int S = B.sets_for(bytes);
    auto qkv = B.alloc_rot(bf, {R, width}, S, 1.0);
    Tensor pos = B.alloc(DType::i32, {R}), cs = B.alloc(DType::f32, {4096, M.head_dim});
    std::vector<int32_t> p(R);
    for (int64_t i = 0; i < R; ++i) p[i] = static_cast<int32_t>(i % 4096);
    B.upload_ints(pos, p);
    RopeShape r;
    r.heads = static_cast<int>(M.heads), r.groups = static_cast<int>(M.groups), r.head_dim = static_cast<int>(M.head_dim);
    r.rot_dim = static_cast<int>(M.head_dim);
    B.memory_op(mn, "rope fwd (q,k in place)", shape2(R, width), bytes,
                [&](int k) { be.rope_forward(qkv.at(k), pos, cs, r); });
    B.memory_op(mn, "rope bwd", shape2(R, width), bytes, [&](int k) { be.rope_backward(qkv.at(k), pos, cs, r); });
    B.free_all();
  }
  {
    // Embedding: random tokens; the backward's traffic counts each distinct token row once.
    Tensor tok = B.alloc(DType::i32, {R}), pos = B.alloc(DType::i32, {R});
    std::vector<int32_t> t(R), p(R);
    std::uniform_int_distribution<int32_t> d(0, static_cast<int32_t>(V - 1));
    std::unordered_set<int32_t> distinct;
    for (int64_t i = 0; i < R; ++i) t[i] = d(gen), p[i] = static_cast<int32_t>(i % 1024), distinct.insert(t[i]);
    B.upload_ints(tok, t);
    B.upload_ints(pos, p);
    Tensor wte = B.alloc(bf, {V, H}), wpe = M.llama ? Tensor() : B.alloc(bf, {1024, H});
    const int S = B.sets_for(2 * act);
    auto out = B.alloc_rot(bf, {R, H}, S);
    B.memory_op(mn, std::string("embedding fwd") + (M.llama ? "" : " (+wpe)"), shape2(R, H), (M.llama ? 2 : 3) * act,
                [&](int k) { be.embedding_forward(out.at(k), tok, pos, wte, wpe, 0); });
    Tensor dwte = B.alloc(DType::f32, {V, H}), dwpe = M.llama ? Tensor() : B.alloc(DType::f32, {1024, H});
    const double bwd_bytes = act + distinct.size() * H * 8.0 + (M.llama ? 0 : act + 1024.0 * H * 8);
    B.memory_op(mn, "embedding bwd (deterministic)", shape2(R, H), bwd_bytes,
                [&](int k) { be.embedding_backward(dwte, dwpe, out.at(k), tok, pos, 0); });
    B.free_all();
  }
  {
    const double lb = static_cast<double>(R) * V * 2;
    Tensor logits = B.alloc(bf, {R, V}, 3.0), labels = B.alloc(DType::i32, {R});
    std::vector<int32_t> l(R);
    std::uniform_int_distribution<int32_t> d(0, static_cast<int32_t>(V - 1));
    for (auto& x : l) x = d(gen);
    B.upload_ints(labels, l);
    Tensor lse = B.alloc(DType::f32, {R}), target = B.alloc(DType::f32, {R}), dloss = B.alloc(DType::f32, {R});
    B.memory_op(mn, "cross_entropy fwd", shape2(R, V), lb,
                [&](int) { be.cross_entropy_forward(lse, target, logits, labels, 0); });
    be.cross_entropy_forward(lse, target, logits, labels, 0);
    B.memory_op(mn, "cross_entropy bwd (in place)", shape2(R, V), 2 * lb,
                [&](int) { be.cross_entropy_backward(logits, logits, labels, lse, dloss, 0); });
    B.free_all();
  }
  {
    const int64_t P = M.params;
    Tensor w = B.alloc(DType::f32, {P}), g = B.alloc(DType::f32, {P}, 1e-3), m = B.alloc(DType::f32, {P}, 1e-4),
           v = B.alloc(DType::f32, {P}, 1e-4), model = B.alloc(bf, {P}), out = B.alloc(DType::f32, {1});
    be.fill(v, 1e-6);  // second moments must be >= 0
    // One segment per 8 MiB-ish tensor, two groups (decay / no decay): a realistic list.
    std::vector<OptimSegment> segs;
    for (int64_t off = 0; off < P; off += 2'000'000) segs.push_back({off, std::min<int64_t>(2'000'000, P - off), int(segs.size() % 2)});
    be.register_optim_segments(segs);
    OptimStepParams p;
    p.lr[0] = p.lr[1] = 1e-4f;
    p.weight_decay[0] = 0.1f;
    // (bench_choice::adamw_variant: the kernel's loads in flight per thread and cache hints.)
    for (int variant = 0; variant <= 3; ++variant) {
      cuda::bench_choice::adamw_variant = variant;
      B.memory_op(mn, "adamw (+bf16 copy)" + (variant ? " variant " + std::to_string(variant) : std::string()),
                  std::to_string(P) + " params", 30.0 * P, [&](int) { be.adamw_step(w, g, m, v, model, segs, p); });
    }
    cuda::bench_choice::adamw_variant = 0;
    // The master weights as remainders beside the bf16 weights (the default for bf16 runs): 28 bytes
    // per parameter (and the tie bits, touched only at ties); ties away (the precision-aware
    // optimizer's) and to nearest even with tie bits.
    {
      Tensor rem = B.alloc(DType::i16, {P}), words = B.alloc(DType::i32, {(P + 31) / 32});
      be.fill(words, 0.0);
      be.split_master(model, rem, w, TieBits{words, 0});
      B.memory_op(mn, "adamw remainders (ties away)", std::to_string(P) + " params", 28.0 * P,
                  [&](int) { be.adamw_step(rem, g, m, v, model, segs, p); });
      be.split_master(model, rem, w, TieBits{words, 0});
      B.memory_op(mn, "adamw remainders (to even, tie bits)", std::to_string(P) + " params", 28.0 * P,
                  [&](int) { be.adamw_step(rem, g, m, v, model, segs, p, TieBits{words, 0}); });
      B.memory_op(mn, "master_sum_squares (params norm)", std::to_string(P) + " params", 4.0 * P,
                  [&](int) { be.master_sum_squares(out, model, rem, TieBits{words, 0}, segs, false); });
    }
    B.memory_op(mn, "sum_squares (grad norm)", std::to_string(P) + " params", 4.0 * P,
                [&](int) { be.sum_squares(out, g, segs, false); });
    // Zeroing the main grads each step: 0 takes cudaMemsetAsync, any other value the fill kernel.
    B.memory_op(mn, "fill grads 0 (memset)", std::to_string(P) + " params", 4.0 * P, [&](int) { be.fill(m, 0.0); });
    B.memory_op(mn, "fill grads 1e-4 (kernel)", std::to_string(P) + " params", 4.0 * P,
                [&](int) { be.fill(m, 1e-4); });
    B.free_all();
  }
}

// The MoE experts' grouped GEMMs (Backend::grouped_linear_*) at a shape's rows (tokens x top-k),
// experts and sizes, the rows spread over the experts by uniform random routing; each op by our
// grouped MMA kernel, by cuBLAS (grouped batched, or per expert for large experts), and a dense
// GEMM of the same FLOPs beside them.
// routing: "uniform" (each row to a random expert), "skewed" (expert e drawn with weight 1 / (e + 1)),
// or "hot" (the rows spread over the first top-k experts alone, as when every token picks the same).
void bench_moe(Bench& B, const std::string& name, int64_t R, int64_t E, int64_t H, int64_t F, int64_t topk,
               const std::string& routing) {
  CudaBackend& be = B.be();
  const DType bf = DType::bf16;
  const std::string mn = name + " " + routing;
  std::printf("%s: %lld expert rows, %lld experts, hidden %lld, expert ffn %lld (SwiGLU), %s routing\n", name.c_str(),
              (long long)R, (long long)E, (long long)H, (long long)F, routing.c_str());
  std::mt19937 gen(11);
  std::vector<int64_t> counts(static_cast<size_t>(E), 0);
  std::vector<double> weight(static_cast<size_t>(E), 1.0);
  for (int64_t e = 0; e < E; ++e) {
    if (routing == "skewed") weight[static_cast<size_t>(e)] = 1.0 / static_cast<double>(e + 1);
    if (routing == "hot") weight[static_cast<size_t>(e)] = e < topk ? 1.0 : 0.0;
  }
  std::discrete_distribution<int64_t> pick(weight.begin(), weight.end());
  for (int64_t r = 0; r < R; ++r) ++counts[static_cast<size_t>(pick(gen))];
  std::vector<int64_t> off{0};
  for (int64_t c : counts) off.push_back(off.back() + c);
  be.prepare_grouped_gemms(static_cast<int>(E));
  const std::vector<int32_t> off32(off.begin(), off.end());
  struct Lin {
    const char* name;
    int64_t n, k;
  };
  using bench_choice_path = cuda::bench_choice::GroupedGemmPath;
  for (const Lin L : {Lin{"fc1", 2 * F, H}, Lin{"fc2", H, F}}) {
    Tensor x = B.alloc(bf, {R, L.k}, 1.0), w = B.alloc(bf, {E * L.n, L.k}, 0.02), y = B.alloc(bf, {R, L.n});
    Tensor dw = B.alloc(DType::f32, {E * L.n, L.k});
    Tensor dw16 = B.alloc(bf, {E * L.n, L.k});
    Tensor sumsq = B.alloc(DType::f32, {1});
    Tensor wd = B.alloc(bf, {L.n, L.k}, 0.02);
    // The offsets on the device, as the MoE block passes them (the host never waits for the routing).
    Tensor off_dev = B.alloc(DType::i32, {E + 1});
    B.upload_ints(off_dev, off32);
    const ExpertOffsets offs = ExpertOffsets::on_device(off_dev);
    struct Variant {
      bench_choice_path path;
      bool register_epilogue;  // the TMA kernel's fragments stored from registers (its old epilogue)
      const char* name;
    };
    for (const Variant v : {Variant{bench_choice_path::mma, false, "ours"},
                            Variant{bench_choice_path::mma, true, "ours, register stores"},
                            Variant{bench_choice_path::mma_cp_async, false, "wgmma cp.async"},
                            Variant{bench_choice_path::cublas, false, "cublas"}}) {
      cuda::bench_choice::grouped_gemm_path = v.path;
      cuda::bench_choice::grouped_register_epilogue = v.register_epilogue;
      const std::string tag = std::string(" ") + L.name + " (" + v.name + ")";
      B.gemm_op(mn, "grouped fwd" + tag, R, L.n, L.k, [&](int) { be.grouped_linear_forward(y, x, w, offs); });
      B.gemm_op(mn, "grouped bwd_input" + tag, R, L.k, L.n, [&](int) { be.grouped_linear_backward_input(x, y, w, offs); });
      B.gemm_op(mn, "grouped bwd_weight f32" + tag, L.n, L.k, R,
                [&](int) { be.grouped_linear_backward_weight(dw, y, x, offs, false); });
      // (With the gradient norm's sum of squares of what it writes: one micro-batch per step.)
      B.gemm_op(mn, "grouped bwd_weight f32 +sumsq" + tag, L.n, L.k, R,
                [&](int) { be.grouped_linear_backward_weight(dw, y, x, offs, false, sumsq); });
      B.gemm_op(mn, "grouped bwd_weight +acc f32" + tag, L.n, L.k, R,
                [&](int) { be.grouped_linear_backward_weight(dw, y, x, offs, true); });
      // (A 16-bit weight gradient: the same main loop with half the epilogue's bytes.)
      B.gemm_op(mn, "grouped bwd_weight bf16" + tag, L.n, L.k, R,
                [&](int) { be.grouped_linear_backward_weight(dw16, y, x, offs, false); });
    }
    cuda::bench_choice::grouped_gemm_path = bench_choice_path::automatic;
    cuda::bench_choice::grouped_register_epilogue = false;
    B.gemm_op(mn, std::string("dense fwd, same FLOPs ") + L.name, R, L.n, L.k,
              [&](int) { be.linear_forward(y, x, wd, Tensor(), Activation::none, Tensor()); });
    // The experts' linear biases (MoE layers with --add-bias-linear): y += p * b (y read and
    // written), and the backward (dy read twice: the bias gradient's column sums, then d p's rows).
    {
      Tensor bias = B.alloc(bf, {E, L.n}, 0.1), p = B.alloc(DType::f32, {R}, 0.5);
      Tensor db = B.alloc(DType::f32, {E, L.n}), dp = B.alloc(DType::f32, {R});
      const double rows_bytes = static_cast<double>(R) * L.n * 2;
      B.memory_op(mn, std::string("grouped bias fwd (x p) ") + L.name, shape2(R, L.n), 2 * rows_bytes,
                  [&](int) { be.grouped_bias_forward(y, bias, p, offs); });
      B.memory_op(mn, std::string("grouped bias bwd (db, dp) ") + L.name, shape2(R, L.n), 2 * rows_bytes,
                  [&](int) { be.grouped_bias_backward(db, dp, y, bias, p, offs, false); });
    }
    B.free_all();
  }
}

// Gated DeltaNet (Backend::gdn_*) at a Qwen3-Next-like layer: batch 4 x seq 4096, 8 key heads, 16
// value heads, dk = dv = 128, bf16. The recurrence is float32 math on the CUDA cores: FLOP/s against
// their peak, counting the forward's 7 operations per state element and position (decay, S^T k,
// the rank-1 update, S^T q) and the backward as 3 times that (its recomputation of states not
// counted). The convolution and the output gate are memory-bound: GB/s.
void bench_gdn(Bench& B, double fp32_peak) {
  CudaBackend& be = B.be();
  const DType bf = DType::bf16;
  GdnShape s;
  s.batch = 4, s.seq = 4096, s.key_heads = 8, s.value_heads = 16, s.dk = 128, s.dv = 128, s.conv_k = 4;
  s.scale = static_cast<float>(1.0 / std::sqrt(128.0));
  const int64_t N = s.tokens(), P = s.proj_width(), C = s.conv_width(), W = s.value_width();
  const std::string mn = "gdn";
  std::printf("%s: batch %d x seq %d, heads %d/%d, dk %d, dv %d, conv %d\n", mn.c_str(), s.batch, s.seq, s.key_heads,
              s.value_heads, s.dk, s.dv, s.conv_k);
  Tensor proj = B.alloc(bf, {N, P}, 1.0), xc = B.alloc(bf, {N, C}, 1.0), w = B.alloc(bf, {C, s.conv_k}, 0.3);
  Tensor out = B.alloc(bf, {N, W}), states = B.alloc(DType::f32, {s.states_numel()});
  Tensor a_log = B.alloc(bf, {s.value_heads}, 1.0), dt_bias = B.alloc(bf, {s.value_heads}, 1.0);
  Tensor dout = B.alloc(bf, {N, W}, 1.0), dxc = B.alloc(bf, {N, C}), dproj = B.alloc(bf, {N, P});
  Tensor da_log = B.alloc(DType::f32, {s.value_heads}), ddt = B.alloc(DType::f32, {s.value_heads});
  Tensor dw = B.alloc(DType::f32, {C, s.conv_k});
  const std::string shape = std::to_string(s.batch) + "x" + std::to_string(s.seq) + " h" +
                            std::to_string(s.value_heads) + " d" + std::to_string(s.dk);
  const double state_steps = static_cast<double>(N) * s.value_heads * s.dk * s.dv;
  B.flop_op(mn, "gdn_forward (recurrence)", shape, 7 * state_steps, fp32_peak,
            [&](int) { be.gdn_forward(out, states, xc, proj, a_log, dt_bias, s); });
  be.gdn_forward(out, states, xc, proj, a_log, dt_bias, s);  // the states the backward reads
  B.flop_op(mn, "gdn_backward (recurrence)", shape, 21 * state_steps, fp32_peak, [&](int) {
    be.gdn_backward(dxc, dproj, da_log, ddt, dout, xc, proj, a_log, dt_bias, states, s, true);
  });
  const double conv_bytes = static_cast<double>(N) * C * 2;  // the q, k, v columns read, xc written
  B.memory_op(mn, "gdn_conv fwd", shape2(N, C), 2 * conv_bytes, [&](int) { be.gdn_conv_forward(xc, proj, w, s); });
  B.memory_op(mn, "gdn_conv bwd", shape2(N, C), 3 * conv_bytes,
              [&](int) { be.gdn_conv_backward(dproj, dw, dxc, proj, w, s, true); });
  const double gate_bytes = static_cast<double>(N) * W * 2;
  B.memory_op(mn, "gdn_gate fwd", shape2(N, W), 3 * gate_bytes, [&](int) { be.gdn_gate_forward(out, dout, proj, s); });
  B.memory_op(mn, "gdn_gate bwd (in place)", shape2(N, W), 5 * gate_bytes,
              [&](int) { be.gdn_gate_backward(dout, dproj, dout, out, proj, s); });
  B.free_all();
}

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) opt.reps = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--only") && i + 1 < argc) opt.only = argv[++i];
    else if (!std::strcmp(argv[i], "--peak-tflops") && i + 1 < argc) opt.peak_tflops = std::atof(argv[++i]);
    else {
      std::fprintf(stderr, "usage: bench_ops [--reps N] [--only SUBSTRING] [--peak-tflops T]\n");
      return 2;
    }
  }
  try {
    CudaBackend be(0);
    cudaDeviceProp prop{};
    MT_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    std::printf("bench_ops on %s (%d SMs, L2 %d MiB), %d reps per op, median\n", prop.name, prop.multiProcessorCount,
                prop.l2CacheSize >> 20, opt.reps);
    Bench B(be, opt);
    int clock_khz = 0;
    MT_CUDA_CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
    // float32 FMA lanes: 128 per SM on Hopper, 2 operations each a cycle.
    const double fp32_peak = prop.multiProcessorCount * 128.0 * 2.0 * clock_khz * 1e3 / 1e12;

    // Ceilings measured here: device-to-device copy (read + write) and a large bf16 GEMM.
    double copy_gbps = 0, gemm_tflops = 0;
    {
      const int64_t n = int64_t{1} << 30;  // 1 GiB each way
      void* a = be.allocate(n);
      void* b = be.allocate(n);
      MT_CUDA_CHECK(cudaMemsetAsync(a, 1, n, be.cuda_stream()));
      const double us = B.time([&](int) { MT_CUDA_CHECK(cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice, be.cuda_stream())); });
      copy_gbps = 2.0 * n / (us * 1e3);
      be.synchronize();
      be.deallocate(a);
      be.deallocate(b);
      Tensor x = B.alloc(DType::bf16, {8192, 8192}, 1.0), w = B.alloc(DType::bf16, {8192, 8192}, 0.02),
             y = B.alloc(DType::bf16, {8192, 8192});
      const double gus = B.time([&](int) { be.linear_forward(y, x, w, Tensor(), Activation::none, Tensor()); });
      gemm_tflops = 2.0 * 8192.0 * 8192 * 8192 / (gus * 1e6);
      B.free_all();
      std::printf("ceilings: D2D copy %.0f GB/s (read+write), bf16 GEMM 8192^3 %.1f TFLOP/s (nominal peak %.0f)\n",
                  copy_gbps, gemm_tflops, opt.peak_tflops);
    }

    const Model models[] = {
        {"gpt2-124m", 32 * 1024, 768, 3072, 50304, 12, 12, 64, 124'000'000, false},
        {"gpt-1.3b", 8 * 2048, 2048, 8192, 50304, 16, 16, 128, 1'300'000'000, false},
        {"llama-1b", 2 * 4096, 2048, 8192, 128256, 32, 8, 64, 1'240'000'000, true},
    };
    for (const Model& m : models) bench_model(B, m);
    // bench/run_bench.sh's MoE configs: seq 4096 x micro-batch 2 tokens, top-k rows each.
    for (const char* routing : {"uniform", "skewed", "hot"}) {
      bench_moe(B, "moe-fine-grained", 8192 * 8, 64, 2048, 768, 8, routing);
      bench_moe(B, "moe-mixtral-proxy", 8192 * 2, 8, 2048, 5632, 2, routing);
    }
    bench_gdn(B, fp32_peak);

    std::printf("\n| model | op | shape | time (us) | GB/s | %% of copy | TFLOP/s | %% of peak |\n");
    std::printf("|---|---|---|---:|---:|---:|---:|---:|\n");
    for (const Row& r : B.rows()) {
      if (r.tflops > 0)
        std::printf("| %s | %s | %s | %.1f | | | %.1f | %.0f%% |\n", r.model.c_str(), r.op.c_str(), r.shape.c_str(), r.us,
                    r.tflops, 100.0 * r.tflops / (r.peak > 0 ? r.peak : opt.peak_tflops));
      else
        std::printf("| %s | %s | %s | %.1f | %.0f | %.0f%% | | |\n", r.model.c_str(), r.op.c_str(), r.shape.c_str(), r.us,
                    r.gbps, 100.0 * r.gbps / copy_gbps);
    }
    std::printf("ceilings: copy %.0f GB/s, GEMM 8192^3 %.1f TFLOP/s; peaks: bf16 dense %.0f TFLOP/s (GEMMs), float32 "
                "CUDA cores %.1f TFLOP/s (gdn_forward, gdn_backward)\n",
                copy_gbps, gemm_tflops, opt.peak_tflops, fp32_peak);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_ops: %s\n", e.what());
    return 1;
  }
  return 0;
}
