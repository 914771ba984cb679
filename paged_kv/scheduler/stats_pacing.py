"""`StatsPacer`: on which steps a scheduler takes the cheap pool figures: every
`stats_every` steps or, with `stats_budget`, every `k >= stats_every` steps for the
smallest `k` keeping their average host cost within that share of a step's."""

from __future__ import annotations

import math

MAX_STATS_INTERVAL = 64  # `stats_budget`: the figures at least every this many steps
STATS_COST_SMOOTHING = 0.2  # `stats_budget`: weight of the newest sample in the averages


class StatsPacer:
  """Decides the steps that take the figures (see the module docstring)."""

  def __init__(self, stats_every: int, stats_budget: float | None):
    self.stats_every = stats_every
    self.stats_budget = stats_budget
    self.interval = max(1, stats_every)  # the current interval (1 until measured)
    self._stats_cost: float | None = None
    self._rest_cost = 0.0
    self._next_step = 0

  def takes(self, step: int) -> bool:
    """Whether step `step` takes the figures."""
    every = self.stats_every
    if not every:
      return False
    if self.stats_budget is None:
      return step % every == 0
    return step >= self._next_step

  def pace(self, step: int, stats_seconds: float, rest_seconds: float) -> None:
    """After a step that took them: what they cost and what the rest of it cost."""
    budget = self.stats_budget
    if budget is None:
      return
    a = STATS_COST_SMOOTHING
    if self._stats_cost is None:
      self._stats_cost, self._rest_cost = stats_seconds, rest_seconds
    else:
      self._stats_cost += a * (stats_seconds - self._stats_cost)
      self._rest_cost += a * (rest_seconds - self._rest_cost)
    want = self._stats_cost / max(budget * self._rest_cost, 1e-9)
    self.interval = min(MAX_STATS_INTERVAL, max(self.stats_every, math.ceil(want)))
    self._next_step = step + self.interval
