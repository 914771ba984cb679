"""`benchmarks/bench_dispatch.py` runs end to end with tiny settings (so it does not rot):
both paths' outputs equal, and the bound path hashes no graph per call."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

# The example scripts' smoke runs (subprocesses).
pytestmark = pytest.mark.slow

_ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_bench_dispatch_smoke(tmp_path):
  env = dict(os.environ, PYTHONPATH=str(_ROOT), JAX_PLATFORMS="cpu")
  record = tmp_path / "dispatch.json"
  proc = subprocess.run(
      [sys.executable, str(_ROOT / "benchmarks" / "bench_dispatch.py"), "--layers=1,2",
       "--batch=2", "--calls=2", "--repeats=1", f"--record={record}"],
      cwd=_ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-4000:]
  rows = [line.split() for line in proc.stdout.splitlines()
          if line.split()[:1] in (["1"], ["2"])]
  assert len(rows) == 2, proc.stdout
  for row in rows:
    assert row[2:5] == ["1", "->", "0"], row  # graph hashes per call: before -> after
  assert record.exists()
