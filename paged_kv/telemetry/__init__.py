"""What an operator sees: metrics snapshots and alerts, Prometheus and JSONL export.

  paged_kv.telemetry.metrics  `snapshot` -> `PoolSnapshot`, `PoolCounters`, alerts
  paged_kv.telemetry.export   `MetricsExporter` (Prometheus), `JsonlLogger`, `read_jsonl`

Reads the core's state and the serving layer's counters; imports nothing of serving.
"""

from paged_kv.telemetry.export import JsonlLogger, MetricsExporter, read_jsonl
from paged_kv.telemetry.metrics import (Alert, AlertMonitor, AlertThresholds, PoolCounters,
                                        PoolSnapshot, check_alerts, snapshot)

__all__ = ["Alert", "AlertMonitor", "AlertThresholds", "JsonlLogger", "MetricsExporter",
           "PoolCounters", "PoolSnapshot", "check_alerts", "read_jsonl", "snapshot"]
