"""The mirror's per-row tail columns (`HostState.tail_block`, `tail_end`, `tail_limit`).

They are derived from the tables and the slots (`HostState.row_tails`) but kept by
the row mutators alone (only the rows a call changes), so a step's reservation and
admission read them instead of the tables. Checked here: they equal the derivation
after every step of a serving loop (opens on cached prefixes with tail copies,
decode rows growing in place on the host or in the step, rows taking fresh blocks,
prompt chunks, releases), and a column that drifts is reported by the mirror's
compare (`verify`, so debug mode and `check_invariants`). The random differential
runs of `test_transitions_match` compare them after every operation too.
"""

from __future__ import annotations

import numpy as np
from absl.testing import absltest, parameterized

import paged_kv
from paged_kv.core.config import PoolConfig
from paged_kv.core.errors import InternalInconsistency
from paged_kv.pool import open_row
from paged_kv.pool import host_transitions as T
from paged_kv.pool.host_state import HostState
from paged_kv.scheduler.scheduler import DryExecutor, Request, Scheduler, SchedulerConfig


def _random_op(h: HostState, rng: np.random.Generator) -> str:
  """One random mirror transition: opens (some on a live row's segments, the tail
  shortened: shared partial tails), reservations of any size, decode steps (some
  grown by the step), releases, forks, tail copies."""
  bs = h.config.block_size
  op = str(rng.choice(["open", "reserve", "decode", "release", "fork", "cow"]))
  live, dead = np.flatnonzero(h.active), np.flatnonzero(~h.active)
  if op == "open" and dead.size:
    grid, k = np.zeros((3, 2, 4), np.int32), 0
    if live.size and rng.random() < 0.7:
      src = int(rng.choice(live))
      k = int(rng.integers(0, min(int(h.num_segments[src]), 4) + 1))
      grid[:, 0, :k] = np.stack([h.block[src, :k], h.start[src, :k], h.length[src, :k]])
      if k and rng.random() < 0.5:
        grid[2, 0, k - 1] = max(1, grid[2, 0, k - 1] - int(rng.integers(0, 3)))
    b = int(rng.integers(1, 3))  # one row (`open_row`) or a batch (`write_rows`)
    T.open_rows(h, np.array([int(rng.choice(dead)), -1][:b]), grid[0, :b], grid[1, :b],
                grid[2, :b], np.array([k, 0][:b]))
  elif op == "reserve" and live.size:
    ids = rng.choice(live, size=min(live.size, int(rng.integers(1, 4))), replace=False)
    T.reserve(h, ids, rng.integers(0, 2 * bs, ids.size), max_new_tokens=2 * bs,
              atomic=bool(rng.random() < 0.5))
  elif op == "decode" and live.size:
    ids = rng.permutation(np.concatenate([live, np.full(T.DECODE_FAST_MIN, -1)]))
    grow = np.zeros(ids.shape, np.int32) if rng.random() < 0.5 else None
    T.reserve(h, ids, np.where(rng.random(ids.size) < 0.9, 1, 2), max_new_tokens=2,
              atomic=False, grow=grow)
    h.log.reset(h)  # as the flush after a step's reservation
  elif op == "release" and live.size:
    T.release(h, np.array([int(rng.choice(live))]), atomic=True)
  elif op == "fork" and live.size and dead.size:
    T.fork(h, np.array([int(rng.choice(live))]), np.array([int(rng.choice(dead))]))
  elif op == "cow" and live.size:
    h.log.reset(h)  # a window without earlier page work
    k = min(int(rng.integers(1, 3)), live.size)  # one row (`move_tail`) or a batch
    T.cow_split(h, rng.choice(live, size=k, replace=False), atomic=False)
  return op


class TailColumnsTest(parameterized.TestCase):

  @parameterized.parameters(4, 64)  # one slot word and two
  def test_columns_follow_random_host_operations(self, block_size):
    cfg = PoolConfig(num_blocks=64, block_size=block_size, num_layers=1, num_kv_heads=1,
                     head_dim=2, max_seqs=12, max_segments=8)
    h, rng = HostState.empty(cfg), np.random.default_rng(block_size)
    grown = 0
    for step in range(300):
      before = int(h.tail_end.sum())
      op = _random_op(h, rng)
      grown += op == "decode" and int(h.tail_end.sum()) > before
      self.assertEqual(h.tail_differences(), [], f"step {step}: {op}")
    self.assertGreater(grown, 10)
    self.assertGreater(int(np.count_nonzero(h.tail_limit > h.tail_end)), 0)

  def test_columns_follow_a_serving_loop(self):
    bs, batch = 4, 10  # above transitions.DECODE_FAST_MIN: the decode path
    cfg = paged_kv.PoolConfig(num_blocks=120, block_size=bs, num_layers=1, num_kv_heads=1,
                              head_dim=2, max_seqs=batch, max_segments=32)
    pool = paged_kv.BlockPool(cfg, debug=False)
    sched = Scheduler(pool, DryExecutor(cfg),
                      SchedulerConfig(max_batch=batch, prefill_chunk=4 * bs,
                                      prefill_token_budget=8 * bs, compaction=None,
                                      output_reserve_ratio=0.0, stats_every=0,
                                      snapshot_every=0))
    rng = np.random.default_rng(0)
    system = rng.integers(0, 1000, 3 * bs + 2)  # a partial shared tail: opens copy it
    calls = {"grow_in_place": 0, "open_held": 0, "open_many_held": 0}
    grow, held, many = HostState.grow_in_place, open_row.open_held, open_row.open_many_held

    def counted(name, fn):
      def wrapper(h, *args, **kwargs):
        calls[name] += 1
        out = fn(h, *args, **kwargs)
        self.assertEqual(h.tail_differences(), [], name)  # at once: a later call may mend it
        return out
      return wrapper

    HostState.grow_in_place = counted("grow_in_place", grow)
    open_row.open_held = counted("open_held", held)
    open_row.open_many_held = counted("open_many_held", many)
    count = 0
    try:
      for step in range(25):
        while len(sched.running) + len(sched.waiting) < batch:
          prompt = np.concatenate([system, rng.integers(0, 1000, int(rng.integers(1, 3 * bs)))])
          sched.submit(Request(count, prompt, int(rng.integers(3, 16))))
          count += 1
        sched.step()
        self.assertEqual(pool.host.tail_differences(), [], f"step {step}")
    finally:
      HostState.grow_in_place, open_row.open_held, open_row.open_many_held = grow, held, many
    self.assertGreater(sched.stats.finished, 10)
    # Admissions on cached prefixes: with a tail copy one by one, else a step's together.
    self.assertGreater(calls["open_held"], 3)
    self.assertGreater(calls["open_many_held"], 3)
    self.assertGreater(calls["grow_in_place"], 10)  # rows the step grows
    sched.check_invariants()

  def test_a_drifted_column_is_reported(self):
    cfg = paged_kv.PoolConfig(num_blocks=16, block_size=4, num_layers=1, num_kv_heads=1,
                              head_dim=2, max_seqs=4, max_segments=8)
    for name in ("tail_block", "tail_end", "tail_limit"):
      pool = paged_kv.BlockPool(cfg, debug=False)
      seq = pool.open_sequence()
      pool.reserve_tokens([seq], [6])
      self.assertEqual(pool.host.tail_end[seq], 2)  # 6 tokens: one block and 2 of 4 slots
      self.assertEqual(pool.host.tail_limit[seq], 4)  # room for 2 more
      getattr(pool.host, name)[seq] += 1
      self.assertIn(name, " ".join(pool.host.tail_differences()))
      with self.assertRaisesRegex(InternalInconsistency, name):
        pool.verify()
      pool.check_invariants()  # the mirror reloaded from the device: consistent again
      self.assertEqual(pool.host.tail_differences(), [])


if __name__ == "__main__":
  absltest.main()
