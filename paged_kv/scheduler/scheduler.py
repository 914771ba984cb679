"""A continuous-batching scheduler: the step loop and the requests' lifecycle.

`Scheduler` runs the loop (`submit`, `step`, `abort`, `take_finished`); each KV
decision is a part in a module of its own, called in this order every step
(`docs/architecture.md` draws one): `admission` (with `eviction`), `forward_pass`
(rows from `batching`, `preemption` under pressure), `finishing`, `maintenance` and
`shrink_control`, then `step_telemetry` (a `StepReport` to `on_step`).

The pool and the radix cache are one `CachedPool`, which applies every reference
change of the cache itself. An exception in `step()` leaves the scheduler usable
(`recovery` reconciles what a half-done call left) unless the pool's donated state
is gone (`SchedulerBroken` from then on); steps that make no progress raise
`SchedulerStalled` (`progress`). A running sequence caches `len(prompt) +
len(output) - 1` tokens: its last output token is pending (sampled, not cached).
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
  """`pool` itself, or `pool` bound to `cache` (a new one from `config` when None)."""
  if isinstance(pool, CachedPool):
    if cache is not None:
      raise InvalidArgument("pass the cache inside the CachedPool, not beside it")
    return pool
  return CachedPool(pool, cache, policy=config.evict_policy, pack_tails=config.pack_tails,
                    clock=clock, mix_namespaces=config.mix_namespaces)


class Scheduler:
  """Continuous batching over a `CachedPool` (a `BlockPool` bound to its `PrefixCache`).

  `pool` is the `BlockPool` (the executor works on `pool.state`), `cached_pool`
  the bound pair, `cache` a read-only view of the prefix cache (None when off).
  The queues `waiting`, `swapped`, `running` (admission order) and `finished` are
  for reading: change them through `submit`, `abort` and `take_finished`.

  Example:
    pool = BlockPool(PoolConfig(num_blocks=4096, block_size=16, max_seqs=64, ...))
    sched = Scheduler(pool, DryExecutor(pool.config), SchedulerConfig(max_batch=32))
    sched.submit(Request(0, prompt_tokens, max_new_tokens=64))
    sched.run()                      # until every submitted request finished
    done = sched.take_finished()     # a server takes them after every step
  """

  def __init__(self, pool: BlockPool | CachedPool, executor: Executor,
               config: SchedulerConfig = SchedulerConfig(), *, cache: PrefixCache | None = None,
               clock: Callable[[], float] = time.monotonic,
               on_snapshot: Callable[[int, metrics.PoolSnapshot, SchedulerStats], None] | None = None,
               on_step: Callable[[StepReport], None] | None = None):
    """Builds a scheduler; a bad argument raises `InvalidArgument`.

    Args:
      pool: a `BlockPool` (bound here to `cache`, or to a new cache when
        `config.enable_prefix_cache`), or a `CachedPool` whose cache is used.
      executor, config: the model work of a step, the scheduling policies.
      cache: a prefix cache whose references are already in `pool`.
      clock: time source for latencies and the new cache's LRU/TTL.
      on_snapshot, on_step: called with `(step, snapshot, stats)` after each
        snapshot, and with each step's `StepReport` (also settable later).
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
    self.record = record = StepRecord()
    # The parts (one concept each, see the module docstring).
    self.evictor = Evictor(cached_pool, stats, config.governance)
    self.admission = Admission(cached_pool, config, stats, self.evictor, q, record,
                               caching=caching)
    self.finishing = Finishing(cached_pool, stats, q, record, caching=caching,
                               on_finished=self._mark_finished)
    self.preemption = Preemption(cached_pool, config, stats, self.evictor, self.finishing, q)
    self.forward_pass = ForwardPass(self.pool, config, stats, self.evictor,
                                    self.preemption, q, record, clock)
    self.shrink_control = ShrinkControl(cached_pool, config, stats, self.evictor,
                                        self.admission, record, caching=caching,
                                        rewarm=self._rewarm)
    self.telemetry = StepTelemetry(cached_pool, config, stats, record, on_snapshot)
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
    """Queues a request (FCFS); with `sampling.n > 1`, its samples too.

    Its inputs are validated and frozen: assigning one later raises.

    Raises:
      InvalidArgument: a bad or reused request, a live id, or what `request_checks`
        refuses (token ids, sampling, logprobs, length).
      radix.InvalidNamespaceError: the namespace is not a typed key.
      PoolExhausted: it could not run even in an empty pool.
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

    A running request's computed tokens go into the prefix cache and its row is
    released at once. It joins `finished` and the next step's report. Call it
    between steps.

    Raises:
      UnknownRequest: no unfinished request has this id (nothing changed).
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
    """The finished requests since the last call, handed over: `finished` is emptied
    (a long-running server takes them every step, or its memory grows)."""
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
    """One scheduling step. Whatever it raises, the scheduler was reconciled first and
    stays usable, except `SchedulerBroken`: the pool's donated state is gone (every
    later call raises it too)."""
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
    maintenance.maybe_compact(self.cached_pool, self.config, self.stats, telemetry.last_stats,
                              shrinking=self.shrink_control.pending is not None)
    self._maybe_shrink()
    maintenance.maybe_promote(self.cached_pool, self.config, self.stats, rec.step)
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
                              queues=self.queues))

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

    From the next step on, each step moves up to `policy`'s byte budget of blocks
    from above the target to below it, then cuts the pool there once and the
    executor follows (`resize`); an idle scheduler finishes by calling `step()`.
    Returns the progress (`shrink_status`). Arguments, errors: `ShrinkControl.start`.
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
    """Compiles and runs once every program the serving path can run (`warmup.warm`;
    with `persistence`, `CachedPool.save` / `restore`'s too); returns the report, also
    kept as `warmup_report`. After it, `stats.compiles_after_warmup` counts what
    compiled anyway (0 for any workload the configs admit)."""
    self._check_usable()
    self._warm_persistence = persistence
    self.warmup_report = warmup_lib.warm(self, progress=progress, persistence=persistence)
    self.telemetry.mark_warm()
    return self.warmup_report

  @property
  def runtime(self) -> counters.RuntimeCounters:
    """The pool's device traffic since the scheduler was built (`runtime.counters`)."""
    return self.telemetry.runtime()

  def extra_segments(self) -> Segments:
    """`i32[n, 3]` `(block, start, length)` references the cache holds (for metrics)."""
    return self.telemetry.extra_segments()

  def take_stats(self) -> metrics.StepStats:
    """The cheap pool figures now, from the host mirror, not recorded (`last_stats`:
    those of the latest step's start)."""
    self._check_usable()
    return self.telemetry.take_stats()

  def take_snapshot(self) -> metrics.PoolSnapshot:
    """The full pool snapshot now (O(num_blocks) host work; not recorded)."""
    self._check_usable()
    return self.telemetry.take_snapshot()

  def check_invariants(self) -> None:
    """The pool's invariants (the cache's references included) and the running rows'.
    Raises InvariantViolation, or SchedulerBroken when unusable."""
    self._check_usable()
    self.cached_pool.check_invariants()
    self.queues.rows.check()
