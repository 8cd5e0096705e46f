// FP8 scaling state in training checkpoints: saved per layer, and a resume is bit-exact (losses,
// weights, amax histories and scales); a checkpoint with another history length is refused.
#include <catch2/catch.hpp>

#include <cstring>
#include <memory>
#include <vector>

#include "app/checkpointing.h"
#include "core/error.h"
#include "engine/backend.h"
#include "engine/gpt_model.h"
#include "engine/trainer.h"
#include "parallel/parallel_state.h"
#include "tests/ckpt_test_util.h"
#include "tests/engine_test_util.h"
#include "tests/split_run_util.h"

using namespace mt;
using Catch::Matchers::Contains;

namespace {

using test::host_copy;

struct Fp8SplitRun {
  std::vector<double> losses;
  std::vector<float> params, history, scale, scale_inv;
};

Fp8SplitRun run_part(const Config& base, const std::string& dir, int64_t to, bool load, bool save) {
  Fp8SplitRun out;
  test::run_split_part(base, dir, to, load, save, [&](Backend& be, GptModel& model, Trainer& trainer) {
    out.losses = trainer.loss_history();
    out.params = host_copy(be, model.params_flat());
    const Fp8State& f = model.fp8_state();
    if (f.any()) {
      out.history = host_copy(be, f.history());
      out.scale = host_copy(be, f.scale());
      out.scale_inv = host_copy(be, f.scale_inv_all());
    }
  });
  return out;
}

Config fp8_config() {
  Config c = test::tiny_gpt_config();
  c.train.fp8_format = Fp8Format::hybrid;
  c.train.fp8_recipe = Fp8Recipe::delayed;
  c.train.fp8_amax_history_len = 3;
  c.train.fp8_amax_compute_algo = Fp8AmaxAlgo::max;
  c.train.fp8_margin = 1;
  c.train.global_batch_size = 4;
  c.train.train_iters = 8;
  c.train.lr_warmup_iters = 2;
  test::derive(c);
  return c;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

TEST_CASE("fp8 resume is bit-exact: amax histories and scales are in the checkpoint", "[fp8][ckpt-train][resume]") {
  const Config c = fp8_config();
  mt_test::TempDir dir;
  const Fp8SplitRun straight = run_part(c, dir.path() + "/unused", 8, false, false);
  REQUIRE(straight.losses.size() == 8);
  REQUIRE(straight.scale.size() == 24u);
  const Fp8SplitRun first = run_part(c, dir.path(), 4, false, true);
  const Fp8SplitRun second = run_part(c, dir.path(), 8, true, false);
  REQUIRE(second.losses.size() == 4);
  for (int i = 0; i < 4; ++i) {
    INFO("iteration " << 5 + i);
    CHECK(second.losses[static_cast<size_t>(i)] == straight.losses[static_cast<size_t>(4 + i)]);
  }
  CHECK(same_bits(second.params, straight.params));
  CHECK(same_bits(second.history, straight.history));
  CHECK(same_bits(second.scale, straight.scale));
  CHECK(same_bits(second.scale_inv, straight.scale_inv));
  // The state that was saved is not the initial one (a resume that dropped it would differ).
  bool moved = false;
  for (float s : first.scale) moved |= s != 1.0f;
  CHECK(moved);
}

TEST_CASE("fp8 checkpoint: another history length is refused, a checkpoint without FP8 state starts at scale 1",
          "[fp8][ckpt-train]") {
  const Config c = fp8_config();
  mt_test::TempDir dir;
  run_part(c, dir.path(), 2, false, true);
  Config other = c;
  other.train.fp8_amax_history_len = 5;
  try {
    run_part(other, dir.path(), 3, true, false);
    FAIL("expected an error");
  } catch (const Error& e) {
    CHECK_THAT(std::string(e.what()), Contains("--fp8-amax-history-len"));
  }
  // A bf16 (here float32) checkpoint resumed in FP8.
  Config plain = c;
  plain.train.fp8_format.reset();
  mt_test::TempDir dir2;
  run_part(plain, dir2.path(), 2, false, true);
  Config lc = c;
  lc.checkpoint.load = dir2.path();
  ParallelState ps = make_single_process_state();
  auto be = make_reference_backend(1);
  const ModelDims dims = ModelDims::from_config(lc, ps);
  GptModel model(dims, ModelOptions::from_config(lc, dims, DType::f32), ps, *be);
  TrainingCheckpoints ck(lc, ps, model);
  REQUIRE(ck.load().loaded);
  const std::vector<float> scale = host_copy(*be, model.fp8_state().scale());
  REQUIRE(scale.size() == 24u);
  for (float s : scale) CHECK(s == 1.0f);
}
