"""Jitted model steps over a pool: reserve, write K/V, attend and sample in one jit.

Each step is `fn(state, ...) -> (state, out)` with the pool donated: `forward`
(a ragged `StepPlan`; `forward_sampled`), `prefill`, `decode_step`,
`decode_multi` and `decode_steps` (k decode steps in one scan). `bind(model,
config)` builds them once as `ModelSteps`, so a call hashes nothing; the
module-level functions hash the graph every call. A plan with host-`reserved`
slots runs no allocator in its program.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import weakref
from typing import Any

import jax
import jax.numpy as jnp
from paged_kv.model.nnx_import import nnx

from paged_kv.core import growth
from paged_kv.core.config import PoolConfig
from paged_kv.core.errors import InvalidArgument, Status
from paged_kv.core.sequences import reserve_tokens
from paged_kv.core.state import PoolState
from paged_kv.model import contract, multistep, penalties, prompt_logprobs, ragged, sampling
from paged_kv.model.metadata import StepMetadata
from paged_kv.model.plan import StepPlan

NO_STOP_TOKEN = -1
_STATICS = ("graphdef", "config", "impl", "interpret")


# Traced bodies, shared by the bound and the module-level steps ---------------------------


def _forward_body(model, state: PoolState, plan: StepPlan, **kwargs
                  ) -> tuple[PoolState, tuple[jax.Array, ...]]:
  """Reserve (unless `plan.reserved`), metadata, model, greedy sample (traced; every step's)."""
  state, out, _ = _forward_core(model, state, plan, **kwargs)
  return state, out


def _forward_core(model, state: PoolState, plan: StepPlan, *, config: PoolConfig,
                  impl: str | None, interpret):
  """`_forward_body` plus the metadata, resolved tokens and logits at `plan.prompt` (or None)."""
  if plan.reserved is not None:  # static: the plan's tree structure
    # The host reserved the slots and its commit already put them in the table,
    # but for the in-place growth the step applies itself (`grow`).
    if plan.reserved.grow is not None:
      grow = plan.reserved.grow
      state = growth.grow_tails(state, plan.seq_ids, grow.tokens, grow.clock, config=config)
    meta = StepMetadata.from_reserved(plan, state.table)
    status = jnp.asarray(plan.reserved.status, jnp.int32)
  else:
    state, (slot_idx, status) = reserve_tokens(state, plan.seq_ids, plan.num_new,
                                               config=config, max_new_tokens=plan.max_query_len)
    meta = StepMetadata.from_reservation(plan, state.table, slot_idx, status)
  tokens = jnp.asarray(plan.tokens, jnp.int32)
  if plan.carried is not None:
    tokens = plan.carried.resolve(tokens)
  last = ragged.last_token_index(meta.cu_q_lens, plan.num_tokens)  # i32[B]
  want = last
  if plan.prompt is not None:  # static: the plan's tree structure
    index = jnp.clip(jnp.asarray(plan.prompt.index, jnp.int32), 0, plan.num_tokens - 1)
    want = jnp.concatenate([last, index])
  if contract.accepts_logits_indices(model):  # static: the graph definition's class
    # The model gathers the rows' last hidden states before its output head.
    pages, logits = model(tokens, state.pages, meta, impl=impl, interpret=interpret,
                          logits_indices=want)
    if logits.shape[:1] != want.shape:
      raise contract.ModelContractError(
          f"{type(model).__name__} takes logits_indices i32{list(want.shape)} but returned "
          f"logits {list(logits.shape)}; the contract asks for one row per index")
  else:
    pages, logits = model(tokens, state.pages, meta, impl=impl, interpret=interpret)
    logits = logits[want]  # [B (+ W), V]
  b = last.shape[0]
  last_logits, prompt_logits = logits[:b], (None if plan.prompt is None else logits[b:])
  sampled = (status == Status.OK) & (meta.seq_ids >= 0) & (meta.q_lens > 0)
  next_tokens = jnp.where(sampled, jnp.argmax(last_logits, axis=-1), -1).astype(jnp.int32)
  return (dataclasses.replace(state, pages=pages), (next_tokens, last_logits, status),
          (meta, tokens, prompt_logits))


def _sampled_body(model, state: PoolState, plan: StepPlan, history=None,
                  **kwargs) -> tuple[PoolState, tuple]:
  """`_forward_body` sampling by `plan.sampling`, then prompt logprobs, then `history`."""
  state, (greedy, last_logits, status), (meta, tokens, prompt_logits) = _forward_core(
      model, state, plan, **kwargs)
  penalize = None
  if history is not None:
    history = penalties.record(history, meta, tokens)
    penalize = penalties.penalizer(history, meta.seq_ids, meta.seq_lens, plan.sampling)
  out = sampling.sample(last_logits, plan.sampling, num_logprobs=plan.num_logprobs,
                        penalize=penalize)
  tokens = jnp.where(greedy >= 0, out.tokens, -1).astype(jnp.int32)
  result = (tokens, status, out._replace(tokens=tokens))
  if prompt_logits is not None:
    result += (prompt_logprobs.prompt_logprobs(prompt_logits, plan.prompt,
                                               num_top=plan.num_logprobs),)
  return state, result if history is None else (*result, history)


def _prefill_plan(seq_ids, tokens, num_new) -> StepPlan:
  flat, _ = ragged.to_ragged(jnp.asarray(tokens, jnp.int32), jnp.asarray(num_new, jnp.int32))
  return StepPlan(seq_ids=seq_ids, num_new=num_new, tokens=flat, max_query_len=tokens.shape[1])


def _decode_plan(seq_ids, tokens) -> StepPlan:
  """One decode step's plan: row b's token is token b of the layout."""
  seq_ids = jnp.asarray(seq_ids, jnp.int32)
  return StepPlan(seq_ids=seq_ids, num_new=jnp.ones_like(seq_ids),
                  tokens=jnp.asarray(tokens, jnp.int32), max_query_len=1)


def _decode_multi_body(model, state, seq_ids, tokens, remaining, *, num_steps: int,
                       stop_token: int, **kwargs):
  seq_ids = jnp.asarray(seq_ids, jnp.int32)

  def body(carry, _):
    state, tokens, remaining = carry
    live = (seq_ids >= 0) & (remaining > 0)
    state, (sampled, _, status) = _forward_body(
        model, state, _decode_plan(jnp.where(live, seq_ids, -1), tokens), **kwargs)
    ok = live & (status == Status.OK)
    stopped = sampled == stop_token if stop_token != NO_STOP_TOKEN else jnp.zeros_like(ok)
    remaining = jnp.where(ok & ~stopped, remaining - 1, jnp.where(live, 0, remaining))
    tokens = jnp.where(ok, sampled, tokens)
    return (state, tokens, remaining), (jnp.where(ok, sampled, -1), status)

  (state, tokens, remaining), (new_tokens, status) = jax.lax.scan(
      body, (state, jnp.asarray(tokens, jnp.int32), jnp.asarray(remaining, jnp.int32)), None,
      length=num_steps)
  return state, (new_tokens, status, tokens, remaining)


def run_decode_steps(model, state: PoolState, plan: StepPlan, remaining: jax.Array, *,
                     config: PoolConfig, num_steps: int, impl: str | None = None,
                     interpret=None, history=None) -> tuple[PoolState, tuple]:
  """`num_steps` decode steps of a decode plan in one `lax.scan` (pure; jit it).

  Rows run as in `multistep.scan_decode`; each step reserves one slot per running
  row and runs `forward` (or `forward_sampled` at output index `index + j`).
  Returns `(state, (tokens i32[k, B], status i32[k, B]))`, plus a k-stacked
  `SampleOutput` with `plan.sampling` and the `history` when given.
  """
  if plan.reserved is not None:
    raise InvalidArgument("run_decode_steps reserves its k steps itself: its plan takes no "
                          "host reservation (plan.reserved must be None)")
  kwargs = dict(config=config, impl=impl, interpret=interpret)
  b, t = plan.num_rows, plan.num_tokens
  tokens = jnp.asarray(plan.tokens, jnp.int32)
  if plan.carried is not None:
    tokens = plan.carried.resolve(tokens)
  tokens = tokens[:b] if t >= b else jnp.pad(tokens, (0, b - t))
  sampled = plan.sampling is not None
  with_history = sampled and history is not None

  def step(carry, ids, tokens, j):
    one = dataclasses.replace(_decode_plan(ids, tokens), num_logprobs=plan.num_logprobs)
    if not sampled:
      carry, (nxt, _, status) = _forward_body(model, carry, one, **kwargs)
      return carry, (nxt, status, None)
    one = dataclasses.replace(one, sampling=dataclasses.replace(
        plan.sampling, index=jnp.asarray(plan.sampling.index, jnp.int32) + j))
    if not with_history:
      carry, (nxt, status, out) = _sampled_body(model, carry, one, **kwargs)
      return carry, (nxt, status, out)
    state, hist = carry
    state, (nxt, status, out, hist) = _sampled_body(model, state, one, hist, **kwargs)
    return (state, hist), (nxt, status, out)

  carry = (state, history) if with_history else state
  carry, (toks, status, out) = multistep.scan_decode(step, carry, plan.seq_ids, tokens,
                                                     remaining, num_steps=num_steps)
  if not sampled:
    return carry, (toks, status)
  if not with_history:
    return carry, (toks, status, out._replace(tokens=toks))
  state, history = carry
  return state, (toks, status, out._replace(tokens=toks), history)


# Module-level steps (slow: the graph definition is hashed on every call) -----------------


@functools.partial(jax.jit, static_argnames=_STATICS, donate_argnames=("state",))
def forward(params: nnx.State, state: PoolState, plan: StepPlan, *, graphdef: nnx.GraphDef,
            config: PoolConfig, impl: str | None = None,
            interpret=None) -> tuple[PoolState, tuple[jax.Array, ...]]:
  """One mixed step: prefill chunks and decode tokens of `plan` in one pass (slow path: use `bind`).

  Returns `(state, (next_tokens i32[B], last_logits f32[B, vocab], status i32[B]))`,
  tokens `-1` for padding, empty and failed rows (a failed row is left as it was).
  """
  return _forward_body(nnx.merge(graphdef, params), state, plan, config=config, impl=impl,
                       interpret=interpret)


@functools.partial(jax.jit, static_argnames=_STATICS, donate_argnames=("state",))
def forward_sampled(params: nnx.State, state: PoolState, plan: StepPlan, *,
                    graphdef: nnx.GraphDef, config: PoolConfig, impl: str | None = None,
                    interpret=None) -> tuple[PoolState, tuple]:
  """`forward` with each row's token drawn by `plan.sampling` (greedy rows as `forward`'s).

  Slow path. Returns `(state, (next_tokens i32[B], status i32[B],
  SampleOutput))` with `plan.num_logprobs` top logprobs per row.
  """
  return _sampled_body(nnx.merge(graphdef, params), state, plan, config=config, impl=impl,
                       interpret=interpret)


@functools.partial(jax.jit, static_argnames=_STATICS, donate_argnames=("state",))
def prefill(params: nnx.State, state: PoolState, seq_ids: jax.Array, tokens: jax.Array,
            num_new: jax.Array, *, graphdef: nnx.GraphDef, config: PoolConfig,
            impl: str | None = None, interpret=None) -> tuple[PoolState, tuple[jax.Array, ...]]:
  """`forward` for padded prompt chunks `tokens i32[B, T]` (`num_new[b]` each); slow path."""
  return _forward_body(nnx.merge(graphdef, params), state,
                       _prefill_plan(seq_ids, tokens, num_new), config=config, impl=impl,
                       interpret=interpret)


@functools.partial(jax.jit, static_argnames=_STATICS, donate_argnames=("state",))
def decode_step(params: nnx.State, state: PoolState, seq_ids: jax.Array, tokens: jax.Array, *,
                graphdef: nnx.GraphDef, config: PoolConfig, impl: str | None = None,
                interpret=None) -> tuple[PoolState, tuple[jax.Array, ...]]:
  """One greedy decode step of rows `seq_ids` on their last sampled `tokens`; slow path.

  Returns `(state, (next_tokens i32[B], logits f32[B, vocab], status i32[B]))`,
  `-1` tokens for padding and failed rows.
  """
  return _forward_body(nnx.merge(graphdef, params), state, _decode_plan(seq_ids, tokens),
                       config=config, impl=impl, interpret=interpret)


@functools.partial(jax.jit, donate_argnames=("state",),
                   static_argnames=_STATICS + ("num_steps", "stop_token"))
def decode_multi(params: nnx.State, state: PoolState, seq_ids: jax.Array, tokens: jax.Array,
                 remaining: jax.Array, *, graphdef: nnx.GraphDef, config: PoolConfig,
                 num_steps: int, stop_token: int = NO_STOP_TOKEN, impl: str | None = None,
                 interpret=None) -> tuple[PoolState, tuple[jax.Array, ...]]:
  """`num_steps` greedy decode steps in one scan, no host round trip (slow path).

  A row stops on `remaining`, `stop_token` or a failed reservation. Returns
  `(state, (new_tokens i32[k, B], status i32[k, B], last_tokens i32[B],
  remaining i32[B]))`.
  """
  return _decode_multi_body(nnx.merge(graphdef, params), state, seq_ids, tokens, remaining,
                            num_steps=num_steps, stop_token=stop_token, config=config,
                            impl=impl, interpret=interpret)


# Bound steps (fast) ----------------------------------------------------------------------

_BINDINGS: "weakref.WeakSet[ModelSteps]" = weakref.WeakSet()


def _programs(graphdef: nnx.GraphDef, treedef, *, config: PoolConfig, impl: str | None,
              interpret, out_shardings) -> dict[str, Any]:
  """The jitted programs of one binding; they hold no reference to the `ModelSteps`."""
  kwargs = dict(config=config, impl=impl, interpret=interpret)
  model = lambda leaves: nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))

  def forward(leaves, state, plan):
    return _forward_body(model(leaves), state, plan, **kwargs)

  def forward_sampled(leaves, state, plan, history=None):
    return _sampled_body(model(leaves), state, plan, history, **kwargs)

  def prefill(leaves, state, seq_ids, tokens, num_new):
    return _forward_body(model(leaves), state, _prefill_plan(seq_ids, tokens, num_new), **kwargs)

  def decode_step(leaves, state, seq_ids, tokens):
    return _forward_body(model(leaves), state, _decode_plan(seq_ids, tokens), **kwargs)

  def decode_multi(leaves, state, seq_ids, tokens, remaining, *, num_steps, stop_token):
    return _decode_multi_body(model(leaves), state, seq_ids, tokens, remaining,
                              num_steps=num_steps, stop_token=stop_token, **kwargs)

  def decode_steps(leaves, state, plan, remaining, history=None, *, num_steps):
    return run_decode_steps(model(leaves), state, plan, remaining, num_steps=num_steps,
                            history=history, **kwargs)

  extra = {} if out_shardings is None else dict(out_shardings=out_shardings)
  jit = lambda fn, statics=(), donate=(1,): jax.jit(fn, donate_argnums=donate,
                                                    static_argnames=statics, **extra)
  # The token history (`paged_kv.model.penalties`) is donated with the state.
  return dict(forward=jit(forward), forward_sampled=jit(forward_sampled, donate=(1, 3)),
              prefill=jit(prefill), decode_step=jit(decode_step),
              decode_multi=jit(decode_multi, ("num_steps", "stop_token")),
              decode_steps=jit(decode_steps, ("num_steps",), donate=(1, 4)))


class ModelSteps:
  """The jitted steps of one model over one pool config, built once (the fast path).

  Methods match the module-level functions with the model, config and kernel
  choice bound; parameters are held flat (`leaves`) and rebuilt only in the trace.
  `jitted` holds the programs by step name.
  """

  def __init__(self, graphdef: nnx.GraphDef, params: nnx.State, config: PoolConfig, *,
               impl: str | None = None, interpret=None, out_shardings=None):
    """Flattens `params` and builds the (lazily compiled) programs, optionally with `out_shardings`.

    Raises `InvalidArgument` when `config` is not a `PoolConfig`.
    """
    if not isinstance(config, PoolConfig):
      raise InvalidArgument(f"config must be a PoolConfig, got {type(config).__name__}")
    leaves, self.treedef = jax.tree.flatten(params)
    self.leaves = tuple(leaves)
    self.graphdef = graphdef
    self.config = config
    self.impl, self.interpret, self.out_shardings = impl, interpret, out_shardings
    self._build()

  def _build(self) -> None:
    self.jitted = _programs(self.graphdef, self.treedef, config=self.config, impl=self.impl,
                            interpret=self.interpret, out_shardings=self.out_shardings)
    _BINDINGS.add(self)

  @property
  def params(self) -> nnx.State:
    """The parameter tree (rebuilt from `leaves`; not for the step loop)."""
    return jax.tree.unflatten(self.treedef, self.leaves)

  def set_params(self, params: nnx.State) -> None:
    """Replaces the parameters; `InvalidArgument` for another structure, shape or dtype."""
    leaves, treedef = jax.tree.flatten(params)
    if treedef != self.treedef:
      raise InvalidArgument("set_params needs the bound parameters' tree structure")
    for i, (new, old) in enumerate(zip(leaves, self.leaves)):
      if jnp.shape(new) != jnp.shape(old) or jnp.result_type(new) != jnp.result_type(old):
        raise InvalidArgument(f"set_params: parameter {i} has shape {jnp.shape(new)} "
                              f"{jnp.result_type(new)}, the bound one {jnp.shape(old)} "
                              f"{jnp.result_type(old)}")
    self.leaves = tuple(leaves)

  def replace(self, *, config: PoolConfig | None = None, out_shardings=None) -> "ModelSteps":
    """A binding of the same parameters at another `config` / `out_shardings`."""
    other = copy.copy(self)
    if config is not None:
      if not isinstance(config, PoolConfig):
        raise InvalidArgument(f"config must be a PoolConfig, got {type(config).__name__}")
      other.config = config
    if out_shardings is not None:
      other.out_shardings = out_shardings
    other._build()  # pylint: disable=protected-access
    return other

  def cache_size(self) -> int:
    """Compiled entries of this binding's programs (a recompile guard counts them)."""
    return sum(fn._cache_size() for fn in self.jitted.values())  # pylint: disable=protected-access

  def clear_cache(self) -> None:
    """Drops this binding's compiled programs (they recompile on next use)."""
    for fn in self.jitted.values():
      fn.clear_cache()

  def lower(self, name: str, state: PoolState, *args, **kwargs) -> jax.stages.Lowered:
    """Program `name` lowered for these arguments; `.compile()` fills the cache a call hits."""
    return self.jitted[name].lower(self.leaves, state, *args, **kwargs)

  def forward(self, state: PoolState, plan: StepPlan):
    """`forward(params, state, plan, ...)`, bound: `(state, (next_tokens, last_logits, status))`."""
    return self.jitted["forward"](self.leaves, state, plan)

  def forward_sampled(self, state: PoolState, plan: StepPlan, history=None):
    """`forward_sampled`, bound; a donated token `history` applies penalties and comes back last."""
    return self.jitted["forward_sampled"](self.leaves, state, plan, history)

  def prefill(self, state: PoolState, seq_ids, tokens, num_new):
    """`prefill`, bound."""
    return self.jitted["prefill"](self.leaves, state, seq_ids, tokens, num_new)

  def decode_step(self, state: PoolState, seq_ids, tokens):
    """`decode_step`, bound."""
    return self.jitted["decode_step"](self.leaves, state, seq_ids, tokens)

  def decode_multi(self, state: PoolState, seq_ids, tokens, remaining, *, num_steps: int,
                   stop_token: int = NO_STOP_TOKEN):
    """`decode_multi`, bound (one program per `(num_steps, stop_token)`)."""
    return self.jitted["decode_multi"](self.leaves, state, seq_ids, tokens, remaining,
                                       num_steps=num_steps, stop_token=stop_token)

  def decode_steps(self, state: PoolState, plan: StepPlan, remaining, *, num_steps: int,
                   history=None):
    """`run_decode_steps`, bound (a donated `history` comes back last).

    Raises `InvalidArgument` before the call (state intact) for a bad `num_steps`,
    a non-decode plan or a `remaining` not `[B]`.
    """
    multistep.check_decode_steps(plan, remaining, num_steps)
    return self.jitted["decode_steps"](self.leaves, state, plan, remaining, history,
                                       num_steps=num_steps)


def bind(model: nnx.Module, config: PoolConfig, *, impl: str | None = None, interpret=None,
         out_shardings=None) -> ModelSteps:
  """The fast steps of `model` over a pool of `config` (see `ModelSteps`).

  Later changes to `model` need `set_params(nnx.state(model))`.
  """
  graphdef, params = nnx.split(model)
  return ModelSteps(graphdef, params, config, impl=impl, interpret=interpret,
                    out_shardings=out_shardings)


def release_programs() -> None:
  """Drops the compiled programs of the module-level steps and every live `ModelSteps`."""
  for fn in (forward, forward_sampled, prefill, decode_step, decode_multi):
    fn.clear_cache()
  for steps in list(_BINDINGS):
    steps.clear_cache()
