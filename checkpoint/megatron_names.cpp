#include "checkpoint/megatron_names.h"

#include <cstring>
#include <regex>

#include <fmt/format.h>

#include "core/error.h"

namespace mt {

namespace {

bool ends_with(const std::string& s, const char* suffix) {
  const size_t n = std::strlen(suffix);
  return s.size() >= n && s.compare(s.size() - n, n, suffix) == 0;
}

// The local spec's norm modules and the Transformer Engine parameters they become (prefixes of
// the name after "decoder.layers.N.").
constexpr std::pair<const char*, const char*> kNormNames[] = {
    {"input_layernorm.", "self_attention.linear_qkv.layer_norm_"},
    {"pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"}};

std::string renamed(const std::string& rest, bool to_te) {
  for (const auto& [local, te] : kNormNames) {
    const char* from = to_te ? local : te;
    const char* to = to_te ? te : local;
    const size_t n = std::strlen(from);
    if (rest.compare(0, n, from) == 0) return to + rest.substr(n);
  }
  return rest;
}

}  // namespace

MegatronTpSplit megatron_tp_split(const std::string& name, bool swiglu) {
  if (ends_with(name, "linear_fc1.weight") || ends_with(name, "linear_fc1.bias"))
    return swiglu ? MegatronTpSplit::swiglu_rows : MegatronTpSplit::rows;
  // (Multi-latent attention: the up projections split the heads; the down projections are whole on
  // every rank, Transformer Engine's "duplicated" linears. The attention sinks split the heads.)
  if (ends_with(name, "linear_qkv.weight") || ends_with(name, "linear_qkv.bias") ||
      ends_with(name, "linear_q_proj.weight") || ends_with(name, "linear_q_up_proj.weight") ||
      ends_with(name, "linear_kv_up_proj.weight") || ends_with(name, "core_attention.softmax_offset") ||
      name == "embedding.word_embeddings.weight" || name == "output_layer.weight")
    return MegatronTpSplit::rows;
  // (An MTP depth's eh_proj is a column-parallel linear: its output rows split.)
  if (ends_with(name, ".eh_proj.weight")) return MegatronTpSplit::rows;
  if (ends_with(name, "linear_proj.weight") || ends_with(name, "linear_fc2.weight")) return MegatronTpSplit::columns;
  return MegatronTpSplit::replicated;
}

ShardIndex megatron_tp_shard(MegatronTpSplit split, const std::vector<int64_t>& global_shape, int tp, int rank,
                             const std::string& name) {
  if (global_shape.empty() || global_shape.size() > 2) fail("'{}' is neither a vector nor a matrix", name);
  const int64_t rows = global_shape[0], cols = global_shape.size() == 2 ? global_shape[1] : 1;
  ShardIndex s = ShardIndex::whole(rows, cols);
  if (split == MegatronTpSplit::replicated || tp == 1) return s;
  auto divide = [&](int64_t n, const char* what) {
    if (n % tp != 0) fail("'{}' has {} {}, which tensor parallel size {} does not divide", name, n, what, tp);
    return n / tp;
  };
  switch (split) {
    case MegatronTpSplit::rows:
      s.local_rows = divide(rows, "rows");
      s.row_offset = rank * s.local_rows;
      break;
    case MegatronTpSplit::swiglu_rows:
      if (rows % 2 != 0) fail("'{}' has {} rows: not SwiGLU's [gate; up]", name, rows);
      s.chunks = 2;
      s.local_rows = divide(rows / 2, "rows in each half");
      s.row_offset = rank * s.local_rows;
      break;
    case MegatronTpSplit::columns:
      if (global_shape.size() != 2) fail("'{}' is split by columns but is not a matrix", name);
      s.local_cols = divide(cols, "columns");
      s.col_offset = rank * s.local_cols;
      break;
    case MegatronTpSplit::replicated: break;
  }
  return s;
}

std::vector<int64_t> megatron_shard_shape(const ShardIndex& shard, const std::vector<int64_t>& global_shape) {
  std::vector<int64_t> shape = {shard.local_rows * shard.local_chunks()};
  if (global_shape.size() == 2) shape.push_back(shard.local_cols);
  return shape;
}

ShardIndex megatron_expert_shard(bool fc1, const std::vector<int64_t>& global_shape, int experts, int expert,
                                 bool swiglu, int tp, int rank) {
  if (global_shape.empty() || global_shape.size() > 2 || experts < 1 || global_shape[0] % experts != 0)
    fail("stacked experts of shape [{} x ...] do not split into {} experts", global_shape.empty() ? 0 : global_shape[0],
         experts);
  const int64_t rows = global_shape[0] / experts, cols = global_shape.size() == 2 ? global_shape[1] : 1;
  // (The experts' biases [E x rows]: fc1's split over TP as fc1's rows, fc2's whole on every rank.)
  if (global_shape.size() == 1 && !fc1) return ShardIndex{global_shape[0], 1, int64_t{expert} * rows, 0, rows, 1, 1};
  if (fc1) {
    const int64_t halves = swiglu ? 2 : 1, local = rows / halves / tp;
    return ShardIndex{global_shape[0], cols, rank * local, 0, local, cols, int64_t{experts} * halves,
                      int64_t{expert} * halves, halves};
  }
  const int64_t local = cols / tp;
  return ShardIndex{global_shape[0], cols, int64_t{expert} * rows, rank * local, rows, local, 1};
}

std::optional<std::pair<int, std::string>> megatron_split_layer_name(const std::string& name) {
  static const std::string prefix = "decoder.layers.";
  if (name.compare(0, prefix.size(), prefix) != 0) return std::nullopt;
  const size_t dot = name.find('.', prefix.size());
  if (dot == std::string::npos) return std::nullopt;
  const std::string number = name.substr(prefix.size(), dot - prefix.size());
  if (number.empty() || number.size() > 9 || number.find_first_not_of("0123456789") != std::string::npos)
    return std::nullopt;
  return std::make_pair(std::stoi(number), name.substr(dot + 1));
}

std::optional<std::pair<int, std::string>> megatron_split_mtp_layer_name(const std::string& name) {
  static const std::regex mtp_layer(R"(mtp\.layers\.(\d{1,9})\.(?:transformer_layer|mtp_model_layer)\.(.*))");
  std::smatch m;
  if (!std::regex_match(name, m, mtp_layer)) return std::nullopt;
  return std::make_pair(std::stoi(m[1].str()), m[2].str());
}

std::string expert_bias_name(int layer) { return fmt::format("decoder.layers.{}.mlp.router.expert_bias", layer); }

std::string megatron_te_layer_name(const std::string& local) { return renamed(local, true); }

std::string megatron_local_layer_name(const std::string& te) { return renamed(te, false); }

bool megatron_has_extra_state(const std::string& module) {
  return module == "output_layer" || ends_with(module, ".linear_qkv") || ends_with(module, ".linear_proj") ||
         ends_with(module, ".linear_fc1") || ends_with(module, ".linear_fc2") || ends_with(module, ".eh_proj");
}

}  // namespace mt
