// A small YAML reader for the configuration files Megatron-LM's launch scripts hand over (the
// distillation config of --export-kd-cfg, a teacher's model_config.yaml): block mappings and
// sequences (also "- - a" nested), flow sequences and mappings ([a, b], {k: v}), plain, single- and
// double-quoted scalars, comments. Scalars become JSON values as YAML 1.2's core schema reads them
// (true/false, null/~, integers, floats, else strings). Not anchors, tags, multi-line scalars or
// several documents: those are refused naming the file and line.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace mt {

// `where` names the text in errors (a path).
nlohmann::json parse_yaml(const std::string& text, const std::string& where);
nlohmann::json read_yaml_file(const std::string& path);

}  // namespace mt
