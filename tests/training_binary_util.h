// What the tests that train through the megatrain binary on the CPU share: tiny GPT and Llama
// command lines, running the binary, and reading its --metrics-jsonl records.
#pragma once

#include <catch2/catch.hpp>

#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ckpt_test_util.h"

namespace mt_test::training_binary {

using nlohmann::json;

inline const std::string kCommon =
    "--device cpu --mock-data --tokenizer-type NullTokenizer --vocab-size 64 --seq-length 16 "
    "--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 4 --lr 1e-2 --min-lr 1e-3 "
    "--lr-decay-style cosine --hidden-dropout 0.1 --attention-dropout 0.1 --seed 7 "
    "--log-interval 1";
inline const std::string kGpt = kCommon + " --num-layers 2 --hidden-size 32 --num-attention-heads 4";
inline const std::string kLlama = kCommon +
                                  " --num-layers 2 --hidden-size 32 --num-attention-heads 4 --normalization RMSNorm --swiglu "
                                  "--ffn-hidden-size 48 --position-embedding-type rope --group-query-attention "
                                  "--num-query-groups 2 --untie-embeddings-and-output-weights --disable-bias-linear";

struct Result {
  int code = -1;
  std::string out;
};

inline Result megatrain(const std::string& args) {
  Result r;
  r.code = run_command(std::string(MEGATRAIN_BINARY) + " " + args, &r.out);
  return r;
}

// The run must succeed; its output is shown when it does not.
inline void require_ok(const Result& r) {
  INFO(r.out);
  REQUIRE(r.code == 0);
}

struct Metrics {
  std::map<int64_t, json> iterations;  // iteration -> record
  std::vector<json> evaluations;
};

inline Metrics read_metrics(const std::string& path) {
  Metrics m;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    const json j = json::parse(line);
    if (j.at("type") == "iteration") m.iterations[j.at("iteration").get<int64_t>()] = j;
    else m.evaluations.push_back(j);
  }
  return m;
}

inline std::string tracker(const std::string& save) { return read_bytes(save + "/latest_checkpointed_iteration.txt"); }

}  // namespace mt_test::training_binary
