"""Fragmentation study: slotted packing and budgeted online compaction, simulated.

A pure memory-management simulation on the real pool transitions (tiny pages, no
attention math):

  (a) multi-turn chat: conversations of short turns (5-200 tokens) that share
      system prompts through a pretend prefix cache; flat 16-token blocks vs
      slotted packing of every cached node's short tail (`pack_slots`).
  (b) 30% long (64k scaled down by --scale) / 70% short (2k scaled) requests
      arriving and leaving; long prefills need a contiguous run of blocks
      (`allocate(contiguous="require")`, held outside the tables), shorts use
      segment tables. No compaction / periodic full / budgeted online.

For both it prints internal fragmentation, mean and p99 fragmentation ratio,
OOMs by reason, max concurrent sequences and the max concurrency of a
token-granular allocator on the same arrivals; then it times one 32-move
compaction step against a plain copy of the same bytes. PNGs go to --out_dir.

Usage: python examples/fragmentation_study.py [--steps=200 --chat_steps=60 --out_dir=out/]
"""

from __future__ import annotations

import collections
import dataclasses
import os
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

import paged_kv
from paged_kv.core import alloc, compact, segments, slots
from paged_kv.telemetry import metrics

_OUT_DIR = flags.DEFINE_string("out_dir", "out/", "Where the PNGs go.")
_STEPS = flags.DEFINE_integer("steps", 200, "Simulated steps per run of study (b).")
_CHAT_STEPS = flags.DEFINE_integer("chat_steps", 60, "Simulated steps of study (a).")
_NUM_BLOCKS = flags.DEFINE_integer("num_blocks", 2048, "Pool blocks.")
_BLOCK_SIZE = flags.DEFINE_integer("block_size", 16, "Tokens per block.")
_SCALE = flags.DEFINE_integer("scale", 32, "64k/2k requests are divided by this.")
_BUDGET = flags.DEFINE_integer("budget", 32, "Compaction moves per step (online).")
_THRESHOLD = flags.DEFINE_float("threshold", 0.35, "Compaction trigger ratio.")
_PERIOD = flags.DEFINE_integer("period", 50, "Steps between periodic full compactions.")
_SEED = flags.DEFINE_integer("seed", 0, "Random seed.")
_FIT = flags.DEFINE_enum("fit", "first", ["first", "best"], "Which free run a long request's "
                         "contiguous allocation takes.")
_TIMING_REPS = flags.DEFINE_integer("timing_reps", 20, "Repetitions of the timing (median).")

FIELD = {"internal": (0.386, 0.038), "external": (0.482, 0.064)}


def _bucket(x: int) -> int:
  return 1 << max(int(x) - 1, 0).bit_length()


def _pad(a, size, fill):
  a = np.asarray(a, np.int32)
  out = np.full((size,) + a.shape[1:], fill, np.int32)
  out[:len(a)] = a
  return out


def _config(max_seqs: int, max_segments: int) -> paged_kv.PoolConfig:
  return paged_kv.PoolConfig(num_blocks=_NUM_BLOCKS.value, block_size=_BLOCK_SIZE.value,
                             num_layers=1, num_kv_heads=1, head_dim=1, max_seqs=max_seqs,
                             max_segments=max_segments)


# ---------------------------------------------------------------------------
# (a) multi-turn chat: flat vs slotted.
# ---------------------------------------------------------------------------


def _turn_lengths(rng, n):
  """5-200 tokens, log-uniform (many short turns)."""
  return np.exp(rng.uniform(np.log(5), np.log(200), n)).astype(int)


def chat_workload(seed: int, steps: int):
  rng = np.random.default_rng(seed)
  families = _turn_lengths(rng, 8) + 20  # system prompts
  convs = []
  for step in range(steps):
    for _ in range(rng.poisson(6)):
      convs.append(dict(arrive=step, family=int(rng.integers(len(families))),
                        turns=_turn_lengths(rng, int(rng.integers(2, 9))).tolist(),
                        retain=int(rng.integers(5, 30))))
  return families, convs


def run_chat(mode: str, families, convs, steps: int):
  """Returns per-step internal fragmentation, OOMs, peak resident conversations.

  Modes: `flat` (one segment per block), `slotted` (short segments packed), and
  `slotted+reclaim` (also frees the slots of segments that left slotted blocks).
  """
  reclaim = mode == "slotted+reclaim"
  config = _config(max_seqs=128, max_segments=256)
  bs = config.block_size
  state = paged_kv.init_pool(config)
  counters = metrics.PoolCounters()
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

  def pack(keys):
    nonlocal state
    ext = [(k, i, s) for k in keys for i, s in enumerate(cache[k]) if s[2] < bs]
    if not ext:
      return
    if reclaim:
      held = np.array([s for v in cache.values() for s in v], np.int32).reshape(-1, 3)
      b = _bucket(len(held))
      state, (status, _) = slots.reclaim_slots(state, _pad(held[:, 0], b, 0),
                                               _pad(held[:, 1], b, 0), _pad(held[:, 2], b, 0),
                                               config=config)
      assert int(status) == 0
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
  state, _ = segments.open_sequence(state, rows, np.zeros((len(rows), 1), np.int32),
                                    np.zeros((len(rows), 1), np.int32),
                                    np.zeros((len(rows), 1), np.int32),
                                    np.zeros(len(rows), np.int32), config=config)
  state, (_, status) = segments.reserve_tokens(state, rows, families.astype(np.int32),
                                               config=config, max_new_tokens=512)
  t = jax.tree.map(np.asarray, state.table)
  for f in range(len(families)):
    cache[("sys", f)] = [(int(t.block[f, s]), int(t.start[f, s]), int(t.length[f, s]))
                         for s in range(int(t.num_segments[f]))]
  take_refs([s for f in range(len(families)) for s in cache[("sys", f)]])
  state, _ = segments.release(state, rows, config=config)
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
      state, st_open = segments.open_sequence(
          state, _pad(rows, b, -1), _pad(segs[0], b, 0), _pad(segs[1], b, 0), _pad(segs[2], b, 0),
          _pad([len(p) for p in prefixes], b, 0), config=config)
      lens = [convs[i]["turns"][active[i]["turn"]] for i in batch]
      state, (_, st_res) = segments.reserve_tokens(state, _pad(rows, b, -1), _pad(lens, b, 0),
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
      state, _ = segments.release(state, _pad(rows, b, -1), config=config)
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
    snap = metrics.snapshot(state, config, extra_segments=[s for v in cache.values() for s in v],
                            counters=counters)
    internal.append(snap.internal_fragmentation)
    resident_hist.append(len(active) + len(retained))
    ideal_used.append(snap.live_tokens + sum(s[2] for v in cache.values() for s in v))
  return dict(internal=np.array(internal), oom=dict(counters.oom_by_reason),
              peak=max(resident_hist), final_snap=snap, packs=counters.pack_moves,
              segments=sum(len(v) for v in cache.values()))


# ---------------------------------------------------------------------------
# (b) long/short mix: compaction policies.
# ---------------------------------------------------------------------------


def mix_workload(seed: int, steps: int, num_blocks: int, bs: int, scale: int):
  rng = np.random.default_rng(seed)
  long_tok, short_tok = 65536 // scale, 2048 // scale
  reqs = []
  cap = num_blocks * bs
  # Offered load ~1.2x capacity so the pool stays full.
  mean_tokens_life = 0.3 * long_tok * 60 + 0.7 * short_tok * 12
  rate = 1.2 * cap / mean_tokens_life
  for step in range(steps):
    for _ in range(rng.poisson(rate)):
      is_long = rng.random() < 0.3
      base = long_tok if is_long else short_tok
      tokens = int(base * rng.uniform(0.75, 1.25))
      life = int(rng.integers(40, 80)) if is_long else int(rng.integers(6, 18))
      reqs.append(dict(arrive=step, long=is_long, tokens=tokens, life=life))
  return reqs


def run_mix(policy: str, reqs, steps: int, *, budget: int, threshold: float, period: int,
            record_map_at: int | None = None):
  config = _config(max_seqs=512, max_segments=128)
  bs, n = config.block_size, config.num_blocks
  state = paged_kv.init_pool(config)
  counters = metrics.PoolCounters()
  queue = collections.deque()
  longs: dict[int, np.ndarray] = {}  # request -> its blocks (outside the tables)
  shorts: dict[int, int] = {}  # request -> table row
  free_rows = list(range(config.max_seqs))
  ends: dict[int, list[int]] = collections.defaultdict(list)
  by_step = collections.defaultdict(list)
  for i, r in enumerate(reqs):
    by_step[r["arrive"]].append(i)
  ratios, internal, live_hist = [], [], []
  maps = {}
  contiguous_failed = False
  online = compact.CompactionPolicy(threshold=threshold, budget=budget)

  def apply_remap(remap):
    for k in longs:
      longs[k] = remap[longs[k]]

  def compact_full():
    nonlocal state
    while True:
      src, dst = compact.plan_compaction(state.meta, budget=256)
      if int((np.asarray(src) >= 0).sum()) == 0:
        return
      t0 = time.perf_counter()
      state, (remap, _) = compact.compact_permute(state, src, dst, config=config)
      remap = np.asarray(remap)
      counters.record_compaction(int((np.asarray(src) >= 0).sum()), time.perf_counter() - t0)
      apply_remap(remap)

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
      state, _ = segments.release(state, _pad(dec_rows, _bucket(len(dec_rows)), -1),
                                  config=config)
    # Compaction policy (between steps).
    if record_map_at is not None and step == record_map_at:
      maps["before"] = _block_map(state, longs)
    if policy == "periodic_full" and step % period == 0:
      compact_full()
    elif policy.startswith("merge"):
      ratio = float(compact.fragmentation_ratio(state.meta))
      if online.should_compact(ratio, contiguous_failed):
        t0 = time.perf_counter()
        src, dst = online.plan(state.meta)
        moves = int((src >= 0).sum())
        if moves:
          state, (remap, _) = compact.compact_permute(state, src, dst, config=config)
          apply_remap(np.asarray(remap))
        counters.record_compaction(moves, time.perf_counter() - t0)
    elif policy.startswith("online"):
      ratio = float(compact.fragmentation_ratio(state.meta))
      if online.should_compact(ratio, contiguous_failed):
        t0 = time.perf_counter()
        state, (remap, moves) = compact.compact_step(state, True, config=config, policy=online)
        moves = int(moves)
        counters.record_compaction(moves, time.perf_counter() - t0)
        apply_remap(np.asarray(remap))
    if record_map_at is not None and step == record_map_at:
      # The "after" map comes from a full compaction of a copy; the run goes on uncompacted.
      saved = (jax.tree.map(jnp.copy, state), {k: v.copy() for k, v in longs.items()},
               dataclasses.replace(counters))
      compact_full()
      maps["after"] = _block_map(state, longs)
      state, longs, counters = saved
    contiguous_failed = False
    # Arrivals, FIFO admission (head of line blocks).
    queue.extend(by_step.get(step, []))
    new_short = []
    while queue:
      i = queue[0]
      r = reqs[i]
      need = -(-r["tokens"] // bs)
      if r["long"]:
        state, (ids, status) = alloc.allocate(state, need, config=config, max_blocks=_bucket(need),
                                              contiguous="require", fit=_FIT.value)
        status = int(status)
        if status != 0:
          counters.record_status(np.array([status]))
          contiguous_failed = status == paged_kv.Status.NO_CONTIGUOUS_RUN
          break
        longs[i] = np.asarray(ids)[:need]
      else:
        if int(state.meta.num_free) - sum(-(-reqs[j]["tokens"] // bs) for j in new_short) < need \
            or not free_rows:
          counters.record_oom("no_free_block")
          break
        new_short.append(i)
      queue.popleft()
      ends[step + r["life"]].append(i)
    if new_short:
      rows = [free_rows.pop() for _ in new_short]
      for i, row in zip(new_short, rows):
        shorts[i] = row
      b = _bucket(len(rows))
      z = np.zeros((b, 1), np.int32)
      state, _ = segments.open_sequence(state, _pad(rows, b, -1), z, z, z, np.zeros(b, np.int32),
                                        config=config)
      state, (_, st_res) = segments.reserve_tokens(
          state, _pad(rows, b, -1), _pad([reqs[i]["tokens"] for i in new_short], b, 0),
          config=config, max_new_tokens=_bucket(2048 // _SCALE.value * 5 // 4 + 1))
      assert (np.asarray(st_res) == 0).all()
    extra = [(int(blk), 0, bs) for ids in longs.values() for blk in ids]
    snap = metrics.snapshot(state, config, extra_segments=extra or None, counters=counters)
    ratios.append(snap.fragmentation_ratio)
    internal.append(snap.internal_fragmentation)
    live_hist.append(len(longs) + len(shorts))
  return dict(ratios=np.array(ratios), internal=np.array(internal), oom=dict(counters.oom_by_reason),
              peak=max(live_hist), mean_live=float(np.mean(live_hist[steps // 4:])),
              moves=counters.compaction_moves, seconds=counters.compaction_seconds,
              max_moves_step=None, maps=maps)


def _block_map(state, longs) -> np.ndarray:
  """`i8[num_blocks]`: 0 free, 1 short (table), 2 long (outside holder)."""
  ref = np.asarray(state.meta.ref_count)
  m = (ref > 0).astype(np.int8)
  for ids in longs.values():
    m[ids] = 2
  return m


def ideal_concurrency(reqs, steps: int, capacity_tokens: int) -> tuple[int, float]:
  """Peak and mean live requests of a token-granular allocator (FIFO, same arrivals)."""
  free = capacity_tokens
  queue = collections.deque()
  ends = collections.defaultdict(list)
  by_step = collections.defaultdict(list)
  for i, r in enumerate(reqs):
    by_step[r["arrive"]].append(i)
  live, hist = 0, []
  for step in range(steps):
    for i in ends.pop(step, []):
      free += reqs[i]["tokens"]
      live -= 1
    queue.extend(by_step.get(step, []))
    while queue and reqs[queue[0]]["tokens"] <= free:
      i = queue.popleft()
      free -= reqs[i]["tokens"]
      live += 1
      ends[step + reqs[i]["life"]].append(i)
    hist.append(live)
  return max(hist), float(np.mean(hist[steps // 4:]))


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


def _plots(out_dir, chat, mix, maps):
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
  fig, axes = plt.subplots(1, 2, figsize=(11, 3.4))
  for name, r in mix.items():
    axes[0].plot(r["ratios"], label=name, lw=0.9)
  axes[0].set_title("(b) fragmentation ratio over time")
  axes[0].set_xlabel("step")
  axes[0].legend(fontsize=7)
  for name, r in chat.items():
    axes[1].plot(r["internal"], label=name)
  axes[1].set_title("(a) internal fragmentation over time")
  axes[1].set_xlabel("step")
  axes[1].legend(fontsize=7)
  fig.tight_layout()
  p = os.path.join(out_dir, "fragmentation_over_time.png")
  fig.savefig(p, dpi=120)
  plt.close(fig)
  paths.append(p)
  return paths


def _fmt_oom(d):
  return ",".join(f"{k}={v}" for k, v in sorted(d.items())) or "0"


def main(argv):
  del argv
  os.makedirs(_OUT_DIR.value, exist_ok=True)
  bs, nblk = _BLOCK_SIZE.value, _NUM_BLOCKS.value
  t_start = time.perf_counter()

  # (a) chat.
  families, convs = chat_workload(_SEED.value, _CHAT_STEPS.value)
  chat = {}
  for mode in ("flat", "slotted", "slotted+reclaim"):
    chat[mode] = run_chat(mode, families, [dict(c) for c in convs], _CHAT_STEPS.value)
  cap_tokens = nblk * bs
  print(f"\n(a) multi-turn chat: {len(convs)} conversations, turns 5-200 tokens (log-uniform), "
        f"{len(families)} shared system prompts, pool {nblk} x {bs}-token blocks")
  print(f"{'mode':<16}{'internal frag mean':>20}{'final':>8}{'field report':>14}{'OOMs':>22}"
        f"{'peak resident conv.':>21}{'segments':>10}{'packs':>8}")
  for mode, r in chat.items():
    field = FIELD["internal"][0 if mode == "flat" else 1]
    print(f"{mode:<16}{r['internal'].mean():>20.2%}{r['internal'][-1]:>8.2%}{field:>14.1%}"
          f"{_fmt_oom(r['oom']):>22}{r['peak']:>21}{r['segments']:>10}{r['packs']:>8}")

  # (b) long/short mix.
  reqs = mix_workload(_SEED.value, _STEPS.value, nblk, bs, _SCALE.value)
  ideal_peak, ideal_mean = ideal_concurrency(reqs, _STEPS.value, cap_tokens)
  mix = {}
  runs = [("none", {}), ("periodic_full", {}), ("online", {}),
          ("online_every_step", dict(threshold=0.0)), ("merge", {}),
          ("merge_every_step", dict(threshold=0.0))]
  map_step = _STEPS.value // 2
  for name, over in runs:
    kw = dict(budget=_BUDGET.value, threshold=_THRESHOLD.value, period=_PERIOD.value)
    kw.update(over)
    mix[name] = run_mix(name, reqs, _STEPS.value, record_map_at=map_step if name == "none" else
                        None, **kw)
  print(f"\n(b) 30% long ({65536 // _SCALE.value} tok) / 70% short ({2048 // _SCALE.value} tok), "
        f"{len(reqs)} requests over {_STEPS.value} steps; long prefill needs a contiguous run; "
        f"budget {_BUDGET.value} moves/step, threshold {_THRESHOLD.value}")
  print(f"{'policy':<19}{'frag mean':>10}{'p99':>8}{'field':>8}{'internal':>10}{'OOMs':>42}"
        f"{'max conc.':>10}{'ideal':>7}{'ratio':>7}{'mean conc./ideal':>18}{'moves':>8}"
        f"{'comp. s':>9}")
  for name, r in mix.items():
    field = {"none": f"{FIELD['external'][0]:.1%}", "online": f"{FIELD['external'][1]:.1%}", "merge": f"{FIELD['external'][1]:.1%}"}.get(
        name, "")
    print(f"{name:<19}{r['ratios'].mean():>10.2%}{np.percentile(r['ratios'], 99):>8.2%}"
          f"{field:>8}{r['internal'].mean():>10.2%}{_fmt_oom(r['oom']):>42}{r['peak']:>10}"
          f"{ideal_peak:>7}{r['peak'] / ideal_peak:>7.3f}{r['mean_live'] / ideal_mean:>18.3f}"
          f"{r['moves']:>8}{r['seconds']:>9.3f}")

  timing = time_compaction(_TIMING_REPS.value)
  print(f"\ncompaction step of 32 moves ({timing['bytes'] / 2**20:.1f} MiB, "
        f"{timing['device']}): {timing['compact_s'] * 1e3:.3f} ms; plain copy of the same bytes: "
        f"{timing['copy_s'] * 1e3:.3f} ms; ratio {timing['compact_s'] / timing['copy_s']:.2f} "
        f"(medians of {_TIMING_REPS.value})")
  paths = _plots(_OUT_DIR.value, chat, mix, mix["none"]["maps"])
  print("plots: " + ", ".join(paths))
  print(f"total {time.perf_counter() - t_start:.1f} s")


if __name__ == "__main__":
  app.run(main)
