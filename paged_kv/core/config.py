"""Static configuration of a block pool.

`PoolConfig` is frozen and hashable so it can be passed as a static argument to
jitted transitions; every array shape of the pool state is derived from it.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

_ALLOWED_DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")


@dataclasses.dataclass(frozen=True)
class PoolConfig:
  """Sizes and policies of one KV block pool.

  Attributes:
    num_blocks: physical blocks in the pool.
    block_size: tokens per block (slots); a power of two from 1 to 128.
    num_layers: transformer layers whose K/V the pool holds.
    num_kv_heads: KV heads per layer.
    head_dim: size of one head.
    dtype: K/V element type, as a string (`"bfloat16"`, `"float32"`, ...).
    max_seqs: rows of the segment table (concurrent sequences).
    max_segments: segments per sequence row.
    base_pool_fraction: fraction of blocks, at the lowest addresses, reserved for
      pinned shared prefixes (region 1). Ordinary allocation never takes them.
      The library default is 0 (a plain pool); `examples/serve.py` uses 0.15 with
      `SchedulerConfig.promote_readers` moving widely shared blocks there.
    scrub_freed_blocks: zero the K/V of a block when it becomes free (for
      deployments that must not leave one tenant's data in memory). Off by default.
  """

  num_blocks: int
  block_size: int = 16
  num_layers: int = 1
  num_kv_heads: int = 1
  head_dim: int = 64
  dtype: str = "float32"
  max_seqs: int = 64
  max_segments: int = 64
  base_pool_fraction: float = 0.0
  scrub_freed_blocks: bool = False

  def __post_init__(self):
    for name in ("num_blocks", "num_layers", "num_kv_heads", "head_dim",
                 "max_seqs", "max_segments"):
      value = getattr(self, name)
      if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"PoolConfig.{name} must be a positive int, got {value!r}")
    bs = self.block_size
    if (not isinstance(bs, (int, np.integer)) or isinstance(bs, bool)
        or bs < 1 or bs > 128 or bs & (bs - 1)):
      raise ValueError(
          f"PoolConfig.block_size must be a power of two in [1, 128], got {bs!r}")
    if isinstance(self.dtype, str):
      name = self.dtype
    else:
      name = jnp.dtype(self.dtype).name
      object.__setattr__(self, "dtype", name)
    if name not in _ALLOWED_DTYPES:
      raise ValueError(f"PoolConfig.dtype must be one of {_ALLOWED_DTYPES}, got {name!r}")
    if not 0.0 <= float(self.base_pool_fraction) < 1.0:
      raise ValueError(
          f"PoolConfig.base_pool_fraction must be in [0, 1), got {self.base_pool_fraction!r}")
    if self.num_blocks >= 2**31 // max(self.block_size, 1):
      raise ValueError("num_blocks * block_size must fit in int32")

  @property
  def jnp_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.dtype)

  @property
  def slot_words(self) -> int:
    """uint32 words per block in the slot bitmap."""
    return math.ceil(self.block_size / 32)

  @property
  def num_base_blocks(self) -> int:
    """Blocks of the base pool (region 1): block ids [0, num_base_blocks)."""
    return int(self.num_blocks * self.base_pool_fraction)

  @property
  def num_slots(self) -> int:
    return self.num_blocks * self.block_size

  @property
  def block_bytes(self) -> int:
    """Bytes of K and V of one block over all layers and heads."""
    return (2 * self.num_layers * self.num_kv_heads * self.block_size * self.head_dim
            * self.jnp_dtype.itemsize)
