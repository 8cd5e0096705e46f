// Checkpoint storage: Megatron's layout, resharding on load, crash and full-disk safety, refusal
// of corrupt, truncated and mismatched checkpoints, async saving.
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <condition_variable>
#include <fstream>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "checkpoint/checkpoint_io.h"
#include "checkpoint/file_io.h"
#include "ckpt_test_util.h"
#include "core/error.h"
#include "core/log.h"
#include "tests/skip.h"

using namespace mt;
using mt_test::TempDir;
using nlohmann::json;

namespace {

// The value of global element (r, c) of test tensor `salt`: distinct everywhere (exact in bf16 for salt 0).
float value_at(int salt, int64_t r, int64_t c) { return static_cast<float>(salt * 1000 + r * 16 + c); }

// The local block (or flat range of it) of a global tensor, filled from value_at.
std::vector<float> make_slice(int salt, const ShardSlice& s) {
  std::vector<float> v(static_cast<size_t>(s.count()));
  for (int64_t i = 0; i < s.count(); ++i) {
    const int64_t g = shard_global_index(s.block, s.flat_begin + i);
    v[static_cast<size_t>(i)] = value_at(salt, g / s.block.global_cols, g % s.block.global_cols);
  }
  return v;
}

Tensor host(std::vector<float>& v) { return Tensor(v.data(), DType::f32, Device::cpu, {static_cast<int64_t>(v.size())}); }

// Ranks as threads: all_ok is a barrier that ANDs the flags.
class ThreadGroup {
 public:
  explicit ThreadGroup(int n) : n_(n) {}
  SaveGroup group(int rank) {
    return SaveGroup{rank, n_, [this](bool ok) { return all_ok(ok); }};
  }
  bool all_ok(bool ok) {
    std::unique_lock<std::mutex> lock(m_);
    const int gen = generation_;
    acc_ = acc_ && ok;
    if (++arrived_ == n_) {
      result_ = acc_;
      acc_ = true;
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return generation_ != gen; });
    }
    return result_;
  }

 private:
  int n_;
  std::mutex m_;
  std::condition_variable cv_;
  int arrived_ = 0, generation_ = 0;
  bool acc_ = true, result_ = true;
};

// Runs fn(rank) on `world` threads; returns the exception messages ("" where none).
std::vector<std::string> run_ranks(int world, const std::function<void(int)>& fn) {
  std::vector<std::string> errors(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  return errors;
}

// A small single-rank checkpoint: tensor "w" [4, 6] (salt 1) and "b" [6] (salt 2), optimizer
// moment "w.exp_avg" (salt 3).
void save_simple(const std::string& dir, int64_t iteration, int extra_salt = 0) {
  CheckpointWriter w(dir, iteration, 0, 1);
  const ShardIndex wi = ShardIndex::whole(4, 6), bi = ShardIndex::whole(6, 1);
  auto wv = make_slice(1 + extra_salt, ShardSlice::whole(wi));
  auto bv = make_slice(2 + extra_salt, ShardSlice::whole(bi));
  auto ov = make_slice(3 + extra_salt, ShardSlice::whole(wi));
  w.add("w", CheckpointKind::model, wi, host(wv));
  w.add("b", CheckpointKind::model, bi, host(bv), {6});
  w.add("w.exp_avg", CheckpointKind::optimizer, wi, host(ov));
  RunState st;
  st.iteration = iteration;
  st.consumed_train_samples = iteration * 8;
  w.set_run_state(st);
  w.save(SaveGroup{});
}

// Throws (no Catch macros: also used in forked children, whose Catch state nobody reads).
void verify_simple(const std::string& load_dir, int64_t iteration, int extra_salt = 0) {
  CheckpointReader r(load_dir);
  if (r.iteration() != iteration)
    throw std::runtime_error("loaded iteration " + std::to_string(r.iteration()) + ", expected " + std::to_string(iteration));
  if (r.run_state().consumed_train_samples != iteration * 8) throw std::runtime_error("consumed samples differ");
  std::vector<float> out(24);
  r.read("w", ShardIndex::whole(4, 6), host(out));
  if (out != make_slice(1 + extra_salt, ShardSlice::whole(ShardIndex::whole(4, 6)))) throw std::runtime_error("w differs");
  std::vector<float> b(6);
  r.read("b", ShardIndex::whole(6, 1), host(b), {6});
  if (b != make_slice(2 + extra_salt, ShardSlice::whole(ShardIndex::whole(6, 1)))) throw std::runtime_error("b differs");
  r.verify_all();
}

void check_simple(const std::string& load_dir, int64_t iteration, int extra_salt = 0) {
  REQUIRE_NOTHROW(verify_simple(load_dir, iteration, extra_salt));
}

std::string tracker_text(const std::string& dir) { return read_text_file(checkpoint_tracker_path(dir)); }

}  // namespace

TEST_CASE("checkpoint layout follows Megatron: iter_XXXXXXX and the tracker", "[checkpoint]") {
  TempDir dir;
  save_simple(dir.path(), 5);
  CHECK(tracker_text(dir.path()) == "5");
  CHECK(is_directory(dir / "iter_0000005"));
  CHECK(!path_exists(dir / "iter_0000005.tmp"));
  const auto names = list_directory(dir / "iter_0000005");
  CHECK(names == std::vector<std::string>{"manifest.json", "rank_00000-model.safetensors", "rank_00000-optim.safetensors"});
  const json m = json::parse(read_text_file(dir / "iter_0000005/manifest.json"));
  CHECK(m["format"] == "megatrain-checkpoint");
  CHECK(m["format_version"] == kCheckpointFormatVersion);
  CHECK(m["iteration"] == 5);
  CHECK(m["world_size"] == 1);
  CHECK(m["tensors"].size() == 3);
  CHECK(m["run_state"]["consumed_train_samples"] == 40);
  check_simple(dir.path(), 5);

  CheckpointReader r(dir.path());
  CHECK(r.has("w.exp_avg", CheckpointKind::optimizer));
  CHECK(!r.has("w.exp_avg", CheckpointKind::model));
  CHECK(r.info("b").global_shape == std::vector<int64_t>{6});
  CHECK(r.names() == std::vector<std::string>{"b", "w"});

  // A later save moves the tracker; --ckpt-step still reaches the earlier one.
  save_simple(dir.path(), 12, 10);
  CHECK(tracker_text(dir.path()) == "12");
  check_simple(dir.path(), 12, 10);
  CheckpointReader old(dir.path(), 5);
  CHECK(old.iteration() == 5);
  CHECK(iteration_directory_name(1234567) == "iter_1234567");

  // A release checkpoint (no iteration), as Megatron names it.
  {
    CheckpointWriter w(dir.path(), 0, 0, 1, /*release=*/true);
    std::vector<float> v = make_slice(4, ShardSlice::whole(ShardIndex::whole(2, 3)));
    w.add("w", CheckpointKind::model, ShardIndex::whole(2, 3), host(v));
    w.save(SaveGroup{});
  }
  CHECK(tracker_text(dir.path()) == "release");
  const auto loc = locate_checkpoint(dir.path());
  REQUIRE(loc.has_value());
  CHECK(loc->release);
  CHECK(loc->directory == dir / "release");
  CHECK(CheckpointReader(dir.path()).names() == std::vector<std::string>{"w"});
}

TEST_CASE("checkpoint reshards: any slice of any split, from any other split", "[checkpoint][reshard]") {
  TempDir dir;
  // Saved by 6 ranks:
  //  "rows"  [6, 5]  split 2 ways by rows (ranks 0-1), replicated copy also saved by rank 2 (dedup)
  //  "cols"  [4, 9]  split 3 ways by cols (ranks 0-2)
  //  "fc1"   [8, 3]  SwiGLU [gate(4); up(4)], chunks=2, split 2 ways (ranks 3-4): [gate half; up half]
  //  "flat"  [5, 7]  distributed-optimizer style: flat ranges 0..13, 13..30, 30..35 (ranks 3-5)
  //  "bf"    [3, 4]  bf16, whole, rank 5
  const int world = 6;
  ThreadGroup tg(world);
  std::vector<std::vector<float>> keep(world * 4);
  std::vector<std::vector<uint16_t>> keep16(world);
  auto errors = run_ranks(world, [&](int r) {
    CheckpointWriter w(dir.path(), 7, r, world);
    int k = 0;
    auto add = [&](const std::string& name, int salt, const ShardSlice& s) {
      auto& v = keep[r * 4 + k++];
      v = make_slice(salt, s);
      w.add(name, CheckpointKind::model, s, host(v));
    };
    if (r < 2) add("rows", 1, ShardSlice::whole({6, 5, 3 * r, 0, 3, 5, 1}));
    if (r == 2) add("rows", 1, ShardSlice::whole({6, 5, 3, 0, 3, 5, 1}));  // a replica of rank 1's block
    if (r < 3) add("cols", 2, ShardSlice::whole({4, 9, 0, 3 * r, 4, 3, 1}));
    if (r == 3 || r == 4) add("fc1", 3, ShardSlice::whole({8, 3, 2 * (r - 3), 0, 2, 3, 2}));
    const int64_t fb[] = {0, 13, 30, 35};
    if (r >= 3) add("flat", 4, ShardSlice{ShardIndex::whole(5, 7), fb[r - 3], fb[r - 2] - fb[r - 3]});
    if (r == 5) {
      const auto f = make_slice(0, ShardSlice::whole(ShardIndex::whole(3, 4)));  // small values: exact in bf16
      keep16[r].resize(f.size());
      for (size_t i = 0; i < f.size(); ++i) keep16[r][i] = float_to_bf16_bits(f[i]);
      w.add("bf", CheckpointKind::model, ShardIndex::whole(3, 4),
            Tensor(keep16[r].data(), DType::bf16, Device::cpu, {12}));
    }
    w.save(tg.group(r));
  });
  for (const auto& e : errors) REQUIRE(e == "");

  CheckpointReader rd(dir.path());
  CHECK(rd.saved_world_size() == 6);
  auto check = [&](const std::string& name, int salt, const ShardSlice& s) {
    std::vector<float> out(static_cast<size_t>(s.count()), -1.0f);
    rd.read(name, CheckpointKind::model, s, host(out));
    INFO(name << " rows " << s.block.row_offset << "+" << s.block.local_rows << " cols " << s.block.col_offset << "+"
              << s.block.local_cols << " chunks " << s.block.chunks << " flat " << s.flat_begin << "+" << s.count());
    CHECK(out == make_slice(salt, s));
  };
  struct Named {
    std::string name;
    int salt;
    int64_t rows, cols;
  };
  for (const Named& t : {Named{"rows", 1, 6, 5}, Named{"cols", 2, 4, 9}, Named{"flat", 4, 5, 7}, Named{"bf", 0, 3, 4}}) {
    check(t.name, t.salt, ShardSlice::whole(ShardIndex::whole(t.rows, t.cols)));
    // every row split 1..rows ways, every col split 1..cols ways, and 2-D blocks of both
    for (int64_t pr = 1; pr <= t.rows; ++pr)
      if (t.rows % pr == 0)
        for (int64_t pc = 1; pc <= t.cols; ++pc)
          if (t.cols % pc == 0)
            for (int64_t i = 0; i < pr; ++i)
              for (int64_t j = 0; j < pc; ++j)
                check(t.name, t.salt,
                      ShardSlice::whole({t.rows, t.cols, i * (t.rows / pr), j * (t.cols / pc), t.rows / pr, t.cols / pc, 1}));
    // flat ranges of a TP block (a distributed-optimizer DP shard of a resharded layout)
    const ShardIndex half{t.rows, t.cols, 0, 0, t.rows, t.cols, 1};
    check(t.name, t.salt, ShardSlice{half, 3, half.local_numel() - 5});
  }
  // SwiGLU fc1: TP 1, 2 and 4 reads with chunks=2 ([gate slice; up slice]), plain row reads too.
  for (int tp : {1, 2, 4})
    for (int r = 0; r < tp; ++r) check("fc1", 3, ShardSlice::whole({8, 3, r * (4 / tp), 0, 4 / tp, 3, 2}));
  check("fc1", 3, ShardSlice::whole(ShardIndex::whole(8, 3)));
  check("fc1", 3, ShardSlice::whole({8, 3, 2, 0, 4, 3, 1}));  // rows 2..5: gate tail and up head
  check("fc1", 3, ShardSlice{ShardIndex{8, 3, 1, 0, 2, 3, 2}, 2, 9});
  // bf16 read as bf16 is exact; read as f32 converts.
  std::vector<uint16_t> raw(12);
  rd.read("bf", CheckpointKind::model, ShardSlice::whole(ShardIndex::whole(3, 4)),
          Tensor(raw.data(), DType::bf16, Device::cpu, {12}));
  CHECK(raw == keep16[5]);
  // The replica saved by rank 2 was deduplicated.
  const json m = json::parse(read_text_file(rd.directory() + "/manifest.json"));
  for (const auto& t : m["tensors"])
    if (t["name"] == "rows") CHECK(t["shards"].size() == 2);
}

TEST_CASE("checkpoint save refuses incomplete or overlapping shards", "[checkpoint]") {
  TempDir dir;
  save_simple(dir.path(), 1);
  CheckpointWriter w(dir.path(), 2, 0, 1);
  auto v = make_slice(1, ShardSlice::whole({4, 6, 0, 0, 2, 6, 1}));
  w.add("w", CheckpointKind::model, ShardIndex{4, 6, 0, 0, 2, 6, 1}, host(v));
  CHECK_THROWS_WITH(w.save(SaveGroup{}), Catch::Contains("'w'") && Catch::Contains("12 elements but the tensor has 24"));
  CHECK(tracker_text(dir.path()) == "1");
  CHECK(!path_exists(dir / "iter_0000002"));
  CHECK(!path_exists(dir / "iter_0000002.tmp"));
  check_simple(dir.path(), 1);
}

TEST_CASE("a failed write on one rank fails the save on every rank and keeps the old checkpoint", "[checkpoint][crash]") {
  TempDir dir;
  save_simple(dir.path(), 10);
  // Rank 1's optimizer file hits "no space" in the middle of a write.
  set_write_fault_hook([](const std::string& path, uint64_t offset, size_t) {
    return path.find("rank_00001-optim") != std::string::npos && offset > 0 ? ENOSPC : 0;
  });
  const int world = 2;
  ThreadGroup tg(world);
  std::vector<std::vector<float>> keep(world * 2);
  auto errors = run_ranks(world, [&](int r) {
    CheckpointWriter w(dir.path(), 20, r, world);
    const ShardSlice s = ShardSlice::whole({4, 6, 2 * r, 0, 2, 6, 1});
    keep[r * 2] = make_slice(1, s);
    keep[r * 2 + 1] = make_slice(3, s);
    w.add("w", CheckpointKind::model, s, host(keep[r * 2]));
    w.add("w.exp_avg", CheckpointKind::optimizer, s, host(keep[r * 2 + 1]));
    w.save(tg.group(r));
  });
  set_write_fault_hook({});
  CHECK_THAT(errors[1], Catch::Contains("rank_00001-optim.safetensors") && Catch::Contains("No space left on device"));
  CHECK_THAT(errors[0], Catch::Contains("failed on another rank"));
  CHECK(tracker_text(dir.path()) == "10");
  CHECK(!path_exists(dir / "iter_0000020"));
  CHECK(!path_exists(dir / "iter_0000020.tmp"));  // cleaned up to give the space back
  check_simple(dir.path(), 10);
}

TEST_CASE("a process killed mid-save leaves the previous checkpoint loadable", "[checkpoint][crash]") {
  TempDir dir;
  save_simple(dir.path(), 10);

  // Kills the saving child process (SIGKILL, no cleanup) at a chosen write.
  auto save_and_die = [&](int64_t iteration, std::function<bool(const std::string&, uint64_t)> die_when) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      set_write_fault_hook([die_when](const std::string& path, uint64_t offset, size_t) {
        if (die_when(path, offset)) ::raise(SIGKILL);
        return 0;
      });
      try {
        save_simple(dir.path(), iteration, 5);
      } catch (...) {
        ::_exit(3);
      }
      ::_exit(0);
    }
    int status = 0;
    ::waitpid(pid, &status, 0);
    return WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
  };

  SECTION("killed while writing a shard file") {
    REQUIRE(save_and_die(20, [](const std::string& p, uint64_t off) { return p.find("optim") != std::string::npos && off > 0; }));
    CHECK(tracker_text(dir.path()) == "10");
    CHECK(!path_exists(dir / "iter_0000020"));
    CHECK(path_exists(dir / "iter_0000020.tmp"));  // the debris a crash leaves
    check_simple(dir.path(), 10);
    // The next save of the same iteration cleans the debris and succeeds.
    save_simple(dir.path(), 20, 5);
    check_simple(dir.path(), 20, 5);
    CHECK(list_directory(dir / "iter_0000020").size() == 3);
  }
  SECTION("killed after publishing the directory, before moving the tracker") {
    REQUIRE(save_and_die(20, [](const std::string& p, uint64_t) {
      return p.find("latest_checkpointed_iteration.txt.tmp") != std::string::npos;
    }));
    CHECK(tracker_text(dir.path()) == "10");
    check_simple(dir.path(), 10);
    CheckpointReader r(dir.path(), 20);  // complete, just not yet the latest
    CHECK(r.iteration() == 20);
  }
  SECTION("killed while writing the manifest") {
    REQUIRE(save_and_die(20, [](const std::string& p, uint64_t) { return p.find("manifest.json") != std::string::npos; }));
    CHECK(tracker_text(dir.path()) == "10");
    check_simple(dir.path(), 10);
  }
}

TEST_CASE("re-saving an existing iteration replaces it whole", "[checkpoint]") {
  TempDir dir;
  save_simple(dir.path(), 30);
  save_simple(dir.path(), 30, 7);
  check_simple(dir.path(), 30, 7);
  CHECK(!path_exists(dir / "iter_0000030.tmp"));
  CHECK(!path_exists(dir / "iter_0000030.old"));
}

namespace {

// In a child process with its own mount namespace: a 256 KiB tmpfs, a small checkpoint that fits,
// then one that does not. Exit codes: 0 pass, 77 cannot mount here, others failures.
int full_disk_child(const std::string& mount_point) {
  if (::unshare(CLONE_NEWNS) != 0) return 77;
  if (::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) return 77;
  if (::mount("tmpfs", mount_point.c_str(), "tmpfs", 0, "size=256k") != 0) return 77;
  try {
    save_simple(mount_point, 1);  // ~1 KB
    CheckpointWriter w(mount_point, 2, 0, 1);
    std::vector<float> big(200 * 1024, 1.0f);  // 800 KB: more than the file system holds
    w.add("big", CheckpointKind::model, ShardIndex::whole(200, 1024), host(big));
    try {
      w.save(SaveGroup{});
      return 10;  // should have failed
    } catch (const Error& e) {
      const std::string msg = e.what();
      if (msg.find("No space left on device") == std::string::npos) return 11;
      if (msg.find("rank_00000-model.safetensors") == std::string::npos) return 12;
    }
    if (read_text_file(checkpoint_tracker_path(mount_point)) != "1") return 13;
    if (path_exists(mount_point + "/iter_0000002") || path_exists(mount_point + "/iter_0000002.tmp")) return 14;
    verify_simple(mount_point, 1);
    // With the partial files removed, a save that fits works again.
    save_simple(mount_point, 3);
    verify_simple(mount_point, 3);
  } catch (...) {
    return 15;
  }
  return 0;
}

}  // namespace

TEST_CASE("a full disk during a save gives a clear error and keeps the previous checkpoint", "[checkpoint][crash]") {
  TempDir dir;
  const std::string mp = dir / "small_fs";
  make_directories(mp);
  const pid_t pid = ::fork();
  if (pid == 0) ::_exit(full_disk_child(mp));
  int status = 0;
  ::waitpid(pid, &status, 0);
  REQUIRE(WIFEXITED(status));
  const int code = WEXITSTATUS(status);
  if (code == 77) {
    MT_SKIP("the real full-disk test: cannot mount a size-limited tmpfs here (needs CAP_SYS_ADMIN for "
            "unshare(CLONE_NEWNS) + mount); the injected-ENOSPC test case still runs");
  }
  CHECK(code == 0);
}

TEST_CASE("corrupt, truncated and mismatched checkpoints are refused naming the file", "[checkpoint][errors]") {
  TempDir dir;
  save_simple(dir.path(), 4);
  const std::string iter = dir / "iter_0000004";
  const std::string model = iter + "/rank_00000-model.safetensors";

  SECTION("flipped byte in tensor data: checksum") {
    std::string b = mt_test::read_bytes(model);
    b[b.size() - 3] ^= 0x40;
    mt_test::write_text(model, b);
    CheckpointReader r(dir.path());
    std::vector<float> out(24);
    CHECK_THROWS_WITH(r.read("w", ShardIndex::whole(4, 6), host(out)),
                      Catch::Contains("checksum mismatch") && Catch::Contains(model));
    CHECK_THROWS_WITH(r.verify_all(), Catch::Contains("checksum mismatch"));
  }
  SECTION("truncated shard file") {
    std::string b = mt_test::read_bytes(model);
    mt_test::write_text(model, b.substr(0, b.size() - 10));
    CHECK_THROWS_WITH(CheckpointReader(dir.path()), Catch::Contains(model) && Catch::Contains("truncated"));
  }
  SECTION("missing shard file") {
    ::unlink(model.c_str());
    CHECK_THROWS_WITH(CheckpointReader(dir.path()), Catch::Contains(model) && Catch::Contains("missing"));
  }
  SECTION("missing or corrupt manifest") {
    ::unlink((iter + "/manifest.json").c_str());
    CHECK_THROWS_WITH(CheckpointReader(dir.path()), Catch::Contains("manifest.json is missing"));
    mt_test::write_text(iter + "/manifest.json", "{\"format\": \"megatrain-checkpoint\", ");
    CHECK_THROWS_WITH(CheckpointReader(dir.path()), Catch::Contains("manifest.json") && Catch::Contains("corrupt"));
  }
  SECTION("another model shape") {
    CheckpointReader r(dir.path());
    std::vector<float> out(32);
    CHECK_THROWS_WITH(r.read("w", ShardIndex::whole(4, 8), host(out)),
                      Catch::Contains("'w'") && Catch::Contains("4x6") && Catch::Contains("4x8"));
    std::vector<float> b(6);
    CHECK_THROWS_WITH(r.read("b", ShardIndex::whole(6, 1), host(b), {3, 2}),
                      Catch::Contains("'b'") && Catch::Contains("[6]") && Catch::Contains("[3, 2]"));
  }
  SECTION("missing tensor") {
    CheckpointReader r(dir.path());
    std::vector<float> out(24);
    CHECK_THROWS_WITH(r.read("decoder.layers.9.mlp.linear_fc1.weight", ShardIndex::whole(4, 6), host(out)),
                      Catch::Contains("no model tensor 'decoder.layers.9.mlp.linear_fc1.weight'"));
    CHECK_THROWS_WITH(r.info("w.exp_avg_sq", CheckpointKind::optimizer), Catch::Contains("no optim tensor"));
  }
  SECTION("integer tensor cannot be read as float") {
    CheckpointReader r(dir.path());
    std::vector<int32_t> out(24);
    CHECK_THROWS_WITH(r.read("w", ShardIndex::whole(4, 6), Tensor(out.data(), DType::i32, Device::cpu, {24})),
                      Catch::Contains("cannot be read as int32"));
  }
  SECTION("missing tracker, bad tracker, missing iteration directory") {
    TempDir empty;
    CHECK(!locate_checkpoint(empty.path()).has_value());
    CHECK_THROWS_WITH(CheckpointReader(empty.path()), Catch::Contains("latest_checkpointed_iteration.txt"));
    CHECK_THROWS_WITH(CheckpointReader(dir.path(), 99), Catch::Contains("--ckpt-step 99") && Catch::Contains("iter_0000099"));
    write_file_atomically(checkpoint_tracker_path(dir.path()), "12abc");
    CHECK_THROWS_WITH(locate_checkpoint(dir.path()), Catch::Contains("invalid checkpoint tracker") && Catch::Contains("12abc"));
    write_file_atomically(checkpoint_tracker_path(dir.path()), "8\n");
    CHECK_THROWS_WITH(locate_checkpoint(dir.path()), Catch::Contains("iter_0000008") && Catch::Contains("does not exist"));
    write_file_atomically(checkpoint_tracker_path(dir.path()), "4\n");
    CHECK(locate_checkpoint(dir.path())->iteration == 4);
  }
}

TEST_CASE("a Megatron-LM checkpoint under --load is named as such, with the way to its weights", "[checkpoint][errors]") {
  TempDir dir;
  auto iteration_dir = [&](const std::string& name, const std::vector<std::string>& files) {
    const std::string d = dir.path() + "/" + name + "/iter_0000100";
    make_directories(d);
    for (const std::string& f : files) {
      make_directories(parent_directory(d + "/" + f));
      mt_test::write_text(d + "/" + f, "x");
    }
    return d;
  };
  const std::string dist = iteration_dir("dist", {"metadata.json", "common.pt", "__0_0.distcp"});
  CHECK_THROWS_WITH(CheckpointReader::open_directory(dist),
                    Catch::Contains("is a Megatron-LM checkpoint (torch_dist format)") && Catch::Contains("import-megatron"));
  const std::string legacy = iteration_dir("legacy", {"mp_rank_00/model_optim_rng.pt"});
  CHECK_THROWS_WITH(CheckpointReader::open_directory(legacy),
                    Catch::Contains("is a Megatron-LM checkpoint (torch format)"));
  const std::string empty = iteration_dir("empty", {});
  CHECK_THROWS_WITH(CheckpointReader::open_directory(empty),
                    Catch::Contains("is not a complete megatrain checkpoint") && !Catch::Contains("Megatron-LM"));
}

TEST_CASE("run state and per-rank state round trip", "[checkpoint]") {
  TempDir dir;
  ThreadGroup tg(2);
  std::vector<std::vector<float>> keep(2);
  auto errors = run_ranks(2, [&](int r) {
    CheckpointWriter w(dir.path(), 3, r, 2);
    const ShardSlice s = ShardSlice::whole({2, 2, r, 0, 1, 2, 1});
    keep[r] = make_slice(1, s);
    w.add("x", CheckpointKind::main_params, s, host(keep[r]));
    RunState st;
    st.iteration = 3;
    st.consumed_train_samples = 96;
    st.consumed_valid_samples = 32;
    st.num_floating_point_operations_so_far = 1.5e18;
    st.lr_scheduler = {{"num_steps", 96}, {"max_lr", 3e-4}};
    st.loss_scaler = {{"scale", 65536.0}, {"growth_tracker", 3}};
    st.config = {{"num_layers", 2}};
    w.set_run_state(st);
    w.set_rank_state({{"philox_offset", 1000 + r}});
    w.save(tg.group(r));
  });
  for (const auto& e : errors) REQUIRE(e == "");
  CheckpointReader r(dir.path());
  CHECK(r.run_state().consumed_valid_samples == 32);
  CHECK(r.run_state().num_floating_point_operations_so_far == 1.5e18);
  CHECK(r.run_state().lr_scheduler["num_steps"] == 96);
  CHECK(r.run_state().loss_scaler["growth_tracker"] == 3);
  CHECK(r.run_state().config["num_layers"] == 2);
  CHECK(r.rank_state(1)["philox_offset"] == 1001);
  CHECK(r.rank_state(5).is_null());
  std::vector<float> out(4);
  r.read("x", CheckpointKind::main_params, ShardSlice::whole(ShardIndex::whole(2, 2)), host(out));
  CHECK(out == make_slice(1, ShardSlice::whole(ShardIndex::whole(2, 2))));
}

TEST_CASE("async save writes in the background and commits at the next call", "[checkpoint][async]") {
  TempDir dir;
  std::vector<float> a = make_slice(1, ShardSlice::whole(ShardIndex::whole(4, 6)));
  std::vector<float> b = make_slice(9, ShardSlice::whole(ShardIndex::whole(4, 6)));
  {
    AsyncCheckpointSaver saver;
    auto w1 = std::make_unique<CheckpointWriter>(dir.path(), 100, 0, 1);
    w1->add("w", CheckpointKind::model, ShardIndex::whole(4, 6), host(a));
    saver.start(std::move(w1), SaveGroup{});
    CHECK(saver.pending());
    auto w2 = std::make_unique<CheckpointWriter>(dir.path(), 200, 0, 1);
    w2->add("w", CheckpointKind::model, ShardIndex::whole(4, 6), host(b));
    saver.start(std::move(w2), SaveGroup{});  // commits 100 first
    CHECK(tracker_text(dir.path()) == "100");
    // finalize_if_done eventually commits without blocking the caller.
    for (int i = 0; i < 2000 && saver.pending(); ++i) {
      saver.finalize_if_done(SaveGroup{});
      if (saver.pending()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    saver.finalize(SaveGroup{});
    CHECK(!saver.pending());
  }
  CHECK(tracker_text(dir.path()) == "200");
  CheckpointReader r(dir.path());
  std::vector<float> out(24);
  r.read("w", ShardIndex::whole(4, 6), host(out));
  CHECK(out == b);
  CheckpointReader r1(dir.path(), 100);
  r1.read("w", ShardIndex::whole(4, 6), host(out));
  CHECK(out == a);

  // A background failure surfaces at the next call, and the previous checkpoint stays.
  set_write_fault_hook([](const std::string&, uint64_t, size_t) { return EIO; });
  AsyncCheckpointSaver saver;
  auto w3 = std::make_unique<CheckpointWriter>(dir.path(), 300, 0, 1);
  w3->add("w", CheckpointKind::model, ShardIndex::whole(4, 6), host(a));
  saver.start(std::move(w3), SaveGroup{});
  CHECK_THROWS_WITH(saver.finalize(SaveGroup{}), Catch::Contains("Input/output error"));
  set_write_fault_hook({});
  CHECK(tracker_text(dir.path()) == "200");
}

TEST_CASE("Megatron's load decision: a missing tracker warns or exits", "[checkpoint]") {
  TempDir dir;
  CheckpointConfig cfg;
  CHECK(!checkpoint_to_load(cfg).has_value());  // no --load
  cfg.load = dir.path();
  log::set_quiet(true);
  CHECK(!checkpoint_to_load(cfg).has_value());  // warns, starts from random
  log::set_quiet(false);
  cfg.exit_on_missing_checkpoint = true;
  CHECK_THROWS_WITH(checkpoint_to_load(cfg), Catch::Contains("--exit-on-missing-checkpoint") &&
                                                 Catch::Contains("latest_checkpointed_iteration.txt"));
  save_simple(dir.path(), 6);
  log::set_quiet(true);
  const auto loc = checkpoint_to_load(cfg);
  log::set_quiet(false);
  REQUIRE(loc.has_value());
  CHECK(loc->iteration == 6);
  CHECK(loc->directory == dir / "iter_0000006");
  cfg.ckpt_step = 7;
  CHECK_THROWS_WITH(checkpoint_to_load(cfg), Catch::Contains("--ckpt-step 7"));
}
