// megatrain export-megatron: a megatrain checkpoint as a Megatron-LM checkpoint (app/export_megatron.h),
// in the torch_dist format (ExportPlan::write_torch_dist) or the torch format. The files follow what
// Megatron-LM's save_checkpoint writes for the local transformer implementation with PyTorch's
// AdamW (megatron/training/checkpointing.py, megatron/core/optimizer/); the torch format: per
// tensor x pipeline rank one torch.save'd dict
//   args                      argparse.Namespace (app/megatron_args.h)
//   checkpoint_version        3.0
//   iteration                 N
//   model | model0, model1..  each model chunk's state dict: stage-local layer numbers, the local
//                             spec's names, this tensor rank's shards, "<linear>._extra_state": None
//   optimizer                 the non-distributed optimizer: torch's Adam state dict {state: {index:
//                             {step, exp_avg, exp_avg_sq}}, param_groups} (bf16/fp16 models: inside
//                             Megatron's wrapper with fp32_from_fp16_params and the loss scaler's
//                             state); the distributed optimizer: the param groups only (with the step),
//                             its state in distrib_optim.pt beside the file
//   opt_param_scheduler       OptimizerParamScheduler.state_dict (steps in samples)
//   rng_state                 checkpoint/megatron_rng.h
//   num_floating_point_operations_so_far
#include "app/export_megatron.h"

#include <fmt/format.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <optional>
#include <set>

#include "app/checkpoint_args.h"
#include "app/megatron_args.h"
#include "app/subcommand_args.h"
#include "checkpoint/checkpoint_io.h"
#include "checkpoint/dcp_writer.h"
#include "checkpoint/file_io.h"
#include "checkpoint/megatron_flat_layout.h"
#include "checkpoint/megatron_names.h"
#include "checkpoint/megatron_rng.h"
#include "checkpoint/pickle_writer.h"
#include "checkpoint/torch_writer.h"
#include "core/error.h"
#include "core/log.h"
#include "core/shape_text.h"
#include "engine/lr_schedule.h"
#include "engine/model_dims.h"
#include "parallel/pipeline_layout.h"

namespace mt {

namespace {

using nlohmann::json;

const json& null_json() {
  static const json n;
  return n;
}

// A recorded flag's value; null when the checkpoint records none.
const json& recorded(const json& flags, const char* flag) {
  auto it = flags.find(flag);
  return it == flags.end() ? null_json() : *it;
}

template <typename T>
T recorded_or(const json& flags, const char* flag, T fallback) {
  const json& v = recorded(flags, flag);
  return v.is_null() ? fallback : v.get<T>();
}

std::optional<int> recorded_int(const json& flags, const char* flag) {
  const json& v = recorded(flags, flag);
  if (v.is_null()) return std::nullopt;
  return v.get<int>();
}

// A step count (Megatron keeps them as ints) as it would be saved.
PickleRef count_value(const json& v) {
  const double d = v.get<double>();
  if (std::floor(d) == d && std::abs(d) < 9e15) return pickle_int(static_cast<int64_t>(d));
  return pickle_float(d);
}

PickleRef int_or_none(const std::optional<int>& v) { return v ? pickle_int(*v) : pickle_none(); }

// The Megatron run's layout.
struct Layout {
  int tp = 1, pp = 1, vpp = 1, dp = 1, ep = 1;
  std::optional<int> first_stage_layers, last_stage_layers;
  bool account_for_embedding = false, account_for_loss = false;
  bool distributed_optimizer = false;
  // the distributed optimizer's buckets (distrib_optim.pt stores them end to end)
  bool overlap_grad_reduce = false;
  std::optional<int64_t> ddp_bucket_size;
};

Layout target_layout(const MegatronExportOptions& o, const json& flags, const json& derived) {
  Layout saved;
  saved.tp = recorded_or<int>(flags, "--tensor-model-parallel-size", 1);
  saved.pp = recorded_or<int>(flags, "--pipeline-model-parallel-size", 1);
  saved.vpp = derived.is_object() ? derived.value("virtual_pipeline_size", 1) : 1;
  saved.dp = derived.is_object() ? derived.value("data_parallel_size", 1) : 1;
  saved.first_stage_layers = recorded_int(flags, "--decoder-first-pipeline-num-layers");
  saved.last_stage_layers = recorded_int(flags, "--decoder-last-pipeline-num-layers");
  saved.account_for_embedding = recorded_or<bool>(flags, "--account-for-embedding-in-pipeline-split", false);
  saved.account_for_loss = recorded_or<bool>(flags, "--account-for-loss-in-pipeline-split", false);
  saved.distributed_optimizer = recorded_or<bool>(flags, "--use-distributed-optimizer", false);
  saved.overlap_grad_reduce = recorded_or<bool>(flags, "--overlap-grad-reduce", false);
  if (const json& b = recorded(flags, "--ddp-bucket-size"); !b.is_null()) saved.ddp_bucket_size = b.get<int64_t>();
  Layout l = saved;
  l.tp = o.tp.value_or(saved.tp);
  l.pp = o.pp.value_or(saved.pp);
  if (l.pp != saved.pp || o.vpp || o.first_stage_layers || o.last_stage_layers) {
    // another pipeline split: only what is asked for
    l.vpp = o.vpp.value_or(1);
    l.first_stage_layers = o.first_stage_layers;
    l.last_stage_layers = o.last_stage_layers;
    l.account_for_embedding = l.account_for_loss = false;
  }
  l.dp = o.dp.value_or(saved.dp);
  l.ep = o.ep.value_or(recorded_or<int>(flags, "--expert-model-parallel-size", 1));
  l.distributed_optimizer = o.distributed_optimizer.value_or(saved.distributed_optimizer);
  l.overlap_grad_reduce = o.overlap_grad_reduce || saved.overlap_grad_reduce;
  if (o.ddp_bucket_size) l.ddp_bucket_size = o.ddp_bucket_size;
  if (l.tp < 1 || l.pp < 1 || l.vpp < 1 || l.dp < 1 || l.ep < 1)
    fail("export-megatron: the parallel sizes must be >= 1 (TP {}, PP {}, virtual stages {}, DP {}, EP {})", l.tp, l.pp,
         l.vpp, l.dp, l.ep);
  return l;
}

// Megatron pads the vocabulary to a multiple of --make-vocab-size-divisible-by x TP; the exported
// embedding keeps the checkpoint's rows, so the Megatron run must pad to the same number.
int vocab_divisor(const ModelConfig& m, const Layout& l, std::optional<int> asked, const std::string& where) {
  const int div = asked.value_or(m.make_vocab_size_divisible_by);
  auto padded = [&](int64_t d) {
    const int64_t multiple = d * l.tp;
    return (m.vocab_size + multiple - 1) / multiple * multiple;
  };
  if (div >= 1 && padded(div) == m.padded_vocab_size) return div;
  std::string hint;
  for (int64_t d = m.padded_vocab_size / l.tp; d >= 1; --d)
    if (padded(d) == m.padded_vocab_size) {
      hint = fmt::format("; --make-vocab-size-divisible-by {} gives {} rows at TP {} (pass it to export-megatron and "
                         "to Megatron-LM)",
                         d, m.padded_vocab_size, l.tp);
      break;
    }
  if (hint.empty())
    hint = fmt::format("; no --make-vocab-size-divisible-by gives {} rows at TP {}: choose a tensor-parallel size that "
                       "divides {}",
                       m.padded_vocab_size, l.tp, m.padded_vocab_size);
  fail("{}: Megatron-LM pads the vocabulary of {} tokens to a multiple of --make-vocab-size-divisible-by {} x TP {} = "
       "{} rows, but the checkpoint's embedding has {}{}",
       where, m.vocab_size, div, l.tp, padded(div), m.padded_vocab_size, hint);
}

// A parameter as one tensor rank holds it in one model chunk.
struct RankParam {
  std::string source;      // megatrain's name (the tied output copy reads the word embeddings)
  std::string local_name;  // in the chunk's state dict
  std::vector<int64_t> global_shape, local_shape;
  ShardIndex shard;
  bool weight_decay = true;
};

// A decoder or MTP layer's parameter: the layer's prefix in megatrain's names and in a chunk's state
// dict, and the parameter's name within the layer (megatrain's).
struct LayerName {
  std::string source, local, rest;
  int global_layer;  // megatrain's number of the layer (MTP depth j: num_layers + j), which names its expert bias
};

class Exporter {
 public:
  Exporter(CheckpointReader& reader, const ModelConfig& model, const Layout& layout)
      : reader_(reader), model_(model), layout_(layout) {
    where_ = join_path(reader.directory(), "manifest.json");
  }

  // The parameters of chunk `c` on tensor rank `t` (and expert-parallel rank `e`), in Megatron's
  // registration order; a mixture-of-experts layer's router buffer expert_bias after the router's
  // weight (the state dict's order).
  std::vector<RankParam> chunk_params(const Config& cfg, const ModelChunk& c, int t, int e = 0) const {
    std::vector<RankParam> out;
    // A later pipeline stage holding the MTP depths keeps its own copy of the word embeddings
    // (GPTModel builds its embedding on the MTP stage too, registered first; its values are stage
    // 0's, all-reduced over the embedding group).
    if (c.has_output && !c.has_embedding && model_.mtp_num_layers.value_or(0) > 0) {
      RankParam emb;
      emb.source = emb.local_name = "embedding.word_embeddings.weight";
      if (!reader_.has(emb.source)) fail("{} has no '{}', which the model it records has", where_, emb.source);
      emb.global_shape = reader_.info(emb.source).global_shape;
      emb.shard = megatron_tp_shard(MegatronTpSplit::rows, emb.global_shape, layout_.tp, t, emb.source);
      emb.local_shape = megatron_shard_shape(emb.shard, emb.global_shape);
      out.push_back(std::move(emb));
    }
    for (const FlatParam& fp : megatron_chunk_params(cfg, layout_.tp, t, c.first_layer, c.num_layers, c.has_embedding,
                                                     c.has_output, layout_.pp > 1, /*te_spec=*/false)) {
      RankParam p;
      p.source = fp.name.empty() ? "embedding.word_embeddings.weight" : fp.name;
      p.local_name = fp.name.empty() ? "output_layer.weight" : fp.name;
      // A layer's parameter: its layer's prefixes in megatrain's names and in the chunk's state dict
      // (the chunk's layers numbered from 0; an MTP depth's inner layer is its mtp_model_layer), and
      // its name within the layer.
      std::optional<LayerName> layer;
      if (const auto d = megatron_split_layer_name(fp.name))
        layer = LayerName{fmt::format("decoder.layers.{}.", d->first),
                          fmt::format("decoder.layers.{}.", d->first - c.first_layer), d->second, d->first};
      else if (const auto m = megatron_split_mtp_layer_name(fp.name))
        layer = LayerName{fmt::format("mtp.layers.{}.transformer_layer.", m->first),
                          fmt::format("mtp.layers.{}.mtp_model_layer.", m->first), m->second,
                          model_.num_layers + m->first};
      if (layer) p.local_name = layer->local + megatron_local_layer_name(layer->rest);
      if (!reader_.has(p.source)) fail("{} has no '{}', which the model it records has", where_, p.source);
      p.global_shape = reader_.info(p.source).global_shape;
      // (each local expert's fc1 then fc2, as SequentialMLP registers them: all at the first fc1's
      // place)
      if (fp.expert >= 0) {
        if (fp.expert == 0 && layer->rest == "mlp.experts.linear_fc1.weight") add_local_experts(out, p, *layer, t, e);
        continue;
      }
      p.shard = megatron_tp_shard(megatron_tp_split(p.source, model_.swiglu), p.global_shape, layout_.tp, t, p.source);
      p.local_shape = megatron_shard_shape(p.shard, p.global_shape);
      if (p.local_shape != fp.local_shape)
        fail("export-megatron: '{}' on tensor rank {} is {} by Megatron's split but {} in megatrain's layout", p.source,
             t, shape_text(p.local_shape), shape_text(fp.local_shape));
      p.weight_decay = fp.weight_decay;
      const bool router = layer && layer->rest == "mlp.router.weight";
      out.push_back(std::move(p));
      if (router) {
        // (a buffer, which megatrain's checkpoints name by the layer's number, MTP depths too)
        const std::string bias = expert_bias_name(layer->global_layer);
        if (reader_.has(bias)) {
          RankParam b;
          b.source = bias;
          b.local_name = layer->local + "mlp.router.expert_bias";
          b.global_shape = {model_.moe.num_experts};
          b.local_shape = b.global_shape;
          b.shard = ShardIndex::whole(model_.moe.num_experts, 1);
          b.weight_decay = false;
          out.push_back(std::move(b));
        }
      }
    }
    return out;
  }

  // Expert-parallel rank e's local experts i (global expert e x E / EP + i) of a layer's stacked
  // experts (megatrain's [E x rows, cols]; fc1 given as `fc1`), each its SequentialMLP's two linears
  // in turn: fc1 rows [gate; up] split over TP as the dense fc1 is, fc2 columns over TP.
  void add_local_experts(std::vector<RankParam>& out, const RankParam& fc1, const LayerName& layer, int t,
                         int e) const {
    const int E = model_.moe.num_experts, El = E / layout_.ep;
    // (with linear biases each linear's bias after its weight, as the local MLP registers them)
    auto stacked = [&](const char* rest, bool weight_decay) {
      RankParam p = fc1;
      p.source = layer.source + rest;
      if (!reader_.has(p.source)) fail("{} has no '{}', which the model it records has", where_, p.source);
      p.global_shape = reader_.info(p.source).global_shape;
      p.weight_decay = weight_decay;
      return p;
    };
    const bool biases = reader_.has(layer.source + "mlp.experts.linear_fc1.bias");
    std::vector<std::pair<RankParam, std::string>> parts = {{fc1, "linear_fc1.weight"}};
    if (biases) parts.push_back({stacked("mlp.experts.linear_fc1.bias", false), "linear_fc1.bias"});
    parts.push_back({stacked("mlp.experts.linear_fc2.weight", fc1.weight_decay), "linear_fc2.weight"});
    if (biases) parts.push_back({stacked("mlp.experts.linear_fc2.bias", false), "linear_fc2.bias"});
    for (int i = 0; i < El; ++i) {
      const int g = e * El + i;
      for (const auto& [part, name] : parts) {
        RankParam a = part;
        a.local_name = fmt::format("{}mlp.experts.local_experts.{}.{}", layer.local, i, name);
        a.shard = megatron_expert_shard(name.starts_with("linear_fc1"), a.global_shape, E, g, model_.swiglu,
                                        layout_.tp, t);
        a.local_shape = megatron_shard_shape(a.shard, a.global_shape);
        out.push_back(std::move(a));
      }
    }
  }

  // A rank's shard of `name` (kind) in `dtype`, read when the file is written.
  PickleRef shard(TorchSaveWriter& w, const RankParam& p, CheckpointKind kind, const std::string& name, DType dtype) {
    CheckpointReader* reader = &reader_;
    return w.tensor(dtype, p.local_shape, [reader, p, kind, name, dtype]() {
      HostArray a = HostArray::zeros(dtype, p.local_shape);
      reader->read(name, kind, ShardSlice::whole(p.shard), Tensor(a.bytes.data(), dtype, Device::cpu, {a.numel()}),
                   p.global_shape);
      return a;
    });
  }

  DType model_dtype(const std::string& name) const { return reader_.info(name).dtype; }

  // The float32 main weights: a separate copy in bf16/fp16 checkpoints, the weights themselves
  // in float32 ones.
  std::pair<CheckpointKind, std::string> main_source(const std::string& name) const {
    if (reader_.has(name, CheckpointKind::main_params)) return {CheckpointKind::main_params, name};
    return {CheckpointKind::model, name};
  }

  const std::string& where() const { return where_; }

 private:
  CheckpointReader& reader_;
  const ModelConfig& model_;
  const Layout& layout_;
  std::string where_;
};

bool has_extra_state_after(const std::vector<RankParam>& params, size_t k) {
  auto module = [](const std::string& n) { return n.substr(0, n.rfind('.')); };
  const std::string m = module(params[k].local_name);
  return megatron_has_extra_state(m) && (k + 1 == params.size() || module(params[k + 1].local_name) != m);
}

// A router's expert bias (a buffer, without optimizer state).
bool is_expert_bias(const std::string& name) { return name.ends_with(".mlp.router.expert_bias"); }

// torch_dist: where a megatrain parameter lies in Megatron-Core's sharded state dict (the local
// spec's keys, as Megatron-LM's own torch_dist checkpoints name them).
struct DistItem {
  std::string key;
  std::optional<int> layer;  // stacked over the decoder's layers: this parameter's index
  int64_t experts = 0;       // routed experts' weights: megatrain's [E x rows, cols] stored as [E, rows, cols]
  std::string module() const {  // the key of the module holding it ("decoder.layers.3.mlp.linear_fc1")
    return key.substr(0, key.rfind('.'));
  }
};

// A layer's parameter name after its prefix, as the local spec's sharded state dict keys it:
// Transformer Engine's fused norm names (megatrain's) where the local spec maps them so (dense
// attention and MLP), its own modules elsewhere (an MoE layer's pre-MLP norm is linear_fc1's fused
// one; MLA layers keep input_layernorm, q_layernorm, kv_layernorm and pre_mlp_layernorm); the
// routed experts under experts.experts.
std::string local_dist_rest(const std::string& rest, bool mla) {
  auto swap = [&](const std::string& from, const std::string& to) -> std::optional<std::string> {
    if (rest.compare(0, from.size(), from) != 0) return std::nullopt;
    return to + rest.substr(from.size());
  };
  if (mla) {
    if (auto r = swap("self_attention.linear_q_up_proj.layer_norm_", "self_attention.q_layernorm.")) return *r;
    if (auto r = swap("self_attention.linear_kv_up_proj.layer_norm_", "self_attention.kv_layernorm.")) return *r;
    if (auto r = swap("mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm.")) return *r;
  } else if (auto r = swap("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_")) {
    return *r;
  }
  if (auto r = swap("mlp.experts.linear_fc", "mlp.experts.experts.linear_fc")) return *r;
  return rest;
}

// `per_layer`: the decoder's layers keyed one by one (Megatron's non-homogeneous layers), else
// stacked along a first dimension of num_layers. MTP depths are always keyed one by one.
DistItem torch_dist_item(const std::string& name, const ModelConfig& m, bool per_layer) {
  DistItem it;
  std::string head, rest;
  std::optional<int> layer;
  if (const auto d = megatron_split_layer_name(name); d && d->first < m.num_layers) {
    layer = d->first;
    head = per_layer ? fmt::format("decoder.layers.{}.", d->first) : std::string("decoder.layers.");
    rest = d->second;
  } else if (d) {  // an MTP depth's expert bias, which megatrain names as layer num_layers + j
    head = fmt::format("mtp.layers.{}.transformer_layer.", d->first - m.num_layers);
    rest = d->second;
  } else if (const auto j = megatron_split_mtp_layer_name(name)) {
    head = fmt::format("mtp.layers.{}.transformer_layer.", j->first);
    rest = j->second;
  } else {
    it.key = name;
    return it;
  }
  it.key = head + local_dist_rest(rest, m.multi_latent_attention);
  if (!per_layer && head == "decoder.layers.") it.layer = layer;
  if (rest.compare(0, 15, "mlp.experts.lin") == 0) it.experts = m.moe.num_experts;
  return it;
}

// The local spec's linear layers, whose extra state (None) the sharded state dict holds beside
// their weights (the output layer's is left out, as GPTModel does).
bool torch_dist_extra_state(const std::string& module) {
  const std::string last = module.substr(module.rfind('.') + 1);
  return module != "output_layer" && (last.compare(0, 7, "linear_") == 0 || last == "eh_proj");
}

// What the writers of both formats read: the checkpoint, the Megatron run's model and layout, and
// what export_megatron worked out from them.
struct ExportPlan {
  CheckpointReader& reader;
  const ModelConfig& model;
  const Layout& layout;
  const Config& cfg;
  const PipelineSplit& split;
  Exporter& ex;
  const RunState& rs;
  const json& flags;
  PickleRef args, scheduler;  // the args namespace; the scheduler's state dict
  // One of Megatron's param groups: with weight decay or not, with Adam's step in it (the
  // distributed optimizer's) or not, of the routed experts' optimizer or not.
  std::function<PickleRef(bool decay, bool with_step, bool experts)> param_group;
  std::function<void(TorchSaveWriter&, PickleValue&)> grad_scaler;  // the loss scaler's state into an optimizer's
  bool with_optimizer = false, bf16 = false, fp16 = false, dp_random_init = false;
  int64_t step = 0, seed = 0;

  // Each writes the iteration directory `tmp_dir` and lists its files in r.files.
  void write_torch_dist(const std::string& tmp_dir, MegatronExportResult& r) const;
  void write_torch_format(const std::string& tmp_dir, MegatronExportResult& r) const;
  void write_fsdp_dtensor(const std::string& tmp_dir, MegatronExportResult& r) const;
};

// One PyTorch Distributed Checkpoint under Megatron-Core's keys (checkpoint/dcp_writer.h):
// every tensor whole (global), a decoder layer's parameters stacked along a first dimension of
// num_layers, one chunk per layer; each linear's extra state (None) per layer; the optimizer
// state by parameter ("optimizer.state.<state>.<key>": the distributed optimizer's fully
// reshardable layout, or the non-distributed optimizer's); the RNG states per pipeline x tensor
// rank; everything else in the common state. A run of any TP x PP x DP layout loads it.
void ExportPlan::write_torch_dist(const std::string& tmp_dir, MegatronExportResult& r) const {
  make_directories(tmp_dir);
  DcpWriter dcp(tmp_dir);
  CheckpointReader* rd = &reader;
  const int64_t layers = model.num_layers;
  // (Megatron-LM keys the layers of MoE models one by one: its non-homogeneous layers, which the
  // content metadata below asks for whatever the Megatron run's --moe-layer-freq says)
  const bool per_layer = model.moe.enabled();
  auto write_tensor = [&](const std::string& prefix, const std::string& param, CheckpointKind kind,
                          const std::string& name, DType dtype) {
    const CheckpointTensorInfo info = reader.info(name, kind);
    const DistItem it = torch_dist_item(param, model, per_layer);
    std::vector<int64_t> global = info.global_shape;
    // the chunks: the whole tensor (one layer's when stacked), or each expert's rows
    struct Chunk {
      std::vector<int64_t> offsets, shape;
      ShardIndex part;  // of megatrain's 2-D view
    };
    std::vector<Chunk> chunks;
    if (it.experts > 0) {  // [E x rows (, cols)]: [E, rows (, cols)], a chunk per expert (biases 1-D per expert)
      const int64_t rows = global.at(0) / it.experts;
      global.front() = rows;
      global.insert(global.begin(), it.experts);
      for (int64_t e = 0; e < it.experts; ++e) {
        Chunk c{std::vector<int64_t>(global.size(), 0), global,
                ShardIndex{info.global_rows, info.global_cols, e * rows, 0, rows, info.global_cols, 1}};
        c.offsets[0] = e;
        c.shape[0] = 1;
        chunks.push_back(std::move(c));
      }
    } else {
      chunks.push_back({std::vector<int64_t>(global.size(), 0), global, ShardIndex::whole(info.global_rows, info.global_cols)});
    }
    if (it.layer) {
      global.insert(global.begin(), layers);
      for (Chunk& c : chunks) {
        c.offsets.insert(c.offsets.begin(), *it.layer);
        c.shape.insert(c.shape.begin(), 1);
      }
    }
    for (const Chunk& c : chunks)
      dcp.tensor_chunk(prefix + it.key, dtype, global, c.offsets, c.shape, [rd, info, name, kind, dtype, c]() {
        HostArray a = HostArray::zeros(dtype, c.shape);
        rd->read(name, kind, ShardSlice::whole(c.part), Tensor(a.bytes.data(), dtype, Device::cpu, {a.numel()}),
                 info.global_shape);
        return a;
      });
  };
  // The model's parameters and buffers (the routers' expert biases) as megatrain saved them, each
  // once (a tied output layer is the word embeddings' key); no FP8 scaling state.
  std::vector<std::string> params;
  for (const std::string& name : reader.names())
    if (name.find(".fp8_meta.") == std::string::npos) params.push_back(name);
  // The linears' extra states: per stacked layer "shard_<l>_<L>", per expert "shard_<e>_<E>", else
  // "shard_0_1".
  std::set<std::string> extra_states;
  for (const std::string& param : params) {
    write_tensor("", param, CheckpointKind::model, param, ex.model_dtype(param));
    const DistItem it = torch_dist_item(param, model, per_layer);
    if (!it.key.ends_with(".weight") || !torch_dist_extra_state(it.module())) continue;
    const std::string base = it.module() + "._extra_state/";
    if (it.layer) extra_states.insert(base + fmt::format("shard_{}_{}", *it.layer, layers));
    else if (it.experts > 0)
      for (int64_t e = 0; e < it.experts; ++e) extra_states.insert(base + fmt::format("shard_{}_{}", e, it.experts));
    else extra_states.insert(base + "shard_0_1");
  }
  for (const std::string& key : extra_states) dcp.object(key, [](TorchSaveWriter&) { return pickle_none(); });
  PickleRef content = pickle_dict();
  if (with_optimizer) {
    // Adam's moments by parameter; the float32 main weights as the distributed optimizer's
    // "param" (float32 models too) or the mixed-precision optimizer's "fp32_param"
    const char* main_state = layout.distributed_optimizer ? "param" : bf16 || fp16 ? "fp32_param" : nullptr;
    for (const std::string& param : params) {
      if (is_expert_bias(param)) continue;
      if (main_state) {
        const auto [main_kind, main_name] = ex.main_source(param);
        write_tensor(fmt::format("optimizer.state.{}.", main_state), param, main_kind, main_name, DType::f32);
      }
      for (const char* state : {"exp_avg", "exp_avg_sq"})
        write_tensor(fmt::format("optimizer.state.{}.", state), param, CheckpointKind::optimizer,
                     param + "." + state, DType::f32);
    }
    for (int p = 0; p < layout.pp; ++p)
      for (int t = 0; t < layout.tp; ++t)
        dcp.object(fmt::format("rng_state/shard_{}.{}_{}.{}", p, t, layout.pp, layout.tp), [&](TorchSaveWriter& w) {
          PickleRef rng = pickle_list();
          for (int d = 0; d < (dp_random_init ? layout.dp : 1); ++d)
            rng->items.push_back(megatron_initial_rng_state(w, seed, t, p, d, dp_random_init));
          return rng;
        });
    if (layout.distributed_optimizer) {
      pickle_set(*content, "distrib_optim_sharding_type", pickle_str("fully_reshardable"));
      pickle_set(*content, "distrib_optim_fully_reshardable_mem_efficient", pickle_bool(false));
    }
  }
  if (per_layer) pickle_set(*content, "non_homogeneous_layers", pickle_bool(true));
  pickle_set(*content, "singleton_local_shards", pickle_bool(false));
  pickle_set(*content, "chained_optim_avoid_prefix", pickle_bool(true));
  dcp.object("common_state/shard_0_1", [&](TorchSaveWriter& w) {
    PickleRef root = pickle_dict();
    pickle_set(*root, "args", args);
    pickle_set(*root, "checkpoint_version", pickle_float(3.0));
    pickle_set(*root, "iteration", pickle_int(r.iteration));
    if (with_optimizer) {
      // the distributed optimizer: its param groups (with the step) and the sharding type; the
      // others: torch's Adam state dict (the step as state.common_step, the param groups without
      // their params), inside the mixed-precision wrapper with the loss scaler for bf16/fp16
      // (with expert parallelism Megatron-LM chains a second optimizer for the routed experts,
      // whose one param group (weight decay) is is_expert_parallel: one state each, keyed 0 and 1)
      auto optimizer_state = [&](bool experts) {
        std::vector<PickleRef> groups;
        for (const bool decay : experts ? std::vector<bool>{true} : std::vector<bool>{true, false})
          groups.push_back(param_group(decay, layout.distributed_optimizer, experts));
        PickleRef opt = pickle_dict(), inner = pickle_dict();
        if (layout.distributed_optimizer) {
          pickle_set(*inner, "param_groups", pickle_list(groups));
          pickle_set(*opt, "optimizer", inner);
          grad_scaler(w, *opt);
          pickle_set(*opt, "param_state_sharding_type", pickle_str("fully_reshardable"));
          return opt;
        }
        PickleRef state = pickle_dict();
        HostArray one = HostArray::zeros(DType::f32, {});
        one.ptr<float>()[0] = static_cast<float>(step);
        pickle_set(*state, "common_step", w.tensor(std::move(one)));
        pickle_set(*inner, "state", state);
        pickle_set(*inner, "param_groups", pickle_list(groups));
        if (!bf16 && !fp16) return inner;
        pickle_set(*opt, "optimizer", inner);
        grad_scaler(w, *opt);
        return opt;
      };
      PickleRef opt = optimizer_state(false);
      if (model.moe.enabled() && layout.ep > 1) {
        PickleRef chained = pickle_dict();
        pickle_set(*chained, pickle_int(0), opt);
        pickle_set(*chained, pickle_int(1), optimizer_state(true));
        opt = chained;
      }
      pickle_set(*root, "optimizer", opt);
      pickle_set(*root, "opt_param_scheduler", scheduler);
    }
    pickle_set(*root, "num_floating_point_operations_so_far",
               pickle_float(r.release ? 0.0 : rs.num_floating_point_operations_so_far));
    pickle_set(*root, "content_metadata", content);
    return root;
  });
  dcp.finish(true);
  write_file_atomically(join_path(tmp_dir, "metadata.json"),
                        R"({"sharded_backend": "torch_dist", "sharded_backend_version": 1})");
  r.files = {"__0_0.distcp", ".metadata", "metadata.json"};
}

// Megatron-FSDP's fsdp_dtensor format (checkpoint/megatron_checkpoint.h, open_fsdp_dtensor): the
// wrapped model's state dict with the local spec's names, every layer its own key, each routed
// expert its own SequentialMLP linears, SwiGLU's linear_fc1 as its halves weight_w (the gate's
// rows) and weight_v; the float32 main weights as the model's tensors; Adam's moments and step,
// and each parameter's param group (param_to_group_meta), under the optimizer's parameter names;
// the RNG states, args, iteration and the scheduler's fields as items of their own. Every tensor
// is global: a Megatron-FSDP run of any DP (x TP) size and sharding strategy loads it.
void ExportPlan::write_fsdp_dtensor(const std::string& tmp_dir, MegatronExportResult& r) const {
  make_directories(tmp_dir);
  DcpWriter dcp(tmp_dir);
  CheckpointReader* rd = &reader;
  // The optimizer names parameters by the wrappers' path: the FSDP adapter and Megatron-FSDP,
  // with Float16Module between them and the model for bf16 and fp16.
  const std::string wrappers = bf16 || fp16 ? "module.module.module." : "module.module.";
  // A stored tensor: rows [first, first + rows) of a megatrain tensor's 2-D view, under `path`.
  struct Piece {
    std::string path, group_path;  // the group's: the parameter's path without a SwiGLU half's suffix
    int64_t first = 0, rows = 0;
  };
  auto pieces = [&](const std::string& name, const CheckpointTensorInfo& info) {
    std::string path = name;
    const auto layer = megatron_split_layer_name(name);
    if (layer) path = fmt::format("decoder.layers.{}.{}", layer->first, megatron_local_layer_name(layer->second));
    std::vector<Piece> whole;
    static const std::string experts = "mlp.experts.linear_fc";
    if (layer && layer->second.starts_with(experts)) {  // [E x rows (, cols)]: each expert's rows
      const int64_t E = model.moe.num_experts, rows = info.global_rows / E;
      for (int64_t e = 0; e < E; ++e)
        whole.push_back({fmt::format("decoder.layers.{}.mlp.experts.local_experts.{}.{}", layer->first, e,
                                     layer->second.substr(std::string("mlp.experts.").size())),
                         "", e * rows, rows});
    } else {
      whole.push_back({path, "", 0, info.global_rows});
    }
    const bool glu = model.swiglu && layer && (layer->second.ends_with("linear_fc1.weight") ||
                                               layer->second.ends_with("linear_fc1.bias"));
    std::vector<Piece> out;
    for (Piece& w : whole) {
      w.group_path = w.path;
      if (!glu) {
        out.push_back(w);
        continue;
      }
      const int64_t half = w.rows / 2;
      out.push_back({w.path + "_w", w.path, w.first, half});
      out.push_back({w.path + "_v", w.path, w.first + half, half});
    }
    return out;
  };
  auto write = [&](const std::string& key, const std::string& name, CheckpointKind kind, const CheckpointTensorInfo& info,
                   const Piece& piece) {
    const ShardIndex part{info.global_rows, info.global_cols, piece.first, 0, piece.rows, info.global_cols, 1};
    std::vector<int64_t> shape = {piece.rows, info.global_cols};
    if (info.global_shape.size() == 1) shape = {piece.rows};
    dcp.tensor_chunk(key, DType::f32, shape, std::vector<int64_t>(shape.size(), 0), shape,
                     [rd, info, name, kind, part, shape]() {
                       HostArray a = HostArray::zeros(DType::f32, shape);
                       rd->read(name, kind, ShardSlice::whole(part), Tensor(a.bytes.data(), DType::f32, Device::cpu, {a.numel()}),
                                info.global_shape);
                       return a;
                     });
  };
  for (const std::string& name : reader.names()) {
    if (name.find(".fp8_meta.") != std::string::npos) continue;
    const auto [main_kind, main_name] = ex.main_source(name);
    const CheckpointTensorInfo info = reader.info(main_name, main_kind);
    const std::vector<Piece> ps = pieces(name, info);
    for (const Piece& piece : ps) write("model.module." + piece.path, main_name, main_kind, info, piece);
    if (!with_optimizer || is_expert_bias(name)) continue;  // (the router's buffer has no Adam state)
    const bool decay = info.global_shape.size() > 1 && !name.ends_with(".bias");
    const bool expert = name.find(".mlp.experts.") != std::string::npos && layout.ep > 1;
    for (const Piece& piece : ps) {
      const std::string base = "optimizer.state." + wrappers + piece.path;
      for (const char* state : {"exp_avg", "exp_avg_sq"})
        write(base + "." + state, name + "." + state, CheckpointKind::optimizer,
              reader.info(name + "." + state, CheckpointKind::optimizer), piece);
      dcp.tensor_chunk(base + ".step", DType::f32, {}, {}, {}, [this]() {
        HostArray a = HostArray::zeros(DType::f32, {});
        a.ptr<float>()[0] = static_cast<float>(step);
        return a;
      });
    }
    std::set<std::string> groups;
    for (const Piece& piece : ps) {
      if (!groups.insert(piece.group_path).second) continue;
      const PickleRef g = param_group(decay, false, expert);
      for (const auto& [k, v] : g->entries)
        dcp.plain_object("optimizer.param_to_group_meta." + wrappers + piece.group_path + "." + k->text,
                         [v](TorchSaveWriter&) { return v; });
    }
  }
  // The RNG states Megatron-LM seeds from --seed, keyed "rng_state.(<pipeline rank>, <tensor rank>).<i>"
  // (i: the data-parallel rank with --data-parallel-random-init, else 0), each state its own item.
  if (with_optimizer)
    for (int t = 0; t < layout.tp; ++t)
      for (int d = 0; d < (dp_random_init ? layout.dp : 1); ++d) {
        MegatronRngState rng = megatron_initial_rng(seed, t, 0, d, dp_random_init);
        const std::string base = fmt::format("rng_state.(0, {}).{}.", t, d);
        dcp.plain_object(base + "random_rng_state", [&](TorchSaveWriter&) { return rng.random_rng_state; });
        dcp.plain_object(base + "np_rng_state", [&](TorchSaveWriter&) { return rng.np_rng_state; });
        auto tensor = [&](const std::string& key, HostArray& a) {
          dcp.tensor_chunk(key, a.dtype, a.shape, std::vector<int64_t>(a.shape.size(), 0), a.shape,
                           [&a]() { return std::move(a); });
        };
        tensor(base + "torch_rng_state", rng.torch_rng_state);
        tensor(base + "cuda_rng_state", rng.cuda_rng_state);
        for (auto& [name, a] : rng.trackers) tensor(base + "rng_tracker_states." + name, a);
      }
  dcp.plain_object("args", [&](TorchSaveWriter&) { return args; });
  dcp.plain_object("checkpoint_version", [](TorchSaveWriter&) { return pickle_float(3.0); });
  dcp.plain_object("iteration", [&](TorchSaveWriter&) { return pickle_int(r.iteration); });
  if (with_optimizer)
    for (const auto& [k, v] : scheduler->entries)
      dcp.plain_object("opt_param_scheduler." + k->text, [v](TorchSaveWriter&) { return v; });
  dcp.plain_object("num_floating_point_operations_so_far", [&](TorchSaveWriter&) {
    return pickle_float(r.release ? 0.0 : rs.num_floating_point_operations_so_far);
  });
  dcp.finish(true);
  r.files = {"__0_0.distcp", ".metadata"};
}

// The torch format: per tensor x pipeline (x expert-parallel) rank one model_optim_rng.pt, and
// distrib_optim.pt beside it with the distributed optimizer (the file comment above).
void ExportPlan::write_torch_format(const std::string& tmp_dir, MegatronExportResult& r) const {
  for (int p = 0; p < layout.pp; ++p) {
    const std::vector<ModelChunk> chunks = stage_chunks(split, p);
    for (int rank = 0; rank < layout.tp * layout.ep; ++rank) {
      const int t = rank % layout.tp, e = rank / layout.tp;  // (expert-parallel ranks last, as Megatron's names)
      std::string rank_dir =
          layout.pp > 1 ? fmt::format("mp_rank_{:02d}_{:03d}", t, p) : fmt::format("mp_rank_{:02d}", t);
      if (layout.ep > 1) rank_dir += fmt::format("_{:03d}", e);
      make_directories(join_path(tmp_dir, rank_dir));
      TorchSaveWriter w;
      PickleRef root = pickle_dict();
      pickle_set(*root, "args", args);
      pickle_set(*root, "checkpoint_version", pickle_float(3.0));
      pickle_set(*root, "iteration", pickle_int(r.iteration));
      std::vector<std::vector<RankParam>> params;  // by chunk
      for (size_t v = 0; v < chunks.size(); ++v) {
        params.push_back(ex.chunk_params(cfg, chunks[v], t, e));
        const std::vector<RankParam>& ps = params.back();
        PickleRef sd = pickle_ordered_dict();
        for (size_t k = 0; k < ps.size(); ++k) {
          pickle_set(*sd, ps[k].local_name,
                     ex.shard(w, ps[k], CheckpointKind::model, ps[k].source, ex.model_dtype(ps[k].source)));
          if (has_extra_state_after(ps, k))
            pickle_set(*sd, ps[k].local_name.substr(0, ps[k].local_name.rfind('.')) + "._extra_state", pickle_none());
        }
        // the output layer of a model whose embeddings it shares on the same stage has no weight
        if (chunks[v].has_output && !model.untie_embeddings_and_output_weights && layout.pp == 1)
          pickle_set(*sd, "output_layer._extra_state", pickle_none());
        pickle_set(*root, chunks.size() > 1 ? fmt::format("model{}", v) : std::string("model"), sd);
      }
      if (with_optimizer) {
        PickleRef opt = pickle_dict();
        if (!layout.distributed_optimizer) {
          // torch's Adam state, indexed through the groups: those with weight decay, then those
          // without, each in registration order over the rank's chunks
          PickleRef adam = pickle_dict();
          PickleRef state = pickle_dict();
          PickleRef groups = pickle_list();
          PickleRef mains = pickle_list();
          int64_t index = 0;
          for (const bool decay : {true, false}) {
            PickleRef g = param_group(decay, true, false);
            PickleRef indices = pickle_list();
            PickleRef group_mains = pickle_list();
            for (const auto& chunk : params)
              for (const RankParam& rp : chunk) {
                if (rp.weight_decay != decay) continue;
                PickleRef s = pickle_dict();
                HostArray one = HostArray::zeros(DType::f32, {});
                one.ptr<float>()[0] = static_cast<float>(step);
                pickle_set(*s, "step", w.tensor(std::move(one)));
                pickle_set(*s, "exp_avg", ex.shard(w, rp, CheckpointKind::optimizer, rp.source + ".exp_avg", DType::f32));
                pickle_set(*s, "exp_avg_sq",
                           ex.shard(w, rp, CheckpointKind::optimizer, rp.source + ".exp_avg_sq", DType::f32));
                pickle_set(*state, pickle_int(index), s);
                indices->items.push_back(pickle_int(index++));
                if (bf16 || fp16)
                  group_mains->items.push_back(ex.shard(w, rp, CheckpointKind::main_params, rp.source, DType::f32));
              }
            pickle_set(*g, "params", indices);
            groups->items.push_back(g);
            mains->items.push_back(group_mains);
          }
          pickle_set(*adam, "state", state);
          pickle_set(*adam, "param_groups", groups);
          if (bf16 || fp16) {
            pickle_set(*opt, "optimizer", adam);
            grad_scaler(w, *opt);
            pickle_set(*opt, "fp32_from_fp16_params", mains);
          } else {
            opt = adam;  // Megatron's FP32Optimizer saves torch's state dict as it is
          }
        } else {
          PickleRef inner = pickle_dict();
          pickle_set(*inner, "param_groups", pickle_list({param_group(true, true, false), param_group(false, true, false)}));
          pickle_set(*opt, "optimizer", inner);
          grad_scaler(w, *opt);
          // distrib_optim.pt: per chunk its buckets end to end, each parameter's TP shard where
          // Megatron's DistributedDataParallel puts it
          TorchSaveWriter dw;
          PickleRef buffers = pickle_dict();
          pickle_set(*buffers, "buckets_coalesced", pickle_bool(true));
          for (size_t v = 0; v < chunks.size(); ++v) {
            const ModelChunk& c = chunks[v];
            const std::vector<FlatParam> flat = megatron_chunk_params(cfg, layout.tp, t, c.first_layer, c.num_layers,
                                                                      c.has_embedding, c.has_output, layout.pp > 1, false);
            const std::string what = fmt::format("tensor rank {}, pipeline rank {}, chunk {}", t, p, v);
            const std::vector<int64_t> sizes =
                megatron_flat_bucket_sizes(flat, saved_bucket_size(*args, p, static_cast<int>(v)));
            const std::vector<FlatSlot> slots = megatron_flat_slots(flat, sizes, what);
            std::vector<int64_t> starts(sizes.size(), 0);
            for (size_t b = 1; b < sizes.size(); ++b) starts[b] = starts[b - 1] + sizes[b - 1];
            const int64_t total = sizes.empty() ? 0 : starts.back() + sizes.back();
            struct Placed {
              RankParam param;
              int64_t offset;
            };
            std::vector<Placed> placed;
            for (size_t k = 0; k < flat.size(); ++k)
              placed.push_back({params[v][k], starts[static_cast<size_t>(slots[k].bucket)] + slots[k].offset});
            PickleRef states = pickle_dict();
            CheckpointReader* rd = &reader;
            for (const char* state : {"param", "exp_avg", "exp_avg_sq"}) {
              const std::string st = state;
              std::vector<std::pair<CheckpointKind, std::string>> sources;
              for (const Placed& pl : placed)
                sources.push_back(st == "param" ? ex.main_source(pl.param.source)
                                                : std::make_pair(CheckpointKind::optimizer, pl.param.source + "." + st));
              pickle_set(*states, st, dw.tensor(DType::f32, {total}, [rd, placed, sources, total]() {
                HostArray buf = HostArray::zeros(DType::f32, {total});
                for (size_t k = 0; k < placed.size(); ++k) {
                  const RankParam& rp = placed[k].param;
                  rd->read(sources[k].second, sources[k].first, ShardSlice::whole(rp.shard),
                           Tensor(buf.ptr<float>() + placed[k].offset, DType::f32, Device::cpu, {rp.shard.local_numel()}),
                           rp.global_shape);
                }
                return buf;
              }));
            }
            pickle_set(*states, "numel_unpadded", pickle_int(total));
            // keyed by (parameter dtype, gradient dtype), as Megatron's grad buffers are
            const DType param_dtype = bf16 ? DType::bf16 : fp16 ? DType::f16 : DType::f32;
            const DType grad_dtype = recorded_or<bool>(flags, "--grad-reduce-in-bf16", false) ? DType::bf16 : DType::f32;
            PickleRef by_dtype = pickle_dict();
            pickle_set(*by_dtype,
                       pickle_tuple({pickle_global(torch_dtype_name(param_dtype)),
                                     pickle_global(torch_dtype_name(grad_dtype))}),
                       states);
            pickle_set(*buffers, pickle_int(static_cast<int64_t>(v)), by_dtype);
          }
          const std::string rel = join_path(rank_dir, "distrib_optim.pt");
          dw.write(join_path(tmp_dir, rel), *buffers);
          r.files.push_back(rel);
        }
        pickle_set(*root, "optimizer", opt);
        pickle_set(*root, "opt_param_scheduler", scheduler);
        PickleRef rng = pickle_list();
        for (int d = 0; d < (dp_random_init ? layout.dp : 1); ++d)
          rng->items.push_back(megatron_initial_rng_state(w, seed, t, p, d, dp_random_init));
        pickle_set(*root, "rng_state", rng);
      }
      pickle_set(*root, "num_floating_point_operations_so_far",
                 pickle_float(r.release ? 0.0 : rs.num_floating_point_operations_so_far));
      const std::string rel = join_path(rank_dir, "model_optim_rng.pt");
      w.write(join_path(tmp_dir, rel), *root);
      r.files.push_back(rel);
    }
  }
}
}  // namespace

MegatronExportResult export_megatron(const MegatronExportOptions& o) {
  if (o.format != "torch" && o.format != "torch_dist" && o.format != "fsdp_dtensor")
    throw Unsupported(
        fmt::format("export-megatron writes --ckpt-format torch_dist, torch or fsdp_dtensor (got '{}')", o.format));
  const bool torch_dist = o.format == "torch_dist";
  const bool fsdp = o.format == "fsdp_dtensor";
  const std::optional<CheckpointLocation> loc = locate_checkpoint(o.load, o.ckpt_step);
  if (!loc)
    fail("{} has no latest_checkpointed_iteration.txt: pass --ckpt-step N or the directory megatrain's --save wrote",
         o.load);
  CheckpointReader reader = CheckpointReader::open_directory(loc->directory);
  const std::string where = join_path(reader.directory(), "manifest.json");
  const RunState& rs = reader.run_state();
  if (!rs.config.contains("model")) fail("{} records no model configuration: cannot tell which model it is", where);
  const ModelConfig model = model_config_from_json(rs.config.at("model"), where);
  if (model.use_mup)
    throw Unsupported(fmt::format("export-megatron: {} holds a --use-mup model; megatrain does not export MuP models "
                                  "(their optimizer's parameter groups) to Megatron-LM yet", reader.directory()));
  if (model.gated_delta_net)
    throw Unsupported(fmt::format("export-megatron: {} holds Gated DeltaNet layers (--experimental-attention-variant "
                                  "gated_delta_net); megatrain does not export them to Megatron-LM yet",
                                  reader.directory()));
  const json flags = rs.config.value("flags", json::object());
  const json derived = rs.config.value("derived", json::object());
  Layout layout = target_layout(o, flags, derived);
  const int divisor = vocab_divisor(model, layout, o.make_vocab_size_divisible_by, where);

  // The Megatron run's model and layout, checked as megatrain checks its own (divisibility, splits).
  Config cfg;
  cfg.model = model;
  cfg.train.micro_batch_size = recorded_or<int>(flags, "--micro-batch-size", 1);
  cfg.parallel.tensor_model_parallel_size = layout.tp;
  // (Megatron-LM runs MoE under TP with sequence parallelism only; dense models load either way.)
  const bool sequence_parallel = recorded_or<bool>(flags, "--sequence-parallel", false) || (model.moe.enabled() && layout.tp > 1);
  cfg.parallel.sequence_parallel = sequence_parallel && layout.tp > 1;
  cfg.parallel.pipeline_model_parallel_size = layout.pp;
  cfg.parallel.virtual_pipeline_size = layout.vpp;
  if (layout.vpp > 1) cfg.parallel.num_virtual_stages_per_pipeline_rank = layout.vpp;
  cfg.parallel.decoder_first_pipeline_num_layers = layout.first_stage_layers;
  cfg.parallel.decoder_last_pipeline_num_layers = layout.last_stage_layers;
  cfg.parallel.account_for_embedding_in_pipeline_split = layout.account_for_embedding;
  cfg.parallel.account_for_loss_in_pipeline_split = layout.account_for_loss;
  const PipelineSplit split = PipelineSplit::from_config(cfg);
  pipeline_chunks(split);  // throws naming the flags for a split Megatron refuses
  for (int t = 0; t < layout.tp; ++t) ModelDims::from_config(cfg, RankPosition::split(cfg, layout.tp, t));
  if (model.moe.enabled() && model.add_bias_linear && layout.tp > 1)
    throw Unsupported(fmt::format("export-megatron: {} holds MoE layers with linear biases, whose experts Megatron-LM "
                                  "keeps at expert tensor-parallel size 1: export with --tensor-model-parallel-size 1 "
                                  "(a Megatron-LM run of any TP loads the torch_dist checkpoint)", where));
  if (model.moe.enabled()) {
    // (The experts are written split over TP as the dense MLP, whatever the megatrain run's
    // --expert-tensor-parallel-size: the args say so; the expert-parallel ranks are data-parallel
    // ranks of the dense layers.)
    if (model.moe.num_experts % layout.ep != 0)
      fail("export-megatron: --expert-model-parallel-size {} does not divide the {} experts", layout.ep,
           model.moe.num_experts);
    if (layout.dp % layout.ep != 0)
      fail("export-megatron: --expert-model-parallel-size {} must divide the data-parallel size {} (the experts' "
           "ranks are data-parallel ranks of the dense layers at expert tensor parallel = TP; pass "
           "--data-parallel-size)",
           layout.ep, layout.dp);
  } else if (layout.ep > 1) {
    fail("export-megatron: --expert-model-parallel-size {} for a model without experts", layout.ep);
  }
  const int mtp = model.mtp_num_layers.value_or(0);
  if (fsdp) {
    // (how a Megatron-FSDP run under pipeline parallelism keys its stages' layers, and the layer
    // names of MTP depths and MLA's norms, are not checked against Megatron-FSDP checkpoints yet)
    if (layout.pp > 1 || layout.vpp > 1)
      fail("export-megatron: megatrain writes --ckpt-format fsdp_dtensor for --pipeline-model-parallel-size 1 only "
           "(Megatron-FSDP's keys under pipeline stages are unchecked); export torch_dist for a pipeline-parallel "
           "Megatron-LM run");
    if (mtp > 0 || model.multi_latent_attention)
      throw Unsupported(fmt::format("export-megatron: {} holds {}, which megatrain does not write in --ckpt-format "
                                    "fsdp_dtensor yet: export torch_dist (Megatron-LM's checkpoint_inspector.py "
                                    "convert-torch-dist-to-fsdp-dtensor converts it)",
                                    reader.directory(), mtp > 0 ? "multi-token prediction depths" : "multi-latent attention"));
    layout.distributed_optimizer = true;  // (Megatron-FSDP's optimizer is the distributed one)
  }
  MegatronExportResult r;
  r.tp = layout.tp;
  r.pp = layout.pp;
  r.vpp = layout.vpp;
  r.dp = layout.dp;
  r.ep = layout.ep;

  // Whether the optimizer state goes over.
  // (the precision the weights were trained in, as stored: an imported checkpoint records no --bf16)
  if (!reader.has("embedding.word_embeddings.weight")) fail("{} has no embedding.word_embeddings.weight", where);
  const DType weights = reader.info("embedding.word_embeddings.weight").dtype;
  const bool bf16 = weights == DType::bf16, fp16 = weights == DType::f16;
  const json optimizer = rs.extra.value("optimizer", json::object());
  Exporter ex(reader, model, layout);
  std::string why;
  if (o.weights_only) why = "--weights-only asks for the weights alone";
  else if (loc->release) why = "it is a release checkpoint (weights only)";
  // (torch_dist keys the optimizer state by parameter; the torch format by index, in an order
  // megatrain does not lay out for MoE and MTP models)
  else if (model.moe.enabled() && !torch_dist && !fsdp)
    why = "megatrain writes a mixture-of-experts model's optimizer state for Megatron-LM in --ckpt-format "
          "torch_dist or fsdp_dtensor only";
  else if (mtp > 0 && !torch_dist)
    why = "megatrain writes a multi-token prediction model's optimizer state for Megatron-LM in --ckpt-format "
          "torch_dist only";
  else if (optimizer.value("kind", std::string()) != "adam")
    why = fmt::format("its optimizer is {}, and export-megatron writes Adam's state",
                      optimizer.value("kind", std::string("not recorded")));
  else if (!rs.lr_scheduler.contains("num_steps"))
    why = "it holds no learning-rate scheduler state (saved with --no-save-optim?)";
  else if (!recorded(flags, "--decoupled-lr").is_null())
    why = "it was trained with --decoupled-lr, whose param groups are not written";
  else {
    for (const std::string& name : reader.names())
      if (is_expert_bias(name)) {
        continue;  // (a router buffer, updated by its own rule)
      } else if (!reader.has(name + ".exp_avg", CheckpointKind::optimizer) ||
          !reader.has(name + ".exp_avg_sq", CheckpointKind::optimizer)) {
        if (name.find("fp8_meta") != std::string::npos) continue;
        why = fmt::format("it holds no Adam state for '{}' (saved with --no-save-optim?)", name);
        break;
      } else if ((bf16 || fp16) && !reader.has(name, CheckpointKind::main_params)) {
        why = fmt::format("it holds no float32 main weights for '{}'", name);
        break;
      }
  }
  const bool with_optimizer = why.empty();
  r.distributed_optimizer = layout.distributed_optimizer;
  r.release = !with_optimizer;
  if (!o.weights_only) r.weights_only_reason = why;
  r.iteration = r.release ? 0 : reader.iteration();
  for (const std::string& name : reader.names())
    if (name.find(".fp8_meta.") != std::string::npos) {
      log::warn0("export-megatron: {} holds FP8 scaling state, which Megatron-LM's local transformer implementation has "
                 "no place for; it is not exported (an FP8 run starts its scales afresh)",
                 where);
      break;
    }

  // The args namespace.
  PickleRef args = megatron_args_from_flags(flags);
  auto set_arg = [&](const std::string& name, PickleRef v) { set_megatron_arg(*args, name, std::move(v)); };
  set_arg("tensor_model_parallel_size", pickle_int(layout.tp));
  set_arg("pipeline_model_parallel_size", pickle_int(layout.pp));
  set_arg("transformer_pipeline_model_parallel_size", pickle_int(layout.pp));
  set_arg("virtual_pipeline_model_parallel_size", layout.vpp > 1 ? pickle_int(layout.vpp) : pickle_none());
  set_arg("num_virtual_stages_per_pipeline_rank", layout.vpp > 1 ? pickle_int(layout.vpp) : pickle_none());
  set_arg("num_layers_per_virtual_pipeline_stage", pickle_none());
  set_arg("decoder_first_pipeline_num_layers", int_or_none(layout.first_stage_layers));
  set_arg("decoder_last_pipeline_num_layers", int_or_none(layout.last_stage_layers));
  set_arg("account_for_embedding_in_pipeline_split", pickle_bool(layout.account_for_embedding));
  set_arg("account_for_loss_in_pipeline_split", pickle_bool(layout.account_for_loss));
  set_arg("context_parallel_size", pickle_int(1));
  set_arg("data_parallel_size", pickle_int(layout.dp));
  set_arg("expert_model_parallel_size", pickle_int(layout.ep));
  if (model.moe.enabled() && layout.tp > 1) set_arg("sequence_parallel", pickle_bool(true));
  set_arg("expert_tensor_parallel_size", model.moe.enabled() ? pickle_int(layout.tp) : pickle_none());
  set_arg("world_size", pickle_int(layout.tp * layout.pp * layout.dp));
  set_arg("rank", pickle_int(0));
  set_arg("use_distributed_optimizer", pickle_bool(layout.distributed_optimizer));
  if (fsdp) set_arg("use_megatron_fsdp", pickle_bool(true));
  set_arg("overlap_grad_reduce", pickle_bool(layout.overlap_grad_reduce));
  set_arg("ddp_bucket_size", layout.ddp_bucket_size ? pickle_int(*layout.ddp_bucket_size) : pickle_none());
  set_arg("ckpt_format", pickle_str(o.format));
  set_arg("use_dist_ckpt", pickle_bool(torch_dist));
  if (torch_dist) {
    set_arg("dist_ckpt_optim_fully_reshardable", pickle_bool(layout.distributed_optimizer));
    set_arg("distrib_optim_fully_reshardable_mem_efficient", pickle_bool(false));
  }
  set_arg("transformer_impl", pickle_str("local"));
  set_arg("make_vocab_size_divisible_by", pickle_int(divisor));
  set_arg("padded_vocab_size", pickle_int(model.padded_vocab_size));
  set_arg("num_layers", pickle_int(model.num_layers));
  set_arg("encoder_num_layers", pickle_int(model.num_layers));
  set_arg("seq_length", pickle_int(model.seq_length));
  set_arg("encoder_seq_length", pickle_int(model.seq_length));
  set_arg("kv_channels", pickle_int(model.head_dim));
  set_arg("ffn_hidden_size", pickle_int(model.ffn_size));
  set_arg("num_query_groups", pickle_int(model.query_groups));
  set_arg("data_parallel_random_init", pickle_bool(recorded_or<bool>(flags, "--data-parallel-random-init", false)));
  set_arg("bf16", pickle_bool(bf16));
  set_arg("fp16", pickle_bool(fp16));
  set_arg("params_dtype", pickle_global(torch_dtype_name(bf16 ? DType::bf16 : fp16 ? DType::f16 : DType::f32)));
  set_arg("iteration", pickle_int(r.iteration));
  set_arg("consumed_train_samples", pickle_int(r.release ? 0 : rs.consumed_train_samples));
  set_arg("skipped_train_samples", pickle_int(r.release ? 0 : rs.skipped_train_samples));
  set_arg("consumed_valid_samples", pickle_int(r.release ? 0 : rs.consumed_valid_samples));
  set_arg("num_floating_point_operations_so_far", pickle_float(r.release ? 0 : rs.num_floating_point_operations_so_far));
  set_arg("no_save_optim", r.release ? pickle_bool(true) : pickle_none());
  set_arg("no_save_rng", r.release ? pickle_bool(true) : pickle_none());
  set_arg("save", pickle_str(o.save));
  set_arg("load", pickle_str(o.save));

  // The optimizer's settings as Megatron's param groups hold them.
  // (max_lr and min_lr as the scheduler saved them: the Megatron run's --lr and --min-lr must equal them)
  double max_lr = 0, min_lr = 0, lr = 0, wd = 0;
  const int64_t step = optimizer.value("successful_steps", int64_t{0});
  PickleRef scheduler = pickle_dict();
  if (with_optimizer) {
    LrSchedule sched(lr_schedule_params_from_json(rs.lr_scheduler, where));
    sched.set_num_steps(rs.lr_scheduler.at("num_steps").get<int64_t>());
    max_lr = sched.params().max_lr;
    min_lr = sched.params().min_lr;
    lr = sched.lr(max_lr, min_lr);
    wd = sched.weight_decay();
    const json& s = rs.lr_scheduler;
    pickle_set(*scheduler, "max_lr", pickle_float(s.at("max_lr").get<double>()));
    pickle_set(*scheduler, "lr_warmup_steps", count_value(s.at("lr_warmup_steps")));
    pickle_set(*scheduler, "num_steps", pickle_int(s.at("num_steps").get<int64_t>()));
    pickle_set(*scheduler, "lr_decay_style", pickle_str(s.at("lr_decay_style").get<std::string>()));
    pickle_set(*scheduler, "lr_decay_steps", count_value(s.at("lr_decay_steps")));
    pickle_set(*scheduler, "min_lr", pickle_float(s.at("min_lr").get<double>()));
    pickle_set(*scheduler, "start_wd", pickle_float(s.at("start_wd").get<double>()));
    pickle_set(*scheduler, "end_wd", pickle_float(s.at("end_wd").get<double>()));
    pickle_set(*scheduler, "wd_incr_style", pickle_str(s.at("wd_incr_style").get<std::string>()));
    pickle_set(*scheduler, "wd_incr_steps", count_value(s.at("wd_incr_steps")));
  }
  // Megatron's two param groups: the default (weight decay), then biases and 1-D parameters
  // (wd_mult 0); `params` is added per rank (non-distributed) or left out (distributed).
  auto param_group = [&](bool decay, bool with_step, bool expert) {
    PickleRef g = pickle_dict();
    pickle_set(*g, "is_expert_parallel", pickle_bool(expert));
    pickle_set(*g, "default_config", pickle_bool(true));
    pickle_set(*g, "wd_mult", pickle_float(decay ? 1.0 : 0.0));
    pickle_set(*g, "lr_mult", pickle_float(1.0));
    pickle_set(*g, "is_decoupled_lr", pickle_bool(false));
    pickle_set(*g, "max_lr", pickle_float(max_lr));
    pickle_set(*g, "min_lr", pickle_float(min_lr));
    pickle_set(*g, "lr", pickle_float(lr));
    pickle_set(*g, "betas", pickle_tuple({pickle_float(recorded_or<double>(flags, "--adam-beta1", 0.9)),
                                          pickle_float(recorded_or<double>(flags, "--adam-beta2", 0.999))}));
    pickle_set(*g, "eps", pickle_float(recorded_or<double>(flags, "--adam-eps", 1e-8)));
    pickle_set(*g, "weight_decay", pickle_float(decay ? wd : 0.0));
    pickle_set(*g, "amsgrad", pickle_bool(false));
    pickle_set(*g, "maximize", pickle_bool(false));
    pickle_set(*g, "foreach", pickle_none());
    pickle_set(*g, "capturable", pickle_bool(false));
    pickle_set(*g, "differentiable", pickle_bool(false));
    pickle_set(*g, "fused", pickle_none());
    pickle_set(*g, "decoupled_weight_decay", pickle_bool(true));
    // Adam's step also in the group, where Transformer Engine's and Apex's FusedAdam keep it
    if (with_step) pickle_set(*g, "step", pickle_float(static_cast<double>(step)));
    return g;
  };
  // The loss scaler's state beside the optimizer's (--fp16's dynamic scaler; a constant one saves {}).
  auto grad_scaler = [&](TorchSaveWriter& w, PickleValue& opt) {
    if (!recorded(flags, "--loss-scale").is_null()) {
      pickle_set(opt, "grad_scaler", pickle_dict());
    } else if (fp16) {
      const json& s = rs.loss_scaler;
      if (s.value("kind", std::string()) != "dynamic")
        fail("{}: an --fp16 checkpoint without its dynamic loss scaler's state", where);
      PickleRef g = pickle_dict();
      HostArray scale = HostArray::zeros(DType::f32, {1});
      scale.ptr<float>()[0] = static_cast<float>(s.at("scale").get<double>());
      pickle_set(*g, "scale", w.tensor(std::move(scale)));
      pickle_set(*g, "growth_tracker", pickle_int(s.at("growth_tracker").get<int64_t>()));
      pickle_set(*g, "hysteresis_tracker", pickle_int(s.at("hysteresis_tracker").get<int64_t>()));
      pickle_set(opt, "grad_scaler", g);
    }
  };

  // Write every rank's files into <save>/<iteration directory>.tmp, then move it into place.
  const std::string dir_name = r.release ? std::string("release") : iteration_directory_name(r.iteration);
  const std::string final_dir = join_path(o.save, dir_name), tmp_dir = final_dir + ".tmp";
  make_directories(o.save);
  remove_tree(tmp_dir);
  const int64_t seed = recorded_or<int64_t>(flags, "--seed", 1234);
  const bool dp_random_init = recorded_or<bool>(flags, "--data-parallel-random-init", false);
  const ExportPlan plan{reader, model, layout, cfg, split, ex, rs, flags, args, scheduler, param_group, grad_scaler,
                        with_optimizer, bf16, fp16, dp_random_init, step, seed};
  if (torch_dist) plan.write_torch_dist(tmp_dir, r);
  else if (fsdp) plan.write_fsdp_dtensor(tmp_dir, r);
  else plan.write_torch_format(tmp_dir, r);
  fsync_directory(tmp_dir);
  remove_tree(final_dir);
  rename_path(tmp_dir, final_dir);
  fsync_directory(o.save);
  write_file_atomically(join_path(o.save, "latest_checkpointed_iteration.txt"),
                        r.release ? std::string("release") : std::to_string(r.iteration));
  r.directory = final_dir;

  // The flags to load it with in Megatron-LM.
  r.megatron_flags = megatron_model_flags(*args, where);
  const std::vector<std::string> tokenizer = megatron_tokenizer_flags(*args, where);
  r.megatron_flags.insert(r.megatron_flags.end(), tokenizer.begin(), tokenizer.end());
  for (const std::string& f : {std::string("--tensor-model-parallel-size"), std::to_string(layout.tp),
                               std::string("--pipeline-model-parallel-size"), std::to_string(layout.pp)})
    r.megatron_flags.push_back(f);
  if (layout.vpp > 1) {
    r.megatron_flags.push_back("--num-virtual-stages-per-pipeline-rank");
    r.megatron_flags.push_back(std::to_string(layout.vpp));
  }
  if (model.moe.enabled() && layout.tp > 1) r.megatron_flags.push_back("--sequence-parallel");
  if (model.moe.enabled())
    for (const std::string& f : {std::string("--expert-model-parallel-size"), std::to_string(layout.ep),
                                 std::string("--expert-tensor-parallel-size"), std::to_string(layout.tp)})
      r.megatron_flags.push_back(f);
  if (layout.first_stage_layers) {
    r.megatron_flags.push_back("--decoder-first-pipeline-num-layers");
    r.megatron_flags.push_back(std::to_string(*layout.first_stage_layers));
  }
  if (layout.last_stage_layers) {
    r.megatron_flags.push_back("--decoder-last-pipeline-num-layers");
    r.megatron_flags.push_back(std::to_string(*layout.last_stage_layers));
  }
  if (fsdp) {
    // (the sharding strategy is the user's choice: any one loads the checkpoint)
    for (const char* f : {"--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"})
      r.megatron_flags.push_back(f);
  } else if (layout.distributed_optimizer) {
    r.megatron_flags.push_back("--use-distributed-optimizer");
  }
  if (!fsdp && layout.distributed_optimizer && layout.overlap_grad_reduce) r.megatron_flags.push_back("--overlap-grad-reduce");
  if (layout.distributed_optimizer && layout.ddp_bucket_size) {
    r.megatron_flags.push_back("--ddp-bucket-size");
    r.megatron_flags.push_back(std::to_string(*layout.ddp_bucket_size));
  }
  if (bf16) r.megatron_flags.push_back("--bf16");
  if (fp16) r.megatron_flags.push_back("--fp16");
  // (Megatron-LM's fused SwiGLU with routing weights raises "Bias is not supported for weighted
  // swiglu fusion": its SwiGLU experts with biases run unfused.)
  if (model.moe.enabled() && model.add_bias_linear && model.swiglu) r.megatron_flags.push_back("--no-bias-swiglu-fusion");
  for (const char* f : {"--transformer-impl", "local", "--ckpt-format"}) r.megatron_flags.push_back(f);
  r.megatron_flags.push_back(o.format);
  r.megatron_flags.push_back("--load");
  r.megatron_flags.push_back(o.save);
  return r;
}

int export_megatron_main(const std::vector<std::string>& argv) {
  const SubcommandArgs a("export-megatron", argv,
                         {"--load", "--save", "--ckpt-step", "--ckpt-format", "--tensor-model-parallel-size",
                          "--pipeline-model-parallel-size", "--num-virtual-stages-per-pipeline-rank",
                          "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
                          "--data-parallel-size", "--make-vocab-size-divisible-by", "--ddp-bucket-size",
                          "--expert-model-parallel-size"},
                         {"--use-distributed-optimizer", "--no-use-distributed-optimizer", "--overlap-grad-reduce",
                          "--weights-only"});
  MegatronExportOptions o;
  o.load = a.required("--load", "CKPT (the megatrain checkpoint directory to export)");
  o.save = a.required("--save", "DIR (where the Megatron-LM checkpoint goes)");
  if (a.get("--ckpt-step")) o.ckpt_step = a.integer("--ckpt-step", 0);
  if (auto f = a.get("--ckpt-format")) o.format = *f;
  auto optional_int = [&](const char* flag) -> std::optional<int> {
    if (!a.get(flag)) return std::nullopt;
    const int64_t v = a.integer(flag, 0);
    if (v < 1 || v > 1 << 20) fail("export-megatron: {} must be a positive integer (got {})", flag, v);
    return static_cast<int>(v);
  };
  o.tp = optional_int("--tensor-model-parallel-size");
  o.pp = optional_int("--pipeline-model-parallel-size");
  o.vpp = optional_int("--num-virtual-stages-per-pipeline-rank");
  o.first_stage_layers = optional_int("--decoder-first-pipeline-num-layers");
  o.last_stage_layers = optional_int("--decoder-last-pipeline-num-layers");
  o.dp = optional_int("--data-parallel-size");
  o.ep = optional_int("--expert-model-parallel-size");
  o.make_vocab_size_divisible_by = optional_int("--make-vocab-size-divisible-by");
  if (a.has("--use-distributed-optimizer") && a.has("--no-use-distributed-optimizer"))
    fail("export-megatron: --use-distributed-optimizer and --no-use-distributed-optimizer contradict each other");
  if (a.has("--use-distributed-optimizer")) o.distributed_optimizer = true;
  if (a.has("--no-use-distributed-optimizer")) o.distributed_optimizer = false;
  o.overlap_grad_reduce = a.has("--overlap-grad-reduce");
  if (a.get("--ddp-bucket-size")) {
    o.ddp_bucket_size = a.integer("--ddp-bucket-size", 0);
    if (*o.ddp_bucket_size < 1) fail("export-megatron: --ddp-bucket-size must be >= 1 (got {})", *o.ddp_bucket_size);
  }
  o.weights_only = a.has("--weights-only");
  const MegatronExportResult r = export_megatron(o);
  std::printf("exported %s to %s (Megatron-LM %s format, %s, TP %d x PP %d%s, %zu files)\n", o.load.c_str(),
              r.directory.c_str(), o.format.c_str(), r.release ? "release" : fmt::format("iteration {}", r.iteration).c_str(), r.tp, r.pp,
              r.vpp > 1 ? fmt::format(" with {} virtual stages", r.vpp).c_str() : "", r.files.size());
  if (!r.release)
    std::printf("with the optimizer state (%s: Adam moments and step, float32 main weights), the learning-rate "
                "scheduler, the consumed samples and the RNG states Megatron-LM seeds from --seed\n",
                o.format == "fsdp_dtensor" ? "Megatron-FSDP's state by parameter"
                : o.format == "torch_dist"
                    ? (r.distributed_optimizer ? "the distributed optimizer's fully reshardable layout"
                                               : "the optimizer's state by parameter")
                : r.distributed_optimizer ? "the distributed optimizer's distrib_optim.pt"
                                          : "torch's Adam state");
  else
    std::printf("weights only, as %s: Megatron-LM starts from it at iteration 0 with a fresh optimizer\n",
                r.weights_only_reason.empty() ? "--weights-only asks" : r.weights_only_reason.c_str());
  std::printf("continue in Megatron-LM (pretrain_gpt.py) with these flags (plus your data, batch and optimizer flags, "
              "as the megatrain run had them):\n%s\n",
              shell_quoted_line(r.megatron_flags).c_str());
  return 0;
}

}  // namespace mt
