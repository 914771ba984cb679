"""The ragged token layout: row b owns tokens `cu_q_lens[b] : cu_q_lens[b+1]` of `[T, ...]`.

Helpers convert to and from padded `[B, max_q, ...]` rows, numpy or jnp (`xp`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def cu_lens(q_lens, *, xp=jnp):
  """`i32[B+1]` cumulative sum of `q_lens i32[B]`, starting at 0."""
  q_lens = xp.asarray(q_lens)
  return xp.concatenate([xp.zeros((1,), xp.int32), xp.cumsum(q_lens).astype(xp.int32)])


def token_rows(cu_q_lens, num_tokens: int, *, xp=jnp):
  """Row `i32[T]` of every token of the ragged layout (`B` for padding tokens)."""
  b = cu_q_lens.shape[0] - 1
  t = xp.arange(num_tokens, dtype=xp.int32)
  row = xp.clip(xp.searchsorted(cu_q_lens, t, side="right") - 1, 0, b - 1).astype(xp.int32)
  return xp.where(t < cu_q_lens[b], row, b).astype(xp.int32)


def last_token_index(cu_q_lens, num_tokens: int, *, xp=jnp):
  """Index `i32[B]` of each row's last token (clipped into `[0, T)` for empty rows)."""
  return xp.clip(cu_q_lens[1:] - 1, 0, num_tokens - 1).astype(xp.int32)


def to_ragged(x: jax.Array, num_new: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Padded `[B, T, ...]` rows to `(flat [B*T, ...], cu_q_lens i32[B+1])`, zeros after."""
  b, t = x.shape[:2]
  cu = cu_lens(num_new)
  r = jnp.arange(b * t, dtype=jnp.int32)
  row = jnp.clip(jnp.searchsorted(cu, r, side="right") - 1, 0, b - 1)
  src = row * t + (r - cu[row])
  flat = x.reshape((b * t,) + x.shape[2:])[jnp.clip(src, 0, b * t - 1)]
  inside = (r < cu[b]).reshape((-1,) + (1,) * (x.ndim - 2))
  return jnp.where(inside, flat, jnp.zeros((), x.dtype)), cu


def from_ragged(flat: jax.Array, cu_q_lens: jax.Array, t: int) -> jax.Array:
  """Inverse of `to_ragged`: `[N, ...]` ragged to `[B, t, ...]` (padding = 0)."""
  i = jnp.arange(t, dtype=jnp.int32)[None, :]
  src = cu_q_lens[:-1, None] + i
  inside = src < cu_q_lens[1:, None]
  out = flat[jnp.clip(src, 0, flat.shape[0] - 1)]
  return jnp.where(inside.reshape(inside.shape + (1,) * (flat.ndim - 1)), out,
                   jnp.zeros((), flat.dtype))


def bucket(x: int) -> int:
  """Smallest power of two >= max(x, 1) (bounds the number of compilations)."""
  return 1 << max(int(x) - 1, 0).bit_length()


def pack_rows(token_lists, *, num_tokens: int | None = None) -> tuple[np.ndarray, np.ndarray]:
  """Host: token lists to `(tokens i32[T], num_new)`; `T` defaults to a power of two."""
  num_new = np.array([len(t) for t in token_lists], np.int32)
  total = int(num_new.sum())
  width = bucket(total) if num_tokens is None else int(num_tokens)
  if total > width:
    raise ValueError(f"{total} tokens do not fit num_tokens={width}")
  tokens = np.zeros((width,), np.int32)
  if total:
    tokens[:total] = np.concatenate([np.asarray(t, np.int32).reshape(-1) for t in token_lists])
  return tokens, num_new
