"""Test-session settings shared by every test module.

Four things, all about running ~1,570 tests in two long-lived xdist workers on a
2-core CPU machine (the fourth, the rule of the tiers `slow` and `long`, is at the end
of the file):

1. **Memory mappings.** Every XLA CPU executable holds about 30 memory mappings
   (measured: 300 small jitted programs took a process from 422 to 10,384 lines of
   ``/proc/self/maps``), and JAX keeps each one alive in its caches while its
   jitted function lives (a module-level ``jax.jit`` lives for the session).
   A worker that keeps ~2,000 programs reaches Linux's ``vm.max_map_count``
   (65,530 by default); from then on ``mmap`` fails inside
   XLA's compiler and the worker dies with a segmentation fault in
   ``backend_compile_and_load``, in whichever program it happened to be
   compiling (``tools/map_limit_repro.py`` shows it).  After each test we count
   the mappings and, above half the limit, drop JAX's caches
   (``jax.clear_caches()``), which unmaps them.

2. **Compile time.** Much of the suite's time is XLA compiling small programs.
   Unless ``XLA_FLAGS`` already names an optimisation level, the tests run with
   ``--xla_backend_optimization_level=0`` (``tests/test_review_regressions.py``:
   60 s -> 46 s, one run each; the whole suite 24.5 -> 16.7 min with this file).
   It changes how fast the CPU code is, not what it computes.
   ``PAGED_KV_TEST_XLA_OPT=default`` keeps XLA's default.

3. **Thread pools for the Mosaic GPU interpreter.** XLA:CPU's pools get
   ``PJRT_NPROC=8`` threads (unless set) before the CPU client exists: with one
   per core (2 here) a kernel whose warpgroups wait on each other's barriers could
   deadlock in interpret mode (``pallas_kernels/lowering.py``).
"""

from __future__ import annotations

import gc
import os

_OPT_FLAG = "--xla_backend_optimization_level"
if os.environ.get("PAGED_KV_TEST_XLA_OPT", "") != "default":
  _flags = os.environ.get("XLA_FLAGS", "")
  if _OPT_FLAG not in _flags:
    os.environ["XLA_FLAGS"] = f"{_flags} {_OPT_FLAG}=0".strip()

# The Mosaic GPU interpreter (interpret-mode kernel tests) needs XLA:CPU thread
# pools wider than this 2-core machine's 2 threads, set before JAX creates its CPU
# client (`lowering.reserve_cpu_threads_for_gpu_interpreter` says why).
from pallas_kernels import lowering as _lowering  # noqa: E402

_lowering.reserve_cpu_threads_for_gpu_interpreter()

_MAPS = "/proc/self/maps"


def _map_limit() -> int:
  try:
    with open("/proc/sys/vm/max_map_count") as f:
      return int(f.read())
  except (OSError, ValueError):
    return 65530


_CLEAR_ABOVE = _map_limit() // 2


def _mapping_count() -> int:
  with open(_MAPS, "rb") as f:
    return sum(1 for _ in f)


def pytest_runtest_teardown(item, nextitem):
  del item, nextitem
  if not os.path.exists(_MAPS):  # not Linux: no per-process mapping limit to watch
    return
  if _mapping_count() > _CLEAR_ABOVE:
    import jax  # pylint: disable=g-import-not-at-top
    jax.clear_caches()
    gc.collect()


# The tiers. A test's tier is a mark written on the test (`@pytest.mark.slow` or
# `@pytest.mark.long` on the function or class, `pytestmark = ...` for a module), with its
# reason beside it. `make test-fast` (`pytest -m "not slow"`, the edit-test loop) leaves
# out `slow`: the whole-system runs and the unit tests of 3 s or more on 2 cores. `make
# test` (the README's test command) leaves out `long` and CI runs it with a second command
# (`make test-long`, `.ci/run`): `-m long` and `-m "not long"` are complements, so CI runs
# every test once. The long tier holds the runs that repeat, at larger size, a behaviour
# `make test` already checks (each mark says what stays in `make test`), and the
# multi-process runs. A long test is slow too: `make test-fast` skips it.


def pytest_configure(config):
  config.addinivalue_line("markers", "slow: a whole-system run or a unit test of seconds; `make test-fast` skips it")
  config.addinivalue_line(
      "markers", "long: the long tier; `make test` skips it, `make test-long` (CI) runs it")


def pytest_collection_modifyitems(config, items):
  """A test marked `long` is also `slow`."""
  del config
  import pytest  # pylint: disable=g-import-not-at-top
  for item in items:
    if item.get_closest_marker("long") and not item.get_closest_marker("slow"):
      item.add_marker(pytest.mark.slow)
