"""The fragmentation study's admission: blocks promised in a step count for shorts and longs.

Runs study (b) at a small scale (pool of 256 blocks, lengths /128) with 10% and
50% long mixes in the three allocation modes: every request is admitted,
rejected or still pending at the end (never lost), no step over-commits the pool
(`run_mix` asserts that every short's `reserve_tokens` succeeded), and a short and
a long arriving in the same step with room for only one leave the second waiting.
"""

from __future__ import annotations

from absl import flags
from absl.testing import absltest, parameterized
import numpy as np

from tests.scripts import load_script

fs = load_script("benchmarks/fragmentation_study.py")

if not flags.FLAGS.is_parsed():
  flags.FLAGS.mark_as_parsed()

NUM_BLOCKS = 256
BS = 16
BLOCK_BYTES = 2 * 2**20


def _run(reqs, mode, policy="merge", steps=40):
  return fs.run_mix(policy, mode, reqs, steps, num_blocks=NUM_BLOCKS, threshold=0.35, period=10,
                    max_wait=15, block_bytes=BLOCK_BYTES)


class AdmissionTest(parameterized.TestCase):

  @parameterized.product(long_fraction=(0.1, 0.5), mode=("segments", "require", "prefer"))
  def test_mix_accounts_for_every_request(self, long_fraction, mode):
    steps = 40
    reqs = fs.mix_workload(0, steps, NUM_BLOCKS, BS, long_tokens=65536 // 128,
                           short_tokens=2048 // 32, long_fraction=long_fraction, load=1.5)
    self.assertGreater(sum(r["long"] for r in reqs), 0)
    r = _run(reqs, mode, policy="none" if mode == "segments" else "merge", steps=steps)
    self.assertEqual(r["admitted"] + sum(r["rejected"].values()) + r["pending"], len(reqs))
    # The pool was full at some point (the admission check mattered).
    self.assertGreater(r["tokens"].max(), 0.8 * NUM_BLOCKS * BS)
    s = fs.summarize(r, reqs, block_bytes=BLOCK_BYTES, warmup=steps // 4)
    self.assertLessEqual(s["share_max"], 0.02 + 1e-9)  # the byte budget holds
    self.assertLessEqual(s["conc"], s["bound"] + 1e-9)  # the fluid bound is an upper bound
    self.assertLessEqual(s["tok_ratio"], 1.0 + 1e-9)

  @parameterized.parameters("segments", "require", "prefer")
  def test_short_then_long_in_one_step(self, mode):
    # 256 blocks: a short of 150 blocks, then a long of 150 blocks, both at step 0.
    reqs = [dict(arrive=0, long=False, tokens=150 * BS, life=5),
            dict(arrive=0, long=True, tokens=150 * BS, life=5)]
    r = _run(reqs, mode, steps=12)  # run_mix asserts the short's reservation succeeded
    self.assertEqual(r["admitted"], 2)
    self.assertEqual(r["delays"], {0: 0, 1: 5})  # the long waits for the short to leave
    self.assertEqual(r["blocked_steps"], {"no_free_block": 5})

  def test_long_then_short_in_one_step(self):
    reqs = [dict(arrive=0, long=True, tokens=150 * BS, life=5),
            dict(arrive=0, long=False, tokens=150 * BS, life=5)]
    r = _run(reqs, "segments", steps=12)
    self.assertEqual(r["delays"], {0: 0, 1: 5})

  def test_fluid_bound(self):
    self.assertEqual(fs.fluid_bound([], 100), 0)
    self.assertEqual(fs.fluid_bound([60, 10, 30, 50], 100), 3)  # 10 + 30 + 50
    self.assertEqual(fs.fluid_bound([101], 100), 0)
    self.assertEqual(fs._runs(np.array([5, 3, 4, 9])), 2)


if __name__ == "__main__":
  absltest.main()
