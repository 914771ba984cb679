"""A small real serving run (DryExecutor: memory dynamics, no math) for telemetry tests.

Under pressure on purpose: preemptions, evictions, prefix-cache hits, compaction,
two namespaces; every step reports to the callbacks given.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import urllib.request

import paged_kv
from paged_kv.core import compact
from paged_kv.telemetry import export
from paged_kv.scheduler.scheduler import DryExecutor, Request, Scheduler, SchedulerConfig
from paged_kv.sim.workload import ChatShape, ChatWorkload

CFG = paged_kv.PoolConfig(num_blocks=64, block_size=4, num_layers=1, num_kv_heads=1,
                          head_dim=2, max_seqs=8, max_segments=40)


def workload(seed: int = 0, n: int = 24, shared: int = 10) -> list[Request]:
  """Requests sharing a system prompt, in two namespaces, with forced outputs."""
  shape = ChatShape(system_len=shared, own_lens=(1, 30), output_lens=(1, 30), vocab=(0, 100),
                    forced_len=30)
  return ChatWorkload(shape, seed).requests(n, namespaces=("tenant-0", "tenant-1"))


def make_scheduler(preemption: str = "swap", clock=None, **config) -> Scheduler:
  """A scheduler on a fresh small pool; a fake clock advancing 10 ms per call by default."""
  if clock is None:
    ticks = itertools.count()
    clock = lambda: next(ticks) * 0.01  # pylint: disable=unnecessary-lambda-assignment
  defaults = dict(max_batch=8, prefill_chunk=16, prefill_token_budget=32, preemption=preemption,
                  output_reserve_ratio=0.0, snapshot_every=5,
                  compaction=compact.CompactionPolicy(threshold=0.2, budget=8))
  defaults.update(config)
  pool = paged_kv.BlockPool(CFG)
  return Scheduler(pool, DryExecutor(CFG), SchedulerConfig(**defaults), clock=clock)


def run(sched: Scheduler, reqs=None, limit: int = 3000) -> Scheduler:
  """Submits `reqs` (default `workload()`) and steps until idle."""
  for r in workload() if reqs is None else reqs:
    sched.submit(r)
  steps = 0
  while not sched.idle:
    sched.step()
    steps += 1
    assert steps < limit, "scheduler made no progress"
  return sched


def fetch(url: str) -> tuple[str, str]:
  """`(body, content type)` of an HTTP GET."""
  with urllib.request.urlopen(url, timeout=5) as resp:
    assert resp.status == 200, resp.status
    return resp.read().decode("utf-8"), resp.headers.get("Content-Type", "")


@functools.cache
def served_run():
  """One real dry-run scheduler with an exporter attached, served over HTTP on
  127.0.0.1 and scraped at the end: `(scheduler, exporter, exposition text, reports)`.
  Cached: the tests of a process share it (the compile is most of its time)."""
  sched = make_scheduler()
  reports = []

  def keep(report):  # `stats` is a live object: keep copies
    reports.append(dataclasses.replace(report, stats=copy.deepcopy(report.stats)))

  sched.on_step = keep  # an existing callback: attach must chain it
  exporter = export.MetricsExporter(port=0, model="tiny-llama", replica="r1").start()
  exporter.attach(sched)
  run(sched)
  text, ctype = fetch(exporter.url)
  assert "text/plain" in ctype, ctype
  exporter.stop()
  return sched, exporter, text, tuple(reports)
