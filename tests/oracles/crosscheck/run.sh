#!/usr/bin/env bash
# Manual cross-check (not part of CI): runs Megatron-LM's own dataset code on the same specs as
# tests/oracles/megatron_gpt_indices.py and compares every window. Needs a Megatron-LM checkout
# (nothing of it is copied into this repository: the files are read from MEGATRON into a temp dir),
# a C++ compiler, Python headers, and pip (pybind11 goes into the temp dir).
#   tests/oracles/crosscheck/run.sh /path/to/Megatron-LM [python]
set -euo pipefail
MEGATRON=${1:?usage: run.sh MEGATRON_DIR [python]}
PY=${2:-$(dirname "$0")/../../../.venv/bin/python}
HERE=$(cd "$(dirname "$0")" && pwd)
export WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
"$PY" -m pip install --quiet --disable-pip-version-check --target "$WORK/pylib" pybind11
D=$WORK/pkg/megatron/core/datasets
mkdir -p "$D" "$WORK/pkg/megatron/core/tokenizers" "$WORK/pkg/torch/utils"
for f in gpt_dataset blended_dataset blended_megatron_dataset_builder blended_megatron_dataset_config \
         megatron_dataset indexed_dataset utils object_storage_utils helpers; do
  cp "$MEGATRON/megatron/core/datasets/$f.py" "$D/"
done
touch "$WORK/pkg/megatron/__init__.py" "$WORK/pkg/megatron/core/__init__.py" "$D/__init__.py"
INC=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
EXT=$("$PY" -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
# Megatron's Makefile flags (asserts stay on).
g++ -O3 -Wall -shared -std=c++17 -fPIC -I "$WORK/pylib/pybind11/include" -I "$INC" \
    "$MEGATRON/megatron/core/datasets/helpers.cpp" -o "$D/helpers_cpp$EXT"
# Stand-ins for what the index code imports but does not use here.
printf 'from . import utils, distributed\nclass Tensor: pass\n' > "$WORK/pkg/torch/__init__.py"
printf 'from . import data\n' > "$WORK/pkg/torch/utils/__init__.py"
printf 'class Dataset: pass\n' > "$WORK/pkg/torch/utils/data.py"
printf 'def is_initialized(): return False\n' > "$WORK/pkg/torch/distributed.py"
printf 'def log_single_rank(logger, *args, rank=0, **kwargs): pass\n' > "$WORK/pkg/megatron/core/utils.py"
printf 'import numpy\ndef safe_numpy_load(*a, **k): return numpy.load(*a, **k)\n' > "$WORK/pkg/megatron/core/safe_globals.py"
printf 'class MegatronTokenizerBase: pass\n' > "$WORK/pkg/megatron/core/tokenizers/__init__.py"
cat > "$WORK/pkg/megatron/core/msc_utils.py" <<'PYEOF'
import builtins
class MultiStorageClientFeature:
    @staticmethod
    def is_enabled(): return False
class _Msc:
    open = staticmethod(builtins.open)
maybe_msc = _Msc()
PYEOF
"$PY" "$HERE/compare.py"
