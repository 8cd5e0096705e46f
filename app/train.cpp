// Temporary: the engine helper's app/train.cpp replaces this file.
#include "app/train.h"

#include "core/error.h"

namespace mt {

int run_training(const Config&) { throw Unsupported("training is not implemented yet in this build"); }

}  // namespace mt
