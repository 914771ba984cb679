"""Scheduler warm-up: run every program the serving path can run, once, up front.

Every jitted program a `Scheduler` runs takes its shapes from a small set derived
from the configs, which `program_runs` enumerates (the commits, the executor's steps,
persistence, swap and packing: `docs/serving_loop.md`); each run is on padding and
changes nothing. `warm` compiles them concurrently, then runs each once; after it, a
run the configs admit compiles nothing (`SchedulerStats.compiles_after_warmup`). A
shrink's cut changes every shape: `release_programs` drops the old size's programs.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import gc
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from paged_kv.pool.changes import CommitWidths
from paged_kv.model import ragged
from paged_kv.model.plan import PromptPositions, ReservedSlots, StepPlan, TailGrowth
from paged_kv.model.sampling import SamplingBatch
from paged_kv.runtime import counters
from paged_kv.scheduler import batching

if TYPE_CHECKING:
  from paged_kv.scheduler.scheduler import Scheduler


@dataclasses.dataclass(frozen=True)
class WarmupReport:
  """What `warm` did: `programs` run (one per shape), XLA `compiles` (their helpers'
  included, so it can exceed `programs`), `cache_loads` from JAX's persistent cache
  (also of what this warm-up's threads wrote moments before), wall `seconds`."""

  programs: int
  compiles: int
  cache_loads: int
  seconds: float

  def __str__(self) -> str:
    return (f"warm-up: {self.programs} programs run; {self.compiles} XLA compiles (the "
            f"programs' and their helpers'), {self.cache_loads} executables loaded from the "
            f"persistent cache, {self.seconds:.1f} s")


def token_buckets(max_tokens: int) -> list[int]:
  """The widths `ragged.bucket` gives totals `1..max_tokens`: powers of two."""
  return [1 << i for i in range(ragged.bucket(max_tokens).bit_length())]


@dataclasses.dataclass(frozen=True)
class ProgramRun:
  """One program of the serving path: `run()` runs it once on padding (changing
  nothing); `lower()`, where given, lowers it without running it (to compile it
  ahead, concurrently with others)."""

  name: str
  run: Callable[[], None]
  lower: Callable[[], object] | None = None


def program_runs(sched: "Scheduler", *, persistence: bool = True) -> list[ProgramRun]:
  """Every program the scheduler's serving path can run (`persistence`: and
  `CachedPool.save` / `restore`'s chunked K/V gather and write)."""
  pool, cfg = sched.pool, sched.config
  pc = pool.config
  runs: list[ProgramRun] = []
  for w in CommitWidths.all_for(pc):
    runs.append(ProgramRun(f"commit rows={w.rows} copies={w.copies} moves={w.moves}",
                           lambda w=w: pool.warm_commit(w), lambda w=w: pool.lower_commit(w)))
  seen_dry = set()
  decode_widths, mixed_widths = batching.token_widths(cfg)
  shapes = [(1, w, False) for w in decode_widths]
  shapes += [(cfg.prefill_chunk, w, False) for w in mixed_widths]
  if getattr(sched.executor, "prompt_logprobs", False):
    shapes += [(cfg.prefill_chunk, w, True) for w in mixed_widths]
  for mql, width, prompt in shapes:
    if not getattr(sched.executor, "uses_tokens", True):
      if mql in seen_dry:
        continue
      seen_dry.add(mql)
    lower = None
    if hasattr(sched.executor, "lower_step"):
      lower = lambda width=width, mql=mql, prompt=prompt: sched.executor.lower_step(
          pool.state, _padding_plan(sched, width, mql, prompt=prompt))
    runs.append(ProgramRun(f"step tokens={width} max_query_len={mql}"
                           + (" prompt_logprobs" if prompt else ""),
                           lambda width=width, mql=mql, prompt=prompt: _padding_step(
                               sched, width, mql, prompt=prompt), lower))
  k = cfg.decode_steps
  if k > 1 and hasattr(sched.executor, "decode_steps"):
    lower = None
    if hasattr(sched.executor, "lower_decode_steps"):
      lower = lambda: sched.executor.lower_decode_steps(
          pool.state, _padding_plan(sched, cfg.max_batch, 1, reserved=False),
          np.zeros((cfg.max_batch,), np.int32), num_steps=k)
    runs.append(ProgramRun(f"decode steps={k} tokens={cfg.max_batch}",
                           lambda: _padding_steps(sched, k), lower))
  if persistence:
    from paged_kv.cache import persist  # pylint: disable=g-import-not-at-top
    runs.append(ProgramRun(f"persistence chunk={persist.CHUNK_TOKENS}",
                           lambda: persist.warm_programs(pool)))
  if cfg.preemption == "swap":
    most = pc.max_segments * pc.block_size
    width = 16
    while True:
      runs.append(ProgramRun(f"swap tokens={width}", lambda width=width: pool.warm_data(width)))
      if width >= most:
        break
      width *= 2
  cache = sched.cache  # a view; None when caching is off
  if cache is not None and cache.pack_tails:
    for width in token_buckets(pc.num_blocks * pc.block_size):  # the pool pads to these
      runs.append(ProgramRun(f"pack segments={width}",
                             lambda width=width: _padding_pack(pool, width)))
  return runs


def _padding_pack(pool, width: int) -> None:
  """`pack_slots` and `reclaim_slots` on `width` padding entries, padded as
  `BlockPool`'s are: compiles, changes nothing."""
  from paged_kv.core import slots# pylint: disable=g-import-not-at-top
  neg = np.full((width,), -1, np.int32)
  zero = np.zeros((width,), np.int32)
  groups = np.zeros((pool.config.num_blocks,), np.int32)
  state, _ = slots.pack_slots(pool.state, neg, zero, neg, zero, zero, zero, groups,
                              config=pool.config, atomic=True)
  state, _ = slots.reclaim_slots(state, zero, zero, zero, config=pool.config)
  pool.state = state  # the mirror reloads from the device
  pool.runtime.dispatch("sync", 2)


def _padding_plan(sched: "Scheduler", width: int, max_query_len: int, *,
                  reserved: bool = True, prompt: bool = False) -> StepPlan:
  """A plan of padding rows shaped as `ForwardPass`'s plans: with host-reserved slots
  (all `-1`) unless `reserved` is False (the k-step decode's plan); with unused
  `PromptPositions` when `prompt`."""
  b = sched.config.max_batch
  sampling = (SamplingBatch.greedy(b) if getattr(sched.executor, "samples", False) else None)
  plan = StepPlan(seq_ids=np.full((b,), -1, np.int32), num_new=np.zeros((b,), np.int32),
                  tokens=np.zeros((width,), np.int32), max_query_len=max_query_len,
                  sampling=sampling, num_logprobs=sched.config.max_logprobs,
                  prompt=(PromptPositions.empty(sched.config.prefill_token_budget)
                          if prompt else None))
  if reserved:
    plan = dataclasses.replace(plan, reserved=ReservedSlots(
        slot_mapping=np.full((width,), -1, np.int32), status=np.zeros((b,), np.int32),
        grow=TailGrowth(tokens=np.zeros((b,), np.int32), clock=np.int32(sched.pool.host.step))))
  no_rows = batching.StepRows([], [], [], [], [], 0)
  return sched.forward_pass._with_carried(sched.executor, plan, no_rows)  # pylint: disable=protected-access


def _padding_step(sched: "Scheduler", width: int, max_query_len: int, *,
                  prompt: bool = False) -> None:
  """The executor's step on a plan of padding rows: compiles, changes nothing."""
  plan = _padding_plan(sched, width, max_query_len, prompt=prompt)
  pool = sched.pool
  pred = pool.reserve_step(plan.seq_ids, plan.num_new, max_new_tokens=max_query_len)
  try:
    state, _, status, *_ = sched.executor.step(pred.state, plan)
  except BaseException:
    pool.abandon_step(None)
    raise
  pool.adopt_step(state, pred, device_status=status)


def _padding_steps(sched: "Scheduler", k: int) -> None:
  """The executor's `decode_steps` (k steps) on padding rows, and the gather of each
  row's last token that feeds the next step: compiles, changes nothing."""
  from paged_kv.scheduler import forward_pass  # pylint: disable=g-import-not-at-top
  b = sched.config.max_batch
  plan = _padding_plan(sched, b, 1, reserved=False)
  pool = sched.pool
  remaining = np.zeros((b,), np.int32)
  pred = pool.predict_decode_steps(np.asarray(plan.seq_ids), remaining, k)
  try:
    state, tokens, status, *_ = sched.executor.decode_steps(pred.state, plan, remaining,
                                                            num_steps=k)
  except BaseException:
    pool.abandon_step(None)
    raise
  pool.adopt_step(state, pred, device_status=status)
  if getattr(sched.executor, "uses_tokens", True):
    forward_pass._last_tokens(tokens, remaining)  # pylint: disable=protected-access


def release_programs() -> None:
  """Drops the compiled programs of the serving path's jitted functions (all shapes),
  as a shrink's cut does: the old size's executables (~30 memory mappings each on
  CPU) are dead from then on. Other pools in the process recompile on next use; the
  freed heap goes back to the OS (`counters.trim_heap`)."""
  import sys  # pylint: disable=g-import-not-at-top
  from paged_kv.pool import kv_io  # pylint: disable=g-import-not-at-top
  from paged_kv.core import commit, kv, sequences# pylint: disable=g-import-not-at-top
  from paged_kv.cache import persist  # pylint: disable=g-import-not-at-top
  from paged_kv.core import regions, resize# pylint: disable=g-import-not-at-top
  from paged_kv.core import slots# pylint: disable=g-import-not-at-top
  fns = [commit.commit, sequences.reserve_tokens, kv.gather_kv, kv_io.write_layers,
         persist._gather_slots,  # pylint: disable=protected-access
         slots.pack_slots, slots.reclaim_slots,
         regions.resize_state]  # the cut's own program: one per pair of sizes, used once
  from paged_kv.scheduler import forward_pass  # pylint: disable=g-import-not-at-top
  fns += [forward_pass._last_tokens, forward_pass._resolve_carried]  # pylint: disable=protected-access
  for fn in fns:
    fn.clear_cache()
  steps = sys.modules.get("paged_kv.model.steps")  # only if a model executor loaded it
  if steps is not None:
    steps.release_programs()  # the module's and every bound executor's
  resize.release_programs()  # a staged cut's per-layer copies
  gc.collect()  # the executables go with their last reference
  counters.trim_heap()  # and their pages back to the OS (RSS), where the libc allows


def warm(sched: "Scheduler", *, progress: bool = True, persistence: bool = True,
         threads: int | None = None) -> WarmupReport:
  """Compiles and runs once every program of `program_runs(sched)`: those that can
  be lowered are, one after the other (tracing holds Python's lock), then compiled
  on `threads` threads (default one per program, at most the CPUs); then all run."""
  runs = program_runs(sched, persistence=persistence)
  c0, l0, t0 = counters.backend_compiles(), counters.cache_loads(), time.perf_counter()
  ahead = [r for r in runs if r.lower is not None]
  if threads is None:
    threads = min(len(ahead), os.cpu_count() or 1)
  bar = None
  if progress:
    try:
      from tqdm.auto import tqdm  # pylint: disable=g-import-not-at-top
      bar = tqdm(total=len(runs) + (len(ahead) if threads > 1 else 0), desc="warm-up",
                 unit="program", leave=False)
    except ImportError:
      bar = None

  def advance(name: str) -> None:
    if bar is not None:
      bar.set_postfix_str(name, refresh=False)
      bar.update(1)

  if threads > 1 and ahead:
    lowered = [(r.name, r.lower()) for r in ahead]
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
      futures = {pool.submit(low.compile): name for name, low in lowered}
      for done in concurrent.futures.as_completed(futures):
        done.result()
        advance(f"compiled {futures[done]}")
  for r in runs:
    r.run()
    advance(r.name)
  if bar is not None:
    bar.close()
  sched.pool.verify()  # the warm-up changed nothing: checked, and every result waited for
  return WarmupReport(programs=len(runs), compiles=counters.backend_compiles() - c0,
                      cache_loads=counters.cache_loads() - l0,
                      seconds=time.perf_counter() - t0)
