// Mixture-of-experts flags: Megatron-LM's types and defaults, --moe-layer-freq's list expressions,
// Megatron's rules (one line each, naming the flags), what megatrain does not build yet, the
// checkpoint's model section, and the dry run's parameter and FLOP counts checked against hand
// computations for a small model.
#include <fstream>
#include <set>
#include <nlohmann/json.hpp>

#include "app/checkpoint_args.h"
#include "app/flags.h"
#include "app/tensorboard_writer.h"
#include "app/unsupported.h"
#include "checkpoint/checkpoint_io.h"
#include "engine/flops.h"
#include "engine/model_dims.h"
#include "engine/param_count.h"
#include "parallel/pipeline_layout.h"
#include "parallel/rank_grid.h"
#include "parallel/rank_position.h"
#include "tests/cli_test_util.h"

using namespace mt;
using namespace mt::test;
using Catch::Contains;
using nlohmann::json;

namespace {

// small_gpt() (2 layers, h 64, 4 heads) as an MoE model megatrain builds: no biases, 8 experts.
Args moe_gpt() { return small_gpt() + words("--disable-bias-linear --num-experts 8"); }

// The hand-counted model below: 4 layers, h 64, 4 heads (d 16), SwiGLU with FFN 128, learned
// positions (32), LayerNorm, no biases, NullTokenizer 1000 (padded to 1024), tied embeddings; MoE
// layers 0 and 2 (--moe-layer-freq 2) of 8 experts of FFN 32, top-2, a shared expert of 64 with
// its gate.
Args counted_moe() {
  return words("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
               "--micro-batch-size 2 --lr 1e-3 --train-iters 10 --mock-data --tokenizer-type NullTokenizer "
               "--vocab-size 1000 --disable-bias-linear --swiglu --ffn-hidden-size 128 --num-experts 8 "
               "--moe-router-topk 2 --moe-layer-freq 2 --moe-ffn-hidden-size 32 "
               "--moe-shared-expert-intermediate-size 64 --moe-shared-expert-gate");
}

ModelChunk chunk(int pp_rank, int first_layer, int num_layers, bool embedding, bool output) {
  ModelChunk c;
  c.pp_rank = pp_rank;
  c.first_layer = first_layer;
  c.num_layers = num_layers;
  c.has_embedding = embedding;
  c.has_output = output;
  return c;
}

// A one-tensor checkpoint in `dir` whose run state records `saved`'s configuration.
void save_config(const TempDir& dir, const Config& saved) {
  std::vector<float> w(4, 1.0f);
  CheckpointWriter writer(dir.path.string(), 3, 0, 1);
  writer.add("w", CheckpointKind::model, ShardIndex::whole(4, 1), Tensor(w.data(), DType::f32, Device::cpu, {4}), {4});
  RunState rs;
  rs.iteration = 3;
  rs.config = checkpoint_config_json(saved);
  writer.set_run_state(rs);
  writer.save(SaveGroup{});
}

json flag_value(const Config& c, const std::string& flag) { return cli::flag_table().find(flag)->value(c); }


}  // namespace

TEST_CASE("MoE flags: Megatron's defaults without --num-experts", "[cli][moe]") {
  const Config c = parse(small_gpt());
  const MoeConfig& e = c.model.moe;
  CHECK_FALSE(e.enabled());
  CHECK(flag_value(c, "--num-experts").is_null());
  CHECK(flag_value(c, "--moe-layer-freq") == 1);
  CHECK(e.router_topk == 2);
  CHECK(flag_value(c, "--moe-router-load-balancing-type") == "aux_loss");
  CHECK(flag_value(c, "--moe-aux-loss-coeff") == 0.0);
  CHECK(flag_value(c, "--moe-router-score-function") == "softmax");
  CHECK(flag_value(c, "--moe-token-dispatcher-type") == "allgather");
  CHECK(flag_value(c, "--moe-token-drop-policy") == "probs");
  CHECK(flag_value(c, "--moe-router-dtype").is_null());
  CHECK(flag_value(c, "--moe-z-loss-coeff").is_null());
  CHECK(flag_value(c, "--moe-router-bias-update-rate") == 1e-3);
  CHECK(c.parallel.expert_model_parallel_size == 1);
  CHECK_FALSE(c.parallel.expert_tensor_parallel_size);  // None: the tensor-parallel size
  CHECK(e.moe_layer.empty());
  CHECK(e.expert_ffn == 0);
  // --num-experts 0 is None.
  const Config zero = parse(small_gpt() + words("--num-experts 0 --moe-router-topk 4"));
  CHECK_FALSE(zero.model.moe.enabled());
  CHECK(flag_value(zero, "--num-experts").is_null());
}

TEST_CASE("MoE flags: every flag parses into the configuration", "[cli][moe]") {
  std::vector<SetupMessage> ms;
  const Config c = parse(moe_gpt() + words("--moe-ffn-hidden-size 48 --moe-layer-freq 1 --moe-router-topk 3 "
                                           "--moe-router-score-function sigmoid --moe-router-pre-softmax "
                                           "--moe-router-topk-scaling-factor 2.5 --moe-router-num-groups 4 "
                                           "--moe-router-group-topk 2 --moe-router-load-balancing-type none "
                                           "--moe-aux-loss-coeff 1e-2 --moe-z-loss-coeff 1e-3 --moe-router-dtype fp32 "
                                           "--moe-router-bias-update-rate 0.01 --moe-token-dispatcher-type alltoall "
                                           "--moe-grouped-gemm --moe-permute-fusion --moe-router-fusion "
                                           "--moe-shared-expert-intermediate-size 96 --moe-shared-expert-gate "
                                           "--moe-shared-expert-overlap --moe-expert-capacity-factor -1 "
                                           "--expert-model-parallel-size 1 --expert-tensor-parallel-size 1"),
                         1, &ms);
  const MoeConfig& e = c.model.moe;
  CHECK(e.num_experts == 8);
  CHECK(e.ffn_hidden_size == 48);
  CHECK(e.expert_ffn == 48);
  CHECK(e.moe_layer == std::vector<char>{1, 1});
  CHECK(e.router_topk == 3);
  CHECK(e.score_function == MoeScoreFunction::sigmoid);
  CHECK(e.router_pre_softmax);
  CHECK(e.router_topk_scaling_factor == 2.5);
  CHECK(e.router_num_groups == 4);
  CHECK(e.router_group_topk == 2);
  CHECK(e.load_balancing_type == std::vector<MoeLoadBalancing>{MoeLoadBalancing::none});
  CHECK(e.aux_loss_coeff == std::vector<double>{0.01});
  CHECK(flag_value(c, "--moe-aux-loss-coeff") == 0.01);  // Megatron: a one-element list is its element
  CHECK(e.z_loss_coeff == 1e-3);
  CHECK(e.router_dtype == std::string("fp32"));
  CHECK(e.router_bias_update_rate == 0.01);
  CHECK(e.token_dispatcher_type == MoeDispatcher::alltoall);
  CHECK(e.grouped_gemm);
  CHECK(e.permute_fusion);
  CHECK(e.router_fusion);
  CHECK(e.shared_expert_intermediate_size == 96);
  CHECK(e.shared_expert_gate);
  CHECK(e.shared_expert_overlap);
  CHECK_FALSE(e.expert_capacity_factor);  // negative: None
  // The performance switches are accepted with a note saying why they change nothing.
  CHECK(has_message(ms, SetupMessage::Kind::note, "--moe-grouped-gemm has no effect in megatrain: megatrain's experts "
                                                  "always run as grouped GEMMs"));
  CHECK(has_message(ms, SetupMessage::Kind::note, "--moe-permute-fusion has no effect in megatrain"));
  CHECK(has_message(ms, SetupMessage::Kind::note, "--moe-router-fusion has no effect in megatrain"));
  CHECK(has_message(ms, SetupMessage::Kind::note, "--moe-shared-expert-overlap has no effect in megatrain: megatrain "
                                                  "runs the shared expert in order"));
  CHECK_FALSE(has_message(ms, SetupMessage::Kind::warning, "moe_ffn_hidden_size is not set"));

  // Without --moe-ffn-hidden-size the experts take the dense FFN size, with Megatron's warning.
  ms.clear();
  const Config d = parse(moe_gpt() + words("--ffn-hidden-size 96"), 1, &ms);
  CHECK(d.model.moe.expert_ffn == 96);
  CHECK_FALSE(d.model.moe.ffn_hidden_size);
  CHECK(has_message(ms, SetupMessage::Kind::warning, "moe_ffn_hidden_size is not set, using ffn_hidden_size for MoE "
                                                     "instead"));
  // Several load-balancing types take one coefficient each; the value stays a list.
  const Config two = parse(moe_gpt() + words("--moe-router-load-balancing-type aux_loss none --moe-aux-loss-coeff 0.1 0"));
  CHECK(two.model.moe.load_balancing_type ==
        std::vector<MoeLoadBalancing>{MoeLoadBalancing::aux_loss, MoeLoadBalancing::none});
  CHECK(flag_value(two, "--moe-router-load-balancing-type") == json({"aux_loss", "none"}));
  CHECK(flag_value(two, "--moe-aux-loss-coeff") == json({0.1, 0.0}));
  CHECK(two.model.moe.aux_loss_coeff_of(MoeLoadBalancing::aux_loss) == 0.1);
  // The FP8 padding switch answers to Megatron's newer spelling too.
  CHECK(parse(small_gpt() + words("--bf16 --fp8-format hybrid --moe-token-dispatcher-type alltoall "
                                  "--moe-router-padding-for-quantization"))
            .model.moe.router_padding_for_fp8);
  // Group routing without a group top-k: no groups (Megatron tests the top-k), with a note.
  ms.clear();
  const Config g = parse(moe_gpt() + words("--moe-router-num-groups 4"), 1, &ms);
  CHECK_FALSE(g.model.moe.router_num_groups);
  CHECK(has_message(ms, SetupMessage::Kind::note, "--moe-router-num-groups has no effect without "
                                                  "--moe-router-group-topk"));
  ms.clear();
  CHECK_FALSE(parse(moe_gpt() + words("--moe-shared-expert-gate"), 1, &ms).model.moe.shared_expert_gate);
  CHECK(has_message(ms, SetupMessage::Kind::note, "--moe-shared-expert-gate has no effect without "
                                                  "--moe-shared-expert-intermediate-size"));
}

TEST_CASE("MoE flags: --moe-layer-freq as an integer or Megatron's list expressions", "[cli][moe]") {
  auto layers = [](int n, const std::string& freq) {
    return parse(small_gpt() + words("--disable-bias-linear --num-experts 4") +
                 Args{"--num-layers", std::to_string(n), "--moe-layer-freq", freq})
        .model.moe.moe_layer;
  };
  CHECK(layers(4, "1") == std::vector<char>{1, 1, 1, 1});
  CHECK(layers(5, "2") == std::vector<char>{1, 0, 1, 0, 1});
  CHECK(layers(6, "3") == std::vector<char>{1, 0, 0, 1, 0, 0});
  CHECK(layers(4, "[1,0,1,0]") == std::vector<char>{1, 0, 1, 0});
  CHECK(layers(4, "[0, 1, 1, 1,]") == std::vector<char>{0, 1, 1, 1});
  std::vector<char> deepseek(32, 1);
  deepseek[0] = deepseek[1] = deepseek[2] = 0;
  CHECK(layers(32, "([0]*3+[1]*29)") == deepseek);
  CHECK(layers(12, "([1]*1+[0]*2)*4") == std::vector<char>{1, 0, 0, 1, 0, 0, 1, 0, 0, 1, 0, 0});
  CHECK(layers(6, "2*[0]+([1]+[0])*2") == std::vector<char>{0, 0, 1, 0, 1, 0});
  CHECK(layers(4, "[0]+2*[1]+[0]") == std::vector<char>{0, 1, 1, 0});
  // The flag's value is Megatron's (an int or the list); the pattern is kept as given.
  const Config c = parse(small_gpt() + words("--disable-bias-linear --num-experts 4 --moe-layer-freq ([1]+[0])"));
  CHECK(flag_value(c, "--moe-layer-freq") == json({1, 0}));
  // Megatron's checks: one entry per layer, entries 0 or 1, N > 0.
  CHECK(parse_error(moe_gpt() + words("--moe-layer-freq ([0]*3+[1]*29)")) ==
        "--moe-layer-freq gives 32 layers but --num-layers is 2: the list needs one 0/1 entry per layer");
  CHECK(parse_error(moe_gpt() + words("--moe-layer-freq [1,2]")) ==
        "--moe-layer-freq: entry 1 (layer 1) of the list is 2; each entry is 1 (an MoE layer) or 0 (a dense layer)");
  CHECK_THAT(parse_error(moe_gpt() + words("--moe-layer-freq 0")), Contains("--moe-layer-freq 0 must be > 0"));
  CHECK_THAT(parse_error(moe_gpt() + words("--moe-layer-freq ([1]*2")),
             Contains("--moe-layer-freq '([1]*2' is not a list expression megatrain can read (a parenthesis is not "
                      "closed)"));
  CHECK_THAT(parse_error(moe_gpt() + words("--moe-layer-freq [1]*[2]")), Contains("'*' needs a list and a number"));
  CHECK_THAT(parse_error(moe_gpt() + words("--moe-layer-freq []")), Contains("is an empty list"));
  CHECK_THAT(parse_error(moe_gpt() + words("--moe-layer-freq two")), Contains("--moe-layer-freq"));
  // Without experts the pattern is not checked (as in Megatron, it is unused).
  CHECK_NOTHROW(parse(small_gpt() + words("--moe-layer-freq [1,0,1]")));
}

TEST_CASE("MoE flags: Megatron's rules, one line each naming the flags", "[cli][moe]") {
  CHECK(parse_error(moe_gpt() + words("--moe-router-topk 9")) ==
        "--moe-router-topk 9 is more than --num-experts 8: each token is routed to k distinct experts");
  CHECK_THAT(parse_error(moe_gpt() + words("--moe-router-topk 0")), Contains("--moe-router-topk must be >= 1 (got 0)"));
  CHECK_THAT(parse_error(moe_gpt() + words("--moe-router-topk 1")),
             Contains("Please use --moe-router-pre-softmax when topk is 1"));
  CHECK_NOTHROW(parse(moe_gpt() + words("--moe-router-topk 1 --moe-router-pre-softmax")));
  CHECK_NOTHROW(parse(moe_gpt() + words("--moe-router-topk 1 --moe-router-score-function sigmoid")));
  CHECK_THAT(parse_error(moe_gpt() + words("--moe-router-group-topk 2")),
             Contains("--moe-router-group-topk 2 needs --moe-router-num-groups"));
  CHECK(parse_error(moe_gpt() + words("--moe-router-num-groups 3 --moe-router-group-topk 1")) ==
        "--num-experts 8 is not divisible by --moe-router-num-groups 3");
  CHECK(parse_error(moe_gpt() + words("--moe-router-num-groups 2 --moe-router-group-topk 4")) ==
        "--moe-router-group-topk 4 is more than --moe-router-num-groups 2");
  CHECK_THAT(parse_error(moe_gpt() + words("--moe-router-enable-expert-bias")),
             Contains("Expert bias for aux-loss-free routing only supports 'sigmoid' and 'sqrtsoftplus' score functions"));
  CHECK(parse(moe_gpt() + words("--moe-router-enable-expert-bias --moe-router-score-function sqrtsoftplus"))
            .model.moe.score_function == MoeScoreFunction::sqrtsoftplus);
  CHECK_THAT(parse_error(moe_gpt() + words("--moe-expert-capacity-factor 1.0 --moe-router-load-balancing-type sinkhorn "
                                           "--moe-aux-loss-coeff 0")),
             Contains("--moe-expert-capacity-factor only works with aux_loss, seq_aux_loss, global_aux_loss or none "
                      "load balancing"));
  CHECK_THAT(parse_error(moe_gpt() + words("--moe-pad-expert-input-to-capacity")),
             Contains("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor"));
  CHECK_THAT(parse_error(moe_gpt() + words("--moe-shared-expert-intermediate-size 0")),
             Contains("--moe-shared-expert-intermediate-size must be num_shared_experts * "
                      "ffn_size_of_each_shared_expert, > 0 (got 0)"));
  CHECK(parse_error(moe_gpt() + words("--moe-shared-expert-intermediate-size 64 --moe-shared-expert-overlap")) ==
        "--moe-shared-expert-overlap only works with --moe-token-dispatcher-type alltoall or flex");
  CHECK_THAT(parse_error(moe_gpt() + words("--moe-router-load-balancing-type aux_loss none --moe-aux-loss-coeff 0.1")),
             Contains("--moe-aux-loss-coeff gives 1 coefficient for the 2 types of --moe-router-load-balancing-type"));
  CHECK_THAT(parse_error(moe_gpt() + words("--moe-aux-loss-coeff 0.1 0.2")),
             Contains("--moe-aux-loss-coeff gives 2 coefficients for the 1 type of"));
  CHECK_THAT(parse_error(moe_gpt() + words("--moe-router-padding-for-fp8 --moe-token-dispatcher-type alltoall")),
             Contains("--moe-router-padding-for-fp8 needs --fp8-format or --fp4-format"));
  CHECK_THAT(parse_error(small_gpt() + words("--bf16 --fp8-format hybrid --moe-router-padding-for-fp8")),
             Contains("--moe-router-padding-for-fp8 does not work with --moe-token-dispatcher-type allgather"));
  // Expert parallelism.
  CHECK_THAT(parse_error(small_gpt() + words("--expert-model-parallel-size 2"), 2),
             Contains("--expert-model-parallel-size 2 needs --num-experts"));
  CHECK_THAT(parse_error(moe_gpt() + words("--num-experts 6 --expert-model-parallel-size 4"), 4),
             Contains("--num-experts 6 is not a multiple of --expert-model-parallel-size 4"));
  CHECK(parse_error(moe_gpt() + words("--num-experts 6 --expert-model-parallel-size 3"), 4) ==
        "world size 4 is not divisible by --expert-tensor-parallel-size 1 x --expert-model-parallel-size 3 x "
        "--pipeline-model-parallel-size 1 = 3");
  CHECK_THAT(parse_error(moe_gpt() + words("--expert-model-parallel-size 0")),
             Contains("--expert-model-parallel-size must be >= 1 (got 0)"));
  // Expert parallelism over the DP ranks is accepted with either dispatcher (alltoall without a
  // note); with the experts split over 2 of TP 4's ranks the alltoall dispatcher's tokens travel by
  // all-gather, and a note says so.
  std::vector<SetupMessage> ep_ms;
  const Config ep = parse(moe_gpt() + words("--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall"), 4, &ep_ms);
  CHECK(ep.parallel.expert_model_parallel_size == 2);
  CHECK_FALSE(has_message(ep_ms, SetupMessage::Kind::note, "--moe-token-dispatcher-type"));
  ep_ms.clear();
  parse(moe_gpt() + words("--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall "
                          "--tensor-model-parallel-size 4 --sequence-parallel --expert-tensor-parallel-size 2"),
        8, &ep_ms);
  CHECK(has_message(ep_ms, SetupMessage::Kind::note,
                    "--moe-token-dispatcher-type alltoall with --expert-tensor-parallel-size 2 (between 1 and TP 4): "
                    "megatrain dispatches these tokens by all-gather and reduce-scatter"));
  // --delay-wgrad-compute: Megatron's rule, then a note (scheduling only).
  CHECK_THAT(parse_error(moe_gpt() + words("--delay-wgrad-compute")),
             Contains("overlap_moe_expert_parallel_comm must be enabled when enabling delay_wgrad_compute"));
  ep_ms.clear();
  parse(moe_gpt() + words("--bf16 --overlap-moe-expert-parallel-comm --delay-wgrad-compute --expert-model-parallel-size 2 "
                          "--moe-token-dispatcher-type alltoall"),
        2, &ep_ms);
  CHECK(has_message(ep_ms, SetupMessage::Kind::note, "--delay-wgrad-compute"));
  // moe_act: what megatrain's experts always do (a note); Megatron's rule on grouped GEMMs.
  ep_ms.clear();
  parse(moe_gpt() + words("--moe-grouped-gemm --recompute-granularity selective --recompute-modules moe_act"), 1, &ep_ms);
  CHECK(has_message(ep_ms, SetupMessage::Kind::note,
                    "--recompute-modules moe_act: megatrain's experts always recompute their activation"));
  CHECK_THAT(parse_error(moe_gpt() + words("--recompute-granularity selective --recompute-modules moe_act")),
             Contains("moe_act in recompute_modules is only supported with moe_grouped_gemm."));
  // flex: megatrain's own dispatcher with a note naming the backend it stands in for; Megatron's
  // rules on the backends.
  ep_ms.clear();
  const Config flex = parse(moe_gpt() + words("--expert-model-parallel-size 2 --moe-token-dispatcher-type flex "
                                              "--moe-flex-dispatcher-backend hybridep --enable-experimental"),
                            2, &ep_ms);
  CHECK(flex.model.moe.token_dispatcher_type == MoeDispatcher::flex);
  CHECK(has_message(ep_ms, SetupMessage::Kind::note,
                    "--moe-token-dispatcher-type flex: megatrain runs its own all-to-all dispatcher, the same "
                    "routing and results as Megatron's flex dispatcher (dropless unless a capacity factor is given), "
                    "without DeepEP's or HybridEP's kernels"));
  CHECK(has_message(ep_ms, SetupMessage::Kind::note, "--moe-flex-dispatcher-backend"));
  CHECK(has_message(ep_ms, SetupMessage::Kind::note, "--enable-experimental"));
  CHECK_THAT(parse_error(moe_gpt() + words("--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend nvep")),
             Contains("nvep"));
  ep_ms.clear();
  parse(moe_gpt() + words("--moe-token-dispatcher-type flex --moe-enable-deepep"), 1, &ep_ms);
  CHECK(has_message(ep_ms, SetupMessage::Kind::note, "--moe-enable-deepep"));
  CHECK_THAT(parse_error(moe_gpt() + words("--moe-enable-deepep --moe-token-dispatcher-type alltoall")),
             Contains("(DeepEP backend is only supported with flex token dispatcher.)"));
  CHECK_THAT(parse_error(moe_gpt() + words("--moe-enable-deepep --moe-token-dispatcher-type flex "
                                           "--moe-flex-dispatcher-backend hybridep")),
             Contains("(Only one backend is supported for flex token dispatcher.)"));
  CHECK_THAT(parse_error(moe_gpt() + words("--moe-token-dispatcher-type flex --moe-expert-capacity-factor 1.0 "
                                           "--moe-pad-expert-input-to-capacity")),
             Contains("does not support moe_pad_expert_input_to_capacity"));
  CHECK_THAT(parse_error(moe_gpt() + words("--moe-flex-dispatcher-backend ncclep")),
             Contains("requires moe_token_dispatcher_type='flex'"));
  ep_ms.clear();
  parse(moe_gpt() + words("--expert-model-parallel-size 2 --moe-token-dispatcher-type allgather"), 2, &ep_ms);
  CHECK_FALSE(has_message(ep_ms, SetupMessage::Kind::note, "--moe-token-dispatcher-type"));
  // --overlap-moe-expert-parallel-comm: Megatron's rules, then accepted with a note (performance only).
  const Args ovl = moe_gpt() + words("--overlap-moe-expert-parallel-comm --bf16");
  CHECK_THAT(parse_error(ovl, 2), Contains("needs --expert-model-parallel-size > 1"));
  CHECK_THAT(parse_error(ovl + words("--expert-model-parallel-size 2 --moe-token-dispatcher-type allgather"), 2),
             Contains("needs --moe-token-dispatcher-type alltoall or flex"));
  CHECK_THAT(parse_error(moe_gpt() + words("--overlap-moe-expert-parallel-comm --expert-model-parallel-size 2 "
                                           "--moe-token-dispatcher-type alltoall"), 2),
             Contains("needs --bf16 or --fp16"));
  CHECK_THAT(parse_error(ovl + words("--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall "
                                     "--pipeline-model-parallel-size 2"), 4),
             Contains("needs a virtual pipeline"));
  ep_ms.clear();
  parse(ovl + words("--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall"), 2, &ep_ms);
  CHECK(has_message(ep_ms, SetupMessage::Kind::note,
                    "megatrain does not overlap the expert-parallel dispatch with computation yet"));
  // MoE with TP > 1 needs sequence parallelism; with biases, ETP 1.
  CHECK(parse_error(moe_gpt() + words("--tensor-model-parallel-size 2"), 2) ==
        "--num-experts with --tensor-model-parallel-size 2 needs --sequence-parallel (Megatron's MoE layer raises "
        "without it)");
  CHECK_THAT(parse_error(small_gpt() + words("--num-experts 8 --tensor-model-parallel-size 2 --sequence-parallel"), 2),
             Contains("Bias in MoE is only supported when ETP==1"));
  CHECK_THAT(parse_error(moe_gpt() + words("--moe-ffn-hidden-size 33 --tensor-model-parallel-size 2 "
                                           "--sequence-parallel"), 2),
             Contains("the experts' FFN size 33 (--moe-ffn-hidden-size) is not divisible by "
                      "--expert-tensor-parallel-size 2"));
  // The sizes.
  CHECK_THAT(parse_error(small_gpt() + words("--num-experts -2")), Contains("--num-experts -2 must be > 0"));
  CHECK_THAT(parse_error(moe_gpt() + words("--moe-ffn-hidden-size 0")), Contains("--moe-ffn-hidden-size must be > 0"));
  CHECK_THAT(parse_error(small_gpt() + words("--moe-ffn-hidden-size 32")),
             Contains("--moe-ffn-hidden-size is set but --num-experts is not"));
  std::vector<SetupMessage> ms;
  const Config mixed = parse(small_gpt() + words("--moe-ffn-hidden-size 32 --moe-layer-freq 2"), 1, &ms);
  CHECK_FALSE(mixed.model.moe.ffn_hidden_size);
  CHECK(has_message(ms, SetupMessage::Kind::warning, "--moe-ffn-hidden-size is ignored without --num-experts"));
  // --recompute-modules moe and shared_experts, and the deprecated --moe-layer-recompute (selective
  // with moe added to the modules), are built; without shared experts shared_experts is a note.
  CHECK_NOTHROW(parse(moe_gpt() + words("--recompute-granularity selective --recompute-modules moe shared_experts")));
  CHECK_NOTHROW(parse(moe_gpt() + words("--moe-layer-recompute")));
  std::vector<SetupMessage> shared_notes;
  parse(moe_gpt() + words("--recompute-granularity selective --recompute-modules shared_experts"), 1, &shared_notes);
  CHECK(std::any_of(shared_notes.begin(), shared_notes.end(), [](const SetupMessage& m) {
    return m.text == "--recompute-modules shared_experts: no shared experts, nothing to recompute";
  }));
  // The deprecated --moe-layer-recompute with full recompute.
  CHECK_THAT(parse_error(moe_gpt() + words("--moe-layer-recompute --recompute-granularity full --recompute-method "
                                           "uniform --recompute-num-layers 1")),
             Contains("Do not set --moe-layer-recompute with full recompute granularity"));
}

TEST_CASE("MoE flags: what the engine does not build yet is refused naming the flag", "[cli][moe]") {
  struct Case {
    const char* flags;
    int world;
    const char* line;
  };
  const Case cases[] = {
      {"--expert-tensor-parallel-size 2", 2,
       "megatrain does not support --expert-tensor-parallel-size 2 with --tensor-model-parallel-size 1 yet (MoE: the "
       "experts' tensor-parallel size must divide the tensor-parallel size)"},
      {"--tensor-model-parallel-size 2 --sequence-parallel --expert-tensor-parallel-size 4", 4,
       "megatrain does not support --expert-tensor-parallel-size 4 with --tensor-model-parallel-size 2 yet (MoE: the "
       "experts' tensor-parallel size must divide the tensor-parallel size)"},
      {"--moe-router-dtype fp64", 1, "megatrain does not support --moe-router-dtype fp64 yet (the router computes in fp32)"},
      {"--moe-router-load-balancing-type sinkhorn aux_loss --moe-aux-loss-coeff 0 0", 1,
       "megatrain does not support --moe-router-load-balancing-type sinkhorn with other types yet"},
  };
  for (const Case& c : cases) {
    INFO(c.flags);
    CHECK(unsupported_error(moe_gpt() + words(c.flags), c.world) == c.line);
  }
  // FP8 MoE layers run (the experts' GEMMs in FP8, each expert with its own scaling state), also with
  // the experts' TP size between 1 and TP (their amaxes maxed over the expert TP group).
  CHECK(parse(moe_gpt() + words("--bf16 --fp8-format hybrid --tensor-model-parallel-size 4 --sequence-parallel "
                                "--expert-tensor-parallel-size 2"), 4)
            .parallel.expert_tensor_parallel_size == 2);
  // FP8 MoE layers run (the experts' GEMMs in FP8, each expert with its own scaling state).
  CHECK(parse(moe_gpt() + words("--bf16 --fp8-format hybrid --fp8-recipe tensorwise")).train.fp8_format ==
        Fp8Format::hybrid);
  // --moe-router-padding-for-fp8: megatrain pads with zero rows whatever the flag says, and says so.
  {
    std::vector<SetupMessage> ms;
    parse(moe_gpt() + words("--bf16 --fp8-format hybrid --moe-token-dispatcher-type alltoall --moe-router-padding-for-fp8"),
          1, &ms);
    CHECK(has_message(ms, SetupMessage::Kind::note, "--moe-router-padding-for-fp8: megatrain pads"));
  }
  // Optimizer instances split the experts' data-parallel groups too (Megatron's partial expert DP
  // groups): their size must divide it.
  CHECK_NOTHROW(parse(moe_gpt() + words("--expert-model-parallel-size 2 --use-distributed-optimizer "
                                        "--num-distributed-optimizer-instances 2"),
                      4));
  CHECK_THAT(parse_error(moe_gpt() + words("--expert-model-parallel-size 2 --use-distributed-optimizer "
                                           "--num-distributed-optimizer-instances 4"),
                         4),
             Contains("the experts' data-parallel size 2 (world size / (ETP x EP x PP)) is not divisible by "
                      "--num-distributed-optimizer-instances 4"));
  // --use-tp-pp-dp-mapping with PP: Megatron's rules for the experts' grid (the same data-parallel
  // size and pipeline groups as the attention's), then it runs (EP folding TP or CP).
  CHECK_THAT(parse_error(moe_gpt() + words("--expert-model-parallel-size 2 --use-tp-pp-dp-mapping "
                                           "--pipeline-model-parallel-size 2"),
                         4),
             Contains("the experts' data-parallel size 1 (world size / (ETP x EP x PP)) must equal the data-parallel "
                      "size 2"));
  CHECK_NOTHROW(parse(moe_gpt() + words("--expert-model-parallel-size 2 --use-tp-pp-dp-mapping "
                                        "--pipeline-model-parallel-size 2 --tensor-model-parallel-size 2 "
                                        "--expert-tensor-parallel-size 1 --sequence-parallel"),
                      4));
  CHECK_NOTHROW(parse(moe_gpt() + words("--expert-model-parallel-size 2 --use-tp-pp-dp-mapping "
                                        "--pipeline-model-parallel-size 2 --context-parallel-size 2"),
                      8));
  // Linear biases with MoE (biases are on unless --disable-bias-linear): built, but not with a
  // shared expert (Megatron's SharedExpertMLP asserts it).
  CHECK_NOTHROW(parse(small_gpt() + words("--num-experts 8")));
  CHECK(parse_error(small_gpt() + words("--num-experts 8 --moe-shared-expert-intermediate-size 64")) ==
        "bias is not supported in the shared experts (--moe-shared-expert-intermediate-size with linear biases), "
        "please set '--disable-bias-linear' instead");
  // Several at once, one line each.
  CHECK(unsupported_error(moe_gpt() + words("--moe-router-dtype fp64 --moe-router-load-balancing-type sinkhorn "
                                            "aux_loss --moe-aux-loss-coeff 0 0.1")) ==
        "2 problems with the command line:\n"
        "  megatrain does not support --moe-router-dtype fp64 yet (the router computes in fp32)\n"
        "  megatrain does not support --moe-router-load-balancing-type sinkhorn with other types yet");
  // Refused while parsing: the values megatrain has no representation for, and the flags it lacks.
  for (const auto& [flags, line] : std::vector<std::pair<std::string, std::string>>{
           {"--moe-router-load-balancing-type quantile_balancing",
            "megatrain does not support --moe-router-load-balancing-type quantile_balancing yet (built: aux_loss, seq_aux_loss, "
            "global_aux_loss, sinkhorn, none)"},
           {"--moe-latent-size 16", "megatrain does not support --moe-latent-size 16 yet"},
           {"--moe-use-upcycling", "megatrain does not support --moe-use-upcycling yet"},
           {"--moe-upcycling-granularity 2", "megatrain does not support --moe-upcycling-granularity 2 yet"}}) {
    INFO(flags);
    CHECK(unsupported_error(moe_gpt() + words(flags)) == line);
  }
  // --moe-apply-probs-on-input: built, top-1 only (Megatron-LM's experts assert it).
  CHECK(parse(moe_gpt() + words("--moe-apply-probs-on-input --moe-router-topk 1 --moe-router-pre-softmax"))
            .model.moe.apply_probs_on_input);
  CHECK_THAT(parse_error(moe_gpt() + words("--moe-apply-probs-on-input --moe-router-topk 2")),
             Contains("`moe_apply_probs_on_input` only works with `moe_router_topk`=1."));
  // What is built: dispatchers, routers, losses, shared experts, fp32 router, ETP = TP, EP 1.
  CHECK_NOTHROW(parse(moe_gpt() + words("--moe-token-dispatcher-type alltoall --moe-router-dtype fp32 "
                                        "--moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2 "
                                        "--moe-z-loss-coeff 1e-3 --moe-shared-expert-intermediate-size 64 "
                                        "--moe-shared-expert-gate --expert-model-parallel-size 1 "
                                        "--expert-tensor-parallel-size 1 --moe-expert-capacity-factor -1")));
  CHECK_NOTHROW(parse(moe_gpt() + words("--moe-router-load-balancing-type none --bf16")));
  // The flag table documents each refusal (docs/flags.md).
  CHECK(cli::unsupported_summary("--moe-router-load-balancing-type") ==
        "values quantile_balancing not supported yet");
  CHECK_THAT(cli::unsupported_summary("--num-experts"), Contains("--fp4-format"));
  // FP8 parameters of MoE layers are built: the experts' weights are FP8 parameters, each expert
  // cast with its own scale.
  CHECK(parse(moe_gpt() + words("--bf16 --fp8-format hybrid --use-distributed-optimizer --fp8-param-gather"))
            .train.fp8_param_gather);
  // MoE with context parallelism is built (the experts' grid folds CP).
  CHECK_NOTHROW(parse(moe_gpt() + words("--context-parallel-size 2 --expert-model-parallel-size 2"), 2));
  CHECK_THAT(cli::unsupported_summary("--expert-tensor-parallel-size"),
             Contains("values not dividing --tensor-model-parallel-size not supported yet"));
  // Input jitter is built (engine/blocks/moe.cpp), its epsilon in [0, 1).
  CHECK_FALSE(cli::fully_unsupported("--moe-input-jitter-eps"));
  CHECK_NOTHROW(parse(moe_gpt() + words("--moe-input-jitter-eps 0.01")));
  CHECK_THAT(parse_error(moe_gpt() + words("--moe-input-jitter-eps -0.1")),
             Contains("--moe-input-jitter-eps must be in [0, 1) (got -0.1)"));
  CHECK_THAT(parse_error(moe_gpt() + words("--moe-input-jitter-eps 1")), Contains("--moe-input-jitter-eps must be in [0, 1)"));
  CHECK_FALSE(cli::fully_unsupported("--moe-per-layer-logging"));
  CHECK_FALSE(cli::fully_unsupported("--num-experts"));
}

TEST_CASE("MoE parameters and FLOPs: a small model counted by hand", "[cli][moe][params]") {
  const Config c = parse(counted_moe());
  const ModelConfig& m = c.model;
  REQUIRE(m.padded_vocab_size == 1024);
  REQUIRE(m.moe.moe_layer == std::vector<char>{1, 0, 1, 0});
  const ParamCounts p = count_parameters(m);
  // A dense layer: LayerNorm 2h = 128, QKV 3h^2 = 12288, projection h^2 = 4096, pre-MLP LayerNorm
  // 128, fc1 2 x 128 x 64 = 16384, fc2 64 x 128 = 8192.
  CHECK(p.layer.total() == 128 + 12288 + 4096 + 128 + 16384 + 8192);
  // An MoE layer: the same attention and norms (16640), router 8 x 64 = 512, experts' fc1
  // 8 x (2 x 32) x 64 = 32768 and fc2 8 x 64 x 32 = 16384, shared fc1 2 x 64 x 64 = 8192, fc2
  // 64 x 64 = 4096, gate 64.
  CHECK(p.moe_layer.router_weight == 512);
  CHECK(p.moe_layer.experts_fc1_weight == 32768);
  CHECK(p.moe_layer.experts_fc2_weight == 16384);
  CHECK(p.moe_layer.shared_fc1_weight == 8192);
  CHECK(p.moe_layer.shared_fc2_weight == 4096);
  CHECK(p.moe_layer.shared_gate_weight == 64);
  CHECK(p.moe_layer.fc1_weight == 0);
  CHECK(p.moe_layer.total() == 16640 + 512 + 32768 + 16384 + 8192 + 4096 + 64);
  CHECK(p.num_moe_layers == 2);
  CHECK(p.layers == 2 * 41216 + 2 * 78656);
  // Embeddings 1024 x 64 and positions 32 x 64, final LayerNorm 128, tied output layer.
  CHECK(p.total == 1024 * 64 + 32 * 64 + (2 * 41216 + 2 * 78656) + 128);
  // A token skips 6 of the 8 experts in each MoE layer: 6 x (2 x 32 x 64 + 64 x 32) each.
  CHECK(p.active == p.total - 2 * 6 * (2 * 32 * 64 + 64 * 32));
  // One rank, all layers: the per-stage count is the total.
  CHECK(stage_parameters_per_rank(m, {chunk(0, 0, 4, true, true)}, 1, 1) == p.total);
  // Two stages: layers 0-1 (one MoE, one dense) with the embeddings, 2-3 with the final norm and the
  // last stage's copy of the tied embeddings.
  CHECK(stage_parameters_per_rank(m, {chunk(0, 0, 2, true, false)}, 1, 2) ==
        78656 + 41216 + 1024 * 64 + 32 * 64);
  CHECK(stage_parameters_per_rank(m, {chunk(1, 2, 2, false, true)}, 1, 2) == 78656 + 41216 + 128 + 1024 * 64);
  // Expert parallelism: each of EP = 4 ranks holds 2 of the 8 experts (and everything else whole).
  CHECK(stage_parameters_per_rank(m, {chunk(0, 0, 4, true, true)}, 1, 1, 4) ==
        p.total - 2 * 3 * (32768 + 16384) / 4);

  // Megatron's FLOPs: B 2 samples of s 32; MLP 6h[f F L_dense + (f_e k F + f_s F) L_moe] =
  // 6 x 64 x [128 x 3 x 2 + (32 x 2 x 3 + 64 x 3) x 2]; projections 6 L (h (q + 2k) + q h) =
  // 6 x 4 x (64 x 192 + 64 x 64); logits 6 h V = 6 x 64 x 1024; attention 6 q L s^2 per sample.
  const double mlp = 6.0 * 64 * (128 * 3 * 2 + (32 * 2 * 3 + 64 * 3) * 2);
  const double projections = 6.0 * 4 * (64 * 192 + 64 * 64);
  const double logits = 6.0 * 64 * 1024;
  const double attention = 6.0 * 64 * 4;
  CHECK(c.train.global_batch == 2);
  CHECK(num_floating_point_operations(m, 2) == 2 * 32 * (mlp + projections + logits) + 2 * 32 * 32 * attention);
  CHECK(flops_per_token(m) == Approx((32 * (mlp + projections + logits) + 32 * 32 * attention) / 32).epsilon(1e-15));
  // The same model without experts: every layer dense.
  const Config dense = parse(small_gpt() + words("--num-layers 4 --disable-bias-linear --swiglu --ffn-hidden-size 128"));
  CHECK(num_floating_point_operations(dense.model, 2) ==
        2 * 32 * (6.0 * 64 * 128 * 3 * 4 + projections + logits) + 2 * 32 * 32 * attention);
  CHECK(count_parameters(dense.model).active == count_parameters(dense.model).total);
  CHECK(count_parameters(dense.model).num_moe_layers == 0);
  // Counting from the flags alone (a configuration not derived) gives the same numbers.
  ModelConfig raw = m;
  raw.moe.moe_layer.clear();
  raw.moe.expert_ffn = 0;
  CHECK(count_parameters(raw).total == p.total);
  CHECK(num_floating_point_operations(raw, 2) == num_floating_point_operations(m, 2));
  // A list pattern: layers 1-3 MoE.
  const Config listed = parse(counted_moe() + words("--moe-layer-freq ([0]+[1]*3)"));
  CHECK(count_parameters(listed.model).layers == 41216 + 3 * 78656);
}

TEST_CASE("MoE: the checkpoint's model section records and checks the experts", "[cli][moe][args]") {
  const Config c = parse(counted_moe() + words("--moe-router-score-function sigmoid --moe-router-topk-scaling-factor 2.5"));
  const json j = model_config_to_json(c.model);
  CHECK(j.at("num_experts") == 8);
  CHECK(j.at("moe_ffn_hidden_size") == 32);
  CHECK(j.at("moe_layer_freq") == 2);
  CHECK(j.at("moe_expert_ffn") == 32);
  CHECK(j.at("moe_layer") == json({1, 0, 1, 0}));
  CHECK(j.at("moe_router_topk") == 2);
  CHECK(j.at("moe_router_score_function") == "sigmoid");
  CHECK(j.at("moe_router_topk_scaling_factor") == 2.5);
  CHECK(j.at("moe_shared_expert_intermediate_size") == 64);
  CHECK(j.at("moe_shared_expert_gate") == true);
  const ModelConfig back = model_config_from_json(j, "m.json");
  CHECK(back.moe.num_experts == 8);
  CHECK(back.moe.moe_layer == c.model.moe.moe_layer);
  CHECK(back.moe.expert_ffn == 32);
  CHECK(back.moe.score_function == MoeScoreFunction::sigmoid);
  CHECK(model_config_to_json(back) == j);
  CHECK_NOTHROW(check_checkpoint_model(j, c.model, "m.json"));
  // Another expert count, expert size or MoE layer pattern is another model.
  CHECK_THROWS_WITH(check_checkpoint_model(j, parse(counted_moe() + words("--num-experts 4")).model, "m.json"),
                    Contains("--num-experts is 8 in the checkpoint but 4 in this run"));
  CHECK_THROWS_WITH(check_checkpoint_model(j, parse(counted_moe() + words("--moe-ffn-hidden-size 16")).model, "m.json"),
                    Contains("the experts' FFN size (--moe-ffn-hidden-size) is 32 in the checkpoint but 16 in this run"));
  CHECK_THROWS_WITH(check_checkpoint_model(j, parse(counted_moe() + words("--moe-layer-freq [0,1,0,1]")).model, "m.json"),
                    Contains("the MoE layer map (--moe-layer-freq) is [1,0,1,0] in the checkpoint but [0,1,0,1]"));
  // The same layers written as a list are the same model.
  CHECK_NOTHROW(check_checkpoint_model(j, parse(counted_moe() + words("--moe-layer-freq [1,0,1,0]")).model, "m.json"));
  // A checkpoint from before MoE was recorded is a dense model.
  json older = model_config_to_json(parse(small_gpt() + words("--num-layers 4 --disable-bias-linear --swiglu "
                                                              "--ffn-hidden-size 128")).model);
  for (const char* k : {"num_experts", "moe_ffn_hidden_size", "moe_layer_freq", "moe_layer_pattern", "moe_expert_ffn",
                        "moe_layer", "moe_router_topk", "moe_router_score_function", "moe_router_pre_softmax",
                        "moe_router_topk_scaling_factor", "moe_router_num_groups", "moe_router_group_topk",
                        "moe_shared_expert_intermediate_size", "moe_shared_expert_gate",
                        "moe_router_enable_expert_bias"})
    older.erase(k);
  CHECK_FALSE(model_config_from_json(older, "old.json").moe.enabled());
  CHECK_THROWS_WITH(check_checkpoint_model(older, c.model, "old.json"),
                    Contains("--num-experts is None in the checkpoint but 8 in this run"));
}

TEST_CASE("MoE dry run: experts, top-k, total and active parameters", "[cli][moe][binary]") {
  const RunResult text = run_binary(counted_moe() + words("--dry-run --device cpu"));
  INFO(text.err);
  REQUIRE(text.exit_code == 0);
  const ParamCounts p = count_parameters(parse(counted_moe()).model);
  auto commas = [](int64_t v) {
    std::string d = std::to_string(v), s;
    for (size_t i = 0; i < d.size(); ++i) {
      if (i > 0 && (d.size() - i) % 3 == 0) s.push_back(',');
      s.push_back(d[i]);
    }
    return s;
  };
  CHECK_THAT(text.out, Contains("total: " + commas(p.total)));
  CHECK_THAT(text.out, Contains("active per token: " + commas(p.active) + " (top-2 of 8 experts in each of 2 MoE layers)"));
  CHECK_THAT(text.out, Contains("per dense layer: 41,216 x 2 layers; per MoE layer: 78,656 x 2 layers"));
  CHECK_THAT(text.out, Contains("\"layer_pattern\":\"E-E-\""));
  CHECK_THAT(text.out, Contains("(MoE layers: top-k experts' FFNs and the shared expert; the router"));

  const RunResult js = run_binary(counted_moe() + words("--dry-run --device cpu --json"));
  INFO(js.err);
  REQUIRE(js.exit_code == 0);
  const json plan = json::parse(js.out);
  CHECK(plan.at("parameters").at("total") == p.total);
  CHECK(plan.at("parameters").at("active") == p.active);
  CHECK(plan.at("parameters").at("moe").at("num_moe_layers") == 2);
  CHECK(plan.at("parameters").at("moe").at("router") == 512);
  CHECK(plan.at("derived").at("moe").at("num_experts") == 8);
  CHECK(plan.at("derived").at("moe").at("router_topk") == 2);
  CHECK(plan.at("derived").at("moe").at("expert_ffn_hidden_size") == 32);
  CHECK(plan.at("derived").at("moe").at("moe_layers") == 2);
  CHECK(plan.at("config").at("--num-experts").at("value") == 8);
  CHECK(plan.at("config").at("--moe-layer-freq").at("value") == 2);
  CHECK(plan.at("flops").at("per_iteration").get<double>() ==
        num_floating_point_operations(parse(counted_moe()).model, 2));
  // A dense model says so.
  const RunResult dense = run_binary(small_gpt() + words("--dry-run --device cpu --json"));
  REQUIRE(dense.exit_code == 0);
  const json d = json::parse(dense.out);
  CHECK(d.at("derived").at("moe").is_null());
  CHECK(d.at("parameters").at("active") == d.at("parameters").at("total"));
  CHECK_FALSE(d.at("parameters").contains("moe"));
}

TEST_CASE("MoE: --use-checkpoint-args takes Megatron's MoE arguments from the checkpoint", "[cli][moe][args]") {
  TempDir dir;
  save_config(dir, parse(counted_moe() + words("--moe-router-score-function sigmoid --moe-router-topk-scaling-factor 2.5 "
                                               "--moe-layer-freq [1,1,0,0] --moe-router-num-groups 2 "
                                               "--moe-router-group-topk 1")));
  std::vector<SetupMessage> ms;
  const Config c = parse(small_gpt() + words("--num-layers 4 --disable-bias-linear --swiglu --ffn-hidden-size 128 "
                                             "--moe-ffn-hidden-size 16 --use-checkpoint-args --load " + dir.str("")),
                         1, &ms);
  const MoeConfig& e = c.model.moe;
  // Megatron's load_args_from_checkpoint forces these ...
  CHECK(e.num_experts == 8);
  CHECK(e.moe_layer == std::vector<char>{1, 1, 0, 0});
  CHECK(e.ffn_hidden_size == 32);  // over the command line's 16
  CHECK(e.router_topk == 2);
  CHECK(e.score_function == MoeScoreFunction::sigmoid);
  CHECK(e.router_topk_scaling_factor == 2.5);
  CHECK(e.shared_expert_intermediate_size == 64);
  CHECK(has_message(ms, SetupMessage::Kind::info, "Setting num_experts to 8 from checkpoint"));
  CHECK(has_message(ms, SetupMessage::Kind::info, "Setting moe_layer_freq to [1,1,0,0] from checkpoint"));
  // ... and not the routing groups or the shared expert's gate.
  CHECK_FALSE(e.router_group_topk);
  CHECK_FALSE(e.shared_expert_gate);

  // A checkpoint without experts clears the command line's --moe-ffn-hidden-size (as Megatron does).
  TempDir dense;
  save_config(dense, parse(small_gpt() + words("--num-layers 4 --disable-bias-linear")));
  ms.clear();
  const Config d = parse(small_gpt() + words("--num-layers 4 --disable-bias-linear --moe-ffn-hidden-size 32 "
                                             "--use-checkpoint-args --load " + dense.str("")),
                         1, &ms);
  CHECK_FALSE(d.model.moe.enabled());
  CHECK_FALSE(d.model.moe.ffn_hidden_size);
  CHECK(has_message(ms, SetupMessage::Kind::info, "Checkpoint did not provide arguments num_experts"));
}

TEST_CASE("MoE: a trained MoE checkpoint trains on, exports as MixtralForCausalLM and to Megatron-LM (weights)",
          "[cli][moe][binary]") {
  TempDir dir;
  const Args model = words("--device cpu --mock-data --tokenizer-type NullTokenizer --vocab-size 64 --num-layers 2 "
                           "--hidden-size 16 --num-attention-heads 2 --seq-length 8 --max-position-embeddings 8 "
                           "--micro-batch-size 2 --global-batch-size 4 --lr 1e-2 --disable-bias-linear --swiglu "
                           "--normalization RMSNorm --position-embedding-type rope --num-experts 4 "
                           "--moe-router-topk 2 --moe-ffn-hidden-size 12 --moe-aux-loss-coeff 1e-2 --save-interval 2 --log-interval 1");
  const RunResult train = run_binary(model + words("--train-iters 4 --exit-interval 2 --save " + dir.str("ckpt")));
  INFO(train.out << train.err);
  REQUIRE(train.exit_code == 0);
  CHECK_THAT(train.out, Contains("load_balancing_loss:"));
  // Resumed: the experts' tensors load by name.
  const RunResult resumed =
      run_binary(model + words("--train-iters 4 --load " + dir.str("ckpt") + " --save " + dir.str("ckpt")));
  INFO(resumed.out << resumed.err);
  CHECK(resumed.exit_code == 0);
  CHECK_THAT(resumed.out, Contains("iteration        4/       4"));
  const RunResult hf = run_binary(words("export-hf --load " + dir.str("ckpt") + " --output " + dir.str("hf")));
  INFO(hf.out << hf.err);
  CHECK(hf.exit_code == 0);
  std::ifstream config(dir.str("hf") + "/config.json");
  const std::string text((std::istreambuf_iterator<char>(config)), std::istreambuf_iterator<char>());
  CHECK_THAT(text, Contains("\"MixtralForCausalLM\""));
  // To Megatron-LM in the torch format: the weights (the optimizer state of MoE models goes over in
  // torch_dist and fsdp_dtensor only), which import back unchanged.
  const RunResult meg = run_binary(words("export-megatron --ckpt-format torch --load " + dir.str("ckpt") + " --save " +
                                                 dir.str("meg")));
  INFO(meg.out << meg.err);
  CHECK(meg.exit_code == 0);
  CHECK_THAT(meg.out, Contains("weights only, as megatrain writes a mixture-of-experts model's optimizer state for "
                               "Megatron-LM in --ckpt-format torch_dist or fsdp_dtensor only"));
  CHECK(std::filesystem::exists(dir.str("meg") + "/release/mp_rank_00/model_optim_rng.pt"));
  const RunResult back = run_binary(words("import-megatron --load " + dir.str("meg") + " --save " + dir.str("back")));
  INFO(back.out << back.err);
  CHECK(back.exit_code == 0);
  CHECK_THAT(back.out, Contains("--num-experts 4"));
}

// MoE layers with linear biases (Megatron's default): they train, save and resume; export-hf (no
// place for the biases in the HF MoE families) refuses in one line; export-megatron's torch_dist and
// torch formats round-trip through import-megatron.
TEST_CASE("MoE with linear biases: trains and resumes, export-hf refuses, export-megatron writes both formats",
          "[cli][moe][binary]") {
  TempDir dir;
  const Args model = words("--device cpu --mock-data --tokenizer-type NullTokenizer --vocab-size 64 --num-layers 2 "
                           "--hidden-size 16 --num-attention-heads 2 --seq-length 8 --max-position-embeddings 8 "
                           "--micro-batch-size 2 --global-batch-size 4 --lr 1e-2 --swiglu --normalization RMSNorm "
                           "--position-embedding-type rope --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 12 "
                           "--moe-aux-loss-coeff 1e-2 --save-interval 2 --log-interval 1 --seed 5");
  const RunResult straight = run_binary(model + words("--train-iters 6"));
  INFO(straight.out << straight.err);
  REQUIRE(straight.exit_code == 0);
  const RunResult first = run_binary(model + words("--train-iters 6 --exit-interval 2 --save " + dir.str("ckpt")));
  REQUIRE(first.exit_code == 0);
  const RunResult resumed = run_binary(model + words("--train-iters 6 --load " + dir.str("ckpt")));
  INFO(resumed.out << resumed.err);
  REQUIRE(resumed.exit_code == 0);
  // Iterations 5 and 6 (loss and grad norm) as in the straight run. (Iteration 4's line averages
  // iterations 3 and 4 after a resume: Megatron logs the run's first iteration without resetting
  // the interval.)
  auto line_of = [](const std::string& out, const std::string& it) {
    const size_t at = out.find("iteration        " + it + "/");
    if (at == std::string::npos) return std::string();
    const size_t from = out.find("lm loss", at), to = out.find("| number of skipped", at);
    return out.substr(from, to - from);
  };
  for (const char* it : {"5", "6"}) {
    CHECK_FALSE(line_of(straight.out, it).empty());
    CHECK(line_of(resumed.out, it) == line_of(straight.out, it));
  }
  const RunResult hf = run_binary(words("export-hf --load " + dir.str("ckpt") + " --output " + dir.str("hf")));
  CHECK(hf.exit_code != 0);
  CHECK_THAT(hf.err, Contains("linear biases in MoE layers"));
  // To Megatron-LM: torch_dist with the optimizer state, which imports back and resumes as the
  // straight run; the torch format (weights only, each expert's biases after its weights, at EP 2 x
  // PP 2 here), which imports back to the same weights: a --finetune run from it trains as one from
  // the checkpoint itself.
  const RunResult torch_fmt =
      run_binary(words("export-megatron --ckpt-format torch --expert-model-parallel-size 2 --data-parallel-size 2 "
                       "--pipeline-model-parallel-size 2 --load " + dir.str("ckpt") + " --save " + dir.str("meg_torch")));
  INFO(torch_fmt.out << torch_fmt.err);
  REQUIRE(torch_fmt.exit_code == 0);
  const RunResult torch_back =
      run_binary(words("import-megatron --load " + dir.str("meg_torch") + " --save " + dir.str("torch_back")));
  INFO(torch_back.out << torch_back.err);
  REQUIRE(torch_back.exit_code == 0);
  const RunResult from_ckpt = run_binary(model + words("--train-iters 2 --finetune --load " + dir.str("ckpt")));
  const RunResult from_torch = run_binary(model + words("--train-iters 2 --finetune --load " + dir.str("torch_back")));
  REQUIRE(from_ckpt.exit_code == 0);
  REQUIRE(from_torch.exit_code == 0);
  for (const char* it : {"1", "2"}) {
    CHECK_FALSE(line_of(from_ckpt.out, it).empty());
    CHECK(line_of(from_torch.out, it) == line_of(from_ckpt.out, it));
  }
  const RunResult meg = run_binary(words("export-megatron --load " + dir.str("ckpt") + " --save " + dir.str("meg")));
  INFO(meg.out << meg.err);
  REQUIRE(meg.exit_code == 0);
  CHECK_THAT(meg.out, Contains("--no-bias-swiglu-fusion"));
  const RunResult back = run_binary(words("import-megatron --load " + dir.str("meg") + " --save " + dir.str("back")));
  INFO(back.out << back.err);
  REQUIRE(back.exit_code == 0);
  const RunResult again = run_binary(model + words("--train-iters 6 --load " + dir.str("back")));
  INFO(again.out << again.err);
  REQUIRE(again.exit_code == 0);
  for (const char* it : {"5", "6"}) CHECK(line_of(again.out, it) == line_of(straight.out, it));
}


TEST_CASE("binary: --moe-per-layer-logging writes each layer's losses to TensorBoard as Megatron names them",
          "[cli][binary][moe]") {
  // 4 layers, MoE layers 0 and 2: moe/load_balancing_loss_layer_<i> and moe/z_loss_layer_<i> for
  // every layer (0 for the dense ones); the MoE layers' mean is the logged load_balancing_loss.
  TempDir dir;
  const RunResult r = run_binary(counted_moe() + words("--device cpu --global-batch-size 4 --train-iters 2 "
                                                       "--moe-aux-loss-coeff 1e-2 --moe-z-loss-coeff 1e-3 "
                                                       "--moe-per-layer-logging --log-interval 1 --tensorboard-dir " +
                                                       dir.str("tb")));
  REQUIRE(r.exit_code == 0);
  std::string event_file;
  for (const auto& e : std::filesystem::directory_iterator(dir.path / "tb")) event_file = e.path().string();
  REQUIRE(!event_file.empty());
  std::map<std::pair<int64_t, std::string>, double> v;
  for (const TensorBoardEvent& e : read_tensorboard_events(event_file))
    for (const auto& [tag, value] : e.scalars) v[{e.step, tag}] = value;
  for (int64_t it : {1, 2}) {
    INFO("iteration " << it);
    for (const char* name : {"load_balancing_loss", "z_loss"}) {
      INFO(name);
      for (int l = 0; l < 4; ++l) REQUIRE(v.count({it, fmt::format("moe/{}_layer_{}", name, l)}) == 1);
      const double l0 = v[{it, fmt::format("moe/{}_layer_0", name)}], l2 = v[{it, fmt::format("moe/{}_layer_2", name)}];
      CHECK(v[{it, fmt::format("moe/{}_layer_1", name)}] == 0.0);
      CHECK(v[{it, fmt::format("moe/{}_layer_3", name)}] == 0.0);
      CHECK(l0 > 0.0);
      CHECK(l2 > 0.0);
      CHECK(v[{it, name}] == Approx((l0 + l2) / 2).epsilon(1e-5));
    }
  }
}

TEST_CASE("binary: --mtp-num-layers writes Megatron's MTP losses and acceptance rates to TensorBoard",
          "[cli][binary][mtp]") {
  // Every iteration, as Megatron's MTP tracker: mtp_<j> loss, mtp_<j>_acceptance_rate and
  // mtp_<j>_cumulative_acceptance_rate (percent), with no "vs samples" twin; lm loss keeps its own.
  // Every iteration counts the same rows (no loss mask), so the cumulative rate of two iterations
  // is the mean of their rates.
  TempDir dir;
  const RunResult r = run_binary(
      words("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
            "--micro-batch-size 2 --global-batch-size 4 --lr 1e-2 --train-iters 3 --mock-data --tokenizer-type "
            "NullTokenizer --vocab-size 64 --position-embedding-type rope --mtp-num-layers 2 --device cpu "
            "--log-interval 1 --tensorboard-dir " +
            dir.str("tb") + " --metrics-jsonl " + dir.str("m.jsonl")));
  REQUIRE(r.exit_code == 0);
  std::string event_file;
  for (const auto& e : std::filesystem::directory_iterator(dir.path / "tb")) event_file = e.path().string();
  REQUIRE(!event_file.empty());
  std::map<std::pair<int64_t, std::string>, double> v;
  std::set<std::string> tags;
  for (const TensorBoardEvent& e : read_tensorboard_events(event_file))
    for (const auto& [tag, value] : e.scalars) {
      v[{e.step, tag}] = value;
      tags.insert(tag);
    }
  CHECK(tags.count("lm loss vs samples") == 1);
  std::ifstream metrics(dir.str("m.jsonl"));
  std::map<int64_t, nlohmann::json> lines;
  for (std::string line; std::getline(metrics, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.value("type", "") == "iteration") lines[j.at("iteration").get<int64_t>()] = j;
  }
  for (int64_t it : {1, 2, 3}) {
    INFO("iteration " << it);
    CHECK(v.count({it, "lm loss"}) == 1);
    for (int j : {1, 2}) {
      INFO("depth " << j);
      const std::string loss = fmt::format("mtp_{} loss", j), rate = fmt::format("mtp_{}_acceptance_rate", j),
                        cumulative = fmt::format("mtp_{}_cumulative_acceptance_rate", j);
      REQUIRE(v.count({it, loss}) == 1);
      CHECK(tags.count(loss + " vs samples") == 0);
      CHECK(v[{it, loss}] > 2.0);  // about ln 64
      REQUIRE(v.count({it, rate}) == 1);
      REQUIRE(v.count({it, cumulative}) == 1);
      CHECK(v[{it, rate}] >= 0.0);
      CHECK(v[{it, rate}] <= 100.0);
      if (it == 1) CHECK(v[{it, cumulative}] == Approx(v[{it, rate}]));
      if (it == 2) CHECK(v[{it, cumulative}] == Approx((v[{1, rate}] + v[{2, rate}]) / 2));
      REQUIRE(lines.count(it) == 1);
      CHECK(lines[it].at(rate).get<double>() == Approx(v[{it, rate}]));
    }
  }
}

TEST_CASE("binary: --moe-pad-expert-input-to-capacity trains as dropping at the capacity does, with a note",
          "[cli][binary][moe]") {
  // Megatron fills each expert's capacity with tokens of routing weight 0: the routed tokens'
  // results are those of dropping alone.
  const Args run = counted_moe() + words("--device cpu --global-batch-size 4 --train-iters 3 --log-interval 1 "
                                         "--moe-expert-capacity-factor 1.0 --moe-token-drop-policy position");
  const RunResult dropped = run_binary(run);
  const RunResult padded = run_binary(run + words("--moe-pad-expert-input-to-capacity"));
  REQUIRE(dropped.exit_code == 0);
  REQUIRE(padded.exit_code == 0);
  CHECK_THAT(padded.out + padded.err, Contains("--moe-pad-expert-input-to-capacity has no effect in megatrain"));
  auto losses = [](const std::string& log) {
    std::vector<std::string> out;
    for (size_t at = log.find("lm loss: "); at != std::string::npos; at = log.find("lm loss: ", at + 1))
      out.push_back(log.substr(at, 21));
    return out;
  };
  CHECK(losses(dropped.out).size() == 3);
  CHECK(losses(padded.out) == losses(dropped.out));
  // With the expert bias, Megatron counts every expert's whole capacity: the bias does not move
  // (without the padding it does).
  TempDir dir;
  const Args biased = words("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
                            "--max-position-embeddings 32 --micro-batch-size 2 --lr 1e-3 --mock-data --tokenizer-type "
                            "NullTokenizer --vocab-size 1000 --disable-bias-linear --swiglu --ffn-hidden-size 128 "
                            "--num-experts 8 --moe-router-topk 2 --moe-layer-freq 2 --moe-ffn-hidden-size 32 "
                            "--moe-router-score-function sigmoid --moe-router-enable-expert-bias "
                            "--moe-expert-capacity-factor 1.0 --device cpu --global-batch-size 4 --train-iters 2 "
                            "--save-interval 2");
  REQUIRE(run_binary(biased + words("--save " + dir.str("drop"))).exit_code == 0);
  REQUIRE(run_binary(biased + words("--moe-pad-expert-input-to-capacity --save " + dir.str("pad"))).exit_code == 0);
  auto bias_moved = [&](const std::string& ckpt) {
    CheckpointReader r(ckpt);
    std::vector<float> b(8);
    r.read("decoder.layers.0.mlp.router.expert_bias", CheckpointKind::model, ShardSlice::whole(ShardIndex::whole(8, 1)),
           Tensor(b.data(), DType::f32, Device::cpu, {8}), {8});
    return std::any_of(b.begin(), b.end(), [](float v) { return v != 0.0f; });
  };
  CHECK(bias_moved(dir.str("drop")));
  CHECK_FALSE(bias_moved(dir.str("pad")));
}

TEST_CASE("RankPosition: every rank's place in the dense and the experts' grid, as ModelDims reads it", "[moe][grid]") {
  // 16 ranks: TP 2 x DP 4 x PP 2; the experts' grid ETP 1 x EP 4 x expert-DP 2 x PP 2.
  const Config c = parse(moe_gpt() + words("--sequence-parallel --tensor-model-parallel-size 2 "
                                           "--pipeline-model-parallel-size 2 --expert-model-parallel-size 4 "
                                           "--expert-tensor-parallel-size 1"), 16);
  const RankGrid dense = RankGrid::from_config(c), experts = RankGrid::experts_from_config(c);
  std::set<std::tuple<int, int, int>> expert_places;
  for (int rank = 0; rank < 16; ++rank) {
    const RankPosition r = RankPosition::of(c, rank);
    const RankCoord d = rank_coord(dense, rank), e = rank_coord(experts, rank);
    CHECK(r.world_size == 16);
    CHECK(r.rank == rank);
    CHECK((r.tp_size == 2 && r.dp_size == 4 && r.pp_size == 2 && r.cp_size == 1));
    CHECK((r.tp_rank == d.tp && r.dp_rank == d.dp && r.pp_rank == d.pp));
    CHECK((r.etp_size == 1 && r.ep_size == 4 && r.edp_size == 2));
    CHECK((r.etp_rank == e.tp && r.ep_rank == e.ep && r.edp_rank == e.dp && e.pp == d.pp));
    expert_places.insert({r.pp_rank, r.ep_rank, r.edp_rank});
    const ModelDims m = ModelDims::from_config(c, r);
    CHECK(m.expert_begin() == 2 * r.ep_rank);  // 8 experts over EP 4
    CHECK(m.experts_local_rows());               // (expert TP 1 under TP 2: each rank dispatches its own rows)
    CHECK(m.first_stage == (r.pp_rank == 0));
  }
  CHECK(expert_places.size() == 16);  // every rank a place of its own in the experts' grid
  // The dry run's rank of a stage is its first.
  CHECK(RankPosition::stage(c, 1).rank == rank_at(dense, RankCoord{0, 0, 0, 0, 1}));
  CHECK(RankPosition::stage(c, 1).pp_rank == 1);

  // Without an own expert grid the experts share the dense TP and their DP group is the replicas.
  const Config same = parse(moe_gpt() + words("--sequence-parallel --tensor-model-parallel-size 2"), 4);
  for (int rank = 0; rank < 4; ++rank) {
    const RankPosition r = RankPosition::of(same, rank);
    CHECK((r.etp_size == 2 && r.etp_rank == r.tp_rank && r.ep_size == 1 && r.ep_rank == 0));
    CHECK((r.edp_size == 2 && r.edp_rank == r.dp_rank));
  }
  // A split for another layout (conversions): the Config's expert sizes, this TP rank.
  const RankPosition s = RankPosition::split(c, 2, 1);
  CHECK((s.tp_size == 2 && s.tp_rank == 1 && s.pp_size == 1 && s.ep_size == 4 && s.ep_rank == 0 && s.etp_size == 1));
}
