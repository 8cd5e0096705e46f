#include "checkpoint/megatron_checkpoint.h"

#include <algorithm>
#include <cctype>
#include <cstring>
#include <regex>
#include <set>
#include <tuple>

#include "checkpoint/file_io.h"
#include "checkpoint/megatron_names.h"
#include "checkpoint/pickle_writer.h"
#include "checkpoint/torch_file.h"
#include "core/error.h"
#include "core/shape_text.h"

namespace mt {

const PickleValue* megatron_arg(const PickleValue& args, const std::string& name) {
  const PickleValue* v = args.find(name);
  return v && !v->is(PickleKind::none) ? v : nullptr;
}

int64_t megatron_int_arg(const PickleValue& args, const std::string& name, int64_t fallback) {
  const PickleValue* v = megatron_arg(args, name);
  return v && v->is(PickleKind::integer) ? v->integer : fallback;
}

bool megatron_bool_arg(const PickleValue& args, const std::string& name) {
  const PickleValue* v = megatron_arg(args, name);
  return v && v->is(PickleKind::boolean) && v->boolean;
}

namespace {

// Writes a tensor-parallel shard (its local layout, rows contiguous) into its place in `out`.
void place_shard(HostArray& out, const ShardIndex& sh, const HostArray& piece) {
  const size_t elem = dtype_size(out.dtype);
  const size_t row_bytes = static_cast<size_t>(sh.local_cols) * elem;
  for (int64_t r = 0; r < sh.local_rows * sh.local_chunks(); ++r)
    std::memcpy(out.bytes.data() + static_cast<size_t>(shard_global_index(sh, r * sh.local_cols)) * elem,
                piece.bytes.data() + static_cast<size_t>(r) * row_bytes, row_bytes);
}

// Copies the box where `chunk` (at chunk_offsets of the global tensor) overlaps the box
// [out_offsets, out_offsets + out.shape) into `out`. Both dense row-major, same dtype.
void copy_overlap(const HostArray& chunk, const std::vector<int64_t>& chunk_offsets, HostArray& out,
                  const std::vector<int64_t>& out_offsets) {
  const size_t nd = out.shape.size();
  std::vector<int64_t> lo(nd), hi(nd);
  for (size_t d = 0; d < nd; ++d) {
    lo[d] = std::max(chunk_offsets[d], out_offsets[d]);
    hi[d] = std::min(chunk_offsets[d] + chunk.shape[d], out_offsets[d] + out.shape[d]);
    if (lo[d] >= hi[d]) return;
  }
  const size_t elem = dtype_size(out.dtype);
  const size_t run = static_cast<size_t>(hi[nd - 1] - lo[nd - 1]) * elem;  // innermost dimension: one memcpy
  std::vector<int64_t> at = lo;
  while (true) {
    int64_t src = 0, dst = 0;
    for (size_t d = 0; d < nd; ++d) {
      src = src * chunk.shape[d] + (at[d] - chunk_offsets[d]);
      dst = dst * out.shape[d] + (at[d] - out_offsets[d]);
    }
    std::memcpy(out.bytes.data() + static_cast<size_t>(dst) * elem, chunk.bytes.data() + static_cast<size_t>(src) * elem,
                run);
    size_t d = nd - 1;
    while (d-- > 0) {
      if (++at[d] < hi[d]) break;
      at[d] = lo[d];
    }
    if (d == static_cast<size_t>(-1)) break;
  }
}


// A torch-format rank file's optimizer: Megatron's wrapper (with fp32_from_fp16_params for bf16 and
// fp16 models) around torch's state dict {state, param_groups}; its FP32Optimizer saves torch's
// directly. inner is nullptr when neither is there.
struct TorchOptimizer {
  const PickleValue* wrapper = nullptr;
  const PickleValue* inner = nullptr;
};
TorchOptimizer torch_optimizer(const PickleValue& root) {
  const PickleValue* o = root.find("optimizer");
  if (!o || !o->is(PickleKind::dict)) return {};
  if (o->find("param_groups")) return {o, o};
  const PickleValue* in = o->find("optimizer");
  if (in && in->is(PickleKind::dict) && in->find("param_groups")) return {o, in};
  return {o, nullptr};
}

// The entry of a dict keyed by integers.
const PickleValue* int_key(const PickleValue& dict, int64_t key) {
  for (const auto& [k, v] : dict.entries)
    if (k->is(PickleKind::integer) && k->integer == key) return v.get();
  return nullptr;
}

}  // namespace

struct MegatronCheckpoint::Files {
  std::vector<std::unique_ptr<TorchFile>> torch_files;                   // torch: one per rank file
  std::vector<std::vector<const TorchFile*>> rank_files;                 // torch: [pp][tp]
  std::unique_ptr<TorchFile> common;                                     // torch_dist: the common state
  std::map<std::string, std::shared_ptr<const MappedFile>> distcp_files;  // torch_dist: by relative path
  // torch_dist with the distributed optimizer in its flat layout: the stored object holding its
  // param groups (torch.save'd inside a .distcp file).
  struct Item {
    std::shared_ptr<const MappedFile> file;
    uint64_t offset = 0, length = 0;
  };
  std::optional<Item> optimizer_groups;
};

struct MegatronCheckpoint::Source {
  // torch: the tensor in each TP rank's file, in rank order.
  std::vector<std::pair<const TorchFile*, const PickleValue*>> shards;
  MegatronTpSplit join = MegatronTpSplit::replicated;
  // torch_dist: the stored chunks of `key`, and the index along its leading dimension when the
  // parameter is one layer of a stacked tensor.
  struct Chunk {
    std::shared_ptr<const MappedFile> file;
    uint64_t offset = 0, length = 0;
    std::vector<int64_t> offsets;
    std::vector<int64_t> sizes;  // from .metadata (empty if it does not list the chunk)
  };
  std::string key;
  std::vector<int64_t> key_shape;
  int layer = -1;
  std::vector<Chunk> chunks;
  // torch: a layer's experts, each its own tensor (by global expert), stacked along the rows
  // (megatrain's mlp.experts.linear_fc{1,2}.weight).
  std::vector<std::shared_ptr<Source>> experts;
};

MegatronCheckpoint::~MegatronCheckpoint() = default;

MegatronCheckpoint::MegatronCheckpoint(const std::string& load_dir, std::optional<int64_t> ckpt_step)
    : files_(std::make_shared<Files>()) {
  const std::string tracker = join_path(load_dir, "latest_checkpointed_iteration.txt");
  // An iteration directory itself (iter_0000100 or release) is taken as it is.
  std::string trimmed = load_dir;
  while (trimmed.size() > 1 && trimmed.back() == '/') trimmed.pop_back();
  const size_t slash = trimmed.find_last_of('/');
  const std::string base = slash == std::string::npos ? trimmed : trimmed.substr(slash + 1);
  const bool iteration_dir = !ckpt_step && !path_exists(tracker) &&
                             (base == "release" || (base.size() == 12 && base.compare(0, 5, "iter_") == 0 &&
                                                    base.find_first_not_of("0123456789", 5) == std::string::npos));
  if (iteration_dir) {
    release_ = base == "release";
    if (!release_) iteration_ = std::stoll(base.substr(5));
    directory_ = trimmed;
  } else if (ckpt_step) {
    iteration_ = *ckpt_step;
  } else {
    if (!path_exists(tracker))
      fail("{} has no latest_checkpointed_iteration.txt: not a Megatron-LM checkpoint directory (give the directory "
           "Megatron's --save wrote)", load_dir);
    std::string text = read_text_file(tracker);
    while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.pop_back();
    if (text == "release") {
      release_ = true;
    } else {
      try {
        size_t used = 0;
        iteration_ = std::stoll(text, &used);
        if (used != text.size()) throw std::invalid_argument(text);
      } catch (const std::exception&) {
        fail("{} holds '{}', neither an iteration number nor 'release'", tracker, text);
      }
    }
  }
  if (!iteration_dir)
    directory_ = join_path(load_dir, release_ ? std::string("release") : fmt::format("iter_{:07d}", iteration_));
  if (!is_directory(directory_)) fail("{} does not exist (named by {})", directory_, ckpt_step ? "--ckpt-step" : tracker);
  if (path_exists(join_path(directory_, "metadata.json"))) {
    format_ = "torch_dist";
    open_torch_dist();
  } else if (path_exists(join_path(directory_, ".metadata"))) {
    format_ = "fsdp_dtensor";
    open_fsdp_dtensor();
  } else {
    format_ = "torch";
    open_torch();
  }
}

namespace {

// Mixture-of-experts expert weights in a torch-format rank file: the local spec's SequentialMLP
// (mlp.experts.local_experts.{i}.linear_fc{1,2}.weight) or Transformer Engine's grouped linears
// (mlp.experts.linear_fc{1,2}.weight{i}), and their biases, i the rank's local expert: the
// layer-relative name and i, with the name as megatrain keys the layer's stacked experts
// (mlp.experts.linear_fc{1,2}.weight / .bias).
std::optional<std::pair<std::string, int>> torch_local_expert(const std::string& rest) {
  static const std::regex sequential(R"(mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias))");
  static const std::regex grouped(R"(mlp\.experts\.(linear_fc[12])\.(weight|bias)(\d+))");
  std::smatch m;
  if (std::regex_match(rest, m, sequential))
    return std::make_pair("mlp.experts." + m[2].str() + "." + m[3].str(), std::stoi(m[1].str()));
  if (std::regex_match(rest, m, grouped))
    return std::make_pair("mlp.experts." + m[1].str() + "." + m[2].str(), std::stoi(m[3].str()));
  return std::nullopt;
}

// A transformer layer's parameter name split after its layer's head ("decoder.layers.<l>." or, for
// a multi-token prediction depth's inner layer under either of Megatron's names,
// "mtp.layers.<d>.transformer_layer."): head and rest; nullopt for other names.
std::optional<std::pair<std::string, std::string>> split_layer_head(const std::string& name) {
  if (const auto layer = megatron_split_layer_name(name))
    return std::make_pair(fmt::format("decoder.layers.{}.", layer->first), layer->second);
  if (const auto mtp = megatron_split_mtp_layer_name(name))
    return std::make_pair(fmt::format("mtp.layers.{}.transformer_layer.", mtp->first), mtp->second);
  return std::nullopt;
}

}  // namespace

void MegatronCheckpoint::open_torch() {
  // mp_rank_TT, with pipeline parallelism mp_rank_TT_PPP, with expert parallelism a last _EEE
  // (Megatron's get_checkpoint_name); which numbers are there follows from the args.
  std::map<std::string, std::vector<int>> named;
  for (const std::string& n : list_directory(directory_)) {
    if (n.compare(0, 8, "mp_rank_") != 0) continue;
    std::vector<int> numbers;
    size_t p = 8;
    while (p <= n.size()) {
      const size_t q = std::min(n.find('_', p), n.size());
      const std::string part = n.substr(p, q - p);
      if (part.empty() || part.find_first_not_of("0123456789") != std::string::npos)
        fail("{}: cannot read the rank directory name '{}'", directory_, n);
      numbers.push_back(std::stoi(part));
      p = q + 1;
    }
    named[n] = numbers;
  }
  if (named.empty())
    fail("{} holds neither metadata.json (torch_dist) nor mp_rank_* directories (torch): not a Megatron-LM "
         "checkpoint megatrain can read", directory_);
  auto open_file = [&](const std::string& dir) -> const TorchFile& {
    const std::string path = join_path(dir, "model_optim_rng.pt");
    if (!path_exists(path)) fail("{} does not exist", path);
    files_->torch_files.push_back(std::make_unique<TorchFile>(path));
    return *files_->torch_files.back();
  };
  // The args (every rank file holds them): the first directory's.
  const TorchFile& first = open_file(join_path(directory_, named.begin()->first));
  const PickleValue* args = first.root().find("args");
  if (!args || !args->is(PickleKind::object))
    fail("{} holds no saved args: megatrain needs them to rebuild the model", first.what());
  args_ = std::make_shared<PickleValue>(*args);
  const int tp = static_cast<int>(megatron_int_arg(*args, "tensor_model_parallel_size", 1));
  const int pp = static_cast<int>(megatron_int_arg(*args, "pipeline_model_parallel_size", 1));
  const int ep = static_cast<int>(megatron_int_arg(*args, "expert_model_parallel_size", 1));
  const int experts = static_cast<int>(megatron_int_arg(*args, "num_experts", 0));
  if (experts > 0 && megatron_int_arg(*args, "expert_tensor_parallel_size", tp) != tp)
    throw Unsupported(fmt::format("{} was saved with --expert-tensor-parallel-size {} under --tensor-model-parallel-size "
                                  "{}: megatrain reads torch-format mixture-of-experts checkpoints whose experts split "
                                  "over TP as the rest does (or their torch_dist form) only",
                                  directory_, megatron_int_arg(*args, "expert_tensor_parallel_size", tp), tp));
  // Rank directories by (tp, pp, ep).
  std::map<std::tuple<int, int, int>, std::string> rank_dirs;
  const size_t numbers_expected = 1 + (pp > 1 ? 1 : 0) + (ep > 1 ? 1 : 0);
  for (const auto& [n, numbers] : named) {
    if (numbers.size() != numbers_expected)
      fail("{}: the rank directory '{}' does not fit the args' tensor parallel {} x pipeline parallel {} x expert "
           "parallel {}", directory_, n, tp, pp, ep);
    const int t = numbers[0], p = pp > 1 ? numbers[1] : 0, e = ep > 1 ? numbers.back() : 0;
    if (t >= tp || p >= pp || e >= ep) fail("{}: the rank directory '{}' is outside the args' layout", directory_, n);
    rank_dirs[{t, p, e}] = join_path(directory_, n);
  }
  if (static_cast<int>(rank_dirs.size()) != tp * pp * ep)
    fail("{} holds {} rank directories, but its args say tensor parallel {} x pipeline parallel {}{}", directory_,
         rank_dirs.size(), tp, pp, ep > 1 ? fmt::format(" x expert parallel {}", ep) : std::string());
  const bool swiglu = megatron_bool_arg(*args, "swiglu");
  const bool tied = !megatron_bool_arg(*args, "untie_embeddings_and_output_weights");

  // [ep][pp][tp]: the files (the first one already open).
  const std::string first_dir = join_path(directory_, named.begin()->first);
  std::vector<std::vector<std::vector<const TorchFile*>>> files(
      static_cast<size_t>(ep), std::vector<std::vector<const TorchFile*>>(static_cast<size_t>(pp)));
  for (int e = 0; e < ep; ++e)
    for (int p = 0; p < pp; ++p)
      for (int t = 0; t < tp; ++t) {
        const std::string& dir = rank_dirs.at({t, p, e});
        files[static_cast<size_t>(e)][static_cast<size_t>(p)].push_back(dir == first_dir ? &first : &open_file(dir));
      }
  files_->rank_files = files[0];
  common_ = std::make_shared<PickleValue>(first.root());
  std::map<std::pair<int, int>, std::string> dense_dirs;  // (the expert-parallel rank 0's)
  for (const auto& [key, dir] : rank_dirs)
    if (std::get<2>(key) == 0) dense_dirs[{std::get<0>(key), std::get<1>(key)}] = dir;
  open_torch_optimizer(dense_dirs, tp, pp);
  if (ep > 1 && optimizer_layout_ != "none")
    optimizer_layout_ = "the torch format's optimizer state under expert parallelism";

  // Virtual pipeline chunks are "model0", "model1", ...; without them "model".
  const TorchFile& root = *files[0][0][0];
  const bool chunked = root.root().find("model") == nullptr;
  int chunks = 1;
  if (chunked)
    while (root.root().find("model" + std::to_string(chunks))) ++chunks;
  // Global layer numbers: the layers of chunk v of stage p follow those of all earlier (v, p) in
  // the order v-major, then p (Megatron's interleaved assignment; also its uneven splits). The
  // experts of expert-parallel rank e are its local experts i, global expert e x (experts / EP) + i;
  // the other tensors are the same on every expert-parallel rank (rank 0's are read).
  const int local_experts = experts > 0 ? experts / ep : 0;
  int next_layer = 0;
  std::map<std::string, std::shared_ptr<Source>> found;
  auto shard_source = [&](std::shared_ptr<Source>& src, const std::string& name) {
    if (!src) {
      src = std::make_shared<Source>();
      src->join = megatron_tp_split(name, swiglu);
      src->shards.resize(static_cast<size_t>(tp), {nullptr, nullptr});
    }
    return src;
  };
  for (int v = 0; v < chunks; ++v) {
    const std::string key = chunked ? "model" + std::to_string(v) : "model";
    for (int p = 0; p < pp; ++p) {
      int layers_here = 0;
      for (int e = 0; e < ep; ++e)
        for (int t = 0; t < tp; ++t) {
          const TorchFile& f = *files[static_cast<size_t>(e)][static_cast<size_t>(p)][static_cast<size_t>(t)];
          const PickleValue* model = f.root().find(key);
          if (!model || !model->is(PickleKind::dict)) fail("{} has no '{}' state dict", f.what(), key);
          for (const auto& [k, value] : model->entries) {
            if (!k->is(PickleKind::string)) continue;
            std::string name = k->text;
            if (name.size() > 12 && name.compare(name.size() - 12, 12, "_extra_state") == 0) continue;
            if (!TorchFile::is_tensor(*value)) continue;
            const auto layer = megatron_split_layer_name(name);
            // (the torch format's mtp_model_layer: megatrain's transformer_layer, as torch_dist's key map says)
            const auto mtp = layer ? std::nullopt : megatron_split_mtp_layer_name(name);
            const std::string prefix =
                layer ? fmt::format("decoder.layers.{}.", next_layer + layer->first)
                      : mtp ? fmt::format("mtp.layers.{}.transformer_layer.", mtp->first) : std::string();
            const auto expert = layer ? torch_local_expert(layer->second)
                                      : mtp ? torch_local_expert(mtp->second) : std::nullopt;
            if (expert) {
              if (expert->second >= local_experts)
                fail("{}: '{}' names local expert {} of {} (--num-experts {} over expert parallel {})", f.what(), name,
                     expert->second, local_experts, experts, ep);
              if (layer) layers_here = std::max(layers_here, layer->first + 1);
              auto& stack = found[prefix + expert->first];
              if (!stack) stack = std::make_shared<Source>();
              stack->experts.resize(static_cast<size_t>(experts));
              auto& one = stack->experts[static_cast<size_t>(e * local_experts + expert->second)];
              shard_source(one, expert->first);
              if (!one->shards[static_cast<size_t>(t)].first) one->shards[static_cast<size_t>(t)] = {&f, value.get()};
              continue;
            }
            if (e > 0) continue;
            if (layer) layers_here = std::max(layers_here, layer->first + 1);
            if (layer || mtp) name = prefix + megatron_te_layer_name(layer ? layer->second : mtp->second);
            if (name == "output_layer.weight" && tied) continue;  // the last stage's copy of the embedding
            auto& src = found[name];
            shard_source(src, name);
            if (!src->shards[static_cast<size_t>(t)].first) src->shards[static_cast<size_t>(t)] = {&f, value.get()};
          }
        }
      next_layer += layers_here;
    }
  }
  for (auto& [name, src] : found) {
    if (!src->experts.empty()) {
      for (size_t g = 0; g < src->experts.size(); ++g) {
        if (!src->experts[g]) fail("{}: no rank file holds expert {} of '{}'", directory_, g, name);
        for (int t = 0; t < tp; ++t)
          if (!src->experts[g]->shards[static_cast<size_t>(t)].first)
            fail("{}: tensor rank {} has no part of expert {} of '{}'", directory_, t, g, name);
      }
    } else {
      for (int t = 0; t < tp; ++t)
        if (!src->shards[static_cast<size_t>(t)].first)
          fail("{}: tensor rank {} has no '{}' although tensor rank 0 has", directory_, t, name);
    }
    params_[name] = src;
  }
  rename_moe_norms();
}

void MegatronCheckpoint::open_torch_optimizer(const std::map<std::pair<int, int>, std::string>& rank_dirs, int tp,
                                              int pp) {
  const TorchFile& first = *files_->rank_files[0][0];
  // The distributed optimizer: the rank file keeps its param groups, distrib_optim.pt (written by
  // data-parallel rank 0 of each model-parallel rank) the parameter state as flat buffers.
  if (path_exists(join_path(rank_dirs.at({0, 0}), "distrib_optim.pt"))) {
    distributed_optimizer_ = true;
    for (int p = 0; p < pp; ++p)
      for (int t = 0; t < tp; ++t) {
        const std::string path = join_path(rank_dirs.at({t, p}), "distrib_optim.pt");
        if (!path_exists(path)) fail("{} does not exist, but tensor rank 0 pipeline rank 0 has one", path);
        files_->torch_files.push_back(std::make_unique<TorchFile>(path));
        const TorchFile& f = *files_->torch_files.back();
        const PickleValue* coalesced = f.root().find("buckets_coalesced");
        if (!coalesced || !coalesced->is(PickleKind::boolean) || !coalesced->boolean) {
          optimizer_layout_ = "the torch format's distributed optimizer state in its older per-bucket layout";
          flat_.clear();
          return;
        }
        for (const auto& [g, by_dtype] : f.root().entries) {
          if (!g->is(PickleKind::integer)) continue;
          if (!by_dtype->is(PickleKind::dict) || by_dtype->entries.size() != 1)
            fail("{}: buffer {} holds {} dtypes; megatrain reads one", f.what(), g->integer, by_dtype->entries.size());
          const PickleValue& states = *by_dtype->entries[0].second;
          for (const char* state : {"param", "exp_avg", "exp_avg_sq"}) {
            const PickleValue* v = states.find(state);
            if (!v || !TorchFile::is_tensor(*v)) fail("{}: buffer {} has no '{}' tensor", f.what(), g->integer, state);
            auto src = std::make_shared<Source>();
            src->key = fmt::format("{} (buffer {})", state, g->integer);
            src->key_shape = {shape_numel(f.tensor_shape(*v, src->key))};
            src->shards = {{&f, v}};
            flat_[{{t + tp * p, static_cast<int>(g->integer), 0}, state}] = src;
          }
        }
      }
    optimizer_layout_ = "flat buckets";
    flat_coalesced_ = true;
    return;
  }
  const TorchOptimizer o = torch_optimizer(first.root());
  if (o.inner) optimizer_layout_ = "by index";
}

std::vector<MegatronCheckpoint::IndexedGroup> MegatronCheckpoint::indexed_groups(int tp, int pp) const {
  const TorchFile& f = *files_->rank_files.at(static_cast<size_t>(pp)).at(static_cast<size_t>(tp));
  const TorchOptimizer o = torch_optimizer(f.root());
  if (!o.inner) fail("{} holds no optimizer state", f.what());
  std::vector<IndexedGroup> out;
  for (const auto& g : o.inner->at("param_groups", f.what()).items) {
    IndexedGroup ig;
    if (const PickleValue* w = g->find("wd_mult"))
      ig.wd_mult = w->is(PickleKind::floating) ? w->floating : static_cast<double>(w->integer);
    if (const PickleValue* d = g->find("is_decoupled_lr")) ig.decoupled_lr = d->is(PickleKind::boolean) && d->boolean;
    const PickleValue* params = g->find("params");
    ig.size = params ? static_cast<int64_t>(params->items.size()) : 0;
    out.push_back(ig);
  }
  return out;
}

std::optional<HostArray> MegatronCheckpoint::read_indexed(int tp, const IndexedPiece& piece, const std::string& state) const {
  const TorchFile& f = *files_->rank_files.at(static_cast<size_t>(piece.pp)).at(static_cast<size_t>(tp));
  const TorchOptimizer o = torch_optimizer(f.root());
  if (!o.inner) fail("{} holds no optimizer state", f.what());
  const std::string what = fmt::format("{}: param group {} position {} ({})", f.what(), piece.group, piece.position, state);
  HostArray a;
  if (state == "fp32_param") {  // bf16 / fp16 models only
    const PickleValue* groups = o.wrapper->find("fp32_from_fp16_params");
    if (!groups || o.wrapper == o.inner) return std::nullopt;
    const PickleValue* g = groups->is(PickleKind::list) && piece.group < static_cast<int>(groups->items.size())
                               ? groups->items[static_cast<size_t>(piece.group)].get()
                               : nullptr;
    if (!g || piece.position >= static_cast<int64_t>(g->items.size())) fail("{}: no such main weights", what);
    a = f.tensor(*g->items[static_cast<size_t>(piece.position)], what);
  } else {
    int64_t index = piece.position;
    const std::vector<IndexedGroup> groups = indexed_groups(tp, piece.pp);
    for (int g = 0; g < piece.group; ++g) index += groups.at(static_cast<size_t>(g)).size;
    const PickleValue* entry = int_key(o.inner->at("state", f.what()), index);
    const PickleValue* v = entry ? entry->find(state) : nullptr;
    if (!v) fail("{}: the optimizer state has no '{}' for parameter index {}", what, state, index);
    a = f.tensor(*v, what);
  }
  if (a.shape != piece.local_shape)
    fail("{} is {}, but the parameter megatrain places there is {}: the checkpoint's parameter order is not the one "
         "megatrain derives",
         what, shape_text(a.shape), shape_text(piece.local_shape));
  return a;
}

namespace {

// A PyTorch Distributed Checkpoint's index (.metadata): every stored item's chunks by key.
struct DcpIndex {
  std::string meta_path;
  PickleRef meta;
  const PickleValue* sdm = nullptr;  // state_dict_metadata: key -> Tensor/BytesStorageMetadata
  std::map<std::string, std::vector<MegatronCheckpoint::Source::Chunk>> chunks;

  // A stored tensor: its global size and chunks (with each chunk's extent from .metadata, so that
  // reading a part opens only the chunks that hold it).
  std::shared_ptr<MegatronCheckpoint::Source> source(const std::string& key, const PickleValue& md) {
    auto src = std::make_shared<MegatronCheckpoint::Source>();
    src->key = key;
    src->key_shape = torch_size(md.at("size", meta_path + ": " + key), meta_path + ": size of " + key);
    src->chunks = chunks[key];
    if (src->chunks.empty()) fail("{}: '{}' has no stored chunks", meta_path, key);
    if (const PickleValue* listed = md.find("chunks"); listed && listed->is(PickleKind::list))
      for (const auto& cm : listed->items) {
        const PickleValue* o = cm->find("offsets");
        const PickleValue* z = cm->find("sizes");
        if (!o || !z) continue;
        const std::vector<int64_t> offsets = torch_size(*o, meta_path + ": chunk offsets of " + key);
        for (MegatronCheckpoint::Source::Chunk& c : src->chunks)
          if (c.offsets == offsets) c.sizes = torch_size(*z, meta_path + ": chunk sizes of " + key);
      }
    return src;
  }
  // A stored object (torch.save'd: DCP's bytes items), as a torch archive.
  std::unique_ptr<TorchFile> object(const std::string& key) {
    const auto& cs = chunks[key];
    if (cs.empty()) return nullptr;
    return std::make_unique<TorchFile>(cs[0].file, cs[0].offset, cs[0].length);
  }
};

DcpIndex read_dcp_index(const std::string& directory,
                        std::map<std::string, std::shared_ptr<const MappedFile>>& files) {
  DcpIndex x;
  x.meta_path = join_path(directory, ".metadata");
  if (!path_exists(x.meta_path)) fail("{} is missing: the checkpoint is incomplete", x.meta_path);
  const auto meta_file = std::make_shared<MappedFile>(x.meta_path);
  x.meta = read_pickle(meta_file->data(), meta_file->size(), x.meta_path);
  x.sdm = &x.meta->at("state_dict_metadata", x.meta_path);
  const PickleValue& storage = x.meta->at("storage_data", x.meta_path);
  auto file = [&](const std::string& rel) {
    auto& f = files[rel];
    if (!f) f = std::make_shared<MappedFile>(join_path(directory, rel));
    return f;
  };
  for (const auto& [index, info] : storage.entries) {
    const PickleValue* fqn = index->find("fqn");
    const PickleValue* rel = info->find("relative_path");
    const PickleValue* off = info->find("offset");
    const PickleValue* len = info->find("length");
    if (!fqn || !rel || !off || !len || !fqn->is(PickleKind::string) || !rel->is(PickleKind::string))
      fail("{}: a storage entry megatrain cannot read ({})", x.meta_path, index->describe());
    if (const PickleValue* t = info->find("transform_descriptors"); t && !t->items.empty())
      fail("{}: item '{}' is stored with transforms (compression?), which megatrain does not read", x.meta_path,
           fqn->text);
    MegatronCheckpoint::Source::Chunk c;
    c.file = file(rel->text);
    c.offset = static_cast<uint64_t>(off->integer);
    c.length = static_cast<uint64_t>(len->integer);
    if (const PickleValue* o = index->find("offset"); o && !o->is(PickleKind::none))
      c.offsets = torch_size(*o, x.meta_path + ": offset of " + fqn->text);
    x.chunks[fqn->text].push_back(std::move(c));
  }
  return x;
}

bool is_dcp_tensor(const PickleValue& md) {
  return md.is_object("torch.distributed.checkpoint.metadata.TensorStorageMetadata");
}

}  // namespace

void MegatronCheckpoint::open_torch_dist() {
  const std::string meta_json = join_path(directory_, "metadata.json");
  const std::string backend = read_text_file(meta_json);
  if (backend.find("torch_dist") == std::string::npos)
    fail("{} names a sharded backend other than torch_dist ({}): megatrain reads torch_dist and torch checkpoints",
         meta_json, backend);
  DcpIndex dcp = read_dcp_index(directory_, files_->distcp_files);
  const std::string& meta_path = dcp.meta_path;
  const PickleValue& sdm = *dcp.sdm;
  auto& chunks = dcp.chunks;

  // The args: common.pt (older Megatron) or the common_state item.
  std::unique_ptr<TorchFile>& common = files_->common;
  const std::string common_pt = join_path(directory_, "common.pt");
  if (path_exists(common_pt)) {
    common = std::make_unique<TorchFile>(common_pt);
  } else {
    for (const auto& [key, cs] : chunks)
      if (key.compare(0, 12, "common_state") == 0 && !cs.empty()) {
        common = dcp.object(key);
        break;
      }
  }
  if (!common) fail("{} holds neither common.pt nor a common_state item: the checkpoint is incomplete", directory_);
  const PickleValue* state = &common->root();
  if (state->is(PickleKind::list) && state->items.size() == 1) state = state->items[0].get();
  const PickleValue* args = state->find("args");
  if (!args || !args->is(PickleKind::object))
    fail("{} holds no saved args: megatrain needs them to rebuild the model", common->what());
  args_ = std::make_shared<PickleValue>(*args);
  common_ = std::make_shared<PickleValue>(*state);

  // Parameters (and optimizer states) under `prefix` + their model key; stacked layer tensors
  // become one entry per layer, the layers along the first dimension.
  // (Mixture of experts: mlp.experts.experts.linear_fc{1,2}.weight, [E, rows, cols] per layer, are
  // megatrain's mlp.experts.linear_fc{1,2}.weight, the experts stacked along the rows: read().)
  auto add = [&](std::map<std::string, std::shared_ptr<const Source>>& to, const std::string& prefix,
                 const std::string& key, std::string model_key, const PickleValue& md) {
    static const std::string experts = ".mlp.experts.experts.";
    if (const size_t at = model_key.find(experts); at != std::string::npos)
      model_key.replace(at, experts.size(), ".mlp.experts.");
    const std::shared_ptr<Source> src = dcp.source(key, md);
    static const std::string stacked = "decoder.layers.";
    if (model_key.compare(0, stacked.size(), stacked) == 0 && !megatron_split_layer_name(model_key)) {
      for (int64_t l = 0; l < src->key_shape[0]; ++l) {
        auto one = std::make_shared<Source>(*src);
        one->layer = static_cast<int>(l);
        to[prefix + fmt::format("decoder.layers.{}.{}", l, model_key.substr(stacked.size()))] = one;
      }
    } else {
      to[prefix + model_key] = src;
    }
  };
  static const std::string by_param = "optimizer.state.";
  // The distributed optimizer's flat buffers:
  // [chained_C.]optimizer.distributed.dp_group_idx_M.gbuf_idx_G.dtype_(PARAM, GRAD).bucket_idx_B.STATE
  static const std::regex flat_key(
      R"((?:chained_(\d+)\.)?optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_\(.*\)\.bucket_idx_(\d+)\.(\w+))");
  static const std::regex chained(R"(chained_\d+\.(optimizer\.distributed\..*))");
  for (const auto& [k, md] : sdm.entries) {
    if (!k->is(PickleKind::string)) continue;
    const std::string& key = k->text;
    std::smatch cm;
    const bool first_chain = key.compare(0, 10, "chained_0.") == 0;
    if (key.compare(0, 22, "optimizer.distributed.") == 0 ||
        (std::regex_match(key, cm, chained) && (first_chain || !files_->optimizer_groups))) {
      distributed_optimizer_ = true;
      // Its param groups (with the step): one object per model-parallel rank, the same on all.
      if (key.find(".optimizer/shard_") != std::string::npos && !chunks[key].empty() &&
          (!files_->optimizer_groups || key.find("dp_group_idx_0.") != std::string::npos)) {
        const Source::Chunk& c = chunks[key][0];
        files_->optimizer_groups = Files::Item{c.file, c.offset, c.length};
      }
    }
    if (!is_dcp_tensor(*md)) continue;
    if (key.find("_extra_state") != std::string::npos || key.compare(0, 5, "rng_s") == 0) continue;
    std::smatch m;
    if (std::regex_match(key, m, flat_key)) {
      const FlatBucket b{std::stoi(m[2].str()), std::stoi(m[3].str()), std::stoi(m[4].str()),
                         m[1].matched ? std::stoi(m[1].str()) : 0};
      const std::shared_ptr<Source> src = dcp.source(key, *md);
      if (src->key_shape.size() != 1) fail("{}: '{}' is not a flat buffer", meta_path, key);
      flat_[{b, m[5].str()}] = src;
      optimizer_layout_ = "flat buckets";
    } else if (key.compare(0, by_param.size(), by_param) == 0) {
      const size_t dot = key.find('.', by_param.size());
      if (dot == std::string::npos) continue;
      std::string state_name = key.substr(by_param.size(), dot - by_param.size());
      // The fully reshardable layout names the distributed optimizer's main weights "param".
      if (state_name == "param") {
        state_name = "fp32_param";
        distributed_optimizer_ = true;
      }
      if (state_name != "exp_avg" && state_name != "exp_avg_sq" && state_name != "fp32_param") continue;
      add(optim_, state_name + "/", key, key.substr(dot + 1), *md);
      if (optimizer_layout_ == "none") optimizer_layout_ = "by parameter";
    } else if (key.compare(0, 10, "optimizer.") != 0) {
      add(params_, "", key, key, *md);
    }
  }
  if (optimizer_layout_ == "none" && distributed_optimizer_)
    optimizer_layout_ = "the distributed optimizer's state in a layout megatrain does not recognise";
  rename_mla_local_norms();
  rename_moe_norms();
}

namespace {

// torch_dcp (--use-torch-fsdp2): the stored name of the parameter each optimizer index belongs to.
// torch numbers the parameters of its param groups in turn; Megatron-LM's groups take the model's
// parameters in state-dict order, each to the group of its weight decay (none for biases and 1-D
// parameters), decoupled learning rate (the embedding and output layer with --decoupled-lr) and, where
// the groups tell experts apart, expert parallelism. Empty, with `why`, when the saved groups do not
// fit that reading (each group's "params" list must be filled exactly, every state's shape its
// parameter's).
std::vector<std::string> indexed_parameter_names(
    DcpIndex& dcp, const std::vector<std::pair<std::string, const PickleValue*>>& model_params, std::string* why) {
  struct Group {
    bool decay = true, expert = false, decoupled = false;
    std::vector<int64_t> params;
    size_t filled = 0;
  };
  std::vector<Group> groups;
  for (int g = 0;; ++g) {
    const std::string base = fmt::format("optimizer.param_groups.{}.", g);
    const std::unique_ptr<TorchFile> params = dcp.object(base + "params");
    if (!params) break;
    Group group;
    for (const auto& v : params->root().items) group.params.push_back(v->integer);
    auto flag = [&](const char* field, bool fallback) {
      const std::unique_ptr<TorchFile> f = dcp.object(base + field);
      if (!f) return fallback;
      const PickleValue& v = f->root();
      return v.is(PickleKind::boolean) ? v.boolean : v.is(PickleKind::floating) ? v.floating != 0 : fallback;
    };
    group.decay = flag("wd_mult", true);
    group.expert = flag("is_expert_parallel", false);
    group.decoupled = flag("is_decoupled_lr", false);
    groups.push_back(std::move(group));
  }
  if (groups.empty()) {
    *why = "no param groups";
    return {};
  }
  const bool experts_apart = std::any_of(groups.begin(), groups.end(), [](const Group& g) { return g.expert; });
  std::map<std::string, std::vector<int64_t>> state_shapes;  // "optimizer.state.<i>.<state>"
  for (const auto& [k, md] : dcp.sdm->entries)
    if (k->is(PickleKind::string) && k->text.starts_with("optimizer.state.") && is_dcp_tensor(*md))
      state_shapes[k->text] = torch_size(md->at("size", dcp.meta_path), dcp.meta_path + ": size of " + k->text);
  std::vector<std::string> names;
  for (const auto& [name, md] : model_params) {
    const std::vector<int64_t> shape = torch_size(md->at("size", dcp.meta_path), dcp.meta_path + ": size of " + name);
    const bool decay = shape.size() > 1 && !name.ends_with(".bias");
    const bool expert = experts_apart && name.find(".mlp.experts.") != std::string::npos;
    const bool decoupled = false;  // (--decoupled-lr: not read yet; a group that has it matches nothing)
    auto g = std::find_if(groups.begin(), groups.end(), [&](const Group& x) {
      return x.decay == decay && x.expert == expert && x.decoupled == decoupled;
    });
    if (g == groups.end() || g->filled == g->params.size()) {
      *why = fmt::format("no param group with room for '{}'", name);
      return {};
    }
    const int64_t index = g->params[g->filled++];
    if (index < 0) {
      *why = "a negative parameter index";
      return {};
    }
    if (names.size() <= static_cast<size_t>(index)) names.resize(static_cast<size_t>(index) + 1);
    names[static_cast<size_t>(index)] = name;
    // every state of the parameter has its shape
    for (const char* state : {"exp_avg", "exp_avg_sq"}) {
      const auto it = state_shapes.find(fmt::format("optimizer.state.{}.{}", index, state));
      if (it != state_shapes.end() && it->second != shape) {
        *why = fmt::format("{} is not shaped as '{}'", it->first, name);
        return {};
      }
    }
  }
  for (const Group& g : groups)
    if (g.filled != g.params.size()) {
      *why = "a param group lists more parameters than the model has";
      return {};
    }
  if (std::any_of(names.begin(), names.end(), [](const std::string& n) { return n.empty(); })) {
    *why = "the param groups skip an index";
    return {};
  }
  return names;
}

}  // namespace

// Megatron-FSDP's format (megatron/core/transformer/fsdp_dtensor_checkpoint.py): a PyTorch
// Distributed Checkpoint of the wrapped model's own state dict without Megatron's metadata.json.
// One global tensor per parameter under its module path ("model." and the wrappers' "module."s
// first), every layer its own key, the local spec's module names; SwiGLU's linear_fc1 split into
// its halves (weight_w the gate's rows, weight_v the up projection's); each expert its own tensor
// (linear_fc1.weight<e>, or local_experts.<e>.linear_fc1.weight), numbered globally. The weights
// are the main (float32) weights. Adam's state by the same paths under "optimizer.state." (exp_avg,
// exp_avg_sq and step per parameter); args, iteration and the scheduler's fields
// ("opt_param_scheduler.<field>") are torch.save'd objects of their own.
void MegatronCheckpoint::open_fsdp_dtensor() {
  DcpIndex dcp = read_dcp_index(directory_, files_->distcp_files);
  // (torch FSDP2's torch_dcp format shares the container: its model keys lack the wrappers'
  // "module.", its optimizer state is keyed by index)
  bool wrapped = false, unwrapped = false;
  static const std::regex virtual_stage(R"(^model\d+\.)");
  for (const auto& [k, md] : dcp.sdm->entries) {
    if (!k->is(PickleKind::string)) continue;
    if (k->text.starts_with("model.")) {
      wrapped = wrapped || k->text.starts_with("model.module.");
      unwrapped = unwrapped || !k->text.starts_with("model.module.");
    }
    if (std::regex_search(k->text, virtual_stage))
      throw Unsupported(fmt::format("{} holds virtual pipeline stages ('{}'), which megatrain does not read in "
                                    "Megatron-LM's FSDP formats yet: save it in torch_dist",
                                    directory_, k->text.substr(0, k->text.find('.'))));
  }
  if (unwrapped && !wrapped) format_ = "torch_dcp";
  auto object = [&](const std::string& key) -> PickleRef {
    const std::unique_ptr<TorchFile> f = dcp.object(key);
    return f ? std::make_shared<PickleValue>(f->root()) : nullptr;
  };
  args_ = object("args");
  if (!args_ || !args_->is(PickleKind::object))
    fail("{} holds no saved args (an 'args' item): megatrain needs them to rebuild the model", directory_);
  // The common state as torch_dist's: {iteration, num_floating_point_operations_so_far,
  // opt_param_scheduler: {field: value}}.
  const PickleRef common = pickle_dict(), scheduler = pickle_dict();
  static const std::string scheduler_prefix = "opt_param_scheduler.";
  for (const auto& [k, md] : dcp.sdm->entries) {
    if (!k->is(PickleKind::string) || is_dcp_tensor(*md)) continue;
    const std::string& key = k->text;
    if (key.compare(0, scheduler_prefix.size(), scheduler_prefix) == 0)
      pickle_set(*scheduler, key.substr(scheduler_prefix.size()), object(key));
    else if (key == "iteration" || key == "num_floating_point_operations_so_far" || key == "checkpoint_version")
      pickle_set(*common, key, object(key));
  }
  if (!scheduler->entries.empty()) pickle_set(*common, "opt_param_scheduler", scheduler);
  common_ = common;

  // Each stored tensor under megatrain's name ("" the weights, else "<state>/"): a SwiGLU half is
  // one of the two row blocks of its parameter, an expert one of its layer's stacked experts.
  static const std::regex model_key(R"(model\.(?:module\.)*(.+))");
  static const std::regex optim_key(R"(optimizer\.state\.(?:module\.)*(.+)\.(exp_avg|exp_avg_sq|step))");
  static const std::regex glu_half(R"((.*\.linear_fc1\.(?:weight|bias)\d*)_([wv]))");
  std::map<std::string, std::shared_ptr<Source>> found;
  auto add = [&](const std::string& prefix, std::string name, std::shared_ptr<Source> src) {
    if (prefix == "step/") {  // one scalar per stored tensor, kept as it is (optimizer_step)
      found[prefix + name] = std::move(src);
      return;
    }
    int half = -1;
    std::smatch m;
    if (std::regex_match(name, m, glu_half)) {
      half = m[2].str() == "w" ? 0 : 1;
      name = m[1].str();
    }
    const auto split = split_layer_head(name);
    const std::string head = split ? split->first : std::string(), rest = split ? split->second : name;
    std::shared_ptr<Source>* slot = nullptr;
    if (const auto expert = head.empty() ? std::nullopt : torch_local_expert(rest)) {
      std::shared_ptr<Source>& stack = found[prefix + head + expert->first];
      if (!stack) stack = std::make_shared<Source>();
      if (stack->experts.size() <= static_cast<size_t>(expert->second))
        stack->experts.resize(static_cast<size_t>(expert->second) + 1);
      slot = &stack->experts[static_cast<size_t>(expert->second)];
    } else {
      slot = &found[prefix + head + (head.empty() ? rest : megatron_te_layer_name(rest))];
    }
    if (half < 0) {
      *slot = std::move(src);
      return;
    }
    if (!*slot) *slot = std::make_shared<Source>();
    (*slot)->experts.resize(2);
    (*slot)->experts[static_cast<size_t>(half)] = std::move(src);
  };
  // torch_dcp: torch's optimizer state dict, keyed by each parameter's index in the param groups
  // (the model's parameters in state-dict order, each group's in turn: indexed_parameter_names).
  std::vector<std::pair<std::string, const PickleValue*>> model_params;  // stored name, metadata
  static const std::regex indexed_key(R"(optimizer\.state\.(\d+)\.(exp_avg|exp_avg_sq|step))");
  std::vector<std::pair<std::smatch, const PickleValue*>> indexed;
  for (const auto& [k, md] : dcp.sdm->entries) {
    if (!k->is(PickleKind::string) || !is_dcp_tensor(*md)) continue;
    const std::string& key = k->text;
    if (key.find("_extra_state") != std::string::npos) continue;
    std::smatch m;
    if (std::regex_match(key, m, model_key)) {
      add("", m[1].str(), dcp.source(key, *md));
      if (!key.ends_with(".expert_bias")) model_params.emplace_back(m[1].str(), md.get());  // (a router buffer)
    } else if (format_ == "torch_dcp" && std::regex_match(key, m, indexed_key)) {
      indexed.emplace_back(m, md.get());
    } else if (format_ == "fsdp_dtensor" && std::regex_match(key, m, optim_key)) {
      add(m[2].str() + "/", m[1].str(), dcp.source(key, *md));
    }
  }
  if (!indexed.empty()) {
    std::string why;
    const std::vector<std::string> names = indexed_parameter_names(dcp, model_params, &why);
    if (names.empty()) {
      optimizer_layout_ = "torch_dcp's optimizer state keyed by parameter index, which megatrain cannot place here (" +
                          why + ")";
    } else {
      for (const auto& [m, md] : indexed) {
        const size_t i = std::stoul(m[1].str());
        if (i >= names.size()) fail("{}: optimizer state {} is past the {} parameters", directory_, i, names.size());
        add(m[2].str() + "/", names[i], dcp.source(m[0].str(), *md));
      }
    }
  }
  for (auto& [key, src] : found) {
    for (size_t i = 0; i < src->experts.size(); ++i) {
      const std::shared_ptr<Source>& part = src->experts[i];
      if (!part || std::any_of(part->experts.begin(), part->experts.end(), [](const auto& h) { return !h; }))
        fail("{}: '{}' lacks {}", directory_, key,
             !part ? fmt::format("expert {} (or a SwiGLU half)", i) : std::string("one of expert ") +
                                                                         std::to_string(i) + "'s SwiGLU halves");
    }
    const size_t slash = key.find('/');
    if (slash == std::string::npos) {
      params_[key] = src;
      optim_["fp32_param/" + key] = src;  // the weights are the main weights
    } else {
      optim_[key] = src;
    }
  }
  if (params_.empty()) fail("{} holds no model weights ('model.' items): not a Megatron-FSDP checkpoint", directory_);
  distributed_optimizer_ = true;
  if (std::any_of(optim_.begin(), optim_.end(), [](const auto& e) { return e.first.compare(0, 8, "exp_avg/") == 0; }))
    optimizer_layout_ = "by parameter";
  rename_mla_local_norms();
  rename_moe_norms();
}

// Renames the keys of the transformer layers' weights and optimizer states (the decoder's and the
// multi-token prediction depths'): `to(head, rest)` gives a key's new rest after its layer's head
// ("decoder.layers.<layer>." or "mtp.layers.<depth>.transformer_layer."), or nullopt to keep it.
void MegatronCheckpoint::rename_layer_keys(
    const std::function<std::optional<std::string>(const std::string&, const std::string&)>& to) {
  const auto rename_in = [&](std::map<std::string, std::shared_ptr<const Source>>& map, const std::string& prefix) {
    std::vector<std::pair<std::string, std::string>> moves;
    for (const auto& [key, src] : map) {
      if (key.compare(0, prefix.size(), prefix) != 0) continue;
      const auto split = split_layer_head(key.substr(prefix.size()));
      if (!split) continue;
      const auto& [head, rest] = *split;
      if (const std::optional<std::string> renamed = to(head, rest)) moves.emplace_back(key, prefix + head + *renamed);
    }
    for (const auto& [from, dest] : moves) {
      auto node = map.extract(from);
      node.key() = dest;
      map.insert(std::move(node));
    }
  };
  for (const char* state : {"exp_avg/", "exp_avg_sq/", "fp32_param/"}) rename_in(optim_, state);
  rename_in(params_, "");
}

// A mixture-of-experts layer's pre-MLP norm is a norm of its own (megatrain's pre_mlp_layernorm, as
// Transformer Engine's spec names it), which the local spec's checkpoints (torch_dist's key map, and
// the torch format as read here: open_torch) call linear_fc1's fused norm as in dense layers.
void MegatronCheckpoint::rename_moe_norms() {
  static const std::string fused = "mlp.linear_fc1.layer_norm_";
  rename_layer_keys([&](const std::string& head, const std::string& rest) -> std::optional<std::string> {
    if (rest.compare(0, fused.size(), fused) != 0) return std::nullopt;
    if (!params_.count(head + "mlp.router.weight")) return std::nullopt;  // not MoE
    return "pre_mlp_layernorm." + rest.substr(fused.size());
  });
}

// Megatron-Core's local layer spec keys the norms of multi-latent-attention layers by their modules
// (it has no key map for them, unlike for its dense attention): q_layernorm and kv_layernorm are the
// Transformer Engine spec's fused norms of the up projections, and a dense MLP's pre_mlp_layernorm
// is linear_fc1's. Renamed to those (megatrain's names) in the weights and the optimizer states.
void MegatronCheckpoint::rename_mla_local_norms() {
  struct Rule {
    const char *from, *to, *needs;
  };
  static const Rule rules[] = {
      {"self_attention.q_layernorm.", "self_attention.linear_q_up_proj.layer_norm_", "self_attention.linear_q_up_proj.weight"},
      {"self_attention.kv_layernorm.", "self_attention.linear_kv_up_proj.layer_norm_",
       "self_attention.linear_kv_up_proj.weight"},
      {"pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_", "mlp.linear_fc1.weight"}};
  rename_layer_keys([&](const std::string& head, const std::string& rest) -> std::optional<std::string> {
    if (!params_.count(head + "self_attention.linear_kv_down_proj.weight")) return std::nullopt;  // not an MLA layer
    for (const Rule& r : rules) {
      const std::string from = r.from;
      if (rest.compare(0, from.size(), from) == 0 && params_.count(head + r.needs))
        return r.to + rest.substr(from.size());
    }
    return std::nullopt;
  });
}

std::map<MegatronCheckpoint::FlatBucket, int64_t> MegatronCheckpoint::flat_buckets() const {
  std::map<FlatBucket, int64_t> out;
  for (const auto& [id, src] : flat_)
    if (id.second == "param") out[id.first] = src->key_shape[0];
  return out;
}

struct MegatronCheckpoint::Placement {
  // Each TP rank's shard of a state ("exp_avg", "exp_avg_sq", "fp32_param"); nullopt when the
  // checkpoint keeps none of that state.
  std::vector<PieceReader> readers;
  std::vector<int64_t> global_shape;
  std::vector<ShardIndex> shards;  // by TP rank
};

void MegatronCheckpoint::place(const std::string& name, std::vector<PieceReader> readers,
                               std::vector<int64_t> global_shape, std::vector<ShardIndex> shards) {
  MT_CHECK(readers.size() == shards.size(), "'{}': {} shards for {} TP ranks", name, shards.size(), readers.size());
  auto p = std::make_shared<Placement>();
  p->readers = std::move(readers);
  p->global_shape = std::move(global_shape);
  p->shards = std::move(shards);
  placements_[name] = std::move(p);
}

void MegatronCheckpoint::set_flat_placement(const std::string& name, std::vector<FlatPiece> pieces,
                                            std::vector<int64_t> global_shape, std::vector<ShardIndex> shards) {
  std::vector<PieceReader> readers;
  for (const FlatPiece& piece : pieces)
    readers.push_back([this, piece](const std::string& state) -> std::optional<HostArray> {
      return read_flat(piece, state == "fp32_param" ? "param" : state);
    });
  place(name, std::move(readers), std::move(global_shape), std::move(shards));
}

void MegatronCheckpoint::set_indexed_placement(const std::string& name, std::vector<IndexedPiece> pieces,
                                               std::vector<int64_t> global_shape, std::vector<ShardIndex> shards) {
  std::vector<PieceReader> readers;
  for (size_t t = 0; t < pieces.size(); ++t)
    readers.push_back([this, t, piece = pieces[t]](const std::string& state) {
      return read_indexed(static_cast<int>(t), piece, state);
    });
  place(name, std::move(readers), std::move(global_shape), std::move(shards));
}

HostArray MegatronCheckpoint::read_flat(const FlatPiece& piece, const std::string& state) const {
  const FlatBucket& b = piece.bucket;
  const std::string what = fmt::format("{} of {}dp_group_idx_{}.gbuf_idx_{}.bucket_idx_{}", state,
                                       b.chain > 0 ? fmt::format("chained_{}.", b.chain) : std::string(), b.mp_rank,
                                       b.gbuf, b.bucket);
  auto it = flat_.find({b, state});
  if (it == flat_.end()) fail("{} has no optimizer buffer {}", directory_, what);
  const Source& s = *it->second;
  if (piece.offset < 0 || piece.count < 0 || piece.offset + piece.count > s.key_shape[0])
    fail("{}: elements [{}, {}) lie outside {} ({} elements)", directory_, piece.offset, piece.offset + piece.count, what,
         s.key_shape[0]);
  if (!s.shards.empty()) return s.shards[0].first->tensor_range(*s.shards[0].second, what, piece.offset, piece.count);
  return read_region(s, {piece.offset}, {piece.count}, what);
}

std::optional<HostArray> MegatronCheckpoint::optimizer_state(const std::string& state, const std::string& name) const {
  if (auto pl = placements_.find(name); pl != placements_.end()) {
    const Placement& p = *pl->second;
    HostArray out;
    for (size_t t = 0; t < p.readers.size(); ++t) {
      std::optional<HostArray> read = p.readers[t](state);
      if (!read) return std::nullopt;
      const HostArray& piece = *read;
      if (t == 0) out = HostArray::zeros(piece.dtype, p.global_shape);
      if (piece.dtype != out.dtype) fail("{}: the {} shards of '{}' differ in dtype", directory_, state, name);
      const ShardIndex& sh = p.shards[t];
      if (piece.numel() != sh.local_numel())
        fail("{}: the {} shard of '{}' on tensor rank {} has {} elements, not {}", directory_, state, name, t,
             piece.numel(), sh.local_numel());
      place_shard(out, sh, piece);
    }
    return out;
  }
  auto it = optim_.find(state + "/" + name);
  if (it == optim_.end()) return std::nullopt;
  return read(*it->second, "optimizer.state." + state + "." + name);
}

namespace {

// A scalar saved as a one-element tensor or a Python number (Adam's step, which Megatron also copies
// with .item(); the loss scaler's state).
double scalar_value(const HostArray& a, const std::string& what) {
  if (a.numel() != 1) fail("{} is not a scalar", what);
  switch (a.dtype) {
    case DType::i64: return static_cast<double>(a.ptr<int64_t>()[0]);
    case DType::i32: return a.ptr<int32_t>()[0];
    case DType::f32: return a.ptr<float>()[0];
    case DType::f64: return a.ptr<double>()[0];
    default: fail("{} has dtype {}", what, dtype_name(a.dtype));
  }
}

double scalar_value(const PickleValue& v, const TorchFile& file, const std::string& what) {
  if (v.is(PickleKind::integer)) return static_cast<double>(v.integer);
  if (v.is(PickleKind::floating)) return v.floating;
  return scalar_value(file.tensor(v, what), what);
}

int64_t step_value(const PickleValue& v, const TorchFile& file, const std::string& what) {
  return static_cast<int64_t>(scalar_value(v, file, what));
}

// The distributed optimizer keeps Adam's step in every param group (torch's optimizer state dict
// without "state"); groups without parameters may lack it. nullopt when no group has one.
std::optional<int64_t> param_groups_step(const PickleValue& optimizer, const TorchFile& file, const std::string& where) {
  const PickleValue* groups = optimizer.find("param_groups");
  if (!groups || !groups->is(PickleKind::list)) return std::nullopt;
  std::optional<int64_t> step;
  for (const auto& g : groups->items) {
    const PickleValue* v = g->find("step");
    if (!v || v->is(PickleKind::none)) continue;
    const int64_t s = step_value(*v, file, where + ": a param group's step");
    if (step && *step != s) fail("{}: the param groups disagree on the step ({} and {})", where, *step, s);
    step = s;
  }
  return step;
}

// Megatron's ChainedOptimizer saves one state per optimizer, keyed 0, 1, ... (with expert parallelism
// the dense parameters' optimizer, then the routed experts'; their steps are kept equal): the
// first, or `opt` itself when it is not chained.
const PickleValue* first_chained(const PickleValue* opt) {
  if (!opt || !opt->is(PickleKind::dict)) return opt;
  for (const auto& [k, v] : opt->entries)
    if (k->is(PickleKind::integer) && k->integer == 0) return v.get();
  return opt;
}

}  // namespace

std::optional<int64_t> MegatronCheckpoint::optimizer_step() const {
  if (format_ == "torch") {
    const TorchFile& f = *files_->rank_files[0][0];
    const TorchOptimizer o = torch_optimizer(f.root());
    if (!o.inner) return std::nullopt;
    if (distributed_optimizer_) return param_groups_step(*o.inner, f, f.what());
    // torch's Adam keeps the step with each parameter's state: all the same.
    const PickleValue* state = o.inner->find("state");
    std::optional<int64_t> step;
    if (state)
      for (const auto& [k, entry] : state->entries)
        if (const PickleValue* v = entry->find("step")) {
          const int64_t s = step_value(*v, f, f.what() + ": a parameter's step");
          if (step && *step != s) fail("{}: the parameters' steps differ ({} and {})", f.what(), *step, s);
          step = s;
        }
    return step;
  }
  if (format_ == "fsdp_dtensor" || format_ == "torch_dcp") {  // Adam's step with each parameter's state: all the same
    std::optional<int64_t> step;
    for (const auto& [key, src] : optim_) {
      if (key.compare(0, 5, "step/") != 0) continue;
      const std::string what = fmt::format("{}: the step of '{}'", directory_, key.substr(5));
      const int64_t s = static_cast<int64_t>(scalar_value(read(*src, what), what));
      if (step && *step != s) fail("{}: the parameters' steps differ ({} and {})", directory_, *step, s);
      step = s;
    }
    return step;
  }
  const std::string where = directory_ + "'s common state";
  if (!common_) fail("{} has no common state with the optimizer's step", directory_);
  // {"optimizer": {"optimizer": {"state": {"common_step": ...}, "param_groups": ...}}} (the outer
  // level is Megatron's mixed-precision wrapper around torch's optimizer state dict).
  const PickleValue* opt = first_chained(common_->find("optimizer"));
  if (opt && !opt->find("state") && !opt->find("param_groups") && opt->find("optimizer")) opt = opt->find("optimizer");
  if (!distributed_optimizer_) {
    if (!opt) fail("{} has no optimizer state", where);
    const PickleValue* state = opt->find("state");
    const PickleValue* found = state ? state->find("common_step") : nullptr;
    if (!found) return std::nullopt;  // an optimizer that never stepped (e.g. a format conversion's)
    return step_value(*found, *files_->common, where + ": optimizer.state.common_step");
  }
  // Fully reshardable: the param groups are in the common state. Flat buckets: in a stored
  // object per model-parallel rank.
  if (opt)
    if (std::optional<int64_t> step = param_groups_step(*opt, *files_->common, where)) return step;
  if (!files_->optimizer_groups) return std::nullopt;
  const Files::Item& item = *files_->optimizer_groups;
  const TorchFile groups(item.file, item.offset, item.length);
  const PickleValue* root = &groups.root();  // a one-element list, as DCP stores objects
  if (root->is(PickleKind::list) && root->items.size() == 1) root = root->items[0].get();
  return param_groups_step(*root, groups, groups.what());
}

std::optional<MegatronCheckpoint::GradScalerState> MegatronCheckpoint::grad_scaler() const {
  // Megatron's mixed-precision wrapper saves {"optimizer": torch's state dict, "grad_scaler": ...,
  // "fp32_from_fp16_params": ...}: the torch format in each rank file (the first one read here),
  // torch_dist in the common state.
  const bool torch_format = format_ == "torch";
  const TorchFile* file = torch_format ? files_->rank_files[0][0] : files_->common.get();
  const PickleValue* root = torch_format ? &file->root() : common_.get();
  if (!file || !root) return std::nullopt;
  const std::string where = torch_format ? file->what() : directory_ + "'s common state";
  const PickleValue* opt = first_chained(root->find("optimizer"));
  const PickleValue* scaler = opt ? opt->find("grad_scaler") : nullptr;
  if (!scaler || scaler->is(PickleKind::none)) return std::nullopt;
  auto number = [&](const char* key) {
    return scalar_value(scaler->at(key, where + ": optimizer.grad_scaler"), *file,
                        where + ": optimizer.grad_scaler." + key);
  };
  GradScalerState s;
  s.scale = number("scale");
  s.growth_tracker = static_cast<int64_t>(number("growth_tracker"));
  s.hysteresis_tracker = static_cast<int64_t>(number("hysteresis_tracker"));
  return s;
}

std::vector<std::string> MegatronCheckpoint::parameter_names() const {
  std::vector<std::string> out;
  for (const auto& [name, src] : params_) out.push_back(name);
  return out;
}

HostArray MegatronCheckpoint::parameter(const std::string& name) const {
  auto it = params_.find(name);
  if (it == params_.end()) fail("the Megatron-LM checkpoint {} has no parameter '{}'", directory_, name);
  return read(*it->second, name);
}

HostArray MegatronCheckpoint::read(const Source& s, const std::string& name) const {
  if (!s.experts.empty()) {  // (torch) experts stacked along the rows (biases: one after another)
    std::vector<HostArray> parts;
    for (const auto& e : s.experts) parts.push_back(read(*e, name));
    const HostArray& p0 = parts[0];
    for (const HostArray& p : parts)
      if (p.dtype != p0.dtype || p.shape != p0.shape || p.shape.empty() || p.shape.size() > 2)
        fail("{}: the experts of '{}' differ in shape or dtype ({} and {})", directory_, name, shape_text(p0.shape),
             shape_text(p.shape));
    std::vector<int64_t> shape = p0.shape;
    shape[0] *= static_cast<int64_t>(parts.size());
    HostArray out = HostArray::zeros(p0.dtype, shape);
    for (size_t g = 0; g < parts.size(); ++g)
      std::memcpy(out.bytes.data() + g * p0.bytes.size(), parts[g].bytes.data(), p0.bytes.size());
    return out;
  }
  if (format_ == "torch") {
    std::vector<HostArray> parts;
    for (const auto& [file, value] : s.shards) parts.push_back(file->tensor(*value, name));
    if (s.join == MegatronTpSplit::replicated || parts.size() == 1) return std::move(parts[0]);
    const HostArray& p0 = parts[0];
    for (const HostArray& p : parts)
      if (p.dtype != p0.dtype || p.shape != p0.shape)
        fail("{}: the tensor-parallel shards of '{}' differ in shape or dtype ({} and {})", directory_, name,
             shape_text(p0.shape), shape_text(p.shape));
    const int tp = static_cast<int>(parts.size());
    std::vector<int64_t> global_shape = p0.shape;
    const size_t split_dim = s.join == MegatronTpSplit::columns ? 1 : 0;
    if (global_shape.size() <= split_dim || global_shape.size() > 2)
      fail("{}: '{}' is {}, not split as Megatron splits it", directory_, name, shape_text(global_shape));
    global_shape[split_dim] *= tp;
    HostArray out = HostArray::zeros(p0.dtype, global_shape);
    for (int t = 0; t < tp; ++t)
      place_shard(out, megatron_tp_shard(s.join, global_shape, tp, t, name), parts[static_cast<size_t>(t)]);
    return out;
  }
  // torch_dist: one layer of a stacked tensor, or all of it.
  std::vector<int64_t> offsets(s.key_shape.size(), 0);
  std::vector<int64_t> region = s.key_shape;
  if (s.layer >= 0) {
    offsets[0] = s.layer;
    region[0] = 1;
  }
  HostArray out = read_region(s, offsets, region, s.layer >= 0 ? fmt::format("'{}' (layer {})", s.key, s.layer)
                                                                : "'" + s.key + "'");
  if (s.layer >= 0) out.shape.erase(out.shape.begin());  // drop the layer dimension
  if (name.find(".mlp.experts.") != std::string::npos && out.shape.size() == 3)  // [E, rows, cols]: stacked rows
    out.shape = {out.shape[0] * out.shape[1], out.shape[2]};
  if (name.find(".mlp.experts.") != std::string::npos && name.ends_with(".bias") && out.shape.size() == 2)
    out.shape = {out.shape[0] * out.shape[1]};  // the experts' biases [E, n]: one after another
  return out;
}

HostArray MegatronCheckpoint::read_region(const Source& s, const std::vector<int64_t>& offsets,
                                          const std::vector<int64_t>& region, const std::string& what) const {
  // Assembled from the chunks that overlap it; a chunk whose extent .metadata lists is opened
  // only when it does.
  auto overlap = [&](const std::vector<int64_t>& at, const std::vector<int64_t>& size) {
    int64_t n = 1;
    for (size_t d = 0; d < region.size(); ++d)
      n *= std::max<int64_t>(0, std::min(at[d] + size[d], offsets[d] + region[d]) - std::max(at[d], offsets[d]));
    return n;
  };
  HostArray out;
  bool first = true;
  int64_t covered = 0;
  for (const Source::Chunk& c : s.chunks) {
    if (c.offsets.size() != s.key_shape.size())
      fail("{}: a chunk of '{}' has {} offsets for {} dimensions", directory_, s.key, c.offsets.size(), s.key_shape.size());
    if (!c.sizes.empty() && overlap(c.offsets, c.sizes) == 0) continue;
    const TorchFile chunk_file(c.file, c.offset, c.length);
    const std::vector<int64_t> chunk_shape = chunk_file.tensor_shape(chunk_file.root(), s.key);
    if (chunk_shape.size() != region.size())
      fail("{}: a chunk of '{}' has {} dimensions, not {}", directory_, s.key, chunk_shape.size(), region.size());
    const int64_t n = overlap(c.offsets, chunk_shape);
    if (n == 0) continue;
    const HostArray chunk = chunk_file.tensor(chunk_file.root(), s.key);
    if (region.empty()) return chunk;  // a scalar (fsdp_dtensor's steps): its one chunk
    if (first) {
      out = HostArray::zeros(chunk.dtype, region);
      first = false;
    } else if (chunk.dtype != out.dtype) {
      fail("{}: the chunks of '{}' have different dtypes", directory_, s.key);
    }
    covered += n;
    copy_overlap(chunk, c.offsets, out, offsets);
  }
  if (first || covered != shape_numel(region))
    fail("{}: the stored chunks of {} cover {} of the {} elements read", directory_, what, covered, shape_numel(region));
  return out;
}

}  // namespace mt
