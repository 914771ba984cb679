"""Static configuration of a block pool.

`PoolConfig` is frozen and hashable so it can be passed as a static argument to
jitted transitions; every array shape of the pool state is derived from it.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax.numpy as jnp
import numpy as np

from paged_kv.core import block_size as block_size_rule
from paged_kv.core.errors import InvalidArgument

_ALLOWED_DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")
_I32_MAX = int(np.iinfo(np.int32).max)

MAX_POOL_BYTES = 2**42
"""Upper bound on the K+V page bytes of one `PoolConfig` (4 TiB, above any single node).

A config beyond it is refused when built, with its size in the message, rather
than failing later with `RESOURCE_EXHAUSTED`; device memory is never probed.
"""


def _is_int(value) -> bool:
  """A Python or numpy integer, not a bool."""
  return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


@dataclasses.dataclass(frozen=True)
class PoolConfig:
  """Sizes and policies of one KV block pool.

  Attributes:
    num_blocks: physical blocks in the pool.
    block_size: tokens per block; a power of two from 1 to 128.
    num_layers, num_kv_heads, head_dim: the K/V shape per token.
    dtype: K/V element type as a string (`"bfloat16"`, ...).
    max_seqs, max_segments: segment-table rows and segments per row.
    base_pool_fraction: fraction of blocks, at the lowest addresses, reserved for
      pinned shared prefixes (region 1).
    scrub_freed_blocks: zero a block's K/V when it becomes free (no tenant's data
      left behind).

  Fields are type-checked and the sizes must fit (slot indices in int32, pages in
  `MAX_POOL_BYTES`), else `InvalidArgument` names the field and the limit.
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
      if not _is_int(value) or value <= 0:
        raise InvalidArgument(f"PoolConfig.{name} must be a positive int, got {value!r}")
      object.__setattr__(self, name, int(value))
    bs = self.block_size
    if not _is_int(bs) or bs < 1 or bs > 128 or bs & (bs - 1):
      raise InvalidArgument(
          f"PoolConfig.block_size must be a power of two in [1, 128], got {bs!r}")
    object.__setattr__(self, "block_size", int(bs))
    if self.dtype is None:  # numpy reads None as float64: name what was given
      raise InvalidArgument(f"PoolConfig.dtype must be one of {_ALLOWED_DTYPES}, got None")
    if isinstance(self.dtype, str):
      name = self.dtype
    else:
      try:
        name = jnp.dtype(self.dtype).name
      except TypeError as e:
        raise InvalidArgument(f"PoolConfig.dtype must be one of {_ALLOWED_DTYPES}, got "
                              f"{self.dtype!r}") from e
      object.__setattr__(self, "dtype", name)
    if name not in _ALLOWED_DTYPES:
      raise InvalidArgument(f"PoolConfig.dtype must be one of {_ALLOWED_DTYPES}, got {name!r}")
    frac = self.base_pool_fraction
    if (isinstance(frac, (bool, np.bool_)) or not isinstance(frac, numbers.Real)
        or not 0.0 <= float(frac) < 1.0):
      raise InvalidArgument(
          f"PoolConfig.base_pool_fraction must be a number in [0, 1), got {frac!r}")
    object.__setattr__(self, "base_pool_fraction", float(frac))
    scrub = self.scrub_freed_blocks
    if not isinstance(scrub, (bool, np.bool_)):
      raise InvalidArgument(
          f"PoolConfig.scrub_freed_blocks must be a bool, got {scrub!r}")
    object.__setattr__(self, "scrub_freed_blocks", bool(scrub))
    if self.num_blocks * self.block_size > _I32_MAX:
      raise InvalidArgument(
          f"PoolConfig: num_blocks * block_size = {self.num_blocks * self.block_size} slots "
          f"must fit in int32 (<= {_I32_MAX}): slot indices are int32")
    if self.max_seqs * self.max_segments > _I32_MAX:
      raise InvalidArgument(
          f"PoolConfig: max_seqs * max_segments = {self.max_seqs * self.max_segments} must "
          f"fit in int32 (<= {_I32_MAX})")
    total = self.num_blocks * self.block_bytes
    if total > MAX_POOL_BYTES:
      raise InvalidArgument(
          f"PoolConfig: the pages would take {total} bytes ({total / 2**40:.1f} TiB), above "
          f"the {MAX_POOL_BYTES} bytes ({MAX_POOL_BYTES / 2**40:.0f} TiB) such pages can "
          "take (paged_kv.core.config.MAX_POOL_BYTES); lower num_blocks, num_layers, "
          "num_kv_heads, head_dim or block_size")

  @classmethod
  def for_workload(cls, lengths=None, *, pool_tokens: int, histogram=None, bandwidth=None,
                   candidates=None, slotted_share: float = 0.0, slot_recovery: float = 1.0,
                   **fields) -> "PoolConfig":
    """A config with the block size `choose_block_size` picks, holding `pool_tokens` tokens.

    Takes `choose_block_size`'s arguments; `num_blocks = pool_tokens // block_size`;
    `**fields` are the other fields. Raises `InvalidArgument` for what either
    refuses, or a bad `pool_tokens`.
    """
    for name in ("block_size", "num_blocks"):
      if name in fields:
        raise InvalidArgument(f"PoolConfig.for_workload derives {name}; do not pass it")
    if not _is_int(pool_tokens) or pool_tokens <= 0:
      raise InvalidArgument(f"pool_tokens must be a positive int, got {pool_tokens!r}")
    choice = block_size_rule.choose_block_size(
        lengths, histogram=histogram, bandwidth=bandwidth,
        candidates=block_size_rule.DEFAULT_CANDIDATES if candidates is None else candidates,
        slotted_share=slotted_share, slot_recovery=slot_recovery)
    if pool_tokens < max(choice.candidates):
      raise InvalidArgument(f"pool_tokens={pool_tokens} is below one block of the largest "
                            f"candidate ({max(choice.candidates)} tokens)")
    return cls(num_blocks=int(pool_tokens) // choice.block_size, block_size=choice.block_size,
               **fields)

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
