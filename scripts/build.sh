#!/usr/bin/env bash
# Configures and builds megatrain into build/ (CUDA backend too where nvcc is available).
set -euo pipefail
cd "$(dirname "$0")/.."
cuda_args=()
if [ -x /usr/local/cuda/bin/nvcc ]; then
  cuda_args+=(-DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc)
fi
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release "${cuda_args[@]}" "$@" > build.log 2>&1 || { cat build.log; exit 1; }
cmake --build build -j"$(nproc)" 2>&1 | tee -a build.log | grep -E "error|warning|Error" || true
test "${PIPESTATUS[0]}" -eq 0
