#!/usr/bin/env bash
# Creates .venv-cuda in the repo root for the compile tier (tests_compile/, `make
# compile-tier`): a Python >= 3.12 (tools/find_python.sh), the pinned packages of
# tools/compile_tier/requirements.txt and this project editable with its `model`
# extra. No GPU and no driver are needed. Reruns only when requirements.txt,
# this script or pyproject.toml changed since the last successful install
# (.venv-cuda/.installed). Any failure (e.g. PyPI unreachable) exits non-zero:
# the tier never skips silently.
# Measured on the 2-core CI machine: see tools/compile_tier/README.md.
set -euo pipefail
SELF="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$SELF")/../.."
VENV=.venv-cuda
REQ=tools/compile_tier/requirements.txt
STAMP="$VENV/.installed"
if [ -f "$STAMP" ] && [ "$STAMP" -nt "$REQ" ] && [ "$STAMP" -nt pyproject.toml ] \
    && [ "$STAMP" -nt "$SELF" ]; then
  exit 0
fi
start=$(date +%s)
if [ ! -x "$VENV/bin/python" ]; then
  PYBIN=$(tools/find_python.sh)
  "$PYBIN" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -r "$REQ" -e '.[model]'
# Fail here, loudly, if the plugin cannot describe an H200 (a broken install).
JAX_PLATFORMS=cpu "$VENV/bin/python" -c '
from tests_compile import compile_tier as ct
d = ct.topology_device(ct.H200)
print(f"compile tier: {d.device_kind} ({d.platform}) via the CUDA plugin")'
touch "$STAMP"
echo "compile tier: $VENV installed in $(( $(date +%s) - start )) s," \
  "$(du -sm "$VENV" | cut -f1) MB"
