"""Test-session setup: one JAX compilation cache shared by the run's workers.

Many tests build the same jitted transitions for the same small configs in
fresh closures (each test makes its own pool, scheduler and executor), so XLA
compiles identical programs again and again, in both xdist workers. A
persistent compilation cache in a fresh temporary directory, made by the
controlling process and inherited by its workers through the environment,
turns the repeats into cache hits; the directory is removed when the run ends.
Set `PAGED_KV_TEST_COMPILE_CACHE=0` to run without it.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import jax

_ENV = "PAGED_KV_TEST_COMPILE_CACHE_DIR"


def pytest_configure(config):
  if os.environ.get("PAGED_KV_TEST_COMPILE_CACHE", "1") == "0":
    return
  if not hasattr(config, "workerinput") and _ENV not in os.environ:
    # The controller (or a run without xdist): make the run's directory.
    os.environ[_ENV] = tempfile.mkdtemp(prefix="paged_kv_test_jax_cache_")
    config._paged_kv_cache_dir = os.environ[_ENV]  # pylint: disable=protected-access
  path = os.environ.get(_ENV)
  if path:
    # A worker can read an entry the other is still writing: JAX then warns and
    # compiles it itself, which is all that is lost.
    config.addinivalue_line(
        "filterwarnings",
        "ignore:Error reading persistent compilation cache entry:UserWarning")
    jax.config.update("jax_compilation_cache_dir", path)
    # Cache every program, however quick to compile (the suite's are small).
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config):
  path = getattr(config, "_paged_kv_cache_dir", None)
  if path:
    shutil.rmtree(path, ignore_errors=True)
    os.environ.pop(_ENV, None)
