"""Metrics export: the Prometheus exporter over real local HTTP, the naming and
counter/gauge rules, the JSONL logger, and the error when prometheus-client is
missing."""

import dataclasses
import importlib.util
import json
import math
import os
import re
import sys
import tempfile
import urllib.error
import urllib.request
from unittest import mock

import numpy as np
from absl.testing import absltest, parameterized

import paged_kv
from paged_kv.telemetry import export, metrics

CFG = paged_kv.PoolConfig(num_blocks=32, block_size=4, num_layers=1, num_kv_heads=1,
                          head_dim=8, max_seqs=4, max_segments=8)

_SAMPLE_RE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$')
_LABEL_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_exposition(text):
  """Parses the Prometheus text format: `({(name, labels): value}, {family: type})`.

  `labels` is a frozenset of `(label, value)` pairs. Written here (not taken
  from prometheus_client) so the test checks the bytes on the wire.
  """
  values, types = {}, {}
  for line in text.splitlines():
    if not line:
      continue
    if line.startswith("# TYPE "):
      _, _, name, kind = line.split(" ", 3)
      types[name] = kind
      continue
    if line.startswith("#"):
      continue
    m = _SAMPLE_RE.match(line)
    assert m, f"unparsable exposition line: {line!r}"
    name, labels, value = m.groups()
    values[(name, frozenset(_LABEL_RE.findall(labels or "")))] = float(value)
  return values, types


def fetch(url):
  with urllib.request.urlopen(url, timeout=5) as resp:
    assert resp.status == 200, resp.status
    ctype = resp.headers.get("Content-Type", "")
    return resp.read().decode("utf-8"), ctype


def small_pool_snapshot(num_tokens=(6, 3), ooms=("no_free_block",), moves=3):
  """A real snapshot of a small pool with live sequences and host counters."""
  pool = paged_kv.BlockPool(CFG)
  ids = [pool.open_sequence() for _ in num_tokens]
  pool.reserve_tokens(ids, list(num_tokens))
  counters = metrics.PoolCounters()
  for reason in ooms:
    counters.record_oom(reason, seq_len=20)
  counters.record_compaction(moves, 0.25)
  return pool, counters, metrics.snapshot(pool.state, CFG, counters=counters)


def numeric_fields(snap):
  """Scalar numeric fields of a snapshot dataclass (the exporter's generic rule)."""
  out = {}
  for f in dataclasses.fields(snap):
    value = getattr(snap, f.name)
    if isinstance(value, (bool, int, float, np.integer, np.floating)):
      out[f.name] = float(value)
  return out


class ExporterHttpTest(absltest.TestCase):

  def test_serves_snapshot_over_http_and_follows_updates(self):
    pool, counters, snap = small_pool_snapshot()
    exporter = export.MetricsExporter(port=0)
    exporter.start()
    self.addCleanup(exporter.stop)
    self.assertGreater(exporter.port, 0)
    self.assertStartsWith(exporter.url, "http://127.0.0.1:")

    exporter.update(snap, step=1, preemptions_total=2, swap_to_host_bytes=4096,
                    prefix_cache_hit_rate=0.5)
    text, ctype = fetch(exporter.url)
    self.assertIn("text/plain", ctype)
    values, types = parse_exposition(text)
    for name, _ in values:
      self.assertStartsWith(name, "paged_kv_")

    # Every numeric field of the real snapshot, by the documented rule.
    for field, value in numeric_fields(snap).items():
      kind = export.metric_kind(field)
      name = "paged_kv_" + field + ("_total" if kind == "counter" else "")
      self.assertIn((name, frozenset()), values, f"{field} not exported as {name}")
      self.assertAlmostEqual(values[(name, frozenset())], value, places=6, msg=field)
      self.assertEqual(types[name], kind, field)
    self.assertEqual(types["paged_kv_block_pool_utilization"], "gauge")
    self.assertEqual(values[("paged_kv_live_tokens", frozenset())], 9.0)
    self.assertEqual(types["paged_kv_compaction_moves_total"], "counter")
    self.assertEqual(values[("paged_kv_compaction_moves_total", frozenset())], 3.0)

    # Mapping fields: one metric with a label.
    oom = ("paged_kv_oom_total", frozenset({("reason", "no_free_block")}))
    self.assertEqual(values[oom], 1.0)
    self.assertEqual(types["paged_kv_oom_total"], "counter")
    for reason in ("no_contiguous_run", "table_full"):  # known reasons start at 0
      self.assertEqual(values[("paged_kv_oom_total", frozenset({("reason", reason)}))], 0.0)
    self.assertEqual(values[("paged_kv_oom_by_seq_len_total", frozenset({("seq_len", "32")}))],
                     1.0)
    for region, ratio in snap.fragmentation_by_region.items():
      self.assertAlmostEqual(
          values[("paged_kv_fragmentation", frozenset({("region", region)}))], ratio)

    # Extras passed by the scheduler.
    self.assertEqual(values[("paged_kv_step", frozenset())], 1.0)
    self.assertEqual(values[("paged_kv_preemptions_total", frozenset())], 2.0)
    self.assertEqual(types["paged_kv_preemptions_total"], "counter")
    self.assertEqual(values[("paged_kv_swap_to_host_bytes", frozenset())], 4096.0)
    self.assertEqual(values[("paged_kv_prefix_cache_hit_rate", frozenset())], 0.5)
    self.assertEqual(types["paged_kv_prefix_cache_hit_rate"], "gauge")

    # Change the pool and the counters; the next scrape shows it.
    seq = pool.open_sequence()
    pool.reserve_tokens([seq, 0], [6, 2])  # the shapes of the first call: no recompile
    counters.record_oom("no_contiguous_run")
    counters.record_oom("no_free_block")
    snap2 = metrics.snapshot(pool.state, CFG, counters=counters)
    exporter.update(snap2, step=2, preemptions_total=5)
    values2, _ = parse_exposition(fetch(exporter.url)[0])
    self.assertEqual(values2[("paged_kv_live_tokens", frozenset())], 17.0)
    self.assertEqual(values2[("paged_kv_live_sequences", frozenset())], 3.0)
    self.assertLess(values2[("paged_kv_num_free_blocks", frozenset())],
                    values[("paged_kv_num_free_blocks", frozenset())])
    self.assertEqual(values2[("paged_kv_step", frozenset())], 2.0)
    self.assertEqual(values2[("paged_kv_preemptions_total", frozenset())], 5.0)
    self.assertEqual(values2[oom], 2.0)
    self.assertEqual(
        values2[("paged_kv_oom_total", frozenset({("reason", "no_contiguous_run")}))], 1.0)
    # Not passed again: kept from the previous update.
    self.assertEqual(values2[("paged_kv_prefix_cache_hit_rate", frozenset())], 0.5)

    port = exporter.port
    exporter.stop()
    self.assertFalse(exporter.serving)
    with self.assertRaises((urllib.error.URLError, ConnectionError)):
      fetch(f"http://127.0.0.1:{port}/metrics")

  def test_context_manager_alerts_and_double_start(self):
    _, _, snap = small_pool_snapshot(ooms=("no_free_block", "no_free_block"))
    alerts = metrics.AlertMonitor().observe(snap)
    self.assertNotEmpty(alerts)
    with export.MetricsExporter(port=0) as exporter:
      with self.assertRaisesRegex(RuntimeError, "already serving"):
        exporter.start()
      self.assertEqual(exporter.record_alerts(alerts), len(alerts))
      exporter.record_alerts([{"metric": "fragmentation_ratio", "severity": "warning"}])
      values, types = parse_exposition(fetch(exporter.url)[0])
    self.assertEqual(types["paged_kv_alerts_total"], "counter")
    for alert in alerts:
      key = ("paged_kv_alerts_total",
             frozenset({("metric", alert.metric), ("severity", alert.severity)}))
      expected = 2.0 if alert.metric == "fragmentation_ratio" else 1.0
      self.assertEqual(values[key], expected)
    with self.assertRaisesRegex(RuntimeError, "not serving"):
      _ = exporter.port

  def test_uses_given_registry(self):
    import prometheus_client  # pylint: disable=import-outside-toplevel
    registry = prometheus_client.CollectorRegistry()
    exporter = export.MetricsExporter(registry=registry)
    exporter.update({"live_tokens": 7})
    self.assertEqual(registry.get_sample_value("paged_kv_live_tokens"), 7.0)
    self.assertIn("paged_kv_live_tokens 7.0", exporter.render())


class NamingRulesTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("total_suffix", "preemptions_total", "counter"),
      ("count_suffix", "request_count", "counter"),
      ("cumulative_counter_field", "compaction_moves", "counter"),
      ("mapping_counter_field", "oom_by_reason", "counter"),
      ("num_is_a_gauge", "num_free_blocks", "gauge"),
      ("average_of_counts", "prefix_cache_avg_ref_count", "gauge"),
      ("ratio", "fragmentation_ratio", "gauge"),
      ("rate", "prefix_cache_hit_rate", "gauge"),
      ("per", "segments_per_sequence", "gauge"),
      ("bytes", "swap_to_host_bytes", "gauge"),
  )
  def test_kind(self, field, kind):
    self.assertEqual(export.metric_kind(field), kind)

  def test_overrides(self):
    self.assertEqual(export.metric_kind("swap_to_host_bytes",
                                        counter_fields={"swap_to_host_bytes"}), "counter")
    self.assertEqual(export.metric_kind("requests_total", gauge_fields={"requests_total"}),
                     "gauge")
    exporter = export.MetricsExporter(counter_fields=["swap_to_host_bytes"])
    exporter.update(swap_to_host_bytes=np.int64(10))
    values, types = parse_exposition(exporter.render())
    self.assertEqual(types["paged_kv_swap_to_host_bytes_total"], "counter")
    self.assertEqual(values[("paged_kv_swap_to_host_bytes_total", frozenset())], 10.0)
    with self.assertRaisesRegex(ValueError, "both"):
      export.MetricsExporter(counter_fields=["a"], gauge_fields=["a"])

  def test_samples_of_mixed_values(self):

    @dataclasses.dataclass(frozen=True)
    class Inner:
      moves: int
      note: str

    @dataclasses.dataclass(frozen=True)
    class Snap:
      ok: bool
      util: np.float32
      scalar_array: np.ndarray
      vector: np.ndarray
      name: str
      missing: None
      hits_by_namespace: dict
      sizes: dict
      inner: Inner

    snap = Snap(ok=True, util=np.float32(0.5), scalar_array=np.array(3),
                vector=np.arange(3), name="x", missing=None,
                hits_by_namespace={"tenant_a": 2, "tenant_b": np.int32(5), "bad": "n/a"},
                sizes={16: 1}, inner=Inner(4, "skip"))
    got = {(s.name, s.kind, s.label, s.label_value): s.value
           for s in export.metric_samples(snap, extra_total=1)}
    self.assertEqual(got, {
        ("paged_kv_ok", "gauge", None, None): 1.0,
        ("paged_kv_util", "gauge", None, None): 0.5,
        ("paged_kv_scalar_array", "gauge", None, None): 3.0,
        ("paged_kv_hits", "gauge", "namespace", "tenant_a"): 2.0,
        ("paged_kv_hits", "gauge", "namespace", "tenant_b"): 5.0,
        ("paged_kv_sizes", "gauge", "key", "16"): 1.0,
        ("paged_kv_inner_moves", "gauge", None, None): 4.0,
        ("paged_kv_extra", "counter", None, None): 1.0,
    })

  def test_mapping_name_collision_keeps_full_name(self):
    samples = export.metric_samples({"oom_by_reason": {"a": 1}, "oom_by_seq_len": {8: 2},
                                     "frag_by_region": {"base": 0.1}, "frag": 0.2})
    names = {(s.field, s.name) for s in samples}
    self.assertEqual(names, {("oom_by_reason", "paged_kv_oom"),
                             ("oom_by_seq_len", "paged_kv_oom_by_seq_len"),
                             ("frag_by_region", "paged_kv_frag_by_region"),
                             ("frag", "paged_kv_frag")})

  def test_updates_merge_and_label_sets_grow(self):
    exporter = export.MetricsExporter(known_labels={})
    exporter.update({"oom_by_reason": {"no_free_block": 1}}, a_total=1)
    exporter.update({"oom_by_reason": {"table_full": 4}}, b=2.5)
    values, _ = parse_exposition(exporter.render())
    self.assertEqual(values[("paged_kv_oom_total", frozenset({("reason", "no_free_block")}))],
                     1.0)
    self.assertEqual(values[("paged_kv_oom_total", frozenset({("reason", "table_full")}))], 4.0)
    self.assertEqual(values[("paged_kv_a_total", frozenset())], 1.0)
    self.assertEqual(values[("paged_kv_b", frozenset())], 2.5)
    self.assertLen([k for k in values if k[0] == "paged_kv_oom_total"], 2)

  @parameterized.named_parameters(
      ("negative_counter", {"moves_total": -1}, ValueError, "finite number >= 0"),
      ("nan_counter", {"moves_total": float("nan")}, ValueError, "finite number >= 0"),
      ("bad_field_name", {"bad-name": 1}, ValueError, "not a valid identifier"),
      ("reserved_alerts", {"alerts_total": 1}, ValueError, "reserved"),
      ("gauge_and_counter_one_name", {"moves": 1, "moves_total": 2}, ValueError,
       "would both export as 'paged_kv_moves'"),
  )
  def test_bad_update(self, fields, error, regex):
    exporter = export.MetricsExporter()
    exporter.update(ok=1)
    with self.assertRaisesRegex(error, regex):
      exporter.update(fields)
    # A failed update changes nothing.
    values, _ = parse_exposition(exporter.render())
    self.assertEqual(values, {("paged_kv_ok", frozenset()): 1.0})

  def test_bad_arguments(self):
    with self.assertRaisesRegex(TypeError, "dataclass instance or a mapping"):
      export.metric_samples([1, 2])
    with self.assertRaisesRegex(ValueError, "port"):
      export.MetricsExporter(port=-1)


class JsonlLoggerTest(absltest.TestCase):

  def test_round_trip_snapshots_and_alerts(self):
    _, counters, snap = small_pool_snapshot()
    alerts = metrics.AlertMonitor().observe(snap)
    self.assertNotEmpty(alerts)
    path = os.path.join(tempfile.mkdtemp(dir=absltest.get_default_test_tmpdir()),
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

  def test_reserved_keys_and_bad_values(self):
    path = os.path.join(absltest.get_default_test_tmpdir(), "bad.jsonl")
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
      path = os.path.join(absltest.get_default_test_tmpdir(), "noprom.jsonl")
      with module.JsonlLogger(path, mode="w") as log:
        log.log_snapshot({"live_tokens": 1}, step=0)
      self.assertEqual(module.read_jsonl(path)[0]["live_tokens"], 1)
      self.assertNotEmpty(module.metric_samples({"live_tokens": 1}))
    # Restored afterwards.
    export.MetricsExporter(port=0)


if __name__ == "__main__":
  absltest.main()
