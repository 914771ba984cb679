"""Block size study: internal waste at blocks 16, 32 and 64 over public traces, slotting on.

For each trace (a Mooncake `.jsonl` or Azure `.csv`, `paged_kv.sim.traces`) and
each block size, the sequences' lengths (prompt + output tokens of each request)
are held in a real pool, and two numbers are measured:

* **live** (flat): every sequence holds `ceil(L / B)` blocks, its tail block partly
  empty: what rows still decoding cost (their tails may grow, so nothing packs them);
* **slotted**: the tails handed to an outside holder (as the prefix cache holds
  finished sequences) and packed with `slots.pack_slots` as they arrive, `--chunk`
  per call, in trace order or longest first (`--pack_order`): what finished sequences
  a holder keeps cost.

A pool holds `--window` consecutive requests at once (a trace's requests are never
all resident together, and packing cost grows with the pool); each window is its own
pool and the numbers add up over the windows.

Efficiency = tokens held / slots of the blocks they occupy. Only tails enter the
pool: a sequence's full blocks hold no waste at any block size (and the Mooncake
trace's shared prefixes are 512-token blocks, whole at every candidate), so they are
counted, not simulated. Beside the pool's numbers the script prints the model of
`paged_kv.core.block_size` (`block_efficiency`: flat exact, slotted tails at their
own tokens), the share of the tails' empty slots packing won back (`recovery`), and
the rule's pick and break-even read rates (how much faster than block 16 a bigger
block must read to pay for its waste). With `--gpu_check=PATH` (a
`gpu_check.json` with the block-size rows) the pick uses the measured rates;
without, bandwidth is unmeasured and the rule picks the smallest block.

Usage: PYTHONPATH=. python benchmarks/block_size_study.py [--max_requests=4096 --record=PATH]
       PYTHONPATH=. python benchmarks/block_size_study.py --traces=a.csv --block_sizes=16,64   # smoke
"""

from __future__ import annotations

import json
import os
import time

from absl import app, flags
import jax
import numpy as np

from benchmarks import records, shared_flags
import paged_kv
from paged_kv.core import alloc, block_size as block_size_rule, sequences, slots
from paged_kv.sim import traces

_DEFAULT_TRACES = [str(shared_flags.shared_traces(__file__) / name)
                   for name in traces.KNOWN_TRACES]

_TRACES = flags.DEFINE_list("traces", _DEFAULT_TRACES, "Trace files (.jsonl Mooncake, .csv "
                            "Azure); default: the public traces in ../shared/traces.")
_BLOCK_SIZES = flags.DEFINE_list("block_sizes", ["16", "32", "64"], "Block sizes to study.")
_MAX_REQUESTS = flags.DEFINE_integer("max_requests", 4096, "First requests of each trace "
                                     "(0: all).")
_CHUNK = flags.DEFINE_integer("chunk", 256, "Sequences per pool call (open, reserve, pack).")
_WINDOW = flags.DEFINE_integer("window", 1024, "Sequences resident together: consecutive "
                               "requests in trace order share one pool.")
_PACK_ORDER = flags.DEFINE_enum("pack_order", "trace", ["trace", "longest_first"],
                                "Order in which the held tails are handed to pack_slots.")
_GPU_CHECK = flags.DEFINE_string("gpu_check", None, "A gpu_check.json with the block-size "
                                 "rows: the rule then uses the measured read rates.")
_GPU_SHAPE = flags.DEFINE_enum("gpu_shape", "b64x8k", ["b64x8k", "b1x128k"],
                               "Which decode shape's rates the rule uses.")
_RECORD = shared_flags.define_record()


def _bucket(x: int) -> int:
  return 1 << max(int(x) - 1, 0).bit_length()


def _pad(a, size, fill):
  a = np.asarray(a, np.int32)
  out = np.full((size,), fill, np.int32)
  out[:len(a)] = a
  return out


def pool_tail_efficiency(lengths: np.ndarray, block_size: int, chunk: int,
                         num_blocks: int, pack_order: str = "trace") -> dict:
  """Live and slotted efficiency of `lengths` at `block_size`, from the pool's transitions.

  Live: every non-zero tail (`L mod B`) is reserved as one row's tokens, handed to an
  outside holder (one reference each) and its row released, `chunk` rows per call;
  the pool's used blocks give the live number; then the holder lets go of them all.
  Slotted: the same tails again, in trace order or (`pack_order="longest_first"`)
  longest first, each chunk reserved, handed to the holder and packed by `pack_slots`
  before the next chunk arrives (as a prefix cache packs nodes when they finish), so
  packing only ever fills blocks that packing made; the used blocks at the end give
  the slotted number. The pool has `num_blocks` blocks (at least one per tail plus
  `chunk`; the same for every window: one compile). Checks that the pool's
  reference counts match the holder's after each pass.
  """
  b = int(block_size)
  lengths = np.asarray(lengths, np.int64)
  tails = (lengths % b).astype(np.int32)
  tails = tails[tails > 0]
  full_blocks = int((lengths // b).sum())
  tokens = int(lengths.sum())
  n = len(tails)
  if num_blocks < n + chunk:
    raise ValueError(f"num_blocks={num_blocks} < {n} tails + chunk {chunk}")
  config = paged_kv.PoolConfig(num_blocks=num_blocks, block_size=b, num_layers=1,
                               num_kv_heads=1, head_dim=1, max_seqs=chunk, max_segments=1)
  state = paged_kv.init_pool(config)
  rows = np.arange(chunk, dtype=np.int32)
  zeros = np.zeros((chunk, 1), np.int32)

  def hold(state, part):
    """Reserves `part` (one row each), takes one reference per segment, releases the rows."""
    k = len(part)
    r = _pad(rows[:k], chunk, -1)
    state, _ = sequences.open_sequence(state, r, zeros, zeros, zeros, np.zeros(chunk, np.int32),
                                      config=config)
    state, (_, st) = sequences.reserve_tokens(state, r, _pad(part, chunk, 0), config=config,
                                             max_new_tokens=b)
    if (np.asarray(st)[:k] != 0).any():
      raise RuntimeError(f"reserve failed: {np.asarray(st)[:k]}")
    t = jax.tree.map(np.asarray, state.table)
    seg = np.stack([t.block[:k, 0], t.start[:k, 0], t.length[:k, 0]], 1)
    state, _ = alloc.apply_ref_deltas(state, _pad(seg[:, 0], chunk, -1),
                                      _pad(np.ones(k), chunk, 0), config=config)
    state, _ = sequences.release(state, r, config=config)
    return state, seg

  def check(state, held):
    ref = np.asarray(state.meta.ref_count)
    want = np.bincount(held[:, 0], minlength=config.num_blocks)
    assert (ref == want).all(), "the pool's references differ from the holder's"
    return int((ref > 0).sum())

  held = np.zeros((n, 3), np.int32)  # (block, start, length) the outside holder keeps
  for lo in range(0, n, chunk):
    state, held[lo:lo + chunk] = hold(state, tails[lo:lo + chunk])
  live_blocks = check(state, held)
  assert live_blocks == n, (live_blocks, n)
  for lo in range(0, n, chunk):  # the holder lets go: one block each, all free again
    ids = held[lo:lo + chunk, 0]
    state, _ = alloc.apply_ref_deltas(state, _pad(ids, chunk, -1),
                                      _pad(-np.ones(len(ids)), chunk, 0), config=config)
  assert int((np.asarray(state.meta.ref_count) > 0).sum()) == 0
  order = np.argsort(-tails, kind="stable") if pack_order == "longest_first" else np.arange(n)
  packs = 0
  for lo in range(0, n, chunk):
    state, seg = hold(state, tails[order[lo:lo + chunk]])
    k = len(seg)
    state, (nb, ns, _) = slots.pack_slots(
        state, _pad(np.full(k, slots.OWNER_EXTERNAL), chunk, -1), np.zeros(chunk, np.int32),
        _pad(seg[:, 0], chunk, -1), _pad(seg[:, 1], chunk, 0), _pad(seg[:, 2], chunk, 0),
        config=config)
    nb, ns = np.asarray(nb)[:k], np.asarray(ns)[:k]
    moved = nb >= 0
    held[lo:lo + k] = np.stack([np.where(moved, nb, seg[:, 0]), np.where(moved, ns, seg[:, 1]),
                                seg[:, 2]], 1)
    packs += int(moved.sum())
  slotted_blocks = check(state, held)
  return dict(tokens=tokens, sequences=int(len(lengths)), tails=n, full_blocks=full_blocks,
              live_blocks=live_blocks, slotted_blocks=slotted_blocks, packs=packs,
              live=tokens / ((full_blocks + live_blocks) * b),
              slotted=tokens / ((full_blocks + slotted_blocks) * b))


def windowed_efficiency(lengths: np.ndarray, block_size: int, chunk: int, window: int,
                        pack_order: str = "trace") -> dict:
  """`pool_tail_efficiency` over consecutive windows of `window` sequences, summed."""
  keys = ("tokens", "sequences", "tails", "full_blocks", "live_blocks", "slotted_blocks",
          "packs")
  total = dict.fromkeys(keys, 0)
  for lo in range(0, len(lengths), window):
    part = pool_tail_efficiency(lengths[lo:lo + window], block_size, chunk, window + chunk,
                                pack_order)
    for k in keys:
      total[k] += part[k]
  b = int(block_size)
  total["live"] = total["tokens"] / ((total["full_blocks"] + total["live_blocks"]) * b)
  total["slotted"] = total["tokens"] / ((total["full_blocks"] + total["slotted_blocks"]) * b)
  total["windows"] = -(-len(lengths) // window)
  waste = (total["full_blocks"] + total["live_blocks"]) * b - total["tokens"]
  total["recovery"] = ((total["live_blocks"] - total["slotted_blocks"]) * b / waste
                       if waste else 1.0)
  return total


def trace_lengths(path: str, max_requests: int) -> np.ndarray:
  """`i64[n]`: prompt + output tokens of the first `max_requests` requests (0: all)."""
  reqs = traces.load_trace(path, max_requests)
  return np.array([r.input_length + r.output_length for r in reqs], np.int64)


def main(argv):
  del argv
  sizes = sorted(int(x) for x in _BLOCK_SIZES.value)
  bandwidth, gpu_note = None, "unmeasured (no --gpu_check)"
  if _GPU_CHECK.value:
    with open(_GPU_CHECK.value) as f:
      bandwidth = block_size_rule.bandwidth_from_gpu_check(json.load(f), _GPU_SHAPE.value)
    gpu_note = f"{_GPU_SHAPE.value} from {_GPU_CHECK.value}: {bandwidth}"
  traces.check_trace_files(_TRACES.value)
  rec = records.Recorder(_RECORD.value, "block_size_study", flag_values=records.script_flags(),
                         seeds=[])
  t_start = time.perf_counter()
  out = []
  print(f"block sizes {sizes}; first {_MAX_REQUESTS.value or 'all'} requests of each trace; "
        f"bandwidth {gpu_note}")
  hdr = (f"{'trace':<34}{'B':>4}{'live (pool)':>12}{'= model':>9}{'slotted (pool)':>15}"
         f"{'ideal':>9}{'recovery':>9}{'break-even live':>16}{'slotted':>9}{'wall s':>8}")
  print(hdr)
  for path in _TRACES.value:
    lengths = trace_lengths(path, _MAX_REQUESTS.value)
    values, counts = block_size_rule.length_distribution(lengths)
    rows = []
    for b in sizes:
      t0 = time.perf_counter()
      pool = windowed_efficiency(lengths, b, _CHUNK.value, _WINDOW.value, _PACK_ORDER.value)
      wall = time.perf_counter() - t0
      model_live = block_size_rule.block_efficiency(values, counts, b)
      model_slotted = block_size_rule.block_efficiency(values, counts, b, slotted_share=1.0)
      if abs(model_live - pool["live"]) > 1e-12:
        raise AssertionError(f"model {model_live} != pool {pool['live']} (live, B={b})")
      rows.append(dict(block_size=b, model_live=model_live, model_slotted=model_slotted,
                       wall_s=wall, **pool))
    for r in rows:  # from the pool's own numbers
      r["break_even_slotted"] = rows[0]["slotted"] / r["slotted"]
    # The rule: live (share 0), and slotted (share 1) at the recovery pack_slots reached
    # at the largest block (the smallest recovery seen, in these runs).
    recovery = min(r["recovery"] for r in rows)
    picks = {}
    for name, share in (("live", 0.0), ("slotted", 1.0)):
      choice = block_size_rule.choose_block_size(lengths, bandwidth=bandwidth,
                                                 candidates=sizes, slotted_share=share,
                                                 slot_recovery=recovery)
      picks[name] = dict(block_size=choice.block_size, break_even=choice.break_even,
                         measured=choice.measured, bandwidth=choice.bandwidth,
                         score=choice.score, slot_recovery=choice.slot_recovery)
    for r in rows:
      print(f"{os.path.basename(path)[:33]:<34}{r['block_size']:>4}{r['live']:>12.4%}"
            f"{r['model_live']:>9.4%}{r['slotted']:>15.4%}{r['model_slotted']:>9.3%}"
            f"{r['recovery']:>9.1%}{picks['live']['break_even'][r['block_size']]:>16.4f}"
            f"{r['break_even_slotted']:>9.4f}{r['wall_s']:>8.1f}", flush=True)
    print(f"  rule's pick: live {picks['live']['block_size']}, slotted "
          f"{picks['slotted']['block_size']} (slot_recovery {recovery:.3f}; bandwidth "
          f"{gpu_note})")
    out.append(dict(trace=os.path.basename(path), origin=traces.describe_trace(path),
                    requests=int(len(lengths)), mean_tokens=float(lengths.mean()),
                    p50_tokens=float(np.percentile(lengths, 50)),
                    p99_tokens=float(np.percentile(lengths, 99)), rows=rows, picks=picks))
  print(f"total {time.perf_counter() - t_start:.1f} s")
  rec.write(dict(block_sizes=sizes, max_requests=_MAX_REQUESTS.value, chunk=_CHUNK.value,
                 window=_WINDOW.value, pack_order=_PACK_ORDER.value,
                 bandwidth=bandwidth, bandwidth_note=gpu_note, traces=out))


if __name__ == "__main__":
  app.run(main)
