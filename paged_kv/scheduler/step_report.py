"""What a scheduler reports: `SchedulerStats` (cumulative counters) and `StepReport`
(one step, handed to `Scheduler(on_step=...)`)."""

from __future__ import annotations

import dataclasses

import numpy as np

from paged_kv.telemetry import metrics


@dataclasses.dataclass
class SchedulerStats:
  """Cumulative counters of a scheduler run."""

  steps: int = 0
  admitted: int = 0
  finished: int = 0  # aborted requests included
  aborted: int = 0  # `Scheduler.abort` of a request before it finished
  prompt_tokens: int = 0
  hit_tokens: int = 0
  prefill_tokens: int = 0
  decode_tokens: int = 0
  preemptions: int = 0
  preemptions_recompute: int = 0
  preemptions_swap: int = 0
  swap_to_host_bytes: int = 0
  swap_in_bytes: int = 0
  evicted_tokens: int = 0
  evictions: int = 0
  compactions: int = 0
  max_running: int = 0
  quota_holds: int = 0  # admissions held back by the live quota (governance)
  prefix_dropped: int = 0  # heads admitted alone without their cached prefix (it cost more)
  # A row alone out of room (`Preemption.unstick`): its cache lock dropped, it
  # preempted to recompute in fresh blocks, or it ended ("pool_exhausted").
  unstick_unlocks: int = 0
  unstick_preemptions: int = 0
  unstick_refusals: int = 0
  quota_evicted_blocks: int = 0  # cached-only blocks evicted above the cached quota
  gc_marked_nodes: int = 0  # cache nodes marked by the GC's phase 1 (all passes)
  gc_evicted_tokens: int = 0  # tokens evicted from GC-marked nodes
  shrinks: int = 0  # shrinks that reached their cut (`Scheduler.shrink_to`)
  shrink_steps: int = 0  # steps with a shrink pending (the cut's included)
  shrink_moves: int = 0  # blocks the shrinks moved below their cut
  shrink_bytes_moved: int = 0  # their bytes (at the shrink's `block_bytes`)
  shrink_evicted_blocks: int = 0  # cached-only blocks evicted to make room below a cut
  shrink_blocks_returned: int = 0  # blocks the cuts gave back
  # Device traffic (`paged_kv.runtime.counters`): the pool's dispatches and blocking
  # reads, and the process's XLA compiles, since the scheduler was built / warmed up.
  device_dispatches: int = 0  # jitted programs launched (commits, steps, K/V data)
  bookkeeping_dispatches: int = 0  # of which bookkeeping (commits, synchronous calls)
  blocking_reads: int = 0  # host reads that waited on the device (sampled tokens excluded)
  backend_compiles: int = 0  # XLA compiles in the process since the scheduler was built
  compiles_after_warmup: int = 0  # ... since `Scheduler.warmup()` (0 is the goal)
  rewarm_compiles: int = 0  # compiles of a shrink's re-warm at its cut (a new pool size)

  @property
  def prefix_cache_hit_rate(self) -> float:
    return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

  @property
  def preemption_rate(self) -> float:
    """Preemptions per admitted request."""
    return self.preemptions / self.admitted if self.admitted else 0.0


@dataclasses.dataclass(frozen=True)
class StepReport:
  """What one scheduler step did, handed to `Scheduler(on_step=...)` after it.

  Attributes:
    step, time, host_seconds: the step's id, the clock at its end, its wall seconds.
    pool, snapshot: the cheap pool figures at its start, the full snapshot (None
      on steps without them).
    stats: the scheduler's cumulative counters (the live object: read, don't keep).
    counters: the pool's cumulative counters (OOMs by reason, compaction...).
    num_running, num_waiting, num_swapped: queue lengths after the step.
    finished: requests that finished in this step (aborted ones included).
    first_token_latencies, inter_token_latencies: seconds from `submit` to a first
      token, and between a request's consecutive tokens (preemptions included).
    alerts: alerts that fired in this step (edge-triggered).
    tokens: `(request_id, token)` of every token emitted, in order.
  """

  step: int
  time: float
  host_seconds: float
  pool: metrics.StepStats | None
  snapshot: metrics.PoolSnapshot | None
  stats: "SchedulerStats"
  counters: metrics.PoolCounters
  num_running: int
  num_waiting: int
  num_swapped: int
  finished: tuple
  first_token_latencies: tuple
  inter_token_latencies: tuple
  alerts: tuple
  tokens: tuple = ()


@dataclasses.dataclass(frozen=True, eq=False)
class _Rows:
  """A pass's rows as `StepRecord` keeps them: `(ids[i], tokens[i])` pairs, or the
  floats `ids` (tokens None)."""

  ids: object  # np.ndarray: request ids (object) or latencies (float)
  tokens: list | None = None


def _expand(items: list) -> tuple:
  """`items` with each `_Rows` entry expanded in place (pairs or floats)."""
  if not any(type(x) is _Rows for x in items):
    return tuple(items)
  out = []
  for x in items:
    if type(x) is not _Rows:
      out.append(x)
    elif x.tokens is None:
      out.extend(x.ids.tolist())
    else:
      out.extend(zip(x.ids.tolist(), x.tokens))
  return tuple(out)


@dataclasses.dataclass(eq=False)
class StepRecord:
  """The step a scheduler is running and what it did so far (for its `StepReport`):
  `step` (the next one's id between steps), `now` (the clock at the step's start,
  then after its forward pass), and `StepReport`'s lists, emptied by `begin` unless
  the step before raised (`interrupted`); `add_rows` entries expand in `report`."""

  step: int = 0
  now: float = 0.0
  finished: list = dataclasses.field(default_factory=list)
  tokens: list = dataclasses.field(default_factory=list)
  first_token_latencies: list = dataclasses.field(default_factory=list)
  inter_token_latencies: list = dataclasses.field(default_factory=list)
  alerts: list = dataclasses.field(default_factory=list)
  aborted: list = dataclasses.field(default_factory=list)  # since the last step: in the next
  interrupted: bool = False  # the step raised: the next report carries what it gathered

  def begin(self, now: float) -> None:
    """Starts a step's record at `now`; requests aborted since the last step lead it,
    and what a step that raised gathered (no report went out for it) is kept."""
    self.now = now
    if self.interrupted:
      self.interrupted = False
      self.finished += self.aborted
      self.aborted = []
      return
    self.finished, self.aborted = self.aborted, []
    self.tokens, self.first_token_latencies, self.inter_token_latencies = [], [], []
    self.alerts = []

  def add_rows(self, request_ids: np.ndarray, tokens: list, gaps: np.ndarray) -> None:
    """Records a pass's tokens `(request_ids[i], tokens[i])` and their inter-token
    latencies `gaps` as arrays; `report` makes the pairs (none without `on_step`)."""
    self.tokens.append(_Rows(request_ids, tokens))
    self.inter_token_latencies.append(_Rows(gaps))

  def report(self, step: int, *, time: float, host_seconds: float, pool, snapshot,
             stats: SchedulerStats, counters, queues) -> StepReport:
    """The `StepReport` of step `step` from this record and the queues after it."""
    return StepReport(
        step=step, time=time, host_seconds=host_seconds, pool=pool, snapshot=snapshot,
        stats=stats, counters=counters, num_running=len(queues.running),
        num_waiting=len(queues.waiting), num_swapped=len(queues.swapped),
        finished=tuple(self.finished), first_token_latencies=tuple(self.first_token_latencies),
        inter_token_latencies=_expand(self.inter_token_latencies), alerts=tuple(self.alerts),
        tokens=_expand(self.tokens))
