#!/usr/bin/env bash
# Runs megatrain's whole test suite: installs dependencies, builds, runs CTest.
# GPU tests (label gpu) report "skipped" on a machine without a GPU.
set -euo pipefail
cd "$(dirname "$0")"
scripts/install-deps.sh
scripts/build.sh
ctest --test-dir build --output-on-failure -j"$(nproc)" --timeout 900
