"""`tools/step_files.py`: the files one steady decode step runs (by side, data path and
spine), and the layout drafts it recounts (`docs/layout_drafts/`)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

_ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.long  # serves a tiny model and traces its step program twice (~12 s)
def test_step_files_splits_host_and_traced_files():
  env = dict(os.environ, PYTHONPATH=str(_ROOT), JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, str(_ROOT / "tools" / "step_files.py"), "--json"],
                       cwd=_ROOT, env=env, capture_output=True, text=True, check=True).stdout
  files = json.loads(out)
  host, traced = files["host"], files["traced_only"]
  assert "paged_kv/scheduler/forward_pass.py" in host
  assert "paged_kv/pool/host_transitions.py" in host  # the host decides the reservation
  assert "pallas_kernels/decode_attention.py" in traced  # the decode kernel runs in jit
  assert "pallas_kernels/decode_attention.py" not in host  # a warm step traces nothing
  assert not set(host) & set(traced)
  data = set(files["data_path"])
  assert {"paged_kv/scheduler/forward_pass.py", "paged_kv/scheduler/finishing.py",
          "pallas_kernels/decode_attention.py"} <= data
  assert "paged_kv/scheduler/admission.py" not in data  # policy, not the step's data
  assert data <= set(host) | set(traced)
  stages = files["stages"]
  assert set(stages) == {"plan", "kernel", "tokens", "bookkeeping"}
  chains = [c for cs in stages.values() for c in cs]
  assert all(c[0] == "paged_kv/scheduler/scheduler.py" for c in chains)  # from the step
  assert any(c[-1] == "pallas_kernels/decode_attention.py" for c in stages["kernel"])
  spine = set(files["spine"])
  assert spine == {f for c in chains for f in c}
  assert spine - {"paged_kv/scheduler/scheduler.py"} <= data  # a chain of the data path
  assert len(files["hops"]) >= len(spine) - 1  # the chains connect every spine file


@pytest.mark.parametrize("draft", sorted((_ROOT / "docs" / "layout_drafts").glob("*.json")),
                         ids=lambda p: p.stem)
def test_layout_drafts_move_files_that_exist(draft):
  moved = json.loads(draft.read_text())
  assert moved
  for old in moved:
    assert (_ROOT / old).is_file(), f"{draft.name}: {old} is not a file of the tree"
