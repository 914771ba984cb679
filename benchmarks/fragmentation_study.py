"""Fragmentation study: slotted packing and byte-budgeted online compaction, simulated.

A pure memory-management simulation on the real pool transitions (one-element pages,
no attention math); bytes and step-time shares are modelled for a real model
(default Llama-3-8B: 32 layers, 8 kv heads, head_dim 128, bf16: 2 MiB per 16-token
block) on an 80 GB card (KV share = card - weights - reserve, in blocks).

  (a) multi-turn chat: conversations of short turns (--turn_min..--turn_max tokens,
      default 5-200) sharing system prompts through a pretend prefix cache; flat
      16-token blocks vs slotted packing (`pack_slots`) with and without
      `reclaim_slots`; one run per seed of --chat_seeds.
  (b) a long/short mix at real size (64k / 2k tokens by default, --scale divides
      them for smoke runs only): three allocation modes for long requests
      (`segments`: any free blocks, as segment tables allow; `require`: one
      contiguous run, the field's setting; `prefer`: a run when one exists) against
      compaction policies budgeted in bytes per step (`CompactionPolicy`: default 2%
      of a --step_ms step at 4.3 TB/s). Admission is FIFO (head of line blocks);
      shorts and longs are checked against blocks promised earlier in the same step.

Per policy it reports the fragmentation ratio (mean, p99), requests delayed (how many
steps) and rejected by reason, bytes moved per step and the modelled step-time share,
runs per long sequence, and concurrency against a fluid upper bound: per step, the
most of the requests present (running + queued) that fit the capacity in tokens,
smallest first, with no ordering or contiguity constraint. Numbers quoted from the
seed reports are printed beside ours, labelled as quoted; they are never computed.
The compaction step's cost against a plain copy is `benchmarks/bench_compaction.py`;
a one-line check of it is printed last. PNGs go to --out_dir.

Usage: PYTHONPATH=. python benchmarks/fragmentation_study.py [--steps=200 --seed=0 --out_dir=out/]
       PYTHONPATH=. python benchmarks/fragmentation_study.py --scale=32 --num_blocks=2048   # smoke
"""

from __future__ import annotations

import collections
import math
import os
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import records, shared_flags
import paged_kv
from paged_kv.core import alloc, compact, sequences, slots
from paged_kv.scheduler import SchedulerStats
from paged_kv.telemetry import metrics

try:  # optional: a progress bar
  import tqdm as _tqdm
except ImportError:  # pragma: no cover
  _tqdm = None

_OUT_DIR = flags.DEFINE_string("out_dir", "out/", "Where the PNGs go.")
_STEPS = flags.DEFINE_integer("steps", 200, "Simulated steps per run of study (b).")
_CHAT_STEPS = flags.DEFINE_integer("chat_steps", 60, "Simulated steps of study (a).")
_CHAT_SEEDS = flags.DEFINE_list("chat_seeds", ["0"], "Seeds of study (a), one run each.")
_TURN_MIN = flags.DEFINE_integer("turn_min", 5, "Shortest chat turn, tokens.")
_TURN_MAX = flags.DEFINE_integer("turn_max", 200, "Longest chat turn, tokens.")
_CHAT_MODES = flags.DEFINE_list("chat_modes", ["flat", "slotted", "slotted+reclaim",
                                               "slotted+consolidate"], "Modes of study (a).")
_CONSOLIDATE_MOVES = flags.DEFINE_integer("consolidate_moves", 64,
                                          "Segments re-packed per step (slotted+consolidate).")
_CHAT_BLOCKS = flags.DEFINE_integer("chat_blocks", 2048, "Pool blocks of study (a).")
_NUM_BLOCKS = flags.DEFINE_integer("num_blocks", None, "Pool blocks of study (b); default: "
                                   "the KV share of --card_gb for the modelled model.")
_BLOCK_SIZE = shared_flags.define_block_size()
_SCALE = flags.DEFINE_integer("scale", 1, "Divide the 64k/2k request lengths (smoke runs).")
_LONG_TOKENS = flags.DEFINE_integer("long_tokens", 65536, "Mean long request, tokens.")
_SHORT_TOKENS = flags.DEFINE_integer("short_tokens", 2048, "Mean short request, tokens.")
_LONG_FRACTION = flags.DEFINE_float("long_fraction", 0.3, "Share of long requests.")
_LOAD = flags.DEFINE_float("load", 1.2, "Offered load, x capacity.")
_MAX_WAIT = flags.DEFINE_integer("max_wait", 100, "Steps a request may wait before rejection.")
_MODES = flags.DEFINE_list("modes", ["segments", "require", "prefer"],
                           "Allocation modes of long requests.")
_POLICIES = flags.DEFINE_list("policies", ["none", "periodic_full", "online",
                                           "online_every_step", "merge", "merge_every_step"],
                              "Compaction policies of study (b).")
_CARD_GB = flags.DEFINE_float("card_gb", 80.0, "Card memory, GB (1e9 bytes).")
_WEIGHTS_GB = flags.DEFINE_float("weights_gb", 16.0, "Model weights, GB.")
_RESERVE_GB = flags.DEFINE_float("reserve_gb", 4.0, "Activations, workspace, GB.")
_MODEL = flags.DEFINE_list("model", ["32", "8", "128", "2"],
                           "Modelled layers, kv heads, head_dim, bytes per element.")
_STEP_MS = flags.DEFINE_float("step_ms", compact.DEFAULT_STEP_SECONDS * 1e3,
                              "Modelled step time, ms.")
_STEP_FRACTION = flags.DEFINE_float("step_fraction", compact.DEFAULT_STEP_FRACTION,
                                    "Share of a step compaction may take.")
_BANDWIDTH = flags.DEFINE_float("bandwidth", compact.H200_COPY_BANDWIDTH,
                                "Copy bandwidth, bytes/s, read + write.")
_BUDGET_BYTES = flags.DEFINE_integer("budget_bytes", None,
                                     "Bytes moved per step (overrides the step share).")
_BUDGET = flags.DEFINE_integer("budget", None, "Cap on moves per step (derived cap).")
_THRESHOLD = flags.DEFINE_float("threshold", 0.35, "Compaction trigger ratio.")
_PERIOD = flags.DEFINE_integer("period", 50, "Steps between periodic full compactions.")
_SEED = shared_flags.define_seed("Random seed of study (b).")
_FIT = flags.DEFINE_enum("fit", "first", ["first", "best"], "Which free run a long request's "
                         "contiguous allocation takes.")
_TIMING_REPS = flags.DEFINE_integer("timing_reps", 20, "Repetitions of the timing (median).")
_PARTS = flags.DEFINE_list("parts", ["a", "b", "timing"], "Which parts to run.")
_PROGRESS = shared_flags.define_progress()
_RECORD = shared_flags.define_record()
_COMPILE_CACHE = shared_flags.define_compile_cache()

# Quoted from the seed reports (operators' field numbers, on their allocator); never
# computed here, printed beside ours for reference only.
QUOTED = {"internal": "38.6% -> 3.8% (slotted)", "external": "48.2% -> 6.4% (16-32 moves/step)",
          "concurrency": "x2.8 (allocator needing contiguity)"}


def _bucket(x: int) -> int:
  return 1 << max(int(x) - 1, 0).bit_length()


def _pad(a, size, fill):
  a = np.asarray(a, np.int32)
  out = np.full((size,) + a.shape[1:], fill, np.int32)
  out[:len(a)] = a
  return out


def _config(max_seqs: int, max_segments: int, num_blocks: int | None = None) -> paged_kv.PoolConfig:
  return paged_kv.PoolConfig(num_blocks=num_blocks or _CHAT_BLOCKS.value,
                             block_size=_BLOCK_SIZE.value, num_layers=1, num_kv_heads=1,
                             head_dim=1, max_seqs=max_seqs, max_segments=max_segments)


def model_block_bytes() -> int:
  """Bytes of K and V of one block of the modelled model."""
  layers, heads, dim, itemsize = (int(x) for x in _MODEL.value)
  return 2 * layers * heads * dim * itemsize * _BLOCK_SIZE.value


def pool_blocks() -> int:
  """Blocks of study (b): --num_blocks, or the card's KV share in modelled blocks."""
  if _NUM_BLOCKS.value:
    return _NUM_BLOCKS.value
  kv = (_CARD_GB.value - _WEIGHTS_GB.value - _RESERVE_GB.value) * 1e9
  return int(kv // model_block_bytes())


def _progress(total: int, desc: str):
  if _tqdm is None or not _PROGRESS.value:
    return None
  return _tqdm.tqdm(total=total, desc=desc, leave=False, mininterval=1.0)


# ---------------------------------------------------------------------------
# (a) multi-turn chat: flat vs slotted.
# ---------------------------------------------------------------------------


def _turn_lengths(rng, n, lo=5, hi=200):
  """`lo`-`hi` tokens, log-uniform (many short turns)."""
  return np.exp(rng.uniform(np.log(lo), np.log(hi), n)).astype(int)


def chat_workload(seed: int, steps: int, turn_range: tuple[int, int] = (5, 200)):
  """Conversations arriving ~6 per step; turns of `turn_range` tokens; 8 system prompts."""
  rng = np.random.default_rng(seed)
  families = _turn_lengths(rng, 8) + 20  # system prompts (5-200 + 20 tokens)
  convs = []
  for step in range(steps):
    for _ in range(rng.poisson(6)):
      convs.append(dict(arrive=step, family=int(rng.integers(len(families))),
                        turns=_turn_lengths(rng, int(rng.integers(2, 9)), *turn_range).tolist(),
                        retain=int(rng.integers(5, 30))))
  return families, convs


def run_chat(mode: str, families, convs, steps: int):
  """Returns per-step internal fragmentation, OOMs, peak resident conversations.

  Modes: `flat` (one segment per block), `slotted` (short segments packed),
  `slotted+reclaim` (also frees the slots of segments that left slotted blocks),
  and `slotted+consolidate` (also re-packs the segments of the sparsest slotted
  blocks into the holes of others after every reclaim, `slots.plan_consolidation`,
  at most `--consolidate_moves` segments per step).
  """
  consolidate = mode == "slotted+consolidate"
  reclaim = mode in ("slotted+reclaim", "slotted+consolidate")
  config = _config(max_seqs=128, max_segments=256)
  bs = config.block_size
  state = paged_kv.init_pool(config)
  counters = SchedulerStats()  # its OOM and pack counts (no scheduler here)
  cache: dict[object, list[tuple[int, int, int]]] = {}  # holder -> segments (one ref each)

  def take_refs(segs):
    nonlocal state
    ids = np.array([s[0] for s in segs], np.int32)
    b = _bucket(len(ids))
    state, status = alloc.apply_ref_deltas(state, _pad(ids, b, -1), _pad(np.sign(len(ids)) *
                                                                         np.ones(len(ids)), b, 0),
                                           config=config)

  def drop(key):
    nonlocal state
    segs = cache.pop(key)
    ids = np.array([s[0] for s in segs], np.int32)
    b = _bucket(len(ids))
    state, _ = alloc.apply_ref_deltas(state, _pad(ids, b, -1), _pad(-np.ones(len(ids)), b, 0),
                                      config=config)

  def do_reclaim():
    nonlocal state
    held = np.array([s for v in cache.values() for s in v], np.int32).reshape(-1, 3)
    b = _bucket(len(held))
    state, (status, _) = slots.reclaim_slots(state, _pad(held[:, 0], b, 0),
                                             _pad(held[:, 1], b, 0), _pad(held[:, 2], b, 0),
                                             config=config)
    assert int(status) == 0

  def do_consolidate():
    do_reclaim()
    entries = [(k, i, s) for k, v in cache.items() for i, s in enumerate(v)]
    if not entries:
      return
    arr = np.array([e[2] for e in entries], np.int32)
    meta = jax.tree.map(np.asarray, state.meta)
    idx = slots.plan_consolidation(meta.ref_count, meta.slots, meta.region, arr[:, 0],
                                   arr[:, 2], block_size=bs,
                                   max_moves=_CONSOLIDATE_MOVES.value)
    pack_entries([entries[j] for j in idx])

  def pack(keys):
    ext = [(k, i, s) for k in keys for i, s in enumerate(cache[k]) if s[2] < bs]
    if not ext:
      return
    if reclaim:
      do_reclaim()
    pack_entries(ext)

  def pack_entries(ext):
    nonlocal state
    for lo in range(0, len(ext), 64):
      chunk = ext[lo:lo + 64]
      b = _bucket(len(chunk))
      arr = np.array([c[2] for c in chunk], np.int32)
      state, (nb, ns, status) = slots.pack_slots(
          state, _pad(np.full(len(chunk), slots.OWNER_EXTERNAL), b, -1), _pad(np.zeros(len(chunk)), b, 0),
          _pad(arr[:, 0], b, -1), _pad(arr[:, 1], b, 0), _pad(arr[:, 2], b, 0), config=config)
      nb, ns = np.asarray(nb), np.asarray(ns)
      for j, (k, i, s) in enumerate(chunk):
        if nb[j] >= 0:
          cache[k][i] = (int(nb[j]), int(ns[j]), s[2])
          counters.pack_moves += 1

  # Prefill the system prompts into the cache.
  rows = np.arange(len(families), dtype=np.int32)
  state, _ = sequences.open_sequence(state, rows, np.zeros((len(rows), 1), np.int32),
                                    np.zeros((len(rows), 1), np.int32),
                                    np.zeros((len(rows), 1), np.int32),
                                    np.zeros(len(rows), np.int32), config=config)
  state, (_, status) = sequences.reserve_tokens(state, rows, families.astype(np.int32),
                                               config=config, max_new_tokens=512)
  t = jax.tree.map(np.asarray, state.table)
  for f in range(len(families)):
    cache[("sys", f)] = [(int(t.block[f, s]), int(t.start[f, s]), int(t.length[f, s]))
                         for s in range(int(t.num_segments[f]))]
  take_refs([s for f in range(len(families)) for s in cache[("sys", f)]])
  state, _ = sequences.release(state, rows, config=config)
  if mode != "flat":
    pack([("sys", f) for f in range(len(families))])

  active: dict[int, dict] = {}
  retained: dict[int, int] = {}  # conv -> step at which its cache entries are dropped
  by_step = collections.defaultdict(list)
  for i, c in enumerate(convs):
    by_step[c["arrive"]].append(i)
  internal, ideal_used, resident_hist = [], [], []
  for step in range(steps):
    for i in by_step.get(step, []):
      active[i] = dict(turn=0, nodes=[])
    for i, drop_at in list(retained.items()):
      if drop_at <= step:
        for node in convs[i]["_nodes"]:
          drop(node)
        del retained[i]
    batch = sorted(active)[:config.max_seqs]
    if batch:
      # Open each turn's sequence from its cached prefix (system prompt + earlier turns).
      prefixes = [cache[("sys", convs[i]["family"])] + [s for nd in active[i]["nodes"]
                                                       for s in cache[nd]] for i in batch]
      width = _bucket(max(len(p) for p in prefixes))
      rows = np.arange(len(batch), dtype=np.int32)
      segs = np.zeros((3, len(batch), width), np.int32)
      for r, p in enumerate(prefixes):
        if p:
          segs[:, r, :len(p)] = np.array(p, np.int32).T
      b = _bucket(len(batch))
      state, st_open = sequences.open_sequence(
          state, _pad(rows, b, -1), _pad(segs[0], b, 0), _pad(segs[1], b, 0), _pad(segs[2], b, 0),
          _pad([len(p) for p in prefixes], b, 0), config=config)
      lens = [convs[i]["turns"][active[i]["turn"]] for i in batch]
      state, (_, st_res) = sequences.reserve_tokens(state, _pad(rows, b, -1), _pad(lens, b, 0),
                                                   config=config, max_new_tokens=256)
      st_res = np.asarray(st_res)[:len(batch)]
      counters.record_status(st_res)
      t = jax.tree.map(np.asarray, state.table)
      new_nodes = []
      for r, i in enumerate(batch):
        if st_res[r] != 0:
          continue
        n0 = len(prefixes[r])
        node = ("turn", i, active[i]["turn"])
        cache[node] = [(int(t.block[r, s]), int(t.start[r, s]), int(t.length[r, s]))
                       for s in range(n0, int(t.num_segments[r]))]
        new_nodes.append(node)
      take_refs([s for nd in new_nodes for s in cache[nd]])
      state, _ = sequences.release(state, _pad(rows, b, -1), config=config)
      if mode != "flat":
        pack(new_nodes)
      for r, i in enumerate(batch):
        if st_res[r] != 0:  # OOM: the conversation is dropped
          for nd in active[i]["nodes"]:
            drop(nd)
          del active[i]
          continue
        active[i]["nodes"].append(("turn", i, active[i]["turn"]))
        active[i]["turn"] += 1
        if active[i]["turn"] == len(convs[i]["turns"]):
          convs[i]["_nodes"] = active.pop(i)["nodes"]
          retained[i] = step + convs[i]["retain"]
    if consolidate:
      do_consolidate()
    snap = metrics.snapshot(state, config, extra_segments=[s for v in cache.values() for s in v],
                            counters=counters)
    internal.append(snap.internal_fragmentation)
    resident_hist.append(len(active) + len(retained))
    ideal_used.append(snap.live_tokens + sum(s[2] for v in cache.values() for s in v))
  return dict(internal=np.array(internal), oom=dict(counters.oom_by_reason),
              peak=max(resident_hist), final_snap=snap, packs=counters.pack_moves,
              segments=sum(len(v) for v in cache.values()))


# ---------------------------------------------------------------------------
# (b) long/short mix at real size: allocation modes x compaction policies.
# ---------------------------------------------------------------------------

CONTIGUITY = {"segments": "never", "require": "require", "prefer": "prefer"}


def mix_workload(seed: int, steps: int, num_blocks: int, bs: int, *, long_tokens: int,
                 short_tokens: int, long_fraction: float, load: float):
  """Requests: long (`long_tokens` +-25%, life 40-80 steps) or short (+-25%, 6-18 steps).

  Arrivals are Poisson at `load` x the rate that fills the pool's tokens.
  """
  rng = np.random.default_rng(seed)
  reqs = []
  cap = num_blocks * bs
  mean_tokens_life = (long_fraction * long_tokens * 60 + (1 - long_fraction) * short_tokens * 12)
  rate = load * cap / mean_tokens_life
  for step in range(steps):
    for _ in range(rng.poisson(rate)):
      is_long = rng.random() < long_fraction
      base = long_tokens if is_long else short_tokens
      tokens = max(1, int(base * rng.uniform(0.75, 1.25)))
      life = int(rng.integers(40, 80)) if is_long else int(rng.integers(6, 18))
      reqs.append(dict(arrive=step, long=is_long, tokens=tokens, life=life))
  return reqs


def _runs(ids: np.ndarray) -> int:
  """Contiguous runs in a set of block ids (1 = one run)."""
  if ids.size == 0:
    return 0
  s = np.sort(ids)
  return int(1 + np.count_nonzero(np.diff(s) != 1))


def _free_stats(ref: np.ndarray) -> tuple[float, int]:
  """`(fragmentation ratio, free blocks)` of a pool with no base region."""
  free = ref == 0
  total = int(free.sum())
  if total == 0:
    return 0.0, 0
  padded = np.concatenate([[False], free, [False]])
  edges = np.flatnonzero(padded[1:] != padded[:-1])
  run = int((edges[1::2] - edges[::2]).max())
  return 1.0 - run / total, total


def fluid_bound(present_tokens: list[int], capacity: int) -> int:
  """Most requests among `present_tokens` that fit `capacity` tokens (smallest first)."""
  if not present_tokens:
    return 0
  c = np.cumsum(np.sort(np.asarray(present_tokens, np.int64)))
  return int(np.searchsorted(c, capacity, side="right"))


def make_policy(name: str, *, threshold: float) -> compact.CompactionPolicy | None:
  """The `CompactionPolicy` of a study policy name (None: no online compaction)."""
  if name in ("none", "periodic_full"):
    return None
  return compact.CompactionPolicy(
      threshold=0.0 if name.endswith("every_step") else threshold,
      strategy="merge" if name.startswith("merge") else "top_down",
      budget=_BUDGET.value, budget_bytes=_BUDGET_BYTES.value,
      step_fraction=_STEP_FRACTION.value, step_seconds=_STEP_MS.value / 1e3,
      copy_bandwidth=_BANDWIDTH.value)


def run_mix(policy_name: str, mode: str, reqs, steps: int, *, num_blocks: int,
            threshold: float, period: int, max_wait: int, block_bytes: int,
            record_map_at: int | None = None, progress=None) -> dict:
  """One run of study (b); returns per-step series and per-request outcomes.

  Longs hold their blocks outside the tables (`allocate` with the mode's
  contiguity, one reference each); shorts are table rows (`reserve_tokens`).
  Every request, long or short, is checked against the free blocks minus those
  promised to requests admitted earlier in the same step.
  """
  bs = _BLOCK_SIZE.value
  short_max = max((r["tokens"] for r in reqs if not r["long"]), default=bs)
  max_segments = -(-short_max // bs) + 1  # derived: a short's blocks, one segment each
  config = _config(max_seqs=512, max_segments=max_segments, num_blocks=num_blocks)
  n = config.num_blocks
  state = paged_kv.init_pool(config)
  policy = make_policy(policy_name, threshold=threshold)
  queue = collections.deque()
  longs: dict[int, np.ndarray] = {}  # request -> its blocks (outside the tables)
  shorts: dict[int, int] = {}  # request -> table row
  free_rows = list(range(config.max_seqs))
  ends: dict[int, list[int]] = collections.defaultdict(list)
  by_step = collections.defaultdict(list)
  for i, r in enumerate(reqs):
    by_step[r["arrive"]].append(i)
  admit_step: dict[int, int] = {}
  rejected = collections.Counter()
  blocked_steps = collections.Counter()  # head-of-line failures by reason (steps)
  last_reason: dict[int, str] = {}
  ratios, live_hist, bound_hist, tok_hist, tokbound_hist, moves_hist = [], [], [], [], [], []
  long_runs = []
  maps = {}
  contiguous_failed = False
  compaction_seconds = 0.0
  cap_tokens = n * bs

  def apply_remap(remap):
    for k in longs:
      longs[k] = remap[longs[k]]

  def move(src, dst) -> int:
    nonlocal state, compaction_seconds
    num = int((np.asarray(src) >= 0).sum())
    if num == 0:
      return 0
    t0 = time.perf_counter()
    b = _bucket(len(src))
    state, (remap, status) = compact.compact_permute(state, _pad(src, b, -1), _pad(dst, b, -1),
                                                     config=config)
    assert (np.asarray(status) == 0).all()
    apply_remap(np.asarray(remap))
    compaction_seconds += time.perf_counter() - t0
    return num

  def compact_full() -> int:
    total = 0
    while True:
      src, dst = compact.plan_compaction(state.meta, budget=min(1024, n // 2))
      got = move(np.asarray(src), np.asarray(dst))
      if not got:
        return total
      total += got

  for step in range(steps):
    # Departures.
    dec_rows = []
    for i in ends.pop(step, []):
      if i in longs:
        ids = longs.pop(i)
        b = _bucket(len(ids))
        state, _ = alloc.apply_ref_deltas(state, _pad(ids, b, -1), _pad(-np.ones(len(ids)), b, 0),
                                          config=config)
      else:
        row = shorts.pop(i)
        dec_rows.append(row)
        free_rows.append(row)
    if dec_rows:
      state, _ = sequences.release(state, _pad(dec_rows, _bucket(len(dec_rows)), -1),
                                  config=config)
    # Compaction (between steps).
    if record_map_at is not None and step == record_map_at:
      maps["before"] = _block_map(state, longs)
    moved = 0
    if policy_name == "periodic_full" and step % period == 0:
      moved = compact_full()
    elif policy is not None:
      ratio = float(compact.fragmentation_ratio(state.meta))
      if policy.should_compact(ratio, contiguous_failed):
        src, dst = policy.plan(state.meta, block_bytes=block_bytes)
        moved = move(src, dst)
    moves_hist.append(moved)
    if record_map_at is not None and step == record_map_at:
      # The "after" map comes from a full compaction of a copy; the run goes on uncompacted.
      saved = (jax.tree.map(jnp.copy, state), {k: v.copy() for k, v in longs.items()},
               compaction_seconds)
      compact_full()
      maps["after"] = _block_map(state, longs)
      state, longs, compaction_seconds = saved
    contiguous_failed = False
    # Arrivals; FIFO admission, head of line blocks; promised blocks counted.
    queue.extend(by_step.get(step, []))
    new_short = []
    promised = 0  # blocks promised to shorts admitted in this step (reserved below)
    num_free = int((np.asarray(state.meta.ref_count) == 0).sum())  # no base region here
    while queue:
      i = queue[0]
      r = reqs[i]
      need = -(-r["tokens"] // bs)
      reason = None
      if need > n:
        queue.popleft()
        rejected["exceeds_pool"] += 1
        continue
      if num_free - promised < need:
        reason = "no_free_block"
      elif r["long"]:
        state, (ids, status) = alloc.allocate(state, need, config=config,
                                              max_blocks=_bucket(need),
                                              contiguous=CONTIGUITY[mode], fit=_FIT.value)
        status = int(status)
        if status == paged_kv.Status.NO_CONTIGUOUS_RUN:
          reason = "no_contiguous_run"
          contiguous_failed = True
        elif status != 0:
          reason = "no_free_block"
        else:
          longs[i] = np.asarray(ids)[:need]
          num_free -= need
      else:
        if not free_rows or len(new_short) >= len(free_rows):
          reason = "no_row"
        else:
          new_short.append(i)
          promised += need
      if reason is not None:
        blocked_steps[reason] += 1
        last_reason[i] = reason
        if step - r["arrive"] >= max_wait:
          queue.popleft()
          rejected[reason] += 1
          continue
        break
      queue.popleft()
      admit_step[i] = step
      ends[step + r["life"]].append(i)
    if new_short:
      rows = [free_rows.pop() for _ in new_short]
      for i, row in zip(new_short, rows):
        shorts[i] = row
      b = _bucket(len(rows))
      z = np.zeros((b, 1), np.int32)
      state, _ = sequences.open_sequence(state, _pad(rows, b, -1), z, z, z, np.zeros(b, np.int32),
                                        config=config)
      state, (_, st_res) = sequences.reserve_tokens(
          state, _pad(rows, b, -1), _pad([reqs[i]["tokens"] for i in new_short], b, 0),
          config=config, max_new_tokens=_bucket(short_max + 1))
      assert (np.asarray(st_res) == 0).all(), np.asarray(st_res)
    ref = np.asarray(state.meta.ref_count)
    ratio, _ = _free_stats(ref)
    ratios.append(ratio)
    live = len(longs) + len(shorts)
    live_hist.append(live)
    present = [reqs[i]["tokens"] for i in list(longs) + list(shorts) + list(queue)]
    bound_hist.append(fluid_bound(present, cap_tokens))
    tok_hist.append(sum(reqs[i]["tokens"] for i in list(longs) + list(shorts)))
    tokbound_hist.append(min(cap_tokens, sum(present)))
    long_runs.extend(_runs(ids) for ids in longs.values())
    if progress is not None:
      progress.update(1)
  delays = {i: admit_step[i] - reqs[i]["arrive"] for i in admit_step}
  return dict(ratios=np.array(ratios), live=np.array(live_hist), bound=np.array(bound_hist),
              tokens=np.array(tok_hist), token_bound=np.array(tokbound_hist),
              moves=np.array(moves_hist), rejected=dict(rejected),
              blocked_steps=dict(blocked_steps), delays=delays, pending=len(queue),
              admitted=len(admit_step), long_runs=np.array(long_runs or [0]),
              seconds=compaction_seconds, maps=maps, max_segments=max_segments)


def _block_map(state, longs) -> np.ndarray:
  """`i8[num_blocks]`: 0 free, 1 short (table), 2 long (outside holder)."""
  ref = np.asarray(state.meta.ref_count)
  m = (ref > 0).astype(np.int8)
  for ids in longs.values():
    m[ids] = 2
  return m


def summarize(r: dict, reqs, *, block_bytes: int, warmup: int) -> dict:
  """The per-run report row."""
  policy = compact.CompactionPolicy(step_seconds=_STEP_MS.value / 1e3,
                                    copy_bandwidth=_BANDWIDTH.value)
  w = slice(warmup, None)
  d = r["delays"]
  delayed = [v for v in d.values() if v > 0]
  long_delayed = [v for i, v in d.items() if v > 0 and reqs[i]["long"]]
  moves = r["moves"]
  share = np.array([policy.step_time_share(m, block_bytes) for m in moves])
  return dict(
      frag_mean=float(r["ratios"].mean()), frag_p99=float(np.percentile(r["ratios"], 99)),
      admitted=r["admitted"], delayed=len(delayed),
      delay_mean=float(np.mean(delayed)) if delayed else 0.0,
      delay_p99=float(np.percentile(delayed, 99)) if delayed else 0.0,
      long_delayed=len(long_delayed), rejected=r["rejected"], pending=r["pending"],
      blocked_steps=r["blocked_steps"],
      mb_per_step=float(moves.mean() * block_bytes / 1e6),
      share_mean=float(share.mean()), share_max=float(share.max()),
      conc=float(r["live"][w].mean()), bound=float(r["bound"][w].mean()),
      conc_ratio=float(r["live"][w].mean() / max(r["bound"][w].mean(), 1e-9)),
      tok_ratio=float(r["tokens"][w].mean() / max(r["token_bound"][w].mean(), 1e-9)),
      long_runs=float(r["long_runs"].mean()), moves=int(moves.sum()), seconds=r["seconds"])


# ---------------------------------------------------------------------------
# Timing: one 32-move compaction step vs a plain copy of the same bytes.
# ---------------------------------------------------------------------------


def time_compaction(reps: int) -> dict:
  config = paged_kv.PoolConfig(num_blocks=512, block_size=16, num_layers=4, num_kv_heads=4,
                               head_dim=128, dtype="bfloat16", max_seqs=4, max_segments=4)
  state = paged_kv.init_pool(config)
  key = jax.random.key(0)
  shape = state.pages.k.shape
  state = paged_kv.PoolState(
      pages=paged_kv.KVPages(k=jax.random.normal(key, shape, jnp.bfloat16),
                             v=jax.random.normal(jax.random.split(key)[0], shape, jnp.bfloat16)),
      meta=state.meta, table=state.table, step=state.step)
  # 32 live blocks at the top, 32 free at the bottom: the moves alternate down and up.
  n = config.num_blocks
  top = np.arange(n - 32, n, dtype=np.int32)
  state, _ = alloc.allocate(state, n, config=config, max_blocks=n, contiguous="never")
  state, _ = alloc.apply_ref_deltas(state, np.arange(0, n - 32, dtype=np.int32),
                                    -np.ones(n - 32, np.int32), config=config)
  bottom = np.arange(0, 32, dtype=np.int32)
  want = np.asarray(state.pages.k[:, :, top[0]])
  times = []
  src, dst = top, bottom
  for i in range(reps + 2):
    t0 = time.perf_counter()
    state, (remap, status) = compact.compact_permute(state, src, dst, config=config)
    jax.block_until_ready(state.pages.k)
    if i >= 2:
      times.append(time.perf_counter() - t0)
    assert (np.asarray(status) == 0).all()
    src, dst = dst, src
  moved_at = src[0]  # after an even number of swaps the data sits at `src`
  np.testing.assert_array_equal(np.asarray(state.pages.k[:, :, moved_at]), want)
  nbytes = 32 * config.block_bytes
  buf = jnp.asarray(np.random.default_rng(0).standard_normal(nbytes // 2), jnp.bfloat16)
  copy = jax.jit(lambda x: x[::-1])
  jax.block_until_ready(copy(buf))
  ctimes = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(copy(buf))
    ctimes.append(time.perf_counter() - t0)
  return dict(bytes=nbytes, compact_s=float(np.median(times)), copy_s=float(np.median(ctimes)),
              device=jax.devices()[0].platform)


# ---------------------------------------------------------------------------


def _plots(out_dir, chat, mix, maps, modes, policies):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  paths = []
  if maps:
    fig, axes = plt.subplots(2, 1, figsize=(10, 2.6))
    for ax, key in zip(axes, ("before", "after")):
      m = maps[key]
      width = 64
      img = np.full(((len(m) + width - 1) // width) * width, -1)
      img[:len(m)] = m
      ax.imshow(img.reshape(-1, width).T, aspect="auto", cmap="viridis", vmin=-1, vmax=2,
                interpolation="nearest")
      ax.set_title(f"block map {key} compaction (dark: free, green: short, yellow: long)",
                   fontsize=8)
      ax.set_xticks([])
      ax.set_yticks([])
    fig.tight_layout()
    p = os.path.join(out_dir, "block_map_compaction.png")
    fig.savefig(p, dpi=120)
    plt.close(fig)
    paths.append(p)
  # Small multiples: one panel per policy (lines: allocation modes), shared axes, so
  # no line hides another; the last panel is study (a).
  cols = 3
  rows = math.ceil((len(policies) + 1) / cols)
  fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 2.6 * rows), squeeze=False)
  flat = axes.reshape(-1)
  colors = dict(zip(("segments", "require", "prefer"), ("tab:blue", "tab:red", "tab:green")))
  for ax, pol in zip(flat, policies):
    for mode in modes:
      r = mix[(mode, pol)]
      ax.plot(r["ratios"], lw=0.9, color=colors.get(mode), label=mode,
              ls="--" if mode == "prefer" else "-")  # prefer often overlays segments
    ax.set_title(f"(b) {pol}", fontsize=9)
    ax.set_ylim(0, 1)
    ax.set_xlabel("step", fontsize=8)
    ax.set_ylabel("fragmentation ratio", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=6, loc="upper right")
  ax = flat[len(policies)]
  for name, r in (chat or {}).items():
    ax.plot(r["internal"], label=name)
  ax.set_title("(a) internal fragmentation (first seed)", fontsize=9)
  ax.set_xlabel("step", fontsize=8)
  ax.tick_params(labelsize=7)
  if chat:
    ax.legend(fontsize=6)
  else:
    ax.axis("off")  # study (a) was not run
  for ax in flat[len(policies) + 1:]:
    ax.axis("off")
  fig.tight_layout()
  p = os.path.join(out_dir, "fragmentation_over_time.png")
  fig.savefig(p, dpi=110)
  plt.close(fig)
  paths.append(p)
  return paths


def _fmt(d):
  return ",".join(f"{k}={v}" for k, v in sorted(d.items())) or "0"


def main(argv):
  del argv
  _COMPILE_CACHE.enable()
  os.makedirs(_OUT_DIR.value, exist_ok=True)
  bs = _BLOCK_SIZE.value
  t_start = time.perf_counter()
  rec = records.Recorder(_RECORD.value, "fragmentation_study",
                         flag_values=records.script_flags(),
                         seeds=[int(x) for x in _CHAT_SEEDS.value] + [_SEED.value])
  result = {"chat": {"turn_range": [_TURN_MIN.value, _TURN_MAX.value],
                     "steps": _CHAT_STEPS.value, "blocks": _CHAT_BLOCKS.value, "runs": []}}

  # (a) chat, one run per seed.
  turn_range = (_TURN_MIN.value, _TURN_MAX.value)
  chat_first = None
  print(f"\n(a) multi-turn chat: turns {turn_range[0]}-{turn_range[1]} tokens (log-uniform), "
        f"8 shared system prompts, pool {_CHAT_BLOCKS.value} x {bs}-token blocks, "
        f"{_CHAT_STEPS.value} steps; quoted (seed reports, not computed): internal "
        f"{QUOTED['internal']}")
  print(f"{'seed':>4} {'mode':<16}{'internal frag mean':>20}{'final':>8}{'OOMs':>22}"
        f"{'peak resident conv.':>21}{'segments':>10}{'packs':>8}")
  chat_summary = collections.defaultdict(list)
  for seed in (int(x) for x in _CHAT_SEEDS.value if "a" in _PARTS.value):
    families, convs = chat_workload(seed, _CHAT_STEPS.value, turn_range)
    chat = {}
    for mode in _CHAT_MODES.value:
      chat[mode] = run_chat(mode, families, [dict(c) for c in convs], _CHAT_STEPS.value)
      r = chat[mode]
      print(f"{seed:>4} {mode:<20}{r['internal'].mean():>16.2%}{r['internal'][-1]:>8.2%}"
            f"{_fmt(r['oom']):>22}{r['peak']:>21}{r['segments']:>10}{r['packs']:>8}",
            flush=True)
      chat_summary[mode].append((r['internal'].mean(), r['internal'][-1]))
      result["chat"]["runs"].append(dict(
          seed=seed, mode=mode, internal_mean=float(r["internal"].mean()),
          internal_final=float(r["internal"][-1]), oom=dict(r["oom"]), peak=r["peak"],
          segments=r["segments"], packs=r["packs"]))
    chat_first = chat_first or chat
  for mode, v in chat_summary.items():
    v = np.array(v)
    print(f"  all seeds {mode:<20} mean of means {v[:, 0].mean():.2%}, worst mean "
          f"{v[:, 0].max():.2%}, worst final {v[:, 1].max():.2%}")
  if "b" not in _PARTS.value:
    rec.write(result)
    return

  # (b) long/short mix.
  nblk = pool_blocks()
  bb = model_block_bytes()
  long_tok, short_tok = _LONG_TOKENS.value // _SCALE.value, _SHORT_TOKENS.value // _SCALE.value
  reqs = mix_workload(_SEED.value, _STEPS.value, nblk, bs, long_tokens=long_tok,
                      short_tokens=short_tok, long_fraction=_LONG_FRACTION.value,
                      load=_LOAD.value)
  example = make_policy("merge", threshold=_THRESHOLD.value)
  per_step_moves = example.max_moves(bb)
  modes, policies = list(_MODES.value), list(_POLICIES.value)
  print(f"\n(b) {_LONG_FRACTION.value:.0%} long ({long_tok} tok) / short ({short_tok} tok), "
        f"{len(reqs)} requests over {_STEPS.value} steps, seed {_SEED.value}; pool {nblk} x "
        f"{bs}-token blocks ({nblk * bb / 1e9:.1f} GB of K/V at {bb / 2**20:.2f} MiB/block); "
        f"budget {example.step_bytes / 1e6:.0f} MB/step = {per_step_moves} moves "
        f"({_STEP_FRACTION.value * 100:g}% of {_STEP_MS.value:g} ms at "
        f"{_BANDWIDTH.value / 1e12:g} "
        f"TB/s), threshold {_THRESHOLD.value}")
  mix, rows = {}, {}
  map_step = _STEPS.value // 2
  bar = _progress(len(modes) * len(policies) * _STEPS.value, "study (b)")
  for mode in modes:
    for pol in policies:
      if bar is not None:
        bar.set_description(f"(b) {mode}/{pol}")
      mix[(mode, pol)] = run_mix(
          pol, mode, reqs, _STEPS.value, num_blocks=nblk, threshold=_THRESHOLD.value,
          period=_PERIOD.value, max_wait=_MAX_WAIT.value, block_bytes=bb,
          record_map_at=map_step if (mode, pol) == ("require", "none") else None,
          progress=bar)
      rows[(mode, pol)] = summarize(mix[(mode, pol)], reqs, block_bytes=bb,
                                    warmup=_STEPS.value // 4)
  if bar is not None:
    bar.close()
  print(f"max_segments (derived from the workload): "
        f"{next(iter(mix.values()))['max_segments']}; concurrency = mean live requests over "
        f"steps {_STEPS.value // 4}-{_STEPS.value}, bound = fluid bound (see docstring); "
        f"quoted (seed reports, not computed): fragmentation {QUOTED['external']}, "
        f"concurrency {QUOTED['concurrency']}")
  hdr = (f"{'mode':<9}{'policy':<18}{'frag mean':>10}{'p99':>8}{'admitted':>9}"
         f"{'delayed':>8}{'(long)':>7}{'delay mean/p99':>15}{'rejected':>26}{'pending':>8}"
         f"{'MB/step':>9}{'share mean/max':>16}{'runs/long':>10}{'conc.':>7}{'bound':>7}"
         f"{'c/bound':>8}{'tok/bound':>10}")
  print(hdr)
  for (mode, pol), s in rows.items():
    print(f"{mode:<9}{pol:<18}{s['frag_mean']:>10.2%}{s['frag_p99']:>8.2%}{s['admitted']:>9}"
          f"{s['delayed']:>8}{s['long_delayed']:>7}"
          f"{s['delay_mean']:>8.1f}/{s['delay_p99']:<6.0f}{_fmt(s['rejected']):>26}"
          f"{s['pending']:>8}{s['mb_per_step']:>9.1f}"
          f"{s['share_mean']:>8.2%}/{s['share_max']:<7.1%}{s['long_runs']:>10.1f}"
          f"{s['conc']:>7.1f}{s['bound']:>7.1f}{s['conc_ratio']:>8.3f}{s['tok_ratio']:>10.3f}")

  result["mix"] = dict(
      seed=_SEED.value, steps=_STEPS.value, requests=len(reqs),
      long_fraction=_LONG_FRACTION.value, load=_LOAD.value, long_tokens=long_tok,
      short_tokens=short_tok, pool_blocks=nblk, block_bytes=bb,
      step_fraction=_STEP_FRACTION.value, step_ms=_STEP_MS.value,
      budget_moves=per_step_moves, threshold=_THRESHOLD.value, max_wait=_MAX_WAIT.value,
      rows=[dict(mode=mode, policy=pol, **s) for (mode, pol), s in rows.items()])
  if "timing" in _PARTS.value:
    timing = time_compaction(_TIMING_REPS.value)
    result["timing"] = timing
    print(f"\ncompaction step of 32 moves ({timing['bytes'] / 2**20:.1f} MiB, "
          f"{timing['device']}): {timing['compact_s'] * 1e3:.3f} ms; plain copy of the same "
          f"bytes: {timing['copy_s'] * 1e3:.3f} ms; ratio "
          f"{timing['compact_s'] / timing['copy_s']:.2f} (medians of {_TIMING_REPS.value}; "
          "benchmarks/bench_compaction.py for the breakdown)")
  paths = _plots(_OUT_DIR.value, chat_first, mix, mix.get(("require", "none"), {}).get("maps"),
                 modes, policies)
  print("plots: " + ", ".join(paths))
  print(f"total {time.perf_counter() - t_start:.1f} s")
  rec.write(result)


if __name__ == "__main__":
  app.run(main)
