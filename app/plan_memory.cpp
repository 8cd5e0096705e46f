// Per-GPU memory estimate of one pipeline stage.
//
// Model state, bytes per parameter this rank holds:
//   weights     2 with --bf16/--fp16, 4 in fp32
//   gradients   4 (fp32 main grads: fp32 runs, --bf16 unless --grad-reduce-in-bf16, or
//               --accumulate-allreduce-grads-in-fp32), else 2
//   optimizer   Adam: fp32 master weights (mixed precision only) + 2 fp32 moments = 12 (8 in fp32);
//               SGD: master + momentum = 8 (4 in fp32). --use-distributed-optimizer shards it over
//               DP (Megatron's 18 bytes/param become 6 + 12/DP).
//
// Activations, bytes per micro-batch per transformer layer, after Korthikanti et al., "Reducing
// Activation Recomputation in Large Transformer Models" (2022): with 16-bit activations and
// dropout a GPT layer stores s*b*h*(34 + 5*a*s/h) bytes without tensor parallelism,
// s*b*h*(10 + 24/t + 5*a*s/(h*t)) with TP t, and s*b*h*(34 + 5*a*s/h)/t with sequence parallelism.
// The 5*a*s/h term is the s x s attention matrix (softmax output and dropout mask), which
// megatrain's flash-style attention never stores; it keeps the per-row log-sum-exp instead. We
// count the tensors our layers keep, for any activation width e (2 for bf16/fp16, 4 for fp32),
// GQA (q + 2k), ffn size f and SwiGLU (fc1 produces (F-1)*f = 2f):
//   sequence region (divided by t with --sequence-parallel, else whole on every TP rank):
//     norm-1 input, norm-1 output (QKV input), norm-2 input, norm-2 output (fc1 input): 4*e*sbh
//     (norm inputs are 4 bytes with --fp32-residual-connection), and two 1-byte dropout masks
//     of sbh when --hidden-dropout > 0;
//   tensor-parallel region (divided by t):
//     Q, K, V e*sb(q + 2k); attention output (projection input) e*sbq; log-sum-exp 4*sb*a;
//     fc1 output e*sb(F-1)f; activation output (fc2 input) e*sbf.
// With e = 2, q + 2k = 3h, f = 4h, GeLU and dropout this is Korthikanti's 10 + 24/t (34/t with
// SP) without the s x s term.
// Selective recompute drops what its modules recompute: core_attn the log-sum-exp (Q, K, V and
// the output stay stored as inputs of neighbouring GEMMs), layernorm the norm outputs, mlp the
// fc1 and activation outputs. Full recompute keeps only each recomputed layer's input (e*sbh in
// the sequence region): uniform N stores one input per group of N layers and re-materialises one
// group at a time; block N recomputes the first N layers of each chunk.
// Per micro-batch extras: token ids (4*sb) and the embedding dropout mask on the first stage; the
// final norm's input and output and the fp32 logits (4*sb*V/t, kept by the vocab-parallel cross
// entropy for its backward) on the last stage.
// Micro-batches alive at the peak (megatron.md 6.1, 6.2): 1 without pipelining; min(P - r, M) on
// stage r with 1F1B; interleaved: min(M*V, W_r + 1) chunk-micro-batches, W_r = min(M*V,
// 2(P - r - 1) + (V - 1)N). Not counted: cuBLASLt/attention workspaces, communication buffers,
// allocator fragmentation, the CUDA context (~0.5-1 GB).
#include <algorithm>
#include <cmath>

#include "app/plan.h"

namespace mt {
namespace {

struct LayerActivation {
  double full = 0;         // no recompute
  double lse = 0;          // dropped by selective core_attn
  double norm_outputs = 0; // dropped by selective layernorm
  double mlp_inner = 0;    // dropped by selective mlp
  double input = 0;        // what a fully recomputed layer keeps
};

LayerActivation layer_activation(const Config& c) {
  const ModelConfig& m = c.model;
  const double s = m.seq_length, b = c.train.micro_batch_size, h = m.hidden_size, a = m.num_attention_heads;
  const double t = c.parallel.tensor_model_parallel_size;
  const double e = c.train.precision == Precision::fp32 ? 4 : 2;
  const double residual_e = m.fp32_residual_connection ? 4 : e;
  const double q = a * m.head_dim, k = static_cast<double>(m.query_groups) * m.head_dim;
  const double f = m.ffn_size, F = m.swiglu ? 3 : 2;
  const double seq_div = c.parallel.sequence_parallel ? t : 1;
  const double sbh = s * b * h;
  const double masks = m.hidden_dropout > 0 ? 2 * sbh : 0;

  LayerActivation l;
  const double norm_inputs = 2 * residual_e * sbh / seq_div;
  l.norm_outputs = 2 * e * sbh / seq_div;
  const double qkv = e * s * b * (q + 2 * k) / t;
  const double attn_out = e * s * b * q / t;
  l.lse = 4 * s * b * a / t;
  l.mlp_inner = (e * s * b * (F - 1) * f + e * s * b * f) / t;
  l.full = norm_inputs + l.norm_outputs + masks / seq_div + qkv + attn_out + l.lse + l.mlp_inner;
  l.input = residual_e * sbh / seq_div;
  return l;
}

double selective_layer(const Config& c, const LayerActivation& l) {
  std::vector<std::string> modules = c.train.recompute_modules;
  if (modules.empty()) modules = {"core_attn"};
  double v = l.full;
  for (const std::string& mod : modules) {
    if (mod == "core_attn") v -= l.lse;
    if (mod == "layernorm") v -= l.norm_outputs;
    if (mod == "mlp") v -= l.mlp_inner;
  }
  return v;
}

// Bytes one micro-batch leaves stored in a chunk of n layers with full recompute, and the
// working set of the re-materialisation (counted once).
void full_recompute_chunk(const LayerActivation& l, RecomputeMethod method, int N, int n, double& stored,
                          double& working) {
  if (n == 0) {
    stored = 0;
    return;
  }
  if (method == RecomputeMethod::block) {
    const int r = std::min(N, n);
    stored = r * l.input + (n - r) * l.full;
    working = std::max(working, r > 0 ? l.full : 0.0);
  } else {
    const int groups = (n + N - 1) / N;
    stored = groups * l.input;
    working = std::max(working, std::min(N, n) * l.full);
  }
}

}  // namespace

StageMemory estimate_stage_memory(const Config& c, const StagePlan& stage, int64_t params) {
  StageMemory mem;
  const bool mixed = c.train.precision != Precision::fp32;
  const double P = static_cast<double>(params);
  mem.weights = P * (mixed ? 2 : 4);
  const bool fp32_grads = !mixed || c.parallel.accumulate_allreduce_grads_in_fp32;
  mem.gradients = P * (fp32_grads ? 4 : 2);
  const double opt_bytes = c.train.optimizer == OptimizerKind::adam ? (mixed ? 12 : 8) : (mixed ? 8 : 4);
  mem.optimizer = P * opt_bytes;
  mem.optimizer_distributed = std::ceil(P / c.parallel.data_parallel_size) * opt_bytes;

  // Micro-batches alive at the peak on this stage.
  const int pp = c.parallel.pipeline_model_parallel_size, V = c.parallel.virtual_pipeline_size;
  const int M = c.train.num_microbatches, r = stage.pp_rank;
  int inflight = 1;            // (chunk-)micro-batches
  double extras_per_chunk = 1; // micro-batches whose embedding/output extras are alive
  if (pp > 1 && V == 1) {
    inflight = std::min(pp - r, M);
    extras_per_chunk = inflight;
  } else if (pp > 1) {
    const int T = M * V;
    const int N = c.parallel.microbatch_group_size_per_virtual_pipeline_stage.value_or(pp);
    const int W = std::min(T, (pp - r - 1) * 2 + (V - 1) * N);
    inflight = std::min(T, W + 1);
    extras_per_chunk = std::ceil(static_cast<double>(inflight) / V);
  }
  mem.inflight_microbatches = inflight;

  const LayerActivation l = layer_activation(c);
  const ModelConfig& m = c.model;
  const double s = m.seq_length, b = c.train.micro_batch_size, h = m.hidden_size;
  const double t = c.parallel.tensor_model_parallel_size;
  const double e = mixed ? 2 : 4;
  const double seq_div = c.parallel.sequence_parallel ? t : 1;
  double extras = 0;
  for (const ModelChunk& ch : stage.chunks) {
    if (ch.has_embedding) extras += 4 * s * b + (m.hidden_dropout > 0 ? s * b * h / seq_div : 0);
    if (ch.has_output) extras += 2 * e * s * b * h / seq_div + 4 * s * b * m.padded_vocab_size / t;
  }
  extras *= extras_per_chunk;

  // Layers per (chunk-)micro-batch: a whole stage without interleaving, one chunk with it.
  const double layers_per_unit = static_cast<double>(stage.num_layers) / V;
  mem.activations_none = inflight * layers_per_unit * l.full + extras;
  mem.activations_selective = inflight * layers_per_unit * selective_layer(c, l) + extras;

  const bool configured_full = c.train.recompute_granularity == RecomputeGranularity::full;
  const RecomputeMethod method = configured_full ? c.train.recompute_method : RecomputeMethod::uniform;
  const int N = configured_full ? c.train.recompute_num_layers.value_or(1) : 1;
  double stored_per_unit = 0, working = 0;
  for (const ModelChunk& ch : stage.chunks) {
    double stored = 0;
    full_recompute_chunk(l, method, N, ch.num_layers, stored, working);
    stored_per_unit += stored;
  }
  stored_per_unit /= V;  // average chunk
  mem.activations_full = inflight * stored_per_unit + working + extras;

  switch (c.train.recompute_granularity) {
    case RecomputeGranularity::none: mem.activations = mem.activations_none; break;
    case RecomputeGranularity::selective: mem.activations = mem.activations_selective; break;
    case RecomputeGranularity::full: mem.activations = mem.activations_full; break;
  }
  mem.total = mem.weights + mem.gradients +
              (c.parallel.use_distributed_optimizer ? mem.optimizer_distributed : mem.optimizer) + mem.activations;
  return mem;
}

}  // namespace mt
