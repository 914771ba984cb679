"""The host side of a scheduler step, counted (not timed).

* A step's reservation predicted on the host mirror (`step_reservation.predict_step`,
  each step of the k-step decode's `BlockPool.predict_decode_steps`), runs
  the same Python code at any batch size: no per-row Python call or numpy call on
  one row's entries (the number of Python-level calls is the same at 16 and 64 rows).
* In a steady serving loop (admission with cached prefixes, chunked prefill,
  decode, finishing into the cache, eviction) no step takes a general batch path
  of the mirror (`row_status`, the general `_reserve`, `open_sequences`) or the
  radix cache's lookup path: admissions open one row at a time, finishing
  sequences are released on a short path, eviction reads the mirror's counts.
* A step in which every running request decodes a token runs the same Python
  code of the serving package at any batch size (the requests' hot progress is in `RunningRows`' arrays).
* A running request's progress fields are one storage with those arrays; its
  output's count (`n_out`) follows every append the step makes.
* A host reservation (`BlockPool.reserve_step`) commits only the rows that took a
  block; rows that grow in place are the step's to apply (no commit at all when
  every row grows in place).
* The single step's reservation is the host's alone: no step of a scheduler without
  the k-step decode predicts a device reservation, and an executor that reserves
  again inside its step leaves a device the mirror catches.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from unittest import mock

import numpy as np
from absl.testing import absltest

import paged_kv
from paged_kv.core import compact, sequences
from paged_kv.core.errors import InternalInconsistency
from paged_kv.pool import host_transitions as transitions
from paged_kv.pool import step_reservation
from paged_kv.model import metadata
from paged_kv.model.plan import StepPlan
from paged_kv.scheduler.running_rows import RunningList, RunningRows
from paged_kv.scheduler.scheduler import DryExecutor, Request, Scheduler, SchedulerConfig
from radix.eviction import EvictionPlanner


def _count_calls(fn, where: tuple[str, ...] = ("",)) -> int:
  """Python-level calls (`sys.setprofile` "call" events) made while `fn()` runs, of
  functions whose file's path contains one of `where`."""
  calls = 0

  def profile(frame, event, arg):
    nonlocal calls
    if event == "call" and any(w in frame.f_code.co_filename for w in where):
      calls += 1

  sys.setprofile(profile)
  try:
    fn()
  finally:
    sys.setprofile(None)
  return calls


def _prediction_calls(batch: int) -> int:
  """Python calls (the library's own functions) of one decode step's prediction over
  `batch` rows: every row one token, all in place but four that need a fresh block."""
  cfg = paged_kv.PoolConfig(num_blocks=8 * batch, block_size=4, num_layers=1, num_kv_heads=1,
                            head_dim=2, max_seqs=batch, max_segments=8)
  pool = paged_kv.BlockPool(cfg, debug=False)
  rows = np.array([pool.open_sequence() for _ in range(batch)])
  pool.reserve_tokens(rows, np.where(np.arange(batch) < 4, 4, 2))  # 4 full tails
  pool.verify()  # no commit left to compare: `poll` inside the prediction finds none ready
  ones = np.ones(batch, np.int32)
  out = {}
  calls = _count_calls(lambda: out.setdefault(
      "pred", step_reservation.predict_step(pool, rows, ones, max_new_tokens=1)),
                       ("/paged_kv/", "/radix/"))
  pred = out["pred"]
  np.testing.assert_array_equal(pred.status, 0)
  assert (pred.slot_idx[:, 0] >= 0).all()
  return calls


class PredictionTest(absltest.TestCase):

  def test_the_prediction_does_the_same_python_work_at_any_batch(self):
    _prediction_calls(40)  # the first call fills caches
    small, large = _prediction_calls(40), _prediction_calls(160)
    self.assertEqual(small, large)
    self.assertLess(small, 60)


def _reserve_step_window(batch: int, full_tails: int):
  """A host reservation (`BlockPool.reserve_step`) of one token per row over `batch`
  rows, `full_tails` of them with a full tail block, applied by `DryExecutor`; returns
  `(commit dispatches, rows and blocks the commit held, pool)`."""
  cfg = paged_kv.PoolConfig(num_blocks=8 * batch, block_size=4, num_layers=1, num_kv_heads=1,
                            head_dim=2, max_seqs=batch, max_segments=8)
  pool = paged_kv.BlockPool(cfg, debug=False)
  rows = np.array([pool.open_sequence() for _ in range(batch)])
  pool.reserve_tokens(rows, np.where(np.arange(batch) < full_tails, 4, 2))
  pool.verify()
  ex = DryExecutor(cfg)
  held = []
  log = pool._log  # pylint: disable=protected-access
  batches = log.batches
  log.batches = lambda host: held.append((log.num_rows, log.touched_blocks(host).size)) or \
      batches(host)
  before = pool.runtime.snapshot()
  ones = np.ones(batch, np.int32)
  pred = pool.reserve_step(rows, ones, max_new_tokens=1, grow_in_step=True)
  plan = StepPlan(seq_ids=rows.astype(np.int32), num_new=ones, tokens=np.zeros(batch, np.int32))
  plan = dataclasses.replace(plan, reserved=metadata.reserved_slots(plan, pred.slot_idx,
                                                                    pred.status, pred.grow,
                                                                    pred.clock))
  state, _, status = ex.step(pred.state, plan)
  pool.adopt_step(state, pred, device_status=status)
  commits = pool.runtime.snapshot().since(before).dispatches.get("commit", 0)
  return commits, held, pool, pred


class ReserveStepTest(absltest.TestCase):
  """Rows that grow in place stay out of the commit: the step applies them."""

  def test_a_decode_step_in_place_commits_nothing(self):
    commits, held, pool, pred = _reserve_step_window(40, 0)
    self.assertEqual((commits, held), (0, []))
    np.testing.assert_array_equal(pred.grow, 1)
    pool.verify()  # the device, grown by the step, equals the mirror
    pool.check_invariants()

  def test_only_rows_that_take_a_block_are_committed(self):
    commits, held, pool, pred = _reserve_step_window(40, 4)
    self.assertEqual(commits, 1)
    self.assertEqual(held, [(4, 4)])  # the 4 rows that took a block, and those blocks
    np.testing.assert_array_equal(pred.grow, np.arange(40) >= 4)
    pool.verify()
    pool.check_invariants()


class SteadyLoopTest(absltest.TestCase):

  def test_no_general_batch_path_in_a_steady_loop(self):
    bs, batch = 4, 16
    cfg = paged_kv.PoolConfig(num_blocks=160, block_size=bs, num_layers=1, num_kv_heads=1,
                              head_dim=2, max_seqs=batch, max_segments=32)
    sched = Scheduler(paged_kv.BlockPool(cfg, debug=False), DryExecutor(cfg), SchedulerConfig(
        max_batch=batch, prefill_chunk=4 * bs, prefill_token_budget=8 * bs, compaction=None,
        output_reserve_ratio=0.0, stats_every=0, snapshot_every=0))
    rng = np.random.default_rng(0)
    system = rng.integers(0, 1000, 4 * bs)
    count = [0]

    def top_up():
      while len(sched.running) + len(sched.waiting) < batch:
        prompt = np.concatenate([system, rng.integers(0, 1000, int(rng.integers(1, 3 * bs)))])
        sched.submit(Request(count[0], prompt, int(rng.integers(4, 24))))
        count[0] += 1

    for _ in range(40):  # past the first admissions, the cache full
      top_up()
      sched.step()
    watched = {
        (transitions, "row_status"): "general", (transitions, "_reserve"): "general",
        (paged_kv.BlockPool, "open_sequences"): "general",
        (EvictionPlanner, "_take_looked_up"): "general",
        (transitions, "_reserve_rows"): "short", (paged_kv.BlockPool, "_open_few"): "short",
        (EvictionPlanner, "_take_plain"): "short", (transitions, "_decode_fast"): "short"}
    calls = {key: 0 for key in watched}
    originals = {(owner, name): inspect.getattr_static(owner, name) for owner, name in watched}

    def counting(key):
      fn = getattr(*key)

      def wrapper(*args, **kwargs):
        calls[key] += 1
        return fn(*args, **kwargs)
      return staticmethod(wrapper) if isinstance(originals[key], staticmethod) else wrapper

    for (owner, name) in watched:
      setattr(owner, name, counting((owner, name)))
    try:
      for _ in range(60):
        top_up()
        sched.step()
    finally:
      for (owner, name), fn in originals.items():
        setattr(owner, name, fn)
    sched.check_invariants()
    for (owner, name), kind in watched.items():
      n = calls[(owner, name)]
      if kind == "general":
        self.assertEqual(n, 0, f"{name} ran {n} times in 60 steady steps")
      else:
        self.assertGreater(n, 0, f"the workload never took {name}")


def _decode_step_calls(batch: int, overlap: bool) -> int:
  """Python calls of the serving package's functions in one scheduler step in which
  `batch` running requests each decode a token: nothing admitted, nothing finishing
  (the pool's reservation has its own test above)."""
  cfg = paged_kv.PoolConfig(num_blocks=16 * batch, block_size=4, num_layers=1,
                            num_kv_heads=1, head_dim=2, max_seqs=batch, max_segments=16)
  sched = Scheduler(paged_kv.BlockPool(cfg, debug=False), DryExecutor(cfg), SchedulerConfig(
      max_batch=batch, prefill_chunk=64, prefill_token_budget=64 * batch, compaction=None,
      output_reserve_ratio=0.0, stats_every=0, snapshot_every=0, overlap=overlap,
      enable_prefix_cache=False))
  for i in range(batch):
    sched.submit(Request(i, np.arange(i * 10, i * 10 + 5), 40))
  for _ in range(4):  # prompts done, first tokens read, every row decoding
    sched.step()
  assert len(sched.running) == batch and not sched.waiting
  calls = _count_calls(sched.step, ("/paged_kv/scheduler/", "/paged_kv/cache/"))
  assert len(sched.running) == batch and not sched.finished
  return calls


class DecodeStepTest(absltest.TestCase):

  def test_a_decode_step_does_the_same_python_work_at_any_batch(self):
    for overlap in (True, False):
      _decode_step_calls(16, overlap)  # the first steps fill caches
      small, large = _decode_step_calls(16, overlap), _decode_step_calls(64, overlap)
      self.assertEqual(small, large, f"overlap={overlap}")


class RequestFieldsTest(absltest.TestCase):

  def test_progress_is_one_storage_while_running(self):
    sched = Scheduler(paged_kv.BlockPool(paged_kv.PoolConfig(
        num_blocks=64, block_size=4, num_layers=1, num_kv_heads=1, head_dim=2, max_seqs=4,
        max_segments=8)), DryExecutor.__new__(DryExecutor), SchedulerConfig(max_batch=4))
    req = Request("a", np.arange(6), 4)
    sched.submit(req)
    req.num_cached = 2  # unbound: the object's own field
    rows = sched.queues.rows
    sched.running.append(req)
    slot = rows.sync(sched.running)[0]
    self.assertIs(req._rows, rows)  # pylint: disable=protected-access
    self.assertEqual(rows.num_cached[slot], 2)
    req.num_cached += 1  # a write through the request lands in the table ...
    self.assertEqual(rows.num_cached[slot], 3)
    rows.in_flight[slot] = 2  # ... and the table's passes are what the request reads
    self.assertEqual((req.in_flight, type(req.in_flight)), (2, int))
    req.stop_reason = "abort"
    self.assertTrue(rows.stopped[slot])
    sched.running.remove(req)
    rows.sync(sched.running)  # it left running: unbound, its values on the object
    self.assertIsNone(req._rows)  # pylint: disable=protected-access
    self.assertEqual((req.num_cached, req.in_flight, req.stop_reason), (3, 2, "abort"))
    with self.assertRaisesRegex(paged_kv.InvalidArgument, "frozen"):
      req.max_new_tokens = 9

  def test_output_counts_follow_every_append(self):
    # `n_out` is the step's count of each bound request's output: the numpy
    # passes (one row at a time for a first token, all rows at once after) keep it,
    # and `check_invariants` catches an output changed behind the scheduler's back.
    cfg = paged_kv.PoolConfig(num_blocks=64, block_size=4, num_layers=1, num_kv_heads=1,
                              head_dim=2, max_seqs=4, max_segments=16)
    for overlap in (True, False):
      sched = Scheduler(paged_kv.BlockPool(cfg), DryExecutor(cfg), SchedulerConfig(
          max_batch=4, prefill_chunk=8, prefill_token_budget=16, compaction=None,
          overlap=overlap))
      for i in range(6):
        sched.submit(Request(i, np.arange(i, i + 5 + 3 * i), 3 + 2 * i))
      rows = sched.queues.rows
      for _ in range(40):
        sched.step()
        sched.check_invariants()
        bound = [r for r in sched.running if r._rows is rows]  # pylint: disable=protected-access
        for r in bound:
          self.assertEqual(rows.n_out[r._slot], len(r.output))  # pylint: disable=protected-access
        if sched.stats.finished >= 2 and any(len(r.output) >= 2 for r in bound):
          break
      else:
        self.fail("no request ran long enough")
      bound[-1].output.append(7)
      with self.assertRaisesRegex(paged_kv.InvariantViolation, "n_out"):
        sched.check_invariants()

  def test_sync_follows_every_change_of_running(self):
    # `RunningList` tells `sync` what changed since its last read (nothing, or
    # appends only) without a per-request comparison; any other change, and a
    # plain list, get the full comparison. The slots must match `running` after each.
    changes = [lambda l, r: l.append(r[4]), lambda l, r: l.extend(r[5:7]),
               lambda l, r: l.remove(r[1]), lambda l, r: l.insert(0, r[7]),
               lambda l, r: l.__setitem__(1, r[8]), lambda l, r: l.__delitem__(0),
               lambda l, r: l.sort(key=lambda q: -q.request_id), lambda l, r: l.pop(),
               lambda l, r: l.__setitem__(slice(None), [r[0], r[9]] + l[:2]),
               lambda l, r: l.reverse(), lambda l, r: l.__iadd__([r[10]]), lambda l, r: l.clear()]
    for running in (RunningList(), []):
      rows, reqs = RunningRows(), [Request(i, np.arange(3), 4) for i in range(11)]
      running.extend(reqs[:4])
      for change in [None] + changes:
        if change is not None:
          change(running, reqs)
        for _ in range(2):  # the second sync: nothing changed since
          order = rows.sync(running)
          self.assertEqual(list(map(id, rows.req[order].tolist())), list(map(id, running)))
          bound = [r for r in reqs if r._rows is rows]  # pylint: disable=protected-access
          self.assertCountEqual(map(id, bound), map(id, running))


if __name__ == "__main__":
  absltest.main()


def _dry_run(decode_steps: int, executor=None, steps: int = 30) -> tuple[Scheduler, dict]:
  """`steps` scheduler steps of a chat-like load; counts of the pool's step reservations
  (`reserve_step`, `predict_step`) and of the executor's dispatches."""
  cfg = paged_kv.PoolConfig(num_blocks=96, block_size=4, num_layers=1, num_kv_heads=1,
                            head_dim=2, max_seqs=8, max_segments=16)
  pool = paged_kv.BlockPool(cfg, debug=False)
  sched = Scheduler(pool, executor(cfg) if executor else DryExecutor(cfg), SchedulerConfig(
      max_batch=8, prefill_chunk=8, prefill_token_budget=16, compaction=None,
      output_reserve_ratio=0.0, stats_every=0, snapshot_every=0, decode_steps=decode_steps))
  rng = np.random.default_rng(0)
  for i in range(6):
    sched.submit(Request(i, rng.integers(0, 1000, int(rng.integers(3, 14))), 40))
  counts = {"reserve_step": 0, "predict_step": 0}

  def counted(name, fn):
    def wrapper(*args, **kwargs):
      counts[name] += 1
      return fn(*args, **kwargs)
    return wrapper

  with mock.patch.object(step_reservation, "predict_step",
                         counted("predict_step", step_reservation.predict_step)), \
       mock.patch.object(paged_kv.BlockPool, "reserve_step",
                         counted("reserve_step", paged_kv.BlockPool.reserve_step)):
    before = pool.runtime.snapshot()
    for _ in range(steps):
      sched.step()
    counts["dispatches"] = pool.runtime.snapshot().since(before).dispatches.get("step", 0)
  return sched, counts


class _ReservingAgain(DryExecutor):
  """Breaks the contract: reserves the plan's slots again inside its step."""

  def step(self, state, plan):
    state, (_, status) = sequences.reserve_tokens(state, plan.seq_ids, plan.num_new,
                                                 config=self.config,
                                                 max_new_tokens=plan.max_query_len)
    return state, np.zeros(plan.seq_ids.shape, np.int32), status


class OneDeciderTest(absltest.TestCase):
  """A single step's reservation is decided once, on the host."""

  def test_the_single_step_path_never_predicts_a_device_reservation(self):
    sched, counts = _dry_run(decode_steps=1)
    self.assertEqual(counts["predict_step"], 0)
    self.assertEqual(counts["reserve_step"], counts["dispatches"])
    self.assertEqual(counts["dispatches"], 30)
    sched.check_invariants()

  def test_the_k_step_decode_still_predicts(self):
    # The counter above can fire: the k-step decode reserves in its program.
    sched, counts = _dry_run(decode_steps=4)
    self.assertGreater(counts["predict_step"], 0)
    self.assertLess(counts["reserve_step"], counts["dispatches"])
    sched.check_invariants()

  def test_an_executor_that_reserves_again_is_caught(self):
    with self.assertRaises(InternalInconsistency):
      sched, _ = _dry_run(decode_steps=1, executor=_ReservingAgain, steps=1)
      sched.pool.verify()

  def test_a_plan_without_the_hosts_reservation_is_refused(self):
    cfg = paged_kv.PoolConfig(num_blocks=8, block_size=4, num_layers=1, num_kv_heads=1,
                              head_dim=2, max_seqs=2, max_segments=4)
    pool = paged_kv.BlockPool(cfg, debug=False)
    seq = pool.open_sequence()
    plan = StepPlan(seq_ids=np.array([seq, -1], np.int32), num_new=np.array([1, 0], np.int32),
                    tokens=np.zeros(2, np.int32))
    with self.assertRaises(paged_kv.InvalidArgument):
      DryExecutor(cfg).step(pool.state, plan)
    pool.check_invariants()  # nothing reserved, the state intact
    self.assertEqual(int(pool.host.seq_len[seq]), 0)
