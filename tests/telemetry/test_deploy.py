"""The Grafana dashboard and the Prometheus alert rules in deploy/: they load, every
metric they use is served by a live exporter fed a real scheduler run, the alert
thresholds are `AlertThresholds`', and promtool accepts them (when installed)."""

import dataclasses
import json
import pathlib
import re
import shutil
import subprocess
import tempfile

from absl.testing import absltest
import pytest

from paged_kv.telemetry import export, metrics
from tests.telemetry import serving_run

try:
  import yaml
except ImportError:  # PyYAML is in the `test` extra
  yaml = None

_ROOT = pathlib.Path(__file__).resolve().parents[2]
DASHBOARD = _ROOT / "deploy" / "grafana" / "paged_kv.json"
ALERTS = _ROOT / "deploy" / "prometheus" / "alerts.yml"
ALERTS_TEST = _ROOT / "deploy" / "prometheus" / "tests" / "alerts_test.yml"
_METRIC_RE = re.compile(r"\bpaged_kv_[a-zA-Z0-9_]+")
# Grafana's variables, as a query sent to Prometheus would have them.
_GRAFANA_VARS = {"$__rate_interval": "5m", "$model": ".*", "$replica": ".*"}


def served_sample_names() -> set[str]:
  from prometheus_client.parser import text_string_to_metric_families  # pylint: disable=import-outside-toplevel
  _, _, text, _ = serving_run.served_run()
  return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def dashboard_targets() -> list[tuple[str, str]]:
  """`(panel title, expr)` of every query of the dashboard."""
  dash = json.loads(DASHBOARD.read_text())
  return [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", ())]


def promql(expr: str) -> str:
  for var, value in _GRAFANA_VARS.items():
    expr = expr.replace(var, value)
  return expr


def load_rules() -> list[dict]:
  doc = yaml.safe_load(ALERTS.read_text())
  return [r for g in doc["groups"] for r in g["rules"]]


class DashboardTest(absltest.TestCase):

  def test_panels_an_operator_needs(self):
    dash = json.loads(DASHBOARD.read_text())
    self.assertEqual(dash["uid"], "paged-kv-overview")
    titles = [p["title"] for p in dash["panels"]]
    for want in ("KV cache usage", "Prefix cache hit rate (tokens)", "Fragmentation by region",
                 "Largest contiguous free run", "Compaction", "OOM by reason", "Preemptions",
                 "Time to first token", "Inter-token latency", "Compiles and memory mappings"):
      self.assertIn(want, titles)
    exprs = {}
    for title, expr in dashboard_targets():
      exprs[title] = exprs.get(title, "") + "\n" + expr
    hit = exprs["Prefix cache hit rate (tokens)"]
    self.assertRegex(hit, r"rate\(paged_kv_prefix_cache_hits_total.*\).*/.*"
                          r"rate\(paged_kv_prefix_cache_queries_total")
    self.assertIn("histogram_quantile(0.99", exprs["Time to first token"])
    self.assertIn("histogram_quantile(0.5", exprs["Inter-token latency"])
    self.assertIn("rate(paged_kv_compaction_bytes_total", exprs["Compaction"])
    ids = [p["id"] for p in dash["panels"]]
    self.assertLen(set(ids), len(ids))
    for p in dash["panels"]:
      if p["type"] != "row":
        self.assertTrue(p["description"], p["title"])
        self.assertIn("unit", p["fieldConfig"]["defaults"], p["title"])

  @pytest.mark.slow
  def test_every_metric_used_is_served(self):
    served = served_sample_names()
    for title, expr in dashboard_targets():
      names = _METRIC_RE.findall(expr)
      self.assertNotEmpty(names, title)
      for name in names:
        self.assertIn(name, served, f"panel {title!r} uses {name}, not in a live scrape")
    # The variables' query too.
    self.assertIn("paged_kv_cache_config_info", served)

  def test_queries_parse(self):
    promtool = shutil.which("promtool")
    if promtool is None:
      self.skipTest("promtool not installed (apt-get install prometheus)")
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:q{i}", "expr": promql(e)}
        for i, (_, e) in enumerate(dashboard_targets())]}]}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
      json.dump(rules, f)  # JSON is YAML: promtool reads it
    proc = subprocess.run([promtool, "check", "rules", f.name], capture_output=True, text=True,
                          check=False)
    self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)


class AlertRulesTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    if yaml is None:
      self.skipTest("PyYAML not installed (the `test` extra has it)")

  def test_schema(self):
    doc = yaml.safe_load(ALERTS.read_text())
    self.assertEqual(set(doc), {"groups"})
    for group in doc["groups"]:
      self.assertEqual(set(group) - {"interval"}, {"name", "rules"})
      for rule in group["rules"]:
        self.assertLessEqual(set(rule), {"alert", "expr", "for", "labels", "annotations"}, rule)
        self.assertRegex(rule["alert"], r"^PagedKV[A-Za-z]+$")
        self.assertIsInstance(rule["expr"], str)
        if "for" in rule:
          self.assertRegex(rule["for"], r"^\d+[smh]$")
        self.assertIn(rule["labels"]["severity"], ("warning", "critical"))
        for key in ("summary", "description", "cause", "action"):
          self.assertTrue(rule["annotations"].get(key), f"{rule['alert']}: no {key}")

  def test_one_rule_per_in_process_alert_with_its_threshold_and_severity(self):
    thresholds = metrics.AlertThresholds()
    # (Rules on the process, without an in-process counterpart, carry no such label.)
    rules = {r["labels"]["paged_kv_alert"]: r for r in load_rules()
             if "paged_kv_alert" in r["labels"]}
    self.assertEqual(set(rules), {name for name, _ in export.alert_rules()})
    for name, severity in export.alert_rules():
      rule = rules[name]
      self.assertEqual(rule["labels"]["severity"], severity, name)
      field = name.replace("oom_by_reason.", "oom_")
      self.assertIn(field, {f.name for f in dataclasses.fields(thresholds)})
      level = float(re.search(r">\s*([0-9.]+)\s*$", rule["expr"]).group(1))
      self.assertEqual(level, float(getattr(thresholds, field)), name)
      self.assertIn(f"AlertThresholds.{field} = ", rule["annotations"]["description"])
      if name.startswith("oom_by_reason."):
        reason = name.split(".", 1)[1]
        self.assertIn(f'paged_kv_oom_total{{reason="{reason}"}}', rule["expr"])

  def test_runtime_rules(self):
    doc = yaml.safe_load(ALERTS.read_text())
    groups = {g["name"]: g["rules"] for g in doc["groups"]}
    unlabelled = [r["alert"] for r in load_rules() if "paged_kv_alert" not in r["labels"]]
    self.assertEqual(unlabelled, [r["alert"] for r in groups["paged_kv_runtime"]])
    rule = {r["alert"]: r for r in groups["paged_kv_runtime"]}["PagedKVCompilesAfterWarmup"]
    self.assertEqual(rule["expr"], "paged_kv_compiles_after_warmup > 0")
    self.assertEqual((rule["for"], rule["labels"]["severity"]), ("5m", "warning"))
    self.assertIn("vm.max_map_count", rule["annotations"]["description"])

  @pytest.mark.slow
  def test_every_metric_used_is_served(self):
    served = served_sample_names()
    for rule in load_rules():
      for name in _METRIC_RE.findall(rule["expr"]):
        self.assertIn(name, served, f"{rule['alert']} uses {name}, not in a live scrape")

  def test_promtool(self):
    promtool = shutil.which("promtool")
    if promtool is None:
      self.skipTest("promtool not installed (apt-get install prometheus)")
    for args in (["check", "rules", str(ALERTS)], ["test", "rules", str(ALERTS_TEST)]):
      proc = subprocess.run([promtool, *args], capture_output=True, text=True, check=False,
                            cwd=ALERTS.parent)
      self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)


class DocsTest(absltest.TestCase):

  def test_docs_list_every_metric_with_type_and_vllm_counterpart(self):
    text = (_ROOT / "docs" / "metrics.md").read_text()
    rows = {}
    for line in text.splitlines():
      m = re.match(r"^\| `(paged_kv_[a-z0-9_]+)` \| (\w+) \| ([^|]+) \|", line)
      if m:
        rows[m.group(1)] = (m.group(2), line)
    for spec in export.METRICS:
      name = export.exposed_names(spec)[0]
      self.assertIn(name, rows, f"docs/metrics.md does not list {name}")
      kind, line = rows[name]
      self.assertEqual(kind, spec.kind, name)
      self.assertIn(spec.help, line, name)
      self.assertIn(f"`{spec.vllm}`" if spec.vllm else "| none |", line, name)
    self.assertLen(rows, len(export.METRICS))


if __name__ == "__main__":
  absltest.main()
