#include "app/version.h"

namespace mt {
const char* version_string() { return MEGATRAIN_VERSION; }
}  // namespace mt
