#include "app/data_args_files.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace mt::cli {

namespace {

std::string read_file(const std::string& path, const char* flag) {
  std::ifstream f(path, std::ios::binary);
  if (!f) fail("{} '{}': cannot open it ({})", flag, path, std::strerror(errno));
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

// Python's str.split(): runs of whitespace separate words.
std::vector<std::string> words(const std::string& text) {
  std::istringstream in(text);
  std::vector<std::string> out;
  for (std::string w; in >> w;) out.push_back(w);
  return out;
}

}  // namespace

std::vector<std::string> read_data_args_file(const std::string& path) {
  return words(read_file(path, "--data-args-path"));
}

PerSplitBlendLists read_per_split_data_args_file(const std::string& path) {
  constexpr const char* kFlag = "--per-split-data-args-path";
  const nlohmann::json j = nlohmann::json::parse(read_file(path, kFlag), nullptr, false);
  if (j.is_discarded()) fail("{} '{}': not valid JSON", kFlag, path);
  if (!j.is_object())
    fail("{} '{}': expected a JSON object with the keys \"train\", \"valid\" and \"test\", found {}", kFlag, path,
         j.type_name());
  PerSplitBlendLists out;
  const char* keys[3] = {"train", "valid", "test"};
  for (int s = 0; s < 3; ++s) {
    const auto it = j.find(keys[s]);
    if (it == j.end())
      fail("{} '{}' has no \"{}\" key (Megatron reads all three; give null for a split without data)", kFlag, path,
           keys[s]);
    const nlohmann::json& v = *it;
    if (v.is_null()) continue;
    if (v.is_string()) {
      out[static_cast<size_t>(s)] = words(v.get<std::string>());
      continue;
    }
    if (!v.is_array())
      fail("{} '{}': \"{}\" is {}; expected a string of weights and prefixes, a list of them, or null", kFlag, path,
           keys[s], v.type_name());
    std::vector<std::string> list;
    for (const nlohmann::json& e : v) {
      // A list's words are taken as they are (not split), as Megatron does; a weight may be a number.
      if (e.is_string()) list.push_back(e.get<std::string>());
      else if (e.is_number()) list.push_back(e.dump());
      else fail("{} '{}': \"{}\" holds {}; its elements must be weights and prefixes", kFlag, path, keys[s], e.type_name());
    }
    out[static_cast<size_t>(s)] = std::move(list);
  }
  return out;
}

}  // namespace mt::cli
