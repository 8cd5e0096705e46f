// --use-precision-aware-optimizer: Megatron's flag rules, bf16 Adam moments in the reference
// update (read as float, stored rounded to nearest even), a tiny model training with them close
// to float32 moments, and checkpoints: a bit-exact resume with bf16 moments, and float32 moments
// loaded into bf16 ones by rounding.
#include <catch2/catch.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "app/checkpointing.h"
#include "app/training_data.h"
#include "core/dtype.h"
#include "core/master_remainder.h"
#include "engine/backend.h"
#include "engine/gpt_model.h"
#include "engine/model_chunks.h"
#include "engine/trainer.h"
#include "parallel/parallel_state.h"
#include "parallel/rank_position.h"
#include "tests/ckpt_test_util.h"
#include "tests/cli_test_util.h"
#include "tests/engine_test_util.h"
#include "tests/split_run_util.h"

using namespace mt;
using namespace mt::test;
using Catch::Contains;

namespace {
const Args kPrecisionAware = words("--bf16 --use-distributed-optimizer --use-precision-aware-optimizer");
}  // namespace

TEST_CASE("precision-aware optimizer: Megatron's rules for the flag and its dtypes", "[cli][precision-aware]") {
  // The dtypes need the flag (Megatron's OptimizerConfig assertions).
  for (const char* flag : {"--exp-avg-dtype", "--exp-avg-sq-dtype", "--main-grads-dtype"}) {
    INFO(flag);
    CHECK_THAT(parse_error(small_gpt() + words("--bf16 --use-distributed-optimizer") + Args{flag, "bf16"}),
               Contains(std::string(flag) + " can only be fp32 when not using precision-aware optimizer"));
  }
  // Adam only, with the distributed optimizer only.
  CHECK_THAT(parse_error(small_gpt() + kPrecisionAware + words("--optimizer sgd")),
             Contains("--use-precision-aware-optimizer only supported with adam"));
  CHECK_THAT(parse_error(small_gpt() + words("--bf16 --use-precision-aware-optimizer")),
             Contains("--use-precision-aware-optimizer only supported with distributed optimizer"));
  // bf16 main grads exclude an explicit --accumulate-allreduce-grads-in-fp32 (Megatron's bf16 rule).
  CHECK_THAT(parse_error(small_gpt() + kPrecisionAware + words("--main-grads-dtype bf16 --accumulate-allreduce-grads-in-fp32")),
             Contains("--main-grads-dtype can only be fp32 when --accumulate-allreduce-grads-in-fp32 is set"));
  // What is not built is refused by name.
  CHECK_THAT(parse_error(small_gpt() + kPrecisionAware + words("--exp-avg-dtype fp16")),
             Contains("megatrain does not support --exp-avg-dtype fp16 yet"));
  CHECK_THAT(parse_error(small_gpt() + kPrecisionAware + words("--exp-avg-sq-dtype fp8")),
             Contains("megatrain does not support --exp-avg-sq-dtype fp8 yet"));
  CHECK_THAT(parse_error(small_gpt() + kPrecisionAware + words("--main-params-dtype fp16")),
             Contains("megatrain does not support --main-params-dtype fp16 yet"));
  CHECK_THAT(parse_error(small_gpt() + kPrecisionAware + words("--exp-avg-dtype int8")), Contains("--exp-avg-dtype"));

  // Accepted: the dtypes reach the configuration, and bf16 main grads turn off Megatron's float32
  // accumulation as --grad-reduce-in-bf16 does.
  const Config c = parse(small_gpt() + kPrecisionAware +
                         words("--main-grads-dtype bf16 --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16"));
  CHECK(c.train.use_precision_aware_optimizer);
  CHECK(c.train.exp_avg_dtype == StateDtype::bf16);
  CHECK(c.train.exp_avg_sq_dtype == StateDtype::bf16);
  CHECK(c.train.main_grads_dtype == StateDtype::bf16);
  CHECK_FALSE(c.parallel.accumulate_allreduce_grads_in_fp32);
  CHECK(parse(small_gpt() + kPrecisionAware).parallel.accumulate_allreduce_grads_in_fp32);  // fp32 main grads
  const Config only_m = parse(small_gpt() + kPrecisionAware + words("--exp-avg-dtype bf16"));
  CHECK(only_m.train.exp_avg_sq_dtype == StateDtype::fp32);

  // Without --bf16 the gradient buffer keeps the parameters' dtype (as in Megatron): a note says so.
  std::vector<SetupMessage> messages;
  parse(small_gpt() + words("--use-distributed-optimizer --use-precision-aware-optimizer --main-grads-dtype bf16"), 1,
        &messages);
  bool noted = false;
  for (const SetupMessage& m : messages) noted |= m.text.find("--main-grads-dtype bf16 has no effect without --bf16") != std::string::npos;
  CHECK(noted);
}

TEST_CASE("precision-aware optimizer: the model's buffers take the dtypes", "[engine][precision-aware]") {
  ParallelState ps = make_single_process_state();
  auto dtypes_of = [&](const std::string& flags) {
    const Config c = parse(small_gpt() + kPrecisionAware + words(flags));
    const std::vector<ChunkSpec> specs = model_chunk_specs(c, ps, DType::bf16);
    REQUIRE(specs.size() == 1);
    const ModelOptions& o = specs[0].options;
    return std::vector<bool>{o.grad == DType::bf16, o.bf16_exp_avg, o.bf16_exp_avg_sq};
  };
  CHECK(dtypes_of("") == std::vector<bool>{false, false, false});
  CHECK(dtypes_of("--main-grads-dtype bf16") == std::vector<bool>{true, false, false});
  CHECK(dtypes_of("--exp-avg-dtype bf16") == std::vector<bool>{false, true, false});
  CHECK(dtypes_of("--exp-avg-sq-dtype bf16") == std::vector<bool>{false, false, true});
  // The memory plan counts 2 bytes per moment element instead of 4.
  const Config f32 = parse(small_gpt() + kPrecisionAware);
  const Config bf16 = parse(small_gpt() + kPrecisionAware + words("--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16"));
  const MemoryPlan a = plan_rank_memory(f32, ps, DType::bf16);
  const MemoryPlan b = plan_rank_memory(bf16, ps, DType::bf16);
  CHECK(b.of(MemoryCategory::optimizer_states) * 2 == a.of(MemoryCategory::optimizer_states));
  CHECK(a.of(MemoryCategory::optimizer_states) > 0);
}

TEST_CASE("precision-aware optimizer: the reference AdamW reads bf16 moments as float and rounds them once",
          "[reference][precision-aware]") {
  auto be = make_reference_backend(2);
  std::mt19937_64 rng(11);
  std::normal_distribution<double> nd(0.0, 1.0);
  const int64_t n = 1037;
  std::vector<float> w(n), g(n);
  std::vector<uint16_t> m(n), v(n);
  for (int64_t i = 0; i < n; ++i) {
    w[i] = static_cast<float>(nd(rng));
    g[i] = static_cast<float>(0.01 * nd(rng));
    m[i] = float_to_bf16_bits(static_cast<float>(1e-3 * nd(rng)));
    v[i] = float_to_bf16_bits(static_cast<float>(1e-5 * std::fabs(nd(rng))));
  }
  const std::vector<float> w0 = w;
  const std::vector<uint16_t> m0 = m, v0 = v;
  auto t = [](void* p, DType d, int64_t count) { return Tensor(p, d, Device::cpu, {count}); };
  OptimStepParams p;
  p.lr[0] = 1e-3f;
  p.weight_decay[0] = 0.1f;
  p.beta1 = 0.9f, p.beta2 = 0.95f, p.eps = 1e-8f;
  p.step = 3;
  p.grad_scale = 0.5f;
  const std::vector<OptimSegment> segs = {OptimSegment{0, n, 0}};
  be->adamw_step(t(w.data(), DType::f32, n), t(g.data(), DType::f32, n), t(m.data(), DType::bf16, n),
                 t(v.data(), DType::bf16, n), Tensor(), segs, p);
  const double b1 = p.beta1, b2 = p.beta2, bc1 = 1 - std::pow(b1, 3.0), bc2 = 1 - std::pow(b2, 3.0);
  int64_t wrong_m = 0, wrong_v = 0, wrong_w = 0, rounded = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double gi = static_cast<double>(g[i]) * p.grad_scale;
    const double mi = b1 * bf16_bits_to_float(m0[i]) + (1 - b1) * gi;
    const double vi = b2 * bf16_bits_to_float(v0[i]) + (1 - b2) * gi * gi;
    wrong_m += m[i] != float_to_bf16_bits(static_cast<float>(mi));
    wrong_v += v[i] != float_to_bf16_bits(static_cast<float>(vi));
    rounded += static_cast<double>(bf16_bits_to_float(m[i])) != static_cast<double>(static_cast<float>(mi));
    // The update takes the unrounded moments (the stored ones are rounded after it).
    const double upd = (mi / bc1) / (std::sqrt(vi / bc2) + p.eps) + p.weight_decay[0] * w0[i];
    wrong_w += w[i] != static_cast<float>(w0[i] - p.lr[0] * upd);
  }
  CHECK(wrong_m == 0);
  CHECK(wrong_v == 0);
  CHECK(wrong_w == 0);
  CHECK(rounded > n / 2);  // the stored moments did lose bits

  // Moments in another dtype than bf16 or the master weights' are refused.
  std::vector<uint16_t> h(n);
  CHECK_THROWS_WITH(be->adamw_step(t(w.data(), DType::f32, n), t(g.data(), DType::f32, n), t(h.data(), DType::f16, n),
                                   t(v.data(), DType::bf16, n), Tensor(), segs, p),
                    Contains("exp_avg is float16"));
}

namespace {

// A tiny model trained on mock data, with the given moment dtypes; its losses.
std::vector<double> train_losses(Config cfg, bool bf16_m, bool bf16_v) {
  cfg = with_mock_training(cfg);
  cfg.train.train_iters = 40;
  cfg.train.lr_warmup_iters = 4;
  cfg.train.eval_iters = 0;
  cfg.train.exp_avg_dtype = bf16_m ? StateDtype::bf16 : StateDtype::fp32;
  cfg.train.exp_avg_sq_dtype = bf16_v ? StateDtype::bf16 : StateDtype::fp32;
  derive(cfg);
  ParallelState ps = make_single_process_state();
  auto be = make_reference_backend(2);
  const ModelDims dims = ModelDims::from_config(cfg, ps);
  GptModel model(dims, ModelOptions::from_config(cfg, dims, DType::f32), ps, *be);
  REQUIRE(model.exp_avg_flat().dtype == (bf16_m ? DType::bf16 : DType::f32));
  REQUIRE(model.exp_avg_sq_flat().dtype == (bf16_v ? DType::bf16 : DType::f32));
  model.init_parameters();
  TrainingData data = build_training_data(cfg, 0, 1, 0);
  NullReporter reporter;
  Trainer trainer(cfg, ps, model, *data.train, nullptr, reporter);
  trainer.train();
  return trainer.loss_history();
}

}  // namespace

TEST_CASE("precision-aware optimizer: tiny GPT and Llama train with bf16 moments close to float32 ones",
          "[train][precision-aware]") {
  for (const Config& c : {tiny_gpt_config(), tiny_llama_config()}) {
    const std::vector<double> f32 = train_losses(c, false, false), bf16 = train_losses(c, true, true),
                              v_only = train_losses(c, false, true);
    REQUIRE(f32.size() == 40);
    REQUIRE(bf16.size() == 40);
    CHECK(f32.front() == bf16.front());  // the same forward before any update
    CHECK(bf16.back() < 0.6 * bf16.front());
    double max_rel = 0, any_diff = 0, v_diff = 0;
    for (size_t i = 0; i < f32.size(); ++i) {
      max_rel = std::max(max_rel, std::fabs(bf16[i] - f32[i]) / f32[i]);
      any_diff = std::max(any_diff, std::fabs(bf16[i] - f32[i]));
      v_diff = std::max(v_diff, std::fabs(v_only[i] - f32[i]));
    }
    CAPTURE(max_rel);
    CHECK(max_rel < 3e-3);  // measured 1.9e-4 (GPT) and 7.5e-4 (Llama)
    CHECK(any_diff > 0);  // the moments were rounded
    CHECK(v_diff > 0);    // each moment's dtype is its own
  }
}

namespace {

struct Part {
  std::vector<double> losses;
  std::vector<unsigned char> params, m, v;
};

std::vector<unsigned char> bytes_of(Backend& be, const Tensor& t) {
  std::vector<unsigned char> out(t.nbytes());
  be.copy_to_host(out.data(), t);
  return out;
}

Part run_part(const Config& c, const std::string& dir, int64_t to, bool load, bool save) {
  Part out;
  run_split_part(c, dir, to, load, save, [&](Backend& be, GptModel& model, Trainer& trainer) {
    out.losses = trainer.loss_history();
    out.params = bytes_of(be, model.params_flat());
    out.m = bytes_of(be, model.exp_avg_flat());
    out.v = bytes_of(be, model.exp_avg_sq_flat());
  });
  return out;
}

// A model built from c that loads the checkpoint in dir, without training.
Part load_only(Config c, const std::string& dir) {
  c.checkpoint.load = dir;
  ParallelState ps = make_single_process_state();
  auto be = make_reference_backend(1);
  const ModelDims dims = ModelDims::from_config(c, ps);
  GptModel model(dims, ModelOptions::from_config(c, dims, DType::f32), ps, *be);
  model.init_parameters();
  TrainingCheckpoints ck(c, ps, model);
  REQUIRE(ck.load().loaded);
  Part out;
  out.params = bytes_of(*be, model.params_flat());
  out.m = bytes_of(*be, model.exp_avg_flat());
  out.v = bytes_of(*be, model.exp_avg_sq_flat());
  return out;
}

Config moments_config(bool bf16) {
  Config c = tiny_llama_config();
  c.train.train_iters = 6;
  c.train.lr_warmup_iters = 2;
  c.train.exp_avg_dtype = c.train.exp_avg_sq_dtype = bf16 ? StateDtype::bf16 : StateDtype::fp32;
  derive(c);
  return c;
}

}  // namespace

TEST_CASE("precision-aware optimizer: bf16 moments resume bit-exactly, float32 ones load into them rounded",
          "[ckpt-train][precision-aware]") {
  mt_test::TempDir dir;
  const Config bf16 = moments_config(true);
  const Part straight = run_part(bf16, dir.path() + "/unused", 6, false, false);
  const Part first = run_part(bf16, dir.path() + "/bf16", 3, false, true);
  const Part second = run_part(bf16, dir.path() + "/bf16", 6, true, false);
  REQUIRE(second.losses.size() == 3);
  for (size_t i = 0; i < 3; ++i) CHECK(second.losses[i] == straight.losses[3 + i]);
  CHECK(second.params == straight.params);
  CHECK(second.m == straight.m);
  CHECK(second.v == straight.v);
  CHECK(second.m.size() * 2 == straight.params.size());  // 2 bytes per element (float32 parameters: 4)

  // A float32-moment checkpoint into a bf16-moment model: the moments are the saved ones rounded.
  const Config f32 = moments_config(false);
  const Part saved = run_part(f32, dir.path() + "/f32", 3, false, true);
  const Part loaded = load_only(bf16, dir.path() + "/f32");
  REQUIRE(saved.m.size() == 2 * loaded.m.size());
  int64_t wrong = 0, changed = 0;
  for (size_t i = 0; i < loaded.m.size() / 2; ++i) {
    float sm, sv;
    uint16_t lm, lv;
    std::memcpy(&sm, saved.m.data() + 4 * i, 4);
    std::memcpy(&sv, saved.v.data() + 4 * i, 4);
    std::memcpy(&lm, loaded.m.data() + 2 * i, 2);
    std::memcpy(&lv, loaded.v.data() + 2 * i, 2);
    wrong += lm != float_to_bf16_bits(sm) || lv != float_to_bf16_bits(sv);
    changed += bf16_bits_to_float(lm) != sm;
  }
  CHECK(wrong == 0);
  CHECK(changed > 0);
  CHECK(loaded.params == saved.params);
}

TEST_CASE("master remainders: every float32 splits into a bf16 weight and 16 bits and joins back exactly",
          "[core][precision-aware]") {
  std::mt19937_64 rng(5);
  int64_t wrong_trip = 0, not_nearest = 0, ties = 0, ties_away = 0, differs_from_even = 0;
  for (int i = 0; i < 200000; ++i) {
    uint32_t bits = static_cast<uint32_t>(rng());
    if (i % 4 == 0) bits = (bits & 0xFFFF0000u) | 0x8000u;  // exact ties, often
    if (((bits >> 23) & 0xFFu) == 0xFFu) continue;           // (inf / NaN)
    float x;
    std::memcpy(&x, &bits, 4);
    const SplitMaster s = split_master_bits(x);
    const float back = join_master_bits(s.weight, s.remainder);
    wrong_trip += std::memcmp(&back, &x, 4) != 0;
    // The weight is a nearest bf16 value; at an exact tie the one farther from zero.
    const double w = bf16_bits_to_float(s.weight);
    const uint16_t hi = static_cast<uint16_t>(bits >> 16);
    const double down = bf16_bits_to_float(hi), up = bf16_bits_to_float(static_cast<uint16_t>(hi + 1));
    const double dw = std::fabs(w - x), best = std::min(std::fabs(down - x), std::fabs(up - x));
    if (std::isfinite(up)) not_nearest += dw > best;
    if ((bits & 0xFFFFu) == 0x8000u) {
      ++ties;
      ties_away += std::fabs(w) > std::fabs(static_cast<double>(x));
      differs_from_even += s.weight != float_to_bf16_bits(x);
    }
  }
  CHECK(wrong_trip == 0);
  CHECK(not_nearest == 0);
  CHECK(ties > 10000);
  CHECK(ties_away == ties);
  CHECK(differs_from_even > ties / 4);  // (half the ties: round to even rounds them down)
  // Zero, signed zero, the largest finite bf16 neighbourhood, subnormals.
  for (float x : {0.0f, -0.0f, 1.0f, -1.0f, 3.0e38f, -3.0e38f, 1e-40f, -1e-40f}) {
    const SplitMaster s = split_master_bits(x);
    const float back = join_master_bits(s.weight, s.remainder);
    CHECK(std::memcmp(&back, &x, 4) == 0);
  }
}

TEST_CASE("master remainders to nearest even: every float32 splits into its bf16 cast, 16 bits and a tie bit, and "
          "joins back exactly", "[core][precision-aware]") {
  int64_t wrong_trip = 0, not_cast = 0, stray_up = 0, ties = 0, ups = 0, tried = 0;
  auto check = [&](uint32_t bits) {
    float x;
    std::memcpy(&x, &bits, 4);
    const SplitMasterEven s = split_master_even(x);
    const float back = join_master_even(s.weight, s.remainder, s.up);
    wrong_trip += std::memcmp(&back, &x, 4) != 0;
    not_cast += s.weight != float_to_bf16_bits(x);  // (NaNs too: the cast makes them quiet)
    stray_up += s.up && !master_tie_ambiguous(s.weight, s.remainder);
    ties += (bits & 0xFFFFu) == 0x8000u;
    ups += s.up;
    ++tried;
  };
  // Every top half (sign, exponent, 7 mantissa bits: infinities and NaNs included) with the low
  // halves around the rounding point and the ends, then random patterns.
  for (uint32_t top = 0; top < 0x10000u; ++top)
    for (uint32_t lo : {0x0000u, 0x0001u, 0x7FFFu, 0x8000u, 0x8001u, 0xFFFFu}) check((top << 16) | lo);
  std::mt19937_64 rng(11);
  for (int i = 0; i < 1000000; ++i) check(static_cast<uint32_t>(rng()));
  INFO(tried << " patterns");
  CHECK(wrong_trip == 0);
  CHECK(not_cast == 0);
  CHECK(stray_up == 0);   // the bit is set only where (weight, remainder) leave the rounding open
  CHECK(ties >= 65536);
  CHECK(ups > ties / 4);  // (half the ties round up, to an even weight; and the overflows to infinity)
  // Why the bit: both neighbours' ties of an even weight give the same weight and remainder.
  const float below = std::bit_cast<float>(0x3F808000u), above = std::bit_cast<float>(0x3F818000u);
  const SplitMasterEven a = split_master_even(below), b = split_master_even(std::bit_cast<float>(0x3F828000u));
  CHECK(a.weight == 0x3F80u);  // 0x3F80 is even: a tie above it rounds down
  CHECK(split_master_even(above).weight == 0x3F82u);  // 0x3F81 is odd: a tie above it rounds up
  CHECK(b.weight == 0x3F82u);
  CHECK(split_master_even(above).remainder == b.remainder);
  CHECK(split_master_even(above).up != b.up);
}

// AdamW over remainders rounded to nearest even (the default master weights of bf16 runs) against
// float32 master weights with a bf16 model copy, on the reference backend: the same master weights
// (joined), weights, moments and sum of squares, bit for bit; exact ties included (a group with a
// zero learning rate keeps master weights that are ties, and the updates make some of their own).
TEST_CASE("master remainders to nearest even: the reference AdamW gives a separate float32 copy's bits",
          "[reference][precision-aware]") {
  auto be = make_reference_backend(2);
  std::mt19937_64 rng(4);
  std::normal_distribution<double> nd(0.0, 1.0);
  const int64_t n = 300007, first = 45;  // (the tie bits of these elements start at bit 45)
  std::vector<float> master(n), g(n), m(n), v(n);
  for (int64_t i = 0; i < n; ++i) {
    master[i] = static_cast<float>(0.05 * nd(rng));
    if (i % 7 == 0) master[i] = std::bit_cast<float>((std::bit_cast<uint32_t>(master[i]) & 0xFFFF0000u) | 0x8000u);
    g[i] = static_cast<float>(0.01 * nd(rng));
    m[i] = static_cast<float>(1e-3 * nd(rng));
    v[i] = static_cast<float>(1e-5 * std::fabs(nd(rng)));
  }
  auto t = [](void* p, DType d, int64_t count) { return Tensor(p, d, Device::cpu, {count}); };
  std::vector<uint16_t> w16(n), copy(n);
  std::vector<int16_t> rem(n);
  std::vector<uint32_t> words((first + n + 31) / 32, 0xFFFFFFFFu);  // (split_master writes every bit)
  const TieBits ties{t(words.data(), DType::i32, static_cast<int64_t>(words.size())), first};
  be->split_master(t(w16.data(), DType::bf16, n), t(rem.data(), DType::i16, n), t(master.data(), DType::f32, n), ties);
  be->cast(t(copy.data(), DType::bf16, n), t(master.data(), DType::f32, n));
  auto compare = [&](const char* when) {
    INFO(when);
    int64_t wrong_master = 0, wrong_weight = 0, stray = 0, ambiguous = 0;
    for (int64_t i = 0; i < n; ++i) {
      const bool up = tie_bit(words.data(), first + i);
      const float joined = join_master_even(w16[i], rem[i], up);
      wrong_master += std::memcmp(&joined, &master[i], 4) != 0;
      wrong_weight += w16[i] != copy[i];
      stray += up && !master_tie_ambiguous(w16[i], rem[i]);
      ambiguous += master_tie_ambiguous(w16[i], rem[i]);
    }
    CHECK(wrong_master == 0);
    CHECK(wrong_weight == 0);
    CHECK(stray == 0);
    CHECK(ambiguous > 1000);
  };
  compare("after split_master");
  std::vector<float> back(n);
  be->join_master(t(back.data(), DType::f32, n), t(w16.data(), DType::bf16, n), t(rem.data(), DType::i16, n), ties);
  CHECK(std::memcmp(back.data(), master.data(), 4 * static_cast<size_t>(n)) == 0);  // join_master undoes it
  OptimStepParams p;
  p.lr[0] = 1e-3f, p.lr[1] = 0.0f, p.lr[2] = 2e-3f;
  p.weight_decay[0] = 0.1f;
  p.beta1 = 0.9f, p.beta2 = 0.95f, p.eps = 1e-8f;
  p.grad_scale = 0.5f;
  const std::vector<OptimSegment> segs = {OptimSegment{3, 100000, 0}, OptimSegment{100003, 100000, 1},
                                          OptimSegment{200005, 100001, 2}};
  std::vector<float> m2 = m, v2 = v;
  for (int step = 1; step <= 3; ++step) {
    p.step = step;
    be->adamw_step(t(master.data(), DType::f32, n), t(g.data(), DType::f32, n), t(m.data(), DType::f32, n),
                   t(v.data(), DType::f32, n), t(copy.data(), DType::bf16, n), segs, p);
    be->adamw_step(t(rem.data(), DType::i16, n), t(g.data(), DType::f32, n), t(m2.data(), DType::f32, n),
                   t(v2.data(), DType::f32, n), t(w16.data(), DType::bf16, n), segs, p, ties);
  }
  compare("after three AdamW steps");
  CHECK(std::memcmp(m.data(), m2.data(), 4 * static_cast<size_t>(n)) == 0);
  CHECK(std::memcmp(v.data(), v2.data(), 4 * static_cast<size_t>(n)) == 0);
  // The sum of squares of the joined master weights: sum_squares' bits over the float32 ones.
  float plain = 0, joined = 0;
  be->sum_squares(t(&plain, DType::f32, 1), t(master.data(), DType::f32, n), segs, false);
  be->master_sum_squares(t(&joined, DType::f32, 1), t(w16.data(), DType::bf16, n), t(rem.data(), DType::i16, n), ties,
                         segs, false);
  CHECK(plain > 0);
  CHECK(std::bit_cast<uint32_t>(plain) == std::bit_cast<uint32_t>(joined));
  // Tie bits that do not cover the elements are refused.
  const TieBits short_ties{t(words.data(), DType::i32, static_cast<int64_t>(words.size()) - 1), first};
  CHECK_THROWS_WITH(be->adamw_step(t(rem.data(), DType::i16, n), t(g.data(), DType::f32, n), t(m2.data(), DType::f32, n),
                                   t(v2.data(), DType::f32, n), t(w16.data(), DType::bf16, n), segs, p, short_ties),
                    Contains("tie bits"));
}

TEST_CASE("master remainders: the reference AdamW and split_master keep the float32 master weights exactly",
          "[reference][precision-aware]") {
  auto be = make_reference_backend(2);
  std::mt19937_64 rng(3);
  std::normal_distribution<double> nd(0.0, 1.0);
  const int64_t n = 4099;
  std::vector<float> master(n), g(n), m(n), v(n);
  for (int64_t i = 0; i < n; ++i) {
    master[i] = static_cast<float>(0.05 * nd(rng));
    g[i] = static_cast<float>(0.01 * nd(rng));
    m[i] = static_cast<float>(1e-3 * nd(rng));
    v[i] = static_cast<float>(1e-5 * std::fabs(nd(rng)));
  }
  auto t = [](void* p, DType d, int64_t count) { return Tensor(p, d, Device::cpu, {count}); };
  // split_master: the weights (and remainders) of core/master_remainder.h.
  std::vector<uint16_t> w16(n), only_w(n);
  std::vector<int16_t> rem(n);
  be->split_master(t(w16.data(), DType::bf16, n), t(rem.data(), DType::i16, n), t(master.data(), DType::f32, n));
  be->split_master(t(only_w.data(), DType::bf16, n), Tensor(), t(master.data(), DType::f32, n));
  int64_t wrong = 0;
  for (int64_t i = 0; i < n; ++i) {
    const SplitMaster s = split_master_bits(master[i]);
    wrong += w16[i] != s.weight || rem[i] != s.remainder || only_w[i] != s.weight;
  }
  CHECK(wrong == 0);

  // Three AdamW steps over float32 master weights with a bf16 copy, and over remainders: the same
  // master weights and moments bit for bit, and weights that are the split of them.
  OptimStepParams p;
  p.lr[0] = 1e-3f, p.lr[1] = 2e-3f;
  p.weight_decay[0] = 0.1f;
  p.beta1 = 0.9f, p.beta2 = 0.95f, p.eps = 1e-8f;
  p.grad_scale = 0.5f;
  const std::vector<OptimSegment> segs = {OptimSegment{3, 2000, 0}, OptimSegment{2100, 1999, 1}};
  std::vector<float> m2 = m, v2 = v;
  std::vector<uint16_t> copy(n);
  for (int step = 1; step <= 3; ++step) {
    p.step = step;
    be->adamw_step(t(master.data(), DType::f32, n), t(g.data(), DType::f32, n), t(m.data(), DType::f32, n),
                   t(v.data(), DType::f32, n), t(copy.data(), DType::bf16, n), segs, p);
    be->adamw_step(t(rem.data(), DType::i16, n), t(g.data(), DType::f32, n), t(m2.data(), DType::f32, n),
                   t(v2.data(), DType::f32, n), t(w16.data(), DType::bf16, n), segs, p);
  }
  int64_t wrong_master = 0, wrong_weight = 0, same_as_copy = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float joined = join_master_bits(w16[i], rem[i]);
    wrong_master += std::memcmp(&joined, &master[i], 4) != 0;
    wrong_weight += w16[i] != split_master_bits(master[i]).weight;
    same_as_copy += i >= 3 && i < 2003 && copy[i] == w16[i];
  }
  CHECK(wrong_master == 0);
  CHECK(wrong_weight == 0);
  CHECK(same_as_copy > 1990);  // the round-to-even copy differs at exact ties only
  CHECK(std::memcmp(m.data(), m2.data(), 4 * static_cast<size_t>(n)) == 0);
  CHECK(std::memcmp(v.data(), v2.data(), 4 * static_cast<size_t>(n)) == 0);
  // Remainders need a bf16 model copy.
  CHECK_THROWS_WITH(be->adamw_step(t(rem.data(), DType::i16, n), t(g.data(), DType::f32, n), t(m2.data(), DType::f32, n),
                                   t(v2.data(), DType::f32, n), Tensor(), segs, p),
                    Contains("int16 master remainders need a bf16 model copy"));
}

// Which runs keep their master weights as remainders (engine/model_chunks.cpp): bf16 parameters with
// AdamW or Muon, to nearest even with tie bits by default, ties away with the precision-aware optimizer; a
// separate float32 copy elsewhere.
TEST_CASE("master remainders: the runs that keep them and how", "[engine][precision-aware]") {
  struct Case {
    std::string flags;
    int world;
    bool remainders, tie_bits;
  };
  const std::vector<Case> cases = {
      {"--bf16", 1, true, true},
      {"--bf16 --use-distributed-optimizer", 2, true, true},
      {"--bf16 --grad-reduce-in-bf16 --use-distributed-optimizer", 2, true, true},
      {"--bf16 --fp8-format hybrid --fp8-recipe tensorwise", 1, true, true},
      {"--bf16 --use-precision-aware-optimizer --use-distributed-optimizer", 2, true, false},
      {"", 1, false, false},                                      // float32: the parameters are the master weights
      {"--fp16", 1, false, false},                                // (fp16 parameters: a float32 copy)
      {"--bf16 --optimizer sgd", 1, false, false},
      {"--bf16 --optimizer muon", 1, true, true},
      {"--bf16 --grad-reduce-in-bf16", 1, false, false},          // (no float32 gradient buffer to stage in)
      {"--bf16 --use-distributed-optimizer --fp8-format hybrid --fp8-recipe tensorwise --fp8-param-gather", 2, false,
       false},
      {"--bf16 --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params --ckpt-format fsdp_dtensor", 2,
       false, false},
      {"--bf16 --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads --ckpt-format fsdp_dtensor", 2, true,
       true},
  };
  for (const Case& k : cases) {
    INFO(k.flags << " on " << k.world << " ranks");
    const Config c = parse(small_gpt() + words(k.flags + " --global-batch-size 4"), k.world);
    const DType compute = c.train.precision == Precision::bf16   ? DType::bf16
                          : c.train.precision == Precision::fp16 ? DType::f16
                                                                 : DType::f32;
    const ModelOptions o = model_chunk_specs(c, RankPosition::of(c, 0), compute).at(0).options;
    CHECK(o.master_remainders == k.remainders);
    CHECK(o.master_tie_bits == k.tie_bits);
  }
}

TEST_CASE("master remainders: a model initializes and loads the same master weights",
          "[engine][precision-aware]") {
  // bf16 parameters over float32 master weights: the reference backend runs no bf16 forward, but
  // builds, initializes and stages such a model (the part remainders change). Ties away (the
  // precision-aware optimizer's, sharded) and to nearest even with tie bits (the default: sharded
  // or not).
  const Config c = tiny_llama_config();
  auto be = make_reference_backend(1);
  ParallelState ps = make_single_process_state();
  const ModelDims d = ModelDims::from_config(c, ps);
  for (const auto& [even, sharded, dp_rank] : {std::tuple{false, true, 0}, std::tuple{false, true, 1},
                                               std::tuple{true, true, 0}, std::tuple{true, true, 1},
                                               std::tuple{true, false, 0}}) {
    INFO("to even " << even << ", sharded " << sharded << ", dp rank " << dp_rank);
    auto build = [&](bool remainders) {
      ModelOptions o = ModelOptions::from_config(c, d, DType::bf16);
      o.accum = DType::f32;
      o.grad = DType::f32;
      o.shard_size = sharded ? 2 : 1;
      o.shard_rank = dp_rank;
      o.bucket_size = 700;
      o.shard_optimizer_state = sharded;
      o.master_remainders = remainders;
      o.master_tie_bits = remainders && even;
      auto m = std::make_unique<GptModel>(d, o, ps, *be);
      m->init_parameters();
      return m;
    };
    auto plain = build(false), rem = build(true);
    REQUIRE(rem->master_flat().dtype == DType::i16);
    REQUIRE(rem->master_flat().numel() == plain->master_flat().numel());
    REQUIRE(rem->master_tie_words().empty() == !even);
    const std::vector<unsigned char> pp = bytes_of(*be, plain->params_flat()), rp = bytes_of(*be, rem->params_flat());
    const std::vector<unsigned char> pm = bytes_of(*be, plain->master_flat()), rm = bytes_of(*be, rem->master_flat());
    const std::vector<unsigned char> rt = even ? bytes_of(*be, rem->master_tie_words()) : std::vector<unsigned char>();
    std::vector<float> joined(static_cast<size_t>(rem->master_flat().numel()));
    rem->master_to_host(joined.data(), rp.data(), rm.data(), even ? rt.data() : nullptr);
    CHECK(std::memcmp(joined.data(), pm.data(), pm.size()) == 0);  // the same float32 master weights
    // Every parameter (every rank's shards alike) is the split weight of the drawn value: to even,
    // the separate copy's bits; ties away, equal to them but at ties.
    int64_t differ = 0;
    for (size_t i = 0; i < pp.size(); i += 2) differ += pp[i] != rp[i] || pp[i + 1] != rp[i + 1];
    if (even) CHECK(differ == 0);
    else CHECK(differ < static_cast<int64_t>(pp.size() / 2 / 1000));
    // params_from_full_master from the joined values (a checkpoint load) gives back the same bytes.
    std::vector<float> full(static_cast<size_t>(rem->grads_flat().numel()), 0.0f);
    for (size_t i = 0; i < pp.size() / 2; ++i) {
      uint16_t w;
      std::memcpy(&w, rp.data() + 2 * i, 2);
      full[i] = bf16_bits_to_float(w);
    }
    const GradLayout& L = rem->grad_layout();
    if (sharded) {
      for (int b = 0; b < L.num_buckets(); ++b)
        for (int64_t i = 0; i < L.shard_numel(b); ++i)
          full[static_cast<size_t>(L.shard_offset(b) + i)] = joined[static_cast<size_t>(L.state_offset[static_cast<size_t>(b)] + i)];
    } else {
      std::copy(joined.begin(), joined.end(), full.begin());
    }
    be->copy_from_host(rem->grads_flat(), full.data());
    be->fill(rem->params_flat(), 0.0);
    const std::vector<int16_t> zeros(static_cast<size_t>(rem->master_flat().numel()), 0);
    be->copy_from_host(rem->master_flat(), zeros.data());
    if (even) be->fill(rem->master_tie_words(), -1.0);  // (every bit set: the load writes each)
    rem->params_from_full_master(rem->grads_flat());
    CHECK(bytes_of(*be, rem->params_flat()) == rp);
    CHECK(bytes_of(*be, rem->master_flat()) == rm);
    if (even) {  // (bits past the last element: not written)
      const std::vector<unsigned char> lt = bytes_of(*be, rem->master_tie_words());
      int64_t wrong = 0;
      for (int64_t i = 0; i < rem->master_flat().numel(); ++i)
        wrong += tie_bit(reinterpret_cast<const uint32_t*>(lt.data()), i) !=
                 tie_bit(reinterpret_cast<const uint32_t*>(rt.data()), i);
      CHECK(wrong == 0);
    }
  }
}
