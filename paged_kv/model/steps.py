"""Jitted model steps over a pool: reserve, write K/V, attend and sample in one jit.

Every step is `fn(params, state, ..., *, graphdef, config, impl, interpret) ->
(state, out)` with the pool state donated (XLA updates the pages in place; hand the
returned state back, the argument is deleted):

  * `forward`      — the serving step: one `StepPlan` of prefill chunks and decode
                     tokens together (ragged), ONE forward pass; greedy sample after
                     each row's last token. `forward_sampled`: the same with each
                     row's `plan.sampling` (temperature, top-k/p, min-p, seed) and
                     logprobs (`paged_kv.model.sampling`).
  * `prefill`      — the same for padded `[B, T]` prompt chunks (a convenience).
  * `decode_step`  — one token per row.
  * `decode_multi` — `lax.scan` over `num_steps` decode steps in one jit: reserve,
                     write, attend and sample on device, no host round trip; rows
                     stop when their budget is spent, on a stop token, or when a
                     reservation fails (the failure is in the returned status).

Inside each step `reserve_tokens` makes room, `StepMetadata.from_reservation` turns
its output into the step's metadata, and the model (`model(tokens, pages, meta,
impl=impl, interpret=interpret) -> (pages, logits)`: the contract of
`paged_kv.model.contract`, e.g. `paged_kv.model.llama.TinyLlama`) writes and attends
layer by layer. A model that takes `logits_indices=` (TinyLlama does) is handed each
row's last token index and computes its output head for those `B` rows only; any
other model returns logits for all `T` tokens and the step gathers the `B` it
samples from. Which of the two is decided while tracing, from the model's
signature (`contract.accepts_logits_indices`), so it is as static as the graph
definition.
`params` / `graphdef` are `nnx.split(model)`; the graph definition is static.
`impl=None` picks `paged_kv.model.attention.default_impl()` for the backend and
the shape (per shape on a GPU: the first impl that builds).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from paged_kv.model.nnx_import import nnx

from paged_kv.core.config import PoolConfig
from paged_kv.core.errors import Status
from paged_kv.core.segments import reserve_tokens
from paged_kv.core.state import PoolState
from paged_kv.model import contract, ragged, sampling
from paged_kv.model.metadata import StepMetadata
from paged_kv.model.plan import StepPlan

NO_STOP_TOKEN = -1
_STATICS = ("graphdef", "config", "impl", "interpret")


def _forward_body(params: nnx.State, state: PoolState, plan: StepPlan, *,
                  graphdef: nnx.GraphDef, config: PoolConfig, impl: str | None,
                  interpret) -> tuple[PoolState, tuple[jax.Array, ...]]:
  """Reserve, metadata, model, greedy sample (traced; shared by every step)."""
  model = nnx.merge(graphdef, params)
  state, (slot_idx, status) = reserve_tokens(state, plan.seq_ids, plan.num_new, config=config,
                                             max_new_tokens=plan.max_query_len)
  meta = StepMetadata.from_reservation(plan, state.table, slot_idx, status)
  tokens = jnp.asarray(plan.tokens, jnp.int32)
  last = ragged.last_token_index(meta.cu_q_lens, plan.num_tokens)  # i32[B]
  if contract.accepts_logits_indices(model):  # static: the graph definition's class
    # The model gathers the rows' last hidden states before its output head.
    pages, last_logits = model(tokens, state.pages, meta, impl=impl, interpret=interpret,
                               logits_indices=last)
    if last_logits.shape[:1] != last.shape:
      raise contract.ModelContractError(
          f"{type(model).__name__} takes logits_indices i32{list(last.shape)} but returned "
          f"logits {list(last_logits.shape)}; the contract asks for one row per index")
  else:
    pages, logits = model(tokens, state.pages, meta, impl=impl, interpret=interpret)
    last_logits = logits[last]  # [B, V]
  sampled = (status == Status.OK) & (meta.seq_ids >= 0) & (meta.q_lens > 0)
  next_tokens = jnp.where(sampled, jnp.argmax(last_logits, axis=-1), -1).astype(jnp.int32)
  return dataclasses.replace(state, pages=pages), (next_tokens, last_logits, status)


@functools.partial(jax.jit, static_argnames=_STATICS, donate_argnames=("state",))
def forward(params: nnx.State, state: PoolState, plan: StepPlan, *, graphdef: nnx.GraphDef,
            config: PoolConfig, impl: str | None = None,
            interpret=None) -> tuple[PoolState, tuple[jax.Array, ...]]:
  """One mixed step: prefill chunks and decode tokens of `plan` in one forward pass.

  Args:
    params: model parameters (`nnx.split(model)[1]`).
    state: the pool (donated).
    plan: rows, their new token counts and the ragged tokens (`StepPlan`); a
      decode row's token is its pending (sampled, not yet cached) token.
    graphdef: static model graph (`nnx.split(model)[0]`).
    config: static pool config (layers, heads, head_dim, dtype matching the model).
    impl: static attention path ("xla", "pallas", "mosaic"; None: per backend).
    interpret: static; Pallas interpret mode (None: on CPU only).

  Returns:
    `(state, (next_tokens i32[B], last_logits f32[B, vocab], status i32[B]))`:
    the greedy token after each row's last new token (`-1` for padding, empty and
    failed rows), the logits it came from, and `reserve_tokens`' status (a failed
    row is left as it was).
  """
  return _forward_body(params, state, plan, graphdef=graphdef, config=config, impl=impl,
                       interpret=interpret)


@functools.partial(jax.jit, static_argnames=_STATICS, donate_argnames=("state",))
def forward_sampled(params: nnx.State, state: PoolState, plan: StepPlan, *,
                    graphdef: nnx.GraphDef, config: PoolConfig, impl: str | None = None,
                    interpret=None) -> tuple[PoolState, tuple]:
  """`forward` with each row's token drawn by its `plan.sampling` parameters.

  Greedy rows (temperature 0) get the same token as `forward`'s. `plan.num_logprobs`
  (static) top logprobs come back per row.

  Returns:
    `(state, (next_tokens i32[B], status i32[B], sampling.SampleOutput))`, tokens
    `-1` for padding, empty and failed rows.
  """
  state, (greedy, last_logits, status) = _forward_body(
      params, state, plan, graphdef=graphdef, config=config, impl=impl, interpret=interpret)
  out = sampling.sample(last_logits, plan.sampling, num_logprobs=plan.num_logprobs)
  tokens = jnp.where(greedy >= 0, out.tokens, -1).astype(jnp.int32)
  return state, (tokens, status, out._replace(tokens=tokens))


@functools.partial(jax.jit, static_argnames=_STATICS, donate_argnames=("state",))
def prefill(params: nnx.State, state: PoolState, seq_ids: jax.Array, tokens: jax.Array,
            num_new: jax.Array, *, graphdef: nnx.GraphDef, config: PoolConfig,
            impl: str | None = None, interpret=None) -> tuple[PoolState, tuple[jax.Array, ...]]:
  """`forward` for padded prompt chunks: `tokens i32[B, T]`, `num_new[b]` of row b's.

  Args:
    params, state, graphdef, config, impl, interpret: as in `forward`.
    seq_ids: `i32[B]` rows (`-1` = padding).
    tokens: `i32[B, T]` the next `num_new[b]` prompt tokens of each row, padded.
    num_new: `i32[B]` tokens of the chunk per row (`0 <= . <= T`).

  Returns:
    As `forward`.
  """
  flat, _ = ragged.to_ragged(jnp.asarray(tokens, jnp.int32), jnp.asarray(num_new, jnp.int32))
  plan = StepPlan(seq_ids=seq_ids, num_new=num_new, tokens=flat, max_query_len=tokens.shape[1])
  return _forward_body(params, state, plan, graphdef=graphdef, config=config, impl=impl,
                       interpret=interpret)


def _decode_body(params, state, seq_ids, tokens, **kwargs):
  """One decode step (traced): row b's token is token b of the layout."""
  seq_ids = jnp.asarray(seq_ids, jnp.int32)
  plan = StepPlan(seq_ids=seq_ids, num_new=jnp.ones_like(seq_ids),
                  tokens=jnp.asarray(tokens, jnp.int32), max_query_len=1)
  return _forward_body(params, state, plan, **kwargs)


@functools.partial(jax.jit, static_argnames=_STATICS, donate_argnames=("state",))
def decode_step(params: nnx.State, state: PoolState, seq_ids: jax.Array, tokens: jax.Array, *,
                graphdef: nnx.GraphDef, config: PoolConfig, impl: str | None = None,
                interpret=None) -> tuple[PoolState, tuple[jax.Array, ...]]:
  """One greedy decode step for a batch: reserve, write K/V, attend, sample.

  Args:
    params, state, graphdef, config, impl, interpret: as in `forward`.
    seq_ids: `i32[B]` rows (`-1` = padding).
    tokens: `i32[B]` each row's last sampled token (not yet in the cache).

  Returns:
    `(state, (next_tokens i32[B], logits f32[B, vocab], status i32[B]))`;
    `next_tokens` is `-1` for padding and for rows whose reservation failed.
  """
  return _decode_body(params, state, seq_ids, tokens, graphdef=graphdef, config=config,
                      impl=impl, interpret=interpret)


@functools.partial(jax.jit, donate_argnames=("state",),
                   static_argnames=_STATICS + ("num_steps", "stop_token"))
def decode_multi(params: nnx.State, state: PoolState, seq_ids: jax.Array, tokens: jax.Array,
                 remaining: jax.Array, *, graphdef: nnx.GraphDef, config: PoolConfig,
                 num_steps: int, stop_token: int = NO_STOP_TOKEN, impl: str | None = None,
                 interpret=None) -> tuple[PoolState, tuple[jax.Array, ...]]:
  """`num_steps` greedy decode steps in one jit (`lax.scan`), no host round trip.

  A row takes part in a step while it has budget left (`remaining > 0`); it stops
  after sampling `stop_token` (if not `-1`) or when its reservation fails, whose
  status is reported at that step.

  Args:
    params, state, graphdef, config, impl, interpret: as in `forward`.
    seq_ids: `i32[B]` rows (`-1` = padding).
    tokens: `i32[B]` each row's last sampled token (not yet in the cache).
    remaining: `i32[B]` tokens each row may still generate.
    num_steps: static number of steps k.
    stop_token: static end-of-sequence token, `-1` for none.

  Returns:
    `(state, (new_tokens i32[k, B], status i32[k, B], last_tokens i32[B],
    remaining i32[B]))`: the token sampled by each row at each step (`-1` where
    the row did not run or failed), the reservation status of each step, each
    row's last sampled token and its remaining budget (0 after a stop or failure).
  """
  seq_ids = jnp.asarray(seq_ids, jnp.int32)
  kwargs = dict(graphdef=graphdef, config=config, impl=impl, interpret=interpret)

  def body(carry, _):
    state, tokens, remaining = carry
    live = (seq_ids >= 0) & (remaining > 0)
    state, (sampled, _, status) = _decode_body(params, state, jnp.where(live, seq_ids, -1),
                                               tokens, **kwargs)
    ok = live & (status == Status.OK)
    stopped = sampled == stop_token if stop_token != NO_STOP_TOKEN else jnp.zeros_like(ok)
    remaining = jnp.where(ok & ~stopped, remaining - 1, jnp.where(live, 0, remaining))
    tokens = jnp.where(ok, sampled, tokens)
    return (state, tokens, remaining), (jnp.where(ok, sampled, -1), status)

  (state, tokens, remaining), (new_tokens, status) = jax.lax.scan(
      body, (state, jnp.asarray(tokens, jnp.int32), jnp.asarray(remaining, jnp.int32)), None,
      length=num_steps)
  return state, (new_tokens, status, tokens, remaining)
