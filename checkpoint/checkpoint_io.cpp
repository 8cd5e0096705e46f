#include "checkpoint/checkpoint_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <set>

#include "checkpoint/file_io.h"
#include "checkpoint/safetensors.h"
#include "core/config.h"
#include "core/crc32c.h"
#include "core/error.h"
#include "core/log.h"
#include "core/sha256.h"
#include "core/shape_text.h"

namespace mt {

using nlohmann::json;

namespace {

constexpr const char* kFormatName = "megatrain-checkpoint";
constexpr const char* kManifestName = "manifest.json";

std::string rank_file_name(int rank, CheckpointKind kind) {
  return fmt::format("rank_{:05d}-{}.safetensors", rank, checkpoint_kind_name(kind));
}
std::string part_manifest_name(int rank) { return fmt::format("rank_{:05d}.part.json", rank); }

CheckpointKind parse_kind(const std::string& s, const std::string& where) {
  for (CheckpointKind k : {CheckpointKind::model, CheckpointKind::main_params, CheckpointKind::optimizer})
    if (s == checkpoint_kind_name(k)) return k;
  fail("{}: unknown tensor kind '{}'", where, s);
}

std::string crc_hex(uint32_t c) { return fmt::format("{:08x}", c); }

json slice_to_json(const ShardSlice& s) {
  const ShardIndex& b = s.block;
  json j{{"global_rows", b.global_rows}, {"global_cols", b.global_cols}, {"row_offset", b.row_offset},
         {"col_offset", b.col_offset},   {"local_rows", b.local_rows},   {"local_cols", b.local_cols},
         {"chunks", b.chunks},           {"flat_begin", s.flat_begin},   {"flat_count", s.count()}};
  if (b.chunk_offset != 0 || b.chunk_count != 0) {  // (a block of some chunks: an expert-parallel rank's experts)
    j["chunk_offset"] = b.chunk_offset;
    j["chunk_count"] = b.chunk_count;
  }
  return j;
}

ShardSlice slice_from_json(const json& j) {
  ShardSlice s;
  ShardIndex& b = s.block;
  b.global_rows = j.at("global_rows").get<int64_t>();
  b.global_cols = j.at("global_cols").get<int64_t>();
  b.row_offset = j.at("row_offset").get<int64_t>();
  b.col_offset = j.at("col_offset").get<int64_t>();
  b.local_rows = j.at("local_rows").get<int64_t>();
  b.local_cols = j.at("local_cols").get<int64_t>();
  b.chunks = j.at("chunks").get<int64_t>();
  b.chunk_offset = j.value("chunk_offset", int64_t{0});
  b.chunk_count = j.value("chunk_count", int64_t{0});
  s.flat_begin = j.at("flat_begin").get<int64_t>();
  s.flat_count = j.at("flat_count").get<int64_t>();
  return s;
}

// Checks a slice's geometry; `what` names it in the message.
void check_slice(const ShardSlice& s, const std::string& what) {
  const ShardIndex& b = s.block;
  const bool ok = b.global_rows >= 0 && b.global_cols >= 0 && b.chunks >= 1 && b.global_rows % b.chunks == 0 &&
                  b.chunk_offset >= 0 && b.chunk_count >= 0 && b.chunk_offset + b.local_chunks() <= b.chunks &&
                  b.local_chunks() >= 1 &&
                  b.row_offset >= 0 && b.col_offset >= 0 && b.local_rows >= 0 && b.local_cols >= 0 &&
                  b.row_offset + b.local_rows <= b.global_rows / b.chunks &&
                  b.col_offset + b.local_cols <= b.global_cols && s.flat_begin >= 0 && s.count() >= 0 &&
                  s.flat_begin + s.count() <= b.local_numel();
  if (!ok)
    fail("{}: invalid shard geometry (global {}x{}, rows {}+{}, cols {}+{}, chunks {} (from {}, {} held), flat {}+{})",
         what, b.global_rows, b.global_cols, b.row_offset, b.local_rows, b.col_offset, b.local_cols, b.chunks,
         b.chunk_offset, b.local_chunks(), s.flat_begin, s.count());
}


// Linux renameat2(RENAME_EXCHANGE): swaps two directories atomically. Returns false where the
// kernel or file system does not support it.
bool exchange_paths(const std::string& a, const std::string& b) {
#if defined(SYS_renameat2)
  constexpr unsigned kRenameExchange = 1u << 1;
  if (::syscall(SYS_renameat2, AT_FDCWD, a.c_str(), AT_FDCWD, b.c_str(), kRenameExchange) == 0) return true;
  if (errno == EINVAL || errno == ENOSYS || errno == ENOTSUP) return false;
  fail("cannot exchange {} and {}: {}", a, b, std::strerror(errno));
#else
  (void)a;
  (void)b;
  return false;
#endif
}

}  // namespace

void convert_copy(const void* src, DType st, void* dst, DType dt, int64_t n) {
  if (st == dt) {
    std::memcpy(dst, src, static_cast<size_t>(n) * dtype_size(st));
    return;
  }
  MT_CHECK(is_floating(st) && is_floating(dt), "conversion {} -> {}", dtype_name(st), dtype_name(dt));
  auto load = [&](int64_t i) -> double {
    switch (st) {
      case DType::f32: return static_cast<const float*>(src)[i];
      case DType::f64: return static_cast<const double*>(src)[i];
      case DType::bf16: return bf16_bits_to_float(static_cast<const uint16_t*>(src)[i]);
      case DType::f16: return f16_bits_to_float(static_cast<const uint16_t*>(src)[i]);
      default: return 0;
    }
  };
  for (int64_t i = 0; i < n; ++i) {
    const double v = load(i);
    switch (dt) {
      case DType::f32: static_cast<float*>(dst)[i] = static_cast<float>(v); break;
      case DType::f64: static_cast<double*>(dst)[i] = v; break;
      case DType::bf16: static_cast<uint16_t*>(dst)[i] = float_to_bf16_bits(static_cast<float>(v)); break;
      case DType::f16: static_cast<uint16_t*>(dst)[i] = float_to_f16_bits(static_cast<float>(v)); break;
      default: break;
    }
  }
}

std::string_view checkpoint_kind_name(CheckpointKind k) {
  switch (k) {
    case CheckpointKind::model: return "model";
    case CheckpointKind::main_params: return "main";
    case CheckpointKind::optimizer: return "optim";
  }
  return "?";
}

json run_state_to_json(const RunState& s) {
  return json{{"iteration", s.iteration},
              {"consumed_train_samples", s.consumed_train_samples},
              {"consumed_valid_samples", s.consumed_valid_samples},
              {"skipped_train_samples", s.skipped_train_samples},
              {"num_floating_point_operations_so_far", s.num_floating_point_operations_so_far},
              {"lr_scheduler", s.lr_scheduler},
              {"loss_scaler", s.loss_scaler},
              {"config", s.config},
              {"extra", s.extra}};
}

RunState run_state_from_json(const json& j) {
  RunState s;
  s.iteration = j.at("iteration").get<int64_t>();
  s.consumed_train_samples = j.at("consumed_train_samples").get<int64_t>();
  s.consumed_valid_samples = j.at("consumed_valid_samples").get<int64_t>();
  s.skipped_train_samples = j.value("skipped_train_samples", int64_t{0});
  s.num_floating_point_operations_so_far = j.value("num_floating_point_operations_so_far", 0.0);
  s.lr_scheduler = j.value("lr_scheduler", json::object());
  s.loss_scaler = j.value("loss_scaler", json::object());
  s.config = j.value("config", json::object());
  s.extra = j.value("extra", json::object());
  return s;
}

// ---------------------------------------------------------------------------------------------
// Layout

std::string iteration_directory_name(int64_t iteration) { return fmt::format("iter_{:07d}", iteration); }

std::string checkpoint_tracker_path(const std::string& save_dir) {
  return join_path(save_dir, "latest_checkpointed_iteration.txt");
}

std::optional<CheckpointLocation> read_checkpoint_tracker(const std::string& dir) {
  const std::string tracker = checkpoint_tracker_path(dir);
  if (!path_exists(tracker)) return std::nullopt;
  CheckpointLocation loc;
  std::string text = read_text_file(tracker);
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.pop_back();
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.front()))) text.erase(text.begin());
  if (text == "release") {
    loc.release = true;
    return loc;
  }
  size_t used = 0;
  int64_t it = -1;
  try {
    it = std::stoll(text, &used);
  } catch (...) {
    used = 0;
  }
  if (used != text.size() || text.empty() || it < 0)
    fail("invalid checkpoint tracker file {}: expected an iteration number or 'release', found '{}'", tracker,
         text.substr(0, 40));
  loc.iteration = it;
  return loc;
}

std::optional<CheckpointLocation> locate_checkpoint(const std::string& load_dir, std::optional<int64_t> ckpt_step) {
  CheckpointLocation loc;
  const std::string tracker = checkpoint_tracker_path(load_dir);
  if (ckpt_step) {
    if (*ckpt_step < 0) fail("--ckpt-step {} is negative", *ckpt_step);
    loc.iteration = *ckpt_step;
  } else {
    const std::optional<CheckpointLocation> t = read_checkpoint_tracker(load_dir);
    if (!t) return std::nullopt;
    loc = *t;
  }
  loc.directory = join_path(load_dir, loc.release ? "release" : iteration_directory_name(loc.iteration));
  if (!is_directory(loc.directory)) {
    // A save that re-published an existing iteration without an atomic exchange renames the old
    // directory to <dir>.old first; a crash right then leaves only that one.
    if (is_directory(loc.directory + ".old") && path_exists(join_path(loc.directory + ".old", kManifestName))) {
      log::warn("checkpoint directory {} is missing; using {} left by an interrupted save", loc.directory,
                loc.directory + ".old");
      loc.directory += ".old";
      return loc;
    }
    if (ckpt_step)
      fail("--ckpt-step {}: checkpoint directory {} does not exist", *ckpt_step, loc.directory);
    fail("checkpoint tracker {} names iteration {} but the directory {} does not exist", tracker,
         loc.release ? "release" : std::to_string(loc.iteration), loc.directory);
  }
  return loc;
}

std::string non_persistent_directory(const std::optional<std::string>& global_dir, const std::optional<std::string>& base) {
  if (global_dir) return *global_dir;
  return base ? join_path(*base, "non_persistent") : std::string();
}

std::optional<CheckpointLocation> newer_non_persistent(const std::optional<std::string>& global_dir,
                                                       const std::optional<std::string>& load, bool report) {
  const std::string np_dir = non_persistent_directory(global_dir, load);
  if (np_dir.empty()) return std::nullopt;
  std::optional<int64_t> persistent;
  if (load)
    if (const auto p = read_checkpoint_tracker(*load)) persistent = p->iteration;  // (0 for a release)
  const std::optional<CheckpointLocation> t = read_checkpoint_tracker(np_dir);
  if (!t) {
    if (report) {
      log::info("WARNING: could not find the metadata file {}", checkpoint_tracker_path(np_dir));
      log::info("    will not load any non-persistent checkpoint");
    }
    return std::nullopt;
  }
  if (t->release)
    fail("Non-persistent checkpoint can't be a release checkpoint: {} names 'release'", checkpoint_tracker_path(np_dir));
  if (persistent && t->iteration < *persistent) {
    if (report) log::info("WARNING: non-persistent checkpoints are older than persistent checkpoint");
    return std::nullopt;
  }
  std::optional<CheckpointLocation> loc = locate_checkpoint(np_dir);
  loc->non_persistent = true;
  if (report) {
    log::info("Loading from a non-persistent checkpoint (non-persistent iter {})", loc->iteration);
    log::info(" loading checkpoint from {} at iteration {}", np_dir, loc->iteration);
  }
  return loc;
}

std::optional<CheckpointLocation> checkpoint_to_load(const CheckpointConfig& cfg) {
  // Megatron looks at the non-persistent checkpoints first and takes theirs when it is at least as
  // new as --load's. (Megatron compares with --ckpt-step too; megatrain loads the one --ckpt-step
  // names.)
  if (cfg.non_persistent_ckpt_type == "global" && cfg.ckpt_step)
    log::info("--ckpt-step {}: loading that checkpoint of --load, not a non-persistent one", *cfg.ckpt_step);
  else if (cfg.non_persistent_ckpt_type == "global")
    if (auto loc = newer_non_persistent(cfg.non_persistent_global_ckpt_dir, cfg.load, /*report=*/true)) return loc;
  // Megatron falls back to --pretrained-checkpoint when --load has no tracker file (whatever
  // --ckpt-step says), and loads from there as a finetune.
  if (cfg.pretrained_checkpoint && (!cfg.load || !path_exists(checkpoint_tracker_path(*cfg.load)))) {
    log::info("Checkpoint file not found in load directory {} attempting to finetune with checkpoint in {}",
              cfg.load ? *cfg.load : std::string("None"), *cfg.pretrained_checkpoint);
    auto loc = locate_checkpoint(*cfg.pretrained_checkpoint, cfg.ckpt_step);
    if (!loc)
      fail("No checkpoint found in load directory or pretrained directory: neither --load {} nor "
           "--pretrained-checkpoint {} has a tracker file ({})", cfg.load ? *cfg.load : std::string("(not given)"),
           *cfg.pretrained_checkpoint, checkpoint_tracker_path(*cfg.pretrained_checkpoint));
    loc->pretrained = true;
    log::info(" loading checkpoint from {} at iteration {}", *cfg.pretrained_checkpoint, loc->iteration);
    return loc;
  }
  if (!cfg.load) return std::nullopt;
  const auto loc = locate_checkpoint(*cfg.load, cfg.ckpt_step);
  if (!loc) {
    const std::string tracker = checkpoint_tracker_path(*cfg.load);
    if (cfg.exit_on_missing_checkpoint)
      fail("--exit-on-missing-checkpoint is set but no checkpoint was found under --load {} (missing tracker file {})",
           *cfg.load, tracker);
    log::info("WARNING: could not find the metadata file {}", tracker);
    log::info("    will not load any checkpoints and will start from random");
    return std::nullopt;
  }
  if (loc->release) log::info(" loading release checkpoint from {}", *cfg.load);
  else log::info(" loading checkpoint from {} at iteration {}", *cfg.load, loc->iteration);
  return loc;
}

// ---------------------------------------------------------------------------------------------
// Saving

CheckpointWriter::CheckpointWriter(std::string save_dir, int64_t iteration, int rank, int world_size, bool release)
    : save_dir_(std::move(save_dir)), iteration_(iteration), rank_(rank), world_size_(world_size), release_(release) {
  MT_CHECK(rank >= 0 && rank < world_size, "rank {} of {}", rank, world_size);
  MT_CHECK(iteration >= 0, "iteration {}", iteration);
  final_dir_ = join_path(save_dir_, release ? "release" : iteration_directory_name(iteration));
  tmp_dir_ = final_dir_ + ".tmp";
  run_state_.iteration = iteration;
}

void CheckpointWriter::add(const std::string& name, CheckpointKind kind, const ShardSlice& slice, const Tensor& host,
                           std::vector<int64_t> global_shape) {
  MT_CHECK(!written_, "checkpoint writer already written");
  MT_CHECK(host.device == Device::cpu, "checkpoint tensor '{}' is not in host memory", name);
  check_slice(slice, fmt::format("checkpoint tensor '{}'", name));
  MT_CHECK(host.numel() == slice.count(), "checkpoint tensor '{}': host tensor has {} elements, slice {}", name,
           host.numel(), slice.count());
  if (global_shape.empty()) global_shape = {slice.block.global_rows, slice.block.global_cols};
  MT_CHECK(shape_numel(global_shape) == slice.block.global_rows * slice.block.global_cols,
           "checkpoint tensor '{}': global shape {} does not match {}x{}", name, shape_text(global_shape),
           slice.block.global_rows, slice.block.global_cols);
  pieces_.push_back({name, kind, slice, std::move(global_shape), host});
}

void CheckpointWriter::write_local() {
  MT_CHECK(!written_, "checkpoint writer already written");
  written_ = true;
  try {
    make_directories(tmp_dir_);
    // One safetensors file per kind. A rank holding two pieces of one tensor (rare) stores the
    // second under "<name>#1".
    std::map<CheckpointKind, std::unique_ptr<SafetensorsWriter>> writers;
    std::vector<std::string> keys(pieces_.size());
    std::map<std::pair<CheckpointKind, std::string>, int> seen;
    for (size_t i = 0; i < pieces_.size(); ++i) {
      const Piece& p = pieces_[i];
      auto& w = writers[p.kind];
      if (!w) {
        w = std::make_unique<SafetensorsWriter>(join_path(tmp_dir_, rank_file_name(rank_, p.kind)));
        w->set_metadata("format", "megatrain");
        w->set_metadata("kind", std::string(checkpoint_kind_name(p.kind)));
        w->set_metadata("rank", std::to_string(rank_));
      }
      const int n = seen[{p.kind, p.name}]++;
      keys[i] = n == 0 ? p.name : fmt::format("{}#{}", p.name, n);
      w->add(keys[i], p.host.dtype, {p.slice.count()}, p.host.data);
    }
    json part;
    part["rank"] = rank_;
    part["world_size"] = world_size_;
    part["files"] = json::array();
    std::map<std::pair<CheckpointKind, std::string>, uint32_t> crcs;
    for (auto& [kind, w] : writers) {
      const std::string file = rank_file_name(rank_, kind);
      for (const auto& wr : w->finish(/*durable=*/true)) crcs[{kind, wr.name}] = wr.crc32c;
      struct stat st;
      const std::string path = join_path(tmp_dir_, file);
      if (::stat(path.c_str(), &st) != 0) fail("cannot stat {} after writing it: {}", path, std::strerror(errno));
      part["files"].push_back({{"name", file}, {"kind", std::string(checkpoint_kind_name(kind))},
                               {"bytes", static_cast<uint64_t>(st.st_size)}});
    }
    part["shards"] = json::array();
    for (size_t i = 0; i < pieces_.size(); ++i) {
      const Piece& p = pieces_[i];
      json s = slice_to_json(p.slice);
      s["name"] = p.name;
      s["kind"] = std::string(checkpoint_kind_name(p.kind));
      s["dtype"] = std::string(safetensors_dtype_string(p.host.dtype));
      s["global_shape"] = p.global_shape;
      s["file"] = rank_file_name(rank_, p.kind);
      s["key"] = keys[i];
      s["crc32c"] = crc_hex(crcs.at({p.kind, keys[i]}));
      part["shards"].push_back(std::move(s));
    }
    part["rank_state"] = rank_state_;
    if (rank_ == 0) part["run_state"] = run_state_to_json(run_state_);
    // The part manifest goes last, atomically: its presence says this rank's files are complete.
    write_file_atomically(join_path(tmp_dir_, part_manifest_name(rank_)), part.dump(1));
    fsync_directory(tmp_dir_);
  } catch (...) {
    local_error_ = std::current_exception();
    throw;
  }
}

void CheckpointWriter::commit(const SaveGroup& group) {
  MT_CHECK(group.rank == rank_ && group.world_size == world_size_, "save group rank {}/{} vs writer {}/{}",
           group.rank, group.world_size, rank_, world_size_);
  const bool local_ok = written_ && !local_error_;
  const bool all_written = group.agree(local_ok);
  if (!all_written) {
    if (rank_ == 0) {
      try {
        remove_tree(tmp_dir_);  // frees the space a full disk needs back; the old checkpoint is untouched
      } catch (...) {
      }
    }
    if (local_error_) std::rethrow_exception(local_error_);
    if (!written_) fail("checkpoint save of iteration {}: commit without write_local", iteration_);
    fail("checkpoint save of iteration {} to {} failed on another rank (see its error); the previous checkpoint "
         "is left as it was", iteration_, save_dir_);
  }
  std::exception_ptr publish_error;
  if (rank_ == 0) {
    try {
      assemble_and_publish();
    } catch (...) {
      publish_error = std::current_exception();
      try {
        if (is_directory(tmp_dir_)) remove_tree(tmp_dir_);
      } catch (...) {
      }
    }
  }
  const bool published = group.agree(publish_error == nullptr);
  if (publish_error) std::rethrow_exception(publish_error);
  if (!published)
    fail("checkpoint save of iteration {} to {} failed on rank 0 (see its error); the previous checkpoint is left "
         "as it was", iteration_, save_dir_);
}

void CheckpointWriter::save(const SaveGroup& group) {
  try {
    write_local();
  } catch (...) {
    // recorded in local_error_; commit() tells every rank and rethrows it here
  }
  commit(group);
}

void CheckpointWriter::assemble_and_publish() {
  json manifest;
  manifest["format"] = kFormatName;
  manifest["format_version"] = kCheckpointFormatVersion;
  manifest["iteration"] = iteration_;
  manifest["release"] = release_;
  manifest["world_size"] = world_size_;
  json files = json::object();
  std::map<std::pair<std::string, std::string>, json> tensors;  // (kind, name) -> entry
  json rank_states = json::array();
  json run_state;
  for (int r = 0; r < world_size_; ++r) {
    const std::string part_path = join_path(tmp_dir_, part_manifest_name(r));
    json part;
    try {
      part = json::parse(read_text_file(part_path));
    } catch (const json::exception& e) {
      fail("checkpoint save: part manifest {} is not valid JSON: {}", part_path, e.what());
    }
    if (part.at("rank").get<int>() != r || part.at("world_size").get<int>() != world_size_)
      fail("checkpoint save: part manifest {} is from rank {} of {}, expected rank {} of {} (stale file?)",
           part_path, part.at("rank").get<int>(), part.at("world_size").get<int>(), r, world_size_);
    for (const auto& f : part.at("files"))
      files[f.at("name").get<std::string>()] = {{"rank", r}, {"kind", f.at("kind")}, {"bytes", f.at("bytes")}};
    rank_states.push_back(part.value("rank_state", json(nullptr)));
    if (r == 0) run_state = part.at("run_state");
    for (const auto& s : part.at("shards")) {
      const std::string name = s.at("name").get<std::string>();
      const std::string kind = s.at("kind").get<std::string>();
      json& t = tensors[{kind, name}];
      if (t.is_null()) {
        t = {{"name", name},
             {"kind", kind},
             {"dtype", s.at("dtype")},
             {"global_shape", s.at("global_shape")},
             {"global_rows", s.at("global_rows")},
             {"global_cols", s.at("global_cols")},
             {"shards", json::array()}};
      }
      if (t["dtype"] != s.at("dtype") || t["global_shape"] != s.at("global_shape") ||
          t["global_rows"] != s.at("global_rows") || t["global_cols"] != s.at("global_cols"))
        fail("checkpoint save: ranks disagree on {} tensor '{}': {} {} vs {} {} (rank {})", kind, name,
             t["dtype"].dump(), t["global_shape"].dump(), s.at("dtype").dump(), s.at("global_shape").dump(), r);
      json shard = slice_to_json(slice_from_json(s));
      shard.erase("global_rows");
      shard.erase("global_cols");
      bool duplicate = false;  // the same slice saved by two replicas: keep the first
      for (json have : t["shards"]) {
        have.erase("file");
        have.erase("key");
        have.erase("crc32c");
        if (have == shard) duplicate = true;
      }
      if (duplicate) continue;
      shard["file"] = s.at("file");
      shard["key"] = s.at("key");
      shard["crc32c"] = s.at("crc32c");
      t["shards"].push_back(std::move(shard));
    }
  }
  // Every tensor must be covered exactly once by its (deduplicated) shards.
  for (const auto& [key, t] : tensors) {
    int64_t covered = 0;
    for (const auto& s : t["shards"]) covered += s.at("flat_count").get<int64_t>();
    const int64_t numel = t["global_rows"].get<int64_t>() * t["global_cols"].get<int64_t>();
    if (covered != numel)
      fail("checkpoint save: {} tensor '{}' {}: its shards hold {} elements but the tensor has {} ({})", key.first,
           key.second, t["global_shape"].dump(), covered, numel,
           covered < numel ? "some slices were not saved by any rank" : "slices overlap");
  }
  manifest["files"] = files;
  manifest["tensors"] = json::array();
  for (auto& [key, t] : tensors) manifest["tensors"].push_back(std::move(t));
  manifest["run_state"] = run_state;
  manifest["rank_state"] = rank_states;

  {
    OutputFile f(join_path(tmp_dir_, kManifestName));
    const std::string text = manifest.dump(1);
    f.write(text.data(), text.size());
    f.sync();
    f.close();
  }
  // Remove the part manifests and anything a crashed earlier attempt left behind.
  for (const std::string& n : list_directory(tmp_dir_))
    if (n != kManifestName && !files.contains(n)) remove_tree(join_path(tmp_dir_, n));
  // Last, over the files as they will be published (Megatron writes it after its metadata).
  if (integrity_manifest_) save_integrity_manifest(tmp_dir_);
  fsync_directory(tmp_dir_);

  // Publish the directory, then the tracker: a crash between the two leaves the tracker on the
  // previous checkpoint, which is still complete.
  if (is_directory(final_dir_)) {
    if (exchange_paths(tmp_dir_, final_dir_)) {
      fsync_directory(save_dir_);
      remove_tree(tmp_dir_);  // now the old one
    } else {
      const std::string old = final_dir_ + ".old";
      if (path_exists(old)) remove_tree(old);
      rename_path(final_dir_, old);
      rename_path(tmp_dir_, final_dir_);
      fsync_directory(save_dir_);
      remove_tree(old);
    }
  } else {
    rename_path(tmp_dir_, final_dir_);
  }
  fsync_directory(save_dir_);
  write_file_atomically(checkpoint_tracker_path(save_dir_), release_ ? std::string("release") : std::to_string(iteration_));
}

// ---------------------------------------------------------------------------------------------
// Integrity manifest

namespace {
constexpr const char* kIntegrityAlgorithm = "sha256";

bool is_regular_file(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}
}  // namespace

void save_integrity_manifest(const std::string& dir) {
  json files = json::object();
  for (const std::string& n : list_directory(dir)) {
    const std::string path = join_path(dir, n);
    if (n != kIntegrityManifestName && is_regular_file(path)) files[n] = sha256_file_hex(path);
  }
  const json payload = {{"algorithm", kIntegrityAlgorithm}, {"files", files}};
  OutputFile f(join_path(dir, kIntegrityManifestName));
  const std::string text = payload.dump(2);
  f.write(text.data(), text.size());
  f.sync();
  f.close();
}

size_t verify_integrity_manifest(const std::string& dir) {
  const std::string path = join_path(dir, kIntegrityManifestName);
  if (!path_exists(path))
    fail("Integrity manifest not found at {}. The checkpoint must be saved with integrity verification enabled "
         "(--verify-integrity) before it can be verified on load.", path);
  json manifest;
  try {
    manifest = json::parse(read_text_file(path));
  } catch (const json::exception& e) {
    fail("checkpoint integrity manifest {} is not valid JSON: {}", path, e.what());
  }
  const std::string algorithm = manifest.value("algorithm", std::string(kIntegrityAlgorithm));
  if (algorithm != kIntegrityAlgorithm)
    fail("Unsupported hash algorithm in integrity manifest: '{}'. Expected: '{}'.", algorithm, kIntegrityAlgorithm);
  if (!manifest.contains("files") || !manifest["files"].is_object())
    fail("checkpoint integrity manifest {} has no \"files\" object", path);
  std::vector<std::string> mismatches;
  for (const auto& [name, expected_json] : manifest["files"].items()) {
    const std::string expected = expected_json.is_string() ? expected_json.get<std::string>() : std::string();
    std::string actual;
    try {
      actual = sha256_file_hex(join_path(dir, name));
    } catch (const Error& e) {
      mismatches.push_back(fmt::format("  {}: file missing or unreadable ({})", name, e.what()));
      continue;
    }
    if (actual != expected)
      mismatches.push_back(fmt::format("  {}: hash mismatch (expected {}..., got {}...)", name, expected.substr(0, 16),
                                       actual.substr(0, 16)));
  }
  if (!mismatches.empty()) {
    std::string text = fmt::format("Checkpoint integrity verification failed for {} file(s) in {}:", mismatches.size(), dir);
    for (const std::string& m : mismatches) text += "\n" + m;
    fail("{}", text);
  }
  return manifest["files"].size();
}

// ---------------------------------------------------------------------------------------------
// Async saving

AsyncCheckpointSaver::~AsyncCheckpointSaver() {
  join();
  if (writer_) {
    log::error(fmt::format(
        "the asynchronous checkpoint save of iteration {} was never finalized: it is NOT committed and {} "
        "remains a temporary directory{}",
        writer_->iteration(), writer_->temp_directory(), ""));
  }
}

void AsyncCheckpointSaver::join() {
  if (thread_.joinable()) thread_.join();
}

void AsyncCheckpointSaver::start(std::unique_ptr<CheckpointWriter> writer, const SaveGroup& group) {
  finalize(group);
  writer_ = std::move(writer);
  done_ = false;
  CheckpointWriter* w = writer_.get();
  thread_ = std::thread([this, w] {
    try {
      w->write_local();
    } catch (...) {
      // kept in the writer; commit() reports it on every rank
    }
    std::lock_guard<std::mutex> lock(mutex_);
    done_ = true;
  });
}

void AsyncCheckpointSaver::finalize(const SaveGroup& group) {
  if (!writer_) return;
  join();
  std::unique_ptr<CheckpointWriter> w = std::move(writer_);
  w->commit(group);
}

bool AsyncCheckpointSaver::finalize_if_done(const SaveGroup& group) {
  bool done_here = true;
  if (writer_) {
    std::lock_guard<std::mutex> lock(mutex_);
    done_here = done_;
  }
  // Every rank must take the same decision, and ranks without a pending save still take part.
  const bool all_done = group.agree(done_here);
  if (!all_done || !writer_) return false;
  finalize(group);
  return true;
}

// ---------------------------------------------------------------------------------------------
// Loading

CheckpointReader::CheckpointReader(const std::string& load_dir, std::optional<int64_t> ckpt_step) {
  const auto loc = locate_checkpoint(load_dir, ckpt_step);
  if (!loc)
    fail("no checkpoint in {}: the tracker file {} does not exist (pass --ckpt-step to pick an iteration)", load_dir,
         checkpoint_tracker_path(load_dir));
  load_manifest(loc->directory);
}

CheckpointReader CheckpointReader::open_directory(const std::string& iteration_dir) {
  CheckpointReader r;
  r.load_manifest(iteration_dir);
  return r;
}

CheckpointReader::~CheckpointReader() = default;
CheckpointReader::CheckpointReader(CheckpointReader&&) noexcept = default;
CheckpointReader& CheckpointReader::operator=(CheckpointReader&&) noexcept = default;

namespace {

// "torch_dist" / "fsdp_dtensor or torch_dcp" (the same container) / "torch" when `dir` looks like a
// Megatron-LM iteration directory, else "".
std::string megatron_checkpoint_format(const std::string& dir) {
  if (path_exists(join_path(dir, "metadata.json")) || path_exists(join_path(dir, "common.pt"))) return "torch_dist";
  if (path_exists(join_path(dir, ".metadata"))) return "fsdp_dtensor or torch_dcp";
  try {
    for (const std::string& name : list_directory(dir)) {
      if (name.size() > 7 && name.compare(name.size() - 7, 7, ".distcp") == 0) return "torch_dist";
      if (name.rfind("mp_rank_", 0) == 0) return "torch";
    }
  } catch (const std::exception&) {
  }
  return "";
}

}  // namespace

void CheckpointReader::load_manifest(const std::string& dir) {
  dir_ = dir;
  const std::string path = join_path(dir, kManifestName);
  if (!path_exists(path)) {
    // A Megatron-LM checkpoint (torch_dist: metadata.json, common.pt, *.distcp; fsdp_dtensor: .metadata, *.distcp; torch:
    // mp_rank_XX/model_optim_rng.pt) is read by import-megatron (checkpoint/megatron_checkpoint.h),
    // not under --load: training loads megatrain's own format.
    const std::string megatron = megatron_checkpoint_format(dir);
    if (!megatron.empty())
      fail("{} is a Megatron-LM checkpoint ({} format), which training does not load directly: run `megatrain "
           "import-megatron --load {} --save CKPT`, then train with --load CKPT (it resumes at the saved iteration "
           "with Megatron's optimizer state where the checkpoint holds it, for any parallel layout; the import says "
           "when it gives the weights only)",
           dir, megatron, parent_directory(dir));
    fail("{} is not a complete megatrain checkpoint: {} is missing (an interrupted save?)", dir, path);
  }
  json m;
  try {
    m = json::parse(read_text_file(path));
  } catch (const json::exception& e) {
    fail("{} is corrupt: not valid JSON ({})", path, e.what());
  }
  try {
    if (m.value("format", std::string()) != kFormatName) fail("{}: not a megatrain checkpoint manifest", path);
    const int version = m.at("format_version").get<int>();
    if (version > kCheckpointFormatVersion)
      fail("{}: checkpoint format version {} is newer than this megatrain reads ({}); use a newer megatrain", path,
           version, kCheckpointFormatVersion);
    saved_world_size_ = m.at("world_size").get<int>();
    state_ = run_state_from_json(m.at("run_state"));
    state_.iteration = m.at("iteration").get<int64_t>();
    for (const auto& rs : m.at("rank_state")) rank_states_.push_back(rs);
    for (auto it = m.at("files").begin(); it != m.at("files").end(); ++it)
      file_sizes_[it.key()] = it.value().at("bytes").get<uint64_t>();
    for (const auto& t : m.at("tensors")) {
      Entry e;
      e.info.name = t.at("name").get<std::string>();
      e.info.kind = parse_kind(t.at("kind").get<std::string>(), path);
      const auto dt = parse_safetensors_dtype(t.at("dtype").get<std::string>());
      if (!dt) fail("{}: tensor '{}' has unsupported dtype {}", path, e.info.name, t.at("dtype").dump());
      e.info.dtype = *dt;
      e.info.global_shape = t.at("global_shape").get<std::vector<int64_t>>();
      e.info.global_rows = t.at("global_rows").get<int64_t>();
      e.info.global_cols = t.at("global_cols").get<int64_t>();
      if (shape_numel(e.info.global_shape) != e.info.global_rows * e.info.global_cols)
        fail("{}: tensor '{}': global shape {} does not match {}x{}", path, e.info.name,
             shape_text(e.info.global_shape), e.info.global_rows, e.info.global_cols);
      for (const auto& s : t.at("shards")) {
        Shard sh;
        sh.file = s.at("file").get<std::string>();
        sh.key = s.at("key").get<std::string>();
        json full = s;
        full["global_rows"] = e.info.global_rows;
        full["global_cols"] = e.info.global_cols;
        sh.slice = slice_from_json(full);
        check_slice(sh.slice, fmt::format("{}: tensor '{}' shard in {}", path, e.info.name, sh.file));
        sh.crc32c = static_cast<uint32_t>(std::stoul(s.at("crc32c").get<std::string>(), nullptr, 16));
        if (!file_sizes_.count(sh.file))
          fail("{}: tensor '{}' refers to file {}, which the manifest does not list", path, e.info.name, sh.file);
        e.shards.push_back(std::move(sh));
      }
      tensors_[{static_cast<int>(e.info.kind), e.info.name}] = std::move(e);
    }
  } catch (const json::exception& e) {
    fail("{} is corrupt or incomplete: {}", path, e.what());
  }
  // Cheap up-front check of every file: present, and of the recorded size (catches truncation
  // before any tensor is read).
  for (const auto& [name, bytes] : file_sizes_) {
    const std::string fp = join_path(dir_, name);
    if (!path_exists(fp)) fail("checkpoint {}: shard file {} is missing", dir_, fp);
    struct stat st;
    if (::stat(fp.c_str(), &st) != 0) fail("checkpoint {}: cannot stat {}", dir_, fp);
    if (static_cast<uint64_t>(st.st_size) != bytes)
      fail("checkpoint {}: shard file {} has {} bytes, the manifest records {} ({})", dir_, fp,
           static_cast<uint64_t>(st.st_size), bytes, static_cast<uint64_t>(st.st_size) < bytes ? "truncated" : "corrupt");
  }
}

const json& CheckpointReader::rank_state(int rank) const {
  static const json null_json = nullptr;
  if (rank < 0 || static_cast<size_t>(rank) >= rank_states_.size()) return null_json;
  return rank_states_[rank];
}

bool CheckpointReader::has(const std::string& name, CheckpointKind kind) const {
  return tensors_.count({static_cast<int>(kind), name}) > 0;
}

const CheckpointTensorInfo& CheckpointReader::info(const std::string& name, CheckpointKind kind) const {
  auto it = tensors_.find({static_cast<int>(kind), name});
  if (it == tensors_.end()) {
    size_t n = 0;
    for (const auto& [key, e] : tensors_) n += key.first == static_cast<int>(kind);
    fail("checkpoint {} has no {} tensor '{}' (it holds {} {} tensors; saved for another model configuration{}?)",
         dir_, checkpoint_kind_name(kind), name, n, checkpoint_kind_name(kind),
         kind == CheckpointKind::model ? "" : ", or with --no-save-optim");
  }
  return it->second.info;
}

std::vector<std::string> CheckpointReader::names(CheckpointKind kind) const {
  std::vector<std::string> out;
  for (const auto& [key, e] : tensors_)
    if (key.first == static_cast<int>(kind)) out.push_back(key.second);
  return out;
}

const SafetensorsFile& CheckpointReader::file(const std::string& name) {
  auto& f = open_files_[name];
  if (!f) f = std::make_unique<SafetensorsFile>(join_path(dir_, name));
  return *f;
}

void CheckpointReader::read(const std::string& name, CheckpointKind kind, const ShardSlice& wanted, const Tensor& out,
                            const std::vector<int64_t>& expected_global_shape) {
  const CheckpointTensorInfo& ti = info(name, kind);
  Entry& entry = tensors_.at({static_cast<int>(kind), name});
  if (!expected_global_shape.empty() && expected_global_shape != ti.global_shape)
    fail("checkpoint {}: tensor '{}' has shape {} in the checkpoint but {} in the model (saved for another model "
         "configuration?)", dir_, name, shape_text(ti.global_shape), shape_text(expected_global_shape));
  const ShardIndex& wb = wanted.block;
  if (wb.global_rows != ti.global_rows || wb.global_cols != ti.global_cols)
    fail("checkpoint {}: tensor '{}' is {}x{} in the checkpoint (shape {}) but the model asks for a slice of a "
         "{}x{} tensor (saved for another model configuration?)", dir_, name, ti.global_rows, ti.global_cols,
         shape_text(ti.global_shape), wb.global_rows, wb.global_cols);
  check_slice(wanted, fmt::format("reading checkpoint tensor '{}'", name));
  MT_CHECK(out.device == Device::cpu, "checkpoint read of '{}' into device memory", name);
  MT_CHECK(out.numel() == wanted.count(), "checkpoint read of '{}': out has {} elements, slice {}", name, out.numel(),
           wanted.count());
  if (ti.dtype != out.dtype && !(is_floating(ti.dtype) && is_floating(out.dtype)))
    fail("checkpoint {}: tensor '{}' is {} and cannot be read as {}", dir_, name, dtype_name(ti.dtype),
         dtype_name(out.dtype));

  // Map each shard's data, checking it against the manifest (and its checksum, once).
  struct Source {
    Shard* shard;
    const unsigned char* data;
    std::string path;
    size_t nbytes;
  };
  std::vector<Source> sources;
  for (Shard& sh : entry.shards) {
    const SafetensorsFile& f = file(sh.file);
    const SafetensorsEntry* e = f.find(sh.key);
    if (!e) fail("checkpoint {}: {} has no tensor '{}' that the manifest lists for '{}'", dir_, f.path(), sh.key, name);
    if (e->dtype != ti.dtype || e->numel() != sh.slice.count())
      fail("checkpoint {}: {} tensor '{}' is {} but the manifest says {} elements of {}", dir_, f.path(), sh.key,
           e->shape_string(), sh.slice.count(), safetensors_dtype_string(ti.dtype));
    sources.push_back({&sh, e->data, f.path(), e->nbytes()});
  }
  // A shard's checksum is verified the first time data is taken from it (a rank reading its slice
  // of a resharded tensor does not read the shards it does not need).
  auto verify = [&](const Source& src) {
    Shard& sh = *src.shard;
    if (sh.verified) return;
    const uint32_t crc = crc32c(src.data, src.nbytes);
    if (crc != sh.crc32c)
      fail("checkpoint {}: checksum mismatch in {} for tensor '{}' (crc32c {:08x}, manifest {:08x}): the file is "
           "corrupt", dir_, src.path, sh.key, crc, sh.crc32c);
    sh.verified = true;
  };

  const size_t src_elem = dtype_size(ti.dtype);
  const size_t dst_elem = dtype_size(out.dtype);
  auto* dst = static_cast<unsigned char*>(out.data);
  std::vector<std::pair<int64_t, int64_t>> covered;
  int64_t flat = wanted.flat_begin;
  const int64_t flat_end = wanted.flat_begin + wanted.count();
  const int64_t chunk_rows = wb.global_rows / wb.chunks;
  // Walk the wanted slice row segment by row segment (each is contiguous in the global row).
  while (flat < flat_end) {
    const int64_t local_row = flat / wb.local_cols, col_in_block = flat % wb.local_cols;
    const int64_t len = std::min(wb.local_cols - col_in_block, flat_end - flat);
    const int64_t grow =
        (wb.chunk_offset + local_row / wb.local_rows) * chunk_rows + wb.row_offset + local_row % wb.local_rows;
    const int64_t gcol = wb.col_offset + col_in_block;
    const int64_t out_base = flat - wanted.flat_begin;
    covered.clear();
    for (const Source& src : sources) {
      const ShardSlice& ps = src.shard->slice;
      const ShardIndex& pb = ps.block;
      const int64_t p_chunk_rows = pb.global_rows / pb.chunks;
      const int64_t pc = grow / p_chunk_rows - pb.chunk_offset, rr = grow % p_chunk_rows;  // (pc: held chunk)
      if (pc < 0 || pc >= pb.local_chunks() || rr < pb.row_offset || rr >= pb.row_offset + pb.local_rows) continue;
      const int64_t c0 = std::max(gcol, pb.col_offset), c1 = std::min(gcol + len, pb.col_offset + pb.local_cols);
      if (c0 >= c1) continue;
      const int64_t prow = pc * pb.local_rows + rr - pb.row_offset;
      const int64_t pf0 = prow * pb.local_cols + (c0 - pb.col_offset);
      const int64_t f0 = std::max(pf0, ps.flat_begin), f1 = std::min(pf0 + (c1 - c0), ps.flat_begin + ps.count());
      if (f0 >= f1) continue;
      const int64_t out_col = c0 + (f0 - pf0) - gcol;  // within this segment
      verify(src);
      convert_copy(src.data + static_cast<size_t>(f0 - ps.flat_begin) * src_elem, ti.dtype,
                   dst + static_cast<size_t>(out_base + out_col) * dst_elem, out.dtype, f1 - f0);
      covered.push_back({out_col, out_col + (f1 - f0)});
    }
    std::sort(covered.begin(), covered.end());
    int64_t reach = 0;
    for (const auto& [a, b] : covered) {
      if (a > reach) break;
      reach = std::max(reach, b);
    }
    if (reach < len)
      fail("checkpoint {}: tensor '{}' global row {} cols {}..{} are not held by any shard (incomplete checkpoint)",
           dir_, name, grow, gcol + reach, gcol + len - 1);
    flat += len;
  }
}

void CheckpointReader::verify_all() {
  for (auto& [key, e] : tensors_) {
    for (Shard& sh : e.shards) {
      if (sh.verified) continue;
      const SafetensorsFile& f = file(sh.file);
      const SafetensorsEntry& se = f.get(sh.key);
      if (crc32c(se.data, se.nbytes()) != sh.crc32c)
        fail("checkpoint {}: checksum mismatch in {} for tensor '{}': the file is corrupt", dir_, f.path(), sh.key);
      sh.verified = true;
    }
  }
}

}  // namespace mt
