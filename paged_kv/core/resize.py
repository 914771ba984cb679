"""Resizing a pool's pages with a bounded peak of device memory.

XLA cannot shrink a buffer in place, so the one-program cut holds the old and
new pool at once. `resize_state_staged` never does: for K, then V, it stages
each layer's kept part (on the device within a budget, else on the host), frees
the old array and writes the parts into the new one in place.
`resize_pool_state` picks the path (`plan_staging`). A failure leaves the pool
as it was and re-raises.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from paged_kv.core import device_memory
from paged_kv.core.config import PoolConfig
from paged_kv.core.errors import InvalidArgument
from paged_kv.core.regions import resize_meta, resize_state
from paged_kv.core.state import KVPages, PoolState

__all__ = ["ResizeReport", "STAGINGS", "live_device_bytes", "plan_staging",
           "resize_pool_state", "resize_state_device", "resize_state_staged",
           "stages_through_host"]

STAGINGS = ("auto", "device", "host")


@dataclasses.dataclass(frozen=True)
class ResizeReport:
  """What one resize of a pool's pages cost (bytes, and wall seconds with every program waited for).

  `staged`: kept pages went through staging; `bytes_before`/`peak_bytes`: live
  device bytes before and at the peak between programs; `pages_*`: old and new
  page bytes; `chunk_bytes`: one staged layer; `host_bytes`/`device_bytes`: kept
  bytes staged through the host (both ways) or held on the device.
  """

  old_blocks: int
  new_blocks: int
  staged: bool
  bytes_before: int
  peak_bytes: int
  pages_before: int
  pages_after: int
  chunk_bytes: int
  host_bytes: int
  seconds: float
  device_bytes: int = 0

  @property
  def peak_extra_bytes(self) -> int:
    """Peak bytes above the old pool's state: what the resize needed beside it."""
    return self.peak_bytes - self.bytes_before


def live_device_bytes() -> int:
  """Bytes of every live (not deleted) `jax.Array` in the process, all devices."""
  return sum(x.nbytes for x in jax.live_arrays() if not x.is_deleted())


def _pages_bytes(config: PoolConfig) -> int:
  return config.num_blocks * config.block_bytes  # K and V, every layer


def plan_staging(config: PoolConfig, new_config: PoolConfig, staging: str = "auto", *,
                 device: jax.Device | None = None) -> tuple[bool, int]:
  """`(staged, device_budget)`: how `resize_pool_state` resizes for `staging`.

  `"device"`: `(False, 0)`; `"host"`: `(True, 0)`; `"auto"`: one program when free
  memory holds the new pages plus an eighth (or is unknown), else staged within
  7/8 of the free memory less one chunk. Raises `InvalidArgument` otherwise.
  """
  if staging not in STAGINGS:
    raise InvalidArgument(f"staging must be one of {STAGINGS}, got {staging!r}")
  if staging != "auto":
    return staging == "host", 0
  free = device_memory.free_bytes(device)
  need = _pages_bytes(new_config)
  if free is None or free >= need + need // 8:
    return False, 0
  chunk = min(config.num_blocks, new_config.num_blocks) * config.block_bytes // (
      2 * config.num_layers)
  return True, max(0, free * 7 // 8 - chunk)


def stages_through_host(config: PoolConfig, new_config: PoolConfig, staging: str = "auto", *,
                        device: jax.Device | None = None) -> bool:
  """Whether `resize_pool_state(..., staging=staging)` goes through host memory."""
  return plan_staging(config, new_config, staging, device=device)[0]


@functools.partial(jax.jit, static_argnames=("keep",))
def _take_layer(pages: jax.Array, layer: jax.Array, *, keep: int) -> jax.Array:
  """`pages[layer:layer + 1, :, :keep]`: one layer's first `keep` blocks."""
  one = jax.lax.dynamic_slice_in_dim(pages, layer, 1, axis=0)
  return one[:, :, :keep]


@functools.partial(jax.jit, donate_argnames=("pages",))
def _put_layer(pages: jax.Array, chunk: jax.Array, layer: jax.Array) -> jax.Array:
  """`pages` with `chunk` (`[1, H, keep, bs, D]`) written at `(layer, :, :keep)`, in place."""
  zero = jnp.zeros((), jnp.int32)
  return jax.lax.dynamic_update_slice(pages, chunk.astype(pages.dtype),
                                      (layer, zero, zero, zero, zero))


@functools.lru_cache(maxsize=8)
def _zeros_program(shape: tuple[int, ...], dtype, sharding) -> Callable[[], jax.Array]:
  return jax.jit(functools.partial(jnp.zeros, shape, dtype), out_shardings=sharding)


def release_programs() -> None:
  """Drops the staged resize's compiled programs (what a shrink's cut calls after)."""
  _take_layer.clear_cache()
  _put_layer.clear_cache()
  _zeros_program.cache_clear()


class _Peak:
  """The largest `live_device_bytes()` seen at the points `see()` is called."""

  def __init__(self):
    self.before = self.peak = live_device_bytes()

  def see(self) -> None:
    self.peak = max(self.peak, live_device_bytes())


def _upload(chunks: list, shape: tuple[int, ...], dtype, sharding, peak: _Peak,
            fault: Callable[[int], None] | None) -> jax.Array:
  """New pages of `shape`: zeros, then each layer's chunk written at its first blocks."""
  pages = _zeros_program(shape, jnp.dtype(dtype), sharding)()
  peak.see()
  for layer, chunk in enumerate(chunks):
    if fault is not None:
      fault(layer)
    piece = chunk if isinstance(chunk, jax.Array) else jax.device_put(chunk, sharding)
    peak.see()
    pages = _put_layer(pages, piece, jnp.int32(layer))
    del piece
  pages.block_until_ready()
  return pages


def _drop(chunks: list) -> None:
  for chunk in chunks:
    if isinstance(chunk, jax.Array) and not chunk.is_deleted():
      chunk.delete()


@dataclasses.dataclass
class _Staged:
  """Bytes one array's replacement moved through the host (both ways) and held on the device."""

  host_bytes: int = 0
  device_bytes: int = 0
  chunk_bytes: int = 0


def _replace(arrays: dict[str, jax.Array], name: str, *, keep: int, num_blocks: int,
             budget: int, peak: _Peak, totals: _Staged,
             fault: Callable[[int], None] | None) -> None:
  """`arrays[name]` becomes a copy with `num_blocks` blocks; the old is deleted first.

  Kept parts wait on the device within `budget` bytes, else on the host. On a
  failure `arrays[name]` is the old array again.
  """
  old = arrays[name]
  chunks: list = []
  held = 0
  try:
    for layer in range(old.shape[0]):
      chunk = _take_layer(old, jnp.int32(layer), keep=keep)
      peak.see()
      if held + chunk.nbytes <= budget:
        held += chunk.nbytes
        chunks.append(chunk)
      else:
        chunks.append(np.array(chunk, copy=True))  # a host copy, not a view of the buffer
        chunk.delete()
  except BaseException:
    _drop(chunks)
    raise
  shape, dtype, sharding = old.shape, old.dtype, old.sharding
  old.delete()
  try:
    new = _upload(chunks, shape[:2] + (num_blocks,) + shape[3:], dtype, sharding, peak, fault)
  except BaseException:
    # The old array is gone: rebuild it from the staged chunks (a cut tail was free,
    # so zeros) before the error propagates.
    arrays[name] = _upload(chunks, shape, dtype, sharding, peak, None)
    _drop(chunks)
    raise
  arrays[name] = new
  host = sum(c.nbytes for c in chunks if isinstance(c, np.ndarray))
  totals.host_bytes += 2 * host
  totals.device_bytes += held
  totals.chunk_bytes = max(totals.chunk_bytes, chunks[0].nbytes if chunks else 0)
  _drop(chunks)


def resize_state_staged(state: PoolState, *, config: PoolConfig, new_config: PoolConfig,
                        device_budget: int = 0,
                        _fault: Callable[[int], None] | None = None
                        ) -> tuple[PoolState, ResizeReport]:
  """`regions.resize_state`'s result without the old and the new pages alive together.

  Peak: the larger pool plus one layer of K plus `device_budget`. Consumes
  `state`, checks nothing; a failure puts the pages back and re-raises. `_fault`
  (tests) runs before each layer's upload.
  """
  t0 = time.perf_counter()
  peak = _Peak()
  old_n, new_n = config.num_blocks, new_config.num_blocks
  keep = min(old_n, new_n)
  meta = resize_meta(state.meta, config=config, new_config=new_config)
  peak.see()
  arrays = {"k": state.pages.k, "v": state.pages.v}
  totals = _Staged()
  budget = max(0, int(device_budget))
  done = []
  try:
    for name in ("k", "v"):
      before = arrays[name].nbytes
      _replace(arrays, name, keep=keep, num_blocks=new_n, budget=budget, peak=peak,
               totals=totals, fault=_fault)
      done.append(name)
      budget = max(0, budget + before - arrays[name].nbytes)  # a cut's freed room
  except BaseException:
    for name in done:  # back to the old size, through the host (the room is the old pool's)
      _replace(arrays, name, keep=keep, num_blocks=old_n, budget=0, peak=peak,
               totals=_Staged(), fault=None)
    object.__setattr__(state, "pages", KVPages(k=arrays["k"], v=arrays["v"]))
    raise
  report = ResizeReport(old_blocks=old_n, new_blocks=new_n, staged=True,
                        bytes_before=peak.before, peak_bytes=peak.peak,
                        pages_before=_pages_bytes(config), pages_after=_pages_bytes(new_config),
                        chunk_bytes=totals.chunk_bytes, host_bytes=totals.host_bytes,
                        device_bytes=totals.device_bytes, seconds=time.perf_counter() - t0)
  return dataclasses.replace(state, pages=KVPages(k=arrays["k"], v=arrays["v"]),
                             meta=meta), report


def resize_state_device(state: PoolState, *, config: PoolConfig,
                        new_config: PoolConfig) -> tuple[PoolState, ResizeReport]:
  """`regions.resize_state` (old and new pages alive together), measured; consumes `state`."""
  t0 = time.perf_counter()
  peak = _Peak()
  new = resize_state(state, config=config, new_config=new_config)
  jax.block_until_ready(new)
  peak.see()
  state.pages.k.delete()
  state.pages.v.delete()
  return new, ResizeReport(old_blocks=config.num_blocks, new_blocks=new_config.num_blocks,
                           staged=False, bytes_before=peak.before, peak_bytes=peak.peak,
                           pages_before=_pages_bytes(config),
                           pages_after=_pages_bytes(new_config), chunk_bytes=0, host_bytes=0,
                           seconds=time.perf_counter() - t0)


def resize_pool_state(state: PoolState, *, config: PoolConfig, new_config: PoolConfig,
                      staging: str = "auto") -> tuple[PoolState, ResizeReport]:
  """The pool's arrays at `new_config`'s size, by the path `plan_staging` picks for `staging`.

  Consumes `state`; the caller checked the cut tail is free. Returns the new
  state and its `ResizeReport`; raises `InvalidArgument` for a bad `staging`.
  """
  staged, budget = plan_staging(config, new_config, staging)
  if staged:
    return resize_state_staged(state, config=config, new_config=new_config,
                               device_budget=budget)
  return resize_state_device(state, config=config, new_config=new_config)
