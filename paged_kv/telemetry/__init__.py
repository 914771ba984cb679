"""What an operator sees: per-step figures, snapshots, alerts, Prometheus and JSONL export.

`metrics` (`StepStats`, `PoolSnapshot`, alerts), `export` (`MetricsExporter`,
`JsonlLogger`, `read_jsonl`) and `plots` (the `plots` extra). Reads the pool's state
and the caller's counters (a `SchedulerStats`, by its fields); imports nothing of the
scheduler.
"""

from paged_kv.telemetry.export import METRICS, JsonlLogger, MetricsExporter, read_jsonl
from paged_kv.telemetry.metrics import (ALERT_RULES, Alert, AlertMonitor, AlertThresholds,
                                        PoolSnapshot, StepStats, check_alerts, snapshot,
                                        step_stats)

__all__ = ["ALERT_RULES", "Alert", "AlertMonitor", "AlertThresholds", "JsonlLogger", "METRICS",
           "MetricsExporter", "PoolSnapshot", "StepStats", "check_alerts",
           "read_jsonl", "snapshot", "step_stats"]
