"""A process that builds many pool shapes in turn stays under a bound of memory maps,
or gets `MapLimitNear`, never a segfault (`paged_kv.runtime.executables`).

The run is a child process (releasing the library's programs in a test worker would
make every later test there compile again): it lowers the map limit it sees to a
small budget above its mappings after start-up, builds 8 pool shapes
(`PAGED_KV_POOL_SHAPES=N`: N) one after the other (each compiling its own programs: ~120 mappings per shape on XLA CPU), and
reports the most mappings seen. Without the release they grow with every shape
(~1,000 over 8 shapes); with it they stay under the budget. Then the refusal
threshold is set below the mappings held: the next new shape raises `MapLimitNear`
naming the limit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from absl.testing import absltest
import pytest

# A child process building pool shapes.
pytestmark = pytest.mark.slow

_CHILD = r"""
import json, sys
import jax
import paged_kv
from paged_kv.runtime import counters, executables

def use(num_blocks):
  config = paged_kv.PoolConfig(num_blocks=num_blocks, block_size=4, num_layers=1,
                               num_kv_heads=1, head_dim=4, max_seqs=2, max_segments=4)
  pool = paged_kv.BlockPool(config)
  seq = pool.open_sequence()
  pool.release([seq])
  jax.block_until_ready(pool.state)

use(8)  # start-up: the first programs, the allocator's arenas
base = counters.memory_mappings()
executables.BUDGET.limit = base + 1000
executables.BUDGET.release_fraction = (base + 300) / executables.BUDGET.limit
executables.BUDGET.refuse_fraction = 1.0
peak = base
for i in range(int(sys.argv[1])):
  use(9 + i)  # the previous shape's pool is gone: its config retired
  peak = max(peak, counters.memory_mappings())
out = {"base": base, "peak": peak, "releases": executables.releases,
       "owned": executables.owned_executables()}
executables.BUDGET.release_fraction = executables.BUDGET.refuse_fraction = 0.0  # as if
# the rest of the process held the maps
try:
  use(100)
  out["refused"] = ""
except executables.MapLimitNear as e:
  out["refused"] = str(e)
print(json.dumps(out))
"""


class MapBoundTest(absltest.TestCase):

  def test_many_pool_shapes_stay_under_a_map_bound_or_raise_typed(self):
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=repo)
    shapes = int(os.environ.get("PAGED_KV_POOL_SHAPES", "0") or 0) or 8
    out = subprocess.run([sys.executable, "-c", _CHILD, str(shapes)], capture_output=True,
                         text=True, cwd=repo, env=env, timeout=600 + 10 * shapes)
    self.assertEqual(out.returncode, 0, out.stderr[-3000:])
    got = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"\nmap bound: {got}")
    self.assertGreater(got["releases"], 0)
    # The release threshold (base + 300) plus one shape's programs, with slack.
    self.assertLess(got["peak"] - got["base"], 600, got)
    self.assertIn("vm.max_map_count", got["refused"])
    self.assertIn("sysctl", got["refused"])


if __name__ == "__main__":
  absltest.main()
