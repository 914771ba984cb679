"""`tools/gpu_check.sh` end to end on the CPU in its dry mode (every timed row
lowered for cuda against an abstract H200 at its real shapes), and the timed
path of `tools/gpu_check.py` at tiny shapes (interpret mode)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

_ROOT = pathlib.Path(__file__).resolve().parents[2]


def _env(**kw):
  return dict(os.environ, PYTHONPATH=str(_ROOT), JAX_PLATFORMS="cpu", **kw)


def test_gpu_check_dry_mode_runs_end_to_end(tmp_path):
  proc = subprocess.run(
      ["bash", str(_ROOT / "tools" / "gpu_check.sh")], cwd=_ROOT,
      env=_env(DRY="1", OUT=str(tmp_path), PY=sys.executable),
      capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  table = (tmp_path / "table.md").read_text()
  assert "FAILED" not in table and "WRONG" not in table, table
  for kernel, impl in [("copy", "xla"), ("decode", "pallas"), ("decode", "xla"),
                       ("decode", "mosaic"),
                       ("decode", "jax-builtin"), ("decode", "dense-xla"),
                       ("permute", "xla"), ("permute", "mosaic"),
                       ("permute", "pallas"), ("permute", "plain-copy")]:
    assert f"| {kernel} | {impl} |" in table, table
  assert table.count("lowered (cuda, abstract H200)") >= 2 * 20
  assert table.rstrip().splitlines()[-1].startswith("0 rows failed")


def test_gpu_check_timed_path_small(tmp_path):
  out = tmp_path / "t.md"
  proc = subprocess.run(
      [sys.executable, str(_ROOT / "tools" / "gpu_check.py"), "--small",
       "--iters=1", "--repeats=1", "--only=permute", f"--out={out}"],
      cwd=_ROOT, env=_env(PYTHONUNBUFFERED="1"), capture_output=True, text=True,
      timeout=300)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  table = out.read_text()
  for impl in ("xla", "mosaic", "pallas", "plain-copy"):
    assert f"| permute | {impl} |" in table and "| ok |" in table, table
