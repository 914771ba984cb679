"""`tools/gpu_check.sh` end to end on the CPU in its dry mode (every row of the
GPU plan at tiny shapes, Pallas kernels in interpret mode, the serving rows on the
tiny random checkpoint), with faults injected into some rows: a hang (killed at its
wall limit, recorded as a timeout, and the rows that need it skipped), an exception,
wrong numbers and a worker crash. Each must cost only its own row, be named in the
table and the footer, and make the exit status non-zero; a clean run exits 0; a
budget too small starts nothing."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import json
import math
import os
import pathlib
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

_ROOT = pathlib.Path(__file__).resolve().parents[2]


def _load_rows():
  """`tools/gpu_check_rows.py` as a module, loaded by path (tools/ is no package)."""
  spec = importlib.util.spec_from_file_location("_paged_kv_gpu_check_rows",
                                                _ROOT / "tools" / "gpu_check_rows.py")
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module
  spec.loader.exec_module(module)
  return module


gpu_check_rows = _load_rows()

_HANG = "check/perm/pallas"  # the perm/*/pallas timing rows need it
_RAISE = "copy/b1x128k-fp8"
_WRONG = "layer/b64x8k-d64/default"
_CRASH = "dense/b1x128k"
_HF = "serving/transformers/1b"  # skipped where torch and transformers are absent
_HAS_HF = all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))


def _run(out_dir, *args, inject=""):
  env = dict(os.environ, GPU_CHECK_DRY="1", OUT=str(out_dir), PY=sys.executable,
             GPU_CHECK_INJECT=inject)
  env.pop("GPU_CHECK_BUDGET_S", None)
  return subprocess.run(["bash", str(_ROOT / "tools" / "gpu_check.sh"), *args], cwd=_ROOT,
                        env=env, capture_output=True, text=True, timeout=400)


def _table(out_dir) -> dict[str, list[str]]:
  """Row id -> its cells, from gpu_check.md."""
  rows = {}
  for line in (out_dir / "gpu_check.md").read_text().splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if line.startswith("| ") and cells[0] not in ("row",) and "/" in cells[0]:
      rows[cells[0]] = cells
  return rows


# Rows the long tier runs dry instead (`test_dry_mode_prefill_and_mixed_rows`): the
# GPU interpreter's Mosaic prefill kernel costs 60-100 s of this test's dry budget.
_LONG_TIER_ROWS = ("check/attn/mosaic-prefill", "prefill/", "layer/mixed/mosaic-1launch")


# gpu_check.sh --dry over every row; `make test` keeps its subset and plan tests.
@pytest.mark.long
def test_dry_mode_every_row_and_injected_faults(tmp_path):
  proc = _run(tmp_path, f"--limit={_HANG}=3", f"--skip={','.join(_LONG_TIER_ROWS)}",
              inject=f"hang:{_HANG},raise:{_RAISE},wrong:{_WRONG},crash:{_CRASH}")
  log = proc.stdout[-4000:] + proc.stderr[-4000:]
  assert proc.returncode == 1, log
  table = _table(tmp_path)
  plan = [r.id for r in gpu_check_rows.plan(dry=True)
          if not any(p in r.id for p in _LONG_TIER_ROWS)]
  assert list(table) == plan, log  # every row, in plan order, once
  status = {k: v[3] for k, v in table.items()}
  assert status[_HANG].startswith("FAILED timeout: no result within its 3 s limit"), status
  assert status[_RAISE] == "FAILED error: RuntimeError: injected failure (GPU_CHECK_INJECT)"
  assert status[_WRONG].startswith("WRONG: rel err"), status
  assert status[_CRASH] == ("FAILED crash: worker exited (signal SIGABRT): Fatal Python "
                            "error: Aborted"), status
  needs_hang = [r for r in plan if r.startswith("perm/") and r.endswith("/pallas")]
  for r in needs_hang:
    assert status[r] == f"skipped: needs {_HANG} (timeout)", status
  hf_skipped = 0 if _HAS_HF else 1
  if not _HAS_HF:
    assert status[_HF] == "skipped: torch and transformers not installed", status
  # The decode-kernel variant rows: dry mode runs those of one key through Triton.
  dry_run = f"kernel/{gpu_check_rows.DRY_VARIANT_KEY}/pallas-"
  kernel_rows = [r for r in plan if r.startswith("kernel/")]
  dry_skipped = [r for r in kernel_rows if not r.startswith(dry_run)]
  assert len(kernel_rows) - len(dry_skipped) == 2, kernel_rows
  assert all(status[r].startswith("skipped: dry mode runs kernel/") for r in dry_skipped), status
  skipped = hf_skipped + len(dry_skipped)
  others = set(plan) - {_HANG, _RAISE, _WRONG, _CRASH, *needs_hang, *dry_skipped} - (
      set() if _HAS_HF else {_HF})
  assert {r: status[r] for r in others if status[r] != "ok"} == {}, log
  # Measured rows carry a time, GB/s and (against their copy row) a % of it.
  cells = table["layer/b64x8k/default"]
  assert cells[1] == "default: xla" and float(cells[4]) > 0 and float(cells[5]) > 0
  assert float(cells[6]) > 0 and float(cells[7]) > 0 and "1.5x builtin" in cells[9]
  assert float(table["check/attn/mosaic"][8]) < gpu_check_rows.TOL
  assert table["builtin/b64x8k"][1] == "jax builtin" and table["copy/b64x8k"][1] == "x + 1 (xla)"
  # The serving rows: a device step, tokens/s against the ceiling (`% copy`), the
  # synchronous loop's tokens equal to the overlapped loop's, nothing compiled.
  for b in ("b1", "b64"):
    device = table[f"serving/device/1b-{b}"]
    assert float(device[4]) > 0
    # JAX's profiler: the step's op time per category (issue U item 5).
    assert re.search(r"; ops [\d.]+ ms per step \(host:XLA execute\): .*top: ", device[11]), device
    for loop in ("sync", "overlapped"):
      cells = table[f"serving/1b-{b}/{loop}"]
      assert cells[1] == loop and float(cells[4]) > 0 and float(cells[6]) > 0, cells
      assert "step <= 1.1x device" in cells[9], cells
      note = cells[11]
      assert re.match(r"step [\d.]+x device; [\d,]+ tok/s; ", note), note
      assert ("tokens = overlapped" in note) == (loop == "sync"), note
      assert " 0 compiles" in note, note
  assert re.match(r"32 new tokens: [\d,]+ tok/s, [\d.]+ TFLOP/s of weight matmuls; ops [\d.]+ "
                  r"ms per chunk \(host:XLA execute\)", table["serving/prefill2k/1b"][11])
  for loop in ("overlapped", "sync"):
    assert re.match(r"served each batch's workload shape untimed: 8 requests, \d+ compiles",
                    table[f"serving/warmup/1b-{loop}"][11])
  md = (tmp_path / "gpu_check.md").read_text()
  footer = md.rstrip().splitlines()
  n = len(plan)
  assert footer[-3] == (f"{n} rows: {n - 7 - skipped} passed, 4 failed (1 timed out), "
                        f"{3 + skipped} skipped; {footer[-3].split('; ')[1]}"), md[-600:]
  dry_budget = _driver_constant("DRY_BUDGET_S")
  assert re.fullmatch(rf"\d+ s of a {dry_budget:.0f} s budget", footer[-3].split("; ")[1])
  assert footer[-2] == f"failed: {_HANG}, {_RAISE}, {_CRASH}, {_WRONG}"
  assert footer[-1].startswith("goals (issues 22, T) (dry mode: meaningless): ")
  for word in ("# GPU check, dry mode", "JAX ", "device: cpu", "Shapes:", "`b64x8k`",
               "`perm1024`"):
    assert word in md, word
  data = json.loads((tmp_path / "gpu_check.json").read_text())
  assert data["dry"] and data["jax"] and data["device_kind"] == "cpu" and data["date"]
  assert set(data["shapes"]) >= {"check", "b64x8k", "b1x128k", "mixed", "perm32"}
  assert [r["id"] for r in data["rows"]] == plan
  assert data["summary"]["failed"] == 4 and data["summary"]["timeouts"] == 1
  assert data["summary"]["failed_rows"] == [_HANG, _RAISE, _CRASH, _WRONG]
  assert "injected failure" in (tmp_path / "gpu_check_worker.log").read_text()


def test_clean_subset_exits_zero_and_small_budget_starts_nothing(tmp_path):
  proc = _run(tmp_path / "a", "--only=check/perm/xla,copy/perm32")
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert [c[3] for c in _table(tmp_path / "a").values()] == ["ok", "ok"]
  assert "2 rows: 2 passed, 0 failed (0 timed out), 0 skipped" in proc.stdout
  proc = _run(tmp_path / "b", "--only=copy/", "--budget_s=1")
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  table = _table(tmp_path / "b")
  assert table and all(c[3].startswith("skipped: budget: ") for c in table.values()), table
  assert not (tmp_path / "b" / "gpu_check_worker.log").read_text()  # never started


def test_plan_is_cheapest_first_and_references_come_first():
  plan = gpu_check_rows.plan()
  shapes = gpu_check_rows.shapes(dry=False)
  seen = set()
  for r in plan:
    for ref in (r.copy_ref, r.builtin_ref, *r.needs):
      assert ref is None or ref in seen, (r.id, ref)
    seen.add(r.id)
  kernels = [r for r in plan if not r.id.startswith("serving/")]
  timed = [shapes[r.key].nbytes for r in kernels if not r.kind.startswith("check")]
  assert timed == sorted(timed)
  for r in plan:  # a copy row moves the bytes of the rows that divide by it
    if r.copy_ref and r.kind in ("layer", "perm", "builtin", "dense"):
      assert shapes[r.key].nbytes == shapes[plan[[p.id for p in plan].index(
          r.copy_ref)].key].nbytes, r.id
  llama = shapes["b64x8k"]
  assert (llama.num_q_heads, llama.num_kv_heads, llama.head_dim, llama.block_size,
          llama.dtype, llama.decode_rows, llama.decode_ctx) == (
              32, 8, 128, 16, "bfloat16", 64, 8192)
  assert shapes["b1x128k"].decode_ctx == 131072
  assert sum(r.est_s for r in kernels) < 400


def test_serving_rows_fit_a_lease_and_are_skippable():
  """The serving rows: last, all under `serving/`, their estimate ~6-7 minutes; with
  the kernel rows' measured ~85 s and the worker starts, under the default budget,
  which with the machine's start fits a 15-minute lease (at most 600 s a command)."""
  plan = gpu_check_rows.plan()
  shapes = gpu_check_rows.shapes(dry=False)
  serving = [r for r in plan if r.id.startswith("serving/")]
  assert [r.id for r in plan[-len(serving):]] == [r.id for r in serving]
  assert 300 <= sum(r.est_s for r in serving) <= 420
  budget = _driver_constant("BUDGET_S")
  assert sum(r.est_s for r in serving) + 85 + 2 * 10 < budget <= 560
  shape = shapes["serving-1b-b64"]
  assert (shape.model, shape.dtype, shape.batch, shape.max_batch, shape.prompt_len,
          shape.output_len) == ("llama-3.2-1b", "bfloat16", 64, 64, 512, 128)
  assert shapes["serving-1b-b1"].max_batch == 64  # one program set for both batches
  # Weights of Llama-3.2-1B in bf16 (tied head): 2,471,628,800 bytes; K/V 32 KiB/token.
  assert shape.weight_bytes == 2_471_628_800
  assert shape.nbytes == 2_471_628_800 + 64 * 576 * 32768
  rows = {r.id: r for r in serving}
  for b in ("b1", "b64"):
    for loop in ("sync", "overlapped"):
      r = rows[f"serving/1b-{b}/{loop}"]
      assert r.device_ref == f"serving/device/1b-{b}" and r.goals == {
          "serving_over_device": 1.1}
  assert all(r.id.startswith("serving/") for r in plan if r.kind.startswith("serving"))
  assert not math.isnan(shape.nbytes)


def test_block_size_rows_time_the_main_decode_shapes_at_other_blocks():
  """`layer/<shape>-bs<B>/default` for both main decode shapes at blocks 32 and 64: the
  block-16 shape with only the block size changed (same bytes, same copy and built-in
  rows), each in both modes."""
  plan = {r.id: r for r in gpu_check_rows.plan()}
  for dry in (False, True):
    shapes = gpu_check_rows.shapes(dry=dry)
    for key in ("b64x8k", "b1x128k"):
      for bs in gpu_check_rows.BLOCK_SIZE_ROWS:
        row = plan[f"layer/{key}-bs{bs}/default"]
        assert (row.impl, row.copy_ref, row.builtin_ref) == (None, f"copy/{key}",
                                                             f"builtin/{key}")
        shape = shapes[row.key]
        assert shape.block_size == bs and shape.nbytes == shapes[key].nbytes
        assert shape == dataclasses.replace(shapes[key], block_size=bs)
  assert gpu_check_rows.BLOCK_SIZE_ROWS == (32, 64)


def _driver_constant(name: str):
  """A module-level constant of `tools/gpu_check.py`, read from its source (importing
  it would define its absl flags in this process)."""
  tree = ast.parse((_ROOT / "tools" / "gpu_check.py").read_text())
  for node in tree.body:
    if isinstance(node, ast.Assign) and [t.id for t in node.targets
                                         if isinstance(t, ast.Name)] == [name]:
      return ast.literal_eval(node.value)
  raise KeyError(name)


def test_prefill_rows_count_causal_flops():
  """`causal_flops` by hand: one row of 2 new tokens on 3 cached sees 4 + 5 keys,
  4 x head_dim FLOPs a key and query head; the issue's shape is 1.37 PFLOP."""
  shape = gpu_check_rows.AttnShape(num_q_heads=2, num_kv_heads=1, head_dim=8,
                                   block_size=16, dtype="bfloat16", prefill_rows=1,
                                   prefill_prefix=3, prefill_chunk=2)
  assert gpu_check_rows.causal_flops(shape) == 4 * 8 * 2 * (4 + 5)
  big = gpu_check_rows.shapes(dry=False)["prefill8x2k"]
  assert (big.prefill_rows, big.prefill_prefix, big.prefill_chunk, big.head_dim) == (
      8, 4096, 2048, 128)
  assert gpu_check_rows.causal_flops(big) == 4 * 128 * 32 * 8 * sum(
      4096 + i + 1 for i in range(2048))
  ids = [r.id for r in gpu_check_rows.plan()]
  for row in ("check/attn/mosaic-prefill", "prefill/prefill8x2k/pallas",
              "prefill/prefill8x2k/mosaic",
              "layer/mixed/default", "layer/mixed/mosaic-1launch"):
    assert row in ids, row


@pytest.mark.long
def test_dry_mode_prefill_and_mixed_rows(tmp_path):
  """The issue-U rows dry (GPU interpreter): the prefill kernel alone, Triton and
  Mosaic GPU, with TFLOP/s in the note, and the one-launch mixed step beside the
  default one, each checked against its reference before it is timed."""
  rows = ("check/attn/pallas,check/attn/mosaic-prefill,prefill/,copy/mixed,"
          "layer/mixed/default,layer/mixed/mosaic-1launch")
  proc = _run(tmp_path, f"--only={rows}")
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  table = _table(tmp_path)
  assert {k: c[3] for k, c in table.items() if c[3] != "ok"} == {}, table
  assert len(table) == 7, list(table)
  assert float(table["check/attn/mosaic-prefill"][8]) < gpu_check_rows.TOL
  for impl in ("pallas", "mosaic"):
    note = table[f"prefill/prefill8x2k/{impl}"][11]
    assert re.match(r"[\d.e+-]+ TFLOP/s causal \([\d,]+ FLOP; goal >= 350: ", note), note
  cells = table["layer/mixed/mosaic-1launch"]
  assert float(cells[6]) > 0 and float(cells[8]) < gpu_check_rows.TOL, cells
