"""Counters of what the host path costs on the device: dispatches, host reads, compiles.

"Compile once, never wait" is checked by counting, not timing. Dispatches by
kind (`"commit"`, `"step"`, `"data"`, `"sync"`, `"stats"`), host reads that
wait by kind (`"status"`, `"resync"`, `"data"`, `"tokens"`, `"check"`),
deferred checks (compared once ready, no wait), and process-wide compiles and
cache loads. A `BlockPool` owns one `RuntimeCounters`; `snapshot()` gives a
`RuntimeStats`, `RuntimeStats.since(earlier)` the difference.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
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


@dataclasses.dataclass(frozen=True)
class RuntimeStats:
  """An immutable reading of `RuntimeCounters` and the process-wide compile counts.

  `dispatches` and `host_reads` are by kind (module docstring).
  """

  dispatches: Mapping[str, int]
  host_reads: Mapping[str, int]
  deferred_checks: int
  backend_compiles: int
  cache_loads: int

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

  def since(self, earlier: "RuntimeStats") -> "RuntimeStats":
    """The counts accumulated after `earlier` (an earlier reading of the same counters)."""
    def diff(a: Mapping[str, int], b: Mapping[str, int]) -> dict[str, int]:
      return {k: a.get(k, 0) - b.get(k, 0) for k in sorted(set(a) | set(b))}
    return RuntimeStats(dispatches=diff(self.dispatches, earlier.dispatches),
                        host_reads=diff(self.host_reads, earlier.host_reads),
                        deferred_checks=self.deferred_checks - earlier.deferred_checks,
                        backend_compiles=self.backend_compiles - earlier.backend_compiles,
                        cache_loads=self.cache_loads - earlier.cache_loads)


class RuntimeCounters:
  """Mutable counters of one pool's device traffic (see the module docstring)."""

  def __init__(self):
    listen_for_compiles()
    self.dispatches: collections.Counter[str] = collections.Counter()
    self.host_reads: collections.Counter[str] = collections.Counter()
    self.deferred_checks = 0

  def dispatch(self, kind: str, n: int = 1) -> None:
    self.dispatches[kind] += n

  def read(self, kind: str, n: int = 1) -> None:
    self.host_reads[kind] += n

  def snapshot(self) -> RuntimeStats:
    return RuntimeStats(dispatches=dict(self.dispatches), host_reads=dict(self.host_reads),
                        deferred_checks=self.deferred_checks,
                        backend_compiles=backend_compiles(), cache_loads=cache_loads())


listen_for_compiles()
