"""Free memory of a device, and the check a pool makes before it allocates its pages.

`check_fits` refuses a pool too big for its device with `PoolTooLarge` before
XLA fails with an untyped out-of-memory error. Free memory comes from
`Device.memory_stats()`, or `/proc/meminfo` on the host; when unknown the check passes.
"""

from __future__ import annotations

import contextlib

import jax

from paged_kv.core.config import PoolConfig
from paged_kv.core.errors import PoolTooLarge

__all__ = ["allocating", "check_fits", "free_bytes", "pool_bytes"]


def free_bytes(device: jax.Device | None = None) -> int | None:
  """Bytes free on `device` (default: JAX's default device), or None when unknown."""
  device = jax.devices()[0] if device is None else device
  try:
    stats = device.memory_stats()
  except Exception:  # pylint: disable=broad-except  (backends without the query)
    stats = None
  if stats and "bytes_limit" in stats:
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
  if device.platform == "cpu":
    try:
      with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
          if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
      return None
  return None


def pool_bytes(config: PoolConfig) -> int:
  """Bytes `init_pool(config)` allocates: the K/V pages (the bookkeeping is ~0.1%)."""
  meta = config.num_blocks * (4 * 4 + 4 * config.slot_words) + config.max_seqs * (
      3 * 4 * config.max_segments + 12)
  return config.num_blocks * config.block_bytes + meta


def check_fits(config: PoolConfig, device: jax.Device | None = None, *,
               reusable: int = 0) -> None:
  """Raises `PoolTooLarge` (bytes needed and free) when `config`'s pool does not fit `device`.

  `reusable`: bytes in use now that are freed before the pool is allocated (a
  staged resize frees the old pages first), counted as free.
  """
  free = free_bytes(device)
  need = pool_bytes(config)
  if free is not None and need > free + reusable:
    free += reusable
    also = f", counting {reusable} bytes it replaces," if reusable else ""
    raise PoolTooLarge(
        f"the pool needs {need} bytes ({need / 2**30:.2f} GiB: {config.num_blocks} blocks of "
        f"{config.block_bytes} bytes) but the device has {free} bytes "
        f"({free / 2**30:.2f} GiB){also} free; lower num_blocks (or the model's layers, kv heads, "
        "head_dim, dtype)")


@contextlib.contextmanager
def allocating(config: PoolConfig):
  """Turns an out-of-memory error inside the block into `PoolTooLarge` (chained).

  The allocation can fail even after `check_fits` (memory taken meanwhile,
  fragmentation, a device without the query).
  """
  try:
    yield
  except jax.errors.JaxRuntimeError as err:
    if "RESOURCE_EXHAUSTED" not in str(err):
      raise
    need = pool_bytes(config)
    raise PoolTooLarge(
        f"the device ran out of memory allocating the pool ({need} bytes, "
        f"{need / 2**30:.2f} GiB: {config.num_blocks} blocks of {config.block_bytes} bytes); "
        f"lower num_blocks (or the model's layers, kv heads, head_dim, dtype)") from err
