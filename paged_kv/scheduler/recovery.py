"""Reconciling a scheduler after an exception interrupted a step (`Scheduler.step`).

The `CachedPool` restores pool/cache agreement; running requests whose rows are
gone are re-queued for recompute, rows no request owns are released, lock counts
rebuilt, invariants checked: every request is then queued, running or finished.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from paged_kv.cache.cached_pool import CachedPool, PoolStateLost, state_lost
from paged_kv.scheduler.request import Phase, Request, RequestQueues, drop_in_flight, is_finished


def recover(cached_pool: CachedPool, queues: RequestQueues, exc: BaseException,
            on_finished: Callable[[Request], None]) -> None:
  """Reconciles requests, rows, locks and the cache after `exc` interrupted a step.
  `PoolStateLost` when the pool's state buffers were deleted."""
  pool = cached_pool.pool
  if state_lost(pool):
    raise PoolStateLost(f"the pool's state buffers were deleted by {type(exc).__name__}: "
                        f"{exc} (an executor that raises after donating must attach the "
                        f"new state, see paged_kv.scheduler.executor)")
  if cached_pool.recover():  # pool and cache disagreed: the cache was dropped
    for req in queues.running:
      req.lock_node = None
  reconcile_rows(pool, queues, on_finished)
  cached_pool.reset_locks([r.lock_node for r in queues.running if r.lock_node is not None])
  cached_pool.check_invariants()


def reconcile_rows(pool, queues: RequestQueues, on_finished: Callable[[Request], None]) -> None:
  """Every running request owns a live row holding exactly its cached tokens; every
  live row belongs to a running request."""
  host = pool.host  # reloaded from the device after an interrupted step
  active, seq_len = host.active, host.seq_len
  owned: set[int] = set()
  for req in list(queues.running):
    row = req.seq_id
    if (row is not None and active[row] and row not in owned
        and int(seq_len[row]) == req.num_cached):
      owned.add(row)
      continue
    # Its row is gone (released by the interrupted call) or holds tokens whose
    # results were lost (an executor raised after reserving): recompute it.
    queues.running.remove(req)
    req.seq_id, req.lock_node = None, None
    if is_finished(req):  # finished, and its release went through
      on_finished(req)
      continue
    req.num_cached = 0
    req.phase = Phase.WAITING
    queues.waiting.appendleft(req)
  stray = [int(r) for r in np.flatnonzero(active) if int(r) not in owned]
  if stray:
    pool.release(stray)


def requeue(finishing, queues: RequestQueues, requests: list[Request]) -> None:
  """Takes running `requests` off their rows for recompute: their computed tokens that
  the host knows go into the cache, the rest is computed again once re-admitted."""
  for req in requests:
    finishing.store_and_release(req)
    queues.running.remove(req)
    drop_in_flight(req)
    node, req.lock_node, req.seq_id = req.lock_node, None, None
    if node is not None:
      finishing.cached_pool.unlock(node)
    req.num_cached = 0
    req.phase = Phase.WAITING
    queues.waiting.appendleft(req)
