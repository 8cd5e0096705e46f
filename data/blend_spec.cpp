#include "data/blend_spec.h"

#include "data/dataset_builder.h"

namespace mt {

BlendSpec blend_from_list(const std::vector<std::string>& list, const std::string& flag) {
  BlendSpec b;
  if (auto blend = parse_blend(list, flag.c_str())) {
    b.prefixes = std::move(blend->prefixes);
    if (blend->weights) b.weights = std::move(*blend->weights);
  }
  return b;
}

}  // namespace mt
