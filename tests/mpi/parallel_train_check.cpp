// Multi-rank training against one rank, on the reference backend over MPI: runs the real megatrain
// binary once on one process and once under `mpirun -np N` with a parallel layout, both with
// --metrics-jsonl and --save, and requires the same run:
//   * every iteration's lm loss (relative 1e-5; MoE models also their (seq_, global_)load_balancing_loss
//     and z_loss, distillation students their total, logits and intermediate losses, MTP models each depth's loss, and its acceptance rate within 2 percentage points: an
//     argmax at a near-tie may turn with the order of a sum) and gradient norm (relative 1e-4), and the
//     parameter norm of every iteration (relative 1e-5),
//   * the validation loss of every evaluation (every 4 iterations and after training; relative 1e-5),
//   * the final checkpoints: every model tensor and optimizer state element within 2e-5 (FP8
//     amax histories and scales: relatively; a
//     checkpoint holds global tensors, so the two layouts compare directly; this also checks that
//     each rank wrote its shards once and that they assemble).
// Same seed and data; float32 arithmetic in a different order (sharded GEMMs, reductions over
// ranks), hence the tolerances. A wrong gradient scale, a missing reduction or a stale shard moves
// the numbers by far more.
//
// Usage: parallel_train_check <megatrain> <mpirun> <work dir> [--teacher "<flags>"] [--model "<flags>"]
//        [--one-rank "<flags>"] <nranks>
//        [layout flags...]
//        parallel_train_check <megatrain> <mpirun> <work dir> [--model "<flags>"] --resume <n1> "<flags 1>" <n2> "<flags 2>"
// --bf16-reduce (first) loosens the tolerances for --grad-reduce-in-bf16, --bf16-moments (first)
// the final tensors' for bf16 Adam moments; --fp8 (first) trains 4
// iterations for FP8 GEMMs (see `iterations`); --iters N (before --model) trains N instead of 8.
// --teacher "<flags>" (before --model) first trains a distillation teacher (the model with these
// flags, 4 iterations, one rank) that every run then distills from (--export-kd-teacher-load).
// --model adds model flags to every run (both the
// one-rank and the parallel ones); --one-rank (after --model) adds flags to the one-rank run only
// (the run a layout equals where it is not simply one rank's); "-" stands for
// no layout flags (CTest drops empty arguments).
// The second form trains half of the iterations (4 of 8, or 2 of 4 with --fp8) with layout 1
// (saving at the exit), resumes with layout 2 from that checkpoint and compares the second half's
// iterations and the final checkpoint with the one-rank run.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "checkpoint/checkpoint_io.h"
#include "core/error.h"
#include "tests/mpi/check_util.h"

using mt_check::check;
using mt_check::failures;
using mt_check::run;

namespace {

namespace fs = std::filesystem;

const char* kModel =
    "--device cpu --mock-data --tokenizer-type NullTokenizer --vocab-size 128 --make-vocab-size-divisible-by 32 "
    "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
    "--micro-batch-size 1 --global-batch-size 12 --lr 1e-2 --min-lr 1e-3 --lr-warmup-iters 2 --train-iters 8 "
    "--hidden-dropout 0 --attention-dropout 0 --eval-iters 2 --eval-interval 4 --log-interval 1 --log-params-norm "
    "--seed 1234 "
    "--weight-decay 0.1 --clip-grad 1.0 --save-interval 100";

struct Record {
  double loss = 0, grad_norm = 0, params_norm = 0;
  // MoE models: load_balancing_loss, z_loss; MTP: mtp_<j>_loss; distillation: total_loss,
  // logits_distillation_loss, intermediate_distillation_loss.
  std::map<std::string, double> moe;
  std::map<std::string, double> accept;  // MTP: mtp_<j>_acceptance_rate (percent)
};
using Evals = std::map<std::pair<int64_t, bool>, double>;  // (iteration, after training) -> lm loss

// Tolerances; --bf16-reduce loosens them for gradients summed in bfloat16 (--grad-reduce-in-bf16:
// 8 mantissa bits, so relative errors near 4e-3 per element; Adam then moves parameters whose
// gradients are near zero by up to the learning rate).
double rtol_loss = 1e-5, rtol_grad = 1e-4, rtol_params = 1e-5, atol_tensors = 2e-5;
// FP8 amax histories and scales, compared relatively (float32 tolerance).
double rtol_fp8_meta = 1e-5;
// Tensorwise FP8 scaling (--fp8-recipe tensorwise in the flags): an input's or gradient's scale in
// the state is only what its last cast set (each cast scales by its own tensor's amax), from the
// last micro-batch a rank cast, which the layout decides; only the weights' scales (role 1 of each
// GEMM's three operands) are compared.
bool tensorwise = false;
// Iterations of a run (eval every half). --fp8 trains 4, with the float32 tolerances: a last-bit
// difference of a float sum can move a value across an FP8 rounding tie, changing that element by
// up to 2^-4 (e4m3) or 2^-3 (e5m2) relatively. Over 8 iterations of a few thousand quantized
// elements that happens (seen at iteration 8 and, after the first step became a calibration step,
// at iteration 5 of the TP2 x PP2 run: 1.3e-4 in the loss by iteration 8), and from there the two
// trajectories part. Up to the first flip they agree to float32 rounding, and a layout error (a
// wrong scale_inv, a transposed operand, a layer left out) shows at once.
int64_t iterations = 8;

bool near(double a, double b, double rtol) { return std::fabs(a - b) <= rtol * std::max(std::fabs(a), std::fabs(b)); }

Evals read_evals(const std::string& path) {
  Evals out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    if (j.value("type", "") == "evaluation")
      out[{j.at("iteration").get<int64_t>(), j.at("after_training").get<bool>()}] = j.at("lm_loss").get<double>();
  }
  return out;
}

void compare_evals(const Evals& base, const Evals& par) {
  check(!par.empty(), "the parallel run evaluated");
  for (const auto& [key, loss] : par) {
    auto b = base.find(key);
    if (b == base.end()) {
      check(false, "an evaluation at iteration " + std::to_string(key.first) + " the one-rank run did not make");
      continue;
    }
    std::printf("  evaluation at iteration %lld%s: %.9g vs %.9g\n", static_cast<long long>(key.first),
                key.second ? " (after training)" : "", b->second, loss);
    check(near(b->second, loss, rtol_loss), "validation loss at iteration " + std::to_string(key.first));
  }
}

std::map<int64_t, Record> read_metrics(const std::string& path) {
  std::map<int64_t, Record> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    if (j.value("type", "") != "iteration") continue;
    Record r;
    r.loss = j.at("lm_loss").get<double>();
    r.grad_norm = j.at("grad_norm").get<double>();
    r.params_norm = j.at("params_norm").get<double>();
    for (const char* key : {"load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss", "z_loss",
                            "total_loss", "logits_distillation_loss", "intermediate_distillation_loss"})
      if (j.contains(key)) r.moe[key] = j.at(key).get<double>();
    for (const auto& [key, value] : j.items()) {
      if (key.rfind("mtp_", 0) != 0) continue;
      if (key.size() > 5 && key.compare(key.size() - 5, 5, "_loss") == 0) r.moe[key] = value.get<double>();
      if (key.find("_acceptance_rate") != std::string::npos && key.find("cumulative") == std::string::npos)
        r.accept[key] = value.get<double>();
    }
    out[j.at("iteration").get<int64_t>()] = r;
  }
  return out;
}

// first: the parallel run's first iteration. The logged lm loss is the average since the last
// log line, and (as in Megatron) the interval is not reset after a run's first iteration: with
// --log-interval 1 the second iteration of a run logs the mean of its first two. The one-rank run
// started at 1, so for a run resumed at first > 1 its second value is compared with that mean.
void compare_metrics(const std::map<int64_t, Record>& base, const std::map<int64_t, Record>& par, int64_t first) {
  for (int64_t it = first; it <= iterations; ++it) {
    auto b = base.find(it), p = par.find(it);
    if (b == base.end() || p == par.end()) {
      check(false, "iteration " + std::to_string(it) + " missing from a metrics file");
      continue;
    }
    if (first > 2 && it == first + 1 && base.count(it - 1)) {
      Record mean = b->second;
      mean.loss = (base.at(it - 1).loss + b->second.loss) / 2;
      std::printf("  (iteration %lld logs the mean loss of iterations %lld and %lld)\n", static_cast<long long>(it),
                  static_cast<long long>(it - 1), static_cast<long long>(it));
      check(near(mean.loss, p->second.loss, rtol_loss), "lm loss of iteration " + std::to_string(it));
      check(near(b->second.grad_norm, p->second.grad_norm, rtol_grad), "grad norm of iteration " + std::to_string(it));
      check(near(b->second.params_norm, p->second.params_norm, rtol_params), "params norm of iteration " + std::to_string(it));
      continue;
    }
    std::printf("  iteration %lld: loss %.9g vs %.9g, grad norm %.9g vs %.9g, params norm %.9g vs %.9g\n",
                static_cast<long long>(it), b->second.loss, p->second.loss, b->second.grad_norm, p->second.grad_norm,
                b->second.params_norm, p->second.params_norm);
    check(near(b->second.loss, p->second.loss, rtol_loss), "lm loss of iteration " + std::to_string(it));
    check(near(b->second.grad_norm, p->second.grad_norm, rtol_grad), "grad norm of iteration " + std::to_string(it));
    check(near(b->second.params_norm, p->second.params_norm, rtol_params), "params norm of iteration " + std::to_string(it));
    for (const auto& [key, value] : b->second.moe) {
      const auto q = p->second.moe.find(key);
      check(q != p->second.moe.end() && near(value, q->second, rtol_loss), key + " of iteration " + std::to_string(it));
    }
    for (const auto& [key, value] : b->second.accept) {
      const auto q = p->second.accept.find(key);
      check(q != p->second.accept.end() && std::fabs(value - q->second) <= 2.0,
            key + " of iteration " + std::to_string(it));
    }
  }
}

void compare_checkpoints(const std::string& base_dir, const std::string& par_dir) {
  mt::CheckpointReader a(base_dir), b(par_dir);
  check(a.iteration() == iterations && b.iteration() == iterations,
        "both final checkpoints are of iteration " + std::to_string(iterations));
  size_t tensors = 0;
  double worst = 0;
  std::string worst_name;
  for (mt::CheckpointKind kind : {mt::CheckpointKind::model, mt::CheckpointKind::optimizer}) {
    for (const std::string& name : a.names(kind)) {
      if (!b.has(name, kind)) {
        check(false, "tensor " + name + " missing from the parallel run's checkpoint");
        continue;
      }
      const mt::CheckpointTensorInfo& info = a.info(name, kind);
      const mt::ShardIndex whole = mt::ShardIndex::whole(info.global_rows, info.global_cols);
      std::vector<float> x(static_cast<size_t>(whole.local_numel())), y(x.size());
      a.read(name, kind, mt::ShardSlice::whole(whole), mt::Tensor(x.data(), mt::DType::f32, mt::Device::cpu, {whole.local_numel()}));
      b.read(name, kind, mt::ShardSlice::whole(whole), mt::Tensor(y.data(), mt::DType::f32, mt::Device::cpu, {whole.local_numel()}));
      // FP8 scaling state (amaxes and scales from them, up to ~1e8): compared relatively.
      const bool relative = name.find(".fp8_meta.") != std::string::npos;
      // (The experts' and the extra GEMMs' states, .fp8_meta.experts_* and .extra_*, hold the same three
      // roles per GEMM.)
      bool scale = false;
      for (const char* k : {".fp8_meta.scale", ".fp8_meta.scale_inv", ".fp8_meta.experts_scale",
                            ".fp8_meta.experts_scale_inv", ".fp8_meta.extra_scale", ".fp8_meta.extra_scale_inv"})
        scale |= name.ends_with(k);
      const bool weights_only = tensorwise && scale;
      for (size_t i = 0; i < x.size(); ++i) {
        if (weights_only && i % 3 != 1) continue;
        double d = std::fabs(static_cast<double>(x[i]) - y[i]);
        if (relative) {
          d /= std::max({1e-30, std::fabs(static_cast<double>(x[i])), std::fabs(static_cast<double>(y[i]))});
          if (d > rtol_fp8_meta) check(false, "FP8 scaling state " + name + " agrees (relative " + std::to_string(d) + ")");
          continue;
        }
        if (!(d <= worst)) {  // NaN-safe
          worst = std::isnan(d) ? INFINITY : d;
          worst_name = name;
        }
      }
      ++tensors;
    }
    check(a.names(kind).size() == b.names(kind).size(), "the same tensors in both checkpoints");
  }
  std::printf("  final checkpoints: %zu tensors, largest difference %.3g (%s)\n", tensors, worst, worst_name.c_str());
  check(tensors > 0, "the checkpoints hold tensors");
  check(worst <= atol_tensors, "final parameters and optimizer states agree");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 5) {
    std::cerr << "usage: parallel_train_check <megatrain> <mpirun> <work dir> <nranks> [flags...] | --resume ...\n";
    return 2;
  }
  const std::string megatrain = argv[1], mpirun = std::string(argv[2]) + " --oversubscribe", work = argv[3];
  std::string base = kModel;
  if (std::string(argv[4]) == "--bf16-reduce") {
    rtol_loss = 1e-3;
    rtol_grad = 2e-2;
    rtol_params = 5e-4;
    atol_tensors = 1e-2;
    ++argv;
    --argc;
  }
  if (std::string(argv[4]) == "--bf16-moments") {
    // bf16 Adam moments (--exp-avg-dtype / --exp-avg-sq-dtype bf16): where a rank's float32 moment
    // differs from the one-rank run's in its last bits (another summation order upstream), the two
    // may round to neighbouring bf16 values, and the next update of that weight differs by up to
    // lr * 2^-8 (4e-5 here); over 8 iterations a weight gathers a few such steps (measured:
    // 1.5e-4 at most). A stale or missing shard moves weights by about lr per step.
    atol_tensors = std::max(atol_tensors, 5e-4);
    ++argv;
    --argc;
  }
  if (std::string(argv[4]) == "--fp8") {
    iterations = 4;
    base += " --train-iters 4 --eval-interval 2";  // (the later flag wins, as with argparse)
    ++argv;
    --argc;
  }
  if (std::string(argv[4]) == "--iters") {  // N iterations instead of 8 (or --fp8's 4; even with --resume)
    if (argc < 7) return 2;
    iterations = std::stoll(argv[5]);
    base += std::string(" --train-iters ") + argv[5];  // (the later flag wins, as with argparse)
    argv += 2;
    argc -= 2;
  }
  // --teacher "<flags>": a distillation teacher (one rank, the model with these flags, 4 iterations)
  // trained first into <work dir>/teacher; every run then distills from it.
  std::string teacher;
  if (std::string(argv[4]) == "--teacher") {
    if (argc < 7) return 2;
    teacher = argv[5];
    argv += 2;
    argc -= 2;
  }
  if (std::string(argv[4]) == "--model") {
    if (argc < 7) return 2;
    base += std::string(" ") + argv[5];
    tensorwise = base.find("--fp8-recipe tensorwise") != std::string::npos;
    argv += 2;
    argc -= 2;
  }
  std::string one_rank;  // --one-rank "<flags>": added to the one-rank run's only
  if (std::string(argv[4]) == "--one-rank") {
    if (argc < 7) return 2;
    one_rank = std::string(" ") + argv[5];
    argv += 2;
    argc -= 2;
  }
  fs::remove_all(work);
  fs::create_directories(work);
  try {
    if (!teacher.empty()) {
      if (run(megatrain + " " + kModel + " " + teacher + " --train-iters 4 --save " + work + "/teacher",
              work + "/teacher.log") != 0)
        return 1;
      base += " --export-kd-teacher-load " + work + "/teacher";
    }
    if (run(megatrain + " " + base + one_rank + " --save " + work + "/base --metrics-jsonl " + work + "/base.jsonl",
            work + "/base.log") != 0)
      return 1;
    const auto base_metrics = read_metrics(work + "/base.jsonl");
    if (std::string(argv[4]) == "--resume") {
      if (argc != 9) {
        std::cerr << "--resume needs <n1> <flags 1> <n2> <flags 2>\n";
        return 2;
      }
      auto flags = [](const char* f) { return std::string(f) == "-" ? std::string() : std::string(f); };
      const std::string first = mpirun + " -np " + argv[5] + " " + megatrain + " " + base + " " + flags(argv[6]) +
                                " --exit-interval " + std::to_string(iterations / 2) + " --save " + work + "/ckpt";
      if (run(first, work + "/first.log") != 0) return 1;
      const std::string second = mpirun + " -np " + argv[7] + " " + megatrain + " " + base + " " + flags(argv[8]) +
                                 " --load " + work + "/ckpt --save " + work + "/ckpt --metrics-jsonl " + work +
                                 "/par.jsonl";
      if (run(second, work + "/second.log") != 0) return 1;
      compare_metrics(base_metrics, read_metrics(work + "/par.jsonl"), iterations / 2 + 1);
      compare_evals(read_evals(work + "/base.jsonl"), read_evals(work + "/par.jsonl"));
      compare_checkpoints(work + "/base", work + "/ckpt");
    } else {
      std::string flags;
      for (int i = 5; i < argc; ++i) flags += std::string(" ") + argv[i];
      const std::string cmd = mpirun + " -np " + argv[4] + " " + megatrain + " " + base + flags + " --save " + work +
                              "/par --metrics-jsonl " + work + "/par.jsonl";
      if (run(cmd, work + "/par.log") != 0) return 1;
      compare_metrics(base_metrics, read_metrics(work + "/par.jsonl"), 1);
      compare_evals(read_evals(work + "/base.jsonl"), read_evals(work + "/par.jsonl"));
      compare_checkpoints(work + "/base", work + "/par");
    }
  } catch (const std::exception& e) {
    std::cout << "FAIL: " << e.what() << "\n";
    return 1;
  }
  std::cout << (failures ? "FAILED" : "PASSED") << "\n";
  return failures ? 1 : 0;
}
