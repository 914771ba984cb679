"""Serve a synthetic multi-turn chat workload with the tiny model on a paged pool.

Conversations share a system prompt; each turn's prompt is the whole
conversation so far plus a new user message, so later turns hit the prefix
cache. The scheduler runs continuous batching (one forward pass per step for the
prefill chunks and decodes together, `paged_kv.serving.executor.ModelExecutor`)
with chunked prefill, eviction, preemption and compaction; the final report, PNG
plots and a metrics JSONL go to `--out_dir`. This is what `make demo` runs.

Usage:
  python examples/serve.py                              # defaults, ~1-2 min on CPU
  python examples/serve.py --num_blocks=96 --preemption=swap --prometheus_port=9400
"""

from __future__ import annotations

import time
from pathlib import Path

from absl import app, flags
import numpy as np
from flax import nnx

import paged_kv
from paged_kv.core import compact
from paged_kv.model import llama
from paged_kv.serving.executor import ModelExecutor
from paged_kv.serving.scheduler import Request, Scheduler, SchedulerConfig
from paged_kv.telemetry.export import JsonlLogger, MetricsExporter

_CONVERSATIONS = flags.DEFINE_integer("conversations", 16, "Concurrent chat conversations.")
_TURNS = flags.DEFINE_integer("turns", 3, "Turns per conversation.")
_SYSTEM_TOKENS = flags.DEFINE_integer("system_tokens", 48, "Shared system prompt length.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 24, "Max tokens generated per turn.")
_NUM_BLOCKS = flags.DEFINE_integer("num_blocks", 128, "Blocks in the pool.")
_BLOCK_SIZE = flags.DEFINE_integer("block_size", 8, "Tokens per block.")
_MAX_BATCH = flags.DEFINE_integer("max_batch", 8, "Sequences per step.")
_PREFILL_BUDGET = flags.DEFINE_integer("prefill_token_budget", 128, "Prompt tokens per step.")
_PREFILL_CHUNK = flags.DEFINE_integer("prefill_chunk", 64, "Prompt tokens per sequence per step.")
_PREEMPTION = flags.DEFINE_enum("preemption", "recompute", ["recompute", "swap"],
                                "How to preempt under pressure.")
_EVICT = flags.DEFINE_enum("evict_policy", "lru", ["lru", "cost"], "Prefix-cache eviction.")
_COMPACT_THRESHOLD = flags.DEFINE_float("compact_threshold", 0.35,
                                        "Compact when the fragmentation ratio exceeds this.")
_COMPACT_BUDGET = flags.DEFINE_integer("compact_budget", 32, "Block moves per step (0: off).")
_NO_CACHE = flags.DEFINE_bool("no_prefix_cache", False, "Disable the prefix cache.")
_BASE_POOL = flags.DEFINE_float("base_pool_fraction", 0.15,
                                "Low-address share of the pool for widely shared prefixes.")
_PROMOTE = flags.DEFINE_integer("promote_readers", 3, "Promote blocks with this many readers "
                                "into the base pool (0: off).")
_PACK = flags.DEFINE_bool("pack_tails", True, "Pack finished sequences' tails into slotted "
                          "blocks.")
_PROMETHEUS_PORT = flags.DEFINE_integer("prometheus_port", -1,
                                        "Serve /metrics on this port (0: any free port; "
                                        "-1: no exporter).")
_IMPL = flags.DEFINE_enum("impl", None, ["xla", "pallas", "mosaic"],
                          "Attention path (default: per backend, paged_kv.model.default_impl).")
_OUT_DIR = flags.DEFINE_string("out_dir", "out/serve", "Where plots and the JSONL go.")
_SEED = flags.DEFINE_integer("seed", 0, "Random seed.")


class ChatWorkload:
  """Multi-turn conversations: turn t+1 is submitted when turn t finishes."""

  def __init__(self, rng: np.random.Generator, vocab: int):
    self.rng, self.vocab = rng, vocab
    self.system = rng.integers(0, vocab, _SYSTEM_TOKENS.value)
    self.history = [self.system.copy() for _ in range(_CONVERSATIONS.value)]
    self.turn = [0] * _CONVERSATIONS.value
    self.pending: dict[int, Request] = {}
    self.next_id = 0
    self.submit_time: dict[int, float] = {}

  def _submit(self, sched: Scheduler, conv: int) -> None:
    user = self.rng.integers(0, self.vocab, int(self.rng.integers(8, 40)))
    prompt = np.concatenate([self.history[conv], user])
    req = Request(self.next_id, prompt, int(self.rng.integers(4, _MAX_NEW.value + 1)),
                  arrival=time.perf_counter())
    self.next_id += 1
    self.pending[conv] = req
    sched.submit(req)

  def before_step(self, sched: Scheduler) -> None:
    for conv in range(_CONVERSATIONS.value):
      req = self.pending.get(conv)
      if req is None and self.turn[conv] == 0:
        self.turn[conv] = 1
        self._submit(sched, conv)
      elif req is not None and req.done:
        self.history[conv] = req.tokens
        del self.pending[conv]
        if self.turn[conv] < _TURNS.value:
          self.turn[conv] += 1
          self._submit(sched, conv)

  @property
  def total(self) -> int:
    return _CONVERSATIONS.value * _TURNS.value


def block_map(state: paged_kv.PoolState, extra: np.ndarray | None) -> np.ndarray:
  """Per block: 0 free, 1 live sequence (maybe shared with the cache), 2 cached only."""
  ref = np.asarray(state.meta.ref_count)
  t = state.table
  active = np.asarray(t.active)
  ns = np.asarray(t.num_segments)
  blocks = np.asarray(t.block)
  live = np.zeros(ref.shape, bool)
  for i in np.nonzero(active)[0]:
    live[blocks[i, :ns[i]]] = True
  out = np.where(ref > 0, 2, 0)
  out[live] = 1
  return out


def write_plots(out_dir: Path, maps: dict[str, np.ndarray], snaps: list) -> list[str]:
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
  except ImportError:
    print("matplotlib not installed (pip install 'paged-kv[plots]'): no plots")
    return []
  paths = []
  cmap = ListedColormap(["#eeeeee", "#1f77b4", "#ff7f0e"])
  fig, axes = plt.subplots(len(maps), 1, figsize=(10, 1.2 * len(maps) + 0.6))
  axes = np.atleast_1d(axes)
  for ax, (title, m) in zip(axes, maps.items()):
    width = int(np.ceil(np.sqrt(m.size * 8)))
    rows = -(-m.size // width)
    grid = np.full(rows * width, -1)
    grid[:m.size] = m
    ax.imshow(np.ma.masked_less(grid.reshape(rows, width), 0), cmap=cmap, vmin=0, vmax=2,
              aspect="auto", interpolation="nearest")
    ax.set_title(f"{title}: grey free, blue live sequence, orange cached only", fontsize=9)
    ax.set_xticks([])
    ax.set_yticks([])
  fig.tight_layout()
  p = out_dir / "block_map.png"
  fig.savefig(p, dpi=110)
  plt.close(fig)
  paths.append(str(p))
  fig, ax = plt.subplots(figsize=(8, 3.5))
  steps = np.arange(len(snaps))
  ax.plot(steps, [s.block_pool_utilization for s in snaps], label="utilization")
  ax.plot(steps, [s.fragmentation_ratio for s in snaps], label="fragmentation ratio")
  ax.plot(steps, [s.internal_fragmentation for s in snaps], label="internal fragmentation")
  ax.set_xlabel("step")
  ax.set_ylim(0, 1.02)
  ax.legend(loc="best", fontsize=8)
  fig.tight_layout()
  p = out_dir / "utilization.png"
  fig.savefig(p, dpi=110)
  plt.close(fig)
  paths.append(str(p))
  return paths


def _progress(total: int):
  try:
    from tqdm import tqdm
    return tqdm(total=total, unit="req", desc="serving", leave=False)
  except ImportError:
    return None


def main(argv):
  del argv
  out_dir = Path(_OUT_DIR.value)
  out_dir.mkdir(parents=True, exist_ok=True)
  rng = np.random.default_rng(_SEED.value)
  model_config = llama.LlamaConfig(num_layers=2)
  model = llama.TinyLlama(model_config, rngs=nnx.Rngs(_SEED.value))
  pool_config = llama.pool_config_for(model_config, num_blocks=_NUM_BLOCKS.value,
                                   block_size=_BLOCK_SIZE.value, max_seqs=_MAX_BATCH.value,
                                   max_segments=64, base_pool_fraction=_BASE_POOL.value)
  pool = paged_kv.BlockPool(pool_config)
  policy = (compact.CompactionPolicy(threshold=_COMPACT_THRESHOLD.value,
                                     budget=_COMPACT_BUDGET.value)
            if _COMPACT_BUDGET.value > 0 else None)
  config = SchedulerConfig(max_batch=_MAX_BATCH.value,
                           prefill_token_budget=_PREFILL_BUDGET.value,
                           prefill_chunk=_PREFILL_CHUNK.value, preemption=_PREEMPTION.value,
                           enable_prefix_cache=not _NO_CACHE.value,
                           evict_policy=_EVICT.value, compaction=policy,
                           pack_tails=_PACK.value, promote_readers=_PROMOTE.value)
  exporter = None
  if _PROMETHEUS_PORT.value >= 0:
    exporter = MetricsExporter(port=_PROMETHEUS_PORT.value).start()
    print(f"Prometheus metrics at http://127.0.0.1:{exporter.port}/metrics")
  logger = JsonlLogger(out_dir / "metrics.jsonl")
  workload = ChatWorkload(rng, model_config.vocab_size)
  bar = _progress(workload.total)

  def on_snapshot(step, snap, stats):
    extra = dict(preemptions_total=stats.preemptions, swap_to_host_bytes=stats.swap_to_host_bytes,
                 prefix_cache_hit_rate=stats.prefix_cache_hit_rate,
                 prefix_cache_evicted_tokens_total=stats.evicted_tokens,
                 requests_finished_total=stats.finished)
    logger.log_snapshot(snap, step=step, **extra)
    if exporter is not None:
      exporter.update(snap, **extra)
    if bar is not None:
      bar.n = stats.finished
      bar.set_postfix(util=f"{snap.block_pool_utilization:.0%}",
                      frag=f"{snap.fragmentation_ratio:.2f}", refresh=False)
      bar.refresh()

  sched = Scheduler(pool, ModelExecutor(model, pool_config, impl=_IMPL.value), config,
                    on_snapshot=on_snapshot, clock=time.perf_counter)
  maps = {}
  t0 = time.perf_counter()
  peak = {"util": -1.0}

  def before_step(s: Scheduler) -> None:
    workload.before_step(s)
    if s.snapshots and s.snapshots[-1].block_pool_utilization > peak["util"]:
      peak["util"] = s.snapshots[-1].block_pool_utilization
      maps["busiest step"] = block_map(pool.state, None)

  sched.run(before_step=before_step)
  wall = time.perf_counter() - t0
  if bar is not None:
    bar.close()
  for alert in sched.alerts:
    logger.log_alert(alert, step=sched.stats.steps)
  logger.close()
  maps["end (only the prefix cache holds blocks)"] = block_map(pool.state, None)
  sched.check_invariants()

  reqs = sorted(sched.finished, key=lambda r: r.request_id)
  ttft = np.array([r.first_token_time - r.arrival for r in reqs])
  generated = sum(len(r.output) for r in reqs)
  snaps = sched.snapshots
  st = sched.stats
  plots = write_plots(out_dir, maps, snaps)
  rows = [
      ("requests finished", f"{st.finished} / {workload.total}"),
      ("steps", st.steps),
      ("generated tokens", generated),
      ("tokens/s (generated, wall)", f"{generated / wall:.0f}"),
      ("TTFT p50 / p99 (s)", f"{np.percentile(ttft, 50):.3f} / {np.percentile(ttft, 99):.3f}"),
      ("prefix cache hit rate (prompt tokens)", f"{st.prefix_cache_hit_rate:.1%}"),
      ("evicted tokens", st.evicted_tokens),
      ("utilization mean / max", f"{np.mean([s.block_pool_utilization for s in snaps]):.1%} / "
                                 f"{max(s.block_pool_utilization for s in snaps):.1%}"),
      ("fragmentation ratio mean / p99", f"{np.mean([s.fragmentation_ratio for s in snaps]):.3f}"
                                         f" / {np.percentile([s.fragmentation_ratio for s in snaps], 99):.3f}"),
      ("internal fragmentation mean", f"{np.mean([s.internal_fragmentation for s in snaps]):.1%}"),
      ("compactions / block moves", f"{st.compactions} / {sched.counters.compaction_moves}"),
      ("packed tails / base-pool promotions", f"{sched.counters.pack_moves} / "
                                              f"{sched.counters.promotions}"),
      ("preemptions (recompute / swap)", f"{st.preemptions} ({st.preemptions_recompute} / "
                                         f"{st.preemptions_swap})"),
      ("swap to host bytes", st.swap_to_host_bytes),
      ("OOMs by reason", dict(sched.counters.oom_by_reason) or "none"),
      ("max concurrent sequences", st.max_running),
      ("alerts", len(sched.alerts)),
      ("wall time (s)", f"{wall:.1f}"),
  ]
  print("\n| metric | value |\n|---|---|")
  for name, value in rows:
    print(f"| {name} | {value} |")
  print(f"\nmetrics JSONL: {out_dir / 'metrics.jsonl'}")
  for p in plots:
    print(f"plot: {p}")
  if exporter is not None:
    exporter.stop()


if __name__ == "__main__":
  app.run(main)
