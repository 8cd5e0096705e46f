// Reporters: Megatron's log line / validation block / timer report character for character,
// TensorBoard event files (golden bytes, our decoder, TensorBoard's own reader), JSON lines.
#include <catch2/catch.hpp>
#include <cmath>
#include <fstream>
#include <random>
#include <regex>
#include <sstream>

#include "app/megatron_log.h"
#include "app/metrics_jsonl.h"
#include "app/reporters.h"
#include "app/tensorboard_writer.h"
#include "checkpoint/file_io.h"
#include "ckpt_test_util.h"
#include "core/crc32c.h"
#include "core/log.h"
#include "tests/skip.h"

using namespace mt;
using mt_test::TempDir;
using nlohmann::json;

namespace {

const std::string kStamp = " [2026-08-22 15:22:22.123456]";

IterationStats example_stats() {
  IterationStats s;
  s.iteration = 100;
  s.train_iters = 500000;
  s.consumed_samples = 12800;
  s.elapsed_ms_per_iteration = 1234.5;
  s.tflops_per_gpu = 456.7;
  s.learning_rate = 1.5e-4;
  s.global_batch_size = 128;
  s.losses = {{"lm loss", 5.123456}};
  s.loss_scale = 1.0;
  s.grad_norm = 1.234;
  return s;
}

std::string hex(const std::string& bytes) {
  static const char* d = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) {
    out += d[c >> 4];
    out += d[c & 15];
  }
  return out;
}

// Splits Megatron's line into its " <text> |" fragments.
std::vector<std::string> fragments(const std::string& line) {
  std::vector<std::string> out;
  size_t at = 0;
  for (size_t bar; (bar = line.find(" |", at)) != std::string::npos; at = bar + 2) out.push_back(line.substr(at, bar - at));
  return out;
}

LoggingConfig tb_config(const std::string& dir) {
  LoggingConfig c;
  c.tensorboard_dir = dir;
  return c;
}

std::string only_event_file(const std::string& dir) {
  const auto names = list_directory(dir);
  REQUIRE(names.size() == 1);
  return dir + "/" + names[0];
}

struct Scalar {
  std::string tag;
  int64_t step;
  float value;
  bool operator==(const Scalar& o) const { return tag == o.tag && step == o.step && value == o.value; }
};
std::ostream& operator<<(std::ostream& os, const Scalar& s) { return os << "{" << s.tag << ", " << s.step << ", " << s.value << "}"; }

std::vector<Scalar> scalars_of(const std::vector<TensorBoardEvent>& events) {
  std::vector<Scalar> out;
  for (const auto& e : events)
    for (const auto& [tag, v] : e.scalars) out.push_back({tag, e.step, v});
  return out;
}

}  // namespace

TEST_CASE("iteration line matches Megatron's example exactly", "[obs][log]") {
  const std::string expected =
      " [2026-08-22 15:22:22.123456] iteration      100/  500000 | consumed samples:        12800 | elapsed time per "
      "iteration (ms): 1234.5 | throughput per GPU (TFLOP/s/GPU): 456.7 | learning rate: 1.500000E-04 | global batch "
      "size:   128 | lm loss: 5.123456E+00 | loss scale: 1.0 | grad norm: 1.234 | number of skipped iterations:   0 | "
      "number of nan iterations:   0 |";
  CHECK(format_iteration_line(example_stats(), kStamp) == expected);
}

TEST_CASE("iteration line: every optional field in Megatron's order", "[obs][log]") {
  IterationStats s = example_stats();
  s.iteration = 7;
  s.train_iters = 20;
  s.consumed_samples = 56;
  s.skipped_samples = 8;
  s.elapsed_ms_per_iteration = 0.04;
  s.tflops_per_gpu.reset();
  s.learning_rate = 3e-5;
  s.decoupled_learning_rate = 1e-3;
  s.global_batch_size = 123456;  // wider than the field
  s.losses = {{"lm loss", 10.9}, {"mtp_1 loss", 11.25}, {"z loss", -1.0}};
  s.loss_scale = 65536.0;
  s.grad_norm = std::nan("");
  s.num_zeros = 42;
  s.params_norm = 123.4567;
  s.skipped_iterations = 2;
  s.nan_iterations = 1234;
  const auto f = fragments(format_iteration_line(s, kStamp));
  const std::vector<std::string> expected = {
      " [2026-08-22 15:22:22.123456] iteration        7/      20",
      " consumed samples:           56",
      " skipped samples:            8",
      " elapsed time per iteration (ms): 0.0",
      " learning rate: 3.000000E-05",
      " decoupled learning rate: 1.000000E-03",
      " global batch size: 123456",
      " lm loss: 1.090000E+01",
      " mtp_1 loss: 1.125000E+01",  // the negative "z loss" is not printed (Megatron: avg >= 0.0)
      " loss scale: 65536.0",
      " grad norm: nan",
      " num zeros: 42",
      " params norm: 123.457",
      " number of skipped iterations:   2",
      " number of nan iterations: 1234"};
  CHECK(f == expected);
  // No grad norm, no learning rate (no trainable parameters): both fields vanish.
  IterationStats t = example_stats();
  t.grad_norm.reset();
  t.learning_rate.reset();
  const std::string line = format_iteration_line(t, kStamp);
  CHECK(line.find("grad norm") == std::string::npos);
  CHECK(line.find("learning rate") == std::string::npos);
  CHECK(line.find(" global batch size:   128 | lm loss:") != std::string::npos);
}

TEST_CASE("iteration line: --log-energy's fragments between throughput and learning rate", "[obs][log][energy]") {
  IterationStats s = example_stats();
  s.energy_per_gpu_j = 812.34;
  s.power_per_gpu_w = 658.06;
  LoggingConfig cfg;
  cfg.log_throughput = true;
  cfg.log_energy = true;
  const auto f = fragments(format_iteration_line(with_logging_flags(s, cfg), kStamp));
  REQUIRE(f.size() > 6);
  CHECK(f[3] == " throughput per GPU (TFLOP/s/GPU): 456.7");
  CHECK(f[4] == " energy per GPU (J/iter/GPU): 812.3");
  CHECK(f[5] == " power per GPU (W/GPU): 658.1");
  CHECK(f[6] == " learning rate: 1.500000E-04");
  cfg.log_energy = false;  // the fields print only under the flag
  const std::string without = format_iteration_line(with_logging_flags(s, cfg), kStamp);
  CHECK(without.find("energy") == std::string::npos);
  CHECK(without.find("power") == std::string::npos);
}

TEST_CASE("number formatting agrees with Python's format()", "[obs][log][python]") {
  std::string why;
  const auto py = mt_test::find_test_python("json", &why);
  if (!py) {
    MT_SKIP("the Python formatting oracle: " << why);
  }
  std::mt19937_64 rng(5);
  std::vector<double> values = {0.0, 0.05, 0.25, 0.35, 1.0 / 3, 2.5, 1e-12, 9.9999995e-5, 123456.789, 1e300, 0.0005, 99.95};
  for (int i = 0; i < 200; ++i) {
    const double mant = std::uniform_real_distribution<double>(0.0, 10.0)(rng);
    const int ex = std::uniform_int_distribution<int>(-12, 12)(rng);
    values.push_back(mant * std::pow(10.0, ex));
  }
  TempDir dir;
  std::string ours;
  json inputs = json::array();
  for (double v : values) {
    inputs.push_back(v);
    ours += fmt::format("{:.6E}|{:.1f}|{:.3f}|{:.2f}\n", v, v, v, v);
  }
  mt_test::write_text(dir / "in.json", inputs.dump());
  mt_test::write_text(dir / "fmt.py",
                      "import json,sys\n"
                      "for v in json.load(open(sys.argv[1])):\n"
                      "    print('{:.6E}|{:.1f}|{:.3f}|{:.2f}'.format(v, v, v, v))\n");
  std::string theirs;
  REQUIRE(mt_test::run_command(*py + " " + (dir / "fmt.py") + " " + (dir / "in.json"), &theirs) == 0);
  CHECK(ours == theirs);
  // Integer widths as Python's {:8d} / {:12d} / {:5d} / {:3d}.
  CHECK(fmt::format("{:8d}|{:12d}|{:5d}|{:3d}", 123456789, -5, 7, 1000) == "123456789|          -5|    7|1000");
}

TEST_CASE("timestamp looks like Megatron's", "[obs][log]") {
  const std::regex re(R"( \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}\])");
  CHECK(std::regex_match(megatron_timestamp(), re));
}

TEST_CASE("validation block: text, dashes, PPL clamp, after-training prefixes", "[obs][log]") {
  EvalStats e;
  e.iteration = 100;
  e.losses = {{"lm loss", 3.0}};
  const std::string text = " validation loss at iteration 100 | lm loss value: 3.000000E+00 | lm loss PPL: 2.008554E+01 | ";
  const std::string dashes(text.size() + 1, '-');
  CHECK(format_eval_block(e) == dashes + "\n" + text + "\n" + dashes);

  e.after_training = true;
  e.losses = {{"lm loss", 25.0}};  // PPL = exp(min(20, 25))
  CHECK(format_eval_block(e).find(" validation loss at iteration 100 on validation set | lm loss value: 2.500000E+01 | "
                                  "lm loss PPL: 4.851652E+08 | ") != std::string::npos);
  e.split = "test";
  CHECK(format_eval_block(e).find(" validation loss at iteration 100 on test set | ") != std::string::npos);
}

TEST_CASE("timer report in Megatron's layout and order", "[obs][log]") {
  IterationStats s;
  s.timers_ms = {{"optimizer", {1.0, 2.5}}, {"forward-backward", {100.123, 101.456}}, {"zz-custom", {0.5, 0.5}},
                 {"all-grads-sync", {0, 0}}};
  const std::string minmax =
      "(min, max) time across ranks (ms):\n"
      "    forward-backward ...............................: (100.12, 101.46)\n"
      "    optimizer ......................................: (1.00, 2.50)\n"
      "    zz-custom ......................................: (0.50, 0.50)";
  CHECK(format_timers(s, "minmax") == minmax);
  CHECK(format_timers(s, "max") ==
        "max time across ranks (ms):\n"
        "    forward-backward ...............................: 101.46\n"
        "    optimizer ......................................: 2.50\n"
        "    zz-custom ......................................: 0.50");
  s.timers_all_ranks_ms = {{"optimizer", {2.0, 0.0, 3.25}}};
  CHECK(format_timers(s, "all") == "times across ranks (ms):\n  optimizer:\n     rank  0: 2.00\n     rank  2: 3.25");
  CHECK(format_timers(IterationStats{}, "minmax").empty());

  // The reporter prints the line at log intervals only, then the timers at --timing-log-level >= 1.
  std::vector<std::string> lines;
  LoggingConfig cfg;
  cfg.timing_log_level = 1;
  cfg.log_throughput = true;
  MegatronLogReporter rep(cfg, [&](const std::string& l) { lines.push_back(l); }, [] { return kStamp; });
  IterationStats quiet = example_stats();
  quiet.interval_end = false;
  rep.on_iteration(quiet);
  CHECK(lines.empty());
  IterationStats logged = example_stats();
  logged.timers_ms = s.timers_ms;
  rep.on_iteration(logged);
  REQUIRE(lines.size() == 2);
  CHECK(lines[0] == format_iteration_line(logged, kStamp));
  CHECK(lines[1] == minmax);
  EvalStats e;
  e.losses = {{"lm loss", 1.0}};
  rep.on_eval(e);
  CHECK(lines.back() == format_eval_block(e));

  // Without --log-throughput / --log-params-norm / --log-num-zeros-in-grad those fields stay out
  // even when the engine measured them.
  lines.clear();
  MegatronLogReporter plain(LoggingConfig{}, [&](const std::string& l) { lines.push_back(l); }, [] { return kStamp; });
  IterationStats all = example_stats();
  all.params_norm = 3.0;
  all.num_zeros = 5;
  plain.on_iteration(all);
  REQUIRE(lines.size() == 1);  // timing level 0: no timer report
  CHECK(lines[0].find("throughput") == std::string::npos);
  CHECK(lines[0].find("params norm") == std::string::npos);
  CHECK(lines[0].find("num zeros") == std::string::npos);
  CHECK(lines[0].find(" grad norm: 1.234 |") != std::string::npos);
}

TEST_CASE("TensorBoard records match the golden bytes", "[obs][tensorboard]") {
  const std::string fv = encode_file_version_event(1700000000.0);
  CHECK(hex(fv) == "0900000040fc54d9411a0d627261696e2e4576656e743a32");
  CHECK(hex(frame_tfrecord(fv)) == "1800000000000000a37f4b22" + hex(fv) + "eced8f9d");
  const std::string sc = encode_scalar_event(1700000001.5, 100, "lm loss", 2.5f);
  CHECK(hex(sc) == "0900006040fc54d94110642a100a0e0a076c6d206c6f73731500002040");
  CHECK(hex(frame_tfrecord(sc)) == "1d00000000000000602fdf23" + hex(sc) + "e4a3c727");
}

// The reporter with every TensorBoard flag on, over four iterations and an evaluation: writes its event
// file under dir/tb and returns the scalars it must hold, in order.
std::vector<Scalar> write_reporter_events(const TempDir& dir) {
  LoggingConfig cfg = tb_config(dir / "tb");
  cfg.log_timers_to_tensorboard = true;
  cfg.log_throughput = true;
  cfg.log_params_norm = true;
  cfg.log_num_zeros_in_grad = true;
  cfg.log_validation_ppl_to_tensorboard = true;
  cfg.log_memory_to_tensorboard = true;
  cfg.log_world_size_to_tensorboard = true;
  cfg.log_energy = true;
  cfg.tensorboard_log_interval = 2;
  cfg.tensorboard_queue_size = 3;  // smaller than one iteration's events: add_scalar must wait, not drop
  std::vector<Scalar> expected;
  {
    TensorBoardReporter rep(cfg, /*skip_train=*/false, /*world_size=*/8);
    CHECK(std::regex_match(rep.path(), std::regex(".*/events\\.out\\.tfevents\\.\\d{10}\\.[^.]+.*\\.\\d+\\.\\d+")));
    for (int it = 1; it <= 4; ++it) {
      IterationStats s;
      s.iteration = it;
      s.consumed_samples = 16 * it;
      s.interval_end = it % 2 == 0;
      s.global_batch_size = 16;
      s.learning_rate = 1e-4 * it;
      s.iteration_losses = {{"lm loss", 10.0 - it}};
      s.losses = {{"lm loss", 99.0}};  // the interval average is NOT what TensorBoard gets
      s.loss_scale = 1024.0;
      s.grad_norm = 0.5 * it;
      s.num_zeros = it;
      s.params_norm = 100.0 + it;
      s.memory_allocated_bytes = 1e9;
      s.memory_peak_bytes = 2e9;
      s.memory_reserved_bytes = 3e9;
      s.elapsed_ms_per_iteration = 250.0;
      s.tflops_per_gpu = 300.0;
      s.energy_per_gpu_j = 175.0;
      s.power_per_gpu_w = 700.0;
      s.timers_ms = {{"forward-backward", {200.0, 240.0}}};
      rep.on_iteration(s);
      if (it % 2 == 0) {
        const int64_t n = 16 * it;
        auto both = [&](const std::string& tag, float v) {
          expected.push_back({tag, it, v});
          expected.push_back({tag + " vs samples", n, v});
        };
        both("learning-rate", static_cast<float>(1e-4 * it));
        both("batch-size", 16.0f);
        both("lm loss", static_cast<float>(10.0 - it));
        both("loss-scale", 1024.0f);
        both("world-size", 8.0f);
        both("grad-norm", static_cast<float>(0.5 * it));
        both("num-zeros", static_cast<float>(it));
        both("params-norm", static_cast<float>(100.0 + it));
        expected.push_back({"mem-reserved-bytes", it, 3e9f});
        expected.push_back({"mem-allocated-bytes", it, 1e9f});
        expected.push_back({"mem-max-allocated-bytes", it, 2e9f});
        expected.push_back({"iter-energy/gpu", it, 175.0f});
        expected.push_back({"power/gpu", it, 700.0f});
        expected.push_back({"iteration-time", it, 0.25f});
        expected.push_back({"throughput", it, 300.0f});
        expected.push_back({"forward-backward-time", it, 0.24f});
      }
    }
    EvalStats e;
    e.iteration = 4;
    e.consumed_train_samples = 64;
    e.losses = {{"lm loss", 2.0}};
    rep.on_eval(e);
    expected.push_back({"lm loss validation", 4, 2.0f});
    expected.push_back({"lm loss validation vs samples", 64, 2.0f});
    expected.push_back({"lm loss validation ppl", 4, static_cast<float>(std::exp(2.0))});
    expected.push_back({"lm loss validation ppl vs samples", 64, static_cast<float>(std::exp(2.0))});
    rep.flush();
  }
  return expected;
}

TEST_CASE("TensorBoard reporter writes Megatron's tags and our decoder reads them back", "[obs][tensorboard]") {
  TempDir dir;
  const std::vector<Scalar> expected = write_reporter_events(dir);
  const std::string path = only_event_file(dir / "tb");
  const auto events = read_tensorboard_events(path);
  REQUIRE(!events.empty());
  CHECK(events[0].file_version == std::optional<std::string>("brain.Event:2"));
  CHECK(events[0].wall_time > 1.6e9);
  for (size_t i = 1; i < events.size(); ++i) CHECK(events[i].wall_time >= events[0].wall_time);
  CHECK(scalars_of(events) == expected);

  // A corrupted byte is caught by the record CRC.
  std::string bytes = mt_test::read_bytes(path);
  bytes[bytes.size() - 6] ^= 1;
  mt_test::write_text(dir / "bad.tfevents", bytes);
  CHECK_THROWS_WITH(read_tensorboard_events(dir / "bad.tfevents"), Catch::Contains("CRC mismatch"));

}

TEST_CASE("TensorBoard's EventAccumulator reads the reporter's events", "[obs][tensorboard][python]") {
  std::string why;
  const auto py = mt_test::find_test_python("tensorboard", &why);
  if (!py) {
    MT_SKIP("reading the events with TensorBoard's EventAccumulator: " << why);
  }
  TempDir dir;
  const std::vector<Scalar> expected = write_reporter_events(dir);
  const std::string path = only_event_file(dir / "tb");
  mt_test::write_text(dir / "read.py", R"PY(
import json, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
acc = EventAccumulator(sys.argv[1], size_guidance={"scalars": 0})
acc.Reload()
out = {tag: [[e.step, e.value] for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
print("SCALARS " + json.dumps(out))
)PY");
  std::string out;
  const int rc = mt_test::run_command(*py + " " + (dir / "read.py") + " " + path, &out);
  INFO(out);
  REQUIRE(rc == 0);
  const size_t at = out.find("SCALARS ");
  REQUIRE(at != std::string::npos);
  const json got = json::parse(out.substr(at + 8, out.find('\n', at) - at - 8));
  std::map<std::string, std::vector<std::pair<int64_t, float>>> want;
  for (const auto& s : expected) want[s.tag].push_back({s.step, s.value});
  CHECK(got.size() == want.size());
  for (const auto& [tag, points] : want) {
    INFO(tag);
    REQUIRE(got.contains(tag));
    REQUIRE(got[tag].size() == points.size());
    for (size_t i = 0; i < points.size(); ++i) {
      CHECK(got[tag][i][0].get<int64_t>() == points[i].first);
      CHECK(got[tag][i][1].get<float>() == points[i].second);
    }
  }
}

TEST_CASE("TensorBoard flags: defaults, no loss scale, skip-train evaluation", "[obs][tensorboard]") {
  TempDir dir;
  LoggingConfig cfg = tb_config(dir / "tb");
  cfg.log_loss_scale_to_tensorboard = false;  // --no-log-loss-scale-to-tensorboard
  {
    TensorBoardReporter rep(cfg, /*skip_train=*/true, 1);
    IterationStats s;
    s.iteration = 3;
    s.consumed_samples = 24;
    s.global_batch_size = 8;
    s.losses = {{"lm loss", 4.0}};
    s.skipped_samples = 5;
    s.tflops_per_gpu = 1.0;
    s.memory_allocated_bytes = 1.0;
    s.timers_ms = {{"optimizer", {1.0, 1.0}}};
    rep.on_iteration(s);
    EvalStats after;
    after.iteration = 3;
    after.after_training = true;
    after.losses = {{"lm loss", 1.0}};
    rep.on_eval(after);  // --skip-train: not written
  }
  const auto got = scalars_of(read_tensorboard_events(only_event_file(dir / "tb")));
  const std::vector<Scalar> want = {{"skipped-train-samples", 3, 5.0f}, {"batch-size", 3, 8.0f},
                                    {"batch-size vs samples", 24, 8.0f}, {"lm loss", 3, 4.0f},
                                    {"lm loss vs samples", 24, 4.0f}};
  CHECK(got == want);  // no loss-scale, world-size, memory, timers, throughput or validation tags
}

TEST_CASE("metrics JSONL: one parseable record per logged iteration and evaluation", "[obs][jsonl]") {
  TempDir dir;
  const std::string path = dir / "sub/metrics.jsonl";
  {
    MetricsJsonlReporter rep(path);
    IterationStats s = example_stats();
    s.losses = {{"lm loss", 5.5}};
    s.num_zeros = 3;
    s.timers_ms = {{"optimizer", {1.0, 2.0}}};
    rep.on_iteration(s);
    IterationStats quiet = s;
    quiet.interval_end = false;
    rep.on_iteration(quiet);  // not a logged iteration
    IterationStats bad = s;
    bad.iteration = 200;
    bad.grad_norm = std::nan("");
    rep.on_iteration(bad);
    EvalStats e;
    e.iteration = 200;
    e.consumed_train_samples = 25600;
    e.losses = {{"lm loss", 2.0}};
    rep.on_eval(e);
  }
  {
    MetricsJsonlReporter again(path);  // appends (a resumed run)
    EvalStats e;
    e.iteration = 300;
    e.split = "test";
    e.after_training = true;
    e.losses = {{"lm loss", 30.0}};
    again.on_eval(e);
  }
  std::ifstream in(path);
  std::vector<json> records;
  for (std::string line; std::getline(in, line);) records.push_back(json::parse(line));
  REQUIRE(records.size() == 4);
  CHECK(records[0]["type"] == "iteration");
  CHECK(records[0]["iteration"] == 100);
  CHECK(records[0]["train_iters"] == 500000);
  CHECK(records[0]["consumed_samples"] == 12800);
  CHECK(records[0]["lm_loss"] == 5.5);
  CHECK(records[0]["learning_rate"] == 1.5e-4);
  CHECK(records[0]["grad_norm"] == 1.234);
  CHECK(records[0]["num_zeros"] == 3);
  CHECK(records[0]["tflops_per_gpu"] == 456.7);
  CHECK(records[0]["global_batch_size"] == 128);
  CHECK(records[0]["timers_ms"]["optimizer"] == json::array({1.0, 2.0}));
  CHECK(!records[0].contains("params_norm"));
  CHECK(records[0]["time"].get<double>() > 1.6e9);
  CHECK(records[1]["iteration"] == 200);
  CHECK(records[1]["grad_norm"].is_null());  // NaN has no JSON spelling
  CHECK(records[2]["type"] == "evaluation");
  CHECK(records[2]["split"] == "validation");
  CHECK(records[2]["lm_loss"] == 2.0);
  CHECK(records[2]["lm_loss_ppl"].get<double>() == Approx(std::exp(2.0)));
  CHECK(records[2]["consumed_samples"] == 25600);
  CHECK(records[3]["split"] == "test");
  CHECK(records[3]["after_training"] == true);
  CHECK(records[3]["lm_loss_ppl"].get<double>() == Approx(std::exp(20.0)));
}

TEST_CASE("make_reporters fans out on the last rank only", "[obs]") {
  TempDir dir;
  Config cfg;
  cfg.parallel.world_size = 4;
  cfg.parallel.rank = 3;
  cfg.logging.tensorboard_dir = dir / "tb";
  cfg.logging.metrics_jsonl = dir / "m.jsonl";
  auto last = make_reporters(cfg);
  REQUIRE(dynamic_cast<CompositeReporter*>(last.get()));
  CHECK(dynamic_cast<CompositeReporter*>(last.get())->size() == 3);
  IterationStats s = example_stats();
  s.interval_end = true;
  log::set_quiet(true);
  last->on_iteration(s);
  log::set_quiet(false);
  last->flush();
  CHECK(mt_test::read_bytes(dir / "m.jsonl").find("\"iteration\":100") != std::string::npos);
  CHECK(scalars_of(read_tensorboard_events(only_event_file(dir / "tb"))).size() > 4);
  cfg.parallel.rank = 0;
  auto first = make_reporters(cfg);
  CHECK(dynamic_cast<CompositeReporter*>(first.get())->size() == 0);
}
