"""Typed checks of `Scheduler`'s public arguments: `InvalidArgument` naming the
argument before anything changes, not a `TypeError` from deep inside a step."""

from __future__ import annotations

from typing import Any

from paged_kv.core import fields
from paged_kv.core.errors import InvalidArgument
from paged_kv.pool.block_pool import BlockPool
from paged_kv.cache.cached_pool import CachedPool
from paged_kv.scheduler.scheduler_config import SchedulerConfig
from radix.cache import PrefixCache


def _callable_or_none(owner: str, name: str, value: Any) -> None:
  if value is not None and not callable(value):
    raise InvalidArgument(f"{owner}'s {name} must be callable or None, got {value!r}")


def check_init_args(pool: Any, config: Any, cache: Any, clock: Any, on_snapshot: Any,
                    on_step: Any) -> None:
  """`Scheduler.__init__`'s arguments but the executor (duck-typed: the `Executor`
  protocol); `InvalidArgument` naming the bad one."""
  if not isinstance(config, SchedulerConfig):
    raise InvalidArgument(f"config must be a SchedulerConfig, got {type(config).__name__}")
  if not isinstance(pool, (CachedPool, BlockPool)):
    raise InvalidArgument(f"pool must be a BlockPool or a CachedPool, got "
                          f"{type(pool).__name__}")
  if cache is not None and not isinstance(cache, PrefixCache):
    raise InvalidArgument(f"cache must be a radix.cache.PrefixCache or None, got "
                          f"{type(cache).__name__}")
  if not callable(clock):
    raise InvalidArgument(f"clock must be callable (a time source), got {clock!r}")
  _callable_or_none("Scheduler", "on_snapshot", on_snapshot)
  _callable_or_none("Scheduler", "on_step", on_step)


def check_run_args(max_steps: Any, before_step: Any) -> int | None:
  """`Scheduler.run`'s arguments: `max_steps` as an int (or None), else
  `InvalidArgument`."""
  max_steps = fields.check_int("Scheduler.run", "max_steps", max_steps, 0, 2**63 - 1,
                               optional=True)
  _callable_or_none("Scheduler.run", "before_step", before_step)
  return max_steps
