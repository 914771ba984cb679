"""The scripts of examples/ run end to end with tiny settings (so they do not rot).

Not smoke-tested yet: `examples/train_tiny.py` (needs the `train` extra);
`examples/serve.py --checkpoint` runs in `test_serve_checkpoint.py`.

Each runs in a subprocess exactly as a user would start it; the assertions check
that it finished and printed its report, not its numbers (those are measured,
with full settings, in docs/benchmarks.md). The scripts run with their persistent
compilation cache on (the default), pointed at the test's temporary directory: nothing
here writes to the user's cache.
"""

from __future__ import annotations

import pytest

from tests.scripts import compile_cache_in_tmp  # pylint: disable=unused-import (autouse)
from tests.scripts import run_script as _run

# The example scripts' smoke runs (subprocesses).
pytestmark = pytest.mark.slow


# One of the two largest example runs; `make test` keeps the other examples' smoke runs.
@pytest.mark.long
def test_serve(tmp_path):
  # ~50 s alone on 2 idle cores (45 s of it the warm-up's compiles); beside the other
  # xdist worker it has taken 270 s, so its guard is wider than the others'.
  out = _run("examples/serve.py", "--conversations=3", "--turns=2", "--num_blocks=48",
             "--max_batch=4", f"--out_dir={tmp_path}", "--prometheus_port=0", timeout=600)
  assert "| requests finished | 6 / 6 |" in out, out
  assert (tmp_path / "metrics.jsonl").stat().st_size > 0
  assert (tmp_path / "block_map.png").exists() and (tmp_path / "utilization.png").exists()


def test_pool_tour():
  out = _run("examples/demo.py", "--num_blocks=64")
  assert "all released" in out and "refused as expected" in out, out


