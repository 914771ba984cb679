"""Does the serving loop hide its host time behind the device? Sync vs overlapped steps.

A steady chat-like load (`--batch` sequences always running, a finished one replaced
by a new request sharing a system prompt) runs through `Scheduler` over
`LatencyExecutor`: the slots are reserved as `DryExecutor` does and the step's
tokens become readable `D` ms after the later of its dispatch and the previous
step's end (a simulated in-order device, since on a CPU host and device are one).
For each D of `--device_ms`, the synchronous loop (`overlap=False`: read step t's
tokens, then plan t+1) and the overlapped one (`overlap=True`: dispatch t+1, then
read t) run the same workload in turn, each round alternating them; D = 0 gives
the host time per step. A loop that hides the host takes max(host, D) per step;
one that does not takes host + D. With `--decode_steps=k` the overlapped loop also
runs k decode steps per dispatch when nothing waits (reported per decode step).

Usage:
  PYTHONPATH=. .venv/bin/python benchmarks/bench_overlap.py                       # batch 64, D 2,5,20 ms
  PYTHONPATH=. .venv/bin/python benchmarks/bench_overlap.py --batch=256 --device_ms=1,3
"""

from __future__ import annotations

import statistics
import time

from absl import app, flags

from benchmarks import records, shared_flags
import paged_kv
from paged_kv.sim import workload
from paged_kv.scheduler.latency_executor import LatencyExecutor
from paged_kv.scheduler.scheduler import Scheduler, SchedulerConfig

_BATCH = flags.DEFINE_integer("batch", 64, "Running sequences per step.")
_DEVICE_MS = flags.DEFINE_list("device_ms", ["2", "5", "20"], "Simulated device ms per step.")
_STEPS = flags.DEFINE_integer("steps", 100, "Timed steps per run.")
_WARMUP = flags.DEFINE_integer("warmup", 20, "Untimed steps first.")
_REPEATS = shared_flags.define_repeats(3, "Rounds (median of the rounds' medians).")
_DECODE_STEPS = flags.DEFINE_integer("decode_steps", 1, "k for the overlapped loop.")
_SEED = shared_flags.define_seed("Workload seed.")
_RECORD = shared_flags.define_record()

BLOCK = 16


def _run(device_s: float, overlap: bool, decode_steps: int, seed: int) -> float:
  """Wall seconds of the timed loop (arrivals and `step()`) per device step it
  dispatched (a k-step dispatch counts k: its wait falls on the next step)."""
  batch = _BATCH.value
  config = paged_kv.PoolConfig(num_blocks=batch * 24, block_size=BLOCK, num_layers=1,
                               num_kv_heads=1, head_dim=2, dtype="bfloat16", max_seqs=batch,
                               max_segments=64)
  sched = Scheduler(paged_kv.BlockPool(config, debug=False), LatencyExecutor(config, device_s),
                    SchedulerConfig(max_batch=batch, prefill_token_budget=8 * BLOCK * 4,
                                    prefill_chunk=BLOCK * 4, compaction=None,
                                    output_reserve_ratio=0.0, stats_every=0, snapshot_every=0,
                                    overlap=overlap, decode_steps=decode_steps))
  chat = workload.ChatWorkload(workload.ChatShape.host_benchmark(BLOCK), seed)

  sched.warmup(progress=False)
  for _ in range(_WARMUP.value):
    chat.top_up(sched, batch)
    sched.step()
  executor = sched.executor
  steps0, t0 = executor.device_steps, time.perf_counter()
  for _ in range(_STEPS.value):
    chat.top_up(sched, batch)  # the arrivals are host work of the loop too
    sched.step()
  wall = time.perf_counter() - t0
  assert sched.stats.compiles_after_warmup == 0
  return wall / (executor.device_steps - steps0)


def main(argv):
  del argv
  rec = records.Recorder(_RECORD.value, "bench_overlap", flag_values=records.script_flags(),
                         seeds=[_SEED.value + r for r in range(_REPEATS.value)])
  k = _DECODE_STEPS.value
  loops = [("sync", False, 1), ("overlap", True, 1)] + ([(f"overlap k={k}", True, k)]
                                                        if k > 1 else [])
  devices = [0.0] + [float(d) / 1e3 for d in _DEVICE_MS.value]
  runs = {(d, name): [] for d in devices for name, _, _ in loops}
  for r in range(_REPEATS.value):
    for d in devices:
      for name, overlap, steps in loops:
        ms = 1e3 * _run(d, overlap, steps, _SEED.value + r)
        runs[(d, name)].append(ms)
        print(f"round {r} D {1e3 * d:5.1f} ms {name:12s}: step {ms:7.3f} ms", flush=True)
  host = statistics.median(runs[(0.0, "sync")])
  print(f"\nWall per device step (ms; the timed loop's wall, arrivals included, over the "
        f"device steps it dispatched; median of {_REPEATS.value} rounds x {_STEPS.value} steps), batch "
        f"{_BATCH.value}, LatencyExecutor. host = the synchronous loop at D = 0 "
        f"({host:.3f} ms). 'vs max' = step / max(host, D) (goal <= 1.15 overlapped); "
        "'vs sum' = step / (host + D).")
  print(f"{'D ms':>6} {'loop':>12} {'step':>8} {'vs max':>7} {'vs sum':>7}")
  rows = []
  for d in devices:
    for name, _, _ in loops:
      ms = statistics.median(runs[(d, name)])
      vs_max, vs_sum = ms / max(host, 1e3 * d), ms / (host + 1e3 * d)
      print(f"{1e3 * d:6.1f} {name:>12} {ms:8.3f} {vs_max:7.3f} {vs_sum:7.3f}")
      rows.append(dict(device_ms=1e3 * d, loop=name, step_ms=ms, rounds=runs[(d, name)],
                       vs_max=vs_max, vs_sum=vs_sum))
  rec.write({"batch": _BATCH.value, "host_ms": host, "rows": rows})


if __name__ == "__main__":
  app.run(main)
