// Kernel choices that benchmark programs (bench/) compare inside one binary. Nothing in the
// megatrain binary sets them: it runs the kernels measured fastest (bench/RESULTS.md), and no
// environment variable reaches them.
#pragma once

namespace mt::cuda::bench_choice {

// Every norm (forward and backward) takes the general kernel instead of the 16-bit fast path.
inline bool norm_general = false;

// The FP8 cast-transpose kernel: by reader (the default), or one kernel for every reader. The
// bytes and the amax are the same either way; a bias gradient's column sums run in another
// (fixed) order.
enum class Fp8CastKernel { by_reader, tiles, blocks };
inline Fp8CastKernel fp8_cast_kernel = Fp8CastKernel::by_reader;

// The MoE grouped GEMMs (cuda/grouped_gemm.h): as measured (automatic), always our grouped MMA
// kernels where they take the op (mma: the best body, cuda/grouped_gemm_mma.h's
// GroupedKernel::best; mma_cp_async: the cp.async-fed wgmma body for every op; mma_sync), or
// always cuBLAS.
enum class GroupedGemmPath { automatic, mma, mma_cp_async, mma_sync, cublas };
inline GroupedGemmPath grouped_gemm_path = GroupedGemmPath::automatic;

// The TMA grouped GEMM kernel's epilogue (cuda/grouped_gemm_tma.cu): through shared memory and TMA
// stores where C allows (the default), or every fragment by the register stores.
inline bool grouped_register_epilogue = false;

// AdamW's kernel (cuda/optimizer_kernels.cu): 0, the one megatrain runs, four groups of four
// elements per thread at a time (sixteen 16-byte loads in flight, two blocks per SM) with streaming
// cache hints (ld.global.cs); 1 one group at a time, four blocks per SM (the kernel before); 2 four
// groups without the hints; 3 eight groups with them, one block per SM. The same arithmetic in each
// (adam_one's explicit roundings): the same bits.
inline int adamw_variant = 0;

}  // namespace mt::cuda::bench_choice
