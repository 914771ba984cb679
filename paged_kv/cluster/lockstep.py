"""One schedule on every process: the same deterministic `Scheduler`, arrivals broadcast.

Every process of a multi-controller run must issue the same device programs in the
same order, so every process runs the same deterministic `Scheduler` on the same
inputs instead of shipping plans. Per step the leader broadcasts its arrivals, aborts
and clock; every process compares a digest of its `StepPlan` before the model step
(so a divergence stops the run before a collective mixes programs) and of its outcome
after it (`ScheduleDiverged`). Swap preemption is refused across processes. Design:
docs/scaling.md.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import time
from typing import Callable, Hashable, Sequence

import jax
import numpy as np

from paged_kv.core.errors import InvalidArgument, PagedKVError
from paged_kv.model.plan import StepPlan
from paged_kv.cluster.distributed import Channel, ScheduleDiverged, digest
from paged_kv.scheduler.sampling_params import SamplingParams
from paged_kv.scheduler.scheduler import Request, Scheduler, SchedulerConfig

__all__ = ["StepClock", "LockstepResult", "LockstepScheduler", "encode_request",
           "decode_request"]


class StepClock:
  """The leader's clock at the start of the current step, the same on every process."""

  def __init__(self, now: float = 0.0):
    self.now = float(now)

  def __call__(self) -> float:
    return self.now


# -- requests on the wire (JSON) ---------------------------------------------------
def _encode_key(x) -> list:
  """A typed key (`str`, `int`, `bytes` or tuples of them), tagged for JSON."""
  if isinstance(x, bool) or isinstance(x, np.generic):
    raise InvalidArgument(f"{x!r}: ids and namespaces of a lockstep run are str, int, bytes "
                          f"or tuples of them (they travel between processes)")
  if isinstance(x, str):
    return ["s", x]
  if isinstance(x, int):
    return ["i", x]
  if isinstance(x, bytes):
    return ["b", base64.b64encode(x).decode()]
  if isinstance(x, tuple):
    return ["t", [_encode_key(y) for y in x]]
  raise InvalidArgument(f"{x!r} ({type(x).__name__}): ids and namespaces of a lockstep run "
                        f"are str, int, bytes or tuples of them (they travel between processes)")


def _decode_key(x):
  tag, value = x
  if tag == "s":
    return str(value)
  if tag == "i":
    return int(value)
  if tag == "b":
    return base64.b64decode(value)
  if tag == "t":
    return tuple(_decode_key(y) for y in value)
  raise InvalidArgument(f"bad key tag {tag!r}")


def encode_request(r: Request) -> dict:
  """A `Request`'s inputs as JSON-able data (progress fields are not carried)."""
  if not isinstance(r, Request):
    raise InvalidArgument(f"arrivals are Requests, got {type(r).__name__}")
  return {
      "id": _encode_key(r.request_id),
      "prompt": np.asarray(r.prompt, np.int32).tolist(),
      "max_new_tokens": int(r.max_new_tokens),
      "namespace": _encode_key(r.namespace),
      "arrival": float(r.arrival),
      "forced_output": (None if r.forced_output is None
                        else np.asarray(r.forced_output, np.int32).tolist()),
      "sampling": None if r.sampling is None else dataclasses.asdict(r.sampling),
  }


def decode_request(d: dict) -> Request:
  """The `Request` `encode_request` described (a fresh object, no progress)."""
  sp = d["sampling"]
  if sp is not None:
    sp = SamplingParams(**{**sp, "stop_token_ids": tuple(sp["stop_token_ids"])})
  forced = d["forced_output"]
  return Request(_decode_key(d["id"]), np.asarray(d["prompt"], np.int32), d["max_new_tokens"],
                 namespace=_decode_key(d["namespace"]), arrival=d["arrival"],
                 forced_output=None if forced is None else np.asarray(forced, np.int32),
                 sampling=sp)


def plan_digest(step: int, plan: StepPlan) -> str:
  """Digest of what a model step computes: its rows, token counts, tokens, sampling."""
  parts = [step, plan.max_query_len, plan.num_logprobs]
  parts += [np.asarray(x) for x in (plan.seq_ids, plan.num_new, plan.tokens)]
  if plan.sampling is not None:
    parts += [np.asarray(x) for x in jax.tree.leaves(plan.sampling)]
  return digest(*parts)


class _AgreedExecutor:
  """The scheduler's executor, comparing the plan's digest across processes first."""

  def __init__(self, inner, lockstep: "LockstepScheduler"):
    self._inner = inner
    self._lockstep = lockstep

  def __getattr__(self, name):  # `samples`, `config`, `resize`, ... of the executor
    return getattr(self._inner, name)

  def step(self, state, plan: StepPlan):
    ls = self._lockstep
    ls.channel.agree("plan", plan_digest(ls.step_index, plan), step=ls.step_index)
    return self._inner.step(state, plan)


@dataclasses.dataclass(frozen=True)
class LockstepResult:
  """What one `LockstepScheduler.step` did (the same on every process).

  Attributes:
    rejected: `(request_id, error)` of this step's arrivals `submit` refused.
    done: the leader closed the arrivals and nothing is left to run.
    wait_seconds: of `seconds`, waiting for the other processes.
  """

  step: int
  finished: tuple
  rejected: tuple
  done: bool
  seconds: float
  wait_seconds: float


def _pages_addressable(pool) -> bool:
  return bool(pool.state.pages.k.is_fully_addressable)


class LockstepScheduler:
  """A `Scheduler` run in lockstep by every process of a multi-controller run.

  Example (every process; only the leader passes arrivals):
    group = distributed.initialize()
    channel = distributed.Channel(group)
    ls = LockstepScheduler(pool, executor, SchedulerConfig(...), channel=channel)
    try:
      while not ls.done:
        arrivals = source.poll() if group.is_leader else ()
        result = ls.step(arrivals, closed=group.is_leader and source.exhausted)
    except BaseException as exc:
      channel.stop(exc)  # tell the others; the leader waits for them before exiting
      raise
    distributed.shutdown()

  `scheduler` is for reading: do not step or submit to it directly.
  """

  def __init__(self, pool, executor, config: SchedulerConfig = SchedulerConfig(), *,
               channel: Channel, leader_clock: Callable[[], float] = time.monotonic,
               check_plans: bool = True, **scheduler_kwargs):
    """Builds the scheduler and compares the setup across processes.

    `pool`, `executor`, `config` and `**scheduler_kwargs` go to `Scheduler` (the same
    on every process; not `clock`); `leader_clock` is read on the leader only.

    Raises:
      InvalidArgument: `clock` passed, `stats_budget` set (wall-clock pacing
        differs per process), or swap preemption on pages not all held here.
      ScheduleDiverged: the processes' setups differ.
    """
    if "clock" in scheduler_kwargs:
      raise InvalidArgument("a LockstepScheduler's clock is the leader's (leader_clock=)")
    if not isinstance(config, SchedulerConfig):
      raise InvalidArgument(f"config must be a SchedulerConfig, got {type(config).__name__}")
    if config.stats_budget is not None:
      raise InvalidArgument("SchedulerConfig.stats_budget paces the figures by wall-clock "
                            "time, which differs per process: use stats_every in lockstep")
    if config.preemption == "swap" and not _pages_addressable(pool):
      raise InvalidArgument("swap preemption copies a sequence's K/V to this host, but the "
                            "pages are spread over processes: use preemption='recompute'")
    self.channel = channel
    self.clock = StepClock()
    self._leader_clock = leader_clock
    self._check_plans = bool(check_plans)
    inner = _AgreedExecutor(executor, self) if check_plans else executor
    self.scheduler = Scheduler(pool, inner, config, clock=self.clock, **scheduler_kwargs)
    self.step_index = 0
    self.closed = False
    self._failed = False
    pc = self.scheduler.pool.config
    self._guard(lambda: channel.agree("setup", digest(
        jax.__version__, _library_version(), os.environ.get("PYTHONHASHSEED"), repr(config),
        repr(pc), jax.device_count(), channel.group.num_processes,
        type(executor).__name__)))

  @property
  def done(self) -> bool:
    """The leader closed the arrivals and every request finished."""
    return self.closed and self.scheduler.idle

  def step(self, arrivals: Sequence[Request] = (), aborts: Sequence[Hashable] = (), *,
           closed: bool = False) -> LockstepResult:
    """One step on every process; `arrivals`, `aborts` and `closed` are the leader's
    (empty elsewhere). Raises `ScheduleDiverged`, `PeerFailed`, `PeerTimeout`, or
    `InvalidArgument` for arrivals off the leader or after it closed them."""
    payload = self._payload(arrivals, aborts, closed)  # a caller's mistake stops nothing
    return self._guard(lambda: self._step(payload))

  def serve(self, arrivals: Callable[[int], Sequence[Request] | None] | None = None, *,
            max_steps: int | None = None,
            on_result: Callable[[LockstepResult], None] | None = None) -> list[Request]:
    """Steps until the leader's arrivals are exhausted and every request finished.

    `arrivals(step) -> requests` (None once no more will come) on the leader, None
    elsewhere. Returns the requests finished during the call, in order.
    """
    if arrivals is not None and not self.channel.group.is_leader:
      raise InvalidArgument("only the leader has arrivals (pass None elsewhere)")
    finished: list[Request] = []
    n = 0
    while not self.done and (max_steps is None or n < max_steps):
      new: Sequence[Request] = ()
      closed = False
      if arrivals is not None and not self.closed:
        got = arrivals(self.step_index)
        closed = got is None
        new = () if got is None else got
      result = self.step(new, closed=closed)
      finished.extend(result.finished)
      if on_result is not None:
        on_result(result)
      n += 1
    return finished

  # -- internals ------------------------------------------------------------------
  def _guard(self, fn):
    try:
      return fn()
    except BaseException as exc:
      self.channel.report_failure(exc)
      raise

  def _payload(self, arrivals, aborts, closed: bool) -> str | None:
    """The leader's broadcast of this step (None elsewhere), after checking the arguments."""
    group = self.channel.group
    if not group.is_leader:
      if arrivals or aborts or closed:
        raise InvalidArgument(f"process {group.process_id} is not the leader: arrivals, "
                              f"aborts and closed come from the leader's broadcast")
      return None
    if self.closed and arrivals:
      raise InvalidArgument("the leader closed the arrivals; no more requests")
    return _encode_json({
        "step": self.step_index, "time": float(self._leader_clock()),
        "closed": bool(closed or self.closed),
        "requests": [encode_request(r) for r in arrivals],
        "aborts": [_encode_key(a) for a in aborts]})

  def _step(self, payload: str | None) -> LockstepResult:
    t0 = time.perf_counter()
    wait0 = self.channel.wait_seconds
    group = self.channel.group
    msg = _decode_json(self.channel.broadcast(payload, label=f"arrivals {self.step_index}"))
    if msg["step"] != self.step_index:
      raise ScheduleDiverged("arrivals", self.step_index,
                             {0: str(msg["step"]), group.process_id: str(self.step_index)})
    self.clock.now = msg["time"]
    self.closed = msg["closed"]
    sched = self.scheduler
    rejected = []
    for key in msg["aborts"]:
      rid = _decode_key(key)
      try:
        sched.abort(rid)
      except PagedKVError as e:
        rejected.append((rid, f"{type(e).__name__}: {e}"))
    for d in msg["requests"]:
      req = decode_request(d)
      try:
        sched.submit(req)
      except PagedKVError as e:
        rejected.append((req.request_id, f"{type(e).__name__}: {e}"))
    sched.step()
    finished = tuple(sched.take_finished())
    self.channel.agree("step", self._outcome_digest(finished, rejected), step=self.step_index)
    result = LockstepResult(step=self.step_index, finished=finished, rejected=tuple(rejected),
                            done=self.done, seconds=time.perf_counter() - t0,
                            wait_seconds=self.channel.wait_seconds - wait0)
    self.step_index += 1
    return result

  def _outcome_digest(self, finished, rejected) -> str:
    sched = self.scheduler
    return digest(
        self.step_index,
        [(r.request_id, r.stop_reason, tuple(r.output)) for r in finished],
        [(r.request_id, r.seq_id, r.num_cached, len(r.output), r.output[-1] if r.output else -1)
         for r in sched.running],
        [r.request_id for r in sched.waiting], [r.request_id for r in sched.swapped],
        sched.pool.num_free_blocks, rejected)


def _encode_json(obj) -> str:
  return json.dumps(obj, separators=(",", ":"))


def _decode_json(text: str):
  return json.loads(text)


def _library_version() -> str:
  try:
    import paged_kv  # pylint: disable=g-import-not-at-top
    return str(getattr(paged_kv, "__version__", "?"))
  except ImportError:  # pragma: no cover
    return "?"
