"""Every example script runs end to end with tiny settings (so none of them rots).

Each runs in a subprocess exactly as a user would start it; the assertions check
that it finished and printed its report, not its numbers (those are measured,
with full settings, in WORKSPACE_NOTES.md).
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

_ROOT = pathlib.Path(__file__).resolve().parents[2]
_TRACE = _ROOT.parent / "shared" / "traces" / "conversation_trace.jsonl"


def _run(script: str, *args: str, timeout: int = 300) -> str:
  env = dict(os.environ, PYTHONPATH=str(_ROOT), JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, str(_ROOT / "examples" / script), *args], cwd=_ROOT,
                        env=env, capture_output=True, text=True, timeout=timeout)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return proc.stdout


def test_serve(tmp_path):
  out = _run("serve.py", "--conversations=3", "--turns=2", "--num_blocks=48",
             "--max_batch=4", f"--out_dir={tmp_path}", "--prometheus_port=0")
  assert "| requests finished | 6 / 6 |" in out, out
  assert (tmp_path / "metrics.jsonl").stat().st_size > 0
  assert (tmp_path / "block_map.png").exists() and (tmp_path / "utilization.png").exists()


def test_pool_tour():
  out = _run("demo.py", "--num_blocks=64")
  assert "all released" in out and "refused as expected" in out, out


@pytest.mark.skipif(not _TRACE.exists(), reason="needs ../shared/traces beside the repo")
def test_replay_trace_sim_and_engine():
  out = _run("replay_trace.py", "--max_requests=40", "--capacity_tokens=100000,0",
             "--progress=false")
  assert "replay and exact bound agree" in out, out
  out = _run("replay_trace.py", "--engine", "--max_requests=20", "--pool_tokens=16384",
             "--variants=flat,all", "--progress=false")
  assert "| conversation_trace.jsonl | all | 20 / 20 |" in out, out


def test_fragmentation_study(tmp_path):
  out = _run("fragmentation_study.py", f"--out_dir={tmp_path}", "--steps=30", "--chat_steps=8",
             "--num_blocks=256", "--timing_reps=2")
  assert "merge_every_step" in out and "compaction step of 32 moves" in out, out


def test_bench_allocator():
  out = _run("bench_allocator.py", "--pool_sizes=1024", "--batch=16", "--max_len=64",
             "--steps=3", "--scan=4")
  assert "| 1024 |" in out, out


def test_bench_decode():
  out = _run("bench_decode.py", "--batch=2", "--prompt_len=4", "--num_tokens=4",
             "--steps=1,2", "--repeats=1", "--num_layers=1")
  assert "tokens/s" in out or "tok/s" in out, out
