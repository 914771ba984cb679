"""Shrink while serving: how fast the pool gives memory back after a burst, and at what cost.

A memory-dynamics run of the real scheduler (`DryExecutor`, one-element pages, prefix
cache on); bytes and step-time shares are modelled for a real model (default
Llama-3-8B, bf16: 2 MiB per 16-token block) at the copy bandwidth of the compaction
policy. A burst fills the pool (`--max_batch` requests: a shared system prompt, then
their own prompt; most outputs short, `--long_share` of them long) and a trickle of
short requests keeps arriving (`--trickle` per step). Once `--finish_share` of the
burst finished, the scheduler shrinks (`Scheduler.shrink_to`) to the live demand (blocks
the running sequences hold plus the blocks their outputs will still take) times
`1 + --headroom`, while serving goes on. The same seed runs again without the shrink.

The simulated pool has the modelled model's layer count (one kv head, head_dim 1), so
the cut's measured peak of live device bytes (`ResizeReport`, `--stagings`: `host`
stages the kept pages through host memory one layer at a time, `device` builds the new
pages beside the old) has the real ratio to the pool; the table gives it, and the
modelled peak at the real model's size. Step time is modelled at the load of the
moment, not as a constant: a decode step reads the weights and the live K/V once
(`(--weight_bytes + live blocks x block bytes) / --bandwidth`), so the steps of a
shrink, which runs when the pool is mostly idle, are short. Move shares and the cut's
share (its copy: kept bytes read and written on the device, or down and up the host
link at `--host_link_bandwidth`) are of that step.

Per run it reports: blocks above the target (the free memory to give back) and how much
of the pool's free memory that is; steps and modelled bytes moved until 50/90/100% of the
blocks above the target are free, and the step of the cut (the memory is returned then,
all at once: shapes change once); modelled step-time share of the moves per step (mean
and max over the shrink's steps, of the step at that step's load); the measured host CPU
time of the shrink's work per move step (median and max: plans, moves, evictions; the
request and the cut apart, the cut recompiles the step's calls for the new shapes) against
the median bare step of the run without it, over the same steps; cached blocks evicted for room; requests whose first
token or finish came later than without the shrink (same seed, same arrivals). Per cut:
its path, its measured peak, its modelled peak and copy time at the model's size, and the
copy's share of the step at the cut's load.

Usage: PYTHONPATH=. python benchmarks/bench_shrink.py [--sizes=28610,2048 --seeds=0,1 --step_fractions=0.02]
"""

from __future__ import annotations

import math
import time

from absl import app, flags
import numpy as np

from benchmarks import records, shared_flags
import paged_kv
from paged_kv.core import compact, regions
from paged_kv.scheduler.executor import DryExecutor
from paged_kv.scheduler.scheduler import Request, Scheduler, SchedulerConfig

_SIZES = flags.DEFINE_list("sizes", ["28610", "2048"], "Pool sizes in blocks (28,610: the KV "
                           "share of an 80 GB card for Llama-3-8B at 16-token blocks).")
_SEEDS = flags.DEFINE_list("seeds", ["0"], "Seeds (one run with and one without shrink each).")
_STEP_FRACTIONS = flags.DEFINE_list("step_fractions", ["0.02"],
                                    "Shares of a step the shrink's moves may take (budget).")
_BLOCK_SIZE = shared_flags.define_block_size()
_MODEL = flags.DEFINE_list("model", ["32", "8", "128", "2"],
                           "Modelled layers, kv heads, head_dim, bytes per element.")
_STEP_MS = flags.DEFINE_float("step_ms", compact.DEFAULT_STEP_SECONDS * 1e3,
                              "Step time the shrink's byte budget is sized for, ms (the "
                              "shares are of the step modelled at load).")
_WEIGHT_BYTES = flags.DEFINE_float("weight_bytes", 8.03e9 * 2, "Model weight bytes a decode "
                                   "step reads (Llama-3-8B, bf16).")
_HOST_LINK = flags.DEFINE_float("host_link_bandwidth", 25e9, "Host link bytes/s each way "
                                "for a staged cut (an assumption: PCIe Gen5 x16 is 64 GB/s "
                                "nominal per direction).")
_STAGINGS = flags.DEFINE_list("stagings", ["host"], "How the cut resizes the pages: host, "
                              "device (each a run).")
_BANDWIDTH = flags.DEFINE_float("bandwidth", compact.H200_COPY_BANDWIDTH,
                                "Copy bandwidth, bytes/s, read + write.")
_MAX_BATCH = flags.DEFINE_integer("max_batch", 256, "Sequences per step (burst size); "
                                  "capped at num_blocks // 32.")
_LONG_SHARE = flags.DEFINE_float("long_share", 0.1, "Share of burst requests with long outputs.")
_FINISH_SHARE = flags.DEFINE_float("finish_share", 0.8, "Shrink once this share of the burst "
                                   "finished.")
_HEADROOM = flags.DEFINE_float("headroom", 0.25, "Target = live demand x (1 + headroom).")
_TRICKLE = flags.DEFINE_float("trickle", 0.5, "Short requests arriving per step after the "
                              "burst (Poisson).")
_AFTER = flags.DEFINE_integer("after_steps", 120, "Steps served after the shrink request.")
_PREFILL_BUDGET = flags.DEFINE_integer("prefill_token_budget", 8192, "Prompt tokens per step.")
_RECORD = shared_flags.define_record()
_COMPILE_CACHE = shared_flags.define_compile_cache()


def model_block_bytes() -> int:
  layers, heads, dim, itemsize = (int(x) for x in _MODEL.value)
  return 2 * layers * heads * dim * itemsize * _BLOCK_SIZE.value


def model_layers() -> int:
  return int(_MODEL.value[0])


def step_seconds_at(live_blocks: int) -> float:
  """A decode step at this load: the weights and the live K/V read once."""
  return (_WEIGHT_BYTES.value + live_blocks * model_block_bytes()) / _BANDWIDTH.value


def policy_for(step_fraction: float) -> compact.CompactionPolicy:
  return compact.CompactionPolicy(step_fraction=step_fraction,
                                  step_seconds=_STEP_MS.value / 1e3,
                                  copy_bandwidth=_BANDWIDTH.value)


def workload(num_blocks: int, max_batch: int, seed: int):
  """`(burst, trickle)`: the burst's requests and `{step: [requests]}` arriving later."""
  rng = np.random.default_rng(seed)
  bs = _BLOCK_SIZE.value
  share = num_blocks * bs // max_batch  # tokens per sequence when the burst fills the pool
  system = rng.integers(0, 30000, max(bs, share // 8))
  burst = []
  for i in range(max_batch):
    own = rng.integers(0, 30000, int(share * rng.uniform(0.35, 0.6)))
    long = rng.random() < _LONG_SHARE.value
    out = int(share * (rng.uniform(0.3, 0.5) if long else rng.uniform(0.02, 0.06))) + 1
    burst.append(Request(f"b{i}", np.concatenate([system, own]), out))
  trickle = {}
  for step in range(1, 2000):
    for j in range(int(rng.poisson(_TRICKLE.value))):
      own = rng.integers(0, 30000, int(share * rng.uniform(0.05, 0.15)) + 1)
      trickle.setdefault(step, []).append(
          Request(f"t{step}.{j}", np.concatenate([system, own]),
                  int(share * rng.uniform(0.02, 0.06)) + 1))
  return burst, trickle


def warm_up(config: paged_kv.PoolConfig, max_moves: int) -> None:
  """Compiles the shrink's per-step calls at this size (plan, progress, an empty move)."""
  pool = paged_kv.BlockPool(config)
  src, dst = regions.plan_shrink(pool.state.meta, config.num_blocks // 2, budget=max_moves)
  regions.shrink_progress(pool.state.meta, config.num_blocks // 2)
  pool.move_blocks(np.asarray(src), np.asarray(dst))


def serve(num_blocks: int, seed: int, step_fraction: float | None,
          staging: str = "host") -> dict:
  """One run; `step_fraction=None`: no shrink. Returns per-step records and the requests."""
  bs = _BLOCK_SIZE.value
  max_batch = max(8, min(_MAX_BATCH.value, num_blocks // 32))
  share = num_blocks * bs // max_batch
  config = paged_kv.PoolConfig(num_blocks=num_blocks, block_size=bs, num_layers=model_layers(),
                               num_kv_heads=1, head_dim=1, max_seqs=max_batch,
                               max_segments=max(16, 2 * math.ceil(share / bs)))
  bb = model_block_bytes()
  # Compaction moves as many blocks per step as the modelled budget allows (2% of a step).
  compaction = compact.CompactionPolicy(budget=policy_for(0.02).max_moves(bb))
  sched = Scheduler(paged_kv.BlockPool(config), DryExecutor(config),
                    SchedulerConfig(max_batch=max_batch, prefill_chunk=512,
                                    prefill_token_budget=_PREFILL_BUDGET.value,
                                    compaction=compaction, snapshot_every=0))
  if step_fraction is not None:
    warm_up(config, max(1, min(policy_for(step_fraction).max_moves(bb), num_blocks // 2)))
  burst, trickle = workload(num_blocks, max_batch, seed)
  for r in burst:
    sched.submit(r)
  host = []
  sched.on_step = lambda rep: host.append(rep.host_seconds)
  rows, shrink, start, step = [], None, None, 0
  while start is None or step < start + _AFTER.value:
    for r in trickle.get(step, ()):
      sched.submit(r)
    if start is None and sum(r.done for r in burst) >= _FINISH_SHARE.value * len(burst):
      start = step
      if step_fraction is not None:
        live, cached = regions.block_usage(sched.pool.state)
        future = sum(math.ceil((r.max_new_tokens - len(r.output)) / bs) + 1
                     for r in sched.running)
        target = config.num_base_blocks + math.ceil((live + future) * (1 + _HEADROOM.value))
        free_at_start = sched.pool.num_free_blocks + cached
        t0 = time.perf_counter()
        shrink = sched.shrink_to(target, policy_for(step_fraction), block_bytes=bb,
                                 staging=staging)
        request_seconds = time.perf_counter() - t0
        rows.append(dict(step=-1, moves=0, emptied=shrink.emptied_fraction,
                         seconds=request_seconds, evicted=shrink.evicted_blocks, live=live))
        info = dict(target=target, live=live, cached=cached, future=future,
                    free_at_start=free_at_start, span=num_blocks - target,
                    held_at_start=shrink.held_at_start)
    before = (shrink.move_seconds, shrink.evicted_blocks) if shrink is not None else None
    sched.step()
    if shrink is not None and (not rows or rows[-1]["emptied"] < 1.0):
      rows.append(dict(step=step - start, moves=shrink.last_moves, emptied=shrink.emptied_fraction,
                       seconds=shrink.move_seconds - before[0],
                       evicted=shrink.evicted_blocks - before[1],
                       live=sched.pool.host.block_usage()[0]))
    step += 1
    if sched.idle and start is not None:
      break
    if step > 5000:
      raise RuntimeError("no shrink trigger: the burst never finished")
  sched.check_invariants()
  out = dict(sched=sched, reqs=burst + [r for v in trickle.values() for r in v if r.submit_step >= 0],
             host=np.asarray(host), start=start, rows=rows, shrink=shrink, max_batch=max_batch)
  if shrink is not None:
    out.update(info)
  return out


def summarize(run: dict, base: dict, step_fraction: float) -> dict:
  s, rows, bb = run["shrink"], run["rows"], model_block_bytes()
  policy = policy_for(step_fraction)
  moves = np.array([r["moves"] for r in rows[1:]])
  cum = np.cumsum([0] + moves.tolist())
  emptied = np.array([r["emptied"] for r in rows])

  def reach(x):
    hit = np.flatnonzero(emptied >= x - 1e-12)
    if not hit.size:
      return "-", "-"
    i = int(hit[0])  # rows[0] is the request itself (its evictions), step 0
    return i, f"{cum[i] * bb / 1e9:.2f}"

  loads = [r["live"] for r in rows[1:]]
  shares = (np.array([policy.step_time_share(m, bb, step_seconds_at(live))
                      for m, live in zip(moves, loads)]) if moves.size else np.zeros(1))
  # The cut: its measured peak (simulated pool, same layer count) and, at the model's
  # size, its copy as a share of the step at the cut's load and its modelled peak.
  rep = s.cut
  old_b, new_b = rep.old_blocks * bb, rep.new_blocks * bb
  kept = min(old_b, new_b)
  # The share of the kept bytes that crossed the host link (measured on the simulated
  # pool: the rest waited on the device, in the room K's cut freed) costs the link
  # both ways; a device copy reads and writes the rest.
  sim_kept = min(rep.old_blocks, rep.new_blocks) * rep.pages_before // rep.old_blocks
  via_host = rep.host_bytes / (2 * sim_kept) if rep.staged else 0.0
  cut_copy_s = (2 * via_host * kept / _HOST_LINK.value
                + 2 * (1 - via_host) * kept / _BANDWIDTH.value)
  cut_share = cut_copy_s / step_seconds_at(rows[-1]["live"]) if s.done else float("nan")
  model_peak = (max(old_b, new_b) + new_b // (2 * model_layers())) if rep.staged else old_b + new_b
  start = run["start"]
  window = base["host"][start:start + max(1, len(rows))]
  bare = float(np.median(window)) if window.size else float("nan")
  # The cut's step apart: it recompiles the step's calls for the new shapes (once).
  last = len(rows) - 1 if s.done else len(rows)
  shrink_s = np.array([r["seconds"] for r in rows[1:last]])
  cut_ms = rows[-1]["seconds"] * 1e3 if s.done else float("nan")
  by_id = {r.request_id: r for r in base["reqs"]}
  never = 10**9  # not reached in the run: later than anything
  at = lambda step: step if step >= 0 else never
  delayed_first = delayed_finish = max_delay = 0
  for r in run["reqs"]:
    b = by_id.get(r.request_id)
    if b is None:
      continue
    delayed_first += at(r.first_token_step) > at(b.first_token_step)
    d = at(r.finish_step) - at(b.finish_step)
    delayed_finish += d > 0
    max_delay = max(max_delay, min(d, never // 2))
  return dict(
      blocks=run["sched"].shrink_status.start_blocks, target=run["target"], span=run["span"],
      free_share=run["span"] / max(run["free_at_start"], 1), held=run["held_at_start"],
      r50=reach(0.5), r90=reach(0.9), r100=reach(1.0),
      cut=(s.done_step - s.start_step + 1) if s.done else "-",
      gb_moved=s.bytes_moved / 1e9, moves=s.moves, evicted=s.evicted_blocks,
      share_mean=float(shares.mean()), share_max=float(shares.max()),
      cpu_shrink_ms=float(np.median(shrink_s) * 1e3) if shrink_s.size else 0.0,
      cpu_shrink_max_ms=float(shrink_s.max() * 1e3) if shrink_s.size else 0.0,
      cpu_request_ms=rows[0]["seconds"] * 1e3, cpu_bare_ms=bare * 1e3, cut_ms=cut_ms,
      delayed_first=delayed_first, delayed_finish=delayed_finish, max_delay=max_delay,
      requests=len(run["reqs"]), spilled=s.spilled_blocks, max_moves=s.max_moves,
      staging="host" if rep.staged else "device", peak_extra=rep.peak_extra_bytes / rep.pages_after,
      via_host=via_host,
      model_peak_gb=model_peak / 1e9, old_gb=old_b / 1e9, cut_copy_ms=cut_copy_s * 1e3,
      cut_share=cut_share, cut_step_ms=step_seconds_at(rows[-1]["live"]) * 1e3)


def main(argv):
  del argv
  _COMPILE_CACHE.enable()
  bb = model_block_bytes()
  rec = records.Recorder(_RECORD.value, "bench_shrink", flag_values=records.script_flags(),
                         seeds=[int(x) for x in _SEEDS.value])
  print(f"modelled block: {bb / 2**20:.2f} MiB; step {_STEP_MS.value} ms; bandwidth "
        f"{_BANDWIDTH.value / 1e12:.1f} TB/s; headroom {_HEADROOM.value}; trickle "
        f"{_TRICKLE.value}/step; long share {_LONG_SHARE.value}; finish share "
        f"{_FINISH_SHARE.value}")
  results = []
  for size in (int(x) for x in _SIZES.value):
    for seed in (int(x) for x in _SEEDS.value):
      t0 = time.perf_counter()
      base = serve(size, seed, None)
      for frac in (float(x) for x in _STEP_FRACTIONS.value):
        for staging in _STAGINGS.value:
          run = serve(size, seed, frac, staging)
          row = summarize(run, base, frac)
          row.update(size=size, seed=seed, frac=frac, wall=time.perf_counter() - t0)
          results.append(row)
          print(f"  size {size} seed {seed} budget {frac:.3f} cut {staging}: done in "
                f"{row['wall']:.0f} s (target {row['target']}, {row['requests']} requests)",
                flush=True)
  head = ("blocks  seed budget  target  above(free%)  held  steps50  steps90  steps100 cut  "
          "GB50   GB90   GB100  moves/step  evicted  share mean/max   CPU shrink ms median/max "
          "(request)  cut ms  bare ms  delayed first/finish (max)  spilled")
  print()
  print(head)
  for r in results:
    print(f"{r['size']:6d}  {r['seed']:4d}  {r['frac']:.3f} {r['target']:7d}  "
          f"{r['span']:6d} ({r['free_share']:4.0%}) {r['held']:5d}  {r['r50'][0]!s:>7}  "
          f"{r['r90'][0]!s:>7}  {r['r100'][0]!s:>8} {r['cut']!s:>3}  {r['r50'][1]:>5}  "
          f"{r['r90'][1]:>5}  {r['r100'][1]:>5}  {r['max_moves']:10d}  {r['evicted']:7d}  "
          f"{r['share_mean']:6.2%}/{r['share_max']:6.2%}   {r['cpu_shrink_ms']:7.1f}/"
          f"{r['cpu_shrink_max_ms']:7.1f} ({r['cpu_request_ms']:6.1f})  {r['cut_ms']:7.0f} "
          f"{r['cpu_bare_ms']:7.1f}  "
          f"{r['delayed_first']:5d}/{r['delayed_finish']:d} ({r['max_delay']:d}) of "
          f"{r['requests']}  {r['spilled']:5d}")
  print()
  print("The cut (peak: live device bytes beside the old state, measured on the simulated "
        "pool, / new pages; at the model's size: modelled)")
  print("blocks  seed budget  cut     peak extra/new  via host  model: old GB  peak GB  "
        "copy ms  step ms at load  share")
  for r in results:
    print(f"{r['size']:6d}  {r['seed']:4d}  {r['frac']:.3f}  {r['staging']:6s}  "
          f"{r['peak_extra']:14.3f}  {r['via_host']:8.0%}  {r['old_gb']:13.1f}  "
          f"{r['model_peak_gb']:7.1f}  "
          f"{r['cut_copy_ms']:7.1f}  {r['cut_step_ms']:15.2f}  {r['cut_share']:6.0%}")
  rec.write({"block_bytes": bb, "rows": results},
            notes=["shares and bytes are modelled for the --model at --bandwidth; the "
                   "CPU times (cpu_*_ms, cut_ms) are measured on this machine"])


if __name__ == "__main__":
  app.run(main)
