#!/usr/bin/env bash
# Installs what megatrain builds and tests with: Debian packages (apt-get) and, for the tests'
# oracles only, a few PyPI packages in .venv/. Idempotent: installs only what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(build-essential cmake pkg-config libcli11-dev libfmt-dev nlohmann-json3-dev catch2
          libopenmpi-dev openmpi-bin libsentencepiece-dev sentencepiece zlib1g-dev python3-venv perl-doc)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing Debian packages: ${missing[*]}"
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# Test oracles (never needed by megatrain itself).
if [ "${MEGATRAIN_SKIP_PYTHON:-0}" != "1" ]; then
  if [ ! -x .venv/bin/python ]; then python3 -m venv .venv; fi
  if ! .venv/bin/python -c "import tokenizers, sentencepiece, numpy, safetensors, tensorboard, ml_dtypes" 2>/dev/null; then
    .venv/bin/python -m pip install --quiet --disable-pip-version-check \
      tokenizers sentencepiece numpy safetensors tensorboard ml_dtypes
  fi
fi
