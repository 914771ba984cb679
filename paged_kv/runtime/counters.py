"""Counters of what the host path costs on the device: dispatches, host reads, compiles.

"Compile once, never wait" is checked by counting, not by timing:

* **dispatches** — jitted programs the library launched, by kind:
  `"commit"` (the pool's bookkeeping, one program per flush), `"step"` (an
  executor's forward pass), `"data"` (K/V writes and gathers: `write_kv`,
  swap, persistence), `"sync"` (a transition run synchronously: debug mode and
  the calls the host mirror does not model), `"stats"` (a device reduction for
  telemetry);
* **host reads** — reads of device data that wait for the device, by kind:
  `"status"` (a transition's status read at once: debug mode, `sync` calls),
  `"resync"` (the host mirror reloaded from the device), `"data"` (K/V brought
  to the host), `"tokens"` (an executor's sampled tokens), `"check"` (a
  deferred check forced to wait);
* **deferred checks** — device results compared with the host's expectation
  once they were ready (`jax.Array.is_ready()`): no wait;
* **compiles** — XLA backend compilations in this process (JAX's
  `/jax/core/compile/backend_compile_duration` events minus its
  `/jax/compilation_cache/cache_hits`: the first also fires on a load) and
  persistent-cache loads, process-wide.

A `BlockPool` owns one `RuntimeCounters`; the scheduler reports its figures in
`SchedulerStats` and the Prometheus exporter exports them. `snapshot()` gives
an immutable `RuntimeStats`; `RuntimeStats.since(earlier)` the difference
(e.g. since warm-up).
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
  """Registers the compile listeners with `jax.monitoring` (once per process).

  Compiles before the first call are not counted; `import paged_kv.runtime.counters`
  registers them, so importing `paged_kv.pool.block_pool` is enough.
  """
  global _listening
  with _lock:
    if _listening:
      return
    _listening = True
  jax.monitoring.register_event_duration_secs_listener(_on_duration)
  jax.monitoring.register_event_listener(_on_event)


def backend_compiles() -> int:
  """XLA backend compilations in this process since the listener was registered.

  JAX records its compile event around "compile, or load from the persistent
  cache" (`compile_or_get_cached`), so a cache hit fires it too: the loads are
  subtracted here (`cache_loads()` counts them).
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
  """Asks the C allocator to hand freed heap pages back to the OS (glibc's
  `malloc_trim(0)`), e.g. after dropping compiled programs; False where there
  is no glibc (the call is then a no-op)."""
  try:
    libc = ctypes.CDLL("libc.so.6")
    return bool(libc.malloc_trim(0))
  except (OSError, AttributeError):
    return False


@dataclasses.dataclass(frozen=True)
class RuntimeStats:
  """An immutable reading of `RuntimeCounters` (and the process-wide compile counts).

  Attributes:
    dispatches: jitted programs launched, by kind (see the module docstring).
    host_reads: blocking reads of device data, by kind.
    deferred_checks: device results compared once ready (no wait).
    backend_compiles: XLA compiles in the process so far.
    cache_loads: persistent-cache loads in the process so far.
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
    """Host reads that waited on the device, sampled tokens excluded (a model's
    output has to reach the host; bookkeeping never has to)."""
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
