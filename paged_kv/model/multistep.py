"""Several decode steps in one jitted program: which rows run each step.

Row b runs step j iff `seq_ids[b] >= 0`, `j < remaining[b]` and none of its
earlier reservations failed; a stop token does not stop it (the host drops the
extra tokens), so the host can predict every reservation. Needs only JAX.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from paged_kv.core.config import PoolConfig
from paged_kv.core.errors import InvalidArgument, Status
from paged_kv.core.sequences import reserve_tokens
from paged_kv.core.state import PoolState

# step(state, seq_ids i32[B], tokens i32[B], j) -> (state, (sampled i32[B], status i32[B], extra))
DecodeFn = Callable[[PoolState, jax.Array, jax.Array, jax.Array],
                    tuple[PoolState, tuple[jax.Array, jax.Array, Any]]]


def check_decode_steps(plan, remaining, num_steps) -> None:
  """Host check of a `decode_steps(state, plan, remaining, *, num_steps)` call.

  Raises `InvalidArgument` unless `num_steps` is an int >= 1, the plan is a
  decode plan (`max_query_len == 1`) and `remaining` is `[B]`.
  """
  if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
    raise InvalidArgument(f"num_steps must be an int >= 1, got {num_steps!r}")
  if plan.max_query_len != 1:
    raise InvalidArgument(f"decode_steps takes a decode plan (max_query_len 1), got "
                          f"max_query_len={plan.max_query_len}")
  if getattr(plan, "reserved", None) is not None:
    raise InvalidArgument("decode_steps reserves each of its steps itself: its plan takes "
                          "no host reservation (plan.reserved must be None)")
  shape = tuple(getattr(remaining, "shape", ()))
  if shape != (plan.num_rows,):
    raise InvalidArgument(f"remaining must be i32[{plan.num_rows}] (one per row), got shape "
                          f"{shape}")


def scan_decode(step: DecodeFn, state: PoolState, seq_ids: jax.Array, tokens: jax.Array,
                remaining: jax.Array, *, num_steps: int
                ) -> tuple[PoolState, tuple[jax.Array, jax.Array, Any]]:
  """`num_steps` decode steps of a batch in one `lax.scan` (module docstring).

  `step(state, seq_ids, tokens, j)` sees non-running rows as `-1` and returns the
  state, tokens, statuses and any `extra`. Returns `(state, (tokens i32[k, B],
  status i32[k, B], extra))`, tokens `-1` where a row did not run or failed.
  """
  seq_ids = jnp.asarray(seq_ids, jnp.int32)
  remaining = jnp.asarray(remaining, jnp.int32)

  def body(carry, j):
    state, tokens, failed = carry
    live = (seq_ids >= 0) & (j < remaining) & ~failed
    state, (sampled, status, extra) = step(state, jnp.where(live, seq_ids, -1), tokens, j)
    ok = live & (status == Status.OK)
    failed = failed | (live & (status != Status.OK))
    tokens = jnp.where(ok, sampled, tokens)
    return (state, tokens, failed), (jnp.where(ok, sampled, -1).astype(jnp.int32),
                                     jnp.asarray(status, jnp.int32), extra)

  init = (state, jnp.asarray(tokens, jnp.int32), jnp.zeros(seq_ids.shape, bool))
  (state, _, _), out = jax.lax.scan(body, init, jnp.arange(num_steps, dtype=jnp.int32))
  return state, out


def reserve_decode_steps(state: PoolState, seq_ids: jax.Array, remaining: jax.Array, *,
                         config: PoolConfig,
                         num_steps: int) -> tuple[PoolState, jax.Array]:
  """The reservations of `scan_decode`'s rows, no model: `(state, status i32[k, B])`."""
  ones = jnp.ones(jnp.shape(seq_ids), jnp.int32)

  def step(state, ids, tokens, j):
    del j
    state, (_, status) = reserve_tokens(state, ids, ones, config=config, max_new_tokens=1)
    return state, (tokens, status, None)

  state, (_, status, _) = scan_decode(step, state, seq_ids, jnp.zeros_like(ones), remaining,
                                      num_steps=num_steps)
  return state, status
