"""Runs the benchmark scripts in small CPU smoke modes.

`bench_kernels.py` with `--interpret --small`; `bench_requests.py` on a tiny chat
workload (its per-request device traffic is asserted from the printed tables).
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

# The example scripts' smoke runs (subprocesses).
pytestmark = pytest.mark.slow

_ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_bench_kernels_smoke(tmp_path):
  out = tmp_path / "table.md"
  env = dict(os.environ, PYTHONPATH=str(_ROOT), JAX_PLATFORMS="cpu")
  proc = subprocess.run(
      [sys.executable, str(_ROOT / "benchmarks" / "bench_kernels.py"),
       "--interpret", "--small", "--runs=1", f"--out={out}"],
      cwd=_ROOT, env=env, capture_output=True, text=True, timeout=240)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
  table = out.read_text()
  for kernel, impl in [("decode", "pallas"), ("decode", "xla"), ("decode", "dense"),
                       ("permute32", "xla"), ("permute32", "pallas"),
                       ("permute32", "mosaic")]:
    assert f"| {kernel} | {impl} |" in table, table
  assert proc.stdout.rstrip().endswith(table.rstrip().splitlines()[-1])


def _table_rows(out: str, title: str) -> list[str]:
  """The lines of the table under the line starting with `title` (to the blank line)."""
  lines = out.splitlines()
  start = next(i for i, line in enumerate(lines) if line.startswith(title))
  rows = []
  for line in lines[start + 1:]:
    if not line.strip():
      break
    rows.append(line)
  return rows


def test_bench_requests_smoke(tmp_path):
  """bench_requests on a tiny chat workload: ours makes at most one dispatch and no
  blocking read per warm request, compiles nothing when warm, and every table prints."""
  env = dict(os.environ, PYTHONPATH=str(_ROOT), JAX_PLATFORMS="cpu",
             PAGED_KV_COMPILE_CACHE=str(tmp_path / "jax_cache"))
  env.pop("PAGED_KV_DEBUG", None)  # the production path's counts (debug mode syncs)
  proc = subprocess.run(
      [sys.executable, str(_ROOT / "benchmarks" / "bench_requests.py"), "--workloads=chat",
       "--chat_conversations=3", "--chat_turns=3", "--repeats=2",
       "--interleave_requests=4", "--novariants"],
      cwd=_ROOT, env=env, capture_output=True, text=True, timeout=240)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  out = proc.stdout

  rows = _table_rows(out, "workload ")  # the per-request table's header
  ours = [r for r in rows if "ours (CachedPool)" in r]
  host = [r for r in rows if "host (numpy)" in r]
  assert len(ours) == 1 and len(host) == 1, out
  # ... request p50/p99, ratio, paired, disp/req (mean/max), reads/req (mean/max).
  cells = re.search(r"(?P<ratio>[\d.]+) +(?P<paired>[\d.]+) +(?P<disp>[\d.]+)/(?P<disp_max>\d+)"
                    r" +(?P<reads>[\d.]+)/(?P<reads_max>\d+)$", ours[0])
  assert cells, ours[0]
  assert float(cells["ratio"]) > 0 and float(cells["paired"]) > 0, ours[0]
  assert float(cells["disp"]) <= 1 and int(cells["disp_max"]) <= 1, ours[0]
  assert float(cells["reads"]) == 0 and int(cells["reads_max"]) == 0, ours[0]
  assert host[0].split()[-2:] == ["-", "-"], host[0]

  runs = _table_rows(out, "Ours / host per run")
  assert [r.split()[-1] for r in runs if r.startswith("workload")] == ["compiles"], out
  (per_run,) = [r for r in runs if r.startswith("chat")]
  assert per_run.split()[-1] == "0", per_run  # nothing compiled in the timed runs
  assert "commit 1.00" in per_run and per_run.split()[-2] == "none", per_run
  assert " 0.0% " in per_run, per_run  # no request made more than one dispatch

  assert re.search(r"chat 20k +ours \(CachedPool\) +0\.\d{4}$", out, re.M), out
  compile_rows = _table_rows(out, "Compile time of the serving path")
  assert [r.split()[0] for r in compile_rows[1:]] == ["no", "persistent", "persistent"], out
  assert out.rstrip().splitlines()[-1].startswith("persistent cache, filled"), out
