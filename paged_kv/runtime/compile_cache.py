"""JAX's persistent compilation cache, turned on explicitly by the caller.

    from paged_kv.runtime.compile_cache import enable_compilation_cache
    enable_compilation_cache()          # ~/.cache/paged_kv/jax, or $PAGED_KV_COMPILE_CACHE

Changing the directory calls JAX's `reset_cache()`, so a switch takes effect at
the next compile (`docs/serving_loop.md`). The directory is trusted: whoever can
write to it can make this process run code.
"""

from __future__ import annotations

import logging
import math
import os

import jax
from jax.experimental.compilation_cache import compilation_cache as _jax_cache

from paged_kv.core.errors import InvalidArgument

ENV_VAR = "PAGED_KV_COMPILE_CACHE"
"""Environment variable naming the cache directory (overrides the XDG default)."""

# The logger of `jax._src.compilation_cache`: `reset_cache()` logs one INFO line, which
# absl scripts print (their default verbosity is INFO); a rename there only brings it back.
_JAX_CACHE_LOGGER = logging.getLogger("jax._src.compilation_cache")


def _reset_jax_cache() -> None:
  """JAX's public `reset_cache()`, without its INFO line."""
  level = _JAX_CACHE_LOGGER.level
  _JAX_CACHE_LOGGER.setLevel(max(level, logging.WARNING))
  try:
    _jax_cache.reset_cache()
  finally:
    _JAX_CACHE_LOGGER.setLevel(level)


def default_cache_dir() -> str:
  """`$PAGED_KV_COMPILE_CACHE` if set, else `$XDG_CACHE_HOME/paged_kv/jax` (`~/.cache`)."""
  path = os.environ.get(ENV_VAR)
  if path:
    return os.path.abspath(os.path.expanduser(path))
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
  return os.path.abspath(os.path.join(os.path.expanduser(base), "paged_kv", "jax"))


def compilation_cache_dir() -> str | None:
  """The persistent cache directory set in JAX's config now (None: no cache)."""
  return jax.config.jax_compilation_cache_dir


def enable_compilation_cache(path: str | None = None, *, min_compile_seconds: float = 0.0) -> str:
  """Turns JAX's persistent compilation cache on, writing to `path`; returns the path.

  Writes entries of any size compiled in at least `min_compile_seconds` (JAX's 1 s
  would skip nearly every program here on CPU). Raises `InvalidArgument` when
  `path` is not a writable directory, or `min_compile_seconds` is negative or not
  finite.
  """
  if not (isinstance(min_compile_seconds, (int, float)) and math.isfinite(min_compile_seconds)
          and min_compile_seconds >= 0):
    raise InvalidArgument(
        f"min_compile_seconds must be a finite number >= 0, got {min_compile_seconds!r}")
  path = default_cache_dir() if path is None else os.path.abspath(os.path.expanduser(path))
  if os.path.exists(path) and not os.path.isdir(path):
    raise InvalidArgument(f"compilation cache path {path} exists and is not a directory")
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    raise InvalidArgument(f"cannot create the compilation cache directory {path}: {e}") from e
  if not os.access(path, os.W_OK | os.X_OK):
    raise InvalidArgument(f"compilation cache directory {path} is not writable")
  jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_seconds))
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  if compilation_cache_dir() != path:
    _jax_cache.set_cache_dir(path)
    _reset_jax_cache()  # a cache built for another directory would keep being used
  return path


def disable_compilation_cache() -> None:
  """Turns the persistent cache off: the next compile neither reads nor writes it."""
  if compilation_cache_dir() is not None:
    _jax_cache.set_cache_dir(None)
  _reset_jax_cache()
