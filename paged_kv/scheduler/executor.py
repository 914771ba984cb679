"""The model work of a scheduler step: ONE forward pass per step, on the pool state.

  * `Executor` — the protocol the `Scheduler` calls: `step(state, plan) -> (state,
    next_tokens, status)` for a `paged_kv.model.StepPlan` holding the step's
    prefill chunks and decode tokens together; optionally `decode_steps(state,
    plan, remaining, *, num_steps)`: k decode steps in one dispatch.
  * `DryExecutor` — memory dynamics only (reserves the slots, computes nothing),
    for trace replay and scheduler tests.
  * `ModelExecutor` — a Flax NNX model (e.g. `paged_kv.model.llama.TinyLlama`)
    through its bound jitted steps (`paged_kv.model.steps.bind`: built once, a
    call hashes nothing, microseconds of host time whatever the model's depth).

This module imports no flax: `ModelExecutor` loads the model steps when built.

Optional attributes the scheduler reads:

  * `vocab_size: int`: the model's vocabulary; `Scheduler.submit` refuses a request
    with a token id outside `[0, vocab_size)` (`paged_kv.scheduler.request_checks`).
    `ModelExecutor` has it (the model's logits width, read by the contract check).
  * `tokenizer`: decodes output ids to text (`paged_kv.model.tokenizer.Tokenizer`
    or anything with its `stream()`); requests with stop strings
    (`SamplingParams.stop`) need it (`paged_kv.scheduler.stop_strings`).
  * `samples = True`: the executor applies `plan.sampling` (the scheduler then
    always hands it one) and may return the rows' `SampleOutput` fourth.
  * `applies_penalties = True`: it applies the presence, frequency and repetition
    penalties of `plan.sampling` (it keeps the rows' token histories:
    `paged_kv.model.penalties`); `submit` refuses penalized requests otherwise, and
    admits them without a cached prefix (`paged_kv.scheduler.admission`).
    `history_len`: the positions its histories hold (`submit` refuses a penalized
    request that could grow longer).
  * `prompt_logprobs = True`: the executor's `step` computes a plan's `prompt`
    positions (`paged_kv.model.plan.PromptPositions`) and returns their
    `PromptLogprobs` after the `SampleOutput`; `submit` refuses requests asking for
    prompt logprobs otherwise, and the warm-up compiles those programs only then.
  * `carries_tokens = True`: the executor resolves `plan.carried` (tokens still on
    the device from the previous step's `next_tokens`) inside its jitted step;
    for any other the scheduler resolves them first.
  * `takes_reserved_slots = True`: the executor's `step` reads a plan's
    `reserved` slots (`paged_kv.model.plan.ReservedSlots`) instead of reserving:
    the scheduler then reserves each step on the pool's host mirror and commits
    it before the call (`BlockPool.reserve_step(grow_in_step=True)`), and the
    step's program holds no allocator (it compiles faster). The rows that grow
    in place are left out of that commit: the step applies `reserved.grow` first
    (`paged_kv.core.growth.grow_tails`). `decode_steps` still reserves its own.
  * `decode_steps(state, plan, remaining, *, num_steps)`: `num_steps` (k) decode
    steps of a decode plan in one dispatch. Row b runs step j iff `seq_ids[b] >=
    0`, `j < remaining[b]` and none of its earlier reservations failed; step j
    reserves with `reserve_tokens(state, where(live_j, seq_ids, -1), ones,
    max_new_tokens=1)` (what the host predicts on its mirror; a stop token does
    not end a row: the host drops tokens past a stop) and its input tokens are
    step j-1's samples (step 0's: the plan's, row b's at position b). Returns
    `(state, tokens i32[k, B], status i32[k, B])`, plus a `SampleOutput` with a
    leading k axis when `plan.sampling` is given; a token where the row did not
    run or failed is meaningless (`ModelExecutor`: -1). The same contract as
    `step` (donation, `attach_state`). Tokens equal k single steps'.
  * `lower_step(state, plan)` / `lower_decode_steps(...)`: the programs lowered,
    not run (`jax.stages.Lowered`), so that `Scheduler.warmup` compiles them
    concurrently before it runs each once.

The executor contract (what keeps a failed step from destroying the pool):

  1. A reservation that fails (no free block, full table, ...) is reported in
     `status`, never raised; the row is left untouched.
  2. `step` donates `state` to its jitted call. If it raises *before* that call
     ran, `state` is still valid. If it raises *after* (a failing conversion, a
     `KeyboardInterrupt`, ...), it attaches the state the call returned to the
     exception with `attach_state(exc, new_state)` before re-raising; the
     scheduler takes it back with `attached_state(exc)`. Both library executors
     do this for every exception, `BaseException` included.
  3. An executor that breaks the contract (raises with the donated state gone)
     makes the scheduler refuse further use with `PoolStateLost`/`SchedulerBroken`,
     naming the deleted buffers, instead of failing later on deleted arrays.

Pool resizes (`Scheduler.shrink_to`): an executor that holds the pool's config
(both library executors do: their jitted steps are built for it) has
`resize(config)`, which the scheduler calls right after the pool changed size;
the next `step` then runs (and compiles once) at the new shapes. An executor
with a `config` but no `resize` cannot follow, and the scheduler refuses to
shrink under it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Protocol

import jax
import numpy as np

from paged_kv.core import growth, segments
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
  """`new`, after checking it is `old` at another size (same model, block size, rows).

  Raises:
    InvalidArgument: `new` is not a `PoolConfig`, or differs from `old` in more
      than `num_blocks` (and the `base_pool_fraction` that keeps the base region).
  """
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
    """Runs one forward pass over the plan's rows: prefill chunks and decodes together.

    Reserves `plan.num_new[i]` slots for row i, caches its new tokens (a decode
    row's one token is its pending token) and samples the token after its last one.

    Returns:
      `(state, next_tokens i32[B], status i32[B])` (host or device arrays); a
      row whose reservation failed (`status != OK`) is left untouched and its
      `next_tokens` entry is meaningless. An executor with `samples = True` gets
      `plan.sampling` (each row's parameters; `paged_kv.model.sampling`) and may
      return a fourth element, the rows' `SampleOutput` (logprobs).

    Raises:
      Anything; raised after the donating call, the exception carries the new
      state (`attach_state`), so the pool is never lost (see the module docstring).
    """

  # Optional: `resize(config: PoolConfig) -> None`, for an executor that holds the
  # pool's config; `samples`, `carries_tokens` and `decode_steps` (the module docstring).


class DryExecutor:
  """Memory dynamics only: reserves the slots, computes nothing, samples token 0.

  Args:
    config: the pool's config.
    takes_reserved_slots: run the serving loop's step as `ModelExecutor` does: the
      scheduler reserves on the host mirror and commits (`BlockPool.reserve_step`),
      the step only reads the plan's `reserved` slots. False: the step reserves
      inside its jitted program (`reserve_tokens`, checked later against the
      host's prediction), as a step without a host reservation does.
  """

  uses_tokens = False  # one program per `max_query_len`, whatever the token width
  carries_tokens = True  # it reads no tokens, so carried ones need no resolving

  def __init__(self, config: PoolConfig, *, takes_reserved_slots: bool = False):
    self.config = config
    self.takes_reserved_slots = bool(takes_reserved_slots)
    self._decode_steps = _reserve_steps_program(config)
    self._grow = _grow_program(config)

  def resize(self, config: PoolConfig) -> None:
    """Follows a pool resize: later steps run at `config`'s shapes."""
    self.config = check_resized(self.config, config)
    self._decode_steps = _reserve_steps_program(self.config)
    self._grow = _grow_program(self.config)

  def step(self, state: PoolState,
           plan: StepPlan) -> tuple[PoolState, np.ndarray, np.ndarray]:
    reserved = plan.reserved
    if reserved is not None:  # the host reserved and committed all but in-place growth
      if reserved.grow is not None:
        state = self._grow(state, plan.seq_ids, reserved.grow.tokens, reserved.grow.clock)
      return state, np.zeros(plan.seq_ids.shape, np.int32), reserved.status
    state, (_, status) = segments.reserve_tokens(state, plan.seq_ids, plan.num_new,
                                                 config=self.config,
                                                 max_new_tokens=plan.max_query_len)
    # The status stays on the device: the scheduler predicted it on its host mirror
    # and compares the two once the device is done (no wait).
    return state, np.zeros(plan.seq_ids.shape, np.int32), status

  def decode_steps(self, state: PoolState, plan: StepPlan, remaining, *,
                   num_steps: int) -> tuple[PoolState, np.ndarray, Any]:
    """`num_steps` decode steps' reservations in one jitted program (`lax.scan`).

    Returns:
      `(state, tokens, status i32[k, B])`: host zeros for the tokens (the host
      knows which rows ran from its own prediction), the device's statuses.

    Raises:
      InvalidArgument: as `paged_kv.model.multistep.check_decode_steps` (before
        the call: `state` is intact).
    """
    multistep.check_decode_steps(plan, remaining, num_steps)
    state, status = self._decode_steps(state, plan.seq_ids, remaining, num_steps=num_steps)
    return state, np.zeros((num_steps, plan.num_rows), np.int32), status


def _grow_program(config: PoolConfig):
  """`growth.grow_tails` jitted for `config` (the state donated)."""

  def run(state, seq_ids, grow, clock):
    return growth.grow_tails(state, seq_ids, grow, clock, config=config)

  return jax.jit(run, donate_argnums=0)


def _reserve_steps_program(config: PoolConfig):
  """`multistep.reserve_decode_steps` jitted for `config` (closed over: not hashed per call)."""

  def run(state, seq_ids, remaining, *, num_steps):
    return multistep.reserve_decode_steps(state, seq_ids, remaining, config=config,
                                          num_steps=num_steps)

  return jax.jit(run, static_argnames=("num_steps",), donate_argnums=0)


class ModelExecutor:
  """A Flax NNX model as an `Executor`: one jitted mixed step per scheduler step.

  The model is called as `model(tokens i32[T], pages, meta, impl=, interpret=) ->
  (pages, logits f32[T, vocab])` inside the jitted step (the contract of
  `paged_kv.model.contract`, which `paged_kv.model.llama.TinyLlama` meets; checked
  when the executor is built); the next token is drawn after each row's last new
  token by the row's `plan.sampling` (`paged_kv.model.sampling`: greedy, the argmax,
  for a request without `SamplingParams`). A model whose signature names `logits_indices` (TinyLlama's does)
  is called with `logits_indices=` each row's last token index `i32[B]` and returns
  `f32[B, vocab]`: its output head runs on B rows instead of every token of the
  step's prefill chunks. Which form is read from the signature once, when the
  executor is built (`uses_logits_indices`), and by the step while tracing.

  The steps are bound once (`steps`: a `paged_kv.model.steps.ModelSteps`; a resize
  binds anew): a step call hashes nothing and flattens no parameter tree.

  Example:
    sched = Scheduler(pool, ModelExecutor(model, pool.config), SchedulerConfig(...))

  A plan with `reserved` slots (the scheduler's: `takes_reserved_slots`) runs a step
  that only reads the reservation the host committed; one without reserves inside
  the step, as `paged_kv.model.steps.forward` does.

  Compilations: one per `(num_tokens, max_query_len)` of the plans it sees (and
  per sampling / logprobs width / carried tokens / reserved slots: the plan's tree
  structure); the
  scheduler rounds `num_tokens` up to a power of two and uses two values of
  `max_query_len` (1 for decode-only steps, `prefill_chunk` otherwise); one per
  `num_steps` for `decode_steps`.
  """

  samples = True  # the scheduler hands it each row's sampling parameters (`plan.sampling`)
  carries_tokens = True  # `plan.carried` is resolved inside the jitted step
  takes_reserved_slots = True  # a plan's `reserved` slots are read, not reserved again

  def __init__(self, model: "nnx.Module", pool_config: PoolConfig, *,
               impl: str | None = None, interpret: bool | None = None, tokenizer=None,
               history_len: int | None = None, prompt_logprobs: bool = False):
    """Checks the model and binds its steps to the pool's config.

    Args:
      model: the model (an `nnx.Module` meeting `paged_kv.model.contract`);
        `model.config` is checked against the pool when it has `num_layers`,
        `num_kv_heads` and `head_dim`. Its parameters are read now.
      pool_config: the pool the scheduler serves from.
      impl: attention path (`None`: `paged_kv.model.default_impl()` for the backend).
      interpret: Pallas interpret mode (`None`: on CPU only).
      tokenizer: the model's tokenizer (a `paged_kv.model.tokenizer.Tokenizer`), for
        stop strings; None: requests with stop strings are refused at submit.
      history_len: positions of the token history kept per pool row for the
        presence, frequency and repetition penalties (`paged_kv.model.penalties`:
        `max_seqs * history_len * 4` bytes on the device); None: `max_segments *
        block_size` (the longest row the table holds); 0: no history, and
        penalized requests are refused at submit.
      prompt_logprobs: serve `SamplingParams.prompt_logprobs`
        (`paged_kv.scheduler.prompt_positions`): a step holding such a prompt runs
        a program of its own (the output head at the prompt's positions too), which
        `Scheduler.warmup` then compiles as well (one per mixed token width).
        False: those requests are refused at submit, and nothing more compiles.

    Raises:
      ModelContractError: the model's signature or its abstract decode, prefill
        and mixed steps (`contract.check_model`: traced, not compiled) break the
        contract; the message names what.
      InvalidArgument: `model.config` does not match the pool.
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
    """Follows a pool resize: binds the steps anew (the old size's programs go with
    the old binding); the next step compiles once for `config`'s shapes."""
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
    # Device arrays: the caller reads the tokens (it needs them) and compares the
    # status with its own prediction once ready.
    return state, nxt, status

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
    """`num_steps` decode steps in one dispatch (see the module docstring).

    Returns:
      `(state, tokens i32[k, B], status i32[k, B])`, and the `SampleOutput`
      (leading k axis) fourth when `plan.sampling` is given; device arrays.

    Raises:
      InvalidArgument: not a decode plan, `num_steps < 1` or `remaining` not
        `[B]` (before the call: `state` is intact).
    """
    if plan.sampling is None or self.history is None:
      state, out = self.steps.decode_steps(state, plan, remaining, num_steps=num_steps)
      return (state, *out)
    state, (*out, self.history) = self.steps.decode_steps(state, plan, remaining,
                                                          num_steps=num_steps,
                                                          history=self.history)
    return (state, *out)
