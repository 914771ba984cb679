"""`ProgressGuard`: a scheduler that stops advancing raises instead of spinning.

A step advances when it computes a token or a request finishes or is aborted. After
`SchedulerConfig.max_stalled_steps` steps in a row with work that do neither, the
next step raises `SchedulerStalled` at its start, naming what holds the pool: the
scheduler's rules make every step with work advance, so a stall is a bug.
"""

from __future__ import annotations

from paged_kv.core.errors import PagedKVError
from paged_kv.cache.cached_pool import CachedPool
from paged_kv.scheduler.request import RequestQueues
from paged_kv.scheduler.step_report import SchedulerStats


class SchedulerStalled(PagedKVError):
  """Steps with requests to serve made no progress (`SchedulerConfig.max_stalled_steps`
  in a row). The message names the requests and what holds the pool's blocks."""


class ProgressGuard:
  """Counts stalled steps in a row; see the module docstring."""

  def __init__(self, cached_pool: CachedPool, stats: SchedulerStats, queues: RequestQueues,
               max_stalled_steps: int):
    """`max_stalled_steps`: stalled steps in a row that raise (0: never)."""
    self.cached_pool = cached_pool
    self.stats = stats
    self.queues = queues
    self.max_stalled_steps = max_stalled_steps
    self.stalled = 0  # stalled steps in a row so far
    self._mark: tuple[int, int, int] | None = None  # the progress counters at the last check

  def _progress(self) -> tuple[int, int, int]:
    st = self.stats
    return st.prefill_tokens, st.decode_tokens, st.finished

  def check(self) -> None:
    """Counts the step before this one (called at every step's start); raises
    `SchedulerStalled` after `max_stalled_steps` stalled ones in a row."""
    mark, before = self._progress(), self._mark
    self._mark = mark
    q = self.queues
    if mark != before or before is None or not (q.running or q.waiting or q.swapped):
      self.stalled = 0
      return
    self.stalled += 1
    if self.max_stalled_steps and self.stalled >= self.max_stalled_steps:
      message = self.describe()
      self.stalled = 0
      raise SchedulerStalled(message)

  def describe(self) -> str:
    """What the scheduler holds now: the queues, the running rows, the pool's blocks."""
    q, cp = self.queues, self.cached_pool
    pool = cp.pool
    host = pool.host
    rows = ", ".join(
        f"{r.request_id!r} ({r.num_cached} tokens cached on {int(host.num_segments[r.seq_id])} "
        f"segments, {len(r.output)}/{r.max_new_tokens} output, "
        f"{'holding' if r.lock_node is not None else 'no'} cache lock)"
        for r in q.running[:8])
    evictable = cp.evictable().num_blocks
    return (f"no progress in {self.stalled} steps (no token computed, no request finished): "
            f"{len(q.running)} running [{rows}], {len(q.waiting)} waiting, "
            f"{len(q.swapped)} swapped; {pool.num_free_blocks} free blocks, {evictable} "
            f"evictable in the prefix cache, of {pool.config.num_blocks} "
            f"({pool.config.num_base_blocks} base)")

