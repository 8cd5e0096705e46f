// --dist-ckpt-strictness through the megatrain binary on the CPU: a checkpoint that lacks tensors
// the run loads (Megatron's "unexpected" keys) and one that holds a tensor no rank loads
// ("missing" keys), loaded with each of Megatron-LM's eight values.
#include <catch2/catch.hpp>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "ckpt_test_util.h"
#include "training_binary_util.h"

using mt_test::read_bytes;
using mt_test::TempDir;
using mt_test::write_text;
using namespace mt_test::training_binary;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

const char* kLacking = "decoder.layers.1.mlp.linear_fc2.weight";
const char* kExtra = "decoder.layers.0.mlp.extra_proj.weight";

// A copy of the checkpoint at `from` (iteration 2) under `to`, its manifest edited by `edit`.
template <class Edit>
void edited_copy(const std::string& from, const std::string& to, Edit edit) {
  fs::create_directories(to);
  fs::copy(from + "/iter_0000002", to + "/iter_0000002", fs::copy_options::recursive);
  write_text(to + "/latest_checkpointed_iteration.txt", "2");
  const std::string path = to + "/iter_0000002/manifest.json";
  json m = json::parse(read_bytes(path));
  edit(m.at("tensors"));
  write_text(path, m.dump(2));
}

Result load(const std::string& dir, const std::string& strictness) {
  return megatrain(kGpt + " --train-iters 4 --load " + dir + " --dist-ckpt-strictness " + strictness);
}

bool has(const Result& r, const std::string& text) { return r.out.find(text) != std::string::npos; }

}  // namespace

TEST_CASE("checkpoint: --dist-ckpt-strictness with tensors lacking or extra", "[checkpoint][binary][cli]") {
  TempDir d;
  const std::string saved = d / "saved", lacking = d / "lacking", extra = d / "extra";
  require_ok(megatrain(kGpt + " --train-iters 4 --save-interval 2 --exit-interval 2 --save " + saved));
  // Lacking: the weight and its two Adam moments are gone from the manifest.
  edited_copy(saved, lacking, [](json& tensors) {
    json kept = json::array();
    size_t removed = 0;
    for (const json& t : tensors) {
      if (t.at("name").get<std::string>().rfind(kLacking, 0) == 0) ++removed;
      else kept.push_back(t);
    }
    REQUIRE(removed == 3);
    tensors = kept;
  });
  // Extra: a model tensor no rank loads (a second name for existing shard data).
  edited_copy(saved, extra, [](json& tensors) {
    json copy;
    for (const json& t : tensors)
      if (t.at("name") == "decoder.layers.0.mlp.linear_fc1.weight" && t.at("kind") == "model") copy = t;
    REQUIRE(copy.is_object());
    copy["name"] = kExtra;
    tensors.push_back(copy);
  });
  const std::string lacking_names = std::string(kLacking) + ", " + kLacking + ".exp_avg, " + kLacking + ".exp_avg_sq";

  SECTION("the default fails on a lacking tensor and ignores an extra one") {
    const Result a = load(lacking, "assume_ok_unexpected");
    CHECK(a.code != 0);
    CHECK(has(a, std::string("has no model tensor '") + kLacking + "'"));
    const Result b = load(extra, "assume_ok_unexpected");
    INFO(b.out);
    CHECK(b.code == 0);
    CHECK_FALSE(has(b, "does not match this run"));
  }
  SECTION("log_*: lacking tensors are named and left as initialized; log_all also names extra ones") {
    for (const char* v : {"log_unexpected", "log_all"}) {
      const Result r = load(lacking, v);
      INFO(v << "\n" << r.out);
      CHECK(r.code == 0);
      CHECK(has(r, std::string("does not match this run (--dist-ckpt-strictness ") + v + "): 3 tensors this run loads "
                   "are not in it: " + lacking_names + "; the tensors it lacks keep their initial values"));
      CHECK(has(r, "iteration        3/       4"));
    }
    const Result u = load(extra, "log_unexpected");
    CHECK(u.code == 0);
    CHECK_FALSE(has(u, "does not match this run"));
    const Result all = load(extra, "log_all");
    INFO(all.out);
    CHECK(all.code == 0);
    CHECK(has(all, std::string("does not match this run (--dist-ckpt-strictness log_all): 1 tensor in it is not "
                               "loaded by this run: ") + kExtra));
  }
  SECTION("raise_*: the load fails naming them; raise_all also for extra ones") {
    for (const char* v : {"raise_unexpected", "raise_all"}) {
      const Result r = load(lacking, v);
      INFO(v << "\n" << r.out);
      CHECK(r.code != 0);
      CHECK(has(r, std::string("does not match this run (--dist-ckpt-strictness ") + v + "): 3 tensors this run loads "
                   "are not in it: " + lacking_names));
    }
    const Result u = load(extra, "raise_unexpected");
    CHECK(u.code == 0);
    const Result all = load(extra, "raise_all");
    CHECK(all.code != 0);
    CHECK(has(all, std::string("1 tensor in it is not loaded by this run: ") + kExtra));
  }
  SECTION("return_* and ignore_all: the load goes on without a word") {
    for (const char* v : {"return_unexpected", "return_all", "ignore_all"}) {
      for (const std::string& dir : {lacking, extra}) {
        const Result r = load(dir, v);
        INFO(v << " " << dir << "\n" << r.out);
        CHECK(r.code == 0);
        CHECK_FALSE(has(r, "does not match this run"));
        CHECK_FALSE(has(r, "has no model tensor"));
      }
    }
  }
  CHECK(fs::exists(saved + "/iter_0000002/manifest.json"));
}
