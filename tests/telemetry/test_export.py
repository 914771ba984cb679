"""Metrics export: a live exporter scraped over HTTP (names, types, HELP, values of a
real scheduler run), counters that never go down, snapshots, alerts as counters and
JSONL events, the JSONL logger, and the error when prometheus-client is missing."""

import functools
import importlib.util
import json
import math
import os
import re
import shutil
import sys
import tempfile
import urllib.error
from unittest import mock

import numpy as np
from absl.testing import absltest
import pytest

import paged_kv
from paged_kv.scheduler import SchedulerStats
from paged_kv.telemetry import export, metrics
from tests.telemetry import serving_run

CFG = paged_kv.PoolConfig(num_blocks=32, block_size=4, num_layers=1, num_kv_heads=1,
                          head_dim=8, max_seqs=4, max_segments=8)


def families(text):
  """`{family name: Metric}` of an exposition, parsed by prometheus_client's parser."""
  from prometheus_client.parser import text_string_to_metric_families  # pylint: disable=import-outside-toplevel
  return {f.name: f for f in text_string_to_metric_families(text)}


def family_name(spec):
  """The name the parser gives a declared metric's family."""
  if spec.kind == "counter":
    return spec.name[:-len("_total")] if spec.name.endswith("_total") else spec.name
  if spec.kind == "info":
    return spec.name + "_info"
  return spec.name


def sample_value(fams, spec_name, **labels):
  fam = fams[family_name(export.SPECS[spec_name])]
  suffix = "_total" if fam.type == "counter" else ""
  hits = [s.value for s in fam.samples if s.name == fam.name + suffix
          and all(s.labels.get(k) == v for k, v in labels.items())]
  return sum(hits)


def small_pool_snapshot(num_tokens=(6, 3), ooms=("no_free_block",), moves=3):
  """A real snapshot of a small pool with live sequences and host counters."""
  pool = paged_kv.BlockPool(CFG)
  ids = [pool.open_sequence() for _ in num_tokens]
  pool.reserve_tokens(ids, list(num_tokens))
  counters = SchedulerStats()
  for reason in ooms:
    counters.record_oom(reason, seq_len=20)
  counters.record_compaction(moves, 0.25)
  return pool, counters, metrics.snapshot(pool.state, CFG, counters=counters)


def _tmpdir(test: absltest.TestCase) -> str:
  """A fresh temp folder of the test's own, removed after it (not absl's shared
  `TEST_TMPDIR`, which nothing creates under pytest and other processes share)."""
  path = tempfile.mkdtemp(prefix="paged_kv_test_")
  test.addCleanup(shutil.rmtree, path, ignore_errors=True)
  return path


class LiveScrapeTest(absltest.TestCase):

  def test_every_declared_metric_is_served_with_its_type_and_help(self):
    _, _, text, _ = serving_run.served_run()
    fams = families(text)
    for spec in export.METRICS:
      name = family_name(spec)
      self.assertIn(name, fams, f"{spec.name} not served")
      fam = fams[name]
      want = "gauge" if spec.kind == "info" else spec.kind  # Info is a gauge in text format
      self.assertEqual(fam.type, want, spec.name)
      self.assertEqual(fam.documentation, spec.help, spec.name)
      if spec.name != "paged_kv_oom_by_seq_len_total":  # its labels appear with OOMs
        self.assertNotEmpty(fam.samples, f"{spec.name} has no samples after a real run")
    # HELP lines on the wire: one per declared family, real text (not generated).
    self.assertIn("# HELP paged_kv_kv_cache_usage_perc KV-cache usage as a fraction", text)
    self.assertIn("# TYPE paged_kv_oom_total counter", text)
    self.assertIn("# TYPE paged_kv_time_to_first_token_seconds histogram", text)

  def test_names_follow_prometheus_rules(self):
    for spec in export.METRICS:
      self.assertStartsWith(spec.name, "paged_kv_")
      self.assertRegex(spec.name, r"^[a-z_][a-z0-9_]*$")
      if spec.kind == "counter":
        self.assertTrue(spec.name.endswith("_total"), spec.name)
      if spec.kind == "histogram":
        self.assertTrue(spec.name.endswith("_seconds"), spec.name)
      self.assertNotRegex(spec.name, r"_(ms|millis|percent|kb|mb)(_|$)", spec.name)
      self.assertTrue(spec.help and spec.help[0].isupper() and spec.help.endswith("."),
                      spec.name)
    self.assertLen({s.name for s in export.METRICS}, len(export.METRICS))

  def test_constant_labels_on_every_sample(self):
    _, _, text, _ = serving_run.served_run()
    for fam in families(text).values():
      for s in fam.samples:
        self.assertEqual(s.labels.get("model"), "tiny-llama", s)
        self.assertEqual(s.labels.get("replica"), "r1", s)

  def test_values_match_the_run(self):
    sched, _, text, reports = serving_run.served_run()
    fams = families(text)
    st = counters = sched.stats
    self.assertLen(reports, st.steps)  # the previous on_step still ran
    value = functools.partial(sample_value, fams)
    self.assertEqual(value("paged_kv_scheduler_steps_total"), st.steps)
    self.assertEqual(value("paged_kv_prefix_cache_queries_total"), st.prompt_tokens)
    self.assertEqual(value("paged_kv_prefix_cache_hits_total"), st.hit_tokens)
    self.assertGreater(st.hit_tokens, 0)
    self.assertEqual(value("paged_kv_prompt_tokens_total"), st.prompt_tokens)
    self.assertEqual(value("paged_kv_prefill_tokens_total"), st.prefill_tokens)
    self.assertEqual(value("paged_kv_num_preemptions_total", mode="swap"), st.preemptions_swap)
    self.assertEqual(value("paged_kv_num_preemptions_total", mode="recompute"),
                     st.preemptions_recompute)
    self.assertGreater(st.preemptions, 0)
    self.assertEqual(value("paged_kv_swap_out_bytes_total"), st.swap_to_host_bytes)
    self.assertEqual(value("paged_kv_prefix_cache_evicted_tokens_total"), st.evicted_tokens)
    generated = sum(len(r.output) for r in sched.finished)
    self.assertEqual(value("paged_kv_generation_tokens_total"), generated)
    self.assertEqual(value("paged_kv_request_success_total"), st.finished)
    self.assertEqual(value("paged_kv_request_success_total", finished_reason="length",
                           namespace="tenant-0"),
                     sum(r.namespace == "tenant-0" for r in sched.finished))
    self.assertEqual(value("paged_kv_namespace_prompt_tokens_total"), st.prompt_tokens)
    for reason in ("no_free_block", "no_contiguous_run", "table_full"):
      self.assertEqual(value("paged_kv_oom_total", reason=reason),
                       counters.oom_by_reason.get(reason, 0), reason)
    self.assertEqual(value("paged_kv_compaction_moves_total"), counters.compaction_moves)
    self.assertGreater(counters.compaction_moves, 0)
    self.assertEqual(value("paged_kv_compaction_bytes_total"),
                     counters.compaction_moves * serving_run.CFG.block_bytes)
    self.assertEqual(value("paged_kv_compaction_runs_total"), counters.compactions)
    last = reports[-1].pool
    self.assertAlmostEqual(value("paged_kv_kv_cache_usage_perc"), last.kv_usage_ratio)
    self.assertEqual(value("paged_kv_cached_only_blocks"), last.cached_blocks)
    self.assertEqual(value("paged_kv_num_requests_running"), 0)
    self.assertEqual(value("paged_kv_alerts_total"), len(sched.alerts))
    snap_steps = [r.step for r in reports if r.snapshot is not None]
    self.assertEqual(value("paged_kv_last_snapshot_step"), snap_steps[-1])
    info = fams["paged_kv_cache_config_info"].samples[0].labels
    self.assertEqual(info["num_blocks"], str(serving_run.CFG.num_blocks))
    self.assertEqual(info["block_bytes"], str(serving_run.CFG.block_bytes))
    # Histograms: one TTFT, e2e and queue time per request, one ITL per decode token.
    count = lambda name: sum(s.value for s in fams[name].samples  # pylint: disable=unnecessary-lambda-assignment
                             if s.name == name + "_count")
    self.assertEqual(count("paged_kv_time_to_first_token_seconds"), st.finished)
    self.assertEqual(count("paged_kv_e2e_request_latency_seconds"), st.finished)
    self.assertEqual(count("paged_kv_request_queue_time_seconds"), st.finished)
    self.assertEqual(count("paged_kv_inter_token_latency_seconds"), st.decode_tokens)
    self.assertEqual(count("paged_kv_step_host_seconds"), st.steps)
    buckets = [float(s.labels["le"]) for s in fams["paged_kv_time_to_first_token_seconds"].samples
               if s.name.endswith("_bucket")]
    self.assertEqual(min(buckets), 0.001)
    self.assertIn(60.0, buckets)
    self.assertGreaterEqual(max(b for b in buckets if b != float("inf")), 1200.0)  # 20 min

  @pytest.mark.slow
  def test_runtime_series_after_warmup(self):
    sched = serving_run.make_scheduler()
    report = sched.warmup(progress=False)
    self.assertGreater(report.programs, 0)
    reports = []
    sched.on_step = reports.append
    exporter = export.MetricsExporter(port=0, model="tiny-llama", replica="r1").start()
    exporter.attach(sched)
    serving_run.run(sched, serving_run.workload(n=6))
    text, _ = serving_run.fetch(exporter.url)
    exporter.stop()
    value = functools.partial(sample_value, families(text))
    st = sched.stats
    self.assertEqual(value("paged_kv_device_dispatches_total"), st.device_dispatches)
    self.assertEqual(value("paged_kv_bookkeeping_dispatches_total"),
                     st.bookkeeping_dispatches)
    self.assertEqual(value("paged_kv_blocking_reads_total"), st.blocking_reads)
    self.assertEqual(value("paged_kv_backend_compiles_total"), st.backend_compiles)
    self.assertEqual(value("paged_kv_compiles_after_warmup"), st.compiles_after_warmup)
    self.assertEqual(st.compiles_after_warmup, 0)  # the warm-up covered every shape
    self.assertGreater(st.bookkeeping_dispatches, 0)
    self.assertGreater(st.device_dispatches, st.bookkeeping_dispatches)  # steps too
    self.assertGreater(value("paged_kv_process_memory_mappings"), 0)
    self.assertGreater(value("paged_kv_process_resident_bytes"), 0)
    # The JSONL step line carries the same figures (`stats`) and the process sample.
    record = export.step_record(reports[-1])
    self.assertEqual(record["stats"]["compiles_after_warmup"], st.compiles_after_warmup)
    self.assertEqual(record["stats"]["bookkeeping_dispatches"], st.bookkeeping_dispatches)
    self.assertGreater(record["process"]["memory_mappings"], 0)
    self.assertGreater(record["process"]["resident_bytes"], 0)

  def test_stop_closes_the_port(self):
    exporter = export.MetricsExporter(port=0, addr="127.0.0.1").start()
    self.assertTrue(exporter.serving)
    self.assertStartsWith(exporter.url, "http://127.0.0.1:")
    with self.assertRaisesRegex(RuntimeError, "already serving"):
      exporter.start()
    port = exporter.port
    serving_run.fetch(exporter.url)
    exporter.stop()
    self.assertFalse(exporter.serving)
    with self.assertRaises((urllib.error.URLError, ConnectionError)):
      serving_run.fetch(f"http://127.0.0.1:{port}/metrics")
    with self.assertRaisesRegex(RuntimeError, "not serving"):
      _ = exporter.port
    exporter.stop()  # idempotent


class CounterSemanticsTest(absltest.TestCase):

  def test_counters_never_go_down_when_totals_restart(self):
    exporter = export.MetricsExporter()
    stats = serving_run.make_scheduler().stats
    stats.prompt_tokens, stats.hit_tokens = 100, 40
    exporter.observe_stats(stats)
    stats.prompt_tokens, stats.hit_tokens = 150, 40
    exporter.observe_stats(stats)
    fams = families(exporter.render())
    self.assertEqual(sample_value(fams, "paged_kv_prefix_cache_queries_total"), 150)
    # A new scheduler: its totals start again; the exporter adds them.
    fresh = type(stats)(prompt_tokens=30, hit_tokens=10)
    exporter.observe_stats(fresh)
    fams = families(exporter.render())
    self.assertEqual(sample_value(fams, "paged_kv_prefix_cache_queries_total"), 180)
    self.assertEqual(sample_value(fams, "paged_kv_prefix_cache_hits_total"), 50)
    with self.assertRaisesRegex(ValueError, "finite number >= 0"):
      exporter.observe_stats(type(stats)(prompt_tokens=-1))

  def test_latencies_observed_together_equal_one_by_one(self):
    from prometheus_client import CollectorRegistry, Histogram  # pylint: disable=import-outside-toplevel
    bounds = export.LATENCY_BUCKETS
    rng = np.random.default_rng(0)
    values = [*bounds[:5], 0.0, -0.5, 1e9, math.nan, *rng.exponential(0.05, 200).tolist()]

    def exposition(feed):
      reg = CollectorRegistry()
      hist = Histogram("h", "h", ["a"], registry=reg, buckets=bounds).labels(a="x")
      feed(hist)
      return [s for s in reg.collect() for s in s.samples if not s.name.endswith("_created")]

    def one_by_one(hist):
      for v in values:
        hist.observe(max(float(v), 0.0))

    reference = exposition(one_by_one)
    together = exposition(lambda h: export.observe_many(h, values))
    self.assertEqual([(s.name, s.labels) for s in together],
                     [(s.name, s.labels) for s in reference])
    for got, want in zip(together, reference):
      if math.isnan(want.value):
        self.assertTrue(math.isnan(got.value), got)
      else:
        self.assertAlmostEqual(got.value, want.value, places=9, msg=got)
    # A histogram without prometheus_client's bucket fields is observed value by value.
    seen = []
    export.observe_many(mock.Mock(spec=["observe"], observe=seen.append), [0.5, -1.0])
    self.assertEqual(seen, [0.5, 0.0])
    export.observe_many(mock.Mock(spec=["observe"], observe=seen.append), ())
    self.assertLen(seen, 2)

  def test_process_figures_are_sampled_at_most_every_process_every_s(self):
    # Reading /proc/self/maps costs milliseconds with many XLA programs: not every step.
    reads = []
    with mock.patch.object(export.runtime_counters, "memory_mappings",
                           lambda: reads.append(1) or 123):
      exporter = export.MetricsExporter(process_every_s=3600.0)
      sched = serving_run.make_scheduler()
      exporter.attach(sched)
      serving_run.run(sched, serving_run.workload(n=4))
      self.assertGreater(sched.stats.steps, 3)
      self.assertLen(reads, 1)  # the first step's report only
      self.assertEqual(exporter.registry.get_sample_value(
          "paged_kv_process_memory_mappings", {"model": "paged_kv", "replica": "0"}), 123)
      sched = serving_run.make_scheduler()
      export.MetricsExporter(process_every_s=0.0).attach(sched)
      reads.clear()
      serving_run.run(sched, serving_run.workload(n=4))
      self.assertLen(reads, sched.stats.steps)

  def test_registries_are_private(self):
    a, b = export.MetricsExporter(model="a"), export.MetricsExporter(model="b")
    a.observe_stats(type(serving_run.make_scheduler().stats)(steps=3))
    self.assertEqual(a.registry.get_sample_value(
        "paged_kv_scheduler_steps_total", {"model": "a", "replica": "0"}), 3)
    self.assertEqual(b.registry.get_sample_value(
        "paged_kv_scheduler_steps_total", {"model": "b", "replica": "0"}), 0)
    import prometheus_client  # pylint: disable=import-outside-toplevel
    self.assertIsNone(prometheus_client.REGISTRY.get_sample_value(
        "paged_kv_scheduler_steps_total", {"model": "a", "replica": "0"}))

  def test_namespaces_are_capped(self):
    exporter = export.MetricsExporter(max_namespaces=2)
    reqs = []
    for i, ns in enumerate(["a", b"b", ("c", 1), "a"]):
      req = serving_run.Request(i, np.arange(3), 1, namespace=ns)
      req.stop_reason, req.hit_tokens = "stop_token", 1
      reqs.append(req)
    exporter.observe_finished(reqs)
    fams = families(exporter.render())
    got = {s.labels["namespace"]: s.value for s in fams["paged_kv_request_success"].samples
           if s.name.endswith("_total")}
    self.assertEqual(got, {"a": 2, "bytes:62": 1, "other": 1})
    reasons = {s.labels["finished_reason"] for s in fams["paged_kv_request_success"].samples}
    self.assertEqual(reasons, {"stop"})  # vLLM's name for a stop token

  def test_typed_namespaces_never_share_a_label(self):
    """Issue P item 3: `1`, `"1"`, `b"1"` and `("1",)` were all label "1"; `("a","b")`,
    `"a/b"` and `(b"a","b")` all "a/b"."""
    keys = [1, "1", b"1", ("1",), ("a", "b"), "a/b", (b"a", "b"), "other", "int:1",
            "str:x", ("a", ("b",)), (("a",), "b"), "", (), b"", -1, ("1", 1)]
    labels = [export.namespace_label(k) for k in keys]
    self.assertLen(set(labels), len(keys), dict(zip(map(repr, keys), labels)))
    self.assertEqual(export.namespace_label("tenant-a"), "tenant-a")  # strings stay readable
    self.assertNotEqual(export.namespace_label("other"), export.OTHER_NAMESPACE)
    exporter = export.MetricsExporter()
    reqs = []
    for i, ns in enumerate((1, "1", b"1", ("1",))):
      req = serving_run.Request(i, np.arange(4), 1, namespace=ns)
      req.stop_reason, req.hit_tokens = "length", 0
      reqs.append(req)
    exporter.observe_finished(reqs)
    fams = families(exporter.render())
    got = {s.labels["namespace"] for s in fams["paged_kv_request_success"].samples
           if s.name.endswith("_total")}
    self.assertEqual(got, {"int:1", "1", "bytes:31", 'tuple:["1"]'})


class SnapshotAndAlertsTest(absltest.TestCase):

  def test_snapshot_gauges_by_declaration(self):
    _, counters, snap = small_pool_snapshot()
    exporter = export.MetricsExporter()
    exporter.set_cache_config(CFG)
    exporter.observe_snapshot(snap, step=7)
    fams = families(exporter.render())
    value = functools.partial(sample_value, fams)
    self.assertEqual(value("paged_kv_live_tokens"), 9)
    self.assertEqual(value("paged_kv_live_sequences"), 2)
    self.assertEqual(value("paged_kv_free_blocks"), snap.num_free_blocks)
    self.assertAlmostEqual(value("paged_kv_internal_fragmentation_ratio"),
                           snap.internal_fragmentation)
    self.assertAlmostEqual(value("paged_kv_kv_cache_usage_perc"), snap.kv_usage_ratio)
    for region, ratio in snap.fragmentation_by_region.items():
      self.assertAlmostEqual(value("paged_kv_fragmentation_ratio", region=region), ratio)
    self.assertEqual(value("paged_kv_last_snapshot_step"), 7)
    self.assertEqual(value("paged_kv_oom_total", reason="no_free_block"), 1)
    self.assertEqual(value("paged_kv_compaction_moves_total"), 3)
    self.assertEqual(value("paged_kv_compaction_bytes_total"), 3 * CFG.block_bytes)
    # The same cumulative totals seen again (counters and snapshot) count once.
    exporter.observe_stats(counters)
    exporter.observe_snapshot(snap)
    fams = families(exporter.render())
    self.assertEqual(sample_value(fams, "paged_kv_oom_total", reason="no_free_block"), 1)
    self.assertEqual(sample_value(fams, "paged_kv_compaction_moves_total"), 3)

  def test_alerts_count_by_name_and_stream_to_jsonl(self):
    _, _, snap = small_pool_snapshot(ooms=("no_free_block", "no_free_block"))
    alerts = metrics.AlertMonitor().observe(snap)
    self.assertNotEmpty(alerts)
    path = os.path.join(_tmpdir(self), "ev.jsonl")
    with export.JsonlLogger(path, mode="w") as log:
      exporter = export.MetricsExporter(events=log)
      fams = families(exporter.render())
      seeded = {s.labels["alert"] for s in fams["paged_kv_alerts"].samples}
      self.assertEqual(seeded, {name for name, _ in export.alert_rules()})
      self.assertEqual(exporter.record_alerts(alerts, step=4), len(alerts))
      # Written when recorded, before the file is closed.
      self.assertLen(export.read_jsonl(path, type="alert"), len(alerts))
    fams = families(exporter.render())
    for alert in alerts:
      self.assertEqual(sample_value(fams, "paged_kv_alerts_total", alert=alert.metric,
                                    severity=alert.severity), 1)
    events = export.read_jsonl(path, type="alert")
    self.assertEqual([e["metric"] for e in events], [a.metric for a in alerts])
    self.assertEqual({e["step"] for e in events}, {4})
    self.assertTrue(all(e["likely_cause"] and e["suggested_action"] for e in events))

  def test_attach_needs_on_step(self):
    with self.assertRaisesRegex(TypeError, "on_step"):
      export.MetricsExporter().attach(object())


class JsonlLoggerTest(absltest.TestCase):

  def test_round_trip_snapshots_and_alerts(self):
    _, counters, snap = small_pool_snapshot()
    alerts = metrics.AlertMonitor().observe(snap)
    self.assertNotEmpty(alerts)
    path = os.path.join(_tmpdir(self),
                        "run", "metrics.jsonl")
    with export.JsonlLogger(path) as log:
      log.log_snapshot(snap, step=5, preemptions_total=np.int64(1),
                       prefix_cache_hit_rate=float("nan"))
      log.log_alerts(alerts)
      counters.record_compaction(2, 0.5)
      log.log_snapshot(metrics.snapshot(paged_kv.BlockPool(CFG).state, CFG, counters=counters))
    self.assertTrue(log.closed)
    with self.assertRaisesRegex(ValueError, "closed"):
      log.log_snapshot(snap)

    with open(path, encoding="utf-8") as f:
      lines = f.read().splitlines()
    self.assertLen(lines, 2 + len(alerts))
    records = [json.loads(line) for line in lines]
    first, *alert_records, last = records

    expected = json.loads(json.dumps(snap.as_dict()))  # int keys -> str, as JSON does
    self.assertEqual(first["type"], "snapshot")
    self.assertEqual(first["step"], 5)
    self.assertTrue(math.isfinite(first["time"]))
    self.assertEqual({k: first[k] for k in expected}, expected)
    self.assertEqual(first["preemptions_total"], 1)
    self.assertIsNone(first["prefix_cache_hit_rate"])  # NaN -> null, strict JSON
    self.assertEqual(first["oom_by_reason"], {"no_free_block": 1})

    self.assertLen(alert_records, len(alerts))
    for record, alert in zip(alert_records, alerts):
      self.assertEqual(record["type"], "alert")
      self.assertEqual(record["step"], 5)  # the latest snapshot's step
      self.assertEqual({k: record[k] for k in alert.as_dict()},
                       json.loads(json.dumps(alert.as_dict())))
    self.assertEqual(last["type"], "snapshot")
    self.assertEqual(last["step"], 1)  # default: snapshots logged before
    self.assertEqual(last["compaction_moves"], 5)
    self.assertGreaterEqual(last["time"], first["time"])

    # Append mode keeps earlier lines; read_jsonl filters by type.
    with export.JsonlLogger(path) as log:
      log.log_snapshot({"live_tokens": 3}, step=9)
    self.assertLen(export.read_jsonl(path), len(records) + 1)
    self.assertEqual([r["step"] for r in export.read_jsonl(path, type="snapshot")], [5, 1, 9])
    self.assertLen(export.read_jsonl(path, type="alert"), len(alerts))

  def test_log_report_of_a_real_run(self):
    _, _, _, reports = serving_run.served_run()
    path = os.path.join(_tmpdir(self), "steps.jsonl")
    with export.JsonlLogger(path, mode="w") as log:
      for report in reports:
        log.log_report(report)
    steps = export.read_jsonl(path, type="step")
    self.assertEqual([r["step"] for r in steps], [r.step for r in reports])
    self.assertEqual(len(export.read_jsonl(path, type="snapshot")),
                     sum(r.snapshot is not None for r in reports))
    self.assertEqual(len(export.read_jsonl(path, type="alert")),
                     sum(len(r.alerts) for r in reports))
    finished = [f for r in steps for f in r["finished"]]
    self.assertEqual(len(finished), sum(len(r.finished) for r in reports))
    self.assertTrue(all(f["e2e_s"] >= f["ttft_s"] >= f["queue_s"] >= 0 for f in finished))
    self.assertEqual(steps[0]["pool"]["num_blocks"], serving_run.CFG.num_blocks)
    self.assertIn("kv_usage_ratio", steps[0]["pool"])
    self.assertIn("oom_by_reason", steps[-1]["stats"])

  def test_reserved_keys_and_bad_values(self):
    path = os.path.join(_tmpdir(self), "bad.jsonl")
    with export.JsonlLogger(path, mode="w") as log:
      with self.assertRaisesRegex(ValueError, "clash"):
        log.log_snapshot({"time": 1.0})
      with self.assertRaisesRegex(TypeError, "cannot write"):
        log.log_snapshot({"x": object()})
      with self.assertRaisesRegex(TypeError, "dataclass instance or a mapping"):
        log.log_alert("fragmentation high")
    self.assertEqual(export.read_jsonl(path), [])
    with self.assertRaisesRegex(ValueError, "mode"):
      export.JsonlLogger(path, mode="r")


class MissingPrometheusTest(absltest.TestCase):

  def test_clear_error_without_prometheus_client(self):
    blocked = {name: None for name in list(sys.modules)
               if name == "prometheus_client" or name.startswith("prometheus_client.")}
    blocked.setdefault("prometheus_client", None)
    with mock.patch.dict(sys.modules, blocked):
      with self.assertRaisesRegex(ImportError, re.escape("pip install 'paged-kv[metrics]'")):
        export.MetricsExporter(port=0)
      # The module itself imports without it, and the JSONL logger works.
      spec = importlib.util.spec_from_file_location("paged_kv_export_without_prometheus",
                                                    export.__file__)
      module = importlib.util.module_from_spec(spec)
      sys.modules[spec.name] = module  # removed again when the patch ends
      spec.loader.exec_module(module)
      path = os.path.join(_tmpdir(self), "noprom.jsonl")
      with module.JsonlLogger(path, mode="w") as log:
        log.log_snapshot({"live_tokens": 1}, step=0)
      self.assertEqual(module.read_jsonl(path)[0]["live_tokens"], 1)
      self.assertNotEmpty(module.METRICS)
    # Restored afterwards.
    export.MetricsExporter(port=0)


if __name__ == "__main__":
  absltest.main()
