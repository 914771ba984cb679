"""The persistent compilation cache helpers: enable, switch, disable, refuse bad paths.

Every test leaves JAX's global config as it found it (the cache directory and both
thresholds, and JAX's cache object dropped), through `addCleanup`, so a failing test
does not leave later tests of the same xdist worker writing to a temporary directory.
"""

from __future__ import annotations

import itertools
import os
import tempfile
from unittest import mock

import jax
import jax.numpy as jnp
from absl.testing import absltest
from jax.experimental.compilation_cache import compilation_cache as jax_cache

from paged_kv.core.errors import InvalidArgument
from paged_kv.runtime import compile_cache

_OPTIONS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
            "jax_persistent_cache_min_entry_size_bytes")
_TAGS = itertools.count(1)


def _compile_fresh_program() -> None:
  """Compiles a program never compiled before in this process (a new constant in it)."""
  tag = float(next(_TAGS)) + 0.5
  jax.jit(lambda x: x * tag + 1.0)(jnp.arange(4, dtype=jnp.float32)).block_until_ready()


def _entries(path: str) -> set[str]:
  return set(os.listdir(path))


class CompileCacheTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    saved = {name: getattr(jax.config, name) for name in _OPTIONS}

    def restore():
      for name, value in saved.items():
        jax.config.update(name, value)
      jax_cache.reset_cache()

    self.addCleanup(restore)

  def _tempdir(self) -> str:
    d = tempfile.TemporaryDirectory(prefix="paged_kv_cc_test_")
    self.addCleanup(d.cleanup)
    return d.name

  def test_enable_writes_compiled_programs(self):
    path = self._tempdir()
    self.assertEqual(compile_cache.enable_compilation_cache(path), path)
    self.assertEqual(compile_cache.compilation_cache_dir(), path)
    self.assertEqual(jax.config.jax_persistent_cache_min_compile_time_secs, 0.0)
    self.assertEqual(jax.config.jax_persistent_cache_min_entry_size_bytes, 0)
    _compile_fresh_program()
    self.assertNotEmpty(_entries(path))

  def test_enable_creates_the_directory_and_is_idempotent(self):
    path = os.path.join(self._tempdir(), "a", "b")
    self.assertEqual(compile_cache.enable_compilation_cache(path, min_compile_seconds=2.5), path)
    self.assertTrue(os.path.isdir(path))
    self.assertEqual(compile_cache.enable_compilation_cache(path, min_compile_seconds=2.5), path)
    self.assertEqual(compile_cache.compilation_cache_dir(), path)
    self.assertEqual(jax.config.jax_persistent_cache_min_compile_time_secs, 2.5)

  def test_switching_directory_after_use_takes_effect(self):
    first, second = self._tempdir(), self._tempdir()
    compile_cache.enable_compilation_cache(first)
    _compile_fresh_program()
    before = _entries(first)
    self.assertNotEmpty(before)
    compile_cache.enable_compilation_cache(second)
    _compile_fresh_program()
    self.assertNotEmpty(_entries(second))
    self.assertEqual(_entries(first), before)

  def test_disable_after_use_stops_writing(self):
    path = self._tempdir()
    compile_cache.enable_compilation_cache(path)
    _compile_fresh_program()
    before = _entries(path)
    compile_cache.disable_compilation_cache()
    self.assertIsNone(compile_cache.compilation_cache_dir())
    _compile_fresh_program()
    self.assertEqual(_entries(path), before)

  def test_file_path_is_refused(self):
    path = os.path.join(self._tempdir(), "not_a_dir")
    with open(path, "w") as f:
      f.write("x")
    with self.assertRaisesRegex(InvalidArgument, "not a directory"):
      compile_cache.enable_compilation_cache(path)
    with self.assertRaisesRegex(InvalidArgument, "cannot create"):
      compile_cache.enable_compilation_cache(os.path.join(path, "below"))
    self.assertIsNone(compile_cache.compilation_cache_dir())

  def test_unwritable_directory_is_refused(self):
    path = self._tempdir()
    with mock.patch.object(os, "access", return_value=False):  # as root, chmod would not do
      with self.assertRaisesRegex(InvalidArgument, "not writable"):
        compile_cache.enable_compilation_cache(path)
    self.assertIsNone(compile_cache.compilation_cache_dir())

  def test_bad_min_compile_seconds_is_refused(self):
    path = self._tempdir()
    for bad in (-1.0, float("nan"), float("inf")):
      with self.assertRaises(InvalidArgument):
        compile_cache.enable_compilation_cache(path, min_compile_seconds=bad)
    self.assertIsNone(compile_cache.compilation_cache_dir())

  def test_default_cache_dir(self):
    with mock.patch.dict(os.environ, {compile_cache.ENV_VAR: "/tmp/pkv_cc"}):
      self.assertEqual(compile_cache.default_cache_dir(), "/tmp/pkv_cc")
    with mock.patch.dict(os.environ, {"XDG_CACHE_HOME": "/tmp/xdg"}):
      os.environ.pop(compile_cache.ENV_VAR, None)
      self.assertEqual(compile_cache.default_cache_dir(), "/tmp/xdg/paged_kv/jax")
    with mock.patch.dict(os.environ, {"HOME": "/tmp/home"}):
      os.environ.pop(compile_cache.ENV_VAR, None)
      os.environ.pop("XDG_CACHE_HOME", None)
      self.assertEqual(compile_cache.default_cache_dir(), "/tmp/home/.cache/paged_kv/jax")


if __name__ == "__main__":
  absltest.main()
