"""Runs examples/bench_kernels.py in its CPU smoke mode (--interpret --small)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

_ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_bench_kernels_smoke(tmp_path):
  out = tmp_path / "table.md"
  env = dict(os.environ, PYTHONPATH=str(_ROOT), JAX_PLATFORMS="cpu")
  proc = subprocess.run(
      [sys.executable, str(_ROOT / "examples" / "bench_kernels.py"),
       "--interpret", "--small", "--runs=1", f"--out={out}"],
      cwd=_ROOT, env=env, capture_output=True, text=True, timeout=240)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
  table = out.read_text()
  for kernel, impl in [("decode", "pallas"), ("decode", "xla"), ("decode", "dense"),
                       ("permute32", "xla"), ("permute32", "pallas"),
                       ("permute32", "mosaic")]:
    assert f"| {kernel} | {impl} |" in table, table
  assert proc.stdout.rstrip().endswith(table.rstrip().splitlines()[-1])
