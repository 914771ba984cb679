"""The compiled programs the library owns, kept below the kernel's memory-map limit.

Every `PoolConfig` field is a static argument of the library's jitted functions, so
each pool shape compiles its own programs, and JAX keeps every one alive while its
jitted function lives (a module-level `jax.jit` lives for the process). An XLA CPU
executable holds about 30 memory mappings; a process that builds pool after pool of
new shapes (a fuzz, a sweep, a server that resizes) reaches `vm.max_map_count`, and
from then on `mmap` fails inside XLA's compiler and the process dies with a
segmentation fault (`tools/map_limit_repro.py`). So:

* `track_pool(pool)` (every `BlockPool` calls it) records the pool's config and the
  pool, weakly: a config whose pools are all gone is *retired*.
* When a pool of a new config is built and the process holds more than
  `release_fraction` of the limit's mappings, the library's own compiled programs
  are released (`release_owned`: every jitted function of a loaded `paged_kv` or
  `pallas_kernels` module, and the serving path's bound model steps); the live
  configs' programs compile again on their next use. Only the library's caches are
  dropped, never the caller's.
* If the mappings still exceed `refuse_fraction` of the limit, building the pool
  raises `MapLimitNear`, naming the limit and the fix, before anything compiles: a
  typed error instead of a segfault.

`owned_executables()` counts the programs held now (for tests and telemetry).
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
  """The process is close to the kernel's memory-map limit (`vm.max_map_count`) even
  after the library released its compiled programs; the message says the fix."""


@dataclasses.dataclass
class Budget:
  """When `track_pool` releases programs and when it refuses.

  Attributes:
    release_fraction: release the library's programs above this share of the limit.
    refuse_fraction: raise `MapLimitNear` above this share after releasing.
    limit: the map limit (None: read `MAP_COUNT_FILE`; no limit off Linux).
  """

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
  """Drops every compiled program the library owns; returns how many its module-level
  functions held. The serving path's model steps go too (`warmup.release_programs`,
  when the serving package is loaded). Live pools recompile what they use next."""
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
  """Records a new pool; for a config not seen before, keeps the process below the map
  limit (module docstring).

  Raises:
    MapLimitNear: the mappings exceed `BUDGET.refuse_fraction` of the limit after
      the library's programs were released.
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
