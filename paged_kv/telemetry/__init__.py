"""What an operator sees: per-step figures, snapshots, alerts, Prometheus and JSONL export.

  paged_kv.telemetry.metrics  `step_stats` -> `StepStats` (cheap, every step),
                              `snapshot` -> `PoolSnapshot` (full, periodic),
                              `PoolCounters`, alerts (`ALERT_RULES`, `AlertMonitor`)
  paged_kv.telemetry.export   `MetricsExporter` (Prometheus, the metrics in `METRICS`,
                              docs/metrics.md), `JsonlLogger`, `read_jsonl`
  paged_kv.telemetry.plots    the operator's PNGs (matplotlib, the `plots` extra)

Reads the core's state and the serving layer's counters; imports nothing of serving.
"""

from paged_kv.telemetry.export import METRICS, JsonlLogger, MetricsExporter, read_jsonl
from paged_kv.telemetry.metrics import (ALERT_RULES, Alert, AlertMonitor, AlertThresholds,
                                        PoolCounters, PoolSnapshot, StepStats, check_alerts,
                                        snapshot, step_stats)

__all__ = ["ALERT_RULES", "Alert", "AlertMonitor", "AlertThresholds", "JsonlLogger", "METRICS",
           "MetricsExporter", "PoolCounters", "PoolSnapshot", "StepStats", "check_alerts",
           "read_jsonl", "snapshot", "step_stats"]
