"""Plots an operator reads: a serving run's timeline and block maps of the pool.

`timeline` draws from `JsonlLogger`'s records (a finished run can be plotted
again), `block_map` from `block_states(pool.state)`. matplotlib (the `plots`
extra) is imported only when a plot is drawn.

  steps = read_jsonl("out/serve/metrics.jsonl", type="step")
  plots.timeline(steps, "out/serve/utilization.png")
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

FREE, LIVE, CACHED = 0, 1, 2  # block_states codes
STATE_NAMES = {FREE: "free", LIVE: "used by a live sequence (may be shared with the cache)",
               CACHED: "held only by the prefix cache (evictable)"}
STATE_COLORS = {FREE: "#e6e6e6", LIVE: "#1f77b4", CACHED: "#ff7f0e"}
_COMPACTION_COLOR, _PREEMPTION_COLOR, _ALERT_COLOR = "#2ca02c", "#d62728", "#9467bd"


def _pyplot():
  """matplotlib's pyplot on the Agg backend, or an ImportError naming the extra."""
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  except ImportError as err:
    raise ImportError("paged_kv.telemetry.plots needs matplotlib; install it with: "
                      "pip install 'paged-kv[plots]'") from err
  return plt


def block_states(state: Any) -> np.ndarray:
  """`i32[num_blocks]` per block: `FREE` (0), `LIVE` (1: in an active row) or `CACHED` (2).

  Copies the block metadata to the host: for plots, not per step.
  """
  ref = np.asarray(state.meta.ref_count)
  t = state.table
  active, ns, blocks = np.asarray(t.active), np.asarray(t.num_segments), np.asarray(t.block)
  used = active[:, None] & (np.arange(blocks.shape[1])[None, :] < ns[:, None])
  live = np.zeros(ref.shape, bool)
  live[blocks[used]] = True
  out = np.where(ref > 0, CACHED, FREE).astype(np.int32)
  out[live & (ref > 0)] = LIVE
  return out


def _row_width(num_blocks: int) -> int:
  """Blocks per row of a map: a power of two, about 4x as wide as tall."""
  return int(max(8, 2 ** np.ceil(np.log2(np.sqrt(max(num_blocks, 1) * 4)))))


def block_map(maps: Sequence[tuple[str, int, np.ndarray]], path: str | os.PathLike, *,
              num_base_blocks: int = 0, dpi: int = 110) -> str:
  """Draws one block map per `(label, step, block_states)`; returns the PNG path.

  Blocks in address order, the base region (the lowest `num_base_blocks`) outlined.
  """
  plt = _pyplot()
  from matplotlib.colors import ListedColormap  # pylint: disable=import-outside-toplevel
  from matplotlib.patches import Patch, Rectangle  # pylint: disable=import-outside-toplevel
  n = int(maps[0][2].size)
  width = _row_width(n)
  rows = -(-n // width)
  cmap = ListedColormap([STATE_COLORS[k] for k in (FREE, LIVE, CACHED)])
  height = 0.35 * rows * len(maps) + 1.0 * len(maps) + 0.8
  fig, axes = plt.subplots(len(maps), 1, figsize=(10, height), squeeze=False)
  for ax, (label, step, states) in zip(axes[:, 0], maps):
    states = np.asarray(states)
    grid = np.full(rows * width, -1)
    grid[:states.size] = states
    ax.imshow(np.ma.masked_less(grid.reshape(rows, width), 0), cmap=cmap, vmin=0, vmax=2,
              aspect="auto", interpolation="nearest")
    counts = {k: int(np.sum(states == k)) for k in (FREE, LIVE, CACHED)}
    ax.set_title(f"Block map at step {step} ({label}): {counts[LIVE]} live, "
                 f"{counts[CACHED]} cached only, {counts[FREE]} free of {states.size} blocks",
                 fontsize=9)
    ax.set_yticks(np.arange(rows))
    ax.set_yticklabels([str(r * width) for r in range(rows)], fontsize=7)
    xt = np.arange(0, width, max(1, width // 8))
    ax.set_xticks(xt)
    ax.set_xticklabels([f"+{x}" for x in xt], fontsize=7)
    ax.set_ylabel("first block\nof row", fontsize=8)
    ax.set_xticks(np.arange(-0.5, width, 1), minor=True)
    ax.set_yticks(np.arange(-0.5, rows, 1), minor=True)
    ax.grid(which="minor", color="white", linewidth=0.6)
    ax.tick_params(which="minor", length=0)
    for b in range(0, num_base_blocks, width):  # outline the base region, row by row
      w = min(width, num_base_blocks - b)
      ax.add_patch(Rectangle((-0.5, b // width - 0.5), w, 1, fill=False, edgecolor="black",
                             linewidth=1.5, linestyle="--"))
  axes[-1, 0].set_xlabel(f"block offset in the row ({width} blocks per row)", fontsize=8)
  handles = [Patch(color=STATE_COLORS[k], label=STATE_NAMES[k]) for k in (LIVE, CACHED, FREE)]
  if num_base_blocks:
    handles.append(Patch(fill=False, edgecolor="black", linestyle="--",
                         label=f"base region (blocks 0-{num_base_blocks - 1}, pinned)"))
  fig.legend(handles=handles, loc="lower center", ncol=2, fontsize=8, frameon=False)
  fig.tight_layout(rect=(0, 0.55 / height, 1, 1))
  fig.savefig(path, dpi=dpi)
  plt.close(fig)
  return os.fspath(path)


def _series(steps: Sequence[Mapping[str, Any]], *keys: str, default=np.nan) -> np.ndarray:
  out = []
  for r in steps:
    v: Any = r
    for k in keys:
      v = v.get(k) if isinstance(v, Mapping) else None
    out.append(default if v is None else v)
  return np.asarray(out, float)


def _increments(values: np.ndarray) -> np.ndarray:
  """Per step, how much a cumulative series grew (first step: its value)."""
  values = np.nan_to_num(values)
  return np.diff(values, prepend=0.0)


def timeline(steps: Sequence[Mapping[str, Any]], path: str | os.PathLike, *,
             snapshots: Sequence[Mapping[str, Any]] = (), title: str = "Serving run",
             dpi: int = 110) -> str:
  """Draws a run's timeline from JSONL `step` records; returns the PNG path.

  Small multiples over the scheduler's clock: KV blocks by state, fragmentation,
  the largest free run, requests by state, time to first token and an event strip
  (compactions, preemptions, alerts).
  """
  plt = _pyplot()
  if not steps:
    raise ValueError("timeline needs at least one step record")
  clock = _series(steps, "clock")
  t = clock - clock[0]
  step_ids = [int(r["step"]) for r in steps]
  n_blocks = _series(steps, "pool", "num_blocks")
  used = _series(steps, "pool", "used_blocks") / n_blocks * 100
  cached = _series(steps, "pool", "cached_blocks") / n_blocks * 100
  free = _series(steps, "pool", "free_blocks") / n_blocks * 100
  compactions = _increments(_series(steps, "stats", "compaction_moves"))
  preempt_rec = _increments(_series(steps, "stats", "preemptions_recompute"))
  preempt_swap = _increments(_series(steps, "stats", "preemptions_swap"))
  alerts = [(ti, a) for ti, r in zip(t, steps) for a in r.get("alerts") or ()]
  t_compact = t[compactions > 0]
  t_preempt = t[(preempt_rec + preempt_swap) > 0]

  num_alert_rows = len({a for _, a in alerts})
  fig, axes = plt.subplots(6, 1, figsize=(11, 13 + 0.25 * num_alert_rows), sharex=True,
                           gridspec_kw={"height_ratios": [3, 2.2, 1.6, 2, 2,
                                                          0.9 + 0.3 * num_alert_rows]})
  ax_blocks, ax_frag, ax_run, ax_req, ax_ttft, ax_ev = axes
  fig.suptitle(title, fontsize=12)

  def legend(ax):
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False,
              borderaxespad=0)

  ax_blocks.stackplot(t, np.nan_to_num(used), np.nan_to_num(cached), np.nan_to_num(free),
                      labels=["used by live sequences (= kv_cache_usage_perc)",
                              "held only by the prefix cache (evictable)", "free"],
                      colors=[STATE_COLORS[LIVE], STATE_COLORS[CACHED], STATE_COLORS[FREE]],
                      step="post")
  ax_blocks.set_ylim(0, 100)
  if len(t) > 1 and t[-1] > t[0]:  # step numbers on top (time runs unevenly: compiles)
    ids = np.asarray(step_ids, float)
    top = ax_blocks.secondary_xaxis(
        "top", functions=(lambda x: np.interp(x, t, ids), lambda s: np.interp(s, ids, t)))
    stride = max(1, int(np.ceil(ids[-1] / 20)))
    kept, last = [], -np.inf
    for step in np.arange(ids[0], ids[-1] + 1, stride):  # ticks at least 1/15 of the span apart
      x = np.interp(step, ids, t)
      if x - last >= (t[-1] - t[0]) / 15:
        kept.append(step)
        last = x
    top.set_xticks(kept)
    top.set_xlabel("scheduler step", fontsize=8)
    top.tick_params(labelsize=7)
  ax_blocks.set_ylabel("share of blocks (%)")
  ax_blocks.set_title("KV-cache blocks by state", fontsize=10)
  legend(ax_blocks)

  ax_frag.step(t, _series(steps, "pool", "fragmentation_ratio"), where="post",
               color="#1f77b4", label="external, dynamic region (every step)")
  if snapshots:
    by_step = dict(zip(step_ids, t))
    pts = [(by_step[s["step"]], s["internal_fragmentation"]) for s in snapshots
           if s.get("step") in by_step and s.get("internal_fragmentation") is not None]
    if pts:
      ts, vs = zip(*pts)
      ax_frag.plot(ts, vs, "s--", color="#8c564b", markersize=4,
                   label="internal: dead slots in used blocks (full snapshots)")
  ax_frag.set_ylim(0, 1.02)
  ax_frag.set_ylabel("ratio (0-1)")
  ax_frag.set_title("Fragmentation (external: 1 - largest free run / free blocks)",
                    fontsize=10)
  legend(ax_frag)

  ax_run.step(t, _series(steps, "pool", "largest_free_run_blocks"), where="post",
              color="#17becf", label="largest contiguous free run")
  ax_run.step(t, _series(steps, "pool", "free_blocks"), where="post", color="#7f7f7f",
              linestyle=":", label="free blocks (all)")
  ax_run.set_ylabel("blocks")
  ax_run.set_ylim(bottom=0)
  ax_run.set_title("Free space", fontsize=10)
  legend(ax_run)

  for key, color, label in (("num_running", "#1f77b4", "running"),
                            ("num_waiting", "#ff7f0e", "waiting"),
                            ("num_swapped", "#d62728", "swapped out")):
    ax_req.step(t, _series(steps, key), where="post", color=color, label=label)
  ax_req.set_ylabel("requests")
  ax_req.set_ylim(bottom=0)
  ax_req.set_title("Requests by state", fontsize=10)
  legend(ax_req)

  ttft = [(ti, v) for ti, r in zip(t, steps) for v in r.get("first_token_latencies") or ()]
  if ttft:
    ts, vs = zip(*ttft)
    ax_ttft.plot(ts, vs, "o", markersize=3, color="#9467bd",
                 label="one request (at its first token)")
    ax_ttft.set_yscale("log")
  ax_ttft.set_ylabel("seconds (log)")
  ax_ttft.set_title("Time to first token (from submission; the first requests include "
                    "compilation)", fontsize=10)
  legend(ax_ttft)

  rows = [("compaction", t_compact, _COMPACTION_COLOR, "|"),
          ("preemption: recompute", t[preempt_rec > 0], _PREEMPTION_COLOR, "v"),
          ("preemption: swap", t[preempt_swap > 0], "#e377c2", "v")]
  for name in sorted({a for _, a in alerts}):
    rows.append((f"alert: {name}", np.array([ti for ti, a in alerts if a == name]),
                 _ALERT_COLOR, "*"))
  for y, (label, ts, color, marker) in enumerate(rows):
    ax_ev.plot(ts, np.full(len(ts), y), marker, color=color, markersize=8, linestyle="none")
    ax_ev.annotate(f"{len(ts)}", (1.005, y), xycoords=("axes fraction", "data"), fontsize=7,
                   va="center")
  ax_ev.set_yticks(range(len(rows)))
  ax_ev.set_yticklabels([r[0] for r in rows], fontsize=8)
  ax_ev.set_ylim(len(rows) - 0.4, -0.6)
  ax_ev.set_title("Events (count at the right)", fontsize=10)
  ax_ev.set_xlabel("time since the first step (s, scheduler clock)")

  for ax in axes[:-1]:
    for ti in t_compact:
      ax.axvline(ti, color=_COMPACTION_COLOR, alpha=0.25, linewidth=0.8, zorder=0)
    for ti in t_preempt:
      ax.axvline(ti, color=_PREEMPTION_COLOR, alpha=0.35, linewidth=0.8, linestyle="--",
                 zorder=0)
    ax.grid(alpha=0.3)
  ax_ev.grid(alpha=0.3, axis="x")
  ax_ev.set_xlim(t[0], t[-1] if t[-1] > t[0] else t[0] + 1)
  fig.text(0.01, 0.005, "Faint vertical lines: green = compaction, red dashed = preemption.",
           fontsize=8)
  fig.tight_layout(rect=(0, 0.015, 1, 0.985))
  fig.savefig(path, dpi=dpi)
  plt.close(fig)
  return os.fspath(path)
