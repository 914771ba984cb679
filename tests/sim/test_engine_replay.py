"""Tests of paged_kv.sim.engine_replay: a trace through the scheduler in dry mode."""

from __future__ import annotations

from absl.testing import absltest
import pytest

from paged_kv.sim import engine_replay
from tests.sim.trace_files import session_trace


class EngineReplayTest(absltest.TestCase):

  @pytest.mark.slow
  def test_small_trace_finishes_with_hits(self):
    trace = session_trace(seed=0, num=16, num_sessions=3, partial=True, gap_s=0.05)
    steps = []
    result = engine_replay.replay_engine(
        trace, variant="all", label="sessions", pool_tokens=4096, token_scale=16,
        step_ms=50.0, max_batch=8, on_step=lambda s: steps.append(s.stats.steps))
    self.assertEqual((result.label, result.variant), ("sessions", "all"))
    self.assertEqual((result.submitted, result.finished, result.rejected), (16, 16, 0))
    self.assertGreater(result.hit_rate, 0.0)  # turns of a session share their prefix
    self.assertGreater(result.steps, 0)
    self.assertGreaterEqual(len(steps), result.steps)  # one call per step (and a last look)
    self.assertGreater(result.utilization_mean, 0.0)

  def test_arguments_are_checked(self):
    trace = session_trace(seed=0, num=2)
    with self.assertRaisesRegex(ValueError, "unknown variant 'fast'"):
      engine_replay.replay_engine(trace, variant="fast")
    with self.assertRaisesRegex(ValueError, "token_scale"):
      engine_replay.replay_engine(trace, variant="flat", token_scale=0)

  def test_variants(self):
    self.assertEqual(list(engine_replay.ENGINE_VARIANTS)[0], "recompute_no_reserve")
    self.assertEqual(engine_replay.ENGINE_VARIANTS["swap_no_reserve"].preemption, "swap")
    self.assertTrue(engine_replay.ENGINE_VARIANTS["all"].compaction)


if __name__ == "__main__":
  absltest.main()
