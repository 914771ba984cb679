"""One data-parallel replica: a `Scheduler` on its own pool, served over a pipe.

`serve` runs in each process `paged_kv.cluster.replicas` spawns; `ReplicaSpec`,
`ReplicaRequest` and `ReplicaResult` are the picklable data the two sides exchange.
`ReplicaServer` answers the commands (tests drive it in-process, no pipe); each reply
is `("ok", value)` or `("error", text)`:

  * `("advance", now_s, max_steps[, namespace, tokens])` (trace clock): steps until
    the clock reaches `now_s` or `max_steps` ran -> `(reached, results, probe)`.
  * `("probe", namespace, tokens)`: a read-only match -> `(matched, backlog_tokens)`.
  * `("submit", request)` -> None, or a `"rejected"` `ReplicaResult`.
  * `("drain", max_steps)` -> `(idle, results)`.
  * `("stats",)` -> `SchedulerStats` fields and `pid`; `("stop",)` -> None, then exit.

`advance` and `drain` hand over every result since the last of them. Backlog: prompt
tokens not yet computed plus `output_weight` times the output tokens still to come.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np

from paged_kv.core.config import PoolConfig
from paged_kv.core.errors import InvalidArgument, PoolExhausted
from paged_kv.scheduler.executor import DryExecutor, Executor
from paged_kv.scheduler.scheduler import Request, Scheduler, SchedulerConfig

__all__ = ["CLOCKS", "ReplicaRequest", "ReplicaResult", "ReplicaServer", "ReplicaSpec",
           "TinyLlamaFactory", "backlog_tokens", "serve"]

CLOCKS = ("trace", "wall")
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


@dataclasses.dataclass(frozen=True)
class ReplicaSpec:
  """How one replica process builds its scheduler (picklable: it crosses a spawn).

  Attributes:
    executor_factory: `f(pool_config) -> Executor`, picklable (e.g.
      `TinyLlamaFactory`); None: a `DryExecutor` (memory dynamics only).
    clock: `"trace"` (driven by `advance`) or `"wall"` (`time.monotonic`).
    step_s: trace seconds per scheduler step (trace clock).
    output_weight: backlog per output token still to generate, in prompt tokens;
      0 by default, since a continuous-batching replica decodes its batch in
      parallel (docs/scaling.md).
    compile_cache_dir: JAX's persistent compilation cache for the process (None: off).
  """

  pool_config: PoolConfig
  scheduler_config: SchedulerConfig = SchedulerConfig()
  executor_factory: Callable[[PoolConfig], Executor] | None = None
  clock: str = "trace"
  step_s: float = 0.05
  output_weight: float = 0.0
  warmup: bool = True
  compile_cache_dir: str | None = None

  def __post_init__(self):
    if not isinstance(self.pool_config, PoolConfig):
      raise InvalidArgument(f"ReplicaSpec.pool_config must be a PoolConfig, got "
                            f"{type(self.pool_config).__name__}")
    if not isinstance(self.scheduler_config, SchedulerConfig):
      raise InvalidArgument(f"ReplicaSpec.scheduler_config must be a SchedulerConfig, got "
                            f"{type(self.scheduler_config).__name__}")
    if self.scheduler_config.max_batch > self.pool_config.max_seqs:
      raise InvalidArgument(f"ReplicaSpec: max_batch {self.scheduler_config.max_batch} is "
                            f"above the pool's max_seqs {self.pool_config.max_seqs}")
    if self.clock not in CLOCKS:
      raise InvalidArgument(f"ReplicaSpec.clock must be one of {CLOCKS}, got {self.clock!r}")
    if not self.step_s > 0:
      raise InvalidArgument(f"ReplicaSpec.step_s must be > 0, got {self.step_s!r}")
    if not self.output_weight >= 0:
      raise InvalidArgument(f"ReplicaSpec.output_weight must be >= 0, got "
                            f"{self.output_weight!r}")
    if self.executor_factory is not None and not callable(self.executor_factory):
      raise InvalidArgument("ReplicaSpec.executor_factory must be callable or None")


@dataclasses.dataclass(frozen=True)
class TinyLlamaFactory:
  """A `ReplicaSpec.executor_factory`: a `ModelExecutor` over `llama.TinyLlama`.

  Every replica gets the same weights (`nnx.Rngs(seed)`), so greedy tokens do not
  depend on the replica. `model_config` must match the pool's shape.
  """

  model_config: Any
  seed: int = 0

  def __call__(self, pool_config: PoolConfig) -> Executor:
    from paged_kv.model import llama  # pylint: disable=g-import-not-at-top
    from paged_kv.model.nnx_import import nnx  # pylint: disable=g-import-not-at-top
    from paged_kv.scheduler.executor import ModelExecutor  # pylint: disable=g-import-not-at-top
    return ModelExecutor(llama.TinyLlama(self.model_config, rngs=nnx.Rngs(self.seed)),
                         pool_config)


@dataclasses.dataclass(frozen=True)
class ReplicaRequest:
  """One request as the front end routes it.

  Attributes:
    request_id: unique among the requests of one `ReplicaSet`.
    prompt: i32[n] prompt tokens (n >= 1).
    arrival_s: trace seconds with the trace clock; non-decreasing.
    forced_output: optional i32[max_new_tokens] tokens to emit instead of samples
      (trace replay, where only lengths are known).
  """

  request_id: Hashable
  prompt: np.ndarray
  max_new_tokens: int
  namespace: Hashable = "default"
  arrival_s: float = 0.0
  forced_output: np.ndarray | None = None

  def __post_init__(self):
    prompt = np.asarray(self.prompt)
    if prompt.ndim != 1 or prompt.size < 1 or not np.issubdtype(prompt.dtype, np.integer):
      raise InvalidArgument(f"request {self.request_id!r}: prompt must be a non-empty 1-D "
                            f"integer array, got shape {prompt.shape} {prompt.dtype}")
    object.__setattr__(self, "prompt", prompt.astype(np.int32, copy=False))
    if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens,
                                                               (int, np.integer)):
      raise InvalidArgument(f"request {self.request_id!r}: max_new_tokens must be an int")
    if self.max_new_tokens < 1:
      raise InvalidArgument(f"request {self.request_id!r}: max_new_tokens must be >= 1, got "
                            f"{self.max_new_tokens}")


@dataclasses.dataclass(frozen=True)
class ReplicaResult:
  """A finished request, as its replica reported it.

  Attributes:
    hit_tokens: prompt tokens served from that replica's prefix cache (at its
      first admission there).
    output: i32[k] the tokens it emitted.
    stop_reason: a `Request.stop_reason`, or `"rejected"` (it can never fit the
      replica's pool; nothing ran).
    reroutes: times the front end re-routed it off a replica that went down.
  """

  request_id: Hashable
  replica: int
  prompt_tokens: int
  hit_tokens: int
  output: np.ndarray
  stop_reason: str
  num_preemptions: int = 0
  reroutes: int = 0


def backlog_tokens(scheduler: Scheduler, output_weight: float) -> float:
  """Queued work in tokens: uncomputed prompt tokens + weighted outputs still to come."""
  total = 0.0
  for r in itertools.chain(scheduler.waiting, scheduler.running, scheduler.swapped):
    total += max(0, int(r.prompt.size) - r.num_cached)
    total += output_weight * max(0, r.max_new_tokens - len(r.output))
  return total


class ReplicaServer:
  """A `Scheduler` on its own pool, answering the commands of the module docstring."""

  def __init__(self, spec: ReplicaSpec, index: int):
    from paged_kv.pool.block_pool import BlockPool  # pylint: disable=g-import-not-at-top
    self.spec = spec
    self.index = index
    self.now_s = 0.0
    factory = spec.executor_factory
    executor = factory(spec.pool_config) if factory is not None else DryExecutor(
        spec.pool_config)
    clock = (lambda: self.now_s) if spec.clock == "trace" else time.monotonic
    self.scheduler = Scheduler(BlockPool(spec.pool_config), executor, spec.scheduler_config,
                               clock=clock)
    if spec.warmup:
      self.scheduler.warmup(progress=False, persistence=False)
    self._pending: list[ReplicaResult] = []

  # ------------------------------------------------------------------ commands
  def handle(self, message: tuple) -> Any:
    """Runs one command; returns its value (raises on a bad command)."""
    name, args = message[0], message[1:]
    if name == "advance":
      return self.advance(*args)
    if name == "probe":
      return self.probe(*args)
    if name == "submit":
      return self.submit(*args)
    if name == "drain":
      return self.drain(*args)
    if name == "stats":
      return self.stats()
    raise InvalidArgument(f"unknown replica command {name!r}")

  def advance(self, now_s: float, max_steps: int, namespace: Hashable | None = None,
              tokens: np.ndarray | None = None) -> tuple[bool, list[ReplicaResult], Any]:
    """Trace clock: steps until the clock reaches `now_s` (or `max_steps` steps), then
    probes when given a namespace. Returns `(reached, results, probe or None)`."""
    if self.spec.clock != "trace":
      raise InvalidArgument("advance needs the trace clock")
    steps = 0
    while self.now_s < now_s:
      if self.scheduler.idle:
        self.now_s = float(now_s)
        break
      if steps >= max_steps:
        return False, self.take_results(), None
      self._step()
      steps += 1
    probe = self.probe(namespace, tokens) if namespace is not None else None
    return True, self.take_results(), probe

  def probe(self, namespace: Hashable, tokens: np.ndarray | None) -> tuple[int, float]:
    """(cached prefix of `tokens`, read-only; backlog in tokens)."""
    cache = self.scheduler.cache
    matched = 0
    if tokens is not None and cache is not None:
      matched = int(cache.match(namespace, tokens, lock=False, record=False).length)
    return matched, backlog_tokens(self.scheduler, self.spec.output_weight)

  def submit(self, request: ReplicaRequest) -> ReplicaResult | None:
    """Queues `request`; its rejected result when it can never fit the pool."""
    req = Request(request.request_id, request.prompt, request.max_new_tokens,
                  namespace=request.namespace, arrival=request.arrival_s,
                  forced_output=request.forced_output)
    try:
      self.scheduler.submit(req)
    except PoolExhausted:
      return ReplicaResult(request.request_id, self.index, int(request.prompt.size), 0,
                           np.zeros(0, np.int32), "rejected")
    return None

  def drain(self, max_steps: int) -> tuple[bool, list[ReplicaResult]]:
    """Steps until idle or `max_steps` steps (wall clock: the loop steps; this collects)."""
    if self.spec.clock == "trace":
      for _ in range(max_steps):
        if self.scheduler.idle:
          break
        self._step()
    return self.scheduler.idle, self.take_results()

  def stats(self) -> dict:
    """The scheduler's counters as a dict, plus this process's pid."""
    out = dataclasses.asdict(self.scheduler.stats)
    out["pid"] = os.getpid()
    out["now_s"] = self.now_s
    return out

  # ------------------------------------------------------------------ stepping
  @property
  def busy(self) -> bool:
    return not self.scheduler.idle

  def step_once(self) -> None:
    """One scheduler step (the wall-clock loop calls it between commands)."""
    self._step()

  def _step(self) -> None:
    if self.spec.clock == "trace":
      self.now_s += self.spec.step_s
    self.scheduler.step()
    for req in self.scheduler.take_finished():
      self._pending.append(ReplicaResult(
          req.request_id, self.index, int(req.prompt.size), int(req.hit_tokens),
          np.asarray(req.output, np.int32), req.stop_reason, int(req.num_preemptions)))

  def take_results(self) -> list[ReplicaResult]:
    """The results finished since the last call, handed over."""
    out, self._pending = self._pending, []
    return out


# ---------------------------------------------------------------------- process
def _die_with_parent() -> None:
  """Linux: the kernel sends SIGKILL to this process when its parent dies."""
  if not sys.platform.startswith("linux"):
    return
  try:
    import ctypes  # pylint: disable=g-import-not-at-top
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
  except (OSError, AttributeError):
    return


def serve(conn, spec: ReplicaSpec, index: int, parent_pid: int) -> None:
  """The replica process: builds a `ReplicaServer`, then answers commands on `conn`.

  Exits on `stop`, when the pipe closes, or (Linux) when the parent dies. A build
  error is sent instead of `("ready", pid)`; a command's error is its reply.
  """
  _die_with_parent()
  if os.getppid() != parent_pid:  # the parent died before the line above
    return
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop
  try:
    if spec.compile_cache_dir:
      from paged_kv.runtime import compile_cache  # pylint: disable=g-import-not-at-top
      compile_cache.enable_compilation_cache(spec.compile_cache_dir)
    server = ReplicaServer(spec, index)
  except BaseException:  # pylint: disable=broad-except
    conn.send(("error", traceback.format_exc()))
    conn.close()
    return
  conn.send(("ready", os.getpid()))
  step_error = None  # a wall-clock step that raised: the next reply says so
  while True:
    try:
      if server.busy and spec.clock == "wall" and step_error is None and not conn.poll(0):
        try:
          server.step_once()
        except Exception:  # pylint: disable=broad-except
          step_error = traceback.format_exc()
        continue
      message = conn.recv()
    except (EOFError, OSError):  # the parent closed its end (or died)
      return
    if message[0] == "stop":
      conn.send(("ok", None))
      conn.close()
      return
    try:
      if step_error is not None:
        reply, step_error = ("error", step_error), None
      else:
        reply = ("ok", server.handle(message))
    except Exception:  # pylint: disable=broad-except
      reply = ("error", traceback.format_exc())
    try:
      conn.send(reply)
    except (BrokenPipeError, OSError):
      return
