"""The library files one steady decode step runs through, measured by tracing it.

Serves a tiny random Llama (CPU is enough) until every row decodes, then profiles
one `Scheduler.step()` twice: warm (the files whose Python runs on the host each
step) and after `jax.clear_caches()` (the files the step's program is traced
from: model, kernels, in-jit bookkeeping). Prints each file with its calls, its
side and whether the step's data path crosses it (a file called inside the
forward pass or the finishing, `DATA_PATH_ROOTS`: not policy or telemetry).

Usage: PYTHONPATH=. python tools/step_files.py [--batch 4] [--steps_before 6] [--json]
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import sys

import jax
import numpy as np
from flax import nnx

import paged_kv
from paged_kv.model import llama
from paged_kv.scheduler.executor import ModelExecutor
from paged_kv.scheduler.scheduler import Request, Scheduler, SchedulerConfig

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("paged_kv", "radix", "pallas_kernels")
# The step's data path: its forward pass (plan, reservation and commit, the model
# call, reading the tokens into the rows) and the bookkeeping of what finished. The
# rest of a step is policy and telemetry (admission, eviction, stats, alerts).
DATA_PATH_ROOTS = (("forward_pass", "run"), ("finishing", "finish"))


def _serving_loop(batch: int) -> Scheduler:
  """A scheduler over a tiny random Llama with `batch` requests submitted."""
  cfg = llama.LlamaConfig(num_layers=2)
  model = llama.TinyLlama(cfg, rngs=nnx.Rngs(0))
  pool_config = llama.pool_config_for(cfg, num_blocks=16 * batch, block_size=4,
                                      max_seqs=batch, max_segments=24)
  sched = Scheduler(paged_kv.BlockPool(pool_config), ModelExecutor(model, pool_config),
                    SchedulerConfig(max_batch=batch, prefill_chunk=8,
                                    prefill_token_budget=8 * batch, compaction=None))
  rng = np.random.default_rng(0)
  for i in range(batch):
    sched.submit(Request(i, rng.integers(0, cfg.vocab_size, 6).tolist(), 40))
  return sched


def _profile_step(sched: Scheduler) -> tuple[collections.Counter, collections.Counter]:
  """Calls per library file during one `sched.step()`: all of them, and those made
  inside the data path's roots (`DATA_PATH_ROOTS`)."""
  calls: collections.Counter = collections.Counter()
  data: collections.Counter = collections.Counter()
  prefixes = tuple(str(ROOT / p) + "/" for p in PACKAGES)
  roots = {getattr(type(getattr(sched, part)), name).__code__ for part, name in DATA_PATH_ROOTS}
  depth = 0

  def hook(frame, event, arg):
    nonlocal depth
    del arg
    code = frame.f_code
    if event == "return" and code in roots:
      depth -= 1
    if event != "call":
      return
    if code in roots:
      depth += 1
    if code.co_filename.startswith(prefixes):
      name = str(pathlib.Path(code.co_filename).relative_to(ROOT))
      calls[name] += 1
      if depth:
        data[name] += 1

  sys.setprofile(hook)
  try:
    sched.step()
  finally:
    sys.setprofile(None)
  return calls, data


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--steps_before", type=int, default=6)
  parser.add_argument("--json", action="store_true")
  args = parser.parse_args()
  sched = _serving_loop(args.batch)
  for _ in range(args.steps_before):
    sched.step()
  if sched.queues.waiting or any(len(r.output) == 0 for r in sched.queues.running):
    raise SystemExit("not every row decodes yet: raise --steps_before")
  host, host_data = _profile_step(sched)
  jax.clear_caches()
  traced, traced_data = _profile_step(sched)
  traced_only = {f: n for f, n in traced.items() if f not in host}
  data = sorted(set(host_data) | {f for f in traced_data if f not in host})
  if args.json:
    print(json.dumps({"host": dict(host), "traced_only": traced_only, "data_path": data},
                     indent=1))
    return
  print(f"{'file':48s} {'calls':>6s}  side    data path")
  for f in sorted(host):
    print(f"{f:48s} {host[f]:6d}  host    {'yes' if f in data else ''}")
  for f in sorted(traced_only):
    print(f"{f:48s} {traced_only[f]:6d}  traced  {'yes' if f in data else ''}")
  print(f"\n{len(host)} files run on the host each step; {len(traced_only)} more trace its "
        f"program; {len(host) + len(traced_only)} in all; {len(data)} on the data path.")


if __name__ == "__main__":
  main()
