#pragma once
namespace mt {
const char* version_string();
}
