// Checkpoints: Megatron's directory layout (<save>/iter_0000100/, latest_checkpointed_iteration.txt)
// holding megatrain's own format inside (checkpoint/FORMAT.md): per-rank safetensors shard files
// and a manifest.json that maps every global tensor to the slices the shard files hold.
//
// Saving is crash-safe: ranks write into <save>/iter_XXXXXXX.tmp/, fsync, and rank 0 publishes the
// directory by rename and only then moves the tracker file, so a crash or a full disk mid-save
// leaves the previous checkpoint intact and the tracker pointing at it.
//
// Loading reshards: CheckpointReader::read assembles any slice of a global tensor from whichever
// shards hold it, so a checkpoint saved with one TP/PP/DP layout loads into any other.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "core/config.h"
#include "core/shard.h"
#include "core/tensor.h"

namespace mt {

constexpr int kCheckpointFormatVersion = 1;

// Which shard file of a rank a tensor goes to. Separate files let a model-only load (--finetune,
// --no-load-optim, HF export) touch only the model files.
enum class CheckpointKind { model, main_params, optimizer };
std::string_view checkpoint_kind_name(CheckpointKind k);  // "model", "main", "optim"

// A piece of a global tensor held by one rank: its tensor-parallel block (ShardIndex), or a
// contiguous flat range of that block's local layout (chunk-major rows, then cols), which is what a
// distributed-optimizer DP shard of a parameter is.
struct ShardSlice {
  ShardIndex block;
  int64_t flat_begin = 0;
  int64_t flat_count = -1;  // -1: to the end of the block

  static ShardSlice whole(const ShardIndex& b) { return {b, 0, -1}; }
  int64_t count() const { return flat_count < 0 ? block.local_numel() - flat_begin : flat_count; }
};

// The run state saved with every checkpoint (rank 0's copy). The LR scheduler, loss scaler and
// config are opaque JSON owned by their code; Megatron's scheduler steps are in samples.
struct RunState {
  int64_t iteration = 0;
  int64_t consumed_train_samples = 0;
  int64_t consumed_valid_samples = 0;
  int64_t skipped_train_samples = 0;
  double num_floating_point_operations_so_far = 0;
  nlohmann::json lr_scheduler = nlohmann::json::object();
  nlohmann::json loss_scaler = nlohmann::json::object();
  nlohmann::json config = nlohmann::json::object();  // the run's Config
  nlohmann::json extra = nlohmann::json::object();
};
nlohmann::json run_state_to_json(const RunState& s);
RunState run_state_from_json(const nlohmann::json& j);

// ---------------------------------------------------------------------------------------------
// Layout (Megatron's)

std::string iteration_directory_name(int64_t iteration);  // "iter_0000100"
std::string checkpoint_tracker_path(const std::string& save_dir);  // <save>/latest_checkpointed_iteration.txt

struct CheckpointLocation {
  std::string directory;  // <load>/iter_XXXXXXX or <load>/release
  int64_t iteration = 0;  // 0 for release
  bool release = false;
  bool pretrained = false;  // found under --pretrained-checkpoint: loaded as a --finetune
  bool non_persistent = false;  // a non-persistent checkpoint (loaded as --load's would be)
};
// What the tracker file of `dir` names (iteration, or release), its directory not checked; nullopt
// without a tracker file. Throws for an unreadable or malformed tracker.
std::optional<CheckpointLocation> read_checkpoint_tracker(const std::string& dir);
// What --load [--ckpt-step N] points at: the tracker's iteration, or ckpt_step when given (as
// Megatron does, even without a tracker). nullopt when there is neither: the caller warns and
// starts from random initialization, or exits with --exit-on-missing-checkpoint.
// Throws when the tracker is unreadable or the iteration directory does not exist.
std::optional<CheckpointLocation> locate_checkpoint(const std::string& load_dir,
                                                    std::optional<int64_t> ckpt_step = std::nullopt);

// Megatron's non-persistent global checkpoints (--non-persistent-ckpt-type global) live in
// --non-persistent-global-ckpt-dir, else in <base>/non_persistent (base: --save when saving,
// --load when loading); "" when there is neither.
std::string non_persistent_directory(const std::optional<std::string>& global_dir, const std::optional<std::string>& base);
// The non-persistent checkpoint to load instead of --load's, as Megatron's _load_base_checkpoint:
// the one the tracker of non_persistent_directory(global_dir, load) names when it is at least as
// new as what --load's tracker names (0 for a release), or --load has none. nullopt when there is
// no such directory or tracker, or its checkpoint is older (both with Megatron's warning when
// `report`, which also prints the loading lines). Throws for a "release" tracker there or a
// tracker naming a missing directory.
std::optional<CheckpointLocation> newer_non_persistent(const std::optional<std::string>& global_dir,
                                                       const std::optional<std::string>& load, bool report);

// Megatron's --load decision (load_checkpoint / _load_base_checkpoint): nullopt without --load;
// when --load has no tracker file and --pretrained-checkpoint is given, that directory's checkpoint
// (pretrained = true; an error when it has none either); with --non-persistent-ckpt-type global a
// newer_non_persistent() checkpoint first (not with --ckpt-step, which names the one to load);
// without a tracker (and no --ckpt-step)
// prints Megatron's warning and returns nullopt (start from random initialization), or throws with
// --exit-on-missing-checkpoint; otherwise prints " loading checkpoint from DIR at iteration N"
// (rank 0) and returns the location.
std::optional<CheckpointLocation> checkpoint_to_load(const CheckpointConfig& cfg);

// Copies `n` elements converting dtype: same dtype is a memcpy; float dtypes convert through
// double; integers must match exactly.
void convert_copy(const void* src, DType st, void* dst, DType dt, int64_t n);

// ---------------------------------------------------------------------------------------------
// Saving

// The ranks taking part in a save. all_ok is an all-reduce (logical AND) of a flag over them and
// doubles as a barrier; with one rank it can be left empty.
struct SaveGroup {
  int rank = 0;
  int world_size = 1;
  std::function<bool(bool ok)> all_ok;

  bool agree(bool ok) const { return all_ok ? all_ok(ok) : ok; }
};

// One rank's part of one checkpoint. Tensors are host views that must stay valid and unchanged
// until write_local() returns. Typical use: add(...) for every shard this rank owns (one replica
// of each: e.g. DP rank 0 for model weights, TP rank 0 for replicated layernorms), then save().
class CheckpointWriter {
 public:
  CheckpointWriter(std::string save_dir, int64_t iteration, int rank, int world_size, bool release = false);

  // global_shape: the tensor's N-D shape (its product must be block.global_rows * global_cols);
  // empty means [global_rows, global_cols].
  void add(const std::string& name, CheckpointKind kind, const ShardSlice& slice, const Tensor& host,
           std::vector<int64_t> global_shape = {});
  void add(const std::string& name, CheckpointKind kind, const ShardIndex& block, const Tensor& host,
           std::vector<int64_t> global_shape = {}) {
    add(name, kind, ShardSlice::whole(block), host, std::move(global_shape));
  }
  void set_run_state(const RunState& s) { run_state_ = s; }  // rank 0's is recorded
  void set_rank_state(nlohmann::json s) { rank_state_ = std::move(s); }  // per rank (RNG states)
  // --verify-integrity: rank 0 also writes the integrity manifest (above) before publishing.
  void set_integrity_manifest(bool on) { integrity_manifest_ = on; }

  // Phase 1, rank-local (no communication; may run on a background thread): writes this rank's
  // shard files and part manifest into <save>/iter_XXXXXXX.tmp/ and fsyncs them.
  void write_local();
  // Phase 2, collective over `group` (every rank calls it, whether or not its write_local failed):
  // rank 0 assembles manifest.json, publishes the directory and updates the tracker. Throws on
  // every rank when any rank failed, leaving the previous checkpoint and tracker untouched.
  void commit(const SaveGroup& group);
  // Both phases; errors of write_local are carried into commit so that no rank waits forever.
  void save(const SaveGroup& group);

  int64_t iteration() const { return iteration_; }
  const std::string& temp_directory() const { return tmp_dir_; }
  const std::string& final_directory() const { return final_dir_; }

 private:
  struct Piece {
    std::string name;
    CheckpointKind kind;
    ShardSlice slice;
    std::vector<int64_t> global_shape;
    Tensor host;
  };
  void assemble_and_publish();  // rank 0

  std::string save_dir_, tmp_dir_, final_dir_;
  int64_t iteration_;
  int rank_, world_size_;
  bool release_;
  std::vector<Piece> pieces_;
  RunState run_state_;
  nlohmann::json rank_state_ = nullptr;
  bool written_ = false;
  bool integrity_manifest_ = false;
  std::exception_ptr local_error_;
};

// --async-save: the caller copies its shards into host buffers (fast) and hands over the writer;
// a background thread writes the files; the commit (collective) happens at the next start(),
// finalize() or finalize_if_done(). A second save waits for the first. Errors surface at the next
// call; a save never finalized is reported on stderr by the destructor (never lost silently).
class AsyncCheckpointSaver {
 public:
  AsyncCheckpointSaver() = default;
  ~AsyncCheckpointSaver();
  AsyncCheckpointSaver(const AsyncCheckpointSaver&) = delete;
  AsyncCheckpointSaver& operator=(const AsyncCheckpointSaver&) = delete;

  // Collective. Finalizes the previous save (throwing its error), then starts writing `writer`'s
  // files in the background. The writer's host buffers must stay unchanged until the next call.
  void start(std::unique_ptr<CheckpointWriter> writer, const SaveGroup& group);
  // Collective: waits for the background write and commits it. No-op when nothing is pending.
  void finalize(const SaveGroup& group);
  // Collective, non-blocking: commits when every rank's write has finished; returns whether a
  // pending save was committed now.
  bool finalize_if_done(const SaveGroup& group);
  bool pending() const { return writer_ != nullptr; }

 private:
  void join();

  std::unique_ptr<CheckpointWriter> writer_;
  std::thread thread_;
  std::mutex mutex_;
  bool done_ = false;
};

// ---------------------------------------------------------------------------------------------
// Integrity manifest (--verify-integrity; Megatron-LM's, megatron/core/dist_checkpointing/
// validation.py): integrity.json in the iteration directory, {"algorithm": "sha256", "files":
// {name: hex digest}} over every regular file directly in it but itself, written by rank 0 once
// every other file of the checkpoint is complete, and checked before a load reads anything. It
// covers manifest.json too, beside the per-slice CRC-32C checksums manifest.json records.

constexpr const char* kIntegrityManifestName = "integrity.json";
// Hashes every file in `dir` and writes the manifest (fsynced).
void save_integrity_manifest(const std::string& dir);
// Rehashes every file the manifest lists; throws mt::Error with Megatron's message when the
// manifest is absent, names another algorithm, or any file is missing or changed (naming each).
// Returns how many files it verified.
size_t verify_integrity_manifest(const std::string& dir);

// ---------------------------------------------------------------------------------------------
// Loading

class SafetensorsFile;

struct CheckpointTensorInfo {
  std::string name;
  CheckpointKind kind;
  DType dtype;
  std::vector<int64_t> global_shape;
  int64_t global_rows = 0, global_cols = 0;  // the 2-D view shards are cut from
};

class CheckpointReader {
 public:
  // Finds the checkpoint as locate_checkpoint() does (throws when there is none), reads and
  // validates manifest.json and checks that every shard file exists with the recorded size.
  explicit CheckpointReader(const std::string& load_dir, std::optional<int64_t> ckpt_step = std::nullopt);
  // Opens a checkpoint iteration directory directly.
  static CheckpointReader open_directory(const std::string& iteration_dir);
  ~CheckpointReader();
  CheckpointReader(CheckpointReader&&) noexcept;
  CheckpointReader& operator=(CheckpointReader&&) noexcept;

  const std::string& directory() const { return dir_; }
  int64_t iteration() const { return state_.iteration; }
  int saved_world_size() const { return saved_world_size_; }
  const RunState& run_state() const { return state_; }
  // The per-rank state (RNG) saved by `rank`; null when that rank saved none.
  const nlohmann::json& rank_state(int rank) const;

  bool has(const std::string& name, CheckpointKind kind = CheckpointKind::model) const;
  const CheckpointTensorInfo& info(const std::string& name, CheckpointKind kind = CheckpointKind::model) const;
  std::vector<std::string> names(CheckpointKind kind = CheckpointKind::model) const;

  // Fills `out` (host, numel == wanted.count()) with the slice `wanted` of the global tensor,
  // assembled from whatever shards hold it, converting between float dtypes when they differ.
  // `expected_global_shape` (optional) is the model's shape of the tensor: a difference names the
  // tensor and both shapes. Each shard's checksum is verified the first time it is read.
  void read(const std::string& name, CheckpointKind kind, const ShardSlice& wanted, const Tensor& out,
            const std::vector<int64_t>& expected_global_shape = {});
  void read(const std::string& name, const ShardIndex& wanted, const Tensor& out,
            const std::vector<int64_t>& expected_global_shape = {}) {
    read(name, CheckpointKind::model, ShardSlice::whole(wanted), out, expected_global_shape);
  }

  // Verifies the checksum of every shard in the checkpoint (reads everything).
  void verify_all();

 private:
  CheckpointReader() = default;
  void load_manifest(const std::string& dir);
  const SafetensorsFile& file(const std::string& name);

  struct Shard {
    std::string file;  // file name inside dir_
    std::string key;   // tensor name inside the file
    ShardSlice slice;
    uint32_t crc32c = 0;
    bool verified = false;
  };
  struct Entry {
    CheckpointTensorInfo info;
    std::vector<Shard> shards;
  };

  std::string dir_;
  int saved_world_size_ = 0;
  RunState state_;
  std::vector<nlohmann::json> rank_states_;
  std::map<std::pair<int, std::string>, Entry> tensors_;  // (kind, name)
  std::map<std::string, uint64_t> file_sizes_;
  std::map<std::string, std::unique_ptr<SafetensorsFile>> open_files_;
};

}  // namespace mt
