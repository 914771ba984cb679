"""Metrics export: a Prometheus exporter and a JSONL logger for pool snapshots.

Both take any snapshot dataclass (`paged_kv.telemetry.metrics.PoolSnapshot`, or the
scheduler's own) or a plain mapping, plus extra keyword values, so a serving
loop can write, every step:

  exporter = MetricsExporter(port=0).start()      # needs `paged-kv[metrics]`
  with JsonlLogger("run/metrics.jsonl") as log:
    for step in ...:
      snap = paged_kv.telemetry.metrics.snapshot(pool.state, pool.config, counters=counters)
      exporter.update(snap, step=step, preemptions_total=n_preempted)
      log.log_snapshot(snap, step=step, preemptions_total=n_preempted)
      log.log_alerts(monitor.observe(snap), step=step)
  exporter.stop()

Naming and typing rules of the Prometheus export (`metric_samples`):

* Every numeric field `x` (int, float, bool, numpy scalar, 0-d array) becomes
  `paged_kv_x`. Non-numeric values (strings, None, arrays, lists) are skipped,
  in mappings too. Two fields that would map to one name are an error.
* A mapping field `x_by_y = {key: number}` becomes one metric `paged_kv_x`
  with label `y` (`oom_by_reason` -> `paged_kv_oom_total{reason="..."}`); a
  mapping field whose name has no `_by_` gets the label `key`. When several
  fields of one snapshot map to the same name, the first one in field order
  keeps it and the others keep their full field name (`oom_by_seq_len` ->
  `paged_kv_oom_by_seq_len_total{seq_len="..."}`). Known keys
  (`DEFAULT_KNOWN_LABELS`: every OOM reason) are exported as 0 until they occur.
* A nested dataclass field `x` is flattened as `x_<subfield>`.
* Counter or gauge, by field name (for mapping fields, the full field name):
  1. the exporter's `counter_fields` / `gauge_fields` arguments win;
  2. a name with an `avg`, `mean`, `ratio`, `rate`, `fraction` or `per` word is
     a gauge (an average of counts is not a count);
  3. a name whose last word is `total` or `count` is a counter;
  4. a name in `CUMULATIVE_FIELDS` (the host counters of
     `paged_kv.telemetry.metrics.PoolCounters` that snapshots carry) is a counter;
  5. anything else is a gauge.
  Counters are exposed with the `_total` suffix Prometheus requires
  (`compaction_moves` -> `paged_kv_compaction_moves_total`; a name already
  ending in `_total` is not suffixed twice). A counter value must be a finite
  number >= 0; it is exported as given (the snapshot holds cumulative values),
  so a process restart shows as an ordinary counter reset.

Values persist in the exporter until a later `update` overwrites them, so
separate calls may update separate fields.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
import re
import socket
import socketserver
import threading
import time
import wsgiref.simple_server
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TextIO

import numpy as np

from paged_kv.core.errors import OOM_REASONS

PREFIX = "paged_kv_"

# Cumulative host counters (`paged_kv.telemetry.metrics.PoolCounters`) whose names do not
# say `total`/`count`; exported as Prometheus counters.
CUMULATIVE_FIELDS = frozenset({
    "oom_by_reason",
    "oom_by_seq_len",
    "compaction_steps",
    "compaction_moves",
    "compaction_seconds",
    "pack_moves",
    "cow_splits",
    "promotions",
})

# Label values exported as 0 until they occur, so that `rate()` and alert
# rules see a series from the start (`MetricsExporter(known_labels=...)`).
DEFAULT_KNOWN_LABELS = {"oom_by_reason": tuple(OOM_REASONS.values())}

_GAUGE_WORDS = frozenset({"avg", "mean", "ratio", "rate", "fraction", "per"})
_COUNTER_LAST_WORDS = frozenset({"total", "count"})
_NAME_RE = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_ALERTS = PREFIX + "alerts"  # the alert-event counter family


def _prometheus():
  """Imports `prometheus_client`, or raises an ImportError naming the extra."""
  try:
    import prometheus_client  # pylint: disable=import-outside-toplevel
    import prometheus_client.core  # pylint: disable=import-outside-toplevel
  except ImportError as err:
    raise ImportError(
        "paged_kv.telemetry.export.MetricsExporter needs the optional dependency "
        "'prometheus-client'; install it with: pip install 'paged-kv[metrics]'") from err
  return prometheus_client


# ---------------------------------------------------------------------------
# Snapshot -> samples (pure, no prometheus_client).
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MetricSample:
  """One exported value.

  Attributes:
    name: the Prometheus family name, prefixed (`paged_kv_oom`); a counter's
      sample is exposed as `name + "_total"`.
    kind: `"counter"` or `"gauge"`.
    label: the label name for a mapping field, or None.
    label_value: the label value (the mapping key as a string), or None.
    value: the number.
    field: the snapshot field (or extra keyword) it came from.
  """

  name: str
  kind: str
  label: str | None
  label_value: str | None
  value: float
  field: str


def _as_fields(obj: Any, what: str) -> dict[str, Any]:
  """Top-level fields of a dataclass instance or a mapping, in order."""
  if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
  if isinstance(obj, Mapping):
    return dict(obj)
  raise TypeError(f"{what} must be a dataclass instance or a mapping, got {type(obj).__name__}")


def _number(value: Any) -> float | None:
  """`value` as a float if it is a numeric scalar, else None."""
  if isinstance(value, (bool, np.bool_)):
    return float(value)
  if isinstance(value, numbers.Real):
    return float(value)
  if isinstance(value, np.ndarray) or hasattr(value, "__array__"):
    try:
      arr = np.asarray(value)
    except Exception:  # pylint: disable=broad-except
      return None
    kind = arr.dtype.kind
    if arr.ndim == 0 and kind in "biuf":
      return float(arr)
  return None


def metric_kind(field: str, *, counter_fields: Iterable[str] = (),
                gauge_fields: Iterable[str] = ()) -> str:
  """`"counter"` or `"gauge"` for a field name, by the rules in the module docstring."""
  if field in set(counter_fields):
    return "counter"
  if field in set(gauge_fields):
    return "gauge"
  words = field.lower().split("_")
  if _GAUGE_WORDS.intersection(words):
    return "gauge"
  if words[-1] in _COUNTER_LAST_WORDS or field in CUMULATIVE_FIELDS:
    return "counter"
  return "gauge"


def _family_name(field: str, kind: str) -> str:
  """`paged_kv_<field>`, without a counter's `_total` (the exposition adds it)."""
  name = PREFIX + field
  if kind == "counter" and name.endswith("_total"):
    name = name[:-len("_total")]
  return name


def _flatten(fields: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
  """(field name, value) pairs with nested dataclasses flattened as `x_sub`."""
  out = []
  for key, value in fields.items():
    if not isinstance(key, str) or not _NAME_RE.match(key):
      raise ValueError(f"metric field name {key!r} is not a valid identifier "
                       "([a-zA-Z_][a-zA-Z0-9_]*)")
    name = prefix + key
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
      out.extend(_flatten(_as_fields(value, name), name + "_"))
    else:
      out.append((name, value))
  return out


def metric_samples(snapshot: Any = None, *, counter_fields: Iterable[str] = (),
                   gauge_fields: Iterable[str] = (),
                   known_labels: Mapping[str, Iterable[Any]] | None = None,
                   **extra: Any) -> list[MetricSample]:
  """Prometheus samples of a snapshot and extra values (rules in the module docstring).

  Args:
    snapshot: a dataclass instance (e.g. `PoolSnapshot`), a mapping, or None.
    counter_fields, gauge_fields: field names forced to a kind.
    known_labels: `{mapping field: keys}` exported as 0 when the field is
      present but lacks them (e.g. every OOM reason before its first OOM).
    **extra: more fields (e.g. `step=`, `preemptions_total=`); an extra field
      with the name of a snapshot field replaces it.

  Returns:
    One `MetricSample` per exported value, in field order.

  Raises:
    TypeError: `snapshot` is neither a dataclass instance nor a mapping.
    ValueError: a field name is not an identifier, two fields map to one
      metric name, or a counter value is negative or not finite.
  """
  fields = {} if snapshot is None else _as_fields(snapshot, "snapshot")
  fields.update(extra)
  counter_fields, gauge_fields = frozenset(counter_fields), frozenset(gauge_fields)
  pairs = _flatten(fields)
  scalar_names = {name for name, value in pairs if not isinstance(value, Mapping)}
  taken: set[str] = set()
  owners: dict[str, str] = {}  # family and exposed sample names -> field
  samples = []
  for field, value in pairs:
    kind = metric_kind(field, counter_fields=counter_fields, gauge_fields=gauge_fields)
    if isinstance(value, Mapping):
      base, label = (field.split("_by_", 1) if "_by_" in field else (field, "key"))
      if not base or not _NAME_RE.match(label):
        base, label = field, "key"
      if base in scalar_names or base in taken:
        base = field
      seeded = {str(k): 0 for k in (known_labels or {}).get(field, ())}
      seeded.update((str(k), v) for k, v in value.items())
      entries = [(k, _number(v)) for k, v in seeded.items()]
      entries = [(k, v) for k, v in entries if v is not None]
    else:
      number = _number(value)
      if number is None:
        continue
      base, label, entries = field, None, [(None, number)]
    taken.add(base)
    name = _family_name(base, kind)
    for exposed in {name, name + "_total" if kind == "counter" else name}:
      if owners.setdefault(exposed, field) != field:
        raise ValueError(f"fields {owners[exposed]!r} and {field!r} would both export as "
                         f"{exposed!r}; rename one or force its kind")
    for label_value, number in entries:
      if kind == "counter" and not (math.isfinite(number) and number >= 0):
        raise ValueError(f"counter {field!r} must be a finite number >= 0, got {number!r}"
                         " (pass it in gauge_fields if it can decrease)")
      samples.append(MetricSample(name, kind, label, label_value, number, field))
  return samples


# ---------------------------------------------------------------------------
# Prometheus exporter.
# ---------------------------------------------------------------------------


class _ThreadingWSGIServer(socketserver.ThreadingMixIn, wsgiref.simple_server.WSGIServer):
  """A WSGI server answering each scrape in its own daemon thread."""

  daemon_threads = True


class _QuietHandler(wsgiref.simple_server.WSGIRequestHandler):
  """Does not log every scrape to stderr."""

  def log_message(self, format, *args):  # pylint: disable=redefined-builtin
    del format, args


@dataclasses.dataclass
class _Family:
  """One exported family: kind, label names, and values keyed by label values."""

  kind: str
  labels: tuple[str, ...]
  field: str
  values: dict[tuple[str, ...], float]


class _SnapshotCollector:
  """A prometheus_client collector yielding the exporter's latest values."""

  def __init__(self, families_fn: Callable[[], list[tuple[str, _Family]]]):
    self._families_fn = families_fn

  def describe(self) -> list:
    """No fixed names: families appear with the first update."""
    return []

  def collect(self) -> Iterator[Any]:
    """One metric family per exported name, from the latest values."""
    core = _prometheus().core
    for name, fam in self._families_fn():
      doc = f"paged_kv {fam.field} ({fam.kind})"
      cls = core.CounterMetricFamily if fam.kind == "counter" else core.GaugeMetricFamily
      metric = cls(name, doc, labels=list(fam.labels))
      for label_values, value in sorted(fam.values.items()):
        metric.add_metric(list(label_values), value)
      yield metric


class MetricsExporter:
  """Serves the latest snapshot at `/metrics` in the Prometheus text format.

  Example:
    exporter = MetricsExporter(port=0).start()     # port 0: any free port
    exporter.update(paged_kv.telemetry.metrics.snapshot(pool.state, pool.config), step=3)
    print(exporter.url)                             # http://127.0.0.1:<port>/metrics
    exporter.stop()

  Names and kinds follow the rules in this module's docstring. Alert events
  (`paged_kv.telemetry.metrics.Alert` or mappings with `metric` and `severity`) passed to
  `record_alerts` count in `paged_kv_alerts_total{metric, severity}`.

  Args:
    port: TCP port for `start()`; 0 picks a free one (see `port` afterwards).
    registry: the `prometheus_client.CollectorRegistry` to register in; None
      creates a private one (pass `prometheus_client.REGISTRY` to serve the
      process metrics beside ours).
    addr: the address to bind; localhost by default.
    counter_fields, gauge_fields: field names forced to a kind.
    known_labels: `{mapping field: keys}` exported as 0 until they occur;
      by default every OOM reason of `oom_by_reason` (`DEFAULT_KNOWN_LABELS`).

  Raises:
    ImportError: prometheus-client is not installed (the `paged-kv[metrics]` extra).
  """

  def __init__(self, port: int = 0, registry: Any = None, *, addr: str = "127.0.0.1",
               counter_fields: Iterable[str] = (), gauge_fields: Iterable[str] = (),
               known_labels: Mapping[str, Iterable[Any]] | None = None):
    prom = _prometheus()
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
      raise ValueError(f"port must be an int in [0, 65535], got {port!r}")
    self._requested_port = port
    self._addr = addr
    self._counter_fields = frozenset(counter_fields)
    self._gauge_fields = frozenset(gauge_fields)
    self._known_labels = {k: tuple(v) for k, v in
                          (DEFAULT_KNOWN_LABELS if known_labels is None else known_labels).items()}
    both = self._counter_fields & self._gauge_fields
    if both:
      raise ValueError(f"fields {sorted(both)} are in both counter_fields and gauge_fields")
    self.registry = prom.CollectorRegistry() if registry is None else registry
    self._lock = threading.Lock()
    self._families: dict[str, _Family] = {}
    self._server = None
    self._thread: threading.Thread | None = None
    self._collector = _SnapshotCollector(self._families_copy)
    self.registry.register(self._collector)

  # -- values ----------------------------------------------------------------
  def update(self, snapshot: Any = None, **extra: Any) -> list[MetricSample]:
    """Sets the exported values from a snapshot and extra fields.

    Args:
      snapshot: a dataclass instance (e.g. `PoolSnapshot`), a mapping, or None.
      **extra: more numeric or mapping fields (`step=`, `preemptions_total=`,
        `swap_to_host_bytes=`, `prefix_cache_hit_rate=`, ...).

    Returns:
      The samples set (see `metric_samples`).
    """
    samples = metric_samples(snapshot, counter_fields=self._counter_fields,
                             gauge_fields=self._gauge_fields,
                             known_labels=self._known_labels, **extra)
    reserved = [s.field for s in samples if s.name == _ALERTS]
    if reserved:
      raise ValueError(f"field {reserved[0]!r} would export as {_ALERTS!r}, which is "
                       "reserved for record_alerts; rename it")
    with self._lock:
      fresh: dict[str, _Family] = {}
      for s in samples:
        fam = fresh.get(s.name)
        if fam is None:
          old = self._families.get(s.name)
          labels = () if s.label is None else (s.label,)
          keep = old is not None and (old.kind, old.labels) == (s.kind, labels)
          fam = fresh[s.name] = _Family(s.kind, labels, s.field,
                                        dict(old.values) if keep else {})
        fam.values[() if s.label is None else (s.label_value,)] = s.value
      self._families.update(fresh)
    return samples

  def record_alerts(self, alerts: Iterable[Any]) -> int:
    """Counts alert events in `paged_kv_alerts_total{metric, severity}`; returns how many.

    Args:
      alerts: `paged_kv.telemetry.metrics.Alert` instances or mappings with `metric` and
        `severity` keys (e.g. `AlertMonitor.observe(snapshot)`).
    """
    count = 0
    with self._lock:
      fam = self._families.get(_ALERTS)
      if fam is None:
        fam = self._families[_ALERTS] = _Family("counter", ("metric", "severity"), "alerts", {})
      for alert in alerts:
        fields = _as_fields(alert, "alert")
        key = (str(fields.get("metric", "unknown")), str(fields.get("severity", "unknown")))
        fam.values[key] = fam.values.get(key, 0.0) + 1.0
        count += 1
    return count

  def _families_copy(self) -> list[tuple[str, _Family]]:
    with self._lock:
      return [(name, dataclasses.replace(fam, values=dict(fam.values)))
              for name, fam in sorted(self._families.items())]

  def render(self) -> str:
    """The current exposition text (what `/metrics` serves)."""
    return _prometheus().generate_latest(self.registry).decode("utf-8")

  # -- HTTP server -------------------------------------------------------------
  def start(self) -> "MetricsExporter":
    """Serves `/metrics` (any path, as prometheus_client does) over HTTP in a
    daemon thread; returns self.

    Raises:
      RuntimeError: already started.
      OSError: the address cannot be bound (e.g. the port is taken).
    """
    if self._server is not None:
      raise RuntimeError(f"MetricsExporter already serving at {self.url}")
    app = _prometheus().make_wsgi_app(self.registry)
    family = socket.getaddrinfo(self._addr, self._requested_port, type=socket.SOCK_STREAM)[0][0]
    server_class = type("_Server", (_ThreadingWSGIServer,), {"address_family": family})
    server = wsgiref.simple_server.make_server(self._addr, self._requested_port, app,
                                               server_class=server_class,
                                               handler_class=_QuietHandler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              name=f"paged_kv-metrics-{server.server_address[1]}", daemon=True)
    thread.start()
    self._server, self._thread = server, thread
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


def _jsonable(value: Any) -> Any:
  """`value` as plain JSON data: numpy scalars and arrays, dataclasses, mappings
  (keys as strings) and sequences converted; non-finite floats become None so
  every line is strict JSON."""
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


class JsonlLogger:
  """Appends one JSON object per line: snapshots and alert events.

  Lines are `{"type": "snapshot", "step": s, "time": t, <snapshot fields>, <extra>}`
  and `{"type": "alert", "step": s, "time": t, <alert fields>}`, where `time` is
  the wall-clock time (`time.time()`, seconds) and `step` is the caller's step
  (by default, the number of snapshots logged before this one). Each line is
  flushed as it is written, so a crash loses nothing already logged. Numpy
  values become plain numbers, mapping keys strings, NaN/inf null.

  Example:
    with JsonlLogger("run/metrics.jsonl") as log:
      log.log_snapshot(snap, step=7, preemptions_total=2)
      log.log_alerts(monitor.observe(snap), step=7)
    records = read_jsonl("run/metrics.jsonl")

  Args:
    path: the file; its directory is created if missing.
    mode: `"a"` (append, the default) or `"w"` (truncate).
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
    self.last_step: int | None = None  # step of the latest snapshot line

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
    """Writes one snapshot line; returns the record written.

    Args:
      snapshot: a dataclass instance (e.g. `PoolSnapshot`), a mapping, or None.
      step: the serving step; by default the number of snapshots logged before.
      **extra: more fields (scheduler counters, ...); they replace snapshot
        fields of the same name.
    """
    fields = {} if snapshot is None else _as_fields(snapshot, "snapshot")
    fields.update(extra)
    record = self._write("snapshot", self.num_snapshots if step is None else step, fields)
    self.num_snapshots += 1
    self.last_step = record["step"]
    return record

  def log_alert(self, alert: Any, *, step: int | None = None) -> dict:
    """Writes one alert line (`paged_kv.telemetry.metrics.Alert` or a mapping); returns it.

    `step` defaults to the step of the latest snapshot (None before any).
    """
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
