"""Benchmark records: one JSON file per benchmark run, results with their provenance.

A script in `benchmarks/` takes `--record=PATH` and, when it is given, writes what it
measured together with how, where and when:

  {"schema": 1, "bench": "bench_allocator",
   "command": "python benchmarks/bench_allocator.py --steps=60", "argv": [...],
   "flags": {...the script's own flags...}, "seeds": [0],
   "git": {"commit": "5c431e5...", "dirty": false},
   "date": "2026-12-03T07:12:09Z", "wall_s": 95.2,
   "machine": {"platform": ..., "cpu_count": 2, "load_avg_start": [...], "load_avg_end": [...]},
   "jax": {"jax": "0.12.0.1", "jaxlib": "0.12.0.1", "backend": "cpu", "device_kind": "cpu"},
   "notes": [...], "results": {...plain JSON...}}

`tools/bench_report.py` renders the tables of docs/benchmarks.md from the committed
records (`docs/records/<bench>/*.json`) and checks that the doc matches them. The
helpers for that report's cells live here too, so that a script and the report read
"median [min-max]" and "goal met" the same way: a goal is met only if the unrounded
number meets it.

A script uses it as (absl flags; `--record` from `benchmarks.shared_flags`):

  _RECORD = shared_flags.define_record()
  ...
  rec = records.Recorder(_RECORD.value, "bench_foo", flag_values=records.script_flags(),
                         seeds=[_SEED.value])
  ... measure ...
  rec.write({"rows": rows}, notes=["machine shared with other jobs"])

numpy and the standard library only (JAX's version and backend are read when a record
is written, from the already-loaded `jax` if there is one).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import pathlib
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["RECORD_FLAG_HELP", "SCHEMA", "Recorder", "format_median_range", "git_info",
           "goal_met", "load_records", "machine_info", "jax_info", "median_range",
           "read_record", "script_flags", "to_jsonable", "write_record"]

SCHEMA = 1
"""Version of the record layout; bumped when a field changes meaning."""

RECORD_FLAG_HELP = ("Write a JSON record of this run (command, flags, seeds, git commit, "
                    "date, machine, JAX version, results) to this path; a path ending in '/' "
                    "or naming a directory gets <bench>-<UTC time>.json inside it.")

_REPO = pathlib.Path(__file__).resolve().parents[1]


def to_jsonable(x: Any) -> Any:
  """`x` as plain JSON data: numpy scalars and arrays, tuples, dataclasses, sets converted;
  NaN and infinities become None (JSON has no spelling for them); dict keys become str."""
  if dataclasses.is_dataclass(x) and not isinstance(x, type):
    return to_jsonable(dataclasses.asdict(x))
  if isinstance(x, Mapping):
    return {str(k) if not isinstance(k, tuple) else "/".join(map(str, k)): to_jsonable(v)
            for k, v in x.items()}
  if isinstance(x, (list, tuple, set, frozenset)):
    return [to_jsonable(v) for v in (sorted(x) if isinstance(x, (set, frozenset)) else x)]
  if isinstance(x, np.ndarray):
    return to_jsonable(x.tolist())
  if isinstance(x, (np.bool_, bool)):
    return bool(x)
  if isinstance(x, (np.integer, int)):
    return int(x)
  if isinstance(x, (np.floating, float)):
    x = float(x)
    return x if math.isfinite(x) else None
  if x is None or isinstance(x, str):
    return x
  return str(x)


def git_info(repo: str | os.PathLike | None = None) -> dict:
  """`{"commit", "dirty", "dirty_paths"}` of the repository holding this file (tracked
  files changed but not committed: other people's edits in a shared tree count too, so
  the paths are kept, at most 30)."""
  cwd = str(repo or _REPO)
  try:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True,
                            text=True, timeout=20, check=True).stdout.strip()
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                            cwd=cwd, capture_output=True, text=True, timeout=20,
                            check=True).stdout
  except (OSError, subprocess.SubprocessError):
    return {"commit": None, "dirty": None, "dirty_paths": []}
  paths = [line[3:] for line in status.splitlines() if line.strip()]
  return {"commit": commit, "dirty": bool(paths), "dirty_paths": paths[:30]}


def _load_avg() -> list[float] | None:
  try:
    return [round(x, 2) for x in os.getloadavg()]
  except (AttributeError, OSError):
    return None


def machine_info() -> dict:
  """The host: OS, architecture, processor, CPU count, Python, load averages now."""
  return {"platform": platform.platform(), "machine": platform.machine(),
          "processor": platform.processor() or None, "node": platform.node(),
          "cpu_count": os.cpu_count(), "python": platform.python_version(),
          "load_avg": _load_avg()}


def jax_info() -> dict:
  """JAX and jaxlib versions and, if JAX is loaded, the default backend and device kind."""
  from importlib import metadata
  out = {}
  for name in ("jax", "jaxlib"):
    try:
      out[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
      out[name] = None
  jax = sys.modules.get("jax")
  if jax is not None:
    try:
      devices = jax.devices()
      out.update(backend=jax.default_backend(), device_kind=devices[0].device_kind,
                 device_count=len(devices))
    except Exception as e:  # pylint: disable=broad-except  # a record must still be written
      out.update(backend=None, device_error=f"{type(e).__name__}: {e}")
  return out


def script_flags(flag_values: Any = None, module: str | None = None) -> dict:
  """The values of the flags the running script defined (absl's `FLAGS`, duck-typed).

  Flags of other modules (absl's own, JAX's) are left out; `module` defaults to the
  main script (absl files a script's flags under `sys.argv[0]`).
  """
  if flag_values is None:
    absl_flags = sys.modules.get("absl.flags")
    if absl_flags is None:
      return {}
    flag_values = absl_flags.FLAGS
  module = module or sys.argv[0]
  try:
    defined = flag_values.get_flags_for_module(module)
  except Exception:  # pylint: disable=broad-except  # not parsed, or no such module
    return {}
  return {f.name: to_jsonable(f.value) for f in sorted(defined, key=lambda f: f.name)}


def _target(path: str | os.PathLike, bench: str, date: datetime.datetime) -> pathlib.Path:
  p = pathlib.Path(path)
  if str(path).endswith(("/", os.sep)) or p.is_dir():
    p.mkdir(parents=True, exist_ok=True)
    return p / f"{bench}-{date.strftime('%Y%m%dT%H%M%SZ')}-{os.getpid()}.json"
  p.parent.mkdir(parents=True, exist_ok=True)
  return p


class Recorder:
  """Collects a run's provenance at its start (date, load, git commit and changed files);
  `write` adds the results, the end's load and the wall time, and saves.

  With `path=None` nothing is written (scripts call it unconditionally).
  """

  def __init__(self, path: str | os.PathLike | None, bench: str, *,
               flag_values: Mapping | None = None, seeds: Sequence[int] | None = None,
               argv: Sequence[str] | None = None):
    self.path, self.bench = path, bench
    self.argv = list(sys.argv if argv is None else argv)
    self.flag_values = dict(flag_values or {})
    self.seeds = None if seeds is None else [int(s) for s in seeds]
    self.started = datetime.datetime.now(datetime.timezone.utc)
    self.load_start = _load_avg()
    # The commit of the code that runs: read now, not when the record is written (a
    # long run can outlive several commits in a shared tree).
    self.git = git_info()
    self._t0 = time.perf_counter()

  def record(self, results: Any, *, notes: Iterable[str] = ()) -> dict:
    """The record as a dict (provenance + `results`), without writing it."""
    machine = machine_info()
    machine["load_avg_start"] = self.load_start
    machine["load_avg_end"] = machine.pop("load_avg")
    command = "python " + shlex.join(
        [os.path.relpath(self.argv[0], _REPO) if self.argv and os.path.isabs(self.argv[0])
         else (self.argv[0] if self.argv else "")] + self.argv[1:])
    return {
        "schema": SCHEMA, "bench": self.bench, "command": command, "argv": self.argv,
        "flags": to_jsonable(self.flag_values), "seeds": self.seeds, "git": self.git,
        "date": self.started.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "wall_s": round(time.perf_counter() - self._t0, 3), "machine": machine,
        "jax": jax_info(), "notes": list(notes), "results": to_jsonable(results)}

  def write(self, results: Any, *, notes: Iterable[str] = ()) -> pathlib.Path | None:
    """Writes the record (if a path was given); returns where, or None."""
    if self.path is None or self.path == "":
      return None
    rec = self.record(results, notes=notes)
    target = _target(self.path, self.bench, self.started)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps(rec, indent=1, sort_keys=True, allow_nan=False) + "\n")
    os.replace(tmp, target)
    print(f"record: {target}", flush=True)
    return target


def write_record(path: str | os.PathLike | None, bench: str, results: Any, *,
                 flag_values: Mapping | None = None, seeds: Sequence[int] | None = None,
                 notes: Iterable[str] = ()) -> pathlib.Path | None:
  """One-shot `Recorder(...).write(...)` (the wall time then covers only this call)."""
  return Recorder(path, bench, flag_values=flag_values, seeds=seeds).write(results, notes=notes)


def read_record(path: str | os.PathLike) -> dict:
  """A record from disk, checked for the fields every record has."""
  rec = json.loads(pathlib.Path(path).read_text())
  missing = {"schema", "bench", "command", "flags", "git", "date", "machine", "jax",
             "results"} - set(rec)
  if missing:
    raise ValueError(f"{path}: not a benchmark record (missing {sorted(missing)})")
  if rec["schema"] != SCHEMA:
    raise ValueError(f"{path}: record schema {rec['schema']}, this code reads {SCHEMA}")
  rec["_path"] = str(path)
  return rec


def load_records(directory: str | os.PathLike) -> list[dict]:
  """Every `*.json` record under `directory`, oldest first (by date, then name)."""
  d = pathlib.Path(directory)
  recs = [read_record(p) for p in sorted(d.glob("*.json"))] if d.is_dir() else []
  return sorted(recs, key=lambda r: (r["date"], r["_path"]))


def median_range(values: Iterable[float]) -> tuple[float, float, float]:
  """(median, min, max) of the values (at least one)."""
  v = [float(x) for x in values]
  if not v:
    raise ValueError("median_range of no values")
  return statistics.median(v), min(v), max(v)


def format_median_range(values: Iterable[float], fmt: str = "{:.2f}", suffix: str = "",
                        min_runs: int = 3) -> str:
  """`"2.31x [1.90-2.80]"`: the median and the range; fewer than `min_runs` values are
  not a ratio this project reports as one, so they say how many there were."""
  v = [float(x) for x in values]
  med, lo, hi = median_range(v)
  text = f"{fmt.format(med)}{suffix} [{fmt.format(lo)}-{fmt.format(hi)}]"
  if len(v) < min_runs:
    text += f" (n={len(v)} < {min_runs})"
  return text


def goal_met(value: float, goal: float, *, at_most: bool) -> bool:
  """Whether the unrounded `value` meets `goal` (`at_most`: value <= goal, else >=).

  1.0032% against a 1% ceiling is missed, however it prints when rounded.
  """
  if value is None or (isinstance(value, float) and math.isnan(value)):
    return False
  return value <= goal if at_most else value >= goal
