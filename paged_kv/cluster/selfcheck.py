"""A multi-process self-check: the tiny model served in lockstep on a global mesh.

Usage:
  python -m paged_kv.cluster.launch -n 2 -- python -m paged_kv.cluster.selfcheck --out DIR
  python -m paged_kv.cluster.selfcheck --plain --out DIR    # one process, no lockstep

Serves a seeded workload (requests sharing a system prompt, two arriving per
step, a pool small enough for evictions and preemptions) with `TinyLlama`
through `LockstepScheduler` and `ShardedModelExecutor`: the pool's pages split
over kv heads across every process's devices. Only the leader knows the
workload; the others get it from the broadcasts. Writes to `DIR`:

* `process_<i>.json`: the tokens of every request, a digest of every captured
  K/V, per-step wall seconds (and the part spent waiting for the others), XLA
  compiles per step, the scheduler's counters;
* `kv.npz` (leader only): the K/V of every running request every `--kv-every`
  steps, `"<step>/<request>/k"` and `.../v`, `[num_layers, num_kv_heads, tokens,
  head_dim]`, gathered over the mesh;
* `process_<i>.error.json` when the process stops with an error.

`--plain` runs the same workload with a plain `Scheduler` and `ModelExecutor`
on one device: the reference the lockstep runs must equal (tokens, and K/V bit
for bit; `compare` checks). `--dry` swaps the model for a
`DryExecutor` (bookkeeping only). `--fault KIND:STEP:PROCESS` injects a failure on
one process before a step: `diverge` (a request only it submits), `raise` (an
exception), `exit` (`os._exit(17)`, no word to the others).

On CPU it turns XLA's YNNPACK fusions off (`EXACT_CPU_FLAG`, before JAX starts;
`--xla-defaults` keeps them): their kernels depend on the shape, so one kv head
per device would round a few elements ~1 ulp apart from four heads on one.

Exit status: 0; 3 `ScheduleDiverged`; 4 `PeerFailed`; 5 `PeerTimeout`; 1 other errors.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback
from typing import Sequence

import numpy as np

# XLA:CPU's YNNPACK fusions pick kernels by shape: attention over 1 kv head rounds
# some elements ~1 ulp apart from the same head computed among 4 (4 of 100 random
# shapes, JAX 0.12; 0 with the fusions off). Off by default here, so a mesh with
# fewer heads per device is bit-equal to one process.
EXACT_CPU_FLAG = "--xla_cpu_experimental_ynn_fusion_type="
EXIT_DIVERGED, EXIT_PEER_FAILED, EXIT_PEER_TIMEOUT, EXIT_ERROR = 3, 4, 5, 1
FAULT_EXIT_STATUS = 17
FAULTS = ("diverge", "raise", "exit")
KV_MAX_LEN = 32  # tokens gathered per request (one compiled gather)


@dataclasses.dataclass(frozen=True)
class Workload:
  """The seeded requests and the sizes of the model, pool and scheduler."""

  num_requests: int = 6
  new_tokens: int = 6
  per_step: int = 2  # arrivals per step
  seed: int = 3
  num_blocks: int = 12
  block_size: int = 4

  def prompts(self) -> list[list[int]]:
    rng = np.random.default_rng(self.seed)
    system = rng.integers(0, 256, 9).tolist()
    return [system + rng.integers(0, 256, int(rng.integers(2, 8))).tolist()
            for _ in range(self.num_requests)]

  def arrivals(self, step: int):
    """The requests arriving before `step`; None once every request arrived."""
    from paged_kv.scheduler.scheduler import Request  # pylint: disable=g-import-not-at-top
    first = step * self.per_step
    if first >= self.num_requests:
      return None
    prompts = self.prompts()
    return [Request(f"r{i}", np.asarray(prompts[i], np.int32), self.new_tokens)
            for i in range(first, min(first + self.per_step, self.num_requests))]


def configs(w: Workload):
  """The pool and scheduler configs (4 kv heads: a mesh of 1, 2 or 4 devices)."""
  from paged_kv.core.config import PoolConfig  # pylint: disable=g-import-not-at-top
  from paged_kv.scheduler.scheduler import SchedulerConfig  # pylint: disable=g-import-not-at-top
  pc = PoolConfig(num_blocks=w.num_blocks, block_size=w.block_size, num_layers=2,
                  num_kv_heads=4, head_dim=16, dtype="float32", max_seqs=4, max_segments=16)
  sc = SchedulerConfig(max_batch=4, prefill_chunk=8, prefill_token_budget=16,
                       output_reserve_ratio=0.0, snapshot_every=0)
  return pc, sc


def tiny_model():
  """The seeded `TinyLlama` whose layers, kv heads and head_dim match `configs`' pool."""
  from paged_kv.model import llama  # pylint: disable=g-import-not-at-top
  from paged_kv.model.nnx_import import nnx  # pylint: disable=g-import-not-at-top
  mc = llama.LlamaConfig(num_layers=2, d_model=64, num_q_heads=8, num_kv_heads=4, head_dim=16,
                         ffn_dim=128)
  return llama.TinyLlama(mc, rngs=nnx.Rngs(0))


def _kv_digest(k: np.ndarray, v: np.ndarray) -> str:
  from paged_kv.cluster.distributed import digest  # pylint: disable=g-import-not-at-top
  return digest(k, v)


class _Recorder:
  """Per-step timings and compiles, the captured K/V, the final tokens."""

  def __init__(self):
    self.step_seconds: list[float] = []
    self.wait_seconds: list[float] = []
    self.compiles: list[int] = []
    self.kv: dict[str, np.ndarray] = {}
    self.kv_digests: dict[str, str] = {}

  def capture(self, step: int, running, gather) -> None:
    for r in running:
      if r.num_cached <= 0:
        continue
      k, v, _ = gather(r.seq_id)
      k, v = np.asarray(k)[:, :, :r.num_cached], np.asarray(v)[:, :, :r.num_cached]
      self.kv[f"{step}/{r.request_id}/k"], self.kv[f"{step}/{r.request_id}/v"] = k, v
      self.kv_digests[f"{step}/{r.request_id}"] = _kv_digest(k, v)

  def summary(self) -> dict:
    steady = [s for s, c in zip(self.step_seconds, self.compiles) if c == 0]
    waits = [w for w, c in zip(self.wait_seconds, self.compiles) if c == 0]
    med = lambda xs: float(np.median(xs)) if xs else None
    return {"step_seconds": self.step_seconds, "wait_seconds": self.wait_seconds,
            "compiles": self.compiles, "steady_steps": len(steady),
            "steady_step_median_s": med(steady), "steady_wait_median_s": med(waits)}


def run_plain(w: Workload, *, kv_every: int = 2) -> tuple[dict, dict]:
  """The reference: a plain `Scheduler` and `ModelExecutor` on one device; returns
  (report, captured K/V)."""
  import functools  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import paged_kv  # pylint: disable=g-import-not-at-top
  from paged_kv.runtime import counters  # pylint: disable=g-import-not-at-top
  from paged_kv.scheduler.executor import ModelExecutor  # pylint: disable=g-import-not-at-top
  from paged_kv.scheduler.scheduler import Scheduler  # pylint: disable=g-import-not-at-top
  counters.listen_for_compiles()
  pc, sc = configs(w)
  pool = paged_kv.BlockPool(pc)
  sched = Scheduler(pool, ModelExecutor(tiny_model(), pc), sc)
  gather_jit = jax.jit(functools.partial(paged_kv.gather_kv, max_len=KV_MAX_LEN))
  rec, done, step = _Recorder(), [], 0
  while True:
    new = w.arrivals(step)
    for r in new or ():
      sched.submit(r)
    if new is None and sched.idle:
      break
    c0, t0 = counters.backend_compiles(), time.perf_counter()
    sched.step()
    rec.step_seconds.append(time.perf_counter() - t0)
    rec.wait_seconds.append(0.0)
    rec.compiles.append(counters.backend_compiles() - c0)
    done.extend(sched.take_finished())
    if kv_every and step % kv_every == kv_every - 1:
      rec.capture(step, sched.running, lambda s: gather_jit(pool.state, s))
    step += 1
  report = _report(rec, done, sched, mode="plain", process_id=0, num_processes=1,
                   devices=1, exchanges=0)
  return report, rec.kv


def _report(rec: _Recorder, done, sched, **extra) -> dict:
  st = sched.stats
  return {**extra, "tokens": {str(r.request_id): r.tokens.tolist() for r in done},
          "stop_reasons": {str(r.request_id): r.stop_reason for r in done},
          "kv_digests": rec.kv_digests, **rec.summary(),
          "stats": {k: getattr(st, k) for k in ("steps", "admitted", "finished", "preemptions",
                                                "evictions", "hit_tokens", "decode_tokens",
                                                "prefill_tokens")}}


def run_lockstep(w: Workload, channel, *, kv_every: int = 2, fault: tuple | None = None,
                 dry: bool = False) -> tuple[dict, dict]:
  """This process's part of the lockstep run; returns (report, captured K/V).

  `dry`: a `DryExecutor` instead of the model (bookkeeping only, for the failure
  checks)."""
  import jax  # pylint: disable=g-import-not-at-top
  import paged_kv  # pylint: disable=g-import-not-at-top
  from paged_kv.parallel import executor, sharding  # pylint: disable=g-import-not-at-top
  from paged_kv.cluster import lockstep
  from paged_kv.runtime import counters  # pylint: disable=g-import-not-at-top
  from paged_kv.scheduler.scheduler import Request  # pylint: disable=g-import-not-at-top
  counters.listen_for_compiles()
  pc, sc = configs(w)
  mesh = sharding.make_tp_mesh()  # every process's devices
  pool = paged_kv.BlockPool(pc, state=sharding.init_sharded_pool(pc, mesh))
  group = channel.group
  if dry:
    from paged_kv.scheduler.executor import DryExecutor  # pylint: disable=g-import-not-at-top
    model_executor = DryExecutor(pc)
  else:
    model_executor = executor.ShardedModelExecutor(tiny_model(), pc, mesh)
  ls = lockstep.LockstepScheduler(pool, model_executor, sc, channel=channel)
  rec, done = _Recorder(), []
  me = group.process_id
  while not ls.done:
    step = ls.step_index
    if fault is not None and fault[1] == step and fault[2] == me:
      kind = fault[0]
      if kind == "exit":
        os._exit(FAULT_EXIT_STATUS)  # pylint: disable=protected-access
      if kind == "raise":
        ls._guard(_raise_injected)  # pylint: disable=protected-access
      if kind == "diverge":  # an arrival that reached this process only
        ls.scheduler.submit(Request("stray", np.arange(5, dtype=np.int32), 2))
    new, closed = (), False
    if group.is_leader and not ls.closed:
      got = w.arrivals(step)
      new, closed = (got or ()), got is None
    c0 = counters.backend_compiles()
    result = ls.step(new, closed=closed)
    rec.step_seconds.append(result.seconds)
    rec.wait_seconds.append(result.wait_seconds)
    rec.compiles.append(counters.backend_compiles() - c0)
    done.extend(result.finished)
    if kv_every and step % kv_every == kv_every - 1:
      rec.capture(step, ls.scheduler.running, lambda s: executor.gather_kv_replicated(
          pool.state, s, max_len=KV_MAX_LEN, mesh=mesh))
  pages = pool.state.pages.k
  report = _report(rec, done, ls.scheduler, mode="lockstep", process_id=me,
                   num_processes=group.num_processes, devices=jax.device_count(),
                   local_devices=jax.local_device_count(), mesh=dict(mesh.shape),
                   page_bytes_local=sum(s.data.nbytes for s in pages.addressable_shards),
                   page_bytes_total=pages.nbytes, exchanges=channel.num_exchanges)
  return report, rec.kv


def _raise_injected():
  raise RuntimeError("injected failure (--fault raise)")


def compare(reference: dict, runs: Sequence[dict], reference_kv: dict, run_kv: dict) -> list[str]:
  """What differs between the reference and the processes of a run (empty: nothing):
  every request's tokens and the K/V captured at every step, bit for bit."""
  problems = []
  if sorted(reference["tokens"]) != sorted(runs[0]["tokens"]):
    problems.append(f"finished requests differ: {sorted(reference['tokens'])} vs "
                    f"{sorted(runs[0]['tokens'])}")
  for run in runs:
    pid = run["process_id"]
    for rid, want in reference["tokens"].items():
      if run["tokens"].get(rid) != want:
        problems.append(f"process {pid}: tokens of {rid} differ")
    if run["kv_digests"] != reference["kv_digests"]:
      bad = [k for k in reference["kv_digests"]
             if run["kv_digests"].get(k) != reference["kv_digests"][k]]
      problems.append(f"process {pid}: K/V digests differ at {bad[:5]} "
                      f"({len(run['kv_digests'])} vs {len(reference['kv_digests'])} captured)")
  if set(reference_kv) != set(run_kv):
    problems.append(f"captured K/V keys differ: {len(reference_kv)} vs {len(run_kv)}")
  for key in sorted(set(reference_kv) & set(run_kv)):
    if not np.array_equal(reference_kv[key], run_kv[key]):
      problems.append(f"K/V {key} differs (max |diff| "
                      f"{np.abs(reference_kv[key] - run_kv[key]).max()})")
  return problems


def _write(out: str, name: str, obj) -> None:
  tmp = os.path.join(out, name + ".tmp")
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(obj, f)
  os.replace(tmp, os.path.join(out, name))


def _parse_fault(text: str | None) -> tuple | None:
  if not text:
    return None
  parts = text.split(":")
  if len(parts) != 3 or parts[0] not in FAULTS:
    raise SystemExit(f"--fault KIND:STEP:PROCESS with KIND in {FAULTS}, got {text!r}")
  return parts[0], int(parts[1]), int(parts[2])


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m paged_kv.cluster.selfcheck",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", required=True, help="directory for the reports")
  parser.add_argument("--plain", action="store_true", help="one process, plain Scheduler")
  parser.add_argument("--requests", type=int, default=Workload.num_requests)
  parser.add_argument("--new-tokens", type=int, default=Workload.new_tokens)
  parser.add_argument("--kv-every", type=int, default=2, help="capture K/V every k steps")
  parser.add_argument("--dry", action="store_true",
                      help="lockstep with a DryExecutor (no model math), for failure checks")
  parser.add_argument("--fault", default=None, help="KIND:STEP:PROCESS, KIND in " + str(FAULTS))
  parser.add_argument("--timeout", type=float, default=300.0,
                      help="seconds to wait for another process")
  parser.add_argument("--heartbeat", type=int, default=30,
                      help="seconds of silence before the service stops the run")
  parser.add_argument("--xla-defaults", action="store_true",
                      help=f"keep XLA:CPU's YNN fusions (without it: {EXACT_CPU_FLAG})")
  args = parser.parse_args(argv)
  if not args.xla_defaults:
    # Read when JAX's backend starts (nothing here has used a device yet). First:
    # XLA stops reading flags after one it cannot parse.
    os.environ["XLA_FLAGS"] = f"{EXACT_CPU_FLAG} {os.environ.get('XLA_FLAGS', '')}".strip()
  os.makedirs(args.out, exist_ok=True)
  w = Workload(num_requests=args.requests, new_tokens=args.new_tokens)
  if args.plain:
    report, kv = run_plain(w, kv_every=args.kv_every)
    _write(args.out, "process_0.json", report)
    np.savez(os.path.join(args.out, "kv.npz"), **kv)
    return 0
  from paged_kv.cluster import distributed  # pylint: disable=g-import-not-at-top
  group = distributed.initialize(heartbeat_timeout_s=args.heartbeat,
                                 shutdown_timeout_s=max(10, args.heartbeat))
  me = group.process_id
  channel = distributed.Channel(group, timeout_s=args.timeout)
  try:
    report, kv = run_lockstep(w, channel, kv_every=args.kv_every,
                              fault=_parse_fault(args.fault), dry=args.dry)
  except BaseException as exc:  # pylint: disable=broad-except
    channel.stop(exc)  # the leader waits for the others: its process hosts the service
    status = {distributed.ScheduleDiverged: EXIT_DIVERGED,
              distributed.PeerFailed: EXIT_PEER_FAILED,
              distributed.PeerTimeout: EXIT_PEER_TIMEOUT}.get(type(exc), EXIT_ERROR)
    _write(args.out, f"process_{me}.error.json",
           {"type": type(exc).__name__, "message": str(exc), "time": time.time()})
    traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # pylint: disable=protected-access  # no shutdown barrier: peers are failing
  _write(args.out, f"process_{me}.json", report)
  if group.is_leader:
    np.savez(os.path.join(args.out, "kv.npz"), **kv)
  distributed.shutdown()
  return 0


if __name__ == "__main__":
  sys.exit(main())
