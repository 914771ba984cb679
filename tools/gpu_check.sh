#!/usr/bin/env bash
# The prepared GPU check for one 15-minute lease of an H100/H200 (tools/gpu_check.py).
# From the repository root (or anywhere: it cds there):
#   tools/gpu_check.sh                      # on the GPU machine: every row, ~8 min
#   tools/gpu_check.sh --skip=serving/      # the kernel rows only, ~2 min
#   tools/gpu_check.sh --dry                # anywhere, CPU, tiny shapes (also GPU_CHECK_DRY=1)
#   tools/gpu_check.sh --plan               # the rows, their limits and estimates
#   tools/gpu_check.sh --only=layer/b64x8k  # a subset (ids contain / glob-match)
# Writes gpu_check.md, gpu_check.json and gpu_check_worker.log to $OUT (the device
# tool's output folder) or out/gpu_check. Nothing is lowered or compiled for the CPU
# here: the lowering and compile tiers run in CI. Each row runs in a worker process
# under its own wall limit (a hang costs that row only); no row starts past the
# budget (--budget_s, default 540 s; the whole command ends within it).
# Exit status: 0 no row failed, 1 a row failed (timeout, crash, exception, wrong
# numbers), 2 nothing could run (no GPU without --dry, the worker cannot start).
set -uo pipefail
cd "$(dirname "$0")/.."
# The repository's .venv if there is one (a dev machine), else python3 (the lent GPU
# machine: JAX, flax and chex preinstalled; absl-py comes with chex).
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$PY" tools/gpu_check.py "$@"
