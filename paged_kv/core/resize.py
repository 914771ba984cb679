"""Resizing a pool's pages with a bounded peak of device memory.

A pool changes size by giving its arrays new shapes. XLA cannot shrink a buffer in
place, so the plain cut (`regions.resize_state`, one jitted program) builds the new
pages while the old ones are still alive: for a moment the device holds the old
pool *and* the new one. On a card whose memory the pool fills (the reason to shrink
it), that is an out-of-memory in the middle of serving.

`resize_state_staged` never holds two pools: it copies the part of the pages it
keeps to host memory one layer of K (or V) at a time, frees the old pages, then
allocates the new ones and uploads the kept part back one layer at a time (each
upload written in place into the donated new pages). Peak device memory is
`max(old pool, new pool) + one layer of K of the kept size`, at the price of the
kept bytes crossing the host link twice (about 1.3 s for 16 GB each way at 25 GB/s,
against a few ms for the device copy). `resize_pool_state` picks one of the two:
`staging="auto"` stages only when the device has no room for the new pages beside
the old ones (`device_memory.free_bytes`), `"device"` and `"host"` force a path.

Both report a `ResizeReport`: the path taken, the live device bytes before and at
the peak (the sum of every live `jax.Array`'s bytes, sampled after each program the
resize runs; XLA's temporaries inside a program are not seen, which the programs'
`memory_analysis` bounds: the staged ones alias the pages and allocate no temporary
of pool size, see tests/core/test_resize.py), the bytes staged through the host and
the wall time.

A failure while the old pages are already freed (the upload of the new ones) puts
the old-size pages back from the host copy (the tail a shrink cuts is free: zeros)
before the error propagates, so a refused resize changes nothing.
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

__all__ = ["ResizeReport", "STAGINGS", "live_device_bytes", "resize_pool_state",
           "resize_state_staged", "stages_through_host"]

STAGINGS = ("auto", "device", "host")


@dataclasses.dataclass(frozen=True)
class ResizeReport:
  """What one resize of a pool's pages cost.

  Attributes:
    old_blocks: pool size before, in blocks.
    new_blocks: pool size after.
    staged: whether the kept pages went through host memory (`False`: one device copy).
    bytes_before: live device bytes (every `jax.Array`) just before the resize.
    peak_bytes: the most live device bytes seen between its programs.
    pages_before: bytes of the old K and V pages.
    pages_after: bytes of the new K and V pages.
    chunk_bytes: bytes of one staged chunk (one layer of K or V, kept part); 0
      when not staged.
    host_bytes: bytes copied to the host and back (0 when not staged).
    seconds: wall time of the resize, every program waited for.
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

  @property
  def peak_extra_bytes(self) -> int:
    """Peak bytes above the old pool's state: what the resize needed beside it."""
    return self.peak_bytes - self.bytes_before


def live_device_bytes() -> int:
  """Bytes of every live (not deleted) `jax.Array` in the process, all devices."""
  return sum(x.nbytes for x in jax.live_arrays() if not x.is_deleted())


def _pages_bytes(config: PoolConfig) -> int:
  return config.num_blocks * config.block_bytes  # K and V, every layer


def stages_through_host(config: PoolConfig, new_config: PoolConfig, staging: str = "auto", *,
                        device: jax.Device | None = None) -> bool:
  """Whether `resize_pool_state(..., staging=staging)` goes through host memory.

  `"auto"` stages when the device's free memory (`device_memory.free_bytes`) is
  short of the new pages plus an eighth of them as headroom; where the free
  memory is unknown it does not.

  Raises:
    InvalidArgument: `staging` not one of `STAGINGS`.
  """
  if staging not in STAGINGS:
    raise InvalidArgument(f"staging must be one of {STAGINGS}, got {staging!r}")
  if staging != "auto":
    return staging == "host"
  free = device_memory.free_bytes(device)
  need = _pages_bytes(new_config)
  return free is not None and free < need + need // 8


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


def _upload(host_layers: list[np.ndarray], shape: tuple[int, ...], dtype, sharding,
            peak: _Peak, fault: Callable[[int], None] | None) -> jax.Array:
  """New pages of `shape`: zeros, then each host layer written at its layer's start."""
  pages = _zeros_program(shape, jnp.dtype(dtype), sharding)()
  peak.see()
  for layer, chunk in enumerate(host_layers):
    if fault is not None:
      fault(layer)
    piece = jax.device_put(chunk, sharding)
    peak.see()
    pages = _put_layer(pages, piece, jnp.int32(layer))
    del piece
  pages.block_until_ready()
  return pages


def resize_state_staged(state: PoolState, *, config: PoolConfig, new_config: PoolConfig,
                        _fault: Callable[[int], None] | None = None
                        ) -> tuple[PoolState, ResizeReport]:
  """`regions.resize_state`'s result with at most one pool and one layer on the device.

  Consumes `state`: its pages are deleted once their kept part is on the host
  (like a donated argument). Nothing is checked: a cut tail must be free, which
  the caller verified (`regions.resize_pool`, `BlockPool.resize`). `_fault`, for
  tests, is called before each layer's upload.

  Returns:
    The new state and its `ResizeReport`.
  """
  t0 = time.perf_counter()
  peak = _Peak()
  old_n, new_n = config.num_blocks, new_config.num_blocks
  keep = min(old_n, new_n)
  meta = resize_meta(state.meta, config=config, new_config=new_config)
  peak.see()
  staged: dict[str, list[np.ndarray]] = {}
  for name in ("k", "v"):
    old = getattr(state.pages, name)
    layers = []
    for layer in range(old.shape[0]):
      chunk = _take_layer(old, jnp.int32(layer), keep=keep)
      peak.see()
      layers.append(np.array(chunk, copy=True))  # a host copy, not a view of the buffer
      chunk.delete()
    staged[name] = layers
  old_k, old_v = state.pages.k, state.pages.v
  shape, dtype, sharding = old_k.shape, old_k.dtype, old_k.sharding
  new_shape = shape[:2] + (new_n,) + shape[3:]
  old_k.delete()
  old_v.delete()
  try:
    pages = KVPages(k=_upload(staged["k"], new_shape, dtype, sharding, peak, _fault),
                    v=_upload(staged["v"], new_shape, dtype, sharding, peak, _fault))
  except BaseException:
    # The old pages are gone: rebuild them from the host copy (a cut tail was
    # free, so zeros), leaving the caller's pool as it was, then re-raise.
    restored = KVPages(k=_upload(staged["k"], shape, dtype, sharding, peak, None),
                       v=_upload(staged["v"], shape, dtype, sharding, peak, None))
    object.__setattr__(state, "pages", restored)
    raise
  chunk_bytes = staged["k"][0].nbytes if staged["k"] else 0
  host_bytes = 2 * sum(x.nbytes for layers in staged.values() for x in layers)
  report = ResizeReport(old_blocks=old_n, new_blocks=new_n, staged=True,
                        bytes_before=peak.before, peak_bytes=peak.peak,
                        pages_before=_pages_bytes(config), pages_after=_pages_bytes(new_config),
                        chunk_bytes=chunk_bytes, host_bytes=host_bytes,
                        seconds=time.perf_counter() - t0)
  return dataclasses.replace(state, pages=pages, meta=meta), report


def resize_pool_state(state: PoolState, *, config: PoolConfig, new_config: PoolConfig,
                      staging: str = "auto") -> tuple[PoolState, ResizeReport]:
  """The pool's arrays at `new_config`'s size, by the path `staging` picks.

  Consumes `state` (its pages are deleted, as a donated argument would be). A cut
  tail must be free: the caller checked (`BlockPool.resize`).

  Args:
    state: the pool's state at `config`.
    config: its config.
    new_config: `regions.resized_config(config, n)`.
    staging: `"device"` (one program; old and new pages live together), `"host"`
      (`resize_state_staged`: at most one pool plus one layer), or `"auto"`
      (`stages_through_host`).

  Returns:
    The new state and its `ResizeReport`.

  Raises:
    InvalidArgument: a bad `staging`.
  """
  if stages_through_host(config, new_config, staging):
    return resize_state_staged(state, config=config, new_config=new_config)
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
