"""Metrics export: a Prometheus exporter and a JSONL logger for a serving run.

  exporter = MetricsExporter(port=0, model="tiny", replica="0").start()  # paged-kv[metrics]
  with JsonlLogger("run/metrics.jsonl") as log:
    exporter.events = log                 # alerts are written to the JSONL as they fire
    exporter.attach(sched)                # sched.on_step -> exporter.observe(report)
    sched.run()

Names follow vLLM's where the concept is vLLM's (`paged_kv_kv_cache_usage_perc`),
else `paged_kv_` with Prometheus' unit suffixes (`docs/metrics.md`). Cumulative
totals become counters by their increments, so a counter never goes down.
`JsonlLogger` and `read_jsonl` need no prometheus_client.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TextIO

import numpy as np

from paged_kv.core.errors import OOM_REASONS
from paged_kv.runtime import counters as runtime_counters

PREFIX = "paged_kv_"

# Latency buckets (seconds), 1 ms .. 20 min: CPU steps (tens of ms to seconds), GPU
# steps (a few ms) and first tokens behind a long queue (a loaded demo's p99 was 74 s)
# all land inside the range, so a p99 never sticks at the top bucket.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5,
                   0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0,
                   1200.0)
# Host time of one scheduler step (seconds), 100 us .. 10 s.
STEP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                0.5, 1.0, 2.5, 5.0, 10.0)

# Our `Request.stop_reason` -> vLLM's `finished_reason` label value ("stop" is a
# stop token; the others keep their own name).
FINISHED_REASONS = {"length": "length", "stop_token": "stop", "table_full": "table_full",
                    "abort": "abort"}
PREEMPTION_MODES = ("recompute", "swap")
OTHER_NAMESPACE = "other"  # the namespace label beyond `max_namespaces` distinct values


def alert_rules() -> tuple[tuple[str, str], ...]:
  """`(alert name, severity)` of every `check_alerts` rule; exported as 0 until they fire."""
  from paged_kv.telemetry import metrics  # pylint: disable=import-outside-toplevel
  rules = metrics.ALERT_RULES
  return tuple((r[0], r[1]) for r in rules)


# PoolConfig fields carried by `paged_kv_cache_config_info`.
_CACHE_CONFIG_FIELDS = ("num_blocks", "block_size", "num_layers", "num_kv_heads", "head_dim",
                        "dtype", "max_seqs", "max_segments", "base_pool_fraction")


def _prometheus():
  """Imports `prometheus_client`, or raises an ImportError naming the extra."""
  try:
    import prometheus_client  # pylint: disable=import-outside-toplevel
  except ImportError as err:
    raise ImportError(
        "paged_kv.telemetry.export.MetricsExporter needs the optional dependency "
        "'prometheus-client'; install it with: pip install 'paged-kv[metrics]'") from err
  return prometheus_client


_TYPED_MARKERS = ("str:", "int:", "bytes:", "tuple:")


def namespace_label(namespace: Any) -> str:
  """A typed namespace key as a label value, one to one: distinct keys never share a label.

  A `str` is itself unless it starts with a type marker or is `"other"` (then
  `"str:"` + it); `1` is `"int:1"`, `b"1"` `"bytes:31"`, a tuple `"tuple:"` + a
  JSON list of its parts' labels.
  """
  if isinstance(namespace, str):
    if namespace == OTHER_NAMESPACE or namespace.startswith(_TYPED_MARKERS):
      return "str:" + namespace
    return namespace
  if isinstance(namespace, bytes):
    return "bytes:" + namespace.hex()
  if isinstance(namespace, tuple):
    return "tuple:" + json.dumps([namespace_label(p) for p in namespace],
                                 separators=(",", ":"), ensure_ascii=False)
  if type(namespace) is int:
    return f"int:{namespace}"
  return "repr:" + repr(namespace)  # not a typed key (never from the scheduler)


@dataclasses.dataclass(frozen=True)
class MetricSpec:
  """One declared metric, as `docs/metrics.md` and the exporter agree on it.

  `name` is the family name (counters add `_total`, infos `_info`); `kind` is
  `counter`, `gauge`, `histogram` or `info`; `labels` go beyond `model` and
  `replica`; `vllm` is the vLLM metric of the same meaning, or None.
  """

  name: str
  kind: str
  labels: tuple[str, ...]
  help: str
  vllm: str | None = None


def _m(name, kind, help, labels=(), vllm=None) -> MetricSpec:  # pylint: disable=redefined-builtin
  return MetricSpec(PREFIX + name, kind, tuple(labels), help, vllm)


METRICS: tuple[MetricSpec, ...] = (
    # -- pool, every step (StepStats) ---------------------------------------------------
    _m("kv_cache_usage_perc", "gauge",
       "KV-cache usage as a fraction in [0, 1] (1 = 100%): blocks a live sequence uses / "
       "all blocks. Blocks held only by the prefix cache count as free (they are evicted "
       "on demand), as in vLLM.", vllm="vllm:kv_cache_usage_perc"),
    _m("num_blocks", "gauge", "Blocks in the pool (both regions)."),
    _m("used_blocks", "gauge",
       "Blocks referenced by a sequence (num_blocks - free_blocks - cached_only_blocks)."),
    _m("free_blocks", "gauge", "Unreferenced blocks (both regions)."),
    _m("cached_only_blocks", "gauge",
       "Blocks held only by the prefix cache: evictable, counted as free by "
       "kv_cache_usage_perc."),
    _m("fragmentation_ratio", "gauge",
       "External fragmentation of a region: 1 - largest contiguous free run / free blocks "
       "(0 when nothing is free). region=dynamic every step, base with each full snapshot.",
       ("region",)),
    _m("largest_free_run_blocks", "gauge",
       "Length in blocks of the largest contiguous free run of the dynamic region."),
    _m("largest_contiguous_free_bytes", "gauge",
       "Bytes (K and V, all layers) of the largest contiguous free run of the dynamic region."),
    # -- pool, full snapshots (PoolSnapshot) -----------------------------------------------
    _m("internal_fragmentation_ratio", "gauge",
       "Slots of used blocks not covered by a live segment / slots of used blocks "
       "(dead slots of moved or released segments count as waste). From full snapshots."),
    _m("handed_out_internal_fragmentation_ratio", "gauge",
       "Slots of used blocks never handed out (slot bitmap) / slots of used blocks "
       "(<= internal_fragmentation_ratio). From full snapshots."),
    _m("segments_per_sequence", "gauge",
       "Mean segment-table rows per live sequence. From full snapshots."),
    _m("live_sequences", "gauge", "Active segment-table rows. From full snapshots."),
    _m("live_tokens", "gauge", "Tokens held by active rows. From full snapshots."),
    _m("live_blocks", "gauge",
       "Used blocks referenced by an active row (may be shared with the cache). From full "
       "snapshots."),
    _m("ghost_block_bytes", "gauge",
       "Bytes of blocks on which the free list and the reference counts disagree. 0 by "
       "construction; anything else is a bookkeeping bug. From full snapshots."),
    _m("last_snapshot_step", "gauge",
       "Scheduler step of the latest full snapshot (the snapshot-only gauges are as of it)."),
    _m("last_snapshot_timestamp_seconds", "gauge",
       "Unix time of the latest full snapshot."),
    # -- pool events (SchedulerStats) ------------------------------------------------------
    _m("oom_total", "counter",
       "Failed block allocations by reason: no_free_block (pool exhausted), "
       "no_contiguous_run (external fragmentation), table_full (segment table row full).",
       ("reason",)),
    _m("oom_by_seq_len_total", "counter",
       "Failed block allocations by the length of the sequence they were for, rounded up "
       "to a power of two (seq_len is that bound).", ("seq_len",)),
    _m("compaction_runs_total", "counter", "Compaction passes that moved at least one block."),
    _m("compaction_moves_total", "counter", "Blocks moved by compaction."),
    _m("compaction_bytes_total", "counter",
       "Bytes copied by compaction (block moves x block bytes)."),
    _m("compaction_seconds_total", "counter", "Host seconds spent planning and moving blocks."),
    _m("pack_moves_total", "counter",
       "Short tail segments moved into slotted (shared) blocks by packing."),
    _m("cow_splits_total", "counter", "Shared tails copied before an append (copy on write)."),
    _m("promotions_total", "counter", "Blocks moved into the base (pinned) region."),
    # -- scheduler (StepReport) ---------------------------------------------------------------
    _m("num_requests_running", "gauge", "Requests holding a row in the batch.",
       vllm="vllm:num_requests_running"),
    _m("num_requests_waiting", "gauge",
       "Requests queued for admission (new, or preempted for recompute).",
       vllm="vllm:num_requests_waiting"),
    _m("num_requests_swapped", "gauge", "Requests whose K/V is swapped out to host memory.",
       vllm="vllm:num_requests_swapped (v0 engine)"),
    _m("scheduler_steps_total", "counter", "Scheduler steps (one forward pass each)."),
    _m("step_host_seconds", "histogram",
       "Host wall time of one scheduler step (admission, forward pass, finish, compaction)."),
    _m("num_preemptions_total", "counter",
       "Preemptions by mode: recompute (K/V dropped into the cache, re-queued) or swap "
       "(K/V copied to host).", ("mode",), vllm="vllm:num_preemptions_total"),
    _m("prefix_cache_queries_total", "counter",
       "Prompt tokens looked up in the prefix cache at first admission.",
       vllm="vllm:prefix_cache_queries_total"),
    _m("prefix_cache_hits_total", "counter",
       "Prompt tokens found in the prefix cache at first admission (hit rate = "
       "rate(hits) / rate(queries)).", vllm="vllm:prefix_cache_hits_total"),
    _m("prefix_cache_evicted_tokens_total", "counter", "Tokens evicted from the prefix cache."),
    _m("prefix_cache_evictions_total", "counter", "Eviction passes that freed cached blocks."),
    _m("prompt_tokens_total", "counter", "Prompt tokens of admitted requests.",
       vllm="vllm:prompt_tokens_total"),
    _m("prefill_tokens_total", "counter",
       "Prompt tokens computed (cache misses, and recomputes after preemption)."),
    _m("generation_tokens_total", "counter", "Tokens generated (sampled).",
       vllm="vllm:generation_tokens_total"),
    _m("swap_out_bytes_total", "counter", "K/V bytes copied to host by swap preemption."),
    _m("swap_in_bytes_total", "counter", "K/V bytes copied back from host."),
    _m("time_to_first_token_seconds", "histogram",
       "Seconds from submission to the first generated token (includes queue time; on "
       "the first requests of a process, XLA compilation).",
       vllm="vllm:time_to_first_token_seconds"),
    _m("inter_token_latency_seconds", "histogram",
       "Seconds between two consecutive tokens of a request.",
       vllm="vllm:inter_token_latency_seconds"),
    _m("e2e_request_latency_seconds", "histogram",
       "Seconds from submission to the last token of a finished request.",
       vllm="vllm:e2e_request_latency_seconds"),
    _m("request_queue_time_seconds", "histogram",
       "Seconds a request waited from submission to its first admission.",
       vllm="vllm:request_queue_time_seconds"),
    _m("request_success_total", "counter",
       "Finished requests by finished_reason (length, stop, table_full, abort) and namespace.",
       ("finished_reason", "namespace"), vllm="vllm:request_success_total"),
    _m("namespace_prompt_tokens_total", "counter",
       "Prompt tokens of finished requests, by namespace.", ("namespace",)),
    _m("namespace_prefix_cache_hits_total", "counter",
       "Prompt tokens of finished requests that were prefix-cache hits, by namespace.",
       ("namespace",)),
    # -- runtime: device traffic (SchedulerStats) and the process ----------------------
    _m("device_dispatches_total", "counter",
       "Jitted programs the pool launched: bookkeeping commits, executor steps, K/V data "
       "moves, telemetry reductions (warm-up included)."),
    _m("bookkeeping_dispatches_total", "counter",
       "Dispatches of bookkeeping, part of device_dispatches_total: the pool's commits and "
       "synchronous transitions (one commit per step is the design)."),
    _m("blocking_reads_total", "counter",
       "Host reads of device data that waited on the device, sampled tokens excluded "
       "(bookkeeping never has to wait)."),
    _m("backend_compiles_total", "counter",
       "XLA backend compiles in the process since the scheduler was built, warm-up "
       "included (paged_kv.runtime.counters.backend_compiles)."),
    _m("compiles_after_warmup", "gauge",
       "XLA backend compiles in the process since Scheduler.warmup() (0 before it). Above "
       "0: a program shape the warm-up missed; compiles without bound end in a crash at "
       "vm.max_map_count."),
    _m("process_memory_mappings", "gauge",
       "Memory mappings of the process (lines of /proc/self/maps; each XLA CPU executable "
       "holds about 30), sampled at a step report at most every process_every_s seconds (1 by "
       "default). Beyond vm.max_map_count (65530 by default) mmap fails and the process "
       "crashes. Absent off Linux."),
    _m("process_resident_bytes", "gauge",
       "Resident set size of the process (/proc/self/statm), sampled with the memory "
       "mappings. Absent off Linux."),
    _m("alerts_total", "counter",
       "Alert events fired (edge-triggered, paged_kv.telemetry.metrics.AlertMonitor), by "
       "alert name and severity.", ("alert", "severity")),
    _m("cache_config", "info",
       "The pool's configuration (PoolConfig) and block bytes.", vllm="vllm:cache_config_info"),
)

SPECS = {s.name: s for s in METRICS}


def exposed_names(spec: MetricSpec) -> tuple[str, ...]:
  """The sample names a metric shows in the text exposition."""
  if spec.kind == "counter":
    return (spec.name if spec.name.endswith("_total") else spec.name + "_total",
            (spec.name[:-len("_total")] if spec.name.endswith("_total") else spec.name)
            + "_created")
  if spec.kind == "histogram":
    return tuple(spec.name + s for s in ("_bucket", "_count", "_sum", "_created"))
  if spec.kind == "info":
    return (spec.name + "_info",)
  return (spec.name,)


class MetricsExporter:
  """Serves the pool's and the scheduler's metrics at `/metrics` (Prometheus text format).

  Feed it a `StepReport` per step with `observe` (`attach(sched)` wires it), or
  piecewise with the `observe_*` and `record_alerts` methods. The metric set is
  `METRICS`.

  Args:
    port: TCP port for `start()`; 0 picks a free one.
    addr: the address to bind (localhost by default).
    model, replica: the constant labels of every series.
    registry: a `prometheus_client.CollectorRegistry`; None creates a private one.
    events: a `JsonlLogger` that receives each alert as it is recorded.
    max_namespaces: distinct `namespace` label values; later ones count as `other`.
    latency_buckets: histogram buckets (seconds) of the request latencies.
    process_every_s: how often `observe` samples the process's mappings and
      resident bytes (reading /proc/self/maps costs milliseconds).

  Raises:
    ImportError: prometheus-client is not installed (the `paged-kv[metrics]` extra).
  """

  def __init__(self, port: int = 0, *, addr: str = "127.0.0.1", model: str = "paged_kv",
               replica: str = "0", registry: Any = None, events: "JsonlLogger | None" = None,
               max_namespaces: int = 64,
               latency_buckets: Iterable[float] = LATENCY_BUCKETS,
               process_every_s: float = 1.0):
    prom = _prometheus()
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
      raise ValueError(f"port must be an int in [0, 65535], got {port!r}")
    if not isinstance(max_namespaces, int) or max_namespaces < 1:
      raise ValueError(f"max_namespaces must be a positive int, got {max_namespaces!r}")
    self.process_every_s = float(process_every_s)
    self._process_sampled = -math.inf  # time.monotonic() of the last process sample
    self._requested_port = port
    self._addr = addr
    self._const = {"model": str(model), "replica": str(replica)}
    self.registry = prom.CollectorRegistry() if registry is None else registry
    self.events = events
    self._max_namespaces = max_namespaces
    self._namespaces: set[str] = set()
    self._lock = threading.Lock()
    self._last: dict[tuple, float] = {}  # cumulative totals already counted
    self._block_bytes: int | None = None
    self._server = None
    self._thread: threading.Thread | None = None
    latency_buckets = tuple(latency_buckets)
    self._metrics: dict[str, Any] = {}
    self._children: dict[tuple, Any] = {}  # (short name, *label items) -> series
    for spec in METRICS:
      labels = ["model", "replica", *spec.labels]
      short = spec.name[len(PREFIX):]
      if spec.kind == "counter":
        metric = prom.Counter(spec.name, spec.help, labels, registry=self.registry)
      elif spec.kind == "gauge":
        metric = prom.Gauge(spec.name, spec.help, labels, registry=self.registry)
      elif spec.kind == "histogram":
        buckets = STEP_BUCKETS if short == "step_host_seconds" else latency_buckets
        metric = prom.Histogram(spec.name, spec.help, labels, registry=self.registry,
                                buckets=buckets)
      else:
        metric = prom.Info(spec.name, spec.help, labels, registry=self.registry)
      self._metrics[short] = metric
    # Series that exist from the start (0), so rate() and alert rules see them.
    for reason in OOM_REASONS.values():
      self._child("oom_total", reason=reason)
    for mode in PREEMPTION_MODES:
      self._child("num_preemptions_total", mode=mode)
    for name, severity in alert_rules():
      self._child("alerts_total", alert=name, severity=severity)
    for spec in METRICS:
      if not spec.labels and spec.kind in ("counter", "histogram"):
        self._child(spec.name[len(PREFIX):])

  # -- plumbing ------------------------------------------------------------------
  def _child(self, short: str, **labels: str):
    """The labelled series (looked up once: `labels()` validates and locks per call)."""
    key = (short, *labels.items())
    child = self._children.get(key)
    if child is None:
      child = self._children[key] = self._metrics[short].labels(**self._const, **labels)
    return child

  def _set(self, short: str, value: float, **labels: str) -> None:
    self._child(short, **labels).set(float(value))

  def _count(self, short: str, total: float, **labels: str) -> None:
    """Adds what the cumulative `total` grew by since the last call (all of it after a reset)."""
    total = float(total)
    if not math.isfinite(total) or total < 0:
      raise ValueError(f"{short}{labels or ''}: a cumulative total must be a finite number "
                       f">= 0, got {total!r}")
    key = (short, *sorted(labels.items()))
    with self._lock:
      last = self._last.get(key, 0.0)
      delta = total - last if total >= last else total
      self._last[key] = total
    if delta > 0:
      self._child(short, **labels).inc(delta)

  def _namespace(self, namespace: Any) -> str:
    label = namespace_label(namespace)
    with self._lock:
      if label in self._namespaces:
        return label
      if len(self._namespaces) < self._max_namespaces:
        self._namespaces.add(label)
        return label
    return OTHER_NAMESPACE

  # -- inputs ----------------------------------------------------------------------
  def set_cache_config(self, config: Any, *, block_bytes: int | None = None) -> None:
    """Sets `paged_kv_cache_config_info` from a `PoolConfig` (and its block bytes)."""
    info = {f: str(getattr(config, f)) for f in _CACHE_CONFIG_FIELDS if hasattr(config, f)}
    if block_bytes is None:
      block_bytes = getattr(config, "block_bytes", None)
    if block_bytes is not None:
      info["block_bytes"] = str(int(block_bytes))
      self._block_bytes = int(block_bytes)
    self._child("cache_config").info(info)

  def observe_step_stats(self, stats: Any) -> None:
    """Sets the per-step pool gauges from a `paged_kv.telemetry.metrics.StepStats`."""
    self._block_bytes = int(stats.block_bytes)
    self._set("kv_cache_usage_perc", stats.kv_usage_ratio)
    self._set("num_blocks", stats.num_blocks)
    self._set("used_blocks", stats.used_blocks)
    self._set("free_blocks", stats.free_blocks)
    self._set("cached_only_blocks", stats.cached_blocks)
    self._set("fragmentation_ratio", stats.fragmentation_ratio, region="dynamic")
    self._set("largest_free_run_blocks", stats.largest_free_run_blocks)
    self._set("largest_contiguous_free_bytes",
              int(stats.largest_free_run_blocks) * int(stats.block_bytes))

  def observe_snapshot(self, snap: Any, *, step: int | None = None) -> None:
    """Sets the gauges of a `PoolSnapshot` and counts its cumulative OOM and compaction totals."""
    for region, ratio in snap.fragmentation_by_region.items():
      self._set("fragmentation_ratio", ratio, region=str(region))
    self._set("num_blocks", snap.num_blocks)
    if getattr(snap, "kv_usage_ratio", None) is not None:
      self._set("kv_cache_usage_perc", snap.kv_usage_ratio)
    self._set("free_blocks", snap.num_free_blocks)
    self._set("cached_only_blocks", snap.cached_only_blocks)
    self._set("used_blocks", snap.num_blocks - snap.num_free_blocks - snap.cached_only_blocks)
    self._set("largest_contiguous_free_bytes", snap.largest_contiguous_free_bytes)
    self._set("internal_fragmentation_ratio", snap.internal_fragmentation)
    self._set("handed_out_internal_fragmentation_ratio", snap.handed_out_internal_fragmentation)
    self._set("segments_per_sequence", snap.segments_per_sequence)
    self._set("live_sequences", snap.live_sequences)
    self._set("live_tokens", snap.live_tokens)
    self._set("live_blocks", snap.live_blocks)
    self._set("ghost_block_bytes", snap.ghost_block_bytes)
    if step is not None:
      self._set("last_snapshot_step", step)
    self._set("last_snapshot_timestamp_seconds", time.time())
    for reason, n in snap.oom_by_reason.items():
      self._count("oom_total", n, reason=str(reason))
    for seq_len, n in snap.oom_by_seq_len.items():
      self._count("oom_by_seq_len_total", n, seq_len=str(seq_len))
    self._count("compaction_moves_total", snap.compaction_moves)
    self._count("compaction_seconds_total", snap.compaction_seconds)
    if self._block_bytes:
      self._count("compaction_bytes_total", snap.compaction_moves * self._block_bytes)

  def observe_stats(self, stats: Any) -> None:
    """Counts the cumulative totals of a `paged_kv.scheduler.SchedulerStats`: requests,
    tokens, preemptions, the pool's events and device traffic."""
    for reason, n in dict(stats.oom_by_reason).items():
      self._count("oom_total", n, reason=str(reason))
    for seq_len, n in dict(stats.oom_by_seq_len).items():
      self._count("oom_by_seq_len_total", n, seq_len=str(seq_len))
    self._count("compaction_runs_total", stats.compactions)
    self._count("compaction_moves_total", stats.compaction_moves)
    self._count("compaction_seconds_total", stats.compaction_seconds)
    if self._block_bytes:
      self._count("compaction_bytes_total", stats.compaction_moves * self._block_bytes)
    self._count("pack_moves_total", stats.pack_moves)
    self._count("cow_splits_total", stats.cow_splits)
    self._count("promotions_total", stats.promotions)
    self._count("scheduler_steps_total", stats.steps)
    self._count("num_preemptions_total", stats.preemptions_recompute, mode="recompute")
    self._count("num_preemptions_total", stats.preemptions_swap, mode="swap")
    self._count("prefix_cache_queries_total", stats.prompt_tokens)
    self._count("prefix_cache_hits_total", stats.hit_tokens)
    self._count("prefix_cache_evicted_tokens_total", stats.evicted_tokens)
    self._count("prefix_cache_evictions_total", stats.evictions)
    self._count("prompt_tokens_total", stats.prompt_tokens)
    self._count("prefill_tokens_total", stats.prefill_tokens)
    self._count("swap_out_bytes_total", stats.swap_to_host_bytes)
    self._count("swap_in_bytes_total", stats.swap_in_bytes)
    self._count("device_dispatches_total", stats.device_dispatches)
    self._count("bookkeeping_dispatches_total", stats.bookkeeping_dispatches)
    self._count("blocking_reads_total", stats.blocking_reads)
    self._count("backend_compiles_total", stats.backend_compiles)
    self._set("compiles_after_warmup", stats.compiles_after_warmup)

  def observe_process(self) -> None:
    """Samples the process's memory mappings and resident bytes (absent off Linux)."""
    for short, value in (("process_memory_mappings", runtime_counters.memory_mappings()),
                         ("process_resident_bytes", runtime_counters.resident_bytes())):
      if value >= 0:
        self._set(short, value)

  def observe_finished(self, requests: Iterable[Any]) -> None:
    """Counts finished requests (`Request` objects) and observes their latencies."""
    for req in requests:
      ns = self._namespace(getattr(req, "namespace", "default"))
      reason = FINISHED_REASONS.get(req.stop_reason, req.stop_reason or "unknown")
      self._child("request_success_total", finished_reason=reason, namespace=ns).inc()
      self._child("namespace_prompt_tokens_total", namespace=ns).inc(len(req.prompt))
      if req.hit_tokens:
        self._child("namespace_prefix_cache_hits_total", namespace=ns).inc(req.hit_tokens)
      submit = getattr(req, "submit_time", None)
      if submit is None:
        submit = getattr(req, "arrival", None)
      admit = getattr(req, "admit_time", None)
      if submit is None or submit < 0:
        continue
      if req.finish_time >= submit:
        self._child("e2e_request_latency_seconds").observe(req.finish_time - submit)
      if admit is not None and admit >= submit:
        self._child("request_queue_time_seconds").observe(admit - submit)

  def record_alerts(self, alerts: Iterable[Any], *, step: int | None = None) -> int:
    """Counts `alerts` (`Alert`s or mappings) in `paged_kv_alerts_total`; writes them to `events`.

    Returns how many; `step` is for the JSONL events.
    """
    count = 0
    for alert in alerts:
      fields = _as_fields(alert, "alert")
      self._child("alerts_total", alert=str(fields.get("metric", "unknown")),
                  severity=str(fields.get("severity", "unknown"))).inc()
      if self.events is not None:
        self.events.log_alert(alert, step=step)
      count += 1
    return count

  def observe(self, report: Any) -> None:
    """Takes one `paged_kv.scheduler.StepReport` (what `on_step` is passed)."""
    if report.pool is not None:
      self.observe_step_stats(report.pool)
    if report.snapshot is not None:
      self.observe_snapshot(report.snapshot, step=report.step)
    self.observe_stats(report.stats)
    now = time.monotonic()
    if now - self._process_sampled >= self.process_every_s:
      self._process_sampled = now
      self.observe_process()
    self._set("num_requests_running", report.num_running)
    self._set("num_requests_waiting", report.num_waiting)
    self._set("num_requests_swapped", report.num_swapped)
    self._child("step_host_seconds").observe(max(float(report.host_seconds), 0.0))
    observe_many(self._child("time_to_first_token_seconds"), report.first_token_latencies)
    observe_many(self._child("inter_token_latency_seconds"), report.inter_token_latencies)
    # Every decode emits one token, and so does the prefill chunk that completes a prompt.
    key = ("generation_tokens_total", "decode_tokens")
    with self._lock:
      last = self._last.get(key, 0.0)
      total = float(report.stats.decode_tokens)
      delta = (total - last if total >= last else total) + len(report.first_token_latencies)
      self._last[key] = total
    if delta > 0:
      self._child("generation_tokens_total").inc(delta)
    self.observe_finished(report.finished)
    self.record_alerts(report.alerts, step=report.step)

  def attach(self, scheduler: Any) -> "MetricsExporter":
    """Chains `scheduler`'s `on_step` to this exporter and sets the cache-config info; returns self.

    Raises `TypeError` when the scheduler has no `on_step` attribute.
    """
    pool = getattr(scheduler, "pool", None)
    config = getattr(pool, "config", None)
    if config is not None:
      self.set_cache_config(config)
    attr = next((a for a in ("on_step", "_on_step") if hasattr(scheduler, a)), None)
    if attr is None:
      raise TypeError(f"{type(scheduler).__name__} has no on_step callback to attach to")
    previous: Callable[[Any], None] | None = getattr(scheduler, attr)

    def on_step(report: Any) -> None:
      if previous is not None:
        previous(report)
      self.observe(report)

    setattr(scheduler, attr, on_step)
    return self

  def render(self) -> str:
    """The current exposition text (what `/metrics` serves)."""
    return _prometheus().generate_latest(self.registry).decode("utf-8")

  # -- HTTP server (prometheus_client's) ------------------------------------------------
  def start(self) -> "MetricsExporter":
    """Serves the registry over HTTP in a daemon thread; returns self.

    Raises `RuntimeError` when already started, `OSError` when the address cannot be bound.
    """
    if self._server is not None:
      raise RuntimeError(f"MetricsExporter already serving at {self.url}")
    self._server, self._thread = _prometheus().start_http_server(
        self._requested_port, addr=self._addr, registry=self.registry)
    return self

  def stop(self) -> None:
    """Stops the HTTP server (a no-op when not started); values are kept."""
    server, thread = self._server, self._thread
    self._server = self._thread = None
    if server is not None:
      server.shutdown()
      server.server_close()
    if thread is not None:
      thread.join(timeout=5.0)

  @property
  def serving(self) -> bool:
    """Whether the HTTP server is running."""
    return self._server is not None

  @property
  def port(self) -> int:
    """The bound TCP port (the chosen one when constructed with port 0)."""
    if self._server is None:
      raise RuntimeError("MetricsExporter is not serving; call start() first")
    return int(self._server.server_address[1])

  @property
  def url(self) -> str:
    """`http://<addr>:<port>/metrics`."""
    host = self._server.server_address[0] if self._server is not None else self._addr
    host = f"[{host}]" if ":" in str(host) else host
    return f"http://{host}:{self.port}/metrics"

  def __enter__(self) -> "MetricsExporter":
    return self.start()

  def __exit__(self, *exc_info) -> None:
    self.stop()


# ---------------------------------------------------------------------------
# JSONL logging.
# ---------------------------------------------------------------------------

_RESERVED_KEYS = ("type", "step", "time")


def observe_many(histogram: Any, seconds: Iterable[float]) -> None:
  """`histogram.observe(max(s, 0))` for each of `seconds`, as one increment per bucket hit.

  One by one costs ~5 us per value, milliseconds a step at a large batch; a
  histogram without prometheus_client's bucket fields is observed value by value.
  """
  values = np.maximum(np.asarray(seconds, dtype=np.float64).reshape(-1), 0.0)
  if not values.size:
    return
  bounds = getattr(histogram, "_upper_bounds", None)
  buckets = getattr(histogram, "_buckets", None)
  total = getattr(histogram, "_sum", None)
  if (bounds is None or buckets is None or total is None or len(bounds) != len(buckets)
      or getattr(histogram, "_raise_if_not_observable", None) is None):
    for v in values.tolist():
      histogram.observe(v)
    return
  histogram._raise_if_not_observable()  # pylint: disable=protected-access
  # `observe` counts a value in the first bucket whose bound is >= it (NaN in none).
  first = np.searchsorted(np.asarray(bounds, np.float64), values, side="left")
  counts = np.bincount(first, minlength=len(bounds) + 1)
  total.inc(float(values.sum()))
  for i in np.flatnonzero(counts[:len(bounds)]).tolist():
    buckets[i].inc(int(counts[i]))


def _as_fields(obj: Any, what: str) -> dict[str, Any]:
  """Top-level fields of a dataclass instance or a mapping, in order."""
  if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
  if isinstance(obj, Mapping):
    return dict(obj)
  raise TypeError(f"{what} must be a dataclass instance or a mapping, got {type(obj).__name__}")


def _jsonable(value: Any) -> Any:
  """`value` as strict JSON data (numpy, dataclasses, mappings, sequences; NaN/inf as None)."""
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
  if isinstance(value, Mapping):
    return {str(k): _jsonable(v) for k, v in value.items()}
  if isinstance(value, (str, type(None), bool)):
    return value
  if isinstance(value, (np.bool_,)):
    return bool(value)
  if isinstance(value, (int, np.integer)):
    return int(value)
  if isinstance(value, (float, np.floating)):
    return float(value) if math.isfinite(value) else None
  if isinstance(value, (list, tuple, set, frozenset)):
    return [_jsonable(v) for v in value]
  if isinstance(value, np.ndarray) or hasattr(value, "__array__"):
    return _jsonable(np.asarray(value).tolist())
  if isinstance(value, numbers.Real):
    return _jsonable(float(value))
  raise TypeError(f"cannot write a {type(value).__name__} to JSONL: {value!r}")


def _finished_record(req: Any) -> dict:
  """The figures of one finished request that a step line carries."""
  submit = getattr(req, "submit_time", None)
  if submit is None:
    submit = getattr(req, "arrival", None)
  out = {"request_id": namespace_label(req.request_id) if not isinstance(req.request_id, int)
         else req.request_id,
         "namespace": namespace_label(getattr(req, "namespace", "default")),
         "stop_reason": req.stop_reason, "prompt_tokens": int(len(req.prompt)),
         "output_tokens": len(req.output), "hit_tokens": int(req.hit_tokens),
         "num_preemptions": int(getattr(req, "num_preemptions", 0))}
  if submit is not None and submit >= 0:
    for name, t in (("ttft_s", getattr(req, "first_token_time", -1.0)),
                    ("e2e_s", getattr(req, "finish_time", -1.0)),
                    ("queue_s", getattr(req, "admit_time", None))):
      if t is not None and t >= submit:
        out[name] = float(t - submit)
  return out


def step_record(report: Any) -> dict:
  """The fields of a `StepReport` as a JSONL `step` line writes them (`pool`: its `StepStats`)."""
  return {
      "clock": float(report.time),
      "host_seconds": float(report.host_seconds),
      "num_running": int(report.num_running),
      "num_waiting": int(report.num_waiting),
      "num_swapped": int(report.num_swapped),
      "pool": None if report.pool is None else _as_fields(report.pool, "pool"),
      "stats": _as_fields(report.stats, "stats"),
      "first_token_latencies": list(report.first_token_latencies),
      "num_inter_token_latencies": len(report.inter_token_latencies),
      "finished": [_finished_record(r) for r in report.finished],
      "alerts": [getattr(a, "metric", None) or _as_fields(a, "alert").get("metric")
                 for a in report.alerts],
      "snapshot": report.snapshot is not None,
      "process": process_record(),
  }


def process_record() -> dict:
  """The process's memory mappings and resident bytes for a step line (-1 off Linux)."""
  return {"memory_mappings": runtime_counters.memory_mappings(),
          "resident_bytes": runtime_counters.resident_bytes()}


class JsonlLogger:
  """Appends one JSON object per line: step reports, snapshots and alert events.

  Lines are `{"type": kind, "step": s, "time": t, ...}` with kind `step`,
  `snapshot` or `alert` and `time` the wall clock. Each line is flushed as
  written, so a crash loses nothing and `tail -f` sees alerts as they fire.

      with JsonlLogger("run/metrics.jsonl") as log:
        sched = Scheduler(pool, executor, config, on_step=log.log_report)
        sched.run()
      steps = read_jsonl("run/metrics.jsonl", type="step")

  `mode` is `"a"` (append) or `"w"`; the file's directory is created if missing.
  """

  def __init__(self, path: str | os.PathLike, mode: str = "a"):
    if mode not in ("a", "w"):
      raise ValueError(f"mode must be 'a' or 'w', got {mode!r}")
    self.path = os.fspath(path)
    parent = os.path.dirname(self.path)
    if parent:
      os.makedirs(parent, exist_ok=True)
    self._file: TextIO | None = open(self.path, mode, encoding="utf-8")  # pylint: disable=consider-using-with
    self._lock = threading.Lock()
    self.num_snapshots = 0
    self.num_alerts = 0
    self.num_steps = 0
    self.last_step: int | None = None  # step of the latest snapshot or step line

  def _write(self, kind: str, step: int | None, fields: Mapping[str, Any]) -> dict:
    clash = [k for k in _RESERVED_KEYS if k in fields]
    if clash:
      raise ValueError(f"{kind} fields {clash} clash with the keys {_RESERVED_KEYS} "
                       "that JsonlLogger adds")
    record = {"type": kind, "step": None if step is None else int(step), "time": time.time()}
    record.update(_jsonable(dict(fields)))
    line = json.dumps(record, allow_nan=False)
    with self._lock:
      if self._file is None:
        raise ValueError(f"JsonlLogger({self.path!r}) is closed")
      self._file.write(line + "\n")
      self._file.flush()
    return record

  def log_snapshot(self, snapshot: Any = None, *, step: int | None = None,
                   **extra: Any) -> dict:
    """Writes one snapshot line (a dataclass, mapping or None, plus `**extra` fields); returns it.

    `step` defaults to the number of snapshots logged before.
    """
    fields = {} if snapshot is None else _as_fields(snapshot, "snapshot")
    fields.update(extra)
    record = self._write("snapshot", self.num_snapshots if step is None else step, fields)
    self.num_snapshots += 1
    self.last_step = record["step"]
    return record

  def log_report(self, report: Any, *, snapshots: bool = True, alerts: bool = True) -> dict:
    """Writes a `StepReport`'s `step` line, snapshot and alerts; returns the step record.

    Usable as `on_step` directly; `alerts=False` when a `MetricsExporter` writes them.
    """
    record = self._write("step", report.step, step_record(report))
    self.num_steps += 1
    self.last_step = record["step"]
    if snapshots and report.snapshot is not None:
      self.log_snapshot(report.snapshot, step=report.step)
    if alerts:
      self.log_alerts(report.alerts, step=report.step)
    return record

  def log_alert(self, alert: Any, *, step: int | None = None) -> dict:
    """Writes one alert line; `step` defaults to the latest snapshot's or step line's."""
    if step is None:
      step = self.last_step
    record = self._write("alert", step, _as_fields(alert, "alert"))
    self.num_alerts += 1
    return record

  def log_alerts(self, alerts: Iterable[Any], *, step: int | None = None) -> list[dict]:
    """Writes one line per alert event; returns the records."""
    return [self.log_alert(a, step=step) for a in alerts]

  @property
  def closed(self) -> bool:
    """Whether `close()` was called."""
    return self._file is None

  def close(self) -> None:
    """Closes the file (idempotent)."""
    with self._lock:
      if self._file is not None:
        self._file.close()
        self._file = None

  def __enter__(self) -> "JsonlLogger":
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()


def read_jsonl(path: str | os.PathLike, *, type: str | None = None) -> list[dict]:  # pylint: disable=redefined-builtin
  """The records of a JSONL file, optionally only those of one `type`."""
  with open(path, encoding="utf-8") as f:
    records = [json.loads(line) for line in f if line.strip()]
  return records if type is None else [r for r in records if r.get("type") == type]
