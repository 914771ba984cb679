"""Host time of a scheduler step against pool size and batch, telemetry on and off.

A steady decode load through `Scheduler` + `DryExecutor` (slots reserved, no model
math): `--batch` sequences always running (a finished one is replaced by a new
request sharing a system prompt with the others, so admission, prefix matching,
cache insertion, release and eviction all run in the timed steps), on pools of
`--pools` blocks. Per configuration it reports the median and p90 wall time of
`step()` over `--steps` steps after a warm-up, the part spent inside the
executor's step, and the part spent in the pool's commits (the jitted program that
applies the mirror's changes on the device, `paged_kv.core.commit`). Both are
device work, timed until done: on this CPU XLA runs them on the calling thread, on
a GPU they are asynchronous launches. `host` is the rest: the scheduler's and the
mirror's own work, what issue T counts ("count the host-side work"); `host+commit`
is the older figure (the step minus the executor only), kept for comparison. Waiting
for each commit keeps it from running beside the host work that follows it (XLA:CPU
runs a larger program on another thread), so `step` and `host+commit` read higher
here than in a loop that does not wait: at batch 256 on 2 cores, ~2.5 ms step and
~2.3 ms host+commit unwaited against ~2.8 and ~2.7 waited, with `host` ~2.2-2.3.

The step is the serving loop's: the host reserves on its mirror and commits, the
executor's jitted step applies the in-place growth (what the removed
`--reserve=host` measured; records made with `--reserve=device` timed a step that
reserved in its program, which the scheduler no longer runs).

Telemetry modes, measured in the same run on the same workload:
  * `off`: `stats_every=0, snapshot_every=0` (the bare step);
  * `stats`: the cheap `metrics.StepStats` every step (from the pool's host
    mirror, no device work) and the full snapshot every 100 steps (the default);
  * `budget`: the cheap figures paced by `stats_budget=0.02` (every step where they
    cost at most 2% of the rest of the step, else every k steps);
  * `full`: the full host `PoolSnapshot` every step (the old default).

The `stats ms` column is the host time the cheap figures take per step, timed
directly (`metrics.step_stats_host`, wrapped in this run), so it does not depend
on two noisy runs agreeing; `vs off` compares against the `off` run of the same
configuration.

On CPU the "device" is this CPU, so the jitted growth and commits run here too;
on a GPU they are asynchronous device work and the host part is what remains.

Usage:
  PYTHONPATH=. .venv/bin/python benchmarks/bench_scheduler.py                      # all pools, batch 32,256
  PYTHONPATH=. .venv/bin/python benchmarks/bench_scheduler.py --pools=4096,65536 --batch=32 --steps=100
"""

from __future__ import annotations

import statistics
import time

import jax
import numpy as np
from absl import app, flags

from benchmarks import records, shared_flags
import paged_kv
from paged_kv.pool import block_pool as pool_module
from paged_kv.sim import workload
from paged_kv.scheduler.executor import DryExecutor
from paged_kv.scheduler.scheduler import Scheduler, SchedulerConfig
from paged_kv.telemetry import metrics

_POOLS = flags.DEFINE_list("pools", ["4096", "65536", "262144", "1048576"],
                           "Pool sizes in blocks.")
_BATCH = flags.DEFINE_list("batch", ["32", "256"], "Running sequences per step.")
_MODES = flags.DEFINE_list("modes", ["off", "stats", "budget", "full"], "Telemetry modes.")
_STEPS = flags.DEFINE_integer("steps", 200, "Timed steps per configuration.")
_WARMUP = flags.DEFINE_integer("warmup", 60, "Untimed steps first (compilation).")
_REPEATS = shared_flags.define_repeats(3, "Runs per configuration (median of medians).")
_BLOCK_SIZE = shared_flags.define_block_size()
_SEED = shared_flags.define_seed("Workload seed.")
_RECORD = shared_flags.define_record()
_COMPILE_CACHE = shared_flags.define_compile_cache()

MODES = {
    "off": dict(stats_every=0, snapshot_every=0),
    "stats": dict(stats_every=1, snapshot_every=100),
    "budget": dict(stats_every=1, stats_budget=0.02, snapshot_every=100),
    "full": dict(stats_every=1, snapshot_every=1),
}


class _StatsTimer:
  """Accumulates the host seconds of the cheap figures (`metrics.step_stats_host`)."""

  def __init__(self):
    self.seconds = 0.0
    self._compute = metrics.step_stats_host

  def __enter__(self):
    timer = self

    def compute(*args, **kwargs):
      t0 = time.perf_counter()
      try:
        return timer._compute(*args, **kwargs)
      finally:
        timer.seconds += time.perf_counter() - t0

    metrics.step_stats_host = compute
    return self

  def __exit__(self, *exc):
    metrics.step_stats_host = self._compute


class _CommitTimer:
  """Accumulates the seconds of the pool's commits (`paged_kv.pool.block_pool.commit`, each
  waited for: device work, like the executor's step)."""

  def __init__(self):
    self.seconds = 0.0
    self.calls = 0
    self._commit = pool_module.commit

  def __enter__(self):
    timer, inner = self, self._commit

    def commit(*args, **kwargs):
      t0 = time.perf_counter()
      out = inner(*args, **kwargs)
      jax.block_until_ready(out)
      timer.seconds += time.perf_counter() - t0
      timer.calls += 1
      return out

    commit.lower = inner.lower  # a warm-up lowers the program ahead
    pool_module.commit = commit
    return self

  def __exit__(self, *exc):
    pool_module.commit = self._commit


class TimedExecutor(DryExecutor):
  """`DryExecutor` that accumulates the seconds spent in its `step` (results ready)."""

  def __init__(self, config):
    super().__init__(config)
    self.seconds = 0.0

  def step(self, state, plan):
    t0 = time.perf_counter()
    state, nxt, status = super().step(state, plan)
    jax.block_until_ready(state)  # the device work, waited for to time it
    self.seconds += time.perf_counter() - t0
    return state, nxt, status


def _run(num_blocks: int, batch: int, mode: str, seed: int
         ) -> tuple[float, float, float, float, int]:
  """What `FIELDS` names, of one configuration (step, executor and commit times
  are medians over the steps; a step's commit time is its commits' sum)."""
  bs = _BLOCK_SIZE.value
  config = paged_kv.PoolConfig(num_blocks=num_blocks, block_size=bs, num_layers=1,
                               num_kv_heads=1, head_dim=2, dtype="bfloat16",
                               max_seqs=batch, max_segments=64)
  pool = paged_kv.BlockPool(config)
  executor = TimedExecutor(config)
  sched = Scheduler(pool, executor, SchedulerConfig(
      max_batch=batch, prefill_token_budget=8 * bs * 4, prefill_chunk=bs * 4,
      compaction=None, output_reserve_ratio=0.0, **MODES[mode]))
  chat = workload.ChatWorkload(workload.ChatShape.host_benchmark(bs), seed)

  sched.warmup(progress=False)
  for _ in range(_WARMUP.value):
    chat.top_up(sched, batch)
    sched.step()
  times, exec_times, commit_times, host_times = [], [], [], []
  before = sched.runtime
  with _StatsTimer() as timer, _CommitTimer() as commits:
    for _ in range(_STEPS.value):
      chat.top_up(sched, batch)
      executor.seconds = commits.seconds = 0.0
      t0 = time.perf_counter()
      sched.step()
      times.append(time.perf_counter() - t0)
      exec_times.append(executor.seconds)
      commit_times.append(commits.seconds)
      host_times.append(times[-1] - executor.seconds - commits.seconds)
    num_commits = commits.calls
  traffic = sched.runtime.since(before)
  sched.check_invariants()
  return (1e3 * statistics.median(times), 1e3 * float(np.percentile(times, 90)),
          1e3 * statistics.median(exec_times), 1e3 * timer.seconds / _STEPS.value,
          sched.stats_interval if mode != "off" else 0,
          traffic.bookkeeping_dispatches / _STEPS.value, traffic.blocking_reads / _STEPS.value,
          sched.stats.compiles_after_warmup, 1e3 * statistics.median(commit_times),
          1e3 * statistics.median(host_times), num_commits / _STEPS.value)


FIELDS = ("step_ms", "p90_ms", "executor_ms", "stats_ms", "stats_every", "dispatches",
          "reads", "compiles", "commit_ms", "host_ms", "commits")
"""What `_run` returns, in order (per step)."""


def main(argv):
  del argv
  _COMPILE_CACHE.enable()
  rec = records.Recorder(_RECORD.value, "bench_scheduler", flag_values=records.script_flags(),
                         seeds=[_SEED.value + r for r in range(_REPEATS.value)])
  configs = [(batch, n, mode) for batch in map(int, _BATCH.value)
             for n in map(int, _POOLS.value) for mode in _MODES.value]
  runs: dict[tuple, list[tuple]] = {c: [] for c in configs}
  # Repeats outermost: every configuration runs once per round, so ratios between
  # configurations are paired within a round (the same minutes of a shared machine).
  for r in range(_REPEATS.value):
    for batch, num_blocks, mode in configs:
      out = _run(num_blocks, batch, mode, _SEED.value + r)
      runs[(batch, num_blocks, mode)].append(out)
      print(f"round {r} batch {batch:4d} pool {num_blocks:8d} {mode:6s}: step {out[0]:7.3f} ms "
            f"(p90 {out[1]:7.3f}), executor {out[2]:7.3f} ms, commit {out[8]:7.3f} ms, "
            f"host {out[9]:7.3f} ms, stats {out[3]:6.3f} ms", flush=True)
  print("\nHost time per scheduler step (ms; median of "
        f"{_REPEATS.value} rounds x {_STEPS.value} steps; DryExecutor). 'executor': its "
        "jitted step (the in-place growth), waited for (device work; on this CPU it runs "
        "on the host); 'commit': "
        "the pool's commits of the step (the jitted program applying the mirror's "
        "changes), waited for (device work too), 'commits': their number per step; "
        "'host': the step's own host work, step - executor - commit per step (issue T's "
        "host time); 'host+commit': step - executor (the older 'host' figure); 'stats': "
        "the cheap figures' host ms per step (timed directly), 'share': of the rest of "
        "the step, 'every': their interval in steps at the end; 'bk/step': bookkeeping "
        "dispatches per step, 'reads/step': blocking host reads per step, 'compiles': "
        "after warm-up; ratios paired per round, median [min-max]")
  print(f"{'batch':>5} {'blocks':>8} {'mode':>6} {'step':>8} {'p90':>8} {'executor':>8} "
        f"{'commit':>7} {'commits':>7} {'host':>8} {'host+commit':>11} {'stats':>7} "
        f"{'share':>6} {'every':>5} {'vs smallest pool':>24} "
        f"{'vs off':>24} {'bk/step':>7} {'reads/step':>10} {'compiles':>8}")
  smallest = int(_POOLS.value[0])
  for batch, n, mode in configs:
    mine = runs[(batch, n, mode)]
    (med, p90, ex, tel, every, disp, reads, comp, cm, host,
     ncm) = (statistics.median(x) for x in zip(*mine))
    vs_small = records.format_median_range(
        [a[0] / b[0] for a, b in zip(mine, runs[(batch, smallest, mode)])], suffix="x")
    off = runs.get((batch, n, "off"))
    vs_off = (records.format_median_range([a[0] / b[0] for a, b in zip(mine, off)], suffix="x")
              if off else "-")
    share = 100 * tel / max(med - tel, 1e-9)
    print(f"{batch:5d} {n:8d} {mode:>6} {med:8.3f} {p90:8.3f} {ex:8.3f} {cm:7.3f} {ncm:7.2f} "
          f"{host:8.3f} {med - ex:11.3f} {tel:7.3f} {share:5.1f}% {every:5.0f} {vs_small:>24} "
          f"{vs_off:>24} {disp:7.2f} {reads:10.2f} {comp:8.0f}")
  rec.write({"steps": _STEPS.value, "warmup": _WARMUP.value, "repeats": _REPEATS.value,
             "runs": [dict(batch=b, num_blocks=n, mode=m,
                           rounds=[dict(zip(FIELDS, out)) for out in runs[(b, n, m)]])
                      for b, n, m in configs]})


if __name__ == "__main__":
  app.run(main)
