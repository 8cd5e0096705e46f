#!/usr/bin/env bash
# Sets everything up and runs the main job: installs dependencies, builds megatrain and trains a
# small GPT. On a machine without a GPU it trains on the CPU reference backend instead.
set -euo pipefail
cd "$(dirname "$0")"
MEGATRAIN_SKIP_PYTHON=1 scripts/install-deps.sh
scripts/build.sh
exec launch/train_small.sh
