// Rank grid (Megatron's RankGenerator order and groups) and pipeline layer placement.
#include <catch2/catch.hpp>

#include <algorithm>
#include <set>

#include "core/error.h"
#include "parallel/pipeline_layout.h"
#include "parallel/rank_grid.h"

using namespace mt;
using Catch::Contains;

TEST_CASE("rank grid: Megatron's 8-GPU TP2 DP2 PP2 example", "[parallel][grid]") {
  RankGrid g;
  g.tp = 2;
  g.dp = 2;
  g.pp = 2;
  using G = std::vector<std::vector<int>>;
  CHECK(rank_groups(g, "tp") == G{{0, 1}, {2, 3}, {4, 5}, {6, 7}});
  CHECK(rank_groups(g, "dp") == G{{0, 2}, {1, 3}, {4, 6}, {5, 7}});
  CHECK(rank_groups(g, "pp") == G{{0, 4}, {1, 5}, {2, 6}, {3, 7}});
  CHECK(embedding_groups(g) == G{{0, 4}, {1, 5}, {2, 6}, {3, 7}});
  CHECK(rank_groups(g, "tp-pp") == G{{0, 1, 4, 5}, {2, 3, 6, 7}});
  CHECK(rank_group_of(g, "dp", 5) == std::vector<int>{5, 7});
  const RankCoord c = rank_coord(g, 6);
  CHECK(c.tp == 0);
  CHECK(c.dp == 1);
  CHECK(c.pp == 1);
}

TEST_CASE("rank grid: --num-distributed-optimizer-instances splits each DP group into consecutive instances", "[parallel][grid]") {
  RankGrid g;
  g.tp = 2;
  g.dp = 8;
  using G = std::vector<std::vector<int>>;
  // DP groups {0, 2, ..., 14} and {1, 3, ..., 15}; 4 instances of 2 consecutive DP ranks
  CHECK(distributed_optimizer_instance_groups(g, 4, false) ==
        G{{0, 2}, {4, 6}, {8, 10}, {12, 14}, {1, 3}, {5, 7}, {9, 11}, {13, 15}});
  CHECK(distributed_optimizer_instance_groups(g, 4, true) == G{{0, 4, 8, 12}, {2, 6, 10, 14}, {1, 5, 9, 13}, {3, 7, 11, 15}});
  // 2 instances of 4 (Megatron's create_hierarchical_groups with sizes [4, 2])
  CHECK(distributed_optimizer_instance_groups(g, 2, false) == G{{0, 2, 4, 6}, {8, 10, 12, 14}, {1, 3, 5, 7}, {9, 11, 13, 15}});
  CHECK(distributed_optimizer_instance_groups(g, 2, true) ==
        G{{0, 8}, {2, 10}, {4, 12}, {6, 14}, {1, 9}, {3, 11}, {5, 13}, {7, 15}});
  // one instance: the DP groups themselves
  CHECK(distributed_optimizer_instance_groups(g, 1, false) == rank_groups(g, "dp"));
}

TEST_CASE("rank grid: --use-tp-pp-dp-mapping puts PP before DP", "[parallel][grid]") {
  RankGrid g;
  g.tp = 2;
  g.dp = 2;
  g.pp = 2;
  g.tp_pp_dp_order = true;
  CHECK(g.order_string() == "tp-cp-ep-pp-dp");
  using G = std::vector<std::vector<int>>;
  CHECK(rank_groups(g, "pp") == G{{0, 2}, {1, 3}, {4, 6}, {5, 7}});
  CHECK(rank_groups(g, "dp") == G{{0, 4}, {1, 5}, {2, 6}, {3, 7}});
  CHECK(embedding_groups(g) == G{{0, 2}, {1, 3}, {4, 6}, {5, 7}});
}

TEST_CASE("rank grid: coordinates round-trip and groups partition the world", "[parallel][grid]") {
  for (bool order : {false, true}) {
    RankGrid g;
    g.tp = 4;
    g.cp = 2;
    g.dp = 3;
    g.pp = 2;
    g.tp_pp_dp_order = order;
    for (int r = 0; r < g.world_size(); ++r) CHECK(rank_at(g, rank_coord(g, r)) == r);
    // Default order: rank = tp + TP*(cp + CP*(dp + DP*pp)).
    if (!order) {
      const RankCoord c{3, 1, 0, 2, 1};
      CHECK(rank_at(g, c) == 3 + 4 * (1 + 2 * (2 + 3 * 1)));
    }
    for (const char* axes : {"tp", "cp", "dp", "pp", "tp-pp", "dp-cp", "tp-dp-cp"}) {
      std::set<int> seen;
      for (const auto& grp : rank_groups(g, axes)) {
        for (int r : grp) CHECK(seen.insert(r).second);
        // Members differ only in the named axes.
        const RankCoord a = rank_coord(g, grp.front());
        for (int r : grp) {
          const RankCoord b = rank_coord(g, r);
          const std::string ax = axes;
          if (ax.find("tp") == std::string::npos) CHECK(a.tp == b.tp);
          if (ax.find("cp") == std::string::npos) CHECK(a.cp == b.cp);
          if (ax.find("dp") == std::string::npos) CHECK(a.dp == b.dp);
          if (ax.find("pp") == std::string::npos) CHECK(a.pp == b.pp);
        }
      }
      CHECK(static_cast<int>(seen.size()) == g.world_size());
    }
  }
}

TEST_CASE("rank grid: PP 1 embedding groups are single ranks", "[parallel][grid]") {
  RankGrid g;
  g.tp = 2;
  g.dp = 2;
  CHECK(embedding_groups(g) == std::vector<std::vector<int>>{{0}, {1}, {2}, {3}});
  CHECK(position_embedding_groups(g).size() == 4);
}

TEST_CASE("pipeline layout: even split", "[parallel][pipeline]") {
  PipelineSplit s;
  s.num_layers = 8;
  s.pp = 4;
  const auto chunks = pipeline_chunks(s);
  REQUIRE(chunks.size() == 4);
  for (int p = 0; p < 4; ++p) {
    CHECK(chunks[p].first_layer == 2 * p);
    CHECK(chunks[p].num_layers == 2);
  }
  CHECK(chunks[0].has_embedding);
  CHECK(chunks[3].has_output);
  CHECK(layers_per_stage(s) == std::vector<int>{2, 2, 2, 2});
}

TEST_CASE("pipeline layout: interleaved chunk (v, p) holds layers (vP + p)Lc up to (vP + p + 1)Lc", "[parallel][pipeline]") {
  PipelineSplit s;
  s.num_layers = 16;
  s.pp = 4;
  s.vpp = 2;  // Lc = 2
  for (int p = 0; p < 4; ++p) {
    const auto st = stage_chunks(s, p);
    REQUIRE(st.size() == 2);
    for (int v = 0; v < 2; ++v) {
      CHECK(st[v].vp_stage == v);
      CHECK(st[v].first_layer == (v * 4 + p) * 2);
      CHECK(st[v].num_layers == 2);
    }
  }
  const auto first = stage_chunks(s, 0);
  CHECK(first[0].has_embedding);
  CHECK_FALSE(first[1].has_embedding);
  const auto last = stage_chunks(s, 3);
  CHECK(last[1].has_output);
  CHECK_FALSE(last[0].has_output);
}

TEST_CASE("pipeline layout: embedding and loss counted as layers", "[parallel][pipeline]") {
  PipelineSplit s;
  s.num_layers = 6;
  s.pp = 4;
  s.account_for_embedding = true;
  s.account_for_loss = true;  // 8 slots, 2 per stage
  CHECK(layers_per_stage(s) == std::vector<int>{1, 2, 2, 1});
  const auto chunks = pipeline_chunks(s);
  CHECK(chunks[1].first_layer == 1);
  CHECK(chunks[3].first_layer == 5);
  s.vpp = 2;  // 1 slot per chunk: (v0, p0) holds only the embedding
  s.num_layers = 6;
  const auto ch = pipeline_chunks(s);
  CHECK(ch[0].num_layers == 0);
  CHECK(ch[0].has_embedding);
  CHECK(ch[1].first_layer == 0);
  CHECK(ch.back().num_layers == 0);
  CHECK(ch.back().has_output);
}

TEST_CASE("pipeline layout: uneven first and last stages", "[parallel][pipeline]") {
  PipelineSplit s;
  s.num_layers = 10;
  s.pp = 4;
  s.first_stage_layers = 1;
  s.last_stage_layers = 1;
  CHECK(layers_per_stage(s) == std::vector<int>{1, 4, 4, 1});
  s.vpp = 2;
  s.first_stage_layers = 2;
  s.last_stage_layers = 4;  // middle 4 layers over 2 stages: 2 each, 1 per chunk
  CHECK(layers_per_stage(s) == std::vector<int>{2, 2, 2, 4});
  const auto ch = pipeline_chunks(s);
  // Model order v-major: (0,0) 1 layer, (0,1) 1, (0,2) 1, (0,3) 2, (1,0) 1, ...
  CHECK(ch[3].first_layer == 3);
  CHECK(ch[3].num_layers == 2);
  CHECK(ch[4].pp_rank == 0);
  CHECK(ch[4].vp_stage == 1);
  CHECK(ch[4].first_layer == 5);
  s.last_stage_layers = 3;
  CHECK_THROWS_WITH(pipeline_chunks(s), Contains("--decoder-last-pipeline-num-layers 3 is not divisible by the virtual pipeline size 2"));
}

TEST_CASE("pipeline layout: errors name the flags", "[parallel][pipeline]") {
  PipelineSplit s;
  s.num_layers = 10;
  s.pp = 4;
  CHECK_THROWS_WITH(pipeline_chunks(s), Contains("--num-layers 10 is not divisible by --pipeline-model-parallel-size 4"));
  s.first_stage_layers = 9;
  s.last_stage_layers = 2;
  CHECK_THROWS_WITH(pipeline_chunks(s), Contains("exceed --num-layers 10"));
  s.pp = 2;
  s.first_stage_layers = 4;
  s.last_stage_layers = 4;
  CHECK_THROWS_WITH(pipeline_chunks(s), Contains("leaves no middle stage for the other 2"));
  s.pp = 3;
  s.first_stage_layers = 5;
  s.last_stage_layers = 5;
  CHECK_THROWS_WITH(pipeline_chunks(s), Contains("leave no layers for the 1 middle pipeline stages"));
}

TEST_CASE("pipeline layout: --pipeline-model-parallel-layout strings, as Megatron-LM unrolls them", "[parallel][pipeline]") {
  // Megatron's own example: "Ettt|(tt|)*29,m|L" -> [E t t t], 29 x [t t], [m], [L].
  const std::vector<std::string> ex = parse_pipeline_layout("Ettt|(tt|)*29,m|L");
  REQUIRE(ex.size() == 32);
  CHECK(ex[0] == "Ettt");
  CHECK(ex[1] == "tt");
  CHECK(ex[29] == "tt");
  CHECK(ex[30] == "m");
  CHECK(ex[31] == "L");
  CHECK(parse_pipeline_layout("Et*2|(tt|)*5t|tmL") ==
        std::vector<std::string>{"Ett", "tt", "tt", "tt", "tt", "tt", "t", "tmL"});
  CHECK(parse_pipeline_layout("(|Et)*2,L") == std::vector<std::string>{"", "Et", "EtL"});
  CHECK(parse_pipeline_layout("E||tL") == std::vector<std::string>{"E", "", "tL"});
  CHECK_THROWS_WITH(parse_pipeline_layout("Ex|tL"), Contains("invalid layer character 'x'"));
}

TEST_CASE("pipeline layout: an explicit layout places the layers, with Megatron's checks", "[parallel][pipeline]") {
  PipelineSplit s;
  s.num_layers = 6;
  s.pp = 2;
  s.vpp = 2;
  s.layout = parse_pipeline_layout("Et|tt|t|ttL");
  // Stage v * PP + p is chunk v of rank p: (0,0) E t, (0,1) t t, (1,0) t, (1,1) t t L.
  const auto ch = pipeline_chunks(s);
  REQUIRE(ch.size() == 4);
  CHECK((ch[0].has_embedding && ch[0].num_layers == 1 && ch[0].first_layer == 0));
  CHECK((ch[1].pp_rank == 1 && ch[1].vp_stage == 0 && ch[1].first_layer == 1 && ch[1].num_layers == 2));
  CHECK((ch[2].pp_rank == 0 && ch[2].vp_stage == 1 && ch[2].first_layer == 3 && ch[2].num_layers == 1));
  CHECK((ch[3].has_output && ch[3].first_layer == 4 && ch[3].num_layers == 2));
  CHECK(layers_per_stage(s) == std::vector<int>{2, 4});
  s.layout = parse_pipeline_layout("Et|tt|t|tL");
  CHECK_THROWS_WITH(pipeline_chunks(s), Contains("it holds 5 decoder layers (t), --num-layers is 6"));
  s.layout = parse_pipeline_layout("tE|tt|t|ttL");
  CHECK_THROWS_WITH(pipeline_chunks(s), Contains("the first layer must be the embedding (E)"));
  s.layout = parse_pipeline_layout("Et|tt|t|tLt");
  CHECK_THROWS_WITH(pipeline_chunks(s), Contains("the last layer must be the loss (L)"));
  s.layout = parse_pipeline_layout("Et|tt|t|tmL");
  s.num_layers = 5;
  CHECK_THROWS_WITH(pipeline_chunks(s), Contains("it holds 1 multi-token prediction layers (m), --mtp-num-layers is 0"));
  s.mtp = 1;  // after the last stage's decoder layers: the head's depths
  const std::vector<ModelChunk> with_mtp = pipeline_chunks(s);
  CHECK((with_mtp.back().has_output && with_mtp.back().num_layers == 1));
  s.layout = parse_pipeline_layout("Et|tt|tm|tL");  // a standalone MTP stage
  CHECK_THROWS_WITH(pipeline_chunks(s), Contains("other than after the decoder layers of the stage with the loss"));
  s.layout = parse_pipeline_layout("Et|tt|t|mtL");
  CHECK_THROWS_WITH(pipeline_chunks(s), Contains("other than after the decoder layers of the stage with the loss"));
  s.mtp = 0;
  s.layout = parse_pipeline_layout("Et|tt|ttL");
  CHECK_THROWS_WITH(pipeline_chunks(s), Contains("has 3 stages, not --pipeline-model-parallel-size 2 x 2"));
  s.layout = parse_pipeline_layout("|Ett|tt|tL");
  CHECK_THROWS_WITH(pipeline_chunks(s), Contains("the layout's first stage must start with E"));
}
