"""The launcher says why each process of a failed run ended, naming the peer whose
failure ended it (plain Python children, no JAX: a second or two)."""

from __future__ import annotations

import signal
import sys

from absl.testing import absltest

from paged_kv.cluster import launch as launch_lib

# Process 0 prints a line and dies by SIGKILL (no word to its peers); process 1
# waits for the launcher; process 2 aborts itself as the coordination service would.
_CHILD = r"""
import os, signal, sys, time
i = int(os.environ["PAGED_KV_PROCESS_ID"])
if i == 0:
  print("loading shard 0", flush=True)
  time.sleep(0.3)
  os.kill(os.getpid(), signal.SIGKILL)
if i == 2:
  time.sleep(1.0)
  print("coordination service: task 0 unhealthy (heartbeat timeout)", flush=True)
  os.kill(os.getpid(), signal.SIGABRT)
time.sleep(120)
"""


class LaunchCauseTest(absltest.TestCase):

  def test_every_failed_process_gets_a_cause_naming_the_first_failure(self):
    result = launch_lib.launch([sys.executable, "-c", _CHILD], 3, grace_s=3.0, timeout_s=60)
    self.assertEqual(result.first_failure, 0)
    self.assertEqual(result.returncodes[0], -signal.SIGKILL)
    self.assertEqual(result.returncodes[2], -signal.SIGABRT)
    self.assertEqual(result.stopped, (1,))
    first = result.cause(0)
    self.assertIn("failed first: killed by SIGKILL", first)
    self.assertIn("loading shard 0", first)
    peer = f"process 0 (pid {result.pids[0]}, killed by SIGKILL)"
    self.assertIn(f"stopped by the launcher (killed by SIGTERM) after {peer} failed",
                  result.cause(1))
    self.assertIn(f"by JAX's coordination service after {peer}", result.cause(2))
    summary = result.summary()
    for i in range(3):
      self.assertIn(result.cause(i), summary)
    self.assertEqual(result.status, 128 + signal.SIGKILL)

  def test_a_clean_run_has_no_cause(self):
    result = launch_lib.launch([sys.executable, "-c", "pass"], 2, timeout_s=60)
    self.assertTrue(result.ok)
    self.assertEqual([result.cause(i) for i in range(2)], ["", ""])


if __name__ == "__main__":
  absltest.main()
