"""`LatencyExecutor`: memory dynamics on a simulated device whose steps take a fixed time.

On a CPU the host's and the device's time cannot be told apart, so this executor
models the device: its tokens are readable `step_seconds` after the later of the
dispatch and the previous step's end (an in-order queue, as a GPU stream). `events`
receives `("dispatch", n)` and `("read", n)`, for tests of the loop's order.
"""

from __future__ import annotations

import time

import numpy as np

from paged_kv.core.config import PoolConfig
from paged_kv.model.plan import StepPlan
from paged_kv.scheduler.executor import DryExecutor


class PendingTokens:
  """Tokens of a simulated step: `np.asarray` waits until the device would be done."""

  def __init__(self, tokens: np.ndarray, ready_at: float, step: int, events: list | None):
    self._tokens, self.ready_at, self.step, self._events = tokens, ready_at, step, events
    self.shape, self.dtype, self.ndim = tokens.shape, tokens.dtype, tokens.ndim

  def is_ready(self) -> bool:
    return time.perf_counter() >= self.ready_at

  def copy_to_host_async(self) -> None:
    """A no-op: the copy is part of the simulated step."""

  def __array__(self, dtype=None, copy=None):
    del copy
    wait = self.ready_at - time.perf_counter()
    if wait > 0:
      time.sleep(wait)
    if self._events is not None:
      self._events.append(("read", self.step))
    return self._tokens if dtype is None else self._tokens.astype(dtype)


class LatencyExecutor(DryExecutor):
  """`DryExecutor` on a simulated device that takes `step_seconds` per decode step."""

  def __init__(self, config: PoolConfig, step_seconds: float, *, events: list | None = None):
    super().__init__(config)
    self.step_seconds = float(step_seconds)
    self.events = events
    self._free_at = 0.0
    self._steps = 0
    self.device_steps = 0  # decode steps run (k per `decode_steps` call)

  def _finish(self, tokens: np.ndarray, num_steps: int) -> PendingTokens:
    now = time.perf_counter()
    self._free_at = max(now, self._free_at) + num_steps * self.step_seconds
    self.device_steps += num_steps
    n = self._steps
    self._steps += 1
    if self.events is not None:
      self.events.append(("dispatch", n))
    return PendingTokens(tokens, self._free_at, n, self.events)

  def step(self, state, plan: StepPlan):
    state, tokens, status = super().step(state, plan)
    return state, self._finish(tokens, 1), status

  def decode_steps(self, state, plan: StepPlan, remaining, *, num_steps: int):
    state, tokens, status = super().decode_steps(state, plan, remaining, num_steps=num_steps)
    return state, self._finish(np.asarray(tokens), num_steps), status
