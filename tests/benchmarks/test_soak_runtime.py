"""`benchmarks/soak_runtime.py` for ~20 s at small sizes: after warm-up, compile once, never wait.

The script runs once per module in a subprocess, exactly as a user starts it (as
`test_examples_smoke.py` does: JAX on the CPU, the persistent compilation cache in
the test's temporary directory through `PAGED_KV_COMPILE_CACHE`, so nothing here
writes to the user's cache, and `PAGED_KV_SOAK_SECONDS` dropped so the run stays
short). The pool is small enough that the workload presses it (16 rows of up to 48
blocks over 512 blocks: swap preemption), saves the prefix cache every 100 steps
and shrinks the pool to 384 blocks half-way. The checks read its `samples.csv` and
`compiles.csv`:

* no XLA compile after warm-up except the shrink's: the cut gives the pool new
  shapes, so its programs compile again; that count is reported apart and must
  stay within what the warm-up compiled plus `CUT_PROGRAMS` (2: the resize
  itself and its free list);
* no blocking read of device data after warm-up except the saves' (a save reads
  the cache's K/V to write it) and the cut's step (where the scheduler may warm
  the new size up); the script counts both with the pool's runtime counters
  around each save and the cut's step, and reports them apart.

A failure names the programs that compiled and where (step, save, the cut), from
the script's compile log.
"""

from __future__ import annotations

import csv
import os
import pathlib
import re
import subprocess
import sys

import pytest

# A soak (a varied runtime workload read by four tests); `make test` keeps
# serving/test_runtime_discipline.py.
pytestmark = pytest.mark.long

_ROOT = pathlib.Path(__file__).resolve().parents[2]
SECONDS = 20
NUM_BLOCKS = 512
SHRINK_TO = 384  # int(0.75 * NUM_BLOCKS), the script's default shrink
CUT_PROGRAMS = 2  # the shrink's compiles beyond the warm-up's set: the cut's own programs
ARGS = (f"--seconds={SECONDS}", f"--num_blocks={NUM_BLOCKS}", "--block_size=16", "--max_seqs=16",
        "--max_segments=48", "--tenants=20", "--save_every=100", "--sample_every_seconds=2",
        "--long_burst_every=2", "--seed=0", "--noprogress")


class SoakRun:
  """The script's output: stdout, the samples and the compile log."""

  def __init__(self, out_dir: pathlib.Path, stdout: str):
    self.stdout = stdout
    self.samples = _read_csv(out_dir / "samples.csv")
    self.compiles = _read_csv(out_dir / "compiles.csv")
    m = re.search(r"warm-up: (\d+) programs run; (\d+) XLA compiles .*?, (\d+) executables "
                  r"loaded", stdout)
    assert m, stdout[-3000:]
    self.warmup_programs = int(m[1])
    self.warmup_executables = int(m[2]) + int(m[3])  # compiled or loaded

  @property
  def last(self) -> dict:
    return self.samples[-1]

  def describe(self, compiles: list[dict]) -> str:
    """One line per (program, phase): how many compiles, at which steps."""
    steps: dict[tuple[str, str], list[int]] = {}
    for c in compiles:
      steps.setdefault((c["name"], c["phase"]), []).append(c["step"])
    return "\n".join(f"  {len(v)} x {name} in phase '{phase}' at step(s) "
                     f"{sorted(set(v))}" for (name, phase), v in sorted(steps.items()))


def _read_csv(path: pathlib.Path) -> list[dict]:
  with open(path, newline="") as f:
    rows = list(csv.DictReader(f))
  for r in rows:
    for k, v in r.items():
      if re.fullmatch(r"-?\d+", v or ""):
        r[k] = int(v)
      elif re.fullmatch(r"-?\d+\.\d*", v or ""):
        r[k] = float(v)
  return rows


@pytest.fixture(scope="module", name="soak")
def _soak(tmp_path_factory) -> SoakRun:
  tmp = tmp_path_factory.mktemp("soak_runtime")
  env = dict(os.environ, PYTHONPATH=str(_ROOT), JAX_PLATFORMS="cpu",
             PAGED_KV_COMPILE_CACHE=str(tmp / "jax_cache"))
  env.pop("PAGED_KV_SOAK_SECONDS", None)  # the long soak's knob: this run stays short
  env.pop("PAGED_KV_DEBUG", None)  # the production path's reads and compiles (debug mode syncs)
  proc = subprocess.run([sys.executable, str(_ROOT / "benchmarks" / "soak_runtime.py"), *ARGS,
                         f"--out_dir={tmp / 'out'}"], cwd=_ROOT, env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return SoakRun(tmp / "out", proc.stdout)


def test_workload_presses_saves_and_shrinks(soak):
  last = soak.last
  assert last["elapsed_s"] >= SECONDS, soak.stdout[-2000:]
  assert len(soak.samples) >= 5, soak.samples
  assert last["finished"] > 0 and last["steps"] > 0, last
  assert last["preemptions_swap"] > 0, "the workload must press the pool into swap preemption"
  assert last["saves"] > 0 and last["save_reads"] > 0, last
  assert last["pool_blocks"] == SHRINK_TO, "the shrink must reach its cut"
  assert "verdict: compiles after warm-up" in soak.stdout
  assert "| elapsed_s | steps |" in soak.stdout and soak.stdout.rstrip().endswith("|")


def test_no_compile_after_warmup_outside_the_shrink(soak):
  outside = [c for c in soak.compiles if c["shrink"] != "True"]
  assert not outside, (f"{len(outside)} XLA compiles after warm-up outside the shrink "
                       f"(goal 0):\n{soak.describe(outside)}")
  for row in soak.samples:
    assert row["other_compiles"] == 0, row


def test_shrink_recompiles_are_bounded_by_the_warmup(soak):
  shrink = [c for c in soak.compiles if c["shrink"] == "True"]
  assert soak.last["shrink_compiles"] == len(shrink)
  assert soak.last["logged_compiles"] == len(soak.compiles)
  assert all(c["phase"] != "step" and c["phase"] != "save" for c in shrink), \
      soak.describe(shrink)  # none before the shrink was requested
  bound = max(soak.warmup_programs, soak.warmup_executables) + CUT_PROGRAMS
  assert len(shrink) <= bound, (
      f"the shrink compiled {len(shrink)} programs, more than the warm-up's "
      f"{bound - CUT_PROGRAMS} + {CUT_PROGRAMS} for the cut:\n{soak.describe(shrink)}")


def test_no_blocking_read_outside_the_saves_and_the_cut(soak):
  for row in soak.samples:
    outside = row["blocking_reads"] - row["save_reads"] - row["cut_reads"]
    assert outside == 0, (f"{outside} blocking reads after warm-up outside the saves and the "
                          f"cut by {row['elapsed_s']} s: {row}")
