"""Where a program's device time goes, op by op, from JAX's own profiler.

`profile_ops(fn)` runs `fn()` under `jax.profiler` and sums each op's time by
name from the trace: the GPU's device planes, or XLA:CPU's execute threads.
Nothing is recompiled and ops keep XLA's names. `OpProfile.categories()` groups
them with heuristic patterns; the per-op list is the measurement.
"""

from __future__ import annotations

import dataclasses
import glob
import re
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["OpProfile", "profile_ops", "CATEGORIES"]

CATEGORIES: tuple[tuple[str, str], ...] = (
    ("attention", r"attention|paged|flash|mosaic|pallas"),
    ("matmul", r"gemm|cublas|cutlass|xmma|wgmma|\bdot|dot_|matmul|convolution"),
    ("sort / top-k", r"sort|topk|top_k|argmax|argmin|radix"),
    ("data movement", r"copy|memcpy|memset|transpose|scatter|gather|dynamic.update|"
                      r"dynamic_update|concatenate|pad"),
)
"""(category, pattern) in order: an op goes to the first it matches (case-insensitive)."""

_SKIP_LINES = re.compile(r"^(XLA Modules|Steps|XLA TraceMe|Launch Stats|Source|"
                         r"framework|TensorFlow)", re.I)
_CPU_OP_LINE = re.compile(r"XLAExecute|XLAEigen", re.I)
_CPU_SKIP_EVENT = re.compile(r"^(ThreadpoolListener|ThunkExecutor|end: )")


@dataclasses.dataclass(frozen=True)
class OpProfile:
  """Device time per op over the traced run: `ops` as `(name, total ns, count)`, most first.

  `source`: the trace lines read; `runs`: times the function ran (totals cover all).
  """

  ops: tuple[tuple[str, float, int], ...]
  source: str
  runs: int = 1

  @property
  def total_ns(self) -> float:
    return sum(ns for _, ns, _ in self.ops)

  def categories(self) -> dict[str, float]:
    """Nanoseconds per category (`CATEGORIES`, then "other"), over all runs."""
    out = {name: 0.0 for name, _ in CATEGORIES}
    out["other"] = 0.0
    for name, ns, _ in self.ops:
      out[categorize(name)] += ns
    return out

  def summary(self, top: int = 5, *, per: str = "run") -> str:
    """One line: ms per run by category with shares, then the `top` ops."""
    total = self.total_ns
    if not total:
      return f"no op events in the trace ({self.source})"
    runs = max(self.runs, 1)
    cats = ", ".join(f"{name} {ns / runs / 1e6:.3f} ms ({ns / total:.0%})"
                     for name, ns in self.categories().items() if ns)
    ops = "; ".join(f"{name[:48]} {ns / runs / 1e6:.3f} ms" for name, ns, _ in self.ops[:top])
    return (f"ops {total / runs / 1e6:.3f} ms per {per} ({self.source}): {cats}; "
            f"top: {ops}")


def categorize(name: str) -> str:
  """The category of op `name` (`CATEGORIES`), else "other"."""
  for category, pattern in CATEGORIES:
    if re.search(pattern, name, re.I):
      return category
  return "other"


def aggregate(planes: Iterable[Any]) -> tuple[tuple[tuple[str, float, int], ...], str]:
  """`(ops, source)` from profile planes (`ProfileData.planes` or look-alikes)."""
  planes = list(planes)
  device = [p for p in planes if p.name.startswith("/device:")]
  totals: Counter = Counter()
  counts: Counter = Counter()

  def add(events):
    for name, ns in _exclusive(events):
      totals[name] += ns
      counts[name] += 1

  source = "none"
  if device:
    for plane in device:
      lines = [l for l in plane.lines if not _SKIP_LINES.match(l.name)]
      ops_lines = [l for l in lines if l.name == "XLA Ops"]
      if ops_lines:
        source = "device:XLA Ops"
        for line in ops_lines:
          add(line.events)
      else:
        source = "device:streams" if source == "none" else source
        for line in lines:
          add(line.events)
  else:
    for plane in planes:
      for line in plane.lines:
        if _CPU_OP_LINE.search(line.name):
          source = "host:XLA execute"
          add(e for e in line.events if not _CPU_SKIP_EVENT.match(e.name))
  ops = tuple(sorted(((n, float(ns), counts[n]) for n, ns in totals.items()),
                     key=lambda x: -x[1]))
  return ops, source


def _exclusive(events) -> list[tuple[str, float]]:
  """`(name, exclusive ns)` of a line's events: time not covered by enclosed events."""
  spans = sorted(((e.start_ns, e.start_ns + e.duration_ns, e.name) for e in events),
                 key=lambda x: (x[0], -x[1]))
  out: list[list] = []
  stack: list[int] = []  # indices into `out` of the open enclosing events
  for start, end, name in spans:
    while stack and out[stack[-1]][2] <= start:
      stack.pop()
    if stack:
      parent = out[stack[-1]]
      parent[1] -= min(end, parent[2]) - start
    out.append([name, end - start, end])
    stack.append(len(out) - 1)
  return [(name, max(ns, 0.0)) for name, ns, _ in out]


def profile_ops(fn: Callable[[], Any], *, runs: int = 1) -> OpProfile:
  """Device time per op of `fn()` run `runs` times under `jax.profiler` (warm programs)."""
  import jax  # pylint: disable=import-outside-toplevel
  from jax.profiler import ProfileData  # pylint: disable=import-outside-toplevel
  with tempfile.TemporaryDirectory() as tmp:
    jax.profiler.start_trace(tmp)
    try:
      for _ in range(runs):
        jax.block_until_ready(fn())
    finally:
      jax.profiler.stop_trace()
    files = glob.glob(f"{tmp}/**/*.xplane.pb", recursive=True)
    if not files:
      return OpProfile((), "none", runs)
    ops, source = aggregate(ProfileData.from_file(files[0]).planes)
  return OpProfile(ops, source, runs)
