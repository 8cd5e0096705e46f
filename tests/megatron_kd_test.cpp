// Knowledge distillation against Megatron-LM with ModelOpt (tests/fixtures/megatron/make_kd_fixtures.sh):
// Megatron-LM trained a 3-layer teacher, then distilled 2-layer students from it on the CPU
// (float32), saving each student after 2 of 4 iterations. megatrain imports a student and resumes
// the distillation, its teacher imported or read from Megatron-LM's directory: iterations 3 and 4 give Megatron-LM's losses (the second
// printed as the mean of both, as a resumed Megatron-LM prints it) and gradient norms.
#include <catch2/catch.hpp>

#include <cmath>
#include <regex>
#include <sstream>

#include "app/import_megatron.h"
#include "ckpt_test_util.h"

using mt_test::read_bytes;
using mt_test::run_command;
using mt_test::TempDir;

namespace {

const std::string kKd = "tests/fixtures/megatron/kd";

// make_kd_fixtures.sh's student ($cpu_common $cpu_llama --num-layers 2 --init-method-std 0.5).
const std::string kStudent =
    "--micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer --vocab-size 60 "
    "--make-vocab-size-divisible-by 32 --seq-length 32 --max-position-embeddings 32 --split 99,1,0 --log-interval 1 "
    "--eval-iters 0 --eval-interval 1000 --attention-dropout 0 --hidden-dropout 0 --seed 1234 --num-layers 2 "
    "--hidden-size 32 --ffn-hidden-size 64 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
    "--position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear "
    "--untie-embeddings-and-output-weights --init-method-std 0.5 --export-te-mcore-model";

// The value of `key` on each iteration line of a Megatron-format log.
std::vector<double> logged(const std::string& log, const std::string& key) {
  const std::regex value(" " + key + R"(: ([0-9.Ee+-]+))");
  std::vector<double> out;
  std::istringstream in(log);
  std::string l;
  std::smatch m;
  while (std::getline(in, l))
    if (l.find("iteration ") != std::string::npos && std::regex_search(l, m, value)) out.push_back(std::stod(m[1]));
  return out;
}

}  // namespace

TEST_CASE("distillation resumes Megatron-LM + ModelOpt's students to their losses", "[megatron-import][distill][binary]") {
  TempDir tmp;
  const mt::MegatronImportResult teacher = mt::import_megatron(kKd + "/teacher", std::nullopt, tmp / "teacher", true);
  CHECK(teacher.tensors == 21);
  struct Case {
    const char* name;
    std::string teacher;  // --export-kd-teacher-load and the model config's flag
  };
  // The teacher imported (its model config named), or Megatron-LM's directory as the functional
  // tests give it (read directly, its model_config.yaml found there).
  const std::string imported = "--export-kd-teacher-load " + (tmp / "teacher") + " --export-kd-teacher-model-config " +
                               kKd + "/teacher/model_config.yaml";
  const std::string megatron = "--export-kd-teacher-load " + kKd + "/teacher";
  // final_ln: logits and the final norms' cosine loss; logits_t2: logits only at temperature 2;
  // tp2: final_ln saved by Megatron-LM at TP 2 + SP (its own initialization), resumed on one rank;
  // layers: the student's layer 1 output against the teacher's layer 2 output (mse) and the final
  // norms' outputs (cosine), the intermediate loss their mean.
  for (const Case& c : {Case{"final_ln", megatron}, Case{"logits_t2", imported}, Case{"tp2", imported},
                        Case{"layers", megatron}}) {
    INFO(c.name);
    const std::string student = (tmp / c.name);
    const mt::MegatronImportResult r = mt::import_megatron(kKd + "/" + c.name, std::nullopt, student, false);
    REQUIRE(r.resumable);
    std::string out;
    const int code = run_command(std::string(MEGATRAIN_BINARY) + " --device cpu " + kStudent + " --train-iters 4 --load " +
                                     student + " " + c.teacher + " --export-kd-cfg " + kKd + "/" + c.name + ".yaml",
                                 &out);
    INFO(out);
    REQUIRE(code == 0);
    const std::string megatron = read_bytes(kKd + "/" + c.name + "_iterations.log");
    for (const char* key : {"total loss", "logits distillation loss", "intermediate distillation loss", "grad norm"}) {
      INFO(key);
      const std::vector<double> ours = logged(out, key), theirs = logged(megatron, key);
      REQUIRE(theirs.size() == 4);
      REQUIRE(ours.size() == 2);
      const bool norm = std::string(key) == "grad norm";
      const double tol = norm ? 1.5e-3 : 3e-6 * std::max(1.0, std::abs(theirs[2]));
      CHECK(std::abs(ours[0] - theirs[2]) <= tol);
      CHECK(std::abs(ours[1] - (norm ? theirs[3] : (theirs[2] + theirs[3]) / 2)) <= tol);
    }
    for (double lm : logged(out, "lm loss")) CHECK(lm == 0.0);  // (ModelOpt's skip_lm_loss: zeros)
  }
  // A teacher model that is not the checkpoint's is refused naming the setting.
  mt_test::write_text(tmp / "two.yaml", "num_layers: 2\n");
  std::string out;
  CHECK(run_command(std::string(MEGATRAIN_BINARY) + " --device cpu " + kStudent + " --train-iters 4 " + megatron +
                        " --export-kd-teacher-model-config " + (tmp / "two.yaml"),
                    &out) != 0);
  CHECK_THAT(out, Catch::Contains("--export-kd-teacher-load") && Catch::Contains("num_layers"));
}
