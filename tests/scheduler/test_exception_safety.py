"""A step is exception-safe: fault injection at every call site of `Scheduler.step`.

Every public method of the pool, the prefix cache, the cache-bound pool and the
executor, the swap functions and the snapshot callback are wrapped (enumerated
from the objects, so a new call site is covered by default). Three scenarios:
`recompute` and `swap` preemption with promotion into the base pool, packing and
compaction; `governance` (live/cached quotas and the two-phase GC on a ticking
clock, plus promotion and the base pool). Two more confine the faults to one
operation: `Scheduler.shrink_to` and the steps' `_maybe_shrink` that carry the
shrink to its cut (the mirror's shrink plans included), and
`CachedPool.save` (`persist.save_prefix_cache`: the K/V gather, the checksum,
the archive write, the fsyncs and the rename). A reference run
counts each site's calls; then, for each site and a few call indices N, a fresh
scheduler runs the same workload with the N-th call raising (an exception or a
`KeyboardInterrupt`), either *before* the call (nothing happened) or *after* it
(it happened, the caller never learns). After the failing step the scheduler
either refuses further use with `SchedulerBroken`, or is usable: invariants
hold, every submitted request is queued, running or finished with a reason, no
row is leaked, and `run()` drains it to a clean pool. The governance, shrink and
save scenarios write tagged K/V (`kv_tags`): every running sequence and cache
node reads back its tags after the fault and after the drain. A shrink hit by a
fault still reaches its cut (or was never registered); a save hit by one leaves
the pool and cache as they were, no temporary file, and under its path either
the previous file or the new one, whole.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import os
import tempfile
import time
import types
from unittest import mock

import jax
import numpy as np
import pytest
from absl.testing import absltest

import paged_kv
from paged_kv.core import compact
from paged_kv.pool import host_transitions as host_ops
from paged_kv.scheduler import admission as admission_mod
from paged_kv.cache import persist
from paged_kv.scheduler import preemption as preemption_mod
from paged_kv.cache.cached_pool import CachedPool
from paged_kv.cache.governance import CacheGovernance
from paged_kv.scheduler.scheduler import (DryExecutor, Phase, Request, Scheduler, SchedulerBroken,
                                        SchedulerConfig)
from radix.cache import PrefixCache
from tests.scheduler import kv_tags

pytestmark = pytest.mark.slow

CFG = paged_kv.PoolConfig(num_blocks=20, block_size=4, num_layers=1, num_kv_heads=1,
                          head_dim=2, max_seqs=6, max_segments=24, base_pool_fraction=0.2)
# The tagged scenarios (governance, shrink, save): K/V of `kv_tags.TAG_DIM`; 28 blocks,
# so a shrink to `SHRINK_TARGET` still holds any one request of the workload.
TAG_CFG = paged_kv.PoolConfig(num_blocks=28, block_size=4, num_layers=1, num_kv_heads=1,
                              head_dim=kv_tags.TAG_DIM, max_seqs=6, max_segments=24,
                              base_pool_fraction=0.2)
SHRINK_AT = 14  # the step before which the shrink scenario calls `shrink_to`
SHRINK_TARGET = 20
SAVE_AT = (3, 6)  # the steps before which the save scenario saves (clean, then armed)
TAGGED_MODES = ("governance", "shrink", "save")


class Fault(Exception):
  """The injected ordinary exception."""


def _workload(seed: int = 0, n: int = 10) -> list[Request]:
  rng = np.random.default_rng(seed)
  system = rng.integers(0, 50, 9)
  reqs = []
  for i in range(n):
    prompt = np.concatenate([system, rng.integers(0, 50, int(rng.integers(1, 14)))])
    reqs.append(Request(i, prompt, int(rng.integers(2, 16)),
                        forced_output=rng.integers(100, 200, 16)))
  return reqs


def _config(mode: str, overlap: bool | None = None) -> SchedulerConfig:
  # The shrink scenario is timed in steps of the synchronous loop (the overlapped
  # one finishes a request a step later, so less is free at SHRINK_AT).
  if overlap is None:
    overlap = mode != "shrink"
  governance = None
  if mode == "governance":  # a tight live quota (holds), a small cached one, GC every step
    governance = CacheGovernance(live_fraction=0.5, max_step=1, gc_ttl=2.0, gc_every=1)
  return SchedulerConfig(max_batch=5, prefill_chunk=8, prefill_token_budget=12,
                         preemption="swap" if mode == "swap" else "recompute",
                         output_reserve_ratio=0.0, pack_tails=True, promote_readers=2,
                         promote_every=2, snapshot_every=1, governance=governance,
                         compaction=compact.CompactionPolicy(threshold=0.0, budget=2),
                         overlap=overlap)


def _tenant_of(namespace) -> int:
  del namespace
  return 0


class _TickClock:
  """A clock that advances a quarter second per reading: deterministic GC marks."""

  def __init__(self):
    self.now = 0.0

  def __call__(self) -> float:
    self.now += 0.25
    return self.now


class _ResizingTaggingExecutor(kv_tags.TaggingExecutor):
  """The tagging executor, following the pool's cut like the library's executors."""

  def resize(self, config):
    self.config = config


class Injector:
  """Counts calls per site while armed; raises at the N-th call of one site (once)."""

  def __init__(self, site: str | None = None, n: int = 0, exc: type = Fault,
               when: str = "before"):
    self.site, self.n, self.exc, self.when = site, n, exc, when
    self.counts: dict[str, int] = {}
    self.armed = False
    self.fired = False
    self.sched = None  # the scenario's scheduler (`_build`)

  def wrap(self, site: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
      if not self.armed:
        return fn(*args, **kwargs)
      self.counts[site] = self.counts.get(site, 0) + 1
      hit = (not self.fired and site == self.site and self.counts[site] == self.n)
      if hit and self.when == "before":
        self.fired = True
        raise self.exc(f"injected before {site} #{self.n}")
      out = fn(*args, **kwargs)
      if hit:
        self.fired = True
        raise self.exc(f"injected after {site} #{self.n}")
      return out
    return wrapper

  def patch_object(self, prefix: str, obj) -> None:
    """Wraps every public method of `obj` (as instance attributes)."""
    for name, _ in inspect.getmembers(type(obj), inspect.isfunction):
      if not name.startswith("_"):
        setattr(obj, name, self.wrap(f"{prefix}.{name}", getattr(obj, name)))


def _armed(inj: Injector, fn):
  """`fn` with the injector armed while it runs (faults confined to one operation)."""
  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    before, inj.armed = inj.armed, True
    try:
      return fn(*args, **kwargs)
    finally:
      inj.armed = before
  return wrapper


def _build(mode: str, inj: Injector, overlap: bool | None = None):
  tagged = mode in TAGGED_MODES
  cfg = TAG_CFG if tagged else CFG
  pool = paged_kv.BlockPool(cfg)
  clock = _TickClock() if tagged else time.monotonic
  cp = CachedPool(pool, pack_tails=True, clock=clock)
  executor = _ResizingTaggingExecutor(cfg, _tenant_of) if tagged else DryExecutor(cfg)

  def on_snapshot(step, snap, stats):
    pass

  def on_step(report):
    pass

  sched = Scheduler(cp, executor, _config(mode, overlap), clock=clock,
                    on_snapshot=inj.wrap("on_snapshot", on_snapshot),
                    on_step=inj.wrap("on_step", on_step))
  if tagged:
    executor.sched = sched
  inj.patch_object("pool", pool)
  inj.patch_object("cache", cp._cache)
  inj.patch_object("cached_pool", cp)
  inj.patch_object("executor", executor)
  if mode == "shrink":  # faults only inside the shrink's own code
    sched.shrink_to = _armed(inj, sched.shrink_to)
    sched._maybe_shrink = _armed(inj, sched._maybe_shrink)
  if mode == "save":  # faults only inside the save
    cp.save = _armed(inj, cp.save)
  inj.sched = sched
  return sched


def _sites_patch(inj: Injector):
  """Module-level call sites (swap; the mirror's shrink plans; the save's steps),
  patched for one run. The wrappers count and raise only while the injector is armed."""
  stack = contextlib.ExitStack()
  # The scheduler's parts that swap: admission swaps in, preemption swaps out.
  stack.enter_context(mock.patch.object(
      admission_mod, "swap_in", inj.wrap("swap.swap_in", admission_mod.swap_in)))
  stack.enter_context(mock.patch.object(
      preemption_mod, "swap_out", inj.wrap("swap.swap_out", preemption_mod.swap_out)))
  stack.enter_context(mock.patch.multiple(
      host_ops, plan_shrink=inj.wrap("host_ops.plan_shrink", host_ops.plan_shrink),
      shrink_progress=inj.wrap("host_ops.shrink_progress", host_ops.shrink_progress)))
  stack.enter_context(mock.patch.multiple(
      persist, gather_tokens=inj.wrap("persist.gather_tokens", persist.gather_tokens),
      _checksum=inj.wrap("persist._checksum", persist._checksum),
      _fsync_dir=inj.wrap("persist._fsync_dir", persist._fsync_dir)))
  stack.enter_context(mock.patch.object(persist.np, "savez",
                                        inj.wrap("np.savez", persist.np.savez)))
  stack.enter_context(mock.patch.multiple(persist.os, fsync=inj.wrap("os.fsync", os.fsync),
                                          replace=inj.wrap("os.replace", os.replace)))
  return stack


def _all_requests(sched):
  return list(sched.waiting) + list(sched.swapped) + list(sched.running) + list(sched.finished)


def check_accounting(sched, reqs) -> None:
  """Every request exactly once, in the list its phase says; rows owned one to one."""
  seen = _all_requests(sched)
  assert sorted(id(r) for r in seen) == sorted(id(r) for r in reqs), "a request was lost"
  for r in sched.waiting:
    assert r.phase == Phase.WAITING and r.seq_id is None and r.lock_node is None
  for r in sched.swapped:
    assert r.phase == Phase.SWAPPED and r.seq_id is None and r.swapped is not None
  for r in sched.finished:
    assert r.phase == Phase.FINISHED and r.stop_reason and r.seq_id is None
  rows = sorted(r.seq_id for r in sched.running)
  assert None not in rows
  np.testing.assert_array_equal(sched.pool.active_sequences(), rows)  # no row leaked


def _tagged(sched) -> bool:
  return isinstance(sched.executor, kv_tags.TaggingExecutor)


def _shrinking(sched) -> bool:
  s = sched.shrink_status
  return s is not None and not s.done and not s.cancelled


def check_clean_drain(sched, reqs) -> None:
  sched.run(max_steps=2000)
  for _ in range(200):  # an idle scheduler carries a pending shrink on by step()
    if not _shrinking(sched):
      break
    sched.step()
  assert sched.idle and not _shrinking(sched)
  sched.check_invariants()
  check_accounting(sched, reqs)
  if _tagged(sched):
    kv_tags.check_tags(sched, _tenant_of)  # the cache's K/V after the drain
  for r in reqs:
    assert r.done and r.stop_reason == "length", (r.request_id, r.stop_reason)
    np.testing.assert_array_equal(r.output, r.forced_output[:r.max_new_tokens])
  pool = sched.pool
  config = pool.config  # after a shrink: the cut size
  assert pool.active_sequences().size == 0
  refs = np.asarray(pool.state.meta.ref_count)
  np.testing.assert_array_equal(refs, sched.cache.tree_ref_counts(config.num_blocks))
  sched.cached_pool.evict(num_tokens=10**9)
  assert (np.asarray(pool.state.meta.ref_count) == 0).all(), "blocks leaked"
  assert pool.num_free_blocks == config.num_blocks - config.num_base_blocks


def _cache_nodes(cache) -> list:
  """Every node of a prefix cache as (namespace, path tokens), sorted."""
  return sorted((repr(n.namespace), tuple(cache.tree.path_tokens(n.node_id).tolist()))
                for n in cache.tree.nodes())


def _save(sched, path: str, record: dict) -> None:
  """`cached_pool.save(path)` (armed in the save scenario); on a fault, checks that the
  pool and cache are as they were, no temporary file is left, and `path` holds the
  previous file or the new one, whole and bit-exact (loaded into a fresh pool)."""
  pool, cache = sched.pool, sched.cache
  before = jax.tree.map(np.array, (pool.state.pages, pool.state.meta, pool.state.table))
  nodes = _cache_nodes(cache)
  try:
    sched.cached_pool.save(path)
  except BaseException:
    after = jax.tree.map(np.array, (pool.state.pages, pool.state.meta, pool.state.table))
    jax.tree.map(np.testing.assert_array_equal, before, after)
    assert _cache_nodes(cache) == nodes, "a failed save changed the cache"
    directory = os.path.dirname(path)
    assert set(os.listdir(directory)) <= {os.path.basename(path)}, os.listdir(directory)
    if os.path.exists(path):
      fresh = paged_kv.BlockPool(pool.config)
      loaded = persist.load_prefix_cache(path, fresh,
                                         PrefixCache(block_size=pool.config.block_size))
      assert _cache_nodes(loaded) in (record.get("nodes"), nodes), "a torn or stale file"
      view = types.SimpleNamespace(pool=fresh, running=[],
                                   cached_pool=types.SimpleNamespace(cache=loaded))
      kv_tags.check_tags(view, _tenant_of)
    else:
      assert "nodes" not in record, "the previous file is gone"
    raise
  record["nodes"] = nodes


def run_scenario(mode: str, inj: Injector) -> str:
  """Runs the workload with `inj`; returns "clean", "recovered" or "refused"."""
  sched = _build(mode, inj)
  reqs = _workload()
  for r in reqs:
    sched.submit(r)
  raised = None
  arm_steps = mode not in ("shrink", "save")  # those arm their own operation only
  record: dict = {}
  with tempfile.TemporaryDirectory() as tmp, _sites_patch(inj):
    for i in range(2000):
      if sched.idle and not _shrinking(sched):
        break
      inj.armed = arm_steps
      try:
        if mode == "shrink" and i == SHRINK_AT:
          sched.shrink_to(SHRINK_TARGET)
        if mode == "save" and i in SAVE_AT:
          _save(sched, os.path.join(tmp, "cache.npz"), record)
        sched.step()
      except SchedulerBroken as e:
        raise AssertionError(f"SchedulerBroken raised before any fault: {e}") from e
      except (Fault, KeyboardInterrupt) as e:
        raised = e
        inj.armed = False
        break
      finally:
        inj.armed = False
    if raised is None:
      check_clean_drain(sched, reqs)
      if mode == "shrink":  # the reference run: the shrink reached its cut
        assert sched.stats.shrinks == 1 and sched.pool.config.num_blocks == SHRINK_TARGET
      if mode == "save":
        assert "nodes" in record
      return "clean"
  if sched.broken is not None:
    with pytest.raises(SchedulerBroken, match="unusable"):
      sched.step()
    with pytest.raises(SchedulerBroken):
      sched.submit(Request("late", [1, 2], 1))
    return "refused"
  sched.check_invariants()
  check_accounting(sched, reqs)
  if _tagged(sched):
    kv_tags.check_tags(sched, _tenant_of)
  check_clean_drain(sched, reqs)
  if mode == "shrink" and sched.shrink_status is not None:  # registered: it still cuts
    assert sched.shrink_status.done, sched.shrink_status
    assert sched.pool.config.num_blocks == SHRINK_TARGET
  return "recovered"


@functools.lru_cache(maxsize=None)
def reference_counts(mode: str) -> dict[str, int]:
  inj = Injector()
  assert run_scenario(mode, inj) == "clean"
  _REFERENCE[mode] = inj.sched
  return dict(inj.counts)


_REFERENCE: dict = {}  # mode -> the reference run's scheduler (its stats)


# The first and the last call of every site; with PAGED_KV_SLOW_TESTS=1 also the
# middle one (a third more scenarios; CI runs the first and last).
ALL_POINTS = os.environ.get("PAGED_KV_SLOW_TESTS") == "1"
NUM_SHARDS = 2  # each mode's points split in two tests, so xdist workers share them
# CI's sites of the governance and save scenarios (every site with
# PAGED_KV_SLOW_TESTS=1): what governance and promotion drive (their step's other
# sites are the recompute scenario's), and the save's own steps.
FOCUS = {
    "governance": ("cache.apply_remap", "cache.evict", "cache.gc_evict", "cache.gc_mark",
                   "cached_pool.evict", "cached_pool.gc_evict", "cached_pool.gc_mark",
                   "cached_pool.promote", "pool.apply_ref_deltas", "pool.promote"),
    "save": ("cached_pool.save", "np.savez", "os.replace", "persist.gather_tokens"),
}


def fault_points(mode: str, shard: int | None = None) -> list[tuple[str, int, type, str]]:
  points = []
  sites = sorted(reference_counts(mode).items())
  if not ALL_POINTS and mode in FOCUS:
    sites = [(site, count) for site, count in sites if site in FOCUS[mode]]
  for i, (site, count) in enumerate(sites):
    if shard is not None and i % NUM_SHARDS != shard:
      continue
    calls = {1, (count + 1) // 2, count} if ALL_POINTS else {1, count}
    for n in sorted(calls):
      for when in ("before", "after"):
        exc = KeyboardInterrupt if (n + (when == "after")) % 2 else Fault
        points.append((site, n, exc, when))
  return points


class FaultInjectionTest(absltest.TestCase):

  def _run_all(self, mode: str, shard: int):
    counts = reference_counts(mode)
    # The armed span reaches every kind of call site of its scenario.
    step_sites = ("executor.step", "cached_pool.insert", "cached_pool.evict", "cached_pool.pack",
                  "cached_pool.move_blocks", "cached_pool.promote", "pool.release",
                  "cache.apply_remap", "pool.apply_ref_deltas", "on_snapshot", "on_step")
    sites = {
        "recompute": step_sites,
        "swap": step_sites + ("swap.swap_out", "swap.swap_in"),
        "governance": step_sites + ("cached_pool.gc_mark", "cache.gc_mark",
                                    "cached_pool.gc_evict", "cache.gc_evict"),
        "shrink": ("host_ops.shrink_progress", "host_ops.plan_shrink", "cached_pool.evict",
                   "cached_pool.move_blocks", "pool.move_blocks", "cache.apply_remap",
                   "cached_pool.resize", "pool.resize", "executor.resize"),
        "save": ("cached_pool.save", "cache.now", "persist.gather_tokens", "persist._checksum",
                 "np.savez", "os.fsync", "os.replace", "persist._fsync_dir"),
    }[mode]
    for site in sites:
      self.assertIn(site, counts)
    if mode == "governance":  # the quota held admissions, the GC marked and evicted
      stats = _REFERENCE[mode].stats
      self.assertGreater(stats.quota_holds, 0)
      self.assertGreater(stats.gc_marked_nodes, 0)
      self.assertGreater(stats.gc_evicted_tokens, 0)
      self.assertGreater(_REFERENCE[mode].stats.promotions, 0)
    outcomes: dict[str, list] = {"recovered": [], "refused": [], "clean": [], "unfired": []}
    for site, n, exc, when in fault_points(mode, shard):
      inj = Injector(site, n, exc, when)
      try:
        outcome = run_scenario(mode, inj)
      except Exception as e:
        raise AssertionError(f"fault {when} {site} #{n} ({exc.__name__}): {e!r}") from e
      if not inj.fired:  # "after" a call that itself raised (a caught PoolExhausted)
        self.assertEqual(when, "after")
        outcome = "unfired"
      outcomes[outcome].append((site, n, when, exc.__name__))
    fired = len(outcomes["recovered"]) + len(outcomes["refused"])
    print(f"\n{mode}: {fired} fault points fired over {len(counts)} call sites: "
          f"{len(outcomes['recovered'])} recovered, {len(outcomes['refused'])} refused "
          f"(contract-breaking executor), {len(outcomes['unfired'])} not reached")
    self.assertGreater(fired, 0.9 * sum(map(len, outcomes.values())))
    # Only a contract-breaking executor (the wrapper raises after the donating
    # call without handing the state back) may lose the state.
    for site, n, when, _ in outcomes["refused"]:
      self.assertEqual((site, when), ("executor.step", "after"))
    return outcomes

  def test_every_call_site_recompute_shard0(self):
    self._run_all("recompute", 0)

  def test_every_call_site_recompute_shard1(self):
    self._run_all("recompute", 1)

  # Fault injection at the swap, governance and shrink_to sites; `make test` keeps the recompute
  # scenario (both shards, most sites).
  @pytest.mark.long
  def test_every_call_site_swap_shard0(self):
    self._run_all("swap", 0)

  @pytest.mark.long
  def test_every_call_site_swap_shard1(self):
    self._run_all("swap", 1)

  @pytest.mark.long
  def test_every_call_site_governance_shard0(self):
    self._run_all("governance", 0)

  @pytest.mark.long
  def test_every_call_site_governance_shard1(self):
    self._run_all("governance", 1)

  @pytest.mark.long
  def test_every_call_site_inside_shrink_to_and_its_steps(self):
    self._run_all("shrink", None)

  def test_every_call_site_inside_save(self):
    self._run_all("save", None)


class ExecutorContractTest(absltest.TestCase):

  def _sched(self):
    pool = paged_kv.BlockPool(CFG)
    return Scheduler(pool, DryExecutor(CFG), _config("recompute"))

  def test_state_handed_back_when_the_step_fails_after_the_executor(self):
    """FIXED (issue J item 6, then issue N): an exception after the executor's jitted
    call (which donated the state) left `pool.state` on deleted buffers; the K/V and
    bookkeeping were gone. The executors now return at once, and the scheduler hands
    the returned state to the pool whatever raises before the pool adopted it."""
    sched = self._sched()
    reqs = _workload(1, n=3)
    for r in reqs:
      sched.submit(r)
    real = sched.pool.adopt_step
    calls = {"n": 0}

    def flaky_adopt(*a, **k):
      calls["n"] += 1
      if calls["n"] == 1:
        raise KeyboardInterrupt("after the donating call, before the pool took the state")
      return real(*a, **k)

    with mock.patch.object(sched.pool, "adopt_step", flaky_adopt):
      with self.assertRaises(KeyboardInterrupt):
        sched.step()
    self.assertIsNone(sched.broken)
    sched.check_invariants()
    check_accounting(sched, reqs)
    check_clean_drain(sched, reqs)


class ShrinkToInterruptedTest(absltest.TestCase):

  def test_an_eviction_interrupted_inside_shrink_to_is_reconciled(self):
    """FIXED (issue P, item 4): `shrink_to` evicts cached blocks to make room below the
    target outside `step()`'s recovery. An exception between the cache's eviction and
    the pool's decrefs (here a `KeyboardInterrupt` after `PrefixCache.evict`) left the
    pool counting references the tree no longer held (`InvariantViolation`), and the
    shrink pending. `shrink_to` now reconciles like `step()` and registers no shrink."""
    inj = Injector("cache.evict", 1, KeyboardInterrupt, "after")
    sched = _build("shrink", inj)
    reqs = _workload()
    for r in reqs:
      sched.submit(r)
    for _ in range(SHRINK_AT):
      sched.step()
    self.assertGreater(sched.cache.num_tokens, 0)  # something for the shrink to evict
    with self.assertRaises(KeyboardInterrupt):
      sched.shrink_to(SHRINK_TARGET)
    self.assertTrue(inj.fired)
    self.assertIsNone(sched.broken)
    sched.check_invariants()
    check_accounting(sched, reqs)
    kv_tags.check_tags(sched, _tenant_of)
    self.assertFalse(_shrinking(sched))  # no shrink pending: the caller may ask again
    sched.run(max_steps=200)
    sched.shrink_to(SHRINK_TARGET)
    check_clean_drain(sched, reqs)
    self.assertEqual(sched.pool.config.num_blocks, SHRINK_TARGET)
