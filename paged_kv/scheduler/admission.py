"""`Admission`: which queued requests start running this step, and the room they need.

Swapped-out requests first, then the waiting ones, FCFS, until one does not fit:
its whole uncomputed context (so it is not preempted at once), `output_reserve_ratio`
of every admitted sequence's remaining output and the watermark must fit now, after
evicting cached-only blocks. Its prompt's cached prefix is matched, locked and
shared, except for a request in `RequestQueues.unshared`, a penalized one and one
asking for `prompt_logprobs` (their own steps must compute every token). A request
alone in a drained pool is always admitted (`alone_need`), so the scheduler never
stalls; governance's live quota holds requests back only while something runs.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from paged_kv.core.errors import InvalidArgument, PagedKVError, PoolExhausted
from paged_kv.scheduler import parallel_sampling
from paged_kv.cache.cached_pool import CachedPool
from paged_kv.scheduler.eviction import Evictor
from paged_kv.scheduler.progress import ProgressGuard
from paged_kv.scheduler.request import Phase, Request, RequestQueues
from paged_kv.scheduler.scheduler_config import SchedulerConfig
from paged_kv.scheduler.step_report import SchedulerStats, StepRecord
from paged_kv.scheduler.swap import swap_in
from paged_kv.telemetry import metrics


def cdiv(a: int, b: int) -> int:
  return -(-a // b)


class _Admission(NamedTuple):
  """A waiting request admitted in this step, to open with the others."""

  request: Request
  segments: np.ndarray  # i32[n, 3] the matched prefix it shares
  node: object  # the locked match node (None: no match)
  matched: int  # tokens the segments cover
  context_size: int  # tokens to compute before its next output token
  forked: bool = False  # the segments are its first request's (`parallel_sampling`)


def _tail_copies(host, admits: list[_Admission], rows) -> int:
  """The admitted rows that opened on a copy of their prefix's partial tail (a
  continued turn's, or a fork's): their last segment is in another block."""
  copies = 0
  for a, row in zip(admits, rows):
    k = len(a.segments)
    if k and int(host.block[row, k - 1]) != int(a.segments[k - 1, 0]):
      copies += 1
  return copies


class Admission:
  """Admits queued requests into pool rows (see the module docstring)."""

  def __init__(self, cached_pool: CachedPool, config: SchedulerConfig, stats: SchedulerStats,
               evictor: Evictor, queues: RequestQueues, record: StepRecord, *, caching: bool):
    self.cached_pool = cached_pool
    self.config = config
    self.stats = stats
    self.evictor = evictor
    self.queues = queues
    self.record = record
    self.caching = caching
    gov, pc = config.governance, cached_pool.config
    self.quota = (gov.quota(pc.num_blocks - pc.num_base_blocks)
                  if gov is not None and gov.quotas else None)
    self.live_limit: int | None = None  # this step's live quota (governance)
    self.live_used = 0  # live blocks: the latest figures plus what this step admitted
    # Per `admit` call (None outside it): the output reserve of the running and
    # just-admitted requests, and the free blocks left for the step's admissions.
    self._reserve_base: int | None = None
    self._admit_free: int | None = None
    self.progress = ProgressGuard(cached_pool, stats, queues, config.max_stalled_steps)

  @property
  def pool(self):
    return self.cached_pool.pool

  @property
  def block_size(self) -> int:
    return self.cached_pool.pool.config.block_size

  # ------------------------------------------------------------------ at submit
  def alone_need(self, request: Request) -> int:
    """The most dynamic blocks `request` needs alone in a drained pool computing every
    token: its prompt and output, a partial block each, plus the watermark. `submit`
    refuses more than the pool; a lone head is admitted within it (`_try_admit`)."""
    p, m, bs = int(request.prompt.size), int(request.max_new_tokens), self.block_size
    return cdiv(p, bs) + cdiv(m, bs) + 2 + self.config.watermark_blocks

  def largest_need(self) -> int:
    """The most blocks any unfinished request may need alone in the pool."""
    q = self.queues
    return max((self.alone_need(r) for r in (*q.waiting, *q.swapped, *q.running)), default=0)

  def check_fits(self, request: Request) -> None:
    """`submit`'s checks against the pool and the config (nothing changes):
    `PoolExhausted` when it could not run even in an empty pool or could overflow its
    segment table; `InvalidArgument` beyond `max_logprobs` or `max_seq_len`."""
    limit = self.config.max_seq_len
    if limit is not None and request.prompt.size + request.max_new_tokens > limit:
      raise InvalidArgument(
          f"request {request.request_id!r} asks for {request.prompt.size} prompt + "
          f"{request.max_new_tokens} new tokens = "
          f"{request.prompt.size + request.max_new_tokens}; SchedulerConfig.max_seq_len is "
          f"{limit}")
    pc = self.pool.config
    need = self.alone_need(request)
    if need > pc.num_blocks - pc.num_base_blocks:
      raise PoolExhausted(f"request {request.request_id} needs up to {need} blocks; the pool "
                          f"has {pc.num_blocks - pc.num_base_blocks} dynamic blocks",
                          reason="no_free_block")
    if cdiv(request.prompt.size + request.max_new_tokens, pc.block_size) > pc.max_segments:
      raise PoolExhausted(f"request {request.request_id} may need more than "
                          f"max_segments={pc.max_segments} segments", reason="table_full")
    sp = request.sampling
    if sp is not None and sp.logprobs > self.config.max_logprobs:
      raise InvalidArgument(f"request {request.request_id!r} asks {sp.logprobs} logprobs; "
                            f"SchedulerConfig.max_logprobs is {self.config.max_logprobs}")

  # ------------------------------------------------------------------ each step
  def govern(self, figures: metrics.StepStats | None) -> metrics.StepStats | None:
    """The start of a step: the progress guard (raises `SchedulerStalled`), then
    governance (GC marks, quota update, cached-quota eviction). Returns the figures
    the quota read (`figures`, else the host mirror's now), or None without a quota."""
    self.progress.check()
    gov = self.config.governance
    if gov is None or not self.caching:
      return None
    if gov.gc_ttl is not None and self.record.step % gov.gc_every == 0:
      self.stats.gc_marked_nodes += self.cached_pool.gc_mark(gov.gc_ttl).num_nodes
    if self.quota is None:
      return None
    fig = figures or metrics.step_stats_host(self.pool.host, self.pool.config,
                                             counters=self.stats)
    decision = self.quota.update(fig.used_blocks, fig.cached_blocks)
    self.live_limit, self.live_used = decision.live_limit, fig.used_blocks
    if decision.evict_cached > 0:
      self.stats.quota_evicted_blocks += self.evictor.evict(decision.evict_cached)
    return fig

  def free_rows(self) -> int:
    """Rows a step may still admit into (`max_batch`, the pool's rows)."""
    return min(self.config.max_batch, self.pool.config.max_seqs) - len(self.queues.running)

  def admit(self) -> None:
    """Swapped requests first, then the waiting ones, FCFS, until one does not fit;
    the waiting ones open together (`CachedPool.open_many`), each decided as if those
    before it were open (reserve and free blocks tracked on the host)."""
    q = self.queues
    if not (q.waiting or q.swapped) or self.free_rows() <= 0:
      return  # nothing can be admitted (and the reserve sum below is O(batch) Python)
    self._reserve_base = self.reserve_sum(q.running) + self.next_token_blocks()
    try:
      if self._admit_swapped():
        self._admit_waiting()
    finally:
      self._reserve_base = self._admit_free = None

  def _admit_swapped(self) -> bool:
    """Swaps requests back in while they fit; False when the head must wait for room."""
    q, ensure_free = self.queues, self.evictor.ensure_free
    while q.swapped and self.free_rows() > 0:
      req = q.swapped[0]
      need = cdiv(req.swapped.length, self.block_size) + 1
      wm = self.config.watermark_blocks
      if not ensure_free(need + self.output_reserve(req) + wm) and (
          q.running or not ensure_free(need + wm)):  # alone: as `_try_admit`
        return False  # swapped requests go first: wait for room
      seq = swap_in(self.pool, req.swapped)  # atomic: nothing opened on an exception
      q.swapped.popleft()
      req.seq_id = seq
      self.stats.swap_in_bytes += req.swapped.nbytes
      req.swapped = None
      req.phase = Phase.RUNNING
      q.running.append(req)
      self._reserve_base += self.request_reserve(req)
    return True

  def _admit_waiting(self) -> None:
    q = self.queues
    admits: list[_Admission] = []
    rows = self.free_rows()
    tails: set = set()  # continuable tails this step's opens copy
    skipped = False
    for req in q.waiting:  # nothing below changes the queue until the opens succeed
      if len(admits) >= rows:
        break
      if req.sample_of is not None and parallel_sampling.held_back(req):
        skipped = True  # it forks its first request's row once the prompt is computed
        continue
      admission = self._try_admit(req, tails, len(admits))
      if admission is None:
        break
      admits.append(admission)
    if not admits:
      return
    try:
      seqs = self.cached_pool.open_many([a.segments for a in admits])
      forks = [int(seq) for a, seq in zip(admits, seqs) if a.forked]
      if forks:  # copy-on-write of the shared partial tails (no block: a fresh one later)
        self.pool.cow_split(forks, skip_exhausted=True)
      self.stats.cow_splits += _tail_copies(self.pool.host, admits, seqs)
    except PagedKVError:
      for a in admits:
        if a.node is not None:
          self.cached_pool.unlock(a.node)
      raise  # (other exceptions: the step's recovery rebuilds the lock counts)
    for a, seq in zip(admits, seqs):
      req = a.request
      req.seq_id, req.lock_node, req.num_cached = int(seq), a.node, a.matched
      req.prefill_target = a.context_size
      req.phase = Phase.RUNNING
      if req.admit_step < 0:
        req.admit_step = self.record.step
        req.admit_time = self.record.now
        req.hit_tokens = a.matched
        self.stats.admitted += 1
        self.stats.prompt_tokens += int(req.prompt.size)
        self.stats.hit_tokens += a.matched
      if skipped:
        q.waiting.remove(req)
      else:
        q.waiting.popleft()
      q.running.append(req)

  def _admit_room(self, need: int) -> bool:
    """`Evictor.ensure_free` for the waiting requests of a step: the free blocks are read
    once and tracked (an eviction adds what it freed, a pending tail copy takes one)."""
    if self._admit_free is None:
      self._admit_free = self.pool.num_free_blocks
    if need > self._admit_free:
      self._admit_free += self.evictor.evict(need - self._admit_free)
    return self._admit_free >= need

  def _try_admit(self, req: Request, tails: set, pending: int = 0) -> _Admission | None:
    """Matches `req`'s prefix (locked) and decides whether it fits now; None: it waits.
    `pending` requests of this step were admitted before it; `tails` are the
    continuable tails their opens copy (a copy takes a block)."""
    bs, running = self.block_size, self.queues.running
    resumed = bool(req.output)
    # A resumed request recomputes everything but its pending token; a fresh one
    # keeps at least one prompt token to compute (for the first token's logits).
    context = req.tokens[:-1] if resumed else req.prompt
    probe = context if resumed else context[:-1]
    matched, segs, node = 0, np.zeros((0, 3), np.int32), None
    unshared = id(req) in self.queues.unshared
    # A penalized request reads its own token history (`paged_kv.model.penalties`),
    # which holds only what its own steps cached, and prompt logprobs come from the
    # steps that compute the prompt: no shared prefix.
    sp = req.sampling
    own_prefix = sp is not None and (sp.penalized or sp.prompt_logprobs is not None)
    fork = (None if req.sample_of is None or unshared
            else parallel_sampling.fork_prefix(req, self.pool.host))
    if fork is not None:
      segs, matched = fork
    elif self.caching and probe.size and not unshared and not own_prefix:
      m = self.cached_pool.match(req.namespace, probe, lock=True, record=not resumed)
      matched, segs, node = m.length, m.segments, m.node
    # Keep the segment table from overflowing: a matched prefix may hold more segments
    # than its tokens need (nodes split mid-block), and the tokens still to come take
    # one segment per fresh block (they start at slot 0 after a shared tail and then
    # fill in place). Share fewer segments (compute more) when it would not fit; with
    # no shared segment it fits, by `submit`'s check.
    out_left = req.max_new_tokens - len(req.output)
    while len(segs) and len(segs) + cdiv(context.size - matched + out_left, bs) > (
        self.pool.config.max_segments):
      segs = segs[:-1]
      matched = int(segs[:, 2].sum())
    need = cdiv(context.size - matched, bs) + 1
    held = (self.live_limit is not None and (running or pending)
            and self.live_used + need > self.live_limit)  # never when nothing runs
    if held:
      self.stats.quota_holds += 1
    alone = not running and not pending
    if held or not self._admit_room(need + self.output_reserve(req)
                                    + self.config.watermark_blocks):
      if node is not None:
        self.cached_pool.unlock(node)
      if held or not alone:
        return None
      # Alone, the usual check can ask more than the drained pool holds: a cached prefix
      # locks its blocks (not evictable) while the tokens after it take fresh ones (a
      # copied partial tail, a partial block), and a resumed request's context plus its
      # output reserve can pass `submit`'s bound by a block. The reserve guards others'
      # growth (there are none) and the prefix is optional: without both the request
      # asks at most `alone_need`, which `submit` checked. Admit it so, never stall.
      dropped = bool(matched)
      matched, segs, node = 0, segs[:0], None
      need = cdiv(context.size, bs) + 1
      if not self._admit_room(need + self.config.watermark_blocks):
        return None  # only pinned cached blocks can hold the drained pool
      self.stats.prefix_dropped += dropped
    if unshared and alone:
      self.queues.unshared.discard(id(req))
    self.live_used += need
    self._reserve_base += self.reserve_blocks(int(context.size) - matched, out_left)
    forked = fork is not None and len(segs) > 0
    if forked and segs[-1, 2] < bs and self._admit_free > 0:
      self._admit_free -= 1  # its tail's copy (`_admit_waiting`)
    elif self.cached_pool.continues_tail(segs):
      tail = tuple(int(x) for x in segs[-1])
      if tail not in tails and tail[2] < bs:
        tails.add(tail)
        if self._admit_free > 0:  # the copy takes a block when one is free
          self._admit_free -= 1
    return _Admission(req, segs, node, matched, int(context.size), forked)

  def next_token_blocks(self) -> int:
    """Fresh blocks the running rows past their prompt take for their next token (a
    row not appending in place to an exclusive tail: `HostState.tail_limit`), kept
    free: a newcomer admitted into them would be preempted by the same step."""
    t = self.queues.rows
    order = t.sync(self.queues.running)
    ids = t.seq_id[order[t.num_cached[order] >= t.prefill_target[order]]]
    if not ids.size:
      return 0
    h = self.pool.host
    room = (h.tail_limit[ids] > h.tail_end[ids]) & (h.ref_count[h.tail_block[ids]] == 1)
    return int(np.count_nonzero(~room))

  # ------------------------------------------------------------------ the output reserve
  def reserve_blocks(self, prompt_left: int, out_left: int) -> int:
    """Blocks one sequence keeps free: its uncomputed prompt and `output_reserve_ratio`
    of its output to come (one more block for a partial tail)."""
    tokens = max(prompt_left, 0) + int(self.config.output_reserve_ratio * max(out_left, 0))
    return cdiv(tokens, self.block_size) + 1 if tokens else 0

  def request_reserve(self, r: Request) -> int:
    return self.reserve_blocks(r.prefill_target - r.num_cached, r.max_new_tokens - len(r.output))

  def reserve_sum(self, requests) -> int:
    """`sum(request_reserve(r) for r in requests)`, inlined (O(batch) every step that
    admits; from the hot arrays for a large batch)."""
    bs, ratio, total = self.block_size, self.config.output_reserve_ratio, 0
    if requests is self.queues.running and len(requests) > 8:  # from the hot arrays
      t = self.queues.rows
      order = t.sync(requests)
      tokens = np.maximum(t.prefill_target[order] - t.num_cached[order], 0)
      if ratio:
        out = t.max_new[order] - t.output_lengths(order)
        tokens = tokens + np.where(out > 0, (ratio * out).astype(np.int64), 0)
      tokens = tokens[tokens > 0]
      return int(np.sum(-(-tokens // bs) + 1))
    if not ratio:  # the uncomputed prompts only
      for r in requests:
        tokens = r.prefill_target - r.num_cached
        if tokens > 0:
          total += -(-tokens // bs) + 1
      return total
    for r in requests:
      tokens = r.prefill_target - r.num_cached
      if tokens < 0:
        tokens = 0
      out = r.max_new_tokens - len(r.output)
      if out > 0:
        tokens += int(ratio * out)
      if tokens:
        total += -(-tokens // bs) + 1
    return total

  def output_reserve(self, new: Request) -> int:
    """Blocks to keep free for what admitted sequences will still need: every running
    sequence's uncomputed prompt, plus `output_reserve_ratio` of the output still to
    come of the running ones and of `new` (kept as a sum during `admit`)."""
    base = self._reserve_base
    if base is None:
      base = self.reserve_sum(self.queues.running)
    return base + self.reserve_blocks(0, new.max_new_tokens - len(new.output))
