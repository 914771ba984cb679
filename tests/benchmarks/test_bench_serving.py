"""`benchmarks/bench_serving.py` on CPU with the tiny random checkpoint: the table comes
last with a row per (batch, loop), tokens are produced, nothing compiles after the
warm-up, the loops agree, the device's own step is timed, and the record holds every
run; then a trace workload. Each run is a subprocess as a user starts it; both share a
compilation cache in a temporary directory (the same pool shapes: the second run loads
its programs)."""

from __future__ import annotations

import importlib.util
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
_HAS_HF = all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))


@pytest.fixture(scope="module", name="cache")
def _cache(tmp_path_factory):
  return tmp_path_factory.mktemp("jax_cache")


def _run(cache, *args: str) -> str:
  env = dict(os.environ, PYTHONPATH=str(_ROOT), JAX_PLATFORMS="cpu",
             PAGED_KV_COMPILE_CACHE=str(cache))
  proc = subprocess.run([sys.executable, str(_ROOT / "benchmarks" / "bench_serving.py"),
                         "--shape=tiny", "--prompt_len=16", "--output_len=8",
                         "--prefill_chunk=16", "--prefill_token_budget=16", *args],
                        cwd=_ROOT, env=env, capture_output=True, text=True, timeout=400)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return proc.stdout


def _table(out: str) -> list[list[str]]:
  """The table's rows: the lines after its header, to the end (or the record's line)."""
  lines = out.rstrip().splitlines()
  head = max(i for i, line in enumerate(lines) if line.split()[:2] == ["batch", "loop"])
  return [line.split() for line in lines[head + 1:] if not line.startswith("record: ")]


def test_sweep_both_loops(tmp_path, cache):
  record = tmp_path / "serving.json"
  out = _run(cache, "--batch=1,2", "--num_requests=4", "--overlap=both", "--device_step",
             f"--record={record}")
  assert out.rstrip().splitlines()[-1] == f"record: {record}", out[-500:]
  rows = _table(out)
  assert [(r[0], r[1]) for r in rows] == [("1", "sync"), ("1", "overlapped"),
                                          ("2", "sync"), ("2", "overlapped")], out
  for r in rows:
    assert r[3] == "4" and float(r[4]) > 0 and r[11].endswith("%"), r
    assert float(r[12]) > 0 and r[13].endswith("x"), r  # device step ms, serving / device
    assert r[14] == "0", r  # compiles in the timed run
  assert "Loops' tokens: equal in every batch row." in out
  assert "Warm-up (sync): " in out and "on a CPU the % of the ceiling is only indicative" in out
  if not _HAS_HF:
    assert "transformers comparison skipped: torch and transformers not installed." in out
    assert all(r[15:] == ["-", "-"] for r in rows), rows
  rec = json.loads(record.read_text())
  assert rec["bench"] == "bench_serving" and rec["results"]["loops_agree"]
  runs = rec["results"]["runs"]
  assert sorted((x["batch"], x["loop"]) for x in runs) == [
      (1, "overlapped"), (1, "sync"), (2, "overlapped"), (2, "sync")]
  for x in runs:
    (r,) = x["rounds"]
    assert r["output_tokens"] == 32 and r["requests"] == 4 and r["compiles"] == 0
    assert 0 < r["ceiling_share"] and r["step_bytes"] > rec["results"]["weight_bytes"]
    assert r["device_step_ms"] > 0
  assert rec["results"]["model"]["num_layers"] == 2


def test_trace_workload(tmp_path, cache):
  trace = write_mooncake(tmp_path / "trace.jsonl", session_trace(seed=0, num=12,
                                                                 num_sessions=3))
  out = _run(cache, "--batch=2", "--num_requests=3", "--overlap=sync", f"--trace={trace}",
             "--trace_scale=8", "--nohf_compare", "--warmup=serve")
  (row,) = _table(out)
  assert row[:4] == ["2", "sync", "1", "3"] and float(row[4]) > 0, out
  assert row[12] == "0", row
  assert "Workload: trace a Mooncake .jsonl or Azure .csv request trace, requests 0-3" in out
  assert "transformers comparison off (--nohf_compare)." in out
  assert "Warm-up (sync): each row's workload shape served untimed (3 requests)" in out
