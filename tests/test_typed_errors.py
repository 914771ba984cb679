"""A new user's small findings, each a typed error or a truthful line now.

`BlockPool(None)`, `BlockPool(cfg, debug="yes")`, `PoolConfig(dtype=None)`, a pool the
allocator cannot hold, the pool under a `CachedPool` checked by itself, the warm-up's
report line, and the docs a user reads first (where `SamplingParams` and the
tokenizer's stream live, what `ModelExecutor` samples).
"""

from __future__ import annotations

import pathlib
from unittest import mock

import jax
import numpy as np
from absl.testing import absltest

import paged_kv
from paged_kv.pool import block_pool as pool_lib
from paged_kv.core import device_memory
from paged_kv.cache import CachedPool
from paged_kv.scheduler import DryExecutor, Request, Scheduler, SchedulerConfig
from paged_kv.scheduler.warmup import WarmupReport

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = paged_kv.PoolConfig(num_blocks=32, block_size=4, num_layers=1, num_kv_heads=1,
                             head_dim=8, max_seqs=4, max_segments=8)


class TypedErrorsTest(absltest.TestCase):

  def test_block_pool_arguments(self):
    with self.assertRaisesRegex(paged_kv.InvalidArgument, "config must be a PoolConfig, got "
                                                          "NoneType"):
      paged_kv.BlockPool(None)
    with self.assertRaisesRegex(paged_kv.InvalidArgument, "debug must be a bool or None.*'yes'"):
      paged_kv.BlockPool(CONFIG, debug="yes")
    self.assertTrue(paged_kv.BlockPool(CONFIG, debug=np.bool_(True)).debug)

  def test_pool_config_dtype_none_is_named(self):
    with self.assertRaisesRegex(paged_kv.InvalidArgument, r"PoolConfig.dtype must be one of "
                                                          r".*got None$"):
      paged_kv.PoolConfig(num_blocks=8, block_size=4, num_layers=1, num_kv_heads=1,
                          head_dim=8, dtype=None)

  def test_the_allocators_out_of_memory_is_pool_too_large(self):
    exhausted = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 1 bytes")
    with mock.patch.object(pool_lib, "init_pool", side_effect=exhausted):
      with self.assertRaisesRegex(paged_kv.PoolTooLarge, "ran out of memory allocating the "
                                                         "pool") as cm:
        paged_kv.BlockPool(CONFIG)
    self.assertIs(cm.exception.__cause__, exhausted)
    other = jax.errors.JaxRuntimeError("INTERNAL: something else")
    with mock.patch.object(pool_lib, "init_pool", side_effect=other):
      with self.assertRaisesRegex(jax.errors.JaxRuntimeError, "INTERNAL"):
        paged_kv.BlockPool(CONFIG)
    with self.assertRaises(paged_kv.PoolTooLarge):
      with device_memory.allocating(CONFIG):
        raise exhausted

  def test_the_pool_under_a_cached_pool_checks_healthy_by_itself(self):
    cached = CachedPool(paged_kv.BlockPool(CONFIG))
    sched = Scheduler(cached, DryExecutor(CONFIG), SchedulerConfig(max_batch=2, prefill_chunk=4))
    sched.submit(Request("a", np.arange(1, 10), 3))
    sched.run()
    self.assertGreater(len(cached.cache.segment_refs()), 0)  # the cache holds references
    sched.pool.check_invariants()  # counts them: no false alarm
    cached.check_invariants()
    with self.assertRaises(paged_kv.InvariantViolation):  # an explicit "none" still checks
      sched.pool.check_invariants(extra_segments=np.zeros((0, 3), np.int32))
    with self.assertRaisesRegex(paged_kv.InvalidArgument, "callable"):
      sched.pool.bind_outside_references(42)

  def test_the_warmup_line_counts_what_it_says(self):
    line = str(WarmupReport(programs=29, compiles=34, cache_loads=7, seconds=1.0))
    self.assertIn("29 programs run; 34 XLA compiles (the programs' and their helpers')", line)
    self.assertIn("7 executables loaded from the persistent cache", line)
    self.assertNotIn("34 compiled", line)

  def test_the_docs_a_new_user_reads(self):
    from paged_kv.model.tokenizer import TextStream  # pylint: disable=import-outside-toplevel
    from paged_kv.scheduler import ModelExecutor  # pylint: disable=import-outside-toplevel
    readme = (ROOT / "README.md").read_text()
    self.assertIn("from paged_kv import SamplingParams", readme)
    self.assertIn("tokenizer.stream()", readme)
    self.assertNotIn("greedy choice", ModelExecutor.__doc__)
    self.assertIn("plan.sampling", ModelExecutor.__doc__)
    for method in (TextStream.add, TextStream.flush):
      self.assertTrue(method.__doc__, method.__name__)


if __name__ == "__main__":
  absltest.main()
