"""`Finishing`: a sequence leaves its pool row, its computed tokens going into the cache.

A finished (or preempted-for-recompute, or aborted) sequence's cached tokens are
inserted into the radix cache, then its row is released (one device call for both).
With `pack_tails`, the new leaf's partial tail blocks are packed into slotted blocks;
every `RECLAIM_EVERY` steps of packing, slots of dead segments are reclaimed.
"""

from __future__ import annotations

import itertools
from typing import Callable

import numpy as np

from paged_kv.core.errors import PoolExhausted
from paged_kv.cache.cached_pool import CachedPool
from paged_kv.scheduler.request import (Request, RequestQueues, cacheable_tokens, drop_in_flight,
                                      is_finished)
from paged_kv.scheduler.running_rows import NO_STOP
from paged_kv.scheduler.step_report import SchedulerStats, StepRecord

RECLAIM_EVERY = 8  # steps between reclaims of dead slots, when packing tails


class Finishing:
  """Stores and releases sequences (see the module docstring)."""

  def __init__(self, cached_pool: CachedPool, stats: SchedulerStats,
               queues: RequestQueues, record: StepRecord, *, caching: bool,
               on_finished: Callable[[Request], None]):
    """`caching`: insert into the cache (else only release); `on_finished` is called
    for each request `finish` ended, after its release."""
    self.cached_pool = cached_pool
    self.stats = stats
    self.queues = queues
    self.record = record
    self.caching = caching
    self.on_finished = on_finished
    self._last_reclaim = -RECLAIM_EVERY
    self.stop_strings = None  # a `stop_strings.StopStringWatch` (`request_checks.accept`)

  def store_and_release(self, req: Request) -> None:
    """Inserts the sequence's cached tokens into the cache, then releases its row."""
    pack = ()
    n = cacheable_tokens(req)
    if self.caching and n > 0:
      outcome = self.cached_pool.insert(req.namespace, req.tokens[:n], req.seq_id, release=True)
      pack = outcome.pack
    else:
      self.cached_pool.release([req.seq_id])
    if pack:
      self._pack(pack)

  def release_running(self, req: Request) -> None:
    """Stores and releases a running request now, takes it off `running` and drops
    its lock on a cached prefix (it stays running if the release raises)."""
    self.store_and_release(req)
    self.queues.running.remove(req)
    drop_in_flight(req)
    node, req.lock_node, req.seq_id = req.lock_node, None, None
    if node is not None:
      self.cached_pool.unlock(node)

  def store_and_release_many(self, reqs: list[Request]) -> None:
    """`store_and_release` of several requests: one segment read, one device call for
    the cache's references and the release of every row, one packing pass."""
    if len(reqs) == 1:
      return self.store_and_release(reqs[0])
    pack = []
    entries = []
    if self.caching:
      for r in reqs:
        n = cacheable_tokens(r)
        if n > 0:
          entries.append((r.namespace, r.tokens[:n], r.seq_id))
    for outcome in self.cached_pool.insert_and_release(entries, [r.seq_id for r in reqs]):
      pack.extend(outcome.pack)
    if pack:
      self._pack(pack)

  def _pack(self, candidates) -> None:
    step = self.record.step
    if step - self._last_reclaim >= RECLAIM_EVERY:
      # Slots of segments that left slotted blocks become reusable (checked
      # against ref_count: every holder, tables and cache, is accounted for).
      self.cached_pool.reclaim_slots()
      self._last_reclaim = step
    try:
      # Base-region (promoted, shared) blocks are skipped; the pool moves the
      # tree's references and the cache rewrites its records.
      self.stats.pack_moves += self.cached_pool.pack(candidates)
    except PoolExhausted:
      pass  # nowhere to pack now (atomic: nothing changed); the tails stay as they are

  def _ended(self, running: list[Request]) -> np.ndarray:
    """`bool[n]`: `is_finished` of each running request, from the hot arrays
    (`RunningRows`): a stop reason, its output complete, or a stop token last."""
    t = self.queues.rows
    order = t.sync(running)
    n_out = t.output_lengths(order)
    ended = t.stopped[order] | (n_out >= t.max_new[order])
    maybe = np.flatnonzero(~ended & (n_out > 0) & (t.stop_tok[order] != NO_STOP))
    if maybe.size:
      last = t.last_tokens(order[maybe])
      ended[maybe] = t.stop_hits(order[maybe], last)
    return ended

  def finish(self) -> None:
    """Ends the running requests that are done: stored and released together, then
    handed to `on_finished`, then their cache locks dropped."""
    running = self.queues.running
    if self.stop_strings:  # requests whose text completed a stop string get their reason
      self.stop_strings.scan()
    ended = self._ended(running)
    if not ended.any():
      return
    done = list(itertools.compress(running, ended))
    keep = list(itertools.compress(running, ~ended))
    for r in done:
      is_finished(r)  # names the stop reason
    self.store_and_release_many(done)  # the requests stay running until this succeeded
    running[:] = keep
    self.queues.rows.kept(running, ~ended)
    nodes = []
    for req in done:
      drop_in_flight(req)
      node, req.lock_node, req.seq_id = req.lock_node, None, None
      self.on_finished(req)
      if node is not None:
        nodes.append(node)
    for node in nodes:  # (an exception here: the step's recovery rebuilds the lock counts)
      self.cached_pool.unlock(node)
