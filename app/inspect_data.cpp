#include "app/inspect_data.h"

#include <fmt/format.h>

#include <cstdlib>
#include <iostream>
#include <optional>

#include "app/cli.h"
#include "core/environment.h"
#include "core/error.h"
#include "core/log.h"
#include "data/dataset_builder.h"
#include "data/inspect.h"

namespace mt {

namespace {

struct InspectFlags {
  int64_t num_samples = -1;
  Split split = Split::train;
  std::vector<std::string> rest;  // the training flags
};

bool has_flag(const std::vector<std::string>& args, const std::string& name) {
  for (const auto& a : args) {
    if (a == name || a.rfind(name + "=", 0) == 0) return true;
  }
  return false;
}

InspectFlags take_own_flags(const std::vector<std::string>& args) {
  InspectFlags f;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    auto value_of = [&](const std::string& name) -> std::optional<std::string> {
      if (a == name) {
        if (i + 1 >= args.size()) fail("inspect-data: {} needs a value", name);
        return args[++i];
      }
      if (a.rfind(name + "=", 0) == 0) return a.substr(name.size() + 1);
      return std::nullopt;
    };
    if (auto v = value_of("--num-samples")) {
      char* end = nullptr;
      f.num_samples = std::strtoll(v->c_str(), &end, 10);
      if (v->empty() || *end != '\0' || f.num_samples < 0) {
        fail("inspect-data: --num-samples '{}' must be a non-negative integer", *v);
      }
    } else if (auto s = value_of("--split-name")) {
      if (*s == "train") f.split = Split::train;
      else if (*s == "valid") f.split = Split::valid;
      else if (*s == "test") f.split = Split::test;
      else fail("inspect-data: --split-name '{}' must be train, valid or test", *s);
    } else {
      f.rest.push_back(a);
    }
  }
  if (f.num_samples < 0) fail("inspect-data needs --num-samples N (how many samples to print)");
  return f;
}

// Model flags do not shape the data; placeholders stand in for the required ones the user left out
// so that a data-only command line parses (likewise --lr, and the device: inspecting needs no GPU).
void add_placeholder_model_flags(std::vector<std::string>& args) {
  auto ensure = [&](const char* name, const std::string& value) {
    if (!has_flag(args, name)) {
      args.push_back(name);
      args.push_back(value);
    }
  };
  ensure("--num-layers", "1");
  ensure("--hidden-size", "64");
  ensure("--num-attention-heads", "1");
  ensure("--micro-batch-size", "1");
  ensure("--device", "cpu");
  ensure("--lr", "1e-4");
  std::string seq = "1024";
  for (size_t i = 0; i + 1 < args.size(); ++i) {
    if (args[i] == "--seq-length") seq = args[i + 1];
  }
  ensure("--max-position-embeddings", seq);
}

}  // namespace

int inspect_data_main(const std::vector<std::string>& args) {
  log::set_info_to_stderr(true);  // stdout carries the windows; index-building progress goes beside the statistics
  InspectFlags flags = take_own_flags(args);
  add_placeholder_model_flags(flags.rest);
  std::vector<SetupMessage> messages;
  const Config cfg = parse_config(flags.rest, current_environment(), &messages);
  for (const SetupMessage& m : messages) std::cerr << m.text << "\n";

  const DatasetsConfig data = datasets_config(cfg, tokenizer_facts(cfg));
  const std::array<int64_t, 3> requested = samples_per_split(cfg);
  const BuiltDatasets built = build_datasets(data, {requested[0], requested[1], requested[2]});
  write_dataset_statistics(built, requested, std::cerr);

  const int which = static_cast<int>(flags.split);
  if (!built.splits[which]) {
    fail("inspect-data: the {} split is not built (--split gives it no share, or no --{}-data-path)",
         split_name(flags.split), split_name(flags.split));
  }
  const SampleDataset& ds = *built.splits[which];
  int64_t n = flags.num_samples;
  if (n > ds.size()) {
    std::cerr << fmt::format("inspect-data: the {} split holds {} samples; printing all of them\n",
                             split_name(flags.split), ds.size());
    n = ds.size();
  }
  write_sample_windows(ds, n, std::cout, cfg.data.num_workers);
  std::cout.flush();
  return 0;
}

}  // namespace mt
