"""The model work of a scheduler step: one forward pass, on the pool state.

`Executor` is the protocol the `Scheduler` calls: `step(state, plan) -> (state,
next_tokens i32[B], status i32[B])` runs row i of a `paged_kv.model.StepPlan` (prefill
chunks and decodes together) on the slots the host reserved and committed for it,
`plan.reserved` (`BlockPool.reserve_step`; the step first grows rows in place by
`reserved.grow` with `reserved_growth`, and never reserves itself), caches its new
tokens and samples the token after its last; `status` is `plan.reserved.status`, and a row whose
reservation failed is left untouched (its token means nothing). `DryExecutor` only
applies the growth (trace replay, scheduler tests); `ModelExecutor` runs a Flax NNX
model through its bound jitted steps (`paged_kv.model.steps.bind`). This module
imports no flax.

Optional attributes the scheduler reads:
  * `vocab_size`: `submit` refuses token ids outside `[0, vocab_size)`.
  * `tokenizer`: decodes output for stop strings.
  * `samples`: it applies `plan.sampling` (then always given) and may return the
    rows' `SampleOutput` fourth.
  * `applies_penalties`, `history_len`: penalties from per-row token histories.
  * `prompt_logprobs`: it computes `plan.prompt`'s `PromptLogprobs` (returned fifth).
  * `carries_tokens`: it resolves `plan.carried` (tokens on the device) in its step.
  * `decode_steps(state, plan, remaining, *, num_steps)`: k decode steps in one
    dispatch, reserving in the step; row b runs step j iff `seq_ids[b] >= 0`,
    `j < remaining[b]` and no earlier reservation of it failed (a stop token does
    not end it). Returns `(state, tokens i32[k, B], status i32[k, B])` and a
    `SampleOutput` with a leading k axis when sampling; tokens equal k steps'.
  * `lower_step` / `lower_decode_steps`: the programs lowered, for `warmup`.
  * `resize(config)`: follows `Scheduler.shrink_to`'s cut (one holding a pool
    `config` without it cannot shrink).

The contract that keeps a failed step from destroying the pool: a failed reservation
is reported in `status`, never raised; `step` donates `state`: raised before the
jitted call, `state` is intact; raised after it (`BaseException` included), the
exception carries the state the call returned (`attach_state`), which the scheduler
takes back (`attached_state`). An executor that breaks this makes the scheduler
refuse further use (`SchedulerBroken`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Protocol

import jax
import numpy as np

from paged_kv.core import growth
from paged_kv.core.config import PoolConfig
from paged_kv.core.errors import InvalidArgument
from paged_kv.core.state import PoolState
from paged_kv.model import multistep
from paged_kv.model.plan import StepPlan

if TYPE_CHECKING:
  from flax import nnx

_STATE_ATTR = "paged_kv_state"


def attach_state(exc: BaseException, state: PoolState) -> None:
  """Marks `exc` as raised after the donating call; `state` is the pool's valid state."""
  setattr(exc, _STATE_ATTR, state)


def attached_state(exc: BaseException) -> PoolState | None:
  """The state `attach_state` put on `exc`, or None (raised before the donation)."""
  return getattr(exc, _STATE_ATTR, None)


def check_resized(old: PoolConfig, new: PoolConfig) -> PoolConfig:
  """`new`, after checking it is `old` at another size: only `num_blocks` (and the
  `base_pool_fraction` that keeps the base region) may differ, else `InvalidArgument`."""
  if not isinstance(new, PoolConfig):
    raise InvalidArgument(f"resize takes a PoolConfig, got {type(new).__name__}")
  same = dataclasses.replace(new, num_blocks=old.num_blocks,
                             base_pool_fraction=old.base_pool_fraction)
  if same != old or new.num_base_blocks != old.num_base_blocks:
    raise InvalidArgument("a resized pool config may differ only in num_blocks (same base "
                          "region); build it with paged_kv.core.regions.resized_config")
  return new


class Executor(Protocol):
  """The model work of a step, on the pool state (donated in, returned out)."""

  def step(self, state: PoolState,
           plan: StepPlan) -> tuple[PoolState, np.ndarray, np.ndarray]:
    """One forward pass over the plan's rows: `(state, next_tokens i32[B], status
    i32[B])`, host or device arrays (see the module docstring)."""

  # Optional: `resize(config: PoolConfig) -> None`, for an executor that holds the
  # pool's config; `samples`, `carries_tokens` and `decode_steps` (the module docstring).


class DryExecutor:
  """Memory dynamics only: applies the host's reservation (`plan.reserved`'s in-place
  growth), computes nothing, samples token 0."""

  uses_tokens = False  # it reads no tokens: its step program fits every token width
  carries_tokens = True  # it reads no tokens, so carried ones need no resolving

  def __init__(self, config: PoolConfig):
    self.config = config
    self._decode_steps = _reserve_steps_program(config)
    self._grow = reserved_growth(config)

  def resize(self, config: PoolConfig) -> None:
    """Follows a pool resize: later steps run at `config`'s shapes."""
    self.config = check_resized(self.config, config)
    self._decode_steps = _reserve_steps_program(self.config)
    self._grow = reserved_growth(self.config)

  def step(self, state: PoolState,
           plan: StepPlan) -> tuple[PoolState, np.ndarray, np.ndarray]:
    """`InvalidArgument` (state intact) for a plan without `reserved`."""
    reserved = plan.reserved
    if reserved is None:
      raise InvalidArgument("DryExecutor.step reads the host's reservation: plan.reserved "
                            "is None (BlockPool.reserve_step)")
    return self._grow(state, plan), np.zeros(plan.seq_ids.shape, np.int32), reserved.status

  def decode_steps(self, state: PoolState, plan: StepPlan, remaining, *,
                   num_steps: int) -> tuple[PoolState, np.ndarray, Any]:
    """`num_steps` decode steps' reservations in one jitted program: host zeros for
    the tokens, the device's statuses. `InvalidArgument` (state intact) as
    `multistep.check_decode_steps`."""
    multistep.check_decode_steps(plan, remaining, num_steps)
    state, status = self._decode_steps(state, plan.seq_ids, remaining, num_steps=num_steps)
    return state, np.zeros((num_steps, plan.num_rows), np.int32), status


def reserved_growth(config: PoolConfig) -> Callable[[PoolState, StepPlan], PoolState]:
  """What an executor's step does first: `apply(state, plan)` grows the rows that
  `plan.reserved.grow` names in place (the commit holds the rest of the reservation),
  `growth.grow_tails` jitted for `config` with the state donated. Build it once per
  config, not per step."""

  def run(state, seq_ids, grow, clock):
    return growth.grow_tails(state, seq_ids, grow, clock, config=config)

  program = jax.jit(run, donate_argnums=0)

  def apply(state: PoolState, plan: StepPlan) -> PoolState:
    grow = plan.reserved.grow
    if grow is None:
      return state
    return program(state, plan.seq_ids, grow.tokens, grow.clock)

  return apply


def _reserve_steps_program(config: PoolConfig):
  """`multistep.reserve_decode_steps` jitted for `config` (closed over: not hashed per call)."""

  def run(state, seq_ids, remaining, *, num_steps):
    return multistep.reserve_decode_steps(state, seq_ids, remaining, config=config,
                                          num_steps=num_steps)

  return jax.jit(run, static_argnames=("num_steps",), donate_argnums=0)


class ModelExecutor:
  """A Flax NNX model as an `Executor`: one jitted mixed step per scheduler step.

  The model meets `paged_kv.model.contract` (`model(tokens i32[T], pages, meta, impl=,
  interpret=) -> (pages, logits)`, checked when built). Each row's next token is
  drawn from its last new token's logits by the row's `plan.sampling` (the argmax
  for a request without `SamplingParams`). A model that takes `logits_indices` runs
  its output head on each row's last token only. The steps are bound once
  (`paged_kv.model.steps.ModelSteps`): a call hashes nothing.

  It compiles one program per plan shape and tree structure; the scheduler's plans
  take few (`docs/serving_loop.md`).

  Example:
    sched = Scheduler(pool, ModelExecutor(model, pool.config), SchedulerConfig(...))
  """

  samples = True  # the scheduler hands it each row's sampling parameters (`plan.sampling`)
  carries_tokens = True  # `plan.carried` is resolved inside the jitted step

  def __init__(self, model: "nnx.Module", pool_config: PoolConfig, *,
               impl: str | None = None, interpret: bool | None = None, tokenizer=None,
               history_len: int | None = None, prompt_logprobs: bool = False):
    """Checks the model and binds its steps to the pool's config.

    Args:
      model: an `nnx.Module` meeting `paged_kv.model.contract` (its `config`, when it
        has `num_layers`, `num_kv_heads` and `head_dim`, must match the pool).
      impl, interpret: attention path and Pallas interpret mode (None: the backend's).
      tokenizer: for stop strings; None: requests with them are refused.
      history_len: token-history positions per row for the penalties (`max_seqs *
        history_len * 4` bytes on the device); None: the longest row; 0: none.
      prompt_logprobs: serve `SamplingParams.prompt_logprobs` (one more program per
        mixed width); False: those requests are refused.

    Raises ModelContractError (the model breaks the contract) or InvalidArgument.
    """
    from paged_kv.model import contract, llama, penalties, steps
    if not isinstance(pool_config, PoolConfig):
      raise InvalidArgument(f"pool_config must be a PoolConfig, got {type(pool_config).__name__}")
    model_config = getattr(model, "config", None)
    if all(hasattr(model_config, a) for a in ("num_layers", "num_kv_heads", "head_dim")):
      llama.check_pool_matches_model(pool_config, model_config)
    self.vocab_size = contract.check_model(model, pool_config)
    self.uses_logits_indices = contract.accepts_logits_indices(model)
    self.tokenizer = tokenizer
    if not isinstance(prompt_logprobs, bool):
      raise InvalidArgument(f"prompt_logprobs must be a bool, got {prompt_logprobs!r}")
    self.prompt_logprobs = prompt_logprobs
    self.config = pool_config
    self.kernel_args: dict[str, Any] = dict(impl=impl, interpret=interpret)
    self.steps = steps.bind(model, pool_config, out_shardings=self._out_shardings(pool_config),
                            **self.kernel_args)
    if history_len is None:
      history_len = pool_config.max_segments * pool_config.block_size
    if not isinstance(history_len, int) or isinstance(history_len, bool) or history_len < 0:
      raise InvalidArgument(f"history_len must be an int >= 0 or None, got {history_len!r}")
    self.history_len = history_len
    self.history = (penalties.empty_history(pool_config.max_seqs, history_len)
                    if history_len else None)

  @property
  def applies_penalties(self) -> bool:
    """Whether the rows' presence, frequency and repetition penalties are applied."""
    return self.history is not None

  def _out_shardings(self, config: PoolConfig):
    """The programs' `out_shardings` for `config` (None: the compiler's choice)."""
    del config
    return None

  @property
  def graphdef(self) -> "nnx.GraphDef":
    """The model's graph definition."""
    return self.steps.graphdef

  @property
  def params(self) -> "nnx.State":
    """The model's parameters (rebuilt from the bound arrays; not for the step loop)."""
    return self.steps.params

  def resize(self, config: PoolConfig) -> None:
    """Follows a pool resize: binds the steps anew; the next step compiles once for
    `config`'s shapes (the old size's programs go with the old binding)."""
    self.config = check_resized(self.config, config)
    self.steps = self.steps.replace(config=config, out_shardings=self._out_shardings(config))

  def step(self, state: PoolState, plan: StepPlan) -> tuple:
    if plan.sampling is not None:
      # `(state, next, status, SampleOutput[, PromptLogprobs])`, the history kept.
      if self.history is None:
        state, (nxt, status, *extra) = self.steps.forward_sampled(state, plan)
      else:
        state, (nxt, status, *extra, self.history) = self.steps.forward_sampled(
            state, plan, self.history)
      return (state, nxt, status, *extra)
    state, (nxt, _, status) = self.steps.forward(state, plan)
    return state, nxt, status  # device arrays: the caller reads the tokens

  def lower_step(self, state: PoolState, plan: StepPlan):
    """`step`'s program for `plan`'s shapes, lowered (not run: `state` is kept), for a
    warm-up that compiles programs concurrently (`jax.stages.Lowered.compile`)."""
    if plan.sampling is None:
      return self.steps.lower("forward", state, plan)
    return self.steps.lower("forward_sampled", state, plan, self.history)

  def lower_decode_steps(self, state: PoolState, plan: StepPlan, remaining, *,
                         num_steps: int):
    """`decode_steps`' program, lowered (see `lower_step`)."""
    history = None if plan.sampling is None else self.history
    return self.steps.lower("decode_steps", state, plan, remaining, history,
                            num_steps=num_steps)

  def decode_steps(self, state: PoolState, plan: StepPlan, remaining, *,
                   num_steps: int) -> tuple:
    """`num_steps` decode steps in one dispatch (the module docstring's contract):
    `(state, tokens i32[k, B], status i32[k, B])` as device arrays, and the
    `SampleOutput` (leading k axis) fourth when `plan.sampling` is given.
    `InvalidArgument` (state intact): not a decode plan, `num_steps < 1` or
    `remaining` not `[B]`."""
    if plan.sampling is None or self.history is None:
      state, out = self.steps.decode_steps(state, plan, remaining, num_steps=num_steps)
      return (state, *out)
    state, (*out, self.history) = self.steps.decode_steps(state, plan, remaining,
                                                          num_steps=num_steps,
                                                          history=self.history)
    return (state, *out)
