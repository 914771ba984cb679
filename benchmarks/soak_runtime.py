"""Soak the serving path after `Scheduler.warmup()`: no new compiles, flat maps, flat RSS.

A server that compiles without bound dies: each XLA CPU executable holds ~30 memory
mappings and the process reaches `vm.max_map_count`. This script warms a
`Scheduler` up (`DryExecutor`, swap preemption, the default compaction policy,
prefix cache on), then serves a varied workload for `--seconds` of wall time
(`PAGED_KV_SOAK_SECONDS` overrides it) and counts what the runtime does:

* **prompts** of 1 to the most tokens `Scheduler.submit` accepts
  (`max_segments * block_size` minus the output, and what the pool after the
  shrink can hold), lengths drawn log-uniformly; outputs 1..256 tokens, uniform.
  Every `--long_burst_every`-th burst is long (long documents, long answers):
  prompts from `--long_low` of the most up, outputs 128..256. That is the
  pressure that makes swap preemption happen. Admission goes by the prompt
  alone (`--output_reserve_ratio=0`), so decodes run out of blocks. With the
  default sizes the table holds at most `max_seqs * max_segments` = 4,096
  blocks, the whole pool: live sequences press it only after the shrink (pass
  a smaller `--num_blocks` for pressure throughout);
* **bursts**: a burst submits `--burst_size` requests at once, then a quiet phase
  (a trickle of `--trickle` requests per step) lets the queue drain (nothing
  waiting or swapped, at most half a batch running) before the next burst;
* **tenants**: `--tenants` namespaces drawn Zipf-like (`--zipf`), and a few shared
  system prompts (`--system_prompts`) prefixing `--shared_share` of the prompts;
* **persistence**: every `--save_every` steps the prefix cache is saved
  (`CachedPool.save`) into a temporary directory;
* **shrink**: once, half-way, `Scheduler.shrink_to(0.75 * num_blocks)` (retried
  every `--shrink_retry_steps` steps while it raises `PoolExhausted`), and serving
  goes on. The cut changes the pool's shapes, so the programs that take the pool
  compile again for the new shapes (in the cut's step when the scheduler
  re-warms there, else when first used): those compiles are counted apart.

Finished requests are taken off `sched.finished` after every step, as a server
hands them back. At the deadline feeding stops, the queue drains (and a pending
shrink reaches its cut) and a last sample is taken.

Every `--sample_every_seconds`: elapsed seconds, steps, requests finished, XLA
compiles since warm-up (`counters.backend_compiles()`), persistent-cache loads
since warm-up (`counters.cache_loads()`), the script's own log of both (JAX's
compile event, which also fires on a load: every new executable costs memory
mappings) split into the shrink's and the others, lines of `/proc/self/maps`,
RSS, blocking reads since warm-up (and the parts the saves did, which read the
cache's K/V, and the cut's step did), bookkeeping dispatches since warm-up. Each
compile after warm-up is logged with its program name (`jax.monitoring`'s
`fun_name`) and the phase it happened in (a step, a save, the `shrink_to` call,
the step of the cut, a step or save after it). A compile is the shrink's when it
happened in `shrink_to` or in the cut's step, or after the cut in a program the
warm-up compiled, up to as many compiles of it as the warm-up had (the same
programs at the new shapes); every other compile after warm-up is a failure of
"compile once".

Verdicts (one line each): compiles after warm-up outside the shrink (goal 0) and
the shrink's (at most what the warm-up compiled, plus `CUT_PROGRAMS` for the cut
itself: the resize and its free list); memory mappings flat (last
sample / first sample after warm-up, at most x1.02; also / the sample after the
shrink's last recompile); RSS within 10% (the same ratios); blocking reads
outside the saves and the cut's step (goal 0). Then the samples as a table; with
`--out_dir`, `samples.csv`, `compiles.csv` (every compile after warm-up) and
`soak_runtime.png` (compiles, mappings and RSS against time; matplotlib optional).

glibc's malloc thresholds are fixed at the start (`--return_freed_memory`, on by
default; `paged_kv.runtime.host_memory`): with its dynamic defaults, freed host
buffers (swapped-out K/V, saves, XLA's buffers, the old pool at the cut) stay
resident and RSS creeps.

The persistent compilation cache is on by default (as in the other scripts);
point `PAGED_KV_COMPILE_CACHE` at an empty directory, or pass `--nocompile_cache`,
to see compiles rather than loads.

Usage:
  PYTHONPATH=. python benchmarks/soak_runtime.py                     # 60 s, defaults
  PYTHONPATH=. python benchmarks/soak_runtime.py --seconds=1800      # the 30-minute goal
  PAGED_KV_SOAK_SECONDS=300 PYTHONPATH=. python benchmarks/soak_runtime.py --out_dir=/tmp/soak
"""

from __future__ import annotations

import collections
import csv
import dataclasses
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

from absl import app, flags
import jax
import numpy as np

from benchmarks import records, shared_flags
import paged_kv
from paged_kv.runtime import counters, host_memory
from paged_kv.cache.cached_pool import CachedPool
from paged_kv.scheduler.executor import DryExecutor
from paged_kv.scheduler.scheduler import Request, Scheduler, SchedulerConfig

_NUM_BLOCKS = flags.DEFINE_integer("num_blocks", 4096, "Blocks in the pool.")
_BLOCK_SIZE = shared_flags.define_block_size()
_MAX_SEQS = flags.DEFINE_integer("max_seqs", 64, "Rows of the segment table.")
_MAX_SEGMENTS = flags.DEFINE_integer("max_segments", 64, "Segments per row.")
_MAX_BATCH = flags.DEFINE_integer("max_batch", 0, "Sequences per step (0: max_seqs).")
_PREFILL_BUDGET = flags.DEFINE_integer("prefill_token_budget", 512, "Prompt tokens per step.")
_PREFILL_CHUNK = flags.DEFINE_integer("prefill_chunk", 128, "Prompt tokens per sequence "
                                      "per step.")
_PREEMPTION = flags.DEFINE_enum("preemption", "swap", ["recompute", "swap"],
                                "How to preempt under pressure.")
_RESERVE = flags.DEFINE_float("output_reserve_ratio", 0.0, "Admission keeps this share of "
                              "the running outputs' blocks free (0: admit on the prompt "
                              "alone, so pressure preempts).")
_SECONDS = flags.DEFINE_float("seconds", 60.0, "Wall seconds of feeding "
                              "(PAGED_KV_SOAK_SECONDS overrides it when set).")
_TENANTS = flags.DEFINE_integer("tenants", 200, "Namespaces (tenants), drawn Zipf-like.")
_ZIPF = flags.DEFINE_float("zipf", 1.1, "Zipf exponent of the tenant draw.")
_SYSTEM_PROMPTS = flags.DEFINE_integer("system_prompts", 4, "Shared system prompts.")
_SHARED_SHARE = flags.DEFINE_float("shared_share", 0.7, "Share of prompts that start with "
                                   "a system prompt.")
_MAX_OUTPUT = flags.DEFINE_integer("max_output", 256, "Most output tokens of a request.")
_BURST_SIZE = flags.DEFINE_integer("burst_size", 0, "Requests a burst submits at once "
                                   "(0: 4 * max_batch).")
_LONG_BURST_EVERY = flags.DEFINE_integer("long_burst_every", 3, "Every k-th burst is long: "
                                         "long prompts and outputs (0: never).")
_LONG_LOW = flags.DEFINE_float("long_low", 0.75, "A long burst's prompts are drawn from this "
                               "share of the most tokens up (log-uniform).")
_TRICKLE = flags.DEFINE_float("trickle", 0.05, "Requests per step in a quiet phase "
                               "(Poisson).")
_SAVE_EVERY = flags.DEFINE_integer("save_every", 500, "Steps between prefix-cache saves "
                                   "(0: never).")
_SHRINK_FRACTION = flags.DEFINE_float("shrink_fraction", 0.75, "Half-way, shrink the pool to "
                                      "this share of its blocks (0: no shrink).")
_SHRINK_RETRY = flags.DEFINE_integer("shrink_retry_steps", 20, "Steps between tries of a "
                                     "shrink refused with PoolExhausted.")
_SAMPLE_EVERY = flags.DEFINE_float("sample_every_seconds", 10.0, "Wall seconds between "
                                   "samples.")
_OUT_DIR = flags.DEFINE_string("out_dir", "/tmp/soak_runtime", "Where the CSVs and the PNG "
                               "go ('': nowhere).")
_SEED = shared_flags.define_seed()
_PROGRESS = shared_flags.define_progress("Progress bar during warm-up (tqdm).")
_RECORD = shared_flags.define_record()
_COMPILE_CACHE = shared_flags.define_compile_cache()
_RETURN_FREED = flags.DEFINE_bool("return_freed_memory", True, "Fix glibc malloc's "
                                  "thresholds so that freed large buffers go back to the OS "
                                  "(`paged_kv.runtime.host_memory`; keeps RSS flat).")

SECONDS_ENV = "PAGED_KV_SOAK_SECONDS"
MAPS_FLAT = 1.02  # mappings: last / reference at most this
RSS_FLAT = 1.10  # RSS: last / first at most this
CUT_PROGRAMS = 2  # the shrink may compile the warm-up's set again plus this many (the cut)
_VOCAB = 32000
_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@dataclasses.dataclass(frozen=True)
class Compile:
  """One XLA backend compile: program name, phase and time (after warm-up: step)."""

  name: str
  phase: str
  step: int
  elapsed_s: float
  shrink: bool = False  # attributed to the shrink's new shapes


class CompileLog:
  """Every new executable of the process (compiled, or loaded from the persistent
  cache) with its program's name and the phase it happened in.

  `jax.monitoring` passes the name (`fun_name`) with the duration event that
  `counters` counts (it fires on a load too; `backend_compiles()` subtracts those).
  """

  def __init__(self):
    self.phase = "before warm-up"
    self.step = -1
    self.t0 = time.perf_counter()
    self.events: list[Compile] = []
    self.warm_counts: collections.Counter[str] = collections.Counter()  # compiles per program
    self.recompiled: collections.Counter[str] = collections.Counter()  # ... since the cut
    jax.monitoring.register_event_duration_secs_listener(self._on_duration)

  def _on_duration(self, event: str, duration: float, **kwargs) -> None:
    del duration
    if event == _BACKEND_COMPILE_EVENT:
      self.events.append(Compile(str(kwargs.get("fun_name", "?")), self.phase, self.step,
                                 time.perf_counter() - self.t0))

  def attribute(self, start: int, *, cut_step: bool = False) -> None:
    """Marks the compiles from index `start` on that the shrink explains.

    Once the pool was cut, the shrink explains as many compiles of each program
    as the warm-up compiled of it (the same programs at the new shapes), and in
    the cut's step also the programs of the cut itself; any compile beyond that
    is not the shrink's.
    """
    for i in range(start, len(self.events)):
      e = self.events[i]
      explained = cut_step
      if self.recompiled[e.name] < self.warm_counts[e.name]:
        self.recompiled[e.name] += 1
        explained = True
      self.events[i] = dataclasses.replace(e, shrink=explained,
                                           phase="cut step" if cut_step else e.phase)


def log_uniform_int(rng: np.random.Generator, low: int, high: int) -> int:
  """An int in `[low, high]`, its logarithm uniform."""
  low = max(1, low)
  high = max(low, high)
  return min(high, int(math.exp(rng.uniform(math.log(low), math.log(high + 1)))))


class Workload:
  """Bursts and quiet phases of requests from Zipf-drawn tenants (see the docstring)."""

  def __init__(self, rng: np.random.Generator, *, max_tokens: int, block_size: int,
               burst_size: int, drained_below: int):
    self.rng = rng
    self.max_tokens = max_tokens
    self.burst_size = burst_size
    self.drained_below = drained_below
    weights = 1.0 / np.arange(1, _TENANTS.value + 1) ** _ZIPF.value
    self.tenant_p = weights / weights.sum()
    top = max(block_size, max_tokens // 4)
    self.system = [rng.integers(0, _VOCAB, log_uniform_int(rng, block_size, top))
                   for _ in range(_SYSTEM_PROMPTS.value)]
    self.bursts = 0
    self.long_bursts = 0
    self.submitted = 0
    self.refused = 0

  def request(self, long: bool) -> Request:
    rng = self.rng
    top = min(_MAX_OUTPUT.value, self.max_tokens - 1)
    out = int(rng.integers(max(1, top // 2) if long else 1, top + 1))
    most = self.max_tokens - out
    n = log_uniform_int(rng, max(1, int(_LONG_LOW.value * most)) if long else 1, most)
    tenant = int(rng.choice(self.tenant_p.size, p=self.tenant_p))
    if self.system and rng.random() < _SHARED_SHARE.value:
      system = self.system[int(rng.integers(len(self.system)))]
      prompt = np.concatenate([system[:n], rng.integers(0, _VOCAB, max(0, n - system.size))])
    else:
      prompt = rng.integers(0, _VOCAB, n)
    return Request(self.submitted + self.refused, prompt, out, namespace=f"tenant-{tenant}")

  def feed(self, sched: Scheduler) -> None:
    """A burst when the queue drained, else the quiet phase's trickle."""
    drained = (not sched.waiting and not sched.swapped
               and len(sched.running) <= self.drained_below)
    if drained:
      self.bursts += 1
      every = _LONG_BURST_EVERY.value
      long = every > 0 and self.bursts % every == 0
      self.long_bursts += long
      self._submit(sched, self.burst_size, long)
    else:
      self._submit(sched, int(self.rng.poisson(_TRICKLE.value)), False)

  def _submit(self, sched: Scheduler, num: int, long: bool) -> None:
    for _ in range(num):
      try:
        sched.submit(self.request(long))
        self.submitted += 1
      except paged_kv.PoolExhausted:
        self.refused += 1  # a request the pool could never run (none, by construction)


def max_request_tokens(config: paged_kv.PoolConfig, target_blocks: int,
                       watermark_blocks: int) -> int:
  """Most prompt + output tokens `Scheduler.submit` accepts, before and after the shrink.

  `submit` refuses `cdiv(prompt, bs) + cdiv(output, bs) + 2 + watermark` above the
  dynamic blocks and `cdiv(prompt + output, bs)` above `max_segments`;
  `cdiv(a) + cdiv(b) <= cdiv(a + b) + 1` gives the bound on the sum.
  """
  bs = config.block_size
  dynamic = min(config.num_blocks, target_blocks) - config.num_base_blocks
  return min(config.max_segments * bs, (dynamic - 3 - watermark_blocks) * bs)


@dataclasses.dataclass
class SoakState:
  """What the loop tracks besides the scheduler."""

  t0: float
  base_runtime: counters.RuntimeCounters  # the pool's counters at the end of warm-up
  compiles0: int
  loads0: int
  steps: int = 0
  saves: int = 0
  save_reads: int = 0  # blocking reads the saves did
  cut_reads: int = 0  # blocking reads in the step of the cut (a re-warm of the new size)
  save_seconds: float = 0.0
  shrink_requested_s: float = -1.0
  shrink_tries: int = 0
  cut_s: float = -1.0
  cut_step: int = -1


def sample(sched: Scheduler, st: SoakState, log: CompileLog, finished: int) -> dict:
  """One row of the samples (counts since warm-up unless named otherwise)."""
  rt = sched.pool.runtime.snapshot().since(st.base_runtime)
  logged = len(log.events)  # new executables: compiles and persistent-cache loads
  shrink = sum(e.shrink for e in log.events)
  return dict(
      elapsed_s=round(time.perf_counter() - st.t0, 2), steps=st.steps, finished=finished,
      compiles_since_warmup=counters.backend_compiles() - st.compiles0,
      cache_loads_since_warmup=counters.cache_loads() - st.loads0,
      logged_compiles=logged, shrink_compiles=shrink, other_compiles=logged - shrink,
      memory_mappings=counters.memory_mappings(),
      rss_mb=round(counters.resident_bytes() / 2**20, 1),
      blocking_reads=rt.blocking_reads, save_reads=st.save_reads, cut_reads=st.cut_reads,
      bookkeeping_dispatches=rt.bookkeeping_dispatches,
      pool_blocks=sched.pool.config.num_blocks, running=len(sched.running),
      waiting=len(sched.waiting), swapped=len(sched.swapped),
      preemptions_swap=sched.stats.preemptions_swap, saves=st.saves)


def write_csv(path: Path, rows: list[dict]) -> None:
  with open(path, "w", newline="") as f:
    if not rows:
      return
    w = csv.DictWriter(f, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)


def write_plot(path: Path, rows: list[dict], st: SoakState, title: str) -> Path | None:
  """Compiles, mappings and RSS against time (3 panels, shared x); None without matplotlib."""
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  except ImportError:
    print("matplotlib not installed (pip install 'paged-kv[plots]'): no plot")
    return None
  t = [r["elapsed_s"] for r in rows]
  fig, axes = plt.subplots(3, 1, sharex=True, figsize=(9, 7.5))
  ax = axes[0]
  ax.step(t, [r["logged_compiles"] for r in rows], where="post", label="all")
  ax.step(t, [r["shrink_compiles"] for r in rows], where="post", ls="--",
          label="the shrink's (new shapes)")
  ax.step(t, [r["other_compiles"] for r in rows], where="post", ls=":", lw=2,
          label="others (goal 0)")
  ax.set_ylabel("compiles (and loads)\nsince warm-up")
  ax.legend(loc="upper left", fontsize=8)
  axes[1].plot(t, [r["memory_mappings"] for r in rows], marker=".")
  axes[1].set_ylabel("memory mappings\n(/proc/self/maps)")
  axes[2].plot(t, [r["rss_mb"] for r in rows], marker=".")
  axes[2].set_ylabel("RSS (MB)")
  axes[2].set_xlabel("seconds since warm-up")
  for ax in axes:
    ax.grid(alpha=0.3)
    if st.shrink_requested_s >= 0:
      ax.axvline(st.shrink_requested_s, color="gray", ls="--", lw=1)
    if st.cut_s >= 0:
      ax.axvline(st.cut_s, color="red", lw=1)
  if st.cut_s >= 0 or st.shrink_requested_s >= 0:
    axes[0].text(max(st.cut_s, st.shrink_requested_s), axes[0].get_ylim()[1], " shrink",
                 color="red", va="top", fontsize=8)
  fig.suptitle(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def ratio(a: float, b: float) -> float:
  return a / b if b > 0 else float("nan")


def main(argv):
  del argv
  rec = records.Recorder(_RECORD.value, "soak_runtime", flag_values=records.script_flags(),
                         seeds=[_SEED.value])
  if _RETURN_FREED.value:
    host_memory.return_freed_memory()
  _COMPILE_CACHE.enable()
  seconds = float(os.environ.get(SECONDS_ENV) or _SECONDS.value)
  log = CompileLog()
  config = paged_kv.PoolConfig(num_blocks=_NUM_BLOCKS.value, block_size=_BLOCK_SIZE.value,
                               max_seqs=_MAX_SEQS.value, max_segments=_MAX_SEGMENTS.value)
  max_batch = _MAX_BATCH.value or config.max_seqs
  sched_config = SchedulerConfig(max_batch=max_batch, preemption=_PREEMPTION.value,
                                 prefill_token_budget=_PREFILL_BUDGET.value,
                                 prefill_chunk=_PREFILL_CHUNK.value, enable_prefix_cache=True,
                                 output_reserve_ratio=_RESERVE.value)
  sched = Scheduler(paged_kv.BlockPool(config), DryExecutor(config), sched_config)
  target = int(_SHRINK_FRACTION.value * config.num_blocks) if _SHRINK_FRACTION.value else 0
  max_tokens = max_request_tokens(config, target or config.num_blocks,
                                  sched_config.watermark_blocks)
  print(f"pool: {config.num_blocks} blocks x {config.block_size} tokens, {config.max_seqs} "
        f"rows x {config.max_segments} segments; max_batch {max_batch}; {_PREEMPTION.value} "
        f"preemption; requests up to {max_tokens} tokens; shrink to {target or '-'} blocks "
        f"half-way; {seconds:g} s; seed {_SEED.value}")

  log.phase = "warm-up"
  report = sched.warmup(progress=_PROGRESS.value)
  print(report, flush=True)
  log.warm_counts.update(e.name for e in log.events)
  st = SoakState(t0=time.perf_counter(), base_runtime=sched.pool.runtime.snapshot(),
                 compiles0=counters.backend_compiles(), loads0=counters.cache_loads())
  log.events.clear()  # from here on: the compiles after warm-up, as the counter counts them
  log.t0 = st.t0
  rng = np.random.default_rng(_SEED.value)
  workload = Workload(rng, max_tokens=max_tokens, block_size=config.block_size,
                      burst_size=_BURST_SIZE.value or 4 * max_batch,
                      drained_below=max(1, max_batch // 2))
  save_dir = tempfile.mkdtemp(prefix="soak_runtime_")
  save_path = os.path.join(save_dir, "prefix_cache.npz")
  finished = 0
  rows = [sample(sched, st, log, finished)]
  next_sample = st.t0 + _SAMPLE_EVERY.value
  deadline = st.t0 + seconds
  shrink_at, next_shrink_try = st.t0 + seconds / 2, 0
  events: list[tuple[str, int, int, int]] = []  # (what, step, compiles before, after)

  def cut_done() -> bool:
    return st.cut_step >= 0

  def pending_shrink() -> bool:
    s = sched.shrink_status
    return s is not None and s.done_step < 0 and not s.cancelled

  while True:
    now = time.perf_counter()
    feeding = now < deadline
    if feeding:
      workload.feed(sched)
    if (target and st.shrink_requested_s < 0 and now >= shrink_at
        and st.steps >= next_shrink_try):
      st.shrink_tries += 1
      log.phase, n0 = "shrink_to", len(log.events)
      try:
        sched.shrink_to(target)
        st.shrink_requested_s = now - st.t0
        print(f"shrink to {target} blocks requested at {st.shrink_requested_s:.0f} s "
              f"(step {st.steps}, try {st.shrink_tries})", flush=True)
      except paged_kv.PoolExhausted as e:
        next_shrink_try = st.steps + _SHRINK_RETRY.value
        if st.shrink_tries == 1:
          print(f"shrink refused for now ({e}); retrying every {_SHRINK_RETRY.value} steps")
      for i in range(n0, len(log.events)):  # compiles the request caused
        log.events[i] = dataclasses.replace(log.events[i], shrink=True)
      events.append(("shrink_to", st.steps, n0, len(log.events)))
    if now >= next_sample:
      rows.append(sample(sched, st, log, finished))
      next_sample += _SAMPLE_EVERY.value * max(1, math.ceil((now - next_sample)
                                                            / _SAMPLE_EVERY.value))
    if sched.idle and not pending_shrink():
      if feeding:
        continue
      break
    log.phase = "step after cut" if cut_done() else "step"
    log.step, n0 = st.steps, len(log.events)
    shrinks = sched.stats.shrinks
    r0 = sched.pool.runtime.snapshot() if pending_shrink() else None
    sched.step()
    st.steps += 1
    finished += len(sched.finished)
    sched.take_finished()  # handed back, as a server does
    if sched.stats.shrinks > shrinks:
      st.cut_s, st.cut_step = time.perf_counter() - st.t0, st.steps - 1
      st.cut_reads = sched.pool.runtime.snapshot().since(r0).blocking_reads
      log.attribute(n0, cut_step=True)
      events.append(("cut", st.cut_step, n0, len(log.events)))
      print(f"pool cut to {sched.pool.config.num_blocks} blocks at {st.cut_s:.0f} s "
            f"(step {st.cut_step}; {sched.shrink_status.moves} moves, "
            f"{sched.shrink_status.evicted_blocks} cached blocks evicted)", flush=True)
    elif cut_done():
      log.attribute(n0)
    if _SAVE_EVERY.value and st.steps % _SAVE_EVERY.value == 0 and sched.cache is not None:
      log.phase = "save after cut" if cut_done() else "save"
      n0, r0, t_save = len(log.events), sched.pool.runtime.snapshot(), time.perf_counter()
      sched.cached_pool.save(save_path)
      st.save_seconds += time.perf_counter() - t_save
      st.save_reads += sched.pool.runtime.snapshot().since(r0).blocking_reads
      st.saves += 1
      if cut_done():
        log.attribute(n0)
      if len(log.events) > n0:
        events.append(("save", st.steps, n0, len(log.events)))
  rows.append(sample(sched, st, log, finished))
  wall = time.perf_counter() - st.t0

  # After the measured window: the invariants, and the last save restores.
  sched.check_invariants()
  restored = -1
  if st.saves:
    cp = CachedPool(paged_kv.BlockPool(sched.pool.config))
    cp.restore(save_path)
    cp.check_invariants()
    restored = cp.cache.num_tokens
  shutil.rmtree(save_dir, ignore_errors=True)

  first, last = rows[0], rows[-1]
  other = [e for e in log.events[:last["logged_compiles"]] if not e.shrink]
  shrink_compiles = last["shrink_compiles"]
  settled = next((r for r in rows if r["shrink_compiles"] == shrink_compiles
                  and r["elapsed_s"] >= max(st.cut_s, 0)), first)
  maps_ratio = ratio(last["memory_mappings"], first["memory_mappings"])
  maps_settled = ratio(last["memory_mappings"], settled["memory_mappings"])
  rss_ratio = ratio(last["rss_mb"], first["rss_mb"])
  outside_reads = last["blocking_reads"] - last["save_reads"] - last["cut_reads"]
  bound = max(report.programs, report.compiles + report.cache_loads) + CUT_PROGRAMS
  s = sched.stats

  print(f"\nserved {wall:.0f} s: {st.steps} steps, {workload.submitted} submitted "
        f"({workload.refused} refused), {finished} finished; {workload.bursts} bursts "
        f"({workload.long_bursts} long); preemptions {s.preemptions} (swap "
        f"{s.preemptions_swap}, recompute {s.preemptions_recompute}); prefix-cache hit rate "
        f"{s.prefix_cache_hit_rate:.1%}; evictions {s.evictions}; compactions "
        f"{s.compactions}; {st.saves} saves ({st.save_seconds:.1f} s, {st.save_reads} "
        f"blocking reads), last one restored {restored} tokens; shrink: "
        + (f"cut to {sched.pool.config.num_blocks} blocks at {st.cut_s:.0f} s"
           if cut_done() else "no cut" if target else "off")
        + f"; the scheduler holds {len(sched.snapshots)} snapshots and {len(sched.alerts)} "
        f"alerts")
  for what, step, a, b in events:
    if b > a:
      names = ", ".join(sorted({e.name for e in log.events[a:b]}))
      print(f"compiles at {what} (step {step}): {b - a} [{names}]")
  print(f"\nverdict: compiles after warm-up outside the shrink: {len(other)} (goal 0) -> "
        f"{'PASS' if not other else 'FAIL'}; the shrink's recompiles for the new shapes: "
        f"{shrink_compiles} (bound: the warm-up's {bound - CUT_PROGRAMS} + {CUT_PROGRAMS} for "
        f"the cut itself) -> "
        f"{'PASS' if shrink_compiles <= bound else 'FAIL'}; persistent-cache loads after "
        f"warm-up: {last['cache_loads_since_warmup']}")
  by_phase: dict[tuple[str, str], int] = {}
  for e in other:
    by_phase[(e.phase, e.name)] = by_phase.get((e.phase, e.name), 0) + 1
  for (phase, name), n in sorted(by_phase.items()):
    print(f"  compiled outside the shrink: {n} x {name} in phase '{phase}'")
  print(f"verdict: memory mappings {first['memory_mappings']} -> {last['memory_mappings']} "
        f"(x{maps_ratio:.3f}) -> {'PASS' if maps_ratio <= MAPS_FLAT else 'FAIL'} (flat: <= "
        f"x{MAPS_FLAT}); since the shrink's last recompile ({settled['elapsed_s']:.0f} s): "
        f"x{maps_settled:.3f}")
  print(f"verdict: RSS {first['rss_mb']:.0f} -> {last['rss_mb']:.0f} MB (x{rss_ratio:.3f}) -> "
        f"{'PASS' if rss_ratio <= RSS_FLAT else 'FAIL'} (within {RSS_FLAT - 1:.0%}); since "
        f"the shrink's last recompile: x{ratio(last['rss_mb'], settled['rss_mb']):.3f}")
  print(f"verdict: blocking reads after warm-up outside the saves and the cut: "
        f"{outside_reads} (goal 0) -> {'PASS' if outside_reads == 0 else 'FAIL'}; the "
        f"saves': {last['save_reads']}; the cut's step: {last['cut_reads']}")

  if _OUT_DIR.value:
    out_dir = Path(_OUT_DIR.value)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_csv(out_dir / "samples.csv", rows)
    write_csv(out_dir / "compiles.csv",
              [dataclasses.asdict(e) for e in log.events[:last["logged_compiles"]]])
    title = (f"benchmarks/soak_runtime.py: {config.num_blocks} blocks x {config.block_size} "
             f"tokens, {config.max_seqs} rows x {config.max_segments} segments, "
             f"{_PREEMPTION.value} preemption, {_TENANTS.value} tenants, seed {_SEED.value}"
             f"\n(dashed: shrink requested; red: pool cut to {target} blocks)")
    png = write_plot(out_dir / "soak_runtime.png", rows, st, title)
    print(f"\nsamples: {out_dir / 'samples.csv'}; compiles: {out_dir / 'compiles.csv'}"
          + (f"; plot: {png}" if png else ""))

  cols = ["elapsed_s", "steps", "finished", "compiles_since_warmup", "cache_loads_since_warmup",
          "shrink_compiles", "other_compiles", "memory_mappings", "rss_mb", "blocking_reads",
          "save_reads", "cut_reads", "bookkeeping_dispatches", "pool_blocks",
          "preemptions_swap"]
  print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
  for r in rows:
    print("| " + " | ".join(str(r[c]) for c in cols) + " |")
  rec.write({"seconds": seconds, "wall_s": wall, "steps": st.steps,
             "submitted": workload.submitted, "finished": finished,
             "cut_s": st.cut_s if cut_done() else None,
             "compiles_outside_shrink": len(other), "shrink_compiles": shrink_compiles,
             "shrink_compile_bound": bound, "maps_ratio": maps_ratio,
             "rss_ratio": rss_ratio, "outside_reads": outside_reads,
             "first": first, "last": last, "samples": rows})


if __name__ == "__main__":
  app.run(main)
