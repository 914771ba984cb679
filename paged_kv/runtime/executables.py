"""The compiled programs the library owns, kept below the kernel's memory-map limit.

An XLA CPU executable holds ~30 memory mappings, so a process building pool after
pool of new shapes reaches `vm.max_map_count` and segfaults inside XLA
(`tools/map_limit_repro.py`). `track_pool` releases the library's own programs
above `release_fraction` of the limit and raises `MapLimitNear` above
`refuse_fraction`, before anything compiles.
"""

from __future__ import annotations

import dataclasses
import gc
import sys
import weakref
from typing import Any

from paged_kv.core.errors import PagedKVError
from paged_kv.runtime import counters

MAP_COUNT_FILE = "/proc/sys/vm/max_map_count"
_OWNED_PACKAGES = ("paged_kv", "pallas_kernels")


class MapLimitNear(PagedKVError):
  """The process nears `vm.max_map_count` even after releasing the library's programs."""


@dataclasses.dataclass
class Budget:
  """When `track_pool` releases programs and when it refuses, as shares of `limit`."""

  release_fraction: float = 0.5
  refuse_fraction: float = 0.85
  limit: int | None = None


BUDGET = Budget()
_live: "weakref.WeakSet[Any]" = weakref.WeakSet()  # every tracked pool
_configs: set = set()  # configs whose programs may be compiled (live or retired)
releases = 0  # times `track_pool` released the owned programs


def map_limit() -> int | None:
  """`vm.max_map_count` (or `BUDGET.limit`); None where there is no such limit."""
  if BUDGET.limit is not None:
    return BUDGET.limit
  try:
    with open(MAP_COUNT_FILE) as f:
      return int(f.read())
  except (OSError, ValueError):
    return None


def _owned_functions() -> list:
  """Jitted functions defined at module level in the library's loaded modules."""
  out, seen = [], set()
  for name, module in list(sys.modules.items()):
    if module is None or name.split(".")[0] not in _OWNED_PACKAGES:
      continue
    for value in list(vars(module).values()):
      if (callable(getattr(value, "clear_cache", None))
          and callable(getattr(value, "_cache_size", None)) and id(value) not in seen):
        seen.add(id(value))
        out.append(value)
  return out


def owned_executables() -> int:
  """Compiled programs the library's module-level jitted functions hold now."""
  return sum(int(fn._cache_size()) for fn in _owned_functions())  # pylint: disable=protected-access


def retired_configs() -> list:
  """Tracked pool configs no live pool uses any more."""
  live = {p.config for p in list(_live)}
  return [c for c in _configs if c not in live]


def release_owned() -> int:
  """Drops every compiled program the library owns; returns how many its functions held."""
  count = owned_executables()
  for fn in _owned_functions():
    fn.clear_cache()
  warmup = sys.modules.get("paged_kv.scheduler.warmup")
  if warmup is not None:
    warmup.release_programs()
  gc.collect()
  counters.trim_heap()
  _configs.intersection_update({p.config for p in list(_live)})
  return count


def track_pool(pool: Any) -> None:
  """Records a new pool; for a new config, keeps the process below the map limit (module docstring).

  Raises `MapLimitNear` when the mappings exceed `BUDGET.refuse_fraction` of the
  limit after releasing.
  """
  global releases
  _live.add(pool)
  config = pool.config
  if config in _configs:
    return
  _configs.add(config)
  limit = map_limit()
  used = counters.memory_mappings()
  if limit is None or used < 0 or used < BUDGET.release_fraction * limit:
    return
  release_owned()
  releases += 1
  used = counters.memory_mappings()
  if used >= BUDGET.refuse_fraction * limit:
    raise MapLimitNear(
        f"this process holds {used} memory mappings, {used / limit:.0%} of the kernel's "
        f"limit vm.max_map_count={limit}, after paged_kv released its compiled programs "
        f"(each XLA executable holds about 30 mappings; past the limit XLA's compiler "
        f"segfaults). Fix: raise the limit (`sysctl -w vm.max_map_count=262144`), build "
        f"fewer distinct pool shapes per process, or drop other compiled programs "
        f"(`jax.clear_caches()`)")
