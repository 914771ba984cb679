"""Metrics snapshot (live-slot internal fragmentation, regions, counters) and alerts."""

from __future__ import annotations

import numpy as np
from absl.testing import absltest

import paged_kv
from paged_kv.scheduler import SchedulerStats
from paged_kv.telemetry import metrics
from paged_kv.core.errors import Status
from tests.testutil import KVModel, small_config

CONFIG = small_config()


class SnapshotTest(absltest.TestCase):

  def test_internal_fragmentation_counts_live_slots_only(self):
    pool = paged_kv.BlockPool(CONFIG)
    model = KVModel(pool)
    a, b = model.open(), model.open()
    model.append([a, b], [12, 3])  # blocks: 8 + 4 (a), 3 (b): 15 live of 24
    snap = metrics.snapshot(pool.state, CONFIG)
    self.assertAlmostEqual(snap.internal_fragmentation, 1 - 15 / 24)
    self.assertAlmostEqual(snap.handed_out_internal_fragmentation, 1 - 15 / 24)
    # b's segment held by a cache node, then b released: still live through the holder.
    seg = pool.segments(b)[0].tolist()
    pool.apply_ref_deltas([seg[0]], [1])
    model.release([b])
    snap = metrics.snapshot(pool.state, CONFIG, extra_segments=[seg])
    self.assertAlmostEqual(snap.internal_fragmentation, 1 - 15 / 24)
    self.assertEqual((snap.live_blocks, snap.cached_only_blocks), (2, 1))
    # Pack it into a fresh block: the old slots die with the old block (freed).
    res = pool.pack_slots(extra_segments=[seg])
    new = res.extra_segments
    snap = metrics.snapshot(pool.state, CONFIG, extra_segments=new)
    self.assertAlmostEqual(snap.internal_fragmentation, 1 - 15 / 24)
    # Without the holder passed in, its slots do not count as live.
    snap = metrics.snapshot(pool.state, CONFIG)
    self.assertAlmostEqual(snap.internal_fragmentation, 1 - 12 / 24)
    self.assertEqual(snap.ghost_block_bytes, 0)
    self.assertEqual(snap.live_sequences, 1)
    self.assertEqual(snap.live_tokens, 12)
    self.assertEqual(set(snap.fragmentation_by_region), {"dynamic", "base"})

  def test_fragmentation_and_counters(self):
    pool = paged_kv.BlockPool(CONFIG)
    model = KVModel(pool)
    seqs = [model.open() for _ in range(4)]
    model.append(seqs, [8, 8, 8, 8])
    model.release([seqs[1]])
    snap = metrics.snapshot(pool.state, CONFIG)
    # Free dynamic blocks: {1} and {4..31}: 29 free, largest run 28.
    self.assertAlmostEqual(snap.fragmentation_ratio, 1 - 28 / 29)
    self.assertEqual(snap.largest_contiguous_free_bytes, 28 * CONFIG.block_bytes)
    counters = SchedulerStats()
    n = counters.record_status(np.array([Status.OK, Status.NO_FREE_BLOCK,
                                         Status.NO_CONTIGUOUS_RUN, Status.NO_FREE_BLOCK]),
                               seq_lens=[5, 100, 3000, 17])
    self.assertEqual(n, 3)
    counters.record_oom(Status.TABLE_FULL)
    counters.record_compaction(moves=7, seconds=0.25)
    snap = metrics.snapshot(pool.state, CONFIG, counters=counters)
    self.assertEqual(snap.oom_by_reason, {"no_free_block": 2, "no_contiguous_run": 1,
                                          "table_full": 1})
    self.assertEqual(snap.oom_by_seq_len, {128: 1, 4096: 1, 32: 1})
    self.assertEqual((snap.compaction_moves, snap.compaction_seconds), (7, 0.25))
    self.assertIsInstance(snap.as_dict(), dict)


class AlertTest(absltest.TestCase):

  def _snap(self, **kw):
    pool = paged_kv.BlockPool(CONFIG)
    snap = metrics.snapshot(pool.state, CONFIG)
    return snap.__class__(**{**snap.as_dict(), **kw})

  def test_level_alerts_carry_cause_and_action(self):
    alerts = metrics.check_alerts(self._snap(fragmentation_ratio=0.5,
                                             oom_by_reason={"no_contiguous_run": 2}))
    names = {a.metric: a for a in alerts}
    self.assertEqual(set(names), {"fragmentation_ratio", "oom_by_reason.no_contiguous_run"})
    frag = names["fragmentation_ratio"]
    self.assertEqual((frag.value, frag.threshold, frag.severity), (0.5, 0.35, "warning"))
    self.assertIn("compaction", frag.suggested_action)
    self.assertTrue(frag.likely_cause)
    self.assertEqual(metrics.check_alerts(self._snap()), [])
    ghost = metrics.check_alerts(self._snap(ghost_block_bytes=64))
    self.assertEqual([(a.metric, a.severity) for a in ghost], [("ghost_block_bytes", "critical")])

  def test_monitor_is_edge_triggered(self):
    mon = metrics.AlertMonitor()
    seq = [0.05, 0.5, 0.6, 0.05, 0.4]
    fired = [len(mon.observe(self._snap(internal_fragmentation=x))) for x in seq]
    self.assertEqual(fired, [0, 1, 0, 0, 1])
    # Cumulative OOM counters alert on increases only.
    mon = metrics.AlertMonitor()
    counts = [0, 1, 1, 3]
    fired = [len(mon.observe(self._snap(oom_by_reason={"no_free_block": c}))) for c in counts]
    self.assertEqual(fired, [0, 1, 0, 1])
    events = metrics.alerts_from([self._snap(kv_usage_ratio=0.99)])
    self.assertEqual(events[0].metric, "kv_usage_ratio")


if __name__ == "__main__":
  absltest.main()
