// Catch2 main for the GPU tests. Without a visible CUDA device it prints why and exits 77, which
// CTest reports as "skipped" (never as passed). Listing the tests needs no GPU.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>

namespace {
bool only_lists(int argc, char** argv) {
  for (int i = 1; i < argc; ++i)
    if (std::strncmp(argv[i], "--list", 6) == 0 || std::strcmp(argv[i], "-l") == 0 || std::strcmp(argv[i], "-t") == 0 ||
        std::strcmp(argv[i], "-h") == 0 || std::strcmp(argv[i], "--help") == 0)
      return true;
  return false;
}
}  // namespace

int main(int argc, char** argv) {
  if (!only_lists(argc, argv)) {
    int count = 0;
    const cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess || count == 0) {
      std::printf("SKIPPED: no CUDA GPU visible (GPU tests run on a GPU machine)%s%s\n",
                  err != cudaSuccess ? ": " : "", err != cudaSuccess ? cudaGetErrorString(err) : "");
      return 77;
    }
  }
  return Catch::Session().run(argc, argv);
}
