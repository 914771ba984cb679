"""`benchmarks/soak_server.py` for a few seconds: a misbehaving client load leaves nothing.

The script runs as a user starts it (a subprocess, JAX on the CPU, the persistent
compilation cache in the test's temporary directory, `PAGED_KV_SOAK_SECONDS`
dropped): 24 connections of whole, streamed, disconnecting, slow, giving-up,
malformed and oversize requests, `/metrics` scraped every second. The script's own
checks (no error beyond the intended 400s and 429s, every scrape answered, drained,
0 blocks held, 0 compiles after warm-up, flat memory) decide its exit status; the
test also reads the record for the kinds that must have run.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

# The server under a misbehaving client load; `make test` keeps the server's tests.
pytestmark = pytest.mark.long

pytest.importorskip("flax", reason="the model extra (pip install 'paged-kv[model]')")
pytest.importorskip("tokenizers", reason="the hf extra (pip install 'paged-kv[hf]')")
pytest.importorskip("fastapi", reason="the server extra (pip install 'paged-kv[server]')")
pytest.importorskip("httpx", reason="the test extra (pip install 'paged-kv[test]')")
pytest.importorskip("prometheus_client", reason="the metrics extra (pip install "
                    "'paged-kv[metrics]')")

_ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_a_short_soak_passes_its_checks(tmp_path):
  env = dict(os.environ, PYTHONPATH=str(_ROOT), JAX_PLATFORMS="cpu",
             PAGED_KV_COMPILE_CACHE=str(tmp_path / "jax_cache"))
  env.pop("PAGED_KV_SOAK_SECONDS", None)
  proc = subprocess.run(
      [sys.executable, str(_ROOT / "benchmarks" / "soak_server.py"), "--seconds=12",
       "--concurrency=24", "--max_batch=8", "--max_tokens=12", "--max_queued=16",
       "--slow_read_ms=50", f"--record={tmp_path}/soak.json"],
      cwd=_ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
  res = json.loads((tmp_path / "soak.json").read_text())["results"]
  assert all(res["checks"].values()), res["checks"]
  out = res["outcomes"]
  assert out["stream"].get("200") and out["whole"].get("200"), out
  assert out["disconnect"].get("disconnected") and out["malformed"].get("400"), out
  assert out["oversize"].get("400") and out["give_up"].get("gave up"), out
  assert res["end"]["aborted"] > 0  # the disconnects and give-ups reached the scheduler
  assert res["scrapes"]["ok"] >= 5
