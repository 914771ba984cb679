"""Counters of what the host path costs on the device: dispatches, host reads, compiles.

"Compile once, never wait" is checked by counting, not timing. Dispatches by
kind (`"commit"`, `"step"`, `"data"`, `"sync"`, `"stats"`), host reads that
wait by kind (`"status"`, `"resync"`, `"data"`, `"tokens"`, `"check"`),
deferred checks (compared once ready, no wait), and process-wide compiles and
cache loads. A `BlockPool` owns one `RuntimeCounters`; its `snapshot()` is a reading
of the same class, `later.since(earlier)` the difference of two readings.
"""

from __future__ import annotations

import collections
import ctypes
import os
import threading
from collections.abc import Mapping

import jax

DISPATCH_KINDS = ("commit", "step", "data", "sync", "stats")
READ_KINDS = ("status", "resync", "data", "tokens", "check")

_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"

_lock = threading.Lock()
_compiles = 0
_cache_loads = 0
_listening = False


def _on_duration(event: str, duration: float, **kwargs) -> None:
  del duration, kwargs
  global _compiles
  if event == _BACKEND_COMPILE_EVENT:
    with _lock:
      _compiles += 1


def _on_event(event: str, **kwargs) -> None:
  del kwargs
  global _cache_loads
  if event == _CACHE_HIT_EVENT:
    with _lock:
      _cache_loads += 1


def listen_for_compiles() -> None:
  """Registers the compile listeners with `jax.monitoring`, once per process (on import)."""
  global _listening
  with _lock:
    if _listening:
      return
    _listening = True
  jax.monitoring.register_event_duration_secs_listener(_on_duration)
  jax.monitoring.register_event_listener(_on_event)


def backend_compiles() -> int:
  """XLA backend compilations in this process since the listener was registered.

  JAX's compile event also fires on a persistent-cache load, so loads are subtracted.
  """
  return _compiles - _cache_loads


def cache_loads() -> int:
  """Executables loaded from JAX's persistent compilation cache in this process."""
  return _cache_loads


def memory_mappings() -> int:
  """Lines of `/proc/self/maps` (each XLA CPU executable holds ~30); -1 off Linux."""
  try:
    with open("/proc/self/maps", "rb") as f:
      return sum(1 for _ in f)
  except OSError:
    return -1


def resident_bytes() -> int:
  """Resident set size of this process in bytes (`/proc/self/statm`); -1 off Linux."""
  try:
    with open("/proc/self/statm") as f:
      return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
  except (OSError, ValueError, IndexError):
    return -1


def trim_heap() -> bool:
  """Hands freed heap pages back to the OS (glibc's `malloc_trim(0)`); False without glibc."""
  try:
    libc = ctypes.CDLL("libc.so.6")
    return bool(libc.malloc_trim(0))
  except (OSError, AttributeError):
    return False


class RuntimeCounters:
  """A pool's device traffic and the process's compiles: live, or a reading of them.

  A `BlockPool` owns a live one (`pool.runtime`) and counts into it (`dispatch`,
  `read`); its `backend_compiles` and `cache_loads` are the process's, read on
  access. `snapshot()` is a reading (the same class, its figures fixed) and
  `later.since(earlier)` the counts between two readings. `dispatches` and
  `host_reads` map a kind (module docstring) to a count.
  """

  __slots__ = ("dispatches", "host_reads", "deferred_checks", "_compiles")

  def __init__(self):
    listen_for_compiles()
    self.dispatches: Mapping[str, int] = collections.Counter()
    self.host_reads: Mapping[str, int] = collections.Counter()
    self.deferred_checks = 0
    self._compiles: tuple[int, int] | None = None  # a reading's (compiles, cache loads)

  @classmethod
  def _reading(cls, dispatches: dict, host_reads: dict, deferred_checks: int,
               compiles: tuple[int, int]) -> "RuntimeCounters":
    out = cls.__new__(cls)
    out.dispatches, out.host_reads, out.deferred_checks = dispatches, host_reads, deferred_checks
    out._compiles = compiles
    return out

  def dispatch(self, kind: str, n: int = 1) -> None:
    self.dispatches[kind] += n

  def read(self, kind: str, n: int = 1) -> None:
    self.host_reads[kind] += n

  @property
  def backend_compiles(self) -> int:
    """XLA compiles in the process (`backend_compiles()`; a reading's: then, or between)."""
    return backend_compiles() if self._compiles is None else self._compiles[0]

  @property
  def cache_loads(self) -> int:
    """Persistent-cache loads in the process (`cache_loads()`), as `backend_compiles`."""
    return cache_loads() if self._compiles is None else self._compiles[1]

  @property
  def num_dispatches(self) -> int:
    return sum(self.dispatches.values())

  @property
  def bookkeeping_dispatches(self) -> int:
    """Dispatches of bookkeeping: commits and synchronous transitions."""
    return self.dispatches.get("commit", 0) + self.dispatches.get("sync", 0)

  @property
  def num_host_reads(self) -> int:
    return sum(self.host_reads.values())

  @property
  def blocking_reads(self) -> int:
    """Host reads that waited on the device, sampled tokens excluded."""
    return self.num_host_reads - self.host_reads.get("tokens", 0)

  def snapshot(self) -> "RuntimeCounters":
    """A reading of these counters and of the process's compile counts now."""
    compiles = self._compiles or (backend_compiles(), cache_loads())
    return self._reading(dict(self.dispatches), dict(self.host_reads), self.deferred_checks,
                         compiles)

  def since(self, earlier: "RuntimeCounters") -> "RuntimeCounters":
    """The counts accumulated after `earlier` (an earlier reading of the same counters)."""
    a, b = self.dispatches, earlier.dispatches
    dispatches = {k: a.get(k, 0) - b.get(k, 0) for k in sorted(a.keys() | b.keys())}
    a, b = self.host_reads, earlier.host_reads
    host_reads = {k: a.get(k, 0) - b.get(k, 0) for k in sorted(a.keys() | b.keys())}
    now = self._compiles or (backend_compiles(), cache_loads())
    then = earlier._compiles or (backend_compiles(), cache_loads())
    return self._reading(dispatches, host_reads, self.deferred_checks - earlier.deferred_checks,
                         (now[0] - then[0], now[1] - then[1]))

  def __repr__(self) -> str:
    return (f"RuntimeCounters(dispatches={dict(self.dispatches)}, "
            f"host_reads={dict(self.host_reads)}, deferred_checks={self.deferred_checks}, "
            f"backend_compiles={self.backend_compiles}, cache_loads={self.cache_loads})")

listen_for_compiles()
