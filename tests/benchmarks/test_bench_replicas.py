"""`benchmarks/bench_replicas.py` end to end with tiny settings (so it does not rot).

The trace is written by the test (nothing here reads ../shared); the replicas compile
into the test's temporary directory. The numbers are measured with full settings
(the script's defaults), not here.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from tests.sim.trace_files import session_trace, write_mooncake

# The example scripts' smoke runs (subprocesses).
pytestmark = pytest.mark.slow

_ROOT = pathlib.Path(__file__).resolve().parents[2]
_SCRIPT = _ROOT / "benchmarks" / "bench_replicas.py"


def _start(*args: str, timeout: int) -> subprocess.CompletedProcess:
  env = dict(os.environ, PYTHONPATH=str(_ROOT), JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, str(_SCRIPT), *args], cwd=_ROOT, env=env,
                        capture_output=True, text=True, timeout=timeout)


def test_bench_replicas_smoke(tmp_path):
  trace = write_mooncake(tmp_path / "sessions.jsonl",
                         session_trace(seed=5, num=30, num_sessions=5, partial=True, gap_s=0.2))
  out_json = tmp_path / "out.json"
  proc = _start(f"--trace={trace}", "--num_requests=30", "--offsets=0", "--replicas=2",
                "--capacity_tokens=100000", "--warmup=false", "--max_batch=8",
                "--prefill_chunk=64", f"--compile_cache_dir={tmp_path / 'jax_cache'}",
                f"--json_out={out_json}", timeout=300)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "| 0 | 2 | 30 |" in proc.stdout, proc.stdout
  assert "N=2: routed / global hit rate, median over 1 slices" in proc.stdout, proc.stdout
  record = json.loads(out_json.read_text())
  assert record["flags"]["num_requests"] == 30 and record["jax_version"]
  kinds = sorted(run["kind"] for run in record["runs"])
  assert kinds == ["global", "routed", "sim global", "sim routed"], kinds
  assert all(run["num_requests"] == 30 for run in record["runs"])
  assert record["summary"]["N=2"]["goal"] == 0.95


def test_bench_replicas_missing_trace_is_one_line():
  proc = _start("--trace=/nowhere/trace.jsonl", timeout=120)
  assert proc.returncode != 0 and proc.stdout == "", proc.stdout + proc.stderr
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and "/nowhere/trace.jsonl not found" in lines[0], proc.stderr
