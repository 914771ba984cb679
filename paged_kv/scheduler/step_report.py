"""What a scheduler reports: `StepReport` (one step, handed to `Scheduler(on_step=...)`)
and in it `SchedulerStats`, the run's one set of cumulative counters. `StepRecord` is
the scheduler's own builder of a report (internal)."""

from __future__ import annotations

import dataclasses

import numpy as np

from paged_kv.core.errors import OOM_REASONS, Status
from paged_kv.telemetry import metrics

__all__ = ["SchedulerStats", "StepReport"]


def _seq_len_bucket(seq_len) -> int:
  """`seq_len` rounded up to a power of two (`oom_by_seq_len`'s key)."""
  return 1 << max(int(seq_len) - 1, 0).bit_length()


@dataclasses.dataclass
class SchedulerStats:
  """Cumulative counters of a serving run: requests and tokens, preemptions, the
  cache's evictions, shrinks, the pool's events (OOMs, compaction, packing,
  promotions) and its device traffic. The scheduler keeps one (`Scheduler.stats`,
  `StepReport.stats`); a bare pool's caller can keep one too (`record_status`).

  `oom_by_reason` (`OOM_REASONS` values) and `oom_by_seq_len` (power-of-two
  buckets of the sequence's length) count failed allocations.
  """

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
  compactions: int = 0  # compaction passes that moved a block
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
  # The pool's events.
  oom_by_reason: dict = dataclasses.field(default_factory=dict)
  oom_by_seq_len: dict = dataclasses.field(default_factory=dict)
  compaction_moves: int = 0  # blocks moved by compaction
  compaction_seconds: float = 0.0  # host seconds planning and moving them
  pack_moves: int = 0  # short tails moved into slotted blocks
  cow_splits: int = 0  # shared tails copied before an append
  promotions: int = 0  # blocks moved into the base region

  def record_status(self, status, seq_lens=None) -> int:
    """Counts the OOM statuses of a transition's output; returns how many."""
    status = np.asarray(status).reshape(-1)
    count = 0
    for code, reason in OOM_REASONS.items():
      hit = status == int(code)
      if hit.any():
        n = int(hit.sum())
        self.oom_by_reason[reason] = self.oom_by_reason.get(reason, 0) + n
        count += n
        if seq_lens is not None:
          for ln in np.asarray(seq_lens).reshape(-1)[hit]:
            b = _seq_len_bucket(ln)
            self.oom_by_seq_len[b] = self.oom_by_seq_len.get(b, 0) + 1
    return count

  def record_oom(self, reason: str | Status, seq_len: int | None = None) -> None:
    """Counts one OOM (a reason name or a `Status`)."""
    if isinstance(reason, Status):
      reason = OOM_REASONS[reason]
    self.oom_by_reason[reason] = self.oom_by_reason.get(reason, 0) + 1
    if seq_len is not None:
      b = _seq_len_bucket(seq_len)
      self.oom_by_seq_len[b] = self.oom_by_seq_len.get(b, 0) + 1

  def record_compaction(self, moves: int, seconds: float) -> None:
    """Counts one compaction pass of `moves` blocks that took `seconds`."""
    self.compactions += 1
    self.compaction_moves += int(moves)
    self.compaction_seconds += float(seconds)

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
    stats: the run's cumulative counters, the pool's events and device traffic
      included (the live object: read, don't keep; by kind: `Scheduler.runtime`).
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
  stats: SchedulerStats
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
  """Internal: the step a scheduler is running and what it did so far (for its `StepReport`):
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
             stats: SchedulerStats, queues) -> StepReport:
    """The `StepReport` of step `step` from this record and the queues after it."""
    return StepReport(
        step=step, time=time, host_seconds=host_seconds, pool=pool, snapshot=snapshot,
        stats=stats, num_running=len(queues.running),
        num_waiting=len(queues.waiting), num_swapped=len(queues.swapped),
        finished=tuple(self.finished), first_token_latencies=tuple(self.first_token_latencies),
        inter_token_latencies=_expand(self.inter_token_latencies), alerts=tuple(self.alerts),
        tokens=_expand(self.tokens))
