// The CUDA backend's count of the device memory it allocated (Backend::bytes_allocated): what the
// trainer checks to hold every step to "nothing allocated inside the step", and what the memory
// log line reports as allocated.
#include <catch2/catch.hpp>

#include "cuda/cuda_backend.h"

using namespace mt;

TEST_CASE("cuda bytes_allocated counts blocks, workspaces, FP8 set-up and frees", "[gpu][memory]") {
  CudaBackend be(0);
  const size_t base = be.bytes_allocated();
  // The scratch and the GEMM runner's workspace, made at construction.
  CHECK(base >= CudaBackend::kDefaultScratchBytes + CudaBackend::kGemmWorkspaceBytes);
  const size_t block = (size_t{1} << 20) + 12345;
  void* p = be.allocate(block);
  REQUIRE(p != nullptr);
  CHECK(be.bytes_allocated() == base + block);
  // FP8 GEMMs' workspace and scale slots: at set-up, once.
  be.prepare_fp8_gemms();
  const size_t with_fp8 = be.bytes_allocated();
  CHECK(with_fp8 == base + block + CudaBackend::kGemmWorkspaceBytes + 8 * sizeof(float));
  be.prepare_fp8_gemms();
  CHECK(be.bytes_allocated() == with_fp8);
  be.deallocate(p);
  CHECK(be.bytes_allocated() == with_fp8 - block);
  be.deallocate(nullptr);
  CHECK(be.bytes_allocated() == with_fp8 - block);
}
