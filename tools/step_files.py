"""The library files one steady decode step runs through, measured by tracing it.

Serves a tiny random Llama (CPU is enough) until every row decodes, then profiles
one `Scheduler.step()` twice: warm (the files whose Python runs on the host each
step) and after `jax.clear_caches()` (the files the step's program is traced
from: model, kernels, in-jit bookkeeping). Prints each file with its calls, its
side and whether the step's data path crosses it (a file called inside the
forward pass or the finishing, `DATA_PATH_ROOTS`: not policy or telemetry), then
the spine: the chain of files on the stack when the data reaches each stage
(`LANDMARKS`), and its hops (distinct caller -> callee file pairs).

`--layout DRAFT.json` ({"old/file.py": "new/file.py", ...}) recounts the same
trace as if files were merged or moved so: a layout draft's figures before it is built.

Usage: PYTHONPATH=. python tools/step_files.py [--batch 4] [--steps_before 6] [--json]
       [--layout DRAFT.json]
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
# The spine: the files on the call stack when the step's data reaches each stage of
# "plan -> kernel -> tokens -> bookkeeping" (file name, function's qualified name).
# A file called and left (a config property, an id check) is on the data path but
# not on the spine; the spine is the chain a reader follows from the step to a stage.
LANDMARKS = {
    "plan": (("batching.py", "plan_rows"), ("host_transitions.py", "reserve")),
    "kernel": (("pallas_call.py", "pallas_call"), ("decode_attention.py", "_xla_decode_attention")),
    "tokens": (("sampling.py", "sample"), ("forward_pass.py", "ForwardPass.resolve")),
    "bookkeeping": (("commit.py", "commit"), ("host_transitions.py", "release"),
                    ("finishing.py", "Finishing.finish")),
}


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


def _chain(frame, prefixes: tuple[str, ...]) -> tuple[str, ...]:
  """The library files on `frame`'s stack, outermost first, repeats merged."""
  files: list[str] = []
  while frame is not None:
    if frame.f_code.co_filename.startswith(prefixes):
      files.append(str(pathlib.Path(frame.f_code.co_filename).relative_to(ROOT)))
    frame = frame.f_back
  return _merged(tuple(reversed(files)))


def _profile_step(sched: Scheduler, spine: dict[str, set] | None = None
                  ) -> tuple[collections.Counter, collections.Counter]:
  """Calls per library file during one `sched.step()`: all of them, and those made
  inside the data path's roots (`DATA_PATH_ROOTS`). With `spine`, adds to it the
  chain of files (`_chain`) at each landmark call, keyed by stage."""
  calls: collections.Counter = collections.Counter()
  data: collections.Counter = collections.Counter()
  prefixes = tuple(str(ROOT / p) + "/" for p in PACKAGES)
  roots = {getattr(type(getattr(sched, part)), name).__code__ for part, name in DATA_PATH_ROOTS}
  marks = {(f, q): stage for stage, pairs in LANDMARKS.items() for f, q in pairs}
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
    if spine is not None:
      stage = marks.get((pathlib.Path(code.co_filename).name, code.co_qualname))
      if stage is not None:
        spine.setdefault(stage, set()).add(_chain(frame, prefixes))
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


def _short(path: str) -> str:
  """`folder/stem` of a library file, as the spine prints it."""
  p = pathlib.Path(path)
  return f"{p.parent.name}/{p.stem}"


def _merged(chain: tuple[str, ...]) -> tuple[str, ...]:
  """`chain` with consecutive repeats merged."""
  return tuple(f for i, f in enumerate(chain) if i == 0 or chain[i - 1] != f)


def _relaid(calls: collections.Counter, moved: dict[str, str]) -> collections.Counter:
  """`calls` counted under a layout draft's file names."""
  out: collections.Counter = collections.Counter()
  for f, n in calls.items():
    out[moved.get(f, f)] += n
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--steps_before", type=int, default=6)
  parser.add_argument("--json", action="store_true")
  parser.add_argument("--layout", type=pathlib.Path, default=None,
                      help="JSON map of old file -> new file to recount under")
  args = parser.parse_args()
  sched = _serving_loop(args.batch)
  for _ in range(args.steps_before):
    sched.step()
  if sched.queues.waiting or any(len(r.output) == 0 for r in sched.queues.running):
    raise SystemExit("not every row decodes yet: raise --steps_before")
  chains: dict[str, set] = {}
  host, host_data = _profile_step(sched, chains)
  jax.clear_caches()
  traced, traced_data = _profile_step(sched, chains)
  if args.layout is not None:
    moved = json.loads(args.layout.read_text())
    host, host_data, traced, traced_data = (_relaid(c, moved) for c in
                                            (host, host_data, traced, traced_data))
    chains = {k: {_merged(tuple(moved.get(f, f) for f in c)) for c in cs}
              for k, cs in chains.items()}
  traced_only = {f: n for f, n in traced.items() if f not in host}
  data = sorted(set(host_data) | {f for f in traced_data if f not in host})
  spine = sorted({f for cs in chains.values() for c in cs for f in c})
  hops = sorted({(c[i], c[i + 1]) for cs in chains.values() for c in cs
                 for i in range(len(c) - 1)})
  if args.json:
    print(json.dumps({"host": dict(host), "traced_only": traced_only, "data_path": data,
                      "spine": spine, "hops": hops,
                      "stages": {k: sorted(v) for k, v in chains.items()}}, indent=1))
    return
  print(f"{'file':48s} {'calls':>6s}  side    data path")
  for f in sorted(host):
    print(f"{f:48s} {host[f]:6d}  host    {'yes' if f in data else ''}")
  for f in sorted(traced_only):
    print(f"{f:48s} {traced_only[f]:6d}  traced  {'yes' if f in data else ''}")
  print(f"\n{len(host)} files run on the host each step; {len(traced_only)} more trace its "
        f"program; {len(host) + len(traced_only)} in all; {len(data)} on the data path.")
  print("\nThe spine (the chain of files from the step to each stage):")
  for stage in LANDMARKS:
    for c in sorted(chains.get(stage, ())):
      print(f"  {stage:12s} {' -> '.join(_short(f) for f in c)}")
  print(f"{len(spine)} files on the spine, {len(hops)} hops between them.")


if __name__ == "__main__":
  main()
