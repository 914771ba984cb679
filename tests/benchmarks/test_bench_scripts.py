"""The scripts of benchmarks/ run end to end with tiny settings (so they do not rot).

Not smoke-tested yet: `benchmarks/bench_compaction.py`, `bench_pool_ops.py`,
`bench_prefill_xla.py`. `bench_kernels.py` and `bench_requests.py` run in
`test_bench_smoke.py`, `soak_runtime.py` in `test_soak_runtime.py`.

Each runs in a subprocess exactly as a user would start it; the assertions check
that it finished and printed its report, not its numbers (those are measured,
with full settings, in docs/benchmarks.md). Traces are written by the tests:
nothing here reads ../shared. The scripts run with their persistent compilation cache
on (the default), pointed at the test's temporary directory: nothing here writes to
the user's cache.
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil

import pytest

from tests.scripts import ROOT as _ROOT
from tests.scripts import compile_cache_in_tmp  # pylint: disable=unused-import (autouse)
from tests.scripts import run_script as _run
from tests.scripts import start_script as _start
from tests.sim.trace_files import session_trace, write_azure, write_mooncake

# The benchmark scripts' smoke runs (subprocesses).
pytestmark = pytest.mark.slow


@pytest.fixture(name="traces")
def _traces(tmp_path):
  """A small Mooncake-format trace and an Azure-format one, written by the test."""
  rows = session_trace(seed=0, num=40, num_sessions=6, partial=True)
  return (write_mooncake(tmp_path / "sessions.jsonl", rows),
          write_azure(tmp_path / "lengths.csv", rows))


def _record(path) -> dict:
  """A record written by a script's --record (checked for its provenance fields)."""
  rec = json.loads(pathlib.Path(path).read_text())
  for key in ("command", "flags", "git", "date", "machine", "jax", "results"):
    assert key in rec, (key, sorted(rec))
  assert rec["command"].startswith("python benchmarks/"), rec["command"]
  # benchmarks.shared_flags defines --record for the script: it is among the script's flags.
  assert rec["flags"]["record"], sorted(rec["flags"])
  return rec


def test_replay_trace_sim(traces, tmp_path):
  mooncake, azure = traces
  out = _run("benchmarks/replay_trace.py", f"--trace={mooncake},{azure}",
             "--capacity_tokens=20000,0", "--progress=false", f"--record={tmp_path / 'sim.json'}")
  assert "replay and exact bound agree" in out, out
  rec = _record(tmp_path / "sim.json")
  assert rec["bench"] == "replay_trace" and rec["flags"]["capacity_tokens"] == ["20000", "0"]
  unlimited = [r for r in rec["results"]["rows"] if r["capacity_tokens"] == 0]
  assert [r["hit_rate"] == r["exact_bound"] for r in unlimited] == [True, True], unlimited
  assert "| sessions.jsonl | 20,000 | 40 |" in out, out
  assert "| lengths.csv | unlimited | 40 | 0.0000 |" in out, out


def test_block_size_study(traces, tmp_path):
  """The study on both trace formats, two block sizes, windows smaller than the trace;
  with a gpu_check-shaped file of read rates the rule's pick follows them."""
  gpu = tmp_path / "gpu_check.json"
  gpu.write_text(json.dumps({"rows": [
      {"id": "layer/b64x8k/default", "gbps": 1000.0, "status": "ok"},
      {"id": "layer/b64x8k-bs64/default", "gbps": 2000.0, "status": "ok"}]}))
  out = _run("benchmarks/block_size_study.py", f"--traces={traces[0]},{traces[1]}",
             "--block_sizes=16,64", "--window=16", "--chunk=8", f"--gpu_check={gpu}",
             f"--record={tmp_path / 'bs.json'}")
  assert "rule's pick: live 64, slotted 64" in out, out
  rec = _record(tmp_path / "bs.json")
  assert rec["bench"] == "block_size_study" and rec["results"]["bandwidth"] == {
      "16": 1000.0, "64": 2000.0}
  for t in rec["results"]["traces"]:
    assert t["requests"] == 40 and [r["block_size"] for r in t["rows"]] == [16, 64], t
    for r in t["rows"]:
      assert r["windows"] == 3 and r["live"] == r["model_live"], r
      assert r["live"] <= r["slotted"] <= r["model_slotted"] <= 1.0, r
      assert 0.0 <= r["recovery"] <= 1.0 and r["break_even_slotted"] > 0, r


def test_replay_trace_engine(traces):
  out = _run("benchmarks/replay_trace.py", "--engine", f"--trace={traces[0]}",
             "--pool_tokens=4096", "--max_requests=20", "--variants=all", "--progress=false")
  assert "| sessions.jsonl | all | 20 / 20 |" in out, out


@pytest.mark.parametrize("script", ["replay_trace.py", "replay_routing.py"])
def test_replay_missing_default_trace_is_one_line(tmp_path, script):
  """In a checkout with no ../shared beside it, the default trace is named in one line."""
  (tmp_path / "repo" / "benchmarks").mkdir(parents=True)
  copy = tmp_path / "repo" / "benchmarks" / script
  shutil.copy(_ROOT / "benchmarks" / script, copy)
  proc = _start(copy, "--progress=false", timeout=120)
  assert proc.returncode != 0 and proc.stdout == "", proc.stdout + proc.stderr
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1, proc.stderr
  missing = tmp_path / "shared" / "traces" / "conversation_trace.jsonl"
  assert f"{missing} not found" in lines[0], lines[0]
  assert "github.com/kvcache-ai/Mooncake" in lines[0], lines[0]


# One of the two largest example runs; `make test` keeps the other examples' smoke runs.
@pytest.mark.long
def test_fragmentation_study(tmp_path):
  out = _run("benchmarks/fragmentation_study.py", f"--out_dir={tmp_path}", "--steps=30",
             "--chat_steps=8",
             "--num_blocks=256", "--timing_reps=2", "--modes=segments,require",
             "--policies=none,merge_every_step", "--chat_modes=flat,slotted+consolidate",
             "--step_fraction=0.005", f"--record={tmp_path / 'study.json'}")
  assert "merge_every_step" in out and "compaction step of 32 moves" in out, out
  assert "(0.5% of 20 ms" in out, out  # was "0% of 20 ms" (issue R)
  rec = _record(tmp_path / "study.json")
  rows = rec["results"]["mix"]["rows"]
  assert {(r["mode"], r["policy"]) for r in rows} == {
      (m, p) for m in ("segments", "require") for p in ("none", "merge_every_step")}, rows
  assert rec["results"]["chat"]["runs"] and rec["results"]["timing"]["copy_s"] > 0


def test_bench_allocator(tmp_path):
  out = _run("benchmarks/bench_allocator.py", "--pool_sizes=1024", "--batch=16", "--max_len=64",
             "--steps=3", "--scan=4", "--runs=1", f"--record={tmp_path / 'a.json'}")
  assert "| 1024 |" in out, out
  (row,) = _record(tmp_path / "a.json")["results"]["rows"]
  for key in ("np_step", "jit_step", "py_step", "np_scan", "jit_scan"):
    assert row[key] > 0, row


def test_bench_allocator_help_prints_percent_once():
  proc = _start("benchmarks/bench_allocator.py", "--help")  # absl's --help exits with status 1
  out = proc.stdout + proc.stderr
  assert "85%" in out and "85%%" not in out, out


def test_bench_decode():
  out = _run("benchmarks/bench_decode.py", "--batch=2", "--prompt_len=4", "--num_tokens=4",
             "--steps=1,2", "--repeats=1", "--num_layers=1")
  assert "tokens/s" in out or "tok/s" in out, out


def test_bench_compile(tmp_path):
  out = _run("benchmarks/bench_compile.py", "--layers=1", "--programs=decode", "--repeats=2",
             "--max_batch=2", "--num_blocks=16", f"--record={tmp_path}/")
  rows = [l.split() for l in out.splitlines() if l.split()[:1] == ["decode"]]
  assert [(r[1], r[2]) for r in rows] == [("scanned", "1"), ("unrolled", "1")], out
  record = json.loads(next(tmp_path.glob("bench_compile-*.json")).read_text())
  assert [len(r["seconds"]) for r in record["results"]["compile"]] == [2, 2]
  assert record["results"]["warmup"] == []


def test_bench_cold_start(tmp_path):
  out = _run("benchmarks/bench_cold_start.py", "--batch=2", "--cache=off", "--max_seq_len=32",
             "--prompt_len=8", "--prefill_chunk=16", "--prefill_token_budget=16",
             f"--record={tmp_path}/")
  rows = [l.split() for l in out.splitlines() if l.split()[:2] == ["2", "off"]]
  assert len(rows) == 1 and int(rows[0][6]) == int(rows[0][7]) > 0, out  # all compiled
  record = json.loads(next(tmp_path.glob("bench_cold_start-*.json")).read_text())
  (row,) = record["results"]["rows"]
  assert row["import_s"] < row["load_s"] < row["first_token_s"] and row["cache_loads"] == 0


def test_bench_overlap():
  out = _run("benchmarks/bench_overlap.py", "--batch=4", "--steps=3", "--warmup=2", "--repeats=1",
             "--device_ms=0,2")
  assert re.search(r"^\s+2\.0\s+overlap\s+[\d.]+", out, re.M), out


def test_bench_scheduler(monkeypatch):
  monkeypatch.delenv("PAGED_KV_DEBUG", raising=False)  # production counts (debug mode syncs)
  out = _run("benchmarks/bench_scheduler.py", "--pools=1024", "--batch=8",
             "--modes=off,stats,budget", "--steps=4", "--warmup=3", "--repeats=1")
  rows = [l.split() for l in out.splitlines() if l.split()[:2] == ["8", "1024"]]
  assert [r[2] for r in rows] == ["off", "stats", "budget"], out
  by_mode = {r[2]: r for r in rows}
  assert float(by_mode["off"][10]) == 0.0, out  # telemetry off: no stats taken
  assert float(by_mode["stats"][10]) > 0 and by_mode["stats"][12] == "1", out  # every step
  assert int(by_mode["budget"][12]) >= 1, out  # paced: every k >= 1 steps
  for r in rows:  # the commit timed apart: 'host' + 'commit' within the old figure (+ noise)
    assert float(r[6]) >= 0 and float(r[7]) >= 0, out
    assert float(r[8]) <= float(r[9]) + 0.5, out
  for r in rows:  # after warm-up: at most one bookkeeping dispatch, no read, no compile
    assert float(r[-3]) <= 1.0 and float(r[-2]) == 0.0 and r[-1] == "0", out


def test_bench_engine(tmp_path):
  pytest.importorskip("tokenizers", reason="the hf extra (pip install 'paged-kv[hf]')")
  out = _run("benchmarks/bench_engine.py", "--batch=8", "--steps=4", "--warmup=3", "--repeats=1",
             "--vocab=400", f"--record={tmp_path}")
  rows = [l.split() for l in out.splitlines() if l.split()[:1] == ["8"]]
  assert [r[1] for r in rows] == ["stream", "final", "ids"], out
  assert all(float(x) > 0 for r in rows for x in r[2:4]), out  # engine and scheduler ms
  assert json.loads(next(tmp_path.glob("bench_engine-*.json")).read_text())["results"]["rows"], out


def test_bench_shrink():
  out = _run("benchmarks/bench_shrink.py", "--sizes=256", "--seeds=0", "--max_batch=16",
             "--after_steps=20", "--prefill_token_budget=1024")
  rows = [l for l in out.splitlines() if l.split()[:2] == ["256", "0"]]
  assert len(rows) == 2, out  # the run, then its cut
  cut = rows[1].split()
  assert cut[3] == "host" and float(cut[4]) < 0.05, out  # one of 32 layers' K, not a pool
  target = int(rows[0].split()[3])
  assert 0 < target < 256, out
  delayed = re.search(r"(\d+)/(\d+) \((\d+)\) of (\d+)", rows[0])
  assert delayed and int(delayed[4]) > 0, out
  assert delayed[1] == delayed[2] == "0", out  # the shrink delayed no request
