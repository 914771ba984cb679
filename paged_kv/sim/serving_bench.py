"""Serving measurements shared by `benchmarks/bench_serving.py` and `tools/gpu_check.sh`.

A closed-loop run of a `workload.Workload` through a warm scheduler
(`run_closed_loop`), the bandwidth floor of a decode step (`weight_bytes_per_step`,
`kv_bytes_per_token`, `copy_rate`), the device's own decode and prefill steps without a scheduler
(`device_step`, `prefill_step`), and served tokens against a reference
(`compare_with_reference`).

Definitions (those of vLLM's serving benchmark): output tokens/s = output
tokens / wall time of the run; TTFT = first token - submit; TPOT = (last token -
first token) / (output tokens - 1); times on the scheduler's clock.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any
import dataclasses
import math
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import paged_kv
from paged_kv.core.config import PoolConfig
from paged_kv.runtime import counters
from paged_kv.scheduler.executor import ModelExecutor
from paged_kv.scheduler.scheduler import Request, Scheduler, SchedulerConfig
from paged_kv.sim.workload import Workload


def serving_pool_config(model_config, *, max_batch: int, max_seq_len: int,
                        block_size: int = 16, num_blocks: int = 0) -> PoolConfig:
  """A pool for `max_batch` sequences of up to `max_seq_len` tokens (`num_blocks` 0:
  twice what they can hold at once, the rest for the prefix cache)."""
  from paged_kv.model import llama  # pylint: disable=import-outside-toplevel
  blocks_per_seq = -(-max_seq_len // block_size)
  return llama.pool_config_for(
      model_config, block_size=block_size,
      num_blocks=num_blocks or 2 * max_batch * blocks_per_seq + 1, max_seqs=max_batch,
      max_segments=blocks_per_seq + 2, base_pool_fraction=0.0)


def build_scheduler(executor: ModelExecutor, pool_config: PoolConfig,
                    config: SchedulerConfig) -> Scheduler:
  """A scheduler over a fresh pool; `executor` may be shared by several (it holds no pool)."""
  return Scheduler(paged_kv.BlockPool(pool_config), executor, config)


@dataclasses.dataclass
class RunResult:
  """One closed-loop run.

  Attributes:
    wall_s: from the first submit to the last token.
    step_s: wall seconds of every `Scheduler.step()`.
    ttft_s, tpot_s: per request (TPOT for requests of >= 2 tokens).
    host_reads, dispatches: blocking device reads and bookkeeping dispatches.
  """

  batch: int
  requests: int
  output_tokens: int
  wall_s: float
  step_s: list[float]
  ttft_s: list[float]
  tpot_s: list[float]
  compiles: int
  host_reads: int
  dispatches: int
  outputs: list[list[int]]

  @property
  def tokens_per_s(self) -> float:
    return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

  def figures(self) -> dict:
    """TTFT, TPOT and step percentiles in ms, tokens/s and the counts, for a table or record."""
    pct = lambda xs, q: 1e3 * float(np.percentile(xs, q)) if xs else float("nan")
    return dict(batch=self.batch, requests=self.requests, output_tokens=self.output_tokens,
                wall_s=self.wall_s, tokens_per_s=self.tokens_per_s, steps=len(self.step_s),
                ttft_p50_ms=pct(self.ttft_s, 50), ttft_p99_ms=pct(self.ttft_s, 99),
                tpot_p50_ms=pct(self.tpot_s, 50), tpot_p99_ms=pct(self.tpot_s, 99),
                step_p50_ms=pct(self.step_s, 50), step_p90_ms=pct(self.step_s, 90),
                compiles=self.compiles, host_reads_per_step=self.host_reads / max(
                    1, len(self.step_s)),
                dispatches_per_step=self.dispatches / max(1, len(self.step_s)))


def run_closed_loop(sched: Scheduler, workload: Workload, batch: int, *,
                    first_id: int = 0) -> RunResult:
  """Serves `workload` keeping `batch` requests in the scheduler (waiting or running):
  each finished request is replaced by the next one before the following step.
  Request ids are `first_id + i` (unique per scheduler across runs)."""
  reqs = [Request(first_id + i, p, o) for i, (p, o) in
          enumerate(zip(workload.prompts, workload.output_lens))]
  pending = collections.deque(reqs)
  steps: list[float] = []
  runtime0, compiles0 = sched.runtime, counters.backend_compiles()
  t0 = time.perf_counter()
  while pending or not sched.idle:
    while pending and len(sched.running) + len(sched.waiting) + len(sched.swapped) < batch:
      sched.submit(pending.popleft())
    ts = time.perf_counter()
    sched.step()
    steps.append(time.perf_counter() - ts)
    sched.take_finished()
  wall = time.perf_counter() - t0
  traffic = sched.runtime.since(runtime0)
  ttft = [r.first_token_time - r.submit_time for r in reqs]
  tpot = [(r.last_token_time - r.first_token_time) / (len(r.output) - 1)
          for r in reqs if len(r.output) > 1]
  return RunResult(batch=batch, requests=len(reqs),
                   output_tokens=sum(len(r.output) for r in reqs), wall_s=wall, step_s=steps,
                   ttft_s=ttft, tpot_s=tpot, compiles=counters.backend_compiles() - compiles0,
                   host_reads=traffic.num_host_reads,
                   dispatches=traffic.bookkeeping_dispatches,
                   outputs=[[int(t) for t in r.output] for r in reqs])


def warm_run(sched: Scheduler, workload: Workload, batch: int, *, first_id: int,
             output_len: int = 4) -> None:
  """An untimed run of `min(batch, len(workload))` requests of `output_len` tokens."""
  n = min(batch, len(workload))
  short = Workload(workload.prompts[:n], (output_len,) * n, workload.source)
  run_closed_loop(sched, short, batch, first_id=first_id)


# Bandwidth floor -------------------------------------------------------------------------


def weight_bytes_per_step(model) -> int:
  """Bytes of parameters a decode step reads: all of them, but an untied input
  embedding (the step gathers a row per token from it)."""
  from paged_kv.model.nnx_import import nnx  # pylint: disable=import-outside-toplevel
  state = nnx.state(model, nnx.Param)
  total = sum(x.nbytes for x in jax.tree.leaves(state))
  if not model.config.tie_embeddings:
    total -= model.embed.embedding[...].nbytes
  return int(total)


def kv_bytes_per_token(pool_config: PoolConfig) -> int:
  """Bytes of K and V of one token, all layers."""
  return int(2 * pool_config.num_layers * pool_config.num_kv_heads * pool_config.head_dim
             * jnp.dtype(pool_config.dtype).itemsize)


def decode_step_bytes(weight_bytes: int, kv_per_token: int, batch: int,
                      mean_context: float) -> int:
  """Bytes one decode step of `batch` rows reads at `mean_context` tokens each."""
  return int(weight_bytes + batch * mean_context * kv_per_token)


def copy_rate(nbytes: int, *, repeats: int = 10, calls: int = 5) -> float:
  """Bytes/s of a device copy (`x + 1` on bf16) moving `nbytes` (read + written):
  the median of `repeats` timings of `calls` chained calls."""
  n = max(1, nbytes // 4)
  fn = jax.jit(lambda x: x + jnp.ones((), x.dtype))
  x = jax.block_until_ready(jnp.zeros((n,), jnp.bfloat16))
  x = jax.block_until_ready(fn(x))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    for _ in range(calls):
      x = fn(x)
    jax.block_until_ready(x)
    times.append((time.perf_counter() - t0) / calls)
  return 4 * n / statistics.median(times)


def device_step_seconds(model, prompts, *, block_size: int = 16, steps_per_call: int = 16,
                        calls: int = 4, prefill_chunk: int = 512,
                        impl: str | None = None) -> float:
  """Seconds per decode step of the batch `prompts` through `PagedRunner.decode`,
  `steps_per_call` steps per jitted call (`decode_multi`), on a pool of
  `len(prompts)` rows: one untimed call (it compiles), then `calls` timed ones."""
  return device_step(model, prompts, block_size=block_size, steps_per_call=steps_per_call,
                     calls=calls, prefill_chunk=prefill_chunk, impl=impl).seconds


@dataclasses.dataclass(frozen=True)
class DeviceStep:
  """`device_step`'s result: seconds per decode step, and with `profile=True` the
  per-op `OpProfile` of one more call (per-run figures are per step), or why the
  profiler failed (`ops_error`)."""
  seconds: float
  ops: Any = None
  ops_error: str | None = None

  def ops_summary(self, per: str) -> str:
    """`ops.summary(per=per)`, or what kept the profile from being taken."""
    if self.ops is not None:
      return self.ops.summary(per=per)
    return f"no per-op profile: {self.ops_error or 'not asked'}"


def _profiled(fn: Callable[[], Any], *, runs: int) -> tuple[Any, str | None]:
  """`(OpProfile of fn() with `runs` steps, None)`, or `(None, why)` when JAX's profiler
  cannot trace here (a timing must not be lost to it)."""
  from paged_kv.runtime import op_profile  # pylint: disable=import-outside-toplevel
  try:
    return dataclasses.replace(op_profile.profile_ops(fn), runs=runs), None
  except Exception as err:  # pylint: disable=broad-except  (reported beside the timing)
    return None, f"{type(err).__name__}: {err}"


def device_step(model, prompts, *, block_size: int = 16, steps_per_call: int = 16,
                calls: int = 4, prefill_chunk: int = 512, impl: str | None = None,
                profile: bool = False) -> DeviceStep:
  """`device_step_seconds`, plus with `profile` one more call traced per op."""
  from paged_kv.model.runner import PagedRunner  # pylint: disable=import-outside-toplevel
  budget = steps_per_call * (calls + 1 + int(profile)) + 1
  pool_config = serving_pool_config(model.config, max_batch=len(prompts),
                                    max_seq_len=max(map(len, prompts)) + budget,
                                    block_size=block_size)
  runner = PagedRunner(model, pool_config, prefill_chunk=prefill_chunk, impl=impl)
  seqs = [runner.open(p, max_new_tokens=budget) for p in prompts]
  runner.prefill(seqs)
  runner.decode(seqs, num_tokens=steps_per_call, steps_per_call=steps_per_call)
  jax.block_until_ready(runner.state)
  t0 = time.perf_counter()
  runner.decode(seqs, num_tokens=steps_per_call * calls, steps_per_call=steps_per_call)
  jax.block_until_ready(runner.state)
  seconds = (time.perf_counter() - t0) / (steps_per_call * calls)
  if not profile:
    return DeviceStep(seconds)

  def one_call():
    runner.decode(seqs, num_tokens=steps_per_call, steps_per_call=steps_per_call)
    return runner.state
  return DeviceStep(seconds, *_profiled(one_call, runs=steps_per_call))


def prefill_step(model, prompt_len: int, *, vocab: int, block_size: int = 16,
                 impl: str | None = None, seed: int = 0) -> DeviceStep:
  """Seconds of one prefill chunk of `prompt_len` tokens on an empty row, after an
  untimed compile call, then one profiled call; the timing includes the next token's read."""
  from paged_kv.model.runner import PagedRunner  # pylint: disable=import-outside-toplevel
  pool_config = serving_pool_config(model.config, max_batch=1, max_seq_len=prompt_len + 1,
                                    block_size=block_size, num_blocks=-(-(prompt_len + 1) //
                                                                        block_size) + 1)
  runner = PagedRunner(model, pool_config, prefill_chunk=prompt_len, impl=impl)
  rng = np.random.default_rng(seed)

  def one() -> Any:
    seq = runner.open(rng.integers(0, vocab, prompt_len).tolist(), max_new_tokens=0)
    runner.prefill([seq])
    runner.release([seq])
    return runner.state

  jax.block_until_ready(one())
  t0 = time.perf_counter()
  jax.block_until_ready(one())
  seconds = time.perf_counter() - t0
  return DeviceStep(seconds, *_profiled(one, runs=1))


def ceiling(tokens_per_s: float, step_bytes: int, rate: float, batch: int) -> tuple[float, float]:
  """`(ceiling tokens/s, share of it reached)`: `batch` tokens per decode step that
  reads `step_bytes` at `rate` bytes/s."""
  floor_s = step_bytes / rate
  top = batch / floor_s
  return top, (tokens_per_s / top if top > 0 else math.nan)


def compare_with_reference(ref, prompts: dict, output_lens: dict, outputs: dict, *,
                           tie_tolerance: float = 0.1, batch_size: int = 64
                           ) -> tuple[dict, float]:
  """Served outputs against `ref` (`hf_reference.Reference` or the same interface).

  `prompts` and `output_lens` map a prompt set to its lists; `outputs` maps
  `(prompt set, label)` to served outputs for the set's first prompts.
  `tie_tolerance` is in standard deviations of the position's logits. Returns
  `({(prompt set, label): verdict}, reference tokens/s)`; a verdict counts greedy
  `equal` requests and teacher-forced `tokens_off`, with the first 8 differences.
  """
  from paged_kv.model import hf_reference  # pylint: disable=import-outside-toplevel
  sizes = {p: max((len(o) for (q, _), o in outputs.items() if q == p), default=0)
           for p in prompts}
  flat = [x for p in prompts for x in prompts[p][:sizes[p]]]
  lens = [x for p in prompts for x in output_lens[p][:sizes[p]]]
  greedy = ref.greedy(flat, lens, batch_size=batch_size)
  theirs, at = {}, 0
  for p in prompts:
    theirs[p] = greedy.outputs[at:at + sizes[p]]
    at += sizes[p]
  verdicts = {}
  for (p, label), ours in outputs.items():
    equal, diffs = hf_reference.compare(ours, theirs[p][:len(ours)])
    check = ref.check(prompts[p][:len(ours)], ours, tie_tolerance=tie_tolerance)
    verdicts[p, label] = dict(compared=len(ours), equal=equal, first_diffs=diffs[:8],
                              tokens=check.tokens, tokens_off=len(check.off),
                              off=check.off[:8])
  return verdicts, sum(lens) / max(greedy.seconds, 1e-9)
