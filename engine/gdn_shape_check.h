// The Gated DeltaNet ops' shape check, shared by both backends (engine/backend.h GdnShape).
#pragma once

#include "engine/backend.h"

namespace mt {

// Fails naming `op` unless every size is positive and the value heads a multiple of the key heads.
void check_gdn_shape(const GdnShape& s, const char* op);

}  // namespace mt
