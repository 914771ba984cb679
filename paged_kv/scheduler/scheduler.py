"""A continuous-batching scheduler that carries the memory manager end to end.

`Scheduler` runs the step loop and the requests' lifecycle (`submit`, `abort`,
`take_finished`); the KV decisions are its parts, each a module of its own:

1. **Admission** (`admission.Admission`): swapped-out requests first, then FCFS;
   the prompt's longest cached prefix is matched (and locked) in the radix cache;
   a request is admitted only if its whole uncached context fits now, with the
   output reserve and the watermark, after evicting cached blocks if needed
   (`eviction.Evictor`). With `governance`, the live quota may hold it back.
2. **One forward pass** (`forward_pass.ForwardPass`, rows from `batching`): a
   decode token of every running sequence whose prompt is done and the next
   prompt chunks under the token budget, in one mixed batch. Under pressure,
   cached blocks are evicted, then the newest sequences are preempted by
   recompute or swap (`preemption.Preemption`). Overlapped
   (`SchedulerConfig.overlap`, the default), the step is dispatched before the
   previous step's tokens are read, and those feed it on the device; with
   `decode_steps = k`, a step with no prompt chunk and nothing waiting runs k
   decode steps in one dispatch.
3. **Finish** (`finishing.Finishing`): a finished sequence's cached tokens go into
   the radix cache (optionally its short tail packed into a slotted block), then
   its row is released.
4. **Maintenance** (`maintenance`): compaction past the fragmentation threshold
   within a byte budget; promotion of widely shared blocks into the base pool; and
   a pending shrink (`shrink_control.ShrinkControl`, after `shrink_to`): budgeted
   moves below the target, then the cut, once, which the executor follows.
5. **Telemetry**: the cheap pool figures from the host mirror on the steps
   `stats_pacing.StatsPacer` picks, the full snapshot every `snapshot_every` steps,
   alerts, and a `StepReport` to the `on_step` callback. Nothing per step copies a
   per-block array to the host.

Exception safety: an exception raised anywhere in `step()` (the executor, a
callback, a `KeyboardInterrupt` at any call site) leaves the scheduler usable: a
request leaves `running` only after the calls that can fail succeeded, and the
step's handler reconciles what a half-done call left (`recovery.recover`). Only
when the pool's donated state is really gone (an executor raised after donating
without handing the state back, see `paged_kv.scheduler.executor`) does the
scheduler refuse further use, with `SchedulerBroken`. Progress: a step that computes
no token and finishes nothing while requests wait or run is a bug, never load; after
`SchedulerConfig.max_stalled_steps` of them the next step raises `SchedulerStalled`
(`paged_kv.scheduler.progress`).

The pool and the radix cache are one `CachedPool`: it applies every reference
delta of the cache (insert, evict, remap, packing) itself. The model is behind an
`Executor`; the `DryExecutor` only reserves slots (memory dynamics) for trace
replay. Tokens: after a sequence's prompt is prefilled, its first output token is
*pending* (sampled, not yet in the cache); each decode step caches the pending
token and samples the next, so a running sequence caches
`len(prompt) + len(output) - 1` tokens.
"""

from __future__ import annotations

import time
import weakref
from typing import Callable, Hashable

from paged_kv.core import compact, regions
from paged_kv.core.errors import InvalidArgument, PagedKVError
from paged_kv.core.segment_format import Segments
from paged_kv.pool.block_pool import BlockPool
from paged_kv.runtime import counters
from paged_kv.scheduler import maintenance, parallel_sampling, recovery, request_checks
from paged_kv.scheduler import request as request_lib
from paged_kv.scheduler import warmup as warmup_lib
from paged_kv.scheduler.admission import Admission
from paged_kv.scheduler.arguments import check_init_args, check_run_args
from paged_kv.cache.cached_pool import CachedPool, CacheView, state_lost
from paged_kv.scheduler.eviction import Evictor
from paged_kv.scheduler.executor import DryExecutor, Executor  # noqa: F401  (re-exported)
from paged_kv.scheduler.finishing import RECLAIM_EVERY, Finishing  # noqa: F401
from paged_kv.scheduler.forward_pass import ForwardPass
from paged_kv.scheduler.preemption import Preemption
from paged_kv.scheduler.progress import SchedulerStalled
from paged_kv.scheduler.request import Phase, Request, RequestQueues, UnknownRequest
from paged_kv.scheduler.scheduler_config import PREEMPTION_MODES, SchedulerConfig  # noqa: F401
from paged_kv.scheduler.shrink_control import ShrinkControl
from paged_kv.scheduler.stats_pacing import MAX_STATS_INTERVAL  # noqa: F401  (re-exported)
from paged_kv.scheduler.step_report import SchedulerStats, StepRecord, StepReport
from paged_kv.scheduler.step_telemetry import MAX_KEPT_ALERTS, MAX_KEPT_SNAPSHOTS, StepTelemetry  # noqa: F401
from paged_kv.scheduler.warmup import WarmupReport
from paged_kv.telemetry import metrics
from radix.cache import PrefixCache

__all__ = ["Phase", "Request", "Scheduler", "SchedulerBroken", "SchedulerConfig",
           "SchedulerStalled", "SchedulerStats", "StepReport", "UnknownRequest"]



class SchedulerBroken(PagedKVError):
  """The scheduler refuses further use: its pool's state is gone (see the message)."""


def _bind_cache(pool: BlockPool | CachedPool, cache: PrefixCache | None,
                config: SchedulerConfig, clock: Callable[[], float]) -> CachedPool:
  """The `CachedPool` a scheduler runs on: `pool` itself, or `pool` bound to `cache`
  (a new one from `config` when None)."""
  if isinstance(pool, CachedPool):
    if cache is not None:
      raise InvalidArgument("pass the cache inside the CachedPool, not beside it")
    return pool
  return CachedPool(pool, cache, policy=config.evict_policy, pack_tails=config.pack_tails,
                    clock=clock, mix_namespaces=config.mix_namespaces)


class Scheduler:
  """Continuous batching over a `CachedPool` (a `BlockPool` bound to its `PrefixCache`).

  Every reference the cache takes or drops is applied by the `CachedPool`; the
  scheduler never handles a `RefDeltas`. `pool` is the `BlockPool` (the executor
  works on `pool.state`), `cached_pool` the bound pair, `cache` a read-only view
  of the prefix cache (None when caching is off).

  Attributes (the queues: read them, change them only through `submit` and `abort`):
    waiting: `Request`s queued for admission (FCFS; recomputed preemptions first).
    swapped: requests preempted by swap, their K/V on the host.
    running: requests holding a pool row (`Request.seq_id`), in admission order; an
      executor maps a step's batch rows (`StepPlan.seq_ids`: decodes first, then
      prefill chunks) to requests by that row.
    finished: requests finished (or aborted) since the last `take_finished()`.

  Example:
    pool = BlockPool(PoolConfig(num_blocks=4096, block_size=16, max_seqs=64, ...))
    sched = Scheduler(pool, DryExecutor(pool.config), SchedulerConfig(max_batch=32))
    sched.submit(Request(0, prompt_tokens, max_new_tokens=64))
    sched.run()                      # until every submitted request finished
    sched.stats, sched.snapshots
    done = sched.take_finished()     # the finished requests, handed over (a server
                                     # takes them every step: `finished` grows until then)
  """

  def __init__(self, pool: BlockPool | CachedPool, executor: Executor,
               config: SchedulerConfig = SchedulerConfig(), *, cache: PrefixCache | None = None,
               clock: Callable[[], float] = time.monotonic,
               on_snapshot: Callable[[int, metrics.PoolSnapshot, SchedulerStats], None] | None = None,
               on_step: Callable[[StepReport], None] | None = None):
    """Builds a scheduler.

    Args:
      pool: a `BlockPool` (bound here to `cache` or to a new cache), or a
        `CachedPool` whose cache is used.
      executor: the model work of a step.
      config: scheduling and memory policies.
      cache: a prefix cache for a plain `pool` (its references must already be
        in the pool: an empty cache, or one `load_prefix_cache` filled); default
        a new one from `config` when `config.enable_prefix_cache`.
      clock: time source for latencies and the new cache's LRU/TTL.
      on_snapshot: called with `(step, snapshot, stats)` after each snapshot.
      on_step: called with a `StepReport` after every step (also settable
        later as `sched.on_step`; `paged_kv.telemetry.export` exporters attach here).

    Raises:
      InvalidArgument: a bad argument (`paged_kv.scheduler.arguments.check_init_args`).
    """
    check_init_args(pool, config, cache, clock, on_snapshot, on_step)
    config.check_pool(pool.config)
    cached_pool = _bind_cache(pool, cache, config, clock)
    self.cached_pool, self.pool = cached_pool, cached_pool.pool
    self.executor, self.config, self.clock = executor, config, clock
    # Match prompts in and insert finished sequences into the cache.
    self._caching = caching = config.enable_prefix_cache or cache is not None
    self.queues = q = RequestQueues()
    self.stats = stats = SchedulerStats()
    self.counters = counters_ = metrics.PoolCounters()
    self.record = record = StepRecord()
    # The parts (one concept each, see the module docstring).
    self.evictor = Evictor(cached_pool, stats, config.governance)
    self.admission = Admission(cached_pool, config, stats, counters_, self.evictor, q, record,
                               caching=caching)
    self.finishing = Finishing(cached_pool, counters_, q, record, caching=caching,
                               on_finished=self._mark_finished)
    self.preemption = Preemption(cached_pool, config, stats, self.evictor, self.finishing, q)
    self.forward_pass = ForwardPass(self.pool, config, stats, counters_, self.evictor,
                                    self.preemption, q, record, clock)
    self.shrink_control = ShrinkControl(cached_pool, config, stats, self.evictor,
                                        self.admission, record, caching=caching,
                                        rewarm=self._rewarm)
    self.telemetry = StepTelemetry(cached_pool, config, stats, counters_, record, on_snapshot)
    self.on_step = on_step
    # id -> request, each object submitted once; weak, so a long-running server does
    # not keep every request it ever served (a dead entry's id may be reused).
    self._submitted: weakref.WeakValueDictionary[int, Request] = weakref.WeakValueDictionary()
    self._live: dict[Hashable, Request] = {}  # request_id -> a submitted, unfinished request
    self._num_submitted = 0
    self._broken: str | None = None
    self.num_recoveries = 0  # steps that raised and were recovered from
    self.warmup_report: WarmupReport | None = None
    self._warm_persistence = True

  # ------------------------------------------------------------------ the queues
  waiting = property(lambda self: self.queues.waiting, doc="Requests queued for admission.")
  swapped = property(lambda self: self.queues.swapped, doc="Requests preempted by swap.")
  running = property(lambda self: self.queues.running, doc="Requests holding a pool row.")
  finished = property(lambda self: self.queues.finished,
                      doc="Requests finished since the last `take_finished()`.")

  @property
  def cache(self) -> CacheView | None:
    """A read-only view of the prefix cache; None when caching is off."""
    return self.cached_pool.cache if self._caching else None

  idle = property(lambda self: not (self.waiting or self.swapped or self.running),
                  doc="Nothing waiting, swapped or running.")
  snapshots = property(lambda self: self.telemetry.snapshots,
                       doc="The latest `PoolSnapshot`s (at most `MAX_KEPT_SNAPSHOTS`).")
  alerts = property(lambda self: self.telemetry.alerts,
                    doc="The latest alerts fired (at most `MAX_KEPT_ALERTS`).")
  last_stats = property(lambda self: self.telemetry.last_stats,
                        doc="The cheap pool figures of the latest step's start.")
  stats_interval = property(lambda self: self.telemetry.pacer.interval,
                            doc="Steps between the cheap figures now (`stats_budget`).")

  # ------------------------------------------------------------------ the lifecycle
  def submit(self, request: Request) -> None:
    """Queues a request (FCFS); `sampling.n > 1`: its samples too (`parallel_sampling`).

    The request's inputs are validated and frozen (`Request`): later changes to the
    caller's arrays change nothing, assignments to its input fields are refused.

    Raises:
      InvalidArgument: not a `Request`, submitted before (the same object), carrying
        progress, bad fields (`Request.validate`), an id an unfinished request
        holds, too many logprobs or tokens, ids or sampling `request_checks` refuses.
      radix.InvalidNamespaceError: the namespace is not a typed key.
      PoolExhausted: it could not run even in an empty pool (so an accepted
        request always runs once the pool drains).
      SchedulerBroken: the scheduler refuses further use.
    """
    self._check_usable()
    request_lib.check_new(request, self._submitted, self._live)
    samples = parallel_sampling.samples_of(request, self._live)  # n > 1: checked here
    request_checks.accept(request, self)  # ids, sampling, the pool's fit; stop strings
    request_lib.seal(request, stop_token=self.config.stop_token, now=self.clock(),
                     step=self.record.step, seed=self.config.seed + self._num_submitted)
    self._num_submitted += 1
    self._submitted[id(request)] = self._live[request.request_id] = request
    self.waiting.append(request)
    for sample in samples:  # seeds follow in submit order; admitted as forks of its row
      self.submit(sample)

  def abort(self, request_id: Hashable) -> Request:
    """Ends a request now, in any phase; returns it (`stop_reason="abort"`).

    Waiting: it leaves the queue. Swapped: its host copy of the K/V is dropped.
    Running (mid-prefill or decoding): like a finished request, its computed
    tokens go into the prefix cache (cached-only blocks: evictable) and its row and
    its lock on a cached prefix are released at once. Its tokens so far stay in
    `output`; it joins `finished` (`take_finished`) and the next step's
    `StepReport.finished` (so exporters count it). Call it between steps.

    Raises:
      UnknownRequest: no unfinished request has this id (never submitted, already
        finished or aborted). Nothing changed.
      SchedulerBroken: the scheduler refuses further use.
    """
    self._check_usable()
    try:
      req = self._live.get(request_id)
    except TypeError:
      req = None
    if req is None:
      raise UnknownRequest(f"no unfinished request has id {request_id!r}")
    if req.phase == Phase.WAITING:
      self.waiting.remove(req)
    elif req.phase == Phase.SWAPPED:
      self.swapped.remove(req)
      req.swapped = None
    else:
      try:
        self.finishing.release_running(req)
      except BaseException as exc:
        self._recover(exc)
        raise
    req.stop_reason = "abort"
    self.stats.aborted += 1
    self.record.now = self.clock()
    self._mark_finished(req, aborted=True)  # in the next step's report
    return req

  def take_finished(self) -> list[Request]:
    """The finished requests since the last call, in finishing order, handed over:
    `finished` is emptied (it holds every finished request until taken, so a
    long-running server takes them after each step, or its memory grows)."""
    done, self.queues.finished = self.queues.finished, []
    return done

  def _mark_finished(self, req: Request, aborted: bool = False) -> None:
    if self._live.get(req.request_id) is req:
      del self._live[req.request_id]
    req.phase = Phase.FINISHED
    req.finish_step, req.finish_time = self.record.step, self.record.now
    self.queues.finished.append(req)
    (self.record.aborted if aborted else self.record.finished).append(req)
    self.stats.finished += 1

  # ------------------------------------------------------------------ the step loop
  def run(self, *, max_steps: int | None = None,
          before_step: Callable[["Scheduler"], None] | None = None) -> None:
    """Steps until idle (or `max_steps`); `before_step(self)` may submit arrivals.
    Raises `InvalidArgument` for bad arguments (`arguments.check_run_args`)."""
    n, max_steps = 0, check_run_args(max_steps, before_step)
    while max_steps is None or n < max_steps:
      if before_step is not None:
        before_step(self)
      if self.idle:
        break
      self.step()
      n += 1

  def step(self) -> None:
    """One scheduling step (see the module docstring).

    Exception-safe: whatever it raises, the scheduler was reconciled first (see
    the module docstring) and stays usable, unless it raises `SchedulerBroken`
    from then on.

    Raises:
      SchedulerBroken: the pool's donated state is gone (now or before).
      Anything a call site raised (the executor, `on_snapshot`, ...), after recovery.
    """
    self._check_usable()
    try:
      self._step_once()
    except BaseException as exc:
      self._recover(exc)
      raise

  def _step_once(self) -> None:
    t0 = time.perf_counter()
    rec, telemetry = self.record, self.telemetry
    rec.begin(self.clock())
    # The figures of the step's start, from the pool's host mirror (no device work).
    figures = self.admission.govern(telemetry.begin(t0))
    if figures is not None:
      telemetry.last_stats = figures
    self.admission.admit()
    if not self.running and (self.waiting or self.swapped):
      # `submit` refuses what cannot fit an empty pool, so this is a bug, not load.
      raise SchedulerStalled(f"scheduler stalled: nothing running, {len(self.waiting)} waiting, "
                             f"{len(self.swapped)} swapped, {self.pool.num_free_blocks} free")
    self.forward_pass.run(self.executor)
    self.finishing.finish()
    maintenance.maybe_compact(self.cached_pool, self.config, self.stats, self.counters,
                              telemetry.last_stats, shrinking=self.shrink_control.pending is not None)
    self._maybe_shrink()
    maintenance.maybe_promote(self.cached_pool, self.config, self.counters, rec.step)
    # The step is done: its id and the counter advance together, before the
    # snapshot's callback (which may raise) runs.
    step_id = rec.step
    rec.step += 1
    self.stats.steps += 1
    telemetry.update_runtime_stats()
    self.stats.max_running = max(self.stats.max_running, len(self.running))
    pool_stats, snap = telemetry.end(step_id, t0)
    if self.on_step is not None:
      self.on_step(rec.report(step_id, time=self.clock(), host_seconds=time.perf_counter() - t0,
                              pool=pool_stats, snapshot=snap, stats=self.stats,
                              counters=self.counters, queues=self.queues))

  # ------------------------------------------------------------------ exception safety
  @property
  def broken(self) -> str | None:
    """Why the scheduler refuses further use, or None while it is usable."""
    return self._broken

  def _check_usable(self) -> None:
    if self._broken is None and state_lost(self.pool):
      self._broken = ("the pool's state points at deleted buffers (donated to a jitted call "
                      "whose new state never came back); its K/V and bookkeeping are gone")
    if self._broken is not None:
      raise SchedulerBroken(f"scheduler unusable: {self._broken}")

  def _recover(self, exc: BaseException) -> None:
    """Reconciles requests, rows, locks and the cache after `exc` interrupted a step."""
    self.num_recoveries += 1
    self.record.interrupted = True
    try:
      lost = self.forward_pass.salvage()  # keeps the tokens of the steps that ran
      recovery.recover(self.cached_pool, self.queues, exc, self._mark_finished)
      recovery.requeue(self.finishing, self.queues, [r for r in lost if r in self.running])
    except BaseException as failure:  # pylint: disable=broad-except
      self._broken = (f"recovery from {type(exc).__name__}({exc}) failed with "
                      f"{type(failure).__name__}: {failure}")

  # ------------------------------------------------------------------ shrink
  def shrink_to(self, num_blocks: int, policy: compact.CompactionPolicy | None = None, *,
                block_bytes: int | None = None, evict_cached: bool = True,
                margin: int | None = None, staging: str = "auto") -> regions.ShrinkProgress:
    """Gives memory back while serving: the pool ends with `num_blocks` blocks.

    From the next step on, each step moves up to `policy.max_moves(block_bytes)`
    referenced blocks above the target below it, then cuts the pool there, once;
    the executor follows (`executor.resize(config)`). Requests are never held back;
    live data is never dropped (the shrink waits for room); compaction pauses
    until the cut or `cancel_shrink` (`paged_kv.scheduler.shrink_control`). Progress:
    the returned record (`shrink_status`, updated every step), `stats.shrink_*`.
    An idle scheduler finishes its shrink by calling `step()` (one budget each).

    Args:
      num_blocks: pool size after the cut: an int above the base pool and
        below the current size.
      policy: the byte budget per step (default: the scheduler's compaction
        policy, else `CompactionPolicy()`: 2% of a 20 ms step at 4.3 TB/s).
      block_bytes: bytes per block the budget counts (default the pool's
        `block_bytes`; a simulation with small pages passes the modelled model's).
      evict_cached: evict cached-only blocks when the room below is short.
      margin: free blocks to keep below the target beyond what the moves need,
        so a step's allocations find room there (default `max_batch` + the
        prefill budget's blocks).
      staging: how the cut resizes the pages (`BlockPool.resize`): `"host"`
        holds at most the old pool plus one layer of K on the device (the kept
        pages go through host memory), `"device"` builds the new pages beside
        the old ones (fast, both pools at once), `"auto"` stages only when the
        device lacks room for both. The cut's `ResizeReport` lands in the
        returned record's `cut`.

    Returns:
      The shrink's `regions.ShrinkProgress` (the scheduler updates it).

    Raises:
      InvalidArgument: a shrink is pending, `num_blocks` is not an int in
        `(num_base_blocks, num_blocks)`, a bad `policy`/`block_bytes`/`margin`/`staging`,
        or an executor that holds the pool config without `resize`.
      PoolExhausted: the target cannot hold the live sequences' blocks (or,
        without `evict_cached`, everything referenced now), or a submitted
        request could not run in a pool of that size (`reason="no_free_block"`).
      SchedulerBroken: the scheduler refuses further use.
      Nothing changed when it raises. Anything else raised while it makes room
      (an interrupted eviction) is raised after the scheduler was reconciled as
      `step()` reconciles; no shrink is pending then.
    """
    self._check_usable()
    return self.shrink_control.start(
        self.executor, num_blocks, policy, block_bytes=block_bytes, evict_cached=evict_cached,
        margin=margin, staging=staging, on_room_failure=self._recover)

  @property
  def shrink_status(self) -> regions.ShrinkProgress | None:
    """The pending shrink's progress, else the latest shrink's (None: never shrunk)."""
    return self.shrink_control.latest

  def cancel_shrink(self) -> regions.ShrinkProgress | None:
    """Ends a pending shrink without cutting (moves done stay; compaction resumes)."""
    return self.shrink_control.cancel()

  def _maybe_shrink(self) -> None:
    """One step of the pending shrink (`ShrinkControl.step`)."""
    self.shrink_control.step(self.executor)

  def _rewarm(self, compiles_before: int) -> None:
    """After a cut: releases the old size's programs and warms the new size's now."""
    if self.warmup_report is None:
      return
    warmup_lib.release_programs()
    warmup_lib.warm(self, progress=False, persistence=self._warm_persistence)
    self.telemetry.count_rewarm(compiles_before)

  # ------------------------------------------------------------------ warm-up, telemetry
  def warmup(self, *, progress: bool = True, persistence: bool = True) -> WarmupReport:
    """Compiles (runs once) every program the serving path can run; see
    `paged_kv.scheduler.warmup`. After it, `stats.compiles_after_warmup` counts
    what compiled anyway (0 for any workload the configs admit). With
    `persistence`, `CachedPool.save` / `restore`'s programs too.

    Returns:
      The `WarmupReport` (also `self.warmup_report`): programs, compiles, cache
      loads, seconds.
    """
    self._check_usable()
    self._warm_persistence = persistence
    self.warmup_report = warmup_lib.warm(self, progress=progress, persistence=persistence)
    self.telemetry.mark_warm()
    return self.warmup_report

  @property
  def runtime(self) -> counters.RuntimeStats:
    """The pool's device traffic since the scheduler was built (dispatches, reads,
    compiles; see `paged_kv.runtime.counters`)."""
    return self.telemetry.runtime()

  def extra_segments(self) -> Segments:
    """`i32[n, 3]` `(block, start, length)` references the cache holds (for metrics)."""
    return self.telemetry.extra_segments()

  def take_stats(self) -> metrics.StepStats:
    """The cheap pool figures now, from the pool's host mirror (not recorded); the
    pool as it is, e.g. after `run()` drained the queue (`last_stats`: the latest
    step's start)."""
    self._check_usable()
    return self.telemetry.take_stats()

  def take_snapshot(self) -> metrics.PoolSnapshot:
    """The full pool snapshot now (O(num_blocks) host work; not recorded)."""
    self._check_usable()
    return self.telemetry.take_snapshot()

  def check_invariants(self) -> None:
    """The pool's invariants (the cache's references included) and the running rows'
    (`RunningRows.check`). Raises InvariantViolation, or SchedulerBroken when unusable."""
    self._check_usable()
    self.cached_pool.check_invariants()
    self.queues.rows.check()
