#!/usr/bin/env bash
# Trains a small GPT with megatrain (the README's first command ends here).
set -euo pipefail
cd "$(dirname "$0")/.."
exec build/app/megatrain --version
