"""The operator plots render from a real run's JSONL records (matplotlib optional)."""

import os
import tempfile

import numpy as np
from absl.testing import absltest
import pytest

import paged_kv
from paged_kv.telemetry import export, plots
from tests.telemetry import serving_run

pytestmark = pytest.mark.slow

try:
  import matplotlib  # pylint: disable=unused-import
except ImportError:  # the `plots` extra
  matplotlib = None


class PlotsTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    if matplotlib is None:
      self.skipTest("matplotlib not installed (pip install 'paged-kv[plots]')")

  def test_timeline_and_block_map_from_jsonl(self):
    sched, _, _, reports = serving_run.served_run()
    out = tempfile.mkdtemp()
    path = os.path.join(out, "metrics.jsonl")
    with export.JsonlLogger(path, mode="w") as log:
      for r in reports:
        log.log_report(r)
    steps = export.read_jsonl(path, type="step")
    snaps = export.read_jsonl(path, type="snapshot")
    png = plots.timeline(steps, os.path.join(out, "timeline.png"), snapshots=snaps,
                         title="dry run")
    self.assertGreater(os.path.getsize(png), 10_000)
    states = plots.block_states(sched.pool.state)
    self.assertEqual(states.shape, (serving_run.CFG.num_blocks,))
    self.assertTrue(np.all(np.isin(states, [plots.FREE, plots.LIVE, plots.CACHED])))
    ref = np.asarray(sched.pool.state.meta.ref_count)
    np.testing.assert_array_equal(states == plots.FREE, ref == 0)
    png = plots.block_map([("end", reports[-1].step, states),
                           ("all free", 0, np.zeros_like(states))],
                          os.path.join(out, "map.png"), num_base_blocks=8)
    self.assertGreater(os.path.getsize(png), 5_000)

  def test_block_states_of_live_and_cached_blocks(self):
    cfg = paged_kv.PoolConfig(num_blocks=16, block_size=4, max_seqs=4, max_segments=8)
    pool = paged_kv.BlockPool(cfg)
    seq = pool.open_sequence()
    pool.reserve_tokens([seq], [6])  # two blocks
    states = plots.block_states(pool.state)
    self.assertEqual(int(np.sum(states == plots.LIVE)), 2)
    self.assertEqual(int(np.sum(states == plots.CACHED)), 0)

  def test_empty_timeline_is_refused(self):
    with self.assertRaisesRegex(ValueError, "at least one step"):
      plots.timeline([], os.path.join(tempfile.mkdtemp(), "x.png"))


if __name__ == "__main__":
  absltest.main()
