// --optimizer muon on the command line (app/validate_training.cpp: validate_muon): Megatron-LM's
// checks, its deprecated dist_muon, and the distributed optimizer (Megatron-LM's layer-wise one
// with Muon) replaced by the unsharded update.
#include "tests/cli_test_util.h"

using namespace mt;
using namespace mt::test;
using Catch::Contains;

namespace {
bool has(const std::vector<SetupMessage>& ms, const std::string& part) {
  return std::any_of(ms.begin(), ms.end(), [&](const SetupMessage& m) { return m.text.find(part) != std::string::npos; });
}
}  // namespace

TEST_CASE("cli muon: --optimizer muon, its settings, dist_muon and the distributed optimizer", "[cli][muon]") {
  const Config c = parse(small_gpt() + words("--optimizer muon --muon-momentum 0.95 --muon-nesterov --muon-no-split-qkv "
                                             "--muon-scale-mode unit_rms_norm --muon-fp32-matmul-prec high "
                                             "--muon-coefficient-type polar_express --muon-num-ns-steps 8 "
                                             "--muon-tp-mode distributed --muon-extra-scale-factor 0.2"));
  CHECK(c.train.optimizer == OptimizerKind::muon);
  CHECK(c.train.muon.momentum == 0.95);
  CHECK(c.train.muon.nesterov);
  CHECK_FALSE(c.train.muon.split_qkv);
  CHECK(c.train.muon.scale_mode == MuonScaleMode::unit_rms_norm);
  CHECK(c.train.muon.fp32_matmul_prec == MuonMatmulPrecision::high);
  CHECK(c.train.muon.coefficient_type == "polar_express");
  CHECK(c.train.muon.num_ns_steps == 8);
  CHECK(c.train.muon.tp_mode == MuonTpMode::distributed);
  CHECK(c.train.muon.extra_scale_factor == 0.2);
  const Config d = parse(small_gpt() + words("--optimizer muon"));
  CHECK(d.train.muon.momentum == 0.9);  // Megatron-LM's flag default (its class default is 0.95)
  CHECK(d.train.muon.split_qkv);
  CHECK(d.train.muon.fp32_matmul_prec == MuonMatmulPrecision::medium);
  CHECK(d.train.muon.coefficient_type == "quintic");

  // dist_muon: Megatron's deprecated spelling of muon with --use-distributed-optimizer (whose
  // layer-wise update megatrain computes with the state sharded as AdamW's; --overlap-param-gather
  // as Megatron-LM accepts it).
  std::vector<SetupMessage> ms;
  const Config dm = parse(small_gpt() + words("--optimizer dist_muon --overlap-grad-reduce --overlap-param-gather"), 2, &ms);
  CHECK(dm.train.optimizer == OptimizerKind::muon);
  CHECK(dm.parallel.use_distributed_optimizer);
  CHECK(dm.parallel.overlap_param_gather);
  CHECK(has(ms, "optimizer='dist_muon' is deprecated"));
  CHECK(has(ms, "layer-wise distributed optimizer"));
  CHECK_THAT(parse_error(small_gpt() + words("--optimizer muon --grad-reduce-in-bf16")),
             Contains("--grad-reduce-in-bf16 with --optimizer muon"));

  // Refused as Megatron-LM refuses them (or fails on them), or not built.
  CHECK_THAT(parse_error(small_gpt() + words("--optimizer muon --muon-coefficient-type custom")),
             Contains("Unsupported muon coefficient type 'custom'"));
  CHECK_THAT(parse_error(small_gpt() + words("--optimizer muon --muon-num-ns-steps 0")),
             Contains("num_ns_steps must be at least 1"));
  CHECK_THAT(parse_error(small_gpt() + words("--optimizer muon --muon-fp32-matmul-prec low")), Contains("'low'"));
  CHECK_THAT(parse_error(small_gpt() + words("--optimizer muon --muon-scalar-optimizer lion")),
             Contains("--muon-scalar-optimizer lion"));
  CHECK_THAT(parse_error(small_gpt() + words("--optimizer muon --fp16")), Contains("fp16 is not supported"));
  CHECK_THAT(parse_error(small_gpt() + words("--optimizer muon --use-distributed-optimizer --use-precision-aware-optimizer")),
             Contains("--use-precision-aware-optimizer is not supported with --optimizer muon"));
  CHECK_THAT(parse_error(small_gpt() + words("--optimizer lion")), Contains("--optimizer lion"));
  CHECK_THAT(parse_error(small_gpt() + words("--optimizer muon --bf16 --fp8-format hybrid --fp8-param-gather "
                                             "--use-distributed-optimizer")),
             Contains("--fp8-param-gather with --optimizer muon"));
  CHECK_THAT(parse_error(small_gpt() + words("--optimizer muon --bf16 --fp8-format hybrid --fp8-recipe tensorwise")),
             Contains("--fp8-recipe tensorwise with --optimizer muon"));
  CHECK(parse(small_gpt() + words("--optimizer muon --bf16 --fp8-format hybrid")).train.fp8_format.has_value());
  // The same values with adam: nothing to check (Megatron-LM reads them in Muon only), a note each.
  std::vector<SetupMessage> adam;
  parse(small_gpt() + words("--muon-fp32-matmul-prec low --muon-coefficient-type custom"), 1, &adam);
  CHECK(has(adam, "--muon-fp32-matmul-prec has no effect without --optimizer muon"));
}
