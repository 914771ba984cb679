#!/usr/bin/env bash
# Runs the kernel tests (interpret mode and the lowering tier) under JAX 0.11.2,
# the GPU machine's version, in a venv of its own (made once, reused):
#   tools/test_jax0112.sh [pytest args]      # default: tests/kernels
# VENV (default /tmp/jax0112) and PYTHON (default python3.12) may be overridden.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-/tmp/jax0112}"
if [ ! -x "$VENV/bin/python" ]; then
  "${PYTHON:-python3.12}" -m venv "$VENV"
  "$VENV/bin/pip" install -q jax==0.11.2 jaxlib==0.11.2 numpy chex pytest absl-py \
    hypothesis
fi
"$VENV/bin/python" -c 'import jax; assert jax.__version__ == "0.11.2", jax.__version__'
PYTHONPATH="$PWD" exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
  "${@:-tests/kernels}"
